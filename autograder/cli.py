"""The command line: ``python -m autograder release | grade | validate``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import DEFAULT_CELL_TIMEOUT, DEFAULT_SUBMISSION_TIMEOUT
from .contracts import positive_float, positive_int
from .course import Course, UnknownChapterError, default_course_root
from .limits import DEFAULT_DISK_BYTES, DEFAULT_MAX_PROCESSES, DEFAULT_MEMORY_BYTES, Limits

__all__ = ["build_parser", "main"]

RELEASE_HELP = """\
Generate the student notebooks notebooks/NN_name/NN_name.ipynb from the instructor
notebooks solutions/NN_name/NN_name.ipynb with nbgrader generate_assignment: solutions
become `raise NotImplementedError()`, hidden tests are removed, outputs are cleared.
Only files whose bytes change are written, so a second run changes nothing. Releasing
every chapter also removes released chapter folders whose source is gone.

exit status: 0 released; 1 nbgrader failed (nothing was written); 2 usage error
(for example an unknown chapter)."""

GRADE_HELP = """\
Grade every SUBMISSIONS/<student_id>/<chapter>/<chapter>.ipynb with nbgrader autograde,
each in its own scratch course directory outside the repository, several at a time.
The tests that run are the instructor's from solutions/, hidden tests included, even
when a student edited or deleted a test cell.

writes:
  OUT/grades.csv         student_id,chapter,score,max_score,status,message
                         (a row per student and chapter folder, sorted)
  OUT/grades_detail.csv  student_id,chapter,grade_id,score,max_score (a row per graded cell)
  OUT/export.csv         student_id,<one column per chapter>,total,max_total (a row per
                         student: for a spreadsheet or an LMS import)
  OUT/feedback/<student_id>/<chapter>.html
  OUT/.done/             the finished grades, for resuming
A text cell that a spreadsheet would run as a formula (it starts with = + - @, a tab or
a CR) is written with a quote first: a student id "=SUM(A1)" appears as "'=SUM(A1)".

status: ok (graded, whatever the score); unknown_chapter (no such chapter in
solutions/); missing_notebook (no <chapter>.ipynb in the folder; the message lists what
is there); invalid_notebook (empty, over 20 MB, or not a readable nbformat 4 notebook);
invalid_submission (the notebook, the chapter folder or the student folder is a symbolic
link or not a plain file or folder: never followed or read); invalid_id (the student
folder's name is not printable UTF-8, starts with a dot, or starts or ends with a space:
rename it; no row in export.csv); timeout (stopped after --timeout seconds); error
(autograde failed, e.g. the kernel died; the message has the last log line). A
submission that is not ok scores 0 and gets no feedback file. The message of an ok row
names the first failing tests, and says so when its feedback page could not be made or
kept (the score stands). Every submission gets exactly one row.

sandbox: each kernel runs under bubblewrap (no network, no view of solutions/, of other
submissions or of OUT; its working folder and /tmp are private in-memory folders of
--disk-gb each that vanish with it, and the folder of its IPC sockets a small private
tmpfs) with a cgroup per submission: a process limit (pids), one CPU share for all its
processes (cpu) and, on a GPU machine, a memory limit; on a CPU the memory limit is
RLIMIT_AS. Test cells are run and scored by a tester that student code cannot reach
(see INSTRUCTORS.md). Feedback shows the submission's outputs and markdown as text: no
HTML or script of a submission is live in it. A limit this machine cannot enforce (no
writable cgroup controller, a bwrap without --size, no right to mount) is said once,
as a "warning:" line, before grading starts. Without bwrap, grade refuses (exit 2)
unless --no-sandbox is given.

resume: each finished submission is recorded in OUT/.done/; a rerun into the same OUT
skips what is recorded (same notebook bytes, same source) unless --force. A record that
is damaged is ignored and that submission graded again.

