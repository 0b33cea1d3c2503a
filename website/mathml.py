"""A Sphinx math renderer that writes MathML at build time, so the site shows formulas offline, without MathJax.

The LaTeX goes through ``autograder.maths.to_mathml`` (latex2mathml, then rebuilt from an allow-list of
MathML elements); what it cannot convert stays on the page as its LaTeX source. Browsers render
MathML natively (Chromium since version 109, Firefox, Safari).
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from sphinx.application import Sphinx

from autograder.maths import to_mathml

__all__ = ["setup"]


def _inline(translator: Any, node: nodes.Element) -> None:
    translator.body.append(f'<span class="math">{to_mathml(node.astext(), display=False)}</span>')
    raise nodes.SkipNode


def _block(translator: Any, node: nodes.Element) -> None:
    translator.body.append(f'<div class="math-block">{to_mathml(node.astext(), display=True)}</div>\n')
    raise nodes.SkipNode


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the ``mathml`` renderer (``html_math_renderer = "mathml"`` selects it)."""
    app.add_html_math_renderer("mathml", (_inline, None), (_block, None))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
