"""Chapter 08 (fusion): element-wise and row-wise kernels in Triton that read and write memory once.

- ``add``: the vector add of the Triton tutorial, one 1-D block per program.
- ``bias_gelu``: y = gelu(x + bias) (exact erf GELU), forward and backward kernels in an autograd.Function;
  ``fast_erf=True`` swaps the library's erf for the fitted erfc of ``course_lib.erfc`` (one exponential,
  one approximate reciprocal, a degree-4 polynomial; relative error below 1e-4, far under bf16's rounding).
- ``softmax``: a numerically stable softmax over the last dimension, forward and backward, with
  an online (running max and sum) pass for rows wider than one block; ``softmax_backward``
  exposes the backward kernel on its own.
- ``cross_entropy``: the mean cross-entropy of (tokens, vocabulary) logits, as ``F.cross_entropy``
  with ``ignore_index``: a forward kernel (online logsumexp, one read of the logits) and a backward
  kernel (softmax - onehot from the saved logsumexp) in an autograd.Function;
  ``cross_entropy_forward`` and ``cross_entropy_backward`` are the two launches (the latter can
  write over the logits, ``out=logits``); ``cross_entropy_forward_backward`` is both in one launch
  for a caller that knows the gradient's scale up front (``course_lib.lm_head_loss``, chunk by
  chunk), reading each row a second time soon after the first. A target outside [0, vocab) that is not
  ``ignore_index`` makes the loss NaN (torch raises there).
- ``adam_step_`` and ``FlatAdam``: a whole Adam/AdamW step in one pass over flat fp32 buffers.

Every kernel computes in fp32 and stores in the tensor's own dtype. Under Triton's CPU
interpreter (no GPU) keep shapes tiny: each program runs in Python.

    y = fusion.bias_gelu(x, b)                 # x: (..., n), b: (n,)
    y = fusion.bias_gelu(x, b, fast_erf=True)  # the same, with the cheaper erfc
    p = fusion.softmax(x)                      # over the last dim
    p = fusion.softmax(x, block_size=16)       # force the online path for rows wider than 16
    loss = fusion.cross_entropy(logits, targets, ignore_index=-100)   # logits (n, vocab), targets (n,)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from course_lib import env  # noqa: F401  (must come first: selects Triton's interpreter without a GPU)

# isort: split
import torch
import triton
import triton.language as tl

from course_lib.erfc import ERFC_COEFFS, ERFC_P

__all__ = [
    "SOFTMAX_MAX_BLOCK",
    "ELEMENTWISE_BLOCK",
    "BIAS_GELU_TILE",
    "add",
    "bias_gelu",
    "bias_gelu_forward",
    "bias_gelu_backward",
    "softmax",
    "softmax_backward",
    "CROSS_ENTROPY_BLOCK",
    "cross_entropy_forward",
    "cross_entropy_backward",
    "cross_entropy_forward_backward",
    "cross_entropy",
    "adam_step_",
    "FlatAdam",
]

Tensor = torch.Tensor

# Largest row that the softmax keeps whole in registers (one block); wider rows take the online path.
SOFTMAX_MAX_BLOCK = 16384
# Elements per program of the element-wise kernels: enough work per program to hide memory
# latency with several 16-byte loads per thread in flight.
ELEMENTWISE_BLOCK = 4096
# Elements per program of bias + GELU: 16 per thread at 4 warps. With the GELU's arithmetic in the
# loop, larger tiles ran slower, smaller ones no faster (the tile rows of benchmarks.gelu_steps).
BIAS_GELU_TILE = 2048
# Columns per block of the cross-entropy kernels: a 128k-entry vocabulary row is walked in 32 blocks.
CROSS_ENTROPY_BLOCK = 4096


def _check_contiguous(*tensors: Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"expected a contiguous tensor, got shape {tuple(t.shape)} with strides {t.stride()}")


# ---- vector add ------------------------------------------------------------------------------

@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    # int64 offsets: a flat index past 2**31 elements would overflow int32.
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n  # the last program may run past the end
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


def add(x: Tensor, y: Tensor, *, block_size: int = ELEMENTWISE_BLOCK) -> Tensor:
    """x + y for contiguous tensors of the same shape, dtype and device, as one Triton kernel."""
    if x.shape != y.shape or x.dtype != y.dtype:
        raise ValueError(f"add needs equal shapes and dtypes, got {tuple(x.shape)} {x.dtype} and {tuple(y.shape)} {y.dtype}")
    _check_contiguous(x, y)
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _add_kernel[(triton.cdiv(n, block_size),)](x, y, out, n, BLOCK=block_size, num_warps=4)
    return out


# ---- bias + GELU -----------------------------------------------------------------------------

# The fitted erfc (course_lib.erfc) as constants the kernels can read: t = 1 / (1 + p |z| / sqrt 2).
_ERFC_P_Z = tl.constexpr(ERFC_P / math.sqrt(2.0))
_ERFC_C0, _ERFC_C1, _ERFC_C2, _ERFC_C3, _ERFC_C4 = (tl.constexpr(c) for c in ERFC_COEFFS)
_HALF_NEG_LOG2E = tl.constexpr(-0.5 / math.log(2.0))


@triton.jit
def _normal_cdf(z, FAST: tl.constexpr):
    """Phi(z) and exp(-z^2 / 2) for fp32 z: from the library's erf, or from the fitted erfc sharing the exponential."""
    e = tl.math.exp2(z * z * _HALF_NEG_LOG2E)  # exp(-z^2 / 2) with the constants folded: one multiply fewer
    if FAST:
        t = tl.fdiv(1.0, 1.0 + _ERFC_P_Z * tl.abs(z), ieee_rounding=False)  # an approximate reciprocal is enough
        tail = 0.5 * t * (_ERFC_C0 + t * (_ERFC_C1 + t * (_ERFC_C2 + t * (_ERFC_C3 + t * _ERFC_C4)))) * e  # Phi(-|z|)
        cdf = tl.where(z >= 0, 1.0 - tail, tail)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))  # Phi(z) = (1 + erf(z / sqrt 2)) / 2
    return cdf, e


