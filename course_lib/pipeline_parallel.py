"""Chapter 14 (pipeline parallelism): layer-wise stages, micro-batches, GPipe and 1F1B schedules.

The model's layers are cut into ``p`` contiguous groups, one per rank ("stage"). A batch is cut
into ``m`` micro-batches; activations travel forward from stage r to r+1 and their gradients
travel back. How the stages order their forward (F) and backward (B) passes is the schedule:

    from course_lib import pipeline_parallel as pp

    pp.balanced_partition([1, 1, 4, 1, 1], 2)        # [(0, 3), (3, 5)]: contiguous, max cost minimal
    pp.bubble_fraction(p=4, m=8)                     # 3/11: idle share of GPipe and 1F1B
    pp.one_f_one_b_schedule(p=4, m=8, rank=0)        # [('F', 0), ('F', 1), ('F', 2), ('F', 3), ('B', 0), ...]
    # inside a rank (course_lib.support.dist.launch):
    stage = pp.Stage(pp.stage_layers(model, bounds, rank), forward_delay=0.01)
    loss = pp.gpipe_step(stage, (x, y), m, F.mse_loss)            # blocking send/recv
    loss = pp.run_schedule(stage, schedule, (x, y), m, F.mse_loss)  # any schedule, batched p2p

A ``Stage`` records its forward and backward spans (``stage.timeline``, a
``data_parallel.Timeline``) and the bytes autograd saves for backward over time
(``stage.meter``), so real runs can be drawn as Gantt charts and their activation memory measured.

Run every schedule on ``N`` ranks and check it against one process:
``torchrun --nproc_per_node N -m course_lib.pipeline_parallel [--small]``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.accumulation_checkpointing import split_micro_batches
from course_lib.data_parallel import Timeline

__all__ = [
    "SavedActivationMeter",
    "Stage",
    "balanced_partition",
    "bubble_fraction",
    "check_schedule",
    "connect_neighbours",
    "exchange",
    "gpipe_schedule",
    "gpipe_step",
    "in_flight",
    "interleaved_schedule",
    "main",
    "make_model",
    "measured_bubble",
    "naive_schedule",
    "one_f_one_b_schedule",
    "plot_gantt",
    "reference_step",
    "run_pipeline",
    "run_schedule",
    "simulate",
    "stage_layers",
    "torch_pipeline_step",
]

Op = tuple[str, int]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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


# ---- bubbles --------------------------------------------------------------------------------------


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle share of a pipeline step with equal stages: (p-1)/(v*m+p-1) (v = 1: GPipe and 1F1B; v > 1: interleaved)."""
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m and v must be positive integers, got p={p}, m={m}, v={v}")
    return (p - 1) / (v * m + p - 1)


def _merged_busy(spans: Sequence[tuple[float, float]]) -> float:
    total = 0.0
    cur: tuple[float, float] | None = None  # the (start, end) of the merged interval being built
    for s, e in sorted(spans):
        if cur is None or s > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = (s, e)
        else:
            cur = (cur[0], max(cur[1], e))
    if cur is not None:
        total += cur[1] - cur[0]
    return total


def measured_bubble(
    spans_by_rank: Sequence[Sequence[tuple[str, str, float, float]]], kinds: Sequence[str] = ("F", "B")
) -> list[float]:
    """Idle fraction of each rank: 1 - busy / window, the window running from the first start to the last end over all ranks.

    ``spans_by_rank[r]`` holds rank r's spans ``(kind, label, start, end)``; only the ``kinds``
    count as busy (overlapping busy spans count once). A rank without spans is idle throughout.
    """
    busy = [[(s, e) for k, _, s, e in spans if k in kinds] for spans in spans_by_rank]
    everything = [se for spans in busy for se in spans]
    if not everything:
        raise ValueError("no busy spans in any rank")
    t0, t1 = min(s for s, _ in everything), max(e for _, e in everything)
    window = t1 - t0
    if window <= 0:
        return [0.0 for _ in busy]
    return [1.0 - _merged_busy(spans) / window for spans in busy]


# ---- schedules ------------------------------------------------------------------------------------


