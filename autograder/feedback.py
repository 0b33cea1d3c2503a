"""Feedback that does not give the hidden tests away, and in which nothing a submission produced is live.

nbgrader's feedback page renders the graded notebook: the student's markdown cells (only
locked cells are put back from the gradebook) and the outputs the kernel sent while it ran.
Both are the submission's, so both are made inert before the page is written:

- ``InertOutputs`` keeps, of every output, plain text and PNG/JPEG images only: HTML, markdown,
  JavaScript, SVG, LaTeX and every other kind is shown as its text/plain form (or, where it has
  none, as its source text), and output metadata (image sizes, filenames) is dropped; raw cells
  become markdown cells; cell and notebook metadata other than nbgrader's is dropped;
- ``InertHTMLExporter`` renders markdown with its raw HTML escaped, links and images that are
  not http(s), mailto or plain image data replaced by ``#harmful-link``, and mermaid blocks as
  plain code.
"""

from __future__ import annotations

import html
import json
import re
from typing import Any

from jinja2 import pass_context
from nbconvert.exporters import HTMLExporter
from nbconvert.exporters.exporter import ResourcesDict
from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath
from nbconvert.preprocessors import Preprocessor
from nbformat import NotebookNode
from nbformat.v4 import new_markdown_cell, new_output
from nbgrader.preprocessors import ClearHiddenTests
from traitlets import Bool

from .course import is_test_cell
from .maths import to_mathml

__all__ = ["InertHTMLExporter", "InertOutputs", "RedactHiddenTests"]

# What the page may not load from elsewhere, and the style that makes long messages wrap.
_REMOTE_SCRIPT = re.compile(r"<script\b[^>]*\bsrc\s*=\s*[\"']?(?:https?:)?//[^>]*>\s*</script>", re.I)
_MATHJAX_CONFIG = re.compile(r"<script\b[^>]*type\s*=\s*[\"']text/x-mathjax-config[\"'][^>]*>.*?</script>", re.I | re.S)
WRAP_STYLE = """<style type="text/css">
  .output_area pre, .output_subarea pre, .jp-OutputArea-output pre { white-space: pre-wrap; overflow-wrap: anywhere; }
  .output_subarea, .jp-OutputArea-output { overflow-x: visible; }
</style>
"""

# The output data shown as they are: plain text, and images whose data is plain base64.
INERT_IMAGES = ("image/png", "image/jpeg")
_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]*")


class RedactHiddenTests(ClearHiddenTests):
    """In each test cell, drop the hidden-test region and cut error tracebacks to their last line.

    nbgrader's feedback shows the test cells as they ran, hidden tests included, and an
    IPython traceback quotes the failing line of the test. The student keeps the score and
    the error message (which says what was wrong) and loses neither.
    """

    def preprocess_cell(
        self, cell: NotebookNode, resources: ResourcesDict, cell_index: int
    ) -> tuple[NotebookNode, ResourcesDict]:
        """Redact one cell when it is a test cell; leave every other cell as it is."""
        if not is_test_cell(cell):
            return cell, resources
        self._remove_hidden_test_region(cell)
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                output.traceback = [f"{output.ename}: {output.evalue}"]
        return cell, resources


class InertOutputs(Preprocessor):
    """Rebuild the notebook from what renders as text: plain outputs and images, nbgrader metadata, markdown."""

    enabled = Bool(True, help="make the submission's content inert (leave it on: the feedback shows untrusted content)")

    def preprocess(self, nb: NotebookNode, resources: ResourcesDict) -> tuple[NotebookNode, ResourcesDict]:
        """Replace every cell by its inert copy, and the notebook's metadata by a plain Python language_info."""
        nb.cells = [_inert_cell(cell) for cell in nb.cells]
        nb.metadata = NotebookNode({"language_info": NotebookNode({"name": "python"})})
        return nb, resources


def _inert_cell(cell: NotebookNode) -> NotebookNode:
    """``cell`` made to render as text: code with inert outputs, or a markdown cell (a raw cell becomes one)."""
    meta = NotebookNode()
    if isinstance(cell.get("metadata", {}).get("nbgrader"), dict):
        meta.nbgrader = NotebookNode(cell.metadata.nbgrader)
        if "grade_id" in meta.nbgrader:  # the page shows it in tags: an id a student made up stays text
            meta.nbgrader.grade_id = html.escape(_text(meta.nbgrader.grade_id))
    if cell.get("cell_type") != "code":
        inert = new_markdown_cell(_text(cell.get("source", "")), metadata=meta)
        if cell.get("cell_type") == "markdown" and isinstance(cell.get("attachments"), dict):
            inert.attachments = cell.attachments
        return inert
    cell.metadata = meta
    cell.source = _text(cell.get("source", ""))
    cell.execution_count = _count(cell.get("execution_count"))
    cell.outputs = [o for o in map(_inert_output, cell.get("outputs", [])) if o is not None]
    return cell


