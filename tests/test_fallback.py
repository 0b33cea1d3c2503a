"""The reference fallback: later cells use the reference where a student's code is not done, raises, or failed a cell."""

from __future__ import annotations

import pickle

import pytest

from course_lib.support import fallback
from course_lib.support.fallback import use_or_fallback


def _todo(x: int) -> int:
    raise NotImplementedError


def _ok(x: int) -> int:
    return x + 1


def _broken(x: int) -> int:
    raise IndexError("list index out of range")


def _as_if_from_notebook(fn):
    """``fn`` as the notebook would define it (functions of a notebook live in ``__main__``)."""
    fn.__module__ = "__main__"
    return fn


def test_a_function_not_done_yet_uses_the_reference_and_says_so_once(capsys: pytest.CaptureFixture[str]) -> None:
    fn = use_or_fallback(_todo, _ok)
    assert fn(1) == 2 and fn(2) == 3
    out = capsys.readouterr()
    assert out.out.count("not done yet") == 1 and "_ok" in out.out and out.err == ""
    assert use_or_fallback(_ok, _broken)(1) == 2
    assert capsys.readouterr().out == "", "a working function is used silently"


def test_a_function_that_raises_uses_the_reference_and_names_the_error(capsys: pytest.CaptureFixture[str]) -> None:
    def raises(x: int) -> int:
        raise IndexError("list index out of range")

    fn = use_or_fallback(raises, _ok)
    assert fn(1) == 2 and fn(5) == 6
    out = capsys.readouterr().out
    assert out.count("note:") == 1 and "IndexError: list index out of range" in out and "_ok" in out, out


def test_a_cell_that_raised_after_using_a_function_sends_the_cells_below_to_the_reference(
        capsys: pytest.CaptureFixture[str]) -> None:
    wrong = _as_if_from_notebook(lambda x: x - 1)
    namespace = {"wrong": wrong}
    test_cell = "assert wrong(1) == 2, 'wrong(1) should be 2'"
    fallback.record_cell(test_cell, AssertionError("wrong(1) should be 2"), namespace, "cell [7]")
    lecture = use_or_fallback(wrong, _ok)
    assert lecture(1) == 2, "after its test cell failed, the lecture cell must run the reference"
    out = capsys.readouterr().out
    assert "cell [7]" in out and "AssertionError: wrong(1) should be 2" in out, out

    fallback.record_cell(test_cell, None, namespace, "cell [9]")  # the same cell runs again, and passes
    assert fallback.failure_of(wrong) is None, "a rerun of the failing cell without an error clears it"


def test_a_redefined_function_starts_afresh() -> None:
    first = _as_if_from_notebook(lambda x: x)
    fallback.record_cell("first(0)", ValueError("boom"), {"first": first}, "cell [1]")
    assert fallback.failure_of(first) is not None
    second = _as_if_from_notebook(lambda x: x + 1)
    assert fallback.failure_of(second) is None and use_or_fallback(second, _ok)(1) == 2


def test_names_a_failing_cell_defines_or_imports_from_elsewhere_are_not_blamed() -> None:
    helper = _as_if_from_notebook(lambda: None)
    fallback.record_cell("def helper():\n    pass\nhelper()\nlen([])", RuntimeError("x"),
                         {"helper": helper, "len": len, "ok": _ok}, "cell [2]")
    assert fallback.failure_of(helper) is None, "the cell defined helper itself"
    assert fallback.failure_of(_ok) is None, "_ok comes from a module, not from the notebook"


def test_a_wrapper_called_in_a_crashing_cell_is_blamed_even_under_another_name() -> None:
    shifted = _as_if_from_notebook(lambda x: x + 10)
    step = use_or_fallback(shifted, _ok)
    step(1)
    fallback.record_cell("plot(results)", ValueError("shapes do not match"), {}, "cell [4]")
    assert "shapes do not match" in (fallback.failure_of(shifted) or "")
    assert step(1) == 2


