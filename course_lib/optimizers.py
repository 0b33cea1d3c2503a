"""Chapter 04 (optimizers): SGD, momentum, RMSprop, Adam and AdamW written out, their memory and their traffic.

Every update is a step function ``step(p, grad, state, **hyper)`` that changes the tensor ``p``
in place and keeps its per-parameter state in the dict ``state``, under the names torch.optim
uses ("momentum_buffer", "square_avg", "exp_avg", ...). ``StepOptimizer`` turns any such function
into a ``torch.optim.Optimizer`` (``course_lib.exercises.optimizers.check_against_torch`` runs one
next to its torch.optim twin).

    model = models.MLP([16, 64, 1], seed=0)
    optimizer = opt.StepOptimizer(model.parameters(), opt.adam_step, lr=1e-3)
    opt.step_traffic(opt.ADAM_FOR_LOOP, numel=10**6, itemsize=4)              # bytes (read, written)
    opt.step_traffic(opt.ADAM_FOR_LOOP, numel=10**6, itemsize=4, fused=True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "StepFn",
    "sgd_step",
    "rmsprop_step",
    "adam_step",
    "adamw_step",
    "StepOptimizer",
    "STATE_LAYOUT",
    "STEP_BYTES",
    "optimizer_state_bytes",
    "state_summary",
    "Op",
    "ADAM_FOR_LOOP",
    "ADAMW_FOR_LOOP",
    "ADAM_L2_FOR_LOOP",
    "SGD_MOMENTUM_FOR_LOOP",
    "SGD_FOR_LOOP",
    "RMSPROP_FOR_LOOP",
    "PROGRAMS",
    "op_traffic",
    "step_traffic",
    "fused_supported",
    "toy_regression",
    "per_sample_gradients",
    "minibatch_noise",
    "expected_minibatch_noise",
]

StepFn = Callable[..., Any]


# ---- step functions -------------------------------------------------------------------------

@torch.no_grad()
def sgd_step(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> None:
    """One step of ``torch.optim.SGD`` on ``p``, in place (``grad`` is left as it is).

    g = grad + weight_decay * p; with momentum, buf = g on the first step and
    buf = momentum * buf + (1 - dampening) * g after; the step direction is buf, or
    g + momentum * buf with Nesterov; then p -= lr * direction.
    """
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum needs momentum > 0 and dampening = 0")
    g = grad.add(p, alpha=weight_decay) if weight_decay != 0 else grad
    if momentum != 0:
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = torch.clone(g).detach()
            state["momentum_buffer"] = buf
        else:
            buf.mul_(momentum).add_(g, alpha=1 - dampening)
        g = g.add(buf, alpha=momentum) if nesterov else buf
    p.add_(g, alpha=-lr)


@torch.no_grad()
def rmsprop_step(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    *,
    lr: float = 1e-2,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
) -> None:
    """One step of ``torch.optim.RMSprop`` on ``p``, in place.

    g = grad + weight_decay * p; square_avg = alpha * square_avg + (1 - alpha) * g^2;
    denom = sqrt(square_avg) + eps (eps outside the root; centred: sqrt(square_avg - grad_avg^2) + eps);
    then p -= lr * g / denom, or with momentum buf = momentum * buf + g / denom and p -= lr * buf.
    """
    if not state:
        state["step"] = 0
        state["square_avg"] = torch.zeros_like(p)
        if momentum > 0:
            state["momentum_buffer"] = torch.zeros_like(p)
        if centered:
            state["grad_avg"] = torch.zeros_like(p)
    state["step"] += 1
    g = grad.add(p, alpha=weight_decay) if weight_decay != 0 else grad
    square_avg = state["square_avg"]
    square_avg.mul_(alpha).addcmul_(g, g, value=1 - alpha)
    if centered:
        grad_avg = state["grad_avg"]
        grad_avg.lerp_(g, 1 - alpha)
        denom = square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
    else:
        denom = square_avg.sqrt()
    denom.add_(eps)
    if momentum > 0:
        buf = state["momentum_buffer"]
        buf.mul_(momentum).addcdiv_(g, denom)
        p.add_(buf, alpha=-lr)
    else:
        p.addcdiv_(g, denom, value=-lr)


@torch.no_grad()
def adam_step(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    *,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = False,
) -> None:
    """One step of ``torch.optim.Adam`` (or, with ``decoupled_weight_decay``, ``torch.optim.AdamW``) on ``p``.

    Weight decay: Adam adds weight_decay * p to the gradient (L2); AdamW instead shrinks
    p *= 1 - lr * weight_decay before the update. Then with t = step count:
    m = beta1 m + (1 - beta1) g, v = beta2 v + (1 - beta2) g^2,
    p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps).
    """
    beta1, beta2 = betas
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
    state["step"] += 1
    t = state["step"]
    g = grad
    if weight_decay != 0:
        if decoupled_weight_decay:
            p.mul_(1 - lr * weight_decay)
        else:
            g = grad.add(p, alpha=weight_decay)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1**t)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-step_size)


def adamw_step(p: torch.Tensor, grad: torch.Tensor, state: dict, *, weight_decay: float = 1e-2, **hyper: Any) -> None:
    """One step of ``torch.optim.AdamW`` on ``p``: ``adam_step`` with decoupled weight decay (default 0.01, as torch)."""
    adam_step(p, grad, state, weight_decay=weight_decay, decoupled_weight_decay=True, **hyper)


class StepOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose update of each parameter is ``step_fn(p, p.grad, state, **hyper)``.

    ``hyper`` are the parameter group's settings (``lr`` and the rest, as keyword arguments of
    ``step_fn``); the state dict is ``optimizer.state[p]``, so ``state_dict()`` works as usual.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], step_fn: StepFn, **hyper: Any) -> None:
        super().__init__(params, hyper)
        self.step_fn = step_fn

    # torch types a closure's loss as a float; here, as in torch's own optimizers, it is the loss tensor.
    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:  # type: ignore[override]
        """Update every parameter that has a gradient; with ``closure``, re-evaluate the loss first and return it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                if p.grad is not None:
                    self.step_fn(p, p.grad, self.state[p], **hyper)
        return loss


