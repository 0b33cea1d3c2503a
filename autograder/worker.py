"""Grade one submission in a child process: nbgrader autograde, then feedback; the result goes to a JSON file.

Started by ``autograder.grade`` in a scratch course directory that holds a copy of the
chapter's gradebook and ``submitted/<student>/<chapter>/<chapter>.ipynb``; the parent
enforces the time limit by killing this process and everything it started.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .config import nbgrader_config
from .logs import failure_reason


def grade_submission(scratch: Path, source_dir: Path, chapter: str, student: str, cell_timeout: int) -> dict:
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
    api = NbGraderAPI(config=config)
    for step, run in (("autograde", api.autograde), ("generate_feedback", api.generate_feedback)):
        result = run(chapter, student)
        if not result["success"]:
            return {"status": "error", "message": f"{step} failed: {failure_reason(result)}"}
    with Gradebook(config.CourseDirectory.db_url) as gb:
        submission = gb.find_submission(chapter, student)
        notebook = gb.find_submission_notebook(chapter, chapter, student)
        cells = [[g.name, g.score, g.max_score] for g in notebook.grades]
        manual = sorted(g.name for g in notebook.grades if g.needs_manual_grade)
        return {
            "status": "ok",
            "score": submission.score,
            "max_score": submission.max_score,
            "cells": cells,
            "message": f"needs manual grading: {', '.join(manual)}" if manual else "",
        }


def main(argv: list[str] | None = None) -> int:
    """Command line of the child process (not meant to be run by hand)."""
    parser = argparse.ArgumentParser(prog="python -m autograder.worker", description=__doc__)
    parser.add_argument("--scratch", type=Path, required=True, help="scratch course directory of this submission")
    parser.add_argument("--source", type=Path, required=True, help="the course's solutions/ folder")
    parser.add_argument("--chapter", required=True)
    parser.add_argument("--student", required=True)
    parser.add_argument("--cell-timeout", type=int, required=True)
    parser.add_argument("--result", type=Path, required=True, help="JSON file to write the result to")
    args = parser.parse_args(argv)
    result = grade_submission(args.scratch, args.source, args.chapter, args.student, args.cell_timeout)
    args.result.write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
