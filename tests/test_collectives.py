"""Unit tests of course_lib.collectives: the collectives from send/recv, the ring, Rabenseifner, all-to-all
and the two-level all-reduce on 2-6 gloo ranks (checked with the chapter's harness,
course_lib.exercises.collectives, against PyTorch's own collectives and a single-process reference),
the cost model, and the torchrun self-check."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from course_lib import collectives as C
from course_lib.exercises import collectives as X
from course_lib.exercises.checks import NotDoneYet
from course_lib.support import torchrun
from course_lib.support.dist import RankError, launch

FUNCTIONS = {
    "broadcast": C.broadcast_p2p,
    "scatter": C.scatter_p2p,
    "gather": C.gather_p2p,
    "reduce": C.reduce_p2p,
    "all_gather": C.all_gather_p2p,
    "reduce_scatter": C.reduce_scatter_p2p,
    "ring_reduce_scatter": C.ring_reduce_scatter,
    "ring_all_gather": C.ring_all_gather,
    "all_reduce": C.ring_all_reduce,
}


def _cases(world_size: int) -> list[tuple]:
    """Lengths divisible and not, shorter than the world, empty; three dtypes; every root; a 2-D case."""
    last = world_size - 1
    return [
        (1, 4 * world_size, torch.float32, 0),
        (2, 4 * world_size + 1, torch.float64, last),
        (3, world_size - 1, torch.int64, last),
        (4, 1, torch.float32, last),
        (5, 0, torch.float32, 0),
        (6, 2 * world_size + world_size - 1, torch.int64, 1 % world_size),
        (7, world_size + 2, torch.float32, 0, 3),
        (8, 2 * world_size + 1, torch.float32, last, 0, True),
        (9, world_size + 1, torch.float64, 0, 3, True),
    ]


@pytest.mark.parametrize("collective", list(FUNCTIONS))
def test_reference_matches_torch_and_definition(collective: str) -> None:
    X.check_collective(FUNCTIONS[collective], collective, 3, _cases(3))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "collective", ["broadcast", "reduce", "all_gather", "ring_reduce_scatter", "ring_all_gather", "all_reduce"]
)
def test_reference_on_other_world_sizes(collective: str, world_size: int) -> None:
    X.check_collective(FUNCTIONS[collective], collective, world_size, _cases(world_size))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 13, 64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_chunk_sizes_match_tensor_split(n: int, world_size: int) -> None:
    want = [len(c) for c in torch.tensor_split(torch.arange(n), world_size)]
    assert C.chunk_sizes(n, world_size) == want


def test_chunk_sizes_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        C.chunk_sizes(-1, 2)
    with pytest.raises(ValueError):
        C.chunk_sizes(4, 0)


def _ring_in_place(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.full((length,), float(dist.get_rank() + 1))
    out = C.ring_all_reduce(t)
    return t, out


def test_ring_all_reduce_writes_in_place() -> None:
    for t, out in launch(_ring_in_place, 3, 5):
        assert torch.equal(t, torch.full((5,), 6.0))
        assert torch.equal(out, t)


def _ring_2d() -> torch.Tensor:
    t = C.rank_input(9, dist.get_rank(), 5, torch.float64, 3)
    C.ring_all_reduce(t)
    return t


def test_ring_all_reduce_any_shape() -> None:
    want = sum(C.rank_input(9, r, 5, torch.float64, 3) for r in range(4))
    for got in launch(_ring_2d, 4):
        torch.testing.assert_close(got, want)


def _ring_all_gather_bad_sizes() -> None:
    C.ring_all_gather(torch.zeros(2), [2])


def test_ring_all_gather_checks_sizes() -> None:
    with pytest.raises(RankError, match="one size per rank"):
        launch(_ring_all_gather_bad_sizes, 2)


# ---- Rabenseifner, all-to-all, two levels -------------------------------------------------------


def _rabenseifner(length: int, width: int) -> torch.Tensor:
    t = C.rank_input(11, dist.get_rank(), length, torch.float64, width)
    out = C.rabenseifner_all_reduce(t)
    assert out is t
    return t


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("length, width", [(0, 0), (1, 0), (3, 0), (13, 0), (5, 3)])
def test_rabenseifner_all_reduce(world_size: int, length: int, width: int) -> None:
    want = sum(C.rank_input(11, r, length, torch.float64, width) for r in range(world_size))
    for got in launch(_rabenseifner, world_size, length, width):
        torch.testing.assert_close(got, want)


def _rabenseifner_three() -> None:
    C.rabenseifner_all_reduce(torch.zeros(4))


def test_rabenseifner_needs_a_power_of_two() -> None:
    with pytest.raises(RankError, match="power-of-two"):
        launch(_rabenseifner_three, 3)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_to_all_reference(world_size: int) -> None:
    X.check_all_to_all(C.all_to_all_p2p, world_size, [
        (1, 3), (2, 0), (3, 4, torch.int64), (4, 2, torch.float64, 3), (5, 3, torch.float32, 0, True),
        (6, 2, torch.int64, 2, True),
    ])


def test_all_to_all_case_is_ragged_and_strided() -> None:
    rows, chunks = X.all_to_all_case(3, 4, 5, torch.float32, 2, strided=True)
    assert rows[0][1] == rows[1][0] == 0
    assert all(chunks[s][d].shape == (rows[s][d], 2) for s in range(4) for d in range(4))
    assert any(not c.is_contiguous() for row in chunks for c in row if c.numel() > 1)


@pytest.mark.parametrize("nodes, per_node", [(2, 2), (3, 2), (2, 3), (1, 2), (2, 1)])
def test_hierarchical_all_reduce_reference(nodes: int, per_node: int) -> None:
    X.check_hierarchical_all_reduce(C.hierarchical_all_reduce, nodes, per_node, [
        (1, 7), (2, 0), (3, 1, torch.float64), (4, 4 * per_node, torch.int64), (5, 5, torch.float32, 3),
    ])


def _flat_all_reduce(t: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    dist.all_reduce(t)
    return t


def _world_shard(t: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    return C.ring_all_reduce(t)


def test_hierarchical_harness_checks_the_phases() -> None:
    with pytest.raises(AssertionError, match="collectives ran as"):
        X.check_hierarchical_all_reduce(_flat_all_reduce, 2, 2, [(1, 8)])
    with pytest.raises(AssertionError, match="called"):
        X.check_hierarchical_all_reduce(_world_shard, 2, 2, [(1, 8)])


def _loose_all_to_all(chunks: list[torch.Tensor], recv_sizes: list[int]) -> list[torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = [chunks[rank].clone()] * world
    for k in range(1, world):
        to, frm = (rank + k) % world, (rank - k) % world
        out[frm] = chunks[rank].new_empty((recv_sizes[frm], *chunks[rank].shape[1:]))
        ops = [dist.P2POp(dist.irecv, out[frm], frm)] if out[frm].numel() else []
        ops += [dist.P2POp(dist.isend, chunks[to], to)] if chunks[to].numel() else []
        for req in dist.batch_isend_irecv(ops) if ops else []:
            req.wait()
    return out


def test_all_to_all_harness_refuses_non_contiguous_buffers() -> None:
    X.check_all_to_all(_loose_all_to_all, 3, [(1, 3)])  # contiguous chunks: right
    # gloo itself refuses some layouts (a RankError); the harness refuses the ones it lets through
    with pytest.raises((AssertionError, RankError), match="contiguous"):
        X.check_all_to_all(_loose_all_to_all, 3, [(1, 3, torch.float32, 2, True)])
    with pytest.raises((AssertionError, RankError), match="contiguous"):
        X.check_all_to_all(_loose_all_to_all, 3, [(1, 3, torch.float32, 0, True)])


# ---- the harness catches what it should -------------------------------------------------------


def _not_done(t: torch.Tensor, src: int) -> torch.Tensor:
    raise NotImplementedError()


def _does_nothing(t: torch.Tensor, src: int) -> torch.Tensor:
    return t


def _uses_collective(t: torch.Tensor, src: int) -> torch.Tensor:
    dist.broadcast(t, src)
    return t


def _deadlocks(t: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    dist.recv(buf, (rank - 1) % world)  # everyone waits for the left neighbour, nobody sends
    return buf


def test_harness_reports_not_done() -> None:
    with pytest.raises(NotDoneYet, match="_not_done is not implemented yet: .* [(]raised in rank 0[)]"):
        X.check_collective(_not_done, "broadcast", 2, [(0, 4)])


def test_harness_reports_wrong_values() -> None:
    with pytest.raises(AssertionError, match="rank 1's result"):
        X.check_collective(_does_nothing, "broadcast", 2, [(0, 4)])


def test_harness_forbids_collectives_in_p2p_exercises() -> None:
    with pytest.raises(AssertionError, match="rank 0 of 2: dist.broadcast is not allowed here: build this collective"):
        X.check_collective(_uses_collective, "broadcast", 2, [(0, 4)])
    X.check_collective(_uses_collective, "broadcast", 2, [(0, 4)], point_to_point_only=False)


def test_harness_reports_deadlock() -> None:
    with pytest.raises(AssertionError, match="deadlock"):
        X.check_collective(_deadlocks, "all_reduce", 2, [(0, 4)], timeout=3.0)


def test_expected_result_unknown_collective() -> None:
    with pytest.raises(ValueError):
        X.expected_result("all_to_all", [torch.zeros(2)])


# ---- the cost model ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "algorithm, world_size, steps",
    [
        ("naive", 8, 14), ("ring", 8, 14), ("tree", 8, 6), ("direct", 8, 7), ("rabenseifner", 8, 6),
        ("naive", 1, 0), ("ring", 1, 0), ("tree", 1, 0), ("direct", 1, 0), ("rabenseifner", 1, 0),
        ("ring", 2, 2), ("tree", 2, 2), ("tree", 5, 6), ("tree", 16, 8), ("naive", 3, 4),
        ("rabenseifner", 2, 2), ("rabenseifner", 6, 6), ("rabenseifner", 64, 12),
    ],
)
def test_allreduce_steps(algorithm: str, world_size: int, steps: int) -> None:
    assert C.allreduce_steps(algorithm, world_size) == steps


def test_allreduce_cost_by_hand() -> None:
    alpha, beta, N = 1e-5, 1e-9, 4e6
    assert math.isclose(C.allreduce_cost("ring", N, 4, alpha, beta), 6 * (1e-5 + 1e6 * 1e-9))
    assert math.isclose(C.allreduce_cost("naive", N, 4, alpha, beta), 6 * (1e-5 + 4e6 * 1e-9))
    assert math.isclose(C.allreduce_cost("tree", N, 4, alpha, beta), 4 * (1e-5 + 4e6 * 1e-9))
    assert math.isclose(C.allreduce_cost("direct", N, 4, alpha, beta), 3 * (1e-5 + 4e6 * 1e-9))
    assert C.allreduce_cost("ring", N, 1, alpha, beta) == 0.0
    # latency-bound: tiny messages favour the tree; bandwidth-bound: big ones favour the ring
    assert C.allreduce_cost("tree", 8, 64, alpha, beta) < C.allreduce_cost("ring", 8, 64, alpha, beta)
    assert C.allreduce_cost("ring", 1e9, 64, alpha, beta) < C.allreduce_cost("tree", 1e9, 64, alpha, beta)


def test_rabenseifner_cost_has_ring_bytes_and_log_rounds() -> None:
    alpha, beta, N = 1e-5, 1e-9, 8e6
    assert math.isclose(C.allreduce_cost("rabenseifner", N, 8, alpha, beta), 6 * alpha + 2 * 7 / 8 * N * beta)
    assert math.isclose(C.allreduce_cost("rabenseifner", N, 8, 0.0, beta), C.allreduce_cost("ring", N, 8, 0.0, beta))
    assert math.isclose(C.allreduce_cost("rabenseifner", N, 6, alpha, beta), 6 * alpha + (2 * 3 / 4 + 2) * N * beta)
    assert math.isclose(C.allreduce_bytes_per_rank("rabenseifner", 800, 8), 1400)
    assert C.allreduce_message_bytes("rabenseifner", 800, 8) == 400


def test_hierarchical_cost_by_hand() -> None:
    intra, inter, N = (1e-6, 1e-10), (1e-5, 1e-9), 8e6
    want = 2 * 3 * (1e-6 + 2e6 * 1e-10) + 2 * 1 * (1e-5 + 1e6 * 1e-9)  # 2 nodes x 4
    assert math.isclose(C.hierarchical_allreduce_cost(N, 2, 4, intra, inter), want)
    same = (0.0, 1e-9)  # equal links, no latency: the flat ring's bytes
    assert math.isclose(C.hierarchical_allreduce_cost(N, 4, 2, same, same), C.allreduce_cost("ring", N, 8, *same))
    assert math.isclose(C.hierarchical_allreduce_cost(N, 1, 8, intra, inter), C.allreduce_cost("ring", N, 8, *intra))
    assert math.isclose(C.hierarchical_allreduce_cost(N, 8, 1, intra, inter), C.allreduce_cost("ring", N, 8, *inter))
    with pytest.raises(ValueError):
        C.hierarchical_allreduce_cost(N, 0, 8, intra, inter)


def test_allreduce_bytes_per_rank() -> None:
    assert math.isclose(C.allreduce_bytes_per_rank("ring", 800, 8), 1400)
    assert C.allreduce_bytes_per_rank("naive", 800, 8) == 5600
    assert C.allreduce_bytes_per_rank("tree", 800, 8) == 2400
    assert C.allreduce_bytes_per_rank("ring", 800, 1) == 0
    assert C.allreduce_message_bytes("ring", 800, 8) == 100
    assert C.allreduce_message_bytes("tree", 800, 8) == 800


def test_cost_model_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        C.allreduce_steps("butterfly", 4)
    with pytest.raises(ValueError):
        C.allreduce_steps("ring", 0)
    with pytest.raises(ValueError):
        C.allreduce_cost("ring", -1, 4, 1e-5, 1e-9)


def test_fit_alpha_beta_recovers_exact_line() -> None:
    sizes = 2.0 ** np.arange(10, 25)
    alpha, beta = C.fit_alpha_beta(sizes, 2e-5 + sizes / 5e9)
    assert math.isclose(alpha, 2e-5, rel_tol=1e-9) and math.isclose(beta, 1 / 5e9, rel_tol=1e-9)


def test_fit_alpha_beta_with_noise() -> None:
    rng = np.random.default_rng(0)
    sizes = np.repeat(2.0 ** np.arange(10, 25, 2), 5)
    times = (3e-5 + sizes / 2e9) * rng.lognormal(0, 0.05, sizes.size)
    alpha, beta = C.fit_alpha_beta(sizes, times)
    assert abs(alpha / 3e-5 - 1) < 0.1 and abs(beta * 2e9 - 1) < 0.1


def test_fit_alpha_beta_rejects_bad_data() -> None:
    with pytest.raises(ValueError):
        C.fit_alpha_beta([1024, 1024], [1e-5, 2e-5])
    with pytest.raises(ValueError):
        C.fit_alpha_beta([1024, 2048], [1e-5, 0.0])
    with pytest.raises(ValueError):
        C.fit_alpha_beta([1024, 2048, 4096], [1e-5, 2e-5])


def test_bandwidths_follow_nccl_tests() -> None:
    assert C.algorithm_bandwidth(1e9, 0.01) == 1e11
    assert math.isclose(C.bus_bandwidth(1e9, 0.01, 8), 1e11 * 2 * 7 / 8)
    assert math.isclose(C.bus_bandwidth(1e9, 0.01, 8, "all_gather"), 1e11 * 7 / 8)
    assert C.bus_bandwidth(1e9, 0.01, 8, "broadcast") == 1e11
    assert C.bus_bandwidth(1e9, 0.01, 1) == 0.0
    with pytest.raises(ValueError):
        C.bus_bandwidth(1e9, 0.0, 8)
    with pytest.raises(ValueError):
        C.bus_bandwidth(1e9, 0.01, 8, "all_to_all")


# ---- the torchrun entry -------------------------------------------------------------------------


def _torchrun(module: str, *args: str) -> tuple[list[str], dict]:
    """The CHECK names and RESULT of ``torchrun --nproc_per_node 2 -m module --small`` (gloo, CPU)."""
    run = torchrun.run_entry(module, 2, "--small", *args)
    return run.checks, run.result


def test_torchrun_entry_checks_every_collective_and_times_them() -> None:
    checks, result = _torchrun("benchmarks.checks.collectives")
    assert sum("ring_all_reduce n=" in c for c in checks) == 6  # three lengths, two of them not divisible by 2
    for name in ("broadcast_p2p", "scatter_p2p", "gather_p2p", "reduce_p2p", "all_gather_p2p",
                 "reduce_scatter_p2p", "ring_reduce_scatter", "ring_all_gather", "rabenseifner_all_reduce",
                 "hierarchical_all_reduce", "all_to_all_p2p"):
        assert any(c.startswith(name + " ") for c in checks), (name, checks)
    assert result["world_size"] == 2 and result["backend"] == "gloo"
    n = len(result["sizes_bytes"])
    assert all(len(result[k]) == n and min(result[k]) > 0
               for k in ("ping_pong_s", "ring_all_reduce_s", "dist_all_reduce_s", "rabenseifner_all_reduce_s"))
