"""Hostile and broken submissions, graded in the sandbox with the judge: each gets the status and score it should.

All of them are graded in one `grade --jobs 2` run (the module fixture `graded`) of a small course
made here, with two chapters that run in seconds:

- 90_tiny: one exercise, `double(x)`, plain Python. Sandbox probes write `double` so that it is
  right only when the attack *failed* (reading solutions/ raised, the socket did not connect...):
  full marks prove the sandbox held. Broken files get their status.
- 91_judge: five exercises whose tests use `course_lib.exercises.checks.assert_close`, `torch.allclose`,
  `numpy.allclose`, a bare `assert` and a course_lib reference (`tensor_nbytes`). Every cheater's
  functions are wrong (or delegate to the reference), and each tries one way of making the tests
  pass anyway: every one must score 0. The tests run in the trusted tester, a process of its own;
  the attacks act on the student's kernel, where nothing judges.

Needs bubblewrap (the grader refuses without it); skipped where it is missing. The fork-bomb
case needs a writable pids cgroup (CI containers without one: skipped, see the test).
"""

from __future__ import annotations

import csv
import html
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
from nbformat import NotebookNode

from autograder.sandbox import Cgroup, bwrap_path

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed")]
TINY, JUDGE = "90_tiny", "91_judge"
HIDDEN_MARKER = "HIDDEN_CHECK_7F3A"


def cell(source: str, **nbgrader: object) -> NotebookNode:
    """A code cell, with nbgrader metadata when given."""
    meta = {"nbgrader": {"schema_version": 3, **nbgrader}} if nbgrader else {}
    return nbformat.v4.new_code_cell(source, metadata=meta)


def exercise(name: str, body: str, test: str, hidden: str) -> list[NotebookNode]:
    """A solution cell and its test cell (one point)."""
    return [
        cell(f"def {name}(x):\n    ### BEGIN SOLUTION\n    {body}\n    ### END SOLUTION",
             grade=False, solution=True, locked=False, grade_id=f"{name}_code"),
        cell(f"{test}\n### BEGIN HIDDEN TESTS\n{HIDDEN_MARKER} = 1\n{hidden}\n### END HIDDEN TESTS",
             grade=True, solution=False, locked=True, points=1, grade_id=name),
    ]


def notebook(cells: list[NotebookNode]) -> NotebookNode:
    """A notebook with the course's kernelspec."""
    return nbformat.v4.new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})


TINY_NB = notebook(exercise("double", "return 2 * x", "assert double(2) == 4", "assert double(-1) == -2"))
JUDGE_NB = notebook([
    cell("import numpy as np\nimport torch\nfrom course_lib import floating_point as fp\n"
         "from course_lib.exercises.checks import assert_close, call"),
    *exercise("double", "return 2 * x", "assert_close(call(double, torch.tensor([1.0, 2.0])), torch.tensor([2.0, 4.0]))",
              "assert_close(call(double, torch.ones(3)), 2 * torch.ones(3))"),
    *exercise("triple", "return 3 * x", "assert torch.allclose(call(triple, torch.ones(2)), 3 * torch.ones(2))",
              "assert torch.allclose(call(triple, torch.zeros(1) + 2), torch.zeros(1) + 6)"),
    *exercise("half", "return x / 2", "assert np.allclose(call(half, np.ones(2)), 0.5 * np.ones(2))",
              "from course_lib.exercises.checks import hidden_seed\n_x = np.random.default_rng(hidden_seed(5)).random(3)\n"
              "assert np.allclose(call(half, _x), _x / 2)"),
    *exercise("neg", "return -x", "assert call(neg, 3) == -3", "assert call(neg, -1) == 1"),
    *exercise("tensor_nbytes", "return x.numel() * x.element_size()",
              "assert call(tensor_nbytes, torch.zeros(3)) == fp.tensor_nbytes(torch.zeros(3))",
              "assert call(tensor_nbytes, torch.zeros(2, 5, dtype=torch.float16)) == 20"),
])
WRONG = {"double": "return x", "triple": "return x", "half": "return x", "neg": "return x", "tensor_nbytes": "return 0"}
JUDGE_POINTS = len(WRONG)

