"""Chapter 14's harness: the instrumented stage test cells and demos run a rank's layers in, one timed step, the checks.

- ``Stage``: a rank's layers plus bookkeeping: the span of each micro-batch's forward (F) and
  backward (B) pass on a ``Timeline`` (lane "stage <rank>"), the bytes of activations autograd
  saves over time (``SavedActivationMeter``), and optional sleeps that stand in for compute;
- ``run_pipeline``: inside a rank, build this rank's stage of a model and run one timed step of a
  schedule with an executor (``pp.run_schedule``, ``pp.gpipe_step`` or a student's); returns
  what the stage recorded;
- ``virtual_stages`` and ``run_interleaved_pipeline``: the same for interleaved 1F1B, the p*v
  virtual stages of a rank sharing one lane and one activation meter;
- ``stage_reference``: the single-process loss and the gradients one stage must end with;
- ``check_schedule`` and ``check_interleaved_schedule``: AssertionError, saying which property
  fails, unless per-rank schedules form a valid pipeline step;
- ``recording_p2p`` and ``check_p2p_order``: the point-to-point operations each rank posted, and
  the check that their order would also run under NCCL (gloo lets through orders NCCL hangs on).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import pipeline_parallel as pp
from course_lib.accumulation_checkpointing import LossFn
from course_lib.support.comm import Call, record_collectives
from course_lib.support.dist import rank_device
from course_lib.support.timeline import Timeline

__all__ = ["P2POp", "SavedActivationMeter", "Stage", "check_interleaved_schedule", "check_p2p_order", "check_schedule",
           "recording_p2p", "run_interleaved_pipeline", "run_pipeline", "stage_reference", "virtual_stages"]


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


def _settle(t: torch.Tensor) -> None:
    """On a GPU, wait until the kernels queued so far on ``t``'s current stream have run.

    The current stream only: it holds this stage's compute, and a receive's ``wait()`` under NCCL
    makes this stream wait for the data. A span started after this starts once its input has
    arrived, and one ended by it ends when its compute does, not when an in-flight send on NCCL's
    own stream does (``torch.cuda.synchronize`` would wait for that too, counting it as work).
    """
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


class _BackwardStart(torch.autograd.Function):
    """Identity; its backward runs first in the stage's backward pass: note the time, sleep the stage's backward delay."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, stage: Stage, mb: int) -> torch.Tensor:
        ctx.stage, ctx.mb = stage, mb
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _settle(grad)  # the incoming gradient has arrived: waiting for it is idle time, not B
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
        _settle(grad)  # kernels run asynchronously: the span ends when the stage's work does
        start = stage._b_start.pop(ctx.mb, None)
        if start is not None:
            stage.timeline.add(stage.lane, "B", stage.label(ctx.mb), start, Timeline.now())
        return (grad if ctx.x_needs_grad else None), None, None, None