@triton.jit
def _load_tile(ptrs, mask, EVEN: tl.constexpr):
    """Load a tile as fp32: whole (EVEN, no mask to compute) or masked with zeros outside."""
    if EVEN:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _store_tile(ptrs, value, mask, EVEN: tl.constexpr):
    """Store a tile in the pointer's dtype: whole (EVEN) or masked."""
    value = value.to(ptrs.dtype.element_ty)
    if EVEN:
        tl.store(ptrs, value)
    else:
        tl.store(ptrs, value, mask=mask)


@triton.jit
def _bias_gelu_fwd_kernel(x_ptr, b_ptr, y_ptr, n_rows, n_cols,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr, EVEN: tl.constexpr):
    # A (BLOCK_M, BLOCK_N) tile per program: the bias block is loaded once and reused for
    # BLOCK_M rows, and each row segment is contiguous, so loads vectorise. The tile's first row
    # is a 64-bit offset, the rest 32-bit; EVEN (every tile whole) drops the masks. On the H200
    # these two cut the integer work per element enough to matter once the erf is cheap.
    row0 = tl.program_id(0) * BLOCK_M
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    base = row0.to(tl.int64) * n_cols
    offs = tl.arange(0, BLOCK_M)[:, None] * n_cols + cols[None, :]
    mask = (row0 + tl.arange(0, BLOCK_M)[:, None] < n_rows) & (cols[None, :] < n_cols)  # unused when EVEN
    b = _load_tile(b_ptr + cols, cols < n_cols, EVEN)
    z = _load_tile(x_ptr + base + offs, mask, EVEN) + b[None, :]
    cdf, _ = _normal_cdf(z, FAST)
    _store_tile(y_ptr + base + offs, z * cdf, mask, EVEN)


@triton.jit
def _bias_gelu_bwd_kernel(dy_ptr, x_ptr, b_ptr, dx_ptr, dbias_part_ptr, n_rows, n_cols,
                          ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FAST: tl.constexpr,
                          EVEN: tl.constexpr):
    # Each program walks ROWS rows of one column block in chunks of BLOCK_M, writes dx, and
    # sums its dx over those rows into one row of partial bias gradients (fp32). A small
    # torch.sum over the partials finishes dbias: deterministic, unlike atomics. Offsets and
    # masks as in the forward.
    row0 = tl.program_id(0) * ROWS
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    offs = tl.arange(0, BLOCK_M)[:, None] * n_cols + cols[None, :]
    for r in range(0, ROWS, BLOCK_M):
        base = (row0 + r).to(tl.int64) * n_cols
        mask = (row0 + r + tl.arange(0, BLOCK_M)[:, None] < n_rows) & col_ok[None, :]  # unused when EVEN
        z = _load_tile(x_ptr + base + offs, mask, EVEN) + b[None, :]
        dy = _load_tile(dy_ptr + base + offs, mask, EVEN)
        cdf, e = _normal_cdf(z, FAST)
        dx = dy * (cdf + z * e * 0.3989422804014327)  # d/dz [z Phi(z)] = Phi(z) + z phi(z), phi = e / sqrt(2 pi)
        _store_tile(dx_ptr + base + offs, dx, mask, EVEN)
        acc += tl.sum(dx, axis=0)  # masked lanes hold dy = 0, hence dx = 0
    tl.store(dbias_part_ptr + tl.program_id(0).to(tl.int64) * n_cols + cols, acc, mask=col_ok)


