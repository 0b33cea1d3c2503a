"""Chapter 09 (tiling and coalescing): copies, transposes and a tiled matmul in Triton.

- ``copy``, ``copy_columns``: the same 2-D copy with coalesced (row by row) and strided
  (column by column) memory accesses.
- ``transpose``: through a tile (reads and writes both coalesced) or naively (strided reads).
- ``matmul``: tiled, with grouped program order for L2 reuse, autotuned on a GPU;
  ``matmul_with_blocks`` runs it with given block sizes; ``matmul_naive`` reuses nothing.
- ``grouped_program_id``, ``tiled_matmul_hbm_bytes``, ``matmul_rates``: the arithmetic behind
  them (program order, HBM traffic, achieved rates), as plain Python.
- ``program_tiles``: the tile each program gets from a mapping written in Triton (a ``@triton.jit``
  function like ``_grouped_tile``), read back by launching it; ``l2_traffic``: the HBM bytes that
  a program order costs through a simulated L2 cache.

Under Triton's CPU interpreter the matmul kernels accept fp32 only (the interpreter computes
16-bit dots wrongly); copies and transposes move any dtype.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from course_lib import env  # sets TRITON_INTERPRET=1 without a GPU; must come before any kernel

# isort: split
import triton  # after env, on purpose
import triton.language as tl

from course_lib.profiling import achieved_rates, arithmetic_intensity, matmul_flops_bytes

__all__ = [
    "copy",
    "copy_columns",
    "transpose",
    "grouped_program_id",
    "program_tiles",
    "l2_traffic",
    "matmul_with_blocks",
    "matmul",
    "matmul_naive",
    "tiled_matmul_hbm_bytes",
    "matmul_rates",
]

# Tile shapes of the copies and transposes: 8K-16K elements per program keeps enough bytes in
# flight per SM on a GPU; under the interpreter fewer, larger programs run faster.
_COPY_BLOCK_M, _COPY_BLOCK_N = (32, 64) if env.INTERPRET else (32, 128)
_TRANSPOSE_BLOCK = 32 if env.INTERPRET else 64
_COLUMN_BLOCK = 64 if env.INTERPRET else 1024  # rows per program in the column-wise (strided) kernels


def _check_2d(x: torch.Tensor, name: str = "x") -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")


# --------------------------------------------------------------------------------------------
# Copies and transposes: the same bytes, moved with coalesced or strided accesses
# --------------------------------------------------------------------------------------------


@triton.jit
def _tile_kernel(
    x_ptr, y_ptr, M, N,
    stride_xm, stride_xn, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSE: tl.constexpr,
):
    # One BLOCK_M x BLOCK_N tile of x per program, read along its rows: neighbouring threads touch
    # neighbouring addresses, so a warp's 32 loads merge into a few wide memory transactions.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tile = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :] * stride_xn, mask=mask)
    if TRANSPOSE:
        # y[j, i] = x[i, j], written along the rows of y (coalesced again): the transposed tile's
        # rows are y's rows rn, its columns y's columns rm. tl.trans only changes which thread
        # holds which element; the compiler does the exchange through shared memory.
        out_mask = (rn[:, None] < N) & (rm[None, :] < M)
        tl.store(y_ptr + rn[:, None] * stride_ym + rm[None, :] * stride_yn, tl.trans(tile), mask=out_mask)
    else:
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn, tile, mask=mask)


@triton.jit
def _copy_column_kernel(
    x_ptr, y_ptr, M,
    stride_xm, stride_xn, stride_ym, stride_yn,
    BLOCK: tl.constexpr,
):
    # BLOCK rows of one column per program: neighbouring threads are a whole row apart in memory,
    # so every load and store of a warp lands in a different memory sector (the slow pattern).
    col = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < M
    values = tl.load(x_ptr + rows * stride_xm + col * stride_xn, mask=mask)
    tl.store(y_ptr + rows * stride_ym + col * stride_yn, values, mask=mask)


def copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of 2-D ``x`` (contiguous result), tile by tile with coalesced reads and writes."""
    _check_2d(x)
    M, N = x.shape
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(M, _COPY_BLOCK_M), triton.cdiv(N, _COPY_BLOCK_N))
    _tile_kernel[grid](
        x, y, M, N, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
        BLOCK_M=_COPY_BLOCK_M, BLOCK_N=_COPY_BLOCK_N, TRANSPOSE=False,
    )
    return y


