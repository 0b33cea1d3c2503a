"""Chapter 06 (mixed precision): autocast, fp32 master weights, loss scaling, gradient underflow.

Mixed precision training (Micikevicius et al. 2018, "Mixed Precision Training") runs the forward
and backward pass in a 16-bit format, keeps an fp32 master copy of the weights for the optimizer
step, and for fp16 multiplies the loss by a scale factor so that small gradients do not underflow.
This module holds the reference pieces, written to match PyTorch step by step:

    from course_lib import mixed_precision as mp
    scaler = mp.DynamicLossScaler()              # behaves like torch.amp.GradScaler
    mw = mp.MasterWeights(model, torch.bfloat16) # 16-bit working copy + fp32 master params
    loss = mp.mixed_precision_step(mw.model, mw.params, opt, scaler, mp.gpt_loss(x, y))
    mp.underflow_fraction(grads, torch.float16)  # share of nonzero values that cast to 0
    mp.clipped_scaled_step(loss_fn, opt, state, max_norm=1.0)   # loss scaling + clipping, GradScaler's order
    mp.autocast_step(model, opt, x, y, torch.bfloat16)          # the autocast style of a step
    mp.measure_step(step, params, opt, device)                  # time per step and the bytes it holds
    mp.autocast_dtypes(model, (x,), "cpu", torch.bfloat16)      # [(op, output dtype), ...]

fp8 compute (scaled casts, ``torch._scaled_mm``) lives in ``course_lib.fp8``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib import memory_math as mm
from course_lib.profiling import Timing, benchmark
from course_lib.support.sizes import tensor_bytes

__all__ = [
    "underflow_fraction",
    "subnormal_fraction",
    "sample_values",
    "log2_magnitudes",
    "unscale_and_check",
    "update_scale",
    "StaticLossScaler",
    "DynamicLossScaler",
    "MasterWeights",
    "grads_to_master",
    "master_to_model",
    "gpt_loss",
    "mixed_precision_step",
    "clipped_scaled_step",
    "autocast_step",
    "StepMeasurement",
    "measure_step",
    "autocast_dtypes",
]

# ---- gradient underflow ----------------------------------------------------------------------


def _flat(grads: torch.Tensor | Iterable[torch.Tensor | None]) -> torch.Tensor:
    if isinstance(grads, torch.Tensor):
        return grads.detach().reshape(-1).to(torch.float64)
    parts = [g.detach().reshape(-1).to(torch.float64) for g in grads if g is not None]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def underflow_fraction(grads: torch.Tensor | Iterable[torch.Tensor | None], dtype: torch.dtype) -> float:
    """Fraction of the nonzero values in ``grads`` that become zero when cast to ``dtype``.

    ``grads`` is a tensor or a list of tensors (``None`` entries are skipped). The cast rounds to
    nearest, ties to even, so a magnitude up to half the smallest subnormal (that half included)
    becomes 0. Zeros are not counted at all; with no nonzero value the fraction is 0.0.
    """
    x = _flat(grads)
    nonzero = x != 0
    n = int(nonzero.sum())
    if n == 0:
        return 0.0
    flushed = nonzero & (x.to(dtype) == 0)
    return int(flushed.sum()) / n


def subnormal_fraction(grads: torch.Tensor | Iterable[torch.Tensor | None], dtype: torch.dtype) -> float:
    """Fraction of the nonzero values that land among ``dtype``'s subnormals (nonzero, below the smallest normal)."""
    x = _flat(grads)
    nonzero = x != 0
    n = int(nonzero.sum())
    if n == 0:
        return 0.0
    y = x.to(dtype).abs()
    sub = (y != 0) & (y < torch.finfo(dtype).tiny)
    return int((sub & nonzero).sum()) / n


def sample_values(grads: torch.Tensor | Iterable[torch.Tensor | None], limit: int = 2**22, seed: int = 0) -> torch.Tensor:
    """The values of ``grads`` flattened (float64, on their device); ``limit`` of them drawn at random (seeded) if more.

    A histogram or a fraction of a random sample of a few million values looks like that of all
    the values, at a fraction of the cost when there are hundreds of millions (GPT-2's gradients).
    """
    x = _flat(grads)
    if x.numel() <= limit:
        return x
    gen = torch.Generator(device=x.device).manual_seed(seed)
    return x[torch.randint(x.numel(), (limit,), generator=gen, device=x.device)]


