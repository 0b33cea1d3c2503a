"""Grade a folder of submissions: nbgrader autograde in scratch course directories, in parallel, each with a time limit.

Layout read: ``SUBMISSIONS/<student_id>/<chapter>/<chapter>.ipynb``. Layout written:
``OUT/grades.csv``, ``OUT/grades_detail.csv``, ``OUT/export.csv`` (a row per student, a column
per chapter), ``OUT/feedback/<student_id>/<chapter>.html`` and ``OUT/.done/`` (finished grades,
for resuming).

Each kernel runs in the sandbox of ``autograder.sandbox``; its test cells are judged by the tester
(``autograder.tester``, through ``autograder.execute``).

Nothing a submission holds is trusted (``autograder.intake``). Its folders and notebook are
opened without following a link; a link, or anything but a plain folder or file, gets a row
with the status ``invalid_submission`` and is never read. A student id is reported in the
tables as it is, but graded under an internal name (``s00042``): that is the only name on a
command line or in a scratch path. The notebook's bytes are read once (at most
MAX_NOTEBOOK_BYTES) and parsed in a child process with a time and memory limit. What comes
back from a submission's scratch folder (result, log, feedback page) is read the same way.

The gradebook of every chapter is generated once from solutions/ (hidden tests included)
into a scratch template; each submission gets its own copy, outside the repository, with
only its notebook (no other submitted file can shadow a module the tests import). nbgrader's
autograde then puts back every locked cell from the gradebook, so the tests that run are the
instructor's, hidden ones included, even when a student edited or deleted a test cell.

Every submission gets exactly one row, whatever happens to the others, to the resume record
or to its own grading; a text cell that a spreadsheet would run as a formula is escaped.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import psutil

from .config import DEFAULT_CELL_TIMEOUT, DEFAULT_SUBMISSION_TIMEOUT, SECRET_VARIABLE, child_environment
from .contracts import ContractError, Grade, Status, WorkerArgs, WorkerResult
from .course import Course, graded_points, read_notebook
from .intake import (
    MAX_NOTEBOOK_BYTES,
    RefusedFile,
    TooLarge,
    check_notebook,
    copy_regular,
    id_problem,
    open_folder,
    read_regular,
    shown,
    write_whole,
)
from .limits import IPC_BYTES, Limits
from .logs import last_relevant_line
from .release import ReleaseError, generate_assignments
from .sandbox import Cgroup, check_available, in_private_tmpfs, private_tmpfs_available, unenforced_limits

__all__ = ["FORMULA_STARTS", "Submission", "find_submissions", "grade_submissions", "write_grades"]

GRADES_COLUMNS = ["student_id", "chapter", "score", "max_score", "status", "message"]
DETAIL_COLUMNS = ["student_id", "chapter", "grade_id", "score", "max_score"]
# What is read back from a submission's scratch folder, at most.
MAX_FEEDBACK_BYTES = 64 * 2**20
MAX_RESULT_BYTES = 16 * 2**20
MAX_LOG_TAIL_BYTES = 2**20
MAX_RECORD_BYTES = 16 * 2**20
# OUT/.done/<key>.json: the grade of each finished submission, so that a rerun resumes.
DONE_DIRECTORY = ".done"
# Set in the environment of each worker, and so of its kernel and what that starts: finds them to clean up.
MARKER_VARIABLE = "AUTOGRADER_SUBMISSION"
# A CSV cell starting with one of these would run as a formula in a spreadsheet (OWASP: prefix a quote).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
LINK_MESSAGE = "is a symbolic link: links are not followed (put the files themselves there)"


@dataclass(frozen=True)
class Submission:
    """One chapter folder of one student folder, as found: its names as the tables show them, and where it is."""

    student_id: str
    chapter: str
    # The folder names on disk below SUBMISSIONS: (student,) or (student, chapter).
    names: tuple[str, ...]
    # (status, message) when the names alone rule grading out.
    problem: tuple[Status, str] | None = None


def find_submissions(submissions_dir: Path, chapter: str | None = None) -> list[Submission]:
    """Every ``<student_id>/<chapter>/`` folder (only ``chapter``'s when given), sorted by student and chapter.

    Folders that cannot be graded (links, names that are no id) are in the list too, with their problem.
    """
    return scan_submissions(submissions_dir, chapter)[0]


def scan_submissions(submissions_dir: Path, chapter: str | None = None) -> tuple[list[Submission], list[str]]:
    """``find_submissions``, and a line for each entry that is ignored (a file outside a chapter folder).

    Nothing is followed: a student or chapter folder that is a link becomes a submission with
    a problem, and so does a student folder whose name cannot be an id. With ``chapter``,
    submissions about a whole student folder (chapter unknown) are kept too.
    """
    found: list[Submission] = []
    ignored: list[str] = []
    with _opened(_open_root(submissions_dir)) as root:
        for entry in _entries(root):
            student = shown(entry.name)
            if entry.is_symlink():
                link = (Status.INVALID_SUBMISSION, f"the folder {LINK_MESSAGE}")
                found.append(Submission(student, "", (entry.name,), link))
            elif entry.is_dir(follow_symlinks=False):
                found += _chapter_folders(root, entry.name, ignored)
            elif not entry.name.startswith("."):
                ignored.append(f"ignored {student}: not a folder (a submission belongs in "
                               "<student_id>/<chapter>/<chapter>.ipynb)")
    kept = [s for s in found if chapter is None or s.chapter in (chapter, "")]
    return sorted(kept, key=lambda s: (s.student_id, s.chapter)), ignored


def _chapter_folders(root: int, name: str, ignored: list[str]) -> list[Submission]:
    """The submissions in the student folder ``name`` of the folder ``root``; a line in ``ignored`` per stray file."""
    student, reason = shown(name), id_problem(name)
    problem = (Status.INVALID_ID, f"{reason}: rename the folder") if reason else None
    found = []
    try:
        with _opened(open_folder(name, root)) as folder:
            for entry in _entries(folder):
                chapter = shown(entry.name)
                if entry.is_symlink():
                    link = (Status.INVALID_SUBMISSION, f"the chapter folder {LINK_MESSAGE}")
                    found.append(Submission(student, chapter, (name, entry.name), problem or link))
                elif entry.is_dir(follow_symlinks=False):
                    found.append(Submission(student, chapter, (name, entry.name), problem))
                elif not entry.name.startswith("."):
                    ignored.append(f"ignored {student}/{chapter}: a submission belongs in "
                                   "<student_id>/<chapter>/<chapter>.ipynb")
    except (OSError, RefusedFile) as exc:
        unreadable = (Status.INVALID_SUBMISSION, f"cannot read the folder: {exc}")
        return [Submission(student, "", (name,), problem or unreadable)]
    return found or ([Submission(student, "", (name,), problem)] if problem else [])


def _entries(folder: int) -> list[os.DirEntry]:
    """The entries of an open folder, sorted by name."""
    with os.scandir(folder) as entries:
        return sorted(entries, key=lambda e: e.name)


def _open_root(submissions_dir: Path) -> int:
    """A descriptor of the SUBMISSIONS folder itself (the instructor's: it may be a link)."""
    return os.open(submissions_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


@contextmanager
def _opened(fd: int) -> Iterator[int]:
    """Close the descriptor ``fd`` after the block."""
    try:
        yield fd
    finally:
        os.close(fd)


@contextmanager
def _submission_folder(submissions_dir: Path, names: Sequence[str]) -> Iterator[int]:
    """The open folder ``SUBMISSIONS/<names...>``, each folder on the way opened without following a link."""
    fds = [_open_root(submissions_dir)]
    try:
        for name in names:
            fds.append(open_folder(name, fds[-1]))
        yield fds[-1]
    finally:
        for fd in fds:
            os.close(fd)


def precheck(sub: Submission, submissions_dir: Path, max_scores: dict[str, float]) -> Grade | bytes:
    """The non-ok grade of a submission that cannot be graded, else its notebook's bytes.

    Reads at most MAX_NOTEBOOK_BYTES and never through a link; whether the bytes are a notebook
    is checked later, in a child process (``autograder.intake.check_notebook``).
    """
    if sub.problem:
        return Grade(sub.student_id, sub.chapter, 0, max_scores.get(sub.chapter, 0), *sub.problem)
    if sub.chapter not in max_scores:
        known = ", ".join(max_scores) or "(none)"
        message = f"no chapter '{sub.chapter}' in solutions/ (chapters: {known})"
        return Grade(sub.student_id, sub.chapter, 0, 0, Status.UNKNOWN_CHAPTER, message)
    fail = Grade(sub.student_id, sub.chapter, 0, max_scores[sub.chapter], Status.INVALID_SUBMISSION)
    name = f"{sub.chapter}.ipynb"
    try:
        with _submission_folder(submissions_dir, sub.names) as folder:
            try:
                data = read_regular(name, MAX_NOTEBOOK_BYTES, dir_fd=folder)
            except FileNotFoundError:
                found = ", ".join(shown(n) for n in sorted(os.listdir(folder))[:10]) or "nothing"
                fail.status, fail.message = Status.MISSING_NOTEBOOK, f"expected {name}; found: {found}"
                return fail
    except TooLarge as exc:
        fail.status, fail.message = Status.INVALID_NOTEBOOK, str(exc)
        return fail
    except RefusedFile as exc:
        fail.message = f"{exc}: the grader reads only plain files and folders, never through a link"
        return fail
    except OSError as exc:
        fail.status, fail.message = Status.ERROR, f"could not read {name}: {exc.strerror or exc}"
        return fail
    if not data:
        fail.status, fail.message = Status.INVALID_NOTEBOOK, "the file is empty"
        return fail
    return data


_print_flushed = partial(print, flush=True)  # the default ``report``: each line shown as it comes


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
    limits: Limits | None = None,
    report: Callable[[str], None] = _print_flushed,
) -> list[Grade]:
    """Grade every submission, write grades.csv, grades_detail.csv and feedback/ into ``out_dir``; return the grades.

    ``limits`` confines each kernel (``autograder.limits``; its defaults when None). Raises
    SandboxUnavailable when ``sandbox`` is asked for and bubblewrap is missing. A submission
    graded by an earlier run into the same ``out_dir`` (same notebook bytes, same source notebook)
    is not graded again unless ``force``. Limits this machine cannot enforce are reported once, first.
    """
    if sandbox:
        check_available()
    jobs = jobs or os.cpu_count() or 1
    limits = replace(limits or Limits(), sandbox=sandbox, jobs=jobs, private_ipc=sandbox and private_tmpfs_available())
    for line in unenforced_limits(limits):
        report(f"warning: {line}")
    submissions, ignored = scan_submissions(submissions_dir, chapter)
    for line in ignored:
        report(line)
    points = {c: graded_points(read_notebook(course.source_notebook(c))) for c in course.chapters()}
    max_scores = {c: sum(p.values()) for c, p in points.items()}
    progress = _Progress(len(submissions), report)
    done = _DoneStore(out_dir / DONE_DIRECTORY, course, report)
    (out_dir / "feedback").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="autograder-grade-", ignore_cleanup_errors=True) as scratch_name:
        scratch = Path(scratch_name)
        grades, todo = _sort_out(submissions, submissions_dir, max_scores, done, force, scratch, progress)
        chapters = sorted({job.sub.chapter for job in todo})
        if chapters:
            report(f"building the gradebook of {', '.join(chapters)} from {course.solutions} ...")
        template_db, broken = _build_gradebook(course, chapters, scratch / "template")
        runner = _Runner(course, scratch, template_db, out_dir, max_scores, timeout, cell_timeout, limits)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(runner.run, job) for job in todo if job.sub.chapter not in broken]
            for job in todo:
                if job.sub.chapter in broken:
                    grade = Grade(job.sub.student_id, job.sub.chapter, 0, max_scores[job.sub.chapter], Status.ERROR,
                                  broken[job.sub.chapter])
                    grades.append(grade)
                    progress.done(grade, 0.0)
            for future in as_completed(futures):
                job, grade, seconds = future.result()
                if grade.status is not Status.ERROR:  # a grader failure may be passing: try it again next time
                    done.save(job.key, grade)
                grades.append(grade)
                progress.done(grade, seconds)
    grades.sort(key=lambda g: (g.student_id, g.chapter))
    write_grades(grades, out_dir, {c: list(p) for c, p in points.items()})
    write_export(grades, out_dir, list(max_scores))
    _remove_stale_feedback(grades, out_dir, max_scores)
    progress.summary(grades, out_dir)
    return grades


