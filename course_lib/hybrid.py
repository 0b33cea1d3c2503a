"""Chapter 16 (hybrid parallelism): device meshes, process groups by hand, and a DP x TP training run.

A cluster of ``world`` ranks is arranged as an n-dimensional *mesh*, for example
(dp, tp) = (2, 2). The convention here is PyTorch's ``init_device_mesh``: the mesh is
``torch.arange(world).reshape(shape)`` (row-major, the **last** dimension varies fastest), so
rank r sits at ``np.unravel_index(r, shape)`` and the ranks that share every coordinate except
one dimension form a process group along that dimension. Tensor parallelism goes on the last,
fastest dimension: its ranks are neighbours, so they share a node (NVLink).

    from course_lib import hybrid
    hybrid.mesh_coords(5, (2, 2, 2))           # (1, 0, 1)
    hybrid.mesh_groups((2, 2), 0)              # [[0, 2], [1, 3]]: the data-parallel groups
    # inside ranks (course_lib.support.dist.launch):
    groups = hybrid.new_mesh_groups((2, 2), ("dp", "tp"))   # every rank builds every group
    hybrid.train_dp_tp(case, dp=2, tp=2)                     # one replica per dp rank, split over tp
    hybrid.train_pp_dp_tp(hybrid.PipelineCase(), 2, 2, 2)    # 8 ranks: a pipeline of tp-split stages, dp copies

What a run must equal (the block trained in one process, and its shards) is in
``course_lib.exercises.hybrid``; the torchrun self-check is ``benchmarks.checks.hybrid``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch._dynamo  # noqa: F401  an optimizer's constructor imports it; once here, not in every forked rank
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import models
from course_lib.support.dist import rank_device
from course_lib.tensor_parallel import ParallelBlock

__all__ = [
    "HybridCase",
    "MeshGroups",
    "device_mesh_groups",
    "mesh_coords",
    "mesh_groups",
    "mesh_rank",
    "new_mesh_groups",
    "PipelineCase",
    "train_dp_tp",
    "train_pp_dp_tp",
]


# ---- mesh arithmetic (no process group needed) -------------------------------------------------


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"a mesh shape needs at least one dimension, all >= 1; got {shape}")
    return shape


def mesh_coords(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Coordinates of ``rank`` in a mesh of ``shape`` laid out row-major (last dimension fastest)."""
    shape = _check_shape(shape)
    if not 0 <= rank < math.prod(shape):
        raise ValueError(f"rank must be in [0, {math.prod(shape)}) for a mesh of shape {shape}, got {rank}")
    return tuple(int(c) for c in np.unravel_index(rank, shape))


def mesh_rank(coords: Sequence[int], shape: Sequence[int]) -> int:
    """The rank at ``coords`` of a row-major mesh of ``shape`` (the inverse of ``mesh_coords``)."""
    shape = _check_shape(shape)
    if len(coords) != len(shape) or any(not 0 <= c < s for c, s in zip(coords, shape)):
        raise ValueError(f"coordinates {tuple(coords)} are outside a mesh of shape {shape}")
    return int(np.ravel_multi_index(tuple(coords), shape))


def mesh_groups(shape: Sequence[int], dim: int) -> list[list[int]]:
    """The process groups along mesh dimension ``dim``: lists of ranks that differ only in that coordinate.

    Groups are ordered by the rank of their first member, ranks inside a group by their
    coordinate along ``dim``, which is the order ``init_device_mesh`` uses.
    """
    shape = _check_shape(shape)
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"dim must be in [{-len(shape)}, {len(shape)}) for a mesh of shape {shape}, got {dim}")
    grid = torch.arange(math.prod(shape)).reshape(shape)
    return grid.movedim(dim, -1).reshape(-1, shape[dim]).tolist()


# ---- process groups inside ranks ---------------------------------------------------------------


