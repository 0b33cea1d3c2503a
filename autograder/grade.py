"""Grade a folder of submissions: nbgrader autograde in scratch course directories, in parallel, each with a time limit.

Layout read: ``SUBMISSIONS/<student_id>/<chapter>/<chapter>.ipynb``. Layout written:
``OUT/grades.csv``, ``OUT/grades_detail.csv``, ``OUT/export.csv`` (a row per student, a column
per chapter), ``OUT/feedback/<student_id>/<chapter>.html`` and ``OUT/.done/`` (finished grades,
for resuming).

Each kernel runs in the sandbox of ``autograder.sandbox`` and its test cells are judged by
``autograder.kernel`` / ``autograder.execute``.

The gradebook of every chapter is generated once from solutions/ (hidden tests included)
into a scratch template; each submission gets its own copy, outside the repository, with
only its notebook (no other submitted file can shadow a module the tests import). nbgrader's
autograde then puts back every locked cell from the gradebook, so the tests that run are the
instructor's, hidden ones included, even when a student edited or deleted a test cell.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import nbformat
import psutil

from .config import DEFAULT_CELL_TIMEOUT, DEFAULT_SUBMISSION_TIMEOUT, child_environment
from .course import Course, graded_points, read_notebook
from .logs import last_relevant_line
from .release import ReleaseError, generate_assignments
from .sandbox import DEFAULT_MAX_PROCESSES, DEFAULT_MEMORY_BYTES, Cgroup, check_available, uses_gpu

GRADES_COLUMNS = ["student_id", "chapter", "score", "max_score", "status", "message"]
DETAIL_COLUMNS = ["student_id", "chapter", "grade_id", "score", "max_score"]
# Submissions larger than this are not read at all.
MAX_NOTEBOOK_BYTES = 100 * 2**20
# OUT/.done/<key>.json: the grade of each finished submission, so that a rerun resumes.
DONE_DIRECTORY = ".done"
# Set in the environment of each worker, and so of its kernel and what that starts: finds them to clean up.
MARKER_VARIABLE = "AUTOGRADER_SUBMISSION"


@dataclass(frozen=True)
class Submission:
    """One student's folder for one chapter."""

    student_id: str
    chapter: str
    folder: Path

    @property
    def notebook(self) -> Path:
        """Where the chapter's notebook should be."""
        return self.folder / f"{self.chapter}.ipynb"


@dataclass
class Grade:
    """The outcome for one submission: a row of grades.csv and its rows of grades_detail.csv."""

    student_id: str
    chapter: str
    score: float
    max_score: float
    status: str
    message: str = ""
    cells: list[tuple[str, float, float]] = field(default_factory=list)