def _bias_gelu_blocks(n_rows: int, n_cols: int) -> tuple[int, int]:
    """Tile (BLOCK_M, BLOCK_N) of about BIAS_GELU_TILE elements: wide along the row, several rows when rows are short."""
    block_n = min(triton.next_power_of_2(n_cols), 1024)
    block_m = max(1, min(triton.next_power_of_2(n_rows), BIAS_GELU_TILE // block_n))
    if block_m * n_cols >= 2**31:
        raise ValueError(f"rows of {n_cols} elements are too long for the 32-bit offsets inside a tile")
    return block_m, block_n


def bias_gelu_forward(x2: Tensor, bias: Tensor, *, fast_erf: bool = False) -> Tensor:
    """gelu(x2 + bias) by one launch, for a contiguous 2-D ``x2`` and ``bias`` (n_cols,); ``bias_gelu``'s forward."""
    n_rows, n_cols = x2.shape
    y = torch.empty_like(x2)
    if x2.numel():
        block_m, block_n = _bias_gelu_blocks(n_rows, n_cols)
        grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n))
        even = n_rows % block_m == 0 and n_cols % block_n == 0
        _bias_gelu_fwd_kernel[grid](x2, bias, y, n_rows, n_cols, BLOCK_M=block_m, BLOCK_N=block_n, FAST=fast_erf,
                                    EVEN=even, num_warps=4)
    return y


def bias_gelu_backward(dy2: Tensor, x2: Tensor, bias: Tensor, *, fast_erf: bool = False) -> tuple[Tensor, Tensor]:
    """(dx, dbias) of gelu(x2 + bias) for the incoming ``dy2``, all contiguous 2-D but ``bias``; ``bias_gelu``'s backward."""
    n_rows, n_cols = x2.shape
    dx = torch.empty_like(x2)
    if x2.numel() == 0:
        return dx, torch.zeros_like(bias)
    block_m, block_n = _bias_gelu_blocks(n_rows, n_cols)
    # Up to 64 rows per program (a multiple of BLOCK_M): keeps the partial-sum buffer 64x smaller than dx.
    rows = block_m * max(1, min(64 // block_m, triton.cdiv(n_rows, block_m)))
    grid = (triton.cdiv(n_rows, rows), triton.cdiv(n_cols, block_n))
    partial = torch.empty(grid[0], n_cols, device=x2.device, dtype=torch.float32)
    even = n_rows % rows == 0 and n_cols % block_n == 0
    _bias_gelu_bwd_kernel[grid](dy2, x2, bias, dx, partial, n_rows, n_cols,
                                ROWS=rows, BLOCK_M=block_m, BLOCK_N=block_n, FAST=fast_erf, EVEN=even, num_warps=4)
    return dx, partial.sum(dim=0).to(bias.dtype)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor, fast_erf: bool) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, bias)
        ctx.shape, ctx.fast_erf = x.shape, fast_erf
        return bias_gelu_forward(x2, bias, fast_erf=fast_erf).view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor, None]:
        x2, bias = ctx.saved_tensors
        dx, dbias = bias_gelu_backward(dy.contiguous().view(x2.shape), x2, bias, fast_erf=ctx.fast_erf)
        return dx.view(ctx.shape), dbias, None


def bias_gelu(x: Tensor, bias: Tensor, *, fast_erf: bool = False) -> Tensor:
    """gelu(x + bias) (exact GELU; ``fast_erf``: through the fitted erfc), bias (n,) over x's last dim; differentiable."""
    if x.dim() == 0 or bias.shape != (x.shape[-1],):
        raise ValueError(f"bias must have shape (x.shape[-1],) = ({x.shape[-1] if x.dim() else '?'},), got {tuple(bias.shape)}")
    if bias.dtype != x.dtype:
        raise ValueError(f"x and bias must share a dtype, got {x.dtype} and {bias.dtype}")
    _check_contiguous(x, bias)
    return _BiasGelu.apply(x, bias, fast_erf)


