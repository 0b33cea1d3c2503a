"""Check the chapter-13 tensor-parallel layers on N ranks (N must divide the head count).

Column- and row-parallel linear, MLP, attention and a whole block against the single-device
modules, forward and backward (output, input gradient, the shard's parameters and gradients);
the sequence-parallel block (dropout on) and the vocabulary-parallel cross-entropy; then one
block's all-reduce calls and bytes against the formula, and its fwd+bwd time:

    torchrun --standalone --nproc_per_node N -m benchmarks.checks.tensor_parallel [--small]
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from course_lib import models
from course_lib import tensor_parallel as tp
from course_lib.support.comm import record_collectives
from course_lib.support.dist import rank_device
from course_lib.support.timing import time_in_ranks
from course_lib.support.torchrun import entry_main, report_check

__all__ = ["check"]

M = TypeVar("M", bound=nn.Module)


def _grads_as_module(module: M) -> M:
    """A copy of ``module`` whose parameters hold ``module``'s gradients (shard it to get the expected shard gradients)."""
    grads = copy.deepcopy(module)
    with torch.no_grad():
        for g, p in zip(grads.parameters(), module.parameters()):
            assert p.grad is not None, "every parameter has a gradient after the backward pass"
            g.copy_(p.grad)
    return grads


def _check_sharded(name: str, module: M, shard_fn: Callable[[M], nn.Module], x: torch.Tensor) -> None:
    """In every rank: ``shard_fn(module)`` against ``module``: output, input gradient, the shard's parameters and gradients.

    Both run forward and backward with the same random upstream gradient. The expected shard
    gradients are ``shard_fn`` applied to a copy of ``module`` that holds its gradients.
    """
    reference = copy.deepcopy(module)
    shard = shard_fn(reference)
    x_ref, x_par = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ref = reference(x_ref)
    dy = torch.randn(y_ref.shape, dtype=y_ref.dtype, generator=torch.Generator().manual_seed(1)).to(y_ref.device)
    y_ref.backward(dy)
    y = shard(x_par)
    y.backward(dy)
    expected = shard_fn(reference)
    for p, g in zip(expected.parameters(), shard_fn(_grads_as_module(reference)).parameters()):
        p.grad = g.detach()
    tol = {"rtol": 1e-9, "atol": 1e-11}  # float64: only the order of the additions differs
    report_check(f"{name}: forward", y, y_ref, **tol)
    report_check(f"{name}: input gradient", x_par.grad, x_ref.grad, **tol)
    report_check(f"{name}: shard parameters and gradients", shard, expected, **tol)


