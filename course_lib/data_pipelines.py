"""Data pipelines: a synthetic image dataset, prefetchers, a throughput model and timelines.

The pieces of chapter 05:

- ``SyntheticImages``: a ``Dataset`` of uint8 images with a configurable storage latency
  (``time.sleep`` per sample) and real CPU preprocessing (``preprocess``: decode, random crop,
  normalise); it can return the timestamps of each stage for timeline plots.
- ``Prefetcher``: a background thread that runs ahead of the consumer by at most ``depth`` items.
- ``CudaPrefetcher``: copies the next batch to the GPU on a side stream while the current one
  computes; on a CPU it is plain iteration plus ``.to(device)``.
- ``steady_state_step_time``, ``bottleneck``, ``prefetch_buffer_bytes``: the arithmetic.
- ``consume_batches``: the training loop with a simulated step (``fake_step``), recording on a
  ``course_lib.support.timeline.Timeline`` when each batch was waited for, computed, loaded and
  preprocessed (``add_sample_times``); ``STAGE_COLORS`` colours its Gantt chart (``plot_gantt``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
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
    "to_device",
    "CudaPrefetcher",
    "steady_state_step_time",
    "bottleneck",
    "choose_num_workers",
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

    Sample ``i`` is the same for a given ``seed`` in every process (its bytes come from
    ``default_rng(seed + i)``), and so is its random crop. ``__getitem__`` returns
    ``(image, label)``; with ``record=True`` it returns ``(image, label, times)``, where ``times``
    is a float64 tensor ``[start, loaded, done, worker]``: ``time.perf_counter()`` when the read
    began, when the bytes arrived and when preprocessing ended, and the DataLoader worker's id
    (-1 in the main thread of the main process, -2 in another thread of it, such as a
    ``Prefetcher``'s). ``perf_counter`` is system-wide on Linux, so worker and main-process
    times can be drawn on one axis.
    """

    def __init__(self, size: int = 256, latency: float = 0.0, seed: int = 0, height: int = 40, width: int = 40,
                 crop: int = 32, num_classes: int = 10, record: bool = False) -> None:
        if size < 0 or latency < 0:
            raise ValueError("size and latency must be non-negative")
        self.size, self.latency, self.seed = size, latency, seed
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
        if self.latency:
            time.sleep(self.latency)  # the storage read: disk, network, object store
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

def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], batch: Any) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it (nested tuples, lists and dicts); other values stay."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: _map_tensors(fn, v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [_map_tensors(fn, v) for v in batch]
        return type(batch)(moved) if isinstance(batch, list) else tuple(moved)
    return batch


def to_device(batch: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested tuple / list / dict) batch to ``device``; other values stay."""
    return _map_tensors(lambda t: t.to(device, non_blocking=non_blocking), batch)


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)


def _pin(batch: Any) -> Any:
    return _map_tensors(lambda t: t if t.is_pinned() else t.pin_memory(), batch)


class CudaPrefetcher:
    """Iterate over ``loader``, delivering each batch already on ``device``.

    On a CUDA device the copy of batch ``i + 1`` is issued on a side stream (from pinned memory,
    ``non_blocking=True``) as soon as batch ``i`` is handed out, so it overlaps with the compute
    on batch ``i``. Handing out a batch makes the current stream wait for the side stream
    (``wait_stream``) and marks its tensors as used by the current stream (``record_stream``), so
    the caching allocator does not reuse their memory too early.

    On a CPU (or any non-CUDA device) there is nothing to overlap: it falls back to plain
    iteration, moving each batch with ``.to(device)``; the values and their order are the same.
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str) -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.uses_cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._stream = torch.cuda.Stream(device=self.device) if self.uses_cuda else None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _copy(self, batch: Any) -> Any:
        with torch.cuda.stream(self._stream):
            return to_device(_pin(batch), self.device, non_blocking=True)

    def __iter__(self) -> Iterator[Any]:
        side = self._stream
        if side is None:  # not CUDA
            for batch in self.loader:
                yield to_device(batch, self.device)
            return
        it = iter(self.loader)
        try:
            nxt = self._copy(next(it))
        except StopIteration:
            return
        current = torch.cuda.current_stream(self.device)
        while True:
            current.wait_stream(side)
            batch = nxt
            for t in _tensors(batch):
                t.record_stream(current)
            try:
                nxt = self._copy(next(it))  # issued now, runs while the caller computes on `batch`
            except StopIteration:
                yield batch
                return
            yield batch


# ---- arithmetic: steady state, bottleneck, buffer memory ------------------------------------

def steady_state_step_time(load_time: float, compute_time: float, workers: int) -> float:
    """Seconds per step once the pipeline is full.

    ``load_time``: seconds one worker needs to produce one batch (read + preprocess);
    ``compute_time``: seconds of the model step. With ``workers == 0`` the main process loads and
    then computes, one after the other: ``load + compute``. With ``w >= 1`` workers loading in
    parallel with the compute, batches arrive every ``load / w`` seconds and the step takes
    ``max(load / w, compute)``.
    """
    if load_time < 0 or compute_time < 0:
        raise ValueError("times must be non-negative")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers must be a non-negative int, got {workers!r}")
    if workers == 0:
        return float(load_time + compute_time)
    return float(max(load_time / workers, compute_time))


def bottleneck(timings: dict[str, float], tol: float = 0.1) -> str:
    """Which stage limits a pipeline: ``"data"``, ``"transfer"``, ``"compute"`` or ``"balanced"``.

    ``timings`` holds ``"load"`` (seconds per batch for one worker), ``"workers"`` (an int, 0 for
    loading in the main process), ``"compute"`` (seconds per step) and optionally ``"transfer"``
    (seconds of the host-to-device copy per batch). The stages' per-batch times are
    ``load / max(workers, 1)``, ``transfer`` and ``compute``; the slowest one is the bottleneck,
    unless the runner-up is within ``tol`` (relative) of it: then ``"balanced"``.
    """
    for key in ("load", "compute", "workers"):
        if key not in timings:
            raise KeyError(f"timings needs {key!r}")
    workers = timings["workers"]
    if workers < 0:
        raise ValueError("workers must be non-negative")
    stages = {"data": timings["load"] / max(workers, 1), "compute": timings["compute"]}
    if "transfer" in timings:
        stages["transfer"] = timings["transfer"]
    if any(v < 0 for v in stages.values()):
        raise ValueError("times must be non-negative")
    ranked = sorted(stages.items(), key=lambda kv: kv[1], reverse=True)
    (name, worst), (_, second) = ranked[0], ranked[1]
    if worst - second <= tol * worst:
        return "balanced"
    return name


def choose_num_workers(step_times: dict[int, float], tol: float = 0.05) -> int:
    """The fewest workers whose measured step time is within ``tol`` (relative) of the best one.

    More workers than that cost memory (each keeps its own prefetch buffers and a copy of the
    dataset object) and CPU cores that the rest of the training process could use, for no speed.
    """
    if not step_times:
        raise ValueError("no measurements")
    best = min(step_times.values())
    return min(w for w, t in step_times.items() if t <= best * (1 + tol))


def prefetch_buffer_bytes(batch_size: int, sample_bytes: int, prefetch_factor: int, num_workers: int) -> int:
    """Bytes held by a DataLoader's prefetch buffers: each worker keeps ``prefetch_factor`` batches ready.

    ``batch_size * sample_bytes * prefetch_factor * num_workers``; with ``num_workers == 0``
    nothing is prefetched, so 0.
    """
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