def naive_schedule(p: int, m: int, rank: int) -> list[Op]:
    """Each micro-batch all the way forward and back before the next starts (no overlap between stages)."""
    _check_pmr(p, m, rank)
    return [op for i in range(m) for op in (("F", i), ("B", i))]


def gpipe_schedule(p: int, m: int, rank: int) -> list[Op]:
    """GPipe: all m forward passes, then all m backward passes (in micro-batch order)."""
    _check_pmr(p, m, rank)
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_schedule(p: int, m: int, rank: int) -> list[Op]:
    """1F1B (PipeDream-Flush): min(p-1-rank, m) warm-up forwards, then alternate F and B, then the remaining Bs."""
    _check_pmr(p, m, rank)
    warmup = min(p - 1 - rank, m)
    ops: list[Op] = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", i) for i in range(m - warmup, m)]
    return ops


def interleaved_schedule(p: int, m: int, v: int, rank: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B (Narayanan et al., 2021): rank r holds v chunks, virtual stages r, r+p, ...; ops are (kind, mb, chunk).

    Micro-batches go through the chunks in groups of p; m must be a multiple of p.
    """
    _check_pmr(p, m, rank)
    if v < 1 or m % p:
        raise ValueError(f"interleaving needs v >= 1 and m a multiple of p, got p={p}, m={m}, v={v}")
    total = m * v

    def fwd(k: int) -> tuple[int, int]:
        group, pos = divmod(k, p * v)
        return group * p + pos % p, pos // p

    def bwd(k: int) -> tuple[int, int]:
        mb, chunk = fwd(k)
        return mb, v - 1 - chunk

    warmup = min(total, (p - rank - 1) * 2 + (v - 1) * p) if v > 1 else min(total, p - rank - 1)
    ops: list[tuple[str, int, int]] = [("F", *fwd(k)) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [("F", *fwd(warmup + k)), ("B", *bwd(k))]
    ops += [("B", *bwd(k)) for k in range(total - warmup, total)]
    return ops


def _check_pmr(p: int, m: int, rank: int) -> None:
    if p < 1 or m < 1 or not 0 <= rank < p:
        raise ValueError(f"need p >= 1, m >= 1 and 0 <= rank < p, got p={p}, m={m}, rank={rank}")


def in_flight(schedule: Sequence[Sequence[Any]]) -> int:
    """The largest number of micro-batches whose forward has run and backward has not, along one rank's schedule."""
    live, peak = 0, 0
    for op in schedule:
        live += 1 if op[0] == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(
    schedules: Sequence[Sequence[Sequence[Any]]], t_f: float = 1.0, t_b: float = 2.0, *, v: int = 1
) -> list[list[tuple[str, str, float, float]]]:
    """Run per-rank schedules on an ideal machine (F costs t_f/v, B costs t_b/v, messages are free); return spans by rank.

    An op starts when its rank is free and its input exists: F of virtual stage s after F of
    s-1, B of s after B of s+1 (the last stage's B after its own F). Ops are (kind, mb) or
    (kind, mb, chunk); rank r's chunk c is virtual stage c*p + r. ValueError on a deadlock.
    """
    p = len(schedules)
    n_virtual = p * v
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * p
    free = [0.0] * p
    spans: list[list[tuple[str, str, float, float]]] = [[] for _ in range(p)]
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
                else:
                    dep = ("B", mb, s + 1) if s < n_virtual - 1 else ("F", mb, s)
                if dep is not None and dep not in done:
                    break
                if kind == "B" and ("F", mb, s) not in done:
                    break
                start = max(free[r], done[dep] if dep is not None else 0.0)
                end = start + (t_f if kind == "F" else t_b) / v
                done[(kind, mb, s)] = end
                free[r] = end
                label = str(mb) if len(op) <= 2 else f"{mb}.{chunk}"
                spans[r].append((kind, label, start, end))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: tuple(schedules[r][pos[r]]) for r in range(p) if pos[r] < len(schedules[r])}
            raise ValueError(f"the schedules deadlock: every rank waits on an input that never comes; next ops {stuck}")
    return spans


