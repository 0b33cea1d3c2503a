"""The grader's host side against hostile submissions: nothing the sandbox wrote is trusted, every
submission gets one row, limits hold. Every case is graded in one `grade --jobs 2` run (the module
fixture `graded`) of a tiny course made here (chapter 90_tiny, one exercise `double(x)`):

- left behind by the kernel: symbolic links in its working folder, its /tmp and its IPC folder to a
  host file and a host folder (which must stay unchanged and unread), a sparse 1 TB file, fillers of
  /tmp and of the working folder (they must hit the --disk-gb limit);
- in SUBMISSIONS: a notebook that is a link (to another student's notebook, to a host file), a FIFO
  notebook, student and chapter folders that are links (to another student, to solutions/), a 25 MB
  notebook, a sparse 64 GB one, JSON nested too deep;
- student ids: 230 characters, bytes that are not UTF-8, a leading `--`, glob characters, a leading
  or trailing space, a dot, a tab, a formula `=SUM(A1)`; a chapter folder named like a formula;
- `<script>` in a markdown cell, a raw cell, HTML / markdown / JavaScript / SVG outputs and printed
  text, with a forged score banner: none of it may be live in the feedback;
- a CPU hog whose children start sessions of their own, graded next to honest neighbours (who keep
  full marks: the time limit is generous, nothing here depends on the machine's load);
- then a rerun into a copy of OUT whose resume records were damaged.

Skipped where bubblewrap is missing (the grader refuses without it). Where this machine cannot
enforce a limit (no cpu cgroup, a bwrap without --size), the check of that limit is skipped.
"""

from __future__ import annotations

import csv
import html
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
import psutil
import pytest
from nbformat import NotebookNode

from autograder.grade import FORMULA_STARTS
from autograder.intake import MAX_NOTEBOOK_BYTES
from autograder.sandbox import Cgroup, bwrap_path, bwrap_supports_size

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed")]
TINY = "90_tiny"
SECRET = "HOST_SECRET_5E1B"
# Unique to this test process: the check scans every process on the machine, and another test run
# grading its own CPU hog at the same moment (two `make test` at once) must not count.
HOG_MARK = f"AUTOGRADER_TEST_HOG_{os.getpid()}_{secrets.token_hex(4)}"
DISK_GB = 0.03
RIGHT = "def double(x):\n    return 2 * x"
LONG_ID = "long_" + "x" * 225


def cell(source: str, **nbgrader: object) -> NotebookNode:
    """A code cell, with nbgrader metadata when given."""
    meta = {"nbgrader": {"schema_version": 3, **nbgrader}} if nbgrader else {}
    return nbformat.v4.new_code_cell(source, metadata=meta)


def tiny(solution: str, extra: tuple[NotebookNode, ...] = ()) -> NotebookNode:
    """The 90_tiny notebook with ``solution`` as its solution cell, and ``extra`` cells before the test cell."""
    return nbformat.v4.new_notebook(cells=[
        cell(solution, grade=False, solution=True, locked=False, grade_id="double_code"),
        *extra,
        cell("assert double(2) == 4\n### BEGIN HIDDEN TESTS\nassert double(-1) == -2\n### END HIDDEN TESTS",
             grade=True, solution=False, locked=True, points=1, grade_id="double"),
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})


SOURCE_NB = tiny("def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION")

# Forks twelve children that each start a session of their own and spin for 45 s, and one that sleeps
# forever; right only when they all stayed in the kernel's own (non-root) cpu cgroup.
HOG = f"""\
import os, sys, time
def _start(code):
    os.setsid()
    os.execv(sys.executable, [sys.executable, '-c', code, {HOG_MARK!r}])
_children = []
for _code in ['import time\\nend = time.monotonic() + 45\\nwhile time.monotonic() < end: pass'] * 12 + \\
        ['import time; time.sleep(10**6)']:
    _pid = os.fork()
    if _pid == 0:
        _start(_code)
    _children.append(_pid)
def _cgroups(pid):
    with open(f'/proc/{{pid}}/cgroup') as f:
        return dict(line.strip().split(':', 2)[1:] for line in f)
_mine = _cgroups(os.getpid())
_key = next((k for k in _mine if 'cpu' in k.split(',')), '')
_confined = _mine.get(_key, '/') != '/' and all(_cgroups(c).get(_key) == _mine[_key] for c in _children)
time.sleep(50)
def double(x):
    return 2 * x if _confined else 0"""

FILLERS = """\
import os
def _fill(folder):
    written, path = 0, os.path.join(folder, 'fill.bin')
    try:
        with open(path, 'wb') as f:
            for _ in range(200):
                f.write(b'x' * 2**20)
                f.flush()
                written += 1
    except OSError:
        pass
    finally:
        os.remove(path)
    return written
_in_tmp, _in_folder = _fill('/tmp'), _fill('.')
def double(x):
    return 2 * x if _in_tmp < 100 and _in_folder < 100 else 0"""

