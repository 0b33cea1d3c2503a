"""Chapter 16 (capstone): chapter 08's bias + GELU kernels inside a compiled model.

    y = bias_gelu_op(h, bias)                     # gelu(h + bias), fitted erfc, differentiable; compiles whole
    block.mlp = KernelGeluFeedForward(block.mlp)  # fc without its bias, then the kernel, then proj

``torch.compile`` fuses a GELU written in PyTorch operations as it sees fit, and decides for itself
what the forward keeps for the backward. Given the fitted erfc as PyTorch operations
(``erfc.fitted_gelu``), it kept GELU's fp32 derivative instead of the bf16 input and so moved more
bytes than the exact GELU (chapter 16's H100 record). Here the forward and the backward are
chapter 08's Triton kernels (``fusion.bias_gelu_forward`` / ``bias_gelu_backward`` with
``fast_erf=True``) behind ``torch.library`` custom ops: the compiler keeps each whole and saves
what the op says, the pre-activation h (without the bias) and the bias. The fc matmul runs without
its bias, which the kernel adds, and the backward kernel returns the bias's gradient from the same
pass. Traffic per element: forward one read and one write, backward two reads and one write, as
for the exact GELU, with less arithmetic on each.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from course_lib import models
from course_lib.kernels import fusion

__all__ = ["KernelGeluFeedForward", "bias_gelu_op"]


@torch.library.custom_op("training_at_speed::bias_gelu", mutates_args=())
def _bias_gelu(x: Tensor, bias: Tensor) -> Tensor:
    return fusion.bias_gelu_forward(x, bias, fast_erf=True)


@_bias_gelu.register_fake
def _(x: Tensor, bias: Tensor) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("training_at_speed::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward(dy: Tensor, x: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    return fusion.bias_gelu_backward(dy, x, bias, fast_erf=True)


@_bias_gelu_backward.register_fake
def _(dy: Tensor, x: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(bias)


def _setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)  # h without the bias, and the bias: the output is not kept


def _backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor]:
    x, bias = ctx.saved_tensors
    return _bias_gelu_backward(dy.contiguous(), x, bias)


_bias_gelu.register_autograd(_backward, setup_context=_setup_context)


def bias_gelu_op(h: Tensor, bias: Tensor) -> Tensor:
    """gelu(h + bias) over h's last dim by chapter 08's kernels (fitted erfc), as a custom op; differentiable."""
    if h.dim() == 0 or bias.shape != (h.shape[-1],):
        raise ValueError(f"bias must have shape (h.shape[-1],), got {tuple(bias.shape)} for h {tuple(h.shape)}")
    if bias.dtype != h.dtype or bias.device != h.device:
        raise ValueError(f"h and bias must share a dtype and a device, got {h.dtype} on {h.device} and "
                         f"{bias.dtype} on {bias.device}")
    y = _bias_gelu(h.reshape(-1, h.shape[-1]).contiguous(), bias.contiguous())
    return y.view(h.shape)


class KernelGeluFeedForward(models.FeedForward):
    """A ``models.FeedForward`` whose bias + GELU is ``bias_gelu_op``, holding the same modules and parameters."""

    def __init__(self, mlp: models.FeedForward) -> None:
        nn.Module.__init__(self)  # not FeedForward's: it would build new layers; these are mlp's own
        if mlp.fc.bias is None:
            raise ValueError("the bias + GELU kernel needs fc's bias (GPTConfig(bias=True))")
        self.fc: nn.Linear = mlp.fc
        self.proj: nn.Linear = mlp.proj
        self.dropout: nn.Dropout = mlp.dropout

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to every position of ``x``; under autocast, the kernel runs in autocast's dtype."""
        h = F.linear(x, self.fc.weight)  # autocast, when on, casts as for any linear layer
        bias = self.fc.bias
        assert bias is not None  # checked in __init__
        return self.dropout(self.proj(bias_gelu_op(h, bias.to(h.dtype))))