def copy_columns(x: torch.Tensor) -> torch.Tensor:
    """A copy of 2-D ``x`` made column by column: the same bytes as ``copy``, with strided accesses."""
    _check_2d(x)
    M, N = x.shape
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    grid = (N, triton.cdiv(M, _COLUMN_BLOCK))  # columns on axis 0, which allows 2**31 - 1 programs
    _copy_column_kernel[grid](
        x, y, M, x.stride(0), x.stride(1), y.stride(0), y.stride(1), BLOCK=_COLUMN_BLOCK,
    )
    return y


def transpose(x: torch.Tensor, *, coalesced: bool = True) -> torch.Tensor:
    """``x.T`` as a new contiguous tensor: through on-chip tiles (coalesced) or naively (strided reads)."""
    _check_2d(x)
    M, N = x.shape
    y = torch.empty((N, M), device=x.device, dtype=x.dtype)
    if coalesced:
        grid = (triton.cdiv(M, _TRANSPOSE_BLOCK), triton.cdiv(N, _TRANSPOSE_BLOCK))
        _tile_kernel[grid](
            x, y, M, N, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
            BLOCK_M=_TRANSPOSE_BLOCK, BLOCK_N=_TRANSPOSE_BLOCK, TRANSPOSE=True,
        )
    else:
        # Row j of y is column j of x: written contiguously, read with a stride of a whole row.
        grid = (N, triton.cdiv(M, _COLUMN_BLOCK))
        _copy_column_kernel[grid](
            x, y, M, x.stride(0), x.stride(1), y.stride(1), y.stride(0), BLOCK=_COLUMN_BLOCK,
        )
    return y


# --------------------------------------------------------------------------------------------
# Matmul: naive, tiled, tiled with grouped program order
# --------------------------------------------------------------------------------------------


