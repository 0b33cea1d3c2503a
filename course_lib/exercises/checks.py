"""Helpers for exercise tests: comparisons that explain themselves (the reference fallback is ``course_lib.support.fallback``).

A failing check raises ``AssertionError`` with a message meant for the student:
what was expected, what came back, and where the two differ.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from course_lib.support.fallback import describe

__all__ = [
    "TOLERANCES",
    "NotDoneYet",
    "assert_close",
    "assert_equal",
    "assert_raises",
    "is_implemented",
    "call",
    "by_reference",
    "is_by_reference",
    "student_side",
    "sending_to",
    "recording",
    "compare_recordings",
    "reference_run",
    "hidden_seed",
    "secret_seed",
    "not_done",
]

# Default tolerances per dtype: about a few units in the last place of each format.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-3, 1e-4),
    torch.bfloat16: (1.6e-2, 1e-3),
}


class NotDoneYet(AssertionError):
    """Raised by a test when the exercise still raises NotImplementedError."""


def _as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.from_numpy(np.asarray(x))  # Python floats stay float64, as NumPy keeps them


def assert_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    name: str = "result",
    check_dtype: bool = True,
    equal_nan: bool = True,
) -> None:
    """Check ``actual`` against ``expected``; on failure say which of type, shape, dtype or value is off."""
    _record("close", name, actual, {"rtol": rtol, "atol": atol, "check_dtype": check_dtype, "equal_nan": equal_nan})
    if isinstance(expected, torch.Tensor) and not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{name}: expected a torch.Tensor, got {type(actual).__name__}")
    a, e = _as_tensor(actual), _as_tensor(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)}, expected {tuple(e.shape)}")
    if check_dtype and a.dtype != e.dtype:
        raise AssertionError(f"{name}: dtype {a.dtype}, expected {e.dtype}")
    default_rtol, default_atol = TOLERANCES.get(e.dtype, (0.0, 0.0))
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    a64, e64 = a.detach().cpu().to(torch.float64), e.detach().cpu().to(torch.float64)
    if a.dtype.is_floating_point or e.dtype.is_floating_point:
        both_nan = torch.isnan(a64) & torch.isnan(e64)
        exact = torch.isinf(e64) | torch.isinf(a64)  # infinities must match exactly, sign included
        err = torch.where(both_nan | (exact & (a64 == e64)), torch.zeros_like(a64), (a64 - e64).abs())
        bad = (err > atol + rtol * e64.abs()) | torch.isnan(err) | (exact & (a64 != e64))
        if not equal_nan:
            bad |= both_nan
    else:
        err = (a64 - e64).abs()
        bad = a64 != e64
    n_bad = int(bad.sum())
    if n_bad == 0:
        return
    flat = int(torch.nonzero(bad.reshape(-1))[0])
    where = tuple(int(i) for i in np.unravel_index(flat, tuple(a.shape))) if a.dim() else ()
    worst = err.reshape(-1)[bad.reshape(-1)].max().item()
    raise AssertionError(
        f"{name}: {n_bad} of {a.numel()} element(s) differ (shape {tuple(a.shape)}, dtype {a.dtype}); "
        f"first at index {where}: got {a64.reshape(-1)[flat].item()!r}, expected {e64.reshape(-1)[flat].item()!r}; "
        f"max abs error {worst:.3g} (rtol={rtol:g}, atol={atol:g})"
    )


def assert_equal(actual: Any, expected: Any, *, name: str = "result") -> None:
    """Check exact equality of plain values (numbers, strings, tuples, dicts), naming both on failure."""
    _record("equal", name, actual, {})
    if isinstance(expected, float) and isinstance(actual, (int, float)) and math.isnan(expected) and math.isnan(actual):
        return
    if actual != expected:
        raise AssertionError(f"{name}: got {actual!r}, expected {expected!r}")


def assert_raises(exc_type: type[BaseException], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> BaseException:
    """Check that ``fn(*args, **kwargs)`` raises ``exc_type``; return the exception."""
    try:
        fn(*args, **kwargs)
    except NotImplementedError:
        if exc_type is not NotImplementedError:
            raise not_done(fn) from None
        raise
    except exc_type as exc:
        return exc
    except Exception as exc:
        raise AssertionError(
            f"{_name(fn)}{_show_args(args, kwargs)} raised {type(exc).__name__}: {exc}; "
            f"expected {exc_type.__name__}"
        ) from exc
    raise AssertionError(f"{_name(fn)}{_show_args(args, kwargs)} returned normally; expected it to raise {exc_type.__name__}")


def is_implemented(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """True unless calling ``fn`` on these arguments raises NotImplementedError (an untouched exercise)."""
    try:
        fn(*args, **kwargs)
    except NotImplementedError:
        return False
    return True


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a student's function; an untouched exercise fails with a clear 'not done yet' message."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise not_done(fn) from None


_BY_REFERENCE: dict[int, Any] = {}
_SENDER: list[Any] = []


def by_reference(obj: Any) -> Any:
    """Mark ``obj`` to stay with the tests when it is handed to a student's function; return it.

    In a notebook this changes nothing. Under the grader, where tests run in a process of their own,
    the student's code then calls back to this very object (a counting source, a simulated clock)
    instead of receiving a copy, so what the test observes is what the student's code did.
    """
    _BY_REFERENCE[id(obj)] = obj
    return obj


def is_by_reference(obj: Any) -> bool:
    """Whether ``by_reference`` marked ``obj``."""
    return id(obj) in _BY_REFERENCE and _BY_REFERENCE[id(obj)] is obj


def student_side(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, to be run where the student's objects live; its result must be plain data.

    In a notebook this is ``fn`` itself. Under the grader it is sent by value to the student's kernel and
    run there (an autograd backward through the student's module, a check that a builtin is not used),
    and only its plain-data result comes back to be judged.
    """
    if not _SENDER:
        return fn
    channel = _SENDER[-1]

    @functools.wraps(fn)
    def in_student_kernel(*args: Any, **kwargs: Any) -> Any:
        return channel.request(fn, "call", args, kwargs, "args")

    return in_student_kernel


