"""Ring attention and its helpers against full attention, in gloo ranks (course_lib.context_parallel)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib import context_parallel as cp
from course_lib.attention import attention_lse, naive_attention
from course_lib.exercises.checks import assert_close
from course_lib.exercises.context_parallel import (
    all_to_all_backward_problem,
    all_to_all_problem,
    autograd_functions,
    borrowed_backward_problem,
    observe,
    random_qkv,
    ring_problem,
)
from course_lib.exercises.ranks import warm_up_autograd
from course_lib.support import torchrun
from course_lib.support.comm import record_collectives
from course_lib.support.dist import launch, rank_device


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


@pytest.mark.parametrize("causal", [False, True])
def test_block_attention_backward_equals_autograd(causal: bool) -> None:
    q, k, v, dout = random_qkv(2, 2, 6, 4, torch.float64, seed=3, count=4)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = naive_attention(*leaves, causal=causal, scale=0.4)
    out.backward(dout)
    lse = attention_lse(q, k, causal=causal, scale=0.4)
    grads = cp.block_attention_backward(q, k, v, out.detach(), lse, dout, causal=causal, scale=0.4)
    for got, leaf in zip(grads, leaves):
        assert_close(got, leaf.grad)


def test_bytes_formulas() -> None:
    assert cp.score_matrix_bytes(2, 3, 5, 7, torch.float16) == 2 * 3 * 5 * 7 * 2
    assert cp.kv_comm_bytes("ring", 64, 8, 4, 2, 4) == cp.kv_comm_bytes("allgather", 64, 8, 4, 2, 4) == 2 * 3 * 2 * 16 * 8 * 4
    assert cp.kv_buffer_bytes("allgather", 64, 8, 4) == 2 * 64 * 8 * 4
    assert cp.kv_buffer_bytes("ring", 64, 8, 4) == 4 * 16 * 8 * 4
    with pytest.raises(ValueError):
        cp.kv_comm_bytes("tree", 64, 8, 4)
    shard = 16 * 8 * 8 * 2  # N/P tokens of 8 heads of 8, bf16
    assert cp.layer_comm_bytes("ring", 64, 8, 8, 4) == cp.layer_comm_bytes("allgather", 64, 8, 8, 4) == 2 * 3 * shard
    assert cp.layer_comm_bytes("ulysses", 64, 8, 8, 4) == 4 * shard * 3 // 4
    assert cp.layer_comm_bytes("ulysses", 64, 8, 8, 4, kv_heads=2) == (2 * shard + 2 * shard // 4) * 3 // 4
    assert cp.layer_buffer_bytes("ring", 64, 8, 8, 4) == 6 * shard
    assert cp.layer_buffer_bytes("allgather", 64, 8, 8, 4) == 2 * shard + 8 * shard
    assert cp.layer_buffer_bytes("ulysses", 64, 8, 8, 4) == 4 * shard
    with pytest.raises(ValueError):
        cp.layer_buffer_bytes("tree", 64, 8, 8, 4)
    # Training: Ulysses' backward repeats its four all-to-alls; the ring sends K/V again and dK/dV P times.
    assert cp.layer_comm_bytes("ulysses", 64, 8, 8, 4, training=True) == 2 * cp.layer_comm_bytes("ulysses", 64, 8, 8, 4)
    assert cp.layer_comm_bytes("ring", 64, 8, 8, 4, training=True) == (2 * 3 + 2 * 3 + 2 * 4) * shard
    assert cp.layer_comm_bytes("allgather", 64, 8, 8, 4, training=True) == 2 * 2 * 3 * shard


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
        if world > 1:
            b, h, n, d = q.shape
            assert n_bytes == cp.layer_comm_bytes("ring", n, h, d, world, batch=b, itemsize=8, training=True)


def test_ring_attention_fp32_many_heads() -> None:
    q, k, v, _ = random_qkv(1, 4, 24, 16, seed=7, count=4)

    def fn(q, k, v):
        rank, world = dist.get_rank(), dist.get_world_size()
        out, _ = cp.ring_attention_forward(*(cp.zigzag_shard(t, rank, world) for t in (q, k, v)), causal=True, layout="zigzag")
        return out

    shards = launch(fn, 3, q, k, v)
    assert_close(cp.zigzag_unshard(shards), torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                 rtol=1e-5, atol=1e-5)


def _ulysses_case(q, k, v, causal):
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [t.tensor_split(world, dim=1)[rank] for t in (q, k, v)]
    back = cp.heads_to_sequence(cp.sequence_to_heads(shards[0]))
    out, traffic = observe(cp.ulysses_attention, *shards, causal=causal)
    return out, back, traffic


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_matches_full_attention(world: int, causal: bool) -> None:
    q, k, v = (t.transpose(1, 2).contiguous() for t in random_qkv(2, 6, 6 * world, 4, torch.float64, seed=world))
    full = naive_attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal).transpose(1, 2)
    shard = q.numel() // world * q.element_size()
    for rank, (out, back, traffic) in enumerate(launch(_ulysses_case, world, q, k, v, causal, backend="gloo")):
        assert_close(out, full.tensor_split(world, dim=1)[rank])
        assert_close(back, q.tensor_split(world, dim=1)[rank])  # the two all-to-alls are inverses
        assert all_to_all_problem(traffic, 4 * shard) is None
        assert len(traffic.calls) == 4


def _ulysses_backward_case(q, k, v, g_bhnd, causal, scale):
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [t.tensor_split(world, dim=1)[rank].clone().requires_grad_(True) for t in (q, k, v)]
    g = g_bhnd.transpose(1, 2).tensor_split(world, dim=1)[rank]  # a non-contiguous upstream gradient
    assert not g.is_contiguous()
    out, forward = observe(cp.ulysses_attention, *shards, causal=causal, scale=scale)
    functions = autograd_functions(out)
    with record_collectives() as log:
        _, backward = observe(out.backward, g)
    buffers_contiguous = all(c.contiguous for c in log.calls)
    return out.detach(), [s.grad for s in shards], functions, forward, backward, buffers_contiguous


@pytest.mark.parametrize(("world", "heads", "causal", "scale"), [(2, 4, False, None), (2, 2, True, 0.4), (3, 3, True, None),
                                                                  (3, 6, False, 0.7)])
def test_ulysses_backward_matches_full_attention(world: int, heads: int, causal: bool, scale: float | None) -> None:
    q, k, v, g = random_qkv(2, heads, 4 * world, 5, torch.float64, seed=10 + world, count=4)  # (b, H, N, d)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    full = naive_attention(*leaves, causal=causal, scale=scale)
    full.backward(g)
    seq = [t.transpose(1, 2).contiguous() for t in (q, k, v)]  # Ulysses takes (b, N, H, d)
    shard = seq[0].numel() // world * seq[0].element_size()
    results = launch(_ulysses_backward_case, world, *seq, g, causal, scale, backend="gloo")
    for rank, (out, grads, functions, forward, backward, contiguous) in enumerate(results):
        assert_close(out, full.detach().transpose(1, 2).tensor_split(world, dim=1)[rank], name=f"rank {rank} output")
        for name, got, leaf in zip("qkv", grads, leaves):
            assert_close(got, leaf.grad.transpose(1, 2).tensor_split(world, dim=1)[rank], name=f"rank {rank} d{name}")
        assert functions == ["course_lib.context_parallel.HeadsToSequence", "course_lib.context_parallel.SequenceToHeads"]
        assert all_to_all_problem(forward, 4 * shard) is None
        # backward: exactly the inverse all-to-alls, one for dO and three for dQ, dK, dV, contiguous
        assert all_to_all_backward_problem(backward, shard) is None
        assert [c[0] for c in backward.calls] == ["all_to_all_single"] * 4 and contiguous
        assert sum(c[1] for c in backward.calls) * (world - 1) // world == cp.layer_comm_bytes(
            "ulysses", 4 * world, heads, 5, world, batch=2, itemsize=8, training=True) // 2


def _ulysses_order_case(q):
    # The backward pass runs the output's all-to-all (sequence to heads) first, then the inputs' (heads to sequence).
    x = q.tensor_split(dist.get_world_size(), dim=1)[dist.get_rank()].clone().requires_grad_(True)
    calls: list[str] = []
    originals = cp.sequence_to_heads, cp.heads_to_sequence
    cp.sequence_to_heads = lambda t: calls.append("sequence_to_heads") or originals[0](t)
    cp.heads_to_sequence = lambda t: calls.append("heads_to_sequence") or originals[1](t)
    try:
        out = cp.ulysses_attention(x, x, x)
        calls.append("backward")
        out.backward(torch.ones_like(out))
    finally:
        cp.sequence_to_heads, cp.heads_to_sequence = originals
    return calls


def test_ulysses_backward_is_the_inverse_all_to_all() -> None:
    q = torch.randn(1, 4, 2, 3, dtype=torch.float64)
    calls = launch(_ulysses_order_case, 2, q, backend="gloo")[0]
    assert calls == ["sequence_to_heads"] * 3 + ["heads_to_sequence", "backward", "sequence_to_heads"] + \
        ["heads_to_sequence"] * 3


def test_borrowed_backward_problem() -> None:
    assert borrowed_backward_problem(["__main__.SequenceToHeads", "__main__.HeadsToSequence"]) is None
    assert "not yours" in (borrowed_backward_problem(["torch.distributed.nn.functional._AlltoAllSingle"]) or "")
    assert "not yours" in (borrowed_backward_problem(["__main__.A", "course_lib.context_parallel.HeadsToSequence"]) or "")
    assert "no torch.autograd.Function of yours" in (borrowed_backward_problem([]) or "")


def _ulysses_error(q):
    with pytest.raises(ValueError, match="divisible"):
        cp.ulysses_attention(q, q, q)
    return True


def test_ulysses_needs_heads_divisible_by_ranks() -> None:
    q = torch.randn(1, 4, 3, 4)
    assert launch(_ulysses_error, 2, q, backend="gloo") == [True, True]


def _ring_traffic(q, k, v, overlap):
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [t.tensor_split(world, dim=-2)[rank] for t in (q, k, v)]
    return observe(cp.ring_attention_forward, *shards, overlap=overlap)[1]


def test_ring_problem_tells_overlap_from_waiting_at_once() -> None:
    q, k, v = random_qkv(1, 2, 12, 4, seed=1)
    kv_bytes = 2 * q.numel() // 3 * q.element_size()
    for overlap in (True, False):
        for traffic in launch(_ring_traffic, 3, q, k, v, overlap, backend="gloo"):
            problem = ring_problem(traffic, 2 * kv_bytes, 2 * kv_bytes)
            assert (problem is None) == overlap, problem
            assert ring_problem(traffic, 3 * kv_bytes, 0) is not None  # the bytes are checked too


def _ring_backward_traffic(q, k, v, dout, causal):
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = "zigzag" if causal else "contiguous"
    shards = [cp.shard_sequence(t, rank, world, layout) for t in (q, k, v, dout)]
    out, lse = cp.ring_attention_forward(*shards[:3], causal=causal, layout=layout)
    return observe(cp.ring_attention_backward, *shards[:3], out, lse, shards[3], causal=causal)[1]


@pytest.mark.parametrize("causal", [False, True])
def test_ring_backward_hides_every_transfer_but_the_homecoming(causal: bool) -> None:
    q, k, v, dout = random_qkv(1, 2, 12, 4, seed=3, count=4)
    shard = q.numel() // 3 * q.element_size()
    for traffic in launch(_ring_backward_traffic, 3, q, k, v, dout, causal, backend="gloo"):
        # K/V: 2 shifts of 2 shards; dK/dV: 3 shifts of 2 shards, of which only the last (home) is not hidden
        assert ring_problem(traffic, 2 * 2 * shard + 3 * 2 * shard, 2 * 2 * shard + 2 * 2 * shard) is None
        assert ring_problem(traffic, 2 * 2 * shard + 3 * 2 * shard, 2 * 2 * shard + 3 * 2 * shard) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_on_gpu_use_the_triton_kernels(causal: bool) -> None:
    q, k, v, dout = (t.cuda().to(torch.bfloat16) for t in random_qkv(1, 2, 128, 64, seed=2, count=4))
    assert cp._triton_ok(q, k) and not cp._triton_ok(q.float(), k.float())
    out, lse = cp.block_attention(q, k, v, causal=causal)
    cpu = [t.cpu().double() for t in (q, k, v, dout)]
    want_out, want_lse = cp.block_attention(*cpu[:3], causal=causal)
    assert_close(out.cpu(), want_out.float(), rtol=2e-2, atol=2e-2)
    assert_close(lse.cpu(), want_lse.float(), rtol=1e-2, atol=1e-2)
    grads = cp.block_attention_backward(q, k, v, out, lse, dout, causal=causal)
    want = cp.block_attention_backward(*cpu[:3], want_out, want_lse, cpu[3], causal=causal)
    for got, expected in zip(grads, want):
        assert_close(got.cpu(), expected.float(), rtol=5e-2, atol=5e-2)


def _ring_bf16(q, k, v):
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    shards = [cp.zigzag_shard(t, rank, world).to(dev, torch.bfloat16) for t in (q, k, v)]
    return cp.ring_attention_forward(*shards, causal=True, layout="zigzag")[0].float()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ring_of_triton_blocks_on_two_gpus() -> None:
    q, k, v = random_qkv(1, 4, 512, 64, seed=4)
    out = cp.zigzag_unshard([o.cpu() for o in launch(_ring_bf16, 2, q, k, v)])
    assert_close(out, naive_attention(q, k, v, causal=True), rtol=3e-2, atol=3e-2)


def _ulysses_bf16_backward(q, k, v, g):
    rank, world, dev = dist.get_rank(), dist.get_world_size(), rank_device()
    shards = [t.tensor_split(world, dim=1)[rank].to(dev, torch.bfloat16).requires_grad_(True) for t in (q, k, v)]
    out = cp.ulysses_attention(*shards, causal=True)
    out.backward(g.tensor_split(world, dim=1)[rank].to(dev, torch.bfloat16))
    return [t.grad.float().cpu() for t in shards]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ulysses_backward_on_two_gpus() -> None:
    q, k, v, g = (t.transpose(1, 2).contiguous() for t in random_qkv(1, 4, 512, 64, seed=5, count=4))  # (b, N, H, d)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    naive_attention(*(t.transpose(1, 2) for t in leaves), causal=True).transpose(1, 2).backward(g)
    for rank, grads in enumerate(launch(_ulysses_bf16_backward, 2, q, k, v, g)):
        for got, leaf in zip(grads, leaves):
            assert_close(got, leaf.grad.tensor_split(2, dim=1)[rank], rtol=5e-2, atol=5e-2)


def test_torchrun_entry() -> None:
    run = torchrun.run_entry("benchmarks.checks.context_parallel", 2, "--small")
    assert len(run.checks) == 11, run.stdout
    result = run.result
    assert result["world_size"] == 2
    assert result["ring_forward_bytes_received_per_rank"] == result["ring_forward_bytes_formula"]
    assert result["ulysses_bytes_received_per_rank"] == result["ulysses_bytes_formula"]
    assert result["ulysses_training_bytes_received_per_rank"] == result["ulysses_training_bytes_formula"]
    assert len(set(result["causal_zigzag_work_per_rank"])) == 1
    assert result["time_with_overlap_s"] > 0 and result["time_without_overlap_s"] > 0
