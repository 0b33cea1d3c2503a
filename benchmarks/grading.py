"""Grading throughput: ``python -m benchmarks.grading [--submissions N] [--jobs J] [--chapter C]``.

Makes N copies of a chapter's solution notebook as N students' submissions, grades them with
``grade --jobs J`` in the sandbox, and prints the wall time, the submissions per minute and the
seconds per submission. The figure in INSTRUCTORS.md comes from this script.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from autograder.contracts import Status
from autograder.course import Course, default_course_root
from autograder.grade import grade_submissions

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit 0 when every copy was graded with full marks."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grading", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--submissions", type=int, default=100, metavar="N")
    parser.add_argument("--jobs", type=int, default=2, metavar="J")
    parser.add_argument("--chapter", default="01_floating_point", metavar="C")
    parser.add_argument("--no-sandbox", action="store_true", help="measure without bubblewrap")
    args = parser.parse_args(argv)
    course = Course(default_course_root())
    with tempfile.TemporaryDirectory(prefix="autograder-bench-") as scratch:
        subs, out = Path(scratch) / "submissions", Path(scratch) / "out"
        for i in range(args.submissions):
            folder = subs / f"student_{i:03d}" / args.chapter
            folder.mkdir(parents=True)
            shutil.copyfile(course.source_notebook(args.chapter), folder / f"{args.chapter}.ipynb")
        start = time.monotonic()
        grades = grade_submissions(course, subs, out, jobs=args.jobs, sandbox=not args.no_sandbox,
                                   report=lambda line: None)
        seconds = time.monotonic() - start
    full = sum(g.status is Status.OK and g.score == g.max_score for g in grades)
    print(f"{args.submissions} submissions of {args.chapter}, --jobs {args.jobs}, "
          f"{'no sandbox' if args.no_sandbox else 'sandbox'}, {os.cpu_count()} CPUs ({platform.processor() or 'cpu'}): "
          f"{seconds:.0f} s wall, {60 * args.submissions / seconds:.1f} submissions/min, "
          f"{seconds / args.submissions:.1f} s per submission; {full}/{len(grades)} full marks")
    return 0 if full == len(grades) else 1


if __name__ == "__main__":
    raise SystemExit(main())
