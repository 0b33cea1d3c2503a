"""Run a chapter's checks under ``torchrun`` on a multi-GPU host, and report them in one format.

A torchrun entry is a function ``check(small) -> dict`` that runs in every rank: it compares each
parallel algorithm with its single-process reference through ``report_check`` (rank 0 prints
``CHECK <name> ok max_abs_err=<x>``, the error maximised over the ranks) and returns what it
measured, which ``entry_main`` prints as ``RESULT <json>``. ``run_entry`` starts such an entry with
torchrun from a test or a benchmark and parses those lines. The entries live in ``benchmarks/checks``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.exercises.checks import assert_close
from course_lib.support.dist import _to_cpu, backend_for, free_then_destroy_group, rank_device

__all__ = [
    "NCCL_ENV_DEFAULTS",
    "EntryRun",
    "assert_matches_reference",
    "assert_same_across_ranks",
    "entry_main",
    "explain_failure",
    "init_from_torchrun",
    "max_abs_error",
    "rank_lines",
    "report_check",
    "report_result",
    "run_as_script",
    "run_entry",
    "agent_devices",
    "set_nccl_env_defaults",
    "torchrun_command",
]


def assert_same_across_ranks(tensor: torch.Tensor, name: str = "tensor", *, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Check that every rank holds the same ``tensor`` (exactly, by default); name the first rank that differs."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, tensor.detach().cpu())
    for rank in range(1, len(gathered)):
        try:
            assert_close(gathered[rank], gathered[0], rtol=rtol, atol=atol, name=name)
        except AssertionError as err:
            raise AssertionError(f"{name} differs between ranks: rank {rank} vs rank 0: {err}") from None


def _param_name(name: str) -> str:
    """A parameter's name without the prefixes that DDP (``module.``) and torch.compile (``_orig_mod.``) add."""
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


