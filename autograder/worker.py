"""Grade one submission in a child process: nbgrader autograde, then feedback; the result goes to a JSON file.

Started by ``autograder.grade`` in a scratch course directory that holds a copy of the
chapter's gradebook and ``submitted/<student>/<chapter>/<chapter>.ipynb``; the parent
enforces the time limit by killing this process and everything it started. The kernel runs
through a kernelspec written here, in bubblewrap (``autograder.sandbox``); nbgrader's Execute step is
``autograder.execute.TrustedExecute``, which runs each test cell in the trusted tester
(``autograder.tester``) while the kernel answers its calls.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from pathlib import Path

from traitlets.config import Config

from .config import SECRET_VARIABLE, nbgrader_config
from .course import is_test_cell, read_notebook
from .kernel import CONFIG_VARIABLE
from .logs import failure_reason
from .sandbox import KERNEL_NAME, KernelSandbox, kernel_environment

__all__ = ["failed_tests", "main", "trusted_config"]


def trusted_config(scratch: Path, source_dir: Path, chapter: str, student: str, *, sandboxed: bool,
                   memory_bytes: int | None, cell_timeout: int) -> Config:
    """Settings that run the submission's kernel in the sandbox and its test cells in the tester."""
    from nbgrader.converters import Autograde
    from nbgrader.preprocessors import Execute

    from .execute import TrustedExecute

    ipc_dir, jupyter_dir = scratch / "ipc", scratch / "jupyter"
    ipc_dir.mkdir(exist_ok=True)
    settings = ipc_dir / f"kernel-{secrets.token_hex(8)}.json"
    settings.write_text(json.dumps({"memory_bytes": memory_bytes}), encoding="utf-8")
    env = {**kernel_environment(dict(os.environ)), CONFIG_VARIABLE: str(settings)}
    notebook_dir = scratch / "autograded" / student / chapter
    KernelSandbox(notebook_dir, ipc_dir, env, sandboxed).write_kernelspec(jupyter_dir)
    # The sandbox kernelspec comes first; folders already on JUPYTER_PATH (nbconvert's templates, for one) stay.
    jupyter_path = os.pathsep.join(filter(None, [str(jupyter_dir), os.environ.get("JUPYTER_PATH")]))
    os.environ.update(JUPYTER_PATH=jupyter_path, JUPYTER_RUNTIME_DIR=str(ipc_dir))
    c = Config()
    steps = Autograde.class_traits()["autograde_preprocessors"].default()
    c.Autograde.autograde_preprocessors = [TrustedExecute if step is Execute else step for step in steps]
    c.TrustedExecute.kernel_name = KERNEL_NAME
    c.TrustedExecute.source_notebook = str(source_dir / chapter / f"{chapter}.ipynb")
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


def grade_submission(scratch: Path, source_dir: Path, chapter: str, student: str, cell_timeout: int, *,
                     sandboxed: bool = True, memory_bytes: int | None = None) -> dict:
    """Autograde and make feedback for one submission in ``scratch``; return status, scores and per-cell grades."""
    from nbgrader.api import Gradebook
    from nbgrader.apps import NbGraderAPI

    db_path = scratch / "gradebook.db"
    config = nbgrader_config(
        scratch,
        db_path=db_path,
        source_directory=str(source_dir),
        release_directory=str(scratch / "release"),
        cell_timeout=cell_timeout,
    )
    config.merge(trusted_config(scratch, source_dir, chapter, student, sandboxed=sandboxed,
                                memory_bytes=memory_bytes, cell_timeout=cell_timeout))
    api = NbGraderAPI(config=config)
    for step, run in (("autograde", api.autograde), ("generate_feedback", api.generate_feedback)):
        result = run(chapter, student)
        if not result["success"]:
            reason = failure_reason(result)
            status = "timeout" if "CellTimeoutError" in reason else "error"
            return {"status": status, "message": f"{step} failed: {reason}"}
    with Gradebook(config.CourseDirectory.db_url) as gb:
        submission = gb.find_submission(chapter, student)
        notebook = gb.find_submission_notebook(chapter, chapter, student)
        cells = [[g.name, g.score, g.max_score] for g in notebook.grades]
        manual = sorted(g.name for g in notebook.grades if g.needs_manual_grade)
        failed = failed_tests(scratch / "autograded" / student / chapter / f"{chapter}.ipynb")
        notes = [f"needs manual grading: {', '.join(manual)}"] * bool(manual) + [f"failed: {failed}"] * bool(failed)
        return {
            "status": "ok",
            "score": submission.score,
            "max_score": submission.max_score,
            "cells": cells,
            "message": "; ".join(notes),
        }


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
    parser = argparse.ArgumentParser(prog="python -m autograder.worker", description=__doc__)
    parser.add_argument("--scratch", type=Path, required=True, help="scratch course directory of this submission")
    parser.add_argument("--source", type=Path, required=True, help="the course's solutions/ folder")
    parser.add_argument("--chapter", required=True)
    parser.add_argument("--student", required=True)
    parser.add_argument("--cell-timeout", type=int, required=True)
    parser.add_argument("--result", type=Path, required=True, help="JSON file to write the result to")
    parser.add_argument("--no-sandbox", action="store_true", help="run the kernel without bubblewrap")
    parser.add_argument("--memory-bytes", type=int, default=None, help="RLIMIT_AS of the kernel (CPU grading)")
    args = parser.parse_args(argv)
    result = grade_submission(args.scratch, args.source, args.chapter, args.student, args.cell_timeout,
                              sandboxed=not args.no_sandbox, memory_bytes=args.memory_bytes)
    args.result.write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
