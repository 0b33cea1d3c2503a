"""Chapter 12 (data parallelism): averaged gradients, DDP, ZeRO stages 1-3, uneven ranks, large batches, DeepSpeed.

Every rank holds a full copy of the model, runs forward and backward on its own slice of the
global batch, and the ranks average their gradients before the optimizer step. Averaging
per-shard mean gradients over equal shards gives exactly the big-batch gradient, so N ranks
train the same model as one process with an N times larger batch.

    from course_lib import data_parallel as dp

    dp.averaged_shard_gradients(model, F.mse_loss, x, y, world_size=4)   # single process, by hand
    # inside a rank (launched with course_lib.support.dist.launch):
    loss.backward(); dp.average_gradients(model); optimizer.step()    # naive DDP
    ddp = dp.BucketedDDP(model, bucket_cap_mb=1.0)                      # overlapped DDP
    loss = loss_fn(ddp(x), y); loss.backward(); ddp.finish_gradient_sync(); optimizer.step()
    opt = dp.ZeroStage1Optimizer(model.parameters(), lr=1e-3)           # Adam states sharded
    opt = dp.ZeroStage2Optimizer(model.parameters(), lr=1e-3)           # + gradients reduce-scattered in hooks
    net = nn.Sequential(*(dp.FullyShardedBlock(b) for b in blocks))     # + parameters sharded (ZeRO-3, FSDP)
    # cost models
    dp.zero_bytes_sent(7.5e9, stage=3, world_size=64)                   # 1.5 times DDP's bytes per rank
    dp.scaling_efficiency(t_compute=0.30, t_comm=0.12, t_overlap=0.10)  # 0.9375
    # heterogeneous ranks and large batches
    counts = dp.speed_proportional_split(64, [1.7, 1.0])                # [40, 24]
    dp.weighted_average_gradients(model, counts[rank], 64)              # in a rank: the full-batch gradient
    dp.warmup_lr(step, dp.linear_scaled_lr(0.1, 256, 1024), warmup_steps=50)

The exercises' training cases and rank workers are ``course_lib.exercises.data_parallel``; the
torchrun self-check against PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2, on GPUs or gloo
CPU ranks, is ``benchmarks.checks.data_parallel``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from course_lib.accumulation_checkpointing import split_micro_batches
from course_lib.optimizers import adam_step

__all__ = [
    "shard_batch",
    "loss_gradients",
    "averaged_shard_gradients",
    "sampler_indices",
    "broadcast_parameters",
    "average_gradients",
    "assign_buckets",
    "BucketedDDP",
    "ZeroStage1Optimizer",
    "shard_size",
    "ZeroStage2Optimizer",
    "FullyShardedBlock",
    "ring_bytes_sent",
    "zero_bytes_sent",
    "zeropp_cross_node_bytes",
    "offload_step_seconds",
    "step_compute_time",
    "scaling_efficiency",
    "speed_proportional_split",
    "weighted_average_gradients",
    "equal_split_utilisation",
    "linear_scaled_lr",
    "warmup_lr",
]

# ---- the maths, in one process ----------------------------------------------------------------


def shard_batch(batch: torch.Tensor | Sequence[torch.Tensor], rank: int, world_size: int) -> Any:
    """Rank ``rank``'s contiguous slice of a global batch (a tensor or a tuple of tensors, split along dim 0).

    The batch size must be a multiple of ``world_size``: with equal shards the average of the
    per-rank mean gradients is the big-batch gradient (see ``averaged_shard_gradients``).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    # The same equal split as gradient accumulation's micro-batches (chapter 07), one part per rank.
    shards = split_micro_batches((batch,) if isinstance(batch, torch.Tensor) else batch, world_size)[rank]
    return shards[0] if isinstance(batch, torch.Tensor) else shards


