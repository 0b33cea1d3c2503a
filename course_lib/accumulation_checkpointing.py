"""Chapter 07 (gradient accumulation and activation checkpointing): trading time for memory.

Gradient accumulation runs a large batch as k smaller micro-batches and adds their gradients
before one optimizer step, so activation memory follows the micro-batch while the update follows
the whole batch. Activation checkpointing (Chen et al. 2016) keeps only the inputs of a few
segments of the network during the forward pass and recomputes each segment's activations in
the backward pass: about one extra forward pass buys a peak of roughly
``segments * input_bytes + (n_layers / segments) * layer_bytes``, smallest near sqrt(n_layers)
segments.

    from course_lib import accumulation_checkpointing as ac
    grads = ac.accumulated_gradients(model, loss_fn, (x, y), micro_batches=4)
    y = ac.checkpointed_sequential(list(model), segments=3, x=x)
    ac.segment_bounds(10, 3)                     # [(0, 4), (4, 7), (7, 10)]
    ac.best_segments(16, layer_bytes=4e6, input_bytes=1e6, budget=20e6)
    ac.peak_saved_bytes(lambda t: ac.checkpointed_sequential(layers, 4, t), x)  # measured, CPU too
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib import memory_math as mm

__all__ = [
    "split_micro_batches",
    "full_batch_gradients",
    "accumulate",
    "accumulated_gradients",
    "accumulation_step",
    "segment_bounds",
    "checkpointed_sequential",
    "plain_sequential",
    "peak_activation_model",
    "best_segments",
    "sqrt_segments",
    "fit_plan",
    "forward_backward",
    "peak_saved_bytes",
    "cuda_peak_bytes",
]

LossFn = Callable[..., torch.Tensor]


# ---- gradient accumulation -----------------------------------------------------------------------

def split_micro_batches(batch: Sequence[torch.Tensor], micro_batches: int) -> list[tuple[torch.Tensor, ...]]:
    """Cut every tensor of ``batch`` along dim 0 into ``micro_batches`` equal parts.

    Raises ValueError unless ``micro_batches`` is a positive integer that divides the batch size:
    with unequal parts, averaging the micro-batch means would weight samples unequally.
    """
    tensors = tuple(batch)
    if not tensors:
        raise ValueError("batch must hold at least one tensor")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    n = tensors[0].shape[0]
    if any(t.shape[0] != n for t in tensors):
        raise ValueError(f"all tensors of a batch need the same first dimension, got {[t.shape[0] for t in tensors]}")
    if n % micro_batches:
        raise ValueError(f"batch size {n} does not split into {micro_batches} equal micro-batches")
    size = n // micro_batches
    return [tuple(t[i * size:(i + 1) * size] for t in tensors) for i in range(micro_batches)]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def full_batch_gradients(model: nn.Module, loss_fn: LossFn, batch: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of ``loss_fn(model(inputs), target)`` over the whole batch, one per parameter (copies)."""
    *inputs, target = batch
    model.zero_grad(set_to_none=True)
    loss_fn(model(*inputs), target).backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return grads


def accumulate(
    model: nn.Module, loss_fn: LossFn, batch: Sequence[torch.Tensor], micro_batches: int, reduction: str = "mean"
) -> float:
    """Add the gradient of the batch's loss into ``.grad``, one micro-batch at a time; return the batch's loss.

    ``reduction`` says what ``loss_fn`` returns for a micro-batch. ``"mean"``: each micro-batch
    loss is divided by ``micro_batches`` before ``backward``, since the sum of k means of equal
    parts, each over k, is the mean over the whole batch. ``"sum"``: the micro-batch sums add up
    to the batch's sum unscaled. ``.grad`` is not zeroed here. The losses are added on the device
    and read once at the end: a ``.item()`` per micro-batch would make the host wait for the GPU
    k times per step, and the host could no longer queue the next micro-batch ahead.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    scale = micro_batches if reduction == "mean" else 1
    losses = []
    for *inputs, target in split_micro_batches(batch, micro_batches):
        loss = loss_fn(model(*inputs), target) / scale
        loss.backward()
        losses.append(loss.detach())
    return float(torch.stack(losses).sum())


def accumulated_gradients(
    model: nn.Module, loss_fn: LossFn, batch: Sequence[torch.Tensor], micro_batches: int, reduction: str = "mean"
) -> list[torch.Tensor]:
    """Gradients of the whole batch's loss computed in ``micro_batches`` parts; one tensor per parameter."""
    model.zero_grad(set_to_none=True)
    accumulate(model, loss_fn, batch, micro_batches, reduction)
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return grads


def accumulation_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    batch: Sequence[torch.Tensor],
    micro_batches: int,
    reduction: str = "mean",
) -> float:
    """One optimizer step on ``batch`` computed in ``micro_batches`` parts; returns the batch's loss.

    Zeroes the gradients, accumulates the micro-batch gradients (scaled by 1/k for a mean loss,
    see ``accumulate``), steps once. ValueError when the batch does not split into equal parts.
    With a model without batch-dependent layers the step equals one step on the whole batch.
    """
    optimizer.zero_grad(set_to_none=True)
    loss = accumulate(model, loss_fn, batch, micro_batches, reduction)
    optimizer.step()
    return loss


# ---- activation checkpointing --------------------------------------------------------------------

