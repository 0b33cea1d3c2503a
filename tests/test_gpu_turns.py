"""The GPU tier's memory turns (conftest.py): the record they read names real chapters, and they hold
one lock per large notebook from its first cell to its last."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import conftest
from autograder.course import Course

ROOT = Path(__file__).resolve().parents[1]


def test_the_memory_record_names_real_chapters_and_says_how_it_was_measured() -> None:
    record = json.loads((ROOT / "tests" / "gpu_memory.json").read_text())
    assert set(record["peak_mib"]) <= set(Course(ROOT).chapters()), "gpu_memory.json names a chapter that does not exist"
    assert {"date", "gpu", "driver", "torch", "how"} <= set(record)
    assert conftest.large_gpu_chapters() == {c for c, mib in record["peak_mib"].items() if mib > conftest.LARGE_MIB}
    assert conftest.large_gpu_chapters(), "no notebook is large: the turns would guard nothing"


def _cell(notebook: str, n: int) -> SimpleNamespace:
    return SimpleNamespace(fspath=notebook, nodeid=f"{notebook}::Cell {n}", get_closest_marker=lambda name: None)


def test_one_turn_covers_a_whole_large_notebook(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    large = sorted(conftest.large_gpu_chapters())[0]
    notebook, small = f"solutions/{large}/{large}.ipynb", "solutions/01_floating_point/01_floating_point.ipynb"
    monkeypatch.setattr(conftest.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(conftest, "LARGE_LOCK", tmp_path / "turn.lock")
    locks: list[str] = []
    monkeypatch.setattr(conftest.fcntl, "flock", lambda f, op: locks.append(f.name))
    first, second, other = _cell(notebook, 0), _cell(notebook, 1), _cell(small, 0)
    conftest.pytest_runtest_setup(first)
    conftest.pytest_runtest_teardown(first, second)
    assert conftest._held, "the turn was given back between two cells of one notebook (its kernel still runs)"
    conftest.pytest_runtest_setup(second)
    assert len(locks) == 1, "the turn was taken again for the notebook's second cell"
    conftest.pytest_runtest_teardown(second, other)
    assert not conftest._held, "the turn was kept after the large notebook's last cell"
    conftest.pytest_runtest_setup(other)
    assert len(locks) == 1 and not conftest._held, "a small notebook waited for the turn"
