"""Timing a call that every rank makes together."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from course_lib.support.dist import rank_device

__all__ = ["time_in_ranks"]


def _sync(device: torch.device) -> None:
    # synchronize(device) waits for every stream of the device, NCCL's communication streams too.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_in_ranks(fn: Callable[..., Any], *args: Any, repeat: int = 5, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``fn(*args)`` made by all ranks together (call it in every rank).

    After ``warmup`` untimed calls, the ranks line up at a barrier before each timed call; the
    clock stops once this rank's device has finished everything queued (communication included).
    A call's time is the slowest rank's (an all-reduce with MAX), so every rank returns the same
    list. ValueError unless repeat >= 1 and warmup >= 0.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"need repeat >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    device = rank_device()
    for _ in range(warmup):
        fn(*args)
    _sync(device)
    times = []
    for _ in range(repeat):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn(*args)
        _sync(device)
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.cpu().tolist()
