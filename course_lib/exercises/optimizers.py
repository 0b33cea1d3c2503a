"""Chapter 04's grading harness: a step function run side by side with its ``torch.optim`` twin.

``check_against_torch(step_fn, torch.optim.Adam, lr=1e-2, state_keys=("exp_avg", "exp_avg_sq"))``
drives a step function of the shape ``step(p, grad, state, **hyper)`` (``course_lib.optimizers``)
and the torch optimizer on the same parameters and gradients, and fails at the first step where a
parameter, or at the end where a state tensor, differs. The test cells of chapters 04 and 08 call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from course_lib.exercises.checks import NotDoneYet, assert_close, call
from course_lib.optimizers import StepFn

__all__ = ["check_against_torch"]


def check_against_torch(
    step_fn: StepFn,
    torch_cls: type[torch.optim.Optimizer],
    *,
    steps: int = 20,
    seed: int = 0,
    shapes: Sequence[tuple[int, ...]] = ((4, 3), (5,), (2, 3, 2)),
    dtype: torch.dtype = torch.float32,
    grad_scale: float = 1.0,
    model: nn.Module | None = None,
    state_keys: Sequence[str] = (),
    step_only: dict[str, Any] | None = None,
    atol: float = 1e-6,
    rtol: float = 1e-5,
    hint: str = "",
    **hyper: Any,
) -> None:
    """Run ``step_fn`` and ``torch_cls(**hyper)`` side by side for ``steps`` steps; raise AssertionError at the first difference.

    Without ``model``, the parameters are random tensors of ``shapes`` and the gradients random
    (times ``grad_scale``) and fresh at every step; with ``model`` (a module taking (batch, in)
    inputs), the gradients are those of a mean squared error on a fixed random batch, so each
    step depends on the previous one as in training. After every step each parameter is compared;
    after the last, the state tensors named in ``state_keys``. ``step_only`` are keyword arguments
    passed to ``step_fn`` but not to ``torch_cls`` (such as ``decoupled_weight_decay``).
    The student's function is called through ``checks.call``; ``hint`` is appended to a failure's message.
    """
    try:
        _run_side_by_side(step_fn, torch_cls, steps, seed, shapes, dtype, grad_scale, model, state_keys,
                          step_only or {}, atol, rtol, hyper)
    except NotDoneYet:
        raise
    except AssertionError as exc:
        if not hint:
            raise
        raise AssertionError(f"{exc}\nhint: {hint}") from None


def _mse_grads(model: nn.Module, params: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Gradients of mean((model(x) - y)^2) with respect to ``params``, used in place of the model's own parameters."""
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    names = [name for name, _ in model.named_parameters()]
    with torch.enable_grad():
        out = torch.func.functional_call(model, dict(zip(names, leaves)), (x,))
        return torch.autograd.grad(((out - y) ** 2).mean(), leaves)


def _run_side_by_side(
    step_fn: StepFn,
    torch_cls: type[torch.optim.Optimizer],
    steps: int,
    seed: int,
    shapes: Sequence[tuple[int, ...]],
    dtype: torch.dtype,
    grad_scale: float,
    model: nn.Module | None,
    state_keys: Sequence[str],
    step_only: dict[str, Any],
    atol: float,
    rtol: float,
    hyper: dict[str, Any],
) -> None:
    label = (f"{getattr(step_fn, '__name__', 'step_fn')}({_kwargs({**hyper, **step_only})}) "
             f"vs torch.optim.{torch_cls.__name__}({_kwargs(hyper)})")
    gen = torch.Generator().manual_seed(seed)
    if model is not None:
        ref_params = [p.detach().clone().to(dtype).requires_grad_(True) for p in model.parameters()]
        x = torch.randn(8, ref_params[0].shape[-1], generator=gen, dtype=dtype)
        with torch.no_grad():
            out_shape = torch.func.functional_call(
                model, dict(zip([n for n, _ in model.named_parameters()], ref_params)), (x,)).shape
        y = torch.randn(out_shape, generator=gen, dtype=dtype)
    else:
        ref_params = [torch.randn(s, generator=gen, dtype=dtype).requires_grad_(True) for s in shapes]
    mine = [p.detach().clone() for p in ref_params]
    states: list[dict] = [{} for _ in mine]
    reference = torch_cls(ref_params, **hyper)
    grads: Sequence[torch.Tensor]
    my_grads: Sequence[torch.Tensor]
    for step in range(1, steps + 1):
        if model is not None:  # each side's gradient at its own parameters
            grads, my_grads = _mse_grads(model, ref_params, x, y), _mse_grads(model, mine, x, y)
        else:
            grads = [torch.randn(p.shape, generator=gen, dtype=dtype) * grad_scale for p in ref_params]
            my_grads = [g.clone() for g in grads]
        for p, g in zip(ref_params, grads):
            p.grad = g.clone()
        reference.step()
        for i, (p, g) in enumerate(zip(mine, my_grads)):
            before, g_before = p.clone(), g.clone()
            returned = call(step_fn, p, g, states[i], **hyper, **step_only)
            if not torch.equal(g, g_before):
                raise AssertionError(f"{label}: step {step} changed `grad` in place; leave the gradient as it is "
                                     "(use out-of-place ops such as grad.add(...) or grad + ...)")
            if torch.equal(p, before) and not torch.equal(ref_params[i].detach(), before):
                why = ""
                if isinstance(returned, torch.Tensor):
                    why = " (it returned a tensor: update `p` in place instead, e.g. p.add_(...))"
                raise AssertionError(f"{label}: step {step} left parameter {i} unchanged{why}")
            assert_close(p, ref_params[i].detach(), atol=atol, rtol=rtol,
                         name=f"{label}: parameter {i} of shape {tuple(p.shape)} after step {step}")
    for i, p in enumerate(ref_params):
        for key in state_keys:
            if key not in states[i]:
                raise AssertionError(f"{label}: state of parameter {i} has no key {key!r} after {steps} steps "
                                     f"(it has {sorted(states[i])}); torch.optim names it {key!r}")
            assert_close(states[i][key], reference.state[p][key], atol=atol, rtol=rtol,
                         name=f"{label}: state[{key!r}] of parameter {i} after {steps} steps")


def _kwargs(hyper: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in hyper.items())
