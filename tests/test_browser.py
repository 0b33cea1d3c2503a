"""The student's loop in a real browser: one Run All in JupyterLab reaches the last cell of a blank, solved or wrong notebook.

Starts JupyterLab the way ``make lab`` does (the student's settings from ``jupyter/student``:
no nbgrader instructor extensions) on a free port, opens notebooks in headless Chromium
(Debian's ``chromium`` package, driven by Playwright's Python package through
``executable_path``: no browser is downloaded) and runs all cells once. For every scenario
every code cell must have run; errors may show only in exercise cells (a student's unfinished
or wrong exercise, and its test), never in a lecture cell: those fall back to the reference.
Screenshots go to ``tests/artifacts/browser_<chapter>_<scenario>[_failure].png``.

Marked ``browser``. It runs in ``make test`` where chromium is installed (``.ci/run`` installs
it) and is skipped elsewhere; ``make test-browser`` runs it alone.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
STUDENT_CONFIG = ROOT / "jupyter" / "student"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = ROOT / "tests" / "artifacts"
pytestmark = [pytest.mark.browser, pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")]

# Plausible mistakes, each failing its own test; the cells after it must still run.
WRONG = {
    "04_activations_optimizers": {
        # softmax without subtracting the maximum: exp overflows to inf for large logits
        "ex04_1_softmax_code": '''\
def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax of `x` along `dim`."""
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)
''',
        # Adam without bias correction
        "ex04_4_adam_code": '''\
def adam_step(p, grad, state, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
              decoupled_weight_decay=False):
    """Adam, forgetting the bias correction of both moments."""
    with torch.no_grad():
        m = state.setdefault("exp_avg", torch.zeros_like(p))
        v = state.setdefault("exp_avg_sq", torch.zeros_like(p))
        m.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
        v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
        p.addcdiv_(m, v.sqrt() + eps, value=-lr)
''',
    },
    "07_accumulation_checkpointing": {
        # run() reads `chunk` when backward recomputes, not when it was defined: every segment replays the last one
        "ex07_3_checkpointed_sequential_code": '''\
class CheckpointSegment(torch.autograd.Function):
    """CheckpointSegment.apply(run, x, *params): run(x), keeping only x and the random state."""

    @staticmethod
    def forward(ctx, run, x, *params):
        ctx.run, ctx.params = run, params
        ctx.cpu_state = torch.get_rng_state()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.set_rng_state(ctx.cpu_state)
            x_again = x.detach().requires_grad_(ctx.needs_input_grad[1])
            y = ctx.run(x_again)
        needs = ctx.needs_input_grad[1:]
        wanted = [t for t, need in zip((x_again, *ctx.params), needs) if need]
        found = iter(torch.autograd.grad(y, wanted, grad_out, allow_unused=True))
        return (None, *(next(found) if need else None for need in needs))


def checkpointed_sequential(modules, segments, x):
    """Apply `modules` in order to x, each segment through CheckpointSegment."""
    modules = list(modules)
    for start, end in ac.segment_bounds(len(modules), segments):
        chunk = modules[start:end]

        def run(t):
            for m in chunk:
                t = m(t)
            return t

        params = [p for m in chunk for p in m.parameters()]
        x = CheckpointSegment.apply(run, x, *params)
    return x
''',
    },
    "13_tensor_parallel": {
        # f's backward forgets the all-reduce: each rank keeps only its own part of the gradient
        "ex13_1_f_and_g_code": '''\
