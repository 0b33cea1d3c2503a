"""Chapter 14 (pipeline parallelism): layer-wise stages, micro-batches, GPipe, 1F1B, interleaved and zero-bubble schedules.

The model's layers are cut into ``p`` contiguous groups, one per rank ("stage"). A batch is cut
into ``m`` micro-batches; activations travel forward from stage r to r+1 and their gradients
travel back. How the stages order their forward (F) and backward (B) passes is the schedule:

    from course_lib import pipeline_parallel as pp

    pp.balanced_partition([1, 1, 4, 1, 1], 2)        # [(0, 3), (3, 5)]: contiguous, max cost minimal
    pp.bubble_fraction(p=4, m=8)                     # 3/11: idle share of GPipe and 1F1B
    pp.one_f_one_b_schedule(p=4, m=8, rank=0)        # [('F', 0), ('F', 1), ('F', 2), ('F', 3), ('B', 0), ...]
    timeline = pp.simulate([pp.gpipe_schedule(4, 8, r) for r in range(4)])  # lanes "stage r", spans F and B
    pp.measured_bubble(timeline)                     # idle fraction of each stage: 3/11 each
    # inside a rank (course_lib.support.dist.launch), ``stage`` holding pp.stage_layers(model, bounds, rank):
    loss = pp.gpipe_step(stage, (x, y), m, F.mse_loss)              # blocking send/recv
    loss = pp.run_schedule(stage, schedule, (x, y), m, F.mse_loss)  # any schedule, batched p2p
    # interleaved 1F1B: v chunks per rank, chunk c of rank r is virtual stage c*p + r of ``parts``
    loss = pp.run_interleaved(parts, pp.interleaved_schedule(p, m, v, rank), (x, y), m, F.mse_loss)
    pp.zero_bubble_schedules(p=4, m=8)               # ZB-H1-like: F, B (input grads), W (weight grads)
    pp.parallel_traffic(b, s, h, n_layers, n_params, m, tp=8, pp=8, dp=8)  # bytes per GPU and step, by kind

Timelines are ``course_lib.support.timeline.Timeline``s, one lane per stage. The instrumented stage
that records real runs (F/B spans, saved activation bytes) and the driver of one timed step in a
rank are ``Stage`` and ``run_pipeline`` of ``course_lib.exercises.pipeline_parallel``; the torchrun
self-check is ``benchmarks.checks.pipeline_parallel``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.accumulation_checkpointing import LossFn, split_micro_batches
from course_lib.support.dist import rank_device
from course_lib.support.timeline import Timeline

__all__ = [
    "SCHEDULES",
    "Action",
    "balanced_partition",
    "boundary_bytes",
    "bubble_fraction",
    "connect_neighbours",
    "exchange",
    "gpipe_schedule",
    "gpipe_step",
    "in_flight",
    "interleaved_schedule",
    "ChunkAction",
    "make_model",
    "measured_bubble",
    "naive_schedule",
    "one_f_one_b_schedule",
    "parallel_traffic",
    "reference_step",
    "ring_all_reduce_bytes",
    "run_interleaved",
    "run_schedule",
    "simulate",
    "stage_layers",
    "torch_pipeline_step",
    "zero_bubble_schedules",
]

Action = tuple[str, int]  # ("F", micro-batch) or ("B", micro-batch): one entry of a rank's schedule
ChunkAction = tuple[str, int, int]  # ("F" or "B", micro-batch, chunk): one entry of an interleaved schedule


# ---- the model and its partition ------------------------------------------------------------------


def make_model(n_layers: int, width: int, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """``n_layers`` blocks Linear(width, width) + Tanh in an ``nn.Sequential``: every cut between blocks has the same shape."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be at least 1, got {n_layers}")
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n_layers)]
    finally:
        torch.random.set_rng_state(gen_state)
    return nn.Sequential(*blocks).to(dtype)


