"""Chapter 11 (collectives): the seven collectives from send/recv, ring all-reduce, and their cost.

Functions that move data run *inside a rank* of an initialised default process group (start the
ranks with ``course_lib.support.dist.launch``) and use only point-to-point calls (``isend``/``irecv``):

- ``broadcast_p2p``, ``scatter_p2p``, ``gather_p2p``, ``reduce_p2p``, ``all_gather_p2p``,
  ``reduce_scatter_p2p``: the collectives built from sends and receives, rooted ones naively;
- ``chunk_sizes``, ``ring_reduce_scatter``, ``ring_all_gather``, ``ring_all_reduce``: the ring
  algorithm for any world size and any length (uneven chunks, as ``torch.tensor_split`` makes them).

Chunks are always taken along dim 0 with ``torch.tensor_split(t, world_size)``: rank ``r`` owns
chunk ``r``, as in ``dist.reduce_scatter``. Reductions are sums.

The alpha-beta cost model (``allreduce_steps``, ``allreduce_bytes_per_rank``, ``allreduce_cost``,
``fit_alpha_beta``, ``algorithm_bandwidth``, ``bus_bandwidth``) runs anywhere. ``rank_input`` is a
rank's fixed random input and ``ping_pong`` the two-rank message that calibrates alpha and beta.
The test harness is ``course_lib.exercises.collectives``; the torchrun self-check, on GPUs or gloo
CPU ranks, is ``benchmarks.checks.collectives``.
"""

from __future__ import annotations

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
    "allreduce_steps",
    "allreduce_message_bytes",
    "allreduce_bytes_per_rank",
    "allreduce_cost",
    "fit_alpha_beta",
    "BUS_FACTORS",
    "algorithm_bandwidth",
    "bus_bandwidth",
    "rank_input",
    "ping_pong",
]

ALGORITHMS = ("naive", "direct", "ring", "tree")


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
        buf = t if t.is_contiguous() else torch.empty_like(t)
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
    acc = [c.clone() for c in torch.tensor_split(t, world)]
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


# --------------------------------------------------------------------------------------------
# The alpha-beta cost model
# --------------------------------------------------------------------------------------------


def _check(algorithm: str, world_size: int) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")


def allreduce_steps(algorithm: str, world_size: int) -> int:
    """Communication rounds of an all-reduce over ``world_size`` ranks, one message per rank and direction per round.

    naive   reduce to rank 0, which receives from the others one at a time, then broadcast the
            same way: 2 (n - 1) rounds, each moving the whole tensor.
    direct  every rank sends its whole tensor to every other rank, one peer per round: n - 1
            rounds (n (n - 1) messages in all), then each rank sums locally.
    ring    reduce-scatter then all-gather around a ring: 2 (n - 1) rounds of 1/n of the tensor.
    tree    binomial-tree reduce then broadcast: 2 ceil(log2 n) rounds, each moving the whole tensor.
    """
    _check(algorithm, world_size)
    n = world_size
    if n == 1:
        return 0
    if algorithm in ("naive", "ring"):
        return 2 * (n - 1)
    if algorithm == "direct":
        return n - 1
    return 2 * math.ceil(math.log2(n))


def allreduce_message_bytes(algorithm: str, n_bytes: float, world_size: int) -> float:
    """Bytes in each message of one round: the whole tensor, or 1/n of it for the ring."""
    _check(algorithm, world_size)
    return n_bytes / world_size if algorithm == "ring" else float(n_bytes)


def allreduce_bytes_per_rank(algorithm: str, n_bytes: float, world_size: int) -> float:
    """Bytes sent by the busiest rank during one all-reduce of ``n_bytes`` (received bytes are the same).

    naive: the root sends the result to n - 1 ranks, (n - 1) N; direct: (n - 1) N; ring:
    2 (n - 1) / n N, the same on every rank; tree: the root sends ceil(log2 n) N while broadcasting.
    """
    _check(algorithm, world_size)
    n = world_size
    if n == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (n - 1) / n * n_bytes
    if algorithm == "tree":
        return math.ceil(math.log2(n)) * float(n_bytes)
    return (n - 1) * float(n_bytes)


def allreduce_cost(algorithm: str, n_bytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Seconds for an all-reduce of ``n_bytes`` under the alpha-beta model: steps * (alpha + message bytes * beta).

    ``alpha`` is the latency of one message in seconds, ``beta`` the seconds per byte of one link
    (1 / bandwidth). Reduction arithmetic is ignored.
    """
    if n_bytes < 0 or alpha < 0 or beta < 0:
        raise ValueError(f"need n_bytes, alpha, beta >= 0, got {n_bytes}, {alpha}, {beta}")
    steps = allreduce_steps(algorithm, world_size)
    return steps * (alpha + allreduce_message_bytes(algorithm, n_bytes, world_size) * beta)


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
