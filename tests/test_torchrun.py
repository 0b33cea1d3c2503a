"""Torchrun support: ``run_entry`` says which rank failed and why; ``run_as_script`` leaves nothing holding the group."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

from benchmarks.checks import CHAPTERS
from course_lib.support import dist, torchrun

ROOT = Path(__file__).resolve().parents[1]

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
        torchrun.run_entry("benchmarks.checks.hybrid", 2, "--no-such-option")


def test_run_as_script_frees_reference_cycles_before_it_destroys_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    # A DDP module and its reducer form a cycle that holds the process group; left for the interpreter's
    # exit, the group's teardown aborted ranks. The cycle must be gone when the group is destroyed.
    class Node:
        pass

    seen: dict[str, object] = {}

    def fn() -> int:
        node = Node()
        node.self = node  # type: ignore[attr-defined]
        seen["node"] = weakref.ref(node)
        return 7

    monkeypatch.setattr(torchrun, "init_from_torchrun", lambda timeout: (0, 1))
    monkeypatch.setattr(dist.dist, "destroy_process_group", lambda: seen.setdefault("alive", seen["node"]() is not None))
    gc.disable()  # only the collection run_as_script asks for may free the cycle
    try:
        assert torchrun.run_as_script(fn) == 7
    finally:
        gc.enable()
    assert seen["alive"] is False


def test_torchrun_command_for_one_node_and_for_a_rendezvous_of_several() -> None:
    assert torchrun.torchrun_command(4) == ["--standalone", "--nproc_per_node", "4"]
    assert torchrun.torchrun_command(2, 2, "127.0.0.1:29500", "job") == [
        "--nnodes", "2", "--nproc_per_node", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:29500",
        "--rdzv_id", "job", "--local_addr", "127.0.0.1"]
    with pytest.raises(ValueError, match="rendezvous endpoint"):
        torchrun.torchrun_command(2, 2)


def test_agents_on_one_host_never_share_a_gpu() -> None:
    assert torchrun.agent_devices(1, 4, 0) == [None]
    assert torchrun.agent_devices(2, 2, 4) == ["0,1", "2,3"]
    assert torchrun.agent_devices(2, 2, 8) == ["0,1", "2,3"]
    assert torchrun.agent_devices(2, 1, 1) == ["", ""]  # one GPU, two agents: both on the CPU
    assert torchrun.agent_devices(2, 2, 3) == ["", ""]


def test_a_failed_two_node_run_names_the_rank() -> None:
    with pytest.raises(RuntimeError, match=r"--nnodes 2 .*exit status [1-9].*\nrank \d failed first \(exit code 2\)"):
        torchrun.run_entry("benchmarks.checks.hybrid", 1, "--no-such-option", nnodes=2)


def test_two_nodes_keep_each_tensor_parallel_group_inside_a_node() -> None:
    run = torchrun.run_entry("benchmarks.checks.hybrid", 2, "--small", nnodes=2)
    assert run.result["world_size"] == 4 and run.checks == ["mesh_dp2xtp2", "dp2xtp2_vs_single_process"], run.stdout
    assert run.result["layouts"]["dp2xtp2"]["tp_group_nodes"] == [[0, 0], [1, 1]]


def test_every_distributed_chapter_passes_as_a_two_node_job() -> None:
    """`make multi-node`: each chapter's self-check as 2 torchrun agents x 1 rank meeting at a c10d rendezvous."""
    command = [sys.executable, "-m", "benchmarks.checks", "--nnodes", "2", "--nproc-per-node", "1", "--small"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == f"{len(CHAPTERS)} of {len(CHAPTERS)} chapters passed", done.stdout