@contextlib.contextmanager
def _pushed(stack: list[Any], value: Any) -> Iterator[None]:
    """``value`` on top of ``stack`` for the block: the innermost block's setting wins."""
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()


def sending_to(channel: Any) -> contextlib.AbstractContextManager[None]:
    """Within the block, ``student_side`` sends functions over ``channel`` (used by the grader's tester)."""
    return _pushed(_SENDER, channel)


_RECORDS: list[list[tuple[str, str, Any, dict[str, Any]]]] = []


def _record(kind: str, name: str, actual: Any, options: dict[str, Any]) -> None:
    """While ``recording``, keep what a check was given to compare (a copy of its ``actual``)."""
    if _RECORDS:
        kept = actual.detach().clone() if isinstance(actual, torch.Tensor) else copy.deepcopy(actual)
        _RECORDS[-1].append((kind, name, kept, options))


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, str, Any, dict[str, Any]]]]:
    """Within the block, ``assert_close`` and ``assert_equal`` also keep what they check (kind, name, actual, options)."""
    _RECORDS.append([])
    try:
        yield _RECORDS[-1]
    finally:
        _RECORDS.pop()


def compare_recordings(got: list, reference: list, label: str) -> None:
    """Check the values a run of the student's code gave each check against a run of the reference's, check by check."""
    if [(k, n) for k, n, _, _ in got] != [(k, n) for k, n, _, _ in reference]:
        raise AssertionError(f"{label}: the checks that ran ({len(got)}) are not those of the reference run "
                             f"({len(reference)}): the run took another path")
    for (kind, name, actual, options), (_, _, expected, _) in zip(got, reference):
        if kind == "close":
            assert_close(actual, expected, name=f"{label}: {name}", **options)
        else:
            assert_equal(actual, expected, name=f"{label}: {name}")


def reference_run(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any] | None:
    """Under the grader, the same ranks run with the reference in place of the student's code, in the tester; else None.

    With ``recording`` around ``fn`` in every rank and ``compare_recordings``, a check made inside the
    student's ranks is judged against what the reference gave in the tester's own ranks, never
    against an expected value worked out where the student's code runs.
    """
    if not _SENDER:
        return None
    return _SENDER[-1].reference_launch(fn, world_size, args, kwargs)


_SECRET: list[int] = []


def hidden_seed(seed: int) -> int:
    """``seed`` itself in a notebook; under the grader, ``seed`` mixed with a secret drawn for the grading run.

    Hidden tests draw their random inputs from ``hidden_seed(n)``: the tests are public, but the
    inputs they are graded on are not, so no answer can be written down for them in advance.
    """
    if not _SECRET:
        return seed
    return (seed * 1_000_003 + _SECRET[-1]) % (2**31 - 1)


def secret_seed(secret: int) -> contextlib.AbstractContextManager[None]:
    """Within the block, ``hidden_seed`` mixes in ``secret`` (used by the grader's tester)."""
    return _pushed(_SECRET, secret)


def not_done(fn: Any) -> NotDoneYet:
    """The failure of a check that met an untouched exercise: names it, and says what to replace."""
    return NotDoneYet(f"{describe(fn)} is not implemented yet: replace `raise NotImplementedError()` with your code")


_name = describe


def _show_args(args: tuple, kwargs: dict) -> str:
    parts = [_short(a) for a in args] + [f"{k}={_short(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def _short(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype})"
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."
