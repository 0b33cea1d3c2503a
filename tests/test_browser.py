"""JupyterLab in a real browser: a released notebook, with a student's answers filled in, runs without an error.

Starts JupyterLab from the project environment on a free port, opens the notebook in headless
Chromium (Debian's ``chromium`` package, driven by Playwright's Python package through
``executable_path``: no browser is downloaded), runs all cells, checks that every code cell ran
and none shows an error, and saves a screenshot to ``tests/artifacts/browser_<chapter>.png``.

Marked ``browser``. It runs in ``make test`` (about 15 s) where chromium is installed (``.ci/run``
installs it) and is skipped elsewhere; ``make test-browser`` runs it alone.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = "00_orientation"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = ROOT / "tests" / "artifacts"
pytestmark = [pytest.mark.browser, pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")]


# The open notebook's code cells, how many have run, the kernel's status and every error output.
STATE = """(() => {
    const panel = window.jupyterapp.shell.currentWidget;
    const session = panel && panel.sessionContext ? panel.sessionContext.session : null;
    const code = panel ? [...panel.content.model.cells].filter(c => c.type === 'code') : [];
    const errors = code.flatMap(c => c.outputs.toJSON()).filter(o => o.output_type === 'error')
        .map(o => `${o.ename}: ${o.evalue}`);
    return {n: code.length, done: code.filter(c => c.executionCount).length,
            kernel: session && session.kernel ? session.kernel.status : 'starting', errors};
})()"""


def completed_notebook(folder: Path) -> Path:
    """The released notebook of CHAPTER with every solution cell answered as the instructor's copy does."""
    released = nbformat.read(ROOT / "notebooks" / CHAPTER / f"{CHAPTER}.ipynb", as_version=4)
    solution = nbformat.read(ROOT / "solutions" / CHAPTER / f"{CHAPTER}.ipynb", as_version=4)
    answers = {c.metadata["nbgrader"]["grade_id"]: c.source for c in solution.cells
               if c.metadata.get("nbgrader", {}).get("solution")}
    for cell in released.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            cell.source = answers[grade_id]
    path = folder / f"{CHAPTER}.ipynb"
    nbformat.write(released, path)
    return path


def free_port() -> int:
    """A TCP port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_released_notebook_runs_in_jupyterlab(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    notebook = completed_notebook(tmp_path)
    port, token = free_port(), "browser-test"
    lab = subprocess.Popen(
        [str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--ServerApp.token={token}", f"--notebook-dir={tmp_path}", "--allow-root",
         "--LabApp.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=True"],
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{base}/lab/tree/{notebook.name}?token={token}", timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.wait_for_function("() => window.jupyterapp && document.querySelector('.jp-Notebook')",
                                   timeout=60_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)
            page.wait_for_function(f"{STATE}.kernel === 'idle'", timeout=120_000, polling=500)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            # JupyterLab renders only the cells in view, so read the notebook's model, not the page.
            # Done when the kernel is idle and every cell ran, or a cell failed (run-all stops there).
            page.wait_for_function(f"(s => s.kernel === 'idle' && (s.done === s.n || s.errors.length > 0))({STATE})",
                                   timeout=300_000, polling=1000)
            state = page.evaluate(STATE)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"browser_{CHAPTER}.png"), full_page=True)
            browser.close()
        assert state["n"] > 0 and state["done"] == state["n"], state
        assert not state["errors"], f"cells show errors: {state['errors']}"
    finally:
        lab.terminate()
        try:
            lab.wait(timeout=20)
        except subprocess.TimeoutExpired:
            lab.kill()
