"""Chapter 09's grading probes: is the student's Triton kernel launched, does the result come from it, does it stay in bounds?

A value check alone passes a launcher that returns ``x.T.contiguous()`` or ``a @ b`` computed by
PyTorch (with or without launching the kernel too), and a kernel that reads past the end of a
ragged matrix without a mask (its stray values never reach the stored result). The test cells
collect the evidence where the student's code runs, with ``watch_kernel`` inside a ``student_side``
call, and judge it in the tester with ``check_kernel_work``:

- the launches of the student's kernel during one call of the launcher;
- with every launch of that kernel skipped (the tensors it would write filled with NaN instead),
  the launcher must no longer return the same result: the work is the kernel's;
- under Triton's interpreter, every load and store of the kernel (``memory_trace``) must hit an
  element of one of the tensors it was launched with; the inputs are copied between unused bytes
  first, so that a stray read lands in memory the process owns;
- the kernel's code must not use ``course_lib`` (``course_lib_names``).
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from course_lib import env
from course_lib.kernels.memory_trace import Access, trace_memory

__all__ = ["KernelWatch", "watch_kernel", "check_kernel_work", "course_lib_names"]

SLACK_BYTES = 65536  # unused bytes on both sides of each input under the interpreter: wider than any stray block


@dataclass(frozen=True)
class KernelWatch:
    """What one call of a launcher did with its kernel, as plain data for the tester."""

    launches: int                  # launches of the kernel during the call
    result: Any                    # what the launcher returned
    same_without_kernel: bool      # the launcher returned an equal result with the kernel's launches skipped
    error_without_kernel: str      # what it raised then ("" if nothing)
    traced: bool                   # whether loads and stores were traced (Triton's interpreter)
    loads_outside: int = 0         # active load lanes that hit no element of the kernel's tensor arguments
    stores_outside: int = 0        # likewise for stores
    course_lib_names: list[str] = field(default_factory=list)  # names in the kernel's code bound to course_lib


def course_lib_names(fn: Any) -> list[str]:
    """Global names that the code of ``fn`` (a ``@triton.jit`` function or a plain one) uses and that are course_lib objects."""
    function = getattr(fn, "fn", fn)
    code, space = getattr(function, "__code__", None), getattr(function, "__globals__", {})
    if code is None:
        return []
    names: set[str] = set()
    stack = [code]
    while stack:
        current = stack.pop()
        names.update(current.co_names)
        stack += [c for c in current.co_consts if isinstance(c, types.CodeType)]

    def from_course_lib(value: Any) -> bool:
        if isinstance(value, types.ModuleType):
            return value.__name__.startswith("course_lib")
        modules = (getattr(value, "__module__", None), getattr(getattr(value, "fn", None), "__module__", None))
        return any(isinstance(m, str) and m.startswith("course_lib") for m in modules)

    return sorted(name for name in names if name in space and from_course_lib(space[name]))


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor)]


def _with_slack(t: torch.Tensor) -> torch.Tensor:
    """``t`` (same shape, strides and values) in a copy of its storage with unused bytes on both sides."""
    storage = t.untyped_storage()
    n = storage.nbytes()
    buffer = torch.zeros(n + 2 * SLACK_BYTES, dtype=torch.uint8, device=t.device)
    buffer[SLACK_BYTES:SLACK_BYTES + n].copy_(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
    offset = SLACK_BYTES // t.element_size() + t.storage_offset()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(buffer.untyped_storage(), offset, t.size(), t.stride())


def _element_addresses(t: torch.Tensor) -> np.ndarray:
    """The byte address of every element of ``t`` (views included)."""
    offsets = np.zeros(1, dtype=np.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    return t.data_ptr() + offsets * t.element_size()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype.is_floating_point:
            return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
        return bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b) if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) else False


@contextlib.contextmanager
def _run_replaced(kernel: Any, run: Callable[..., Any]) -> Any:
    """``kernel[grid](...)`` calls ``run`` in the block (a launch goes through the kernel's ``run``)."""
    had_own = "run" in vars(kernel)
    own = vars(kernel).get("run")
    kernel.run = run
    try:
        yield
    finally:
        if had_own:
            kernel.run = own
        else:
            del kernel.run


def watch_kernel(kernel: Any, launcher: Callable[..., Any], /, *args: Any, **kwargs: Any) -> KernelWatch:
    """Call ``launcher(*args, **kwargs)`` twice, watching ``kernel``: once as written, once with its launches skipped.

    Run it where the student's code lives (inside ``student_side``). The first call counts the
    kernel's launches and, under the interpreter, traces its loads and stores on inputs that sit
    between unused bytes; the second fills the kernel's tensor arguments that are not inputs with
    NaN instead of launching it.
    """
    if env.INTERPRET:
        args = tuple(_with_slack(a) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: _with_slack(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    original = kernel.run
    launched: list[torch.Tensor] = []  # the tensor arguments of every launch
    trace: list[Access] = []           # the loads and stores of the kernel's launches (interpreter)
    launches = 0

    def counted(*a: Any, grid: Any, warmup: bool, **kw: Any) -> Any:
        nonlocal launches
        if warmup:
            return original(*a, grid=grid, warmup=warmup, **kw)
        launches += 1
        launched.extend(_tensors(list(a) + list(kw.values())))
        if not env.INTERPRET:
            return original(*a, grid=grid, warmup=warmup, **kw)
        with trace_memory() as accesses:
            out = original(*a, grid=grid, warmup=warmup, **kw)
        trace.extend(accesses)
        return out

    with _run_replaced(kernel, counted):
        result = launcher(*args, **kwargs)
    loads_outside = stores_outside = 0
    if env.INTERPRET and launched:
        valid = np.unique(np.concatenate([_element_addresses(t) for t in launched]))
        for access in trace:
            stray = int((~np.isin(access.addresses[access.mask], valid)).sum())
            if access.kind == "load":
                loads_outside += stray
            else:
                stores_outside += stray

    inputs = {t.untyped_storage().data_ptr() for t in _tensors(list(args) + list(kwargs.values()))}

    def skipped(*a: Any, grid: Any, warmup: bool, **kw: Any) -> None:
        for t in _tensors(list(a) + list(kw.values())):
            if t.dtype.is_floating_point and t.untyped_storage().data_ptr() not in inputs:
                t.fill_(math.nan)

    error = ""
    try:
        with _run_replaced(kernel, skipped):
            again = launcher(*args, **kwargs)
        same = _same(result, again)
    except Exception as exc:  # noqa: BLE001 - a launcher that fails without its kernel depends on it: fine
        same, error = False, f"{type(exc).__name__}: {exc}"
    return KernelWatch(launches, result, same, error, env.INTERPRET, loads_outside, stores_outside,
                       course_lib_names(kernel))


def check_kernel_work(watch: KernelWatch, launcher: str, kernel: str, *, launches: int = 1) -> None:
    """AssertionError saying what is wrong in ``watch``: launches, where the result comes from, stray accesses, course_lib."""
    if watch.launches != launches:
        raise AssertionError(f"{launcher} launched {kernel} {watch.launches} time(s), expected {launches}: "
                             f"the result must be computed by your kernel, launched as {kernel}[grid](...)")
    if watch.same_without_kernel:
        raise AssertionError(f"{launcher} returned the same result with the launches of {kernel} skipped: the "
                             "result must come from your kernel, not from PyTorch or another function")
    if watch.loads_outside:
        raise AssertionError(f"{kernel} loaded {watch.loads_outside} element(s) outside its tensors (past a ragged "
                             "edge): mask the loads of rows and columns beyond the matrix")
    if watch.stores_outside:
        raise AssertionError(f"{kernel} stored {watch.stores_outside} element(s) outside its output: mask the store")
    if watch.course_lib_names:
        raise AssertionError(f"{kernel} uses course_lib ({', '.join(watch.course_lib_names)}): write the kernel "
                             "yourself")
