"""The site's checks (website.check) catch each fault they are for, and the graft (website.editions) shows no solution.

Fast: tiny synthetic sites and notebooks in tmp_path; the test over the real chapters grafts them with
made-up outputs instead of executing them.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from html import escape
from pathlib import Path

import nbformat
import pytest
from nbformat import NotebookNode
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from website import editions
from website.check import check_site, leaks, main
from website.editions import EDITIONS_DIR, graft, record

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 32  # only its size is checked

PAGE = """<!DOCTYPE html>
<html><head><link rel="stylesheet" href="../_static/site.css?v=1"><script src="../_static/site.js"></script></head>
<body><a href="#main">skip</a><a href="#">top</a><a href="https://example.org/x">elsewhere</a>
<main id="main"><section id="intro"><h1>Chapter</h1>
<p>Back to <a href="../index.html#chapters">the chapters</a>, on to <a href="#intro">the top</a>.</p>
<div class="cell docutils container">
<div class="cell_input docutils container"><pre><span class="n">y</span> <span class="o">=</span> lecture(x)
</pre></div>
<div class="cell_output docutils container">
<div class="output stream highlight-myst-ansi notranslate"><pre>relative error 1e-06
</pre></div>
<img alt="Plot: loss by step" src="../_images/plot.png" />
</div></div>
{extra}
</section></main></body></html>
"""
INDEX = """<!DOCTYPE html><html><body><h2 id="chapters">Chapters</h2>
<a href="cpu/01_demo.html">CPU</a> <a href="cpu/">the CPU edition</a> <a href="cpu/01_demo.html#intro">intro</a>
<img alt="Course logo" src="_static/logo.svg"></body></html>
"""


def site(tmp_path: Path, extra: str = "") -> Path:
    """A tiny site like Sphinx writes: a landing page and one chapter page of the cpu edition."""
    html = tmp_path / "html"
    for folder in ("_static", "_images", "cpu"):
        (html / folder).mkdir(parents=True, exist_ok=True)
    (html / "index.html").write_text(INDEX)
    (html / "cpu" / "index.html").write_text('<html><body><a href="01_demo.html">01</a></body></html>')
    (html / "cpu" / "01_demo.html").write_text(PAGE.replace("{extra}", extra))
    (html / "_static" / "site.css").write_text("body { margin: 0 }")
    (html / "_static" / "site.js").write_text("// nothing")
    (html / "_static" / "logo.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg"/>')
    (html / "_images" / "plot.png").write_bytes(PNG)
    return html


def check(html: Path) -> list[str]:
    """check_site on the tiny site's one chapter and edition."""
    return check_site(html, ["01_demo"], ["cpu"])


def test_a_clean_site_passes(tmp_path: Path) -> None:
    assert check(site(tmp_path)) == []


