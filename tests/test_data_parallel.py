"""Unit tests of course_lib.data_parallel: the maths in one process, DDP / ZeRO-1-2-3 in 2-4 gloo ranks through the
chapter's harness (course_lib.exercises.data_parallel), the byte and time models, and the torchrun self-check."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from course_lib import data_parallel as dp
from course_lib import memory_math as mm
from course_lib.exercises import data_parallel as dpx
from course_lib.exercises.checks import NotDoneYet, assert_close
from course_lib.models import MLP
from course_lib.support import torchrun
from course_lib.support.comm import record_collectives
from course_lib.support.dist import launch
from course_lib.support.timeline import Timeline

CASES = [
    dpx.TrainCase(seed=0),
    dpx.TrainCase(sizes=(3, 5, 4, 2), optimizer="adam", lr=0.01, accumulation=2, seed=1),
    dpx.TrainCase(sizes=(7, 1, 3), optimizer="sgd", lr=0.05, weight_decay=0.1, seed=2),
]


def _run(worker, world_size, student, cases, **kwargs):
    return dpx.launch_exercise(worker, world_size, student, cases, **kwargs)


def test_shard_batch_splits_equally_and_rejects_unequal() -> None:
    x, y = torch.arange(12).reshape(6, 2), torch.arange(6)
    xs, ys = dp.shard_batch((x, y), 1, 3)
    assert torch.equal(xs, x[2:4]) and torch.equal(ys, y[2:4])
    assert torch.equal(dp.shard_batch(y, 0, 1), y)
    with pytest.raises(ValueError):
        dp.shard_batch(y, 0, 4)
    with pytest.raises(ValueError):
        dp.shard_batch(y, 3, 3)


@pytest.mark.parametrize("world_size", [1, 2, 3, 6])
def test_averaged_shard_gradients_equal_the_big_batch_gradient(world_size: int) -> None:
    model = MLP([4, 6, 2], seed=0).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    got = dp.averaged_shard_gradients(model, F.mse_loss, x, y, world_size)
    want = dp.loss_gradients(model, F.mse_loss, x, y)
    for g, w in zip(got, want):
        assert_close(g, w, rtol=1e-12, atol=1e-14)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("n", "world", "shuffle", "drop_last"), [(10, 3, True, False), (10, 3, False, True), (2, 4, True, False), (8, 4, True, True)]
)
def test_sampler_indices_match_distributed_sampler(n: int, world: int, shuffle: bool, drop_last: bool) -> None:
    data = list(range(n))
    for epoch in (0, 3):
        for rank in range(world):
            s = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            s.set_epoch(epoch)
            assert dp.sampler_indices(n, world, rank, shuffle=shuffle, seed=5, epoch=epoch, drop_last=drop_last) == list(s)


def test_assign_buckets_reverse_order_cap_and_dtype() -> None:
    params = [torch.zeros(10), torch.zeros(3), torch.zeros(5), torch.zeros(2, dtype=torch.float64), torch.zeros(4)]
    assert dp.assign_buckets(params, 0) == [[4], [3], [2], [1], [0]]
    assert dp.assign_buckets(params, 1e9) == [[4], [3], [2, 1, 0]]
    assert dp.assign_buckets(params, 32) == [[4], [3], [2, 1], [0]]  # 20 + 12 bytes reach 32
    assert dp.assign_buckets([], 10) == []


def test_scaling_efficiency() -> None:
    assert dp.scaling_efficiency(1.0, 0.0) == 1.0
    assert dp.scaling_efficiency(3.0, 1.0) == 0.75
    assert dp.scaling_efficiency(3.0, 1.0, 2.0) == 1.0
    assert dp.scaling_efficiency(0.3, 0.12, 0.1) == pytest.approx(0.9375)
    np.testing.assert_allclose(dp.scaling_efficiency(np.array([1.0, 1.0]), np.array([1.0, 3.0]), 1.0), [1.0, 1 / 3])
    with pytest.raises(ValueError):
        dp.scaling_efficiency(0.0, 1.0)
    with pytest.raises(ValueError):
        dp.scaling_efficiency(1.0, -1.0)
    assert dp.step_compute_time(1e9, 1e3, 6e12) == pytest.approx(1.0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_naive_ddp_equals_big_batch_training(world_size: int) -> None:
    results = _run(dpx.train_naive_ddp, world_size, dp.average_gradients, CASES)
    for rank_results in results:
        for case, got in zip(CASES, rank_results):
            want = dpx.train_single_process(case)
            for a, b in zip(got["params"], want["params"]):
                assert_close(a, b, rtol=1e-10, atol=1e-12, name=case.describe(world_size))


def test_gradient_scale_hint_spots_a_missing_division() -> None:
    g = [torch.ones(3, dtype=torch.float64)]
    assert "forget to divide" in dpx.gradient_scale_hint([t * 4 for t in g], g, 4)
    assert "twice" in dpx.gradient_scale_hint([t / 4 for t in g], g, 4)
    assert dpx.gradient_scale_hint(g, g, 4) == ""


def test_bucketed_ddp_equals_torch_ddp_and_overlaps() -> None:
    results = _run(dpx.train_bucketed_ddp, 3, dp.BucketedDDP, CASES, distinct_init=True)
    for rank_results in results:
        for case, got in zip(CASES, rank_results):
            want = dpx.train_single_process(case)
            for a, b, c in zip(got["params"], want["params"], got["torch_ddp"]):
                assert_close(a, b, rtol=1e-10, atol=1e-12)
                assert_close(a, c, rtol=1e-10, atol=1e-12)
            assert got["async_during_backward"] >= 2  # a tiny bucket cap: several buckets, launched during backward


class _WithUnused(torch.nn.Module):
    """An MLP and a parameter that no forward pass uses."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP([6, 9, 3], seed=3).double()
        self.unused = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def _train_in_place_grads(world: int) -> tuple[list[torch.Tensor], bool, list[torch.Tensor]]:
    """Three SGD steps of 2 micro-batches with ``zero_grad(set_to_none=False)``; in a rank or (world 1) alone."""
    model = _WithUnused()
    rank = torch.distributed.get_rank() if world > 1 else 0
    net = dp.BucketedDDP(model, bucket_cap_mb=1e-4) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(2, 4, 6, generator=g, dtype=torch.float64), torch.randn(2, 4, 3, generator=g, dtype=torch.float64))
            for _ in range(3)]
    views = True
    for x, y in data:
        opt.zero_grad(set_to_none=False)
        for k in range(2):
            xs, ys = dp.shard_batch((x[k], y[k]), rank, world)
            with net.no_sync() if world > 1 and k == 0 else contextlib.nullcontext():
                (F.mse_loss(net(xs), ys) / 2).backward()
        if world > 1:
            net.finish_gradient_sync()
            buckets = {t.untyped_storage().data_ptr() for t in net.bucket_grads}
            views &= all(p.grad.untyped_storage().data_ptr() in buckets for p in model.parameters())
        opt.step()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()], views, grads


