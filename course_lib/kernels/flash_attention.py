"""FlashAttention-2 in Triton: a fused forward that saves the logsumexp, and a backward that recomputes P (chapter 10).

Attention softmax(Q K^T * scale) V never materialises the N x N score matrix here. The forward
kernel (Dao et al. 2022, FlashAttention; Dao 2023, FlashAttention-2) gives each program one
block of query rows of one (batch, head) and streams K and V past it in blocks, keeping a
running row maximum ``m_i``, a running row sum ``l_i`` and an fp32 accumulator that is rescaled
whenever the maximum grows (``attention_step``). Its loop has two phases: the key blocks that
need no mask (left of the diagonal when causal, every whole block otherwise), then the few that
do (the diagonal, or the ragged last block). It writes O and the per-row logsumexp, nothing else.

The backward recomputes P = exp(S - lse) from the saved logsumexp, as FlashAttention-2 does, but
divides the work differently. FA2's own backward (Algorithm 2 of the paper, and its CUDA kernels)
gives each program one K/V block, loops over the query blocks, and adds each program's share of
dQ into memory with atomic additions. Here, as in the Triton tutorial "Fused Attention", dK/dV
and dQ have separate owners and no atomics are used, in three kernels:

1. ``_bwd_preprocess``: delta_i = rowsum(dO_i * O_i), one number per query row;
2. ``dkdv_kernel``: one program per K/V block, looping over query blocks; it recomputes P and
   accumulates dV = P^T dO and dK = dS^T Q;
3. ``dq_kernel``: one program per query block, looping over K/V blocks; it recomputes P again and
   accumulates dQ = dS K.

With dS = P * (dP - delta) and dP = dO V^T. Each output block is owned by exactly one program,
so every kernel writes plain stores, autotunes safely and is deterministic. The price is doing
S = Q K^T and dP = dO V^T in both kernels: 7 matrix products of N x N x head_dim per head
(4 in ``dkdv_kernel``, 3 in ``dq_kernel``), where an atomic-dQ backward does 5 and the forward 2.

Exponentials use ``exp2``: log2(e) is folded into the softmax scale, so exp(x * scale) becomes
exp2(x * scale * log2(e)), one multiply that the compiler fuses with the subtraction of the max.

``attention_step``, ``flash_forward_kernel`` and ``dkdv_kernel`` are the references of the
chapter's Triton exercises (same names, same signatures); every kernel works on contiguous
(batch * heads, N, head_dim) tensors.

    from course_lib.kernels.flash_attention import flash_attention, flash_attention_forward
    out = flash_attention(q, k, v, causal=True)          # (batch, heads, seq, head_dim), autograd-aware
    out, lse = flash_attention_forward(q, k, v, True, None)

Under Triton's CPU interpreter (no GPU) the kernels run in fp32 with one small block size;
fp16/bf16 inputs are computed in fp32 there and cast back.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from course_lib import env  # sets TRITON_INTERPRET=1 without a GPU; must precede triton

# isort: split
import triton
import triton.language as tl

__all__ = [
    "LOG2E",
    "HEAD_DIMS",
    "INTERPRETER_BLOCK",
    "attention_step",
    "flash_forward_kernel",
    "dkdv_kernel",
    "dq_kernel",
    "compute_dtype",
    "launch_config",
    "flash_attention_forward",
    "flash_attention_dkdv",
    "flash_attention_dq",
    "flash_attention_backward",
    "FlashAttention",
    "flash_attention",
]

LOG2E: float = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
HEAD_DIMS: tuple[int, ...] = (16, 32, 64, 128)
INTERPRETER_BLOCK: int = 16  # every block size under the interpreter: tiny grids, tl.dot-legal

# Masking a score with -inf would give exp2(-inf - (-inf)) = NaN in a row whose every score in the
# block is masked; a large finite negative value keeps the arithmetic finite and still underflows to 0.
_MASKED = tl.constexpr(-1.0e30)
_LOG2E = tl.constexpr(LOG2E)  # the same constant, readable inside kernels


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


@triton.jit
def attention_step(acc, m_i, l_i, q, k, v, qk_scale, keep):
    """Fold one K/V block into a query block's running (acc, m_i, l_i), scores in log2 units; ``keep=None``: no mask."""
    s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N) scores, fp32
    if keep is not None:  # decided when the kernel compiles: unmasked blocks carry no masking code
        s = tl.where(keep, s, _MASKED)
    # Online softmax: new max, rescale what was accumulated under the old one.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _fwd_blocks(acc, m_i, l_i, q, K, V, lo, hi, offs_m, N, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                STEP: tl.constexpr):
    """Fold the key blocks [lo, hi) of this head's K, V into the state; MASKED blocks apply the bounds and causal masks."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv = cols[:, None] * HEAD_DIM + offs_d[None, :]
        if MASKED:
            k = tl.load(K + kv, mask=cols[:, None] < N, other=0.0)
            v = tl.load(V + kv, mask=cols[:, None] < N, other=0.0)
            keep = cols[None, :] < N
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= cols[None, :])
            acc, m_i, l_i = STEP(acc, m_i, l_i, q, k, v, qk_scale, keep)
        else:
            k = tl.load(K + kv)  # every key of an unmasked block exists: no bounds mask either
            v = tl.load(V + kv)
            acc, m_i, l_i = STEP(acc, m_i, l_i, q, k, v, qk_scale, None)
    return acc, m_i, l_i


@triton.jit
def flash_forward_kernel(Q, K, V, Out, LSE, qk_scale, N,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, STEP: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, head); writes those rows of O and their logsumexp (natural log)."""
    if CAUSAL:
        # Later query blocks do more work under a causal mask: launch them first, so that the
        # short programs fill the gaps at the end instead of one long program running alone.
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        start_m = tl.program_id(0)
    head = tl.program_id(1) * N * HEAD_DIM  # this (batch, head)'s (N, HEAD_DIM) slice of Q, K, V, Out
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + head + rows, mask=offs_m[:, None] < N, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        # Blocks left of the diagonal are fully visible (no mask); blocks right of it are skipped
        # entirely; only the BLOCK_M columns on the diagonal pay for the element-wise mask.
        lo = start_m * BLOCK_M
        hi = tl.minimum(lo + BLOCK_M, N)
    else:
        # Every whole block without a mask, then the ragged last one (if N % BLOCK_N != 0) with one.
        lo = (N // BLOCK_N) * BLOCK_N
        hi = N
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, K + head, V + head, 0, lo, offs_m, N, qk_scale,
                                HEAD_DIM, BLOCK_N, False, CAUSAL, STEP)
    acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, q, K + head, V + head, lo, hi, offs_m, N, qk_scale,
                                HEAD_DIM, BLOCK_N, True, CAUSAL, STEP)
    # logsumexp of the scaled scores in natural-log units: (m_i + log2 l_i) is in log2 units.
    tl.store(LSE + tl.program_id(1) * N + offs_m, (m_i + tl.math.log2(l_i)) / _LOG2E, mask=offs_m < N)
    tl.store(Out + head + rows, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=offs_m[:, None] < N)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess(Out, DO, DELTA, N, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O) for BLOCK_M rows of one (batch, head); O (``Out``) and dO are contiguous."""
    off_hz = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs = off_hz * N * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(Out + offs, mask=offs_m[:, None] < N, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=offs_m[:, None] < N, other=0.0).to(tl.float32)
    tl.store(DELTA + off_hz * N + offs_m, tl.sum(o * do, 1), mask=offs_m < N)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, Q, DO, LSE, DELTA, lo, hi, offs_n, N, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
):
    """Accumulate one K/V block's dK and dV over the query blocks [lo, hi); Q, dO are this head's (N, D) slices."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q = tl.load(Q + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=rows[:, None] < N, other=0.0)
        do = tl.load(DO + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=rows[:, None] < N, other=0.0)
        # lse = +inf on rows past N makes their recomputed probabilities exactly 0.
        lse = tl.load(LSE + rows, mask=rows < N, other=float("inf")) * _LOG2E
        delta = tl.load(DELTA + rows, mask=rows < N, other=0.0)
        # Work on the transposed tile, (BLOCK_N keys) x (BLOCK_M queries), so dK and dV come out directly.
        pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
        if MASKED:
            pT = tl.where(rows[None, :] >= offs_n[:, None], pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, qk_scale, sm_scale, N,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):
    """One program: dK and dV of BLOCK_N keys of one (batch, head); all tensors contiguous (B*H, N, D)."""
    off_hz = tl.program_id(1)
    start_n = tl.program_id(0) * BLOCK_N
    head = off_hz * N * HEAD_DIM
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_offs = head + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + kv_offs, mask=offs_n[:, None] < N, other=0.0)
    v = tl.load(V + kv_offs, mask=offs_n[:, None] < N, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    Qh, DOh, LSEh, DELTAh = Q + head, DO + head, LSE + off_hz * N, DELTA + off_hz * N
    if CAUSAL:
        # Queries above this key block never see it: start at the diagonal; only the BLOCK_N
        # query rows that cross the diagonal need the element mask.
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, start_n, start_n + BLOCK_N, offs_n, N,
                                 qk_scale, HEAD_DIM, BLOCK_M, True)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, start_n + BLOCK_N, N, offs_n, N,
                                 qk_scale, HEAD_DIM, BLOCK_M, False)
    else:
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, 0, N, offs_n, N,
                                 qk_scale, HEAD_DIM, BLOCK_M, False)
    # S = scale * Q K^T, so dK picks up the scale once, here, instead of in every block.
    tl.store(DK + kv_offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=offs_n[:, None] < N)
    tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < N)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse, delta, K, V, lo, hi, offs_m, N, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):
    """Accumulate one query block's dQ over the K/V blocks [lo, hi); K, V are this head's (N, D) slices."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        # Keys past N load as zeros: they add nothing to dQ = dS K, so no score mask is needed for them.
        k = tl.load(K + cols[:, None] * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
        v = tl.load(V + cols[:, None] * HEAD_DIM + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(offs_m[:, None] >= cols[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, qk_scale, sm_scale, N,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):
    """One program: dQ of BLOCK_M query rows of one (batch, head); all tensors contiguous (B*H, N, D)."""
    off_hz = tl.program_id(1)
    start_m = tl.program_id(0) * BLOCK_M
    head = off_hz * N * HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_offs = head + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + row_offs, mask=offs_m[:, None] < N, other=0.0)
    do = tl.load(DO + row_offs, mask=offs_m[:, None] < N, other=0.0)
    lse = tl.load(LSE + off_hz * N + offs_m, mask=offs_m < N, other=float("inf")) * _LOG2E
    delta = tl.load(DELTA + off_hz * N + offs_m, mask=offs_m < N, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    Kh, Vh = K + head, V + head
    if CAUSAL:
        dq = _bwd_dq_inner(dq, q, do, lse, delta, Kh, Vh, 0, start_m, offs_m, N, qk_scale,
                           HEAD_DIM, BLOCK_N, False)
        dq = _bwd_dq_inner(dq, q, do, lse, delta, Kh, Vh, start_m, tl.minimum(start_m + BLOCK_M, N), offs_m, N,
                           qk_scale, HEAD_DIM, BLOCK_N, True)
    else:
        dq = _bwd_dq_inner(dq, q, do, lse, delta, Kh, Vh, 0, N, offs_m, N, qk_scale, HEAD_DIM, BLOCK_N, False)
    tl.store(DQ + row_offs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=offs_m[:, None] < N)


# --------------------------------------------------------------------------------------------
# Launch configurations: autotuned on a GPU, one small fixed block under the interpreter
# --------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, for 16-bit inputs and for fp32 (whose
# tiles take twice the shared memory and registers). The first 16-bit entry of each list is also
# the fixed configuration of ``launch_config``, which the chapter's exercises launch with.
_CONFIGS: dict[str, tuple[list[tuple[int, int, int, int]], list[tuple[int, int, int, int]]]] = {
    # Hopper, head_dim 128: 128 x 64 tiles, 8 warps, 3 stages is the FA2 sweet spot for the forward;
    # 128 x 128 can win on long sequences, 4 warps on small head dims.
    "forward": ([(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4)], [(64, 32, 4, 1)]),
    # dK/dV keeps a BLOCK_N-row block of K, V, dK, dV resident and streams narrow query blocks past
    # it (BLOCK_N % BLOCK_M == 0); dQ is the mirror image (BLOCK_M % BLOCK_N == 0).
    "dkdv": ([(32, 128, 4, 5), (32, 128, 8, 3), (64, 128, 8, 3)], [(16, 32, 4, 1)]),
    "dq": ([(128, 32, 4, 5), (128, 32, 8, 3), (128, 64, 8, 3)], [(32, 16, 4, 1)]),
}


def launch_config(kernel: str, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) to launch ``kernel`` ("forward", "dkdv", "dq") without autotuning."""
    if env.INTERPRET:
        return INTERPRETER_BLOCK, INTERPRETER_BLOCK, 1, 1
    half, single = _CONFIGS[kernel]
    return (single if dtype == torch.float32 else half)[0]


