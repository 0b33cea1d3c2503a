"""Feedback pieces: the hidden/visible mark computed in the tester, and maths rendered on the host, safely."""

from __future__ import annotations

from pathlib import Path

import nbformat

from autograder.contracts import Status, Verdict
from autograder.execute import HIDDEN_FAILURE, VISIBLE_FAILURE, _judge
from autograder.maths import to_mathml
from autograder.tester import _failed_in_hidden_part
from autograder.worker import run_steps

CELL = """\
def _check(x):
    assert x < 3, f"got {x}"

_check(1)
### BEGIN HIDDEN TESTS
_check(5)
### END HIDDEN TESTS
"""


def _failure(source: str) -> BaseException:
    try:
        exec(compile(source, "<test ex1>", "exec"), {})
    except AssertionError as exc:
        return exc
    raise AssertionError("the cell did not fail")


def test_a_failure_in_a_hidden_statement_is_hidden_even_inside_a_visible_helper() -> None:
    assert _failed_in_hidden_part(_failure(CELL), "<test ex1>", CELL)
    visible = CELL.replace("_check(1)", "_check(4)")
    assert not _failed_in_hidden_part(_failure(visible), "<test ex1>", visible)
    assert not _failed_in_hidden_part(_failure(CELL), "<test other>", CELL), "only the cell's own frames count"


def test_the_judged_cell_says_which_kind_of_case_failed() -> None:
    for hidden, prefix in ((True, HIDDEN_FAILURE), (False, VISIBLE_FAILURE)):
        cell = nbformat.v4.new_code_cell("x")
        _judge(cell, Verdict("ex1", False, ("AssertionError", "got 13.0, expected 15.0"), hidden))
        error = cell.outputs[-1]
        assert error.evalue == prefix + "got 13.0, expected 15.0", error


def test_maths_becomes_mathml_with_nothing_live_in_it() -> None:
    inline = to_mathml(r"\frac{1}{k}\sum_j L_j", display=False)
    assert inline.startswith("<math") and "<mfrac>" in inline and 'display="inline"' in inline
    assert 'display="block"' in to_mathml("x^2", display=True)
    hostile = to_mathml(r"\text{<script>alert(1)</script>} \href{javascript:alert(1)}{x} \style{color:red}{y}", False)
    assert "<script" not in hostile and "javascript:" not in hostile and "style=" not in hostile, hostile
    assert "<mtext>alert(1)</mtext>" in hostile, "a dropped element's text stays, as text"
    assert to_mathml(r"\frac{1}{", display=False) == r"$\frac{1}{$", "LaTeX that does not convert shows as written"