def _remove_stale_feedback(grades: Sequence[Grade], out_dir: Path, max_scores: dict[str, float]) -> None:
    """Remove the feedback page an earlier run left for a submission that is not ok now."""
    for g in grades:
        if g.status not in (Status.OK, Status.INVALID_ID) and g.chapter in max_scores:
            try:
                (out_dir / "feedback" / g.student_id / f"{g.chapter}.html").unlink(missing_ok=True)
            except OSError:  # not ours to clean (a file where a student's feedback folder would be)
                continue


def _sort_out(
    submissions: Sequence[Submission], submissions_dir: Path, max_scores: dict[str, float], done: _DoneStore,
    force: bool, scratch: Path, progress: _Progress,
) -> tuple[list[Grade], list[_Job]]:
    """Precheck every submission: the grades known without grading (problems, earlier runs), and the jobs to grade.

    Each job's notebook is staged in its scratch course as it is read, so that at most one
    notebook's bytes are held at a time.
    """
    grades, todo = [], []
    for index, sub in enumerate(submissions):
        checked = precheck(sub, submissions_dir, max_scores)
        if isinstance(checked, Grade):
            grades.append(checked)
            progress.done(checked, 0.0)
            continue
        job = _Job(index, sub, done.key(sub, checked))
        kept = None if force else done.load(job.key, sub)
        if kept:
            grades.append(kept)
            progress.done(kept, 0.0, resumed=True)
        else:
            job.stage(scratch, checked)
            todo.append(job)
    return grades, todo