def _autotune(kernel, name: str):
    """``kernel`` autotuned over ``_CONFIGS[name]``, keeping only the list that matches the dtype of Q."""
    half, single = ([triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]
                    for shapes in _CONFIGS[name])

    def by_dtype(configs, named_args, **kwargs):
        return single if named_args["Q"].element_size() == 4 else half

    return triton.autotune(half + single, key=["N", "HEAD_DIM", "CAUSAL"],
                           prune_configs_by={"early_config_prune": by_dtype})(kernel)


if env.INTERPRET:
    _fwd, _dkdv, _dq = flash_forward_kernel, dkdv_kernel, dq_kernel
else:
    # Keyed on the shape, so each (N, head_dim, causal, dtype) tunes once per process.
    _fwd, _dkdv, _dq = (_autotune(k, name) for k, name in
                        ((flash_forward_kernel, "forward"), (dkdv_kernel, "dkdv"), (dq_kernel, "dq")))


def _blocks() -> dict[str, int]:
    """Meta-parameters passed by hand under the interpreter (the autotuner supplies them on a GPU)."""
    return {"BLOCK_M": INTERPRETER_BLOCK, "BLOCK_N": INTERPRETER_BLOCK} if env.INTERPRET else {}


def _grid(rows_key: str, n: int, bh: int):
    return lambda meta: (triton.cdiv(n, meta[rows_key]), bh)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must share one (batch, heads, seq, head_dim) shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {q.shape[-1]}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share a dtype among fp16, bf16, fp32; got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_rows(q: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> None:
    """lse and delta: one fp32 number per query row, (batch, heads, seq)."""
    for name, t in (("lse", lse), ("delta", delta)):
        if t.shape != q.shape[:-1] or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 of shape {tuple(q.shape[:-1])} (batch, heads, seq), "
                             f"got {t.dtype} of shape {tuple(t.shape)}")