class Stage(nn.Module):
    """One pipeline stage: ``layers`` plus bookkeeping. Call it like the layers, once per micro-batch.

    Forward passes are numbered 0, 1, ... in call order (``new_step()`` restarts the count);
    each records a span of kind "F" labelled with its number in ``self.timeline``, on lane
    ``lane`` (default "stage <rank>"), and its backward pass a span of kind "B".
    ``forward_delay`` / ``backward_delay`` seconds of sleep per micro-batch stand in for compute
    that a tiny model does not have. ``self.meter`` counts the activation bytes saved for
    backward over time. On a GPU each span starts once its input has arrived and ends when its
    kernels have run (the compute stream is synchronised at both ends, not the whole device, so an
    in-flight send does not count as work), at the price of those syncs.
    """

    def __init__(self, layers: nn.Module, *, forward_delay: float = 0.0, backward_delay: float = 0.0,
                 lane: str | None = None, chunk: int | None = None, timeline: Timeline | None = None,
                 meter: SavedActivationMeter | None = None) -> None:
        super().__init__()
        self.layers = layers
        self.lane = lane if lane is not None else f"stage {dist.get_rank() if dist.is_initialized() else 0}"
        self.chunk = chunk
        self.forward_delay = forward_delay
        self.backward_delay = backward_delay
        self.timeline = timeline if timeline is not None else Timeline()
        self.meter = meter if meter is not None else SavedActivationMeter(list(layers.parameters()))
        self._anchor = torch.zeros((), requires_grad=True)  # gives _BackwardEnd a differentiable input on stage 0
        self._b_start: dict[int, float] = {}
        self._mb = 0

    def new_step(self) -> None:
        """Restart the micro-batch count and forget the recorded spans and memory samples (of a shared timeline too)."""
        self._mb = 0
        self._b_start.clear()
        self.timeline.spans.clear()
        self.meter.reset()

    def label(self, mb: int) -> str:
        """The label of micro-batch ``mb``'s spans: "mb", or "mb.chunk" for a chunk of an interleaved stage."""
        return str(mb) if self.chunk is None else f"{mb}.{self.chunk}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mb = self._mb
        self._mb += 1
        _settle(x)  # the micro-batch has arrived: waiting for it is idle time, not F
        start = Timeline.now()
        x = _BackwardEnd.apply(x, self._anchor, self, mb)
        with self.meter.track():
            y = self.layers(x)
        _settle(y)  # kernels run asynchronously: the span ends when the work does
        if self.forward_delay > 0:
            time.sleep(self.forward_delay)
        y = _BackwardStart.apply(y, self, mb)
        self.timeline.add(self.lane, "F", self.label(mb), start, Timeline.now())
        return y


# ---- one timed step in a rank ---------------------------------------------------------------------