FAULTS: dict[str, tuple[Callable[[Path], object], str]] = {
    "broken link": (lambda h: _append(h, '<a href="02_next.html">next</a>'), "broken link '02_next.html'"),
    "broken anchor": (lambda h: _append(h, '<a href="../index.html#nowhere">x</a>'), "has no id 'nowhere'"),
    "link out of the site": (lambda h: _append(h, '<a href="../../secret.html">x</a>'), "leaves the site"),
    "script from a CDN": (lambda h: _append(h, '<script src="https://cdn.example.org/mathjax.js"></script>'),
                          "loads 'https://cdn.example.org/mathjax.js' from another site"),
    "stylesheet from elsewhere": (lambda h: _append(h, '<link rel="stylesheet" href="//fonts.example.org/a.css">'),
                                  "loads '//fonts.example.org/a.css' from another site"),
    "missing stylesheet": (lambda h: (h / "_static" / "site.css").unlink(), "broken link '../_static/site.css?v=1'"),
    "missing image": (lambda h: (h / "_images" / "plot.png").unlink(), "missing image '../_images/plot.png'"),
    "empty image": (lambda h: (h / "_images" / "plot.png").write_bytes(b""), "empty image '../_images/plot.png'"),
    "image without alt": (lambda h: _append(h, '<img src="../_images/plot.png">'), "has no alt text"),
    "image with blank alt": (lambda h: _append(h, '<img alt=" " src="../_images/plot.png">'), "has no alt text"),
    "page without outputs": (lambda h: _edit(h, 'class="cell_output docutils container"', 'class="x"'),
                             "01_demo.html: the chapter page shows no cell output"),
    "missing chapter page": (lambda h: (h / "cpu" / "01_demo.html").unlink(), "01_demo.html: the chapter page is missing"),
    "error output": (lambda h: _append(h, '<div class="cell_output"><div class="output traceback"><pre>'
                                          '<span class="ne">ZeroDivisionError</span>: division by zero</pre></div></div>'),
                     "an output shows an error"),
    "traceback printed": (lambda h: _append(h, '<div class="cell_output"><pre><span class="n">Traceback</span> '
                                               '<span class="p">(</span>most recent call last<span class="p">)</span>'
                                               '</pre></div>'), "an output shows a traceback"),
    "exception line printed": (lambda h: _append(h, '<div class="cell_output"><pre>RuntimeError: CUDA out of memory'
                                                    '</pre></div>'), "an output shows a traceback"),
    "build error on the page": (lambda h: _append(h, '<div class="system-message">Unknown directive</div>'),
                                "the build left an error message"),
}


def _append(html: Path, extra: str) -> None:
    (html / "cpu" / "01_demo.html").write_text(PAGE.replace("{extra}", extra))


def _edit(html: Path, old: str, new: str) -> None:
    page = html / "cpu" / "01_demo.html"
    page.write_text(page.read_text().replace(old, new))


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_is_caught(tmp_path: Path, fault: str) -> None:
    html = site(tmp_path)
    plant, expected = FAULTS[fault]
    plant(html)
    problems = check(html)
    assert any(expected in p for p in problems), f"{fault}: expected {expected!r} in {problems}"


def test_error_words_outside_outputs_are_fine(tmp_path: Path) -> None:
    prose = "<p>A <code>RuntimeError: out of memory</code> means the batch is too large; read the Traceback.</p>"
    assert check(site(tmp_path, prose)) == []


# --- the no-leak check -------------------------------------------------------------------------------

SOLUTION_CELL = '''def scale(x, factor):
    """x times factor."""
    ### BEGIN SOLUTION
    checked = validate_factor(factor)
    return x * checked
    ### END SOLUTION
'''
TEST_CELL = '''assert scale(2, 3) == 6
### BEGIN HIDDEN TESTS
assert scale(-1.5, 4) == -6.0, "negative"
assert scale(0, 99) == 0
### END HIDDEN TESTS
'''
RELEASED_SOLUTION = '''def scale(x, factor):
    """x times factor."""
    # YOUR CODE HERE
    raise NotImplementedError()
'''
SECRET = "checked = validate_factor(factor)"
HIDDEN = 'assert scale(-1.5, 4) == -6.0, "negative"'


def notebooks(tmp_path: Path) -> tuple[Path, Path]:
    """A one-chapter course: (solutions folder, released folder)."""
    solutions, released = tmp_path / "solutions", tmp_path / "notebooks"
    intro = "# Demo\n\nUse `return x * checked` at the end."  # a solution line the student is shown anyway
    for folder, body, tests in ((solutions, SOLUTION_CELL, TEST_CELL),
                                (released, RELEASED_SOLUTION, "assert scale(2, 3) == 6\n")):
        (folder / "01_demo").mkdir(parents=True)
        nb = new_notebook(cells=[new_markdown_cell(intro, id="intro"),
                                 new_code_cell(body, id="ex", metadata={"nbgrader": {"solution": True, "grade_id": "ex"}}),
                                 new_code_cell(tests, id="test", metadata={"nbgrader": {"grade": True, "grade_id": "t"}})])
        nbformat.write(nb, folder / "01_demo" / "01_demo.ipynb")
    return solutions, released


def highlighted(line: str) -> str:
    """A code line as Pygments writes it into HTML: one span per token, entities escaped."""
    return " ".join(f'<span class="n">{escape(token)}</span>' for token in line.split(" "))