def write_grades(grades: Sequence[Grade], out_dir: Path, cell_order: dict[str, list[str]]) -> None:
    """Write grades.csv (a row per submission) and grades_detail.csv (a row per graded cell, in notebook order)."""
    rows = [[g.student_id, g.chapter, _number(g.score), _number(g.max_score), str(g.status), g.message] for g in grades]
    _write_csv(out_dir / "grades.csv", GRADES_COLUMNS, rows)
    detail = []
    for g in grades:
        order = cell_order.get(g.chapter, [])
        for name, score, max_score in sorted(g.cells, key=lambda c: order.index(c[0]) if c[0] in order else len(order)):
            detail.append([g.student_id, g.chapter, name, _number(score), _number(max_score)])
    _write_csv(out_dir / "grades_detail.csv", DETAIL_COLUMNS, detail)


def write_export(grades: Sequence[Grade], out_dir: Path, course_chapters: Sequence[str]) -> None:
    """Write export.csv: a row per student, a score column per chapter, then the total (for a spreadsheet or an LMS).

    The columns are the course's chapters that were submitted; a student folder whose name is
    not a valid id (``invalid_id``) has no row: it matches no student of an LMS.
    """
    chapters = sorted({g.chapter for g in grades if g.chapter in course_chapters})
    by_student: dict[str, dict[str, Grade]] = {}
    for g in grades:
        if g.status is not Status.INVALID_ID:
            by_student.setdefault(g.student_id, {}).update({g.chapter: g} if g.chapter in chapters else {})
    max_total = {c: max((g.max_score for g in grades if g.chapter == c), default=0) for c in chapters}
    rows = []
    for student, theirs in sorted(by_student.items()):
        scores = [theirs[c].score if c in theirs else 0.0 for c in chapters]
        rows.append([student, *map(_number, scores), _number(sum(scores)), _number(sum(max_total.values()))])
    _write_csv(out_dir / "export.csv", ["student_id", *chapters, "total", "max_total"], rows)


