"""Check the chapter-12 data-parallel algorithms on N ranks and time them.

Naive DDP, ``BucketedDDP`` (micro-batches in ``no_sync``) and torch's DistributedDataParallel
against single-process training, ZeRO-1 against single-process Adam and torch's
ZeroRedundancyOptimizer, ZeRO-2 against single-process Adam, ``FullyShardedBlock`` (ZeRO-3) against
single-process training and torch's FSDP2 (``fully_shard``), a speed-proportional split with
``weighted_average_gradients`` (ranks of made-up unequal speeds) against single-process training;
then the step time of each DDP and the optimizer-state bytes per rank:

    torchrun --standalone --nproc_per_node N -m benchmarks.checks.data_parallel [--small]
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from course_lib import data_parallel as dp
from course_lib.exercises.data_parallel import TrainCase
from course_lib.models import MLP
from course_lib.support.dist import rank_device
from course_lib.support.sizes import tensor_bytes
from course_lib.support.timing import time_in_ranks
from course_lib.support.torchrun import entry_main, report_check

__all__ = ["check"]

_MODES = ("single", "naive", "bucketed", "torch_ddp", "zero1", "torch_zero", "zero2", "fsdp", "torch_fsdp2", "weighted")


def _train(case: TrainCase, mode: str, device: torch.device) -> tuple[nn.Module, Any]:
    """Train ``case`` on ``device`` one way (see ``_MODES``); return the model and its optimizer.

    "single" trains on the whole batch in this process, without communication (the reference);
    "naive", "bucketed" and "torch_ddp" are naive DDP, ``BucketedDDP`` and torch's
    DistributedDataParallel; "zero1" is ``ZeroStage1Optimizer`` and "torch_zero" torch's DDP with
    ``ZeroRedundancyOptimizer`` (Adam); "zero2" is ``ZeroStage2Optimizer``; "fsdp" wraps every block
    of ``case.blocks()`` in ``FullyShardedBlock`` and "torch_fsdp2" applies ``fully_shard`` to every
    block and to the model; "weighted" gives rank r a share of every batch in proportion to a speed of
    r + 1 and averages with ``weighted_average_gradients``. Micro-batches but the last run in ``no_sync()``.
    """
    if mode not in _MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {_MODES}")
    rank, world = (0, 1) if mode == "single" else (dist.get_rank(), dist.get_world_size())
    model: nn.Module = case.model().to(device)
    if mode == "fsdp":
        model = nn.Sequential(*(dp.FullyShardedBlock(b) for b in case.blocks().to(device)))
    elif mode == "torch_fsdp2":
        model = case.blocks().to(device)
        mesh = init_device_mesh(device.type, (world,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    wrapper: dp.BucketedDDP | nn.parallel.DistributedDataParallel | None = None
    if mode == "bucketed":
        wrapper = dp.BucketedDDP(model, bucket_cap_mb=case.bucket_cap_mb)
    elif mode in ("torch_ddp", "torch_zero"):
        wrapper = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=case.bucket_cap_mb)
    net: nn.Module = model if wrapper is None else wrapper
    if mode == "zero1":
        opt: Any = dp.ZeroStage1Optimizer(model.parameters(), lr=case.lr, weight_decay=case.weight_decay)
    elif mode == "zero2":
        opt = dp.ZeroStage2Optimizer(model.parameters(), lr=case.lr, weight_decay=case.weight_decay)
    elif mode == "torch_zero":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=case.lr,
                                      weight_decay=case.weight_decay)
    else:
        opt = case.make_optimizer(model.parameters())
    x, y = (t.to(device) for t in case.data())
    counts = dp.speed_proportional_split(case.batch, [r + 1.0 for r in range(world)])
    start = sum(counts[:rank])
    for s in range(case.steps):
        opt.zero_grad(set_to_none=True)
        for k in range(case.accumulation):
            if mode == "weighted":
                if counts[rank]:
                    xs, ys = x[s, k, start:start + counts[rank]], y[s, k, start:start + counts[rank]]
                    (F.mse_loss(model(xs), ys) / case.accumulation).backward()
                continue
            xs, ys = dp.shard_batch((x[s, k], y[s, k]), rank, world)
            last = k == case.accumulation - 1
            with contextlib.nullcontext() if last or wrapper is None else wrapper.no_sync():
                (F.mse_loss(net(xs), ys) / case.accumulation).backward()
        if mode == "naive":
            dp.average_gradients(model)
        elif mode == "weighted":
            dp.weighted_average_gradients(model, counts[rank], case.batch)
        elif isinstance(net, dp.BucketedDDP):  # mode == "bucketed"
            net.finish_gradient_sync()
        opt.step()
    return model, opt


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in model.parameters()]


def _flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters of a trained model as one flat vector: gathered from the shards of ``FullyShardedBlock``s
    or of FSDP2's DTensors, as they are otherwise."""
    blocks = [b for b in model.children() if isinstance(b, dp.FullyShardedBlock)]
    if blocks:
        return torch.cat([b.gather()[:sum(n for _, _, n in b.layout)] for b in blocks])
    full = [cast(Any, p).full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters() if p.requires_grad]
    return torch.cat([p.detach().reshape(-1) for p in full])


