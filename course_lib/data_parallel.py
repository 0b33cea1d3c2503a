"""Chapter 12 (data parallelism): averaged gradients, naive and bucketed DDP, ZeRO stage 1, scaling.

Every rank holds a full copy of the model, runs forward and backward on its own slice of the
global batch, and the ranks average their gradients before the optimizer step. Averaging
per-shard mean gradients over equal shards gives exactly the big-batch gradient, so N ranks
train the same model as one process with an N times larger batch.

    from course_lib import data_parallel as dp
    from course_lib.support.dist import launch

    dp.averaged_shard_gradients(model, F.mse_loss, x, y, world_size=4)   # single process, by hand
    # inside a rank (launched with course_lib.support.dist.launch):
    loss.backward(); dp.average_gradients(model); optimizer.step()    # naive DDP
    ddp = dp.BucketedDDP(model, bucket_cap_mb=1.0)                      # overlapped DDP
    loss = loss_fn(ddp(x), y); loss.backward(); ddp.finish_gradient_sync(); optimizer.step()
    opt = dp.ZeroStage1Optimizer(model.parameters(), lr=1e-3)           # Adam states sharded
    # cost model
    dp.scaling_efficiency(t_compute=0.30, t_comm=0.12, t_overlap=0.10)  # 0.9375

On several GPUs (or gloo CPU ranks with ``--small``) the module checks naive DDP, bucketed DDP
and ZeRO-1 against single-process training and PyTorch's DDP / ZeroRedundancyOptimizer, and
times a step of each DDP:

    torchrun --nproc_per_node 4 -m course_lib.data_parallel [--small]
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.accumulation_checkpointing import split_micro_batches
from course_lib.exercises.checks import not_done
from course_lib.models import MLP
from course_lib.optimizers import adam_step

__all__ = [
    "shard_batch",
    "full_batch_gradients",
    "averaged_shard_gradients",
    "sampler_indices",
    "broadcast_parameters",
    "average_gradients",
    "naive_ddp_step",
    "assign_buckets",
    "Timeline",
    "record_all_reduces",
    "BucketedDDP",
    "ZeroStage1Optimizer",
    "state_tensor_bytes",
    "step_compute_time",
    "scaling_efficiency",
    "TrainCase",
    "train_reference",
    "train_naive_ddp",
    "train_bucketed_ddp",
    "train_zero1",
    "launch_exercise",
    "gradient_scale_hint",
    "train_on_device",
    "main",
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


def full_batch_gradients(
    model: nn.Module, loss_fn: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> list[torch.Tensor]:
    """Gradients of ``loss_fn(model(x), y)`` for each parameter that requires grad (the big-batch reference)."""
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
        grads = full_batch_gradients(model, loss_fn, xs, ys)
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


def naive_ddp_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    average_fn: Callable[[nn.Module], None] = average_gradients,
) -> torch.Tensor:
    """One naive data-parallel step on this rank's shard ``(x, y)``: forward, backward, average, update.

    Returns the local loss.
    """
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    average_fn(model)
    optimizer.step()
    return loss.detach()


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


class Timeline:
    """Spans (kind, label, start, end) recorded in one rank, in seconds of ``time.perf_counter``.

    All ranks of one machine share that clock, so spans from several ranks can be drawn on one
    axis (``plot_timeline``). ``add`` is safe to call from a communication thread.
    """

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, float, float]] = []

    @staticmethod
    def now() -> float:
        """The current time on the shared clock."""
        return time.perf_counter()

    def add(self, kind: str, label: str, start: float, end: float) -> None:
        """Record one span."""
        self.spans.append((kind, label, start, end))

    @contextlib.contextmanager
    def span(self, kind: str, label: str = "") -> Iterator[None]:
        """Record the time the ``with`` body takes."""
        start = self.now()
        try:
            yield
        finally:
            self.add(kind, label, start, self.now())


@contextlib.contextmanager
def record_all_reduces(timeline: Timeline, label: str = "all-reduce") -> Iterator[None]:
    """Inside: every ``torch.distributed.all_reduce`` call is recorded in ``timeline`` as a span, from launch to completion.

    A synchronous call ends when it returns; an asynchronous one (``async_op=True``) when its
    future completes (a callback on ``work.get_future()``). Works with any code that calls
    ``dist.all_reduce`` through the ``torch.distributed`` module.
    """
    original = dist.all_reduce
    count = 0

    def recording(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        name, start = f"{label} {count}", timeline.now()
        count += 1
        work = original(*args, **kwargs)
        if kwargs.get("async_op", False) and work is not None:
            work.get_future().then(lambda _: timeline.add("all-reduce", name, start, timeline.now()))
        else:
            timeline.add("all-reduce", name, start, timeline.now())
        return work

    dist.all_reduce = recording
    try:
        yield
    finally:
        dist.all_reduce = original


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
    hybrid layout). With a ``timeline``, the backward hooks and all-reduces are recorded in it.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, *, group: dist.ProcessGroup | None = None,
                 timeline: Timeline | None = None) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self._native_avg = dist.get_backend(group) == "nccl"
        self.timeline = timeline
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
        if self.timeline is not None:
            now = self.timeline.now()
            self.timeline.add("grad ready", str(i), now, now)
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
        start = self.timeline.now() if self.timeline is not None else 0.0
        work = dist.all_reduce(flat, op=op, group=self.group, async_op=True)
        if self.timeline is not None:
            timeline = self.timeline
            work.get_future().then(lambda _: timeline.add("all-reduce", f"bucket {b}", start, timeline.now()))
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


def state_tensor_bytes(state: Any) -> int:
    """Bytes of every tensor inside ``state`` (dicts, lists, tuples, an optimizer's ``.state``), each storage once."""
    seen: dict[tuple[str, int], int] = {}

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if hasattr(obj, "to_local"):  # a DTensor (FSDP2): count this rank's local shard
                obj = obj.to_local()
            seen[(str(obj.device), obj.untyped_storage().data_ptr())] = obj.untyped_storage().nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v)

    visit(state)
    return sum(seen.values())


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