# ---- softmax ---------------------------------------------------------------------------------

@triton.jit
def _softmax_fwd_rows_kernel(x_ptr, y_ptr, n_rows, n_cols,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # BLOCK_M whole rows per program, held in registers: one read and one write per element.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    # -inf in the padding columns: it never wins the max and exp(-inf) adds 0 to the sum.
    x = tl.load(x_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
    # Padding rows (past n_rows) get 0 instead, so that they compute finite values that are never stored.
    x = tl.where(rows[:, None] < n_rows, x, 0.0)
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    y = e / tl.sum(e, axis=1)[:, None]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_fwd_online_kernel(x_ptr, y_ptr, n_cols, BLOCK_N: tl.constexpr):
    # One row per program, too wide for registers. Pass 1 keeps, per lane, a running max m and a
    # running sum s of exp(x - m), rescaling s whenever m grows; the lanes are combined at the
    # end. Pass 2 reads the row again and writes exp(x - m) / s: two reads and one write in all.
    base = tl.program_id(0).to(tl.int64) * n_cols
    m = tl.full((BLOCK_N,), -float("inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # A lane that has only seen -inf keeps s = 0 (exp(-inf - -inf) would be NaN).
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    row_max = tl.max(m, axis=0)
    row_sum = tl.sum(s * tl.exp(m - row_max), axis=0)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x = tl.load(x_ptr + base + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(y_ptr + base + cols, (tl.exp(x - row_max) / row_sum).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_rows_kernel(dy_ptr, y_ptr, dx_ptr, n_rows, n_cols,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # dx = y * (dy - sum(dy * y)) over each row, rows held whole in registers.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dot = tl.sum(dy * y, axis=1)
    tl.store(dx_ptr + offs, (y * (dy - dot[:, None])).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_online_kernel(dy_ptr, y_ptr, dx_ptr, n_cols, BLOCK_N: tl.constexpr):
    # The wide-row backward: pass 1 sums dy * y block by block, pass 2 writes dx.
    base = tl.program_id(0).to(tl.int64) * n_cols
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        y = tl.load(y_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        acc += dy * y
    dot = tl.sum(acc, axis=0)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        y = tl.load(y_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + base + cols, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=mask)


def _softmax_launch(n_rows: int, n_cols: int, max_block: int) -> tuple[bool, int, int, int]:
    """(online?, BLOCK_M, BLOCK_N, num_warps) for a (n_rows, n_cols) softmax."""
    block_n = triton.next_power_of_2(n_cols)
    if block_n > max_block:
        return True, 1, max_block, min(32, max(4, max_block // 512))
    # Narrow rows: pack several per program so that each program still handles ~2048 elements.
    block_m = max(1, min(2048 // block_n, triton.next_power_of_2(n_rows)))
    # About 16 elements per thread for wide rows (8192 fp32 columns: 16 warps).
    num_warps = min(32, max(4, block_m * block_n // 512))
    return False, block_m, block_n, num_warps


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, max_block: int) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # the kernels find row i at i * n_cols: a view is packed first
        n_rows, n_cols = x2.shape
        y = torch.empty_like(x2)
        online, block_m, block_n, warps = _softmax_launch(n_rows, n_cols, max_block)
        if x2.numel():
            if online:
                _softmax_fwd_online_kernel[(n_rows,)](x2, y, n_cols, BLOCK_N=block_n, num_warps=warps)
            else:
                _softmax_fwd_rows_kernel[(triton.cdiv(n_rows, block_m),)](
                    x2, y, n_rows, n_cols, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(y)
        ctx.max_block = max_block
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None]:
        (y,) = ctx.saved_tensors
        return _softmax_backward(y, dy.reshape(y.shape).contiguous(), ctx.max_block).view(ctx.shape), None


def _softmax_backward(y: Tensor, dy: Tensor, max_block: int) -> Tensor:
    """dx for a (n_rows, n_cols) softmax output ``y`` and incoming gradient ``dy``."""
    n_rows, n_cols = y.shape
    dx = torch.empty_like(y)
    online, block_m, block_n, warps = _softmax_launch(n_rows, n_cols, max_block)
    if y.numel():
        if online:
            _softmax_bwd_online_kernel[(n_rows,)](dy, y, dx, n_cols, BLOCK_N=block_n, num_warps=warps)
        else:
            _softmax_bwd_rows_kernel[(triton.cdiv(n_rows, block_m),)](
                dy, y, dx, n_rows, n_cols, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return dx


def softmax(x: Tensor, *, block_size: int | None = None) -> Tensor:
    """Softmax over the last dim of a tensor of any layout (a view is packed first); differentiable.

    Rows up to ``block_size`` wide (a power of two, default ``SOFTMAX_MAX_BLOCK``) are done in
    registers in one pass; wider rows by an online pass over column blocks of that size.
    """
    max_block = SOFTMAX_MAX_BLOCK if block_size is None else block_size
    if max_block < 1 or max_block & (max_block - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if x.dim() == 0:
        raise ValueError("softmax needs at least one dimension")
    return _Softmax.apply(x, max_block)


def softmax_backward(y: Tensor, dy: Tensor, *, block_size: int | None = None) -> Tensor:
    """The gradient y * (dy - sum(dy * y)) of a softmax over the last dim, from its output ``y`` and ``dy`` (any layouts)."""
    max_block = SOFTMAX_MAX_BLOCK if block_size is None else block_size
    if y.shape != dy.shape or y.dim() == 0:
        raise ValueError(f"y and dy must have one shape of at least one dim, got {tuple(y.shape)} and {tuple(dy.shape)}")
    n_cols = y.shape[-1]
    y2, dy2 = (t.reshape(-1, n_cols).contiguous() for t in (y, dy))
    return _softmax_backward(y2, dy2, max_block).view(y.shape)


# ---- cross-entropy over a large vocabulary ---------------------------------------------------

@triton.jit
def _row_logsumexp(base, n_cols, BLOCK: tl.constexpr):
    """log sum exp of one row of logits at ``base``, read once, block by block."""
    # A running max m and a running sum s of exp(x - m), rescaled whenever m grows (the online
    # softmax of the wide-row kernel above, with scalars instead of one pair per lane).
    m = -float("inf")  # scalars: fp32 once the loop has run
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row that is all -inf so far: s stays 0
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
    return m + tl.log(s)


@triton.jit
def _row_loss(base, target, lse, n_cols, ignore_index):
    """One row's loss lse - x[target]: 0 if the row is ignored, NaN if it counts but names no column."""
    # The target's logit is one more element, read only for rows that count and name a column. A
    # row that counts but names no column gets a NaN loss: the mean turns NaN without a host sync
    # (torch checks with a device-side assert instead), and nothing outside the row is read.
    counts = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    x_target = tl.load(base + target, mask=counts & in_range, other=0.0).to(tl.float32)
    return tl.where(counts, tl.where(in_range, lse - x_target, float("nan")), 0.0)


@triton.jit
def _row_softmax_grad(base, out_base, target, lse, scale, n_cols, ignore_index, BLOCK: tl.constexpr):
    """Write (softmax(x) - onehot(target)) * scale over one row: 0 if ignored, NaN if the target names no column."""
    # softmax(x) = exp(x - lse) from the row's logsumexp: one read of the logits, one write of the
    # gradient, no reduction left to do. Each block is read before the same block is written.
    counts = target != ignore_index
    scale = tl.where(counts, scale, 0.0)
    scale = tl.where(counts & ((target < 0) | (target >= n_cols)), float("nan"), scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=-float("inf")).to(tl.float32)
        d = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
        tl.store(out_base + cols, d.to(out_base.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_fwd_kernel(logits_ptr, targets_ptr, loss_ptr, lse_ptr, n_cols, row_stride, ignore_index,
                              BLOCK: tl.constexpr):
    # One program per row (token): its logsumexp and loss.
    row = tl.program_id(0).to(tl.int64)  # int64: 16k tokens x 128k vocabulary is past 2**31 elements
    base = logits_ptr + row * row_stride
    lse = _row_logsumexp(base, n_cols, BLOCK)
    tl.store(loss_ptr + row, _row_loss(base, tl.load(targets_ptr + row), lse, n_cols, ignore_index))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _cross_entropy_bwd_kernel(logits_ptr, targets_ptr, lse_ptr, scale_ptr, dlogits_ptr, n_cols, row_stride,
                              ignore_index, BLOCK: tl.constexpr):
    # One program per row: its gradient from the saved logsumexp. scale = d(loss)/d(loss of a row):
    # grad_output / number of rows that count.
    row = tl.program_id(0).to(tl.int64)
    _row_softmax_grad(logits_ptr + row * row_stride, dlogits_ptr + row * n_cols, tl.load(targets_ptr + row),
                      tl.load(lse_ptr + row), tl.load(scale_ptr), n_cols, ignore_index, BLOCK)


@triton.jit
def _cross_entropy_fwd_bwd_kernel(logits_ptr, targets_ptr, loss_ptr, dlogits_ptr, scale_ptr, n_rows, n_cols,
                                  row_stride, ignore_index, BLOCK: tl.constexpr):
    # Forward and backward in one launch, for a caller that knows the gradient's scale before the
    # loss (the chunked LM head). Each program takes rows pid, pid + programs, ...; a row is read
    # twice, the second time soon after the first, when L2 may still hold it.
    scale = tl.load(scale_ptr)
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0).to(tl.int64)):  # int64 rows
        base = logits_ptr + row * row_stride
        target = tl.load(targets_ptr + row)
        lse = _row_logsumexp(base, n_cols, BLOCK)
        tl.store(loss_ptr + row, _row_loss(base, target, lse, n_cols, ignore_index))
        _row_softmax_grad(base, dlogits_ptr + row * n_cols, target, lse, scale, n_cols, ignore_index, BLOCK)


def _check_cross_entropy_args(logits: Tensor, targets: Tensor) -> None:
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"expected logits (n, vocab) and targets (n,), got {tuple(logits.shape)} and {tuple(targets.shape)}")
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be class indices (int64), got {targets.dtype}")
    if logits.stride(-1) != 1:
        raise ValueError(f"the vocabulary dim of logits must be contiguous, got strides {logits.stride()}")


def _cross_entropy_block(n_cols: int, block_size: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of ``n_cols``: a block of at most ``block_size`` columns, about 16 per thread."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    block = min(block_size, triton.next_power_of_2(max(n_cols, 1)))
    return block, min(16, max(1, block // 512))


def _dlogits_out(logits: Tensor, out: Tensor | None) -> Tensor:
    """Where the logits' gradient goes: ``out`` once checked (contiguous, the logits' shape and dtype; if it
    shares their memory, the logits themselves), or a new tensor."""
    if out is None:
        return torch.empty_like(logits, memory_format=torch.contiguous_format)
    if out.shape != logits.shape or out.dtype != logits.dtype or out.device != logits.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(logits.shape)} {logits.dtype} tensor on {logits.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device} with strides {out.stride()}")
    same_memory = out.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    if same_memory and (out.data_ptr() != logits.data_ptr() or out.stride() != logits.stride()):
        raise ValueError("out shares memory with the logits: it must then be the logits themselves, contiguous")
    return out


def cross_entropy_forward(logits: Tensor, targets: Tensor, *, ignore_index: int = -100,
                          block_size: int = CROSS_ENTROPY_BLOCK) -> tuple[Tensor, Tensor]:
    """(losses, lse) of (n, vocab) logits, one kernel: fp32 per-row loss (0 if ignored, NaN if no column) and logsumexp."""
    _check_cross_entropy_args(logits, targets)
    n_rows, n_cols = logits.shape
    losses = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
    lse = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
    block, warps = _cross_entropy_block(n_cols, block_size)
    if n_rows:
        _cross_entropy_fwd_kernel[(n_rows,)](logits, targets, losses, lse, n_cols, logits.stride(0), ignore_index,
                                             BLOCK=block, num_warps=warps)
    return losses, lse


def cross_entropy_backward(logits: Tensor, targets: Tensor, lse: Tensor, scale: Tensor, *, ignore_index: int = -100,
                           block_size: int = CROSS_ENTROPY_BLOCK, out: Tensor | None = None) -> Tensor:
    """dlogits = (softmax(logits) - onehot(targets)) * scale, 0 on ignored rows, one kernel; ``scale``: 1 fp32 value.

    ``out``: a contiguous tensor shaped and typed like the logits to write dlogits into; it may be
    the logits themselves (each program reads a block of its own row before writing that block, and
    reads no element of the logits again), but no other view of their memory.
    """
    _check_cross_entropy_args(logits, targets)
    n_rows, n_cols = logits.shape
    dlogits = _dlogits_out(logits, out)
    block, warps = _cross_entropy_block(n_cols, block_size)
    if n_rows:
        _cross_entropy_bwd_kernel[(n_rows,)](logits, targets, lse, scale, dlogits, n_cols, logits.stride(0),
                                             ignore_index, BLOCK=block, num_warps=warps)
    return dlogits


def cross_entropy_forward_backward(logits: Tensor, targets: Tensor, scale: Tensor, *, ignore_index: int = -100,
                                   block_size: int = CROSS_ENTROPY_BLOCK, out: Tensor | None = None,
                                   programs: int | None = None) -> tuple[Tensor, Tensor]:
    """(losses, dlogits) in one kernel: ``cross_entropy_forward``'s losses and ``cross_entropy_backward``'s gradient.

    ``scale`` and ``out`` as for ``cross_entropy_backward``. ``programs``: how many programs share
    the rows, each taking rows pid, pid + programs, ... (default: one per row; on an H100 no smaller
    grid that ``benchmarks.cross_entropy`` tried was faster).
    """
    _check_cross_entropy_args(logits, targets)
    n_rows, n_cols = logits.shape
    dlogits = _dlogits_out(logits, out)
    losses = torch.empty(n_rows, device=logits.device, dtype=torch.float32)
    if programs is None:
        programs = max(n_rows, 1)
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
        raise ValueError(f"programs must be an int >= 1 or None, got {programs!r}")
    block, warps = _cross_entropy_block(n_cols, block_size)
    if n_rows:
        _cross_entropy_fwd_bwd_kernel[(min(programs, n_rows),)](logits, targets, losses, dlogits, scale, n_rows,
                                                                n_cols, logits.stride(0), ignore_index,
                                                                BLOCK=block, num_warps=warps)
    return losses, dlogits


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int, block_size: int) -> Tensor:
        losses, lse = cross_entropy_forward(logits, targets, ignore_index=ignore_index, block_size=block_size)
        n_valid = (targets != ignore_index).sum()
        # Saved: the logits (alive anyway as the model's output) and n floats, never an (n, vocab) softmax.
        ctx.save_for_backward(logits, targets, lse, n_valid)
        ctx.ignore_index, ctx.block_size = ignore_index, block_size
        return losses.sum() / n_valid  # the mean over the rows that count; NaN when none does, as in torch

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        logits, targets, lse, n_valid = ctx.saved_tensors
        scale = (grad / n_valid).to(torch.float32).reshape(1)  # stays on the device: no .item(), no sync
        dlogits = cross_entropy_backward(logits, targets, lse, scale, ignore_index=ctx.ignore_index,
                                         block_size=ctx.block_size)
        return dlogits, None, None, None


def cross_entropy(logits: Tensor, targets: Tensor, *, ignore_index: int = -100,
                  block_size: int = CROSS_ENTROPY_BLOCK) -> Tensor:
    """Mean cross-entropy of (n, vocab) logits and (n,) class indices, as F.cross_entropy; fp32; differentiable.

    One kernel forward (online logsumexp) and one backward (softmax - onehot from the saved
    logsumexp); rows whose target is ``ignore_index`` count neither in the mean nor in the gradient.
    A target outside [0, vocab) that is not ``ignore_index`` gives a NaN loss and NaN gradient row
    (no host sync to check it; F.cross_entropy raises instead).
    """
    return _CrossEntropy.apply(logits, targets, ignore_index, block_size)


# ---- fused Adam ------------------------------------------------------------------------------

@triton.jit
def _adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, lr, beta1, beta2, eps, weight_decay,
                 step_size, bias_correction2_sqrt,
                 DECOUPLED: tl.constexpr, BLOCK: tl.constexpr):
    # Reads p, g, m, v once and writes p, m, v once: 7 passes over a parameter-sized tensor
    # instead of the 18 of the unfused for-loop (chapter 04's count).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if DECOUPLED:
        p = p * (1.0 - lr * weight_decay)  # AdamW: shrink the weights, leave the gradient alone
    else:
        g = g + weight_decay * p  # Adam: L2 term in the gradient (weight_decay = 0: no-op)
    m = m + (1.0 - beta1) * (g - m)  # lerp towards g, as torch.optim.Adam does
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - step_size * (m / denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


def adam_step_(
    params: Tensor,
    grads: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled: bool = False,
    block_size: int = ELEMENTWISE_BLOCK,
) -> None:
    """One Adam (or, with ``decoupled``, AdamW) step ``step`` >= 1 in place on flat fp32 buffers, in one kernel."""
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    for name, t in (("grads", grads), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != params.shape or t.dtype != params.dtype or t.device != params.device:
            raise ValueError(f"{name} must match params in shape, dtype and device")
    if params.dtype != torch.float32:
        raise ValueError(f"adam_step_ works on fp32 buffers, got {params.dtype}")
    _check_contiguous(params, grads, exp_avg, exp_avg_sq)
    n = params.numel()
    if n == 0:
        return
    # Bias corrections in Python (float64), as torch.optim.Adam computes them on the host.
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    _adam_kernel[(triton.cdiv(n, block_size),)](
        params, grads, exp_avg, exp_avg_sq, n, lr, beta1, beta2, eps, weight_decay,
        step_size, bias_correction2_sqrt, DECOUPLED=decoupled, BLOCK=block_size, num_warps=8)


@dataclass
class _FlatGroup:
    """One parameter group's flat buffers; each parameter's data and grad are views into them."""

    params: list[Tensor]
    offsets: list[int]
    flat_param: Tensor
    flat_grad: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: int = 0


class FlatAdam(torch.optim.Optimizer):
    """Adam/AdamW over one flat buffer per parameter group: each ``step()`` is one kernel launch per group.

    At construction every parameter's data is copied into the group's flat buffer and the
    parameter becomes a view into it; so does its gradient (``p.grad`` is set to a view of a
    flat, zeroed gradient buffer, which backward accumulates into). ``zero_grad()`` zeroes that
    buffer in place. A gradient replaced from outside (``p.grad = ...`` or ``set_to_none``) is
    copied back into the buffer at the next step; a parameter without a gradient counts as
    zero gradient. All parameters must be fp32, contiguous and on one device.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled: bool = False,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid hyper-parameters lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=decoupled)
        super().__init__(params, defaults)
        self.flat_groups = [self._flatten(group["params"]) for group in self.param_groups]

    @staticmethod
    @torch.no_grad()
    def _flatten(params: list[Tensor]) -> _FlatGroup:
        if not params:
            raise ValueError("a parameter group needs at least one parameter")
        device = params[0].device
        for p in params:
            if p.dtype != torch.float32 or p.device != device or not p.is_contiguous():
                raise ValueError(f"FlatAdam needs contiguous fp32 parameters on one device, got {p.dtype} "
                                 f"on {p.device} (first parameter on {device})")
        sizes = [p.numel() for p in params]
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        flat_param = torch.cat([p.detach().reshape(-1) for p in params])
        flat_grad = torch.zeros_like(flat_param)
        group = _FlatGroup(params, offsets, flat_param, flat_grad, torch.zeros_like(flat_param), torch.zeros_like(flat_param))
        for i, p in enumerate(params):
            p.data = flat_param[offsets[i]:offsets[i + 1]].view_as(p)
            if p.grad is not None:
                flat_grad[offsets[i]:offsets[i + 1]].copy_(p.grad.reshape(-1))
            p.grad = flat_grad[offsets[i]:offsets[i + 1]].view_as(p)
        return group

    @staticmethod
    @torch.no_grad()
    def _regather_grads(group: _FlatGroup) -> None:
        """Put back into the flat buffer any gradient that is no longer a view of it."""
        for i, p in enumerate(group.params):
            view = group.flat_grad[group.offsets[i]:group.offsets[i + 1]]
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
            else:
                continue
            p.grad = view.view_as(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers in place (``set_to_none`` is ignored: the views must survive)."""
        for group in self.flat_groups:
            group.flat_grad.zero_()
            for i, p in enumerate(group.params):
                if p.grad is None or p.grad.data_ptr() != group.flat_grad[group.offsets[i]:].data_ptr():
                    p.grad = group.flat_grad[group.offsets[i]:group.offsets[i + 1]].view_as(p)

    # torch types a closure's loss as a float; here, as in torch's own optimizers, it is the loss tensor.
    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:  # type: ignore[override]
        """One Adam/AdamW step of every group, one kernel each; with ``closure``, re-evaluate the loss first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for hyper, group in zip(self.param_groups, self.flat_groups):
            self._regather_grads(group)
            group.step += 1
            beta1, beta2 = hyper["betas"]
            adam_step_(group.flat_param, group.flat_grad, group.exp_avg, group.exp_avg_sq, step=group.step,
                       lr=hyper["lr"], beta1=beta1, beta2=beta2, eps=hyper["eps"],
                       weight_decay=hyper["weight_decay"], decoupled=hyper["decoupled"])
        return loss
