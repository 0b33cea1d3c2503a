"""Chapter 09: the memory accesses of a Triton kernel, watched under Triton's CPU interpreter.

Under ``TRITON_INTERPRET=1`` a ``tl.load`` or ``tl.store`` is a Python call inside Triton's
interpreter that receives the byte address of every lane of the block and its mask. ``trace_memory``
records those calls, one ``Access`` per instruction per program, while its block runs;
``bytes_moved`` turns a trace into the bytes read from and written to each tensor, which is the
traffic the kernel causes when no cache helps, and counts the lanes that touched no tensor at all
(a missing mask).

    with trace_memory() as trace:
        y = tc.copy(x)
    bytes_moved(trace, {"x": region_of(x), "y": region_of(y)})
    # {"x": (x_bytes, 0), "y": (0, y_bytes), "outside": (0, 0)}

Compiled kernels on a GPU run out of Python's sight: there ``trace_memory`` raises. Atomics and
block pointers are not recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from course_lib import env  # sets TRITON_INTERPRET=1 without a GPU; must come before triton

__all__ = ["Access", "trace_memory", "region_of", "bytes_moved"]


@dataclass(frozen=True, eq=False)
class Access:
    """One ``tl.load`` or ``tl.store`` executed by one program: the byte address and the mask of each lane."""

    kind: str                      # "load" or "store"
    program: tuple[int, int, int]  # the program's (x, y, z) ids
    addresses: np.ndarray          # int64 byte addresses, one per lane of the block (flattened)
    mask: np.ndarray               # bool, one per lane: False lanes touch no memory
    itemsize: int                  # bytes each active lane reads or writes


def _itemsize(pointers: Any) -> int:
    """Bytes of the element type that a block of pointers points to."""
    dtype = pointers.dtype
    while hasattr(dtype, "element_ty"):
        dtype = dtype.element_ty
    return max(1, dtype.primitive_bitwidth // 8)


@contextlib.contextmanager
def trace_memory() -> Iterator[list[Access]]:
    """Record every load and store that interpreted Triton kernels execute in the block, in execution order."""
    if not env.INTERPRET:
        raise RuntimeError("trace_memory watches Triton's CPU interpreter (TRITON_INTERPRET=1); compiled GPU "
                           "kernels cannot be traced this way")
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    trace: list[Access] = []
    saved = {name: vars(builder).get(name) for name in ("create_masked_load", "create_masked_store")}
    load, store = builder.create_masked_load, builder.create_masked_store

    def record(kind: str, pointers: Any, mask: Any) -> None:
        addresses = np.asarray(pointers.data).astype(np.int64).reshape(-1)
        lanes = np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(pointers.data)).reshape(-1)
        program = tuple(int(i) for i in builder.grid_idx)
        trace.append(Access(kind, (program[0], program[1], program[2]), addresses, lanes.copy(), _itemsize(pointers)))

    def traced_load(pointers: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        record("load", pointers, mask)
        return load(pointers, mask, *args, **kwargs)

    def traced_store(pointers: Any, value: Any, mask: Any, *args: Any, **kwargs: Any) -> Any:
        record("store", pointers, mask)
        return store(pointers, value, mask, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = traced_load, traced_store
    try:
        yield trace
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(builder, name)
            else:
                setattr(builder, name, value)


def region_of(t: torch.Tensor) -> tuple[int, int]:
    """(first byte address, bytes spanned) of the memory that tensor ``t`` (a view too) covers."""
    if t.numel() == 0:
        return t.data_ptr(), 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), (last + 1) * t.element_size()


def bytes_moved(trace: Sequence[Access], regions: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """(bytes loaded, bytes stored) in each region of ``regions`` (name -> (start address, size in bytes)).

    Only active lanes count, ``itemsize`` bytes each, as often as they run (a second read of the
    same element is traffic too). Lanes whose address lies in no region are summed under
    ``"outside"``. Regions must not overlap.
    """
    spans = sorted((start, start + size, name) for name, (start, size) in regions.items())
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"regions {first!r} and {second!r} overlap")
    totals = {name: [0, 0] for name in regions}
    totals["outside"] = [0, 0]
    for access in trace:
        column = 0 if access.kind == "load" else 1
        addresses = access.addresses[access.mask]
        placed = np.zeros(addresses.shape, dtype=bool)
        for start, end, name in spans:
            inside = (addresses >= start) & (addresses < end)
            totals[name][column] += int(inside.sum()) * access.itemsize
            placed |= inside
        totals["outside"][column] += int((~placed).sum()) * access.itemsize
    return {name: (loaded, stored) for name, (loaded, stored) in totals.items()}
