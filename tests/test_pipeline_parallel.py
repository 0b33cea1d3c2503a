"""Pipeline parallelism (course_lib.pipeline_parallel, its harness): partitions, schedules, bubbles, gloo runs vs one process."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.pipelining  # noqa: F401  (imported before forking, so ranks do not each import it)

from course_lib import pipeline_parallel as pp
from course_lib.exercises.pipeline_parallel import Stage, check_schedule, run_pipeline, stage_reference
from course_lib.support import torchrun
from course_lib.support.dist import launch
from course_lib.support.timeline import Span, Timeline
from course_lib.support.torchrun import max_abs_error


def _max_cost(costs, bounds):
    return max(sum(costs[s:e]) for s, e in bounds)


def _brute(costs, p):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), p - 1):
        edges = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(edges, edges[1:])))
    return best


@pytest.mark.parametrize("costs,p", [([1, 1, 4, 1, 1], 2), ([1] * 7, 3), ([9, 1, 1, 1], 2), ([1, 2, 3, 4, 5], 5),
                                     ([3, 1, 4, 1, 5, 9, 2, 6], 3), ([2.5], 1), ([0, 0, 5, 0], 2)])
def test_balanced_partition_optimal(costs, p):
    bounds = pp.balanced_partition(costs, p)
    assert len(bounds) == p and bounds[0][0] == 0 and bounds[-1][1] == len(costs)
    assert all(s < e for s, e in bounds) and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert _max_cost(costs, bounds) == pytest.approx(_brute(costs, p))


def test_balanced_partition_errors():
    for bad in (0, 4):
        with pytest.raises(ValueError):
            pp.balanced_partition([1, 1, 1], bad)
    with pytest.raises(ValueError):
        pp.balanced_partition([1, -1], 1)


def test_bubble_formula_and_simulation():
    assert pp.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert pp.bubble_fraction(1, 5) == 0
    assert pp.bubble_fraction(4, 8, v=2) == pytest.approx(3 / 19)
    for p, m in ((2, 1), (3, 4), (4, 8)):
        for sched in (pp.gpipe_schedule, pp.one_f_one_b_schedule):
            timeline = pp.simulate([sched(p, m, r) for r in range(p)])
            assert timeline.lanes() == [f"stage {r}" for r in range(p)]
            fr = pp.measured_bubble(timeline)
            assert fr == pytest.approx([pp.bubble_fraction(p, m)] * p)
    fr = pp.measured_bubble(pp.simulate([pp.interleaved_schedule(4, 8, 2, r) for r in range(4)], v=2))
    assert fr == pytest.approx([pp.bubble_fraction(4, 8, 2)] * 4)


def test_measured_bubble_by_hand():
    timeline = Timeline([Span("stage 0", "F", "0", 0.0, 1.0), Span("stage 0", "B", "0", 3.0, 4.0),
                         Span("stage 1", "F", "0", 1.0, 2.0), Span("stage 1", "B", "0", 2.0, 3.0),
                         Span("stage 1", "x", "", 0.0, 9.0)])
    assert pp.measured_bubble(timeline) == pytest.approx([0.5, 0.5])
    assert pp.measured_bubble(timeline, ["stage 1", "stage 2"]) == pytest.approx([0.5, 1.0])  # a lane without spans: idle
    with pytest.raises(ValueError):
        pp.measured_bubble(Timeline([Span("stage 0", "x", "", 0.0, 1.0)]))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_one_f_one_b_properties(p):
    for m in (1, p, 2 * p + 1):
        scheds = [pp.one_f_one_b_schedule(p, m, r) for r in range(p)]
        check_schedule(scheds, m)
        for r, s in enumerate(scheds):
            assert pp.in_flight(s) == min(m, p - r)
            assert s[: min(p - 1 - r, m)] == [("F", i) for i in range(min(p - 1 - r, m))]


def test_check_schedule_catches_errors():
    with pytest.raises(AssertionError, match="before"):
        check_schedule([[("B", 0), ("F", 0)]], 1)
    with pytest.raises(AssertionError, match="in flight"):
        check_schedule([pp.gpipe_schedule(2, 3, r) for r in range(2)], 3)
    with pytest.raises(AssertionError, match="deadlock"):
        check_schedule([[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("B", 1), ("F", 0), ("B", 0)]], 2)


def test_meter_counts_and_releases():
    layers = pp.make_model(2, 4, dtype=torch.float64)
    stage = Stage(layers)
    x = torch.randn(3, 4, dtype=torch.float64)
    outs = [stage(x.clone()) for _ in range(2)]
    per_mb = stage.meter.live // 2
    assert per_mb > 0 and stage.meter.live == 2 * per_mb
    outs[0].sum().backward()
    assert stage.meter.live == per_mb
    outs[1].sum().backward()
    assert stage.meter.live == 0 and stage.meter.peak == 2 * per_mb
    assert [(s.lane, s.kind, s.label) for s in stage.timeline.spans] == [
        ("stage 0", "F", "0"), ("stage 0", "F", "1"), ("stage 0", "B", "0"), ("stage 0", "B", "1")]


def _steps_in_rank(cases):
    errors = []
    for sched, m, gpipe in cases:
        model = pp.make_model(5, 4, seed=3, dtype=torch.float64)
        gen = torch.Generator().manual_seed(4)
        batch = (
            torch.randn(2 * m, 4, generator=gen, dtype=torch.float64),
            torch.randn(2 * m, 4, generator=gen, dtype=torch.float64),
        )
        ex = (lambda st, ops, *a: pp.gpipe_step(st, *a)) if gpipe else pp.run_schedule
        out = run_pipeline(model, batch, m, sched, executor=ex, warmup=False)
        loss, grads = stage_reference(model, batch, out["bounds"], dist.get_rank())
        errors.append(max_abs_error(out["grads"], grads))
        if dist.get_rank() == dist.get_world_size() - 1:
            errors.append(max_abs_error(out["loss"], loss))
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_executors_match_reference(world):
    cases = [(sched, m, gpipe) for sched, gpipe in (("gpipe", True), ("gpipe", False), ("1f1b", False), ("naive", False))
             for m in (1, world, 2 * world + 1)]
    res = launch(_steps_in_rank, world, cases, timeout=300)
    assert max(max(r) for r in res) < 1e-12


def _torch_vs_ours(sched, m):
    model = pp.make_model(4, 4, seed=5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(6)
    batch = (torch.randn(8, 4, generator=gen, dtype=torch.float64), torch.randn(8, 4, generator=gen, dtype=torch.float64))
    ours = run_pipeline(model, batch, m, sched, warmup=False)
    theirs = pp.torch_pipeline_step(model, batch, m, sched)
    for a, b in zip(ours["grads"], theirs["grads"]):
        torch.testing.assert_close(a, b)
    if dist.get_rank() == dist.get_world_size() - 1:
        torch.testing.assert_close(ours["loss"], theirs["loss"])
    return True


def test_torch_pipelining_agrees():
    assert all(launch(_torch_vs_ours, 2, "1f1b", 4, timeout=300))


def test_torchrun_entry():
    run = torchrun.run_entry("benchmarks.checks.pipeline_parallel", 2, "--small")
    assert run.checks == ["naive", "gpipe", "1f1b", "interleaved"], run.stdout
    result = run.result
    assert result["world_size"] == 2
    for name in ("naive", "gpipe", "1f1b", "interleaved"):
        assert len(result[name]["bubble_measured"]) == 2 and len(result[name]["peak_activation_bytes"]) == 2
    assert result["1f1b"]["peak_activation_bytes"][0] < result["gpipe"]["peak_activation_bytes"][0]


def _neighbours_in_rank() -> bool:
    pp.connect_neighbours()  # one mirrored batch with each neighbour; a mismatch would hang until the timeout
    pp.connect_neighbours()
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_connect_neighbours_completes(world):
    assert launch(_neighbours_in_rank, world, timeout=300) == [True] * world


# ---- interleaved 1F1B, the order of point-to-point posts, zero bubble, bytes ----------------------


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_interleaved_schedule_properties(p, v):
    from course_lib.exercises.pipeline_parallel import check_interleaved_schedule
    for m in (p, 2 * p, 3 * p):
        scheds = [pp.interleaved_schedule(p, m, v, r) for r in range(p)]
        check_interleaved_schedule(scheds, m, v)
        timeline = pp.simulate(scheds, v=v)
        assert pp.measured_bubble(timeline) == pytest.approx([pp.bubble_fraction(p, m, v)] * p)
        if v == 1:
            assert [op[:2] for op in scheds[0]] == pp.one_f_one_b_schedule(p, m, 0)


def test_interleaved_schedule_errors():
    with pytest.raises(ValueError, match="multiple"):
        pp.interleaved_schedule(3, 4, 2, 0)
    for args in ((2, 2, 0, 0), (2, 2, 2, 2), (0, 2, 2, 0)):
        with pytest.raises(ValueError):
            pp.interleaved_schedule(*args)


def test_check_interleaved_schedule_catches_errors():
    from course_lib.exercises.pipeline_parallel import check_interleaved_schedule
    good = [pp.interleaved_schedule(2, 4, 2, r) for r in range(2)]
    with pytest.raises(AssertionError, match="actions"):
        check_interleaved_schedule([good[0][:-1], good[1]], 4, 2)
    with pytest.raises(AssertionError, match="deadlock"):
        check_interleaved_schedule([[(k, mb, 1 - c) for k, mb, c in good[0]], good[1]], 4, 2)


def _op(kind, peer, n=8, batch=None, together=0):
    from course_lib.exercises.pipeline_parallel import P2POp
    return P2POp(kind, peer, n, batch, together)


def test_check_p2p_order():
    from course_lib.exercises.pipeline_parallel import check_p2p_order
    batched = [[_op("send", 1, batch=0), _op("recv", 1, batch=0)], [_op("send", 0, batch=0), _op("recv", 0, batch=0)]]
    check_p2p_order(batched)
    mirrored = [[_op("send", 1), _op("recv", 1)], [_op("recv", 0), _op("send", 0)]]
    check_p2p_order(mirrored)
    with pytest.raises(AssertionError, match="NCCL"):
        check_p2p_order([[_op("send", 1), _op("recv", 1)], [_op("send", 0), _op("recv", 0)]])
    with pytest.raises(AssertionError, match="receives"):
        check_p2p_order([[_op("send", 1), _op("send", 1)], [_op("recv", 0)]])
    with pytest.raises(AssertionError, match="bytes"):
        check_p2p_order([[_op("send", 1, 8)], [_op("recv", 0, 4)]])
    from course_lib.exercises.pipeline_parallel import P2POp
    same_bytes = [[P2POp("send", 1, 8, None, 0, (2,), torch.float32)], [P2POp("recv", 0, 8, None, 0, (1,), torch.float64)]]
    with pytest.raises(AssertionError, match=r"shape \(2,\), torch.float32, 8 bytes.*shape \(1,\), torch.float64"):
        check_p2p_order(same_bytes)  # as many bytes, but another tensor: NCCL would fill the wrong layout
    # posted in separate runs (a wait between them): each side blocks on its own, in an order that matches
    check_p2p_order([[_op("send", 1, together=0), _op("recv", 1, together=1)],
                     [_op("recv", 0, together=0), _op("send", 0, together=1)]])


def _interleaved_in_rank(cases):
    from course_lib.exercises.pipeline_parallel import check_p2p_order, recording_p2p, virtual_stages
    rank, p = dist.get_rank(), dist.get_world_size()
    errors = []
    for m, v in cases:
        model = pp.make_model(p * v, 4, seed=m + v, dtype=torch.float64)
        gen = torch.Generator().manual_seed(1)
        batch = tuple(torch.randn(2 * m, 4, generator=gen, dtype=torch.float64) for _ in range(2))
        parts = virtual_stages(model, p, v, rank)
        with recording_p2p() as posted:
            loss = pp.run_interleaved(parts, pp.interleaved_schedule(p, m, v, rank), batch, m, torch.nn.functional.mse_loss)
        everyone: list = [None] * p
        dist.all_gather_object(everyone, posted)
        check_p2p_order(everyone)
        ref_loss, ref_grads = pp.reference_step(model, batch)
        got = [q.grad for c in range(v) for q in parts[c * p + rank].layers.parameters()]
        want = [ref_grads[2 * (c * p + rank) + k] for c in range(v) for k in range(2)]
        errors.append(max_abs_error(got, want))
        if rank == p - 1:
            errors.append(max_abs_error(loss, ref_loss))
        assert parts[rank].meter.peak > 0
    return errors


@pytest.mark.parametrize("world", [2, 3])
def test_run_interleaved_matches_reference(world):
    cases = [(m, v) for v in (1, 2, 3) for m in (world, 2 * world)]
    res = launch(_interleaved_in_rank, world, cases, timeout=300)
    assert max(max(r) for r in res) < 1e-12


def _separate_posts_in_rank():
    from course_lib.exercises.pipeline_parallel import recording_p2p
    peer = 1 - dist.get_rank()
    with recording_p2p() as posted:
        work = dist.isend(torch.ones(2), peer)
        dist.irecv(torch.empty(2), peer).wait()
        work.wait()
    return posted


def test_recording_p2p_sees_separate_posts():
    from course_lib.exercises.pipeline_parallel import check_p2p_order
    posted = launch(_separate_posts_in_rank, 2, timeout=300)
    assert [[(op.kind, op.batch) for op in ops] for ops in posted] == [[("send", None), ("recv", None)]] * 2
    assert posted[0][0].together == posted[0][1].together
    with pytest.raises(AssertionError, match="NCCL"):
        check_p2p_order(posted)


@pytest.mark.parametrize("p,m", [(1, 3), (2, 4), (3, 6), (4, 8), (4, 3)])
def test_zero_bubble_schedules(p, m):
    scheds = pp.zero_bubble_schedules(p, m)
    for r, s in enumerate(scheds):
        for kind in ("F", "B", "W"):
            assert sorted(mb for k, mb in s if k == kind) == list(range(m))
        assert all(s.index(("B", mb)) < s.index(("W", mb)) for mb in range(m))
        assert [op for op in s if op[0] != "W"] == pp.one_f_one_b_schedule(p, m, r)
        assert pp.in_flight(s) <= p
    timeline = pp.simulate(scheds, 1.0, 1.0, t_w=1.0)
    ofob = pp.simulate([pp.one_f_one_b_schedule(p, m, r) for r in range(p)], 1.0, 2.0)
    assert timeline.end - timeline.start <= ofob.end - ofob.start
    if m >= p:  # ZB-H1's bubble: (p - 1)(t_f + t_B - t_W) instead of (p - 1)(t_f + t_b)
        assert timeline.end - timeline.start == pytest.approx(3 * m + (p - 1))


def test_traffic_model():
    assert pp.boundary_bytes(2, 3, 4, 2) == 96
    assert pp.ring_all_reduce_bytes(100, 4) == pytest.approx(150)
    t = pp.parallel_traffic(1, 8, 16, 4, 1000, m=2, tp=2, pp=2, dp=4, dtype_bytes=2)
    assert t["pp"] == 2 * pp.boundary_bytes(1, 8, 16, 2)
    assert t["tp"] == pytest.approx(2 * 2 * 4 * pp.ring_all_reduce_bytes(8 * 16 * 2, 2))
    assert t["dp"] == pytest.approx(pp.ring_all_reduce_bytes(1000 / 4 * 2, 4))
    assert pp.parallel_traffic(1, 8, 16, 4, 1000, m=2)["pp"] == 0.0