class CopyToParallelRegion(torch.autograd.Function):
    """f: the identity forward; the backward should all-reduce, and does not."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ReduceFromParallelRegion(torch.autograd.Function):
    """g: an all-reduce forward, the identity backward."""

    @staticmethod
    def forward(ctx, x):
        total = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad
''',
    },
}
SCENARIOS = [("00_orientation", "solved")] + [(c, s) for c in WRONG for s in ("blank", "wrong")]

# The open notebook's code cells: how many ran, the kernel's status, and each error with its cell's tags.
STATE = """(() => {
    const panel = window.jupyterapp.shell.currentWidget;
    const session = panel && panel.sessionContext ? panel.sessionContext.session : null;
    const cells = panel ? [...panel.content.model.cells] : [];
    const code = cells.map((c, i) => [c, i]).filter(([c]) => c.type === 'code');
    const errors = code.flatMap(([c, i]) => c.outputs.toJSON().filter(o => o.output_type === 'error').map(o => ({
        index: i, tags: c.getMetadata('tags') || [], error: `${o.ename}: ${o.evalue}`})));
    return {n: code.length, done: code.filter(([c]) => c.executionCount).length,
            last: code.length ? !!code[code.length - 1][0].executionCount : false,
            kernel: session && session.kernel ? session.kernel.status : 'starting', errors};
})()"""
NBGRADER_PLUGINS = "window.jupyterapp.listPlugins().filter(id => id.startsWith('@jupyter/nbgrader'))"


def notebook_for(chapter: str, scenario: str, folder: Path) -> Path:
    """The released notebook, with the solution's answers ('solved'), none ('blank'), or those plus WRONG's mistakes."""
    released = nbformat.read(ROOT / "notebooks" / chapter / f"{chapter}.ipynb", as_version=4)
    if scenario != "blank":
        solution = nbformat.read(ROOT / "solutions" / chapter / f"{chapter}.ipynb", as_version=4)
        answers = {c.metadata["nbgrader"]["grade_id"]: c.source for c in solution.cells
                   if c.metadata.get("nbgrader", {}).get("solution")}
        answers |= WRONG.get(chapter, {}) if scenario == "wrong" else {}
        for cell in released.cells:
            grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
            if grade_id in answers and cell.metadata.nbgrader.get("solution"):
                cell.source = answers[grade_id]
    path = folder / f"{chapter}_{scenario}.ipynb"
    nbformat.write(released, path)
    return path


def free_port() -> int:
    """A TCP port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status_of(url: str) -> int:
    """The HTTP status of a GET of ``url``."""
    try:
        return urllib.request.urlopen(url, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """A student's JupyterLab serving a scratch folder: (base URL, token, folder)."""
    folder = tmp_path_factory.mktemp("lab")
    port, token = free_port(), "browser-test"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "JUPYTER_CONFIG_PATH": str(STUDENT_CONFIG)}
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--ServerApp.token={token}", f"--notebook-dir={folder}", "--allow-root",
         "--LabApp.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=True"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        yield base, token, folder
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture(scope="module")
def page(lab: tuple[str, str, Path]) -> Iterator[object]:
    """One headless Chromium page for every scenario."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser.new_page(viewport={"width": 1400, "height": 1000})
        browser.close()


def open_notebook(page: object, base: str, token: str, name: str) -> None:
    """Open ``name`` in the lab and wait until its kernel is idle."""
    # A workspace of its own, so that the lab does not reopen the notebooks of earlier scenarios.
    workspace = name.removesuffix(".ipynb").replace("_", "-")
    page.goto(f"{base}/lab/workspaces/{workspace}/tree/{name}?reset&token={token}", timeout=120_000)
    page.wait_for_function("() => window.jupyterapp && document.querySelector('.jp-Notebook .jp-Cell')",
                           timeout=120_000)
    page.wait_for_function(f"{STATE}.kernel === 'idle'", timeout=120_000, polling=500)


def test_the_students_lab_has_no_instructor_extensions(lab: tuple[str, str, Path], page: object) -> None:
    base, token, folder = lab
    installed = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "@jupyter" / "nbgrader"
    assert installed.is_dir(), "nbgrader's lab extension is not installed, so this check would prove nothing"
    notebook = notebook_for("00_orientation", "blank", folder)
    open_notebook(page, base, token, notebook.name)
    assert page.evaluate(NBGRADER_PLUGINS) == [], "the student's lab shows nbgrader's instructor plugins"
    assert status_of(f"{base}/formgrader?token={token}") == 404, "the formgrader is served to students"
    page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")


@pytest.mark.parametrize(("chapter", "scenario"), SCENARIOS, ids=[f"{c}-{s}" for c, s in SCENARIOS])
def test_one_run_all_reaches_the_last_cell(lab: tuple[str, str, Path], page: object, chapter: str, scenario: str) -> None:
    base, token, folder = lab
    notebook = notebook_for(chapter, scenario, folder)
    open_notebook(page, base, token, notebook.name)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    # JupyterLab renders only the cells in view, so read the notebook's model, not the page. Done
    # when the kernel is idle and the last cell ran, or a lecture cell failed (Run All stops there).
    page.wait_for_function(
        f"(s => s.kernel === 'idle' && (s.last || s.errors.some(e => !e.tags.includes('raises-exception'))))({STATE})",
        timeout=600_000, polling=1000)
    state = page.evaluate(STATE)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / f"browser_{chapter}_{scenario}"
    page.screenshot(path=f"{shot}.png")
    if state["errors"]:  # the first failure, as the student sees it
        page.evaluate(f"window.jupyterapp.shell.currentWidget.content.scrollToItem({state['errors'][0]['index']}, 'start')")
        page.wait_for_timeout(500)
        page.evaluate("(document.querySelector('.jp-OutputArea-output[data-mime-type=\"application/vnd.jupyter.stderr\"]')"
                      " || document.body).scrollIntoView({block: 'center'})")
        page.wait_for_timeout(300)
        page.screenshot(path=f"{shot}_failure.png")
    page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")

    lecture = [e for e in state["errors"] if "raises-exception" not in e["tags"]]
    assert not lecture, f"{chapter} ({scenario}): lecture cells raised: {lecture}"
    assert state["n"] > 0 and state["done"] == state["n"] and state["last"], \
        f"{chapter} ({scenario}): {state['done']} of {state['n']} code cells ran"
    if scenario == "solved":
        assert not state["errors"], f"{chapter}: a solved notebook shows errors: {state['errors']}"
    else:
        assert state["errors"], f"{chapter} ({scenario}): no exercise failed, so this scenario tests nothing"
