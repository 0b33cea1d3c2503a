"""Test-wide set-up: the `gpu` marker, the pinned outputs that nbval checks in solution notebooks, and a
closing line when the grader's security suite could not run (no bubblewrap).

Solution notebooks are committed without outputs, so a cell marked `# NBVAL_CHECK_OUTPUT` would
have nothing to be compared with. Its expected output lives instead in
`tests/pinned_outputs/<chapter>.json` (written by `python -m autograder pin`), and is put into
the cell here before nbval runs it.
"""

import json
from pathlib import Path

import nbformat
import pytest
import torch

PINNED = Path(__file__).parent / "tests" / "pinned_outputs"


def _pin_expected_outputs(item: pytest.Item, cache: dict[str, dict]) -> None:
    cell, options = getattr(item, "cell", None), getattr(item, "options", None)
    if cell is None or not isinstance(options, dict) or not options.get("check"):
        return
    chapter = Path(str(item.fspath)).stem
    if chapter not in cache:
        path = PINNED / f"{chapter}.json"
        cache[chapter] = json.loads(path.read_text()) if path.exists() else {}
    expected = cache[chapter].get(cell.get("id"))
    if expected is not None:  # a cell without an entry is reported by tests/test_pinned_outputs.py
        cell.outputs = [nbformat.from_dict(output) for output in expected]
        cell.execution_count = 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Pin notebook cells' expected outputs and mark them `notebook`; skip `gpu` tests without a CUDA device."""
    cache: dict[str, dict] = {}
    for item in items:
        _pin_expected_outputs(item, cache)
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.notebook)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU tier)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say plainly, at the end, when the sandboxed grading tests were skipped and how to run them."""
    import shutil

    ran_grading = any("test_adversarial" in str(r.nodeid) or "test_grading_host" in str(r.nodeid)
                      for reports in terminalreporter.stats.values() for r in reports if hasattr(r, "nodeid"))
    if ran_grading and shutil.which("bwrap") is None:
        terminalreporter.write_sep("!", "security suite skipped", yellow=True)
        terminalreporter.write_line(
            "tests/test_adversarial.py and tests/test_grading_host.py did not run: bubblewrap (bwrap) is not "
            "installed, so hostile submissions were not graded. Install it with `make sandbox-deps` (Debian/Ubuntu: "
            "apt-get install bubblewrap) and run `make test` again.")
