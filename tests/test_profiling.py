"""benchmark() warms up, repeats and summarises; it synchronises on CUDA."""

import time

import pytest
import torch

from course_lib.profiling import Timing, benchmark


def test_counts_warmup_and_repeats() -> None:
    calls = []
    timing = benchmark(lambda: calls.append(1), warmup=2, repeat=5, device="cpu")
    assert len(calls) == 7 and len(timing.times) == 5


def test_measures_a_known_sleep() -> None:
    timing = benchmark(time.sleep, 0.01, warmup=0, repeat=5, device="cpu")
    assert 0.009 < timing.median < 0.05
    lo, hi = timing.spread
    assert timing.minimum <= lo <= timing.median <= hi


def test_timing_summary() -> None:
    t = Timing([3e-3, 1e-3, 2e-3])
    assert t.median == 2e-3 and t.minimum == 1e-3
    assert str(t).startswith("2 ms median")
    assert Timing([5e-6]).spread == (5e-6, 5e-6)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="repeat >= 1"):
        benchmark(lambda: None, repeat=0)


@pytest.mark.gpu
def test_cuda_timing_waits_for_the_kernel() -> None:
    a = torch.randn(4096, 4096, device="cuda")
    timing = benchmark(torch.mm, a, a, warmup=2, repeat=5)
    # A 4096^3 matmul is 137 GFLOP: no GPU does it in under 50 us, so a launch-only time would show.
    assert timing.median > 50e-6