SCRIPT_CELL = """\
from IPython.display import HTML, Javascript, Markdown, display
display(HTML("<script>alert('XSS_HTML')</script><div class='panel-heading'>Score: 99 / 1</div>"))
display(Markdown("<script>alert('XSS_MDOUT')</script>"))
display(Javascript("alert('XSS_JS')"))
display({'image/svg+xml': "<svg onload=alert('XSS_SVG')></svg>"}, raw=True)
display({'image/png': '"><script>alert(1)</script>'}, raw=True, metadata={'image/png': {'width': '1 onerror=alert(2)'}})
print("<script>alert('XSS_PRINT')</script>")
""" + RIGHT
SCRIPT_EXTRA = (
    nbformat.v4.new_markdown_cell("<script>alert('XSS_MD')</script>\n\n"
                                  "<div class=\"panel-heading\">Score: 99 / 1</div>\n\n"
                                  "[click me](javascript:alert('XSS_LINK'))"),
    nbformat.v4.new_raw_cell("<script>alert('XSS_RAW')</script>", metadata={"raw_mimetype": "text/html"}),
)


def host_links(secret: Path, host_dir: Path) -> str:
    """A solution that leaves links to host paths where the grader reads and writes, and a sparse file beside them."""
    return f"""\
import os, sys
_targets = {{'{TINY}.ipynb': {str(secret)!r}, '{TINY}.html': {str(secret)!r}, 'gradebook.db': {str(secret)!r},
            'result.json': {str(secret)!r}, 'worker.log': {str(secret)!r}, 'feedback': {str(host_dir)!r},
            'autograded': {str(host_dir)!r}}}
_ipc = next((os.path.dirname(a) for a in sys.argv if a.endswith('.json')), None)
for _folder in ['.', '/tmp'] + [_ipc] * bool(_ipc):
    for _name, _target in _targets.items():
        try:
            os.symlink(_target, os.path.join(_folder, _name))
        except OSError:
            pass
    try:
        open(os.path.join(_folder, 'sparse.bin'), 'wb').truncate(2**40)
    except OSError:
        pass
_seen = os.path.exists({str(secret)!r})
def double(x):
    return 0 if _seen else 2 * x"""


@dataclass(frozen=True)
class Expect:
    """What one submission's row should say."""

    status: str
    score: float | None = None
    message: str = ""


