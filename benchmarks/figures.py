"""The GPU figures the chapters quote, measured in one run: ``python -m benchmarks.figures [--out PATH]``.

A chapter that says what happens *on a GPU* renders the figure from the record this writes
(``benchmarks/results/figures_<gpu>.json``, read with ``course_lib.support.records``), so that prose
never holds a GPU number that no run produced. Each section measures one chapter's claim:

- ``timers`` (chapter 03): one operation timed five ways: an event pair around one call on an
  idle stream (the naive timer), ``profiling.benchmark``, ``triton.testing.do_bench``, amortised
  over back-to-back calls with a warm cache, and replayed as a CUDA graph;
- ``async_demo`` (chapter 00): an 8192^3 bf16 matmul timed by ``benchmark``, by ``perf_counter``
  alone and by ``perf_counter`` with ``torch.cuda.synchronize``;
- ``sum_vs_copy`` (chapter 00): a 2 GiB ``torch.sum`` against the time the copy rate predicts;
- ``adam`` (chapter 04): ``torch.optim.Adam`` for-loop, foreach and fused on 16 fp32 tensors of 4096^2;
- ``matmul_dtypes`` (chapter 06): 8192^3 matmuls in fp32, tf32, bf16 and fp16;
- ``copy_sweep`` (chapter 00): copy bandwidth from 4 KiB to 2 GiB, with the L2 flushed before each
  copy, with a warm L2 over back-to-back copies launched from Python, and with those copies
  replayed as one CUDA graph (no launch cost left): the launch-bound, L2 and HBM regimes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks.provenance import run_facts
from course_lib.profiling import benchmark, compare_timers

__all__ = ["copy_sweep", "main", "measure", "timers"]

RESULTS = Path(__file__).resolve().parent / "results"


def timers() -> dict[str, Any]:
    """One small and two larger operations, each timed by the five timers of ``profiling.TIMERS``, in us per call."""
    x, y = torch.randn(2**20, device="cuda"), torch.randn(2**20, device="cuda")
    a512 = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
    a2048 = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    cases: dict[str, Callable[[], Any]] = {
        "add of two 1M-element fp32 vectors": lambda: torch.add(x, y),
        "512^3 bf16 matmul": lambda: torch.mm(a512, a512),
        "2048^3 bf16 matmul": lambda: torch.mm(a2048, a2048),
    }
    rows = [{"operation": name, **{k: v * 1e6 for k, v in compare_timers(fn).items()}} for name, fn in cases.items()]
    return {"unit": "us per call (median)", "rows": rows}


def copy_sweep() -> dict[str, Any]:
    """Copy bandwidth (bytes read + written per second) against size: L2 flushed, L2 warm, warm as a CUDA graph."""
    sizes = [2**k for k in range(12, 32)]
    flushed, warm, graph = [], [], []
    for nbytes in tqdm(sizes, desc="copy sweep"):
        src = torch.rand(nbytes // 4, device="cuda")
        dst = torch.empty_like(src)
        calls = max(1, min(1000, 2**28 // nbytes))
        flushed.append(2 * nbytes / benchmark(dst.copy_, src, warmup=3, repeat=30).median)
        warm.append(2 * nbytes / benchmark(dst.copy_, src, warmup=3, repeat=30, flush_l2=False, calls=calls).median)
        graph.append(2 * nbytes / benchmark(dst.copy_, src, warmup=3, repeat=30, flush_l2=False, calls=calls,
                                            cuda_graph=True).median)
        del src, dst
    return {"sizes_bytes": sizes, "flushed_bytes_per_s": flushed, "warm_bytes_per_s": warm,
            "graph_bytes_per_s": graph,
            "warm_calls": "back-to-back copies per repeat: 2**28 // size, between 1 and 1000"}


def async_demo() -> dict[str, Any]:
    """Seconds per 8192^3 bf16 matmul as three timers read it (chapter 00's demonstration)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def host_seconds(wait: bool) -> float:
        rounds = []
        for _ in range(5):
            if wait:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                a @ a
            if wait:
                torch.cuda.synchronize()
            rounds.append((time.perf_counter() - start) / 10)
        return statistics.median(rounds)

    return {"benchmark": benchmark(lambda: a @ a).median, "perf_counter only": host_seconds(False),
            "perf_counter + synchronize": host_seconds(True), "unit": "seconds per call"}


def sum_vs_copy(copy_bytes_per_s: float) -> dict[str, Any]:
    """A 2 GiB fp32 sum: measured, and predicted from the largest copy's rate (bytes / rate)."""
    x = torch.rand(2**29, device="cuda")
    measured = benchmark(torch.sum, x).median
    predicted = x.numel() * 4 / copy_bytes_per_s
    return {"bytes": x.numel() * 4, "measured_s": measured, "predicted_s": predicted, "ratio": measured / predicted}


def adam() -> dict[str, Any]:
    """Milliseconds per torch.optim.Adam step on 16 fp32 tensors of 4096^2, for-loop, foreach and fused."""
    params = [torch.randn(4096, 4096, device="cuda", requires_grad=True) for _ in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    ms = {}
    for name, foreach, fused in (("for-loop", False, None), ("foreach", True, None), ("fused", None, True)):
        optimizer = torch.optim.Adam(params, lr=1e-6, foreach=foreach, fused=fused)
        ms[name] = benchmark(optimizer.step, warmup=3, repeat=20).median * 1e3
    return {"tensors": 16, "side": 4096, "dtype": "float32", "ms_per_step": ms}


def matmul_dtypes() -> dict[str, Any]:
    """TFLOP/s of an 8192^3 matmul per input format (tf32: fp32 inputs on tensor cores)."""
    n, rates = 8192, {}
    for name, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                              ("bf16", torch.bfloat16, False), ("fp16", torch.float16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a, b = (torch.randn(n, n, device="cuda").to(dtype) for _ in range(2))
        rates[name] = 2 * n**3 / benchmark(torch.mm, a, b, warmup=2, repeat=20).median / 1e12
    torch.backends.cuda.matmul.allow_tf32 = False
    return {"n": n, "tflops": rates}


def measure() -> dict[str, Any]:
    """Every section, with the facts of the run (date, GPU, driver, versions)."""
    sweep = copy_sweep()
    sections = {"timers": timers(), "copy_sweep": sweep, "async_demo": async_demo(),
                "sum_vs_copy": sum_vs_copy(sweep["flushed_bytes_per_s"][-1]), "adam": adam(),
                "matmul_dtypes": matmul_dtypes()}
    return {
        **run_facts("python -m benchmarks.figures"),
        "sections": sections,
    }


def main(argv: list[str] | None = None) -> int:
    """Measure and write the record (CUDA only)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/figures_<gpu>.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    record = measure()
    slug = record["gpu"].lower().replace("nvidia", "").strip().split()[0]
    out = args.out or RESULTS / f"figures_{slug}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    for row in record["sections"]["timers"]["rows"]:
        print(" | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
