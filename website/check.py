"""Checks of a built site: what a reader would trip over, and the guarantee that no solution shows.

``check_site`` reads every HTML page of the site (Sphinx's ``_static`` and ``_sources`` aside): each
internal ``href``/``src`` must resolve to a file (and an ``#anchor`` to an id of that page), no
script or stylesheet may come from another site (the pages work offline: formulas are MathML), each
image must exist, be non-empty and have alt text, each chapter page of each edition must exist with
at least one cell output, no output may be an error (a traceback) and no page may carry an error
message of the build. ``leaks`` collects the lines of every solution body and hidden test that the
released notebooks do not give away anyway, and searches every file of the site for them.

    python -m website check [HTML] [--chapters NN_a ...] [--editions cpu h200]
"""

from __future__ import annotations

import argparse
import json
import keyword
import re
from collections.abc import Iterable, Iterator
from functools import cache
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat

from website import BUILD, ROOT

__all__ = ["check_site", "find_lines", "leaks", "main", "secret_lines", "site_text"]

SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")
LINK_ATTRS = {"href": {"a", "link", "area"}, "src": {"script", "iframe", "source", "audio", "video", "embed"}}
"""Attributes that must resolve, by the tags they are checked on (``<img>`` has its own check)."""
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|^\s*[A-Z]\w*(?:Error|Exception): ", re.MULTILINE)
OUTPUT_ERROR_CLASSES = {"traceback", "error"}
LOADED_RELS = {"stylesheet", "preload", "modulepreload", "icon"}
"""``<link rel>`` values whose target the browser fetches with the page: like a script, it must be on the site."""
SPHINX_ERROR_CLASSES = {"system-message", "problematic"}
BINARY = {".png", ".jpg", ".jpeg", ".gif", ".ico", ".webp", ".woff", ".woff2", ".ttf", ".eot", ".otf", ".pdf",
          ".inv", ".zip", ".gz", ".pickle", ".doctree"}
