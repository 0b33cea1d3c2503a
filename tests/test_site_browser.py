"""The built course site in a real browser: the landing page and two chapters in both editions.

Serves ``build/site/html`` (``SITE_HTML`` overrides) with ``http.server`` on a free port and opens
it in headless Chromium (Debian's ``chromium``, driven by Playwright through ``executable_path``,
as tests/test_browser.py does). Every same-origin image must have loaded (``naturalWidth > 0``) and
every request succeeded, no output may show error text, and the banner's link to the other edition
must lead to the same chapter there. Full-page screenshots go to
``tests/artifacts/site_<page>_<edition>.png``.

Marked ``browser``. Skipped when chromium is missing or the site is not built, so that
``make test`` runs it only where ``make site`` ran; with ``SITE_REQUIRED=1`` (``make site-check``,
CI) a missing site fails instead. ``SITE_CHAPTERS`` and ``SITE_EDITIONS`` (space-separated; ``all``
for every chapter) change which pages are opened.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("SITE_HTML", ROOT / "build" / "site" / "html"))
REQUIRED = os.environ.get("SITE_REQUIRED") == "1"
CHAPTERS = os.environ.get("SITE_CHAPTERS", "01_floating_point 10_flash_attention").split()
if CHAPTERS == ["all"]:
    CHAPTERS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*") if p.is_dir())
EDITIONS = os.environ.get("SITE_EDITIONS", "cpu h200").split()
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = ROOT / "tests" / "artifacts"
# A traceback, or a line that starts like one's last ("ValueError: ..."); an output may still name an error in passing.
ERROR_TEXT = re.compile(r"Traceback|^\s*[A-Z]\w*(?:Error|Exception)\b", re.MULTILINE)
pytestmark = [pytest.mark.browser, pytest.mark.skipif(CHROMIUM is None and not REQUIRED, reason="chromium is not installed")]

# What the open page shows: its images that did not load, its outputs' text, its build error messages.
STATE = """(() => ({
    broken: [...document.images].filter(i => i.src.startsWith(location.origin) && !(i.complete && i.naturalWidth > 0))
                                 .map(i => i.getAttribute('src')),
    images: document.images.length,
    outputs: [...document.querySelectorAll('.cell_output')].map(o => o.innerText),
    messages: [...document.querySelectorAll('.system-message, .problematic')].map(e => e.innerText),
    banner: [...document.querySelectorAll('.site-banner a')].map(a => a.href),
    prevNext: document.querySelectorAll('.prev-next-area a').length,
}))()"""


class _Quiet(SimpleHTTPRequestHandler):
    """A static file handler that does not log every request."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    """The site served on a free local port: its base URL."""
    if not (SITE / "index.html").is_file():
        message = f"no site at {SITE}: run make site first"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: run make browser-deps")
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(SITE)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser(base: str) -> Iterator[Any]:
    """One headless Chromium for every page."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any, base: str) -> Iterator[Any]:
    """A fresh page that records the site's failed requests in ``page.failed``."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.failed = []
    page.on("response", lambda r: r.url.startswith(base) and r.status >= 400 and not r.url.endswith("/favicon.ico")
            and page.failed.append(f"{r.status} {r.url}"))
    page.on("requestfailed", lambda r: r.url.startswith(base) and page.failed.append(f"failed {r.url}"))
    yield page
    page.close()


def open_page(page: Any, url: str) -> dict[str, Any]:
    """Go to ``url``, load every image (lazy ones too), and return what the page shows (STATE)."""
    page.goto(url, wait_until="load", timeout=60_000)
    page.evaluate("document.querySelectorAll('img[loading=lazy]').forEach(i => { i.loading = 'eager'; })")
    page.wait_for_function("[...document.images].every(i => i.complete)", timeout=60_000)
    state: dict[str, Any] = page.evaluate(STATE)
    return state


def shoot(page: Any, name: str, edition: str) -> None:
    """A full-page screenshot to tests/artifacts/site_<name>_<edition>.png."""
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"site_{name}_{edition}.png"), full_page=True)


def assert_clean(page: Any, state: dict[str, Any], what: str) -> None:
    """No broken image, failed request, error text in an output, or build error message on the page."""
    assert not state["broken"], f"{what}: images that did not load: {state['broken']}"
    assert not page.failed, f"{what}: requests that failed: {page.failed}"
    errors = [text[:300] for text in state["outputs"] if ERROR_TEXT.search(text)]
    assert not errors, f"{what}: outputs show errors: {errors}"
    assert not state["messages"], f"{what}: the build left error messages: {state['messages']}"


def test_landing_page(page: Any, base: str) -> None:
    state = open_page(page, f"{base}/index.html")
    shoot(page, "landing", "all")
    assert_clean(page, state, "landing page")
    hrefs = page.evaluate("[...document.querySelectorAll('article a')].map(a => a.getAttribute('href'))")
    for edition in EDITIONS:
        for chapter in CHAPTERS:
            assert f"{edition}/{chapter}.html" in hrefs, f"the landing page does not link {edition}/{chapter}"


@pytest.mark.parametrize("edition", EDITIONS)
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_page(page: Any, base: str, chapter: str, edition: str) -> None:
    state = open_page(page, f"{base}/{edition}/{chapter}.html")
    shoot(page, chapter, edition)
    assert_clean(page, state, f"{edition}/{chapter}")
    assert state["outputs"], f"{edition}/{chapter}: no cell outputs"
    assert state["prevNext"] > 0, f"{edition}/{chapter}: no previous/next links"
    for service in ("colab.research.google.com", "mybinder.org"):
        assert any(service in href for href in state["banner"]), f"{edition}/{chapter}: no launch link to {service}"
    for other in (e for e in EDITIONS if e != edition):
        switch = [href for href in state["banner"] if href.endswith(f"/{other}/{chapter}.html")]
        assert switch, f"{edition}/{chapter}: the banner has no link to the {other} edition: {state['banner']}"
        page.click(f".site-banner a[href$='{other}/{chapter}.html']")
        page.wait_for_url(f"**/{other}/{chapter}.html", timeout=30_000)
        assert page.evaluate("document.querySelectorAll('.cell_output').length") > 0, f"{other}/{chapter}: no outputs"


def test_search_finds_a_chapter(page: Any, base: str) -> None:
    page.goto(f"{base}/search.html?q=mantissa", wait_until="load", timeout=60_000)
    page.wait_for_function("document.querySelectorAll('#search-results li a').length > 0", timeout=60_000)
    hits = page.evaluate("[...document.querySelectorAll('#search-results li a')].map(a => a.getAttribute('href'))")
    shoot(page, "search", "all")
    assert any("01_floating_point" in h for h in hits), f"searching 'mantissa' did not find chapter 01: {hits}"
