"""``run_entry`` says which rank failed and why, not only the last lines of a torchrun run."""

from __future__ import annotations

import pytest

from course_lib.support import torchrun

# What ``torchrun --tee 3`` printed when rank 1 raised and rank 0 was then stopped (torch 2.13, abridged).
FAILED_RUN = """\
[default0]:CHECK ring ok max_abs_err=0
[default1]:Traceback (most recent call last):
[default1]:  File "entry.py", line 5, in <module>
[default1]:    raise ValueError("rank one broke")
[default1]:ValueError: rank one broke
[default0]:terminate called without an active exception
Traceback (most recent call last):
  File ".venv/bin/torchrun", line 8, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
entry.py FAILED
------------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 20072)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_08:08:23
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 20073)
============================================================
"""


def test_rank_lines_split_the_output_by_rank() -> None:
    lines = torchrun.rank_lines(FAILED_RUN)
    assert lines[0] == ["CHECK ring ok max_abs_err=0", "terminate called without an active exception"]
    assert lines[1][-1] == "ValueError: rank one broke"


def test_a_failure_names_the_first_rank_and_each_rank_first_error() -> None:
    text = torchrun.explain_failure(FAILED_RUN)
    assert text == ("rank 1 failed first (exit code 1); rank 0's first error: terminate called without an active "
                    "exception; rank 1's first error: ValueError: rank one broke")
    aborted = FAILED_RUN.replace("exitcode  : 1 (pid: 20073)", "exitcode  : -6 (pid: 20073)")
    assert torchrun.explain_failure(aborted).startswith("rank 1 failed first (killed by signal SIGABRT)")
    assert torchrun.explain_failure("nothing useful") == "no rank printed an error line"


def test_run_entry_reports_a_failed_run_by_rank() -> None:
    with pytest.raises(RuntimeError, match=r"exit status [1-9].*\nrank \d failed first \(exit code 2\)"):
        torchrun.run_entry("benchmarks.checks.hybrid", 2, "--no-such-option", timeout=120)