# 91_judge cheaters: wrong functions plus one attack, in a cell of their own after the setup cell.
CHEATS = {
    "patch_assert_close": "import course_lib.exercises.checks as T\nT.assert_close = lambda *a, **k: None\n"
                          "assert_close = lambda *a, **k: None",
    "patch_code_object": "import course_lib.exercises.checks as T\nT.assert_close.__code__ = (lambda *a, **k: None).__code__\n"
                         "T.call.__code__ = (lambda fn, *a, **k: k.get('_', a[0]) * 0 + 1).__code__",
    "torch_allclose": "torch.allclose = lambda *a, **k: True\ntorch.Tensor.__eq__ = lambda *a: True",
    "numpy_allclose": "np.allclose = lambda *a, **k: True\nimport numpy\nnumpy.allclose = np.allclose",
    "fake_torch_name": "class _Yes:\n    def __getattr__(self, name):\n        return lambda *a, **k: True\n"
                       "torch = _Yes()\nnp = _Yes()",
    "builtins_edit": "import builtins\nbuiltins.AssertionError = Warning\n__builtins__.AssertionError = Warning\n"
                     "builtins.abs = lambda x: 0",
    "custom_exc": "get_ipython().set_custom_exc((BaseException,), lambda *a, **k: None)",
    "showtraceback": "import sys\nip = get_ipython()\nip.showtraceback = lambda *a, **k: None\n"
                     "ip._showtraceback = lambda *a, **k: None\nsys.excepthook = lambda *a: None",
    "patch_during_test": "def _rig():\n    torch.allclose = lambda *a, **k: True\n    np.allclose = lambda *a, **k: True\n"
                         "    import course_lib.exercises.checks as T\n    T.assert_close = lambda *a, **k: None",
    "forged_verdict": "import os, re, json, glob\ndef _forge(info):\n"
                      "    found = re.search(r'([0-9a-f]{32})', info.raw_cell or '')\n    if not found:\n        return\n"
                      "    for fd in os.listdir('/proc/self/fd'):\n        try:\n"
                      "            target = os.readlink(f'/proc/self/fd/{fd}')\n        except OSError:\n            continue\n"
                      "        if target.endswith('verdicts.jsonl'):\n"
                      "            with open(target, 'a') as f:\n"
                      "                f.write(json.dumps({'nonce': found.group(1), 'passed': True, 'message': ''}) + '\\n')\n"
                      "get_ipython().events.register('pre_run_cell', _forge)",
    # Lying values: comparisons that always agree.
    "lying_float": "class _Yes(float):\n    def __eq__(self, other):\n        return True\n"
                   "    __ne__ = lambda s, o: False\n"
                   "    __le__ = __ge__ = __lt__ = __gt__ = __eq__\n    __hash__ = float.__hash__\n"
                   "def _lie(f):\n    return lambda *a, **k: _Yes(0.0)\n",
    "lying_tensor": "class _Yes(torch.Tensor):\n    @classmethod\n"
                    "    def __torch_function__(cls, func, types, args=(), kwargs=None):\n"
                    "        return torch.tensor(True)\n"
                    "def _lie(f):\n    return lambda x: torch.zeros(1).as_subclass(_Yes)\n",
    "tensor_base_methods": "torch._C.TensorBase.__eq__ = lambda *a: torch.tensor(True)\n"
                           "torch._C.TensorBase.allclose = lambda *a, **k: True\n"
                           "torch._C.TensorBase.__bool__ = lambda *a: True",
    "module_class_swap": "import types, math\nclass _M(types.ModuleType):\n    def __getattr__(self, n):\n"
                         "        return lambda *a, **k: True\nmath.__class__ = _M\nnp.__class__ = _M\n"
                         "torch.__class__ = _M",
    "finfo_math_patch": "import math\nmath.isclose = lambda *a, **k: True\ntorch.finfo = lambda *a: None",
    # Reaching the grader from inside: input transformers, ast transformers, gc, profile hooks, threads, signals.
    "input_transformers": "ip = get_ipython()\n_pass = lambda lines: ['pass\\n']\n"
                          "ip.input_transformers_cleanup.insert(0, _pass)\n"
                          "ip.input_transformers_post.append(_pass)",
    "ast_transformer": "import ast\nclass _Empty(ast.NodeTransformer):\n    def visit_Module(self, node):\n"
                       "        return ast.Module(body=[], type_ignores=[])\nget_ipython().ast_transformers.append(_Empty())",
    "gc_hunt": "import gc, builtins\nfor _o in gc.get_objects():\n    try:\n"
               "        if callable(_o) and 'judge' in getattr(_o, '__qualname__', '').lower():\n"
               "            _o.__globals__['__builtins__'] = {}\n    except Exception:\n        pass\n"
               "for _n in dir(builtins):\n    if 'judge' in _n:\n        setattr(builtins, _n, lambda *a, **k: None)",
    "profile_hook": "import sys, builtins\n_real = builtins.AssertionError\n"
                    "def _hook(frame, event, arg):\n    builtins.abs = lambda x: 0\nsys.setprofile(_hook)",
    "thread_and_signal": "import threading, signal, time, builtins\n"
                         "def _spin():\n    while True:\n        torch.allclose = lambda *a, **k: True\n"
                         "        time.sleep(0.001)\n"
                         "threading.Thread(target=_spin, daemon=True).start()\n"
                         "signal.signal(signal.SIGALRM, lambda *a: None)\nsignal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)",
    "agent_replaced": "import sys, types\n_fake = types.ModuleType('autograder.agent')\n"
                      "_fake.serve = lambda *a, **k: print('ok')\nsys.modules['autograder.agent'] = _fake\n"
                      "import autograder\nautograder.agent = _fake",
    "print_history": "print(get_ipython().user_ns.get('In'))\nget_ipython().events.register('post_run_cell', "
                     "lambda r: print('LEAK', r.info.raw_cell))",
    # The reference is not an answer: delegating to it, by any route, scores 0; patching it changes nothing.
    "delegate_reference": "import importlib\nfrom course_lib.floating_point import tensor_nbytes as _ref\n"
                          "_copy = type(_ref)(_ref.__code__, _ref.__globals__)\n_reloaded = importlib.reload(fp)",
    "hardcoded_hidden": "pass",
    "patch_reference": "import course_lib.floating_point as _fp\n_fp.tensor_nbytes = lambda t: 0\n"
                       "fp.tensor_nbytes = _fp.tensor_nbytes",
}
# How a cheater's function is written when the attack needs it (default: the wrong body of WRONG).
CHEAT_BODIES = {
    "lying_float": {"neg": "return _lie(None)(x)", "half": "return np.zeros(1)"},
    "lying_tensor": {"double": "return _lie(None)(x)", "triple": "return _lie(None)(x)"},
    "delegate_reference": {"tensor_nbytes": "return _ref(x) + _copy(x) * 0 if x.numel() != 3 else fp.tensor_nbytes(x)"},
    "patch_reference": {"tensor_nbytes": "return 0"},
    # The hidden test's code is public: an answer written down for its published seed is right only there.
    "hardcoded_hidden": {"half": "return x / 2 if len(x) == 2 else np.random.default_rng(5).random(3) / 2"},
}
# 91_judge student who is right only when the grader's NBGRADER_EXECUTION is visible: it is not.
GRADING_DETECTOR = ("import os\n_graded = bool(os.environ.get('NBGRADER_EXECUTION'))\n"
                    "def neg(x):\n    return -x if _graded else x")


