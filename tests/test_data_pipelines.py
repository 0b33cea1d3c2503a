"""Unit tests of course_lib.data_pipelines (prefetchers, DataLoader schedule, bottlenecks, timelines) and its grading harness."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader

from course_lib import data_pipelines as dp
from course_lib.exercises import data_pipelines as dpx
from course_lib.support.timeline import Span, Timeline


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "Prefetcher" and t.is_alive()]


def _threads_end_within(seconds: float) -> bool:
    """Whether every Prefetcher thread has ended within ``seconds`` (a loaded machine may be slow to schedule it)."""
    deadline = time.monotonic() + seconds
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _prefetch_threads()


class Counting:
    """An iterable that records how many items were pulled from it."""

    def __init__(self, n: int) -> None:
        self.n, self.pulled = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.pulled += 1
            yield i


def test_preprocess_shape_dtype_and_centre_crop() -> None:
    ds = dp.SyntheticImages(4, height=10, width=12, crop=8)
    raw = ds.raw(1)
    x = dp.preprocess(raw, 8)
    assert x.shape == (3, 8, 8) and x.dtype == torch.float32
    expect = (torch.from_numpy(raw[1:9, 2:10]).permute(2, 0, 1).float() / 255 - 0.5) / 0.25
    torch.testing.assert_close(x, expect)
    with pytest.raises(ValueError):
        dp.preprocess(raw, 11)


def test_dataset_is_deterministic_and_records_times() -> None:
    a, b = dp.SyntheticImages(8, seed=3), dp.SyntheticImages(8, seed=3, record=True)
    x, y = a[5]
    x2, y2, times = b[5]
    torch.testing.assert_close(x, x2)
    assert int(y) == int(y2) == 5
    assert times.shape == (4,) and times[0] <= times[1] <= times[2] and times[3] == -1
    with pytest.raises(IndexError):
        a[8]


def test_dataset_latency_pattern_repeats() -> None:
    ds = dp.SyntheticImages(4, latency=[0.0, 0.02], record=True)
    fast, slow = ds[2][2], ds[3][2]
    assert fast[1] - fast[0] < 0.015 <= slow[1] - slow[0]
    with pytest.raises(ValueError):
        dp.SyntheticImages(4, latency=[])
    with pytest.raises(ValueError):
        dp.SyntheticImages(4, latency=[0.1, -0.1])


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_prefetcher_stays_within_depth(depth: int) -> None:
    src = Counting(30)
    out = []
    with dp.Prefetcher(src, depth) as p:
        for item in p:
            time.sleep(0.002)
            assert src.pulled - (len(out) + 1) <= depth
            out.append(item)
    assert out == list(range(30))
    assert not _prefetch_threads()


def test_prefetcher_empty_early_stop_gc_and_errors() -> None:
    assert list(dp.Prefetcher([], 3)) == []
    p = dp.Prefetcher(iter(range(1000)), 2)
    assert next(p) == 0
    p.close()
    assert not _prefetch_threads()
    p = dp.Prefetcher(iter(range(1000)), 2)
    next(p)
    del p
    gc.collect()
    assert _threads_end_within(30), "a dropped Prefetcher's thread kept running"

    def broken():
        yield 1
        raise KeyError("bad sample")

    p = dp.Prefetcher(broken(), 2)
    assert next(p) == 1
    with pytest.raises(KeyError) as info:
        next(p)
    assert any(f.name == "broken" for f in __import__("traceback").extract_tb(info.value.__traceback__))
    with pytest.raises(StopIteration):
        next(p)
    assert not _prefetch_threads()
    with pytest.raises(ValueError):
        dp.Prefetcher([], 0)


def test_cuda_prefetcher_falls_back_on_cpu() -> None:
    ds = dp.SyntheticImages(10)
    loader = DataLoader(ds, batch_size=4)
    prefetcher = dp.CudaPrefetcher(loader, "cpu")
    assert prefetcher.ops is None
    got = list(prefetcher)
    want = list(loader)
    assert len(got) == len(want) == 3
    for (gx, gy), (wx, wy) in zip(got, want):
        torch.testing.assert_close(gx, wx)
        assert torch.equal(gy, wy) and gx.device.type == "cpu"
    nested = [{"a": torch.ones(2), "b": [torch.zeros(1), 3]}]
    out = list(dp.CudaPrefetcher(nested, torch.device("cpu")))
    assert out[0]["b"][1] == 3 and torch.equal(out[0]["a"], torch.ones(2))


def test_cuda_prefetcher_copies_ahead_through_its_ops() -> None:
    ops = dp.RecordingOps(label=lambda t: int(t[0]))
    batches = [(torch.full((2,), float(i)), {"y": torch.full((1,), 10.0 + i)}) for i in range(3)]
    out = []
    for batch in dp.CudaPrefetcher(batches, "cuda", ops=ops):
        ops.events.append(("use", len(out)))
        out.append(batch)
    assert [int(b[0][0]) for b in out] == [0, 1, 2] and float(out[2][1]["y"][0]) == 12.0
    kinds = [e[0] for e in ops.events]
    assert kinds[:2] == ["new_stream", "current_stream"]
    # batch 1 is copied before batch 0 is used; the wait for batch 0 comes before batch 1's copy
    assert ops.events.index(("copy", 1, "side stream 1", True, True)) < ops.events.index(("use", 0))
    assert kinds.index("wait_stream") < ops.events.index(("copy", 1, "side stream 1", True, True))
    assert ("record_stream", 10, "default stream") in ops.events
    assert list(dp.CudaPrefetcher([], "cuda", ops=dp.RecordingOps())) == []


@pytest.mark.gpu
def test_cuda_prefetcher_on_gpu_overlaps_its_copies() -> None:
    loader = DataLoader(dp.SyntheticImages(10), batch_size=4)
    for (gx, _), (wx, _) in zip(dp.CudaPrefetcher(loader, "cuda"), loader):
        assert gx.is_cuda
        torch.testing.assert_close(gx.cpu(), wx)
    dpx.check_gpu_trace(dpx.gpu_copy_trace(dp.CudaPrefetcher, 6), 6)


def test_map_tensors_and_tensors_of_walk_nested_batches() -> None:
    batch = ({"a": torch.ones(1), "b": [torch.zeros(2), "text"]}, torch.full((1,), 2.0))
    assert [t.numel() for t in dp.tensors_of(batch)] == [1, 2, 1]
    doubled = dp.map_tensors(lambda t: t * 2, batch)
    assert doubled[0]["b"][1] == "text" and float(doubled[1][0]) == 4.0 and isinstance(doubled, tuple)


def test_copy_ahead_checker_accepts_the_reference_and_names_each_mistake() -> None:
    out, events, batches = dpx.run_logged(dp.CudaPrefetcher, 4, ((3,), (2, 2)))
    dpx.check_copy_ahead(events, 4, 2)
    assert all(torch.equal(a, b) for got, want in zip(out, batches) for a, b in zip(got, want))

    def without(kind: str) -> list:
        return [e for e in events if e[0] != kind]

    with pytest.raises(AssertionError, match="waiting for its copy"):
        dpx.check_copy_ahead(without("wait_stream"), 4, 2)
    with pytest.raises(AssertionError, match="record_stream"):
        dpx.check_copy_ahead(without("record_stream"), 4, 2)
    on_default = [("copy", e[1], "default stream", *e[3:]) if e[0] == "copy" else e for e in events]
    with pytest.raises(AssertionError, match="not on a side stream"):
        dpx.check_copy_ahead(on_default, 4, 2)
    late = [e for e in events if e != ("use", 0)]
    late.insert(late.index(("pull", 1)), ("use", 0))  # batch 0 handed out before batch 1's copy was queued
    with pytest.raises(AssertionError, match="queued after batch 0"):
        dpx.check_copy_ahead(late, 4, 2)


class _TooEager(dp.CudaPrefetcher):
    """Copies every batch before handing out the first."""

    def __iter__(self):
        ops = self.ops
        side, compute = ops.new_stream(), ops.current_stream()
        moved = [dp.map_tensors(lambda t: ops.copy(ops.pin(t), side, True), b) for b in self.loader]
        for batch in moved:
            ops.wait_stream(compute, side)
            for t in dp.tensors_of(batch):
                ops.record_stream(t, compute)
            yield batch


def test_copy_ahead_checker_bounds_the_lead_to_one_batch() -> None:
    _, events, _ = dpx.run_logged(_TooEager, 3, ((2,),))
    with pytest.raises(AssertionError, match="one batch ahead"):
        dpx.check_copy_ahead(events, 3, 1)


def test_gpu_trace_checker_reads_structure() -> None:
    good = {"values": [0.0, 1.0, 2.0], "waits": 3,
            "copies": [[0, 10, 7, "Memcpy HtoD (Pinned -> Device)"], [20, 30, 7, "Memcpy HtoD (Pinned -> Device)"],
                       [120, 130, 7, "Memcpy HtoD (Pinned -> Device)"]],
            "computes": [[15, 115, 3, "spin_kernel"], [115, 215, 3, "spin_kernel"], [215, 315, 3, "spin_kernel"]]}
    dpx.check_gpu_trace(good, 3)
    serial = dict(good, copies=[[0, 10, 3, c[3]] for c in good["copies"]])
    with pytest.raises(AssertionError, match="compute stream"):
        dpx.check_gpu_trace(serial, 3)
    late = dict(good, copies=good["copies"][:1] + [[116, 126, 7, good["copies"][1][3]], good["copies"][2]])
    with pytest.raises(AssertionError, match="after the compute on batch 0 ended"):
        dpx.check_gpu_trace(late, 3)
    with pytest.raises(AssertionError, match="pinned"):
        dpx.check_gpu_trace(dict(good, copies=[[*c[:3], "Memcpy HtoD (Pageable -> Device)"] for c in good["copies"]]), 3)


def test_simulate_loader_follows_the_dataloader_rules() -> None:
    assert dp.simulate_loader([0.04] * 3, 0.01, 0) == pytest.approx([0.04, 0.09, 0.14])
    # two workers, data-bound: batches 0 and 1 at 40 ms, then one every 20 ms on average (pairs at 80 ms)
    assert dp.simulate_loader([0.04] * 4, 0.01, 2) == pytest.approx([0.04, 0.05, 0.08, 0.09])
    # in order: batch 1 is slow, batch 2 (worker 0, ready at 20 ms) waits for it
    assert dp.simulate_loader([0.01, 0.1, 0.01], 0.0, 2) == pytest.approx([0.01, 0.1, 0.1])
    # one batch in flight per worker: batch 1 is handed out only when the loop takes batch 0
    assert dp.simulate_loader([0.01, 0.01, 0.01], 0.05, 1, 1) == pytest.approx([0.01, 0.06, 0.11])
    assert dp.simulate_loader([0.01, 0.01, 0.01], 0.05, 1, 3) == pytest.approx([0.01, 0.06, 0.11])
    # a slow batch later on: with three in flight the worker started it while the loop was busy
    assert dp.simulate_loader([0.01, 0.01, 0.1, 0.01], 0.05, 1, 1) == pytest.approx([0.01, 0.06, 0.16, 0.21])
    assert dp.simulate_loader([0.01, 0.01, 0.1, 0.01], 0.05, 1, 3) == pytest.approx([0.01, 0.06, 0.12, 0.17])
    assert dp.simulate_loader([], 0.01, 2) == []
    for bad in ((-1, 2), (True, 2), (1, 0)):
        with pytest.raises(ValueError):
            dp.simulate_loader([0.01], 0.01, *bad)
    with pytest.raises(ValueError):
        dp.simulate_loader([-0.01], 0.01, 1)


def test_simulate_loader_reaches_the_steady_state() -> None:
    starts = dp.simulate_loader([0.03] * 40, 0.01, 2, 2)
    assert starts[-1] - starts[-2] + starts[-2] - starts[-3] == pytest.approx(2 * 0.015)
    starts = dp.simulate_loader([0.03] * 40, 0.02, 4, 2)
    assert starts[-1] - starts[-2] == pytest.approx(0.02)


def _run(steps, loaders=()):
    spans, t = [], 0.0
    for i, (wait, compute) in enumerate(steps):
        spans += [("accelerator", "wait", str(i), t, t + wait), ("accelerator", "compute", str(i), t + wait, t + wait + compute)]
        t += wait + compute
    for k, (lane, kind, seconds) in enumerate(loaders):
        spans.append((lane, kind, str(k), 0.0, seconds))
    return Timeline(spans)


def test_bottleneck_reads_a_timeline() -> None:
    reads = [("main thread", "load", 0.012), ("main thread", "preprocess", 0.003)] * 4
    assert dp.bottleneck(_run([(0.015, 0.015)] * 4, reads)) == "storage"
    cpu_heavy = [("worker 0", "preprocess", 0.02), ("worker 0", "load", 0.001)]
    assert dp.bottleneck(_run([(0.015, 0.015)] * 4, cpu_heavy)) == "preprocess"
    assert dp.bottleneck(_run([(0.5, 0.02)] + [(0.001, 0.02)] * 5, reads)) == "compute"  # step 0 is start-up
    assert dp.bottleneck(_run([(0.01, 0.01)] * 3)) == "data"
    assert dp.bottleneck(_run([(0.004, 0.016)] * 3, reads), tol=0.25) == "compute"
    assert dp.bottleneck(_run([(0.004, 0.016)] * 3, reads), tol=0.15) == "storage"
    with pytest.raises(ValueError):
        dp.bottleneck(_run([(0.01, 0.01)], reads))


def test_prefetch_buffer_bytes() -> None:
    per_image = 1024 * 1024 * 3  # uint8 RGB
    assert dp.prefetch_buffer_bytes(256, per_image, 2, 1) == 256 * per_image * 2
    assert dp.prefetch_buffer_bytes(8, 100, 2, 0) == 0
    with pytest.raises(ValueError):
        dp.prefetch_buffer_bytes(8, -1, 2, 1)


def test_consume_batches_records_its_timeline_with_workers() -> None:
    ds = dp.SyntheticImages(16, latency=0.001, record=True)
    loader = DataLoader(ds, batch_size=4, num_workers=1, worker_init_fn=dp.worker_init)
    tl = Timeline()
    r = dp.consume_batches(loader, lambda b: dp.fake_step(0.002), timeline=tl)
    assert r["batches"] == 4
    assert tl.lanes() == ["accelerator", "worker 0"]  # the accelerator's lane first
    assert [s.label for s in tl.of("accelerator", "compute")] == ["0", "1", "2", "3"]
    assert {s.kind for s in tl.of("worker 0")} == {"load", "preprocess"}
    assert tl.busy("accelerator", "compute") >= 4 * 0.002
    assert 0.0 <= tl.idle_fraction("accelerator", "compute") < 1.0
    tl2 = Timeline()
    with dp.Prefetcher(DataLoader(ds, batch_size=4), 2) as p:
        dp.consume_batches(p, lambda b: None, timeline=tl2)
    assert tl2.lanes() == ["accelerator", "prefetch thread"]


def test_add_sample_times_sums_reads_then_preprocessing_per_loader() -> None:
    # two samples of worker 1 (read 1 s each, preprocessed 0.5 s each) and one of the main thread
    times = torch.tensor([[10.0, 11.0, 11.5, 1], [11.5, 12.5, 13.0, 1], [20.0, 20.25, 21.0, -1]], dtype=torch.float64)
    tl = Timeline()
    dp.add_sample_times(tl, 7, times)
    assert sorted(tl.spans) == sorted([
        Span("worker 1", "load", "7", 10.0, 12.0), Span("worker 1", "preprocess", "7", 12.0, 13.0),
        Span("main thread", "load", "7", 20.0, 20.25), Span("main thread", "preprocess", "7", 20.25, 21.0),
    ])
