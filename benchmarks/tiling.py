"""Chapter 09's GPU figures, measured in one run: ``python -m benchmarks.tiling [--out PATH]`` (CUDA only).

Writes ``benchmarks/results/tiling_<gpu>.json``, which the notebook renders with
``course_lib.support.records``. Sections:

- ``bank_conflicts``: an 8192 x 8192 fp32 transpose staged through a 32 x 32 tile of shared memory,
  written in CUDA C++ (compiled here with ``torch.utils.cpp_extension.load_inline``, which needs
  ``nvcc`` and ``ninja``) in three layouts: rows of 32 floats (a column read hits one bank 32 times),
  rows padded to 33, and an XOR swizzle; next to Triton's ``tc.transpose`` (``tl.trans``, whose
  shared-memory layout Triton chooses: the shared encodings of its compiled TTGIR are recorded
  too), PyTorch's ``x.t().contiguous()`` and a device-to-device copy of the same bytes. Rates are
  bytes read + written per second, medians of ``profiling.benchmark`` (L2 flushed between calls);
- ``grouped_order``: an 8192^3 bf16 matmul by ``tc.matmul_with_blocks`` with 128 x 128 x 64 tiles,
  8 warps and 3 stages, in row-major program order (``group_m=1``) and grouped (``group_m=8``),
  with cuBLAS (``torch.matmul``) beside them, in TFLOP/s.

A part that fails (no compiler, a compile error, a wrong result) is recorded as that part's error
and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.provenance import run_facts
from course_lib.profiling import benchmark

__all__ = ["CUDA_SOURCE", "main", "measure"]

RESULTS = Path(__file__).resolve().parent / "results"

# Three transposes through shared memory that differ only in the tile's layout. A block of 32 x 8
# threads moves a 32 x 32 tile: it writes x's rows into the tile's rows (lane tx, column tx), then
# reads the tile's columns (lane tx, row tx) to write y's rows. VARIANT 0: rows of 32 floats, so a
# column is one bank; 1: rows of 33 floats, so row r of a column is in bank (r + c) % 32; 2: rows of
# 32 floats with column c of row r stored at c ^ r, so a column's elements are in 32 banks.
CUDA_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

constexpr int TILE = 32;
constexpr int ROWS = 8;

template <int VARIANT>
__global__ void transpose_tile(const float* __restrict__ x, float* __restrict__ y, int M, int N) {
    __shared__ float tile[TILE][TILE + (VARIANT == 1 ? 1 : 0)];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int col0 = blockIdx.x * TILE, row0 = blockIdx.y * TILE;
    for (int j = ty; j < TILE; j += ROWS) {
        const int r = row0 + j, c = col0 + tx;
        const int slot = VARIANT == 2 ? (tx ^ j) : tx;
        if (r < M && c < N) tile[j][slot] = x[(size_t)r * N + c];
    }
    __syncthreads();
    for (int j = ty; j < TILE; j += ROWS) {
        const int r = col0 + j, c = row0 + tx;  // y is N x M: row r of y is column r of x
        const int slot = VARIANT == 2 ? (j ^ tx) : j;
        if (r < N && c < M) y[(size_t)r * M + c] = tile[tx][slot];
    }
}

torch::Tensor transpose_smem(torch::Tensor x, int64_t variant) {
    TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
                "x must be a contiguous 2-D fp32 CUDA tensor");
    const int M = x.size(0), N = x.size(1);
    auto y = torch::empty({N, M}, x.options());
    const dim3 block(TILE, ROWS), grid((N + TILE - 1) / TILE, (M + TILE - 1) / TILE);
    auto stream = at::cuda::getCurrentCUDAStream();
    const float* src = x.data_ptr<float>();
    float* dst = y.data_ptr<float>();
    if (variant == 0) transpose_tile<0><<<grid, block, 0, stream>>>(src, dst, M, N);
    else if (variant == 1) transpose_tile<1><<<grid, block, 0, stream>>>(src, dst, M, N);
    else transpose_tile<2><<<grid, block, 0, stream>>>(src, dst, M, N);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""
CPP_DECLARATION = "torch::Tensor transpose_smem(torch::Tensor x, int64_t variant);"
VARIANTS = {
    0: "CUDA, shared tile 32 x 32 (column reads: 32-way bank conflict)",
    1: "CUDA, shared tile 32 x 33 (padded by one float)",
    2: "CUDA, shared tile 32 x 32, XOR swizzle",
}


def _gbps(fn: Callable[[], Any], moved: int) -> float:
    return moved / benchmark(fn, warmup=5, repeat=30).median / 1e9


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:500]}"


def shared_layouts(ttgir: str) -> list[str]:
    """The shared-memory encodings declared in a TTGIR listing (``#shared = #ttg.swizzled_shared<...>`` lines)."""
    return sorted({line.strip() for line in ttgir.splitlines() if re.match(r"\s*#\w*shared\w*\s*=", line)})


def triton_transpose_facts(x: torch.Tensor) -> dict[str, Any]:
    """What Triton compiled for ``tc.transpose(x)``: tile, shared memory bytes, shared encodings and layout conversions."""
    import triton

    from course_lib.kernels import tiling_coalescing as tc

    block = tc._TRANSPOSE_BLOCK
    n_rows, n_cols = x.shape
    out = torch.empty(n_cols, n_rows, device=x.device, dtype=x.dtype)
    compiled = tc._tile_kernel[(triton.cdiv(n_rows, block), triton.cdiv(n_cols, block))](
        x, out, n_rows, n_cols, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block, BLOCK_N=block, TRANSPOSE=True)
    ttgir = compiled.asm["ttgir"]
    metadata = getattr(compiled, "metadata", None)
    shared = getattr(metadata, "shared", None) if metadata is not None else None
    return {"tile": [block, block], "tile_bytes": block * block * x.element_size(),
            "shared_bytes": shared, "num_warps": getattr(metadata, "num_warps", None),
            "shared_encodings": shared_layouts(ttgir), "convert_layout_ops": ttgir.count("convert_layout")}


def bank_conflicts(n: int = 8192) -> dict[str, Any]:
    """GB/s of an n x n fp32 transpose: CUDA with three shared-memory layouts, Triton, PyTorch, and a copy."""
    from course_lib.kernels import tiling_coalescing as tc

    x = torch.randn(n, n, device="cuda")
    moved = 2 * x.numel() * x.element_size()
    expected = x.t().contiguous()
    rows: list[dict[str, Any]] = []
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(name="tiling_bank_conflicts", cpp_sources=CPP_DECLARATION, cuda_sources=CUDA_SOURCE,
                             functions=["transpose_smem"], extra_cuda_cflags=["-O3"], verbose=False)
        for variant, label in VARIANTS.items():
            def run(variant: int = variant) -> torch.Tensor:
                return module.transpose_smem(x, variant)
            try:
                if not torch.equal(run(), expected):
                    raise AssertionError("wrong result")
                rows.append({"variant": label, "gbps": _gbps(run, moved), "error": None})
            except Exception as exc:  # noqa: BLE001 - one variant's failure is its row's error
                rows.append({"variant": label, "gbps": None, "error": _error(exc)})
    except Exception as exc:  # noqa: BLE001 - no compiler here: the CUDA rows are one error
        rows.append({"variant": "CUDA transposes", "gbps": None, "error": _error(exc)})
    rows.append({"variant": "Triton tc.transpose (tl.trans; layout chosen by Triton)",
                 "gbps": _gbps(lambda: tc.transpose(x), moved), "error": None})
    rows.append({"variant": "Triton tc.transpose(coalesced=False) (strided reads)",
                 "gbps": _gbps(lambda: tc.transpose(x, coalesced=False), moved), "error": None})
    rows.append({"variant": "PyTorch x.t().contiguous()", "gbps": _gbps(lambda: x.t().contiguous(), moved),
                 "error": None})
    y = torch.empty_like(x)
    copy_gbps = _gbps(lambda: y.copy_(x), moved)
    try:
        triton_facts = triton_transpose_facts(x)
    except Exception as exc:  # noqa: BLE001 - the listing is context, not a measurement
        triton_facts = {"error": _error(exc)}
    return {"shape": [n, n], "dtype": "float32", "unit": "GB/s (bytes read + written)", "copy_gbps": copy_gbps,
            "rows": rows, "triton": triton_facts}


def grouped_order(n: int = 8192) -> dict[str, Any]:
    """TFLOP/s of an n^3 bf16 matmul with 128 x 128 x 64 tiles in row-major and grouped program order, and cuBLAS."""
    from course_lib.kernels import tiling_coalescing as tc

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    flops = 2 * n**3
    expected = (a @ b).float()
    rates: dict[str, float | str] = {}
    for group_m in (1, 8):
        def run(group_m: int = group_m) -> torch.Tensor:
            return tc.matmul_with_blocks(a, b, 128, 128, 64, group_m=group_m, num_warps=8, num_stages=3)
        try:
            error = ((run().float() - expected).norm() / expected.norm()).item()
            if not error < 1e-2:
                raise AssertionError(f"relative error {error:.3g}")
            rates[f"group_m={group_m}"] = flops / benchmark(run, warmup=5, repeat=20).median / 1e12
        except Exception as exc:  # noqa: BLE001 - recorded as the row's error
            rates[f"group_m={group_m}"] = _error(exc)
    rates["torch.matmul (cuBLAS)"] = flops / benchmark(lambda: a @ b, warmup=5, repeat=20).median / 1e12
    return {"shape": [n, n, n], "dtype": "bfloat16", "tile": [128, 128, 64], "num_warps": 8, "num_stages": 3,
            "unit": "TFLOP/s", "tflops": rates}


def measure() -> dict[str, Any]:
    """Both sections, with the facts of the run (date, GPU, driver, versions)."""
    return {
        **run_facts("python -m benchmarks.tiling"),
        "sections": {"bank_conflicts": bank_conflicts(), "grouped_order": grouped_order()},
    }


def main(argv: list[str] | None = None) -> int:
    """Measure and write the record (CUDA only)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tiling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/tiling_<gpu>.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    record = measure()
    slug = record["gpu"].lower().replace("nvidia", "").strip().split()[0]
    out = args.out or RESULTS / f"tiling_{slug}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    section = record["sections"]["bank_conflicts"]
    for row in section["rows"]:
        value = "error: " + row["error"] if row["error"] else f"{row['gbps']:8.1f} GB/s"
        print(f"{row['variant']:>62}: {value}")
    print(f"{'device-to-device copy':>62}: {section['copy_gbps']:8.1f} GB/s")
    print("what Triton compiled for tc.transpose:", section["triton"])
    for name, value in record["sections"]["grouped_order"]["tflops"].items():
        print(f"{name:>24}: {value if isinstance(value, str) else f'{value:.1f} TFLOP/s'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
