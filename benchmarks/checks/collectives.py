"""Check the chapter-11 collectives on N ranks and time them.

Every collective built from send/recv against the single-process reference, the ring all-reduce
against the single-process sum and ``dist.all_reduce``, Rabenseifner's all-reduce (N a power of two),
the ragged all-to-all and the two-level all-reduce (2 ranks per node when N is even); then
ping-pong, the ring, Rabenseifner and ``dist.all_reduce`` timed by message size, with the
alpha-beta fit and the bus bandwidth:

    torchrun --standalone --nproc_per_node N -m benchmarks.checks.collectives [--small]   (N >= 2)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from course_lib import collectives as coll
from course_lib.exercises.collectives import ANY, all_to_all_case, call_collective, expected_result
from course_lib.support.dist import rank_device
from course_lib.support.timing import time_in_ranks
from course_lib.support.torchrun import entry_main, report_check

__all__ = ["check"]

_P2P_COLLECTIVES: dict[str, Callable[..., Any]] = {
    "broadcast": coll.broadcast_p2p,
    "scatter": coll.scatter_p2p,
    "gather": coll.gather_p2p,
    "reduce": coll.reduce_p2p,
    "all_gather": coll.all_gather_p2p,
    "reduce_scatter": coll.reduce_scatter_p2p,
    "ring_reduce_scatter": coll.ring_reduce_scatter,
    "ring_all_gather": coll.ring_all_gather,
}


def check(small: bool) -> dict[str, Any]:
    """In every rank: each collective against the single-process reference, the ring against ``dist.all_reduce``; timings."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    lengths = [4 * world, 4 * world + 1, 1000 * world + 1] if small else [4 * world + 1, 2**20 + 1, 2**22 + world - 1]
    tol = {"rtol": 1e-5, "atol": 1e-5 * world}
    for i, length in enumerate(lengths):
        inputs = [coll.rank_input(i, r, length) for r in range(world)]
        x = inputs[rank].to(device)
        ours, theirs = coll.ring_all_reduce(x.clone()), x.clone()
        dist.all_reduce(theirs)
        report_check(f"ring_all_reduce n={length} vs single-process sum", ours, expected_result("all_reduce", inputs)[rank],
                     **tol)
        report_check(f"ring_all_reduce n={length} vs dist.all_reduce", ours, theirs, **tol)
        want = expected_result("all_reduce", inputs)[rank]
        if world & (world - 1) == 0:
            report_check(f"rabenseifner_all_reduce n={length} vs single-process sum",
                         coll.rabenseifner_all_reduce(x.clone()), want, **tol)
        per_node = 2 if world % 2 == 0 else 1
        report_check(f"hierarchical_all_reduce n={length} {world // per_node}x{per_node} vs single-process sum",
                     coll.hierarchical_all_reduce(x.clone(), per_node), want, **tol)
    for seed, width in ((0, 0), (1, 3)):
        rows, chunks = all_to_all_case(seed, world, 4 if small else 4096, torch.float32, width, strided=bool(width))
        got = coll.all_to_all_p2p([c.to(device) for c in chunks[rank]], [rows[src][rank] for src in range(world)])
        report_check(f"all_to_all_p2p seed={seed} width={width} vs single-process", got,
                     [chunks[src][rank] for src in range(world)], rtol=0.0, atol=0.0)
    root = world - 1
    for name, fn in _P2P_COLLECTIVES.items():
        for seed, length in enumerate(lengths[:2]):
            mine = call_collective(fn, name, coll.rank_input(seed, rank, length).to(device), root)
            want = expected_result(name, [coll.rank_input(seed, r, length) for r in range(world)], root)[rank]
            if want is None or (isinstance(want, str) and want == ANY):  # not the root: nothing to compare
                mine, want = [], []
            report_check(f"{fn.__name__} n={length} root={root} vs single-process", mine, want, **tol)
    return _all_reduce_timings(small, device)


def _all_reduce_timings(small: bool, device: torch.device) -> dict[str, Any]:
    """In every rank: ping-pong, the ring and ``dist.all_reduce`` by size (slowest rank, fastest repeat), alpha-beta fit."""
    world = dist.get_world_size()
    sizes = [2**k for k in range(10, 17, 2)] if small else [2**k for k in range(10, 27, 2)]
    repeat = 3 if small else 10
    times: dict[str, list[float]] = {"ping_pong_s": [], "ring_all_reduce_s": [], "dist_all_reduce_s": []}
    if world & (world - 1) == 0:
        times["rabenseifner_all_reduce_s"] = []
    for n_bytes in sizes:
        t = torch.zeros(n_bytes // 4, device=device)  # zeros stay zeros however often they are summed
        times["ping_pong_s"].append(min(time_in_ranks(coll.ping_pong, t, repeat=repeat)) / 2)
        times["ring_all_reduce_s"].append(min(time_in_ranks(coll.ring_all_reduce, t, repeat=repeat)))
        times["dist_all_reduce_s"].append(min(time_in_ranks(dist.all_reduce, t, repeat=repeat)))
        if "rabenseifner_all_reduce_s" in times:
            times["rabenseifner_all_reduce_s"].append(min(time_in_ranks(coll.rabenseifner_all_reduce, t, repeat=repeat)))
    alpha, beta = coll.fit_alpha_beta(sizes, times["ping_pong_s"])
    big = sizes[-1]
    return {
        "world_size": world,
        "backend": dist.get_backend(),
        "sizes_bytes": sizes,
        **times,
        "ping_pong_alpha_s": alpha,
        "ping_pong_bandwidth_GBps": 1 / beta / 1e9 if beta > 0 else None,
        "ring_busbw_GBps_largest": coll.bus_bandwidth(big, times["ring_all_reduce_s"][-1], world) / 1e9,
        "dist_busbw_GBps_largest": coll.bus_bandwidth(big, times["dist_all_reduce_s"][-1], world) / 1e9,
    }


if __name__ == "__main__":
    entry_main(check, __doc__)
