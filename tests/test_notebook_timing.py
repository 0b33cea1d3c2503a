"""benchmarks.notebooks (the notebook run-time table): what it writes when notebooks pass, raise, or the run is stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import notebooks

FIRST, SECOND = "00_orientation", "01_floating_point"


@pytest.fixture
def fake_runs(monkeypatch: pytest.MonkeyPatch) -> dict:
    """run_notebook replaced by a table of outcomes per chapter: a list of errors, or an exception to raise."""
    outcomes: dict = {}

    def run(path: Path, out_dir: Path, cell_timeout: int) -> dict:
        outcome = outcomes[path.parent.name]
        if isinstance(outcome, BaseException):
            raise outcome
        return {"chapter": path.parent.name, "seconds": 1.5, "errors": outcome}

    monkeypatch.setattr(notebooks, "run_notebook", run)
    monkeypatch.setattr(notebooks, "device_name", lambda: "test device")
    return outcomes


def test_table_lists_every_notebook_and_exit_status_follows_errors(tmp_path: Path, fake_runs: dict) -> None:
    fake_runs.update({FIRST: [], SECOND: []})
    assert notebooks.main(["--out", str(tmp_path), FIRST, SECOND]) == 0
    report = json.loads((tmp_path / "times.json").read_text())
    assert [r["chapter"] for r in report["notebooks"]] == [FIRST, SECOND]
    assert report["total_seconds"] == 3.0 and report["interrupted_in"] is None
    # The run records the machine it ran on, so that a record made elsewhere from the folder names it right.
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)"
    assert report["versions"]["torch"] == torch.__version__ and report["versions"]["gpu"] == gpu
    fake_runs[SECOND] = ["cell abc: ValueError: boom"]
    assert notebooks.main(["--out", str(tmp_path), FIRST, SECOND]) == 1, "a notebook that raised must make the run fail"
    assert "ValueError: boom" in (tmp_path / "times.md").read_text()


def test_a_stopped_run_keeps_the_finished_notebooks(tmp_path: Path, fake_runs: dict) -> None:
    fake_runs.update({FIRST: [], SECOND: KeyboardInterrupt()})
    assert notebooks.main(["--out", str(tmp_path), FIRST, SECOND]) == 130
    report = json.loads((tmp_path / "times.json").read_text())
    assert [r["chapter"] for r in report["notebooks"]] == [FIRST], "the finished notebook's time was lost"
    assert report["interrupted_in"] == SECOND
    assert f"Stopped while running {SECOND}" in (tmp_path / "times.md").read_text()


def test_unknown_chapter_is_named() -> None:
    with pytest.raises(SystemExit, match="unknown chapter"):
        notebooks.chapters(["99_nope"])


def test_a_dead_kernel_is_recorded_and_the_copy_kept(tmp_path: Path) -> None:
    import nbformat

    folder = tmp_path / "src" / "98_dies"
    folder.mkdir(parents=True)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("import os; os._exit(3)")])
    nbformat.write(nb, folder / "98_dies.ipynb")
    row = notebooks.run_notebook(folder / "98_dies.ipynb", tmp_path, cell_timeout=60)
    assert row["chapter"] == "98_dies"
    assert any("notebook stopped: DeadKernelError" in e for e in row["errors"]), row["errors"]
    assert (tmp_path / "98_dies.ipynb").exists(), "the executed copy should be written even when the kernel died"