def segment_bounds(n_layers: int, segments: int) -> list[tuple[int, int]]:
    """Split layers 0..n_layers-1 into ``segments`` consecutive runs as equal as possible.

    Returns half-open ``(start, end)`` pairs; when the split is uneven the first
    ``n_layers % segments`` segments get one layer more. ValueError unless
    1 <= segments <= n_layers.
    """
    if not isinstance(n_layers, int) or not isinstance(segments, int):
        raise ValueError(f"n_layers and segments must be integers, got {n_layers!r}, {segments!r}")
    if n_layers < 1 or not 1 <= segments <= n_layers:
        raise ValueError(f"need 1 <= segments <= n_layers, got segments={segments}, n_layers={n_layers}")
    base, extra = divmod(n_layers, segments)
    bounds, start = [], 0
    for i in range(segments):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _run(modules: Sequence[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    for m in modules:
        x = m(x)
    return x


def checkpointed_sequential(
    modules: Sequence[Callable[[torch.Tensor], torch.Tensor]], segments: int, x: torch.Tensor
) -> torch.Tensor:
    """Apply ``modules`` in order to ``x``, checkpointing each of ``segments`` segments.

    During the forward pass only each segment's input is kept; the backward pass reruns the
    segment (with the random-number state of the first run, so dropout draws the same mask) to get
    the activations it needs. Same outputs and gradients as the plain loop.
    """
    modules = list(modules)
    for start, end in segment_bounds(len(modules), segments):
        x = checkpoint(_run, modules[start:end], x, use_reentrant=False, preserve_rng_state=True)
    return x


def plain_sequential(modules: Sequence[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """Apply ``modules`` in order to ``x`` without checkpointing (the baseline)."""
    return _run(list(modules), x)


def peak_activation_model(n_layers: int, layer_bytes: float, input_bytes: float, segments: int | None) -> float:
    """Modelled peak activation bytes of a chain of ``n_layers`` identical layers in ``segments`` checkpointed segments.

    The forward pass keeps ``segments`` segment inputs of ``input_bytes`` each; the backward pass
    recomputes one segment at a time, which holds its layers' activations (``layer_bytes`` per
    layer) next to them: peak = segments * input_bytes + longest segment * layer_bytes.
    ``segments=None`` (or 0) is plain training: every layer's activations, n_layers * layer_bytes.
    """
    if n_layers < 1 or layer_bytes < 0 or input_bytes < 0:
        raise ValueError(f"need n_layers >= 1 and bytes >= 0, got {n_layers}, {layer_bytes}, {input_bytes}")
    if not segments:
        return n_layers * layer_bytes
    longest = max(end - start for start, end in segment_bounds(n_layers, segments))
    return segments * input_bytes + longest * layer_bytes


def best_segments(n_layers: int, layer_bytes: float, input_bytes: float, budget: float) -> int:
    """Number of segments to use under an activation ``budget`` (bytes), by the peak model.

    0 when plain training already fits (no recomputation needed); otherwise the segment count with
    the smallest modelled peak (the fewest segments among equal peaks). ValueError when even that
    peak exceeds the budget.
    """
    if budget < 0:
        raise ValueError(f"budget must not be negative, got {budget}")
    if peak_activation_model(n_layers, layer_bytes, input_bytes, None) <= budget:
        return 0
    peaks = {s: peak_activation_model(n_layers, layer_bytes, input_bytes, s) for s in range(1, n_layers + 1)}
    best = min(peaks, key=lambda s: (peaks[s], s))
    if peaks[best] > budget:
        raise ValueError(
            f"no segment count fits: the smallest modelled peak is {peaks[best]:.4g} bytes "
            f"(segments={best}), above the budget of {budget:.4g}"
        )
    return best


def sqrt_segments(n_layers: int) -> int:
    """Chen et al.'s rule of thumb: about sqrt(n_layers) segments, rounded, at least 1."""
    return max(1, min(n_layers, round(math.sqrt(n_layers))))


def fit_plan(
    n_layers: int,
    layer_bytes_per_sample: float,
    input_bytes_per_sample: float,
    batch_size: int,
    budget: float,
) -> tuple[int, int]:
    """Choose (micro_batches, segments) so one micro-batch's modelled activation peak fits ``budget``.

    Prefers the fewest micro-batches (least loss of parallelism), then plain training over
    checkpointing (segments 0); micro-batch counts are the divisors of ``batch_size``.
    ValueError when even one sample per micro-batch does not fit.
    """
    for k in (d for d in range(1, batch_size + 1) if batch_size % d == 0):
        b = batch_size // k
        try:
            s = best_segments(n_layers, layer_bytes_per_sample * b, input_bytes_per_sample * b, budget)
        except ValueError:
            continue
        return k, s
    raise ValueError(f"even a micro-batch of one sample does not fit in {budget:.4g} bytes")


def forward_backward(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """One forward and backward pass of ``fn`` on ``x`` (sum of the output as the loss); for timing."""
    fn(x).sum().backward()


def cuda_peak_bytes(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> int:
    """On a CUDA device: peak bytes allocated above the start during one forward and backward pass of ``fn``."""
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_peak_bytes needs a CUDA device")
    forward_backward(fn, x)  # warm-up: one-time allocations are not counted
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    forward_backward(fn, x)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def peak_saved_bytes(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> int:
    """Peak live saved-activation bytes over one forward and backward pass of ``fn`` on ``x``, recomputation included."""
    with mm.SavedBytesTracker() as tracker:
        forward_backward(fn, x)
    return tracker.peak
