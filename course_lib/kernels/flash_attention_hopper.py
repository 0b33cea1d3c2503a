"""FlashAttention's forward on Hopper (sm90): chapter 10's kernel fed by TMA tensor descriptors (chapter 10).

The teaching kernel (``flash_attention.flash_forward_kernel``) computes every K and V address per
thread and loads through the register file. Hopper has a copy engine for that, the Tensor Memory
Accelerator: given a descriptor (base, shape, strides of a 2-D tensor, and a block shape) one
thread asks for a whole (BLOCK_N, head_dim) tile and it lands in shared memory, where the tensor
cores read it. Triton exposes it as ``TensorDescriptor`` (built on the host) and ``desc.load``;
with the loop's ``num_stages`` it keeps the next tiles in flight while the current one is used.

What this kernel changes from the teaching one, each measured in ``benchmarks.flash_steps``
(chapter 10 renders its record):

1. Q, K, V and O travel by TMA, viewed as one (batch * heads * N, head_dim) matrix; a head's
   rows start at ``bh * N``. A tile must then not straddle two heads: N is a multiple of the
   block, else the call falls back to the teaching kernels.
2. 128 x 128 tiles, 8 warps (two warpgroups share the 128 query rows), 3 stages.
3. The softmax scale and log2(e) are folded into one multiply-add: the row max is taken on the
   raw scores and scaled once, and ``exp2(s * qk_scale - m)`` compiles to an FMA and an exp2.
4. Causal: the query blocks with the most work start first, the blocks left of the diagonal run
   without a mask, those right of it not at all.

Triton 3.6's warp specialization (``tl.range(..., warp_specialize=True)``) is a switch here so
that the benchmark can measure it; it is off because it did not pay on sm90 (see the record).

Two switches try what FlashAttention-4 does to shorten the softmax (as described in Modal's 2025
blog post that reverse-engineered it), each measured as a step of ``benchmarks.flash_steps``:

5. ``lazy_rescale``: the running max moves only when some row's max has grown by more than
   ``RESCALE_AFTER`` (8, in log2 units); until then the stale max stays, the probabilities may
   reach 2^8, and the rescale of the accumulator (BLOCK_M x head_dim multiplies) is skipped. The
   result is exact: the logsumexp and the final division use the same max as the sums.
6. ``poly_exp2``: part of the exponentials computed on the FMA pipes by a cubic polynomial
   (``exp2_fma``) instead of the special-function unit, which returns 16 results per SM and clock
   against the FMA pipes' 128 (the CUDA C++ Programming Guide's throughput table, compute
   capability 9.0): 1, the odd columns of every tile; 2, every other key block.

The backward needs only O and the logsumexp, which this forward writes in the teaching kernel's
layout, so either backward fits it. By default it is the Hopper backward (``flash_attention_backward_tma``):
the teaching module's products, its tiles fed by TMA, and the dK/dV programs and the dQ programs in
one launch (a head's key blocks and query blocks paired, longest first; ``schedule`` picks another
order or two launches), so the two kinds of work share the GPU instead of running one after the
other, with four tiles in flight per loop rather than three: under the causal mask the fourth
stage is the step that pays (``TMA_BACKWARD_CONFIGS``). ``benchmarks.flash_steps`` times each of
these choices; ``tma_backward=False`` selects the teaching backward
(``flash_attention.flash_attention_backward``).

    from course_lib.kernels.flash_attention_hopper import flash_attention_tma, tma_applies
    out = flash_attention_tma(q, k, v, causal=True)   # the TMA forward where it applies, else the teaching one

Under Triton's CPU interpreter the kernel runs in fp32 with 16 x 16 tiles (descriptors work there
too), so the CPU tests check the same code the GPU compiles.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from course_lib import env  # sets TRITON_INTERPRET=1 without a GPU; must precede triton
from course_lib.kernels import flash_attention as teaching

# isort: split
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = [
    "TMA_CONFIGS",
    "RESCALE_AFTER",
    "EXP2_COEFFS",
    "exp2_fma",
    "tma_forward_kernel",
    "tma_applies",
    "flash_attention_forward_tma",
    "TMA_BACKWARD_CONFIGS",
    "SCHEDULES",
    "tma_backward_kernel",
    "flash_attention_backward_tma",
    "backward_launches",
    "FlashAttentionTMA",
    "flash_attention_tma",
]

# (BLOCK_M, BLOCK_N, num_warps, num_stages), 16-bit inputs. On the H200 at B4 H32 N4096 D128 bf16
# the first was the fastest forward (benchmarks.flash_steps); the second is the teaching kernel's tile.
# The third, one warpgroup, is for head_dim <= 64 only (``_fitting_configs``): at B4 H32 N8192 D64 on an
# H100 it ran 5% ahead of the other two without the mask and 6% with it; at 128 its accumulator spills.
TMA_CONFIGS: list[tuple[int, int, int, int]] = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 3)]
_BLOCK_ROWS = 128  # the largest BLOCK_M / BLOCK_N above: N must be a multiple of it on a GPU
_MASKED = tl.constexpr(-1.0e30)  # finite, as in the teaching kernel: a fully masked row stays NaN-free
_LOG2E = tl.constexpr(teaching.LOG2E)

# Lazy rescale: how far (log2 units) a row's max may run ahead of the max in use: p <= 2^8, far inside fp32 and bf16.
RESCALE_AFTER: float = 8.0
_RESCALE_AFTER = tl.constexpr(RESCALE_AFTER)
# 2^f ~= 1 + f (c1 + f (c2 + f c3)) on [0, 1): a least-squares fit of the relative error, reweighted towards its
# maximum (8.6e-5, well under bf16's half-ulp of 2e-3, the precision P is used at). p(0) = 1: integers are exact.
EXP2_COEFFS: tuple[float, float, float] = (0.6951163386766311, 0.22764698465846603, 0.07706521678347895)
_EXP2_C1, _EXP2_C2, _EXP2_C3 = (tl.constexpr(c) for c in EXP2_COEFFS)


@triton.jit
def exp2_fma(x):
    """2^x for fp32 ``x`` <= 128 on the FMA and integer pipes: 2^floor(x) put straight into the exponent bits of
    the cubic's 2^frac(x). Relative error below 1e-4; about 0 (a denormal or 0) below -127."""
    x = tl.maximum(x, -127.0)
    whole = tl.floor(x)
    f = x - whole
    mantissa = 1.0 + f * (_EXP2_C1 + f * (_EXP2_C2 + f * _EXP2_C3))  # in [1, 2)
    bits = mantissa.to(tl.int32, bitcast=True) + (whole.to(tl.int32) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2(x, POLY_EXP2: tl.constexpr, odd_block):
    """2^x of a (rows, cols) tile: all on the special-function unit (0), its odd columns by ``exp2_fma`` (1), or
    all by ``exp2_fma`` in odd key blocks (2)."""
    if POLY_EXP2 == 1:
        even, odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
        p = tl.reshape(tl.join(tl.math.exp2(even), exp2_fma(odd)), [x.shape[0], x.shape[1]])
    elif POLY_EXP2 == 2:
        if odd_block:
            p = exp2_fma(x)
        else:
            p = tl.math.exp2(x)
    else:
        p = tl.math.exp2(x)
    return p


@triton.jit
def _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, row0, lo, hi, offs_m, qk_scale,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                LAZY_RESCALE: tl.constexpr, POLY_EXP2: tl.constexpr):
    """Fold key blocks [lo, hi) of the head whose rows start at ``row0`` into (acc, m_i, l_i); scores in log2 units."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([row0 + start_n, 0])
        s = tl.dot(q, k.T)  # raw scores, fp32
        if MASKED:
            s = tl.where(offs_m[:, None] >= (start_n + offs_n)[None, :], s, _MASKED)
        # The max of the raw scores, scaled once per row; below, scale and shift fuse into one FMA.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        odd_block = (start_n // BLOCK_N) % 2 == 1
        if LAZY_RESCALE:
            # One test for the whole tile: move to the new max (and rescale) only once some row needs it.
            if tl.max(m_new - m_i, 0) > _RESCALE_AFTER:
                alpha = tl.math.exp2(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            p = _exp2(s * qk_scale - m_i[:, None], POLY_EXP2, odd_block)
            l_i = l_i + tl.sum(p, 1)
            v = desc_v.load([row0 + start_n, 0])
            acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            p = _exp2(s * qk_scale - m_new[:, None], POLY_EXP2, odd_block)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = desc_v.load([row0 + start_n, 0])  # issued after the first product: its wait overlaps the softmax
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
    return acc, m_i, l_i


@triton.jit
def tma_forward_kernel(desc_q, desc_k, desc_v, desc_o, LSE, qk_scale, N,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, LAZY_RESCALE: tl.constexpr,
                       POLY_EXP2: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, head), through descriptors of (B*H*N, D) views; N % BLOCK_M == 0."""
    if CAUSAL:
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest programs first
    else:
        start_m = tl.program_id(0)
    bh = tl.program_id(1)
    row0 = bh * N
    first = start_m * BLOCK_M
    offs_m = first + tl.arange(0, BLOCK_M)
    q = desc_q.load([row0 + first, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        acc, m_i, l_i = _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, row0, 0, first, offs_m, qk_scale,
                                    BLOCK_N, False, WARP_SPECIALIZE, LAZY_RESCALE, POLY_EXP2)
        acc, m_i, l_i = _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, row0, first, first + BLOCK_M, offs_m, qk_scale,
                                    BLOCK_N, True, False, LAZY_RESCALE, POLY_EXP2)
    else:
        acc, m_i, l_i = _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, row0, 0, N, offs_m, qk_scale,
                                    BLOCK_N, False, WARP_SPECIALIZE, LAZY_RESCALE, POLY_EXP2)
    tl.store(LSE + bh * N + offs_m, (m_i + tl.math.log2(l_i)) / _LOG2E)  # natural-log logsumexp
    desc_o.store([row0 + first, 0], (acc / l_i[:, None]).to(q.dtype))