def test_a_clean_site_has_no_leaks(tmp_path: Path) -> None:
    solutions, released = notebooks(tmp_path)
    html = site(tmp_path, "<p>Use <code>return x * checked</code> at the end.</p><pre>    return x</pre>")
    assert leaks(html, solutions, released) == []


LEAKS = {
    "solution line in a page": ("cpu/01_demo.html", f"<pre>{highlighted('    ' + SECRET)}\n</pre>", "solution"),
    "hidden-test line in a page": ("cpu/01_demo.html", f"<div class='cell_output'><pre>{highlighted(HIDDEN)}</pre></div>",
                                   "hidden test"),
    "line reflowed over two lines": ("cpu/01_demo.html", "<p>Hint: <code>checked =</code>\n"
                                                         "<code>validate_factor(factor)</code></p>", "solution"),
    "line in an attribute": ("cpu/01_demo.html", f'<img alt="{SECRET}" src="../_images/plot.png">', "solution"),
    "line in the search index": ("searchindex.js", "Search.setIndex(" + json.dumps({"text": ["intro", HIDDEN]}) + ")",
                                 "hidden test"),
    "line in a copied notebook": ("_sources/cpu/01_demo.ipynb", json.dumps({"source": ["x = 1\n", SECRET + "\n"]}),
                                  "solution"),
    "line in a text file": ("_sources/index.md.txt", f"Look: {SECRET}  # cheat\n", "solution"),
}


@pytest.mark.parametrize("where", LEAKS)
def test_each_leak_is_caught(tmp_path: Path, where: str) -> None:
    solutions, released = notebooks(tmp_path)
    html = site(tmp_path)
    name, content, kind = LEAKS[where]
    target = html / name
    target.parent.mkdir(parents=True, exist_ok=True)
    if name == "cpu/01_demo.html":
        _append(html, content)
    else:
        target.write_text(content)
    found = leaks(html, solutions, released)
    assert len(found) == 1 and found[0].startswith(f"{name}:") and f"shows a {kind} in 01_demo" in found[0], found


def test_the_command_line_runs_both_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    html = site(tmp_path)
    assert main([str(html), "--chapters", "01_demo", "--editions", "cpu"]) == 0
    (html / "_images" / "plot.png").unlink()
    assert main([str(html), "--chapters", "01_demo", "--editions", "cpu"]) == 1
    assert "missing image" in capsys.readouterr().out
    assert main([str(tmp_path / "nothing")]) == 1


# --- the graft -----------------------------------------------------------------------------------------

def _ran(nb: NotebookNode) -> NotebookNode:
    """``nb`` as if executed: every code cell prints its own source (so a leak would show) and has a count."""
    nb = copy.deepcopy(nb)
    for count, cell in enumerate((c for c in nb.cells if c.cell_type == "code"), start=1):
        cell.execution_count = count
        cell.outputs = [new_output("stream", name="stdout", text=cell.source),
                        new_output("execute_result", data={"text/plain": "42"}, execution_count=count)]
    return nb


def _pair() -> tuple[NotebookNode, NotebookNode]:
    """A tiny (solution, released) pair: lecture cells, an exercise, a test, and a lecture cell the release changed."""
    lecture = new_code_cell("y = lecture(x)", id="lecture")
    solution = new_notebook(cells=[
        new_markdown_cell("# Demo", id="intro"), lecture,
        new_code_cell(SOLUTION_CELL, id="ex", metadata={"nbgrader": {"solution": True, "grade_id": "ex"}}),
        new_code_cell(TEST_CELL, id="test", metadata={"nbgrader": {"grade": True, "grade_id": "t"}}),
        new_code_cell("show(scale(2, 3))", id="same-but-graded", metadata={"nbgrader": {"grade": True, "grade_id": "g"}}),
        new_code_cell("z = answer_of_exercise()", id="changed"),
    ])
    released = new_notebook(cells=[
        new_markdown_cell("# Demo", id="intro"), copy.deepcopy(lecture),
        new_code_cell(RELEASED_SOLUTION, id="ex", metadata={"nbgrader": {"solution": True, "grade_id": "ex"}}),
        new_code_cell("assert scale(2, 3) == 6\n", id="test", metadata={"nbgrader": {"grade": True, "grade_id": "t"}}),
        new_code_cell("show(scale(2, 3))", id="same-but-graded", metadata={"nbgrader": {"grade": True, "grade_id": "g"}}),
        new_code_cell("z = reference_answer()", id="changed"),
        new_code_cell("only_in_release()", id="new"),
    ])
    return solution, released


