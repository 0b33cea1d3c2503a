"""Chapter 12's grading harness: small training runs, done once in one process and once in gloo ranks.

A ``TrainCase`` is a small regression MLP and its data, the same in every process that builds it.
``train_single_process`` trains it on the whole batch (what data parallelism must reproduce);
``train_naive_ddp``, ``train_bucketed_ddp``, ``train_zero1``, ``train_zero2`` and
``train_fully_sharded`` train it in a rank with a student's ``average_gradients``, ``BucketedDDP``,
``ZeroStage1Optimizer``, ``ZeroStage2Optimizer`` or ``FullyShardedBlock`` (``train_heterogeneous``:
with a speed-proportional split and a weighted average of the gradients), and record what the
mechanism did (the collectives, their bytes, when a handle was waited for, which gathered
buffers were still alive); ``launch_exercise`` runs one of those in every rank, for every case,
and the test compares what comes back.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch._dynamo  # noqa: F401 - torch.optim imports it on first use (seconds): once here, not in every rank
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.data_parallel import shard_batch
from course_lib.exercises.ranks import launch_on_cpu
from course_lib.models import MLP
from course_lib.support.comm import Call, record_collectives
from course_lib.support.sizes import tensor_bytes

__all__ = [
    "TrainCase",
    "comm_summary",
    "expected_shards",
    "gradient_scale_hint",
    "launch_exercise",
    "train_bucketed_ddp",
    "train_fully_sharded",
    "train_heterogeneous",
    "train_naive_ddp",
    "train_single_process",
    "train_zero1",
    "train_zero2",
]


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

    def blocks(self, seed: int | None = None) -> nn.Sequential:
        """The same model as ``model()``, as a stack of blocks: (Linear, Tanh) pairs, the last Linear alone."""
        layers = list(self.model(seed))
        return nn.Sequential(*(nn.Sequential(*layers[i:i + 2]) for i in range(0, len(layers), 2)))

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


def comm_summary(calls: Iterable[Call]) -> dict[str, Any]:
    """Plain data about recorded calls: payload bytes per operation, and whether every buffer was contiguous."""
    by_op: dict[str, int] = {}
    contiguous = True
    for c in calls:
        by_op[c.op] = by_op.get(c.op, 0) + c.bytes
        contiguous &= c.contiguous
    return {"bytes": by_op, "contiguous": contiguous}


def _train_shards(case: TrainCase, rank: int, world: int,
                  average_fn: Callable[[nn.Module], None] | None = None) -> dict[str, Any]:
    """Train ``case`` on shard ``rank`` of ``world`` of every batch, calling ``average_fn(model)`` before each step."""
    model = case.model()
    opt = case.make_optimizer(model.parameters())
    x, y = case.data()
    first: list[torch.Tensor] = []
    calls: list[Call] = []
    for s in range(case.steps):
        opt.zero_grad(set_to_none=True)
        for k in range(case.accumulation):
            xs, ys = shard_batch((x[s, k], y[s, k]), rank, world)
            (F.mse_loss(model(xs), ys) / case.accumulation).backward()
        if average_fn is not None:
            with record_collectives() as log:
                average_fn(model)
            calls += log.calls
        if s == 0:
            first = _grad_copies(model)
        opt.step()
    return {"first_grads": first, "params": [p.detach().clone() for p in model.parameters()],
            "comm": comm_summary(calls)}


def train_single_process(case: TrainCase) -> dict[str, list[torch.Tensor]]:
    """Big-batch training of ``case`` in this process: the gradients of the first step and the final parameters."""
    return _train_shards(case, 0, 1)


def train_naive_ddp(average_fn: Callable[[nn.Module], None], case: TrainCase) -> dict[str, list[torch.Tensor]]:
    """In a rank: train ``case`` on this rank's shards, averaging gradients with ``average_fn(model)``.

    Returns the averaged gradients of the first step and the final parameters, as ``train_single_process``.
    """
    return _train_shards(case, dist.get_rank(), dist.get_world_size(), average_fn)


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
    during_backward: list[Call] = []  # the all-reduces ours called while backward() ran
    early_waits: list[str] = []  # buckets waited for inside backward before a later bucket was started
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
                        with record_collectives() as log:
                            loss.backward()
                        launched = log.of("all_reduce")
                        during_backward += launched
                        # A bucket handle waited for before the next bucket started (the last one: before
                        # backward returned) is communication that overlapped nothing.
                        for j, c in enumerate(launched[:-1]):
                            if c.waited is not None and c.waited < launched[j + 1].start:
                                early_waits.append(f"step {s}, all-reduce {j} of {len(launched)}")
                    else:
                        loss.backward()
            if net is ours:
                ours.finish_gradient_sync()
            o.step()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "torch_ddp": [p.detach().clone() for p in ref_model.parameters()],
        "all_reduces_during_backward": len(during_backward),
        "async_during_backward": sum(c.async_op for c in during_backward),
        "early_waits": early_waits,
        "contiguous": all(c.contiguous for c in during_backward),
    }


def train_zero1(opt_cls: Callable[..., Any], case: TrainCase) -> dict[str, Any]:
    """In a rank: train ``case`` (Adam) with ``opt_cls(params, world_size, rank, lr=..., weight_decay=...)``, no other sync.

    Returns the final parameters, the bytes of the tensors in the optimizer's ``state`` and the collectives of ``step()``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = case.model()
    opt = opt_cls(list(model.parameters()), world, rank, lr=case.lr, weight_decay=case.weight_decay)
    x, y = case.data()
    calls: list[Call] = []
    for s in range(case.steps):
        opt.zero_grad()
        for k in range(case.accumulation):
            xs, ys = shard_batch((x[s, k], y[s, k]), rank, world)
            (F.mse_loss(model(xs), ys) / case.accumulation).backward()
        with record_collectives() as log:
            opt.step()
        calls += log.calls
    return {"params": [p.detach().clone() for p in model.parameters()], "state_bytes": tensor_bytes(opt.state),
            "comm": comm_summary(calls)}


