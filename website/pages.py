"""The site's pages as Sphinx (MyST) source: landing page, guides, benchmark records and chapter pages.

Files keep their place in the repository (``docs/gpu-run.md`` stays ``docs/gpu-run.md``) so that
their relative links still resolve; a link to a file that is not on the site points at the
repository instead. Chapter pages live at ``<edition>/<chapter>.ipynb`` and start with a banner.
"""

from __future__ import annotations

import posixpath
import re
import tomllib
from datetime import datetime
from importlib import metadata
from pathlib import Path
from urllib.parse import quote

import nbformat
from nbformat import NotebookNode

from course_lib.support.hosted import REPOSITORY
from website import ROOT
from website.editions import Edition

__all__ = [
    "alt_text", "banner", "benchmarks_index", "chapter_page", "chapter_table", "course_version", "edition_index",
    "format_seconds", "landing_page", "launch_links", "markdown_section", "rewrite_links", "run_locally_page",
    "write_markdown",
]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".svg")
IMAGE_MIMES = ("image/png", "image/jpeg", "image/gif", "image/svg+xml")
LINK = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)\)")
TITLE_CALL = re.compile(r"""(?:set_title\(|suptitle\(|plt\.title\(|\btitle=)\s*(["'])(.+?)(?<!\\)\1""")
FENCE = re.compile(r"^\s*(```|~~~)")


def course_version() -> str:
    """The course's version: the installed package's, else pyproject.toml's."""
    try:
        return metadata.version("training-at-speed")
    except metadata.PackageNotFoundError:
        return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def format_seconds(seconds: float | None) -> str:
    """A run time as people read it: "42 s", "3 min 05 s", or "not measured"."""
    if seconds is None:
        return "not measured"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


def _repo_url(path: str, folder: bool) -> str:
    """The repository's page for ``path`` at this version's release tag."""
    return f"{REPOSITORY}/{'tree' if folder else 'blob'}/v{course_version()}/{path}"


def _rewrite_prose(text: str, source: str, page: str, site: dict[str, str], assets: set[str]) -> str:
    """Rewrite the links of ``text`` (prose, no code) from the file ``source`` for the page ``page``."""

    def fix(match: re.Match[str]) -> str:
        label, target = match.groups()
        path, hash_, anchor = target.partition("#")
        if not path or re.match(r"^[a-zA-Z][\w+.-]*:", path):
            return match.group(0)
        repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
        on_disk = ROOT / repo_path
        if repo_path.startswith("..") or not on_disk.exists():
            return match.group(0)
        if repo_path not in site and repo_path.lower().endswith(IMAGE_SUFFIXES):
            assets.add(repo_path)
            site[repo_path] = repo_path
        if repo_path in site:
            new = posixpath.relpath(site[repo_path], posixpath.dirname(page) or ".")
        else:
            new = _repo_url(repo_path, on_disk.is_dir())
        return f"{label}({new}{hash_}{anchor})"

    pieces = re.split(r"(`+[^`]*`+)", text)
    return "".join(p if i % 2 else LINK.sub(fix, p) for i, p in enumerate(pieces))


def rewrite_links(text: str, source: str, page: str, site: dict[str, str], assets: set[str]) -> str:
    """Markdown ``text`` of the repository file ``source`` with its relative links fixed for the site page ``page``.

    ``site`` maps repository paths to site paths; links to other files of the repository point at
    GitHub; images are added to ``site`` and ``assets`` (to be copied); code is left alone.
    """
    out: list[str] = []
    block: list[str] = []
    fenced = False
    for line in text.splitlines(keepends=True):
        if FENCE.match(line):
            if not fenced:
                out.append(_rewrite_prose("".join(block), source, page, site, assets))
                block = []
            fenced = not fenced
            out.append(line)
        elif fenced:
            out.append(line)
        else:
            block.append(line)
    out.append(_rewrite_prose("".join(block), source, page, site, assets))
    return "".join(out)