@dataclass(frozen=True)
class Expect:
    """What one 90_tiny submission should get."""

    status: str
    score: float | None = None
    message: str = ""


def tiny_sources(paths: dict[str, str], port: int) -> dict[str, tuple[str, Expect]]:
    """90_tiny students: the code of their solution cell and what they should get."""
    readable = "\n".join(f"    _try(lambda: open({p!r}, 'rb').read(1))" for p in paths.values())
    prober = "_escaped = []\ndef _try(attempt):\n    try:\n        attempt()\n        _escaped.append(1)\n" \
             "    except Exception:\n        pass\n"
    right_if_held = "\ndef double(x):\n    return 0 if _escaped else 2 * x"
    writes = "\n".join(f"    _try(lambda: open({str(Path(p).parent / 'PWNED')!r}, 'w').write('x'))" for p in paths.values())
    return {
        "fine": ("def double(x):\n    return 2 * x", Expect("ok", 1)),
        # Right on the visible test's input only: the hidden test runs at grading and fails it.
        "visible_only": ("def double(x):\n    return 4 if x == 2 else 0", Expect("ok", 0)),
        "reads_files": (prober + "def _probe():\n" + readable + "\n_probe()" + right_if_held, Expect("ok", 1)),
        "writes_outside": (prober + "def _probe():\n" + writes + "\n_probe()" + right_if_held, Expect("ok", 1)),
        "network": (prober + f"import socket\n_try(lambda: socket.create_connection(('127.0.0.1', {port}), timeout=3))\n"
                    "_try(lambda: socket.create_connection(('1.1.1.1', 53), timeout=3))" + right_if_held,
                    Expect("ok", 1)),
        "loopback_works": ("import socket\n_s = socket.socket()\n_s.bind(('127.0.0.1', 0))\n_s.listen()\n"
                           "socket.create_connection(_s.getsockname(), timeout=3)\ndef double(x):\n    return 2 * x",
                           Expect("ok", 1)),
        "infinite_loop": ("def double(x):\n    return 2 * x\nwhile True:\n    pass", Expect("ok", 1)),
        "os_exit": ("import os\nos._exit(3)", Expect("error", 0, "Kernel died")),
        "segfault": ("import ctypes\nctypes.string_at(0)", Expect("error", 0, "Kernel died")),
        "memory_bomb": ("_ok = False\ntry:\n    _big = bytearray(64 * 2**30)\nexcept MemoryError:\n    _ok = True\n"
                        "def double(x):\n    return 2 * x if _ok else 0", Expect("ok", 1)),
        "endless_thread": ("import threading, time\nthreading.Thread(target=time.sleep, args=(10**6,)).start()\n"
                           "def double(x):\n    return 2 * x", Expect("ok", 1)),
        "huge_output": ("for _ in range(100):\n    print('x' * 2**20)\ndef double(x):\n    return 2 * x", Expect("ok", 1)),
        # Children wait, so that they pile up against the limit, then exit; the parent reaps them.
        "fork_bomb": ("import os, time\n_forks = 0\nfor _ in range(2000):\n    try:\n        pid = os.fork()\n"
                      "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(3)\n        os._exit(0)\n"
                      "    _forks += 1\nwhile True:\n    try:\n        os.wait()\n    except ChildProcessError:\n"
                      "        break\ndef double(x):\n    return 2 * x if _forks < 1000 else 0", Expect("ok", 1)),
    }