JSON_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
MARKERS = {"solution": ("### BEGIN SOLUTION", "### END SOLUTION"),
           "hidden test": ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")}
MIN_CHARS = 12
TOKEN = re.compile(r"[A-Za-z_]\w*|\d[\w.]*")
"""Trivial solution lines are not searched for: shorter than MIN_CHARS (whitespace collapsed), or with fewer
than two distinct names or numbers besides keywords (``return out``, ``else:``, ``options = {}``). A leaked
body still shows through its other lines."""
PLAIN_WORDS = set(keyword.kwlist) | {"self", "print", "range", "len"}


class _Page(HTMLParser):
    """What one HTML file holds: ids, links, images, cell outputs, error text, and its text by line."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[int, str, str]] = []  # (line, what loads it: a tag, or "load" for a script or stylesheet, url)
        self.images: list[tuple[int, str, str]] = []  # (line, src, alt)
        self.outputs = 0
        self.errors: list[tuple[int, str]] = []  # (line, what)
        self.text: dict[int, list[str]] = {}
        self.attributes: list[tuple[int, str]] = []
        self._open: list[tuple[str, bool]] = []  # open elements: (tag, is a cell output)
        self._output: list[str] = []  # the text of the cell output being read
        self._output_line = 0

    def _add_text(self, line: int, text: str) -> None:
        for k, part in enumerate(text.split("\n")):
            self.text.setdefault(line + k, []).append(part)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        line = self.getpos()[0]
        values = {name: value or "" for name, value in attrs}
        classes = set(values.get("class", "").split())
        for name, value in values.items():
            if name == "id" or (name == "name" and tag == "a"):
                self.ids.add(value)
            if tag in LINK_ATTRS.get(name, ()):
                loads = tag == "script" or (tag == "link" and set(values.get("rel", "").split()) & LOADED_RELS)
                self.links.append((line, "load" if loads else tag, value))
            if name not in ("class", "style") and value:
                self.attributes.append((line, value))
        if tag == "img":
            self.images.append((line, values.get("src", ""), values.get("alt", "")))
        if classes & SPHINX_ERROR_CLASSES:
            self.errors.append((line, "the build left an error message on the page"))
        in_output = any(flag for _, flag in self._open)
        if in_output and classes & OUTPUT_ERROR_CLASSES:
            self.errors.append((line, "an output shows an error"))
        if "cell_output" in classes and not in_output:
            self.outputs += 1
            self._output, self._output_line = [], line
        if tag not in VOID:
            self._open.append((tag, "cell_output" in classes))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] == tag:
                closed = self._open[i:]
                del self._open[i:]
                if any(flag for _, flag in closed) and not any(flag for _, flag in self._open):
                    self._end_output()
                break

    def _end_output(self) -> None:
        if TRACEBACK.search("".join(self._output)):
            self.errors.append((self._output_line, "an output shows a traceback"))
        self._output = []

    def handle_data(self, data: str) -> None:
        self._add_text(self.getpos()[0], data)
        if any(flag for _, flag in self._open):
            self._output.append(data)


@cache
def _parse(path: Path) -> _Page:
    """The parsed HTML file (cached: a page is read once however many pages link to it)."""
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    page.close()
    return page


def _resolve(html: Path, page: Path, url: str) -> tuple[Path | None, str]:
    """The file an internal URL of ``page`` points at (None when it leaves the site) and its anchor."""
    parts = urlsplit(url)
    target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
    if not target.is_relative_to(html):
        return None, parts.fragment
    if target.is_dir():
        target = target / "index.html"
    return target, unquote(parts.fragment)


def _link_problems(html: Path, path: Path, page: _Page) -> Iterator[str]:
    """Broken internal links and anchors of one page, and scripts or stylesheets it would fetch from elsewhere."""
    name = path.relative_to(html)
    for line, what, url in page.links:
        if what == "load" and SCHEME.match(url) and not url.startswith("data:"):
            yield f"{name}:{line}: loads {url!r} from another site (the site must work offline)"
        if not url or url == "#" or SCHEME.match(url):
            continue
        target, anchor = _resolve(html, path, url)
        if target is None:
            yield f"{name}:{line}: link {url!r} leaves the site"
        elif not target.is_file():
            yield f"{name}:{line}: broken link {url!r} (no {target.relative_to(html)})"
        elif anchor and target.suffix == ".html" and anchor not in _parse(target).ids:
            yield f"{name}:{line}: link {url!r}: {target.relative_to(html)} has no id {anchor!r}"


def _image_problems(html: Path, path: Path, page: _Page) -> Iterator[str]:
    """Images of one page that are missing, empty or without alt text."""
    name = path.relative_to(html)
    for line, src, alt in page.images:
        if not alt.strip():
            yield f"{name}:{line}: image {src[:80]!r} has no alt text"
        if src.startswith("data:"):
            if not src.partition(",")[2].strip():
                yield f"{name}:{line}: image {src[:40]!r} is empty"
            continue
        if not src:
            yield f"{name}:{line}: image without src"
            continue
        if SCHEME.match(src):
            continue
        target, _ = _resolve(html, path, src)
        if target is None or not target.is_file():
            yield f"{name}:{line}: missing image {src!r}"
        elif target.stat().st_size == 0:
            yield f"{name}:{line}: empty image {src!r}"


def _pages(html: Path) -> list[Path]:
    """The site's HTML pages: Sphinx's own folders (``_static``: theme templates, ``_sources``) left out."""
    return sorted(p for p in html.rglob("*.html") if not p.relative_to(html).parts[0].startswith("_"))


def check_site(html: Path, chapters: list[str], editions: list[str]) -> list[str]:
    """Problems of the built site in ``html`` (empty when fine): links, images, alt text, outputs, errors."""
    html = html.resolve()
    _parse.cache_clear()
    problems: list[str] = []
    for path in _pages(html):
        page = _parse(path)
        problems += _link_problems(html, path, page)
        problems += _image_problems(html, path, page)
        problems += [f"{path.relative_to(html)}:{line}: {what}" for line, what in dict.fromkeys(page.errors)]
    for edition in editions:
        for chapter in chapters:
            path = html / edition / f"{chapter}.html"
            if not path.is_file():
                problems.append(f"{edition}/{chapter}.html: the chapter page is missing")
            elif _parse(path).outputs == 0:
                problems.append(f"{edition}/{chapter}.html: the chapter page shows no cell output")
    return problems


def _normal(line: str) -> str:
    """A line with its whitespace collapsed, as it is compared."""
    return " ".join(line.split())


def _telling(line: str) -> bool:
    """Whether a (normalised) line is specific enough to be searched for: long enough, two names or numbers."""
    return len(line) >= MIN_CHARS and len(set(TOKEN.findall(line)) - PLAIN_WORDS) >= 2


def _marked(source: str) -> Iterator[tuple[str, str]]:
    """(kind, line) for every line between nbgrader's solution or hidden-test markers in a cell's source."""
    inside: str | None = None
    for line in source.splitlines():
        begins = [kind for kind, (begin, _) in MARKERS.items() if begin in line]
        if begins:
            inside = begins[0]
        elif inside and MARKERS[inside][1] in line:
            inside = None
        elif inside:
            yield inside, line


def _notebooks(folder: Path) -> list[Path]:
    """The notebooks under ``folder``, checkpoints left out."""
    return sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def _found_in(text: str, by_key: dict[str, list[str]]) -> Iterator[str]:
    """The needles inside ``text``, looked up by their first MIN_CHARS characters."""
    grams = {text[i:i + MIN_CHARS] for i in range(len(text) - MIN_CHARS + 1)}
    for key in grams & by_key.keys():
        yield from (needle for needle in by_key[key] if needle in text)


def find_lines(needles: dict[str, str], lines: Iterable[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """(line number, needle) for every needle (a normalised line) found in the numbered ``lines``.

    A needle cut in two by a line break (prose reflowed over two lines) is found too, at its first
    line; a blank line stops that.
    """
    by_key: dict[str, list[str]] = {}
    for needle in needles:
        by_key.setdefault(needle[:MIN_CHARS], []).append(needle)
    longest = max(map(len, needles), default=0)
    before, before_number = "", 0
    for number, raw in lines:
        text = _normal(raw)
        yield from ((number, needle) for needle in _found_in(text, by_key))
        if before and text:
            seam = f"{before[-longest:]} {text[:longest]}"
            yield from ((before_number, needle) for needle in _found_in(seam, by_key)
                        if needle not in before and needle not in text)
        before, before_number = text, number


def secret_lines(solutions: Path, released: Path) -> dict[str, str]:
    """Solution-body and hidden-test lines worth searching for (normalised), each with where it comes from.

    A line is left out when it is too short or generic (see ``TOKEN``) or when a cell of a released
    notebook holds it: the student is given it anyway.
    """
    secrets: dict[str, str] = {}
    for path in _notebooks(solutions):
        for cell in nbformat.read(path, as_version=4).cells:
            for kind, line in _marked(cell.source):
                text = _normal(line)
                if _telling(text):
                    secrets.setdefault(text, f"{kind} in {path.relative_to(solutions)}")
    given: set[str] = set()
    for path in _notebooks(released):
        # Whole cells (markdown reflows a sentence over lines), as written and as rendered: `code` marks gone.
        sources = [cell.source for cell in nbformat.read(path, as_version=4).cells]
        numbered = ((0, text) for source in sources for text in (source, "", source.replace("`", ""), ""))
        given.update(needle for _, needle in find_lines(secrets, numbered))
    return {line: origin for line, origin in secrets.items() if line not in given}


def site_text(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a site file as a reader or a search would see it.

    HTML: its text without tags, entities decoded, and its attribute values; JSON and JavaScript
    (a search index, a notebook): the lines and each string literal decoded; other text files: their
    lines; binary files: nothing.
    """
    if path.suffix.lower() in BINARY:
        return
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return
    if path.suffix.lower() in (".html", ".htm"):
        page = _Page()
        page.feed(raw)
        page.close()
        yield from ((number, "".join(parts)) for number, parts in sorted(page.text.items()))
        yield from page.attributes
        return
    yield from enumerate(raw.splitlines(), start=1)
    if path.suffix.lower() in (".js", ".json", ".ipynb"):
        for match in JSON_STRING.finditer(raw):
            try:
                decoded = json.loads(match.group(0))
            except ValueError:
                continue
            number = raw.count("\n", 0, match.start()) + 1
            yield from ((number, part) for part in decoded.splitlines())


def leaks(site: Path, solutions: Path, released: Path) -> list[str]:
    """Every place in the files under ``site`` that shows a solution-body or hidden-test line: "file:line: ..."."""
    secrets = secret_lines(solutions, released)
    found = []
    for path in sorted(p for p in site.rglob("*") if p.is_file()):
        for number, line in dict.fromkeys(find_lines(secrets, site_text(path))):
            found.append(f"{path.relative_to(site)}:{number}: shows a {secrets[line]}: {line!r}")
    return found


def _editions_in(html: Path) -> list[str]:
    """The folders of ``html`` that hold chapter pages (``NN_name.html``)."""
    return sorted(d.name for d in html.iterdir() if d.is_dir() and any(d.glob("[0-9][0-9]_*.html")))


def main(argv: list[str] | None = None) -> int:
    """``python -m website check``: both checks on a built site; 1 when there are problems."""
    parser = argparse.ArgumentParser(prog="python -m website check",
                                     description="Check a built site: links, images, outputs, leaks.")
    parser.add_argument("html", nargs="?", type=Path, default=BUILD / "html", help="the built site (build/site/html)")
    parser.add_argument("--chapters", nargs="+", help="chapters expected (default: every released chapter)")
    parser.add_argument("--editions", nargs="+", help="editions expected (default: cpu, h200 and any the site has)")
    args = parser.parse_args(argv)
    if not (args.html / "index.html").is_file():
        print(f"{args.html}: no site there; run `make site` first")
        return 1
    chapters = args.chapters or sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*") if p.is_dir())
    editions = args.editions or sorted({"cpu", "h200", *_editions_in(args.html)})
    problems = check_site(args.html, chapters, editions)
    problems += leaks(args.html, ROOT / "solutions", ROOT / "notebooks")
    for problem in problems:
        print(problem)
    print(f"{args.html}: {len(problems)} problem(s) in {len(chapters)} chapters x {len(editions)} editions")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
