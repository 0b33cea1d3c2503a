"""Chapter 16's harness: what a DP x TP run of a ``hybrid.HybridCase`` must equal, shard by shard.

- ``train_single_block``: the case's block trained in one process on the whole batch;
- ``reference_shard``: tensor-parallel shard t of that block, with the matching slices of its
  gradients, to compare rank (d, t)'s result with;
- ``train_single_stack``: a ``hybrid.PipelineCase``'s stack of blocks trained in one process, to
  compare each pipeline stage's shards with (a PP x DP x TP run).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from course_lib import models
from course_lib.hybrid import HybridCase, PipelineCase
from course_lib.tensor_parallel import ParallelBlock

__all__ = ["reference_shard", "train_single_block", "train_single_stack"]


def train_single_block(case: HybridCase, device: torch.device | str = "cpu") -> models.Block:
    """Train ``case``'s block in one process on the whole batch; the gradients of the last step stay in ``.grad``.

    Returns the block on the CPU (``device`` is where it trains).
    """
    model = case.model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=case.lr)
    xs, ys = case.data()
    for x, y in zip(xs, ys):
        opt.zero_grad()
        F.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return model.cpu()


def reference_shard(reference: models.Block, tp_rank: int, tp: int) -> ParallelBlock:
    """The tensor-parallel shard of a trained single-process block, with the matching slices of its gradients."""
    shard = ParallelBlock.from_module(reference, tp_rank, tp)
    grads = copy.deepcopy(reference)
    with torch.no_grad():
        for p, original in zip(grads.parameters(), reference.parameters()):
            assert original.grad is not None, "the reference block has been trained: every parameter has a gradient"
            p.copy_(original.grad)
    for p, g in zip(shard.parameters(), ParallelBlock.from_module(grads, tp_rank, tp).parameters()):
        p.grad = g.detach().clone()
    return shard


def train_single_stack(case: PipelineCase, device: torch.device | str = "cpu") -> list[models.Block]:
    """Train ``case``'s stack of blocks in one process on the whole batch; the last step's gradients stay in ``.grad``."""
    blocks = case.blocks()
    stack = torch.nn.ModuleList(blocks).to(device)  # moves the blocks themselves
    opt = torch.optim.SGD(stack.parameters(), lr=case.lr)
    xs, ys = case.data()
    for x, y in zip(xs, ys):
        opt.zero_grad()
        h = x.to(device)
        for block in blocks:
            h = block(h)
        F.mse_loss(h, y.to(device)).backward()
        opt.step()
    stack.cpu()
    return blocks
