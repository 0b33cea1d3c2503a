"""Chapter 11 (collectives): the seven collectives from send/recv, ring all-reduce, and their cost.

Functions that move data run *inside a rank* of an initialised default process group (start the
ranks with ``course_lib.support.dist.launch``) and use only point-to-point calls (``isend``/``irecv``):

- ``broadcast_p2p``, ``scatter_p2p``, ``gather_p2p``, ``reduce_p2p``, ``all_gather_p2p``,
  ``reduce_scatter_p2p``: the collectives built from sends and receives, rooted ones naively;
- ``chunk_sizes``, ``ring_reduce_scatter``, ``ring_all_gather``, ``ring_all_reduce``: the ring
  algorithm for any world size and any length (uneven chunks, as ``torch.tensor_split`` makes them);
- ``rabenseifner_all_reduce``: recursive-halving reduce-scatter then recursive-doubling all-gather,
  for a power-of-two world size;
- ``all_to_all_p2p``: every rank sends a different (ragged) chunk to every rank, pairwise exchange;
- ``two_level_groups``, ``hierarchical_all_reduce``: the node/cluster all-reduce from subgroups
  (``dist.new_group``) and torch's collectives on them.

Chunks are always taken along dim 0 with ``torch.tensor_split(t, world_size)``: rank ``r`` owns
chunk ``r``, as in ``dist.reduce_scatter``. Reductions are sums.

The alpha-beta cost model (``allreduce_steps``, ``allreduce_bytes_per_rank``, ``allreduce_cost``,
``hierarchical_allreduce_cost``, ``fit_alpha_beta``, ``algorithm_bandwidth``, ``bus_bandwidth``) runs anywhere.
``rank_input`` is a rank's fixed random input and ``ping_pong`` the two-rank message that calibrates alpha and beta.
The test harness is ``course_lib.exercises.collectives``; the torchrun self-check, on GPUs or gloo
CPU ranks, is ``benchmarks.checks.collectives``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "ALGORITHMS",
    "chunk_sizes",
    "broadcast_p2p",
    "scatter_p2p",
    "gather_p2p",
    "reduce_p2p",
    "all_gather_p2p",
    "reduce_scatter_p2p",
    "ring_reduce_scatter",
    "ring_all_gather",
    "ring_all_reduce",
    "rabenseifner_all_reduce",
    "all_to_all_p2p",
    "two_level_groups",
    "hierarchical_all_reduce",
    "allreduce_steps",
    "allreduce_message_bytes",
    "allreduce_bytes_per_rank",
    "allreduce_cost",
    "hierarchical_allreduce_cost",
    "fit_alpha_beta",
    "BUS_FACTORS",
    "algorithm_bandwidth",
    "bus_bandwidth",
    "rank_input",
    "ping_pong",
]

ALGORITHMS = ("naive", "direct", "ring", "tree", "rabenseifner")


# --------------------------------------------------------------------------------------------
# Chunks
# --------------------------------------------------------------------------------------------


def chunk_sizes(n: int, world_size: int) -> list[int]:
    """Lengths of the ``world_size`` chunks that ``torch.tensor_split`` cuts ``n`` items into.

    The first ``n % world_size`` chunks get one item more; chunks may be empty when
    ``n < world_size``. ValueError unless n >= 0 and world_size >= 1.
    """
    if n < 0 or world_size < 1:
        raise ValueError(f"need n >= 0 and world_size >= 1, got n={n}, world_size={world_size}")
    base, extra = divmod(n, world_size)
    return [base + 1 if r < extra else base for r in range(world_size)]


def _me() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _exchange(send: torch.Tensor | None, to: int, recv: torch.Tensor | None, frm: int) -> None:
    """Send ``send`` to rank ``to`` while receiving into ``recv`` from rank ``frm``; empty tensors are skipped."""
    ops = []
    if recv is not None and recv.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv, frm))
    if send is not None and send.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), to))
    _post_together(ops)


def _post_together(ops: list[dist.P2POp]) -> None:
    """Start ``ops`` as one batch and wait for them all.

    Under NCCL a lone irecv and isend to the same peer share one stream, so two ranks that both
    receive first would wait for each other forever; a batch (``batch_isend_irecv``) runs them as
    one grouped operation. Under gloo the batch is the same isend/irecv calls.
    """
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


# --------------------------------------------------------------------------------------------
# The seven collectives from send/recv (rooted ones: the root talks to every rank in turn)
# --------------------------------------------------------------------------------------------


def broadcast_p2p(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copy rank ``src``'s ``t`` into ``t`` on every rank (in place) and return it: src sends to each rank in turn."""
    rank, world = _me()
    if t.numel() == 0:
        return t
    if rank == src:
        for dst in range(world):
            if dst != src:
                dist.send(t.contiguous(), dst)
    else:
        buf = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
        dist.recv(buf, src)
        if buf is not t:
            t.copy_(buf)
    return t


