"""Chapter 15's harness: the seeded queries, keys and values that its tests, demos and self-check draw."""

from __future__ import annotations

import torch

__all__ = ["random_qkv"]


def random_qkv(batch: int, heads: int, n: int, d: int, dtype: torch.dtype = torch.float32, seed: int = 0,
               count: int = 3) -> list[torch.Tensor]:
    """``count`` seeded random (batch, heads, n, d) tensors on the CPU: queries, keys, values (and more of that shape)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, d, dtype=dtype, generator=g) for _ in range(count)]