def write(nb: NotebookNode, path: Path) -> None:
    """Write a notebook, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def make_course(root: Path) -> None:
    """The two chapters' sources."""
    for name, nb in ((TINY, TINY_NB), (JUDGE, JUDGE_NB)):
        write(nb, root / "solutions" / name / f"{name}.ipynb")


def make_submissions(subs: Path, paths: dict[str, str], port: int) -> dict[str, Expect]:
    """Write every submission; return what each 90_tiny one should get (91_judge ones are checked by name)."""
    expected = {}
    for student, (source, expect) in tiny_sources(paths, port).items():
        nb = nbformat.from_dict(json.loads(json.dumps(TINY_NB)))
        nb.cells[0].source = source
        write(nb, subs / student / TINY / f"{TINY}.ipynb")
        expected[student] = expect
    nb = nbformat.from_dict(json.loads(json.dumps(TINY_NB)))
    del nb.metadata["kernelspec"]
    write(nb, subs / "no_kernelspec" / TINY / f"{TINY}.ipynb")
    expected["no_kernelspec"] = Expect("ok", 1)
    bad_files = {
        "malformed_json": b'{"cells": [', "empty_file": b"", "binary_file": bytes(range(256)) * 64,
        "nbformat3": json.dumps({"nbformat": 3, "nbformat_minor": 0, "metadata": {}, "worksheets": []}).encode(),
    }
    for student, data in bad_files.items():
        (subs / student / TINY).mkdir(parents=True)
        (subs / student / TINY / f"{TINY}.ipynb").write_bytes(data)
        expected[student] = Expect("invalid_notebook", 0)
    write(TINY_NB, subs / "wrong_name" / TINY / "my_homework.ipynb")
    expected["wrong_name"] = Expect("missing_notebook", 0, "my_homework.ipynb")
    for student, attack in {**CHEATS, "honest_wrong": "pass", "judge_fine": None, "detector": GRADING_DETECTOR}.items():
        nb = nbformat.from_dict(json.loads(json.dumps(JUDGE_NB)))
        for c in nb.cells:
            grade_id = c.metadata.get("nbgrader", {}).get("grade_id", "")
            if grade_id.endswith("_code") and attack is not None:
                name = grade_id.removesuffix("_code")
                c.source = f"def {name}(x):\n    {CHEAT_BODIES.get(student, {}).get(name, WRONG[name])}"
                if student == "patch_during_test" and name == "double":
                    c.source = "def double(x):\n    _rig()\n    return x"
        if attack is not None:
            nb.cells.insert(1, cell(attack))
        write(nb, subs / student / JUDGE / f"{JUDGE}.ipynb")
    return expected


