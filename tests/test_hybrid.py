"""Tests for course_lib.hybrid: mesh arithmetic, groups built by hand vs init_device_mesh, DP x TP vs one process."""

import math

import pytest

from course_lib import hybrid
from course_lib.exercises.hybrid import reference_shard, train_single_block
from course_lib.support import torchrun
from course_lib.support.dist import launch
from course_lib.support.torchrun import assert_matches_reference


def test_mesh_coords_row_major_and_inverse():
    assert hybrid.mesh_coords(5, (2, 2, 2)) == (1, 0, 1)
    assert hybrid.mesh_coords(3, (4,)) == (3,)
    for r in range(12):
        assert hybrid.mesh_rank(hybrid.mesh_coords(r, (3, 2, 2)), (3, 2, 2)) == r
    with pytest.raises(ValueError):
        hybrid.mesh_coords(8, (2, 4))
    with pytest.raises(ValueError):
        hybrid.mesh_coords(0, (0, 2))


def test_mesh_groups_shapes():
    assert hybrid.mesh_groups((2, 2), 0) == [[0, 2], [1, 3]]
    assert hybrid.mesh_groups((2, 2), 1) == [[0, 1], [2, 3]]
    assert hybrid.mesh_groups((2, 3), -1) == [[0, 1, 2], [3, 4, 5]]
    groups = hybrid.mesh_groups((2, 2, 2), 1)
    assert groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(r for g in groups for r in g) == list(range(8))
    with pytest.raises(ValueError):
        hybrid.mesh_groups((2, 2), 2)


def _both_layouts(shape, names):
    mine = hybrid.new_mesh_groups(shape, names)
    return mine.ranks, hybrid.device_mesh_groups(shape, names), mine.coords


@pytest.mark.parametrize("shape", [(2, 2), (4, 1), (1, 4)])
def test_new_groups_match_init_device_mesh(shape):
    results = launch(_both_layouts, 4, shape, ("dp", "tp"), timeout=300)
    for rank, (mine, theirs, coords) in enumerate(results):
        assert mine == theirs, f"rank {rank}: {mine} != {theirs}"
        assert tuple(coords.values()) == hybrid.mesh_coords(rank, shape)


def _dp_tp(case, dp, tp):
    out = hybrid.train_dp_tp(case, dp, tp)
    want = reference_shard(train_single_block(case), out["coords"][1], tp)
    assert_matches_reference(out["model"], want, name=f"dp{dp}xtp{tp}", rtol=1e-4, atol=1e-5)
    return out["step_s"]


@pytest.mark.parametrize("dp,tp", [(2, 2), (1, 4), (4, 1)])
def test_dp_tp_matches_single_process(dp, tp):
    times = launch(_dp_tp, dp * tp, hybrid.HybridCase(steps=2), dp, tp, timeout=300)
    assert all(t > 0 for t in times)


def test_reference_shard_tp1_is_the_model():
    case = hybrid.HybridCase(steps=1)
    ref = train_single_block(case)
    shard = reference_shard(ref, 0, 1)
    for a, b in zip(shard.parameters(), ref.parameters()):
        assert (a == b).all() and (a.grad == b.grad).all()


def test_torchrun_entry_small():
    run = torchrun.run_entry("benchmarks.checks.hybrid", 2, "--small")
    assert run.checks == ["mesh_dp1xtp2", "dp1xtp2_vs_single_process", "mesh_dp2xtp1", "dp2xtp1_vs_single_process"], run.stdout
    result = run.result
    assert result["world_size"] == 2 and set(result["layouts"]) == {"dp1xtp2", "dp2xtp1"}
    assert all(v["step_s"] > 0 for v in result["layouts"].values())


def _pp_dp_tp(case, pp, dp, tp):
    from course_lib.exercises.hybrid import train_single_stack

    out = hybrid.train_pp_dp_tp(case, pp, dp, tp)
    s, _, t = out["coords"]
    ref = train_single_stack(case)
    per = case.n_blocks // pp
    for i, block in enumerate(out["stage"]):
        assert_matches_reference(block, reference_shard(ref[s * per + i], t, tp),
                                 name=f"pp{pp}xdp{dp}xtp{tp} stage {s} block {i}", rtol=1e-4, atol=1e-5)
    return out["coords"]


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 1, 2), (4, 1, 1)])
def test_pp_dp_tp_matches_single_process(shape):
    case = hybrid.PipelineCase(steps=2, n_blocks=4 if shape[0] == 4 else 2, micro_batches=2)
    coords = launch(_pp_dp_tp, math.prod(shape), case, *shape, timeout=300)
    assert coords == [hybrid.mesh_coords(r, shape) for r in range(math.prod(shape))]


def test_torchrun_entry_eight_ranks_adds_a_pipeline():
    run = torchrun.run_entry("benchmarks.checks.hybrid", 8, "--small")
    assert run.checks == ["mesh_dp4xtp2", "dp4xtp2_vs_single_process", "pp2xdp2xtp2_vs_single_process"], run.stdout
    assert set(run.result["layouts"]) == {"dp4xtp2", "pp2xdp2xtp2"}