def _set_block_shapes(nargs: dict[str, Any]) -> None:
    """Autotuner pre-hook: the descriptors' block shapes follow the config being tried."""
    rows = {"desc_q": "BLOCK_M", "desc_o": "BLOCK_M", "desc_k": "BLOCK_N", "desc_v": "BLOCK_N"}
    for desc, block in rows.items():
        nargs[desc].block_shape = [nargs[block], nargs["HEAD_DIM"]]


def _fitting_configs(configs: list[triton.Config], named_args: dict[str, Any], **kwargs: Any) -> list[triton.Config]:
    """Autotuner prune: 4-warp configs only where head_dim <= 64 (a 128-wide fp32 accumulator spills in 4 warps)."""
    return [c for c in configs if c.num_warps >= 8 or kwargs["HEAD_DIM"] <= 64]


# Autotuned on a GPU (each config's block shapes set on the descriptors by the pre-hook); the
# interpreter launches one fixed config instead (see flash_attention_forward_tma).
_tma_fwd = triton.autotune(
    [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s, pre_hook=_set_block_shapes)
     for m, n, w, s in TMA_CONFIGS],
    key=["N", "HEAD_DIM", "CAUSAL", "LAZY_RESCALE", "POLY_EXP2"],
    prune_configs_by={"early_config_prune": _fitting_configs},
)(tma_forward_kernel)