def _write_csv(path: Path, header: list[str], rows: Iterable[list[str]]) -> None:
    """Write a CSV file whole (never half a file), each cell that a spreadsheet would run as a formula escaped."""
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(header)
    writer.writerows([_cell(value) for value in row] for row in rows)
    write_whole(path, text.getvalue().encode("utf-8", "backslashreplace"))


def _cell(text: str) -> str:
    """A CSV cell as written: with a quote first when it starts like a formula (``=``, ``+``, ``-``, ``@``, tab, CR)."""
    return f"'{text}" if text.startswith(FORMULA_STARTS) else text


def _number(x: float) -> str:
    """A score as written in the CSV files: 3, 2.5."""
    return f"{float(x):g}"


@dataclass(frozen=True)
class _Job:
    """A submission that passed the precheck, with its scratch course ``NNNNN/`` and its key in OUT/.done/."""

    index: int
    sub: Submission
    key: str

    @property
    def internal(self) -> str:
        """The name it is graded under: the only one on a command line or in a scratch path."""
        return f"s{self.index:05d}"

    def folder(self, scratch: Path) -> Path:
        """Its scratch course directory."""
        return scratch / f"{self.index:05d}"

    def stage(self, scratch: Path, data: bytes) -> None:
        """Write the notebook's bytes where nbgrader looks for them: ``submitted/<internal>/<chapter>/``."""
        folder = self.folder(scratch) / "submitted" / self.internal / self.sub.chapter
        folder.mkdir(parents=True)
        (folder / f"{self.sub.chapter}.ipynb").write_bytes(data)