def run_pipeline(
    model: nn.Sequential,
    batch: Sequence[torch.Tensor],
    m: int,
    schedule: str | Callable[[int, int, int], Sequence[pp.Action]] = "gpipe",
    *,
    bounds: Sequence[tuple[int, int]] | None = None,
    executor: Callable[..., Any] = pp.run_schedule,
    forward_delay: float = 0.0,
    backward_delay: float = 0.0,
    loss_fn: LossFn = F.mse_loss,
    lr: float = 0.0,
    warmup: bool = True,
) -> dict[str, Any]:
    """In a rank: build this rank's ``Stage`` of ``model``, run one timed pipeline step, return what it measured.

    ``schedule`` names one of ``pp.SCHEDULES`` or is a function (p, m, rank) -> actions;
    ``executor(stage, actions, batch, m, loss_fn)`` runs it (``gpipe_step`` style executors take no
    actions: pass ``executor=lambda st, actions, *a: gpipe_step(st, *a)``). ``bounds`` default: equal
    layer counts (``balanced_partition`` with unit costs). With ``lr`` > 0 an SGD step follows.
    Returns a dict: loss (last rank, else None), grads and params (this stage's, after the
    step), timeline (the stage's F/B spans, lane "stage <rank>"), memory samples, peak_bytes,
    bounds, actions.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    bounds = list(bounds) if bounds is not None else pp.balanced_partition([1.0] * len(model), world)
    sched_fn = pp.SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    actions = list(sched_fn(world, m, rank))
    stage = Stage(pp.stage_layers(model, bounds, rank).to(dev), lane=f"stage {rank}")
    batch = tuple(t.to(dev) for t in batch)
    if warmup:  # one untimed step: first-call costs (autograd, p2p connections) stay out of the chart
        executor(stage, actions, batch, m, loss_fn)
        stage.zero_grad(set_to_none=True)
        stage.new_step()
    stage.forward_delay, stage.backward_delay = forward_delay, backward_delay
    dist.barrier()
    loss = executor(stage, actions, batch, m, loss_fn)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in stage.layers.parameters()]
    if lr > 0:
        torch.optim.SGD(stage.layers.parameters(), lr=lr).step()
    return {
        "loss": None if loss is None else loss.detach(),
        "grads": grads,
        "params": [p.detach().clone() for p in stage.layers.parameters()],
        "timeline": stage.timeline,
        "memory": list(stage.meter.samples),
        "peak_bytes": stage.meter.peak,
        "bounds": bounds,
        "actions": actions,
    }


def virtual_stages(model: nn.Sequential, p: int, v: int, rank: int, *, timeline: Timeline | None = None,
                   meter: SavedActivationMeter | None = None) -> list[Stage]:
    """The p*v virtual stages of ``model`` (equal layer counts), each a ``Stage`` on lane "stage <rank>".

    Every rank builds all of them (an interleaved executor picks its own: chunk c is
    ``parts[c*p + rank]``); all share one timeline and one activation meter, so the rank's
    spans and its live activation bytes are counted together whichever chunk runs.
    """
    bounds = pp.balanced_partition([1.0] * len(model), p * v)
    layers = [pp.stage_layers(model, bounds, s) for s in range(p * v)]
    timeline = timeline if timeline is not None else Timeline()
    if meter is None:
        meter = SavedActivationMeter([q for part in layers for q in part.parameters()])
    return [Stage(part, lane=f"stage {rank}", chunk=s // p, timeline=timeline, meter=meter) for s, part in enumerate(layers)]


def run_interleaved_pipeline(
    model: nn.Sequential,
    batch: Sequence[torch.Tensor],
    m: int,
    v: int,
    *,
    schedule: Callable[[int, int, int, int], Sequence[pp.ChunkAction]] = pp.interleaved_schedule,
    executor: Callable[..., Any] = pp.run_interleaved,
    forward_delay: float = 0.0,
    backward_delay: float = 0.0,
    loss_fn: LossFn = F.mse_loss,
    warmup: bool = True,
) -> dict[str, Any]:
    """In a rank: one timed interleaved step of ``model`` cut into p*v virtual stages; what ``run_pipeline`` returns.

    ``executor(parts, actions, batch, m, loss_fn)`` runs ``schedule(p, m, v, rank)``. Each chunk
    sleeps ``forward_delay / v`` and ``backward_delay / v`` per micro-batch (a chunk is 1/v of a
    stage). grads: the parameters of this rank's chunks, chunk by chunk.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    parts = virtual_stages(model.to(dev), world, v, rank)
    mine = [parts[c * world + rank] for c in range(v)]
    actions = list(schedule(world, m, v, rank))
    batch = tuple(t.to(dev) for t in batch)
    if warmup:
        executor(parts, actions, batch, m, loss_fn)
        for part in parts:
            part.zero_grad(set_to_none=True)
            part.new_step()
    for part in parts:
        part.forward_delay, part.backward_delay = forward_delay / v, backward_delay / v
    dist.barrier()
    loss = executor(parts, actions, batch, m, loss_fn)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    params = [q for part in mine for q in part.layers.parameters()]
    return {
        "loss": None if loss is None else loss.detach(),
        "grads": [q.grad.detach().clone() if q.grad is not None else torch.zeros_like(q) for q in params],
        "timeline": mine[0].timeline,
        "memory": list(mine[0].meter.samples),
        "peak_bytes": mine[0].meter.peak,
        "actions": actions,
    }


# ---- checks ---------------------------------------------------------------------------------------