def check(small: bool) -> dict[str, Any]:
    """In every rank: column/row-parallel linear, MLP, attention and block against the single-device modules; bytes, times."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    cfg = models.GPTConfig(d_model=32, n_head=8, seq_len=8) if small else models.GPTConfig(d_model=1024, n_head=16, seq_len=256)
    b, s, h = (2 if small else 4), cfg.seq_len, cfg.d_model
    block = cast(models.Block, models.GPT(cfg, seed=0).blocks[0]).to(device, torch.float64)  # ModuleList: untyped items
    x = torch.randn(b, s, h, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(device)
    x_wide = torch.randn(b, s, cfg.d_ff, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(device)
    _check_sharded("ColumnParallelLinear (gather_output)", block.mlp.fc,
                   lambda m: tp.ColumnParallelLinear.from_linear(m, rank, world, gather_output=True), x)
    _check_sharded("RowParallelLinear (full input)", block.mlp.proj,
                   lambda m: tp.RowParallelLinear.from_linear(m, rank, world, input_is_parallel=False), x_wide)
    _check_sharded("ParallelMLP", block.mlp, lambda m: tp.ParallelMLP.from_module(m, rank, world), x)
    _check_sharded("ParallelAttention", block.attn, lambda m: tp.ParallelAttention.from_module(m, rank, world), x)
    _check_sharded("ParallelBlock", block, lambda m: tp.ParallelBlock.from_module(m, rank, world), x)
    _check_sequence_parallel(block, x)
    _check_vocab_cross_entropy(50 if small else cfg.vocab_size, b * s)
    return {"world_size": world, "backend": dist.get_backend(), **_block_measurements(block.float(), x.float())}


def _check_sequence_parallel(block: models.Block, x: torch.Tensor, p: float = 0.1, seed: int = 3) -> None:
    """In every rank: the sequence-parallel block (two ParallelSublayers, dropout ``p``) against one device."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = copy.deepcopy(block)
    layer = tp.parallel_sublayer_block(reference, rank, world, sequence_parallel=True, p=p, seed=seed)
    x_ref = x.clone().requires_grad_(True)
    mid = x_ref + tp.sequence_dropout(reference.attn(reference.ln_1(x_ref)), p, seed)
    y_ref = mid + tp.sequence_dropout(reference.mlp(reference.ln_2(mid)), p, seed + 1)
    dy = torch.randn(y_ref.shape, dtype=y_ref.dtype, generator=torch.Generator().manual_seed(1)).to(y_ref.device)
    y_ref.backward(dy)
    mine = slice(rank * x.shape[1] // world, (rank + 1) * x.shape[1] // world)
    x_par = x[:, mine].clone().requires_grad_(True)
    layer(x_par).backward(dy[:, mine])
    tol = {"rtol": 1e-9, "atol": 1e-11}
    report_check("SequenceParallelBlock: forward", layer(x_par), y_ref[:, mine], **tol)
    assert x_ref.grad is not None and x_par.grad is not None, "the input gradients exist after backward"
    report_check("SequenceParallelBlock: input gradient", x_par.grad, x_ref.grad[:, mine], **tol)
    for i, ln in enumerate((reference.ln_1, reference.ln_2)):
        for name in ("weight", "bias"):
            report_check(f"SequenceParallelBlock: LayerNorm {i + 1} {name} gradient",
                         getattr(layer[i].ln, name).grad, getattr(ln, name).grad, **tol)


def _check_vocab_cross_entropy(vocab: int, tokens: int) -> None:
    """In every rank: the vocabulary-parallel loss on uneven slices against ``F.cross_entropy``, loss and gradient."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(tokens, vocab, dtype=torch.float64, generator=gen) * 10 + 1e4).to(device)
    targets = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    bounds = [vocab * r // world for r in range(world + 1)]  # slices differ by at most one id
    ref = logits.clone().requires_grad_(True)
    want = torch.nn.functional.cross_entropy(ref, targets)
    want.backward()
    local = logits[:, bounds[rank]:bounds[rank + 1]].clone().requires_grad_(True)
    loss = tp.vocab_parallel_cross_entropy(local, targets, bounds[rank])
    loss.backward()
    report_check("VocabParallelCrossEntropy: loss", loss, want, rtol=1e-9, atol=1e-11)
    assert ref.grad is not None, "the reference logits have a gradient after backward"
    report_check("VocabParallelCrossEntropy: logit gradient", local.grad, ref.grad[:, bounds[rank]:bounds[rank + 1]],
                 rtol=1e-9, atol=1e-11)


def _block_measurements(block: models.Block, x: torch.Tensor) -> dict[str, Any]:
    """In every rank: all-reduce calls and bytes of one block's forward and backward (against the formula), fp32 times."""
    b, s, h = x.shape
    shard = tp.ParallelBlock.from_module(block)
    x_par = x.clone().requires_grad_(True)
    with record_collectives() as fwd:
        y = shard(x_par)
    with record_collectives() as bwd:
        y.sum().backward()

    def fwd_bwd(module: nn.Module) -> Callable[[torch.Tensor], None]:
        return lambda t: module(t.requires_grad_(True)).sum().backward()

    times = {name: statistics.median(time_in_ranks(fwd_bwd(m), x.clone(), repeat=5, warmup=2)) * 1e3
             for name, m in (("single_device", block), ("tensor_parallel", shard))}
    return {
        "block": {"b": b, "s": s, "h": h, "dtype": "float32"},
        "forward_all_reduces": fwd.count("all_reduce"),
        "forward_bytes": fwd.bytes(),
        "backward_all_reduces": bwd.count("all_reduce"),
        "backward_bytes": bwd.bytes(),
        "formula_bytes": tp.tp_comm_bytes_per_layer(b, s, h, x.dtype),
        "fwd_bwd_ms": times,
    }


if __name__ == "__main__":
    entry_main(check, __doc__)
