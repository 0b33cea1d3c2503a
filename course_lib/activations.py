"""Chapter 04 (activations): activation functions, their derivatives, stable softmax, and two diagnostics.

    from course_lib import activations as act
    act.derivative("gelu", x)            # the analytic derivative, checked against autograd in the tests
    act.softmax(logits, dim=-1)          # subtracts the row maximum: no overflow for huge logits
    act.layer_grad_norms(model)          # per-Linear gradient norms, input side first (vanishing gradients)
    act.dead_unit_fraction(model, x)     # per ReLU, the share of units that output 0 for every row of x
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ACTIVATIONS",
    "DERIVATIVES",
    "derivative",
    "naive_softmax",
    "softmax",
    "log_softmax",
    "init_linear_",
    "layer_grad_norms",
    "dead_unit_fraction",
]

# The element-wise activations the chapter compares, by name.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "relu": torch.relu,
    "gelu": F.gelu,  # the exact form x * Phi(x), Phi the standard normal CDF
}

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _sigmoid_grad(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1 - s)


def _tanh_grad(x: torch.Tensor) -> torch.Tensor:
    return 1 - torch.tanh(x) ** 2


def _relu_grad(x: torch.Tensor) -> torch.Tensor:
    return (x > 0).to(x.dtype)  # PyTorch's convention: the derivative at exactly 0 is 0


def _gelu_grad(x: torch.Tensor) -> torch.Tensor:
    cdf = 0.5 * (1 + torch.erf(x * _INV_SQRT_2))
    pdf = _INV_SQRT_2PI * torch.exp(-0.5 * x * x)
    return cdf + x * pdf


DERIVATIVES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": _sigmoid_grad,
    "tanh": _tanh_grad,
    "relu": _relu_grad,
    "gelu": _gelu_grad,
}


def derivative(name: str, x: torch.Tensor) -> torch.Tensor:
    """The analytic derivative of activation ``name`` (a key of ``ACTIVATIONS``) at every element of ``x``."""
    if name not in DERIVATIVES:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(DERIVATIVES)}")
    return DERIVATIVES[name](x)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16 and bf16 are computed in fp32 (as PyTorch's softmax does); fp32 and fp64 as they are."""
    return torch.promote_types(dtype, torch.float32)


def naive_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """exp(x) / sum(exp(x)) literally: overflows to inf/inf = NaN once a logit passes the dtype's exp range."""
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Numerically stable softmax along ``dim``: exp(x - max) / sum(exp(x - max)), same shape and dtype as ``x``.

    fp16 and bf16 inputs are computed in fp32 and rounded once at the end. Entries of -inf get
    probability 0; a slice whose entries are all -inf has no distribution and gives NaN, as in
    ``torch.softmax``.
    """
    z = x.to(_compute_dtype(x.dtype))
    shifted = z - z.amax(dim=dim, keepdim=True)
    e = torch.exp(shifted)
    return (e / e.sum(dim=dim, keepdim=True)).to(x.dtype)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Numerically stable log-softmax along ``dim``: (x - max) - log(sum(exp(x - max))), same shape and dtype as ``x``."""
    z = x.to(_compute_dtype(x.dtype))
    shifted = z - z.amax(dim=dim, keepdim=True)
    return (shifted - torch.log(torch.exp(shifted).sum(dim=dim, keepdim=True))).to(x.dtype)


def init_linear_(model: nn.Module, scheme: str) -> nn.Module:
    """Re-initialise every Linear of ``model`` in place and return it: zero biases, and weights by ``scheme``.

    ``"xavier"``: Glorot normal, variance 2 / (fan_in + fan_out), meant for tanh and sigmoid.
    ``"kaiming"``: He normal, variance 2 / fan_in, meant for ReLU. ``"default"`` leaves PyTorch's
    own initialisation (uniform with variance 1 / (3 fan_in)) untouched, biases included.
    """
    if scheme not in ("xavier", "kaiming", "default"):
        raise ValueError(f"scheme must be 'xavier', 'kaiming' or 'default', got {scheme!r}")
    if scheme == "default":
        return model
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                if scheme == "xavier":
                    nn.init.xavier_normal_(module.weight)
                else:
                    nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
    return model


def layer_grad_norms(model: nn.Module) -> list[float]:
    """Frobenius norm of each Linear layer's weight gradient, in the order the layers were registered.

    Call it after ``loss.backward()``. A layer whose weight has no gradient yet counts as 0.0.
    """
    norms = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            grad = module.weight.grad
            norms.append(0.0 if grad is None else float(grad.detach().norm()))
    return norms


def dead_unit_fraction(model: nn.Module, x: torch.Tensor, activation: type[nn.Module] = nn.ReLU) -> list[float]:
    """For each ``activation`` module of ``model``, the fraction of its units that output 0 for every row of ``x``.

    A ReLU unit that is zero for all inputs also has zero gradient for all of them, so no
    gradient step can revive it through its own weights: it is "dead". ``x`` is (rows, features);
    the model runs once, without gradients, with a forward hook on each activation module.
    """
    outputs: list[torch.Tensor] = []

    def keep(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
        outputs.append(output.detach())

    hooks = [m.register_forward_hook(keep) for m in model.modules() if isinstance(m, activation)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return [float((out.reshape(out.shape[0], -1) == 0).all(dim=0).float().mean()) for out in outputs]
