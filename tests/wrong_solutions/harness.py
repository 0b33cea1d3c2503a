"""Grade plausible wrong solutions of a chapter's exercises the way the grader does, all in one kernel.

A chapter's wrong solutions live in ``tests/wrong_solutions/<chapter>.py`` as a dict ``WRONG``:
test ``grade_id`` -> ``{label: source of a solution cell}``. Each source is what a student might
write: it passes the visible checks (most do) but misses the mechanism, mishandles an edge case,
or calls the reference. Graded by the real grader's parts (``autograder.execute.TrustedExecute``:
the test cell runs in the trusted tester, hidden tests included, inputs drawn from a secret; the
exercise's reference refuses to run), each must fail, whatever the secret: each run draws a fresh
one, and a failure names it so that ``WRONG_SOLUTIONS_SECRET=<secret>`` replays that run.

One kernel per chapter keeps this cheap: it runs the setup cells, the cells of imports only, the
solution cells and the cells whose definitions live in the kernel, then, per exercise, the right solution's test (which
must pass: it proves the short notebook is a fair context), each wrong solution followed by the
test, and the right solution again. Lecture cells are left out: test cells run in the tester,
which sees only the notebook's imports and the student's names.

Grading here is CPU grading, on any host (the kernel and the tester see no GPU): some mechanisms
are observable only under Triton's interpreter (the tiles a kernel computes), so this tier checks
the CPU grading path, the one every course machine has.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import os
import runpy
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbformat import NotebookNode

from autograder.config import SECRET_VARIABLE, child_environment, course_environment
from autograder.course import is_test_cell, read_notebook
from autograder.execute import TrustedExecute
from autograder.tester import STUDENT_SIDE_KEY
from course_lib.support.hosted import SETUP_CELL_ID

__all__ = ["HERE", "REPLAY_VARIABLE", "Outcome", "chapters_with_wrong_solutions", "grade_wrong_solutions", "run_secret",
           "solution_cells", "wrong_solutions"]

HERE = Path(__file__).resolve().parent
RIGHT = "the course's solution"
REPLAY_VARIABLE = "WRONG_SOLUTIONS_SECRET"


@dataclass(frozen=True)
class Outcome:
    """How one solution did on its exercise's test cell."""

    grade_id: str
    label: str
    passed: bool
    message: str
    secret: int  # the run's grading secret: WRONG_SOLUTIONS_SECRET=<it> replays the run's hidden inputs


def chapters_with_wrong_solutions() -> list[str]:
    """Chapters that have a file of wrong solutions."""
    return sorted(p.stem for p in HERE.glob("[0-9][0-9]_*.py"))


def solution_cells(chapter: str) -> tuple[dict[str, str], Callable[..., str]]:
    """A chapter's solution cells by cell id, and ``edited(cell_id, *(old, new), count=1)``: a cell with edits applied.

    Each ``old`` must occur exactly ``count`` times in the cell, so that a change of the course's
    solution shows up as an error here rather than as a wrong solution that silently became right.
    """
    notebook = HERE.parents[1] / "solutions" / chapter / f"{chapter}.ipynb"
    cells = {c.id: c.source for c in read_notebook(notebook).cells}

    def edited(cell_id: str, *edits: tuple[str, str], count: int = 1) -> str:
        source = cells[cell_id]
        for old, new in edits:
            if source.count(old) != count:
                raise ValueError(f"{cell_id}: the edit {old!r} does not match exactly {count} time(s)")
            source = source.replace(old, new)
        return source

    return cells, edited


def wrong_solutions(chapter: str) -> dict[str, dict[str, str]]:
    """``grade_id -> {label: cell source}`` of a chapter."""
    return runpy.run_path(str(HERE / f"{chapter}.py"))["WRONG"]


def _is_solution(cell: NotebookNode) -> bool:
    return bool(cell.metadata.get("nbgrader", {}).get("solution"))


def _imports_only(cell: NotebookNode) -> bool:
    """A cell whose every top-level statement is an import."""
    try:
        body = ast.parse(cell.source).body
    except SyntaxError:
        return False
    return bool(body) and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in body)