def test_bucketed_ddp_grads_live_in_the_buckets_and_accumulate_in_place() -> None:
    torch.set_num_threads(1)
    want, _, want_grads = _train_in_place_grads(1)
    for got, views, grads in launch(_train_in_place_grads, 2, 2):
        assert views, "after finish_gradient_sync every .grad should be a view into a bucket tensor"
        for a, b in zip(got, want):
            assert_close(a, b, rtol=1e-10, atol=1e-12)
        assert_close(grads[0], torch.zeros(4, dtype=torch.float64), name="the unused parameter's gradient")  # listed first
        for a, b in zip(grads[1:], want_grads[1:]):
            assert_close(a, b, rtol=1e-10, atol=1e-12)


def _train_in_two_groups(world: int) -> list[torch.Tensor]:
    """Two SGD steps of an MLP whose data-parallel group is {0, 1} or {2, 3}; in a rank, or (world 1) alone for group 1."""
    rank = torch.distributed.get_rank() if world > 1 else 2
    groups = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])] if world > 1 else [None, None]
    model = MLP([6, 9, 3], seed=rank).double()  # every rank starts different: the group's first rank must win
    net = dp.BucketedDDP(model, bucket_cap_mb=1e-4, group=groups[rank // 2]) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank // 2)  # each group trains on its own data
    for _ in range(2):
        x, y = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)
        xs, ys = dp.shard_batch((x, y), rank % 2, 2) if world > 1 else (x, y)
        opt.zero_grad()
        F.mse_loss(net(xs), ys).backward()
        if world > 1:
            net.finish_gradient_sync()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_bucketed_ddp_averages_within_its_group_only() -> None:
    torch.set_num_threads(1)
    want = _train_in_two_groups(1)
    results = launch(_train_in_two_groups, 4, 4)
    for rank in (2, 3):
        for a, b in zip(results[rank], want):
            assert_close(a, b, rtol=1e-10, atol=1e-12, name=f"rank {rank}'s parameters (group {{2, 3}})")
    for a, b in zip(results[0], results[1]):
        assert_close(a, b, rtol=0, atol=0, name="ranks 0 and 1 (one group) should hold the same parameters")
    assert not torch.allclose(results[0][0], results[2][0]), "the two groups train on different data and must differ"


def test_zero1_equals_adam_with_sharded_state() -> None:
    cases = [c for c in CASES if c.optimizer == "adam"]
    cases += [dpx.TrainCase(sizes=(3, 1, 2), optimizer="adam", lr=0.02, weight_decay=0.1)]
    for world_size in (2, 3):
        results = _run(dpx.train_zero1, world_size, dp.ZeroStage1Optimizer, cases)
        for rank_results in results:
            for case, got in zip(cases, rank_results):
                want = dpx.train_single_process(case)
                for a, b in zip(got["params"], want["params"]):
                    assert_close(a, b, rtol=1e-9, atol=1e-11)
                numel = sum(p.numel() for p in case.model().parameters())
                assert got["state_bytes"] == 2 * 8 * -(-numel // world_size)  # two float64 moments of one shard


def test_zero1_state_matches_memory_math() -> None:
    numel = 10_000
    per_rank = mm.zero_memory_per_gpu(numel, stage=1, world_size=4, regime="fp32_adam").optimizer
    assert per_rank == 8 * numel / 4


def test_zero2_equals_adam_with_sharded_gradients_and_states() -> None:
    cases = [dpx.TrainCase(sizes=(7, 1, 3), optimizer="adam", lr=0.01, seed=2),
             dpx.TrainCase(sizes=(5, 9, 4, 1), optimizer="adam", lr=0.02, weight_decay=0.1, accumulation=2, seed=3)]
    world = 3
    for rank, rank_results in enumerate(_run(dpx.train_zero2, world, dp.ZeroStage2Optimizer, cases)):
        for case, got in zip(cases, rank_results):
            want = dpx.train_single_process(case)
            for a, b in zip(got["params"], want["params"]):
                assert_close(a, b, rtol=1e-9, atol=1e-11)
            for g, w in zip(got["first_grad_shards"], want["first_grads"]):
                assert_close(g, dpx.expected_shards([w], world, rank), rtol=1e-10, atol=1e-12)
            shards = sum(dp.shard_size(p.numel(), world) for p in case.model().parameters())
            assert got["state_bytes"] == 2 * 8 * shards and got["grad_shard_bytes"] == 8 * shards
            assert got["full_grad_bytes"] == 0 and got["calls_in_backward"] > 0
            micro = case.steps * case.accumulation
            assert got["comm"]["bytes"] == {"reduce_scatter_tensor": micro * world * shards * 8,
                                            "all_gather_into_tensor": case.steps * shards * 8}


def test_fully_sharded_block_equals_single_process_and_fsdp2() -> None:
    cases = [dpx.TrainCase(sizes=(7, 1, 3), seed=2),
             dpx.TrainCase(sizes=(5, 9, 4, 1), optimizer="adam", lr=0.02, weight_decay=0.1, accumulation=2, seed=3)]
    world = 3
    results = _run(dpx.train_fully_sharded, world, dp.FullyShardedBlock, cases, against_fsdp2=True)
    for c, case in enumerate(cases):
        want = dpx.train_single_process(case)
        blocks = [len(list(b.parameters())) for b in case.blocks()]
        ends = np.cumsum([0, *blocks])
        shard_bytes = 8 * sum(dp.shard_size(sum(p.numel() for p in b.parameters()), world) for b in case.blocks())
        for j, (a, b) in enumerate(zip(ends[:-1], ends[1:])):
            full = torch.cat([results[r][c]["shards"][j] for r in range(world)])
            expected = torch.cat([w.reshape(-1) for w in want["params"][a:b]])
            assert_close(full[:expected.numel()], expected, rtol=1e-9, atol=1e-11)
        for r in range(world):
            got = results[r][c]
            assert got["alive"] == {"forward": 0, "backward": 0, "after_step": 0}
            assert got["held_bytes"] == shard_bytes
            micro = case.steps * case.accumulation
            assert got["forward"]["bytes"] == {"all_gather_into_tensor": micro * shard_bytes}
            assert got["backward"]["bytes"] == {"all_gather_into_tensor": micro * shard_bytes,
                                                "reduce_scatter_tensor": micro * world * shard_bytes}
        for theirs, mine in zip(results[0][c]["fsdp2"], want["params"]):
            assert_close(theirs, mine, rtol=1e-9, atol=1e-11)


def _gathers_alive_with(wrapper_cls: type) -> dict[str, int]:
    return _run(dpx.train_fully_sharded, 2, wrapper_cls, [dpx.TrainCase(sizes=(4, 6, 5, 2))])[0][0]["alive"]


class _KeepsGathered(dp.FullyShardedBlock):
    """A wrapper that forgets to reshard: it keeps the forward's gathered parameters."""

    def gather(self) -> torch.Tensor:
        self.kept = super().gather()
        return self.kept


def test_the_harness_sees_gathered_parameters_kept_alive() -> None:
    assert _gathers_alive_with(dp.FullyShardedBlock) == {"forward": 0, "backward": 0, "after_step": 0}
    alive = _gathers_alive_with(_KeepsGathered)
    assert alive["forward"] > 0 and alive["after_step"] > 0


def test_ring_and_zero_byte_models() -> None:
    assert dp.ring_bytes_sent("all_reduce", 100, 4) == 150
    assert dp.ring_bytes_sent("reduce_scatter_tensor", 100, 4) + dp.ring_bytes_sent("all_gather_into_tensor", 25, 4) == 150
    assert dp.zero_bytes_sent(1e9, 3, 8) == pytest.approx(1.5 * dp.zero_bytes_sent(1e9, 0, 8))
    assert dp.zero_bytes_sent(1e9, 2, 8) == dp.zero_bytes_sent(1e9, 0, 8) == pytest.approx(2 * 7 / 8 * 2e9)
    plain = dp.zeropp_cross_node_bytes(1e9, 16, quantized_weights=False, hierarchical=False, quantized_gradients=False)
    assert plain == pytest.approx(dp.zero_bytes_sent(1e9, 3, 16))
    assert dp.zeropp_cross_node_bytes(1e9, 16) == pytest.approx(plain / 4)  # ZeRO++: 3M -> 0.75M
    with pytest.raises(ValueError):
        dp.ring_bytes_sent("broadcast", 1, 2)


def test_offload_model() -> None:
    t = dp.offload_step_seconds(1e9, 1e3, 6e12, pcie_bytes_per_s=4e9, cpu_adam_params_per_s=1e9, nvme_bytes_per_s=24e9)
    assert t["compute"] == pytest.approx(1.0) and t["pcie"] == pytest.approx(1.0)
    assert t["cpu_adam"] == pytest.approx(1.0) and t["nvme"] == pytest.approx(1.0) and t["total"] == pytest.approx(4.0)
    assert "nvme" not in dp.offload_step_seconds(1e9, 1e3, 6e12, 4e9, 1e9)


def average_gradients(model: torch.nn.Module) -> None:
    """An untouched exercise."""
    raise NotImplementedError()


def test_not_implemented_in_ranks_says_not_done() -> None:
    with pytest.raises(NotDoneYet, match="average_gradients is not implemented yet: .* [(]raised in rank 0[)]"):
        _run(dpx.train_naive_ddp, 2, average_gradients, CASES[:1])


def _bucketed_step_timeline() -> Timeline:
    timeline = Timeline()
    model = MLP([32, 64, 64, 4], seed=0)
    ddp = dp.BucketedDDP(model, bucket_cap_mb=0.005)
    with record_collectives(timeline=timeline, lane="comm"):
        with timeline.span("compute", "backward"):
            F.mse_loss(ddp(torch.randn(8, 32)), torch.randn(8, 4)).backward()
        ddp.finish_gradient_sync()
    return timeline


def test_bucketed_all_reduces_start_during_backward() -> None:
    timeline = launch(_bucketed_step_timeline, 2)[0]
    (bwd,) = timeline.of("compute", "backward")
    reduces = timeline.of("comm", "all_reduce")
    assert len(reduces) >= 2
    assert min(s.start for s in reduces) < bwd.end  # the first bucket starts before backward ends


# ---- the torchrun entry -------------------------------------------------------------------------


def _torchrun(module: str, *args: str) -> tuple[list[str], dict]:
    """The CHECK names and RESULT of ``torchrun --nproc_per_node 2 -m module --small`` (gloo, CPU)."""
    run = torchrun.run_entry(module, 2, "--small", *args)
    return run.checks, run.result


def test_torchrun_entry_checks_ddp_and_zero_against_single_process_and_torch() -> None:
    checks, result = _torchrun("benchmarks.checks.data_parallel")
    for expected in ("naive sgd", "bucketed sgd", "torch_ddp sgd", "naive adam", "bucketed adam",
                     "zero1 adam MLP[6, 10, 4]: params vs single-process Adam",
                     "zero1 adam MLP[6, 10, 4]: params vs torch ZeroRedundancyOptimizer",
                     "zero2 adam MLP[6, 10, 4]: params vs single-process Adam",
                     "fsdp sgd MLP[6, 10, 4]: params vs single process", "fsdp adam MLP[6, 10, 4]: params vs torch FSDP2"):
        assert any(c.startswith(expected) for c in checks), (expected, checks)
    assert any("vs torch DDP" in c for c in checks)
    assert result["world_size"] == 2 and set(result["step_ms"]) == {"compute_only", "naive", "bucketed", "torch_ddp"}
    states = result["optimizer_state_bytes_per_rank"]
    assert states["zero1"] < states["adam_single_process"]  # two moments of half the parameters, padded
    assert states["zero2"] < states["adam_single_process"]


def test_speed_proportional_split_largest_remainder_minimum_and_ties() -> None:
    assert dp.speed_proportional_split(64, [1.7, 1.0]) == [40, 24]
    assert dp.speed_proportional_split(10, [1.0, 1.0, 2.0]) == [3, 2, 5]  # rounding each quota gives 11 or 9
    assert dp.speed_proportional_split(10, [1.0, 1.0, 1.0]) == [4, 3, 3]  # a tie: the lower rank first
    assert dp.speed_proportional_split(10, [100.0, 1.0, 1.0]) == [8, 1, 1]  # every rank at least one
    assert dp.speed_proportional_split(7, [1.0, 5.0, 5.0, 1.0]) == [1, 2, 3, 1]  # the donor: the lower of the largest
    assert dp.speed_proportional_split(2, [1.0, 3.0, 3.0]) == [0, 1, 1]  # fewer samples than ranks: the fastest
    assert dp.speed_proportional_split(0, [1.0, 2.0]) == [0, 0]
    rng = np.random.default_rng(0)
    for _ in range(200):
        speeds = list(rng.uniform(0.1, 5.0, rng.integers(1, 7)))
        batch = int(rng.integers(0, 100))
        counts = dp.speed_proportional_split(batch, speeds)
        assert sum(counts) == batch and min(counts) >= (1 if batch >= len(speeds) else 0)
        quotas = [batch * s / sum(speeds) for s in speeds]
        if min(quotas) >= 1:  # no minimum to enforce: every count within one of its quota
            assert all(abs(c - q) < 1 for c, q in zip(counts, quotas))
    for bad in ((-1, [1.0]), (4, []), (4, [1.0, 0.0]), (4, [1.0, -2.0])):
        with pytest.raises(ValueError):
            dp.speed_proportional_split(*bad)


@pytest.mark.parametrize("world_size", [2, 3])
def test_weighted_average_gradients_equals_single_process(world_size: int) -> None:
    speeds = {2: [1.7, 1.0], 3: [1.0, 4.0, 4.0]}[world_size]
    cases = [dpx.TrainCase(batch=11, seed=0), dpx.TrainCase(sizes=(4, 6, 2), optimizer="adam", lr=0.02, batch=2, seed=3)]
    student = (dp.speed_proportional_split, dp.weighted_average_gradients)
    results = _run(dpx.train_heterogeneous, world_size, student, cases, speeds=speeds)
    for case, *per_rank in zip(cases, *results):
        want = dpx.train_single_process(case)
        param_bytes = sum(p.numel() * p.element_size() for p in case.model().parameters())
        for got in per_rank:
            assert got["counts"] == dp.speed_proportional_split(case.batch, speeds)
            for p, w in zip(got["params"], want["params"]):
                assert_close(p, w, rtol=1e-10, atol=1e-10)
            assert got["ops_per_step"] == [["all_reduce"]] * case.steps
            assert got["comm"] == {"bytes": {"all_reduce": case.steps * param_bytes}, "contiguous": True}


def test_equal_split_utilisation_and_large_batch_schedules() -> None:
    assert dp.equal_split_utilisation([1.7, 1.0]) == pytest.approx(2 / 2.7)
    assert dp.equal_split_utilisation([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert dp.linear_scaled_lr(0.1, 256, 8192) == pytest.approx(3.2)
    assert [dp.warmup_lr(s, 1.0, 4) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert dp.warmup_lr(0, 0.8, 8, start_lr=0.1) == pytest.approx(0.1)
    assert dp.warmup_lr(3, 0.5, 0) == 0.5
    for bad in (lambda: dp.equal_split_utilisation([]), lambda: dp.linear_scaled_lr(0.1, 0, 4),
                lambda: dp.warmup_lr(-1, 1.0, 4)):
        with pytest.raises(ValueError):
            bad()
