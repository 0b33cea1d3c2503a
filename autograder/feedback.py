"""Feedback that does not give the hidden tests away."""

from __future__ import annotations

from nbconvert.exporters.exporter import ResourcesDict
from nbformat import NotebookNode
from nbgrader.preprocessors import ClearHiddenTests

from .course import is_test_cell


class RedactHiddenTests(ClearHiddenTests):
    """In each test cell, drop the hidden-test region and cut error tracebacks to their last line.

    nbgrader's feedback shows the test cells as they ran, hidden tests included, and an
    IPython traceback quotes the failing line of the test. The student keeps the score and
    the error message (which says what was wrong) and loses neither.
    """

    def preprocess_cell(
        self, cell: NotebookNode, resources: ResourcesDict, cell_index: int
    ) -> tuple[NotebookNode, ResourcesDict]:
        """Redact one cell when it is a test cell; leave every other cell as it is."""
        if not is_test_cell(cell):
            return cell, resources
        self._remove_hidden_test_region(cell)
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                output.traceback = [f"{output.ename}: {output.evalue}"]
        return cell, resources