def balanced_partition(costs: Sequence[float], p: int) -> list[tuple[int, int]]:
    """Cut ``costs`` (one per layer) into ``p`` non-empty contiguous stages, minimising the largest stage cost.

    Returns ``p`` half-open ranges ``(start, end)`` covering ``range(len(costs))`` in order.
    Among optimal cuts, earlier stages take as many layers as they can. ValueError unless
    ``1 <= p <= len(costs)`` and every cost is non-negative.
    """
    n = len(costs)
    if not 1 <= p <= n:
        raise ValueError(f"p must be between 1 and the number of layers ({n}), got {p}")
    if any(c < 0 for c in costs):
        raise ValueError("layer costs must not be negative")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: the smallest possible max stage cost when the first i layers form k stages.
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for i in range(k, n - (p - k) + 1):
            best[k][i] = min(max(best[k - 1][j], prefix[i] - prefix[j]) for j in range(k - 1, i))
    target = best[p][n]
    # Walk forward greedily: give each stage as many layers as still lets the rest reach the optimum.
    bounds, start = [], 0
    for k in range(p, 0, -1):
        if k == 1:
            end = n
        else:
            end = start + 1
            for e in range(start + 1, n - (k - 1) + 1):
                if prefix[e] - prefix[start] <= target + 1e-12 and _can_split(prefix, e, n, k - 1, target):
                    end = e
        bounds.append((start, end))
        start = end
    return bounds


def _can_split(prefix: Sequence[float], start: int, n: int, k: int, limit: float) -> bool:
    """Whether layers start..n-1 fit into k non-empty contiguous stages of cost at most ``limit``."""
    if n - start < k:
        return False
    stages, acc = 1, 0.0
    for i in range(start, n):
        c = prefix[i + 1] - prefix[i]
        if c > limit + 1e-12:
            return False
        if acc + c > limit + 1e-12:
            stages, acc = stages + 1, c
        else:
            acc += c
    return stages <= k


def stage_layers(model: nn.Sequential, bounds: Sequence[tuple[int, int]], rank: int) -> nn.Sequential:
    """A deep copy of the layers ``bounds[rank]`` of ``model`` (what rank ``rank`` holds)."""
    start, end = bounds[rank]
    return copy.deepcopy(cast(nn.Sequential, model[start:end]))  # a slice of a Sequential is one (torch types it loosely)


# ---- schedules ------------------------------------------------------------------------------------


def naive_schedule(p: int, m: int, rank: int) -> list[Action]:
    """Each micro-batch all the way forward and back before the next starts (no overlap between stages)."""
    _check_pmr(p, m, rank)
    return [op for i in range(m) for op in (("F", i), ("B", i))]


def gpipe_schedule(p: int, m: int, rank: int) -> list[Action]:
    """GPipe: all m forward passes, then all m backward passes (in micro-batch order)."""
    _check_pmr(p, m, rank)
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_schedule(p: int, m: int, rank: int) -> list[Action]:
    """1F1B (PipeDream-Flush): min(p-1-rank, m) warm-up forwards, then alternate F and B, then the remaining Bs."""
    _check_pmr(p, m, rank)
    warmup = min(p - 1 - rank, m)
    ops: list[Action] = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", i) for i in range(m - warmup, m)]
    return ops