@dataclass
class MeshGroups:
    """This rank's place in a mesh: its coordinates and, per dimension name, its group and that group's ranks."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    coords: dict[str, int]
    groups: dict[str, Any]
    ranks: dict[str, list[int]]


def new_mesh_groups(shape: Sequence[int], names: Sequence[str]) -> MeshGroups:
    """Build every process group of a mesh with ``dist.new_group``; return this rank's view of them.

    ``new_group`` is collective: every rank must call it for every group, in the same order,
    even for groups it is not a member of. So each rank walks all dimensions and all groups.
    """
    shape = _check_shape(shape)
    names = tuple(names)
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise ValueError(f"need one distinct name per mesh dimension, got names={names} for shape {shape}")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != math.prod(shape):
        raise ValueError(f"a mesh of shape {shape} needs {math.prod(shape)} ranks, the world has {world}")
    coords = mesh_coords(rank, shape)
    groups: dict[str, Any] = {}
    ranks: dict[str, list[int]] = {}
    for dim, name in enumerate(names):
        for members in mesh_groups(shape, dim):
            handle = dist.new_group(members)
            if rank in members:
                groups[name], ranks[name] = handle, members
    return MeshGroups(shape, names, dict(zip(names, coords)), groups, ranks)


def device_mesh_groups(shape: Sequence[int], names: Sequence[str]) -> dict[str, list[int]]:
    """PyTorch's answer: ``init_device_mesh``'s group of this rank along each named dimension, as lists of ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    return {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in names}


# ---- a DP x TP training run --------------------------------------------------------------------


