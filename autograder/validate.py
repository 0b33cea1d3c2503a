"""Check a notebook the way the grader will: run it top to bottom in a fresh kernel, then score its test cells.

A test cell fails when it raises, and also when it writes to stderr: nbgrader scores any
stderr output in a test cell as a failure, after dropping the harmless library warnings
that ``config.HARMLESS_STDERR`` matches. (nbgrader's own ``validate`` exits 0 even when
tests fail; this one does not.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nbformat import NotebookNode

from .config import DEFAULT_CELL_TIMEOUT, course_environment, nbgrader_config
from .course import is_test_cell, read_notebook

STDERR_PROBLEM = "wrote to stderr, which nbgrader scores as a failure"


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


def run_tests(notebook: Path, course_root: Path, cell_timeout: int = DEFAULT_CELL_TIMEOUT) -> list[CellOutcome]:
    """Execute ``notebook`` in a fresh kernel (working directory: its folder) and score each test cell as nbgrader does."""
    from nbgrader.preprocessors import Execute, IgnorePattern
    from nbgrader.utils import determine_grade

    config = nbgrader_config(course_root, cell_timeout=cell_timeout)
    nb = read_notebook(notebook)
    with course_environment(course_root):
        nb, _ = Execute(config=config).preprocess(nb, {"metadata": {"path": str(notebook.parent.resolve())}})
    nb, _ = IgnorePattern(config=config).preprocess(nb, {})
    outcomes = []
    for cell in nb.cells:
        if is_test_cell(cell):
            score, max_score = determine_grade(cell)
            outcomes.append(CellOutcome(cell.metadata.nbgrader["grade_id"], score or 0.0, max_score, _problem(cell)))
    return outcomes


def _problem(cell: NotebookNode) -> str:
    """What went wrong in an executed test cell, in one line ('' when nothing did)."""
    for output in cell.outputs:
        if output.output_type == "error":
            return " ".join(f"{output.ename}: {output.evalue}".split())[:300]
    for output in cell.outputs:
        if output.output_type == "stream" and output.name == "stderr":
            first = (output.text.strip().splitlines() or [""])[0]
            return f"{STDERR_PROBLEM}: {first[:200]}"
    return ""


def summarise(outcomes: list[CellOutcome]) -> tuple[str, bool]:
    """The report printed by ``validate``: the failing grade_ids with their errors, then points; and whether all passed."""
    failed = [o for o in outcomes if not o.passed]
    score, total = sum(o.score for o in outcomes), sum(o.max_score for o in outcomes)
    lines = [f"FAILED {o.grade_id} ({o.score:g}/{o.max_score:g} points): {o.problem or 'partial credit'}" for o in failed]
    if not outcomes:
        lines.append("no test cells found (cells marked grade: true, solution: false)")
    elif failed:
        names = ", ".join(o.grade_id for o in failed)
        lines.append(f"{len(failed)} of {len(outcomes)} tests failed ({names}); {score:g}/{total:g} points")
    else:
        lines.append(f"all {len(outcomes)} tests passed ({score:g}/{total:g} points)")
    return "\n".join(lines), not failed
