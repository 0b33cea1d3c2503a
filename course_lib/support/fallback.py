"""Later cells use the reference where a student's exercise is not done, raises, or failed a cell.

One missed or wrong exercise must not break the rest of a chapter: the lecture cells after an
exercise take the student's function through ``use_or_fallback``, which hands back the
student's code while it works and the course's reference (saying why, once) when it does not.

"Does not work" means any of:

- calling it raises (``NotImplementedError`` of an untouched exercise, or any other exception);
- a cell that used it raised: a failed visible test, or a lecture cell that crashed on what it
  returned. ``watch_cells`` (called by ``course_lib.env`` inside IPython) records this after
  every cell; redefining the function, or running the same cell again without an error,
  clears it.

The rule is one; when it is applied is of two kinds:

- lazy (the default): ``use_or_fallback(fn, ref)`` returns a stand-in that decides at every call,
  so an exercise finished later in the session is used from then on, and a call that raises
  where the reference does not switches to the reference for good;
- eager (with a ``probe``): the choice is made once, now, and the object itself comes back. For
  what cannot be wrapped or must be decided before ranks start: a class used other than by
  calling it (subclassed, ``isinstance``), or code sent to ranks, whose output the notebook does
  not see.

Nothing here takes part in grading: the grader computes the verdict elsewhere.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

__all__ = ["use_or_fallback", "watch_cells", "record_cell", "failure_of", "describe"]

T = TypeVar("T")


@dataclass(frozen=True)
class _Failure:
    """Why a student's object is not used: the reason, and the source of the cell that showed it."""

    reason: str
    cell_source: str


# Student functions and classes known not to work, by object: a redefinition is a new object.
_FAILED: weakref.WeakKeyDictionary[Any, _Failure] = weakref.WeakKeyDictionary()
# Wrappers called during the cell now running, so that a crash can be pinned on them.
_CALLED: weakref.WeakSet[_Fallback] = weakref.WeakSet()


def describe(obj: Any) -> str:
    """The name a student knows ``obj`` by: ``Class.method`` for methods, the plain name otherwise."""
    qualname, name = getattr(obj, "__qualname__", None), getattr(obj, "__name__", None)
    if isinstance(qualname, str) and "." in qualname and "<locals>" not in qualname:
        return qualname  # a method: ColumnParallelLinear.from_linear
    return name or qualname or repr(obj)


def _reference_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{describe(obj)}"