class _DoneStore:
    """``OUT/.done/``: one JSON file per finished submission, named by a hash of who, which chapter and which bytes.

    A record that is not a regular file, not JSON or not a grade is ignored (the submission is
    graded again); a record that cannot be written is reported once and grading goes on.
    """

    def __init__(self, folder: Path, course: Course, report: Callable[[str], None]):
        self.folder, self.course, self.report = folder, course, report
        self.sources: dict[str, bytes] = {}
        self.warned = False

    def key(self, sub: Submission, data: bytes) -> str:
        """The identity of a grading: who, which chapter, which bytes were graded against which source."""
        if sub.chapter not in self.sources:
            self.sources[sub.chapter] = self.course.source_notebook(sub.chapter).read_bytes()
        digest = hashlib.sha256()
        for part in (*map(os.fsencode, sub.names), data, self.sources[sub.chapter]):
            digest.update(len(part).to_bytes(8, "big") + part)
        return digest.hexdigest()[:32]

    def load(self, key: str, sub: Submission) -> Grade | None:
        """The grade of an earlier run of exactly this submission, or None."""
        try:
            return Grade.from_json(read_regular(self.folder / f"{key}.json", MAX_RECORD_BYTES), sub.student_id,
                                   sub.chapter)
        except (OSError, RefusedFile, ContractError):  # missing, not a regular file, or spoiled: grade it again
            return None

    def save(self, key: str, grade: Grade) -> None:
        """Record a finished grade (written whole, through a temporary name)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_whole(self.folder / f"{key}.json", grade.to_json().encode())
        except OSError as exc:
            if not self.warned:
                self.report(f"warning: cannot record grades in {self.folder} for resuming ({exc}); grading goes on")
            self.warned = True


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
        timeout: float, cell_timeout: int, limits: Limits,
    ):
        self.course, self.scratch, self.template_db, self.out_dir = course, scratch, template_db, out_dir
        self.max_scores, self.limits = max_scores, limits
        self.timeout, self.cell_timeout = timeout, cell_timeout
        self.env = child_environment(course.root)
        # Each kernel gets its share of the cores instead of all of them.
        self.env.setdefault("OMP_NUM_THREADS", str(limits.kernel_threads))
        # Drawn once per run: the hidden tests' inputs (course_lib.exercises.checks.hidden_seed); only the testers see it.
        self.env[SECRET_VARIABLE] = str(secrets.randbits(31))

    def run(self, job: _Job) -> tuple[_Job, Grade, float]:
        """Grade ``job`` in its scratch course directory; return it with its grade, and the seconds it took."""
        start = time.monotonic()
        try:
            grade = self._grade(job)
        except Exception as exc:  # whatever goes wrong with one submission must not stop the others
            message = f"{type(exc).__name__}: {exc}"
            grade = Grade(job.sub.student_id, job.sub.chapter, 0, self.max_scores[job.sub.chapter], Status.ERROR, message)
        return job, grade, time.monotonic() - start

    def _grade(self, job: _Job) -> Grade:
        """Check the staged notebook in a child, add the gradebook, run the worker, read its result."""
        sub, work = job.sub, job.folder(self.scratch)
        fail = Grade(sub.student_id, sub.chapter, 0, self.max_scores[sub.chapter], Status.INVALID_NOTEBOOK)
        problem = check_notebook(work / "submitted" / job.internal / sub.chapter / f"{sub.chapter}.ipynb", self.env)
        if problem:
            fail.message = problem
            return fail
        fail.status = Status.ERROR
        shutil.copyfile(self.template_db, work / "gradebook.db")
        result_file, log_file = work / "result.json", work / "worker.log"
        args = WorkerArgs(work, self.course.solutions, sub.chapter, job.internal, self.cell_timeout, result_file,
                          self.limits.disk_bytes, self.limits.sandbox, self.limits.kernel_address_space)
        command = [sys.executable, "-m", "autograder.worker", *args.argv()]
        if self.limits.private_ipc:
            (work / "ipc").mkdir()
            command = in_private_tmpfs(work / "ipc", IPC_BYTES, command)
        timed_out, returncode = self._run_worker(command, work, log_file)
        if timed_out:
            fail.status, fail.message = Status.TIMEOUT, f"grading took longer than {self.timeout:g} s and was stopped"
            return fail
        try:
            result = WorkerResult.from_json(read_regular(result_file, MAX_RESULT_BYTES))
        except FileNotFoundError:
            log = read_regular(log_file, MAX_LOG_TAIL_BYTES, tail=True).decode("utf-8", "replace")
            fail.message = f"grader exited with status {returncode}: {last_relevant_line(log)}"
            return fail
        except ContractError as exc:
            fail.message = f"the grader's worker wrote an unreadable result: {exc}"
            return fail
        grade = Grade.from_result(result, sub.student_id, sub.chapter, self.max_scores[sub.chapter])
        if grade.status is Status.OK:
            grade.message = "; ".join(filter(None, [grade.message, self._keep_feedback(work, job)]))
        return grade

    def _run_worker(self, command: list[str], work: Path, log_file: Path) -> tuple[bool, int]:
        """Run the worker with the time limit; return whether it was stopped for taking too long, and its exit status."""
        with open(log_file, "wb") as log:
            env = {**self.env, MARKER_VARIABLE: f"{os.getpid()}-{work.name}"}
            cgroup = Cgroup(f"autograder-{env[MARKER_VARIABLE]}", self.limits.max_processes, self.limits.cgroup_memory)
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
                cgroup.kill_and_remove()
                _kill_all(proc.pid, env[MARKER_VARIABLE])
            return timed_out, proc.wait()

    def _keep_feedback(self, work: Path, job: _Job) -> str:
        """Copy the feedback HTML to ``OUT/feedback/<student_id>/<chapter>.html`` (a regular file, size-checked).

        Returns "" when it was kept; otherwise a note for the grade's message, and an older page
        there is removed (it would show another run's results). The score stands either way.
        """
        chapter = job.sub.chapter
        html = work / "feedback" / job.internal / chapter / f"{chapter}.html"
        target = self.out_dir / "feedback" / job.sub.student_id / f"{chapter}.html"
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            copy_regular(html, target, MAX_FEEDBACK_BYTES)
        except FileNotFoundError:
            target.unlink(missing_ok=True)
            return ""  # the worker made none and its note says why
        except RefusedFile as exc:
            target.unlink(missing_ok=True)
            return f"no feedback page kept: {exc}"
        return ""


def _kill_all(pid: int, marker: str) -> None:
    """Kill the worker ``pid``, its descendants and any process that still carries its ``marker`` in the environment.

    The submission's cgroup covers every process it started, wherever the machine has one; this
    covers the rest: a Jupyter kernel starts in a session of its own, and what it starts may
    outlive it, so neither the process group nor the session of the worker covers them all.
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
            line += f" {_number(grade.score)}/{_number(grade.max_score)}" if grade.status is Status.OK else f" ({grade.message})"
            line += (f" in {seconds:.1f} s" if seconds else "") + (" (from an earlier run)" if resumed else "")
            self.report(shown(line))

    def summary(self, grades: Sequence[Grade], out_dir: Path) -> None:
        """Report the counts per status and where the results are."""
        counts = Counter(str(g.status) for g in grades)
        parts = ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: (kv[0] != Status.OK, kv[0])))
        self.report(f"graded {len(grades)} submission(s) in {time.monotonic() - self.start:.1f} s: {parts or 'nothing'}")
        self.report(f"wrote {out_dir / 'grades.csv'}, {out_dir / 'grades_detail.csv'} and {out_dir / 'feedback'}/")