def test_classes_and_probed_functions_are_decided_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    class Todo:
        @classmethod
        def build(cls) -> Todo:
            raise NotImplementedError

    class NeedsGroup:
        @classmethod
        def build(cls) -> NeedsGroup:
            raise RuntimeError("Default process group has not been initialized")

    class Reference:
        @classmethod
        def build(cls) -> Reference:
            return cls()

    assert use_or_fallback(Todo, Reference, lambda c: c.build()) is Reference
    assert "Todo is not done yet" in capsys.readouterr().out
    assert use_or_fallback(NeedsGroup, Reference, lambda c: c.build()) is NeedsGroup, \
        "a probe that needs a process group does not make a finished class fall back"
    assert isinstance(use_or_fallback(Reference, Todo)(), Reference), "a working class builds the student's instances"

    class Unbuilt:
        def __init__(self) -> None:
            raise NotImplementedError

    assert isinstance(use_or_fallback(Unbuilt, Reference)(), Reference), "an unfinished class builds the reference's"
    _as_if_from_notebook(NeedsGroup)
    fallback.record_cell("NeedsGroup.build()", AssertionError("wrong shape"), {"NeedsGroup": NeedsGroup}, "cell [3]")
    assert use_or_fallback(NeedsGroup, Reference, lambda c: c.build()) is Reference


def test_the_decision_travels_with_a_pickled_wrapper() -> None:
    fn = use_or_fallback(_broken, _ok)
    assert fn(1) == 2
    data = pickle.dumps(fn)
    fallback._FAILED.clear()  # as in a rank started from a forkserver: nothing recorded there
    copy = pickle.loads(data)
    assert "IndexError" in (fallback.failure_of(copy.student) or ""), "the rank must know the function failed"
    assert copy(3) == 4


def _fallback_in_rank() -> None:
    use_or_fallback(_todo, _ok)(1)


def test_notes_come_from_the_first_rank_only(capfd: pytest.CaptureFixture[str]) -> None:
    from course_lib.support.dist import launch

    launch(_fallback_in_rank, 2)
    out = capfd.readouterr().out
    assert out.count("not done yet") == 1 and "[rank 0]" in out, out


def test_in_ipython_a_failed_test_cell_makes_the_lecture_cell_use_the_reference() -> None:
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance()
    try:
        fallback.watch_cells()
        fallback.watch_cells()
        assert shell.events.callbacks["post_run_cell"].count(fallback._after_cell) == 1, "registered once"
        cells = [
            "from course_lib.support.fallback import use_or_fallback\ndef double(x):\n    return x + x + 1",
            "assert double(2) == 4, f'double(2) returned {double(2)}'",
            "fn = use_or_fallback(double, lambda x: 2 * x)\nresult = fn(21)",
        ]
        with capture_output() as captured:
            outcomes = [shell.run_cell(c) for c in cells]
        assert [o.success for o in outcomes] == [True, False, True]
        assert shell.user_ns["result"] == 42, "the lecture cell ran the reference"
        assert "double is not used below" in captured.stdout and "double(2) returned 5" in captured.stdout
        with capture_output():
            shell.run_cell("def double(x):\n    return 2 * x")
            shell.run_cell(cells[2])
        assert shell.user_ns["fn"].student is shell.user_ns["double"] and shell.user_ns["result"] == 42
        assert fallback.failure_of(shell.user_ns["double"]) is None, "the fixed definition is used"
    finally:
        shell.events.unregister("post_run_cell", fallback._after_cell)
        InteractiveShell.clear_instance()


def test_an_exception_the_reference_raises_too_is_the_contract_not_a_failure() -> None:
    def student(budget: int) -> int:
        if budget < 0:
            raise ValueError("budget must not be negative")
        return budget

    def reference(budget: int) -> int:
        if budget < 0:
            raise ValueError("negative budget")
        return budget

    fn = use_or_fallback(student, reference)
    with pytest.raises(ValueError, match="budget must not be negative"):
        fn(-1)
    assert fallback.failure_of(student) is None and fn(3) == 3

    def wrong_error(budget: int) -> int:
        raise TypeError("oops")

    fn = use_or_fallback(wrong_error, reference)
    with pytest.raises(ValueError, match="negative budget"):
        fn(-1)
    assert "TypeError: oops" in (fallback.failure_of(wrong_error) or "")
