"""The grader end to end on the real chapters, plus its command line and `validate`.

Grading is the expensive part: every scenario is graded in one `grade --jobs 2` run (the
module fixture `graded`), and the tests read its output. Students in that run:

- solution: the solution notebooks             -> full marks
- blank:    the released notebooks, with a first cell that prints a fingerprint of the hidden
            tests of every cell the grader runs    -> zero, and every chapter's hidden tests ran;
            plus a folder for an unknown chapter
- partial:  released, exercises 1, 3, 5... solved -> exactly their points
- tamper:   released, exercises 2, 4... solved; the test cell of the first solved exercise
            deleted, the other test cells replaced by `pass`  -> the original tests ran
- broken:   invalid JSON                       -> invalid_notebook
- misnamed: the notebook under another name    -> missing_notebook

Every chapter is graded as solution and blank; partial and tamper, which exercise the same
grader paths whatever the chapter, use PARTIAL_CHAPTERS only, so that the grading run grows by
two notebook executions per chapter, not four.

Time limits, kernel deaths and stderr filtering are checked on a tiny generated chapter
(its own quick `grade` run), so that no real notebook has to be slowed down or broken.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import html
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from nbformat import NotebookNode

from autograder.cli import main
from autograder.config import HARMLESS_STDERR
from autograder.course import Course, graded_points, is_test_cell
from autograder.sandbox import bwrap_path
from conftest import large_gpu_chapters

ROOT = Path(__file__).resolve().parents[1]
COURSE = Course(ROOT)
CHAPTERS = COURSE.chapters()
PARTIAL_CHAPTERS = CHAPTERS[:2]
HIDDEN_BLOCK = r"BEGIN HIDDEN TESTS[^\n]*\n(.*?)\n[^\n]*END HIDDEN TESTS"
# A student cell that would show what the kernel executes: before each cell runs, it prints a
# fingerprint of that cell's hidden tests, which would then show in the feedback. Tests run in the
# grader's tester, so the kernel never receives them and the spy must find nothing.
SPY_CELL = f"""\
import hashlib, re, sys
def _spy(info):
    found = re.search({HIDDEN_BLOCK!r}, info.raw_cell or "", re.S)
    if found:
        sys.stdout.write(f"SPY {{hashlib.md5(found.group(1).encode()).hexdigest()}}\\n")  # one write: one stream chunk
