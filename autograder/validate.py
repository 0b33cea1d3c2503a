"""A student's self-check: run the notebook as saved, top to bottom in a fresh kernel, and say what it shows.

It reports the visible tests (a released notebook holds only those; the grader adds hidden
ones, so passing here is necessary, not sufficient), the lecture and exercise cells that
raised (a crashed lecture cell means a later experiment did not run), and where the chapter
used the course's reference instead of the student's code. A test cell fails when it raises,
and also when it writes to stderr: nbgrader scores any stderr output in a test cell as a
failure, after dropping the harmless library warnings that ``config.HARMLESS_STDERR`` matches.
(nbgrader's own ``validate`` exits 0 even when tests fail; this one does not.)
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from nbformat import NotebookNode

from .config import DEFAULT_CELL_TIMEOUT, course_environment, nbgrader_config
from .course import HIDDEN_BEGIN, is_test_cell, read_notebook

__all__ = ["CellOutcome", "CrashedCell", "Validation", "inspect_notebook", "run_notebook", "saved_note", "summarise"]

STDERR_PROBLEM = "wrote to stderr, which nbgrader scores as a failure"
_FALLBACK_NOTE = re.compile(r"^note: (\S+) .*using the reference", re.MULTILINE)


@dataclass(frozen=True)
class CellOutcome:
    """How one test cell did."""

    grade_id: str
    score: float
    max_score: float
    problem: str

    @property
    def passed(self) -> bool:
        """Full points."""
        return self.score >= self.max_score


@dataclass(frozen=True)
class CrashedCell:
    """A cell other than a test cell that raised: where it is and what it raised."""

    index: int
    first_line: str
    error: str
    exercise: str = ""


@dataclass
class Validation:
    """What running a notebook showed: test cells, cells that crashed, and the reference used instead of the student's code."""

    tests: list[CellOutcome] = field(default_factory=list)
    crashed: list[CrashedCell] = field(default_factory=list)
    fallbacks: dict[str, int] = field(default_factory=dict)
    has_hidden_tests: bool = False


def run_notebook(notebook: Path, course_root: Path, cell_timeout: int = DEFAULT_CELL_TIMEOUT) -> Validation:
    """Execute ``notebook`` in a fresh kernel (working directory: its folder) and collect what it showed."""
    from nbgrader.preprocessors import Execute, IgnorePattern

    config = nbgrader_config(course_root, cell_timeout=cell_timeout)
    nb = read_notebook(notebook)
    with course_environment(course_root):
        nb, _ = Execute(config=config).preprocess(nb, {"metadata": {"path": str(notebook.parent.resolve())}})
    nb, _ = IgnorePattern(config=config).preprocess(nb, {})
    return inspect_notebook(nb)


def inspect_notebook(nb: NotebookNode) -> Validation:
    """Read an executed notebook's test outcomes, crashed cells and fallback notes."""
    from nbgrader.utils import determine_grade

    result = Validation()
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        meta = cell.metadata.get("nbgrader", {})
        if is_test_cell(cell):
            score, max_score = determine_grade(cell)
            result.tests.append(CellOutcome(meta["grade_id"], score or 0.0, max_score, _problem(cell)))
            result.has_hidden_tests |= HIDDEN_BEGIN in cell.source
            continue
        error = _error(cell)
        if error:
            lines = [line for line in cell.source.splitlines() if line.strip()]
            result.crashed.append(CrashedCell(index, (lines or [""])[0][:80], error,
                                              meta.get("grade_id", "") if meta.get("solution") else ""))
        for output in cell.outputs:
            if output.output_type == "stream" and output.name == "stdout":
                for name in _FALLBACK_NOTE.findall(output.text):
                    result.fallbacks.setdefault(name, index)
    return result


def _error(cell: NotebookNode) -> str:
    for output in cell.outputs:
        if output.output_type == "error":
            return " ".join(f"{output.ename}: {output.evalue}".split())[:300]
    return ""


def _problem(cell: NotebookNode) -> str:
    """What went wrong in an executed test cell, in one line ('' when nothing did)."""
    error = _error(cell)
    if error:
        return error
    for output in cell.outputs:
        if output.output_type == "stream" and output.name == "stderr":
            first = (output.text.strip().splitlines() or [""])[0]
            return f"{STDERR_PROBLEM}: {first[:200]}"
    return ""


def saved_note(notebook: Path, now: float | None = None) -> str:
    """A line saying which saved version is checked, and that unsaved edits in the lab are not."""
    age = max(0.0, (time.time() if now is None else now) - notebook.stat().st_mtime)
    when = time.strftime("%H:%M", time.localtime(notebook.stat().st_mtime))
    ago = f"{age:.0f} s" if age < 120 else f"{age / 60:.0f} min" if age < 7200 else f"{age / 3600:.0f} h"
    return (f"checking {notebook} as saved at {when} ({ago} ago); edits not saved in JupyterLab "
            "are not checked: save first (Ctrl+S, or File > Save Notebook)")


def summarise(result: Validation) -> tuple[str, bool]:
    """The report printed by ``validate``, and whether every test passed."""
    tests = result.tests
    failed = [o for o in tests if not o.passed]
    lines = [f"FAILED {o.grade_id} ({o.score:g}/{o.max_score:g} points): {o.problem or 'partial credit'}" for o in failed]
    for crash in result.crashed:
        where = f"exercise cell {crash.exercise}" if crash.exercise else "lecture cell"
        lines.append(f"CRASHED {where} (cell {crash.index}, `{crash.first_line}`): {crash.error}")
    for name, index in result.fallbacks.items():
        lines.append(f"reference used: cells from cell {index} on ran the course's reference instead of your {name}")
    if not tests:
        lines.append("no test cells found (cells marked grade: true, solution: false)")
        return "\n".join(lines), False
    score, total = sum(o.score for o in tests), sum(o.max_score for o in tests)
    scope = "tests" if result.has_hidden_tests else "visible tests"
    lines.append(f"{scope}: {len(tests) - len(failed)} of {len(tests)} passed ({score:g} of {total:g} "
                 f"{'points' if result.has_hidden_tests else 'visible points'})")
    if not result.has_hidden_tests:
        lines.append("the grader adds hidden tests (other shapes, dtypes, seeds, edge cases): "
                     "your grade can be lower than this")
    if result.crashed:
        lines.append(f"{len(result.crashed)} other cell(s) raised: the experiments after them did not run as written")
    return "\n".join(lines), not failed
