"""The committed records of GPU runs, for the notebooks that say what happens on a GPU.

A figure measured on a GPU is not typed into prose: it is written by a run into a record under
``benchmarks/results/`` (JSON, with the date, the GPU, the driver and the versions), and the
notebook renders it from there with ``load_record``. ``Record.provenance`` is the line that says
which run it was. The records are plain files of the repository: reading one needs no GPU.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RESULTS", "Record", "load_record", "suite_rows"]

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@dataclass(frozen=True)
class Record:
    """One committed record: its file name and its content."""

    name: str
    data: dict[str, Any]

    def section(self, name: str) -> dict[str, Any]:
        """One section of the record (KeyError naming the sections there are)."""
        sections = self.data.get("sections", {})
        if name not in sections:
            raise KeyError(f"{self.name} has no section {name!r} (it has: {', '.join(sections) or 'none'})")
        return sections[name]

    @property
    def provenance(self) -> str:
        """Which run this is: GPU, date, driver and versions, and the file."""
        d = self.data
        versions = ", ".join(f"{k} {d[k]}" for k in ("torch", "triton", "nccl", "driver") if k in d)
        gpu = d.get("gpu") or " + ".join(d.get("gpus", [])) or d.get("device") or "unknown GPU"
        return f"measured on {gpu} on {str(d.get('date', '?'))[:10]} " \
               f"({versions}; benchmarks/results/{self.name})"


def load_record(name: str) -> Record:
    """The record ``benchmarks/results/<name>`` (FileNotFoundError saying where it was looked for)."""
    path = RESULTS / name
    if not path.is_file():
        raise FileNotFoundError(f"no GPU record {name} in {RESULTS}: run the benchmark that writes it on a GPU")
    return Record(name, json.loads(path.read_text(encoding="utf-8")))


def suite_rows(record: Record, names: Sequence[str]) -> list[str]:
    """Lines showing the rows ``names`` of a benchmark-suite record (``python -m benchmarks``): every rate of a row, in its unit.

    Each row lists the course's kernel, the row's reference and its context measurements, with the
    ratio of the first two as the suite defines it (``ratio_convention``); a rate in
    GB/s is also shown as a share of the device-to-device copy rate measured in the same run.
    """
    missing = set(names) - {row["name"] for row in record.data["results"]}
    if missing:
        raise KeyError(f"{record.name} has no row {', '.join(sorted(missing))}")
    copy_gbps = record.data.get("copy_gbps")
    lines = []
    for row in record.data["results"]:
        if row["name"] not in names:
            continue
        ratio = "" if row["ratio"] is None else f" (ratio {row['ratio']:.2f}: above 1 when course_lib is ahead)"
        lines.append(f"{row['name']}, {' x '.join(map(str, row['shape']))} {row['dtype']}{ratio}:")
        rates = {"course_lib": row["ours"], row["reference_name"]: row["reference"], **row["context"]}
        for label, value in rates.items():
            share = f"  {value / copy_gbps:4.0%} of copy" if row["unit"] == "GB/s" and copy_gbps else ""
            digits = 2 if row["unit"] == "ms" else 1
            lines.append(f"  {label:48s} {value:9,.{digits}f} {row['unit']}{share}")
    return lines