get_ipython().events.register("pre_run_cell", _spy)
"""


# Grading runs in the bubblewrap sandbox where bwrap is installed (CI installs it); on a laptop
# without it the end-to-end tests grade unsandboxed, which changes nothing they check.
SANDBOX_ARGS: list[str] = [] if bwrap_path() else ["--no-sandbox"]


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `python -m autograder ARGS` from the project root (``grade`` without a sandbox where bwrap is missing)."""
    if args[:1] == ("grade",):
        args = (*args, *SANDBOX_ARGS)
    command = [sys.executable, "-m", "autograder", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def exercises(nb: NotebookNode) -> list[tuple[str, str]]:
    """``(solution grade_id, test grade_id)`` of each exercise, paired by the convention ``<test id>_code``."""
    tests = {c.metadata.nbgrader["grade_id"] for c in nb.cells if is_test_cell(c)}
    solutions = [c.metadata.nbgrader["grade_id"] for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")]
    return [(s, s.removesuffix("_code")) for s in solutions if s.removesuffix("_code") in tests]


def cell_by_id(nb: NotebookNode, grade_id: str) -> NotebookNode:
    """The cell with this nbgrader grade_id."""
    return next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def hidden_fingerprints(nb: NotebookNode) -> dict[str, str]:
    """``test grade_id -> md5 of its hidden tests``, as the spy cell prints it."""
    found = {}
    for cell in nb.cells:
        block = re.search(HIDDEN_BLOCK, cell.source, re.S) if is_test_cell(cell) else None
        if block:
            found[cell.metadata.nbgrader["grade_id"]] = hashlib.md5(block.group(1).encode()).hexdigest()
    return found


def html_text(path: Path) -> str:
    """The text of an HTML file, tags removed."""
    return html.unescape(re.sub(r"<[^>]+>", "", path.read_text(encoding="utf-8")))


@dataclass
class Graded:
    """What one `grade` run produced, and what each scenario expects."""

    process: subprocess.CompletedProcess
    out: Path
    rows: list[dict[str, str]]
    detail: dict[tuple[str, str, str], tuple[float, float]]
    solved: dict[tuple[str, str], list[str]]
    deleted: dict[str, str]

    def row(self, student: str, chapter: str) -> dict[str, str]:
        """The grades.csv row of one submission."""
        matches = [r for r in self.rows if (r["student_id"], r["chapter"]) == (student, chapter)]
        assert len(matches) == 1, f"expected one row for {student}/{chapter}, got {matches}\n{self.process.stdout}"
        return matches[0]


def make_submissions(root: Path, released: Path) -> tuple[dict[tuple[str, str], list[str]], dict[str, str]]:
    """Write every scenario under ``root``.

    Returns the test ids that each partial/tamper notebook solves, and the test deleted per chapter.
    """
    solved, deleted = {}, {}

    def put(student: str, chapter: str, nb: NotebookNode, name: str | None = None) -> None:
        folder = root / student / chapter
        folder.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, folder / (name or f"{chapter}.ipynb"))

    for chapter in CHAPTERS:
        solution = nbformat.read(COURSE.source_notebook(chapter), as_version=4)
        put("solution", chapter, solution)
        blank = nbformat.read(released / chapter / f"{chapter}.ipynb", as_version=4)
        blank.cells.insert(0, nbformat.v4.new_code_cell(SPY_CELL))
        put("blank", chapter, blank)
        if chapter not in PARTIAL_CHAPTERS:
            continue
        pairs = exercises(solution)
        for student, chosen in (("partial", pairs[0::2]), ("tamper", pairs[1::2])):
            nb = nbformat.read(released / chapter / f"{chapter}.ipynb", as_version=4)
            for code_id, _ in chosen:
                cell_by_id(nb, code_id).source = cell_by_id(solution, code_id).source
            solved[student, chapter] = [test_id for _, test_id in chosen]
            if student == "tamper":
                unsolved = [test_id for _, test_id in pairs if test_id not in solved[student, chapter]]
                for test_id in unsolved:
                    cell_by_id(nb, test_id).source = "pass"
                if chosen:
                    deleted[chapter] = chosen[0][1]
                    nb.cells.remove(cell_by_id(nb, deleted[chapter]))
            put(student, chapter, nb)
    if RIGGED_CHAPTER in CHAPTERS:  # a wrong class, and the checks inside the ranks silenced in the kernel
        nb = nbformat.read(COURSE.source_notebook(RIGGED_CHAPTER), as_version=4)
        index = nb.cells.index(cell_by_id(nb, RIGGED_EXERCISE + "_code"))
        nb.cells.insert(index + 1, nbformat.v4.new_code_cell(RIGGED_CELL))
        put("rigged", RIGGED_CHAPTER, nb)
    first = CHAPTERS[0]
    (root / "broken" / first).mkdir(parents=True)
    (root / "broken" / first / f"{first}.ipynb").write_text('{"cells": [', encoding="utf-8")
    put("misnamed", first, nbformat.read(released / first / f"{first}.ipynb", as_version=4), name=f"{first}_final.ipynb")
    put("blank", "99_no_such_chapter", nbformat.read(released / first / f"{first}.ipynb", as_version=4))
    return solved, deleted


RIGGED_CHAPTER, RIGGED_EXERCISE = "13_tensor_parallel", "ex13_2_column_parallel"
RIGGED_CELL = """\
import course_lib.exercises.checks as _T
_T.assert_close = lambda *a, **k: None
_T.assert_equal = lambda *a, **k: None
_Right = ColumnParallelLinear
class ColumnParallelLinear(_Right):
    def forward(self, x):
        return super().forward(x) * 0
"""


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The student notebooks, released from solutions/ into a temporary folder."""
    if not CHAPTERS:
        pytest.skip("no chapters in solutions/")
    out = tmp_path_factory.mktemp("released")
    result = run_cli("release", "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory, released: Path) -> Graded:
    """Every scenario graded in a single `grade --jobs 2` run."""
    submissions, out = tmp_path_factory.mktemp("submissions"), tmp_path_factory.mktemp("graded")
    solved, deleted = make_submissions(submissions, released)
    # Limits for hangs only: every chapter's lecture cells run here (one of chapter 14's, timed GPipe and
    # 1F1B steps, takes 24 s on a quiet 2-core machine; a loaded one takes several times that).
    process = run_cli("grade", str(submissions), "--out", str(out), "--jobs", "2", "--timeout", "1800",
                      "--cell-timeout", "600", timeout=3600)
    assert (out / "grades.csv").is_file(), f"grade wrote no grades.csv:\n{process.stdout}\n{process.stderr}"
    with open(out / "grades.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    with open(out / "grades_detail.csv", newline="", encoding="utf-8") as f:
        detail = {
            (r["student_id"], r["chapter"], r["grade_id"]): (float(r["score"]), float(r["max_score"]))
            for r in csv.DictReader(f)
        }
    return Graded(process, out, rows, detail, solved, deleted)


def points(chapter: str) -> dict[str, float]:
    """``grade_id -> points`` of a chapter's graded cells."""
    return graded_points(nbformat.read(COURSE.source_notebook(chapter), as_version=4))


@pytest.mark.slow
def test_checks_silenced_inside_ranks_score_zero(graded: Graded) -> None:
    # The ranks run in the student's kernel, where the notebook replaced assert_close: the tester
    # judges what the checks were given against a run of the reference, so the wrong class scores 0.
    if RIGGED_CHAPTER not in CHAPTERS:
        pytest.skip(f"no {RIGGED_CHAPTER}")
    assert graded.detail["rigged", RIGGED_CHAPTER, RIGGED_EXERCISE][0] == 0, graded.row("rigged", RIGGED_CHAPTER)


@pytest.mark.slow
def test_grade_tables_have_the_documented_layout(graded: Graded) -> None:
    def header(name: str) -> str:
        return (graded.out / name).read_text(encoding="utf-8").splitlines()[0]

    assert header("grades.csv") == "student_id,chapter,score,max_score,status,message"
    assert header("grades_detail.csv") == "student_id,chapter,grade_id,score,max_score"
    keys = [(r["student_id"], r["chapter"]) for r in graded.rows]
    assert keys == sorted(keys) and len(keys) == len(set(keys))
    expected = {(s, c) for s in ("solution", "blank") for c in CHAPTERS}
    expected |= {(s, c) for s in ("partial", "tamper") for c in PARTIAL_CHAPTERS}
    expected |= {("broken", CHAPTERS[0]), ("misnamed", CHAPTERS[0]), ("blank", "99_no_such_chapter")}
    expected |= {("rigged", RIGGED_CHAPTER)} if RIGGED_CHAPTER in CHAPTERS else set()
    assert set(keys) == expected


@pytest.mark.slow
def test_exit_status_and_summary(graded: Graded) -> None:
    assert graded.process.returncode == 1, "some submissions are not ok, so grade should exit 1"
    assert "invalid_notebook" in graded.process.stdout and "graded" in graded.process.stdout


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_solutions_score_full_marks(graded: Graded, chapter: str) -> None:
    row = graded.row("solution", chapter)
    assert row["status"] == "ok", row["message"]
    assert float(row["score"]) == float(row["max_score"]) == sum(points(chapter).values()) > 0, row
    for grade_id, max_points in points(chapter).items():
        assert graded.detail["solution", chapter, grade_id] == (max_points, max_points), grade_id


@pytest.mark.gpu
@pytest.mark.parametrize("size", [pytest.param("large", marks=pytest.mark.large_gpu_memory), "small"])
def test_solutions_score_full_marks_on_the_gpu(tmp_path: Path, size: str) -> None:
    """The GPU tier's grading run: every solution executed in GPU mode (GPU sizes, compiled Triton) scores full marks.

    The chapters that need much GPU memory (tests/gpu_memory.json) are graded one at a time, beside no
    other large notebook; the others GPU_GRADE_JOBS at a time (default 2). Cells may take 10 minutes.
    """
    large = large_gpu_chapters()
    chapters = [c for c in CHAPTERS if (c in large) == (size == "large")]
    jobs = "1" if size == "large" else os.environ.get("GPU_GRADE_JOBS", "2")
    submissions, out = tmp_path / "submissions", tmp_path / "graded"
    for chapter in chapters:
        (submissions / "solution" / chapter).mkdir(parents=True)
        shutil.copy(COURSE.source_notebook(chapter), submissions / "solution" / chapter / f"{chapter}.ipynb")
    process = run_cli("grade", str(submissions), "--out", str(out), "--jobs", jobs, "--cell-timeout", "600", timeout=3600)
    assert (out / "grades.csv").is_file(), f"grade wrote no grades.csv:\n{process.stdout}\n{process.stderr}"
    with open(out / "grades.csv", newline="", encoding="utf-8") as f:
        rows = {r["chapter"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == sorted(chapters), f"graded {sorted(rows)}, expected {chapters}"
    short = [f"{c}: {r['score']}/{r['max_score']} {r['status']} {r['message']}" for c, r in rows.items()
             if r["status"] != "ok" or float(r["score"]) != float(r["max_score"]) or float(r["max_score"]) == 0]
    assert not short, "solutions below full marks on the GPU:\n" + "\n".join(short)
    assert process.returncode == 0, process.stdout + process.stderr


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_released_notebooks_score_zero(graded: Graded, chapter: str) -> None:
    row = graded.row("blank", chapter)
    assert row["status"] == "ok", row["message"]
    assert float(row["score"]) == 0 and float(row["max_score"]) == sum(points(chapter).values()), row


@pytest.mark.slow
@pytest.mark.parametrize("chapter", PARTIAL_CHAPTERS)
def test_partial_scores_exactly_the_solved_exercises(graded: Graded, chapter: str) -> None:
    solved = graded.solved["partial", chapter]
    row = graded.row("partial", chapter)
    assert row["status"] == "ok", row["message"]
    assert float(row["score"]) == sum(points(chapter)[t] for t in solved), (row, solved)
    for grade_id, max_points in points(chapter).items():
        expected = max_points if grade_id in solved else 0.0
        assert graded.detail["partial", chapter, grade_id] == (expected, max_points), f"{grade_id} (solved: {solved})"


@pytest.mark.slow
@pytest.mark.parametrize("chapter", PARTIAL_CHAPTERS)
def test_edited_or_deleted_test_cells_are_put_back(graded: Graded, chapter: str) -> None:
    solved = graded.solved["tamper", chapter]
    row = graded.row("tamper", chapter)
    assert row["status"] == "ok", row["message"]
    for grade_id, max_points in points(chapter).items():
        # Unsolved exercises had their tests replaced by `pass`: full marks would mean the edit was run.
        # The deleted test of a solved exercise scoring full marks means it was put back and run.
        expected = max_points if grade_id in solved else 0.0
        what = "deleted" if grade_id == graded.deleted.get(chapter) else "kept" if grade_id in solved else "edited"
        assert graded.detail["tamper", chapter, grade_id] == (expected, max_points), f"{grade_id} ({what})"


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_hidden_tests_never_reach_the_kernel(graded: Graded, chapter: str) -> None:
    fingerprints = hidden_fingerprints(nbformat.read(COURSE.source_notebook(chapter), as_version=4))
    printed = set(re.findall(r"SPY\s+([0-9a-f]{32})", html_text(graded.out / "feedback" / "blank" / f"{chapter}.html")))
    assert fingerprints
    leaked = sorted(g for g, md5 in fingerprints.items() if md5 in printed)
    assert not leaked, f"the student's kernel saw the hidden tests of {leaked}"


@pytest.mark.slow
def test_unreadable_or_misplaced_submissions_get_their_status(graded: Graded) -> None:
    first = CHAPTERS[0]
    broken = graded.row("broken", first)
    assert broken["status"] == "invalid_notebook" and float(broken["score"]) == 0, broken
    misnamed = graded.row("misnamed", first)
    assert misnamed["status"] == "missing_notebook" and f"{first}_final.ipynb" in misnamed["message"], misnamed
    unknown = graded.row("blank", "99_no_such_chapter")
    assert unknown["status"] == "unknown_chapter", unknown


@pytest.mark.slow
def test_feedback_for_graded_submissions_only_without_hidden_tests(graded: Graded) -> None:
    for row in graded.rows:
        feedback = graded.out / "feedback" / row["student_id"] / f"{row['chapter']}.html"
        assert feedback.is_file() == (row["status"] == "ok"), feedback
    for chapter in CHAPTERS:
        text = html_text(graded.out / "feedback" / "solution" / f"{chapter}.html")
        assert "BEGIN HIDDEN TESTS" not in text, f"{chapter}: the feedback shows the hidden tests"


def tiny_chapter(root: Path, name: str) -> NotebookNode:
    """Write a one-exercise chapter (no course_lib, runs in a blink) into the course at ``root``; return its notebook."""
    def cell(source: str, **nbgrader: object) -> NotebookNode:
        return nbformat.v4.new_code_cell(source, metadata={"nbgrader": {"schema_version": 3, **nbgrader}})

    nb = nbformat.v4.new_notebook(cells=[
        cell("def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION",
             grade=False, solution=True, locked=False, grade_id="ex90_1_double_code"),
        cell("assert double(2) == 4\n### BEGIN HIDDEN TESTS\nassert double(-1) == -2\n### END HIDDEN TESTS",
             grade=True, solution=False, locked=True, points=1, grade_id="ex90_1_double"),
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    (root / "solutions" / name).mkdir(parents=True)
    nbformat.write(nb, root / "solutions" / name / f"{name}.ipynb")
    return nb


# Code appended to the tiny chapter's solution cell, per student.
WRAP_DOUBLE = "\n_double = double\ndef double(x):\n    {}\n    return _double(x)"
TINY_STUDENTS = {
    "fine": "",
    "sleeper": "\nimport time\ntime.sleep(600)",
    "crasher": "\nimport os\nos._exit(1)",
    # Library noise on stderr is dropped by the IgnorePattern filter; the student's own stderr fails the test.
    "noisy": "\nimport warnings" + WRAP_DOUBLE.format(
        "warnings.warn_explicit('noise', UserWarning, '/venv/lib/python3.11/site-packages/torch/x.py', 1)"),
    "loud": "\nimport sys" + WRAP_DOUBLE.format("print('debug', file=sys.stderr)"),
}


@pytest.mark.slow
def test_time_limit_crash_and_stderr_on_a_tiny_chapter(tmp_path: Path) -> None:
    # Only the sleeper may meet a time limit: it runs alone with a short one (it sleeps far longer,
    # whatever the load); the others get one they never come near, in a second run at the same time.
    course, name = tmp_path / "course", "90_tiny"
    nb = tiny_chapter(course, name)
    runs = {"slow": (["sleeper"], "20"), "honest": ([s for s in TINY_STUDENTS if s != "sleeper"], "600")}
    processes = {}
    for run, (students, timeout) in runs.items():
        for student in students:
            submitted = copy.deepcopy(nb)
            submitted.cells[0].source += TINY_STUDENTS[student]
            (tmp_path / run / student / name).mkdir(parents=True)
            nbformat.write(submitted, tmp_path / run / student / name / f"{name}.ipynb")
        command = [sys.executable, "-m", "autograder", "grade", str(tmp_path / run), "--out",
                   str(tmp_path / f"{run}_out"), "--course-root", str(course), "--jobs", "2", "--timeout", timeout,
                   *SANDBOX_ARGS]
        processes[run] = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True)
    outputs = {run: proc.communicate(timeout=3600)[0] for run, proc in processes.items()}
    rows = {}
    for run in runs:
        with open(tmp_path / f"{run}_out" / "grades.csv", newline="", encoding="utf-8") as f:
            rows.update({r["student_id"]: r for r in csv.DictReader(f)})
    assert processes["slow"].returncode == processes["honest"].returncode == 1, outputs
    assert rows["fine"]["status"] == "ok" and rows["fine"]["score"] == "1", rows["fine"]
    assert rows["sleeper"]["status"] == "timeout" and "20 s" in rows["sleeper"]["message"], rows["sleeper"]
    assert rows["crasher"]["status"] == "error" and "Kernel died" in rows["crasher"]["message"], rows["crasher"]
    assert rows["noisy"]["status"] == "ok" and rows["noisy"]["score"] == "1", rows["noisy"]
    assert rows["loud"]["status"] == "ok" and rows["loud"]["score"] == "0", rows["loud"]


@pytest.mark.slow
def test_validate_passes_the_solution_notebook(released: Path, tmp_path: Path) -> None:
    chapter = CHAPTERS[0]
    shutil.copytree(COURSE.solutions / chapter, tmp_path / chapter)
    result = run_cli("validate", str(tmp_path / chapter / f"{chapter}.ipynb"))
    n_tests = sum(is_test_cell(c) for c in nbformat.read(COURSE.source_notebook(chapter), as_version=4).cells)
    total = sum(points(chapter).values())
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"tests: {n_tests} of {n_tests} passed ({total:g} of {total:g} points)" in result.stdout, result.stdout
    assert "CRASHED" not in result.stdout, result.stdout  # (a lecture cell may demonstrate the fallback)


@pytest.mark.slow
def test_validate_fails_a_blank_notebook_and_names_its_tests(released: Path) -> None:
    chapter = CHAPTERS[0]
    result = run_cli("validate", str(released / chapter / f"{chapter}.ipynb"))
    assert result.returncode == 1, result.stdout + result.stderr
    for grade_id in points(chapter):
        assert f"FAILED {grade_id}" in result.stdout, result.stdout
    assert f"(0 of {sum(points(chapter).values()):g} visible points)" in result.stdout, result.stdout
    assert "save first" in result.stdout, "validate reads the saved file: it must say so"


@pytest.mark.slow
def test_validate_says_hidden_tests_remain_and_names_a_crashed_lecture_cell(released: Path, tmp_path: Path) -> None:
    # Every visible test passes, but one answer is right only for the visible cases, and a lecture
    # cell the student added crashes: validate must not present the visible points as the grade.
    chapter = CHAPTERS[0]
    nb = nbformat.read(released / chapter / f"{chapter}.ipynb", as_version=4)
    solution = nbformat.read(COURSE.source_notebook(chapter), as_version=4)
    for code_id, _ in exercises(solution):
        cell_by_id(nb, code_id).source = cell_by_id(solution, code_id).source
    nb.cells.append(nbformat.v4.new_code_cell("results = {}\nprint(results['speed-up'])"))
    path = tmp_path / chapter / f"{chapter}.ipynb"
    path.parent.mkdir()
    nbformat.write(nb, path)
    result = run_cli("validate", str(path))
    n_tests, total = len(points(chapter)), sum(points(chapter).values())
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"visible tests: {n_tests} of {n_tests} passed ({total:g} of {total:g} visible points)" in result.stdout
    assert "the grader adds hidden tests" in result.stdout and "can be lower" in result.stdout, result.stdout
    crash = f"CRASHED lecture cell (cell {len(nb.cells) - 1}, `results = {{}}`): KeyError: 'speed-up'"
    assert crash in result.stdout, result.stdout


def test_help_of_every_command() -> None:
    for args in ([], ["release"], ["grade"], ["validate"]):
        result = run_cli(*args, "--help", timeout=60)
        assert result.returncode == 0, result.stderr
        assert "exit status" in " ".join(result.stdout.split())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["grade", "no/such/folder", "--out", "x"], "SUBMISSIONS folder not found"),
        (["grade", "."], "--out"),
        (["grade", str(ROOT / "tests"), "--out", "x", "--chapter", "99_nope"], "unknown chapter"),
        (["grade", str(ROOT / "tests"), "--out", "x", "--jobs", "0"], "positive"),
        (["release", "99_nope"], "unknown chapter"),
        (["validate", "no/such.ipynb"], "notebook not found"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_grade_without_submissions_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["grade", str(tmp_path), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "no submissions" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text",
    [
        "/x/lib/python3.11/site-packages/torch/nn/modules/module.py:1234: UserWarning: harmless\n  return forward(x)\n",
        "/x/site-packages/triton/runtime/interpreter.py:10: RuntimeWarning: something\n",
        "[rank0]:[W105 16:00:00.123456789 socket.cpp:697] [c10d] The client socket has failed to connect\n",
        # several harmless lines in one output
        "/x/site-packages/ipykernel/ipkernel.py:7: DeprecationWarning: old\n  import x\n"
        "[W1129 16:00:00.123456789 NNPACK.cpp:62] Could not initialize NNPACK! Reason: Unsupported hardware.\n",
    ],
)
def test_harmless_stderr_is_ignored(text: str) -> None:
    assert re.search(HARMLESS_STDERR, text)


@pytest.mark.parametrize(
    "text",
    [
        "oops\n",
        "/tmp/ipykernel_123/456.py:3: UserWarning: the student's own warning\n  warn('x')\n",
        "/x/site-packages/torch/nn/functional.py:5: UserWarning: fine\n  y = f(x)\nTraceback (most recent call last):\n",
        "/x/site-packages/numpy/core/fromnumeric.py:3: RuntimeWarning: Mean of empty slice\n",
    ],
)
def test_other_stderr_still_fails(text: str) -> None:
    assert not re.search(HARMLESS_STDERR, text)