def log2_magnitudes(grads: torch.Tensor | Iterable[torch.Tensor | None]) -> np.ndarray:
    """log2 |g| of the nonzero gradient values, as float64 NumPy (for histograms)."""
    x = _flat(grads)
    x = x[x != 0]
    return torch.log2(x.abs()).cpu().numpy()


# ---- loss scalers ----------------------------------------------------------------------------


def _f32(x: float) -> float:
    """Round a Python float to float32 (GradScaler keeps its scale in an fp32 tensor)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def unscale_and_check(grads: Iterable[torch.Tensor | None], scale: float) -> bool:
    """Multiply every gradient in place by 1/``scale``; return True if any value is inf or NaN.

    Like ``torch._amp_foreach_non_finite_check_and_unscale_``: the reciprocal is taken in fp64,
    rounded to fp32, and every gradient (finite or not) is multiplied by it.
    """
    inv = _f32(1.0 / float(scale))
    found = False
    with torch.no_grad():
        for g in grads:
            if g is None:
                continue
            if not bool(torch.isfinite(g).all()):
                found = True
            g.mul_(inv)
    return found


def update_scale(
    scale: float,
    growth_tracker: int,
    found_inf: bool,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> tuple[float, int]:
    """One update of a dynamic loss scale: (new scale, new count of overflow-free steps).

    Like ``torch._amp_update_scale_``: an overflow multiplies the scale by ``backoff_factor``
    and resets the count; otherwise the count grows by one, and when it reaches
    ``growth_interval`` the scale is multiplied by ``growth_factor`` (if that stays finite in
    fp32) and the count restarts at 0. The scale is kept as an fp32 value.
    """
    if found_inf:
        return _f32(scale * backoff_factor), 0
    successful = growth_tracker + 1
    if successful == growth_interval:
        grown = _f32(scale * growth_factor)
        return (grown if np.isfinite(grown) else _f32(scale)), 0
    return _f32(scale), successful


def _optimizer_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


class StaticLossScaler:
    """A fixed loss scale: scale the loss, unscale the gradients, skip a step whose gradients hold inf or NaN.

    Same interface as ``DynamicLossScaler`` (and ``torch.amp.GradScaler``): ``scale``,
    ``unscale_``, ``step``, ``update``, ``get_scale``; ``update`` leaves the scale alone.
    """

    def __init__(self, scale: float = 2.0**10) -> None:
        if not scale > 0:
            raise ValueError(f"the loss scale must be positive, got {scale}")
        self._scale = _f32(scale)
        self.found_inf: bool | None = None
        self._unscaled = False
        self.skipped_steps = 0

    def get_scale(self) -> float:
        """The current loss scale."""
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the scale (an fp32 0-dim factor, as GradScaler multiplies)."""
        return loss * torch.tensor(self._scale, dtype=torch.float32, device=loss.device)

    def unscale(self, grads: Iterable[torch.Tensor | None]) -> bool:
        """Divide ``grads`` in place by the scale; record and return whether one was not finite."""
        self.found_inf = unscale_and_check(grads, self._scale)
        return self.found_inf

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the gradients of ``optimizer``'s parameters in place (once per step)."""
        if self._unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        self.unscale(_optimizer_grads(optimizer))
        self._unscaled = True

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale if not yet done, then step ``optimizer`` unless a gradient is inf/NaN; True if it stepped."""
        if not self._unscaled:
            self.unscale_(optimizer)
        if self.found_inf:
            self.skipped_steps += 1
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """End the step: a static scale does not change."""
        if self.found_inf is None:
            raise RuntimeError("update() called before any unscale/step: no inf checks were recorded")
        self._unscaled = False
        self.found_inf = None


class DynamicLossScaler(StaticLossScaler):
    """Dynamic loss scaling that follows ``torch.amp.GradScaler`` step by step.

    Start at ``init_scale``; a step whose gradients overflow is skipped and the scale multiplied by
    ``backoff_factor``; after ``growth_interval`` overflow-free steps in a row the scale is
    multiplied by ``growth_factor``. ``history`` lists (scale used, found_inf) per step.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        update_fn: Callable[..., tuple[float, int]] = update_scale,
    ) -> None:
        super().__init__(init_scale)
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0
        self.update_fn = update_fn
        self.history: list[tuple[float, bool]] = []

    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps (see ``update_scale``)."""
        if self.found_inf is None:
            raise RuntimeError("update() called before any unscale/step: no inf checks were recorded")
        self.history.append((self._scale, bool(self.found_inf)))
        scale, tracker = self.update_fn(
            self._scale, self.growth_tracker, bool(self.found_inf),
            self.growth_factor, self.backoff_factor, self.growth_interval,
        )
        self._scale, self.growth_tracker = float(scale), int(tracker)
        self._unscaled = False
        self.found_inf = None


# ---- fp32 master weights ---------------------------------------------------------------------


class MasterWeights:
    """A 16-bit working copy of ``model`` (``.model``) and fp32 master copies of its parameters (``.params``).

    The master parameters start as exact fp32 copies of ``model``'s parameters (not of the rounded
    16-bit ones); the optimizer is built on ``.params``.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.model = copy.deepcopy(model).to(dtype)
        self.params = [nn.Parameter(p.detach().to(torch.float32).clone()) for p in model.parameters()]

    def grads_to_master(self) -> None:
        """Copy the 16-bit gradients up into fp32 ``.grad`` of the master parameters."""
        grads_to_master(self.model, self.params)

    def master_to_model(self) -> None:
        """Round the master parameters down into the 16-bit model."""
        master_to_model(self.model, self.params)


