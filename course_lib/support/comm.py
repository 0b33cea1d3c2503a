"""A recorder of the ``torch.distributed`` calls made inside a block: count them, size them, time them, forbid them.

    with record_collectives() as log:
        model(x).sum().backward()
    log.count("all_reduce"), log.bytes("all_reduce")       # calls and payload bytes of this rank

It replaces the functions of the ``torch.distributed`` module for the duration of the block, so it
sees code that calls ``dist.all_reduce(...)``, ``dist.isend(...)``, ``dist.batch_isend_irecv(...)``
and the rest through that module (as the course's code does); DTensor and torch's DDP go through
other paths. The payload of a call is the bytes of this rank's tensor: the input of a reduction or
a broadcast, this rank's contribution to an all-gather, the tensor sent or received by a
point-to-point call. With ``timeline`` each call is also recorded as a span, from the call to its
completion (the return of a synchronous call; for an asynchronous one, when its future completes).
The work handle of an asynchronous call comes back wrapped, so that the log also knows when the
code first called its ``wait()`` (``Call.waited``): an overlap check can then tell "started early
and waited for late" from "started and waited for at once".
``forbid`` names operations that raise AssertionError instead of running (an exercise that must
build a collective from send/recv).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from course_lib.support.timeline import Timeline

__all__ = ["COLLECTIVES", "POINT_TO_POINT", "Call", "CommLog", "record_collectives"]

# Collectives, with the position of the argument whose bytes are this rank's payload.
COLLECTIVES: dict[str, int] = {
    "all_reduce": 0, "broadcast": 0, "reduce": 0, "all_gather": 1, "all_gather_into_tensor": 1,
    "reduce_scatter": 1, "reduce_scatter_tensor": 1, "gather": 0, "scatter": 0, "all_to_all": 1,
    "all_to_all_single": 1, "broadcast_object_list": 0, "all_gather_object": 1, "gather_object": 0,
    "scatter_object_list": 1, "reduce_scatter_single": 1, "all_gather_single": 1,
}
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


@dataclass
class Call:
    """One recorded call: the operation, this rank's payload bytes, the peer of a point-to-point call, its span.

    ``async_op``: the call returned at once with a work handle (``async_op=True``, ``isend``/``irecv``,
    ``batch_isend_irecv``) instead of waiting for completion. ``waited``: when the code first called
    ``wait()`` on that handle (None if it never did, or for a synchronous call). ``contiguous``: every
    tensor handed to the call (inputs and output buffers) was contiguous, which NCCL needs and gloo
    does not check for every operation. For a point-to-point call: ``shape`` and ``dtype`` of its
    tensor, and ``batch``, the number (in this log, from 0) of the ``batch_isend_irecv`` that posted
    it (None when posted on its own).
    """

    op: str
    bytes: int
    peer: int | None = None
    start: float = 0.0
    end: float | None = None  # None until it completes
    async_op: bool = False
    waited: float | None = None
    contiguous: bool = True
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    batch: int | None = None


class _RecordedWork:
    """A work handle that notes in its ``Call`` when ``wait()`` is first called; everything else is the handle's."""

    def __init__(self, work: Any, call: Call) -> None:
        self._work, self._call = work, call

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        """The handle's ``wait``, timed."""
        if self._call.waited is None:
            self._call.waited = Timeline.now()
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@dataclass
class CommLog:
    """What ``record_collectives`` saw, in call order (``batch_isend_irecv`` as its isend and irecv operations)."""

    calls: list[Call] = field(default_factory=list)

    def of(self, op: str | None = None) -> list[Call]:
        """The calls of ``op`` (all when None)."""
        return [c for c in self.calls if op is None or c.op == op]

    def count(self, op: str | None = None) -> int:
        """Number of calls (of ``op`` only, if given)."""
        return len(self.of(op))

    def bytes(self, op: str | None = None) -> int:
        """Total payload bytes (of ``op`` only, if given)."""
        return sum(c.bytes for c in self.of(op))

    def clear(self) -> None:
        """Forget what was recorded so far."""
        self.calls.clear()


def _payload(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_payload(v) for v in x)
    return 0


def _all_contiguous(*values: Any) -> bool:
    """Every tensor in ``values`` (searched through lists, tuples and dict values) is contiguous."""
    for v in values:
        if isinstance(v, torch.Tensor) and not v.is_contiguous():
            return False
        if isinstance(v, (list, tuple)) and not _all_contiguous(*v):
            return False
        if isinstance(v, dict) and not _all_contiguous(*v.values()):
            return False
    return True


def _tensor_arg(args: tuple, kwargs: dict[str, Any], at: int) -> Any:
    if len(args) > at:
        return args[at]
    return next((v for v in kwargs.values() if isinstance(v, (torch.Tensor, list))), None)