@dataclass
class Graded:
    """What the grading run produced."""

    process: subprocess.CompletedProcess
    out: Path
    rows: dict[tuple[str, str], dict[str, str]]
    expected: dict[str, Expect]
    paths: dict[str, str]
    seconds: float


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory) -> Graded:
    """Every hostile and broken submission, graded in one run."""
    import time

    base = tmp_path_factory.mktemp("adversarial")
    course, subs, out = base / "course", base / "submissions", base / "out"
    make_course(course)
    paths = {
        "solutions": str(course / "solutions" / TINY / f"{TINY}.ipynb"),
        "repo_solutions": str(ROOT / "solutions" / "00_orientation" / "00_orientation.ipynb"),
        "other_student": str(subs / "fine" / TINY / f"{TINY}.ipynb"),
        "grades": str(out / "grades.csv"),
    }
    out.mkdir()
    (out / "grades.csv").write_text("placeholder\n")
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    connections: list[object] = []
    closing = threading.Event()

    def accept() -> None:
        while not closing.is_set():
            try:
                connections.append(server.accept())
            except OSError:
                continue

    threading.Thread(target=accept, daemon=True).start()
    expected = make_submissions(subs, paths, server.getsockname()[1])
    start = time.monotonic()
    # Time limits for hangs only, far above what an honest tiny submission needs on a loaded 2-core machine;
    # the infinite loop meets the cell limit, and no submission is expected to meet the submission limit.
    process = subprocess.run(
        [sys.executable, "-m", "autograder", "grade", str(subs), "--out", str(out), "--course-root", str(course),
         "--jobs", "2", "--timeout", "600", "--cell-timeout", "45"],
        cwd=ROOT, capture_output=True, text=True, timeout=3600,
    )
    seconds = time.monotonic() - start
    closing.set()
    server.close()
    assert not connections, "a submission reached a socket outside its sandbox"
    with open(out / "grades.csv", newline="", encoding="utf-8") as f:
        rows = {(r["student_id"], r["chapter"]): r for r in csv.DictReader(f)}
    return Graded(process, out, rows, expected, paths, seconds)


def test_every_submission_has_one_row_in_order(graded: Graded) -> None:
    keys = list(graded.rows)
    assert keys == sorted(keys), graded.process.stdout
    students = set(graded.expected) | set(CHEATS) | {"honest_wrong", "judge_fine", "detector"}
    assert {s for s, _ in keys} == students, graded.process.stdout + graded.process.stderr
    assert all(r["message"] for r in graded.rows.values() if r["status"] != "ok" or r["score"] != r["max_score"])


def pids_cgroup_available() -> bool:
    """Whether this machine lets the grader create a pids cgroup (else the process limit cannot hold)."""
    probe = Cgroup("autograder-probe", 10, None)
    try:
        return probe.limits_processes
    finally:
        probe.kill_and_remove()


@pytest.mark.parametrize("student", sorted(tiny_sources({}, 0)) + ["no_kernelspec", "malformed_json", "empty_file",
                                                                   "binary_file", "nbformat3", "wrong_name"])