def assert_matches_reference(
    actual: torch.Tensor | Sequence[torch.Tensor] | nn.Module,
    expected: torch.Tensor | Sequence[torch.Tensor] | nn.Module,
    name: str = "result",
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Check a parallel result against a single-process reference.

    Either tensors, lists of tensors, or two modules (parameters and gradients by name).
    """
    if isinstance(expected, nn.Module):
        if not isinstance(actual, nn.Module):
            raise AssertionError(f"{name}: expected an nn.Module, got {type(actual).__name__}")
        got = {_param_name(n): p for n, p in actual.named_parameters()}
        want = {_param_name(n): p for n, p in expected.named_parameters()}
        if got.keys() != want.keys():
            raise AssertionError(
                f"{name}: parameter names differ; missing {sorted(want.keys() - got.keys())}, "
                f"unexpected {sorted(got.keys() - want.keys())}"
            )
        for pname, ref in want.items():
            assert_close(got[pname].detach().cpu(), ref.detach().cpu(), rtol=rtol, atol=atol, name=f"{name}.{pname}")
        for pname, ref in want.items():
            g, r = got[pname].grad, ref.grad
            if g is None and r is None:
                continue
            if g is None or r is None:
                which = "the result" if g is None else "the reference"
                raise AssertionError(f"{name}.{pname}.grad: missing in {which} (present in the other)")
            assert_close(g.cpu(), r.cpu(), rtol=rtol, atol=atol, name=f"{name}.{pname}.grad")
        return
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)):
            raise AssertionError(f"{name}: expected a list of {len(expected)} tensors, got {type(actual).__name__}")
        if len(actual) != len(expected):
            raise AssertionError(f"{name}: {len(actual)} tensors, expected {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(_to_cpu(a), _to_cpu(e), rtol=rtol, atol=atol, name=f"{name}[{i}]")
        return
    assert_close(_to_cpu(actual), _to_cpu(expected), rtol=rtol, atol=atol, name=name)


def init_from_torchrun(timeout: float = 300.0) -> tuple[int, int]:
    """Initialise the default group from torchrun's environment, set this rank's GPU; return (rank, world_size).

    A collective or send/recv that waits longer than ``timeout`` seconds fails (NCCL's watchdog
    names the operation) instead of hanging the job.
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_from_torchrun: {', '.join(missing)} not set; start this script with "
            "`torchrun --nproc_per_node N script.py`, or call launch(fn, N) from Python"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    # Only this host's ranks need a GPU each, so judge by the local count (all of them on one host).
    backend = backend_for(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    return rank, world_size


def run_as_script(fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> Any:
    """Under torchrun: initialise the group (``timeout`` as in ``init_from_torchrun``), run ``fn(*args)``, destroy the group.

    What ``fn`` left in reference cycles is freed before the group is destroyed (``free_then_destroy_group``).
    """
    init_from_torchrun(timeout)
    try:
        return fn(*args)
    finally:
        free_then_destroy_group()


# Variables torchrun sets for its workers: a torchrun started from inside one must not inherit them.
_TORCHRUN_VARS = {
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
}
_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class EntryRun:
    """What a chapter's torchrun entry printed: the names of its ``CHECK <name> ok ...`` lines and its ``RESULT``."""

    checks: list[str]
    result: dict[str, Any]
    stdout: str


def torchrun_command(nproc: int, nnodes: int = 1, rendezvous: str = "", run_id: str = "") -> list[str]:
    """The ``torchrun`` options that start ``nproc`` ranks per node on ``nnodes`` nodes (one agent per node).

    One node: ``--standalone`` (a private rendezvous on a free port). Several: every node's agent
    meets the others at the c10d rendezvous ``rendezvous`` (``host:port``, served by whichever agent
    gets there first) under ``run_id``; the agents give out node ranks in the order they join.
    """
    if nnodes == 1:
        return ["--standalone", "--nproc_per_node", str(nproc)]
    if not rendezvous or not run_id:
        raise ValueError("torchrun_command: several nodes need a rendezvous endpoint and a run id")
    host = rendezvous.rsplit(":", 1)[0]
    return ["--nnodes", str(nnodes), "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
            "--rdzv_endpoint", rendezvous, "--rdzv_id", run_id, "--local_addr", host]


def agent_devices(nnodes: int, nproc: int, n_gpus: int) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` for each of ``nnodes`` agents of ``nproc`` ranks on one host with ``n_gpus`` GPUs.

    One agent: None (the environment as it is). Several: disjoint slices of ``nproc`` GPUs when there
    are enough for every rank, else "" for all (no GPU: gloo ranks on the CPU), never a GPU shared
    by two agents (NCCL refuses two ranks on one GPU).
    """
    if nnodes == 1:
        return [None]
    if n_gpus >= nnodes * nproc:
        return [",".join(str(node * nproc + i) for i in range(nproc)) for node in range(nnodes)]
    return [""] * nnodes


def _free_port() -> int:
    """A TCP port nothing listens on at the moment (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_entry(module: str, nproc: int, *args: str, nnodes: int = 1, timeout: float = 600.0) -> EntryRun:
    """Run ``torchrun ... -m module *args`` from the project root with ``nproc`` ranks per node; parse what it printed.

    One node: ``torchrun --standalone`` (its own free port, so runs in parallel do not meet).
    ``nnodes`` > 1: that many torchrun agents on this host, each a "node", meeting at a c10d
    rendezvous on the loopback, as the nodes of a cluster do over the network (``torchrun_command``).
    The agents of one host must not share a GPU, as the nodes of a cluster do not: each gets its own
    ``nproc`` GPUs (``CUDA_VISIBLE_DEVICES``) when the host has enough for all, and none otherwise,
    so that its ranks use gloo on the CPU (``agent_devices``).
    ``--tee 3`` with a prefix template makes every line a rank prints start with ``[default<global rank>]:``.
    Raises RuntimeError when any node fails, times out or no RESULT is printed, saying which rank
    failed first, how, and its first error line (``explain_failure``), then the end of the output.
    """
    if nnodes < 1 or nproc < 1:
        raise ValueError(f"run_entry: need at least one node and one rank per node, got nnodes={nnodes}, nproc={nproc}")
    rendezvous, run_id = (f"127.0.0.1:{_free_port()}", f"{module}-{os.getpid()}-{_free_port()}") if nnodes > 1 else ("", "")
    options = torchrun_command(nproc, nnodes, rendezvous, run_id)
    command = [sys.executable, "-m", "torch.distributed.run", *options, "--tee", "3", "-m", module, *args]
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[default${rank}]:"  # the global rank, on every node
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    shown = f"torchrun {' '.join(options)} -m {module} {' '.join(args)}".rstrip()
    devices = agent_devices(nnodes, nproc, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    nodes = [subprocess.Popen(command, cwd=_ROOT, env=env if mine is None else {**env, "CUDA_VISIBLE_DEVICES": mine},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for mine in devices]
    outputs, codes, late = [], [], False
    for node in nodes:
        try:
            out, err = node.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            late = True
            for other in nodes:
                other.kill()
            out, err = node.communicate()
        outputs.append((out, err))
        codes.append(node.returncode)
    stdout = "".join(out for out, _ in outputs)
    output = "".join(out + err for out, err in outputs)
    if late:
        raise RuntimeError(f"{shown}: still running after {timeout:g} s\n{explain_failure(output)}")
    lines = rank_lines(stdout).get(0, [])
    results = [line.removeprefix("RESULT ") for line in lines if line.startswith("RESULT ")]
    failed = [code for code in codes if code != 0]
    if failed or not results:
        tail = "\n".join(output.splitlines()[-30:])
        status = failed[0] if failed else 0
        raise RuntimeError(f"{shown}: exit status {status}, {len(results)} RESULT line(s)\n"
                           f"{explain_failure(output)}\nlast output:\n{tail}")
    checks = [line.removeprefix("CHECK ").split(" ok max_abs_err=")[0] for line in lines
              if line.startswith("CHECK ") and " ok max_abs_err=" in line]
    return EntryRun(checks, json.loads(results[-1]), "\n".join(lines))


_RANK_PREFIX = re.compile(r"^\[default(\d+)\]:(.*)$")
# The first line of a failure in a rank's output: an exception, a C++ abort, a crash of the interpreter.
_ERROR_LINE = re.compile(r"^(?:[\w.]*(?:Error|Exception|Interrupt|Exit)\b|terminate called|Fatal Python error|"
                         r"Segmentation fault|Aborted)")
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def rank_lines(output: str) -> dict[int, list[str]]:
    """The lines each rank printed, from the output of ``torchrun --tee 3`` (which prefixes them ``[default<rank>]:``)."""
    found: dict[int, list[str]] = {}
    for line in output.splitlines():
        match = _RANK_PREFIX.match(line)
        if match:
            found.setdefault(int(match.group(1)), []).append(match.group(2))
    return found


def explain_failure(output: str) -> str:
    """What went wrong in a torchrun run, from its output: which rank failed first and how, and each rank's first error line."""
    parts = []
    cause = _ROOT_CAUSE.search(output)
    if cause:
        rank, code = int(cause.group(1)), int(cause.group(2))
        how = f"killed by signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
            else f"exit code {code}"
        parts.append(f"rank {rank} failed first ({how})")
    for rank, lines in sorted(rank_lines(output).items()):
        first = next((line.strip() for line in lines if _ERROR_LINE.match(line.strip())), None)
        if first is not None:
            parts.append(f"rank {rank}'s first error: {first}")
    return "; ".join(parts) or "no rank printed an error line"


# ---- the torchrun entries of the distributed chapters -----------------------------------------

# NVLink multicast (NVLS) and symmetric memory stay off on the course's GPU hosts.
NCCL_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def set_nccl_env_defaults() -> dict[str, str]:
    """Set ``NCCL_ENV_DEFAULTS`` where the environment does not say otherwise (call before init); return the values in force."""
    for key, value in NCCL_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in NCCL_ENV_DEFAULTS}


def _tensors_of(x: Any) -> list[torch.Tensor]:
    """The tensors in ``x``: itself, those in a list, or a module's parameters and their gradients."""
    if isinstance(x, nn.Module):
        return [t for p in x.parameters() for t in (p, p.grad) if t is not None]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors_of(v)]
    return [x]


def max_abs_error(actual: Any, expected: Any) -> float:
    """Largest ``|actual - expected|`` over tensors, lists of tensors, or two modules (parameters and gradients)."""
    worst = 0.0
    for a, e in zip(_tensors_of(actual), _tensors_of(expected)):
        if a.numel():
            diff = a.detach().cpu().to(torch.float64) - e.detach().cpu().to(torch.float64)
            worst = max(worst, float(diff.abs().max()))
    return worst


def report_check(name: str, actual: Any, expected: Any, *, rtol: float | None = None, atol: float | None = None) -> float:
    """Assert that a parallel result equals its single-process reference on this rank.

    Rank 0 prints ``CHECK <name> ok max_abs_err=<x>``.

    Every rank must call it for every check (the error is maximised over the ranks with an
    all-reduce). Returns that maximum.
    """
    assert_matches_reference(actual, expected, name=name, rtol=rtol, atol=atol)
    worst = torch.tensor([max_abs_error(actual, expected)], dtype=torch.float64, device=rank_device())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok max_abs_err={worst.item():.3g}", flush=True)
    return worst.item()


def report_result(result: dict[str, Any]) -> None:
    """Rank 0 prints ``RESULT <json>`` on one line: what a torchrun entry measured."""
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def _run_and_report(fn: Callable[[bool], dict[str, Any]], small: bool) -> None:
    report_result(fn(small))


def entry_main(fn: Callable[[bool], dict[str, Any]], description: str, argv: Sequence[str] | None = None) -> None:
    """The ``main`` of a chapter's torchrun entry.

    It takes ``--small``, turns NVLink multicast off, runs ``fn(small)`` in every rank and prints ``RESULT`` from rank 0.

    ``fn`` checks the chapter's algorithms (``report_check``) and returns what it measured.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--small", action="store_true", help="tiny sizes, for gloo ranks on a CPU")
    small = parser.parse_args(argv).small
    set_nccl_env_defaults()
    run_as_script(_run_and_report, fn, small)
