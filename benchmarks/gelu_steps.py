"""Chapter 08's bias + GELU, step by step: what stands between the fused kernel and copy speed.

    python -m benchmarks.gelu_steps [--out PATH] [--quick]

writes ``benchmarks/results/gelu_steps_<gpu>.json`` (``-quick`` with ``--quick``). One shape
(8192 x 8192 bf16, bias of 8192; ``--quick``: 1024 x 1024), GB/s counting x read and y written
once (the bias is 1/8192 of it), by the median of ``triton.testing.do_bench``, in three groups:

- ``reference``: a device-to-device copy of x (the bandwidth roof), and torch.compile's fused bias
  add alone, its exact GELU, its tanh GELU and the fitted erfc's GELU written in PyTorch operations
  (``erfc.fitted_gelu``, the capstone's), the same bytes with more or less arithmetic;
- ``course``: ``fusion.bias_gelu`` as shipped, with the library's erf and with the fitted erfc;
- ``math``: a copy of the course kernel's forward at its own tile, with the arithmetic cut back
  step by step: the bias add alone, then one exponential per element, then the fitted erfc (the
  shipped fast kernel's arithmetic), then the library's erf. The distance from the bias add to copy
  is the kernel's access pattern; each step after it is what that much arithmetic costs;
- ``tile``: the bias add alone and the fitted erfc at other tiles and warp counts: if a tile
  brings the erfc closer to the bias add, more bytes in flight hide the arithmetic's latency.

Every row is checked before it is timed (the GELU rows against the exact GELU in fp64, the cut-back
ones against what they compute); a row that fails to compile or to match is recorded with its error.
The exact-GELU rows also record ``rounding``: their largest error in bf16 ulps and the fraction of
outputs that are not the correctly rounded exact GELU.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.provenance import median_ms, record_main, run_facts
from course_lib.erfc import fitted_gelu
from course_lib.kernels import fusion

# isort: split
import triton
import triton.language as tl

__all__ = ["FULL", "MATH", "QUICK", "TILES", "main", "math_forward", "measure", "rounding", "steps"]

FULL: dict[str, Any] = {"rows": 8192, "cols": 8192, "warmup_ms": 25, "rep_ms": 100}
QUICK: dict[str, Any] = {"rows": 1024, "cols": 1024, "warmup_ms": 5, "rep_ms": 20}
MATH = {0: "bias add only", 1: "+ one exponential", 2: "fitted erfc (fast_erf=True)", 3: "library erf (exact)"}
"""The arithmetic of ``math_forward``'s modes, from none to the exact GELU."""
TILES: list[tuple[int, int, int]] = [(1, 1024, 4), (1, 1024, 2), (4, 1024, 4), (8, 1024, 4), (8, 1024, 8),
                                     (4, 512, 2), (4, 2048, 8)]
"""(BLOCK_M, BLOCK_N, num_warps) beside the course's own, ``fusion._bias_gelu_blocks`` at 4 warps."""

Ms = Callable[[Callable[[], Any]], float]


@triton.jit
def _math_kernel(x_ptr, b_ptr, y_ptr, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MATH: tl.constexpr):
    # The course's forward (fusion._bias_gelu_fwd_kernel) for whole tiles, its arithmetic set by MATH.
    row0 = tl.program_id(0) * BLOCK_M
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    base = row0.to(tl.int64) * n_cols
    offs = tl.arange(0, BLOCK_M)[:, None] * n_cols + cols[None, :]
    b = tl.load(b_ptr + cols).to(tl.float32)
    z = tl.load(x_ptr + base + offs).to(tl.float32) + b[None, :]
    if MATH == 0:
        y = z
    elif MATH == 1:
        y = z * tl.exp(-0.5 * z * z)
    else:
        cdf, _ = fusion._normal_cdf(z, MATH == 2)
        y = z * cdf
    tl.store(y_ptr + base + offs, y.to(y_ptr.dtype.element_ty))


def math_forward(x: torch.Tensor, bias: torch.Tensor, math: int, tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``_math_kernel``'s output for 2-D ``x`` and ``bias`` (x's last dim); ``tile`` (BLOCK_M, BLOCK_N, warps) must divide x."""
    if math not in MATH:
        raise ValueError(f"math must be one of {sorted(MATH)}, got {math!r}")
    n_rows, n_cols = x.shape
    block_m, block_n, warps = tile if tile is not None else (*fusion._bias_gelu_blocks(n_rows, n_cols), 4)
    if n_rows % block_m or n_cols % block_n or bias.shape != (n_cols,):
        raise ValueError(f"tile {block_m}x{block_n} must divide x {tuple(x.shape)}, and bias must be ({n_cols},)")
    y = torch.empty_like(x)
    _math_kernel[(n_rows // block_m, n_cols // block_n)](x, bias, y, n_cols, BLOCK_M=block_m, BLOCK_N=block_n,
                                                         MATH=math, num_warps=warps)
    return y


def _expected(x: torch.Tensor, bias: torch.Tensor, math: int) -> torch.Tensor:
    """What ``math_forward`` computes, in fp64: the GELU modes against the exact GELU."""
    z = x.double() + bias.double()
    if math == 0:
        return z
    if math == 1:
        return z * torch.exp(-0.5 * z * z)
    return F.gelu(z)


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within two bf16 roundings of the fp64 result (the output's own rounding dominates any erf error)."""
    torch.testing.assert_close(got.double(), want.to(got.dtype).double(), rtol=2 * 2.0 ** -8, atol=1e-6)


