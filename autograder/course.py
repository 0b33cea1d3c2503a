"""The course's layout: chapters in solutions/ and notebooks/, and the graded cells of a notebook."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbformat import NotebookNode

from .config import PACKAGE_PARENT, RELEASE_DIRECTORY, SOURCE_DIRECTORY

__all__ = [
    "HIDDEN_BEGIN", "HIDDEN_END", "Course", "UnknownChapterError", "default_course_root", "graded_points", "is_test_cell",
    "read_notebook",
]


class UnknownChapterError(ValueError):
    """A chapter name that has no ``solutions/<name>/<name>.ipynb``."""


def default_course_root() -> Path:
    """The project root this package sits in, or the working directory when the package is installed elsewhere."""
    if (PACKAGE_PARENT / SOURCE_DIRECTORY).is_dir():
        return PACKAGE_PARENT
    return Path.cwd()


@dataclass(frozen=True)
class Course:
    """A course root: ``solutions/NN_name/NN_name.ipynb`` sources and ``notebooks/`` releases."""

    root: Path

    @property
    def solutions(self) -> Path:
        """The nbgrader source folder."""
        return self.root / SOURCE_DIRECTORY

    @property
    def notebooks(self) -> Path:
        """The folder the student notebooks are released into."""
        return self.root / RELEASE_DIRECTORY

    def chapters(self) -> list[str]:
        """Every chapter with a source notebook, sorted by name."""
        if not self.solutions.is_dir():
            return []
        return sorted(
            d.name
            for d in self.solutions.iterdir()
            if d.is_dir() and not d.name.startswith((".", "_")) and (d / f"{d.name}.ipynb").is_file()
        )

    def source_notebook(self, chapter: str) -> Path:
        """``solutions/<chapter>/<chapter>.ipynb``."""
        return self.solutions / chapter / f"{chapter}.ipynb"

    def released_notebook(self, chapter: str) -> Path:
        """``notebooks/<chapter>/<chapter>.ipynb``."""
        return self.notebooks / chapter / f"{chapter}.ipynb"

    def resolve(self, names: Sequence[str]) -> list[str]:
        """The chapters named (every chapter when none is), checked to exist; raises UnknownChapterError."""
        known = self.chapters()
        unknown = [n for n in names if n not in known]
        if unknown:
            raise UnknownChapterError(
                f"unknown chapter(s): {', '.join(unknown)}; chapters in {self.solutions}: "
                f"{', '.join(known) or '(none)'}"
            )
        return sorted(set(names)) if names else known


# nbgrader's markers around the hidden part of a test cell.
HIDDEN_BEGIN, HIDDEN_END = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"


def is_test_cell(cell: NotebookNode) -> bool:
    """True for an autograded test cell: a code cell marked ``grade`` and not ``solution``."""
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return cell.get("cell_type") == "code" and bool(meta.get("grade")) and not meta.get("solution")


def graded_points(nb: NotebookNode) -> dict[str, float]:
    """``grade_id -> points`` for every graded cell (tests and manually graded answers), in notebook order."""
    points = {}
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("grade"):
            points[meta["grade_id"]] = float(meta.get("points", 0))
    return points


def read_notebook(path: Path) -> NotebookNode:
    """Read a notebook as nbformat v4."""
    return nbformat.read(path, as_version=4)