def check(small: bool) -> dict[str, Any]:
    """In every rank: naive, bucketed, torch and weighted DDP, ZeRO-1/2/3 and torch's against single-process training; timings."""
    world, device = dist.get_world_size(), rank_device()
    sizes = (6, 10, 4) if small else (512, 1024, 1024, 256)
    common: dict[str, Any] = dict(sizes=sizes, batch=4 * world, steps=3, bucket_cap_mb=1e-4 if small else 1.0)
    tol = {"rtol": 1e-9, "atol": 1e-11}  # float64: only the order of the additions differs
    states: dict[str, int] = {}
    for case in (TrainCase(accumulation=2, **common), TrainCase(optimizer="adam", lr=0.01, seed=1, **common)):
        label = f"{case.optimizer} MLP{list(sizes)}"
        reference, reference_opt = _train(case, "single", device)
        for mode in ("naive", "bucketed", "torch_ddp", "weighted"):
            model, _ = _train(case, mode, device)
            report_check(f"{mode} {label}: params and grads vs single process", model, reference, **tol)
            if mode == "bucketed":
                torch_ddp, _ = _train(case, "torch_ddp", device)
                report_check(f"bucketed {label}: params and grads vs torch DDP", model, torch_ddp, **tol)
        if case.optimizer == "adam":
            zero1, opt = _train(case, "zero1", device)
            torch_zero, torch_opt = _train(case, "torch_zero", device)
            report_check(f"zero1 {label}: params vs single-process Adam", _params(zero1), _params(reference), **tol)
            report_check(f"zero1 {label}: params vs torch ZeroRedundancyOptimizer", _params(zero1), _params(torch_zero),
                         **tol)
            zero2, opt2 = _train(case, "zero2", device)
            report_check(f"zero2 {label}: params vs single-process Adam", _params(zero2), _params(reference), **tol)
            states = {"zero1": tensor_bytes(opt.state), "torch_zero": tensor_bytes(torch_opt.optim.state),
                      "zero2": tensor_bytes(opt2.state), "adam_single_process": tensor_bytes(reference_opt.state)}
        fsdp, _ = _train(case, "fsdp", device)
        fsdp2, _ = _train(case, "torch_fsdp2", device)
        report_check(f"fsdp {label}: params vs single process", _flat_params(fsdp), _flat_params(reference), **tol)
        report_check(f"fsdp {label}: params vs torch FSDP2", _flat_params(fsdp), _flat_params(fsdp2), **tol)
    return {
        "world_size": world,
        "backend": dist.get_backend(),
        "step_ms": _step_times(64 if small else 4096, device),
        "optimizer_state_bytes_per_rank": states,
    }


def _step_times(width: int, device: torch.device) -> dict[str, float]:
    """Median ms of forward + backward + gradient sync of a 4-layer fp32 MLP: none, naive, bucketed, torch DDP."""
    x = torch.randn(32, width, device=device)
    out = {}
    for mode in ("compute_only", "naive", "bucketed", "torch_ddp"):
        model = MLP([width] * 5, seed=0).to(device)
        net: nn.Module = model
        if mode == "bucketed":
            net = dp.BucketedDDP(model)
        elif mode == "torch_ddp":
            net = nn.parallel.DistributedDataParallel(model)
        step = functools.partial(_sync_step, model, net, mode == "naive")
        out[mode] = statistics.median(time_in_ranks(step, x, repeat=5, warmup=2)) * 1e3
    return out


def _sync_step(model: nn.Module, net: nn.Module, naive: bool, t: torch.Tensor) -> None:
    """Forward + backward of ``net`` (``model``, maybe wrapped) on ``t``, then the gradient sync a wrapper leaves to us."""
    model.zero_grad(set_to_none=True)
    F.mse_loss(net(t), t).backward()
    if naive:
        dp.average_gradients(model)
    elif isinstance(net, dp.BucketedDDP):
        net.finish_gradient_sync()


if __name__ == "__main__":
    entry_main(check, __doc__)
