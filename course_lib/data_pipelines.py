"""Data pipelines: a synthetic image dataset, prefetchers, a model of DataLoader's schedule, timelines.

The pieces of chapter 05:

- ``SyntheticImages``: a ``Dataset`` of uint8 images with a configurable storage latency
  (``time.sleep`` per sample, the same for every sample or a repeating pattern) and real CPU
  preprocessing (``preprocess``: decode, random crop, normalise); it can return the timestamps of
  each stage for timeline plots.
- ``Prefetcher``: a background thread that runs ahead of the consumer by at most ``depth`` items.
- ``CudaPrefetcher``: copies the next batch to the GPU on a side stream while the current one
  computes, through ``CudaOps`` (the six CUDA calls it needs; ``RecordingOps`` is a stand-in that
  runs anywhere and logs them); on a CPU it is plain iteration plus ``.to(device)``.
- ``simulate_loader``: when each step starts under DataLoader's scheduling rules;
  ``bottleneck``: which stage limits a measured run, read from its timeline;
  ``prefetch_buffer_bytes``: the memory of the batches in flight.
- ``consume_batches``: the training loop with a simulated step (``fake_step``), recording on a
  ``course_lib.support.timeline.Timeline`` when each batch was waited for, computed, loaded and
  preprocessed (``add_sample_times``); ``STAGE_COLORS`` colours its Gantt chart (``plot_gantt``).

LLM-style token data (a memory-mapped token stream, sharded and resumable) is in ``token_data``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from course_lib.support.timeline import Timeline

__all__ = [
    "MEAN",
    "STD",
    "worker_init",
    "preprocess",
    "SyntheticImages",
    "Prefetcher",
    "map_tensors",
    "tensors_of",
    "to_device",
    "CudaOps",
    "RecordingOps",
    "CudaPrefetcher",
    "simulate_loader",
    "bottleneck",
    "prefetch_buffer_bytes",
    "STAGE_COLORS",
    "add_sample_times",
    "fake_step",
    "consume_batches",
]

# Per-channel mean and standard deviation used by ``preprocess`` (uint8 pixel scale 0..1).
MEAN = (0.5, 0.5, 0.5)
STD = (0.25, 0.25, 0.25)


def worker_init(worker_id: int) -> None:
    """``worker_init_fn`` for DataLoader workers: one torch thread each, so workers do not oversubscribe the cores."""
    torch.set_num_threads(1)


def preprocess(raw: np.ndarray, crop: int, rng: np.random.Generator | None = None,
               mean: tuple[float, ...] = MEAN, std: tuple[float, ...] = STD) -> torch.Tensor:
    """Decode one stored image: uint8 (H, W, C) bytes -> random ``crop`` x ``crop`` window -> float32 (C, crop, crop), normalised.

    ``rng`` picks the crop's corner (``None``: the centre crop), so a seeded generator repeats.
    """
    h, w, c = raw.shape
    if not 0 < crop <= min(h, w):
        raise ValueError(f"crop {crop} does not fit an image of {h}x{w}")
    if rng is None:
        top, left = (h - crop) // 2, (w - crop) // 2
    else:
        top, left = int(rng.integers(0, h - crop + 1)), int(rng.integers(0, w - crop + 1))
    x = torch.from_numpy(np.ascontiguousarray(raw[top:top + crop, left:left + crop]))
    x = x.permute(2, 0, 1).to(torch.float32).div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(c, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(c, 1, 1)
    return (x - m) / s


class SyntheticImages(Dataset):
    """``size`` random uint8 images (``height`` x ``width`` x 3) with ``latency`` seconds of simulated storage per sample.

    ``latency`` is one number for every sample, or a sequence: sample ``i`` then takes
    ``latency[i % len(latency)]`` seconds (a repeating pattern of fast and slow reads).

    Sample ``i`` is the same for a given ``seed`` in every process (its bytes come from
    ``default_rng(seed + i)``), and so is its random crop. ``__getitem__`` returns
    ``(image, label)``; with ``record=True`` it returns ``(image, label, times)``, where ``times``
    is a float64 tensor ``[start, loaded, done, worker]``: ``time.perf_counter()`` when the read
    began, when the bytes arrived and when preprocessing ended, and the DataLoader worker's id
    (-1 in the main thread of the main process, -2 in another thread of it, such as a
    ``Prefetcher``'s). ``perf_counter`` is system-wide on Linux, so worker and main-process
    times can be drawn on one axis.
    """

    def __init__(self, size: int = 256, latency: float | Sequence[float] = 0.0, seed: int = 0, height: int = 40,
                 width: int = 40, crop: int = 32, num_classes: int = 10, record: bool = False) -> None:
        pattern = [float(latency)] if isinstance(latency, (int, float)) else [float(t) for t in latency]
        if size < 0 or not pattern or min(pattern) < 0:
            raise ValueError("size must be non-negative and latency a non-negative number or a non-empty sequence of them")
        self.size, self.latency, self.seed = size, latency, seed
        self._pattern = pattern
        self.height, self.width, self.crop, self.num_classes, self.record = height, width, crop, num_classes, record

    def __len__(self) -> int:
        return self.size

    @property
    def sample_bytes(self) -> int:
        """Bytes of one preprocessed image (float32, 3 x crop x crop)."""
        return 3 * self.crop * self.crop * 4

    def raw(self, index: int) -> np.ndarray:
        """The stored bytes of sample ``index`` (uint8, H x W x 3), without the latency."""
        rng = np.random.default_rng(self.seed + index)
        return rng.integers(0, 256, (self.height, self.width, 3), dtype=np.uint8)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        start = time.perf_counter()
        pause = self._pattern[index % len(self._pattern)]
        if pause:
            time.sleep(pause)  # the storage read: disk, network, object store
        raw = self.raw(index)
        loaded = time.perf_counter()
        crop_rng = np.random.default_rng((self.seed, index))
        x = preprocess(raw, self.crop, crop_rng)
        label = torch.tensor(index % self.num_classes)
        if not self.record:
            return x, label
        info = torch.utils.data.get_worker_info()
        if info is not None:
            worker = info.id
        else:
            worker = -1 if threading.current_thread() is threading.main_thread() else -2
        times = torch.tensor([start, loaded, time.perf_counter(), worker], dtype=torch.float64)
        return x, label, times


# ---- a background prefetcher -------------------------------------------------------------

_END = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _fill(source: Iterable[Any], out: queue.Queue, room: threading.Semaphore, stop: threading.Event) -> None:
    """Producer thread: take a slot, pull one item, hand it over; stop when told to."""
    it = None
    try:
        it = iter(source)
        while not stop.is_set():
            while not room.acquire(timeout=0.05):  # wait for a free slot, but notice `stop`
                if stop.is_set():
                    return
            if stop.is_set():
                return
            try:
                item = next(it)
            except StopIteration:
                out.put(_END)
                return
            out.put(item)
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
        out.put(_Failure(exc))
    finally:
        close = getattr(it, "close", None)
        if callable(close):
            # the source's own cleanup must not kill the thread silently
            with contextlib.suppress(Exception):
                close()


def _shutdown(stop: threading.Event, room: threading.Semaphore, thread: threading.Thread, depth: int) -> None:
    stop.set()
    room.release(depth)  # wake the producer if it waits for a slot
    if thread is not threading.current_thread():
        thread.join(timeout=10)


class Prefetcher:
    """Iterate over ``iterable`` with a background thread that runs at most ``depth`` items ahead.

    The producer takes a slot from a semaphore of ``depth`` before it pulls an item, and the
    consumer gives the slot back when it receives the item, so at any moment at most ``depth``
    items have been pulled from the source and not yet handed to the consumer. An exception in the
    source is re-raised in the consumer (with the source's traceback). ``close()``, leaving a
    ``with`` block, or garbage collection stops the thread and joins it, also when the consumer
    stops early.
    """

    def __init__(self, iterable: Iterable[Any], depth: int = 2) -> None:
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be a positive int, got {depth!r}")
        self.depth = depth
        self._queue: queue.Queue = queue.Queue()
        self._room = threading.Semaphore(depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=_fill, args=(iterable, self._queue, self._room, self._stop),
                                        name="Prefetcher", daemon=True)
        self._thread.start()
        # The thread holds no reference to self, so a dropped Prefetcher is collected and shut down.
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._room, self._thread, depth)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        self._room.release()
        return item

    def close(self) -> None:
        """Stop the producer thread and wait for it; safe to call more than once."""
        self._done = True
        self._finalizer()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- host-to-device copies on a side stream ------------------------------------------------

def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], batch: Any) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it (nested tuples, lists and dicts); other values stay."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [map_tensors(fn, v) for v in batch]
        return type(batch)(moved) if isinstance(batch, list) else tuple(moved)
    return batch


def tensors_of(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested tuple / list / dict) batch, in order."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from tensors_of(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from tensors_of(v)


def to_device(batch: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested tuple / list / dict) batch to ``device``; other values stay."""
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)


class CudaOps:
    """The six CUDA calls a copy-ahead prefetcher makes, one method each, for one CUDA ``device``.

    A prefetcher that makes its calls through an object like this one can be run, and its order of
    calls checked, on a machine without a GPU: ``RecordingOps`` has the same methods.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def new_stream(self) -> torch.cuda.Stream:
        """A new CUDA stream (a side stream for copies)."""
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> torch.cuda.Stream:
        """The stream the caller's kernels are queued on (the compute stream)."""
        return torch.cuda.current_stream(self.device)

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in page-locked host memory (itself if it already is)."""
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def copy(self, tensor: torch.Tensor, stream: torch.cuda.Stream, non_blocking: bool) -> torch.Tensor:
        """Queue the copy of ``tensor`` to the device on ``stream``; with ``non_blocking`` the host does not wait for it."""
        with torch.cuda.stream(stream):
            return tensor.to(self.device, non_blocking=non_blocking)

    def wait_stream(self, waiter: torch.cuda.Stream, stream: torch.cuda.Stream) -> None:
        """Work queued on ``waiter`` from now on starts only after the work queued on ``stream`` so far."""
        waiter.wait_stream(stream)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor``, so its memory is not reused before that work ends."""
        tensor.record_stream(stream)


class RecordingOps:
    """A stand-in for ``CudaOps`` that runs anywhere and writes down every call in ``events``, in order.

    Streams are names (``"default stream"``, ``"side stream 1"``, ...), a pinned tensor and a copy
    are clones, and each tensor is named in the events by ``label(tensor)`` (its first element by
    default). Events: ``("new_stream", name)``, ``("current_stream", name)``, ``("pin", label)``,
    ``("copy", label, stream, non_blocking, pinned_before)``, ``("wait_stream", waiter, stream)``,
    ``("record_stream", label, stream)``; a caller may add its own (``("use", i)``).
    """

    CALLS = ("new_stream", "current_stream", "pin", "copy", "wait_stream", "record_stream")
    DEFAULT = "default stream"

    def __init__(self, label: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.label = label or (lambda t: t.reshape(-1)[0].item() if t.numel() else None)
        self._streams = 0
        self._pinned: set[Any] = set()

    def new_stream(self) -> str:
        """A new side stream's name."""
        self._streams += 1
        name = f"side stream {self._streams}"
        self.events.append(("new_stream", name))
        return name

    def current_stream(self) -> str:
        """The compute stream's name."""
        self.events.append(("current_stream", self.DEFAULT))
        return self.DEFAULT

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A clone of ``tensor``, noted as pinned."""
        self._pinned.add(self.label(tensor))
        self.events.append(("pin", self.label(tensor)))
        return tensor.clone()

    def copy(self, tensor: torch.Tensor, stream: str, non_blocking: bool) -> torch.Tensor:
        """A clone of ``tensor``, noted as copied on ``stream``."""
        name = self.label(tensor)
        self.events.append(("copy", name, stream, bool(non_blocking), name in self._pinned))
        return tensor.clone()

    def wait_stream(self, waiter: str, stream: str) -> None:
        """Note that ``waiter`` waits for ``stream``."""
        self.events.append(("wait_stream", waiter, stream))

    def record_stream(self, tensor: torch.Tensor, stream: str) -> None:
        """Note that ``stream`` uses ``tensor``."""
        self.events.append(("record_stream", self.label(tensor), stream))


class CudaPrefetcher:
    """Iterate over ``loader``, delivering each batch already on ``device``, the next one copied while this one computes.

    With stream operations (``ops``, a ``CudaOps`` by default on a CUDA device), every tensor of
    batch ``i + 1`` is pinned and copied with ``non_blocking=True`` on a side stream before batch
    ``i`` is handed out, so the copy runs while the caller computes on batch ``i``. Before a batch
    is handed out, the compute stream waits for the side stream (``wait_stream``) and each of its
    tensors is marked as used by the compute stream (``record_stream``), so that the caching
    allocator does not give its memory away while the compute may still read it.

    Without them (a CPU device, no ``ops``) there is nothing to overlap: it is plain iteration,
    moving each batch with ``.to(device)``; the values and their order are the same.
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str, ops: Any = None) -> None:
        self.loader = loader
        self.device = torch.device(device)
        if ops is None and self.device.type == "cuda" and torch.cuda.is_available():
            ops = CudaOps(self.device)
        self.ops = ops

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        ops = self.ops
        if ops is None:
            for batch in self.loader:
                yield to_device(batch, self.device)
            return
        side, compute = ops.new_stream(), ops.current_stream()

        def issue(batch: Any) -> Any:
            return map_tensors(lambda t: ops.copy(ops.pin(t), side, True), batch)

        it = iter(self.loader)
        try:
            nxt = issue(next(it))
        except StopIteration:
            return
        while True:
            ops.wait_stream(compute, side)  # the compute waits for the copies queued so far, not for later ones
            batch = nxt
            for t in tensors_of(batch):
                ops.record_stream(t, compute)
            try:
                nxt = issue(next(it))  # queued now: it runs while the caller computes on `batch`
            except StopIteration:
                yield batch
                return
            yield batch


# ---- a model of DataLoader's schedule, and reading a measured timeline ---------------------

def simulate_loader(load_times: Sequence[float], compute_time: float, num_workers: int,
                    prefetch_factor: int = 2) -> list[float]:
    """When each step of a training loop starts, fed by ``DataLoader(num_workers, prefetch_factor)``; seconds from its start.

    ``load_times[k]``: seconds one worker needs to build batch ``k``; each step computes for
    ``compute_time``. The rules are those of PyTorch's DataLoader (map-style dataset, in order):
    with ``num_workers == 0`` the loop loads batch ``k`` itself after step ``k - 1`` ends. With
    ``w >= 1`` workers, batch ``k`` goes to worker ``k % w``, which builds its batches one at a
    time in order; batches ``0 .. w * prefetch_factor - 1`` are handed out at time 0, and batch
    ``k + w * prefetch_factor`` when the loop takes batch ``k``; the loop takes batch ``k`` (step
    ``k`` starts) once it is built and step ``k - 1`` has ended.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be a non-negative int, got {num_workers!r}")
    if num_workers and prefetch_factor < 1:
        raise ValueError(f"prefetch_factor must be at least 1, got {prefetch_factor!r}")
    if compute_time < 0 or any(t < 0 for t in load_times):
        raise ValueError("times must be non-negative")
    starts: list[float] = []
    end = 0.0  # when the previous step ended
    if num_workers == 0:
        for load in load_times:
            starts.append(end + load)
            end = starts[-1] + compute_time
        return starts
    ahead = num_workers * prefetch_factor
    free = [0.0] * num_workers  # when each worker finishes the batch it is building
    for k, load in enumerate(load_times):
        handed = starts[k - ahead] if k >= ahead else 0.0
        worker = k % num_workers
        free[worker] = max(handed, free[worker]) + load
        starts.append(max(free[worker], end))
        end = starts[-1] + compute_time
    return starts


def bottleneck(timeline: Timeline, tol: float = 0.1) -> str:
    """Which stage limits a measured run: ``"compute"``, ``"storage"``, ``"preprocess"`` or ``"data"``.

    ``timeline`` is what ``consume_batches`` records: ``"wait"`` and ``"compute"`` spans on the lane
    ``"accelerator"``, labelled with the step's index, and ``"load"`` / ``"preprocess"`` spans on
    the loaders' lanes. Step 0, which pays for the start-up, is left out. If the accelerator
    waited at most ``tol`` of the remaining steps' time, the run is compute-bound; otherwise the
    data stage with more busy seconds on the loaders' lanes is named (``"storage"`` for
    ``"load"``, ties included), or ``"data"`` when the timeline has no loader spans.
    """
    steady = [s for s in timeline.of("accelerator") if s.label != "0"]
    if not steady:
        raise ValueError("the timeline needs at least two steps on the lane 'accelerator'")
    wait = sum(s.end - s.start for s in steady if s.kind == "wait")
    compute = sum(s.end - s.start for s in steady if s.kind == "compute")
    if wait <= tol * (wait + compute):
        return "compute"
    loaders = [s for s in timeline.spans if s.lane != "accelerator"]
    storage = sum(s.end - s.start for s in loaders if s.kind == "load")
    cpu = sum(s.end - s.start for s in loaders if s.kind == "preprocess")
    if not any(s.kind in ("load", "preprocess") for s in loaders):
        return "data"
    return "storage" if storage >= cpu else "preprocess"


def prefetch_buffer_bytes(batch_size: int, sample_bytes: int, prefetch_factor: int, num_workers: int) -> int:
    """Bytes of the batches a DataLoader keeps in flight: ``num_workers * prefetch_factor`` batches (0 without workers)."""
    for name, v in (("batch_size", batch_size), ("sample_bytes", sample_bytes),
                    ("prefetch_factor", prefetch_factor), ("num_workers", num_workers)):
        if v < 0:
            raise ValueError(f"{name} must be non-negative, got {v}")
    return int(batch_size) * int(sample_bytes) * int(prefetch_factor) * int(num_workers)


# ---- the training loop, on a timeline ------------------------------------------------------

# The colour of each kind of span in the chapter's Gantt charts (``plot_gantt(..., colors=STAGE_COLORS)``).
STAGE_COLORS = {"load": "tab:orange", "preprocess": "tab:green", "copy": "tab:purple",
                "compute": "tab:blue", "wait": "lightgray"}


def add_sample_times(timeline: Timeline, batch: int, times: torch.Tensor) -> None:
    """Add the load and preprocess spans of ``batch`` from its ``SyntheticImages(record=True)`` times (B x 4).

    One lane per loader: "main thread", "prefetch thread" or "worker k". A batch alternates
    reading and preprocessing sample by sample; each lane draws their sums as two spans in order.
    """
    times = torch.as_tensor(times, dtype=torch.float64).reshape(-1, 4)
    for worker in sorted({int(w) for w in times[:, 3].tolist()}):
        rows = times[times[:, 3] == worker]
        lane = {-1: "main thread", -2: "prefetch thread"}.get(worker, f"worker {worker}")
        start, done = rows[:, 0].min().item(), rows[:, 2].max().item()
        read = float((rows[:, 1] - rows[:, 0]).sum())
        timeline.add(lane, "load", batch, start, start + read)
        timeline.add(lane, "preprocess", batch, start + read, max(done, start + read))


def fake_step(seconds: float) -> None:
    """Stand-in for an accelerator's model step: the host waits ``seconds`` without using a CPU core."""
    if seconds > 0:
        time.sleep(seconds)


