"""Watch what a piece of code does with Triton kernels and with PyTorch, compiled on a GPU or interpreted on a CPU.

``torch.profiler`` sees CUDA kernels, but under Triton's CPU interpreter a launch is a Python call
that no profiler records. These context managers look at the launch itself instead, the same way
in both modes: every ``kernel[grid](...)`` goes through ``run`` of Triton's ``JITFunction`` (compiled)
or ``InterpretedFunction`` (interpreter), which ``watch_launches`` wraps for the block.

- ``watch_launches()``: a list of ``Launch`` (kernel name, grid, scalar arguments, the storages of
  its tensor arguments), one per launch in the block. With ``guard=True`` each launch runs on copies
  of its tensors placed between guard bytes, so that a write past either end (a missing mask) is
  caught instead of changing other memory, and a read there gets absurd values (3.4e38). With
  ``run=False`` launches are skipped and their tensor arguments, except those named in ``keep``,
  are filled with NaN: what code returns then shows which of its results came from a kernel.
- ``watch_torch(min_numel)``: the PyTorch operators the block runs outside kernel launches that do
  arithmetic on a tensor of at least ``min_numel`` elements (views, allocations and constant fills
  are not counted); with ``poison=True``, every tensor it allocates with ``torch.empty`` and friends
  starts out NaN, so that an element no kernel wrote shows.

    with watch_launches() as launches:
        y = fusion.softmax(x)
    print([launch.name for launch in launches])      # ['_softmax_fwd_rows_kernel']
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["GUARD_BYTES", "Launch", "TorchWork", "watch_launches", "watch_torch"]

# Bytes of guard on each side of every tensor a watched launch receives: past the last element of
# a block of 4096 fp32 values, the widest block the course's exercises use.
GUARD_BYTES = 16384
_GUARD_BYTE = 0x7F  # fp32 0x7f7f7f7f = 3.4e38: an out-of-bounds read gives absurd values, not zeros

# Operators that move no data of their inputs: allocations, constant fills, scalar reads.
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like",
         "ones", "ones_like", "full", "full_like", "new_zeros", "new_ones", "new_full", "fill_", "zero_",
         "_local_scalar_dense", "lift_fresh", "lift_fresh_copy", "scalar_tensor"}
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}

_LAUNCH_DEPTH = [0]  # > 0 while a watched launch runs: watch_torch ignores what Triton does inside


@dataclass(frozen=True)
class Launch:
    """One launch of a Triton kernel: which, on what grid, with which scalars and tensors."""

    kernel: Any = field(repr=False, compare=False)  # the JITFunction / InterpretedFunction launched
    name: str
    grid: tuple[int, ...]
    scalars: dict[str, int | float | bool]  # arguments that are plain numbers (constexprs included), by name
    storages: tuple[int, ...]  # data_ptr of the storage of each tensor argument, in order
    wrote_past_end: tuple[str, ...] = ()  # tensor arguments written past either end (guard=True only)


def _kernel_classes() -> list[type]:
    """Triton's kernel classes whose ``run`` launches: compiled, and the interpreter's."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return [JITFunction, InterpretedFunction]