# ---- exercise harness: cases, single-process references and rank workers ---------------------------


@dataclass(frozen=True)
class TrainCase:
    """A small training run: an MLP of ``sizes`` on a regression batch, the same in every process that builds it.

    ``batch`` is the global batch; each of the ``steps`` optimizer steps takes ``accumulation``
    micro-batches of that size. ``optimizer`` is "sgd" or "adam".
    """

    sizes: tuple[int, ...] = (5, 7, 3)
    batch: int = 12
    steps: int = 3
    seed: int = 0
    optimizer: str = "sgd"
    lr: float = 0.1
    dtype: torch.dtype = torch.float64
    accumulation: int = 1
    weight_decay: float = 0.0
    bucket_cap_mb: float = 1e-4

    def model(self, seed: int | None = None) -> MLP:
        """The initial model (``seed`` overrides the case's: ranks that start from different weights)."""
        return MLP(self.sizes, nn.Tanh, seed=self.seed if seed is None else seed).to(self.dtype)

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs (steps, accumulation, batch, in) and targets (steps, accumulation, batch, out)."""
        g = torch.Generator().manual_seed(1000 + self.seed)
        shape = (self.steps, self.accumulation, self.batch)
        x = torch.randn(*shape, self.sizes[0], generator=g).to(self.dtype)
        y = torch.randn(*shape, self.sizes[-1], generator=g).to(self.dtype)
        return x, y

    def make_optimizer(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        """torch.optim.SGD or Adam with the case's learning rate and weight decay."""
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay)
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)
        raise ValueError(f"unknown optimizer {self.optimizer!r}")

    def describe(self, world_size: int) -> str:
        """A one-line label for messages."""
        return (
            f"{world_size} ranks, MLP{list(self.sizes)} {str(self.dtype).replace('torch.', '')}, "
            f"{self.optimizer} lr={self.lr}, batch {self.batch}, "
            f"{self.steps} steps x {self.accumulation} micro-batches, seed {self.seed}"
        )


def _grad_copies(model: nn.Module) -> list[torch.Tensor]:
    """Copies of the gradients of ``model``'s parameters, which a backward pass has just filled."""
    grads = [p.grad for p in model.parameters()]
    if any(g is None for g in grads):
        raise AttributeError("a parameter has no gradient after the backward pass")
    return [g.clone() for g in grads if g is not None]


