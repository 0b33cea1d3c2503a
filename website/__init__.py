"""The course as a static website: every chapter in two editions (CPU and H200), built with Sphinx.

    python -m website build [--cpu-from DIR] [--chapters NN_a NN_b] [--h200-from DIR]
    python -m website record --executed DIR --edition h200 --machine "..."

``editions`` grafts executed outputs onto the released (solution-free) notebooks and keeps the
committed GPU record, ``pages`` writes the Sphinx source (landing page, guides, benchmark tables,
chapter banners), ``build`` runs the whole chain into ``build/site/`` (docs/website.md says how).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["BUILD", "ROOT"]

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "site"