def interleaved_schedule(p: int, m: int, v: int, rank: int) -> list[ChunkAction]:
    """Interleaved 1F1B (Narayanan et al., 2021): this rank's ("F"/"B", micro-batch, chunk) actions.

    Rank r holds v chunks; its chunk c is virtual stage c*p + r. Forwards visit (micro-batch, chunk)
    in groups of p micro-batches: group g runs chunk 0 of micro-batches gp..gp+p-1, then chunk 1 of
    the same ones, and so on; backwards follow the same order with the chunks reversed. Warm-up:
    2(p-1-r) + (v-1)p forwards (all of them if fewer), then one F and one B in turn, then the rest of
    the Bs. ValueError unless v >= 1 and m is a multiple of p (the groups of p need whole groups).
    """
    _check_pmr(p, m, rank)
    if v < 1:
        raise ValueError(f"interleaving needs v >= 1 chunks per rank, got v={v}")
    if m % p:
        raise ValueError(f"the interleaved schedule sends micro-batches through the chunks in groups of p={p}: "
                         f"m must be a multiple of p, got m={m}")
    total = m * v

    def fwd(k: int) -> tuple[int, int]:
        group, pos = divmod(k, p * v)
        return group * p + pos % p, pos // p

    def bwd(k: int) -> tuple[int, int]:
        mb, chunk = fwd(k)
        return mb, v - 1 - chunk

    warmup = min(total, (p - rank - 1) * 2 + (v - 1) * p) if v > 1 else min(total, p - rank - 1)
    ops: list[ChunkAction] = [("F", *fwd(k)) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [("F", *fwd(warmup + k)), ("B", *bwd(k))]
    ops += [("B", *bwd(k)) for k in range(total - warmup, total)]
    return ops


def zero_bubble_schedules(p: int, m: int, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0) -> list[list[Action]]:
    """A ZB-H1-like schedule (Qi et al., 2023) for all p ranks: ("F", mb), ("B", mb) and ("W", mb) actions per rank.

    The backward is split: B computes the input's gradient (what the previous stage waits for), W
    the weights' gradients (which nobody waits for). Each rank keeps 1F1B's order of F and B; a
    W goes where the rank would otherwise idle (its next F or B is not ready yet), or when
    starting another F would hold more than 1F1B's p - rank micro-batches' activations; the rest
    follow at the end. Placed by playing the ranks on the ideal machine of ``simulate``.
    """
    orders = [one_f_one_b_schedule(p, m, r) for r in range(p)]
    out: list[list[Action]] = [[] for _ in range(p)]
    end: dict[tuple[str, int, int], float] = {}
    pos, free, live = [0] * p, [0.0] * p, [0] * p
    owed: list[list[int]] = [[] for _ in range(p)]  # micro-batches whose B ran and W has not, per rank

    def ready(r: int, kind: str, mb: int) -> float | None:
        """When the input of rank r's next F or B exists (None: not placed yet)."""
        if kind == "F":
            return 0.0 if r == 0 else end.get(("F", mb, r - 1))
        return end.get(("B", mb, r + 1) if r < p - 1 else ("F", mb, r))

    for _ in range(3 * p * m):
        best: tuple[float, int, str] | None = None
        for r in range(p):
            nxt = orders[r][pos[r]] if pos[r] < len(orders[r]) else None
            if nxt is None and not owed[r]:
                continue
            capped = nxt is not None and nxt[0] == "F" and live[r] >= p
            at = None if nxt is None or capped else ready(r, *nxt)
            if at is not None and at <= free[r]:
                cand = (free[r], r, "next")
            elif owed[r]:
                cand = (free[r], r, "W")
            elif at is not None:
                cand = (at, r, "next")
            else:
                continue  # waits for an op of another rank that is not placed yet
            best = cand if best is None or cand < best else best
        assert best is not None, "no rank can move: the 1F1B orders deadlock"
        start, r, what = best
        if what == "W":
            op: Action = ("W", owed[r].pop(0))
            live[r] -= 1
        else:
            op = orders[r][pos[r]]
            pos[r] += 1
            if op[0] == "F":
                live[r] += 1
            else:
                owed[r].append(op[1])
        free[r] = start + {"F": t_f, "B": t_b, "W": t_w}[op[0]]
        end[(op[0], op[1], r)] = free[r]
        out[r].append(op)
    return out


def _check_pmr(p: int, m: int, rank: int) -> None:
    if p < 1 or m < 1 or not 0 <= rank < p:
        raise ValueError(f"need p >= 1, m >= 1 and 0 <= rank < p, got p={p}, m={m}, rank={rank}")


# The schedules with one chunk per rank, by name: (p, m, rank) -> that rank's actions.
SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "naive": naive_schedule, "gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule,
}