def find_submissions(submissions_dir: Path, chapter: str | None = None) -> list[Submission]:
    """Every ``<student_id>/<chapter>/`` folder (only ``chapter``'s when given), sorted by student and chapter."""
    found = []
    for student in sorted(p for p in submissions_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for folder in sorted(p for p in student.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if chapter is None or folder.name == chapter:
                found.append(Submission(student.name, folder.name, folder))
    return found


def stray_files(submissions_dir: Path) -> list[Path]:
    """Files directly in ``SUBMISSIONS/<student_id>/``, outside any chapter folder (they are not graded)."""
    return sorted(
        f for student in submissions_dir.iterdir() if student.is_dir() and not student.name.startswith(".")
        for f in student.iterdir() if f.is_file() and not f.name.startswith(".")
    )


def precheck(sub: Submission, max_scores: dict[str, float]) -> Grade | None:
    """The non-ok grade of a submission that cannot be graded (unknown chapter, missing or invalid notebook), else None."""
    if sub.chapter not in max_scores:
        known = ", ".join(max_scores) or "(none)"
        message = f"no chapter '{sub.chapter}' in solutions/ (chapters: {known})"
        return Grade(sub.student_id, sub.chapter, 0, 0, "unknown_chapter", message)
    fail = Grade(sub.student_id, sub.chapter, 0, max_scores[sub.chapter], "", "")
    if not sub.notebook.exists():
        found = ", ".join(sorted(p.name for p in sub.folder.iterdir())) or "nothing"
        fail.status, fail.message = "missing_notebook", f"expected {sub.notebook.name}; found: {found}"
        return fail
    if sub.notebook.is_symlink() or not sub.notebook.is_file():
        fail.status, fail.message = "invalid_notebook", f"{sub.notebook.name} is not a regular file"
        return fail
    size = sub.notebook.stat().st_size
    if size == 0 or size > MAX_NOTEBOOK_BYTES:
        fail.status = "invalid_notebook"
        fail.message = "the file is empty" if size == 0 else f"the file is larger than {MAX_NOTEBOOK_BYTES // 2**20} MB"
        return fail
    try:
        version = json.loads(sub.notebook.read_bytes()).get("nbformat")
        if version != 4:
            raise ValueError(f"nbformat {version!r} is not supported (the course's notebooks are nbformat 4)")
        nbformat.validate(nbformat.reads(sub.notebook.read_text(encoding="utf-8"), as_version=4))
    except Exception as exc:  # any way of not being a notebook: bad encoding, bad JSON, bad schema
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        fail.status, fail.message = "invalid_notebook", f"not a readable notebook: {type(exc).__name__}: {reason}"
        return fail
    return None


def grade_submissions(
    course: Course,
    submissions_dir: Path,
    out_dir: Path,
    *,
    chapter: str | None = None,
    jobs: int | None = None,
    timeout: float = DEFAULT_SUBMISSION_TIMEOUT,
    cell_timeout: int = DEFAULT_CELL_TIMEOUT,
    sandbox: bool = True,
    force: bool = False,
    max_processes: int = DEFAULT_MAX_PROCESSES,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    report: Callable[[str], None] = partial(print, flush=True),
) -> list[Grade]:
    """Grade every submission, write grades.csv, grades_detail.csv and feedback/ into ``out_dir``; return the grades.

    Raises SandboxUnavailable when ``sandbox`` is asked for and bubblewrap is missing. A
    submission graded by an earlier run into the same ``out_dir`` (same notebook bytes, same
    source notebook) is not graded again unless ``force``.
    """
    if sandbox:
        check_available()
    jobs = jobs or os.cpu_count() or 1
    submissions = find_submissions(submissions_dir, chapter)
    for path in stray_files(submissions_dir):
        report(f"ignored {path}: a submission belongs in <student_id>/<chapter>/<chapter>.ipynb")
    points = {c: graded_points(read_notebook(course.source_notebook(c))) for c in course.chapters()}
    max_scores = {c: sum(p.values()) for c, p in points.items()}
    progress = _Progress(len(submissions), report)
    done = _DoneStore(out_dir / DONE_DIRECTORY, course)
    grades, todo = [], []
    for sub in submissions:
        failed = precheck(sub, max_scores)
        kept = None if force or failed else done.load(sub)
        if failed or kept:
            grades.append(failed or kept)
            progress.done(failed or kept, 0.0, resumed=kept is not None)
        else:
            todo.append(sub)
    (out_dir / "feedback").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="autograder-grade-") as scratch_name:
        scratch = Path(scratch_name)
        chapters = sorted({s.chapter for s in todo})
        if chapters:
            report(f"building the gradebook of {', '.join(chapters)} from {course.solutions} ...")
        template_db, broken = _build_gradebook(course, chapters, scratch / "template")
        limits = _Limits(sandbox, max_processes, memory_bytes)
        runner = _Runner(course, scratch, template_db, out_dir, max_scores, jobs, timeout, cell_timeout, limits)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(runner.run, i, sub) for i, sub in enumerate(todo) if sub.chapter not in broken]
            for sub in todo:
                if sub.chapter in broken:
                    grade = Grade(sub.student_id, sub.chapter, 0, max_scores[sub.chapter], "error", broken[sub.chapter])
                    grades.append(grade)
                    progress.done(grade, 0.0)
            for future in as_completed(futures):
                (sub, grade), seconds = future.result()
                if grade.status != "error":  # a grader failure may be passing: try it again next time
                    done.save(sub, grade)
                grades.append(grade)
                progress.done(grade, seconds)
    grades.sort(key=lambda g: (g.student_id, g.chapter))
    for g in grades:
        if g.status != "ok":
            (out_dir / "feedback" / g.student_id / f"{g.chapter}.html").unlink(missing_ok=True)
    write_grades(grades, out_dir, {c: list(p) for c, p in points.items()})
    write_export(grades, out_dir)
    progress.summary(grades, out_dir)
    return grades