def train_reference(case: TrainCase) -> dict[str, list[torch.Tensor]]:
    """Single-process big-batch training of ``case``: the gradients of the first step and the final parameters."""
    model = case.model()
    opt = case.make_optimizer(model.parameters())
    x, y = case.data()
    first: list[torch.Tensor] = []
    for s in range(case.steps):
        opt.zero_grad(set_to_none=True)
        for k in range(case.accumulation):
            (F.mse_loss(model(x[s, k]), y[s, k]) / case.accumulation).backward()
        if s == 0:
            first = _grad_copies(model)
        opt.step()
    return {"first_grads": first, "params": [p.detach().clone() for p in model.parameters()]}


def train_naive_ddp(average_fn: Callable[[nn.Module], None], case: TrainCase) -> dict[str, list[torch.Tensor]]:
    """In a rank: train ``case`` on this rank's shards, averaging gradients with ``average_fn(model)``.

    Returns the averaged gradients of the first step and the final parameters, as ``train_reference``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = case.model()
    opt = case.make_optimizer(model.parameters())
    x, y = case.data()
    first: list[torch.Tensor] = []
    for s in range(case.steps):
        opt.zero_grad(set_to_none=True)
        for k in range(case.accumulation):
            xs, ys = shard_batch((x[s, k], y[s, k]), rank, world)
            (F.mse_loss(model(xs), ys) / case.accumulation).backward()
        average_fn(model)
        if s == 0:
            first = _grad_copies(model)
        opt.step()
    return {"first_grads": first, "params": [p.detach().clone() for p in model.parameters()]}


def _count_all_reduces(counts: dict[str, int]) -> Callable[[], None]:
    """Wrap ``torch.distributed.all_reduce`` to count calls made while ``counts['in_backward']`` is set; return an undo."""
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        if counts.get("in_backward"):
            counts["during_backward"] += 1
            counts["async_during_backward"] += bool(kwargs.get("async_op", False))
        counts["total"] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting

    def undo() -> None:
        dist.all_reduce = original

    return undo


def train_bucketed_ddp(ddp_cls: Callable[..., Any], case: TrainCase, *, distinct_init: bool = False) -> dict[str, Any]:
    """In a rank: train ``case`` with ``ddp_cls(model, bucket_cap_mb=...)`` and with torch's DDP side by side.

    Micro-batches but the last run inside ``no_sync()``. Returns the parameters of both after
    training, and how many all-reduces ``ddp_cls`` started during the backward passes (and how
    many of those with ``async_op=True``). ``distinct_init`` starts each rank from different
    weights, which the wrapper must replace with rank 0's.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = case.data()
    model = case.model(seed=case.seed + rank if distinct_init else None)
    ours = ddp_cls(model, bucket_cap_mb=case.bucket_cap_mb)
    opt = case.make_optimizer(model.parameters())
    ref_model = case.model()
    theirs = nn.parallel.DistributedDataParallel(ref_model, bucket_cap_mb=case.bucket_cap_mb)
    ref_opt = case.make_optimizer(ref_model.parameters())
    counts = {"during_backward": 0, "async_during_backward": 0, "total": 0, "in_backward": 0}
    for s in range(case.steps):
        runs: list[tuple[Any, torch.optim.Optimizer]] = [(ours, opt), (theirs, ref_opt)]
        for net, o in runs:
            o.zero_grad(set_to_none=True)
            for k in range(case.accumulation):
                xs, ys = shard_batch((x[s, k], y[s, k]), rank, world)
                last = k == case.accumulation - 1
                with contextlib.nullcontext() if last else net.no_sync():
                    loss = F.mse_loss(net(xs), ys) / case.accumulation
                    if net is ours:
                        undo = _count_all_reduces(counts)
                        counts["in_backward"] = 1
                        try:
                            loss.backward()
                        finally:
                            counts["in_backward"] = 0
                            undo()
                    else:
                        loss.backward()
            if net is ours:
                ours.finish_gradient_sync()
            o.step()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "torch_ddp": [p.detach().clone() for p in ref_model.parameters()],
        "all_reduces_during_backward": counts["during_backward"],
        "async_during_backward": counts["async_during_backward"],
    }