def stage_reference(
    model: nn.Sequential, batch: Sequence[torch.Tensor], bounds: Sequence[tuple[int, int]], rank: int,
    loss_fn: LossFn = F.mse_loss,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The single-process step's loss and the gradients of the parameters stage ``rank`` holds under ``bounds``."""
    loss, grads = pp.reference_step(model, batch, loss_fn)
    start, end = bounds[rank]
    counts = [len(list(layer.parameters())) for layer in model]
    first = sum(counts[:start])
    return loss, grads[first:first + sum(counts[start:end])]


def check_schedule(schedules: Sequence[Sequence[pp.Action]], m: int) -> None:
    """AssertionError (saying what is wrong) unless the per-rank schedules form a valid 1F1B-style pipeline step.

    Every rank runs F and B of each micro-batch exactly once, F before B; the ranks can run them
    without deadlock; rank r never holds more than p - r micro-batches in flight.
    """
    p = len(schedules)
    for r, sched in enumerate(schedules):
        raw = [tuple(action) for action in sched]
        bad = [a for a in raw if len(a) != 2 or a[0] not in ("F", "B") or not isinstance(a[1], int)]
        if bad:
            raise AssertionError(f"rank {r}: actions must be ('F', mb) or ('B', mb) with an int mb, got {bad[0]!r}")
        actions = cast(list[pp.Action], raw)  # checked just above
        for kind in ("F", "B"):
            mbs = sorted(mb for k, mb in actions if k == kind)
            if mbs != list(range(m)):
                raise AssertionError(f"rank {r}: the {kind} actions cover micro-batches {mbs}, expected each of 0..{m - 1} once")
        seen: set[int] = set()
        for k, mb in actions:
            if k == "F":
                seen.add(mb)
            elif mb not in seen:
                raise AssertionError(f"rank {r}: ('B', {mb}) comes before ('F', {mb})")
        peak = pp.in_flight(actions)
        if peak > p - r:
            raise AssertionError(f"rank {r}: {peak} micro-batches in flight at once, at most p - rank = {p - r} allowed")
    try:
        pp.simulate(schedules)
    except ValueError as err:
        raise AssertionError(str(err)) from None


def check_interleaved_schedule(schedules: Sequence[Sequence[Sequence[Any]]], m: int, v: int) -> None:
    """AssertionError (saying what is wrong) unless per-rank (kind, mb, chunk) schedules form a valid interleaved step.

    Every rank runs F and B of each (micro-batch, chunk) exactly once, F before B; the ranks can run
    them without deadlock (``pp.simulate``, chunk c of rank r being virtual stage c*p + r).
    """
    want = sorted((mb, c) for mb in range(m) for c in range(v))
    for r, sched in enumerate(schedules):
        actions = [tuple(a) for a in sched]
        bad = [a for a in actions if len(a) != 3 or a[0] not in ("F", "B") or not all(isinstance(x, int) for x in a[1:])]
        if bad:
            raise AssertionError(f"rank {r}: actions must be ('F' or 'B', mb, chunk) with int mb and chunk, got {bad[0]!r}")
        if len(actions) != 2 * m * v:
            raise AssertionError(f"rank {r}: {len(actions)} actions, expected 2*m*v = {2 * m * v} (an F and a B per "
                                 "micro-batch and chunk)")
        for kind in ("F", "B"):
            got = sorted((mb, c) for k, mb, c in actions if k == kind)
            if got != want:
                missing = sorted(set(want) - set(got))
                raise AssertionError(f"rank {r}: the {kind} actions do not cover each (micro-batch, chunk) of "
                                     f"0..{m - 1} x 0..{v - 1} once" + (f"; missing {missing[:3]}" if missing else ""))
        seen: set[tuple[int, int]] = set()
        for k, mb, c in actions:
            if k == "F":
                seen.add((mb, c))
            elif (mb, c) not in seen:
                raise AssertionError(f"rank {r}: ('B', {mb}, {c}) comes before ('F', {mb}, {c})")
    try:
        pp.simulate(schedules, v=v)
    except ValueError as err:
        raise AssertionError(str(err)) from None


# ---- the order of point-to-point messages --------------------------------------------------------


class P2POp(NamedTuple):
    """One point-to-point operation a rank posted: "send" or "recv", the peer, its tensor (bytes, shape, dtype), how posted.

    ``batch``: the number of the ``batch_isend_irecv`` that posted it (None for a plain send, recv,
    isend or irecv); ``together``: the number of the run of posts it belongs to, made with no
    ``wait()`` and no blocking call between them.
    """

    kind: str
    peer: int
    bytes: int
    batch: int | None
    together: int
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None


@contextlib.contextmanager
def recording_p2p() -> Iterator[list[P2POp]]:
    """Inside the block, record this rank's point-to-point operations in posting order; the list is filled at exit."""
    ops: list[P2POp] = []
    with record_collectives() as log:
        try:
            yield ops
        finally:
            together = 0
            run: list[Call] = []  # the calls of the current run of posts
            for call in log.calls:
                if call.op not in ("send", "recv", "isend", "irecv") or call.peer is None:
                    continue
                if any(not c.async_op or (c.waited is not None and c.waited <= call.start) for c in run):
                    together, run = together + 1, []
                run.append(call)
                ops.append(P2POp("send" if call.op in ("send", "isend") else "recv", int(call.peer), call.bytes,
                                 call.batch, together, call.shape, call.dtype))


def _tensor_text(op: P2POp) -> str:
    shape = "" if op.shape is None else f"shape {tuple(op.shape)}, "
    dtype = "" if op.dtype is None else f"{op.dtype}, "
    return f"{shape}{dtype}{op.bytes} bytes"


def _ordinal(k: int) -> str:
    return f"{k + 1}{'th' if 10 <= (k + 1) % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get((k + 1) % 10, 'th')}"


def check_p2p_order(ops_by_rank: Sequence[Sequence[P2POp]]) -> None:
    """AssertionError unless the ranks' point-to-point operations also match under NCCL, which gloo may not show.

    1. For every pair of ranks, the k-th send from a to b meets the k-th receive at b from a, and
       both have the same size (messages between two ranks are matched in order; NCCL has no tags).
    2. A send and a receive that a rank posts together with one peer (no wait between them) are
       posted in one ``batch_isend_irecv``, or in an order that mirrors the peer's: a rank that
       posts its send first meets a peer that posts the matching receive first. Otherwise each
       side's first operation waits for one the other side has queued behind its own, forever
       under NCCL (its operations run in posting order, and a send may wait for its receive);
       gloo's isend does not wait, and lets it pass.
    """
    key_of: dict[tuple[int, int], tuple[str, int, int, int]] = {}  # (rank, index) -> (kind, from, to, k)
    at: dict[tuple[str, int, int, int], tuple[int, int]] = {}  # (kind, from, to, k) -> (rank, index)
    counts: dict[tuple[str, int, int], int] = {}
    for r, ops in enumerate(ops_by_rank):
        for i, op in enumerate(ops):
            src, dst = (r, op.peer) if op.kind == "send" else (op.peer, r)
            k = counts.get((op.kind, src, dst), 0)
            counts[op.kind, src, dst] = k + 1
            key_of[r, i] = (op.kind, src, dst, k)
            at[op.kind, src, dst, k] = (r, i)
    for src, dst in sorted({(a, b) for _, a, b in counts}):
        n_send, n_recv = counts.get(("send", src, dst), 0), counts.get(("recv", src, dst), 0)
        if n_send != n_recv:
            raise AssertionError(f"rank {src} sends {n_send} message(s) to rank {dst}, which receives {n_recv} from it: "
                                 "every send needs exactly one matching receive")
        for k in range(n_send):
            (rs, i_s), (rr, i_r) = at["send", src, dst, k], at["recv", src, dst, k]
            sent, room = ops_by_rank[rs][i_s], ops_by_rank[rr][i_r]
            if (sent.bytes, sent.shape, sent.dtype) != (room.bytes, room.shape, room.dtype):
                raise AssertionError(
                    f"the {_ordinal(k)} message from rank {src} to rank {dst} holds {_tensor_text(sent)}, but the "
                    f"{_ordinal(k)} receive of rank {dst} from rank {src} expects {_tensor_text(room)}: messages between "
                    "two ranks are matched in posting order (NCCL has no tags), so both sides must post them in the same "
                    "order, with tensors of the same shape and dtype")

    def partner(r: int, i: int) -> int:
        kind, src, dst, k = key_of[r, i]
        return at["recv" if kind == "send" else "send", src, dst, k][1]

    for a, ops in enumerate(ops_by_rank):
        for i, u in enumerate(ops):
            for j in range(i + 1, len(ops)):
                v = ops[j]
                if v.together != u.together:
                    break
                if v.peer != u.peer or v.kind == u.kind or (u.batch is not None and u.batch == v.batch):
                    continue
                b = u.peer
                ui, vi = partner(a, i), partner(a, j)
                theirs = ops_by_rank[b]
                if vi < ui and (theirs[vi].batch is None or theirs[vi].batch != theirs[ui].batch):
                    raise AssertionError(
                        f"rank {a} posts a {u.kind} then a {v.kind} with rank {b} as separate operations, and rank {b} "
                        f"posts their partners the other way round (its {v.kind and theirs[vi].kind} first): under NCCL "
                        "each side's first operation waits for one the other side has queued behind its own, forever "
                        "(gloo let it pass). Post a step's send and receive together in one dist.batch_isend_irecv "
                        "(pp.exchange), or mirror the order on the two sides (even ranks send first, odd ranks receive first)")