def _context(nb: NotebookNode) -> tuple[list[NotebookNode], dict[str, NotebookNode], dict[str, NotebookNode]]:
    """The cells the kernel needs, and each exercise's solution cell and test cell by the test's grade_id."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    # The chapter's setup cell (``from course_lib import env`` ...): the first code cell after the hosted setup cell.
    first = next(i for i, c in enumerate(code) if c.get("id") != SETUP_CELL_ID)
    keep = code[:first + 1] + [c for c in code[first + 1:]
                               if _is_solution(c) or c.metadata.get(STUDENT_SIDE_KEY) or _imports_only(c)]
    solutions, tests = {}, {}
    for cell in code:
        if _is_solution(cell):
            solutions[cell.metadata.nbgrader["grade_id"].removesuffix("_code")] = cell
        elif is_test_cell(cell):
            tests[cell.metadata.nbgrader["grade_id"]] = cell
    return keep, solutions, tests


def run_secret() -> int:
    """The grading secret of a run: ``$WRONG_SOLUTIONS_SECRET`` (to replay a run that failed), else a fresh one."""
    given = os.environ.get(REPLAY_VARIABLE, "").strip()
    if not given:
        return secrets.randbelow(2**31 - 1)
    if not given.isdigit():
        raise ValueError(f"{REPLAY_VARIABLE} must be a non-negative integer (a run's secret), got {given!r}")
    return int(given)


def _plain(source: str) -> NotebookNode:
    return nbformat.v4.new_code_cell(source)


def _copy(cell: NotebookNode) -> NotebookNode:
    """A copy of a cell with an id of its own (nbformat wants them unique)."""
    twin = copy.deepcopy(cell)
    twin.id = nbformat.v4.new_code_cell().id
    return twin


@contextlib.contextmanager
def _cpu_only() -> Iterator[None]:
    """Within the block, kernels started from this process see no GPU."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def grade_wrong_solutions(source_notebook: Path, wrong: dict[str, dict[str, str]], workdir: Path,
                          cell_timeout: float = 600) -> list[Outcome]:
    """Run the right and every wrong solution of each exercise in ``wrong`` through its test cell; one Outcome each."""
    source_notebook, workdir = source_notebook.resolve(), workdir.resolve()
    nb = read_notebook(source_notebook)
    keep, solutions, tests = _context(nb)
    unknown = sorted(set(wrong) - set(tests))
    if unknown:
        raise KeyError(f"{source_notebook.name} has no test cell {unknown}")
    cells = [_plain(c.source) for c in keep]
    plan: list[tuple[str, str]] = []  # (grade_id, label) of each test cell appended, in order
    for grade_id, variants in wrong.items():
        cells.append(_copy(tests[grade_id]))
        plan.append((grade_id, RIGHT))
        for label, source in variants.items():
            cells += [_plain(source), _copy(tests[grade_id])]
            plan.append((grade_id, label))
        cells.append(_plain(solutions[grade_id].source))
    short = nbformat.v4.new_notebook(cells=cells, metadata=nb.metadata)
    workdir.mkdir(parents=True, exist_ok=True)
    root = source_notebook.resolve().parents[2]
    env = {**child_environment(root), "CUDA_VISIBLE_DEVICES": ""}  # CPU grading, on any host: see the module docstring
    secret = run_secret()
    runner = TrustedExecute(
        kernel_name="python3", timeout=int(cell_timeout), interrupt_on_timeout=True,
        extra_arguments=["--IPKernelApp.log_level=ERROR"],
        source_notebook=str(source_notebook), tester_socket=str(workdir / "tester.sock"),
        tester_timeout=float(cell_timeout), tester_env={**env, SECRET_VARIABLE: str(secret)},
    )
    with course_environment(root), _cpu_only():
        runner.preprocess(short, {"metadata": {"path": str(workdir)}})
    graded = [c for c in short.cells if is_test_cell(c)]
    outcomes = []
    for (grade_id, label), cell in zip(plan, graded, strict=True):
        errors = [o for o in cell.outputs if o.output_type == "error"]
        message = f"{errors[0].ename}: {errors[0].evalue}" if errors else ""
        outcomes.append(Outcome(grade_id, label, not errors, message, secret))
    return outcomes