def rounding(got: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    """How far bf16 ``got`` is from the fp64 ``exact``: the largest error in bf16 ulps (of the exact value, where
    it is above 1e-6; below, fp32's own ``1 + erf`` cancellation decides) and the fraction of outputs that differ
    from the correctly rounded result."""
    big = exact.abs() > 1e-6
    ulp = torch.pow(2.0, torch.floor(torch.log2(exact[big].abs())) - 7)
    return {"max_ulps": float(((got[big].double() - exact[big]).abs() / ulp).max()) if big.any() else 0.0,
            "misrounded": float((got != exact.to(got.dtype)).double().mean())}


def _error(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _row(group: str, label: str, tile: tuple[int, int, int] | None, num_bytes: int, call: Callable[[], Any],
         want: torch.Tensor | None, ms: Ms, gelu: bool = False) -> dict[str, Any]:
    """One row: ``call`` checked against ``want`` (when given), then timed; any failure is the row's error.
    ``gelu``: ``want`` is the exact GELU, and the row records ``rounding`` against it."""
    entry: dict[str, Any] = {"group": group, "label": label, "tile": list(tile) if tile else None, "error": None}
    try:
        if want is not None:
            got = call()
            _check(got, want)
            if gelu:
                entry["rounding"] = rounding(got, want)
        entry["ms"] = ms(call)
        entry["gbps"] = num_bytes / entry["ms"] / 1e6
    except Exception as exc:  # noqa: BLE001 - a variant that fails is a row of the record
        entry["error"] = _error(exc)
    shown = f"{entry['gbps']:8,.0f} GB/s" if entry["error"] is None else entry["error"]
    print(f"{group:9} {label:58} {shown}", flush=True)
    return entry


def steps(config: dict[str, Any], ms: Ms, device: str = "cuda", compiled: bool = True) -> dict[str, Any]:
    """Every row at ``config``'s shape; ``ms(fn)`` is the median milliseconds of a call; ``compiled``: the
    torch.compile references (slow to build on a CPU)."""
    n_rows, n_cols = config["rows"], config["cols"]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n_rows, n_cols, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(n_cols, generator=gen, device=device).to(torch.bfloat16)
    num_bytes = 2 * x.numel() * x.element_size()
    out = torch.empty_like(x)
    exact = _expected(x, bias, 3)
    rows = [_row("reference", "copy (x read, y written)", None, num_bytes, lambda: out.copy_(x), None, ms)]
    if compiled:
        for label, fn, want in (
            ("torch.compile, bias add only", lambda a, b: a + b, _expected(x, bias, 0)),
            ("torch.compile, exact GELU", lambda a, b: F.gelu(a + b), exact),
            ("torch.compile, tanh GELU", lambda a, b: F.gelu(a + b, approximate="tanh"),
             F.gelu(x.double() + bias.double(), approximate="tanh")),
            ("torch.compile, fitted-erfc GELU (erfc.fitted_gelu)", lambda a, b: fitted_gelu(a + b), exact),
        ):
            step = torch.compile(fn)
            rows.append(_row("reference", label, None, num_bytes, partial(step, x, bias), want, ms,
                             gelu=want is exact))
    for label, fast in (("bias_gelu, library erf", False), ("bias_gelu(fast_erf=True)", True)):
        rows.append(_row("course", label, None, num_bytes,
                         partial(fusion.bias_gelu, x, bias, fast_erf=fast), exact, ms, gelu=True))
    own = (*fusion._bias_gelu_blocks(n_rows, n_cols), 4)
    for math, label in MATH.items():
        rows.append(_row("math", label, own, num_bytes, partial(math_forward, x, bias, math),
                         _expected(x, bias, math), ms, gelu=math >= 2))
    for tile in TILES:
        if tile == own or n_rows % tile[0] or n_cols % tile[1]:
            continue
        for math in (0, 2):
            rows.append(_row("tile", f"{MATH[math]}, {tile[0]}x{tile[1]}, {tile[2]} warps", tile, num_bytes,
                             partial(math_forward, x, bias, math, tile), _expected(x, bias, math), ms))
    return {"rows_x_cols": [n_rows, n_cols], "dtype": "bfloat16", "course_tile": list(own), "rows": rows,
            "bytes": "x read and y written once: 2 x rows x cols x 2 bytes",
            "timing": "median of triton.testing.do_bench (L2 flushed between calls)"}


def measure(quick: bool = False) -> dict[str, Any]:
    """The record: every row at the full (or quick) shape, with the facts of the run."""
    config = QUICK if quick else FULL
    return {**run_facts("python -m benchmarks.gelu_steps" + (" --quick" if quick else "")),
            "sections": {"steps": steps(config, partial(median_ms, config))}}


def main(argv: list[str] | None = None) -> int:
    """Measure and write the record (CUDA only)."""
    return record_main("gelu_steps", __doc__, measure, argv)


if __name__ == "__main__":
    raise SystemExit(main())
