"""Record the outputs of the solution cells marked ``# NBVAL_CHECK_OUTPUT``, for nbval to compare against.

Solution notebooks are stored without outputs, so the expected output of a pinned cell is kept
beside the tests, in ``tests/pinned_outputs/<chapter>.json`` (cell id -> outputs). The project's
``conftest.py`` hands those outputs to nbval. Pin only output that is the same on every device.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
from nbclient import NotebookClient

__all__ = ["PINNED_DIRECTORY", "pin_chapter", "pinned_cell_ids"]

PIN_MARKER = "# NBVAL_CHECK_OUTPUT"
PINNED_DIRECTORY = Path("tests") / "pinned_outputs"


def pinned_cell_ids(notebook: nbformat.NotebookNode) -> list[str]:
    """Ids of the code cells whose source starts with the pin marker, in notebook order."""
    return [c.id for c in notebook.cells if c.cell_type == "code" and c.source.lstrip().startswith(PIN_MARKER)]


def _comparable(output: nbformat.NotebookNode) -> dict:
    """An output without the fields nbval does not compare (metadata, execution count)."""
    return {k: v for k, v in output.items() if k not in ("metadata", "execution_count")}


def record_pinned_outputs(notebook_path: Path, timeout: int = 600) -> dict[str, list[dict]]:
    """Execute a solution notebook in its own folder and return the outputs of its pinned cells."""
    notebook = nbformat.read(notebook_path, as_version=4)
    NotebookClient(notebook, timeout=timeout, kernel_name="python3", iopub_timeout=60, raise_on_iopub_timeout=True,
                   resources={"metadata": {"path": str(notebook_path.parent)}}).execute()
    wanted = set(pinned_cell_ids(notebook))
    return {c.id: [_comparable(o) for o in c.outputs] for c in notebook.cells if c.id in wanted}


def pin_chapter(course_root: Path, chapter: str) -> Path:
    """Write ``tests/pinned_outputs/<chapter>.json`` from a fresh run of the chapter's solution notebook."""
    outputs = record_pinned_outputs(course_root / "solutions" / chapter / f"{chapter}.ipynb")
    target = course_root / PINNED_DIRECTORY / f"{chapter}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(outputs, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    return target