def _bound(kernel: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = list(getattr(kernel, "arg_names", []))
    return {**dict(zip(names, args)), **kwargs}


def _grid(grid: Any, bound: dict[str, Any]) -> tuple[int, ...]:
    if callable(grid):
        grid = grid(bound)
    return tuple(int(g) for g in (grid if isinstance(grid, tuple | list) else (grid,)))


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Guarded:
    """Every tensor argument of one launch moved between guard bytes (each storage once, aliases kept)."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]):
        self.copies: dict[int, tuple[torch.UntypedStorage, torch.Tensor, str]] = {}
        for name, t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() in self.copies:
                continue
            n = storage.nbytes()
            buf = torch.full((n + 2 * GUARD_BYTES,), _GUARD_BYTE, dtype=torch.uint8, device=t.device)
            buf[GUARD_BYTES:GUARD_BYTES + n].copy_(_as_bytes(storage))
            self.copies[storage.data_ptr()] = (storage, buf, name)

    def moved(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor ``t`` as a view of its guarded copy."""
        _, buf, _ = self.copies[t.untyped_storage().data_ptr()]
        offset = GUARD_BYTES // t.element_size() + t.storage_offset()
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(buf.untyped_storage(), offset, t.size(), t.stride())

    def restore(self) -> tuple[str, ...]:
        """Copy every result back; the names of the arguments whose guard bytes changed."""
        spoiled = []
        for storage, buf, name in self.copies.values():
            n = storage.nbytes()
            guards = torch.cat([buf[:GUARD_BYTES], buf[GUARD_BYTES + n:]])
            if bool((guards != _GUARD_BYTE).any()):
                spoiled.append(name)
            _as_bytes(storage).copy_(buf[GUARD_BYTES:GUARD_BYTES + n])
        return tuple(spoiled)


@contextlib.contextmanager
def watch_launches(*, run: bool = True, guard: bool = False, keep: Iterable[torch.Tensor] = ()) -> Iterator[list[Launch]]:
    """Record every Triton kernel launch of the block, compiled or interpreted, as a ``Launch``.

    ``guard``: run each launch on guarded copies of its tensors and report what went past an end.
    ``run=False``: launch nothing; fill every floating tensor argument with NaN instead, except those
    that share memory with a tensor of ``keep`` (the caller's inputs).
    """
    launches: list[Launch] = []
    kept = {t.untyped_storage().data_ptr() for t in keep}
    classes = _kernel_classes()
    own = {cls: cls.__dict__.get("run") for cls in classes}  # None where a Triton version inherits run
    originals = {cls: cls.run for cls in classes}  # type: ignore[attr-defined]

    def watched(original: Any) -> Any:
        def run_watched(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if warmup:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            bound = _bound(self, args, kwargs)
            tensors = [(k, v) for k, v in bound.items() if isinstance(v, torch.Tensor)]
            scalars = {k: v for k, v in bound.items() if isinstance(v, bool | int | float)}
            fn = getattr(self, "fn", None)
            name = getattr(fn, "__name__", type(self).__name__)
            storages = tuple(t.untyped_storage().data_ptr() for _, t in tensors)
            result: Any = None
            spoiled: tuple[str, ...] = ()
            _LAUNCH_DEPTH[0] += 1
            try:
                with torch.no_grad():
                    if not run:
                        for _, t in tensors:
                            if t.dtype.is_floating_point and t.untyped_storage().data_ptr() not in kept:
                                t.fill_(math.nan)
                    elif guard:
                        copies = _Guarded(tensors)
                        args = tuple(copies.moved(a) if isinstance(a, torch.Tensor) else a for a in args)
                        kwargs = {k: copies.moved(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
                        try:
                            with warnings.catch_warnings():  # a read of the guard bytes overflows: that is the point
                                warnings.simplefilter("ignore", RuntimeWarning)
                                result = original(self, *args, grid=grid, warmup=warmup, **kwargs)
                        finally:
                            spoiled = copies.restore()
                    else:
                        result = original(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                _LAUNCH_DEPTH[0] -= 1
            launches.append(Launch(self, name, _grid(grid, bound), scalars, storages, spoiled))
            return result

        return run_watched

    for cls, original in originals.items():
        cls.run = watched(original)  # type: ignore[attr-defined]
    try:
        yield launches
    finally:
        for cls in classes:
            if own[cls] is None:
                delattr(cls, "run")
            else:
                cls.run = own[cls]  # type: ignore[attr-defined]


@dataclass
class TorchWork:
    """What ``watch_torch`` saw: the operators that did arithmetic on a large tensor, by name (``aten.add``)."""

    min_numel: int
    ops: list[str] = field(default_factory=list)  # each name once, in the order first seen
    calls: dict[str, int] = field(default_factory=dict)  # op name -> how many times it ran
    largest: dict[str, int] = field(default_factory=dict)  # op name -> largest tensor it touched (elements)


class _TorchWatch(TorchDispatchMode):
    def __init__(self, work: TorchWork, poison: bool):
        super().__init__()
        self.work, self.poison = work, poison

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _LAUNCH_DEPTH[0]:
            return out
        name = func.overloadpacket.__name__
        if self.poison and name in _ALLOCATIONS and isinstance(out, torch.Tensor) and out.dtype.is_floating_point:
            out.fill_(math.nan)
        if name in _FREE or getattr(func, "is_view", False):
            return out
        sizes = [t.numel() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        largest = max(sizes, default=0)
        if largest >= self.work.min_numel:
            label = f"aten.{name}"
            if label not in self.work.largest:
                self.work.ops.append(label)
            self.work.calls[label] = self.work.calls.get(label, 0) + 1
            self.work.largest[label] = max(largest, self.work.largest.get(label, 0))
        return out


@contextlib.contextmanager
def watch_torch(min_numel: int, *, poison: bool = True) -> Iterator[TorchWork]:
    """Record the PyTorch operators of the block, outside Triton launches, that touch a tensor of ``min_numel`` or more elements.

    Views, allocations, constant fills and scalar reads are not counted. With ``poison``, floating
    tensors allocated uninitialised (``torch.empty``, ``empty_like``, ``new_empty``) are filled with NaN.
    """
    work = TorchWork(min_numel)
    with _TorchWatch(work, poison):
        yield work