@dataclass(frozen=True)
class HybridCase:
    """A small regression task on one transformer block: the same data and steps for every layout."""

    d_model: int = 32
    n_head: int = 4
    seq_len: int = 8
    global_batch: int = 8
    steps: int = 3
    lr: float = 0.05
    seed: int = 0

    def config(self) -> models.GPTConfig:
        """The block's configuration."""
        return models.GPTConfig(d_model=self.d_model, n_head=self.n_head, seq_len=self.seq_len)

    def model(self) -> models.Block:
        """The single-device block every run starts from."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return models.Block(self.config())

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (steps, global_batch, seq_len, d_model)."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        shape = (self.steps, self.global_batch, self.seq_len, self.d_model)
        return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def train_dp_tp(case: HybridCase, dp: int, tp: int, *, mesh: MeshGroups | None = None) -> dict[str, Any]:
    """Inside ``dp * tp`` ranks: train ``case`` with tensor parallelism inside each replica, data parallelism across.

    Mesh (dp, tp), tp fastest. Rank (d, t) holds tensor-parallel shard t of the block, runs
    it on data-parallel shard d of the batch, and after the backward pass averages its
    gradients over its dp group (ranks with the same t hold the same shard). Returns
    ``{"model": the shard, "step_s": seconds per step, "coords": (d, t)}``.
    """
    mesh = mesh or new_mesh_groups((dp, tp), ("dp", "tp"))
    d, t = mesh.coords["dp"], mesh.coords["tp"]
    dev = rank_device()
    if case.global_batch % dp:
        raise ValueError(f"global_batch={case.global_batch} does not split over dp={dp}")
    model = ParallelBlock.from_module(case.model(), t, tp, group=mesh.groups["tp"]).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=case.lr)
    xs, ys = case.data()
    per = case.global_batch // dp
    times = []
    for x, y in zip(xs, ys):
        start = time.perf_counter()
        x_local, y_local = x[d * per:(d + 1) * per].to(dev), y[d * per:(d + 1) * per].to(dev)
        opt.zero_grad()
        F.mse_loss(model(x_local), y_local).backward()
        for p in model.parameters():  # average over the replicas that hold the same shard
            grad = p.grad
            assert grad is not None, "every parameter has a gradient after the backward pass"
            dist.all_reduce(grad, group=mesh.groups["dp"])
            grad /= dp
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"model": model.cpu(), "step_s": float(np.median(times)), "coords": (d, t)}


# ---- a PP x DP x TP training run ---------------------------------------------------------------


@dataclass(frozen=True)
class PipelineCase(HybridCase):
    """``HybridCase`` with a stack of ``n_blocks`` blocks (split into pipeline stages) and ``micro_batches`` per step."""

    n_blocks: int = 2
    micro_batches: int = 2

    def blocks(self) -> list[models.Block]:
        """The single-device blocks every run starts from, block i seeded with ``seed + i``."""
        with torch.random.fork_rng(devices=[]):
            out = []
            for i in range(self.n_blocks):
                torch.manual_seed(self.seed + i)
                out.append(models.Block(self.config()))
            return out


def train_pp_dp_tp(case: PipelineCase, pp: int, dp: int, tp: int, *, mesh: MeshGroups | None = None) -> dict[str, Any]:
    """Inside ``pp * dp * tp`` ranks: a GPipe pipeline of tensor-parallel stages, with data parallelism across pipelines.

    Mesh (pp, dp, tp), tp fastest. Rank (s, d, t) holds shard t of the blocks of stage s
    (``n_blocks / pp`` consecutive blocks), runs the ``micro_batches`` micro-batches of data-parallel
    shard d forward (receiving each input from stage s - 1, sending each output to stage s + 1:
    the rank with the same d and t), then backward in the same order (gradients travel the other
    way), averages its gradients over its dp group and steps. The last stage's loss is the MSE of
    each micro-batch divided by their number, so the gradients equal one step on the whole batch.
    Returns ``{"stage": the stage's blocks, "coords": (s, d, t), "step_s": seconds per step}``.
    """
    shape = (pp, dp, tp)
    mesh = mesh or new_mesh_groups(shape, ("pp", "dp", "tp"))
    s, d, t = mesh.coords["pp"], mesh.coords["dp"], mesh.coords["tp"]
    if case.n_blocks % pp or case.global_batch % (dp * case.micro_batches):
        raise ValueError(f"{case.n_blocks} blocks over pp={pp}, or batch {case.global_batch} over dp={dp} x "
                         f"{case.micro_batches} micro-batches, do not divide")
    dev = rank_device()
    per_stage = case.n_blocks // pp
    blocks = case.blocks()[s * per_stage:(s + 1) * per_stage]
    stage = torch.nn.ModuleList(ParallelBlock.from_module(b, t, tp, group=mesh.groups["tp"]) for b in blocks).to(dev)
    prev = mesh_rank((s - 1, d, t), shape) if s > 0 else None
    after = mesh_rank((s + 1, d, t), shape) if s < pp - 1 else None
    opt = torch.optim.SGD(stage.parameters(), lr=case.lr)
    xs, ys = case.data()
    per, m = case.global_batch // dp, case.micro_batches
    times = []
    for x, y in zip(xs, ys):
        start = time.perf_counter()
        x_mbs, y_mbs = x[d * per:(d + 1) * per].chunk(m), y[d * per:(d + 1) * per].chunk(m)
        opt.zero_grad()
        received, outputs = [], []
        for k in range(m):  # all forwards (GPipe)
            if prev is None:
                h = x_mbs[k].to(dev)
            else:
                h = torch.empty(x_mbs[k].shape, device=dev)
                dist.recv(h, prev)
                h.requires_grad_(True)
            received.append(h)
            out = h
            for block in stage:
                out = block(out)
            if after is not None:
                dist.send(out.detach().contiguous(), after)
            outputs.append(out)
        for k in range(m):  # then all backwards, in the same order
            if after is None:
                (F.mse_loss(outputs[k], y_mbs[k].to(dev)) / m).backward()
            else:
                grad_out = torch.empty_like(outputs[k])
                dist.recv(grad_out, after)
                outputs[k].backward(grad_out)
            if prev is not None:
                input_grad = received[k].grad
                assert input_grad is not None, "a received input requires grad, so the backward pass reaches it"
                dist.send(input_grad.contiguous(), prev)
        for p in stage.parameters():
            grad = p.grad
            assert grad is not None, "every parameter has a gradient after the backward pass"
            dist.all_reduce(grad, group=mesh.groups["dp"])
            grad /= dp
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"stage": stage.cpu(), "coords": (s, d, t), "step_s": float(np.median(times))}
