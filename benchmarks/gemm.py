"""cuBLAS bf16 matrix-multiply rate over a grid of shapes: the size dependence chapter 16's planner uses.

    python -m benchmarks.gemm              # on a GPU; writes benchmarks/results/gemm_<gpu>.json

A transformer layer's matrix multiplies are (tokens x width) by (width x k width / tp) and their
transposes in the backward pass; small micro-batches, narrow models and wide tensor parallelism make
them small, and a small GEMM reaches a smaller fraction of the GPU's peak (chapter 09's block-size
sweep shows why: too few tiles to fill the SMs, and each tile's K loop too short to hide its loads).
The record holds, for every (M, N, K) of the grid, the median TFLOP/s of ``A (M x K) @ B (K x N)``
timed with ``course_lib.profiling.benchmark`` (L2 flushed before each repeat), and the largest rate
measured. ``course_lib.planner.gemm_shape_factor`` interpolates it.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.provenance import run_facts
from course_lib.profiling import benchmark
from course_lib.support.records import RESULTS

__all__ = ["GRID_K", "GRID_M", "GRID_N", "main", "measure"]

GRID_M = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
GRID_N = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
GRID_K = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def rate(m: int, n: int, k: int) -> float:
    """Median TFLOP/s of one bf16 ``(m x k) @ (k x n)`` on the current GPU."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    seconds = benchmark(torch.matmul, a, b, warmup=3, repeat=10).median
    return 2 * m * n * k / seconds / 1e12


def measure(progress: bool = True) -> dict[str, Any]:
    """The grid's rates (TFLOP/s, a nested list indexed [m][n][k]) with the facts of the run."""
    from tqdm.auto import tqdm

    shapes = list(itertools.product(GRID_M, GRID_N, GRID_K))
    rates: dict[tuple[int, int, int], float] = {}
    for m, n, k in tqdm(shapes, desc="GEMM shapes", disable=not progress):
        rates[m, n, k] = rate(m, n, k)
    table = [[[rates[m, n, k] for k in GRID_K] for n in GRID_N] for m in GRID_M]
    return {
        **run_facts("python -m benchmarks.gemm"),
        "sections": {"gemm": {"dtype": "bfloat16", "library": "cuBLAS (torch.matmul)", "unit": "TFLOP/s",
                              "m": list(GRID_M), "n": list(GRID_N), "k": list(GRID_K), "tflops": table,
                              "max_tflops": max(rates.values())}},
    }


def main(argv: list[str] | None = None) -> int:
    """Measure and write the record (CUDA only)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gemm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/gemm_<gpu>.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    record = measure()
    slug = record["gpu"].lower().replace("nvidia", "").strip().split()[0]
    out = args.out or RESULTS / f"gemm_{slug}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    section = record["sections"]["gemm"]
    print(f"wrote {out}; largest rate {section['max_tflops']:.1f} TFLOP/s")
    for m_i, m in enumerate(section["m"]):
        row = "  ".join(f"{section['tflops'][m_i][n_i][n_i]:6.0f}" for n_i in range(len(section["n"])))
        print(f"M={m:>6}, N=K over the grid: {row}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
