"""Unit tests of course_lib.data_pipelines: prefetchers, the throughput model, buffers, timelines."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader

from course_lib import data_pipelines as dp
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
    got = list(dp.CudaPrefetcher(loader, "cpu"))
    want = list(loader)
    assert len(got) == len(want) == 3
    for (gx, gy), (wx, wy) in zip(got, want):
        torch.testing.assert_close(gx, wx)
        assert torch.equal(gy, wy) and gx.device.type == "cpu"
    nested = [{"a": torch.ones(2), "b": [torch.zeros(1), 3]}]
    out = list(dp.CudaPrefetcher(nested, torch.device("cpu")))
    assert out[0]["b"][1] == 3 and torch.equal(out[0]["a"], torch.ones(2))


@pytest.mark.gpu
def test_cuda_prefetcher_on_gpu() -> None:
    loader = DataLoader(dp.SyntheticImages(10), batch_size=4)
    got = list(dp.CudaPrefetcher(loader, "cuda"))
    for (gx, _), (wx, _) in zip(got, loader):
        assert gx.is_cuda
        torch.testing.assert_close(gx.cpu(), wx)


def test_steady_state_and_bottleneck() -> None:
    assert dp.steady_state_step_time(0.04, 0.01, 0) == pytest.approx(0.05)
    assert dp.steady_state_step_time(0.04, 0.01, 2) == pytest.approx(0.02)
    assert dp.steady_state_step_time(0.04, 0.03, 4) == pytest.approx(0.03)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            dp.steady_state_step_time(0.1, 0.1, bad)
    assert dp.bottleneck({"load": 0.04, "compute": 0.01, "workers": 2}) == "data"
    assert dp.bottleneck({"load": 0.04, "compute": 0.03, "workers": 4}) == "compute"
    assert dp.bottleneck({"load": 0.04, "compute": 0.0195, "workers": 2}) == "balanced"
    assert dp.bottleneck({"load": 0.01, "compute": 0.01, "workers": 1, "transfer": 0.05}) == "transfer"
    with pytest.raises(KeyError):
        dp.bottleneck({"load": 1.0, "compute": 1.0})


def test_choose_num_workers() -> None:
    assert dp.choose_num_workers({0: 0.05, 1: 0.03, 2: 0.0201, 3: 0.02}) == 2
    assert dp.choose_num_workers({0: 0.01, 1: 0.02}) == 0
    with pytest.raises(ValueError):
        dp.choose_num_workers({})


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