def in_flight(schedule: Sequence[Sequence[Any]]) -> int:
    """The largest number of micro-batches whose forward has run and backward (W, if split) has not, along one rank's schedule."""
    split = any(op[0] == "W" for op in schedule)  # with a split backward, W frees what F saved
    live, peak = 0, 0
    for op in schedule:
        live += 1 if op[0] == "F" else -1 if op[0] == ("W" if split else "B") else 0
        peak = max(peak, live)
    return peak


# ---- executors ------------------------------------------------------------------------------------


def _grad(t: torch.Tensor) -> torch.Tensor:
    """``t.grad``, which the backward pass has just filled."""
    assert t.grad is not None, "the backward pass did not reach this tensor"
    return t.grad


def gpipe_step(stage: nn.Module, batch: Sequence[torch.Tensor], m: int, loss_fn: LossFn) -> torch.Tensor | None:
    """One GPipe step on this rank's stage: m forwards (receive, compute, send), then m backwards; gradients accumulate.

    ``batch`` = (x, y), the whole batch, on every rank. Stage 0 feeds micro-batches of x; the
    last stage computes ``loss_fn(out, y_mb) / m`` and returns the summed (= mean) loss; other
    ranks return None. Blocking ``dist.send``/``dist.recv``: in GPipe's order they cannot deadlock.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mbs = split_micro_batches(batch, m)
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    total = None
    for x_mb, y_mb in mbs:
        if rank == 0:
            x = x_mb
        else:
            x = torch.empty_like(x_mb)
            dist.recv(x, rank - 1)
            x.requires_grad_(True)
        out = stage(x)
        if rank == world - 1:
            out = loss_fn(out, y_mb) / m
            total = out.detach() if total is None else total + out.detach()
        else:
            dist.send(out.detach().contiguous(), rank + 1)
        inputs.append(x)
        outputs.append(out)
    for _ in range(m):
        # Micro-batches in order; popped, so that autograd's saved tensors go with x and out.
        x, out = inputs.pop(0), outputs.pop(0)
        if rank == world - 1:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, rank + 1)
            torch.autograd.backward(out, grad)
        if rank > 0:
            dist.send(_grad(x).contiguous(), rank - 1)
    return total


_connected: list[Any] = []  # the NCCL process groups whose neighbours are connected (connect_neighbours)


def connect_neighbours() -> None:
    """Send one number to each neighbouring stage and receive one from it, in one batch on every rank.

    NCCL connects two ranks for point-to-point on their first send/recv, and then the two sides'
    first batches must mirror each other. A pipeline's first batches do not (the first stage sends
    and receives in one batch where the second only receives), which NCCL reports as "Message
    truncated" and then hangs. ``exchange`` calls this once per process group under NCCL first.
    Neighbours on a ring: the last rank and rank 0 too, which interleaved schedules connect.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    ops = []
    for peer in sorted({(rank - 1) % world, (rank + 1) % world} - {rank}):
        ops += [dist.P2POp(dist.isend, torch.zeros(1, device=dev), peer),
                dist.P2POp(dist.irecv, torch.empty(1, device=dev), peer)]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _connect_once() -> None:
    """Under NCCL, ``connect_neighbours`` the first time this process's default group is used for the pipeline."""
    group = dist.group.WORLD
    if dist.get_backend() == "nccl" and not any(g is group for g in _connected):
        _connected.append(group)
        connect_neighbours()