def test_graft_keeps_identical_lecture_outputs_only() -> None:
    solution, released = _pair()
    page = graft(released, _ran(solution))
    cells = {c.id: c for c in page.cells}
    assert [o.output_type for o in cells["lecture"].outputs] == ["stream", "execute_result"]
    assert cells["lecture"].outputs[0].text == "y = lecture(x)"
    assert all(c.get("execution_count") is None for c in page.cells if c.cell_type == "code")
    assert all(o.get("execution_count") is None for c in page.cells for o in c.get("outputs", []))
    for dropped in ("ex", "test", "same-but-graded", "changed", "new"):
        assert cells[dropped].outputs == [], f"cell {dropped} got outputs"
    assert [c.source for c in page.cells] == [c.source for c in released.cells], "the graft changed a source"


def test_graft_leaves_no_solution_on_a_page(tmp_path: Path) -> None:
    solutions, released = notebooks(tmp_path)
    solution, released_nb = _pair()
    pages = tmp_path / "pages"
    pages.mkdir()
    nbformat.write(graft(released_nb, _ran(solution)), pages / "01_demo.ipynb")
    assert leaks(pages, solutions, released) == []
    nbformat.write(_careless_graft(released_nb, _ran(solution)), pages / "01_demo.ipynb")
    assert len(leaks(pages, solutions, released)) == 3  # the solution line and the two hidden-test lines


def _careless_graft(released: NotebookNode, executed: NotebookNode) -> NotebookNode:
    """What a graft without the rule would do: every cell takes the outputs of the executed cell with its id."""
    outputs = {c.get("id"): c.get("outputs", []) for c in executed.cells}
    page = copy.deepcopy(released)
    for cell in page.cells:
        if cell.cell_type == "code":
            cell.outputs = outputs.get(cell.get("id"), [])
    return page