# ---- memory of the optimizer state ----------------------------------------------------------

# Per trainable parameter tensor: how many param-sized state tensors torch.optim keeps, and
# whether it also keeps a 0-d "step" tensor (float32, 4 bytes, under the default dtype).
STATE_LAYOUT: dict[str, tuple[int, bool]] = {
    "sgd": (0, False),  # torch.optim.SGD(momentum=0): no state at all
    "sgd_momentum": (1, False),  # momentum_buffer
    "rmsprop": (1, True),  # square_avg, step
    "adam": (2, True),  # exp_avg, exp_avg_sq, step
    "adamw": (2, True),  # the same as Adam
}
STEP_BYTES = 4


def optimizer_state_bytes(model: nn.Module, name: str) -> int:
    """Bytes of state that torch.optim optimizer ``name`` (a key of ``STATE_LAYOUT``) keeps for ``model``.

    Counts the trainable parameters (``requires_grad``) once each: per parameter tensor, the
    param-sized state tensors in the parameter's dtype, plus a 4-byte step tensor where the
    optimizer keeps one. Valid once every trainable parameter has had a gradient and a step.
    """
    if name not in STATE_LAYOUT:
        raise ValueError(f"unknown optimizer {name!r}; known: {sorted(STATE_LAYOUT)}")
    copies, has_step = STATE_LAYOUT[name]
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum(copies * p.numel() * p.element_size() + (STEP_BYTES if has_step else 0) for p in trainable)


def state_summary(optimizer: torch.optim.Optimizer) -> dict[str, tuple[str, int]]:
    """For each state key of the first parameter: (dtype and shape as text, number of such tensors in the whole state)."""
    states = list(optimizer.state_dict()["state"].values())
    if not states:
        return {}
    summary = {}
    for key, value in states[0].items():
        count = sum(1 for s in states if isinstance(s.get(key), torch.Tensor))
        if isinstance(value, torch.Tensor):
            text = f"{str(value.dtype).replace('torch.', '')} {tuple(value.shape)}"
        else:
            text = repr(value)
        summary[key] = (text, count)
    return summary


# ---- memory traffic of an update ------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    """One element-wise kernel of an update: the tensor it writes and the tensors it reads (scalars left out)."""

    code: str
    out: str
    reads: tuple[str, ...]


# torch.optim.Adam's for-loop path (foreach=False, no weight decay, no AMSGrad), one kernel per line.
ADAM_FOR_LOOP: list[Op] = [
    Op("exp_avg.lerp_(grad, 1 - beta1)", "exp_avg", ("exp_avg", "grad")),
    Op("exp_avg_sq.mul_(beta2)", "exp_avg_sq", ("exp_avg_sq",)),
    Op("exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)", "exp_avg_sq", ("exp_avg_sq", "grad", "grad")),
    Op("denom = exp_avg_sq.sqrt()", "denom", ("exp_avg_sq",)),
    Op("denom = denom / bias_correction2_sqrt", "denom", ("denom",)),
    Op("denom.add_(eps)", "denom", ("denom",)),
    Op("param.addcdiv_(exp_avg, denom, value=-step_size)", "param", ("param", "exp_avg", "denom")),
]

# AdamW: the decoupled decay is one more kernel in front.
ADAMW_FOR_LOOP: list[Op] = [Op("param.mul_(1 - lr * weight_decay)", "param", ("param",))] + ADAM_FOR_LOOP

# Adam with L2 weight decay: the decayed gradient is a new tensor that the rest of the step reads.
ADAM_L2_FOR_LOOP: list[Op] = [Op("g = grad.add(param, alpha=weight_decay)", "g", ("grad", "param"))] + [
    Op(op.code.replace("grad", "g"), op.out, tuple("g" if r == "grad" else r for r in op.reads)) for op in ADAM_FOR_LOOP
]