def exchange(send: tuple[torch.Tensor, int] | list[tuple[torch.Tensor, int]] | None = None,
             recv: tuple[torch.Tensor, int] | None = None) -> list[Any]:
    """Post sends and/or one receive together (``dist.batch_isend_irecv``); wait for the receive only.

    ``send`` = (tensor, peer), or a list of them; ``recv`` = (buffer, peer). Returns the sends'
    work handles: wait for them before the step ends. Posting a send together with the next
    receive is what keeps 1F1B free of deadlocks with NCCL, whose sends may wait for the matching
    receive.
    """
    sends = send if isinstance(send, list) else [] if send is None else [send]
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for t, peer in sends]
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv[0], recv[1]))
    if not ops:
        return []
    _connect_once()
    works = dist.batch_isend_irecv(ops)
    if recv is not None:
        works[-1].wait()
        works = works[:-1]
    return list(works)


def run_schedule(
    stage: nn.Module, schedule: Sequence[Action], batch: Sequence[torch.Tensor], m: int, loss_fn: LossFn
) -> torch.Tensor | None:
    """Execute this rank's ``schedule`` of ("F", mb) / ("B", mb) ops; same contract as ``gpipe_step``.

    Each op's outgoing message (activation forward, gradient backward) is posted together with
    the next op's incoming one through ``exchange``; the last one after the loop. Micro-batch
    state is dropped after its B, so memory follows the schedule's in-flight count.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mbs = split_micro_batches(batch, m)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    pending: tuple[torch.Tensor, int] | None = None
    sends: list[Any] = []
    total = None
    for kind, i in schedule:
        x_mb, y_mb = mbs[i]
        if kind == "F":
            if rank == 0:
                sends += exchange(pending, None)
                x = x_mb
            else:
                x = torch.empty_like(x_mb)
                sends += exchange(pending, (x, rank - 1))
                x.requires_grad_(True)
            pending = None
            out = stage(x)
            if rank == world - 1:
                out = loss_fn(out, y_mb) / m
                total = out.detach() if total is None else total + out.detach()
            else:
                pending = (out.detach(), rank + 1)
            inputs[i], outputs[i] = x, out
        else:
            out = outputs.pop(i)
            x = inputs.pop(i)
            if rank == world - 1:
                sends += exchange(pending, None)
                pending = None
                out.backward()
            else:
                grad = torch.empty_like(out)
                sends += exchange(pending, (grad, rank + 1))
                pending = None
                torch.autograd.backward(out, grad)
            if rank > 0:
                pending = (_grad(x), rank - 1)
    sends += exchange(pending, None)
    for work in sends:
        work.wait()
    return total


def run_interleaved(
    parts: Sequence[nn.Module], schedule: Sequence[ChunkAction], batch: Sequence[torch.Tensor], m: int, loss_fn: LossFn
) -> torch.Tensor | None:
    """Execute this rank's interleaved ``schedule`` of (kind, mb, chunk) ops; same contract as ``run_schedule``.

    ``parts``: the model's p*v virtual stages in order, the same list on every rank; this rank runs
    chunk c as ``parts[c*p + rank]``. Activations flow from virtual stage s to s+1, on rank
    (rank+1) % p: the last rank's chunk c feeds rank 0's chunk c+1 (the wrap-around). Every
    activation has the shape of a micro-batch of x. Outgoing messages wait in ``pending`` until
    the next op that receives, and go out in one batch with its receive (``exchange``): no send is
    ever posted on its own ahead of a receive, which could meet a peer that posted the two the
    other way round.
    """
    rank, p = dist.get_rank(), dist.get_world_size()
    if len(parts) % p:
        raise ValueError(f"{len(parts)} virtual stages cannot be dealt to {p} ranks: need a multiple of p")
    last = len(parts) - 1
    prev, nxt = (rank - 1) % p, (rank + 1) % p
    mbs = split_micro_batches(batch, m)
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    pending: list[tuple[torch.Tensor, int]] = []
    sends: list[Any] = []
    total = None
    for kind, i, chunk in schedule:
        s = chunk * p + rank  # the virtual stage this op runs
        x_mb, y_mb = mbs[i]
        if kind == "F":
            if s == 0:
                x = x_mb
            else:
                x = torch.empty_like(x_mb)
                sends += exchange(pending, (x, prev))
                pending = []
                x.requires_grad_(True)
            out = parts[s](x)
            if s == last:
                out = loss_fn(out, y_mb) / m
                total = out.detach() if total is None else total + out.detach()
            else:
                pending.append((out.detach(), nxt))
            inputs[i, chunk], outputs[i, chunk] = x, out
        else:
            x, out = inputs.pop((i, chunk)), outputs.pop((i, chunk))
            if s == last:
                out.backward()
            else:
                grad = torch.empty_like(out)
                sends += exchange(pending, (grad, nxt))
                pending = []
                torch.autograd.backward(out, grad)
            if s > 0:
                pending.append((_grad(x), prev))
    sends += exchange(pending, None)
    for work in sends:
        work.wait()
    return total


# ---- the cost model: bubbles ---------------------------------------------------------------------


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle share of a pipeline step with equal stages: (p-1)/(v*m+p-1) (v = 1: GPipe and 1F1B; v > 1: interleaved)."""
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m and v must be positive integers, got p={p}, m={m}, v={v}")
    return (p - 1) / (v * m + p - 1)