def grads_to_master(model_lowp: nn.Module, master_params: Sequence[torch.Tensor]) -> None:
    """Set each master parameter's ``.grad`` to the fp32 copy of the 16-bit gradient (zeros where none)."""
    for p, m in zip(model_lowp.parameters(), master_params, strict=True):
        m.grad = torch.zeros_like(m) if p.grad is None else p.grad.detach().to(torch.float32)


def master_to_model(model_lowp: nn.Module, master_params: Sequence[torch.Tensor]) -> None:
    """Copy the master parameters into the model's parameters, rounding to their dtype."""
    with torch.no_grad():
        for p, m in zip(model_lowp.parameters(), master_params, strict=True):
            p.copy_(m)


def gpt_loss(inputs: torch.Tensor, targets: torch.Tensor) -> Callable[[nn.Module], torch.Tensor]:
    """A loss function for ``mixed_precision_step``: the model's logits, cast to fp32, into cross-entropy."""

    def loss_fn(model: nn.Module) -> torch.Tensor:
        logits, _ = model(inputs)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return loss_fn


def mixed_precision_step(
    model_lowp: nn.Module,
    master_params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    loss_fn: Callable[[nn.Module], torch.Tensor],
) -> float:
    """One training step with fp32 master weights; returns the (unscaled) loss as a Python float.

    1. clear the gradients of the 16-bit model and of the master parameters;
    2. forward and backward through the 16-bit model, on ``scaler.scale(loss)`` if a scaler is given;
    3. copy the 16-bit gradients up to fp32 ``.grad`` of ``master_params``;
    4. ``scaler.step(optimizer)`` then ``scaler.update()`` (or ``optimizer.step()`` without scaler);
    5. copy the master parameters back down into the 16-bit model.
    """
    model_lowp.zero_grad(set_to_none=True)
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model_lowp)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    grads_to_master(model_lowp, master_params)
    if scaler is None:
        optimizer.step()
    else:  # unscales the master gradients, skips the step if one is inf/NaN, adjusts the scale
        scaler.step(optimizer)
        scaler.update()
    master_to_model(model_lowp, master_params)
    return float(loss.detach())


# ---- loss scaling with gradient clipping ----------------------------------------------------