def train_zero2(opt_cls: Callable[..., Any], case: TrainCase) -> dict[str, Any]:
    """In a rank: train ``case`` with ``opt_cls(params, world_size, rank, lr=..., weight_decay=...)`` (ZeRO-2).

    Returns the final parameters, ``grad_shards`` before the first step; the bytes of ``state``,
    of ``grad_shards`` and of the full gradients still held after each backward; the collectives
    of each step, and how many were called while backward ran.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = case.model()
    opt = opt_cls(list(model.parameters()), world, rank, lr=case.lr, weight_decay=case.weight_decay)
    x, y = case.data()
    calls: list[Call] = []
    in_backward = 0
    full_grad_bytes = 0
    first: list[torch.Tensor | None] = []
    for s in range(case.steps):
        opt.zero_grad()
        with record_collectives() as log:
            for k in range(case.accumulation):
                xs, ys = shard_batch((x[s, k], y[s, k]), rank, world)
                before = len(log.calls)
                (F.mse_loss(model(xs), ys) / case.accumulation).backward()
                in_backward += len(log.calls) - before
                full_grad_bytes = max(full_grad_bytes, tensor_bytes([p.grad for p in model.parameters()]))
            grad_shard_bytes = tensor_bytes(getattr(opt, "grad_shards", None))
            if s == 0:
                first = [None if g is None else g.detach().clone() for g in getattr(opt, "grad_shards", [])]
            opt.step()
        calls += log.calls
    return {"params": [p.detach().clone() for p in model.parameters()], "state_bytes": tensor_bytes(opt.state),
            "first_grad_shards": first, "grad_shard_bytes": grad_shard_bytes, "full_grad_bytes": full_grad_bytes,
            "comm": comm_summary(calls), "calls_in_backward": in_backward}


class _GatheredBuffers:
    """Weak references to the buffers every all-gather wrote into: how many of them are still alive, and their bytes."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []

    def alive(self, patience: float = 0.0) -> int:
        """Bytes of the gathered buffers whose storage is still allocated.

        With ``patience`` (seconds), a buffer counts only if it is still alive after garbage in
        reference cycles is collected and that long has passed.
        """
        deadline = time.monotonic() + patience
        while (n := self._count()) and patience:
            gc.collect()
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        return n

    def _count(self) -> int:
        return sum(s.nbytes() for s in (r() for r in self.refs) if s is not None)

    @contextlib.contextmanager
    def watching(self, on_gather: Callable[[Callable[[float], int]], None]) -> Any:
        """Within the block, every ``dist.all_gather_into_tensor`` / ``dist.all_gather`` first calls ``on_gather(self.alive)``."""
        originals = {name: getattr(dist, name) for name in ("all_gather_into_tensor", "all_gather")}

        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            def watched(out: Any, *args: Any, **kwargs: Any) -> Any:
                on_gather(self.alive)
                outs = list(out) if isinstance(out, (list, tuple)) else [out]
                for t in outs:
                    self.refs.append(weakref.ref(t.untyped_storage()))
                if kwargs.get("async_op"):
                    return fn(out, *args, **kwargs)
                # A synchronous call gathers into buffers of our own, copied into the caller's: gloo keeps
                # references to a collective's buffers for a while after it returns, and only the caller's
                # own references are to count.
                mine = [torch.empty_like(t) for t in outs]
                result = fn(mine if isinstance(out, (list, tuple)) else mine[0], *args, **kwargs)
                with torch.no_grad():
                    for t, m in zip(outs, mine):
                        t.copy_(m)
                return result
            return watched

        try:
            for name, fn in originals.items():
                setattr(dist, name, wrap(fn))
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def _held_bytes(module: nn.Module) -> int:
    """Bytes of the tensors a module tree holds in its attributes (parameters, buffers, anything else), each storage once."""
    return tensor_bytes([list(vars(m).values()) for m in module.modules()])


