"""Triton exercises: is the student's kernel launched, once, and does it do all the work?

A value check alone passes a wrapper that launches the kernel and then returns ``x + y`` computed
by PyTorch, a kernel that skips the ragged tail of a tensor whose output buffer happened to hold the
answer, or a "fused" op that adds the bias in PyTorch before a GELU kernel. The test cells gather
evidence where the student's code runs (``launch_evidence``, inside a ``student_side`` function)
and judge it in the tester (``check_kernel_work``):

- the launches, by kernel: the student's kernel exactly ``launches`` times, no other Triton kernel;
- nothing written past the ends of a tensor (each launch runs between guard bytes);
- no arithmetic in PyTorch on a tensor as large as the inputs, outside the launches;
- the result lives in a buffer the kernel was launched with, and every element was written
  (fresh allocations start out NaN);
- with the launches skipped (their outputs NaN instead), no finite result is left: nothing was
  computed beside the kernel; an in-place update leaves its buffers untouched;
- the inputs are left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from course_lib.exercises.checks import not_done
from course_lib.support.launches import watch_launches, watch_torch

__all__ = ["launch_evidence", "check_kernel_work"]


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return bool(torch.equal(a, b))


def _copies(inputs: Sequence[Any]) -> list[Any]:
    return [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in inputs]


def _changed(before: Sequence[Any], after: Sequence[Any]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(before, after)) if isinstance(a, torch.Tensor) and not _same(a, b)]


def launch_evidence(fn: Callable[..., Any], *inputs: Any, kernels: dict[str, Any], min_numel: int | None = None,
                    saved: bool = False, label: Any = None, **kwargs: Any) -> dict[str, Any]:
    """What ``fn(*inputs, **kwargs)`` does with its kernels, as plain data; run it where the student's code lives.

    ``fn`` runs twice, each time on fresh copies of ``inputs``: as written (launches guarded, fresh
    allocations NaN, PyTorch operators on tensors of ``min_numel`` elements or more logged, by
    default the largest input's size), then with every launch skipped and its outputs NaN.
    ``kernels`` names the student's kernel objects; a launch of any other kernel is named
    ``other:<name>``. With ``saved``, the sizes of the tensors autograd saves are recorded too.
    An untouched exercise (NotImplementedError) fails as not done yet, named after ``label``
    (the student's function) or else ``fn``.
    """
    if min_numel is None:
        min_numel = max((x.numel() for x in inputs if isinstance(x, torch.Tensor)), default=1)
    names = {id(k): name for name, k in kernels.items()}
    names.update({id(getattr(k, "fn", None)): name for name, k in kernels.items()})

    def kernel_name(launched: Any) -> str:
        return names.get(id(launched)) or f"other:{getattr(getattr(launched, 'fn', None), '__name__', '?')}"

    originals = _copies(inputs)
    args = _copies(inputs)
    input_storages = {x.untyped_storage().data_ptr() for x in args if isinstance(x, torch.Tensor)}
    saved_sizes: list[list[Any]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved_sizes.append([t.numel(), t.untyped_storage().data_ptr() in input_storages])
        return t

    try:
        with watch_torch(min_numel) as work, watch_launches(guard=True) as launches:
            if saved:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    result = fn(*args, **kwargs)
            else:
                result = fn(*args, **kwargs)
    except NotImplementedError:
        raise not_done(label or fn) from None
    launched = {s for launch in launches for s in launch.storages}
    evidence: dict[str, Any] = {
        "launches": [kernel_name(launch.kernel) for launch in launches],
        "grids": [list(launch.grid) for launch in launches],
        "scalars": [dict(launch.scalars) for launch in launches],
        "wrote_past_end": [[kernel_name(launch.kernel), list(launch.wrote_past_end)]
                           for launch in launches if launch.wrote_past_end],
        "torch_ops": [[op, work.largest[op]] for op in work.ops],
        "result": _detached(result),
        "from_launch": [t.untyped_storage().data_ptr() in launched for t in _tensors(result)],
        "inputs_changed": _changed(originals, args),
        "saved": saved_sizes,
    }
    stub_args = _copies(inputs)
    keep = [x for x in stub_args if isinstance(x, torch.Tensor)]
    evidence["stub_error"] = None
    try:
        with watch_torch(min_numel), watch_launches(run=False, keep=keep):
            evidence["stub_result"] = _detached(fn(*stub_args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - code that fails without its kernel depends on it: fine
        evidence["stub_result"], evidence["stub_error"] = None, f"{type(exc).__name__}: {exc}"
    evidence["stub_inputs_changed"] = _changed(originals, stub_args)
    return evidence


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple | list):
        return type(value)(_detached(v) for v in value)
    return value


def check_kernel_work(evidence: dict[str, Any], what: str, kernel: str, *, launches: int = 1,
                      in_place: Sequence[int] = (), other_launches: int = 0, input_names: Sequence[str] = (),
                      from_launch: Sequence[int] | None = None) -> None:
    """Judge ``launch_evidence``: AssertionError naming what is wrong, from the launches to the inputs.

    ``in_place``: indices of the inputs the call updates in place (its results); the others must be
    left alone. ``other_launches``: launches of other kernels allowed (a given forward kernel, say).
    ``from_launch``: indices of the result tensors that must be buffers of a launch (default: all).
    """
    def named(i: int) -> str:
        return input_names[i] if i < len(input_names) else f"input {i}"

    mine = [name for name in evidence["launches"] if name == kernel]
    others = [name.removeprefix("other:") for name in evidence["launches"] if name != kernel]
    if not mine:
        instead = f"; it launched {', '.join(others)} instead: launch your own kernel" if others else ""
        raise AssertionError(f"{what} never launched {kernel}{instead}. The kernel must do the work; "
                             "the Python function around it only allocates, reshapes and launches")
    if len(mine) != launches:
        raise AssertionError(f"{what} launched {kernel} {len(mine)} times, expected {launches}: a fused kernel is one "
                             "launch whose grid covers the whole tensor")
    if len(others) > other_launches:
        raise AssertionError(f"{what} also launched {', '.join(others)}: expected {kernel} alone")
    for name, args in evidence["wrote_past_end"]:
        raise AssertionError(f"{name} wrote past an end of {', '.join(args)}: the last block runs past the end "
                             "of the tensor, and its lanes there must be masked off (mask= on every tl.load and "
                             "tl.store)")
    if evidence["torch_ops"]:
        ops = ", ".join(f"{op} (on {numel} elements)" for op, numel in evidence["torch_ops"])
        raise AssertionError(f"{what} computed in PyTorch outside {kernel}: {ops}. In a fused kernel every pass over "
                             "the data happens inside the kernel; the Python side only allocates, reshapes and launches")
    changed = [i for i in evidence["inputs_changed"] if i not in in_place]
    if changed:
        raise AssertionError(f"{what} changed {', '.join(named(i) for i in changed)} in place: leave the inputs alone")
    if in_place:
        if evidence["stub_inputs_changed"]:
            raise AssertionError(f"with {kernel}'s launch skipped, {what} still changed "
                                 f"{', '.join(named(i) for i in evidence['stub_inputs_changed'])}: "
                                 "the update must happen in the kernel")
        return
    flags = evidence["from_launch"]
    if not all(flags[i] for i in (range(len(flags)) if from_launch is None else from_launch)):
        raise AssertionError(f"{what} returned a tensor that is not a buffer {kernel} was launched with: return "
                             "the output your kernel wrote")
    if evidence["stub_error"] is None:
        finite = sum(int(torch.isfinite(t).sum()) for t in _tensors(evidence["stub_result"]) if t.dtype.is_floating_point)
        if finite:
            raise AssertionError(f"with {kernel}'s launch skipped (its output left NaN), {what} still returned "
                                 f"{finite} finite value(s): they were computed outside the kernel")
