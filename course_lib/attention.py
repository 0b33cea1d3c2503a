"""Attention in plain PyTorch, from the textbook formula to FlashAttention's tiling (chapter 10).

- ``naive_attention``: softmax(Q K^T * scale) V with the whole N x N score matrix in memory.
- ``online_softmax_stats`` / ``online_softmax``: one pass over blocks of a row with a running
  maximum and a running sum, rescaled whenever the maximum grows (Milakov and Gimelshein 2018).
- ``tiled_attention``: the same online softmax over K/V blocks for each block of queries, so
  memory grows with N, not N^2; returns the output and the logsumexp of each row
  (Dao et al. 2022, FlashAttention; Dao 2023, FlashAttention-2).
- ``tiled_attention_backward``: dQ, dK, dV block by block, recomputing P from the logsumexp.
- ``merge_attention``: combine two partial attentions over disjoint keys by their logsumexps.
- ``causal_tile_counts``: how many score tiles a causal kernel computes fully, masks, or skips.

All tensors are (..., seq, head_dim); the tiled functions compute in fp32 (fp64 for fp64
inputs) and return the output in the input dtype and the logsumexp in the compute dtype.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "causal_mask",
    "attention_scores",
    "naive_attention",
    "attention_lse",
    "online_softmax_stats",
    "online_softmax",
    "tiled_attention",
    "tiled_attention_backward",
    "merge_attention",
    "causal_tile_counts",
]


def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp64 stays fp64, everything else is computed in fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def causal_mask(n_q: int, n_k: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean (n_q, n_k) mask, True where query i may see key j (j <= i)."""
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril()


