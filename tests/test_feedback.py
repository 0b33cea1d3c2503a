"""Feedback pieces: the hidden/visible mark computed in the tester, and maths rendered on the host, safely."""

from __future__ import annotations

import nbformat

from autograder.execute import HIDDEN_FAILURE, VISIBLE_FAILURE, _judge
from autograder.maths import to_mathml
from autograder.tester import _failed_in_hidden_part

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
        _judge(cell, {"passed": False, "error": ["AssertionError", "got 13.0, expected 15.0"], "hidden": hidden})
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
