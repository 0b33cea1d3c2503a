"""Build the course site into ``build/site/``: execute, graft, write the Sphinx source, render, check.

``build/site/executed/cpu/`` gets the solution notebooks executed by this build (the CPU
edition), ``build/site/src/`` the generated Sphinx source and ``build/site/html/`` the site.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nbformat

from course_lib.support.hosted import REPOSITORY
from website import BUILD, ROOT
from website import pages as pg
from website.check import check_site, leaks
from website.editions import EDITIONS_DIR, Edition, cpu_edition, graft, load_edition, released_notebook

__all__ = ["all_chapters", "build", "run_sphinx", "write_source"]

SITE_CSS = """\
/* A wider page than the theme's, for plots: they use the text's width at most and keep their proportions. */
.bd-page-width { max-width: 110rem; }
.bd-main .bd-content .bd-article-container { max-width: 72em; }
.cell_output img { max-width: 100%; height: auto; cursor: zoom-in; }
.site-banner p { margin: 0.3em 0; }
"""
SITE_JS = """\
// Every plot opens at its full resolution in a new tab when clicked.
document.addEventListener("DOMContentLoaded", () => {
  for (const img of document.querySelectorAll(".cell_output img")) {
    img.title = "click for full size";
    img.addEventListener("click", () => window.open(img.src, "_blank"));
  }
});
"""


def all_chapters() -> list[str]:
    """Every chapter of the course, in order (folder names under notebooks/)."""
    return sorted(p.parent.name for p in ROOT.glob("notebooks/[0-9][0-9]_*/[0-9][0-9]_*.ipynb"))


def _h200_edition(folder: Path, chapters: list[str], allow_missing: bool) -> Edition | None:
    """The committed H200 edition for ``chapters``; None (or a failure) when it is missing."""
    if not (folder / "provenance.json").is_file():
        if allow_missing:
            print(f"note: no H200 record in {folder}: building the CPU edition only")
            return None
        raise SystemExit(f"no H200 record in {folder}: the site needs both editions. Record a GPU run "
                         "(docs/website.md), point --h200-from at one, or pass --allow-missing-h200 for a draft.")
    edition = load_edition("h200", "H200", folder)
    if "H200" not in str(edition.provenance.get("gpu")):
        print(f"warning: the H200 record in {folder} was made on {edition.provenance.get('gpu')}, not an H200")
    missing = [c for c in chapters if c not in edition.notebooks]
    if missing and not allow_missing:
        raise SystemExit(f"the H200 record in {folder} lacks {', '.join(missing)}; record a full GPU run "
                         "or pass --allow-missing-h200")
    edition.notebooks = {c: p for c, p in edition.notebooks.items() if c in chapters}
    return edition


def _site_map(chapters: list[str]) -> dict[str, str]:
    """Repository files that are pages of the site, and where: repository path -> site path."""
    # README.md's set-up sections are the "run it locally" page (its intro and table are the landing page's).
    site = {"README.md": "run-locally.md", "INSTRUCTORS.md": "INSTRUCTORS.md"}
    for path in [*ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/results/*.md")]:
        rel = path.relative_to(ROOT).as_posix()
        site[rel] = rel
    site.update({f"notebooks/{c}/{c}.ipynb": f"cpu/{c}.ipynb" for c in chapters})
    return site


def _copy_markdown(repo_path: str, src: Path, site: dict[str, str], assets: set[str]) -> None:
    """Put a markdown file of the repository on the site at its own path, links fixed."""
    text = (ROOT / repo_path).read_text()
    pg.write_markdown(pg.rewrite_links(text, repo_path, repo_path, site, assets), src / repo_path)


def _first_heading(path: Path) -> str:
    """The title of a markdown file (its first ``# `` line), or its name."""
    return next((line[2:].strip() for line in path.read_text().splitlines() if line.startswith("# ")), path.stem)


def write_source(src: Path, chapters: list[str], editions: list[Edition]) -> None:
    """Write the whole Sphinx source tree for ``chapters`` in ``editions`` into ``src``."""
    if src.exists():
        shutil.rmtree(src)
    (src / "_static").mkdir(parents=True)
    site, assets = _site_map(chapters), set[str]()
    readme = (ROOT / "README.md").read_text()
    docs = [p.relative_to(ROOT).as_posix() for p in sorted(ROOT.glob("docs/*.md"))]
    results = [p.relative_to(ROOT).as_posix() for p in sorted(ROOT.glob("benchmarks/results/*.md"))]
    for repo_path in ["INSTRUCTORS.md", *docs, *results]:
        _copy_markdown(repo_path, src, site, assets)
    pg.write_markdown(pg.rewrite_links(pg.run_locally_page(readme), "README.md", "run-locally.md", site, assets),
                      src / "run-locally.md")
    records = {p.removeprefix("benchmarks/").removesuffix(".md"): _first_heading(ROOT / p) for p in results}
    plots = [p.relative_to(ROOT / "benchmarks").as_posix() for p in sorted(ROOT.glob("benchmarks/results/*.png"))]
    assets.update(f"benchmarks/{p}" for p in plots)
    pg.write_markdown(pg.benchmarks_index(records, plots), src / "benchmarks" / "index.md")
    guides = ["run-locally", *(d.removesuffix(".md") for d in docs), "INSTRUCTORS"]
    landing = pg.landing_page(readme, editions, guides, ["benchmarks/index"])
    pg.write_markdown(pg.rewrite_links(landing, "README.md", "index.md", site, assets), src / "index.md")
    for edition in editions:
        other = next((e for e in editions if e is not edition), None)
        pg.write_markdown(pg.edition_index(edition), src / edition.key / "index.md")
        for chapter, path in edition.notebooks.items():
            page = graft(nbformat.read(released_notebook(chapter), as_version=4), nbformat.read(path, as_version=4))
            page = pg.chapter_page(page, chapter, edition, other, site, assets)
            nbformat.write(page, src / edition.key / f"{chapter}.ipynb")
    for asset in sorted(assets):
        (src / asset).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / asset, src / asset)
    (src / "_static" / "site.css").write_text(SITE_CSS)
    (src / "_static" / "site.js").write_text(SITE_JS)
    shutil.copy2(Path(__file__).with_name("conf.py"), src / "conf.py")
    facts = {"version": pg.course_version(), "repository": REPOSITORY, "year": datetime.now(UTC).year}
    (src / "site.json").write_text(json.dumps(facts, indent=2) + "\n")