def check_schedule(schedules: Sequence[Sequence[Op]], m: int) -> None:
    """AssertionError (saying what is wrong) unless the per-rank schedules form a valid 1F1B-style pipeline step.

    Every rank runs F and B of each micro-batch exactly once, F before B; the ranks can run them
    without deadlock; rank r never holds more than p - r micro-batches in flight.
    """
    p = len(schedules)
    for r, sched in enumerate(schedules):
        raw = [tuple(op) for op in sched]
        bad = [op for op in raw if len(op) != 2 or op[0] not in ("F", "B") or not isinstance(op[1], int)]
        if bad:
            raise AssertionError(f"rank {r}: ops must be ('F', mb) or ('B', mb) with an int mb, got {bad[0]!r}")
        ops = cast(list[Op], raw)  # checked just above
        for kind in ("F", "B"):
            mbs = sorted(mb for k, mb in ops if k == kind)
            if mbs != list(range(m)):
                raise AssertionError(f"rank {r}: the {kind} ops cover micro-batches {mbs}, expected each of 0..{m - 1} once")
        seen: set[int] = set()
        for k, mb in ops:
            if k == "F":
                seen.add(mb)
            elif mb not in seen:
                raise AssertionError(f"rank {r}: ('B', {mb}) comes before ('F', {mb})")
        peak = in_flight(ops)
        if peak > p - r:
            raise AssertionError(f"rank {r}: {peak} micro-batches in flight at once, at most p - rank = {p - r} allowed")
    try:
        simulate(schedules)
    except ValueError as err:
        raise AssertionError(str(err)) from None


# ---- what a stage records -------------------------------------------------------------------------


class _Held:
    """A tensor autograd saved for backward; telling the meter when autograd lets go of it."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: SavedActivationMeter, key: tuple[int, int], tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedActivationMeter:
    """Counts the bytes of activations autograd holds for backward, over time (parameters excluded).

    Inside ``with meter.track():`` every saved tensor is counted (each distinct tensor memory once) until
    autograd frees it, which happens as the backward pass consumes it. ``samples`` holds
    ``(time, live_bytes)`` after every change; ``peak`` the largest live count.
    """

    def __init__(self, params: Sequence[torch.Tensor] = ()) -> None:
        self._param_storages = {p.untyped_storage().data_ptr() for p in params}
        self._refs: dict[tuple[int, int], list[int]] = {}  # (address, bytes) -> [bytes, references]
        self.live = 0
        self.peak = 0
        self.samples: list[tuple[float, int]] = []

    def reset(self) -> None:
        """Forget the history (tensors still held stay counted)."""
        self.peak = self.live
        self.samples = []

    def track(self) -> Any:
        """A context manager: tensors saved for backward inside it are counted."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        if t.untyped_storage().data_ptr() in self._param_storages:
            return t
        # A view counts for its own bytes (a micro-batch is a view of the whole batch).
        key = (t.data_ptr(), t.numel() * t.element_size())
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [key[1], 1]
            self.live += self._refs[key][0]
            self._sample()
        else:
            entry[1] += 1
        return _Held(self, key, t)

    @staticmethod
    def _unpack(obj: Any) -> torch.Tensor:
        return obj.tensor if isinstance(obj, _Held) else obj

    def _release(self, key: tuple[int, int]) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._refs[key]
            self.live -= entry[0]
            self._sample()

    def _sample(self) -> None:
        self.peak = max(self.peak, self.live)
        self.samples.append((time.perf_counter(), self.live))


class _BackwardStart(torch.autograd.Function):
    """Identity; its backward runs first in the stage's backward pass: note the time, sleep the stage's backward delay."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, stage: Stage, mb: int) -> torch.Tensor:
        ctx.stage, ctx.mb = stage, mb
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.stage._b_start[ctx.mb] = Timeline.now()
        if ctx.stage.backward_delay > 0:
            time.sleep(ctx.stage.backward_delay)
        return grad, None, None


class _BackwardEnd(torch.autograd.Function):
    """Identity; its backward runs last in the stage's backward pass: record the B span."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, stage: Stage, mb: int) -> torch.Tensor:
        ctx.stage, ctx.mb, ctx.x_needs_grad = stage, mb, x.requires_grad
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None]:
        stage = ctx.stage
        if grad.is_cuda:  # kernels run asynchronously: wait for them, so the span ends when the work does
            torch.cuda.synchronize(grad.device)
        start = stage._b_start.pop(ctx.mb, None)
        if start is not None:
            stage.timeline.add("B", str(ctx.mb), start, Timeline.now())
        return (grad if ctx.x_needs_grad else None), None, None, None


