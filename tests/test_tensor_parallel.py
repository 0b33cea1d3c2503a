"""Tensor-parallel layers against single-device modules in gloo ranks (course_lib.tensor_parallel); the torchrun check."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel  # noqa: F401  (imported before forking, so ranks do not each import it)
import torch.nn.functional as F
from torch import nn

from course_lib import models
from course_lib import tensor_parallel as tp
from course_lib.exercises.checks import assert_close
from course_lib.exercises.ranks import warm_up_autograd
from course_lib.support import torchrun
from course_lib.support.comm import record_collectives
from course_lib.support.dist import launch


@pytest.fixture(autouse=True, scope="module")
def _warm_autograd() -> None:
    """The first backward with an explicit gradient imports a few hundred modules; do it once, before forking."""
    warm_up_autograd()


def _chunk(t: torch.Tensor, rank: int, world: int, dim: int) -> torch.Tensor:
    return t.chunk(world, dim=dim)[rank]


def _f_and_g(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    xs = [torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    gs = [torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(20 + r)) for r in range(world)]
    x = xs[rank].clone().requires_grad_(True)
    y = tp.copy_to_parallel_region(x)
    assert_close(y, xs[rank], name="f forward")
    y.backward(gs[rank])
    assert_close(x.grad, sum(gs), name="f backward")
    x = xs[rank].clone().requires_grad_(True)
    y = tp.reduce_from_parallel_region(x)
    assert_close(y, sum(xs), name="g forward")
    assert_close(x, xs[rank], name="g leaves its input alone")
    y.backward(gs[rank])
    assert_close(x.grad, gs[rank], name="g backward")
    # a non-contiguous input and gradient
    x = xs[rank].clone().requires_grad_(True)
    tp.reduce_from_parallel_region(x.transpose(0, -1)).transpose(0, -1).backward(gs[rank])
    assert_close(x.grad, gs[rank], name="g backward (transposed)")


@pytest.mark.parametrize("world", [2, 4])
def test_f_and_g(world: int) -> None:
    launch(_f_and_g, world, (3, 5), torch.float64)


def _linears(bias: bool, dtype: torch.dtype) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    lin = nn.Linear(6, 4 * world, bias=bias).to(dtype)
    x = torch.randn(3, 5, 6, dtype=dtype)
    gout = torch.randn(3, 5, 4 * world, dtype=dtype)
    xr = x.clone().requires_grad_(True)
    ref = lin(xr)
    ref.backward(gout)
    for gather in (False, True):
        col = tp.ColumnParallelLinear.from_linear(lin, rank, world, gather_output=gather)
        xc = x.clone().requires_grad_(True)
        y = col(xc)
        y.backward(gout if gather else _chunk(gout, rank, world, -1))
        assert_close(y, ref.detach() if gather else _chunk(ref.detach(), rank, world, -1), name="column output")
        assert_close(xc.grad, xr.grad, name="column input grad")
        assert_close(col.weight.grad, _chunk(lin.weight.grad, rank, world, 0), name="column weight grad")
        if bias:
            assert_close(col.bias.grad, _chunk(lin.bias.grad, rank, world, 0), name="column bias grad")

    lin2 = nn.Linear(4 * world, 6, bias=bias).to(dtype)
    x2 = torch.randn(3, 5, 4 * world, dtype=dtype)
    g2 = torch.randn(3, 5, 6, dtype=dtype)
    xr2 = x2.clone().requires_grad_(True)
    ref2 = lin2(xr2)
    ref2.backward(g2)
    for parallel_in in (True, False):
        row = tp.RowParallelLinear.from_linear(lin2, rank, world, input_is_parallel=parallel_in)
        xin = (_chunk(x2, rank, world, -1) if parallel_in else x2).clone().requires_grad_(True)
        y = row(xin)
        y.backward(g2)
        assert_close(y, ref2.detach(), name="row output")
        want = _chunk(xr2.grad, rank, world, -1) if parallel_in else xr2.grad
        assert_close(xin.grad, want, name="row input grad")
        assert_close(row.weight.grad, _chunk(lin2.weight.grad, rank, world, 1), name="row weight grad")
        if bias:
            assert_close(row.bias.grad, lin2.bias.grad, name="row bias grad")


@pytest.mark.parametrize("world,bias", [(2, True), (4, False)])
def test_column_and_row_parallel_linear(world: int, bias: bool) -> None:
    launch(_linears, world, bias, torch.float64)


def _block(block: models.Block, x: torch.Tensor) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    pb = tp.ParallelBlock.from_module(block, rank, world)
    xx = x.clone().requires_grad_(True)
    with record_collectives() as fwd:
        y = pb(xx)
    with record_collectives() as bwd:
        y.backward(torch.cos(y.detach()))
    grads = {n: p.grad for n, p in pb.named_parameters()}
    return y, xx.grad, grads, [(c.op, c.bytes) for c in fwd.calls], [(c.op, c.bytes) for c in bwd.calls]


@pytest.mark.parametrize("world,bias", [(2, True), (4, False)])
def test_parallel_block_matches_single_device(world: int, bias: bool) -> None:
    cfg = models.GPTConfig(d_model=16, n_head=4, bias=bias)
    block = models.GPT(cfg, seed=1).blocks[0].double()
    x = torch.randn(3, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xr = x.clone().requires_grad_(True)
    yr = block(xr)
    yr.backward(torch.cos(yr.detach()))
    results = launch(_block, world, block, x)
    d, ff = 16, cfg.d_ff
    expected_calls = [("all_reduce", 3 * 7 * 16 * 8)] * 2
    b = tp.tp_comm_bytes_per_layer(3, 7, 16, torch.float64)
    for rank, (y, gx, grads, fwd, bwd) in enumerate(results):
        assert_close(y, yr.detach(), name="block output")
        assert_close(gx, xr.grad, name="block input grad")
        assert_close(grads["mlp.fc.weight"], _chunk(block.mlp.fc.weight.grad, rank, world, 0))
        assert_close(grads["mlp.proj.weight"], _chunk(block.mlp.proj.weight.grad, rank, world, 1))
        qkv_rows = torch.cat([_chunk(w, rank, world, 0) for w in block.attn.qkv.weight.grad.split(d)])
        assert_close(grads["attn.qkv.weight"], qkv_rows)
        assert_close(grads["attn.proj.weight"], _chunk(block.attn.proj.weight.grad, rank, world, 1))
        assert_close(grads["ln_1.weight"], block.ln_1.weight.grad)
        if bias:
            assert_close(grads["mlp.proj.bias"], block.mlp.proj.bias.grad)
            qkv_bias = torch.cat([_chunk(w, rank, world, 0) for w in block.attn.qkv.bias.grad.split(d)])
            assert_close(grads["attn.qkv.bias"], qkv_bias)
        assert fwd == expected_calls and bwd == expected_calls, (fwd, bwd)
        assert sum(n for _, n in fwd) == b["forward"] and sum(n for _, n in bwd) == b["backward"]
    assert ff % world == 0


def _sequence_regions(x: torch.Tensor, g: torch.Tensor) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = _chunk(x, rank, world, 1).clone().requires_grad_(True)
    with record_collectives() as log:
        full = tp.gather_from_sequence_parallel_region(shard)
        full.backward(g[rank])
    assert_close(full, x, name="all-gather forward")
    assert_close(shard.grad, _chunk(sum(g), rank, world, 1), name="reduce-scatter backward")
    partial = (x * (rank + 1)).requires_grad_(True)
    with record_collectives() as log2:
        out = tp.reduce_scatter_to_sequence_parallel_region(partial)
        out.backward(_chunk(g[rank], rank, world, 1))
    assert_close(out, _chunk(x * sum(range(1, world + 1)), rank, world, 1), name="reduce-scatter forward")
    assert_close(partial.grad, torch.cat([_chunk(g[r], r, world, 1) for r in range(world)], dim=1), name="all-gather backward")
    calls = log.calls + log2.calls
    assert [c.op for c in calls] == ["all_gather", "reduce_scatter", "reduce_scatter", "all_gather"], calls
    assert all(c.contiguous for c in calls), "a non-contiguous buffer was handed to a collective"


@pytest.mark.parametrize("world", [2, 3])
def test_sequence_parallel_regions(world: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2 * world, 3, dtype=torch.float64, generator=gen)
    g = [torch.randn(2, 2 * world, 3, dtype=torch.float64, generator=gen) for _ in range(world)]
    launch(_sequence_regions, world, x, g)


def _sublayers(block: models.Block, x: torch.Tensor, p: float, sp: bool) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = tp.parallel_sublayer_block(block, rank, world, sequence_parallel=sp, p=p, seed=7)
    xin = (_chunk(x, rank, world, 1) if sp else x).clone().requires_grad_(True)
    with record_collectives() as log:
        y = layer(xin)
        y.backward(torch.ones_like(y))
    grads = {n: q.grad for n, q in layer.named_parameters()}
    assert all(c.contiguous for c in log.calls)
    return y, xin.grad, grads, [c.op for c in log.calls]


@pytest.mark.parametrize("world,sp", [(2, False), (2, True), (3, True)])
def test_parallel_sublayer_block_matches_single_device(world: int, sp: bool) -> None:
    cfg = models.GPTConfig(d_model=12, n_head=6, dropout=0.0)
    block = models.GPT(cfg, seed=3).blocks[0].double()
    x = torch.randn(2, 2 * world, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    p = 0.25
    xr = x.clone().requires_grad_(True)
    h = xr + tp.sequence_dropout(block.attn(block.ln_1(xr)), p, 7)
    y_ref = h + tp.sequence_dropout(block.mlp(block.ln_2(h)), p, 8)
    y_ref.backward(torch.ones_like(y_ref))
    for rank, (y, gx, grads, ops) in enumerate(launch(_sublayers, world, block, x, p, sp)):
        want_y, want_gx = y_ref.detach(), xr.grad
        if sp:
            want_y, want_gx = _chunk(want_y, rank, world, 1), _chunk(want_gx, rank, world, 1)
        assert_close(y, want_y, name="output")
        assert_close(gx, want_gx, name="input grad")
        for i, ln in enumerate((block.ln_1, block.ln_2)):
            assert_close(grads[f"{i}.ln.weight"], ln.weight.grad, name="LayerNorm weight grad")
            assert_close(grads[f"{i}.ln.bias"], ln.bias.grad, name="LayerNorm bias grad")
        assert_close(grads["1.inner.proj.bias"], block.mlp.proj.bias.grad, name="row-parallel bias grad")
        assert ("all_reduce" in ops[:4]) != sp and ("reduce_scatter" in ops) == sp, ops


def _vocab(emb: nn.Embedding, idx: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    e = tp.VocabParallelEmbedding.from_embedding(emb, rank, world)
    out = e(idx)
    out.backward(torch.ones_like(out))
    lg = _chunk(logits, rank, world, -1).clone().requires_grad_(True)
    losses = {}
    for red in ("mean", "sum", "none"):
        losses[red] = tp.vocab_parallel_cross_entropy(lg, targets, reduction=red)
    losses["mean"].backward()
    return out, e.weight.grad, losses, lg.grad


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_embedding_and_cross_entropy(world: int) -> None:
    torch.manual_seed(3)
    emb = nn.Embedding(12, 5).double()
    idx = torch.tensor([[0, 11, 5, 5, 6], [3, 2, 9, 11, 0]])
    logits = torch.randn(2, 5, 12, dtype=torch.float64) * 30  # large logits: the max shift matters
    targets = torch.tensor([[1, 11, 0, 6, 6], [5, 3, 9, 0, 2]])
    ref_out = emb(idx)
    ref_out.backward(torch.ones_like(ref_out))
    lg = logits.clone().requires_grad_(True)
    F.cross_entropy(lg.reshape(-1, 12), targets.reshape(-1)).backward()
    for rank, (out, gw, losses, glg) in enumerate(launch(_vocab, world, emb, idx, logits, targets)):
        assert_close(out, ref_out.detach(), name="embedding")
        assert_close(gw, _chunk(emb.weight.grad, rank, world, 0), name="embedding grad")
        for red in ("mean", "sum", "none"):
            want = F.cross_entropy(logits.reshape(-1, 12), targets.reshape(-1), reduction=red)
            assert_close(losses[red], want.reshape(targets.shape) if red == "none" else want, name=f"loss {red}")
        assert_close(glg, _chunk(lg.grad, rank, world, -1), name="logit grad")


def _uneven_vocab(logits: torch.Tensor, targets: torch.Tensor, bounds: list[int]) -> tuple:
    rank = dist.get_rank()
    lg = logits[:, bounds[rank]:bounds[rank + 1]].clone().requires_grad_(True)
    with record_collectives() as log:
        loss = tp.vocab_parallel_cross_entropy(lg, targets, bounds[rank])
    loss.backward()
    return loss, lg.grad, log.bytes(), log.count("all_gather")


def test_vocab_parallel_cross_entropy_uneven_split_and_large_logits() -> None:
    logits = torch.randn(6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 5 + 1e4
    targets = torch.tensor([0, 3, 4, 6, 7, 9])  # the first and last id of each shard
    bounds = [0, 4, 7, 10]
    lg = logits.clone().requires_grad_(True)
    want = F.cross_entropy(lg, targets)
    want.backward()
    for rank, (loss, grad, nbytes, gathers) in enumerate(launch(_uneven_vocab, 3, logits, targets, bounds)):
        assert_close(loss, want.detach(), name="loss")
        assert_close(grad, lg.grad[:, bounds[rank]:bounds[rank + 1]], name="logit grad")
        assert nbytes == 3 * 6 * 8 and gathers == 0


def _dtensor(ff: models.FeedForward, attn: models.CausalSelfAttention, x: torch.Tensor) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(ff, mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    tp.regroup_qkv_for_sharding(attn, dist.get_world_size())
    parallelize_module(attn, mesh, {"qkv": ColwiseParallel(), "proj": RowwiseParallel()})
    y = ff(x)
    y.sum().backward()
    # A DTensor layer's output may be an AsyncCollectiveTensor whose all-reduce has not finished:
    # any operation (clone) waits for it; pickling it as it is would send a partial sum.
    return y.clone(), ff.fc.weight.grad.full_tensor(), attn(x).clone()


def test_dtensor_matches_single_device() -> None:
    cfg = models.GPTConfig(d_model=16, n_head=4)
    block = models.GPT(cfg, seed=4).blocks[0]
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(5))
    y_ref = block.mlp(x)
    y_ref.sum().backward()
    for y, g, ya in launch(_dtensor, 2, block.mlp, block.attn, x):
        assert_close(y, y_ref.detach(), rtol=1e-5, atol=1e-6)
        assert_close(g, block.mlp.fc.weight.grad, rtol=1e-5, atol=1e-6)
        assert_close(ya, block.attn(x).detach(), rtol=1e-5, atol=1e-6)


def test_regroup_qkv_gives_each_rank_its_heads() -> None:
    cfg = models.GPTConfig(d_model=8, n_head=4)
    attn = models.CausalSelfAttention(cfg)
    w = attn.qkv.weight.detach().clone()
    tp.regroup_qkv_for_sharding(attn, 2)
    for rank in range(2):
        block = attn.qkv.weight.detach().chunk(2)[rank]
        q, k, v = w.split(8)
        want = torch.cat([q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank]])
        assert_close(block, want)


def test_shard_validation_and_comm_formula() -> None:
    with pytest.raises(ValueError, match="out_features"):
        tp.ColumnParallelLinear.from_linear(nn.Linear(4, 6), 0, 4)
    with pytest.raises(ValueError, match="in_features"):
        tp.RowParallelLinear.from_linear(nn.Linear(6, 4), 1, 4)
    with pytest.raises(ValueError, match="heads"):
        tp.ParallelAttention.from_module(models.CausalSelfAttention(models.GPTConfig(d_model=12, n_head=6)), 0, 4)
    with pytest.raises(ValueError, match="rank"):
        tp.shard_range(8, 2, 2)
    assert tp.tp_comm_bytes_per_layer(8, 1024, 768, torch.bfloat16) == {"forward": 2 * 8 * 1024 * 768 * 2,
                                                                         "backward": 2 * 8 * 1024 * 768 * 2}
    assert tp.tp_comm_bytes_per_layer(1, 1, 1, torch.float64)["forward"] == 16
    assert tp.all_reduce_wire_bytes(100, 4) == 150
    assert tp.tp_activation_bytes_per_layer(1, 1, 1, 1, 1) == 34 + 5
    assert tp.tp_activation_bytes_per_layer(2, 1, 4, 2, 4, sequence_parallel=True, attention_scores=False) == 8 * 34 / 4
    assert tp.tp_activation_bytes_per_layer(2, 1, 4, 2, 2, attention_scores=False) == 8 * (10 + 12)


# ---- the torchrun entry -------------------------------------------------------------------------


def _torchrun(module: str, *args: str) -> tuple[list[str], dict]:
    """The CHECK names and RESULT of ``torchrun --nproc_per_node 2 -m module --small`` (gloo, CPU)."""
    run = torchrun.run_entry(module, 2, "--small", *args)
    return run.checks, run.result


def test_torchrun_entry_checks_every_layer_forward_and_backward() -> None:
    checks, result = _torchrun("benchmarks.checks.tensor_parallel")
    for layer in ("ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelAttention", "ParallelBlock"):
        assert [c.split(": ")[1] for c in checks if c.startswith(layer)] == [
            "forward", "input gradient", "shard parameters and gradients"], (layer, checks)
    assert {c.split(": ")[0] for c in checks} >= {"SequenceParallelBlock", "VocabParallelCrossEntropy"}, checks
    assert (result["forward_all_reduces"], result["backward_all_reduces"]) == (2, 2)
    assert (result["forward_bytes"], result["backward_bytes"]) == tuple(result["formula_bytes"].values())