def _first_rank() -> bool:
    """False inside ranks 1.. of a torch.distributed run, so that a note prints once, not once per rank."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _note(student: Any, reference: Any, why: str) -> None:
    if _first_rank():
        print(f"note: {describe(student)} {why}; using the reference {_reference_name(reference)} instead")


def _short_error(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 160 else text[:157] + "..."


def failure_of(student: Any) -> str | None:
    """Why ``student`` is not used by the cells below, or None while it is."""
    try:
        failure = _FAILED.get(student)
    except TypeError:  # not weak-referenceable: never recorded
        return None
    return failure.reason if failure else None


class _Fallback:
    """A student's function that turns into the reference the first time it cannot be used."""

    def __init__(self, student: Callable[..., Any], reference: Callable[..., Any]) -> None:
        self.student, self.reference = student, reference
        self.told = False
        self.__wrapped__ = student
        self.__name__ = getattr(student, "__name__", "student_function")
        self.__qualname__ = describe(student)
        self.__doc__ = getattr(student, "__doc__", None)
        self.__module__ = getattr(student, "__module__", "__main__")

    def _fall_back(self, why: str) -> None:
        if not self.told:
            _note(self.student, self.reference, why)
            self.told = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        reason = failure_of(self.student)
        if reason is not None:
            self._fall_back(reason)
            return self.reference(*args, **kwargs)
        _CALLED.add(self)
        try:
            return self.student(*args, **kwargs)
        except NotImplementedError:
            self._give_up("is not done yet")
            return self.reference(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a failure of student code: does the reference fail too?
            refused = exc
        try:
            result = self.reference(*args, **kwargs)
        except type(refused):
            raise refused from None  # the reference refuses these arguments the same way: part of the contract
        except Exception:
            self._give_up(f"raised {_short_error(refused)}")
            raise
        self._give_up(f"raised {_short_error(refused)}")
        return result

    def _give_up(self, why: str) -> None:
        _record(self.student, why, "")
        self._fall_back(why)

    def __getstate__(self) -> dict[str, Any]:
        # Ranks started from a forkserver see a fresh process: carry the decision with the function.
        state = dict(self.__dict__)
        state["failed"] = failure_of(self.student)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        failed = state.pop("failed", None)
        self.__dict__.update(state)
        if failed is not None:
            _record(self.student, failed, "")


def use_or_fallback(student: T, reference: T, probe: Callable[[T], Any] | None = None) -> T:
    """``student`` where it works, else ``reference``, with a one-line note saying why.

    A function or class comes back wrapped: each call (a class's: building an instance) runs the
    student's code, and the first call that
    raises where the reference does not (an exception the reference raises too, say ValueError
    for a bad argument, is the function's contract and passes through), or any call after a
    cell that used the function raised, runs the reference instead.
    With a ``probe`` (for code that must be decided before ranks start, since a rank's prints
    do not reach the notebook, or a class used other than by calling it) the choice is made
    now and the object itself comes back: the reference if a cell that used the student's
    raised or if ``probe(student)`` raises NotImplementedError. Other exceptions of a probe count as done:
    a probe may need a process group that the notebook's process does not have.
    """
    reason = failure_of(student)
    if reason is not None:
        _note(student, reference, reason)
        return reference
    if probe is not None:
        try:
            probe(student)
        except NotImplementedError:
            _record(student, "is not done yet", "")
            _note(student, reference, "is not done yet")
            return reference
        except Exception:  # noqa: BLE001,S110 - implemented, it just cannot run here
            pass
        return student
    if not callable(student):
        return student
    # The reference is the same kind of callable as the student's; the wrapper stands in for both.
    return cast(T, _Fallback(student, cast(Callable[..., Any], reference)))


# --------------------------------------------------------------------------------------------
# Watching cells: which student objects did a failing cell use?
# --------------------------------------------------------------------------------------------


def _record(student: Any, reason: str, cell_source: str) -> None:
    with contextlib.suppress(TypeError):  # not weak-referenceable (a builtin, say): nothing to remember
        _FAILED[student] = _Failure(reason, cell_source)


def _names_used(source: str) -> set[str]:
    """Names a cell reads without assigning them itself (empty when the cell does not parse)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    loaded: set[str] = set()
    stored: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else stored).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stored.add(node.name)
    return loaded - stored


def _student_objects(names: set[str], namespace: dict[str, Any]) -> list[Any]:
    """The functions and classes among ``names`` that the notebook itself defined."""
    found = []
    for name in sorted(names):
        obj = namespace.get(name)
        if isinstance(obj, _Fallback):
            found.append(obj.student)
        elif (isinstance(obj, type) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == "__main__":
            found.append(obj)
    return found


def record_cell(source: str, error: BaseException | None, namespace: dict[str, Any], label: str) -> None:
    """After a cell: remember the notebook's functions it used if it raised; forget them if it now runs."""
    called = [w.student for w in list(_CALLED)]
    _CALLED.clear()
    if error is None:
        for obj, failure in list(_FAILED.items()):
            if failure.cell_source == source:
                del _FAILED[obj]
        return
    if isinstance(error, KeyboardInterrupt):
        return
    reason = f"is not used below: {label}, which uses it, raised {_short_error(error)}"
    for obj in _student_objects(_names_used(source), namespace) + called:
        if failure_of(obj) is None:
            _record(obj, reason, source)


def _after_cell(result: Any) -> None:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return
    count = getattr(result, "execution_count", None)
    label = f"cell [{count}]" if count else "a cell"
    error = result.error_in_exec or result.error_before_exec
    record_cell(result.info.raw_cell or "", error, shell.user_ns, label)


def watch_cells() -> None:
    """In IPython, call ``record_cell`` after every cell (once, however often this runs)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or _after_cell in shell.events.callbacks["post_run_cell"]:
        return
    shell.events.register("post_run_cell", _after_cell)
