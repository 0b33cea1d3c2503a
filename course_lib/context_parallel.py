"""Context (sequence) parallelism: attention over a sequence split across ranks (chapter 15).

Each of P ranks holds N/P of the queries, keys and values. Attention needs every query to see
every (visible) key, so the K/V blocks travel round a ring of ranks while each rank folds them
into its own output with the logsumexp merge of FlashAttention (Liu et al., 2023, Ring Attention):

- ``merge_partials``: combine any number of partial attentions over disjoint key sets by their
  logsumexps; rows that saw no key at all (lse = -inf) are handled without NaN.
- ``ring_shift``: send tensors to the next rank and receive the previous rank's, asynchronously.
- ``block_attention`` / ``block_attention_backward``: one K/V block, forward (with its lse) and
  backward (from the final output and lse); chapter 10's Triton kernels on a GPU, its tiled
  PyTorch attention elsewhere.
- ``ring_attention_forward`` / ``ring_attention_backward`` / ``ring_attention`` (autograd): the
  ring, non-causal or causal, with the contiguous layout or the load-balanced zigzag layout (rank
  i holds chunks i and 2P-1-i); in the backward pass dK/dV travel with their K/V block and one
  last shift brings them home.
- ``allgather_attention_forward``: the alternative that all-gathers K and V first.
- ``ulysses_attention`` (DeepSpeed-Ulysses): an all-to-all turns sequence shards of all heads into
  the whole sequence of H/P heads, attention runs locally, an all-to-all turns it back; the
  all-to-alls (``sequence_to_heads``, ``heads_to_sequence``) are differentiable through
  ``SequenceToHeads`` / ``HeadsToSequence``, whose backward is the inverse all-to-all.
- ``zigzag_indices`` / ``zigzag_shard`` / ``zigzag_unshard``, ``ring_step_work`` and
  ``causal_work_per_rank``: layouts and the causal work they give each rank.
- ``kv_comm_bytes`` / ``kv_buffer_bytes`` / ``score_matrix_bytes`` / ``layer_comm_bytes`` /
  ``layer_buffer_bytes``: communication and memory of the three schemes.

The bytes that really travel are counted with ``course_lib.support.comm.record_collectives``; the
torchrun self-check on N ranks is ``benchmarks.checks.context_parallel``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import env
from course_lib.attention import tiled_attention, tiled_attention_backward
from course_lib.support.timeline import Timeline

__all__ = [
    "LAYOUTS",
    "STRATEGIES",
    "HeadsToSequence",
    "RingAttention",
    "SequenceToHeads",
    "allgather_attention_forward",
    "block_attention",
    "block_attention_backward",
    "causal_ring_attention_forward",
    "causal_work_per_rank",
    "chunk_pair_kind",
    "contiguous_indices",
    "heads_to_sequence",
    "kv_buffer_bytes",
    "kv_comm_bytes",
    "layer_buffer_bytes",
    "layer_comm_bytes",
    "layout_indices",
    "merge_partials",
    "ring_attention",
    "ring_attention_backward",
    "ring_attention_forward",
    "ring_shift",
    "ring_step_work",
    "score_matrix_bytes",
    "sequence_to_heads",
    "shard_sequence",
    "ulysses_attention",
    "ulysses_attention_trainable",
    "zigzag_indices",
    "zigzag_shard",
    "zigzag_unshard",
]

LAYOUTS = ("contiguous", "zigzag")
STRATEGIES = ("ring", "allgather", "ulysses")


def _acc(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp64 stays fp64, everything else is computed in fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


# --------------------------------------------------------------------------------------------
# Memory of full attention
# --------------------------------------------------------------------------------------------


def score_matrix_bytes(batch: int, heads: int, n_q: int, n_k: int, dtype: torch.dtype) -> int:
    """Bytes of one (batch, heads, n_q, n_k) score (or probability) matrix in ``dtype``."""
    return batch * heads * n_q * n_k * torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------------------------
# Partial attentions and their merge
# --------------------------------------------------------------------------------------------


def merge_partials(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial attentions over disjoint key sets, given as outputs (..., n, d) and logsumexps (..., n).

    The merged lse is logsumexp over the parts; part i's output is weighted by exp(lse_i - lse).
    A row whose every part has lse = -inf (it saw no key) comes out as zeros with lse = -inf.
    Returns the output in ``outs[0]``'s dtype and the lse in fp32 (fp64 for fp64 outputs).
    """
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"need as many lses as outputs, at least one; got {len(outs)} outputs and {len(lses)} lses")
    dt = _acc(outs[0])
    stacked = torch.stack([lse.to(dt) for lse in lses])
    lse = torch.logsumexp(stacked, dim=0)
    # Rows that saw nothing: subtract 0 instead of -inf, so every weight is exp(-inf) = 0, not NaN.
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(stacked - safe)
    out = sum(w[..., None] * o.to(dt) for w, o in zip(weights, outs))
    return out.to(outs[0].dtype), lse


