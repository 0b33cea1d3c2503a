"""Chapter 05's grading harness: the copy-ahead prefetcher's order of calls, its GPU trace, and token batches.

- ``run_logged(CudaPrefetcher, n, shapes, seed)`` runs a student's prefetcher over ``n`` labelled
  batches with a ``RecordingOps`` kept with the test (the student's code calls back to it), logging
  each batch pulled from the loader and handed to the consumer; ``check_copy_ahead`` then fails
  with a message at the first call out of place. ``gpu_copy_trace`` runs the prefetcher for real
  on a GPU under ``torch.profiler`` (sent to the student's kernel) and ``check_gpu_trace`` reads
  the structure of what ran: copies from pinned memory on a stream of their own, each started
  before the previous batch's compute ended.
- ``unique_tokens``, ``check_epochs`` and ``check_resume`` check a ``TokenBatches``-like class:
  windows cut right, disjoint and equal shares per rank, orders that follow seed and epoch, and a
  state that continues exactly; ``memmap_growth`` (sent to the kernel) says how much of a
  memory-mapped token file one batch pulls into memory.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from course_lib.data_pipelines import RecordingOps
from course_lib.exercises.checks import assert_equal, by_reference, call, not_done

__all__ = [
    "run_logged",
    "check_copy_ahead",
    "gpu_copy_trace",
    "check_gpu_trace",
    "unique_tokens",
    "check_epochs",
    "check_resume",
    "memmap_growth",
]

_CODE = 10_000  # tensor j of batch i starts with the value _CODE + 100 * i + j


def _label(t: torch.Tensor) -> tuple[int, int] | None:
    """(batch, tensor) of a labelled tensor, from its first element."""
    if t.numel() == 0:
        return None
    return divmod(int(t.reshape(-1)[0].item()) - _CODE, 100)


class _LoggedLoader:
    """An iterable of batches that logs ("pull", i) in ``events`` when batch i is taken from it."""

    def __init__(self, batches: list[tuple[torch.Tensor, ...]], events: list[tuple[Any, ...]]) -> None:
        self.batches, self.events = batches, events

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for i, batch in enumerate(self.batches):
            self.events.append(("pull", i))
            yield batch

    def __len__(self) -> int:
        return len(self.batches)


def _labelled_batches(n: int, shapes: Sequence[tuple[int, ...]], seed: int) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(n):
        batch = []
        for j, shape in enumerate(shapes):
            t = torch.randn(shape, generator=gen)
            t.view(-1)[0] = _CODE + 100 * i + j
            batch.append(t)
        batches.append(tuple(batch))
    return batches


def run_logged(prefetcher_cls: Any, n: int, shapes: Sequence[tuple[int, ...]] = ((4, 3), (4,)),
               seed: int = 0) -> tuple[list[Any], list[tuple[Any, ...]], list[tuple[torch.Tensor, ...]]]:
    """Drain ``prefetcher_cls(loader, "cuda", ops=RecordingOps)`` over ``n`` labelled batches; (batches out, events, batches in).

    The stand-in and the loader stay with the test (``by_reference``), so the events are what the
    student's code did, in order; ``("use", i)`` marks batch ``i`` reaching the consumer.
    """
    ops = RecordingOps(label=_label)
    for name in RecordingOps.CALLS:  # each method stays here too: the student's code calls back to it
        setattr(ops, name, by_reference(getattr(ops, name)))
    batches = _labelled_batches(n, shapes, seed)
    loader = by_reference(_LoggedLoader(batches, ops.events))
    out: list[Any] = []
    try:
        it = iter(call(prefetcher_cls, loader, "cuda", ops=by_reference(ops)))
        while True:
            try:
                batch = next(it)
            except StopIteration:
                break
            ops.events.append(("use", len(out)))
            out.append(batch)
            if len(out) > n:
                raise AssertionError(f"CudaPrefetcher yielded more batches than the loader's {n}")
    except NotImplementedError:
        raise not_done(prefetcher_cls) from None
    except AssertionError:
        raise
    except Exception as exc:  # noqa: BLE001 - the student's error, with what the test was doing
        raise AssertionError(
            f"CudaPrefetcher(loader, 'cuda', ops=RecordingOps) raised {type(exc).__name__}: {exc}. Given `ops`, make "
            "every CUDA call through it (ops.copy, not .to('cuda')): the test runs it with a stand-in, on any machine"
        ) from None
    return out, ops.events, batches


def _show(events: list[tuple[Any, ...]], upto: int) -> str:
    """The events up to position ``upto``, one short line (for messages)."""
    return " | ".join(" ".join(str(x) for x in e) for e in events[max(0, upto - 12):upto + 1])


def check_copy_ahead(events: list[tuple[Any, ...]], n: int, tensors: int) -> None:
    """Fail unless the events show the copy-ahead mechanism for ``n`` batches of ``tensors`` tensors each.

    Every tensor is pinned, then copied with ``non_blocking=True`` on a side stream; the copies
    of batch ``i + 1`` are queued before batch ``i`` reaches the consumer, those of batch
    ``i + 2`` after; between its copies and its use, the compute stream waits for the copy's
    stream and each of its tensors is recorded on the compute stream.
    """
    side = {e[1] for e in events if e[0] == "new_stream"}
    current = {e[1] for e in events if e[0] == "current_stream"}
    used = [k for k, e in enumerate(events) if e[0] == "use"]
    assert_equal(len(used), n, name="number of batches handed out")
    copies: dict[Any, tuple[int, tuple[Any, ...]]] = {}
    for k, e in enumerate(events):
        if e[0] == "copy" and e[1] not in copies:
            copies[e[1]] = (k, e)
    for i in range(n):
        use = used[i]
        for j in range(tensors):
            if (i, j) not in copies:
                raise AssertionError(
                    f"batch {i}, tensor {j} never went through ops.copy: copy each tensor with "
                    "ops.copy(ops.pin(t), side_stream, non_blocking=True) (a plain .to(device) runs on the "
                    "compute stream and overlaps nothing)")
            k, (_, _, stream, non_blocking, pinned) = copies[(i, j)]
            if stream in current or stream not in side:
                raise AssertionError(
                    f"batch {i}, tensor {j} was copied on {stream!r}, not on a side stream from ops.new_stream(): "
                    "a copy queued on the compute stream waits for the compute before it, so nothing overlaps")
            if not pinned:
                raise AssertionError(f"batch {i}, tensor {j} was copied without ops.pin first: from pageable memory "
                                     "the copy cannot run asynchronously")
            if non_blocking is not True:
                raise AssertionError(f"batch {i}, tensor {j} was copied with non_blocking={non_blocking!r}: "
                                     "the host would wait for every copy")
            if k > use:
                raise AssertionError(f"batch {i}, tensor {j} was copied after the batch was handed out")
        if i + 1 < n:
            ahead = max(copies[(i + 1, j)][0] if (i + 1, j) in copies else len(events) for j in range(tensors))
            if ahead > use:
                raise AssertionError(
                    f"batch {i + 1}'s copy was queued after batch {i} was handed out: queue the next batch's copy "
                    f"before handing out this one, so that it runs during this one's compute. Last calls: {_show(events, use)}")
        if i + 2 < n and any((i + 2, j) in copies and copies[(i + 2, j)][0] < use for j in range(tensors)):
            raise AssertionError(f"batch {i + 2} was copied before batch {i} was handed out: the prefetcher should "
                                 "run one batch ahead, holding two batches in device memory, not more")
        last = max(copies[(i, j)][0] for j in range(tensors))
        streams = {copies[(i, j)][1][2] for j in range(tensors)}
        following = min((copies[(i + 1, j)][0] for j in range(tensors) if (i + 1, j) in copies), default=use)
        waits = [(k, e) for k, e in enumerate(events) if e[0] == "wait_stream" and last < k < use]
        right = [k for k, e in waits if e[1] in current and e[2] in streams]
        if not right:
            seen = f" (it saw {', '.join(f'wait_stream({e[1]!r}, {e[2]!r})' for _, e in waits)})" if waits else ""
            raise AssertionError(
                f"batch {i} was handed out without the compute stream waiting for its copy{seen}: between the "
                "copy and handing the batch out, call ops.wait_stream(compute_stream, side_stream), or the "
                f"compute may read a half-copied batch. Last calls: {_show(events, use)}")
        if min(right) > following:
            raise AssertionError(
                f"the compute stream waited for batch {i}'s copy only after batch {i + 1}'s copy was queued: the step "
                f"on batch {i} then waits for batch {i + 1}'s copy too, and nothing overlaps. Wait first, then queue "
                f"the next copy. Last calls: {_show(events, use)}")
        for j in range(tensors):
            k = copies[(i, j)][0]
            if not any(e[0] == "record_stream" and e[1] == (i, j) and e[2] in current for e in events[k:use]):
                raise AssertionError(
                    f"batch {i}, tensor {j} was handed out without ops.record_stream(tensor, compute_stream): the "
                    "caching allocator would reuse its memory as soon as the side stream is done with it")


def gpu_copy_trace(prefetcher_cls: Any, n: int = 6, numel: int = 1 << 21, spin_cycles: int = 2_000_000) -> dict[str, Any]:
    """Run ``prefetcher_cls(batches, "cuda")`` for real under ``torch.profiler``; the copies and computes it saw (plain data).

    The batches are pageable CPU tensors; each step spins on the GPU for ``spin_cycles`` cycles,
    then reads its batch and waits for the result (as a loop that logs its loss does).
    """
    batches = [(torch.full((numel,), float(i)),) for i in range(n)]
    values = []
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for (x,) in prefetcher_cls(batches, "cuda"):
            torch.cuda._sleep(spin_cycles)
            values.append(float(x[-1].item()))
        torch.cuda.synchronize()
    handle, path = tempfile.mkstemp(suffix=".json")
    os.close(handle)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    finally:
        os.remove(path)

    def spans(keep: Callable[[dict[str, Any]], bool]) -> list[list[Any]]:
        return sorted([float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), int(e.get("args", {}).get("stream", -1)),
                       str(e.get("name", ""))] for e in trace if e.get("ph") == "X" and keep(e))

    return {
        "values": values,
        "copies": spans(lambda e: e.get("cat") == "gpu_memcpy" and "HtoD" in str(e.get("name", ""))),
        "computes": spans(lambda e: e.get("cat") == "kernel" and "spin" in str(e.get("name", "")).lower()),
        "waits": sum(1 for e in trace if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaStreamWaitEvent"),
    }


def check_gpu_trace(trace: dict[str, Any], n: int) -> None:
    """Fail unless a ``gpu_copy_trace`` of ``n`` batches shows pinned copies on a side stream overlapping the computes."""
    assert_equal(trace["values"], [float(i) for i in range(n)], name="the last element of each batch the GPU computed on")
    copies, computes = trace["copies"], trace["computes"]
    assert_equal(len(computes), n, name="spin kernels in the profile (the test's own compute)")
    assert_equal(len(copies), n, name="host-to-device copies in the profile (one per batch)")
    compute_streams = {c[2] for c in computes}
    for i, (_, _, stream, name) in enumerate(copies):
        if stream in compute_streams:
            raise AssertionError(f"on the GPU, batch {i} was copied on stream {stream}, the compute stream: "
                                 "nothing can overlap")
        if "Pinned" not in name:
            raise AssertionError(f"on the GPU, batch {i}'s copy was {name!r}: copy from pinned memory")
    for i in range(n - 1):
        if copies[i + 1][0] >= computes[i][1]:
            raise AssertionError(
                f"on the GPU, the copy of batch {i + 1} started {copies[i + 1][0] - computes[i][1]:.0f} us after the "
                f"compute on batch {i} ended: queue it before handing out batch {i}, so that the two overlap")
    if trace["waits"] < n:
        raise AssertionError(f"on the GPU, the compute stream waited for another stream {trace['waits']} times for {n} "
                             "batches: make it wait (wait_stream) before each batch is used")


# ---------------------------------------------------------------------------------------------- token batches
def unique_tokens(n: int, seed: int, wide: bool = False) -> np.ndarray:
    """``n`` distinct token ids in random order, so that a window's first token names it: uint16, or uint32 past 65,535."""
    ids = np.random.default_rng(seed).permutation(n)
    return (ids + 70_000).astype(np.uint32) if wide else ids.astype(np.uint16)


