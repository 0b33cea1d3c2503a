"""LaTeX to MathML on the grading host, so that feedback shows maths offline, with nothing live in it.

``latex2mathml`` turns ``$...$`` into MathML, which browsers render natively. It copies some
input through as it is (``\\text{<script>}`` becomes a ``<script>`` element, ``\\href`` an
``href`` attribute), and the LaTeX comes from a submission's markdown, so its output is parsed
and rebuilt from an allow-list of MathML presentation elements and attributes; anything else
is dropped and its text kept as text. LaTeX it cannot convert is shown as escaped source.
"""

from __future__ import annotations

import html
import xml.etree.ElementTree as ET

__all__ = ["to_mathml"]

MATHML = "http://www.w3.org/1998/Math/MathML"
ELEMENTS = frozenset(
    [
        "math", "mrow", "mi", "mn", "mo", "mtext", "ms", "mspace", "mfrac", "msqrt", "mroot", "msub", "msup",
        "msubsup", "munder", "mover", "munderover", "mtable", "mtr", "mtd", "mstyle", "mpadded", "mphantom",
        "menclose", "mfenced", "merror"
    ]
)
ATTRIBUTES = frozenset(
    [
        "display", "mathvariant", "stretchy", "fence", "separator", "lspace", "rspace", "columnalign", "rowalign",
        "rowspacing", "columnspacing", "columnlines", "rowlines", "frame", "width", "height", "depth", "accent",
        "accentunder", "linethickness", "displaystyle", "scriptlevel", "minsize", "maxsize", "movablelimits", "form",
        "notation", "open", "close", "separators", "symmetric", "largeop"
    ]
)


def to_mathml(latex: str, display: bool) -> str:
    """``latex`` as safe MathML (block when ``display``), or as escaped ``$``-delimited text if it does not convert."""
    from latex2mathml.converter import convert

    fence = "$$" if display else "$"
    try:
        root = ET.fromstring(convert(latex, display="block" if display else "inline"))
    except Exception:  # noqa: BLE001 - unsupported LaTeX: show it as written
        return html.escape(f"{fence}{latex}{fence}", quote=False)
    return _rebuild(root)


def _rebuild(node: ET.Element) -> str:
    """One element, allowed parts only, serialised with every text and attribute value escaped."""
    tag = node.tag.rsplit("}", 1)[-1]
    inner = html.escape(node.text or "", quote=False)
    inner += "".join(_rebuild(child) + html.escape(child.tail or "", quote=False) for child in node)
    if tag not in ELEMENTS:
        return inner
    attrs = "".join(f' {k}="{html.escape(v, quote=True)}"' for k, v in sorted(node.attrib.items()) if k in ATTRIBUTES)
    if tag == "math":
        attrs = f' xmlns="{MATHML}"' + attrs
    return f"<{tag}{attrs}>{inner}</{tag}>"
