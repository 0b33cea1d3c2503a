"""Test-wide set-up: the `gpu` marker, the pinned outputs that nbval checks in solution notebooks, the
turns that keep the GPU tier within one GPU's memory, and a closing line when the grader's security
suite could not run (no bubblewrap).

Solution notebooks are committed without outputs, so a cell marked `# NBVAL_CHECK_OUTPUT` would
have nothing to be compared with. Its expected output lives instead in
`tests/pinned_outputs/<chapter>.json` (written by `python tests/pin_outputs.py`), and is put into
the cell here before nbval runs it.
"""

import fcntl
import json
import os
import tempfile
from pathlib import Path

import nbformat
import pytest
import torch

PINNED = Path(__file__).parent / "tests" / "pinned_outputs"

# Notebooks that held more than this much GPU memory (tests/gpu_memory.json) run one at a time in the
# GPU tier: together they need more than one GPU has, and a kernel that runs out fails a cell of whichever
# notebook asked last (four OOM failures in a run of eight workers). Taking turns, a run of eight workers
# used at most 78 of the H200's 140 GiB (peak_total_mib). The turn is a lock file every pytest worker on the host shares.
LARGE_MIB = 16 * 1024
LARGE_LOCK = Path(tempfile.gettempdir()) / f"course-gpu-memory-{os.getuid()}.lock"


def large_gpu_chapters() -> set[str]:
    """The chapters whose solution notebook held more than LARGE_MIB of GPU memory when measured."""
    record = json.loads((Path(__file__).parent / "tests" / "gpu_memory.json").read_text())
    return {chapter for chapter, mib in record["peak_mib"].items() if mib > LARGE_MIB}


_LARGE = large_gpu_chapters()
NBVAL_OUTPUT_TIMEOUT_S = 120
_held: dict[str, object] = {}  # the open lock file, while this worker runs a large item


def _needs_turn(item: pytest.Item) -> bool:
    path = Path(str(item.fspath))
    return (path.suffix == ".ipynb" and path.stem in _LARGE) or item.get_closest_marker("large_gpu_memory") is not None


def _unit(item: pytest.Item) -> str:
    """What holds the turn: a whole notebook (its kernel lives from the first cell to the last), else one test."""
    return str(item.fspath) if str(item.fspath).endswith(".ipynb") else item.nodeid


@pytest.hookimpl(tryfirst=True)  # before nbval's collector starts the notebook's kernel
def pytest_runtest_setup(item: pytest.Item) -> None:
    """On a GPU, wait for the large-memory turn before the first cell of a large notebook or a large test."""
    if torch.cuda.is_available() and _needs_turn(item) and _held.get("unit") != _unit(item):
        lock = open(LARGE_LOCK, "a")  # noqa: SIM115 (held across hooks, closed in teardown)
        fcntl.flock(lock, fcntl.LOCK_EX)
        _held.update(unit=_unit(item), file=lock)


@pytest.hookimpl(trylast=True)  # after the kernel of a finished notebook has been shut down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Give the turn back once the large notebook or test is over."""
    if _held and (nextitem is None or _unit(nextitem) != _held["unit"]):
        _held.pop("file").close()  # closing the file releases the lock
        _held.clear()


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
    """Pin notebook cells' outputs, mark them `notebook`, widen nbval's output wait; skip `gpu` tests without CUDA."""
    cache: dict[str, dict] = {}
    for item in items:
        _pin_expected_outputs(item, cache)
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.notebook)
            # After a cell's reply nbval waits this long for each of its outputs (5 s by default): a guard
            # against a lost kernel, not a time limit, so long enough for a loaded machine to deliver them.
            if hasattr(item, "output_timeout"):
                item.output_timeout = NBVAL_OUTPUT_TIMEOUT_S
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (GPU tier)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Tests skipped because a system package is missing, and the make target that installs it.
MISSING_TOOLS = {"bubblewrap is not installed": "sandbox-deps", "chromium is not installed": "browser-deps"}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """End with one line when tests were skipped for a missing system package: how many, which, and how to enable them."""
    skipped: dict[str, set[str]] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        for missing in MISSING_TOOLS:
            if missing in reason:
                skipped.setdefault(missing, set()).add(report.nodeid)
    if skipped:
        files = {m: sorted({n.split("::")[0].rsplit("/", 1)[-1] for n in ids}) for m, ids in skipped.items()}
        what = "; ".join(f"{m} ({', '.join(files[m])})" for m in skipped)
        targets = " ".join(sorted({MISSING_TOOLS[m] for m in skipped}))
        terminalreporter.write_line(f"{sum(map(len, skipped.values()))} tests skipped because {what}: "
                                    f"run `make {targets}` (Debian/Ubuntu, as root), then `make test` again", yellow=True)