exit status: 0 every submission graded (status ok); 1 at least one submission not ok;
2 usage error (SUBMISSIONS missing or holding no submission, unknown --chapter)."""

VALIDATE_HELP = """\
Check a notebook as it is saved on disk (save it in JupyterLab first): run it top to
bottom in a fresh kernel (working directory: the notebook's folder), then score each
test cell as nbgrader does. A test cell fails when it raises or when it writes to stderr
(nbgrader scores stderr output as a failure, after dropping known-harmless library
warnings). Prints the failing grade_ids with their error, the other cells that raised,
the exercises for which later cells used the course's reference, and how many visible
tests passed. A student notebook holds only the visible tests: the grader adds hidden
ones, so the grade can be lower.

exit status: 0 all tests passed; 1 a test failed or the notebook could not be run;
2 usage error."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m autograder``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--course-root", type=Path, default=None, metavar="DIR",
        help="course root holding solutions/ and notebooks/ (default: the project root)",
    )
    parser = argparse.ArgumentParser(
        prog="python -m autograder",
        description="Release, grade and validate the course's nbgrader notebooks.",
        epilog="Run `python -m autograder COMMAND --help` for a command's options and exit status.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    fmt = argparse.RawDescriptionHelpFormatter

    release = commands.add_parser("release", parents=[common], formatter_class=fmt, description=RELEASE_HELP,
                                  help="generate notebooks/ from solutions/")
    release.add_argument("chapters", nargs="*", metavar="CHAPTER", help="chapter folder names (default: every chapter)")
    release.add_argument("--out", type=Path, default=None, metavar="DIR", help="release into DIR instead of notebooks/")
    release.set_defaults(handler=_release, parser=release)

    grade = commands.add_parser("grade", parents=[common], formatter_class=fmt, description=GRADE_HELP,
                                help="grade a folder of submissions")
    grade.add_argument("submissions", type=Path, metavar="SUBMISSIONS",
                       help="folder of <student_id>/<chapter>/<chapter>.ipynb")
    grade.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder for the grade tables and feedback")
    grade.add_argument("--chapter", default=None, metavar="C", help="grade only chapter C")
    grade.add_argument("--jobs", type=positive_int, default=None, metavar="N",
                       help="submissions graded at once (default: number of CPUs)")
    grade.add_argument("--timeout", type=positive_float, default=DEFAULT_SUBMISSION_TIMEOUT, metavar="SECONDS",
                       help="time limit per submission; it is killed after (default: %(default)s)")
    grade.add_argument("--cell-timeout", type=positive_int, default=DEFAULT_CELL_TIMEOUT, metavar="SECONDS",
                       help="time limit per cell; the cell is interrupted and scores 0 (default: %(default)s)")
    grade.add_argument("--no-sandbox", action="store_true",
                       help="run kernels without bubblewrap (only for trusted notebooks; tests still run in the tester)")
    grade.add_argument("--force", action="store_true",
                       help="regrade every submission, also those an earlier run into --out already graded")
    grade.add_argument("--max-processes", type=positive_int, default=DEFAULT_MAX_PROCESSES, metavar="N",
                       help="processes and threads per submission, where a pids cgroup is available (default: %(default)s)")
    grade.add_argument("--memory-gb", type=positive_float, default=DEFAULT_MEMORY_BYTES / 2**30, metavar="GB",
                       help="memory per kernel process: RLIMIT_AS on a CPU, a memory cgroup on a GPU machine "
                            "(default: %(default)s)")
    grade.add_argument("--disk-gb", type=positive_float, default=DEFAULT_DISK_BYTES / 2**30, metavar="GB",
                       help="size of a kernel's /tmp and of its working folder, each: in memory, gone after the "
                            "submission (default: %(default)s)")
    grade.set_defaults(handler=_grade, parser=grade)

    validate = commands.add_parser("validate", parents=[common], formatter_class=fmt, description=VALIDATE_HELP,
                                   help="run a notebook's tests the way the grader will")
    validate.add_argument("notebook", type=Path, metavar="NOTEBOOK", help="the notebook to check")
    validate.add_argument("--cell-timeout", type=positive_int, default=DEFAULT_CELL_TIMEOUT, metavar="SECONDS",
                          help="time limit per cell (default: %(default)s)")
    validate.set_defaults(handler=_validate, parser=validate)

    return parser


# Each command imports what it runs when it runs: nbgrader takes seconds to import, and ``--help``
# or a usage error should not wait for it.
def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit status (argparse exits with 2 on a usage error)."""
    args = build_parser().parse_args(argv)
    course = Course((args.course_root or default_course_root()).resolve())
    return args.handler(args, course)


def _release(args: argparse.Namespace, course: Course) -> int:
    """``release``: generate the chapters, then report each file written."""
    from .release import ReleaseError, release

    try:
        changes = release(course, args.chapters, args.out)
    except UnknownChapterError as exc:
        args.parser.error(str(exc))
    except ReleaseError as exc:
        print(f"error: {exc}\nnothing was written.", file=sys.stderr)
        return 1
    for line in changes:
        print(line)
    print(f"released {', '.join(course.resolve(args.chapters)) or 'no chapters'}: {len(changes)} file(s) changed")
    return 0


def _grade(args: argparse.Namespace, course: Course) -> int:
    """``grade``: check the arguments, then grade every submission."""
    from .grade import find_submissions, grade_submissions
    from .sandbox import SandboxUnavailable, check_available

    if not args.submissions.is_dir():
        args.parser.error(f"SUBMISSIONS folder not found: {args.submissions}")
    if args.chapter is not None:
        try:
            course.resolve([args.chapter])
        except UnknownChapterError as exc:
            args.parser.error(str(exc))
    if not find_submissions(args.submissions, args.chapter):
        args.parser.error(f"no submissions in {args.submissions} (expected <student_id>/<chapter>/<chapter>.ipynb)")
    if not args.no_sandbox:
        try:
            check_available()
        except SandboxUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    grades = grade_submissions(
        course, args.submissions, args.out, chapter=args.chapter, jobs=args.jobs,
        timeout=args.timeout, cell_timeout=args.cell_timeout, sandbox=not args.no_sandbox, force=args.force,
        limits=Limits(max_processes=args.max_processes, memory_bytes=int(args.memory_gb * 2**30),
                      disk_bytes=int(args.disk_gb * 2**30)),
    )
    return 0 if all(g.status == "ok" for g in grades) else 1


def _validate(args: argparse.Namespace, course: Course) -> int:
    """``validate``: run the notebook and report what it showed."""
    from .validate import run_notebook, saved_note, summarise

    if not args.notebook.is_file():
        args.parser.error(f"notebook not found: {args.notebook}")
    print(saved_note(args.notebook), flush=True)
    print("running it top to bottom in a fresh kernel ...", flush=True)
    try:
        result = run_notebook(args.notebook, course.root, args.cell_timeout)
    except Exception as exc:  # the kernel died or could not start: report it, do not crash
        print(f"error: could not run {args.notebook}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    report, passed = summarise(result)
    print(report)
    return 0 if passed else 1