def measured_bubble(timeline: Timeline, lanes: Sequence[str] | None = None, kinds: Sequence[str] = ("F", "B")) -> list[float]:
    """Idle fraction of each of ``lanes`` (default: the timeline's): 1 - busy / window.

    The window runs from the first start to the last end of the ``kinds`` spans over all lanes;
    busy is the time a lane spends in its ``kinds`` spans (overlapping spans count once). A lane
    without such spans is idle throughout. ValueError if the timeline holds no ``kinds`` span.
    """
    work = Timeline(s for s in timeline.spans if s.kind in kinds)
    if not work.spans:
        raise ValueError(f"no {'/'.join(kinds)} spans in the timeline")
    return [work.idle_fraction(lane) for lane in (timeline.lanes() if lanes is None else lanes)]


def simulate(schedules: Sequence[Sequence[Sequence[Any]]], t_f: float = 1.0, t_b: float = 2.0, *, v: int = 1,
             t_w: float = 1.0) -> Timeline:
    """Run per-rank schedules on an ideal machine (F costs t_f/v, B costs t_b/v, messages are free); lane "stage r" per rank.

    An op starts when its rank is free and its input exists: F of virtual stage s after F of
    s-1, B of s after B of s+1 (the last stage's B after its own F). Ops are (kind, mb) or
    (kind, mb, chunk); rank r's chunk c is virtual stage c*p + r. A split backward (zero bubble)
    has B compute input gradients only and a W (weight gradients, cost t_w/v) after its B.
    ValueError on a deadlock.
    """
    p = len(schedules)
    n_virtual = p * v
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * p
    free = [0.0] * p
    timeline = Timeline()
    remaining = sum(len(s) for s in schedules)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(schedules[r]):
                op = schedules[r][pos[r]]
                kind, mb = op[0], op[1]
                chunk = op[2] if len(op) > 2 else 0
                s = chunk * p + r
                if kind == "F":
                    dep = ("F", mb, s - 1) if s > 0 else None
                elif kind == "W":
                    dep = ("B", mb, s)
                else:
                    dep = ("B", mb, s + 1) if s < n_virtual - 1 else ("F", mb, s)
                if dep is not None and dep not in done:
                    break
                if kind == "B" and ("F", mb, s) not in done:
                    break
                start = max(free[r], done[dep] if dep is not None else 0.0)
                end = start + {"F": t_f, "B": t_b, "W": t_w}[kind] / v
                done[(kind, mb, s)] = end
                free[r] = end
                label = str(mb) if len(op) <= 2 else f"{mb}.{chunk}"
                timeline.add(f"stage {r}", kind, label, start, end)
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: tuple(schedules[r][pos[r]]) for r in range(p) if pos[r] < len(schedules[r])}
            raise ValueError(f"the schedules deadlock: every rank waits on an input that never comes; next ops {stuck}")
    return timeline