def consume_batches(batches: Iterable[Any], compute: Callable[[Any], None], num_batches: int | None = None,
                    timeline: Timeline | None = None) -> dict[str, float]:
    """Consume ``batches``, calling ``compute(batch)`` on each; return per-step ``wait``, ``compute`` and ``step`` seconds.

    ``wait`` is the time the consumer spent waiting for the next batch (the accelerator's idle
    time); the first batch is excluded (it includes start-up). Also returned: ``batches``, how
    many were consumed, and ``total``, the seconds from the end of the first step to the end.
    With a ``timeline``, each step adds a "wait" and a "compute" span on the lane "accelerator"
    (labelled with the batch's index, so that lane comes first); if the batches carry
    ``SyntheticImages`` times as their last element, their load and preprocess spans are added
    too (``add_sample_times``).
    """
    waits, computes = [], []
    it = iter(batches)
    t_first = None
    i = 0
    while num_batches is None or i < num_batches:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        compute(batch)
        t2 = time.perf_counter()
        if timeline is not None:
            timeline.add("accelerator", "wait", i, t0, t1)
            timeline.add("accelerator", "compute", i, t1, t2)
            if isinstance(batch, (tuple, list)) and isinstance(batch[-1], torch.Tensor) and batch[-1].dtype == torch.float64:
                add_sample_times(timeline, i, batch[-1])
        if i == 0:
            t_first = t2
        else:
            waits.append(t1 - t0)
            computes.append(t2 - t1)
        i += 1
    close = getattr(it, "close", None)
    if callable(close):
        close()
    steps = max(len(waits), 1)
    total = (time.perf_counter() - t_first) if t_first is not None and waits else 0.0
    return {"wait": sum(waits) / steps, "compute": sum(computes) / steps,
            "step": (sum(waits) + sum(computes)) / steps, "batches": i, "total": total}
