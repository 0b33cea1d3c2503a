"""Counting the FLOPs and bytes of real work, and how much of a device a training step uses (chapter 03).

- ``op_costs``: run a function under a ``TorchDispatchMode`` and count, per ATen operator, its
  calls, its matmul FLOPs and the bytes of the tensors it reads and writes (forward and backward).
- ``count_flops``: PyTorch's own ``FlopCounterMode`` total, with the CPU's fused attention added
  (PyTorch counts the GPU attention kernels only).
- ``step_flops``, ``utilization``: model and hardware FLOPs of a training step of the course GPT
  from its configuration, and the MFU and HFU a measured step time gives.
- ``checkpoint_blocks``, ``device_peak_flops``: a GPT whose blocks are recomputed in the backward
  pass (more hardware FLOPs, the same model FLOPs), and the peak rate to state MFU against.

    model_flops, hardware_flops = step_flops(cfg, batch_size=8, checkpointing=True)
    mfu, hfu = utilization(cfg, 8, step_seconds, peak_flops_per_s, checkpointing=True)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from course_lib.models import GPT, GPTConfig
from course_lib.orientation import H100_SXM, H200_SXM

__all__ = [
    "MATMULS",
    "op_costs",
    "count_flops",
    "step_flops",
    "utilization",
    "checkpoint_blocks",
    "device_peak_flops",
]

aten = torch.ops.aten

# The operators that multiply matrices, and where their two factors sit among the arguments.
MATMULS = {aten.mm: (0, 1), aten.addmm: (1, 2), aten.bmm: (0, 1), aten.baddbmm: (1, 2)}


def _tensor_bytes(tree: Any) -> int:
    """Bytes of every tensor in a nested structure of arguments or results (logical size: numel x itemsize)."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


class _OpCosts(TorchDispatchMode):
    """Sees every ATen operator below autograd (so the backward pass too) and adds up its costs."""

    def __init__(self) -> None:
        super().__init__()
        self.costs: dict[str, tuple[int, int, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view:  # a view moves no data and launches nothing
            flops = 0
            if func.overloadpacket in MATMULS:
                i, j = MATMULS[func.overloadpacket]
                flops = 2 * args[i].numel() * args[j].shape[-1]  # (.., m, k) @ (.., k, n): 2 m k n per matrix
            moved = _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
            calls, f, b = self.costs.get(func._schema.name, (0, 0, 0))
            self.costs[func._schema.name] = (calls + 1, f + flops, b + moved)
        return out


def op_costs(fn: Callable[[], Any]) -> dict[str, tuple[int, int, int]]:
    """Run ``fn()`` once; per operator (``aten::mm``, named as the profiler's table names it): (calls, FLOPs, bytes).

    FLOPs count matrix products only (``MATMULS``: 2 m k n each, a bias add not counted), as
    ``FlopCounterMode`` does. Bytes are those of every tensor argument read and every tensor
    result written, each once at its logical size. View operators (``func.is_view``) are left out.
    """
    with _OpCosts() as mode:
        fn()
    return mode.costs


def _cpu_attention_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None,
                         **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward_flops(grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any,
                                  *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# FlopCounterMode knows SDPA's GPU kernels; the CPU's flash kernel gets the same formula here (full
# s_q x s_k scores: the causal mask is not subtracted, as PyTorch does not for the GPU kernels).
CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of ``fn()`` as ``torch.utils.flop_counter.FlopCounterMode`` counts them, CPU attention included."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        fn()
    return counter.get_total_flops()


def step_flops(cfg: GPTConfig, batch_size: int, checkpointing: bool = False) -> tuple[int, int]:
    """(model FLOPs, hardware FLOPs) of one forward and backward pass of ``GPT(cfg)`` on ``batch_size`` x ``seq_len`` tokens.

    Per token, with width h, depth L, MLP ratio r, vocabulary V and sequence length s:

    - model FLOPs are 6 N + 12 L s h (PaLM, Chowdhery et al. 2022, appendix B). N counts the weights
      that multiply a token's activations, (4 + 2r) h^2 per block plus V h for the LM head (tied or
      not: the matmul happens either way; embedding lookups, biases and LayerNorm are left out);
      12 L s h is the attention scores and their weighted sum, 4 L s h forward and twice that
      backward (a causal mask's skipped half is counted, as usual);
    - hardware FLOPs add what the device computes twice: the fused attention's backward recomputes
      the scores from Q and K (FlashAttention keeps only their logsumexp), 2 L s h; and with every
      block checkpointed (``checkpoint_blocks``), one more forward pass of the blocks,
      L (2 (4 + 2r) h^2 + 4 s h).
    """
    h, layers, s, r, vocab = cfg.d_model, cfg.n_layer, cfg.seq_len, cfg.mlp_ratio, cfg.vocab_size
    tokens = batch_size * s
    block_forward = 2 * (4 + 2 * r) * h * h + 4 * s * h  # one block's matmuls and attention, per token
    forward = layers * block_forward + 2 * vocab * h
    model = 3 * forward * tokens  # backward: a gradient for the input and one for the weight of every matmul
    hardware = model + layers * 2 * s * h * tokens
    if checkpointing:
        hardware += layers * block_forward * tokens
    return model, hardware


def utilization(cfg: GPTConfig, batch_size: int, step_seconds: float, peak_flops_per_s: float,
                checkpointing: bool = False) -> tuple[float, float]:
    """(MFU, HFU) of a training step of ``GPT(cfg)`` that took ``step_seconds``: FLOPs per second over the peak.

    ValueError unless step_seconds > 0 and peak_flops_per_s > 0.
    """
    if not (step_seconds > 0 and peak_flops_per_s > 0):
        raise ValueError(f"need step_seconds > 0 and peak_flops_per_s > 0, got {step_seconds}, {peak_flops_per_s}")
    model, hardware = step_flops(cfg, batch_size, checkpointing)
    budget = step_seconds * peak_flops_per_s
    return model / budget, hardware / budget


class _CheckpointedBlock(nn.Module):
    """A block whose activations are dropped after the forward pass and recomputed in the backward pass."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Without early stop the whole block is recomputed, its last matmul included (by default
        # PyTorch stops recomputing once it has every tensor the backward pass needs).
        with set_checkpoint_early_stop(False):
            return checkpoint(self.block, x, use_reentrant=False)


def checkpoint_blocks(model: GPT) -> GPT:
    """Wrap every block of ``model`` in activation checkpointing, in place; return the model."""
    model.blocks = nn.ModuleList(_CheckpointedBlock(block) for block in model.blocks)
    return model


def device_peak_flops(device: torch.device) -> tuple[float, str]:
    """The peak FLOP/s to state MFU against, and where it comes from.

    A known GPU: its dense bf16 datasheet figure (``orientation.H200_SXM`` / ``H100_SXM``). A CPU,
    which has no datasheet figure here: the fp32 rate of a 512^3 matmul measured now.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for spec in (H200_SXM, H100_SXM):
            if spec.name.split()[0] in name:
                return spec.bf16_dense_flops, f"{spec.name} dense bf16 datasheet"
        return H100_SXM.bf16_dense_flops, f"unknown GPU {name}: H100 SXM dense bf16 datasheet used"
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    rate = 10 * 2 * n**3 / (time.perf_counter() - start)
    return rate, "measured fp32 matmul rate of this CPU"
