"""Chapter 07 (gradient accumulation and activation checkpointing): trading time for memory.

Gradient accumulation runs a large batch as k smaller micro-batches and adds their gradients
before one optimizer step, so activation memory follows the micro-batch while the update follows
the whole batch. For a language model the batch's loss is a mean over target tokens, so each
micro-batch's summed loss is divided by the token count of the *whole* batch, not averaged per
micro-batch. Activation checkpointing (Chen et al. 2016) keeps only the inputs of a few segments
of the network during the forward pass and recomputes each segment, with the same random
numbers, in the backward pass: about one extra forward pass buys a peak of roughly
``segments * input_bytes + (n_layers / segments) * layer_bytes``.

    from course_lib import accumulation_checkpointing as ac
    grads = ac.accumulated_gradients(model, loss_fn, (x, y), micro_batches=4)
    loss = ac.accumulation_step(lm, optimizer, [(idx1, tgt1), (idx2, tgt2)])   # token-normalised
    y = ac.checkpointed_sequential(list(model), segments=3, x=x)               # ac.CheckpointSegment
    ac.peak_saved_bytes(lambda t: ac.checkpointed_sequential(layers, 4, t), x)  # measured, CPU too
    ac.fit_plan(measure, n_layers=16, batch_size=8, budget=20e6)               # (micro_batches, segments)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import memory_math as mm

__all__ = [
    "split_micro_batches",
    "full_batch_gradients",
    "accumulate",
    "accumulated_gradients",
    "token_loss_sum",
    "count_targets",
    "join_micro_batches",
    "lm_gradients",
    "accumulation_step",
    "segment_bounds",
    "CheckpointSegment",
    "checkpointed_sequential",
    "plain_sequential",
    "forward_backward",
    "peak_saved_bytes",
    "cuda_peak_bytes",
    "peak_activation_model",
    "sqrt_segments",
    "fit_plan",
]

LossFn = Callable[..., torch.Tensor]
Batch = Sequence[tuple[torch.Tensor, torch.Tensor]]


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
    k times per step.
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


# ---- language models: normalise by target tokens ------------------------------------------------

def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Cross-entropy summed over the targets that are not ``ignore_index``; logits are (*targets.shape, vocab)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index, reduction="sum")


def count_targets(micro_batches: Batch, ignore_index: int = -100) -> int:
    """Number of targets that are not ``ignore_index`` over all micro-batches ``(inputs, targets)``."""
    return int(sum(int((targets != ignore_index).sum()) for _, targets in micro_batches))


def join_micro_batches(micro_batches: Batch, ignore_index: int = -100, pad_token: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The one big batch of token micro-batches ``(inputs, targets)`` of shape (b_i, t_i).

    Every micro-batch is padded on the right to the longest t_i (inputs with ``pad_token``, targets
    with ``ignore_index``), then all are stacked along dim 0. For a causal model the padding
    changes no logit of a real position, and the ignored targets add nothing to the loss.
    """
    length = max(t.shape[1] for _, t in micro_batches)
    inputs = torch.cat([F.pad(i, (0, length - i.shape[1]), value=pad_token) for i, _ in micro_batches])
    targets = torch.cat([F.pad(t, (0, length - t.shape[1]), value=ignore_index) for _, t in micro_batches])
    return inputs, targets


def lm_gradients(model: nn.Module, micro_batches: Batch, ignore_index: int = -100,
                 per_micro_batch_mean: bool = False) -> list[torch.Tensor]:
    """Gradients of a language model's loss accumulated over ``micro_batches``; one tensor per parameter.

    By default each micro-batch's summed loss is divided by the target count of all of them: the
    big batch's token mean. ``per_micro_batch_mean=True`` is the classic bug: the mean of each
    micro-batch, divided by the number of micro-batches (NaN where a micro-batch is all padding).
    """
    total = count_targets(micro_batches, ignore_index)
    model.zero_grad(set_to_none=True)
    for inputs, targets in micro_batches:
        logits = model(inputs)
        if per_micro_batch_mean:  # F.cross_entropy's default mean: over this micro-batch's targets (0/0 if none)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=ignore_index) / len(micro_batches)
        else:
            loss = token_loss_sum(logits, targets, ignore_index) / total
        loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return grads