def write_grades(grades: Sequence[Grade], out_dir: Path, cell_order: dict[str, list[str]]) -> None:
    """Write grades.csv (a row per submission) and grades_detail.csv (a row per graded cell, in notebook order)."""
    with open(out_dir / "grades.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(GRADES_COLUMNS)
        for g in grades:
            writer.writerow([g.student_id, g.chapter, _number(g.score), _number(g.max_score), g.status, g.message])
    with open(out_dir / "grades_detail.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(DETAIL_COLUMNS)
        for g in grades:
            order = cell_order.get(g.chapter, [])
            for name, score, max_score in sorted(g.cells, key=lambda c: order.index(c[0]) if c[0] in order else len(order)):
                writer.writerow([g.student_id, g.chapter, name, _number(score), _number(max_score)])


def write_export(grades: Sequence[Grade], out_dir: Path) -> None:
    """Write export.csv: a row per student, a score column per chapter, then the total (for a spreadsheet or an LMS)."""
    chapters = sorted({g.chapter for g in grades if g.status != "unknown_chapter"})
    by_student: dict[str, dict[str, Grade]] = {}
    for g in grades:
        by_student.setdefault(g.student_id, {})[g.chapter] = g
    max_total = {c: max((g.max_score for g in grades if g.chapter == c), default=0) for c in chapters}
    with open(out_dir / "export.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["student_id", *chapters, "total", "max_total"])
        for student, theirs in sorted(by_student.items()):
            scores = [theirs[c].score if c in theirs else 0.0 for c in chapters]
            writer.writerow([student, *map(_number, scores), _number(sum(scores)), _number(sum(max_total.values()))])


def _number(x: float) -> str:
    """A score as written in the CSV files: 3, 2.5."""
    return f"{float(x):g}"


@dataclass(frozen=True)
class _Limits:
    """How each submission's kernel is confined."""

    sandbox: bool
    max_processes: int
    memory_bytes: int


class _DoneStore:
    """``OUT/.done/``: one JSON file per finished submission, keyed by the hashes of its notebook and its source."""

    def __init__(self, folder: Path, course: Course):
        self.folder, self.course = folder, course

    def _key(self, sub: Submission) -> str:
        """The identity of a grading: who, which chapter, which bytes were graded against which source."""
        digest = hashlib.sha256(sub.notebook.read_bytes())
        digest.update(self.course.source_notebook(sub.chapter).read_bytes())
        return f"{sub.student_id}__{sub.chapter}__{digest.hexdigest()[:16]}"

    def load(self, sub: Submission) -> Grade | None:
        """The grade of an earlier run of exactly this submission, or None."""
        path = self.folder / f"{self._key(sub)}.json"
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return Grade(**{**data, "cells": [tuple(c) for c in data["cells"]]})
        except (ValueError, TypeError, KeyError):
            return None

    def save(self, sub: Submission, grade: Grade) -> None:
        """Record a finished grade (written to a temporary name, then renamed: never half a file)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{self._key(sub)}.json"
        partial_path = path.with_suffix(".tmp")
        partial_path.write_text(json.dumps(grade.__dict__), encoding="utf-8")
        partial_path.replace(path)


def _build_gradebook(course: Course, chapters: list[str], folder: Path) -> tuple[Path, dict[str, str]]:
    """Generate one template gradebook with every chapter; return it and ``chapter -> error`` for chapters that failed."""
    db_path, broken = folder / "gradebook.db", {}
    for chapter in chapters:
        try:
            generate_assignments(course, [chapter], folder / "release", db_path)
        except ReleaseError as exc:
            broken[chapter] = f"could not build the gradebook: {exc}"
    return db_path, broken


class _Runner:
    """Grades one submission at a time in a child process; safe to call from several threads."""

    def __init__(
        self, course: Course, scratch: Path, template_db: Path, out_dir: Path, max_scores: dict[str, float],
        jobs: int, timeout: float, cell_timeout: int, limits: _Limits,
    ):
        self.course, self.scratch, self.template_db, self.out_dir = course, scratch, template_db, out_dir
        self.max_scores, self.limits = max_scores, limits
        self.timeout, self.cell_timeout = timeout, cell_timeout
        self.env = child_environment(course.root)
        # Each kernel gets its share of the cores instead of all of them.
        self.env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))

    def run(self, index: int, sub: Submission) -> tuple[tuple[Submission, Grade], float]:
        """Grade ``sub`` in its own scratch course directory; return it with its grade, and the seconds it took."""
        start = time.monotonic()
        try:
            return (sub, self._grade(index, sub)), time.monotonic() - start
        except Exception as exc:  # whatever goes wrong with one submission must not stop the others
            message = f"{type(exc).__name__}: {exc}"
            grade = Grade(sub.student_id, sub.chapter, 0, self.max_scores[sub.chapter], "error", message)
            return (sub, grade), time.monotonic() - start

    def _grade(self, index: int, sub: Submission) -> Grade:
        """Grade ``sub``: copy it and the gradebook into a scratch course, run the worker, read its result."""
        work = self.scratch / f"{index:05d}"
        submitted = work / "submitted" / sub.student_id / sub.chapter
        submitted.mkdir(parents=True)
        shutil.copyfile(sub.notebook, submitted / sub.notebook.name)
        shutil.copyfile(self.template_db, work / "gradebook.db")
        result_file, log_file = work / "result.json", work / "worker.log"
        command = [
            sys.executable, "-m", "autograder.worker", "--scratch", str(work), "--source", str(self.course.solutions),
            "--chapter", sub.chapter, "--student", sub.student_id, "--cell-timeout", str(self.cell_timeout),
            "--result", str(result_file),
        ]
        if not self.limits.sandbox:
            command.append("--no-sandbox")
        if not uses_gpu():
            command += ["--memory-bytes", str(self.limits.memory_bytes)]
        timed_out, returncode = self._run_worker(command, work, log_file)
        fail = Grade(sub.student_id, sub.chapter, 0, self.max_scores[sub.chapter], "error")
        if timed_out:
            fail.status, fail.message = "timeout", f"grading took longer than {self.timeout:g} s and was stopped"
            return fail
        if not result_file.is_file():
            reason = last_relevant_line(log_file.read_text(errors="replace"))
            fail.message = f"grader exited with status {returncode}: {reason}"
            return fail
        result = json.loads(result_file.read_text(encoding="utf-8"))
        if result["status"] != "ok":
            fail.status, fail.message = result["status"], result["message"]
            return fail
        self._keep_feedback(work, sub)
        cells = [(name, score, max_score) for name, score, max_score in result["cells"]]
        return Grade(sub.student_id, sub.chapter, result["score"], result["max_score"], "ok", result["message"], cells)

    def _run_worker(self, command: list[str], work: Path, log_file: Path) -> tuple[bool, int]:
        """Run the worker with the time limit; return whether it was stopped for taking too long, and its exit status."""
        with open(log_file, "wb") as log:
            env = {**self.env, MARKER_VARIABLE: f"{os.getpid()}-{work.name}"}
            memory = self.limits.memory_bytes if uses_gpu() else None
            cgroup = Cgroup(f"autograder-{env[MARKER_VARIABLE]}", self.limits.max_processes, memory)
            proc = subprocess.Popen(
                command, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
            cgroup.add(proc.pid)
            try:
                proc.wait(timeout=self.timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_all(proc.pid, env[MARKER_VARIABLE])
                cgroup.kill_and_remove()
            return timed_out, proc.wait()

    def _keep_feedback(self, work: Path, sub: Submission) -> None:
        """Copy the feedback HTML to ``OUT/feedback/<student_id>/<chapter>.html``."""
        html = work / "feedback" / sub.student_id / sub.chapter / f"{sub.chapter}.html"
        target = self.out_dir / "feedback" / sub.student_id / f"{sub.chapter}.html"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(html, target)


def _kill_all(pid: int, marker: str) -> None:
    """Kill the worker ``pid``, its descendants and any process that still carries its ``marker`` in the environment.

    A Jupyter kernel starts in a session of its own, and what it starts may outlive it, so
    neither the process group nor the session of the worker covers them all.
    """
    try:
        root = psutil.Process(pid)
        doomed = [root, *root.children(recursive=True)]
    except psutil.Error:
        doomed = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER_VARIABLE) == marker:
                doomed.append(proc)
        except psutil.Error:
            continue
    for proc in doomed:
        try:
            proc.kill()
        except psutil.Error:
            continue


class _Progress:
    """One line per finished submission, and a summary at the end."""

    def __init__(self, total: int, report: Callable[[str], None]):
        self.total, self.count, self.report, self.lock, self.start = total, 0, report, threading.Lock(), time.monotonic()

    def done(self, grade: Grade, seconds: float, resumed: bool = False) -> None:
        """Report one finished submission (``resumed``: its grade comes from an earlier run)."""
        with self.lock:
            self.count += 1
            width = len(str(self.total))
            line = f"[{self.count:{width}d}/{self.total}] {grade.student_id} {grade.chapter}: {grade.status}"
            line += f" {_number(grade.score)}/{_number(grade.max_score)}" if grade.status == "ok" else f" ({grade.message})"
            self.report(line + (f" in {seconds:.1f} s" if seconds else "") + (" (from an earlier run)" if resumed else ""))

    def summary(self, grades: Sequence[Grade], out_dir: Path) -> None:
        """Report the counts per status and where the results are."""
        counts = Counter(g.status for g in grades)
        parts = ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: (kv[0] != "ok", kv[0])))
        self.report(f"graded {len(grades)} submission(s) in {time.monotonic() - self.start:.1f} s: {parts or 'nothing'}")
        self.report(f"wrote {out_dir / 'grades.csv'}, {out_dir / 'grades_detail.csv'} and {out_dir / 'feedback'}/")
