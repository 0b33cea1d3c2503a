"""Ring attention and its helpers against full attention, in gloo ranks (course_lib.context_parallel)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib import context_parallel as cp
from course_lib.attention import attention_lse, naive_attention
from course_lib.exercises.checks import assert_close
from course_lib.exercises.context_parallel import random_qkv
from course_lib.exercises.ranks import warm_up_autograd
from course_lib.support import torchrun
from course_lib.support.comm import record_collectives
from course_lib.support.dist import launch


@pytest.fixture(autouse=True, scope="module")
def _warm_autograd() -> None:
    warm_up_autograd()


@pytest.mark.parametrize("parts", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_partials_equals_full_attention(parts: int, dtype: torch.dtype) -> None:
    q, k, v, _ = random_qkv(2, 3, 7, 4, dtype, seed=parts, count=4)
    k, v = torch.cat([k, k[..., :3, :]], dim=-2), torch.cat([v, v[..., :3, :]], dim=-2)  # 10 keys
    outs, lses = zip(*(cp.block_attention(q, kb, vb) for kb, vb in zip(k.tensor_split(parts, -2), v.tensor_split(parts, -2))))
    out, lse = cp.merge_partials([o.to(dtype) for o in outs], lses)
    assert_close(out, naive_attention(q, k, v))
    assert_close(lse, attention_lse(q, k).to(lse.dtype), rtol=1e-5 if dtype == torch.float32 else 1e-10)


def test_merge_partials_fully_masked_rows() -> None:
    o1, o2 = torch.randn(3, 4), torch.randn(3, 4)
    l1 = torch.tensor([0.5, float("-inf"), float("-inf")])
    l2 = torch.tensor([float("-inf"), 1.0, float("-inf")])
    out, lse = cp.merge_partials([o1, o2], [l1, l2])
    assert not torch.isnan(out).any()
    assert_close(out[0], o1[0])
    assert_close(out[1], o2[1])
    assert_close(out[2], torch.zeros(4))
    assert torch.isneginf(lse[2])
    with pytest.raises(ValueError):
        cp.merge_partials([], [])


def test_zigzag_layout() -> None:
    assert cp.zigzag_indices(8, 0, 1).tolist() == list(range(8))
    assert cp.zigzag_indices(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert cp.zigzag_indices(12, 0, 3).tolist() == [0, 1, 10, 11]
    for p in (1, 2, 3, 4):
        n = 4 * p
        allpos = torch.cat([cp.zigzag_indices(n, r, p) for r in range(p)])
        assert sorted(allpos.tolist()) == list(range(n))
        x = torch.randn(2, n, 3)
        assert_close(cp.zigzag_unshard([cp.zigzag_shard(x, r, p) for r in range(p)]), x)
    for bad in ((6, 0, 2), (8, 2, 2), (8, 0, 0)):
        with pytest.raises(ValueError):
            cp.zigzag_indices(*bad)
    with pytest.raises(ValueError):
        cp.contiguous_indices(7, 0, 2)
    with pytest.raises(ValueError):
        cp.layout_indices("striped", 8, 0, 2)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_causal_work(p: int) -> None:
    n = 8 * p
    total = n * (n + 1) // 2
    for layout in cp.LAYOUTS:
        work = cp.causal_work_per_rank(n, p, layout)
        assert sum(work) == total
        assert cp.ring_step_work(n, p, layout).sum(axis=0).tolist() == work
    assert len(set(cp.causal_work_per_rank(n, p, "zigzag"))) == 1
    if p > 1:
        contiguous = cp.causal_work_per_rank(n, p, "contiguous")
        assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]
    assert [cp.chunk_pair_kind(2, b) for b in (1, 2, 3)] == ["full", "diagonal", "skip"]


def test_bytes_formulas() -> None:
    assert cp.score_matrix_bytes(2, 3, 5, 7, torch.float16) == 2 * 3 * 5 * 7 * 2
    assert cp.kv_comm_bytes("ring", 64, 8, 4, 2, 4) == cp.kv_comm_bytes("allgather", 64, 8, 4, 2, 4) == 2 * 3 * 2 * 16 * 8 * 4
    assert cp.kv_buffer_bytes("allgather", 64, 8, 4) == 2 * 64 * 8 * 4
    assert cp.kv_buffer_bytes("ring", 64, 8, 4) == 4 * 16 * 8 * 4
    with pytest.raises(ValueError):
        cp.kv_comm_bytes("tree", 64, 8, 4)


def _ring_case(q, k, v, dout, causal, layout):
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [cp.shard_sequence(t, rank, world, layout).requires_grad_(True) for t in (q, k, v)]
    out_fwd, lse = cp.ring_attention_forward(*(s.detach() for s in shards), causal=causal, layout=layout, overlap=rank % 2 == 0)
    with record_collectives() as log:
        out = cp.ring_attention(*shards, causal=causal, layout=layout)
        out.backward(cp.shard_sequence(dout, rank, world, layout))
    ag, ag_lse = cp.allgather_attention_forward(*(s.detach() for s in shards), causal=causal, layout=layout)
    return out_fwd, lse, out.detach(), [s.grad for s in shards], ag, ag_lse, log.bytes("irecv")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize(("causal", "layout"), [(False, "contiguous"), (True, "zigzag"), (True, "contiguous")])
def test_ring_attention_matches_full_attention(world: int, causal: bool, layout: str) -> None:
    dtype = torch.float64
    q, k, v, dout = random_qkv(2, 2, 4 * world, 5, dtype, seed=world, count=4)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = naive_attention(*leaves, causal=causal)
    ref.backward(dout)
    ref_lse = attention_lse(q, k, causal=causal)
    # CPU tensors, so gloo on every machine (on a GPU host a single rank would otherwise get NCCL).
    results = launch(_ring_case, world, q, k, v, dout, causal, layout, backend="gloo")
    for rank, (out_fwd, lse, out, grads, ag, ag_lse, n_bytes) in enumerate(results):
        sel = lambda t, rank=rank: cp.shard_sequence(t, rank, world, layout)  # noqa: E731
        assert_close(out_fwd, sel(ref.detach()), name=f"rank {rank} forward")
        assert_close(lse, sel(ref_lse[..., None])[..., 0], name=f"rank {rank} lse")
        assert_close(out, sel(ref.detach()), name=f"rank {rank} autograd forward")
        for name, g, leaf in zip("qkv", grads, leaves):
            assert_close(g, sel(leaf.grad), name=f"rank {rank} d{name}")
        assert_close(ag, sel(ref.detach()), name=f"rank {rank} all-gather forward")
        assert_close(ag_lse, lse, name=f"rank {rank} all-gather lse")
        # forward: P-1 K/V shifts; backward: P-1 K/V shifts and P dK/dV shifts
        shard = q.numel() // world * q.element_size()
        assert n_bytes == (world - 1) * 2 * shard * 2 + (world * 2 * shard if world > 1 else 0), n_bytes


def test_ring_attention_fp32_many_heads() -> None:
    q, k, v, _ = random_qkv(1, 4, 24, 16, seed=7, count=4)

    def fn(q, k, v):
        rank, world = dist.get_rank(), dist.get_world_size()
        out, _ = cp.ring_attention_forward(*(cp.zigzag_shard(t, rank, world) for t in (q, k, v)), causal=True, layout="zigzag")
        return out

    shards = launch(fn, 3, q, k, v)
    assert_close(cp.zigzag_unshard(shards), torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                 rtol=1e-5, atol=1e-5)


def test_torchrun_entry() -> None:
    run = torchrun.run_entry("benchmarks.checks.context_parallel", 2, "--small")
    assert len(run.checks) == 9, run.stdout
    result = run.result
    assert result["world_size"] == 2
    assert result["ring_forward_bytes_received_per_rank"] == result["ring_forward_bytes_formula"]
    assert len(set(result["causal_zigzag_work_per_rank"])) == 1
    assert result["time_with_overlap_s"] > 0 and result["time_without_overlap_s"] > 0