@pytest.mark.parametrize("rule", ["graft", "careless"])
def test_real_chapters_grafted_leak_nothing(tmp_path: Path, rule: str) -> None:
    """Every real chapter, its solution "executed" (each output repeats its cell's source), grafted onto its release."""
    chapters = sorted(p.parent.name for p in (ROOT / "solutions").glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb"))
    assert len(chapters) >= 17
    graft_with = graft if rule == "graft" else _careless_graft
    for chapter in chapters:
        executed = _ran(nbformat.read(ROOT / "solutions" / chapter / f"{chapter}.ipynb", as_version=4))
        released = nbformat.read(ROOT / "notebooks" / chapter / f"{chapter}.ipynb", as_version=4)
        nbformat.write(graft_with(released, executed), tmp_path / f"{chapter}.ipynb")
    found = leaks(tmp_path, ROOT / "solutions", ROOT / "notebooks")
    if rule == "graft":
        assert found == []
    else:  # the check is not vacuous: without the rule, solution bodies and hidden tests of every chapter show
        leaked = {line.split(".ipynb")[0] for line in found}
        assert any("shows a solution" in f for f in found) and any("shows a hidden test" in f for f in found)
        assert len(leaked) == len(chapters), leaked


# --- the committed H200 record and how it is made -----------------------------------------------------------

def test_the_h200_record_covers_every_chapter_and_shows_no_solution() -> None:
    """The committed record: every chapter, outputs on its pages, where and how long it ran, nothing to leak."""
    folder = EDITIONS_DIR / "h200"
    chapters = sorted(p.parent.name for p in (ROOT / "solutions").glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb"))
    assert sorted(p.stem for p in folder.glob("[0-9][0-9]_*.ipynb")) == chapters
    facts = json.loads((folder / "provenance.json").read_text())
    assert "H200" in facts["gpu"] and facts["driver"] not in ("none", "unknown"), facts
    assert sorted(facts["seconds"]) == chapters and all(t > 0 for t in facts["seconds"].values())
    for chapter in chapters:
        nb = nbformat.read(folder / f"{chapter}.ipynb", as_version=4)
        assert any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), f"{chapter} has no outputs"
        assert not any(c.get("outputs") for c in nb.cells if editions.is_graded(c)), f"{chapter}: a graded cell has outputs"
    assert leaks(folder, ROOT / "solutions", ROOT / "notebooks") == []


def _run(folder: Path, chapters: list[str], gpu: str = "NVIDIA H200") -> Path:
    """A ``benchmarks.notebooks --out`` folder: each chapter "executed", with the versions of the machine."""
    folder.mkdir(parents=True)
    solution, _ = _pair()
    for chapter in chapters:
        nbformat.write(_ran(solution), folder / f"{chapter}.ipynb")
    versions = {"gpu": gpu, "driver": "580.1", "torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0", "python": "3.12.3"}
    rows = [{"chapter": c, "seconds": 10.0 + i, "errors": []} for i, c in enumerate(chapters)]
    times = {"date": f"2026-12-04T10:0{len(chapters)}:00+00:00", "device": f"device: {gpu}", "versions": versions,
             "notebooks": rows, "total_seconds": sum(r["seconds"] for r in rows), "interrupted_in": None}
    (folder / "times.json").write_text(json.dumps(times))
    return folder


def test_record_joins_runs_made_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of chapters run at once on one GPU make one record, with the versions the runs wrote."""
    _, released = _pair()
    (tmp_path / "released").mkdir()
    for chapter in ("01_demo", "02_demo", "03_demo"):
        nbformat.write(released, tmp_path / "released" / f"{chapter}.ipynb")
    monkeypatch.setattr(editions, "released_notebook", lambda chapter: tmp_path / "released" / f"{chapter}.ipynb")
    first = _run(tmp_path / "A", ["02_demo"])
    second = _run(tmp_path / "B", ["01_demo", "03_demo"])
    out = record([first, second], tmp_path / "record", "one GPU", "h200")
    facts = json.loads((out / "provenance.json").read_text())
    assert facts["seconds"] == {"01_demo": 10.0, "02_demo": 10.0, "03_demo": 11.0} and facts["total_seconds"] == 31.0
    assert (facts["gpu"], facts["driver"], facts["torch"]) == ("NVIDIA H200", "580.1", "2.11.0")  # not this machine's
    assert facts["date"] == "2026-12-04T10:02:00+00:00"  # the later run
    assert sorted(p.name for p in out.glob("*.ipynb")) == ["01_demo.ipynb", "02_demo.ipynb", "03_demo.ipynb"]
    with pytest.raises(SystemExit, match="different GPUs or versions"):
        record([first, _run(tmp_path / "C", ["01_demo"], gpu="NVIDIA H100")], tmp_path / "r2", "x", "h200")
    with pytest.raises(SystemExit, match="more than one"):
        record([first, _run(tmp_path / "D", ["02_demo"])], tmp_path / "r3", "x", "h200")


# --- the browser test without a site ---------------------------------------------------------------------

@pytest.mark.parametrize("required", [True, False])
def test_the_browser_test_without_a_site(tmp_path: Path, required: bool) -> None:
    """``make site-check`` (SITE_REQUIRED=1) fails when nothing was built; ``make test`` skips it."""
    env = {**os.environ, "SITE_HTML": str(tmp_path / "none"), "SITE_REQUIRED": "1" if required else "0"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "landing",
                          str(ROOT / "tests" / "test_site_browser.py")], cwd=ROOT, env=env, capture_output=True, text=True)
    if required:
        assert run.returncode != 0 and "run make site first" in run.stdout, run.stdout[-2000:]
    else:
        assert run.returncode == 0 and "1 skipped" in run.stdout, run.stdout[-2000:]