def write_notebook(nb: NotebookNode, path: Path) -> None:
    """Write a notebook, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def make_submissions(subs: Path, course: Path, secret: Path, host_dir: Path) -> dict[tuple[str, str], Expect]:
    """Write every submission; return the row each should get, by (student_id, chapter) as grades.csv shows them."""
    graded = {"fine": tiny(RIGHT), LONG_ID: tiny(RIGHT), "--help": tiny(RIGHT), "[ab]*?": tiny(RIGHT),
              "=SUM(A1)": tiny(SCRIPT_CELL, SCRIPT_EXTRA), "!cpu_hog": tiny(HOG), "fillers": tiny(FILLERS),
              "host_links": tiny(host_links(secret, host_dir))}
    for student, nb in graded.items():
        write_notebook(nb, subs / student / TINY / f"{TINY}.ipynb")
    expected = {(s, TINY): Expect("ok", 1) for s in graded}
    fine = subs / "fine" / TINY / f"{TINY}.ipynb"
    for student, target in (("notebook_link", fine), ("secret_link", secret)):
        (subs / student / TINY).mkdir(parents=True)
        (subs / student / TINY / f"{TINY}.ipynb").symlink_to(target)
        expected[student, TINY] = Expect("invalid_submission", 0, "symbolic link")
    (subs / "fifo" / TINY).mkdir(parents=True)
    os.mkfifo(subs / "fifo" / TINY / f"{TINY}.ipynb")
    expected["fifo", TINY] = Expect("invalid_submission", 0, "not a regular file")
    (subs / "student_link").symlink_to(subs / "fine")
    expected["student_link", ""] = Expect("invalid_submission", 0, "symbolic link")
    (subs / "chapter_link").mkdir()
    (subs / "chapter_link" / TINY).symlink_to(course / "solutions" / TINY)
    expected["chapter_link", TINY] = Expect("invalid_submission", 0, "symbolic link")
    for name, shown_as, reason in ((b"caf\xe9", "caf\\xe9", "UTF-8"), (b"bob ", "bob ", "space"),
                                   (b" alice", " alice", "space"), (b".hidden", ".hidden", "dot"),
                                   (b"tab\tid", "tab\\tid", "control")):
        folder = os.path.join(os.fsencode(subs), name, TINY.encode())
        os.makedirs(folder)
        nbformat.write(tiny(RIGHT), os.path.join(os.fsdecode(folder), f"{TINY}.ipynb"))
        expected[shown_as, TINY] = Expect("invalid_id", 0, reason)
    write_notebook(tiny(RIGHT), subs / "chapters" / "=cmd" / "=cmd.ipynb")
    expected["chapters", "=cmd"] = Expect("unknown_chapter", 0, "no chapter")
    os.makedirs(os.path.join(os.fsencode(subs), b"chapters", b"\xff"))
    expected["chapters", "\\xff"] = Expect("unknown_chapter", 0, "no chapter")
    huge = tiny(RIGHT)
    huge.cells.append(nbformat.v4.new_markdown_cell("x" * (MAX_NOTEBOOK_BYTES + 5 * 2**20)))
    write_notebook(huge, subs / "huge" / TINY / f"{TINY}.ipynb")
    (subs / "sparse_nb" / TINY).mkdir(parents=True)
    with open(subs / "sparse_nb" / TINY / f"{TINY}.ipynb", "wb") as f:
        f.truncate(64 * 2**30)
    expected["huge", TINY] = expected["sparse_nb", TINY] = Expect("invalid_notebook", 0, "larger than 20 MB")
    (subs / "nested" / TINY).mkdir(parents=True)
    (subs / "nested" / TINY / f"{TINY}.ipynb").write_text("[" * 200_000)
    expected["nested", TINY] = Expect("invalid_notebook", 0, "not a readable notebook")
    return expected


@dataclass
class Graded:
    """What the grading run produced."""

    process: subprocess.CompletedProcess
    course: Path
    subs: Path
    out: Path
    rows: list[dict[str, str]]
    expected: dict[tuple[str, str], Expect]
    secret: Path
    host_dir: Path
    secret_state: tuple[bytes, int, int]


def grade(subs: Path, out: Path, course: Path) -> subprocess.CompletedProcess:
    """One `grade --jobs 2` run, with limits that honest submissions never come near."""
    command = [sys.executable, "-m", "autograder", "grade", str(subs), "--out", str(out), "--course-root", str(course),
               "--jobs", "2", "--timeout", "300", "--cell-timeout", "120", "--disk-gb", str(DISK_GB)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV file."""
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def state(path: Path) -> tuple[bytes, int, int]:
    """A file's bytes, mode and modification time."""
    info = path.stat()
    return path.read_bytes(), info.st_mode, info.st_mtime_ns


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory) -> Graded:
    """Every case, graded in one run."""
    base = tmp_path_factory.mktemp("host")
    course, subs, out, host_dir = base / "course", base / "submissions", base / "out", base / "host_dir"
    write_notebook(SOURCE_NB, course / "solutions" / TINY / f"{TINY}.ipynb")
    host_dir.mkdir()
    secret = base / "host_secret.txt"
    secret.write_text(f"{SECRET}\n")
    secret.chmod(0o600)
    secret_state = state(secret)
    expected = make_submissions(subs, course, secret, host_dir)
    process = grade(subs, out, course)
    assert (out / "grades.csv").is_file(), process.stdout + process.stderr
    return Graded(process, course, subs, out, read_rows(out / "grades.csv"), expected, secret, host_dir, secret_state)


def row_of(graded: Graded, key: tuple[str, str]) -> dict[str, str]:
    """The grades.csv row of a submission, ids unescaped."""
    escaped = tuple(f"'{k}" if k.startswith(FORMULA_STARTS) else k for k in key)
    rows = [r for r in graded.rows if (r["student_id"], r["chapter"]) == escaped]
    assert len(rows) == 1, f"{key}: {rows}\n{graded.process.stdout}\n{graded.process.stderr}"
    return rows[0]


def test_every_submission_has_exactly_one_row(graded: Graded) -> None:
    keys = [(r["student_id"], r["chapter"]) for r in graded.rows]
    assert len(keys) == len(set(keys)) == len(graded.expected), graded.process.stdout + graded.process.stderr
    for key in graded.expected:
        row_of(graded, key)
    assert graded.process.returncode == 1, graded.process.stderr


@pytest.mark.parametrize("key", ["fine", LONG_ID, "--help", "[ab]*?", "=SUM(A1)", "fillers", "host_links", "!cpu_hog"])
def test_graded_submissions_get_full_marks(graded: Graded, key: str) -> None:
    if key == "fillers" and not bwrap_supports_size():
        pytest.skip("this bubblewrap has no --size: /tmp and the working folder cannot be size-limited")
    if key == "!cpu_hog" and not cpu_cgroup_available():
        pytest.skip("no writable cpu cgroup on this machine: a submission's CPU share cannot be enforced")
    row = row_of(graded, (key, TINY))
    assert row["status"] == "ok" and row["score"] == row["max_score"] == "1", row
    assert (graded.out / "feedback" / key / f"{TINY}.html").is_file()