def clipped_scaled_step(
    loss_fn: Callable[[], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    max_norm: float,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> float | None:
    """One step with a dynamic loss scale and gradient clipping; the gradient norm before clipping, None if skipped.

    ``state`` holds ``"scale"`` and ``"growth_tracker"`` and is updated in place. In order: clear
    the gradients; backward on ``loss_fn() * scale``; unscale every gradient of every parameter
    group and look for inf/NaN; with none, clip the *unscaled* gradients to total norm
    ``max_norm`` and step, with one, do neither; then update the scale. Equal to
    ``GradScaler.scale(loss).backward(); unscale_(opt); clip_grad_norm_(params, max_norm); step(opt); update()``.
    """
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn()
    (loss * torch.tensor(_f32(state["scale"]), dtype=torch.float32, device=loss.device)).backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    found_inf = unscale_and_check([p.grad for p in params], state["scale"])
    norm = None
    if not found_inf:  # clipping scaled gradients would compare s * |g| with max_norm
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        optimizer.step()
    state["scale"], state["growth_tracker"] = update_scale(
        state["scale"], state["growth_tracker"], found_inf, growth_factor, backoff_factor, growth_interval)
    return norm


# ---- autocast: which op ran in which dtype --------------------------------------------------


class _RecordDtypes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(first, torch.Tensor):
            self.records.append((func.overloadpacket.__name__, first.dtype))
        return out


def autocast_dtypes(
    model: Callable[..., Any], inputs: Sequence[Any], device_type: str, dtype: torch.dtype
) -> list[tuple[str, torch.dtype]]:
    """Run ``model(*inputs)`` under ``torch.autocast(device_type, dtype)``; list (aten op, output dtype) in call order.

    The ops are seen below autocast, so the casts it inserts show up as ``_to_copy``.
    """
    mode = _RecordDtypes()
    with torch.no_grad(), torch.autocast(device_type, dtype=dtype), mode:
        model(*inputs)
    return mode.records


# ---- autocast end to end: a step, its time and its memory ------------------------------------


def autocast_step(
    model: Callable[..., Any],
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    dtype: torch.dtype | None = None,
    scaler: Any = None,
) -> float:
    """One training step of an fp32 model, forward and loss under ``torch.autocast(dtype)``; returns the loss.

    ``model(inputs, targets)`` returns (logits, loss), as the course's GPT does. The backward pass
    and the optimizer step run outside autocast. ``dtype=None`` is the plain fp32 step. With a
    ``scaler`` (``torch.amp.GradScaler`` or this module's): backward on ``scaler.scale(loss)``,
    then ``scaler.step(optimizer)`` and ``scaler.update()``.
    """
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(inputs.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        _, loss = model(inputs, targets)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return float(loss.detach())


@dataclass(frozen=True)
class StepMeasurement:
    """Time per training step and the bytes it holds.

    ``state_bytes``: weights, gradients and optimizer states after a step; ``saved_bytes``: the
    peak of what autograd saved for the backward pass during a step (parameters excluded; None when
    not counted);
    ``cuda_peak_bytes``: on a CUDA device, the allocator's peak during a step (everything:
    states, saved tensors, temporaries, autocast's casts); None elsewhere.
    """

    seconds: Timing
    state_bytes: int
    saved_bytes: int | None
    cuda_peak_bytes: int | None


def measure_step(
    step: Callable[[], Any],
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    device: torch.device | str,
    warmup: int = 2,
    repeat: int = 5,
    count_saved: bool = True,
) -> StepMeasurement:
    """Time ``step()`` with ``profiling.benchmark`` and measure its memory (see ``StepMeasurement``).

    ``params`` lists every tensor the step trains (a 16-bit model's and its fp32 masters both);
    their ``.grad`` and ``optimizer.state`` count as state too. ``count_saved=False`` skips the
    saved-tensor hooks (a compiled model would be traced again under them).
    """
    device = torch.device(device)
    seconds = benchmark(step, warmup=warmup, repeat=repeat, device=device)
    saved = None
    if count_saved:
        with mm.SavedBytesTracker() as tracker:
            step()
        saved = tracker.peak
    state = tensor_bytes(list(params)) + tensor_bytes([p.grad for p in params]) + tensor_bytes(optimizer.state)
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    return StepMeasurement(seconds, state, saved, peak)