def grouped_program_id(pid: int, num_pid_m: int, num_pid_n: int, group_m: int) -> tuple[int, int]:
    """The output tile (pid_m, pid_n) that program ``pid`` computes under grouped ordering.

    Programs walk down a band of ``group_m`` tile rows, column by column, before moving to the next
    band (the last band may be narrower); ``group_m=1`` is plain row-major order.
    """
    if group_m < 1:
        raise ValueError(f"group_m must be at least 1, got {group_m}")
    if not 0 <= pid < num_pid_m * num_pid_n:
        raise ValueError(f"pid {pid} outside a grid of {num_pid_m} x {num_pid_n} tiles")
    per_band = group_m * num_pid_n
    first_m = (pid // per_band) * group_m
    band_rows = min(num_pid_m - first_m, group_m)
    within = pid % per_band
    return first_m + within % band_rows, within // band_rows


@triton.jit
def _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # The same arithmetic as grouped_program_id, in the kernel.
    per_band = GROUP_M * num_pid_n
    first_m = (pid // per_band) * GROUP_M
    band_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    within = pid % per_band
    return first_m + within % band_rows, within // band_rows


@triton.jit
def _program_tiles_kernel(
    out_ptr, num_programs, num_pid_m, num_pid_n, GROUP_M: tl.constexpr, MAPPING: tl.constexpr, BLOCK: tl.constexpr,
):
    # BLOCK program ids at once through the mapping; out[2 * pid] = pid_m, out[2 * pid + 1] = pid_n.
    # Ids past the end are clamped to the last program (their results are not stored).
    ids = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    pid_m, pid_n = MAPPING(tl.minimum(ids, num_programs - 1), num_pid_m, num_pid_n, GROUP_M)
    tl.store(out_ptr + 2 * ids, pid_m, mask=ids < num_programs)
    tl.store(out_ptr + 2 * ids + 1, pid_n, mask=ids < num_programs)


@triton.jit
def _program_tile_kernel(out_ptr, num_pid_m, num_pid_n, GROUP_M: tl.constexpr, MAPPING: tl.constexpr):
    # One program id per program, as a matmul kernel calls the mapping.
    pid = tl.program_id(0)
    pid_m, pid_n = MAPPING(pid, num_pid_m, num_pid_n, GROUP_M)
    tl.store(out_ptr + 2 * pid, pid_m)
    tl.store(out_ptr + 2 * pid + 1, pid_n)


def program_tiles(mapping: Any, num_pid_m: int, num_pid_n: int, group_m: int) -> list[tuple[int, int]]:
    """``[(pid_m, pid_n) of program 0, of program 1, ...]`` under ``mapping``, a ``@triton.jit`` function
    ``(pid, num_pid_m, num_pid_n, GROUP_M) -> (pid_m, pid_n)`` such as ``_grouped_tile``.

    The mapping runs inside a kernel, one program id per program as a matmul kernel calls it. On
    grids of more than 256 programs it runs on blocks of ids at once, if that gives the same tiles
    as one id at a time on a small ragged grid (a Python ``min`` or ``if`` does not, under the
    interpreter); else one id at a time, slowly.
    """

    def one_at_a_time(rows: int, cols: int) -> torch.Tensor:
        out = torch.full((2 * rows * cols,), -1, dtype=torch.int32, device=env.DEVICE)
        _program_tile_kernel[(rows * cols,)](out, rows, cols, GROUP_M=group_m, MAPPING=mapping)
        return out

    def in_blocks(rows: int, cols: int) -> torch.Tensor:
        out = torch.full((2 * rows * cols,), -1, dtype=torch.int32, device=env.DEVICE)
        block = min(triton.next_power_of_2(rows * cols), 4096)
        _program_tiles_kernel[(triton.cdiv(rows * cols, block),)](
            out, rows * cols, rows, cols, GROUP_M=group_m, MAPPING=mapping, BLOCK=block)
        return out

    out = None
    if num_pid_m * num_pid_n > 256:
        try:
            if torch.equal(in_blocks(7, 5), one_at_a_time(7, 5)):
                out = in_blocks(num_pid_m, num_pid_n)
        except Exception:  # noqa: BLE001,S110 - a mapping written for one id at a time only
            pass
    if out is None:
        out = one_at_a_time(num_pid_m, num_pid_n)
    return [(int(m), int(n)) for m, n in out.view(-1, 2).tolist()]


def l2_traffic(
    order: Sequence[tuple[int, int]],
    k_steps: int,
    a_tile_bytes: int,
    b_tile_bytes: int,
    l2_bytes: int,
    wave: int,
) -> int:
    """HBM bytes that a tiled matmul's reads of A and B cost through a simulated L2 cache.

    ``order[pid]`` is the output tile ``(pid_m, pid_n)`` of program ``pid``. Programs run in waves of
    ``wave`` consecutive ids, and a wave walks K in step: at step ``s`` each of its programs reads
    the tile ``A[pid_m, s]`` (``a_tile_bytes``) and ``B[s, pid_n]`` (``b_tile_bytes``). A tile found in
    the cache costs nothing; any other comes from HBM and enters the cache, which then drops the
    least recently used tiles beyond ``l2_bytes``. The write of C is not included.
    """
    if min(k_steps, a_tile_bytes, b_tile_bytes, wave) < 1 or l2_bytes < 0:
        raise ValueError("k_steps, tile sizes and wave must be positive, l2_bytes not negative")
    cache: OrderedDict[tuple[str, int, int], int] = OrderedDict()
    held = hbm = 0
    for start in range(0, len(order), wave):
        programs = order[start:start + wave]
        for step in range(k_steps):
            for pid_m, pid_n in programs:
                for key, size in ((("A", pid_m, step), a_tile_bytes), (("B", step, pid_n), b_tile_bytes)):
                    if key in cache:
                        cache.move_to_end(key)
                        continue
                    hbm += size
                    cache[key] = size
                    held += size
                    while held > l2_bytes:
                        held -= cache.popitem(last=False)[1]
    return hbm


@triton.jit
def _tile_product(
    a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, pid_m, pid_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
):
    # The (pid_m, pid_n) tile of A @ B, accumulated in fp32. Each step of the K loop brings a
    # BLOCK_M x BLOCK_K tile of A and a BLOCK_K x BLOCK_N tile of B on chip and uses every element
    # BLOCK_N (or BLOCK_M) times: that reuse is what lifts the kernel off the memory roof.
    # Rows and columns past the edge wrap around instead of being masked: their loads stay in bounds,
    # their results are never stored, and the K loop needs no M or N masks.
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # fp32 accumulation whatever the inputs
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:  # K a multiple of BLOCK_K (chosen at compile time): no masks in the hot loop
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
):
    # One BLOCK_M x BLOCK_N tile of C per program, in grouped order for L2 reuse.
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    acc = _tile_product(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, pid_m, pid_n,
                        BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, EVEN_K)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _matmul_naive_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # BLOCK_N outputs of one row of C per program: the row of A is read once per program, but every
    # program reads its columns of B in full, so B comes from memory M times over.
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + row * stride_am + rk * stride_ak, mask=rk < K, other=0.0).to(tl.float32)
        b = tl.load(
            b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn,
            mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a[:, None] * b, axis=0)
    tl.store(c_ptr + row * stride_cm + rn * stride_cn, acc.to(c_ptr.dtype.element_ty), mask=rn < N)


