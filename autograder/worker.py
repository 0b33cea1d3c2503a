"""Grade one submission in a child process: nbgrader autograde, then feedback; the result goes to a JSON file.

Its command line is ``autograder.contracts.WorkerArgs``, its result file ``WorkerResult``. Started
by ``autograder.grade`` in a scratch course directory that holds a copy of the
chapter's gradebook and ``submitted/<student>/<chapter>/<chapter>.ipynb``; the parent
enforces the time limit by killing this process and everything it started. The kernel runs
through a kernelspec written here, in bubblewrap (``autograder.sandbox``); nbgrader's Execute step is
``autograder.execute.TrustedExecute``, which runs each test cell in the trusted tester
(``autograder.tester``) while the kernel answers its calls.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from nbgrader.api import Gradebook
from nbgrader.apps import NbGraderAPI
from nbgrader.converters import Autograde
from nbgrader.preprocessors import Execute
from traitlets.config import Config

from .config import SECRET_VARIABLE, nbgrader_config
from .contracts import KERNEL_SETTINGS_VARIABLE, KernelSettings, Status, WorkerArgs, WorkerResult
from .course import is_test_cell, read_notebook
from .execute import TrustedExecute
from .logs import failure_reason
from .sandbox import KERNEL_NAME, KernelSandbox, kernel_environment

__all__ = ["failed_tests", "grade_submission", "main", "run_steps", "trusted_config"]


def trusted_config(args: WorkerArgs) -> Config:
    """Settings that run the submission's kernel in the sandbox and its test cells in the tester."""
    scratch, chapter, cell_timeout = args.scratch, args.chapter, args.cell_timeout
    ipc_dir, jupyter_dir = scratch / "ipc", scratch / "jupyter"
    ipc_dir.mkdir(exist_ok=True)
    settings = ipc_dir / f"kernel-{secrets.token_hex(8)}.json"
    KernelSettings(args.memory_bytes).write(settings)
    env = {**kernel_environment(dict(os.environ)), KERNEL_SETTINGS_VARIABLE: str(settings)}
    notebook_dir = scratch / "autograded" / args.student / chapter
    KernelSandbox(notebook_dir, ipc_dir, env, args.sandboxed, args.disk_bytes).write_kernelspec(jupyter_dir)
    # The sandbox kernelspec comes first; folders already on JUPYTER_PATH (nbconvert's templates, for one) stay.
    jupyter_path = os.pathsep.join(filter(None, [str(jupyter_dir), os.environ.get("JUPYTER_PATH")]))
    os.environ.update(JUPYTER_PATH=jupyter_path, JUPYTER_RUNTIME_DIR=str(ipc_dir))
    c = Config()
    steps = Autograde.class_traits()["autograde_preprocessors"].default()
    c.Autograde.autograde_preprocessors = [TrustedExecute if step is Execute else step for step in steps]
    c.TrustedExecute.kernel_name = KERNEL_NAME
    c.TrustedExecute.source_notebook = str(args.source / chapter / f"{chapter}.ipynb")
    c.TrustedExecute.tester_socket = str(ipc_dir / "tester.sock")
    c.TrustedExecute.tester_timeout = float(cell_timeout)
    # The run's secret goes to the tester alone: it leaves this process's environment, which a kernel
    # started without the sandbox would inherit.
    secret = os.environ.pop(SECRET_VARIABLE, None)
    c.TrustedExecute.tester_env = {**os.environ, **({SECRET_VARIABLE: secret} if secret else {})}
    c.KernelManager.transport = "ipc"
    c.KernelManager.ip = str(ipc_dir / "kernel")
    c.KernelManager.connection_file = str(ipc_dir / "connection.json")
    return c


def grade_submission(args: WorkerArgs) -> WorkerResult:
    """Autograde and make feedback for one submission in its scratch folder; return status, scores and per-cell grades."""
    scratch, chapter, student = args.scratch, args.chapter, args.student
    config = nbgrader_config(
        scratch,
        db_path=scratch / "gradebook.db",
        source_directory=str(args.source),
        release_directory=str(scratch / "release"),
        cell_timeout=args.cell_timeout,
    )
    config.merge(trusted_config(args))
    failure, feedback_note = run_steps(NbGraderAPI(config=config), chapter, student)
    if failure is not None:
        return failure
    with Gradebook(config.CourseDirectory.db_url) as gb:
        submission = gb.find_submission(chapter, student)
        notebook = gb.find_submission_notebook(chapter, chapter, student)
        cells = [(g.name, float(g.score), float(g.max_score)) for g in notebook.grades]
        manual = sorted(g.name for g in notebook.grades if g.needs_manual_grade)
        failed = failed_tests(scratch / "autograded" / student / chapter / f"{chapter}.ipynb")
        notes = [f"needs manual grading: {', '.join(manual)}"] * bool(manual) + [f"failed: {failed}"] * bool(failed)
        notes += [feedback_note] * bool(feedback_note)
        return WorkerResult(Status.OK, "; ".join(notes), float(submission.score), float(submission.max_score), cells)


def run_steps(api: NbGraderAPI, chapter: str, student: str) -> tuple[WorkerResult | None, str]:
    """Autograde, then make the feedback page: (the failed result, or None once scores exist; a note if only feedback failed).

    The scores are in the gradebook as soon as autograde succeeds: a feedback page that cannot be
    made (a missing package on the grading host, a page the exporter chokes on) is noted beside
    them, never allowed to turn a graded submission into an error worth 0.
    """
    result = api.autograde(chapter, student)
    if not result["success"]:
        reason = failure_reason(result)
        status = Status.TIMEOUT if "CellTimeoutError" in reason else Status.ERROR
        return WorkerResult(status, f"autograde failed: {reason}"), ""
    result = api.generate_feedback(chapter, student)
    if not result["success"]:
        return None, f"no feedback page (generate_feedback failed: {failure_reason(result)})"
    return None, ""


def failed_tests(autograded: Path) -> str:
    """``grade_id (Error: message)`` of every failing test cell of a graded notebook, messages whole (grades.csv)."""
    failed = []
    for cell in read_notebook(autograded).cells if autograded.is_file() else []:
        errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
        if is_test_cell(cell) and errors:
            failed.append(f"{cell.metadata.nbgrader['grade_id']} ({errors[0].ename}: {errors[0].evalue})")
    return ", ".join(failed)


def main(argv: list[str] | None = None) -> int:
    """Command line of the child process (not meant to be run by hand)."""
    args = WorkerArgs.parse(argv)
    args.result.write_text(grade_submission(args).to_json(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
