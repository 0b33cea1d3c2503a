"""The committed records of GPU runs, for the notebooks that say what happens on a GPU.

A figure measured on a GPU is not typed into prose: it is written by a run into a record under
``benchmarks/results/`` (JSON, with the date, the GPU, the driver and the versions), and the
notebook renders it from there with ``load_record``. ``Record.provenance`` is the line that says
which run it was. The records are plain files of the repository: reading one needs no GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RESULTS", "Record", "load_record"]

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
        versions = ", ".join(f"{k} {d[k]}" for k in ("torch", "triton", "driver") if k in d)
        return f"measured on an {d.get('gpu', d.get('device', 'unknown GPU'))} on {str(d.get('date', '?'))[:10]} " \
               f"({versions}; benchmarks/results/{self.name})"


def load_record(name: str) -> Record:
    """The record ``benchmarks/results/<name>`` (FileNotFoundError saying where it was looked for)."""
    path = RESULTS / name
    if not path.is_file():
        raise FileNotFoundError(f"no GPU record {name} in {RESULTS}: run the benchmark that writes it on a GPU")
    return Record(name, json.loads(path.read_text(encoding="utf-8")))