def train_zero1(opt_cls: Callable[..., Any], case: TrainCase) -> dict[str, Any]:
    """In a rank: train ``case`` (Adam) with ``opt_cls(params, world_size, rank, lr=..., weight_decay=...)``, no other sync.

    Returns the final parameters and the bytes of the tensors in the optimizer's ``state``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = case.model()
    opt = opt_cls(list(model.parameters()), world, rank, lr=case.lr, weight_decay=case.weight_decay)
    x, y = case.data()
    for s in range(case.steps):
        opt.zero_grad()
        for k in range(case.accumulation):
            xs, ys = shard_batch((x[s, k], y[s, k]), rank, world)
            (F.mse_loss(model(xs), ys) / case.accumulation).backward()
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "state_bytes": state_tensor_bytes(opt.state)}


_NOT_DONE = "__not_implemented__"


def _run_cases(worker: Callable[..., Any], student: Any, cases: Sequence[TrainCase], kwargs: dict[str, Any]) -> Any:
    """In a rank: ``[worker(student, case, **kwargs) for case in cases]``, or a marker if the exercise is not done yet."""
    torch.set_num_threads(1)  # a forked child cannot use the parent's OpenMP pool; one thread avoids it
    try:
        return [worker(student, case, **kwargs) for case in cases]
    except NotImplementedError:
        return _NOT_DONE


def launch_exercise(
    worker: Callable[..., Any],
    world_size: int,
    student: Any,
    cases: Sequence[TrainCase],
    *,
    timeout: float = 60.0,
    **kwargs: Any,
) -> list[list[Any]]:
    """Run ``worker(student, case, **kwargs)`` for every case in ``world_size`` ranks, in one launch.

    Returns, per rank, the list of the worker's results. A ``student`` function or class that
    still raises NotImplementedError fails with a clear "not implemented yet" (``NotDoneYet``).
    The ranks use gloo on the CPU, also where there are GPUs: the cases are small CPU models.
    """
    import torch._dynamo  # noqa: F401 - torch.optim imports it on first use (seconds): once here, not in every rank

    from course_lib.support.dist import launch

    results = launch(_run_cases, world_size, worker, student, list(cases), kwargs, backend="gloo", timeout=timeout)
    if any(isinstance(r, str) and r == _NOT_DONE for r in results):
        raise not_done(student)
    return results


def gradient_scale_hint(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], world_size: int) -> str:
    """A hint when ``got`` differs from ``expected`` by a factor of the world size (a missing or extra division)."""
    diff_sum = sum(float((g - e).abs().sum()) for g, e in zip(got, expected))
    if diff_sum == 0:
        return ""
    for factor, hint in ((world_size, "did you forget to divide by the world size?"),
                         (1 / world_size, "did you divide by the world size twice?")):
        if all(torch.allclose(g, e * factor, rtol=1e-6, atol=1e-9) for g, e in zip(got, expected)):
            return f" (the result is {factor:g} times the expected one: {hint})"
    return ""


# ---- torchrun entry: every algorithm against the single-process run and PyTorch's own ----------

_MODES = ("single", "naive", "bucketed", "torch_ddp", "zero1", "torch_zero")


def train_on_device(case: TrainCase, mode: str, device: torch.device) -> tuple[nn.Module, Any]:
    """Train ``case`` on ``device`` one way (see ``_MODES``); return the model and its optimizer.

    "single" trains on the whole batch in this process, without communication (the reference);
    "naive", "bucketed" and "torch_ddp" are naive DDP, ``BucketedDDP`` and torch's
    DistributedDataParallel; "zero1" is ``ZeroStage1Optimizer`` and "torch_zero" torch's DDP with
    ``ZeroRedundancyOptimizer`` (Adam). Micro-batches but the last run in ``no_sync()``.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if mode not in _MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {_MODES}")
    rank, world = (0, 1) if mode == "single" else (dist.get_rank(), dist.get_world_size())
    model = case.model().to(device)
    wrapper: BucketedDDP | nn.parallel.DistributedDataParallel | None = None
    if mode == "bucketed":
        wrapper = BucketedDDP(model, bucket_cap_mb=case.bucket_cap_mb)
    elif mode in ("torch_ddp", "torch_zero"):
        wrapper = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=case.bucket_cap_mb)
    net: nn.Module = model if wrapper is None else wrapper
    if mode == "zero1":
        opt: Any = ZeroStage1Optimizer(model.parameters(), lr=case.lr, weight_decay=case.weight_decay)
    elif mode == "torch_zero":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=case.lr,
                                      weight_decay=case.weight_decay)
    else:
        opt = case.make_optimizer(model.parameters())
    x, y = (t.to(device) for t in case.data())
    for s in range(case.steps):
        opt.zero_grad(set_to_none=True)
        for k in range(case.accumulation):
            xs, ys = shard_batch((x[s, k], y[s, k]), rank, world)
            last = k == case.accumulation - 1
            with contextlib.nullcontext() if last or wrapper is None else wrapper.no_sync():
                (F.mse_loss(net(xs), ys) / case.accumulation).backward()
        if mode == "naive":
            average_gradients(model)
        elif isinstance(net, BucketedDDP):  # mode == "bucketed"
            net.finish_gradient_sync()
        opt.step()
    return model, opt


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in model.parameters()]