def test_the_feedback_page_fetches_nothing_renders_maths_and_wraps() -> None:
    import os
    import re

    import nbgrader
    from traitlets.config import Config

    from autograder.feedback import InertHTMLExporter

    config = Config()  # what nbgrader's GenerateFeedback sets: its own feedback template
    base = os.path.join(os.path.dirname(nbgrader.__file__), "server_extensions", "formgrader")
    config.HTMLExporter.template_name = "feedback"
    config.HTMLExporter.extra_template_basedirs = [os.path.join(base, "templates")]
    config.HTMLExporter.extra_template_paths = [os.path.join(base, "static", "node_modules", "bootstrap", "dist", "css")]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(r"The loss $L = \frac{1}{k}\sum_j L_j$, and $$\nabla L = \sum_j \nabla L_j$$"),
                nbformat.v4.new_code_cell("check()", outputs=[nbformat.v4.new_output(
                    "error", ename="AssertionError", evalue="x" * 400 + " got 13.0, expected 15.0",
                    traceback=["AssertionError: " + "x" * 400 + " got 13.0, expected 15.0"])])]
    page, _ = InertHTMLExporter(config=config).from_notebook_node(
        nb, resources={"nbgrader": {"notebook": "ch", "score": 0, "max_score": 1, "late_penalty": 0}})
    assert not re.findall(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//", page, re.I)
    assert "<script" not in page, "nothing on the page runs"
    assert page.count("<math") == 2 and "$" not in re.sub(r"<[^>]+>", "", page.split("<body", 1)[1]).replace("$$", "")
    assert "white-space: pre-wrap" in page and "got 13.0, expected 15.0" in page


# A test cell of a tiny exercise, and a wrong answer that passes its visible check only.
DOUBLE_TEST = """\
assert double(2) == 4, f"double(2) gave {double(2)}, expected 4"
### BEGIN HIDDEN TESTS
assert double(-7) == -14, f"double(-7) gave {double(-7)}, expected -14"
### END HIDDEN TESTS"""
HIDDEN_CODE = "assert double(-7) == -14"


def _judged_cell(double: object) -> nbformat.NotebookNode:
    """The test cell after the tester ran it against ``double`` and the judge gave it its outputs."""
    grade_id = "ex1_double"
    try:
        exec(compile(DOUBLE_TEST, f"<test {grade_id}>", "exec"), {"double": double})
        verdict = Verdict(grade_id, True)
    except AssertionError as exc:
        verdict = Verdict(grade_id, False, (type(exc).__name__, str(exc)),
                          _failed_in_hidden_part(exc, f"<test {grade_id}>", DOUBLE_TEST))
    cell = nbformat.v4.new_code_cell(DOUBLE_TEST, metadata={"nbgrader": {
        "grade": True, "solution": False, "locked": True, "points": 1, "grade_id": grade_id, "score": 0}})
    _judge(cell, verdict)
    return cell


def _feedback_page(cells: list[nbformat.NotebookNode]) -> str:
    """The feedback HTML of a notebook of ``cells``, through the preprocessors and exporter the grader configures."""
    from nbgrader.converters import GenerateFeedback

    from autograder.config import nbgrader_config
    from autograder.feedback import InertHTMLExporter, InertOutputs, RedactHiddenTests

    config = GenerateFeedback(config=nbgrader_config(".")).config
    nb = nbformat.v4.new_notebook(cells=cells)
    resources = {"nbgrader": {"notebook": "ch", "score": 0, "max_score": 1, "late_penalty": 0}}
    for step in (RedactHiddenTests(config=config), InertOutputs(config=config)):
        nb, resources = step.preprocess(nb, resources)
    return InertHTMLExporter(config=config).from_notebook_node(nb, resources=resources)[0]


def _page_text(page: str) -> str:
    """What a reader sees of an HTML page: its text, tags removed (syntax highlighting splits code into spans)."""
    import html
    import re

    return html.unescape(re.sub(r"<[^>]+>", "", page))


def test_a_hidden_failure_is_marked_in_the_feedback_without_its_code() -> None:
    import re

    page = _page_text(_feedback_page([_judged_cell(lambda x: abs(2 * x))]))
    assert HIDDEN_FAILURE.strip() in page and "double(-7) gave 14, expected -14" in page, "say which case failed"
    assert VISIBLE_FAILURE.strip() not in page
    assert "assert double(2) == 4" in page, "the visible checks stay shown"
    assert HIDDEN_CODE not in page and "HIDDEN TESTS" not in page, "the hidden code never shows"
    assert not re.search(r"line \d+|<test ex1_double>", page), "no line number or file name of the cell's code"


def test_a_visible_failure_is_marked_as_visible() -> None:
    page = _page_text(_feedback_page([_judged_cell(lambda x: x + 1)]))
    assert VISIBLE_FAILURE.strip() in page and "double(2) gave 3, expected 4" in page
    assert HIDDEN_FAILURE.strip() not in page and HIDDEN_CODE not in page


def test_grades_csv_keeps_every_failure_message_whole(tmp_path: Path) -> None:
    import csv

    from autograder.contracts import Grade
    from autograder.grade import write_grades
    from autograder.worker import failed_tests

    messages = [f"case {i}: got 13.0, expected 15.0 at index (3, {i}); " + "the sum drifts, " * 20 + "see the docstring"
                for i in range(5)]
    messages.append("=1+1 is not a formula here,\nand this line stays")
    cells = [nbformat.v4.new_code_cell("check()", metadata={"nbgrader": {"grade": True, "solution": False,
                                                                          "grade_id": f"ex{i}", "points": 1}},
                                       outputs=[nbformat.v4.new_output("error", ename="AssertionError", evalue=m)])
             for i, m in enumerate(messages)]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), tmp_path / "graded.ipynb")
    summary = failed_tests(tmp_path / "graded.ipynb")
    assert summary == ", ".join(f"ex{i} (AssertionError: {m})" for i, m in enumerate(messages)), summary
    write_grades([Grade("=student", "ch", 0, 6, "ok", summary)], tmp_path, {})
    with open(tmp_path / "grades.csv", newline="", encoding="utf-8") as f:
        (row,) = list(csv.DictReader(f))
    assert row["message"] == summary, "the message comes back whole: no cut, commas and newlines quoted"
    assert row["student_id"] == "'=student", "a cell that starts like a formula is still escaped"


class _FakeAPI:
    """nbgrader's API with canned answers: which steps ran, in order."""

    def __init__(self, autograde_ok: bool, feedback_ok: bool) -> None:
        self.ran: list[str] = []
        self.answers = {"autograde": autograde_ok, "generate_feedback": feedback_ok}

    def _step(self, name: str) -> dict:
        self.ran.append(name)
        ok = self.answers[name]
        return {"success": ok, "log": "", "error": "" if ok else f"ModuleNotFoundError: no module for {name}"}

    def autograde(self, chapter: str, student: str) -> dict:
        return self._step("autograde")

    def generate_feedback(self, chapter: str, student: str) -> dict:
        return self._step("generate_feedback")


def test_a_feedback_page_that_cannot_be_made_leaves_the_scores_standing() -> None:
    api = _FakeAPI(autograde_ok=True, feedback_ok=False)
    failure, note = run_steps(api, "01_floating_point", "s00001")  # type: ignore[arg-type]
    assert failure is None and api.ran == ["autograde", "generate_feedback"]
    assert note == "no feedback page (generate_feedback failed: ModuleNotFoundError: no module for generate_feedback)"
    failure, note = run_steps(_FakeAPI(True, True), "01_floating_point", "s00001")  # type: ignore[arg-type]
    assert failure is None and note == ""


def test_a_failed_autograde_is_an_error_and_makes_no_feedback() -> None:
    api = _FakeAPI(autograde_ok=False, feedback_ok=True)
    failure, note = run_steps(api, "01_floating_point", "s00001")  # type: ignore[arg-type]
    assert failure is not None and failure.status is Status.ERROR and api.ran == ["autograde"]
    assert failure.message == "autograde failed: ModuleNotFoundError: no module for autograde" and note == ""