def test_refused_submissions_get_their_status(graded: Graded) -> None:
    for key, expect in graded.expected.items():
        if expect.status == "ok":
            continue
        row = row_of(graded, key)
        assert row["status"] == expect.status and expect.message in row["message"], row
        assert expect.score is None or float(row["score"]) == expect.score, row
        assert (graded.out / "feedback" / key[0] / f"{key[1]}.html").exists() == (expect.status == "ok"), key


def cpu_cgroup_available() -> bool:
    """Whether the grader can give each submission its own cpu cgroup here."""
    probe = Cgroup("autograder-probe-test", 10, None)
    try:
        return probe.limits_cpu
    finally:
        probe.kill_and_remove()


def test_host_files_are_unchanged_and_unread(graded: Graded) -> None:
    assert state(graded.secret) == graded.secret_state, "the grader changed a host file a submission linked to"
    assert not list(graded.host_dir.iterdir()), "the grader wrote into a host folder a submission linked to"
    for path in graded.out.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert SECRET.encode() not in path.read_bytes(), f"{path} holds the content of a host file"
    assert not [p for p in graded.out.rglob("*") if p.is_symlink()], "a link reached OUT"


def test_no_csv_cell_starts_like_a_formula(graded: Graded) -> None:
    for name in ("grades.csv", "grades_detail.csv", "export.csv"):
        with open(graded.out / name, newline="", encoding="utf-8") as f:
            cells = [value for row in csv.reader(f) for value in row]
        assert not [c for c in cells if c.startswith(FORMULA_STARTS)], name
    export = {r["student_id"]: r for r in read_rows(graded.out / "export.csv")}
    assert export["'=SUM(A1)"]["total"] == "1" and export["'--help"]["total"] == "1", export
    assert "caf\\xe9" not in export and ".hidden" not in export, "an invalid id matches no LMS student"
    columns = list(next(iter(export.values())))
    assert columns == ["student_id", TINY, "total", "max_total"], "an unknown chapter gets no column"


def test_feedback_shows_the_submission_as_inert_text(graded: Graded) -> None:
    page = (graded.out / "feedback" / "=SUM(A1)" / f"{TINY}.html").read_text(encoding="utf-8")
    honest = (graded.out / "feedback" / "fine" / f"{TINY}.html").read_text(encoding="utf-8")

    def live(text: str) -> dict[str, object]:
        return {"scripts": text.count("<script"), "banners": text.count('<div class="panel-heading"'),
                "handlers": sorted(re.findall(r"<[^>]*\son\w+\s*=[^>]*>", text)),
                "links": re.findall(r"<[^>]*javascript:", text, re.I),
                "embedded": re.findall(r"<(?:svg|iframe|object|embed)\b", text, re.I)}

    assert live(page) == live(honest)
    text = html.unescape(re.sub(r"<[^>]+>", "", page))
    for marker in ("<script>alert('XSS_MD')</script>", "<script>alert('XSS_RAW')</script>",
                   "<script>alert('XSS_PRINT')</script>", "<svg onload=alert('XSS_SVG')></svg>"):
        assert marker in text, f"{marker} should show as text"


def test_cpu_hog_children_are_killed(graded: Graded) -> None:
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        if HOG_MARK in (proc.info["cmdline"] or []):
            left.append(proc.pid)
    assert not left, f"processes of the CPU hog outlived its grading: {left}"


def test_limits_that_cannot_hold_are_said_once_before_grading(graded: Graded) -> None:
    lines = graded.process.stdout.splitlines()
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == len(set(warnings)), warnings
    first_row = next(i for i, line in enumerate(lines) if line.startswith("["))
    assert all(lines.index(w) < first_row for w in warnings), lines
    assert ("--size" in graded.process.stdout) != bwrap_supports_size()
    assert ("cpu cgroup" in graded.process.stdout) != cpu_cgroup_available()


def test_damaged_resume_records_are_graded_again(graded: Graded) -> None:
    again = graded.out.parent / "out_again"
    shutil.copytree(graded.out, again, symlinks=True)
    records = {json.loads(p.read_text())["student_id"]: p for p in (again / ".done").glob("*.json")}
    records["fine"].write_text("{not json")
    records["--help"].unlink()
    records["--help"].symlink_to("/dev/zero")
    records["[ab]*?"].unlink()
    os.mkfifo(records["[ab]*?"])
    (again / ".done" / "junk.json").mkdir()
    process = grade(graded.subs, again, graded.course)
    assert process.stdout.count("(from an earlier run)") == len(records) - 3, process.stdout
    rows = {(r["student_id"], r["chapter"]): (r["status"], r["score"]) for r in read_rows(again / "grades.csv")}
    assert rows == {(r["student_id"], r["chapter"]): (r["status"], r["score"]) for r in graded.rows}
