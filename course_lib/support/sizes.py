"""Sizes of tensors in memory, and byte counts written for people.

``tensor_bytes`` is the one way the course counts the memory a collection of tensors holds: each
storage once (views share their base's), a DTensor by its local shard. ``human_bytes`` prints it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["human_bytes", "storage_key", "tensor_bytes"]


def human_bytes(n: float) -> str:
    """A byte count in binary units, e.g. '1.50 GiB'."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    i = 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.2f} {units[i]}"


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identifies the memory a tensor lives in: views and the tensor they view share one key."""
    return (str(t.device), t.untyped_storage().data_ptr())


def tensor_bytes(obj: Any) -> int:
    """Bytes of the storages of every tensor inside ``obj``, each storage once.

    ``obj`` may be a tensor, or dicts, lists and tuples of them nested any way (an optimizer's
    ``.state``, a list of ``p.grad``); anything else inside is ignored. A DTensor counts its local
    shard, the memory this rank holds. A view counts the whole storage it views: that is what
    stays allocated while it lives.
    """
    seen: dict[tuple[str, int], int] = {}

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if hasattr(x, "to_local"):  # a DTensor (FSDP2): this rank's local shard
                x = x.to_local()
            seen[storage_key(x)] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(obj)
    return sum(seen.values())