class _Recorder:
    """The wrappers of one ``record_collectives`` block."""

    def __init__(self, log: CommLog, timeline: Timeline | None, lane: str, forbid: Collection[str], reason: str) -> None:
        self.log, self.timeline, self.lane, self.forbid, self.reason = log, timeline, lane, set(forbid), reason
        self.batches = 0  # batch_isend_irecv calls so far

    def _start(self, op: str, n_bytes: int, peer: int | None = None, async_op: bool = False,
               contiguous: bool = True) -> Call:
        if op in self.forbid:
            raise AssertionError(f"dist.{op} is not allowed here" + (f": {self.reason}" if self.reason else ""))
        call = Call(op, n_bytes, peer, Timeline.now(), async_op=async_op, contiguous=contiguous)
        self.log.calls.append(call)
        return call

    def _finish(self, call: Call, work: Any) -> None:
        def done(*_: Any) -> None:
            call.end = Timeline.now()
            if self.timeline is not None:
                self.timeline.add(self.lane, call.op, str(len(self.timeline.of(self.lane, call.op))), call.start, call.end)

        future = None
        if work is not None and hasattr(work, "get_future"):
            with contextlib.suppress(RuntimeError):  # a backend's work without a future: end unknown
                future = work.get_future()
        if future is not None:
            future.then(done)
        elif work is None:
            done()

    def collective(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            async_op = bool(kwargs.get("async_op", False))
            call = self._start(name, _payload(_tensor_arg(args, kwargs, COLLECTIVES[name])), async_op=async_op,
                               contiguous=_all_contiguous(args, kwargs))
            result = fn(*args, **kwargs)
            self._finish(call, result if async_op else None)
            return _RecordedWork(result, call) if async_op and result is not None else result
        return recorded

    def point_to_point(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if name == "batch_isend_irecv":
                ops = list(args[0] if args else kwargs["p2p_op_list"])
                calls = [self._start(op.op.__name__, _payload(op.tensor), op.peer, async_op=True,
                                     contiguous=_all_contiguous(op.tensor)) for op in ops]
                for call, op in zip(calls, ops):
                    call.shape, call.dtype, call.batch = tuple(op.tensor.shape), op.tensor.dtype, self.batches
                self.batches += 1
                works = fn(ops)
                for call, work in zip(calls, works or [None] * len(calls)):
                    self._finish(call, work)
                return works if not works else [_RecordedWork(w, c) for w, c in zip(works, calls)]
            tensor = args[0] if args else kwargs["tensor"]
            peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
            call = self._start(name, _payload(tensor), peer, async_op=name in ("isend", "irecv"),
                               contiguous=_all_contiguous(tensor))
            if isinstance(tensor, torch.Tensor):
                call.shape, call.dtype = tuple(tensor.shape), tensor.dtype
            result = fn(*args, **kwargs)
            if name in ("isend", "irecv"):
                self._finish(call, result)
                return None if result is None else _RecordedWork(result, call)
            self._finish(call, None)
            return result
        return recorded


class _P2POp(dist.P2POp):
    """``dist.P2POp`` that accepts the recorder's ``isend``/``irecv`` (it checks the functions' identity)."""

    def __new__(cls, op: Callable[..., Any], *args: Any, **kwargs: Any) -> _P2POp:
        return super().__new__(cls, inspect.unwrap(op), *args, **kwargs)

    def __init__(self, op: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(inspect.unwrap(op), *args, **kwargs)


@contextlib.contextmanager
def record_collectives(*, timeline: Timeline | None = None, lane: str = "communication",
                       forbid: Collection[str] = (), reason: str = "") -> Iterator[CommLog]:
    """Inside the block, record every ``torch.distributed`` collective and point-to-point call in the yielded log.

    ``timeline`` also gets a span per completed call on ``lane`` (kind: the operation's name).
    ``forbid``: names of operations (keys of ``COLLECTIVES`` or ``POINT_TO_POINT``) that raise an
    AssertionError saying ``reason`` instead of running. Blocks may nest; each restores what it replaced.
    """
    unknown = set(forbid) - set(COLLECTIVES) - set(POINT_TO_POINT)
    if unknown:
        raise ValueError(f"cannot forbid {sorted(unknown)}: not torch.distributed operations this recorder knows")
    log = CommLog()
    recorder = _Recorder(log, timeline, lane, forbid, reason)
    originals = {name: getattr(dist, name) for name in (*COLLECTIVES, *POINT_TO_POINT) if hasattr(dist, name)}
    original_op = dist.P2POp
    try:
        for name, fn in originals.items():
            wrap = recorder.point_to_point if name in POINT_TO_POINT else recorder.collective
            setattr(dist, name, wrap(name, fn))
        dist.P2POp = _P2POp  # type: ignore[misc]
        yield log
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        dist.P2POp = original_op  # type: ignore[misc]
