"""`validate`'s report read from an executed notebook: visible points, crashed cells, the reference used instead."""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat

from autograder.validate import inspect_notebook, saved_note, summarise


def _executed(*cells: nbformat.NotebookNode) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    return nb


def _code(source: str, outputs: list | None = None, **nbgrader: object) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source, outputs=outputs or [])
    if nbgrader:
        cell.metadata["nbgrader"] = nbgrader
    return cell


def _error(ename: str, evalue: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[])


def _stdout(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def test_the_report_separates_visible_points_crashes_and_fallbacks() -> None:
    nb = _executed(
        _code("def f(x):\n    raise NotImplementedError()", grade_id="ex1_code", solution=True, grade=False),
        _code("assert f(1) == 2", [_error("NotDoneYet", "f is not implemented yet")],
              grade_id="ex1", grade=True, solution=False, points=3),
        _code("def g(x):\n    return x", grade_id="ex2_code", solution=True, grade=False),
        _code("assert g(1) == 1", grade_id="ex2", grade=True, solution=False, points=2),
        _code("ff = use_or_fallback(f, ref)\nff(2)",
              [_stdout("note: f is not done yet; using the reference course_lib.x.f instead\n")]),
        _code("\nplt.plot(xs, ys)", [_error("ValueError", "x and y must have same first dimension")]),
    )
    result = inspect_notebook(nb)
    report, passed = summarise(result)
    assert not passed
    assert "FAILED ex1 (0/3 points): NotDoneYet: f is not implemented yet" in report
    assert "visible tests: 1 of 2 passed (2 of 5 visible points)" in report
    assert "the grader adds hidden tests" in report
    assert "CRASHED lecture cell (cell 5, `plt.plot(xs, ys)`): ValueError: x and y must have same first dimension" in report
    assert "cells from cell 4 on ran the course's reference instead of your f" in report


def test_an_instructor_copy_with_hidden_tests_reports_points_not_visible_points() -> None:
    nb = _executed(_code("assert True\n### BEGIN HIDDEN TESTS\nassert 1\n### END HIDDEN TESTS",
                         grade_id="ex1", grade=True, solution=False, points=4))
    report, passed = summarise(inspect_notebook(nb))
    assert passed and "tests: 1 of 1 passed (4 of 4 points)" in report and "hidden tests" not in report


def test_a_crashed_exercise_cell_is_named_by_its_grade_id() -> None:
    nb = _executed(_code("def f(:\n", [_error("SyntaxError", "invalid syntax")], grade_id="ex1_code", solution=True))
    report, _ = summarise(inspect_notebook(nb))
    assert "CRASHED exercise cell ex1_code (cell 0, `def f(:`): SyntaxError: invalid syntax" in report


def test_the_note_says_which_saved_version_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "nb.ipynb"
    path.write_text("{}")
    os.utime(path, (time.time() - 600, time.time() - 600))
    note = saved_note(path)
    assert "10 min ago" in note and "save first" in note, note