# Configurations tried by the autotuner on a GPU (Hopper-sized tiles; a config that needs more
# shared memory than the GPU has is skipped by the autotuner). Under the interpreter: one config.
_GPU_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_stages=stages, num_warps=warps)
    for bm, bn, bk, stages, warps in [
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 8),
        (128, 128, 64, 4, 4),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (128, 128, 32, 4, 4),
        (64, 64, 64, 4, 4),
    ]
]
_INTERPRETER_BLOCKS = (32, 32, 32)

if not env.INTERPRET:
    _matmul_autotuned = triton.autotune(configs=_GPU_CONFIGS, key=["M", "N", "K"])(_matmul_kernel)


def _matmul_operands(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Check the operands of C = A @ B and return an empty C.
    _check_2d(a, "a")
    _check_2d(b, "b")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if env.INTERPRET and a.dtype != torch.float32:
        raise ValueError(f"the Triton interpreter computes fp32 matmuls only, got {a.dtype}")
    return torch.empty((a.shape[0], b.shape[1]), device=a.device, dtype=a.dtype)


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs follow torch's own setting: exact fp32 products unless TF32 was allowed with
    # torch.set_float32_matmul_precision("high"). 16-bit inputs use tensor cores either way.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def matmul_with_blocks(
    a: torch.Tensor,
    b: torch.Tensor,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int = 8,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """``a @ b`` by the tiled kernel with the given tile and launch parameters (no autotuning)."""
    c = _matmul_operands(a, b)
    (M, K), N = a.shape, b.shape[1]
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _matmul_kernel[grid](
        a, b, c, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        PRECISION=_precision(a.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return c


def matmul(a: torch.Tensor, b: torch.Tensor, *, group_m: int = 8) -> torch.Tensor:
    """``a @ b`` by the tiled, grouped kernel: autotuned on a GPU, one small config under the interpreter."""
    if env.INTERPRET:
        return matmul_with_blocks(a, b, *_INTERPRETER_BLOCKS, group_m=group_m)
    c = _matmul_operands(a, b)
    (M, K), N = a.shape, b.shape[1]

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _matmul_autotuned[grid](
        a, b, c, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        GROUP_M=group_m, PRECISION=_precision(a.dtype),
    )
    return c


def matmul_naive(a: torch.Tensor, b: torch.Tensor, *, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """``a @ b`` with ``block_n`` outputs of one row per program: no reuse of B between rows."""
    c = _matmul_operands(a, b)
    (M, K), N = a.shape, b.shape[1]
    grid = (M, triton.cdiv(N, block_n))
    _matmul_naive_kernel[grid](
        a, b, c, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return c


# --------------------------------------------------------------------------------------------
# The arithmetic: HBM traffic of a tiled matmul, achieved rates
# --------------------------------------------------------------------------------------------


def tiled_matmul_hbm_bytes(m: int, n: int, k: int, block_m: int, block_n: int, itemsize: int) -> int:
    """Bytes a tiled (m x k) @ (k x n) moves from and to HBM when no tile is reused through a cache.

    Each of the ceil(n / block_n) columns of programs reads all of A, each of the ceil(m / block_m)
    rows of programs reads all of B, and C is written once. ``block_m = 1`` is the naive kernel.
    """
    if min(m, n, k, block_m, block_n, itemsize) < 1:
        raise ValueError(f"sizes must be positive, got {(m, n, k, block_m, block_n, itemsize)}")
    elements = m * k * math.ceil(n / block_n) + k * n * math.ceil(m / block_m) + m * n
    return elements * itemsize


def matmul_rates(m: int, n: int, k: int, dtype: torch.dtype, seconds: float) -> dict[str, float]:
    """What an (m x k) @ (k x n) matmul in ``seconds`` achieved, as a dict with exactly these keys.

    flops        2 m n k
    bytes        (m k + k n + m n) * itemsize, the minimum traffic
    intensity    flops / bytes (FLOP per byte)
    flops_per_s  flops / seconds
    bytes_per_s  bytes / seconds
    """
    flops, num_bytes = matmul_flops_bytes(m, n, k, dtype)
    flops_per_s, bytes_per_s = achieved_rates(flops, num_bytes, seconds)
    return {
        "flops": float(flops),
        "bytes": float(num_bytes),
        "intensity": arithmetic_intensity(flops, num_bytes),
        "flops_per_s": flops_per_s,
        "bytes_per_s": bytes_per_s,
    }
