"""A GPU figure quoted in a chapter's prose is one that a committed record holds, a datasheet gives, or a named source reports.

Notebooks render GPU measurements from the records under ``benchmarks/results`` (``course_lib.support.records``).
Typed prose is checked here: in each markdown cell of ``solutions/``, a sentence that speaks of a GPU
(H100, H200, A100, NVLink, NCCL, CUDA, "GPU") and quotes a time or a rate (ms, us, GB/s, TB/s,
TFLOP/s) must quote a value that some record holds in that unit (to the digits shown), or a
datasheet figure of ``course_lib``'s GPU specs or of the links the chapters compare (NVLink,
PCIe, InfiniBand); a sentence that names its source ("et al.", a year
in parentheses, a whitepaper, a paper, a textbook, a blog post) may quote that source's figures.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from course_lib.orientation import H100_SXM, H200_SXM
from course_lib.profiling import A100_SXM

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p.name for p in (ROOT / "solutions").iterdir() if (p / f"{p.name}.ipynb").is_file())
FIGURE = re.compile(r"(?<![\w.^/])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)\s*(GB/s|TB/s|TFLOP/s|GFLOP/s|ms|µs|us)(?![\w/])")
GPU_CONTEXT = re.compile(r"H100|H200|A100|V100|\bGPUs?\b|CUDA|NVLink|NCCL")
SOURCED = re.compile(r"et al\.|\((?:[^()]*\s)?(?:19|20)\d\d\)|whitepaper|blog post|textbook|paper")
# How a record's number in one unit reads in another: seconds or milliseconds as ms or us, bytes/s or GB/s as GB/s or TB/s...
SCALES = {"ms": (1e3, 1.0, 1e-3), "µs": (1e6, 1e3, 1.0), "us": (1e6, 1e3, 1.0),
          "GB/s": (1e-9, 1.0, 1e3), "TB/s": (1e-12, 1e-3), "TFLOP/s": (1e-12, 1.0), "GFLOP/s": (1e-9, 1e3)}


def _numbers(value: object) -> Iterator[float]:
    """Every positive finite number in a JSON tree."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        if math.isfinite(value) and value > 0:
            yield float(value)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)


def _known_values() -> list[float]:
    values = [v for path in sorted((ROOT / "benchmarks" / "results").glob("*.json"))
              for v in _numbers(json.loads(path.read_text()))]
    for spec in (H100_SXM, H200_SXM, A100_SXM):
        values += [spec.hbm_bytes_per_s, spec.bf16_dense_flops, spec.fp32_flops]
    # Link datasheets, bytes/s: NVLink 4 (H100/H200) 450 per direction, 900 both; NVLink 3 (A100) 300 per
    # direction; PCIe Gen5 x16 64; InfiniBand NDR 400 Gb/s = 50, HDR 200 Gb/s = 25.
    return values + [450e9, 900e9, 300e9, 64e9, 50e9, 25e9]


KNOWN = _known_values()


def is_held(text: str, unit: str) -> bool:
    """Whether the figure ``text`` (as written: "4,224", "2.17") in ``unit`` is a known value to the digits shown."""
    number = float(text.replace(",", ""))
    shown = len(text.split(".")[1]) if "." in text else 0
    tolerance = 0.5 * 10**-shown * (1 + 1e-9)
    return any(abs(v * scale - number) <= tolerance for v in KNOWN for scale in SCALES[unit])


def unheld_figures(markdown: str) -> list[str]:
    """The GPU figures of one markdown cell that no record, datasheet or named source backs."""
    found = []
    for sentence in re.split(r"(?<=[.;:])\s+|\n\n|\n- |\|", markdown):
        if GPU_CONTEXT.search(sentence) and not SOURCED.search(sentence):
            found += [m.group(0) for m in FIGURE.finditer(sentence) if not is_held(m.group(1), m.group(2))]
    return found


def test_the_checker_tells_record_figures_from_typed_ones() -> None:
    assert unheld_figures("On an H200 the copy reached 123,457 GB/s.") == ["123,457 GB/s"], "no record holds it"
    record = json.loads((ROOT / "benchmarks" / "results" / "figures_h200.json").read_text())
    fused_ms = record["sections"]["adam"]["ms_per_step"]["fused"]
    assert unheld_figures(f"On an H200 the fused step took {fused_ms:.2f} ms.") == []
    assert unheld_figures("The H200 paper (2024) reports 9.9 TB/s.") == [], "a named source"
    assert unheld_figures("An H200 streams 4.8 TB/s.") == [], "a datasheet figure of course_lib's specs"
    assert unheld_figures("On a CPU the loop took 12.3 ms.") == [], "not about a GPU"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_gpu_figures_in_prose_come_from_records(chapter: str) -> None:
    notebook = json.loads((ROOT / "solutions" / chapter / f"{chapter}.ipynb").read_text())
    problems = []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] == "markdown":
            problems += [f"cell {index}: {figure}" for figure in unheld_figures("".join(cell["source"]))]
    assert not problems, (f"{chapter} quotes GPU figures that no committed record holds: {problems}; render them "
                          "from benchmarks/results with course_lib.support.records, or name their source")
