"""Sphinx configuration of the course site; ``website.build`` copies it into the generated source tree.

What changes per build (version, repository) comes from ``site.json`` beside it. Notebooks are
never executed here (``nb_execution_mode = "off"``): their outputs were grafted beforehand.
"""

from __future__ import annotations

import json
from pathlib import Path

SITE = json.loads((Path(__file__).parent / "site.json").read_text())

project = "Training at Speed"
author = "the Training at Speed authors"
copyright = f"{SITE['year']}, {author}"  # the name Sphinx reads
release = version = SITE["version"]

extensions = ["myst_nb", "website.mathml"]
html_math_renderer = "mathml"  # MathML written at build time: formulas show offline, no MathJax
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3
nb_execution_mode = "off"
nb_merge_streams = True
exclude_patterns = ["_build", "**.ipynb_checkpoints", "site.json"]
suppress_warnings = ["myst.header"]

html_theme = "sphinx_book_theme"
html_title = project
html_static_path = ["_static"]
html_css_files = ["site.css"]
html_js_files = ["site.js"]
html_copy_source = False
html_show_sourcelink = False
html_last_updated_fmt = None
html_theme_options = {
    "repository_url": SITE["repository"],
    "repository_branch": f"v{version}",
    "use_repository_button": True,
    "use_download_button": False,
    "use_fullscreen_button": False,
    "navigation_with_keys": True,
    "show_toc_level": 2,
}