def test_broken_or_hostile_submission_gets_its_status(graded: Graded, student: str) -> None:
    if student == "fork_bomb" and not pids_cgroup_available():
        pytest.skip("no writable pids cgroup on this machine: the process limit cannot be enforced (see INSTRUCTORS.md)")
    row, expect = graded.rows[student, TINY], graded.expected[student]
    assert row["status"] == expect.status, row
    if expect.score is not None:
        assert float(row["score"]) == expect.score, row
    assert expect.message in row["message"], row


def test_sandbox_left_no_file_outside_its_folder(graded: Graded) -> None:
    leaked = [str(Path(p).parent / "PWNED") for p in graded.paths.values() if (Path(p).parent / "PWNED").exists()]
    assert not leaked
    assert (graded.out / "grades.csv").read_text().startswith("student_id,"), "the grader's output was overwritten"


def test_huge_output_is_capped_in_the_feedback(graded: Graded) -> None:
    feedback = graded.out / "feedback" / "huge_output" / f"{TINY}.html"
    assert feedback.stat().st_size < 20 * 2**20 and "output truncated by the grader" in feedback.read_text()


@pytest.mark.parametrize("student", sorted(CHEATS) + ["honest_wrong", "detector"])
def test_cheating_scores_zero(graded: Graded, student: str) -> None:
    row = graded.rows[student, JUDGE]
    assert row["status"] == "ok" and float(row["score"]) == 0 and float(row["max_score"]) == JUDGE_POINTS, row


def test_honest_solution_under_the_judge_scores_full_marks(graded: Graded) -> None:
    row = graded.rows["judge_fine", JUDGE]
    assert row["status"] == "ok" and float(row["score"]) == JUDGE_POINTS, row


def test_feedback_shows_results_but_no_hidden_tests(graded: Graded) -> None:
    for (student, chapter), row in graded.rows.items():
        feedback = graded.out / "feedback" / student / f"{chapter}.html"
        assert feedback.is_file() == (row["status"] == "ok")
        if feedback.is_file():
            text = feedback.read_text(encoding="utf-8")
            assert HIDDEN_MARKER not in text and "BEGIN HIDDEN TESTS" not in text, feedback
    text = (graded.out / "feedback" / "honest_wrong" / f"{JUDGE}.html").read_text(encoding="utf-8")
    assert "AssertionError" in text and "element(s) differ" in text  # the visible test's message
    assert "0 / 1" in text or "0.0 / 1.0" in text or "Points: 0" in text


def test_grading_resumes_without_regrading(graded: Graded) -> None:
    again = graded.out.parent / "out_again"
    shutil.copytree(graded.out, again)
    process = subprocess.run(
        [sys.executable, "-m", "autograder", "grade", str(graded.out.parent / "submissions"), "--out", str(again),
         "--course-root", str(graded.out.parent / "course"), "--jobs", "2", "--chapter", JUDGE],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )
    assert process.stdout.count("(from an earlier run)") == len(CHEATS) + 3, process.stdout
    print(f"adversarial grading run: {graded.seconds:.0f} s")


def test_feedback_says_whether_a_hidden_or_a_visible_case_failed(graded: Graded) -> None:
    hidden = html.unescape((graded.out / "feedback" / "visible_only" / f"{TINY}.html").read_text(encoding="utf-8"))
    assert "a hidden test case failed; its code is not shown" in hidden, "a hidden failure must be marked as such"
    visible = html.unescape((graded.out / "feedback" / "honest_wrong" / f"{JUDGE}.html").read_text(encoding="utf-8"))
    assert "a visible test failed" in visible and "hidden test case failed" not in visible
    row = graded.rows["honest_wrong", JUDGE]
    assert "[a visible test failed]" in row["message"] and "atol=" in row["message"], \
        f"grades.csv must keep the whole message, not cut it: {row['message']!r}"


def test_feedback_pages_fetch_nothing_and_wrap_long_messages(graded: Graded) -> None:
    pages = sorted((graded.out / "feedback").rglob("*.html"))
    assert pages
    for page in pages:
        text = page.read_text(encoding="utf-8")
        remote = re.findall(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//", text, re.I)
        assert not remote, f"{page.name} loads {remote[:3]} from the network: it must read well offline"
        assert "pre-wrap" in text, f"{page.name}: long messages must wrap"