def loss_gradients(
    model: nn.Module, loss_fn: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> list[torch.Tensor]:
    """Gradients of ``loss_fn(model(x), y)``, one per parameter that requires grad; ``.grad`` is left alone.

    ``torch.autograd.grad`` returns them instead of accumulating them into ``.grad`` (chapter 07's
    ``accumulation_checkpointing.full_batch_gradients`` goes through ``.grad`` and clears it).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss_fn(model(x), y), params, allow_unused=False))


def averaged_shard_gradients(
    model: nn.Module, loss_fn: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor, world_size: int
) -> list[torch.Tensor]:
    """What N data-parallel ranks compute, in one process: the mean over ``world_size`` equal shards of each shard's gradient.

    One tensor per parameter that requires grad, in ``model.parameters()`` order. ValueError when
    the batch does not split into equal shards. ``model``'s ``.grad`` fields are left alone.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    total: list[torch.Tensor] | None = None
    for rank in range(world_size):
        xs, ys = shard_batch((x, y), rank, world_size)
        grads = loss_gradients(model, loss_fn, xs, ys)
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    assert total is not None
    return [t / world_size for t in total]


def sampler_indices(
    n: int, world_size: int, rank: int, *, shuffle: bool = True, seed: int = 0, epoch: int = 0, drop_last: bool = False
) -> list[int]:
    """The indices ``torch.utils.data.DistributedSampler`` gives rank ``rank`` in epoch ``epoch``, written out.

    Shuffle with a generator seeded by ``seed + epoch`` (the same permutation on every rank);
    pad by repeating indices from the start until the length is a multiple of ``world_size``
    (or, with ``drop_last``, cut the tail instead); then rank r takes every world_size-th index
    starting at r.
    """
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    if drop_last and n % world_size:
        per_rank = math.ceil((n - world_size) / world_size)
    else:
        per_rank = math.ceil(n / world_size)
    total = per_rank * world_size
    if total > len(order):
        padding = total - len(order)
        order += (order * math.ceil(padding / len(order)))[:padding]
    return order[:total][rank:total:world_size]


# ---- naive DDP ------------------------------------------------------------------------------------


@torch.no_grad()
def broadcast_parameters(module: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Copy the parameters and buffers of ``group``'s rank ``src`` to its other ranks (what DDP does when it wraps a model)."""
    root = src if group is None else dist.get_global_rank(group, src)
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, root, group=group)


@torch.no_grad()
def average_gradients(model: nn.Module) -> None:
    """Naive DDP: replace every parameter's ``.grad`` with its mean over all ranks, one all-reduce per tensor.

    Parameters without a gradient (frozen, or unused in this step) are skipped; that must be the
    same set on every rank, or the ranks' collectives would not match.
    """
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world_size)


# ---- bucketed, overlapped DDP ---------------------------------------------------------------------