def train_fully_sharded(block_cls: Callable[..., Any], case: TrainCase, *, against_fsdp2: bool = False) -> dict[str, Any]:
    """In a rank: train ``case``'s block stack with every block wrapped in ``block_cls(block)`` (ZeRO-3).

    Returns each block's ``shard`` after training and its ``shard.grad`` before the first step; the
    bytes the wrapped model holds; the collectives of forward and of backward; the most bytes of gathered parameters alive when a
    block gathered in the forward pass, in the backward pass, and after each step. With
    ``against_fsdp2``, also the full parameters of the same training under ``fully_shard``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped: list[Any] = [block_cls(b) for b in case.blocks()]
    model = nn.Sequential(*wrapped)
    opt = case.make_optimizer(model.parameters())
    x, y = case.data()
    forward_calls: list[Call] = []
    backward_calls: list[Call] = []
    alive = {"forward": 0, "backward": 0, "after_step": 0}
    buffers = _GatheredBuffers()
    first: list[torch.Tensor | None] = []
    phase = ["forward"]
    largest = max(b.shard.numel() * b.shard.element_size() for b in wrapped) * world
    limit = {"forward": 0, "backward": largest, "after_step": 0}  # what a correct wrapper may keep alive

    def note(measure: Callable[[float], int]) -> None:
        # be patient until the first excess of a phase is found: then the run has failed anyway
        alive[phase[0]] = max(alive[phase[0]], measure(0.0 if alive[phase[0]] > limit[phase[0]] else 0.5))

    with buffers.watching(note):
        for s in range(case.steps):
            opt.zero_grad(set_to_none=True)
            for k in range(case.accumulation):
                xs, ys = shard_batch((x[s, k], y[s, k]), rank, world)
                phase[0] = "forward"
                with record_collectives() as log:
                    loss = F.mse_loss(model(xs), ys) / case.accumulation
                forward_calls += log.calls
                phase[0] = "backward"
                with record_collectives() as log:
                    loss.backward()
                backward_calls += log.calls
                del loss
                alive["after_step"] = max(alive["after_step"], buffers.alive(0.5))
            if s == 0:
                first = [None if b.shard.grad is None else b.shard.grad.detach().clone() for b in wrapped]
            opt.step()
    result: dict[str, Any] = {
        "shards": [b.shard.detach().clone() for b in wrapped], "first_grad_shards": first,
        "held_bytes": _held_bytes(model),
        "forward": comm_summary(forward_calls), "backward": comm_summary(backward_calls),
        "forward_ops": [c.op for c in forward_calls], "backward_ops": [c.op for c in backward_calls],
        "alive": alive,
    }
    if against_fsdp2:
        result["fsdp2"] = _train_fsdp2(case)
    return result


def _train_fsdp2(case: TrainCase) -> list[torch.Tensor]:
    """In a rank: the full parameters after training ``case``'s block stack under FSDP2 (``fully_shard`` per block)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    model = case.blocks()
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = case.make_optimizer(model.parameters())
    x, y = case.data()
    for s in range(case.steps):
        opt.zero_grad(set_to_none=True)
        for k in range(case.accumulation):
            xs, ys = shard_batch((x[s, k], y[s, k]), rank, world)
            (F.mse_loss(model(xs), ys) / case.accumulation).backward()
        opt.step()
    return [cast(Any, p).full_tensor().detach().clone() for p in model.parameters()]