# ---- the cost model: bytes on the wire ----------------------------------------------------------


def boundary_bytes(b: int, s: int, h: int, dtype_bytes: int = 2) -> int:
    """Bytes one pipeline boundary carries per micro-batch: the (b, s, h) activation forward plus its gradient backward."""
    return 2 * b * s * h * dtype_bytes


def ring_all_reduce_bytes(n_bytes: float, world: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``n_bytes``: 2 (world - 1) / world of them (chapter 11)."""
    return 2 * (world - 1) / world * n_bytes


def parallel_traffic(b: int, s: int, h: int, n_layers: int, n_params: float, m: int, *, tp: int = 1, pp: int = 1,
                     dp: int = 1, dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes one GPU sends per training step for each kind of parallelism of a transformer, Megatron-LM style.

    pp: per micro-batch, its stage's output forward and the input's gradient backward
    (``boundary_bytes``); tp: per micro-batch and layer, 4 ring all-reduces of the (b, s, h)
    activation (2 in the forward, 2 in the backward); dp: once per step, a ring all-reduce of the
    gradients of the GPU's n_params / (tp pp) parameters. Gradients travel in ``dtype_bytes`` too.
    """
    act = b * s * h * dtype_bytes
    return {
        "pp": 0.0 if pp == 1 else float(m * boundary_bytes(b, s, h, dtype_bytes)),
        "tp": m * (n_layers / pp) * 4 * ring_all_reduce_bytes(act, tp),
        "dp": ring_all_reduce_bytes(n_params / (tp * pp) * dtype_bytes, dp),
    }


# ---- the single-process step, and the same pipeline with PyTorch -------------------------------


def reference_step(
    model: nn.Module, batch: Sequence[torch.Tensor], loss_fn: LossFn = F.mse_loss
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The single-process step: loss of the whole batch and every parameter's gradient (the model's .grad is left alone)."""
    x, y = batch
    params = list(model.parameters())
    loss = loss_fn(model(x), y)
    grads = torch.autograd.grad(loss, params)
    return loss.detach(), [g.detach() for g in grads]


def torch_pipeline_step(
    model: nn.Sequential,
    batch: Sequence[torch.Tensor],
    m: int,
    schedule: str = "gpipe",
    *,
    bounds: Sequence[tuple[int, int]] | None = None,
    loss_fn: LossFn = F.mse_loss,
) -> dict[str, Any]:
    """In a rank: the same step with ``torch.distributed.pipelining`` (PipelineStage + ScheduleGPipe or Schedule1F1B).

    Returns the loss (mean of the micro-batch losses, last rank; else None) and this stage's gradients.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    bounds = list(bounds) if bounds is not None else balanced_partition([1.0] * len(model), world)
    layers = stage_layers(model, bounds, rank).to(dev)
    _connect_once()  # PipelineStage's own first sends and receives do not mirror each other either
    stage = PipelineStage(layers, rank, world, dev)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    # The schedule divides each micro-batch's gradients by m (scale_grads), like our loss / m.
    runner = cls(stage, n_microbatches=m, loss_fn=loss_fn)
    x, y = (t.to(dev) for t in batch)
    losses: list[torch.Tensor] = []
    if world == 1:
        runner.step(x, target=y, losses=losses)
    elif rank == 0:
        runner.step(x)
    elif rank == world - 1:
        runner.step(target=y, losses=losses)
    else:
        runner.step()
    loss = torch.stack([t.detach() for t in losses]).mean() if losses else None
    grads = [_grad(p).detach().clone() for p in layers.parameters()]
    return {"loss": loss, "grads": grads}