_POSITIONS: dict[bytes, dict[int, int]] = {}


def _position(tokens: np.ndarray) -> dict[int, int]:
    """Token id -> its position in ``tokens`` (whose ids are distinct), computed once per stream."""
    key = tokens.tobytes()
    if key not in _POSITIONS:
        _POSITIONS.clear()
        _POSITIONS[key] = {int(v): p for p, v in enumerate(tokens.tolist())}
    return _POSITIONS[key]


def _windows(batch: Any, tokens: np.ndarray, seq_len: int, batch_size: int, where: str) -> list[int]:
    """The window index of each row of an (input, target) batch; AssertionError when a row is not a window."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise AssertionError(f"{where}: expected a pair (input, target), got {type(batch).__name__}")
    x, y = batch
    for name, t in (("input", x), ("target", y)):
        if not isinstance(t, torch.Tensor):
            raise AssertionError(f"{where}: the {name} should be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int64:
            raise AssertionError(f"{where}: the {name} has dtype {t.dtype}; token ids go to an embedding as int64")
        if tuple(t.shape) != (batch_size, seq_len):
            raise AssertionError(f"{where}: the {name} has shape {tuple(t.shape)}, expected {(batch_size, seq_len)}")
    position = _position(tokens)
    ids = []
    for r in range(batch_size):
        start = position.get(int(x[r, 0]))
        if start is None or start % seq_len:
            raise AssertionError(f"{where}, row {r}: the input does not start at a window boundary (a multiple of "
                                 f"seq_len={seq_len} in the token stream)")
        want = torch.from_numpy(tokens[start:start + seq_len + 1].astype(np.int64))
        if len(want) < seq_len + 1:
            raise AssertionError(f"{where}, row {r}: window {start // seq_len} runs past the end of the stream")
        if not torch.equal(x[r], want[:-1]):
            raise AssertionError(f"{where}, row {r}: the input is not tokens[{start}:{start + seq_len}]")
        if not torch.equal(y[r], want[1:]):
            raise AssertionError(f"{where}, row {r}: the target should be the input shifted by one token: "
                                 f"tokens[{start + 1}:{start + seq_len + 1}]")
        ids.append(start // seq_len)
    return ids


def _take(loader: Any, count: int, tokens: np.ndarray, seq_len: int, batch_size: int, where: str) -> list[list[int]]:
    """The window indices of the next ``count`` batches, starting a new iteration whenever one ends."""
    out: list[list[int]] = []
    if count == 0:
        return out
    for _ in range(count + 3):
        before = len(out)
        for batch in iter(loader):
            out.append(_windows(batch, tokens, seq_len, batch_size, f"{where}, batch {len(out)}"))
            if len(out) == count:
                return out
        if len(out) == before:
            break
    raise AssertionError(f"{where}: iterations ended after {len(out)} batches; each new iteration should start the "
                         f"next epoch ({count} batches wanted)")


def check_epochs(cls: Any, tokens: np.ndarray, seq_len: int, batch_size: int, world_size: int, seed: int) -> None:
    """Two epochs on every rank: windows cut right, ``len`` honest, shares disjoint and equal, orders by seed and epoch."""
    n = (len(tokens) - 1) // seq_len
    steps = (n // world_size) // batch_size
    seen: dict[int, list[list[int]]] = {}
    for rank in range(world_size):
        loader = call(cls, tokens, seq_len, batch_size, rank=rank, world_size=world_size, seed=seed)
        where = f"rank {rank} of {world_size}"
        if len(loader) != steps:
            raise AssertionError(
                f"{where}: len() is {len(loader)}, expected {steps}: {len(tokens)} tokens hold {n} windows of "
                f"seq_len + 1 = {seq_len + 1} tokens (consecutive windows share one token), each rank gets "
                f"{n} // {world_size} = {n // world_size} of them, in full batches of {batch_size}")
        epochs = []
        for e in range(2):
            got = [_windows(b, tokens, seq_len, batch_size, f"{where}, epoch {e}, batch {k}") for k, b in enumerate(loader)]
            if len(got) != steps:
                raise AssertionError(f"{where}, epoch {e}: {len(got)} batches, expected len() = {steps} (every rank "
                                     "must take the same number of steps, or a collective waits forever)")
            epochs.append(got)
        seen[rank] = epochs[0]
        first = [w for b in epochs[0] for w in b]
        if len(set(first)) != len(first):
            raise AssertionError(f"{where}, epoch 0: a window was read twice in one epoch")
        if steps * batch_size >= 4 and epochs[0] == epochs[1]:
            raise AssertionError(f"{where}: epoch 1 repeats epoch 0's order; mix the epoch into the shuffle's seed")
        if rank == 0 and steps * batch_size >= 4:
            again = _take(call(cls, tokens, seq_len, batch_size, rank=0, world_size=world_size, seed=seed), steps,
                          tokens, seq_len, batch_size, "a second loader with the same seed")
            if again != epochs[0]:
                raise AssertionError("two loaders with the same seed read epoch 0 in different orders")
            other = _take(call(cls, tokens, seq_len, batch_size, rank=0, world_size=world_size, seed=seed + 1), steps,
                          tokens, seq_len, batch_size, "a loader with another seed")
            if other == epochs[0]:
                raise AssertionError("a loader with another seed read epoch 0 in the same order")
    owner: dict[int, int] = {}
    for rank, batches in seen.items():
        for w in (w for b in batches for w in b):
            if w in owner:
                raise AssertionError(f"epoch 0: window {w} was read by rank {owner[w]} and by rank {rank}: the ranks' "
                                     "shares must be disjoint (every rank shuffles with the same permutation and "
                                     "takes its own slice)")
            owner[w] = rank


def check_resume(cls: Any, tokens: np.ndarray, seq_len: int, batch_size: int, world_size: int, rank: int, seed: int,
                 after: int) -> None:
    """A state taken after ``after`` batches, saved as JSON and loaded into a fresh loader, continues exactly."""
    where = f"rank {rank} of {world_size}"
    steps = len(call(cls, tokens, seq_len, batch_size, rank=rank, world_size=world_size, seed=seed))
    reference = call(cls, tokens, seq_len, batch_size, rank=rank, world_size=world_size, seed=seed)
    want = _take(reference, after + 2 * steps, tokens, seq_len, batch_size, f"{where}, an uninterrupted run")
    run = call(cls, tokens, seq_len, batch_size, rank=rank, world_size=world_size, seed=seed)
    if after:
        _take(run, after, tokens, seq_len, batch_size, f"{where}, before the restart")
    state = run.state_dict()
    try:
        saved = json.loads(json.dumps(state))
    except (TypeError, ValueError):
        raise AssertionError(f"state_dict() returned {state!r}: it should be plain data (a dict of ints) that a "
                             "checkpoint can store") from None
    fresh = call(cls, tokens, seq_len, batch_size, rank=rank, world_size=world_size, seed=seed)
    fresh.load_state_dict(saved)
    got = _take(fresh, 2 * steps, tokens, seq_len, batch_size, f"{where}, after load_state_dict")
    for k, (g, w) in enumerate(zip(got, want[after:])):
        if g != w:
            epoch, step = divmod(after + k, steps)
            raise AssertionError(
                f"{where}: restarted after {after} batches (epoch {after // steps}, step {after % steps}), the "
                f"resumed loader's batch {k} is not the one the uninterrupted run read at epoch {epoch}, step {step}"
                + (" (it read the epoch's first batch: load_state_dict must restore the position within the epoch too)"
                   if k == 0 and step and g == want[after - step] else ""))


def memmap_growth(cls: Any, megabytes: int = 128, seq_len: int = 256, batch_size: int = 2) -> float | None:
    """Resident memory that building ``cls`` on a memory-mapped token file and taking one batch adds, per byte of the file.

    None where ``/proc/self/statm`` does not exist. Reading only the windows adds a few of the
    kernel's pages (large folios: up to 2 MiB) per window, a few percent of the file; copying or
    converting the whole stream adds at least the file's size (a ratio of 1 or more).
    """
    if not os.path.exists("/proc/self/statm"):
        return None
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "tokens.bin")
    chunk = np.resize(np.arange(50_000, dtype=np.uint16), 2**22)
    with open(path, "wb") as f:
        for _ in range(megabytes * 2**20 // chunk.nbytes):
            chunk.tofile(f)

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    try:
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        before = resident()
        loader = cls(tokens, seq_len, batch_size)
        next(iter(loader))
        grown = resident() - before
        size = tokens.nbytes
        del loader, tokens
        return grown / size
    finally:
        os.remove(path)
        os.rmdir(folder)
