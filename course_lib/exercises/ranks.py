"""Running a test's checks in ranks: the one way the hidden tests of chapters 11-16 start student code in ranks.

Both launchers start ``world_size`` ranks (``support.dist.launch``), run ``fn(*args)`` in each, and
turn what the ranks met into one plain failure for the student:

- a rank that hits an unfinished exercise (``NotImplementedError``, or ``checks.call``'s
  ``NotDoneYet``) makes them raise ``NotDoneYet``, naming the function and the rank;
- a rank whose check failed (an ``AssertionError``) makes them raise ``AssertionError`` naming the rank;
- any other exception comes back as ``support.dist.RankError``, a run past ``timeout`` as ``TimeoutError``.

``launch_checked`` is for checks made inside the ranks (chapters 13-16). Under the grader the ranks
run in the student's kernel, and then once more in the grader's own process with the course's
reference in place of the student's code: every value a check inside the ranks compared must
equal the reference run's (``checks.reference_run``).

``launch_on_cpu`` is for tests that judge the values the ranks return, in the test's own process
(chapters 11 and 12): gloo ranks on the CPU, also where there are GPUs, and no second run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from course_lib.exercises.checks import NotDoneYet, compare_recordings, recording, reference_run
from course_lib.support.dist import launch

__all__ = ["launch_checked", "launch_on_cpu", "warm_up_autograd"]


def warm_up_autograd() -> None:
    """Run one tiny backward with an explicit gradient here, so that forked ranks do not each pay its first-call imports.

    (torch imports a few hundred modules, about half a second, on the first such backward of a
    process; ranks forked before that happens all repeat it.)
    """
    x = torch.zeros(2, requires_grad=True)
    (x * 1.0).backward(torch.ones(2))


def _unfinished(exc: NotImplementedError) -> str:
    """What an unfinished exercise raised: its own message, else the name of the function that raised it."""
    if str(exc):
        return str(exc)
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "not implemented yet"
    code = tb.tb_frame.f_code
    name = code.co_name if "<locals>" in code.co_qualname else code.co_qualname
    return f"{name} is not implemented yet: replace `raise NotImplementedError()` with your code"


class _Checked:
    """Runs ``fn`` in a rank and turns a failed check into a value, so the caller can re-raise it plainly."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[str, Any, list]:
        with recording() as records:
            try:
                return ("ok", self.fn(*args, **kwargs), records)
            except NotImplementedError as exc:
                return ("todo", _unfinished(exc), records)
            except AssertionError as exc:
                return ("fail", f"{type(exc).__name__}: {exc}" if isinstance(exc, NotDoneYet) else str(exc), records)


def _run_checked(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict[str, Any]) -> list[tuple]:
    """``launch`` of ``_Checked(fn)``; raise the first unfinished exercise, then the first failed check, by rank."""
    warm_up_autograd()
    results = launch(_Checked(fn), world_size, *args, **kwargs)
    for rank, (status, value, _) in enumerate(results):
        if status == "todo" or (status == "fail" and value.startswith("NotDoneYet: ")):
            message = value.removeprefix("NotDoneYet: ") or "not implemented yet"
            raise NotDoneYet(f"{message} (raised in rank {rank})")
    for rank, (status, value, _) in enumerate(results):
        if status == "fail":
            raise AssertionError(f"rank {rank} of {world_size}: {value}")
    return results


def launch_checked(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0, **kwargs: Any) -> list[Any]:
    """``support.dist.launch`` for checks inside the ranks: what each rank's ``fn`` returned, judged against the reference."""
    results = _run_checked(fn, world_size, args, {"timeout": timeout, **kwargs})
    reference = reference_run(_Checked(fn), world_size, *args, timeout=timeout, **kwargs)
    for rank, ((_, _, got), (_, _, want)) in enumerate(zip(results, reference or [])):
        compare_recordings(got, want, f"rank {rank} of {world_size}")
    return [value for _, value, _ in results]


def launch_on_cpu(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0, **kwargs: Any) -> list[Any]:
    """``launch_checked``'s failures on gloo CPU ranks, without the reference run: the caller judges what comes back."""
    results = _run_checked(fn, world_size, args, {"backend": "gloo", "timeout": timeout, **kwargs})
    return [value for _, value, _ in results]