def tma_applies(q: torch.Tensor) -> bool:
    """Whether ``flash_attention_forward_tma`` takes (batch, heads, seq, head_dim) ``q``: sm90+, 16-bit, seq % 128 == 0.

    Under the interpreter: any float dtype and seq % 16 == 0. Elsewhere the teaching kernels run.
    """
    if q.dim() != 4 or q.shape[-1] not in teaching.HEAD_DIMS or q.shape[0] * q.shape[1] * q.shape[2] >= 2**31:
        return False  # TMA coordinates are 32-bit: every row of the (B*H*N, D) view must be addressable
    if env.INTERPRET:
        return q.shape[2] % teaching.INTERPRETER_BLOCK == 0
    return (q.is_cuda and torch.cuda.get_device_capability(q.device) >= (9, 0)
            and q.dtype in (torch.float16, torch.bfloat16) and q.shape[2] % _BLOCK_ROWS == 0)


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernel reads it: a contiguous (B*H*N, D) matrix whose base is 16-byte aligned (TMA's rule)."""
    t = teaching.compute_dtype(t).contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t.view(-1, t.shape[-1])


def _checked_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: tuple[int, int, int, int] | None,
                    scale: float | None, pass_name: str, blocks: tuple[str, str]) -> tuple[Any, float]:
    """Check the inputs of a TMA pass; return the config to launch (16 x 16 under the interpreter) and the scale."""
    teaching._check(q, k, v)
    if not tma_applies(q):
        raise ValueError(f"the TMA {pass_name} needs sm90+, fp16/bf16 and seq % {_BLOCK_ROWS} == 0; got {q.dtype} "
                         f"of shape {tuple(q.shape)} on {q.device} (flash_attention_tma falls back by itself)")
    n, d = q.shape[2], q.shape[3]
    if config is None and env.INTERPRET:
        config = (teaching.INTERPRETER_BLOCK, teaching.INTERPRETER_BLOCK, 1, 1)
    if config is not None and (n % config[0] or config[0] % config[1]):
        raise ValueError(f"config {config}: {blocks[0]} must divide seq={n} and be a multiple of {blocks[1]}")
    return config, 1.0 / math.sqrt(d) if scale is None else float(scale)


