"""Timing that tells the truth: warm-up, device synchronisation, repeats, median and spread."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Timing:
    """Seconds per call of a benchmarked function, over ``len(times)`` timed repeats."""

    times: list[float] = field(repr=False)

    @property
    def median(self) -> float:
        """Median seconds per call: robust to the odd slow repeat."""
        return statistics.median(self.times)

    @property
    def spread(self) -> tuple[float, float]:
        """The 10th and 90th percentile, in seconds per call."""
        if len(self.times) == 1:
            return (self.times[0], self.times[0])
        deciles = statistics.quantiles(self.times, n=10, method="inclusive")
        return (deciles[0], deciles[-1])

    @property
    def minimum(self) -> float:
        """Fastest repeat, in seconds per call."""
        return min(self.times)

    def __str__(self) -> str:
        lo, hi = self.spread
        return f"{_fmt(self.median)} median (p10 {_fmt(lo)}, p90 {_fmt(hi)}, n={len(self.times)})"


def _fmt(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _uses_cuda(device: torch.device | str | None) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def benchmark(
    fn: Callable[..., Any],
    *args: Any,
    warmup: int = 3,
    repeat: int = 20,
    device: torch.device | str | None = None,
    **kwargs: Any,
) -> Timing:
    """Time ``fn(*args, **kwargs)``: ``warmup`` untimed calls, then ``repeat`` timed ones.

    On a CUDA device each call is bracketed by CUDA events and the host waits for the
    device before reading them, so the time is the kernel's, not the launch's. On the
    CPU each call is timed with ``time.perf_counter``.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"need repeat >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    for _ in range(warmup):
        fn(*args, **kwargs)
    times: list[float] = []
    if _uses_cuda(device):
        torch.cuda.synchronize()
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args, **kwargs)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn(*args, **kwargs)
            times.append(time.perf_counter() - t0)
    return Timing(times)