def train_heterogeneous(student: tuple[Callable[..., Any], Callable[..., Any]], case: TrainCase,
                        speeds: Sequence[float]) -> dict[str, Any]:
    """In a rank: train ``case`` on a slice of each batch sized by ``split(batch, speeds)``, averaging with ``average``.

    ``student`` is ``(split, average)``: ``split(global_batch, speeds)`` gives the samples per rank
    (rank r takes the r-th contiguous slice) and ``average(model, local_count, global_count)`` turns
    the local gradients into the full-batch one. A rank with no samples runs no backward (its
    gradients stay None). Returns the split, the gradients of the first step, the final
    parameters and the collectives of each step's averaging.
    """
    split, average = student
    rank = dist.get_rank()
    model = case.model()
    opt = case.make_optimizer(model.parameters())
    x, y = case.data()
    counts = [int(c) for c in split(case.batch, list(speeds))]
    if len(counts) != dist.get_world_size() or sum(counts) != case.batch or min(counts) < 0:
        raise AssertionError(f"split({case.batch}, {list(speeds)}) gave {counts}: expected one non-negative count per "
                             f"rank, summing to {case.batch}")
    start = sum(counts[:rank])
    first: list[torch.Tensor] = []
    per_step: list[list[Call]] = []
    for s in range(case.steps):
        opt.zero_grad(set_to_none=True)
        if counts[rank]:
            xs, ys = x[s, 0, start:start + counts[rank]], y[s, 0, start:start + counts[rank]]
            F.mse_loss(model(xs), ys).backward()
        with record_collectives() as log:
            average(model, counts[rank], case.batch)
        per_step.append(log.calls)
        if s == 0:
            first = _grad_copies(model)
        opt.step()
    return {"counts": counts, "first_grads": first, "params": [p.detach().clone() for p in model.parameters()],
            "comm": comm_summary(c for calls in per_step for c in calls),
            "ops_per_step": [[c.op for c in calls] for calls in per_step]}


def _each_case(worker: Callable[..., Any], student: Any, cases: Sequence[TrainCase], kwargs: dict[str, Any]) -> list[Any]:
    """In a rank: ``worker(student, case, **kwargs)`` for every case."""
    return [worker(student, case, **kwargs) for case in cases]


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
    return launch_on_cpu(_each_case, world_size, worker, student, list(cases), kwargs, timeout=timeout)


def expected_shards(tensors: Sequence[torch.Tensor], world_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the flattened, concatenated ``tensors`` padded with zeros to a multiple of ``world_size``."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    size = math.ceil(flat.numel() / world_size)
    return F.pad(flat, (0, size * world_size - flat.numel()))[rank * size:(rank + 1) * size]


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