# torch.optim.SGD with momentum (after the first step), and plain SGD.
SGD_MOMENTUM_FOR_LOOP: list[Op] = [
    Op("buf.mul_(momentum)", "buf", ("buf",)),
    Op("buf.add_(grad, alpha=1 - dampening)", "buf", ("buf", "grad")),
    Op("param.add_(buf, alpha=-lr)", "param", ("param", "buf")),
]
SGD_FOR_LOOP: list[Op] = [Op("param.add_(grad, alpha=-lr)", "param", ("param", "grad"))]

# torch.optim.RMSprop (no momentum, not centred).
RMSPROP_FOR_LOOP: list[Op] = [
    Op("square_avg.mul_(alpha)", "square_avg", ("square_avg",)),
    Op("square_avg.addcmul_(grad, grad, value=1 - alpha)", "square_avg", ("square_avg", "grad", "grad")),
    Op("avg = square_avg.sqrt()", "avg", ("square_avg",)),
    Op("avg.add_(eps)", "avg", ("avg",)),
    Op("param.addcdiv_(grad, avg, value=-lr)", "param", ("param", "grad", "avg")),
]

PROGRAMS: dict[str, list[Op]] = {
    "sgd": SGD_FOR_LOOP,
    "sgd_momentum": SGD_MOMENTUM_FOR_LOOP,
    "rmsprop": RMSPROP_FOR_LOOP,
    "adam": ADAM_FOR_LOOP,
    "adam_l2": ADAM_L2_FOR_LOOP,
    "adamw": ADAMW_FOR_LOOP,
}


def op_traffic(program: Sequence[Op], numel: int, itemsize: int) -> list[tuple[str, int, int]]:
    """Bytes (read, written) of each kernel when every op runs as its own kernel: ``(code, read, written)`` per op.

    A kernel reads each distinct tensor among its inputs once and writes its output once; each
    tensor has ``numel`` elements of ``itemsize`` bytes.
    """
    size = numel * itemsize
    return [(op.code, len(set(op.reads)) * size, size) for op in program]


def step_traffic(program: Sequence[Op], numel: int, itemsize: int, fused: bool = False) -> tuple[int, int]:
    """Total bytes (read, written) of one update, as separate kernels (``fused=False``) or one fused kernel.

    Unfused: the sum of ``op_traffic``. Fused: one kernel reads once each tensor that exists
    before the step (one that the program reads before any op writes it) and writes once each
    such tensor that the program changes; tensors made inside the step stay in registers.
    """
    if not fused:
        per_op = op_traffic(program, numel, itemsize)
        return sum(r for _, r, _ in per_op), sum(w for _, _, w in per_op)
    existing: list[str] = []
    made: set[str] = set()
    for op in program:
        for name in op.reads:
            if name not in made and name not in existing:
                existing.append(name)
        if op.out not in existing:
            made.add(op.out)
    written = {op.out for op in program} & set(existing)
    size = numel * itemsize
    return len(existing) * size, len(written) * size


def fused_supported(device: torch.device | str) -> bool:
    """Whether this torch has fused optimizer kernels (``fused=True``) for ``device``'s type."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # older torch: fused kernels were CUDA-only
        return torch.device(device).type == "cuda"
    return torch.device(device).type in _get_fused_kernels_supported_devices()


# ---- mini-batch gradients -------------------------------------------------------------------

def toy_regression(n: int, d: int, *, seed: int = 0, noise: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic task: x ~ N(0, I_d) of shape (n, d), y = sin(x @ w) + noise of shape (n, 1), w ~ N(0, I/d)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    w = torch.randn(d, 1, generator=gen) / math.sqrt(d) * 2
    y = torch.sin(x @ w) + noise * torch.randn(n, 1, generator=gen)
    return x, y


def per_sample_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of the squared error of each sample with respect to all parameters: (n, num_params).

    Uses ``torch.func.vmap`` over ``torch.func.grad``; the mean of the rows is the full-batch
    gradient of the mean squared error.
    """
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, p, (xi.unsqueeze(0),))
        return ((out - yi.unsqueeze(0)) ** 2).mean()

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g.reshape(x.shape[0], -1) for g in grads.values()], dim=1)


def minibatch_noise(per_sample: torch.Tensor, batch_size: int, draws: int, *, seed: int = 0) -> float:
    """Mean squared distance between a mini-batch gradient and the full-batch gradient, over ``draws`` batches.

    Each batch takes ``batch_size`` rows of ``per_sample`` without replacement.
    """
    n = per_sample.shape[0]
    if not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be between 1 and {n}, got {batch_size}")
    gen = torch.Generator().manual_seed(seed)
    full = per_sample.mean(dim=0)
    total = 0.0
    for _ in range(draws):
        idx = torch.randperm(n, generator=gen)[:batch_size]
        total += float(((per_sample[idx].mean(dim=0) - full) ** 2).sum())
    return total / draws


def expected_minibatch_noise(per_sample: torch.Tensor, batch_size: int) -> float:
    """E ||g_B - g||^2 for batches drawn without replacement: tr(Sigma) / B * (n - B) / (n - 1)."""
    n = per_sample.shape[0]
    trace = float(((per_sample - per_sample.mean(dim=0)) ** 2).sum()) / n  # population variance, summed
    return trace / batch_size * (n - batch_size) / (n - 1)