def assign_buckets(params: Sequence[torch.Tensor], bucket_cap_bytes: float) -> list[list[int]]:
    """Group parameters into all-reduce buckets in reverse order (the order backward produces their gradients).

    Walk ``params`` from the last to the first, adding each index to the current bucket; close the
    bucket as soon as its bytes reach ``bucket_cap_bytes`` (so one large tensor makes a bucket of
    its own). A parameter whose dtype differs from the current bucket's starts a new bucket (a
    bucket is flattened into one tensor). Returns lists of indices into ``params``.
    """
    if bucket_cap_bytes < 0:
        raise ValueError(f"bucket_cap_bytes must not be negative, got {bucket_cap_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(params))):
        p = params[i]
        if current and p.dtype != params[current[0]].dtype:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += p.numel() * p.element_size()
        if size >= bucket_cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class BucketedDDP(nn.Module):
    """Data parallelism that overlaps gradient all-reduces with the backward pass, like torch's DDP.

    At construction rank 0's parameters are broadcast and the parameters are split into
    buckets of about ``bucket_cap_mb`` MiB in reverse order (``assign_buckets``). Each bucket is
    one preallocated flat tensor (``bucket_grads``) and each parameter's ``.grad`` becomes a view
    of its slice: a post-accumulate-grad hook moves a freshly allocated gradient into its slice
    (one copy; none when ``.grad`` already is the view, e.g. after ``zero_grad(set_to_none=False)``)
    and counts it ready. When a bucket is complete it is averaged in place by an all-reduce with
    ``async_op=True`` while backward goes on (NCCL's ``AVG`` reduction; gloo has none, so there
    the bucket is divided by the world size and summed). Buckets are launched in bucket order,
    the same on every rank. ``finish_gradient_sync()`` waits for them: the averages are then
    already in ``.grad``. Call it after ``backward()`` and before ``optimizer.step()``. Inside
    ``no_sync()`` the hooks do not communicate and gradients just accumulate locally. ``group``
    is the process group to average over (all ranks by default; a data-parallel subgroup in a
    hybrid layout).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, *, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self._native_avg = dist.get_backend(group) == "nccl"
        broadcast_parameters(module, group=group)
        self._params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = assign_buckets(self._params, bucket_cap_mb * 2**20)
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self.bucket_grads: list[torch.Tensor] = []
        self._slots: dict[int, torch.Tensor] = {}
        for idx in self.buckets:
            first = self._params[idx[0]]
            flat = torch.zeros(sum(self._params[i].numel() for i in idx), dtype=first.dtype, device=first.device)
            offset = 0
            for i in idx:
                n = self._params[i].numel()
                self._slots[i] = flat[offset:offset + n].view_as(self._params[i])
                offset += n
            self.bucket_grads.append(flat)
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
            for i, p in enumerate(self._params)
        ]
        self._sync = True
        self._reset()

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._inflight: list[tuple[int, Any]] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _into_bucket(self, i: int) -> None:
        """Make parameter ``i``'s ``.grad`` the view of its bucket slice (zeros if it has no gradient)."""
        p, slot = self._params[i], self._slots[i]
        grad = p.grad
        if grad is slot:  # accumulated in place: nothing to do
            return
        if grad is None:
            slot.zero_()
        else:
            slot.copy_(grad)
        p.grad = slot

    def _grad_ready(self, i: int, p: torch.Tensor) -> None:
        self._into_bucket(i)
        if not self._sync:
            return
        b = self._bucket_of[i]
        self._ready[b] += 1
        if b == self._next:
            while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
                self._launch(self._next)
                self._next += 1

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        for i in self.buckets[b]:
            self._into_bucket(i)  # only does something for a parameter that got no gradient
        flat = self.bucket_grads[b]
        op = dist.ReduceOp.AVG
        if not self._native_avg:
            flat.div_(self.world_size)
            op = dist.ReduceOp.SUM
        work = dist.all_reduce(flat, op=op, group=self.group, async_op=True)
        self._inflight.append((b, work))

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket's all-reduce; afterwards each ``.grad`` holds the average over the ranks.

        Buckets whose parameters got no gradient this step are reduced here, with zeros for the
        missing gradients. Does nothing if no synchronised backward ran since the last call.
        """
        if not any(self._ready):
            return
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        for _, work in self._inflight:
            work.wait()
        self._reset()


# ---- ZeRO stage 1 ---------------------------------------------------------------------------------


class ZeroStage1Optimizer:
    """Adam with its states sharded over the ranks (ZeRO stage 1, Rajbhandari et al. 2020).

    The parameters are seen as one flat vector of P numbers, padded to a multiple of the world
    size N; rank r owns the slice [r S, (r + 1) S) with S = ceil(P / N) and keeps Adam's two
    moments only for it, in ``self.state`` (the dict ``optimizers.adam_step`` fills). ``step()``
    reduce-scatters the gradients (each rank receives the average of its slice), applies Adam
    to its slice of the parameters, then all-gathers the updated slices into every rank's
    parameters. Do not average the gradients yourself before ``step()``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        world_size: int | None = None,
        rank: int | None = None,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ZeroStage1Optimizer got no parameters that require grad")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"all parameters need one dtype to share a flat vector, got {sorted(map(str, dtypes))}")
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.rank = dist.get_rank() if rank is None else rank
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size = math.ceil(self.numel / self.world_size)
        self.hyper: dict[str, Any] = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.state: dict[str, Any] = {}

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return F.pad(flat, (0, self.shard_size * self.world_size - self.numel))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, as ``torch.optim.Optimizer.zero_grad`` does."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Average this rank's slice of the gradients, update its slice with Adam, all-gather the parameters."""
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        flat_grad = self._flat(grads)
        grad_shard = torch.empty(self.shard_size, dtype=flat_grad.dtype, device=flat_grad.device)
        dist.reduce_scatter_tensor(grad_shard, flat_grad, op=dist.ReduceOp.SUM)
        grad_shard.div_(self.world_size)
        flat_param = self._flat([p.detach() for p in self.params])
        lo = self.rank * self.shard_size
        param_shard = flat_param[lo:lo + self.shard_size].clone()
        adam_step(param_shard, grad_shard, self.state, **self.hyper)
        dist.all_gather_into_tensor(flat_param, param_shard)
        offset = 0
        for p in self.params:
            p.copy_(flat_param[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


# ---- ZeRO stage 2 ---------------------------------------------------------------------------------


def shard_size(numel: int, world_size: int) -> int:
    """Elements of one rank's shard of a flat vector of ``numel`` elements padded to a multiple of ``world_size``."""
    return math.ceil(numel / world_size)


def _padded_flat(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """``t`` flattened and zero-padded to ``world_size`` shards of ``shard_size`` elements (a new contiguous tensor)."""
    return F.pad(t.reshape(-1), (0, shard_size(t.numel(), world_size) * world_size - t.numel()))


class ZeroStage2Optimizer:
    """Adam with its states *and the gradients* sharded over the ranks (ZeRO stage 2).

    Every parameter is flattened and padded to N equal shards; rank r owns shard r of each. A
    post-accumulate-grad hook reduce-scatters a gradient as soon as backward has produced it,
    adds this rank's averaged shard to ``self.grad_shards[i]`` and frees the full gradient
    (``p.grad = None``): between two hooks a rank holds one full gradient at most, and after
    backward only its 1/N of them. ``step()`` applies Adam to each parameter's shard (states in
    ``self.state[i]``) and all-gathers the updated shards into every rank's parameters.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        world_size: int | None = None,
        rank: int | None = None,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.rank = dist.get_rank() if rank is None else rank
        self.hyper: dict[str, Any] = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.state: dict[int, dict[str, Any]] = {}
        self.grad_shards: list[torch.Tensor | None] = [None] * len(self.params)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._reduce_scatter, i))

    @torch.no_grad()
    def _reduce_scatter(self, i: int, p: torch.Tensor) -> None:
        """The hook: this rank's averaged shard of ``p.grad`` is added to ``grad_shards[i]``; ``p.grad`` is freed."""
        assert p.grad is not None
        shard = torch.empty(shard_size(p.numel(), self.world_size), dtype=p.dtype, device=p.device)
        dist.reduce_scatter_tensor(shard, _padded_flat(p.grad, self.world_size))
        shard.div_(self.world_size)
        old = self.grad_shards[i]
        self.grad_shards[i] = shard if old is None else old.add_(shard)
        p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradient shards (and any full gradient)."""
        self.grad_shards = [None] * len(self.params)
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Adam on this rank's shard of every parameter, then an all-gather of the updated shards."""
        for i, p in enumerate(self.params):
            full = _padded_flat(p.detach(), self.world_size)
            size = full.numel() // self.world_size
            shard = full[self.rank * size:(self.rank + 1) * size].clone()
            grad = self.grad_shards[i]
            adam_step(shard, torch.zeros_like(shard) if grad is None else grad, self.state.setdefault(i, {}),
                      **self.hyper)
            dist.all_gather_into_tensor(full, shard)
            p.copy_(full[:p.numel()].view_as(p))


# ---- ZeRO stage 3: a fully sharded block (FSDP) ----------------------------------------------------


class _GatherParams(torch.autograd.Function):
    """Forward: all-gather a block's flat parameters from the shards. Backward: reduce-scatter their gradient."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, owner: FullyShardedBlock) -> torch.Tensor:
        ctx.owner = owner
        return owner.gather()

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[torch.Tensor, None]:
        owner = ctx.owner
        owner.full_for_backward = None  # reshard: the gathered parameters of the backward pass are freed
        return owner.reduce_scatter(grad_full), None


class FullyShardedBlock(nn.Module):
    """ZeRO stage 3 for one block of a model: only this rank's flat shard of its parameters lives between uses.

    At construction the block's parameters (``block.parameters()`` order) are flattened into one
    vector, padded to a multiple of N; rank r keeps elements [r S, (r + 1) S) as the parameter
    ``self.shard`` and the block's own parameters are emptied. ``forward`` all-gathers the full
    vector (``gather``), runs the block on views of it, and lets it go: autograd does not keep
    it, because a saved-tensor hook replaces each saved parameter by its place in the vector.
    When the gradient of the block's output arrives, the vector is gathered again
    (``full_for_backward``) for the saved tensors to read; once backward has the gradient of the
    whole vector it is freed and the gradient reduce-scattered (averaged) into ``self.shard.grad``.
    Any optimizer on the model's parameters then steps on the shards.
    """

    def __init__(self, block: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.block = block
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        named = [(n, p) for n, p in block.named_parameters()]
        self.layout = [(n, p.shape, p.numel()) for n, p in named]
        flat = _padded_flat(torch.cat([p.detach().reshape(-1) for _, p in named]), self.world_size)
        size = flat.numel() // self.world_size
        self.shard = nn.Parameter(flat[self.rank * size:(self.rank + 1) * size].clone())
        for _, p in named:  # free the block's own copy: the shard is all this rank keeps
            p.requires_grad_(False)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.full_for_backward: torch.Tensor | None = None

    def gather(self) -> torch.Tensor:
        """The full flat parameter vector (padded), all-gathered from every rank's shard into a new buffer."""
        full = torch.empty(self.shard.numel() * self.world_size, dtype=self.shard.dtype, device=self.shard.device)
        dist.all_gather_into_tensor(full, self.shard.detach(), group=self.group)
        return full

    def reduce_scatter(self, grad_full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the gradient of the full vector, averaged over the ranks."""
        grad = torch.empty_like(self.shard)
        dist.reduce_scatter_tensor(grad, grad_full.contiguous(), group=self.group)
        return grad.div_(self.world_size)

    def _views(self, full: torch.Tensor) -> dict[str, torch.Tensor]:
        views, offset = {}, 0
        for name, shape, n in self.layout:
            views[name] = full[offset:offset + n].view(shape)
            offset += n
        return views

    def _gather_for_backward(self, grad: torch.Tensor) -> None:
        """Hook on the block's output: its backward is next, so gather the parameters again."""
        with torch.no_grad():
            self.full_for_backward = self.gather()

    def forward(self, *args: Any) -> Any:
        """Gather, run the block on views of the gathered vector, free it (autograd keeps only offsets)."""
        full = _GatherParams.apply(self.shard, self)
        where = full.data_ptr()  # an address, not the tensor: the hooks must not keep it alive

        def pack(t: torch.Tensor) -> Any:
            if t.untyped_storage().data_ptr() == where:
                return (t.storage_offset(), t.shape, t.stride())  # a parameter view: keep where it was
            return t

        def unpack(saved: Any) -> torch.Tensor:
            if isinstance(saved, tuple):
                assert self.full_for_backward is not None, "the parameters were not gathered for backward"
                offset, shape, stride = saved
                return self.full_for_backward.as_strided(shape, stride, offset)
            return saved

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = functional_call(self.block, self._views(full), args)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._gather_for_backward)
        return out


# ---- the communication and offload models ----------------------------------------------------------


def ring_bytes_sent(op: str, payload_bytes: float, world_size: int) -> float:
    """Bytes one rank sends for a ring collective, given the payload that ``record_collectives`` logs.

    all_reduce (payload: the whole buffer B): 2 (N-1)/N B; reduce_scatter (payload: the input, B):
    (N-1)/N B; all_gather (payload: this rank's contribution C): (N-1) C.
    """
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n * payload_bytes
    if op.startswith("reduce_scatter"):
        return (n - 1) / n * payload_bytes
    if op.startswith("all_gather"):
        return (n - 1) * payload_bytes
    raise ValueError(f"no ring model for {op!r}")


def zero_bytes_sent(num_params: float, stage: int, world_size: int, bytes_per_value: float = 2.0) -> float:
    """Bytes one rank sends per step under ZeRO ``stage`` with ring collectives (Rajbhandari et al. 2020).

    Stages 0-2 move a reduce-scatter and an all-gather's worth, 2 (N-1)/N Psi values, as an
    all-reduce does; stage 3 gathers the parameters twice (forward and backward): 3 (N-1)/N Psi, 1.5 times.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    passes = 3 if stage == 3 else 2
    return passes * (world_size - 1) / world_size * num_params * bytes_per_value


def zeropp_cross_node_bytes(num_params: float, world_size: int, *, quantized_weights: bool = True,
                            hierarchical: bool = True, quantized_gradients: bool = True) -> float:
    """Bytes one rank sends across nodes per ZeRO-3 step with ZeRO++'s three options (Wang et al. 2023).

    Plain ZeRO-3 with fp16 values: forward all-gather, backward all-gather, gradient
    reduce-scatter, each (N-1)/N Psi 2 bytes. qwZ sends the weights as int8 (half); hpZ keeps a
    secondary copy of the weights inside each node, so the backward all-gather crosses no node;
    qgZ sends the gradients as int4 (a quarter). All three: 0.75 Psi bytes instead of 3 Psi (times (N-1)/N).
    """
    share = (world_size - 1) / world_size * num_params
    forward = share * (1.0 if quantized_weights else 2.0)
    backward = 0.0 if hierarchical else forward
    gradients = share * (0.5 if quantized_gradients else 2.0)
    return forward + backward + gradients


def offload_step_seconds(num_params: float, tokens: float, flops_per_s: float, pcie_bytes_per_s: float,
                         cpu_adam_params_per_s: float, nvme_bytes_per_s: float | None = None) -> dict[str, float]:
    """A model of one ZeRO-Offload step on one GPU, in seconds: compute, PCIe traffic, the CPU's Adam (and NVMe).

    The GPU runs forward and backward (6 Psi tokens FLOPs); the fp16 gradients go to the CPU and
    the updated fp16 parameters come back (2 Psi bytes each way, one after the other); the CPU
    runs Adam on all Psi parameters. With ``nvme_bytes_per_s`` (ZeRO-Infinity) the 12 Psi bytes
    of fp32 master weights and moments live on NVMe: read and written back once per step. Without
    overlap the step takes the sum (``total``).
    """
    parts = {
        "compute": step_compute_time(num_params, tokens, flops_per_s),
        "pcie": 2 * (2 * num_params) / pcie_bytes_per_s,
        "cpu_adam": num_params / cpu_adam_params_per_s,
    }
    if nvme_bytes_per_s is not None:
        parts["nvme"] = 2 * (12 * num_params) / nvme_bytes_per_s
    parts["total"] = sum(parts.values())
    return parts


# ---- the cost model -------------------------------------------------------------------------------


def step_compute_time(num_params: float, tokens: float, flops_per_s: float) -> float:
    """Seconds of forward + backward for ``tokens`` tokens of a ``num_params`` model: 6 P T / achieved FLOP/s."""
    if flops_per_s <= 0:
        raise ValueError(f"flops_per_s must be positive, got {flops_per_s}")
    return 6.0 * num_params * tokens / flops_per_s


def scaling_efficiency(t_compute: Any, t_comm: Any, t_overlap: Any = 0.0) -> Any:
    """Fraction of linear speed-up a data-parallel step keeps: T1 / (T1 + exposed communication).

    T1 = ``t_compute`` is the step time of one GPU (weak scaling: every GPU keeps its batch),
    ``t_comm`` the time of the gradient all-reduce, ``t_overlap`` how much of it runs hidden
    behind compute. Exposed communication is max(t_comm - t_overlap, 0). Works element-wise on
    NumPy arrays. ValueError for negative times or a non-positive ``t_compute``.
    """
    c, m, o = (np.asarray(v, dtype=float) for v in (t_compute, t_comm, t_overlap))
    if np.any(c <= 0):
        raise ValueError("t_compute must be positive")
    if np.any(m < 0) or np.any(o < 0):
        raise ValueError("t_comm and t_overlap must not be negative")
    eff = c / (c + np.maximum(m - o, 0.0))
    return float(eff) if eff.ndim == 0 else eff


# ---- heterogeneous ranks: a split in proportion to speed, a weighted average ------------------------


def speed_proportional_split(global_batch: int, speeds: Sequence[float]) -> list[int]:
    """Samples per rank, in proportion to ``speeds`` (largest remainder), summing to ``global_batch``.

    Each rank's quota is ``global_batch * speed / sum(speeds)`` (exact fractions); every rank first
    gets the floor of its quota, and the samples left over go one each to the ranks with the largest
    remainders, the lower rank first on ties. If ``global_batch >= len(speeds)``, a rank left with
    none then takes one from the rank with the most (the lower rank on ties), until every rank has
    one. With fewer samples than ranks, the fastest ranks get one each (the lower rank on ties).
    ValueError for a negative batch, no ranks, or a speed that is not positive.
    """
    if global_batch < 0:
        raise ValueError(f"global_batch must not be negative, got {global_batch}")
    if not speeds or any(not s > 0 for s in speeds):
        raise ValueError(f"speeds must be a non-empty list of positive numbers, got {list(speeds)}")
    n = len(speeds)
    if global_batch < n:
        fastest = sorted(range(n), key=lambda r: (-speeds[r], r))[:global_batch]
        return [int(r in fastest) for r in range(n)]
    exact = [Fraction(s) for s in speeds]
    quotas = [global_batch * s / sum(exact) for s in exact]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(n), key=lambda r: (-(quotas[r] - counts[r]), r))
    for r in by_remainder[:global_batch - sum(counts)]:
        counts[r] += 1
    for r in range(n):
        if counts[r] == 0:
            donor = max(range(n), key=lambda d: (counts[d], -d))
            counts[donor] -= 1
            counts[r] = 1
    return counts


@torch.no_grad()
def weighted_average_gradients(model: nn.Module, local_count: int, global_count: int) -> None:
    """In a rank: replace the ``.grad`` of every trainable parameter by the full-batch gradient, in place.

    Each rank holds the mean gradient of its ``local_count`` samples (or no gradient, with none);
    weighted by ``local_count / global_count`` and summed over the ranks, they give the mean over
    all ``global_count`` samples. All gradients travel in one flat, contiguous buffer: one
    all-reduce per step. A parameter without ``.grad`` counts as zero and gets one.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads]) * (local_count / global_count)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for p, piece in zip(params, flat.split([p.numel() for p in params])):
        p.grad = piece.view_as(p).clone()


def equal_split_utilisation(speeds: Sequence[float]) -> float:
    """Fraction of the ranks' summed throughput that an equal split delivers: N min(s) / sum(s).

    With b samples each, a step lasts b / min(s) (everyone waits for the slowest rank) and delivers
    N b samples, where ranks that never wait would deliver sum(s) b / min(s) in that time.
    """
    if not speeds or any(not s > 0 for s in speeds):
        raise ValueError(f"speeds must be a non-empty list of positive numbers, got {list(speeds)}")
    return len(speeds) * min(speeds) / sum(speeds)


# ---- large batches: the linear scaling rule and warmup (Goyal et al. 2017) -------------------------


def linear_scaled_lr(base_lr: float, base_batch: int, batch: int) -> float:
    """The linear scaling rule: a ``batch / base_batch`` times larger batch gets that many times the learning rate."""
    if base_batch <= 0 or batch <= 0:
        raise ValueError(f"batch sizes must be positive, got {base_batch} and {batch}")
    return base_lr * batch / base_batch


def warmup_lr(step: int, peak_lr: float, warmup_steps: int, start_lr: float = 0.0) -> float:
    """Gradual warmup: the learning rate of ``step`` (from 0), rising linearly from ``start_lr`` to ``peak_lr``.

    Step ``warmup_steps`` and later use ``peak_lr``; ``warmup_steps=0`` means no warmup.
    """
    if step < 0 or warmup_steps < 0:
        raise ValueError(f"step and warmup_steps must not be negative, got {step} and {warmup_steps}")
    if step >= warmup_steps:
        return peak_lr
    return start_lr + (peak_lr - start_lr) * step / warmup_steps