def accumulation_step(model: Callable[[torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer,
                      micro_batches: Batch, ignore_index: int = -100) -> float:
    """One optimizer step of a language model on ``micro_batches``; returns the mean loss per target token.

    ``model(inputs)`` gives logits of shape (*targets.shape, vocab). The targets equal to
    ``ignore_index`` (padding) count for nothing. Each micro-batch runs its forward and backward
    pass before the next one starts, and its summed loss is divided by the number of counted
    targets of *all* micro-batches, so the accumulated gradient is the big batch's, whatever the
    sizes and paddings (a micro-batch of padding only adds zero). ValueError when no target counts.
    """
    total = count_targets(micro_batches, ignore_index)
    if total == 0:
        raise ValueError("no target token to learn from: every target is ignore_index")
    optimizer.zero_grad(set_to_none=True)
    losses = []
    for inputs, targets in micro_batches:
        loss = token_loss_sum(model(inputs), targets, ignore_index)
        (loss / total).backward()
        losses.append(loss.detach())  # on the device: read once, after the loop
    optimizer.step()
    return float(torch.stack(losses).sum()) / total


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


class CheckpointSegment(torch.autograd.Function):
    """``CheckpointSegment.apply(run, x, *params)``: ``run(x)``, keeping only x and the random-number state.

    ``forward`` runs the segment without building a graph (autograd runs it under no_grad) and
    saves x, the CPU random state and, for a CUDA input, that device's. ``backward`` replays the
    random state inside ``fork_rng`` (so dropout draws the same masks, and the random stream of
    the rest of training is left as it was), reruns the segment with grad enabled and
    backpropagates ``grad_out`` through it. ``params`` (the segment's parameters) are inputs of the
    node so that autograd asks for their gradients even when x does not require grad.
    """

    @staticmethod
    def forward(ctx: Any, run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        """The segment's output; nothing of its inside is kept."""
        ctx.run, ctx.params = run, params
        ctx.cpu_state = torch.get_rng_state()
        ctx.cuda_state = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Recompute the segment from the saved input and random state, then backpropagate through it."""
        (x,) = ctx.saved_tensors
        devices = [x.device] if ctx.cuda_state is not None else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.set_rng_state(ctx.cpu_state)
            if ctx.cuda_state is not None:
                torch.cuda.set_rng_state(ctx.cuda_state, x.device)
            x_again = x.detach().requires_grad_(ctx.needs_input_grad[1])
            y = ctx.run(x_again)
        wanted = [t for t, need in zip((x_again, *ctx.params), ctx.needs_input_grad[1:]) if need]
        found = iter(torch.autograd.grad(y, wanted, grad_out, allow_unused=True))
        return (None, *(next(found) if need else None for need in ctx.needs_input_grad[1:]))


def _run(modules: Sequence[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    for m in modules:
        x = m(x)
    return x


def checkpointed_sequential(modules: Sequence[nn.Module], segments: int, x: torch.Tensor) -> torch.Tensor:
    """Apply ``modules`` in order to ``x``, each of ``segments`` near-equal segments a ``CheckpointSegment``.

    Only the segment inputs are kept after the forward pass; the backward pass reruns each segment
    once, with the random numbers of its first run. Same outputs and gradients as the plain loop.
    """
    modules = list(modules)
    for start, end in segment_bounds(len(modules), segments):
        chunk = modules[start:end]
        params = list(dict.fromkeys(p for m in chunk for p in m.parameters()))  # a shared weight once
        x = CheckpointSegment.apply(functools.partial(_run, chunk), x, *params)
    return x


def plain_sequential(modules: Sequence[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """Apply ``modules`` in order to ``x`` without checkpointing (the baseline)."""
    return _run(list(modules), x)


def forward_backward(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """One forward and backward pass of ``fn`` on ``x`` (sum of the output as the loss); for timing."""
    fn(x).sum().backward()


def peak_saved_bytes(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> int:
    """Peak live saved-activation bytes over one forward and backward pass of ``fn`` on ``x``, recomputation included.

    A tensor counts by its storage (views of one storage once), parameters and their views not at
    all, from the moment autograd saves it until autograd frees it (``mm.SavedBytesTracker``).
    """
    with mm.SavedBytesTracker() as tracker:
        forward_backward(fn, x)
    return tracker.peak


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


def sqrt_segments(n_layers: int) -> int:
    """Chen et al.'s rule of thumb: about sqrt(n_layers) segments, rounded, at least 1."""
    return max(1, min(n_layers, round(math.sqrt(n_layers))))


def fit_plan(measure: Callable[[int, int], float], n_layers: int, batch_size: int, budget: float) -> tuple[int, int]:
    """``(micro_batches, segments)`` whose measured activation peak fits ``budget`` bytes.

    ``measure(micro_batch_size, segments)`` runs one forward and backward pass of a micro-batch of
    that many samples, checkpointed in ``segments`` segments (0: plain), and returns its peak.
    Preference: the fewest micro-batches (a divisor of ``batch_size``); then plain training; then
    the fewest segments. Configurations are measured in that order, each once, and the search
    stops at the first that fits. ValueError when none does.
    """
    if n_layers < 1 or batch_size < 1 or budget < 0:
        raise ValueError(f"need n_layers >= 1, batch_size >= 1, budget >= 0; got {n_layers}, {batch_size}, {budget}")
    peaks = []
    for k in (d for d in range(1, batch_size + 1) if batch_size % d == 0):
        for s in range(n_layers + 1):
            peak = measure(batch_size // k, s)
            if peak <= budget:
                return k, s
            peaks.append(peak)
    raise ValueError(f"nothing fits in {budget:.4g} bytes: the smallest measured peak is {min(peaks):.4g}")