class Stage(nn.Module):
    """One pipeline stage: ``layers`` plus bookkeeping. Call it like the layers, once per micro-batch.

    Forward passes are numbered 0, 1, ... in call order (``new_step()`` restarts the count);
    each records an ``("F", str(mb), start, end)`` span in ``self.timeline`` and its backward
    pass a ``("B", ...)`` span. ``forward_delay`` / ``backward_delay`` seconds of sleep per
    micro-batch stand in for compute that a tiny model does not have. ``self.meter`` counts the
    activation bytes saved for backward over time. On a GPU each span waits for its kernels
    (``torch.cuda.synchronize``), so the timestamps mean something, at the price of that sync.
    """

    def __init__(self, layers: nn.Module, *, forward_delay: float = 0.0, backward_delay: float = 0.0) -> None:
        super().__init__()
        self.layers = layers
        self.forward_delay = forward_delay
        self.backward_delay = backward_delay
        self.timeline = Timeline()
        self.meter = SavedActivationMeter(list(layers.parameters()))
        self._anchor = torch.zeros((), requires_grad=True)  # gives _BackwardEnd a differentiable input on stage 0
        self._b_start: dict[int, float] = {}
        self._mb = 0

    def new_step(self) -> None:
        """Restart the micro-batch count and forget the recorded spans and memory samples."""
        self._mb = 0
        self._b_start.clear()
        self.timeline = Timeline()
        self.meter.reset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mb = self._mb
        self._mb += 1
        start = Timeline.now()
        x = _BackwardEnd.apply(x, self._anchor, self, mb)
        with self.meter.track():
            y = self.layers(x)
        if y.is_cuda:  # kernels run asynchronously: wait for them, so the span ends when the work does
            torch.cuda.synchronize(y.device)
        if self.forward_delay > 0:
            time.sleep(self.forward_delay)
        y = _BackwardStart.apply(y, self, mb)
        self.timeline.add("F", str(mb), start, Timeline.now())
        return y


# ---- executors ------------------------------------------------------------------------------------


def _grad(t: torch.Tensor) -> torch.Tensor:
    """``t.grad``, which the backward pass has just filled."""
    assert t.grad is not None, "the backward pass did not reach this tensor"
    return t.grad


def _micro_batches(batch: Sequence[torch.Tensor], m: int) -> list[tuple[torch.Tensor, ...]]:
    return split_micro_batches(tuple(batch), m)


def gpipe_step(stage: nn.Module, batch: Sequence[torch.Tensor], m: int, loss_fn: LossFn) -> torch.Tensor | None:
    """One GPipe step on this rank's stage: m forwards (receive, compute, send), then m backwards; gradients accumulate.

    ``batch`` = (x, y), the whole batch, on every rank. Stage 0 feeds micro-batches of x; the
    last stage computes ``loss_fn(out, y_mb) / m`` and returns the summed (= mean) loss; other
    ranks return None. Blocking ``dist.send``/``dist.recv``: in GPipe's order they cannot deadlock.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mbs = _micro_batches(batch, m)
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
    """
    from course_lib.support.dist import rank_device

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    ops = []
    for peer in (rank - 1, rank + 1):
        if 0 <= peer < world:
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


def exchange(send: tuple[torch.Tensor, int] | None = None, recv: tuple[torch.Tensor, int] | None = None) -> list[Any]:
    """Post one send and/or one receive together (``dist.batch_isend_irecv``); wait for the receive only.

    ``send`` = (tensor, peer), ``recv`` = (buffer, peer). Returns the send's work handle(s):
    wait for them before the step ends. Posting a send together with the next receive is what
    keeps 1F1B free of deadlocks with NCCL, whose sends may wait for the matching receive.
    """
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send[0].contiguous(), send[1]))
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
    stage: nn.Module, schedule: Sequence[Op], batch: Sequence[torch.Tensor], m: int, loss_fn: LossFn
) -> torch.Tensor | None:
    """Execute this rank's ``schedule`` of ("F", mb) / ("B", mb) ops; same contract as ``gpipe_step``.

    Each op's outgoing message (activation forward, gradient backward) is posted together with
    the next op's incoming one through ``exchange``; the last one after the loop. Micro-batch
    state is dropped after its B, so memory follows the schedule's in-flight count.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mbs = _micro_batches(batch, m)
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


# ---- reference and drivers ------------------------------------------------------------------------


def reference_step(
    model: nn.Module, batch: Sequence[torch.Tensor], loss_fn: LossFn = F.mse_loss
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The single-process step: loss of the whole batch and every parameter's gradient (the model's .grad is left alone)."""
    x, y = batch
    params = list(model.parameters())
    loss = loss_fn(model(x), y)
    grads = torch.autograd.grad(loss, params)
    return loss.detach(), [g.detach() for g in grads]


