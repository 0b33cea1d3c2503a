"""The facts every record starts with: when, on which machine (GPU, driver, versions), by which command.

    record = {**run_facts("python -m benchmarks.tiling"), "sections": {...}}
    raise SystemExit(record_main("flash_steps", __doc__, measure))   # --out PATH, --quick; CUDA only
    ms = functools.partial(median_ms, config)                          # how those modules time a call: ms(fn)
    host = host_ms(fn)                                                 # what the same call costs the CPU
    samples, failures = interleaved_rounds({"ours": t1, "cuDNN": t2}, 3)  # several timers, drift shared alike

The same facts on a machine without a GPU say so ("none (CPU)"), so a CPU smoke run and a
notebook run on a laptop are recorded by the one function.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from benchmarks.report import gpu_slug
from course_lib.profiling import host_seconds

__all__ = ["RESULTS", "driver_version", "host_ms", "interleaved_rounds", "machine_facts", "median_ms", "record_main",
           "record_path", "run_facts"]

K = TypeVar("K")

RESULTS = Path(__file__).resolve().parent / "results"


def driver_version() -> str:
    """The NVIDIA driver's version, as nvidia-smi reports it ("unknown" without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def machine_facts() -> dict[str, Any]:
    """GPU (name, SMs, L2), driver, CUDA, cuDNN, torch, Triton and Python versions; the GPU fields say "none" on a CPU."""
    import triton

    on_gpu = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if on_gpu else None
    return {
        "gpu": props.name if props else "none (CPU)",
        "sms": props.multi_processor_count if props else None,
        "l2_bytes": props.L2_cache_size if props else None,
        "driver": driver_version() if on_gpu else "none",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "cudnn": torch.backends.cudnn.version() if on_gpu else None,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def run_facts(command: str) -> dict[str, Any]:
    """Schema, date (UTC), :func:`machine_facts` and ``command``: the head of a record."""
    return {
        "schema_version": 1,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **machine_facts(),
        "command": command,
    }


def median_ms(config: dict[str, Any], fn: Callable[[], Any], grad_to_none: list[torch.Tensor] | None = None) -> float:
    """Median milliseconds of ``fn()`` by ``triton.testing.do_bench`` (L2 flushed between calls), with ``config``'s
    ``warmup_ms`` and ``rep_ms``; the tensors in ``grad_to_none`` get their ``.grad`` reset before each call."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=config["warmup_ms"], rep=config["rep_ms"], grad_to_none=grad_to_none or None,
                          return_mode="median"))


def interleaved_rounds(timers: Mapping[K, Callable[[], float]],
                       rounds: int) -> tuple[dict[K, list[float]], dict[K, Exception]]:
    """(samples, failures): each timer's results over ``rounds`` rounds in which every timer runs once, in turn.

    A drift of the GPU's clocks over a run then reaches every timer alike, where timing each one's
    rounds back to back would hand the drift to whichever ran last. A timer that raises stops: its
    exception goes to ``failures`` and its samples are dropped.
    """
    samples: dict[K, list[float]] = {key: [] for key in timers}
    failures: dict[K, Exception] = {}
    for _ in range(rounds):
        for key in list(samples):
            try:
                samples[key].append(timers[key]())
            except Exception as exc:  # noqa: BLE001 - the caller reports each failure as its row's error
                failures[key] = exc
                del samples[key]
    return samples, failures


def host_ms(fn: Callable[[], Any], grad_to_none: list[torch.Tensor] | None = None, *, calls: int = 20,
            repeats: int = 5, sync: Callable[[], Any] | None = None) -> float:
    """Median milliseconds of the host's time per call of ``fn()``, ``calls`` calls issued back to back.

    Nothing waits for the GPU between the calls, so this is what a call costs the CPU: Python,
    dispatch, autotuner lookups, descriptor encoding, kernel launches (a call that synchronises
    inside counts its wait). Where it exceeds :func:`median_ms`'s GPU time, the GPU idles between
    calls and the call is host-bound. ``sync`` (default ``torch.cuda.synchronize``) runs before each
    timed run and after the last, outside the timing.
    """
    fn()  # compile and autotune outside the timing

    def run() -> None:
        for _ in range(calls):
            for t in grad_to_none or ():
                t.grad = None
            fn()

    return host_seconds(run, repeats=repeats, sync=sync) * 1e3 / calls


def record_path(name: str, gpu: str, quick: bool) -> Path:
    """Where a record module writes by default: ``benchmarks/results/<name>_<gpu slug>[-quick].json``."""
    return RESULTS / f"{name}_{gpu_slug(gpu)}{'-quick' if quick else ''}.json"


def record_main(name: str, doc: str | None, measure: Callable[[bool], dict[str, Any]],
                argv: list[str] | None = None) -> int:
    """The command line of a one-GPU record module ``benchmarks.<name>``: ``--out PATH``, ``--quick``; needs CUDA."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help=f"default: benchmarks/results/{name}_<gpu>.json")
    parser.add_argument("--quick", action="store_true", help="a smaller shape, short timing: a smoke run")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    record = measure(args.quick)
    out = args.out or record_path(name, record["gpu"], args.quick)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 0