def _triton_ok(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether chapter 10's Triton kernels take this block: on a GPU, fp16/bf16, square blocks, a kernel head size.

    fp32 and fp64 blocks stay with PyTorch: the kernels' fp32 dots run in TF32 on a GPU, further off
    than fp32 checks accept.
    """
    if not (env.HAS_GPU and q.is_cuda) or q.dim() != 4 or q.shape != k.shape:
        return False
    from course_lib.kernels.flash_attention import HEAD_DIMS
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in HEAD_DIMS


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, lse) of ``q`` attending to one K/V block, in fp32 (fp64 for fp64).

    On a GPU, for fp16/bf16, chapter 10's Triton kernel (``flash_attention_forward``, which returns
    the lse) computes the block; otherwise chapter 10's tiled PyTorch attention as one tile.
    ``causal`` masks key j > query i by position within the block: right for a block on the
    diagonal, where queries and keys are the same positions.
    """
    dt = _acc(q)
    if _triton_ok(q, k):
        from course_lib.kernels.flash_attention import flash_attention_forward
        out, lse = flash_attention_forward(q, k.to(q.dtype), v.to(q.dtype), causal=causal, scale=_scale(q, scale))
        return out.to(dt), lse.to(dt)
    return tiled_attention(q.to(dt), k.to(dt), v.to(dt), causal=causal,
                           block_q=max(1, q.shape[-2]), block_k=max(1, k.shape[-2]), scale=_scale(q, scale))


def block_attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
    causal: bool = False, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one K/V block's share of attention, in fp32 (fp64 for fp64).

    ``out`` and ``lse`` are the queries' *final* output and logsumexp over all keys, so the block's
    probabilities exp(S - lse) are the true ones; ``dq`` is this block's share of the queries'
    gradient, ``dk``/``dv`` this query block's share of the block's. Triton on a GPU for fp16/bf16
    (chapter 10's dK/dV and dQ kernels, which take lse and delta = rowsum(dO * O) as inputs),
    PyTorch otherwise.
    """
    dt = _acc(q)
    if _triton_ok(q, k):
        from course_lib.kernels.flash_attention import flash_attention_dkdv, flash_attention_dq
        delta = (dout.float() * out.float()).sum(-1)
        args = (q, k.to(q.dtype), v.to(q.dtype), dout.to(q.dtype), lse.float().contiguous(), delta)
        dk, dv = flash_attention_dkdv(*args, causal=causal, scale=_scale(q, scale))
        return flash_attention_dq(*args, causal=causal, scale=_scale(q, scale)).to(dt), dk.to(dt), dv.to(dt)
    return tiled_attention_backward(q.to(dt), k.to(dt), v.to(dt), out.to(dt), lse.to(dt), dout.to(dt), causal=causal,
                                    block_k=max(1, k.shape[-2]), scale=_scale(q, scale))


# --------------------------------------------------------------------------------------------
# Layouts: which positions each rank holds
# --------------------------------------------------------------------------------------------


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got rank={rank}, world_size={world_size}")


def contiguous_indices(n: int, rank: int, world_size: int) -> torch.Tensor:
    """Positions rank ``rank`` holds when a length-``n`` sequence is cut into ``world_size`` equal consecutive pieces."""
    _check_rank(rank, world_size)
    if n % world_size:
        raise ValueError(f"sequence length n={n} must be divisible by world_size={world_size}")
    m = n // world_size
    return torch.arange(rank * m, (rank + 1) * m)


def zigzag_indices(n: int, rank: int, world_size: int) -> torch.Tensor:
    """Positions rank ``rank`` holds in the zigzag layout: chunks ``rank`` and ``2P-1-rank`` of 2P equal chunks."""
    _check_rank(rank, world_size)
    if n % (2 * world_size):
        raise ValueError(f"sequence length n={n} must be divisible by 2 * world_size = {2 * world_size} for the zigzag layout")
    c = n // (2 * world_size)
    first, second = rank, 2 * world_size - 1 - rank
    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])


def layout_indices(layout: str, n: int, rank: int, world_size: int) -> torch.Tensor:
    """``contiguous_indices`` or ``zigzag_indices`` by name."""
    if layout == "contiguous":
        return contiguous_indices(n, rank, world_size)
    if layout == "zigzag":
        return zigzag_indices(n, rank, world_size)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "contiguous") -> torch.Tensor:
    """Rank ``rank``'s positions of ``x`` (..., n, d) along the sequence dimension (-2)."""
    return x.index_select(-2, layout_indices(layout, x.shape[-2], rank, world_size).to(x.device))


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of ``x`` (..., n, d)."""
    return shard_sequence(x, rank, world_size, "zigzag")


def zigzag_unshard(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full sequence (..., n, d) from the zigzag shards of ranks 0..P-1, in rank order."""
    if len(shards) == 0:
        raise ValueError("need at least one shard")
    shape = shards[0].shape
    if any(s.shape != shape for s in shards):
        raise ValueError(f"all shards must have the same shape, got {[tuple(s.shape) for s in shards]}")
    p = len(shards)
    n = shape[-2] * p
    out = shards[0].new_empty(shape[:-2] + (n, shape[-1]))
    for rank, s in enumerate(shards):
        out[..., zigzag_indices(n, rank, p).to(s.device), :] = s
    return out


# --------------------------------------------------------------------------------------------
# Causal work per rank
# --------------------------------------------------------------------------------------------


def chunk_pair_kind(q_chunk: int, k_chunk: int) -> str:
    """How a causal mask treats queries of chunk ``q_chunk`` against keys of chunk ``k_chunk`` (equal chunks).

    "full": every key is earlier (k_chunk < q_chunk); "diagonal": the same chunk, lower triangle;
    "skip": every key is later (k_chunk > q_chunk), nothing to compute.
    """
    if k_chunk < q_chunk:
        return "full"
    return "diagonal" if k_chunk == q_chunk else "skip"


def _chunks_of(layout: str, rank: int, world_size: int) -> tuple[int, ...]:
    """Chunk ids rank ``rank`` holds: (rank,) of P chunks, or (rank, 2P-1-rank) of 2P chunks."""
    if layout == "contiguous":
        return (rank,)
    if layout == "zigzag":
        return (rank, 2 * world_size - 1 - rank)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def ring_step_work(n: int, world_size: int, layout: str) -> np.ndarray:
    """(step, rank) array: causal (query, key) pairs rank r computes at ring step s, on the K/V block of rank (r - s) mod P."""
    work = np.zeros((world_size, world_size), dtype=np.int64)
    for rank in range(world_size):
        q_pos = layout_indices(layout, n, rank, world_size)
        for step in range(world_size):
            k_pos = layout_indices(layout, n, (rank - step) % world_size, world_size)
            work[step, rank] = int((k_pos[None, :] <= q_pos[:, None]).sum())
    return work


def causal_work_per_rank(n: int, world_size: int, layout: str) -> list[int]:
    """Causal (query, key) pairs with key <= query that each rank's queries need, for a layout."""
    return [int((layout_indices(layout, n, r, world_size) + 1).sum()) for r in range(world_size)]


# --------------------------------------------------------------------------------------------
# Point-to-point exchange round the ring
# --------------------------------------------------------------------------------------------


class _Pending:
    """Receives in flight; ``wait()`` returns the received tensors."""

    def __init__(self, works: list[Any], received: list[torch.Tensor]) -> None:
        self.works, self.received = works, received

    def wait(self) -> list[torch.Tensor]:
        """Wait for the receives (and this rank's sends); return the received tensors."""
        for w in self.works:
            w.wait()
        return self.received


def ring_shift(tensors: Sequence[torch.Tensor]) -> _Pending:
    """Start sending ``tensors`` to rank+1 and receiving same-shaped tensors from rank-1; ``.wait()`` returns them.

    Uses ``dist.batch_isend_irecv``, which NCCL needs when a rank sends to and receives from
    the same peer (2 ranks). With one rank, "received" is the input itself.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return _Pending([], list(tensors))
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), (rank + 1) % world) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, (rank - 1) % world) for r in received]
    return _Pending(dist.batch_isend_irecv(ops), received)


def _sync(device: torch.device) -> None:
    """On a GPU, wait for this rank's compute stream only (not NCCL's, where the next block is in flight).

    Under NCCL a receive's ``wait()`` only makes the compute stream wait for the data; syncing
    that stream after it makes the host wait until the block has arrived, so a "wait" span ends
    when the data is there and the next "compute" span holds compute only.
    """
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# --------------------------------------------------------------------------------------------
# Ring attention: forward
# --------------------------------------------------------------------------------------------


def _split_chunks(x: torch.Tensor, n_chunks: int) -> list[torch.Tensor]:
    if x.shape[-2] % n_chunks:
        raise ValueError(f"local sequence length {x.shape[-2]} must be divisible by {n_chunks} chunks")
    return list(x.split(x.shape[-2] // n_chunks, dim=-2))


def _pairs(layout: str, rank: int, src: int, world: int, causal: bool) -> list[tuple[int, int, bool]]:
    """(query chunk index, key chunk index, diagonal?) of the chunk pairs to compute at one ring step."""
    mine, theirs = _chunks_of(layout, rank, world), _chunks_of(layout, src, world)
    pairs = []
    for qi, a in enumerate(mine):
        for ki, b in enumerate(theirs):
            kind = chunk_pair_kind(a, b) if causal else "full"
            if kind != "skip":
                pairs.append((qi, ki, kind == "diagonal"))
    return pairs


def ring_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    layout: str = "contiguous",
    scale: float | None = None,
    overlap: bool = True,
    timeline: Timeline | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (output, lse) of attention over the whole sequence; call in every rank with its local q, k, v (..., n/P, d).

    K/V blocks go round the ring (rank r receives from r-1, sends to r+1); each rank folds every
    block into its (output, lse) with ``merge_partials``. ``causal`` masks by global position
    for the ``layout`` the shards were cut with (skipping chunk pairs entirely in the future).
    ``overlap`` starts receiving the next block before computing on the current one; a
    ``timeline`` records "compute" and "wait" spans (lane "rank <r>", label "step <s>").
    Output in q's dtype, lse in fp32/fp64.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    n_chunks = len(_chunks_of(layout, rank, world))
    sc = _scale(q, scale)
    q_chunks = _split_chunks(q, n_chunks)
    dt = _acc(q)
    outs = [torch.zeros(c.shape[:-1] + (v.shape[-1],), dtype=dt, device=q.device) for c in q_chunks]
    lses = [torch.full(c.shape[:-1], float("-inf"), dtype=dt, device=q.device) for c in q_chunks]
    kv = [k.contiguous(), v.contiguous()]
    for step in range(world):
        last = step == world - 1
        pending = ring_shift(kv) if overlap and not last else None
        start = Timeline.now()
        k_chunks, v_chunks = _split_chunks(kv[0], n_chunks), _split_chunks(kv[1], n_chunks)
        for qi, ki, diagonal in _pairs(layout, rank, (rank - step) % world, world, causal):
            o, lse = block_attention(q_chunks[qi], k_chunks[ki], v_chunks[ki], causal=diagonal, scale=sc)
            outs[qi], lses[qi] = merge_partials([outs[qi], o], [lses[qi], lse])
        if timeline is not None:
            _sync(q.device)
            timeline.add(f"rank {rank}", "compute", f"step {step}", start, Timeline.now())
        if not last:
            start = Timeline.now()
            kv = (pending or ring_shift(kv)).wait()
            if timeline is not None:
                _sync(q.device)
                timeline.add(f"rank {rank}", "wait", f"step {step}", start, Timeline.now())
    return torch.cat(outs, dim=-2).to(q.dtype), torch.cat(lses, dim=-1)


# --------------------------------------------------------------------------------------------
# Ring attention: backward, and the autograd Function
# --------------------------------------------------------------------------------------------


def causal_ring_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (output, lse) of causal attention for zigzag shards (..., 2c, d): the ring, future chunks skipped."""
    return ring_attention_forward(q, k, v, causal=True, layout="zigzag", scale=scale)


def ring_attention_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
    causal: bool = False, layout: str | None = None, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this rank's shards from the forward's ``out``, ``lse`` and ``dout``: K/V go round again with dK/dV.

    At step s a rank holds block (r - s) mod P. It computes its queries' contribution to that
    block's dK/dV into a fresh buffer while two transfers are in flight: the next K/V block, and
    the block's dK/dV accumulated so far, sent by rank r - 1 at the end of its step s - 1. After
    the compute it adds what arrived and sends the sum on. After P steps the accumulators have
    visited every rank, and the last shift, waited for at the end, brings each home. ``layout``
    defaults to the chapter's choice: zigzag when causal, contiguous otherwise. Gradients in the
    inputs' dtypes.
    """
    layout = layout or ("zigzag" if causal else "contiguous")
    rank, world = dist.get_rank(), dist.get_world_size()
    n_chunks = len(_chunks_of(layout, rank, world))
    sc = _scale(q, scale)
    dt = _acc(q)
    qc, oc, dc = (_split_chunks(t, n_chunks) for t in (q, out, dout))
    lc = list(lse.to(dt).split(q.shape[-2] // n_chunks, dim=-1))
    dq = [torch.zeros(c.shape, dtype=dt, device=q.device) for c in qc]
    kv = [k.contiguous(), v.contiguous()]
    in_flight: _Pending | None = None  # the dK/dV of the block this rank holds next, on their way from rank - 1
    for step in range(world):
        pending_kv = ring_shift(kv) if step < world - 1 else None  # K/V do not change: send them on while computing
        dkv = [torch.zeros(k.shape, dtype=dt, device=k.device), torch.zeros(v.shape, dtype=dt, device=v.device)]
        kc, vc = _split_chunks(kv[0], n_chunks), _split_chunks(kv[1], n_chunks)
        dkc, dvc = _split_chunks(dkv[0], n_chunks), _split_chunks(dkv[1], n_chunks)
        for qi, ki, diagonal in _pairs(layout, rank, (rank - step) % world, world, causal):
            gq, gk, gv = block_attention_backward(qc[qi], kc[ki], vc[ki], oc[qi], lc[qi], dc[qi], causal=diagonal, scale=sc)
            dq[qi] += gq
            dkc[ki] += gk  # views into dkv: accumulate in place
            dvc[ki] += gv
        if in_flight is not None:  # the block's earlier contributions arrived behind this compute
            for mine, arrived in zip(dkv, in_flight.wait()):
                mine += arrived
        in_flight = ring_shift(dkv)  # on to the next rank; after the last step this is the shift home
        if pending_kv is not None:
            kv = pending_kv.wait()
    assert in_flight is not None  # the loop ran at least once
    dk, dv = in_flight.wait()
    return torch.cat(dq, dim=-2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Ring attention as an autograd Function: ``RingAttention.apply(q, k, v, causal, layout, scale)`` -> output."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                layout: str = "contiguous", scale: float | None = None) -> torch.Tensor:
        out, lse = ring_attention_forward(q, k, v, causal=causal, layout=layout, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (causal, layout, scale)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        causal, layout, scale = ctx.options
        dq, dk, dv = ring_attention_backward(q, k, v, out, lse, dout, causal, layout, scale)
        return dq, dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   layout: str = "contiguous", scale: float | None = None) -> torch.Tensor:
    """Differentiable ring attention of this rank's shards (see ``ring_attention_forward``)."""
    return RingAttention.apply(q, k, v, causal, layout, scale)


# --------------------------------------------------------------------------------------------
# The alternative: all-gather K and V
# --------------------------------------------------------------------------------------------


def allgather_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
    layout: str = "contiguous", scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (output, lse) after all-gathering the whole K and V (every rank then holds all of them)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ks = [torch.empty_like(k) for _ in range(world)]
    vs = [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k.contiguous())
    dist.all_gather(vs, v.contiguous())
    n = k.shape[-2] * world
    positions = [layout_indices(layout, n, r, world).to(q.device) for r in range(world)]
    k_all, v_all, k_pos = torch.cat(ks, dim=-2), torch.cat(vs, dim=-2), torch.cat(positions)
    dt = _acc(q)
    s = (q.to(dt) @ k_all.to(dt).transpose(-2, -1)) * _scale(q, scale)
    if causal:
        s = s.masked_fill(k_pos[None, :] > positions[rank][:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse[..., None]) @ v_all.to(dt)
    return out.to(q.dtype), lse


# --------------------------------------------------------------------------------------------
# DeepSpeed-Ulysses: trade the sequence split for a head split, with all-to-alls
# --------------------------------------------------------------------------------------------


def _check_heads(heads: int, world: int) -> None:
    if heads % world:
        raise ValueError(f"Ulysses splits the heads over the ranks: heads={heads} must be divisible by the "
                         f"world size {world} (and so at least {world}); use the ring for more ranks than heads")


def sequence_to_heads(x: torch.Tensor) -> torch.Tensor:
    """All-to-all: this rank's sequence shard of every head (b, n/P, H, d) -> the whole sequence of its H/P heads (b, n, H/P, d).

    Head group j goes to rank j; from rank i comes sequence shard i of this rank's heads, stacked in
    rank order. No autograd: ``SequenceToHeads`` is the differentiable version.
    """
    world = dist.get_world_size()
    b, m, h, d = x.shape
    _check_heads(h, world)
    # (P, b, n/P, H/P, d): the block for rank j first, as one contiguous buffer (a transpose, not a reshape).
    send = x.reshape(b, m, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)  # (P, b, n/P, H/P, d): block i from rank i, sequence shard i
    dist.all_to_all_single(received, send)
    return received.permute(1, 0, 2, 3, 4).reshape(b, world * m, h // world, d)


def heads_to_sequence(x: torch.Tensor) -> torch.Tensor:
    """The inverse all-to-all: the whole sequence of H/P heads (b, n, H/P, d) -> this rank's shard of all heads (b, n/P, H, d).

    No autograd: ``HeadsToSequence`` is the differentiable version.
    """
    world = dist.get_world_size()
    b, n, hp, d = x.shape
    if n % world:
        raise ValueError(f"sequence length {n} must be divisible by the world size {world}")
    # (P, b, n/P, H/P, d): sequence shard j goes to rank j.
    send = x.reshape(b, world, n // world, hp, d).permute(1, 0, 2, 3, 4).contiguous()
    received = torch.empty_like(send)  # block i: head group i of this rank's sequence shard
    dist.all_to_all_single(received, send)
    return received.permute(1, 2, 0, 3, 4).reshape(b, n // world, world * hp, d)


class SequenceToHeads(torch.autograd.Function):
    """``sequence_to_heads`` with autograd: its backward is the inverse all-to-all of the gradient, ``heads_to_sequence``.

    An all-to-all only moves elements (each lands once, somewhere else), so its Jacobian is a
    permutation matrix, whose transpose is the inverse permutation.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return sequence_to_heads(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return heads_to_sequence(grad)


class HeadsToSequence(torch.autograd.Function):
    """``heads_to_sequence`` with autograd: its backward is ``sequence_to_heads`` of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return heads_to_sequence(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return sequence_to_heads(grad)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      scale: float | None = None) -> torch.Tensor:
    """This rank's (b, n/P, H, d) output of attention over the whole sequence, for contiguous sequence shards (b, n/P, H, d).

    Three all-to-alls (``SequenceToHeads``) give each rank the whole sequence of H/P heads,
    attention runs there, and one all-to-all (``HeadsToSequence``) returns each rank its own
    tokens. Differentiable: the backward pass makes the four all-to-alls the other way round (dO
    in, dQ, dK, dV back). The local attention is PyTorch's ``scaled_dot_product_attention``, which
    has a backward on every device (``block_attention`` runs a Triton kernel without autograd on
    a GPU) and needs no lse here, since nothing is merged. Needs H divisible by P (ValueError
    otherwise). Output in q's dtype.
    """
    _check_heads(q.shape[2], dist.get_world_size())
    qh, kh, vh = (SequenceToHeads.apply(t).transpose(1, 2) for t in (q, k, v))  # (b, H/P, n, d)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    return HeadsToSequence.apply(out.transpose(1, 2))


# The name chapter 15's Exercise 7 (the trainable Ulysses) asks for: the same function.
ulysses_attention_trainable = ulysses_attention


# --------------------------------------------------------------------------------------------
# Communication and memory per rank
# --------------------------------------------------------------------------------------------


def kv_comm_bytes(strategy: str, n: int, head_dim: int, world_size: int, batch_heads: int = 1, itemsize: int = 4) -> int:
    """Bytes of K and V each rank receives in one forward pass: "ring" (P-1 shifts) or "allgather" (P-1 shards)."""
    if strategy not in ("ring", "allgather"):
        raise ValueError(f"strategy must be 'ring' or 'allgather', got {strategy!r}")
    shard = batch_heads * (n // world_size) * head_dim * itemsize
    return 2 * (world_size - 1) * shard  # the same for both: every rank must see every other rank's K and V once


def kv_buffer_bytes(strategy: str, n: int, head_dim: int, world_size: int, batch_heads: int = 1, itemsize: int = 4) -> int:
    """Bytes of K and V a rank holds at once: the ring's current and incoming block, or the whole gathered K and V."""
    shard = batch_heads * (n // world_size) * head_dim * itemsize
    if strategy == "ring":
        return 2 * 2 * shard
    if strategy == "allgather":
        return 2 * world_size * shard
    raise ValueError(f"strategy must be 'ring' or 'allgather', got {strategy!r}")


def layer_comm_bytes(strategy: str, n: int, heads: int, head_dim: int, world_size: int, kv_heads: int | None = None,
                     batch: int = 1, itemsize: int = 2, training: bool = False) -> int:
    """Bytes each rank receives from other ranks in one attention forward (``training``: forward and backward).

    Forward. Ring and all-gather: every other rank's K and V shard, once. Ulysses: of each of its
    four all-to-alls (Q, K, V in, the output back), the (P-1)/P of a shard that comes from other ranks.
    Backward (``training``). Ulysses: the same four all-to-alls the other way round (dO in, dQ,
    dK, dV back), as many bytes again. Ring: K/V go round once more (P-1 shifts) and the dK/dV
    accumulators make P shifts. All-gather: K/V kept from the forward, dK/dV reduce-scattered
    (P-1 shards of each arrive). Gradients are counted at ``itemsize`` (the course's ring sends its
    dK/dV accumulators in fp32 for fp16/bf16 inputs). ``kv_heads`` (grouped-query attention)
    defaults to ``heads``.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    shard_q = batch * (n // world_size) * heads * head_dim * itemsize
    shard_kv = batch * (n // world_size) * kv_heads * head_dim * itemsize
    if strategy == "ring":
        return 2 * (world_size - 1) * shard_kv + (2 * (world_size - 1) + 2 * world_size) * shard_kv * training
    if strategy == "allgather":
        return 2 * (world_size - 1) * shard_kv * (1 + training)
    if strategy == "ulysses":
        return (2 * shard_q + 2 * shard_kv) * (world_size - 1) // world_size * (1 + training)
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def layer_buffer_bytes(strategy: str, n: int, heads: int, head_dim: int, world_size: int, kv_heads: int | None = None,
                       batch: int = 1, itemsize: int = 2) -> int:
    """Bytes of Q, K, V and the output a rank holds during attention (the inputs of its all-to-alls aside).

    Ring: its Q and output shards, the K/V block it computes on and the one arriving. All-gather:
    its Q and output shards and the whole K and V. Ulysses: the whole sequence of H/P heads of Q,
    K, V and the output: as many bytes as its shards.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    shard_q = batch * (n // world_size) * heads * head_dim * itemsize
    shard_kv = batch * (n // world_size) * kv_heads * head_dim * itemsize
    if strategy == "ring":
        return 2 * shard_q + 4 * shard_kv
    if strategy == "allgather":
        return 2 * shard_q + 2 * world_size * shard_kv
    if strategy == "ulysses":
        return 2 * shard_q + 2 * shard_kv
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