def _inert_output(output: Any) -> NotebookNode | None:
    """The inert copy of one output, or None for a kind nbformat does not know."""
    kind = output.get("output_type") if isinstance(output, dict) else None
    if kind == "stream":
        return new_output("stream", name="stderr" if output.get("name") == "stderr" else "stdout",
                          text=_text(output.get("text", "")))
    if kind == "error":
        traceback = output.get("traceback", [])
        return new_output("error", ename=_text(output.get("ename", "")), evalue=_text(output.get("evalue", "")),
                          traceback=[_text(line) for line in traceback] if isinstance(traceback, list) else [])
    if kind in ("display_data", "execute_result"):
        data = output.get("data", {})
        inert = new_output(kind, data=_inert_data(data if isinstance(data, dict) else {}))
        if kind == "execute_result":
            inert.execution_count = _count(output.get("execution_count"))
        return inert
    return None


def _inert_data(data: dict) -> dict[str, str]:
    """An output's data reduced to PNG/JPEG images with plain base64 data, and text/plain for everything else."""
    inert = {m: v for m, v in data.items() if m in INERT_IMAGES and isinstance(v, str) and _BASE64.fullmatch(v)}
    others = [m for m in data if m not in inert and m != "text/plain"]
    if "text/plain" in data:
        inert["text/plain"] = _text(data["text/plain"])
    elif others or not inert:
        inert["text/plain"] = _text(data[others[0]]) if others else ""
    return inert


def _text(value: Any) -> str:
    """Text as nbformat may store it: a string, a list of lines, or JSON data (shown as JSON)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "".join(value)
    return json.dumps(value, default=str)


def _count(value: Any) -> int | None:
    """An execution count: an int, else none."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _InertRenderer(IPythonRenderer):
    """nbconvert's markdown renderer with raw HTML escaped, mermaid blocks as plain code and maths as MathML."""

    def block_mermaidjs(self, code: str) -> str:
        """A mermaid block, as a plain code block (mermaid's own rendering runs script)."""
        return super().block_code(code)

    def block_math(self, body: str) -> str:
        """Display maths, rendered here as MathML (the page loads no MathJax)."""
        return to_mathml(body, display=True)

    def inline_math(self, body: str) -> str:
        """Inline maths, rendered here as MathML."""
        return to_mathml(body, display=False)

    def latex_environment(self, name: str, body: str) -> str:
        """A ``\\begin{name}...\\end{name}`` block, as display maths."""
        return to_mathml(f"\\begin{{{name}}}{body}\\end{{{name}}}", display=True)


class InertHTMLExporter(HTMLExporter):
    """nbconvert's HTML exporter with ``_InertRenderer`` (no raw HTML, no harmful links), on a page that fetches nothing.

    The page is nbgrader's feedback template less its scripts from a CDN (require.js, MathJax:
    maths is MathML rendered here), with output text that wraps instead of scrolling sideways.
    Every ``<script src=...>`` left in the page comes from the template: the submission's own
    content is escaped text by then.
    """

    # The page is a str, as in nbconvert's own HTMLExporter, which overrides the base Exporter's NotebookNode the same way.
    def from_notebook_node(  # type: ignore[override]
        self, nb: NotebookNode, resources: Any = None, **kw: Any
    ) -> tuple[str, ResourcesDict]:
        """The page, with remote scripts and MathJax's configuration removed and the wrapping style added."""
        body, resources = super().from_notebook_node(nb, resources, **kw)
        body = _REMOTE_SCRIPT.sub("", body)
        body = _MATHJAX_CONFIG.sub("", body)
        return body.replace("</head>", WRAP_STYLE + "</head>", 1), resources

    @pass_context
    def markdown2html(self, context: Any, source: str) -> str:
        """Markdown to HTML, with raw HTML escaped and links of harmful protocols (``javascript:``...) dropped."""
        cell = context.get("cell", {})
        renderer = _InertRenderer(
            escape=True, allow_harmful_protocols=False, attachments=cell.get("attachments", {}),
            anchor_link_text=self.anchor_link_text, exclude_anchor_links=self.exclude_anchor_links,
            **self.lexer_options,
        )
        return MarkdownWithMath(renderer=renderer).render(source)
