"""course_lib.support.comm and .timing, in gloo ranks: what is recorded, forbidden, restored and timed."""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.support.comm import record_collectives
from course_lib.support.dist import launch
from course_lib.support.timeline import Timeline
from course_lib.support.timing import time_in_ranks


def _record_everything() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(10)
    tl = Timeline()
    with record_collectives(timeline=tl, lane=f"rank {rank}") as log:
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        out = [torch.empty(10) for _ in range(world)]
        dist.all_gather(out, t)
        got = torch.empty(3, dtype=torch.float64)
        ops = [dist.P2POp(dist.isend, torch.zeros(3, dtype=torch.float64), (rank + 1) % world),
               dist.P2POp(dist.irecv, got, (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    restored = dist.all_reduce.__module__.startswith("torch") and dist.P2POp.__module__.startswith("torch")
    try:
        with record_collectives(forbid=("all_reduce",), reason="use send/recv") as _:
            dist.all_reduce(t)
        forbidden = ""
    except AssertionError as exc:
        forbidden = str(exc)
    p2p = [(c.shape, c.dtype, c.batch) for c in log.calls if c.peer is not None]
    return {"calls": [(c.op, c.bytes, c.peer) for c in log.calls], "ends": [c.end is not None for c in log.calls], "p2p": p2p,
            "spans": len(tl.of(f"rank {rank}", "all_reduce")), "restored": restored, "forbidden": forbidden,
            "bytes": log.bytes("all_reduce"), "count": log.count()}


def test_record_collectives_sees_collectives_and_batched_point_to_point() -> None:
    results = launch(_record_everything, 3)
    for rank, r in enumerate(results):
        assert r["calls"] == [("all_reduce", 40, None), ("all_reduce", 40, None), ("all_gather", 40, None),
                              ("isend", 24, (rank + 1) % 3), ("irecv", 24, (rank - 1) % 3)]
        assert r["ends"][:3] == [True, True, True] and r["spans"] == 2
        assert r["p2p"] == [((3,), torch.float64, 0), ((3,), torch.float64, 0)]
        assert r["bytes"] == 80 and r["count"] == 5 and r["restored"]
        assert r["forbidden"] == "dist.all_reduce is not allowed here: use send/recv"


def _waits() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(8)
    with record_collectives() as log:
        early = dist.all_reduce(t, async_op=True)
        torch.ones(1000).sum()  # work between the start and the wait
        early.wait()
        got = torch.empty(2)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), (rank + 1) % world),
                                        dist.P2POp(dist.irecv, got, (rank - 1) % world)])
        works[0].wait()
        works[1].is_completed()  # any other attribute is the handle's own
        works[1].wait()
        blocking = dist.all_reduce(t)
        never = dist.all_reduce(t, async_op=True)
        wide = torch.zeros(4, 2 * world)
        dist.all_gather([wide[:, 2 * r:2 * r + 2] for r in range(world)], torch.ones(4, 2))  # outputs: strided views
    never._work.wait()  # the handle itself: not seen by the log
    return {"waited": [c.waited is not None for c in log.calls], "contiguous": [c.contiguous for c in log.calls],
            "after_start": all(c.waited >= c.start for c in log.calls if c.waited is not None), "blocking": blocking}


def test_the_log_knows_when_each_handle_was_first_waited_for() -> None:
    for r in launch(_waits, 2):
        assert r["waited"] == [True, True, True, False, False, False]
        assert r["contiguous"] == [True] * 5 + [False]
        assert r["after_start"] and r["blocking"] is None


def _timed() -> list[float]:
    return time_in_ranks(dist.all_reduce, torch.ones(4), repeat=3, warmup=1)


def test_time_in_ranks_returns_the_same_slowest_times_everywhere() -> None:
    a, b = launch(_timed, 2)
    assert len(a) == 3 and a == b and all(t > 0 for t in a)