def markdown_section(text: str, heading: str) -> str:
    """The ``## heading`` section of a markdown text, its heading line included, up to the next ``## ``."""
    lines = text.splitlines()
    start = lines.index(f"## {heading}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end]).strip() + "\n"


def chapter_table(readme: str) -> tuple[list[str], list[list[str]]]:
    """The README's chapter table: its header cells and its rows of cells."""
    rows = [line.strip().strip("|").split("|") for line in markdown_section(readme, "Chapters").splitlines()
            if line.startswith("|")]
    cells = [[c.strip() for c in row] for row in rows]
    return cells[0], cells[2:]


def launch_links(chapter: str) -> dict[str, str]:
    """Where the released notebook of ``chapter`` opens: Colab and Binder, at this version's tag."""
    owner_repo = REPOSITORY.removeprefix("https://github.com/")
    notebook = f"notebooks/{chapter}/{chapter}.ipynb"
    tag = f"v{course_version()}"
    return {
        "Colab": f"https://colab.research.google.com/github/{owner_repo}/blob/{tag}/{notebook}",
        "Binder": f"https://mybinder.org/v2/gh/{owner_repo}/{tag}?labpath={quote(notebook, safe='')}",
    }


def _when_where(edition: Edition) -> str:
    """One phrase saying on what and when an edition's notebooks ran."""
    facts = edition.provenance
    date = facts.get("date") or ""
    when = datetime.fromisoformat(date).strftime("%Y-%m-%d %H:%M UTC") if date else "an unknown date"
    device = (facts.get("device") or facts.get("gpu") or "an unknown device").removeprefix("device: ")
    where = ", ".join(part for part in device.split(" | ") if not part.startswith("seed "))
    driver = f", NVIDIA driver {facts['driver']}" if facts.get("driver") not in (None, "none", "unknown") else ""
    return f"{facts.get('machine', 'unknown machine')} ({where}{driver}), {when}"


def banner(chapter: str, edition: Edition, other: Edition | None) -> str:
    """The markdown banner on top of a chapter page: edition, where it ran, run time, the other edition, launch links."""
    lines = [
        f"```{{admonition}} {edition.title} edition",
        ":class: note site-banner",
        "",
        f"The outputs on this page were computed on {_when_where(edition)}. "
        f"The whole notebook ran in **{format_seconds(edition.seconds(chapter))}** there.",
    ]
    if other is not None and chapter in other.notebooks:
        lines += ["", f"**Other edition:** [this chapter as run on {other.title}](../{other.key}/{chapter}.ipynb) "
                      f"({format_seconds(other.seconds(chapter))})."]
    launch = " · ".join(f"[{name}]({url})" for name, url in launch_links(chapter).items())
    lines += ["", f"**Run it yourself:** {launch} · [locally in JupyterLab](../run-locally.md) (`make lab`).", "```"]
    return "\n".join(lines)


def _plain_heading(markdown: str) -> str | None:
    """The last heading of a markdown cell, without its ``#`` marks and formatting, or None."""
    headings = [line.lstrip("#").strip() for line in markdown.splitlines() if re.match(r"^#{1,6} ", line)]
    return re.sub(r"[*_`]", "", headings[-1]) if headings else None


def alt_text(source: str, heading: str | None) -> str:
    """Alt text for a cell's plots: the titles its code sets literally, else the section it sits in."""
    titles = [m.group(2).replace("\\n", " ") for m in TITLE_CALL.finditer(source) if "{" not in m.group(2)]
    if titles:
        return "Plot: " + "; ".join(dict.fromkeys(titles))
    return f"Plot for the section “{heading}”" if heading else "Plot from the notebook"


def _split_title(cell: NotebookNode) -> list[NotebookNode]:
    """A markdown cell cut after its first line (the chapter title) so that the banner can follow it."""
    title, _, rest = cell.source.partition("\n")
    cells = [nbformat.v4.new_markdown_cell(title, id="site-title")]
    if rest.strip():
        cells.append(nbformat.v4.new_markdown_cell(rest, id=cell.get("id", "intro")))
    return cells


def chapter_page(nb: NotebookNode, chapter: str, edition: Edition, other: Edition | None,
                 site: dict[str, str], assets: set[str]) -> NotebookNode:
    """A grafted chapter notebook made into its page: banner under the title, alt text on plots, links fixed."""
    source, page = f"notebooks/{chapter}/{chapter}.ipynb", f"{edition.key}/{chapter}.ipynb"
    heading: str | None = None
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = rewrite_links(cell.source, source, page, site, assets)
            heading = _plain_heading(cell.source) or heading
        elif cell.cell_type == "code" and any(m in o.get("data", {}) for o in cell.outputs for m in IMAGE_MIMES):
            cell.metadata.setdefault("mystnb", {})["image"] = {"alt": alt_text(cell.source, heading)}
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown")
    head = _split_title(nb.cells[first])
    head[0].source += f" ({edition.title})"  # the edition in the page's title: the sidebar and search tell them apart
    bann = nbformat.v4.new_markdown_cell(banner(chapter, edition, other), id="site-banner")
    nb.cells[first:first + 1] = [head[0], bann, *head[1:]]
    return nb


def _toctree(caption: str, entries: list[str]) -> str:
    """A hidden toctree (the sidebar's navigation) with a caption."""
    return "\n".join(["```{toctree}", f":caption: {caption}", ":hidden:", ":maxdepth: 1", "", *entries, "```", ""])


def landing_page(readme: str, editions: list[Edition], guides: list[str], benchmarks: list[str]) -> str:
    """The landing page: the README's opening, its chapter table linked to each edition, and the navigation."""
    intro = readme.split("\n## ", 1)[0].strip()
    header, rows = chapter_table(readme)
    head = [*header[:3], "editions"]
    titles = " and ".join(f"{e.title} ({e.provenance.get('machine', 'unknown machine')})" for e in editions)
    count = "two editions" if len(editions) == 2 else "one edition"
    lines = [intro, "", f"Every chapter is here executed, in {count}: {titles}. Each chapter page says where and "
             "when it ran, and how to run it yourself.", "", "## Chapters", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        chapter = row[1].strip("`")
        present = [e for e in editions if chapter in e.notebooks]
        if not present:
            continue
        links = " · ".join(f"[{e.title}]({e.key}/{chapter}.ipynb)" for e in present)
        lines.append(f"| {row[0]} | [`{chapter}`]({present[0].key}/{chapter}.ipynb) | {row[2]} | {links} |")
    lines.append("")
    for edition in editions:
        lines.append(_toctree(f"{edition.title} edition",
                              [f"{edition.key}/index", *(f"{edition.key}/{c}" for c in edition.notebooks)]))
    lines += [_toctree("Guides", guides), _toctree("Benchmarks", benchmarks)]
    return "\n".join(lines)


def edition_index(edition: Edition) -> str:
    """An edition's own page: where and when its notebooks ran, and each chapter's run time."""
    facts = edition.provenance
    lines = [f"# About the {edition.title} edition", "", f"Executed on {_when_where(edition)}.", ""]
    for key in ("gpu", "driver", "torch", "triton", "python", "course", "recorded"):
        if facts.get(key):
            lines.append(f"- **{key}**: {facts[key]}")
    if facts.get("how"):
        lines.append(f"- **how**: `{facts['how']}`")
    lines += ["", "| chapter | run time |", "|---|---:|"]
    lines += [f"| [{c}]({c}.ipynb) | {format_seconds(edition.seconds(c))} |" for c in edition.notebooks]
    return "\n".join(lines) + "\n"


def write_markdown(text: str, out: Path) -> None:
    """Write a page, making its folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


def run_locally_page(readme: str) -> str:
    """The "run it locally" guide: the README's quick start and its steps for students."""
    body = "\n".join(markdown_section(readme, h) for h in ("Quick start", "For students"))
    intro = ("Every chapter page links here. The course runs on any machine with Python 3.11 or newer: "
             "on a CPU at small sizes, on a GPU at full size.")
    return f"# Run the course locally\n\n{intro}\n\n{body}"


def benchmarks_index(records: dict[str, str], plots: list[str]) -> str:
    """The "Benchmarks" page: what the records are, their contents (page -> title) and their plots (paths)."""
    lines = ["# Benchmarks", "",
             "The course's kernels and runs measured on real GPUs, committed with the date, GPU, driver and "
             "versions of each run (`benchmarks/results/` in the repository; [the GPU run](../docs/gpu-run.md) "
             "says how they are made).",
             "", "```{toctree}", ":maxdepth: 1", ""]
    lines += [f"{title} ({posixpath.basename(page)}) <{page}>" for page, title in records.items()]
    lines += ["```", ""]
    lines += ["## Plots", ""] if plots else []
    for plot in plots:
        name = posixpath.basename(plot)
        lines += [f"`{name}`:", "", f"![Benchmark plot {posixpath.splitext(name)[0].replace('_', ' ')}]({plot})", ""]
    return "\n".join(lines)