def _check_everything(small: bool) -> dict[str, Any]:
    """In a rank: naive, bucketed and torch DDP, ZeRO-1 and torch's ZeRO against single-process training; then timings."""
    from course_lib.support.dist import rank_device
    from course_lib.support.torchrun import report_check

    world, device = dist.get_world_size(), rank_device()
    sizes = (6, 10, 4) if small else (512, 1024, 1024, 256)
    common: dict[str, Any] = dict(sizes=sizes, batch=4 * world, steps=3, bucket_cap_mb=1e-4 if small else 1.0)
    tol = {"rtol": 1e-9, "atol": 1e-11}  # float64: only the order of the additions differs
    states: dict[str, int] = {}
    for case in (TrainCase(accumulation=2, **common), TrainCase(optimizer="adam", lr=0.01, seed=1, **common)):
        label = f"{case.optimizer} MLP{list(sizes)}"
        reference, reference_opt = train_on_device(case, "single", device)
        for mode in ("naive", "bucketed", "torch_ddp"):
            model, _ = train_on_device(case, mode, device)
            report_check(f"{mode} {label}: params and grads vs single process", model, reference, **tol)
            if mode == "bucketed":
                torch_ddp, _ = train_on_device(case, "torch_ddp", device)
                report_check(f"bucketed {label}: params and grads vs torch DDP", model, torch_ddp, **tol)
        if case.optimizer == "adam":
            zero1, opt = train_on_device(case, "zero1", device)
            torch_zero, torch_opt = train_on_device(case, "torch_zero", device)
            report_check(f"zero1 {label}: params vs single-process Adam", _params(zero1), _params(reference), **tol)
            report_check(f"zero1 {label}: params vs torch ZeroRedundancyOptimizer", _params(zero1), _params(torch_zero),
                         **tol)
            states = {"zero1": state_tensor_bytes(opt.state), "torch_zero": state_tensor_bytes(torch_opt.optim.state)}
            states["adam_single_process"] = state_tensor_bytes(reference_opt.state)
    return {
        "world_size": world,
        "backend": dist.get_backend(),
        "step_ms": _step_times(64 if small else 4096, device),
        "optimizer_state_bytes_per_rank": states,
    }


def _step_times(width: int, device: torch.device) -> dict[str, float]:
    """Median ms of forward + backward + gradient sync of a 4-layer fp32 MLP: none, naive, bucketed, torch DDP."""
    from course_lib.collectives import time_in_ranks

    x = torch.randn(32, width, device=device)
    out = {}
    for mode in ("compute_only", "naive", "bucketed", "torch_ddp"):
        model = MLP([width] * 5, seed=0).to(device)
        net: nn.Module = model
        if mode == "bucketed":
            net = BucketedDDP(model)
        elif mode == "torch_ddp":
            net = nn.parallel.DistributedDataParallel(model)
        step = functools.partial(_sync_step, model, net, mode == "naive")
        out[mode] = float(np.median(time_in_ranks(step, x, repeat=5, warmup=2))) * 1e3
    return out


def _sync_step(model: nn.Module, net: nn.Module, naive: bool, t: torch.Tensor) -> None:
    """Forward + backward of ``net`` (``model``, maybe wrapped) on ``t``, then the gradient sync a wrapper leaves to us."""
    model.zero_grad(set_to_none=True)
    F.mse_loss(net(t), t).backward()
    if naive:
        average_gradients(model)
    elif isinstance(net, BucketedDDP):
        net.finish_gradient_sync()


def main(argv: list[str] | None = None) -> None:
    """Entry for ``torchrun --nproc_per_node N -m course_lib.data_parallel [--small]``."""
    from course_lib.support.torchrun import entry_main

    entry_main(_check_everything, "Check the chapter-12 data-parallel algorithms on N ranks and time them.", argv)


if __name__ == "__main__":
    main()
