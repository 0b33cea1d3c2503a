"""The LM head and its cross-entropy computed chunk by chunk, so the (tokens, vocabulary) logits never exist whole.

``F.cross_entropy(F.linear(h, W), y)`` materialises n x vocab logits: at 32 x 1024 tokens and a
50,304-word vocabulary that is 3.3 GB in bf16, and under autocast the loss adds an fp32 copy and an
fp32 log-softmax (6.6 GB each), then as much again for their gradients. ``linear_cross_entropy``
takes the rows ``chunk_rows`` at a time instead. For each chunk it computes the logits (one GEMM),
the per-row loss and the logits' gradient written over the logits (one kernel,
``kernels.fusion.cross_entropy_forward_backward``; ``cross_entropy_forward`` alone when no gradient
is wanted), and straight away the chunk's gradient of ``h`` (dlogits @ W) and its share of W's
gradient (dlogits^T @ h_chunk, summed over the chunks in fp32). Only those two gradients are kept
for the backward pass, which merely scales them by the incoming gradient.

Memory: one chunk of logits (at most ``LOGITS_CHUNK_BYTES`` = 1 GiB by default) plus the two
gradients (the size of ``h``, and of W in fp32), instead of several n x vocab tensors. Time: the
same three GEMMs as the unfused head (6 n d vocab FLOPs) and, for the loss, two reads of each
chunk's logits and one write, in one launch. The
backward GEMMs run in the forward pass (skipped under ``torch.no_grad()`` or for inputs that need no
gradient); the result is differentiable once, not twice.

    loss = linear_cross_entropy(h, model.lm_head.weight, y)     # h (batch, time, d), y (batch, time)
    loss = linear_cross_entropy(h, w, y, ignore_index=-1, chunk_rows=4096)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from course_lib import env
from course_lib.kernels import fusion

__all__ = ["LOGITS_CHUNK_BYTES", "default_chunk_rows", "linear_cross_entropy"]

Tensor = torch.Tensor

# Bytes of one chunk's logits when the caller does not choose ``chunk_rows``: big enough that each
# GEMM stays efficient (8,192 rows of a 50k vocabulary in bf16 are 0.8 GiB), small next to an H200's memory.
LOGITS_CHUNK_BYTES = 1 << 30


def default_chunk_rows(n_rows: int, vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk: equal chunks, as few as keep one chunk's logits within ``LOGITS_CHUNK_BYTES``."""
    most = max(1, LOGITS_CHUNK_BYTES // (vocab * dtype.itemsize))
    chunks = max(1, -(-n_rows // most))
    return max(1, -(-n_rows // chunks))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, chunk_rows: int,
                compute_dtype: torch.dtype, grad_enabled: bool) -> Tensor:
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        need_h, need_w = (grad_enabled and needs for needs in ctx.needs_input_grad[:2])
        acc_dtype = torch.promote_types(compute_dtype, torch.float32)
        counted = (targets != ignore_index).sum()
        scale = (1.0 / counted.to(torch.float32)).reshape(1)  # on the device: no .item(), no sync
        w = weight.to(compute_dtype)
        grad_h = torch.empty(hidden.shape, device=hidden.device, dtype=compute_dtype) if need_h else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=acc_dtype) if need_w else None
        # One logits buffer for every chunk: no more than chunk_rows x vocab of them exist at any time.
        buffer = torch.empty(min(chunk_rows, n_rows), vocab, device=hidden.device, dtype=compute_dtype)
        loss_sum = torch.zeros((), device=hidden.device, dtype=torch.float32)
        # The GEMMs run in compute_dtype as cast here; autocast would recast the fp32 accumulator.
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n_rows, chunk_rows):
                rows = slice(start, min(start + chunk_rows, n_rows))
                h = hidden[rows].to(compute_dtype)
                t = targets[rows]
                logits = torch.mm(h, w.t(), out=buffer[: h.shape[0]])
                if not (need_h or need_w):
                    loss_sum += fusion.cross_entropy_forward(logits, t, ignore_index=ignore_index)[0].sum()
                    continue
                # Loss and gradient in one kernel, the gradient in place: each program reads a row whole
                # (for its logsumexp and loss), then reads each block of it again and writes the same
                # block, and no program reads another's rows; the buffer is contiguous.
                losses, dlogits = fusion.cross_entropy_forward_backward(logits, t, scale, ignore_index=ignore_index,
                                                                        out=logits)
                loss_sum += losses.sum()
                if grad_h is not None:
                    torch.mm(dlogits, w, out=grad_h[rows])
                if grad_w is not None:
                    if dlogits.dtype == acc_dtype:
                        grad_w.addmm_(dlogits.t(), h)
                    else:
                        grad_w += dlogits.t() @ h  # a low-precision GEMM, summed over the chunks in fp32
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = hidden.dtype, weight.dtype
        return loss_sum / counted  # the mean over the rows that count; NaN when none does, as in torch

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        dh = None if grad_h is None else grad_h.to(hidden_dtype) * grad
        dw = None if grad_w is None else (grad_w * grad).to(weight_dtype)
        return dh, dw, None, None, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *, ignore_index: int = -100,
                         chunk_rows: int | None = None) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, as F.cross_entropy(F.linear(...)), by row chunks.

    ``hidden`` (..., d), ``weight`` (vocab, d), ``targets`` class indices shaped like ``hidden``
    without its last dim; rows whose target is ``ignore_index`` count neither in the mean nor in
    the gradients. The GEMMs run in the autocast dtype when autocast is on for ``hidden``'s device,
    else in ``hidden``'s dtype; the loss is fp32. ``chunk_rows`` (default: ``default_chunk_rows``,
    about ``LOGITS_CHUNK_BYTES`` of logits per chunk) bounds the logits held at once. Targets
    outside [0, vocab) are not checked (that would wait for the device) and give wrong results.
    """
    if hidden.dim() < 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"expected hidden (..., d) and weight (vocab, d) with vocab >= 1, "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets must have hidden's shape without its last dim, {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be class indices (int64 or int32), got {targets.dtype}")
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise ValueError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if not hidden.device == weight.device == targets.device:
        raise ValueError(f"hidden, weight and targets must be on one device, got {hidden.device}, {weight.device}, "
                         f"{targets.device}")
    if not (hidden.is_cuda or env.INTERPRET):
        raise ValueError(f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {hidden.device}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be an int >= 1 or None, got {chunk_rows!r}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    elif weight.dtype != hidden.dtype:
        raise ValueError(f"hidden and weight must share a dtype outside autocast, got {hidden.dtype} and {weight.dtype}")
    else:
        compute_dtype = hidden.dtype
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    targets1 = targets.reshape(-1).contiguous()  # the kernels index targets as a dense vector
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(hidden2.shape[0], weight.shape[0], compute_dtype)
    return _LinearCrossEntropy.apply(hidden2, weight, targets1, ignore_index, rows, compute_dtype, torch.is_grad_enabled())
