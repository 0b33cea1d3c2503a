"""Every cell marked # NBVAL_CHECK_OUTPUT has a recorded expected output, and no stale entry is left."""

import json
from pathlib import Path

import nbformat
import pytest
from pin_outputs import PINNED_DIRECTORY, pinned_cell_ids

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p.name for p in (ROOT / "solutions").iterdir() if p.is_dir() and p.name[:2].isdigit())


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_pinned_outputs_match_marked_cells(chapter: str) -> None:
    notebook = nbformat.read(ROOT / "solutions" / chapter / f"{chapter}.ipynb", as_version=4)
    marked = set(pinned_cell_ids(notebook))
    path = ROOT / PINNED_DIRECTORY / f"{chapter}.json"
    recorded = set(json.loads(path.read_text())) if path.exists() else set()
    fix = f"run `.venv/bin/python tests/pin_outputs.py {chapter}`"
    assert not marked - recorded, f"{chapter}: pinned cells without a recorded output {sorted(marked - recorded)}; {fix}"
    assert not recorded - marked, f"{chapter}: recorded outputs for cells no longer pinned {sorted(recorded - marked)}; {fix}"
    for cell_id in marked:
        assert json.loads(path.read_text())[cell_id], (
            f"{chapter}: pinned cell {cell_id} has an empty output: pin a cell that prints"
        )