_SCHEDULES = {"naive": naive_schedule, "gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def run_pipeline(
    model: nn.Sequential,
    batch: Sequence[torch.Tensor],
    m: int,
    schedule: str | Callable[[int, int, int], Sequence[Op]] = "gpipe",
    *,
    bounds: Sequence[tuple[int, int]] | None = None,
    executor: Callable[..., Any] = run_schedule,
    forward_delay: float = 0.0,
    backward_delay: float = 0.0,
    loss_fn: LossFn = F.mse_loss,
    lr: float = 0.0,
    warmup: bool = True,
) -> dict[str, Any]:
    """In a rank: build this rank's stage of ``model``, run one timed pipeline step, return what it measured.

    ``schedule`` names one of "naive", "gpipe", "1f1b" or is a function (p, m, rank) -> ops;
    ``executor(stage, ops, batch, m, loss_fn)`` runs it (``gpipe_step`` style executors take no
    ops: pass ``executor=lambda st, ops, *a: gpipe_step(st, *a)``). ``bounds`` default: equal
    layer counts (``balanced_partition`` with unit costs). With ``lr`` > 0 an SGD step follows.
    Returns a dict: loss (last rank, else None), grads and params (this stage's, after the
    step), spans, memory samples, peak_bytes, bounds.
    """
    from course_lib.support.dist import rank_device

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    bounds = list(bounds) if bounds is not None else balanced_partition([1.0] * len(model), world)
    sched_fn = _SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    ops = list(sched_fn(world, m, rank))
    stage = Stage(stage_layers(model, bounds, rank).to(dev), forward_delay=0.0, backward_delay=0.0)
    batch = tuple(t.to(dev) for t in batch)
    if warmup:  # one untimed step: first-call costs (autograd, p2p connections) stay out of the chart
        executor(stage, ops, batch, m, loss_fn)
        stage.zero_grad(set_to_none=True)
        stage.new_step()
    stage.forward_delay, stage.backward_delay = forward_delay, backward_delay
    dist.barrier()
    loss = executor(stage, ops, batch, m, loss_fn)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in stage.layers.parameters()]
    if lr > 0:
        torch.optim.SGD(stage.layers.parameters(), lr=lr).step()
    return {
        "loss": None if loss is None else loss.detach(),
        "grads": grads,
        "params": [p.detach().clone() for p in stage.layers.parameters()],
        "spans": list(stage.timeline.spans),
        "memory": list(stage.meter.samples),
        "peak_bytes": stage.meter.peak,
        "bounds": bounds,
        "ops": ops,
    }


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

    from course_lib.support.dist import rank_device

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


# ---- plots ----------------------------------------------------------------------------------------

_COLORS = {"F": "#4C72B0", "B": "#DD8452"}


def plot_gantt(
    ax: Any, spans_by_rank: Sequence[Sequence[tuple[str, str, float, float]]], title: str = "", *,
    unit: float = 1e3, label_mb: bool = True,
) -> Any:
    """Draw per-rank F/B spans as a Gantt chart (rank 0 at the top; gaps are idle time). ``unit`` 1e3: milliseconds."""
    everything = [s for spans in spans_by_rank for (_, _, s, _) in spans]
    t0 = min(everything) if everything else 0.0
    p = len(spans_by_rank)
    for r, spans in enumerate(spans_by_rank):
        row = p - 1 - r
        for kind, label, s, e in spans:
            if kind not in _COLORS:
                continue
            ax.barh(row, (e - s) * unit, left=(s - t0) * unit, height=0.8, color=_COLORS[kind], edgecolor="white", linewidth=0.5)
            if label_mb and (e - s) * unit > 0:
                ax.text((s - t0 + (e - s) / 2) * unit, row, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {r}" for r in reversed(range(p))])
    ax.set_xlabel("time since the step started (ms)" if unit == 1e3 else "time")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=_COLORS["F"], label="forward"), Patch(color=_COLORS["B"], label="backward"),
                       Patch(facecolor="white", edgecolor="gray", label="idle")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if title:
        ax.set_title(title)
    return ax