def attention_scores(
    q: torch.Tensor, k: torch.Tensor, causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """The scaled scores Q K^T * scale in fp32 (fp64 for fp64 inputs), masked to -inf above the diagonal when causal."""
    s = (q.to(_acc(q)) @ k.to(_acc(q)).transpose(-2, -1)) * _scale(q, scale)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return s


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """softmax(Q K^T * scale) V, materialising the (..., N, N) scores and probabilities in q's dtype."""
    s = (q @ k.transpose(-2, -1)) * _scale(q, scale)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return p @ v


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """logsumexp over keys of each row of scaled scores, in fp32: what the fused kernels save."""
    return torch.logsumexp(attention_scores(q, k, causal, scale), dim=-1)


def online_softmax_stats(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row max, sum of exp(x - row max)) over the last dim, reading it in blocks of ``block`` columns.

    After each block the running sum is rescaled by exp(old max - new max), so that it is always
    a sum of exponentials relative to the current maximum. Rows that are all -inf give (-inf, 0).
    """
    if block < 1:
        raise ValueError(f"block must be at least 1, got {block}")
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    s = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[-1], block):
        xb = x[..., start:start + block]
        m_new = torch.maximum(m, xb.amax(dim=-1))
        # Where the maximum is still -inf nothing has been seen yet: subtract 0 instead of -inf (no NaN).
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        s = s * torch.exp(m - safe) + torch.exp(xb - safe[..., None]).sum(dim=-1)
        m = m_new
    return m, s


def online_softmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """softmax over the last dim from the one-pass statistics, then one more pass to normalise."""
    m, s = online_softmax_stats(x, block)
    return torch.exp(x - m[..., None]) / s[..., None]


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    block_q: int = 64,
    block_k: int = 64,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, logsumexp) of attention, computed block by block without an N x N tensor.

    For each block of ``block_q`` queries, K/V blocks of ``block_k`` keys are folded in with an
    online softmax: running max ``m``, running sum ``l_i``, accumulator ``acc`` rescaled by
    exp(m_old - m_new). Under a causal mask, key blocks entirely above the diagonal are skipped.
    """
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_k={block_k}")
    sc = _scale(q, scale)
    n_q, n_k = q.shape[-2], k.shape[-2]
    acc_dtype = _acc(q)
    qf, kf, vf = q.to(acc_dtype), k.to(acc_dtype), v.to(acc_dtype)
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=acc_dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=acc_dtype, device=q.device)
    for qs in range(0, n_q, block_q):
        qe = min(qs + block_q, n_q)
        qb = qf[..., qs:qe, :]
        m = torch.full(qb.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
        l_i = torch.zeros(qb.shape[:-1], dtype=acc_dtype, device=q.device)
        acc = torch.zeros(qb.shape[:-1] + (v.shape[-1],), dtype=acc_dtype, device=q.device)
        k_end = min(qe, n_k) if causal else n_k  # causal: keys past the block's last query are never seen
        for ks in range(0, k_end, block_k):
            ke = min(ks + block_k, n_k)
            s = (qb @ kf[..., ks:ke, :].transpose(-2, -1)) * sc
            if causal:
                rows = torch.arange(qs, qe, device=q.device)[:, None]
                cols = torch.arange(ks, ke, device=q.device)[None, :]
                s = s.masked_fill(cols > rows, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - safe)
            p = torch.exp(s - safe[..., None])
            l_i = l_i * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ vf[..., ks:ke, :]
            m = m_new
        out[..., qs:qe, :] = acc / l_i[..., None]
        lse[..., qs:qe] = m + torch.log(l_i)
    return out.to(q.dtype), lse


def tiled_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    causal: bool = False,
    block_k: int = 64,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of attention from O and the saved logsumexp, one K/V block at a time.

    P of a block is recomputed as exp(S - lse); dV = P^T dO, dP = dO V^T,
    dS = P * (dP - delta) with delta = rowsum(dO * O), dQ += dS K * scale, dK = dS^T Q * scale.
    """
    sc = _scale(q, scale)
    qf, kf, vf, of, dof = (t.to(_acc(q)) for t in (q, k, v, out, dout))
    delta = (dof * of).sum(dim=-1, keepdim=True)
    n_q, n_k = q.shape[-2], k.shape[-2]
    dq = torch.zeros_like(qf)
    dk, dv = torch.empty_like(kf), torch.empty_like(vf)
    for ks in range(0, n_k, block_k):
        ke = min(ks + block_k, n_k)
        kb, vb = kf[..., ks:ke, :], vf[..., ks:ke, :]
        s = (qf @ kb.transpose(-2, -1)) * sc
        if causal:
            rows = torch.arange(n_q, device=q.device)[:, None]
            cols = torch.arange(ks, ke, device=q.device)[None, :]
            s = s.masked_fill(cols > rows, float("-inf"))
        p = torch.exp(s - lse.to(s.dtype)[..., None])
        dv[..., ks:ke, :] = p.transpose(-2, -1) @ dof
        ds = p * (dof @ vb.transpose(-2, -1) - delta)
        dq += (ds @ kb) * sc
        dk[..., ks:ke, :] = (ds.transpose(-2, -1) @ qf) * sc
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets, each given as (output, logsumexp), into one."""
    dt = _acc(out_a)
    lse = torch.logaddexp(lse_a.to(dt), lse_b.to(dt))
    # A row that saw no key in one part has lse -inf there; its weight exp(-inf - lse) is 0.
    w_a = torch.exp(lse_a.to(dt) - lse)[..., None]
    w_b = torch.exp(lse_b.to(dt) - lse)[..., None]
    return (w_a * out_a.to(dt) + w_b * out_b.to(dt)).to(out_a.dtype), lse


def causal_tile_counts(n: int, block_m: int, block_n: int) -> dict[str, int]:
    """Tiles of the (n x n) causal score matrix cut into block_m x block_n tiles: "full", "partial", "skipped".

    A tile is full when every (query, key) in it is visible (key <= query), skipped when none is,
    partial otherwise (the tiles on the diagonal, which need the element-wise mask).
    """
    if n < 1 or block_m < 1 or block_n < 1:
        raise ValueError(f"need n, block_m, block_n >= 1, got {n}, {block_m}, {block_n}")
    counts = {"full": 0, "partial": 0, "skipped": 0}
    for r0 in range(0, n, block_m):
        r1 = min(r0 + block_m, n) - 1  # last query row of the tile
        for c0 in range(0, n, block_n):
            c1 = min(c0 + block_n, n) - 1  # last key column
            if c1 <= r0:
                counts["full"] += 1
            elif c0 > r1:
                counts["skipped"] += 1
            else:
                counts["partial"] += 1
    return counts