def compute_dtype(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels compute it: in fp32 under the interpreter (which computes bf16/fp16 wrongly), as is on a GPU."""
    return t.float() if env.INTERPRET else t


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def flash_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output (dtype of q) and the fp32 logsumexp of each row of scaled scores, (batch, heads, seq)."""
    _check(q, k, v)
    b, h, n, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qc, kc, vc = (compute_dtype(t).contiguous() for t in (q, k, v))
    out = torch.empty_like(qc)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    _fwd[_grid("BLOCK_M", n, b * h)](
        qc, kc, vc, out, lse, scale * LOG2E, n, HEAD_DIM=d, CAUSAL=bool(causal), STEP=attention_step, **_blocks(),
    )
    return out.to(q.dtype), lse


def _backward_inputs(*tensors: torch.Tensor) -> list[torch.Tensor]:
    # The backward kernels index (B*H, N, D) directly; a loss such as out.sum() hands in a stride-0 dO.
    return [compute_dtype(t).contiguous() for t in tensors]


def flash_attention_dkdv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
    causal: bool = False, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dK, dV) in the dtypes of k and v, from the logsumexp and delta = rowsum(dO * O) (both fp32, (batch, heads, seq))."""
    _check(q, k, v)
    _check_rows(q, lse, delta)
    b, h, n, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qc, kc, vc, doc = _backward_inputs(q, k, v, dout)
    dk, dv = torch.empty_like(kc), torch.empty_like(vc)
    _dkdv[_grid("BLOCK_N", n, b * h)](
        qc, kc, vc, doc, dk, dv, lse.contiguous(), delta.contiguous(), scale * LOG2E, scale, n,
        HEAD_DIM=d, CAUSAL=bool(causal), **_blocks(),
    )
    return dk.to(k.dtype), dv.to(v.dtype)


def flash_attention_dq(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
    causal: bool = False, scale: float | None = None,
) -> torch.Tensor:
    """dQ in the dtype of q, from the logsumexp and delta = rowsum(dO * O) (both fp32, (batch, heads, seq))."""
    _check(q, k, v)
    _check_rows(q, lse, delta)
    b, h, n, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qc, kc, vc, doc = _backward_inputs(q, k, v, dout)
    dq = torch.empty_like(qc)
    _dq[_grid("BLOCK_M", n, b * h)](
        qc, kc, vc, doc, dq, lse.contiguous(), delta.contiguous(), scale * LOG2E, scale, n,
        HEAD_DIM=d, CAUSAL=bool(causal), **_blocks(),
    )
    return dq.to(q.dtype)


def flash_attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dout: torch.Tensor, causal: bool = False, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of attention in the inputs' dtypes, from the forward's output and logsumexp."""
    b, h, n, d = q.shape
    oc, doc = _backward_inputs(out, dout)
    delta = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    pre_block = INTERPRETER_BLOCK if env.INTERPRET else 128
    _bwd_preprocess[(triton.cdiv(n, pre_block), b * h)](oc, doc, delta, n, HEAD_DIM=d, BLOCK_M=pre_block)
    dk, dv = flash_attention_dkdv(q, k, v, dout, lse, delta, causal, scale)
    return flash_attention_dq(q, k, v, dout, lse, delta, causal, scale), dk, dv


class FlashAttention(torch.autograd.Function):
    """Autograd wrapper: saves Q, K, V, O and the logsumexp (O(N) extra memory), never P."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
    ) -> torch.Tensor:
        """The attention output; keeps what the backward needs on ``ctx``."""
        out, lse = flash_attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        """(dQ, dK, dV) in the inputs' dtypes, and no gradient for ``causal`` and ``scale``."""
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(q, k, v, out, lse, dout, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """softmax(Q K^T * scale [+ causal mask]) V for (batch, heads, seq, head_dim) tensors; scale defaults to 1/sqrt(head_dim)."""
    return FlashAttention.apply(q, k, v, causal, scale)