def flash_attention_forward_tma(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: float | None = None,
    config: tuple[int, int, int, int] | None = None, warp_specialize: bool = False, lazy_rescale: bool = False,
    poly_exp2: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output (dtype of q) and fp32 logsumexp (batch, heads, seq) by the TMA kernel; raises where it does not apply.

    ``config`` (BLOCK_M, BLOCK_N, num_warps, num_stages) launches that one configuration instead of
    the autotuned ones (16 x 16 tiles under the interpreter); ``warp_specialize`` needs a ``config``.
    ``lazy_rescale`` and ``poly_exp2`` (0, 1 or 2) are steps 5 and 6 of the module's docstring.
    """
    if poly_exp2 not in (0, 1, 2):
        raise ValueError(f"poly_exp2 is 0 (none), 1 (odd columns) or 2 (odd key blocks), got {poly_exp2!r}")
    if warp_specialize and config is None:
        raise ValueError("warp_specialize needs a config: Triton 3.6 cannot compile it for every autotuned one")
    config, scale = _checked_launch(q, k, v, config, scale, "forward", ("BLOCK_M", "BLOCK_N"))
    b, h, n, d = q.shape
    qm, km, vm = (_rows_view(t) for t in (q, k, v))
    out = torch.empty_like(qm)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    block_m, block_n = config[:2] if config is not None else (_BLOCK_ROWS, _BLOCK_ROWS)  # autotuned: pre-hook sets them
    dq, do = (TensorDescriptor.from_tensor(t, [block_m, d]) for t in (qm, out))
    dk, dv = (TensorDescriptor.from_tensor(t, [block_n, d]) for t in (km, vm))
    args = (dq, dk, dv, do, lse, scale * teaching.LOG2E, n)
    switches = {"CAUSAL": bool(causal), "LAZY_RESCALE": bool(lazy_rescale), "POLY_EXP2": int(poly_exp2)}
    if config is None:
        _tma_fwd[lambda m: (n // m["BLOCK_M"], b * h)](*args, HEAD_DIM=d, WARP_SPECIALIZE=False, **switches)
    else:
        tma_forward_kernel[(n // block_m, b * h)](
            *args, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, WARP_SPECIALIZE=bool(warp_specialize),
            num_warps=config[2], num_stages=config[3], **switches)
    return out.view(b, h, n, d).to(q.dtype), lse


# (BIG, SMALL, num_warps, num_stages), 16-bit inputs: a dK/dV program keeps BIG keys and streams SMALL query rows past
# them, a dQ program the mirror image. The second is FlexAttention's default on sm90 at head_dim <= 128 (torch 2.11);
# the first is the same tile with a fourth stage in flight. On an H100 at B4 H32 N4096 D128 bf16 (a probe of the
# backward's parts, 2026-12-06) the fourth stage changed nothing without the mask and, under it, made the dQ programs
# 19% faster and the whole backward 17%.
# (128, 32, 4 warps, 4 stages) ran at under a third of the 3-stage tile's rate on an H100 and was dropped.
TMA_BACKWARD_CONFIGS: list[tuple[int, int, int, int]] = [(128, 64, 8, 4), (128, 64, 8, 3), (64, 64, 4, 3)]

# The backward's schedules: the ``programs`` value of each launch (see tma_backward_kernel).
SCHEDULES: dict[str, tuple[int, ...]] = {"paired": (0,), "halves": (3,), "two launches": (1, 2)}


@triton.jit
def _tma_dkdv_blocks(dk, dv, k, v, desc_q, desc_do, LSE, DELTA, row0, offs_n, lo, hi, qk_scale,
                     BLOCK_M: tl.constexpr, MASKED: tl.constexpr):
    """Fold query blocks [lo, hi) into one key block's (dK, dV), on the transposed (keys x queries) tile."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q = desc_q.load([row0 + start_m, 0])
        do = desc_do.load([row0 + start_m, 0])
        lse = tl.load(LSE + row0 + rows) * _LOG2E
        delta = tl.load(DELTA + row0 + rows)
        pT = tl.math.exp2(tl.dot(k, q.T) * qk_scale - lse[None, :])
        if MASKED:
            pT = tl.where(rows[None, :] >= offs_n[:, None], pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dsT = pT * (tl.dot(v, do.T) - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _tma_dq_blocks(dq, q, do, lse, delta, desc_k, desc_v, row0, offs_m, lo, hi, qk_scale,
                   BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Fold key blocks [lo, hi) into one query block's dQ."""
    for start_n in range(lo, hi, BLOCK_N):
        k = desc_k.load([row0 + start_n, 0])
        v = desc_v.load([row0 + start_n, 0])
        p = tl.math.exp2(tl.dot(q, k.T) * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(offs_m[:, None] >= (start_n + tl.arange(0, BLOCK_N))[None, :], p, 0.0)
        ds = p * (tl.dot(do, v.T) - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def tma_backward_kernel(desc_q_small, desc_do_small, desc_k_big, desc_v_big, desc_q_big, desc_do_big,
                        desc_k_small, desc_v_small, desc_dq, desc_dk, desc_dv, LSE, DELTA, qk_scale, sm_scale, N,
                        programs, HEAD_DIM: tl.constexpr, BIG: tl.constexpr, SMALL: tl.constexpr,
                        CAUSAL: tl.constexpr):
    """Program p of a head: dK and dV of a key block, or dQ of a query block, as ``programs`` orders them.

    ``programs`` says which kinds the grid holds and in what order: 0 both (2 N / BIG programs a head),
    paired: program 2j takes dK/dV block j, 2j + 1 dQ block j; 3 both in halves, the dK/dV ones first;
    1 the dK/dV ones, 2 the dQ ones (N / BIG each).
    Descriptors view (B*H*N, D) matrices; ``_big`` ones move BIG rows, ``_small`` ones SMALL. LSE (natural log)
    and DELTA = rowsum(dO * O) are fp32, one per row. Causal: block j of each kind is the j-th longest, so a
    head's programs run longest first when paired, and twice over (once per half) when not.
    """
    blocks = N // BIG
    pid = tl.program_id(0)
    if programs == 0:
        pid = pid // 2 + (pid % 2) * blocks
    elif programs == 2:
        pid += blocks
    row0 = tl.program_id(1) * N
    if pid < blocks:
        start_n = pid * BIG  # key block 0 sees every query: the longest dK/dV program starts first
        offs_n = start_n + tl.arange(0, BIG)
        k = desc_k_big.load([row0 + start_n, 0])
        v = desc_v_big.load([row0 + start_n, 0])
        dk = tl.zeros([BIG, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BIG, HEAD_DIM], dtype=tl.float32)
        if CAUSAL:  # queries above the block never see it; only those crossing the diagonal need the mask
            dk, dv = _tma_dkdv_blocks(dk, dv, k, v, desc_q_small, desc_do_small, LSE, DELTA, row0, offs_n,
                                      start_n, start_n + BIG, qk_scale, SMALL, True)
            dk, dv = _tma_dkdv_blocks(dk, dv, k, v, desc_q_small, desc_do_small, LSE, DELTA, row0, offs_n,
                                      start_n + BIG, N, qk_scale, SMALL, False)
        else:
            dk, dv = _tma_dkdv_blocks(dk, dv, k, v, desc_q_small, desc_do_small, LSE, DELTA, row0, offs_n,
                                      0, N, qk_scale, SMALL, False)
        desc_dk.store([row0 + start_n, 0], (dk * sm_scale).to(k.dtype))  # S = scale Q K^T: dK takes it once
        desc_dv.store([row0 + start_n, 0], dv.to(v.dtype))
    else:
        start_m = (2 * blocks - 1 - pid) * BIG  # the last query block sees every key: it starts first
        offs_m = start_m + tl.arange(0, BIG)
        q = desc_q_big.load([row0 + start_m, 0])
        do = desc_do_big.load([row0 + start_m, 0])
        lse = tl.load(LSE + row0 + offs_m) * _LOG2E
        delta = tl.load(DELTA + row0 + offs_m)
        dq = tl.zeros([BIG, HEAD_DIM], dtype=tl.float32)
        if CAUSAL:
            dq = _tma_dq_blocks(dq, q, do, lse, delta, desc_k_small, desc_v_small, row0, offs_m, 0, start_m,
                                qk_scale, SMALL, False)
            dq = _tma_dq_blocks(dq, q, do, lse, delta, desc_k_small, desc_v_small, row0, offs_m, start_m,
                                start_m + BIG, qk_scale, SMALL, True)
        else:
            dq = _tma_dq_blocks(dq, q, do, lse, delta, desc_k_small, desc_v_small, row0, offs_m, 0, N,
                                qk_scale, SMALL, False)
        desc_dq.store([row0 + start_m, 0], (dq * sm_scale).to(q.dtype))


_BWD_DESCRIPTORS = ("desc_q_small", "desc_do_small", "desc_k_big", "desc_v_big", "desc_q_big", "desc_do_big",
                    "desc_k_small", "desc_v_small", "desc_dq", "desc_dk", "desc_dv")


def _set_backward_block_shapes(nargs: dict[str, Any]) -> None:
    """Autotuner pre-hook: each descriptor moves BIG or SMALL rows, as the config being tried says."""
    for desc in _BWD_DESCRIPTORS:
        nargs[desc].block_shape = [nargs["SMALL" if desc.endswith("_small") else "BIG"], nargs["HEAD_DIM"]]


# Every program writes its own rows and reads nothing it writes, so timing a config twice is harmless.
_tma_bwd = triton.autotune(
    [triton.Config({"BIG": big, "SMALL": small}, num_warps=w, num_stages=st, pre_hook=_set_backward_block_shapes)
     for big, small, w, st in TMA_BACKWARD_CONFIGS],
    key=["N", "HEAD_DIM", "CAUSAL", "programs"],
)(tma_backward_kernel)


def flash_attention_backward_tma(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
    causal: bool = False, scale: float | None = None, config: tuple[int, int, int, int] | None = None,
    schedule: str = "paired",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) in the inputs' dtypes by the Hopper backward; raises where ``tma_applies`` is false.

    ``config`` (BIG, SMALL, num_warps, num_stages) launches that one instead of the autotuned ones
    (16 x 16 under the interpreter). ``schedule``: "paired" (one launch, a head's dK/dV and dQ programs
    alternating, longest first), "halves" (one launch, the dK/dV programs, then the dQ ones) or
    "two launches" (the dK/dV programs in one, the dQ ones in the next).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, not {schedule!r}")
    return backward_launches(q, k, v, out, lse, dout, causal, scale, config, SCHEDULES[schedule])


def backward_launches(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
    causal: bool, scale: float | None, config: tuple[int, int, int, int] | None, launches: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) by one launch of the Hopper backward per ``programs`` value in ``launches`` (see ``SCHEDULES``).

    ``(1,)`` (the dK/dV programs) or ``(2,)`` (the dQ ones) alone time one kind of program, as
    ``benchmarks.flash_steps`` does; the other kind's gradients are then left unwritten (uninitialised).
    """
    config, scale = _checked_launch(q, k, v, config, scale, "backward", ("BIG", "SMALL"))
    b, h, n, d = q.shape
    qm, km, vm, om, dom = (_rows_view(t) for t in (q, k, v, out, dout))
    delta = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    teaching._check_rows(q, lse, delta)
    pre_block = teaching.INTERPRETER_BLOCK if env.INTERPRET else _BLOCK_ROWS
    teaching._bwd_preprocess[(triton.cdiv(n, pre_block), b * h)](om, dom, delta, n, HEAD_DIM=d, BLOCK_M=pre_block)
    grads = [torch.empty_like(t) for t in (qm, km, vm)]
    big, small = config[:2] if config is not None else (_BLOCK_ROWS, _BLOCK_ROWS)  # autotuned: the pre-hook sets them
    sources = (qm, dom, km, vm, qm, dom, km, vm, *grads)
    descs = [TensorDescriptor.from_tensor(t, [small if name.endswith("_small") else big, d])
             for name, t in zip(_BWD_DESCRIPTORS, sources)]
    args = (*descs, lse.contiguous(), delta, scale * teaching.LOG2E, scale, n)
    for programs in launches:
        share = 1 if programs in (1, 2) else 2  # one of the two kinds, or key blocks and query blocks
        if config is None:
            _tma_bwd[lambda m, share=share: (share * n // m["BIG"], b * h)](
                *args, programs, HEAD_DIM=d, CAUSAL=bool(causal))
        else:
            tma_backward_kernel[(share * n // big, b * h)](
                *args, programs, HEAD_DIM=d, BIG=big, SMALL=small, CAUSAL=bool(causal),
                num_warps=config[2], num_stages=config[3])
    dq, dk, dv = (g.view(b, h, n, d) for g in grads)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttentionTMA(torch.autograd.Function):
    """Autograd wrapper: the TMA forward where it applies (else the teaching one); the teaching backward, or the Hopper one."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
        tma_backward: bool,
    ) -> torch.Tensor:
        """The attention output; saves Q, K, V, O and the logsumexp for the backward."""
        forward = flash_attention_forward_tma if tma_applies(q) else teaching.flash_attention_forward
        out, lse = forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.tma_backward = causal, scale, tma_backward
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """(dQ, dK, dV); no gradient for ``causal``, ``scale`` and ``tma_backward``."""
        q, k, v, out, lse = ctx.saved_tensors
        backward = (flash_attention_backward_tma if ctx.tma_backward and tma_applies(q)
                    else teaching.flash_attention_backward)
        dq, dk, dv = backward(q, k, v, out, lse, dout, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def flash_attention_tma(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: float | None = None,
    tma_backward: bool = True,
) -> torch.Tensor:
    """softmax(Q K^T * scale [+ causal mask]) V, (batch, heads, seq, head_dim); the TMA forward where ``tma_applies``.

    The backward is the Hopper one where it applies, else (or with ``tma_backward=False``) the teaching three kernels.
    """
    return FlashAttentionTMA.apply(q, k, v, causal, scale, tma_backward)