# ---- torchrun entry -------------------------------------------------------------------------------


def _check_against_reference(
    result: dict[str, Any], model: nn.Sequential, batch: Sequence[torch.Tensor], name: str, rtol: float = 1e-4, atol: float = 1e-6
) -> float:
    """Compare this rank's loss and gradients with the single-process step; return the max abs error over all ranks."""
    from course_lib.support.dist import rank_device
    from course_lib.support.torchrun import assert_matches_reference

    rank, world = dist.get_rank(), dist.get_world_size()
    ref_loss, ref_grads = reference_step(model, batch)
    start, end = result["bounds"][rank]
    mine = [g.cpu() for g in ref_grads[2 * start:2 * end]]  # two parameters (weight, bias) per block
    got = [g.cpu() for g in result["grads"]]
    assert_matches_reference(got, mine, name=f"{name} gradients (stage {rank})", rtol=rtol, atol=atol)
    err = max(float((g - r).abs().max()) for g, r in zip(got, mine))
    if rank == world - 1:
        assert_matches_reference(result["loss"].cpu(), ref_loss.cpu(), name=f"{name} loss", rtol=rtol, atol=atol)
        err = max(err, float((result["loss"].cpu() - ref_loss).abs()))
    t = torch.tensor([err], dtype=torch.float64, device=rank_device())  # NCCL reduces GPU tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _main_in_rank(small: bool) -> dict[str, Any]:
    from course_lib.support.dist import rank_device

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    # --small: tiny layers, the stages' "compute" is a sleep (10 ms F, 20 ms B). Otherwise real work
    # (a 4096-wide fp32 layer on 1024-row micro-batches) and no sleep.
    width, rows, m = (8, 4, 2 * world) if small else (4096, 1024, 4 * world)
    delay = 0.01 if small else 0.0
    tol = dict(rtol=1e-4, atol=1e-6) if small else dict(rtol=1e-3, atol=1e-5)  # fp32 sums in other orders on a GPU
    model = make_model(2 * world, width, seed=0).to(dev)
    gen = torch.Generator().manual_seed(1)
    batch = tuple(torch.randn(rows * m, width, generator=gen).to(dev) for _ in range(2))
    result: dict[str, Any] = {"world_size": world, "micro_batches": m, "bubble_formula": bubble_fraction(world, m)}
    for name, sched, mbs in (("naive", "gpipe", 1), ("gpipe", "gpipe", m), ("1f1b", "1f1b", m)):
        out = run_pipeline(model, batch, mbs, sched, forward_delay=delay, backward_delay=2 * delay)
        err = _check_against_reference(out, model, batch, name, **tol)
        if rank == 0:
            print(f"CHECK {name} ok max_abs_err={err:.3g}", flush=True)
        spans = _gather(out["spans"])
        peaks = _gather(out["peak_bytes"])
        window = max(e for s in spans for *_, e in s) - min(st for s in spans for _, _, st, _ in s)
        result[name] = {
            "micro_batches": mbs,
            "bubble_formula": bubble_fraction(world, mbs),
            "bubble_measured": measured_bubble(spans),
            "step_seconds": window,
            "peak_activation_bytes": peaks,
        }
    return result


def main(argv: Sequence[str] | None = None) -> None:
    """``torchrun --nproc_per_node N -m course_lib.pipeline_parallel [--small]``: check naive, GPipe, 1F1B; print RESULT json."""
    from course_lib.support.torchrun import entry_main

    entry_main(_main_in_rank, "Check the naive split, GPipe and 1F1B on N pipeline stages and measure their bubbles.", argv)


if __name__ == "__main__":
    main()
