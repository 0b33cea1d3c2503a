"""Chapter 12's grading harness: small training runs, done once in one process and once in gloo ranks.

A ``TrainCase`` is a small regression MLP and its data, the same in every process that builds it.
``train_single_process`` trains it on the whole batch (what data parallelism must reproduce);
``train_naive_ddp``, ``train_bucketed_ddp`` and ``train_zero1`` train it in a rank with a
student's ``average_gradients``, ``BucketedDDP`` or ``ZeroStage1Optimizer``; ``launch_exercise``
runs one of those in every rank, for every case, and the test compares what comes back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

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
    "gradient_scale_hint",
    "launch_exercise",
    "train_bucketed_ddp",
    "train_naive_ddp",
    "train_single_process",
    "train_zero1",
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


def _train_shards(case: TrainCase, rank: int, world: int,
                  average_fn: Callable[[nn.Module], None] | None = None) -> dict[str, list[torch.Tensor]]:
    """Train ``case`` on shard ``rank`` of ``world`` of every batch, calling ``average_fn(model)`` before each step."""
    model = case.model()
    opt = case.make_optimizer(model.parameters())
    x, y = case.data()
    first: list[torch.Tensor] = []
    for s in range(case.steps):
        opt.zero_grad(set_to_none=True)
        for k in range(case.accumulation):
            xs, ys = shard_batch((x[s, k], y[s, k]), rank, world)
            (F.mse_loss(model(xs), ys) / case.accumulation).backward()
        if average_fn is not None:
            average_fn(model)
        if s == 0:
            first = _grad_copies(model)
        opt.step()
    return {"first_grads": first, "params": [p.detach().clone() for p in model.parameters()]}


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
                        during_backward += log.of("all_reduce")
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
    return {"params": [p.detach().clone() for p in model.parameters()], "state_bytes": tensor_bytes(opt.state)}


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