def scatter_p2p(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank r's chunk ``tensor_split(t, world)[r]`` of rank ``src``'s ``t`` (every rank passes a tensor of that shape)."""
    rank, world = _me()
    chunks = torch.tensor_split(t, world)
    if rank == src:
        for dst in range(world):
            if dst != src and chunks[dst].numel() > 0:
                dist.send(chunks[dst].contiguous(), dst)
        return chunks[src].clone()
    mine = torch.empty_like(chunks[rank])
    if mine.numel() > 0:
        dist.recv(mine, src)
    return mine


def gather_p2p(t: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
    """On rank ``dst``: the list of every rank's ``t`` (same shape on all ranks), in rank order; None elsewhere."""
    rank, world = _me()
    if rank != dst:
        if t.numel() > 0:
            dist.send(t.contiguous(), dst)
        return None
    out = []
    for src in range(world):
        if src == dst:
            out.append(t.clone())
        else:
            buf = torch.empty_like(t, memory_format=torch.contiguous_format)
            if buf.numel() > 0:
                dist.recv(buf, src)
            out.append(buf)
    return out


def reduce_p2p(t: torch.Tensor, dst: int = 0) -> torch.Tensor:
    """Sum every rank's ``t`` into ``t`` on rank ``dst`` (in place, adding in rank order) and return it.

    The other ranks send their ``t`` and return it unchanged.
    """
    rank, world = _me()
    if t.numel() == 0:
        return t
    if rank != dst:
        dist.send(t.contiguous(), dst)
        return t
    received = {}
    for src in range(world):
        if src != dst:
            buf = torch.empty_like(t, memory_format=torch.contiguous_format)
            dist.recv(buf, src)
            received[src] = buf
    parts = [t if src == dst else received[src] for src in range(world)]
    total = parts[0].clone()
    for part in parts[1:]:
        total = total + part
    t.copy_(total)
    return t


def all_gather_p2p(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape on all ranks) on every rank, as a list in rank order.

    Ring schedule: at step s each rank forwards the piece it received last (starting with its
    own) to its right neighbour and receives a new one from its left neighbour; n - 1 steps.
    """
    rank, world = _me()
    out: list[torch.Tensor | None] = [None] * world
    out[rank] = t.clone()
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_idx, recv_idx = (rank - step) % world, (rank - step - 1) % world
        buf = torch.empty_like(t, memory_format=torch.contiguous_format)
        _exchange(out[send_idx], right, buf, left)
        out[recv_idx] = buf
    return out  # type: ignore[return-value]


def reduce_scatter_p2p(t: torch.Tensor) -> torch.Tensor:
    """Rank r's chunk ``tensor_split(sum over ranks of t, world)[r]``: each rank sends chunk j straight to rank j.

    All sends and receives are posted at once (one batch of isend/irecv), so no ordering can deadlock.
    """
    rank, world = _me()
    chunks = torch.tensor_split(t, world)
    bufs = {src: torch.empty_like(chunks[rank], memory_format=torch.contiguous_format) for src in range(world) if src != rank}
    ops = [dist.P2POp(dist.irecv, buf, src) for src, buf in bufs.items() if buf.numel() > 0]
    ops += [dist.P2POp(dist.isend, chunks[dst].contiguous(), dst)
            for dst in range(world) if dst != rank and chunks[dst].numel() > 0]
    _post_together(ops)
    total = None
    for src in range(world):
        part = chunks[rank] if src == rank else bufs[src]
        total = part.clone() if total is None else total + part
    return total  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Ring all-reduce = ring reduce-scatter + ring all-gather
# --------------------------------------------------------------------------------------------


def ring_reduce_scatter(t: torch.Tensor) -> torch.Tensor:
    """Rank r's fully summed chunk ``tensor_split(sum over ranks of t, world)[r]``, by the ring algorithm.

    At step s (0 .. n-2) rank r sends its partial sum of chunk (r - s - 1) mod n to rank r + 1,
    receives the partial sum of chunk (r - s - 2) mod n from rank r - 1 and adds its own part.
    After n - 1 steps the chunk it last received, r itself, holds all n contributions. Each step's
    send and receive are posted together as one ``batch_isend_irecv``, so the ring cannot deadlock,
    under gloo or NCCL. ``t`` is not changed.
    """
    rank, world = _me()
    acc = [c.clone(memory_format=torch.contiguous_format) for c in torch.tensor_split(t, world)]
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_idx, recv_idx = (rank - step - 1) % world, (rank - step - 2) % world
        buf = torch.empty_like(acc[recv_idx])
        _exchange(acc[send_idx], right, buf, left)
        acc[recv_idx] += buf
    return acc[rank]


def ring_all_gather(chunk: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """The concatenation (dim 0) of every rank's ``chunk``, where rank r's chunk has ``sizes[r]`` rows.

    At step s rank r forwards chunk (r - s) mod n to rank r + 1 and receives chunk (r - s - 1) mod n
    from rank r - 1; after n - 1 steps every rank holds all n chunks.
    """
    rank, world = _me()
    if len(sizes) != world:
        raise ValueError(f"need one size per rank ({world}), got {len(sizes)}")
    if chunk.shape[0] != sizes[rank]:
        raise ValueError(f"rank {rank}'s chunk has {chunk.shape[0]} rows, sizes says {sizes[rank]}")
    out = chunk.new_empty((sum(sizes), *chunk.shape[1:]))
    parts = list(torch.split(out, list(sizes)))
    parts[rank].copy_(chunk)
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_idx, recv_idx = (rank - step) % world, (rank - step - 1) % world
        _exchange(parts[send_idx], right, parts[recv_idx], left)
    return out


def ring_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over all ranks with ring reduce-scatter then ring all-gather; write the sum into ``t`` and return it.

    The tensor is flattened first so that chunks are as even as possible whatever its shape.
    """
    _, world = _me()
    flat = t.reshape(-1)
    mine = ring_reduce_scatter(flat)
    total = ring_all_gather(mine, chunk_sizes(flat.numel(), world))
    t.copy_(total.reshape(t.shape))
    return t


def rabenseifner_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over a power-of-two number of ranks by Rabenseifner's algorithm; write it into ``t`` and return it.

    Reduce-scatter by recursive halving: in round k rank r exchanges with r XOR n/2^(k+1) half of the
    chunk range it is still summing, keeps the half holding its own chunk and adds the partner's
    part of it; after log2 n rounds it holds chunk r summed. All-gather by recursive doubling: the
    same pairs in reverse order swap the ranges they hold, which double each round. 2 log2 n rounds,
    2 (n - 1) / n of the tensor sent per rank, as in the ring.
    """
    rank, world = _me()
    if world & (world - 1):
        raise ValueError(f"Rabenseifner's algorithm here needs a power-of-two world size, got {world}")
    flat = t.reshape(-1).clone()
    bounds = [0, *np.cumsum(chunk_sizes(flat.numel(), world)).tolist()]  # chunk c is flat[bounds[c]:bounds[c+1]]
    lo, hi, mask = 0, world, world // 2
    while mask:  # recursive halving: the range of chunks this rank still sums halves each round
        partner, mid = rank ^ mask, (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if rank & mask else ((lo, mid), (mid, hi))
        mine = flat[bounds[keep[0]]:bounds[keep[1]]]
        buf = torch.empty_like(mine)
        _exchange(flat[bounds[give[0]]:bounds[give[1]]], partner, buf, partner)
        mine += buf
        lo, hi, mask = *keep, mask // 2
    mask = 1
    while mask < world:  # recursive doubling: swap ranges with the same partners in reverse order
        partner = rank ^ mask
        other = (lo - mask, lo) if rank & mask else (hi, hi + mask)
        _exchange(flat[bounds[lo]:bounds[hi]], partner, flat[bounds[other[0]]:bounds[other[1]]], partner)
        lo, hi, mask = min(lo, other[0]), max(hi, other[1]), mask * 2
    t.copy_(flat.reshape(t.shape))
    return t


# --------------------------------------------------------------------------------------------
# All-to-all: a different chunk from every rank to every rank
# --------------------------------------------------------------------------------------------


def all_to_all_p2p(chunks: Sequence[torch.Tensor], recv_sizes: Sequence[int]) -> list[torch.Tensor]:
    """The chunk every rank sent to this one, in rank order: ``chunks[j]`` goes to rank j.

    ``recv_sizes[j]`` is the number of rows (dim 0) rank j sends here; the chunks share dtype and
    trailing shape, and may be empty. Pairwise exchange: in step k (1 .. n-1) rank r sends to
    r + k and receives from r - k, both posted as one batch, so every pair meets once and no rank
    waits on a rank that waits on it. ``out[rank]`` is a copy of ``chunks[rank]``.
    """
    rank, world = _me()
    if len(chunks) != world or len(recv_sizes) != world:
        raise ValueError(f"need one chunk and one receive size per rank ({world}), got {len(chunks)} and {len(recv_sizes)}")
    mine = chunks[rank]
    out: list[torch.Tensor] = [mine.clone(memory_format=torch.contiguous_format)] * world
    for k in range(1, world):
        to, frm = (rank + k) % world, (rank - k) % world
        out[frm] = mine.new_empty((recv_sizes[frm], *mine.shape[1:]))
        _exchange(chunks[to], to, out[frm], frm)
    return out


# --------------------------------------------------------------------------------------------
# Two-level (node / cluster) all-reduce
# --------------------------------------------------------------------------------------------


@functools.cache
def two_level_groups(world_size: int, ranks_per_node: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (node group, cross-node group); every rank creates every group, in the same order, once.

    Node k holds ranks k * ranks_per_node ... (k + 1) * ranks_per_node - 1; the cross-node group of
    local index i holds the ranks i, i + ranks_per_node, ... ``dist.new_group`` is a collective of
    the whole world (every rank calls it for every group, even groups it is not in), so the groups
    are made once per process and kept (``world_size`` is part of the key for that reason).
    """
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node must divide the world size {world_size}, got {ranks_per_node}")
    rank, nodes = dist.get_rank(), world_size // ranks_per_node
    node_group = cross_group = None
    for k in range(nodes):
        group = dist.new_group(list(range(k * ranks_per_node, (k + 1) * ranks_per_node)))
        if rank // ranks_per_node == k:
            node_group = group
    for i in range(ranks_per_node):
        group = dist.new_group(list(range(i, world_size, ranks_per_node)))
        if rank % ranks_per_node == i:
            cross_group = group
    return node_group, cross_group  # type: ignore[return-value]


def hierarchical_all_reduce(t: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    """Sum ``t`` over all ranks in three phases over subgroups; write the sum into ``t`` and return it.

    1. reduce-scatter inside the node: local rank i holds shard i of the node's sum (1/p of the tensor);
    2. all-reduce of that shard across nodes, among the ranks of local index i: the only traffic on
       the slow inter-node links, 1/p of the tensor per rank;
    3. all-gather of the shards inside the node.
    The flattened tensor is padded with zeros to a multiple of ``ranks_per_node`` so that the
    shards are equal, as ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` need.
    """
    node_group, cross_group = two_level_groups(dist.get_world_size(), ranks_per_node)
    flat = t.reshape(-1)
    shard_len = -(-flat.numel() // ranks_per_node)
    padded = torch.zeros(shard_len * ranks_per_node, dtype=t.dtype, device=t.device)
    padded[:flat.numel()] = flat
    shard = padded.new_empty(shard_len)
    dist.reduce_scatter_tensor(shard, padded, group=node_group)
    dist.all_reduce(shard, group=cross_group)
    dist.all_gather_into_tensor(padded, shard, group=node_group)
    t.copy_(padded[:flat.numel()].reshape(t.shape))
    return t


# --------------------------------------------------------------------------------------------
# The alpha-beta cost model
# --------------------------------------------------------------------------------------------


def _check(algorithm: str, world_size: int) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")


def _fold(n: int) -> tuple[int, int]:
    """Rabenseifner on n ranks: (the largest power of two p <= n, extra rounds of the whole tensor: 2 unless n = p)."""
    p = 1 << (n.bit_length() - 1)
    return p, 0 if p == n else 2


def allreduce_steps(algorithm: str, world_size: int) -> int:
    """Communication rounds of an all-reduce over ``world_size`` ranks, one message per rank and direction per round.

    naive         reduce to rank 0, which receives from the others one at a time, then broadcast the
                  same way: 2 (n - 1) rounds, each moving the whole tensor.
    direct        every rank sends its whole tensor to every other rank, one peer per round: n - 1
                  rounds (n (n - 1) messages in all), then each rank sums locally.
    ring          reduce-scatter then all-gather around a ring: 2 (n - 1) rounds of 1/n of the tensor.
    tree          binomial-tree reduce then broadcast: 2 ceil(log2 n) rounds, each moving the whole tensor.
    rabenseifner  recursive-halving reduce-scatter then recursive-doubling all-gather: 2 log2 n rounds
                  whose messages halve (N/2, N/4 ... N/n) and then double again. When n is not a power
                  of two, the n - p ranks above the largest power of two p first hand their tensor to
                  a partner and get the result back at the end: 2 log2 p + 2 rounds.
    """
    _check(algorithm, world_size)
    n = world_size
    if n == 1:
        return 0
    if algorithm in ("naive", "ring"):
        return 2 * (n - 1)
    if algorithm == "direct":
        return n - 1
    if algorithm == "rabenseifner":
        p, extra = _fold(n)
        return 2 * (p.bit_length() - 1) + extra
    return 2 * math.ceil(math.log2(n))


def allreduce_message_bytes(algorithm: str, n_bytes: float, world_size: int) -> float:
    """Bytes in the largest message of one round: the whole tensor, 1/n of it for the ring, half of it for Rabenseifner."""
    _check(algorithm, world_size)
    if algorithm == "ring":
        return n_bytes / world_size
    if algorithm == "rabenseifner" and _fold(world_size)[1] == 0:
        return n_bytes / 2 if world_size > 1 else 0.0
    return float(n_bytes)


def allreduce_bytes_per_rank(algorithm: str, n_bytes: float, world_size: int) -> float:
    """Bytes sent by the busiest rank during one all-reduce of ``n_bytes`` (received bytes are the same).

    naive: the root sends the result to n - 1 ranks, (n - 1) N; direct: (n - 1) N; ring and
    Rabenseifner (n a power of two): 2 (n - 1) / n N, the same on every rank; tree: the root sends
    ceil(log2 n) N while broadcasting.
    """
    _check(algorithm, world_size)
    n = world_size
    if n == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (n - 1) / n * n_bytes
    if algorithm == "rabenseifner":
        p, extra = _fold(n)
        return 2 * (p - 1) / p * n_bytes + extra / 2 * n_bytes  # a folded-in partner also sends the result back
    if algorithm == "tree":
        return math.ceil(math.log2(n)) * float(n_bytes)
    return (n - 1) * float(n_bytes)


def _serial_bytes(algorithm: str, n_bytes: float, world_size: int) -> float:
    """Bytes that pass one after the other over the busiest link: the sum of the message sizes of every round."""
    n = world_size
    if algorithm == "rabenseifner":
        p, extra = _fold(n)
        return 2 * (p - 1) / p * n_bytes + extra * n_bytes
    return allreduce_steps(algorithm, n) * allreduce_message_bytes(algorithm, n_bytes, n)


def allreduce_cost(algorithm: str, n_bytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Seconds for an all-reduce of ``n_bytes`` under the alpha-beta model: the sum over rounds of (alpha + message bytes * beta).

    ``alpha`` is the latency of one message in seconds, ``beta`` the seconds per byte of one link
    (1 / bandwidth). Reduction arithmetic is ignored. For every algorithm but Rabenseifner's all
    rounds move equal messages, so the cost is steps * (alpha + message bytes * beta).
    """
    if n_bytes < 0 or alpha < 0 or beta < 0:
        raise ValueError(f"need n_bytes, alpha, beta >= 0, got {n_bytes}, {alpha}, {beta}")
    if world_size == 1:
        _check(algorithm, world_size)
        return 0.0
    return allreduce_steps(algorithm, world_size) * alpha + _serial_bytes(algorithm, n_bytes, world_size) * beta


def hierarchical_allreduce_cost(n_bytes: float, nodes: int, per_node: int, intra: tuple[float, float],
                                inter: tuple[float, float]) -> float:
    """Seconds for the two-level all-reduce of ``n_bytes`` on ``nodes`` x ``per_node`` ranks; links given as (alpha, beta).

    Ring reduce-scatter inside each node, (p - 1) (alpha_i + N/p beta_i); ring all-reduce of the
    N/p shard across the m nodes, 2 (m - 1) (alpha_e + N/(m p) beta_e), the p shards of a node
    travelling at once over their own links (one NIC per GPU); ring all-gather inside the node,
    (p - 1) (alpha_i + N/p beta_i).
    """
    if n_bytes < 0 or nodes < 1 or per_node < 1:
        raise ValueError(f"need n_bytes >= 0, nodes >= 1, per_node >= 1, got {n_bytes}, {nodes}, {per_node}")
    (alpha_i, beta_i), (alpha_e, beta_e) = intra, inter
    p, m = per_node, nodes
    inside = 2 * (p - 1) * (alpha_i + n_bytes / p * beta_i)
    across = allreduce_cost("ring", n_bytes / p, m, alpha_e, beta_e)
    return inside + across


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``time = alpha + beta * size``; returns (alpha in s, beta in s/byte).

    Errors are weighted relative to each time (rows divided by the time), so that the small
    messages, whose time is mostly alpha, count as much as the large ones, whose time is mostly
    beta. ValueError with fewer than two distinct sizes or a non-positive time.
    """
    s, t = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    if s.shape != t.shape or s.ndim != 1:
        raise ValueError(f"sizes and times must be 1-D and of equal length, got {s.shape} and {t.shape}")
    if len(np.unique(s)) < 2:
        raise ValueError("need at least two different sizes to fit a line")
    if np.any(t <= 0):
        raise ValueError("times must be positive")
    design = np.stack([np.ones_like(s), s], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)


BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def algorithm_bandwidth(n_bytes: float, seconds: float) -> float:
    """algbw in bytes/s: the tensor's size divided by the collective's time (nccl-tests convention)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    return n_bytes / seconds


def bus_bandwidth(n_bytes: float, seconds: float, world_size: int, collective: str = "all_reduce") -> float:
    """busbw in bytes/s: algbw times the collective's bus factor (all_reduce: 2 (n - 1) / n), as nccl-tests reports it.

    busbw is what each link carried per second if the algorithm were optimal, so it can be
    compared with the link's bandwidth whatever the number of ranks.
    """
    if collective not in BUS_FACTORS:
        raise ValueError(f"unknown collective {collective!r}; expected one of {sorted(BUS_FACTORS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return algorithm_bandwidth(n_bytes, seconds) * BUS_FACTORS[collective](world_size)


# --------------------------------------------------------------------------------------------
# Inputs and measurements in ranks
# --------------------------------------------------------------------------------------------


def rank_input(seed: int, rank: int, length: int, dtype: torch.dtype = torch.float32, width: int = 0) -> torch.Tensor:
    """The input of ``rank``: ``length`` rows (``width`` columns when width > 0), random but fixed by (seed, rank).

    Every process can build any rank's input, so a single process can compute what a collective
    over all of them should give.
    """
    gen = torch.Generator().manual_seed(10_007 * seed + rank)
    shape = (length, width) if width else (length,)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen).to(dtype)


def ping_pong(t: torch.Tensor) -> None:
    """Rank 0 sends ``t`` to rank 1 and gets it back (the other ranks wait): two one-way messages."""
    rank = dist.get_rank()
    if rank == 0:
        dist.send(t, 1)
        dist.recv(t, 1)
    elif rank == 1:
        dist.recv(t, 0)
        dist.send(t, 0)