def run_sphinx(src: Path, html: Path, jobs: int) -> None:
    """Render ``src`` to ``html`` with Sphinx (fails the build when Sphinx does)."""
    from sphinx.cmd.build import build_main

    if html.exists():
        shutil.rmtree(html)
    status = build_main(["-b", "html", "-q", "-j", str(jobs), "-d", str(html.parent / "doctrees"), str(src), str(html)])
    if status:
        raise SystemExit(f"sphinx-build failed (exit status {status})")
    for template in html.glob("_static/*webpack-macros.html"):  # the theme's Jinja macros, copied along: not pages
        template.unlink()


def _check(html: Path, chapters: list[str], editions: list[Edition]) -> None:
    """Check the built site (``website.check``): links, images, outputs, no solution lines; fail on any problem."""
    problems = check_site(html, chapters, [e.key for e in editions])
    problems += leaks(html, ROOT / "solutions", ROOT / "notebooks")
    if problems:
        raise SystemExit(f"the built site has {len(problems)} problem(s):\n  " + "\n  ".join(problems))


def _timed(step: str, times: dict[str, float], func: Callable[..., Any], *args: Any) -> Any:
    """Run one step of the build, print and keep its duration."""
    start = time.perf_counter()
    result = func(*args)
    times[step] = round(time.perf_counter() - start, 1)
    print(f"[site] {step}: {times[step]:.0f} s")
    return result


def build(chapters: list[str], cpu_from: Path | None = None, h200_from: Path | None = None,
          allow_missing_h200: bool = False, jobs: int = 2) -> dict[str, float]:
    """Build the site: CPU run (or reuse ``cpu_from``), both editions grafted, Sphinx, checks; returns step times."""
    from benchmarks.notebooks import main as run_notebooks

    chapters = chapters or all_chapters()
    times: dict[str, float] = {}
    h200 = _h200_edition(h200_from or EDITIONS_DIR / "h200", chapters, allow_missing_h200)
    executed = cpu_from or BUILD / "executed" / "cpu"
    if cpu_from is None:
        shutil.rmtree(executed, ignore_errors=True)
        _timed("execute CPU edition", times, run_notebooks, ["--out", str(executed), *chapters])
    editions = [cpu_edition(executed, chapters), *([h200] if h200 else [])]
    _timed("write source", times, write_source, BUILD / "src", chapters, editions)
    _timed("sphinx", times, run_sphinx, BUILD / "src", BUILD / "html", jobs)
    _timed("check", times, _check, BUILD / "html", chapters, editions)
    print(f"[site] built {BUILD / 'html' / 'index.html'} in {sum(times.values()):.0f} s")
    return times
