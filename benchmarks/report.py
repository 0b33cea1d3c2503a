"""What a benchmark run found, and how it is written down: results, ratios, targets, JSON and markdown.

Nothing here measures or needs a GPU: ``benchmarks.cases`` fills ``Result`` objects, and this
module turns them into ``<slug>.json`` and ``<slug>.md``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["KNOWN_SLUGS", "RATIO_CONVENTION", "SCHEMA_VERSION", "Report", "Result", "Target", "TargetKind", "Unit", "gpu_slug"]

Unit = Literal["ms", "GB/s", "TFLOP/s"]
TargetKind = Literal["ratio", "time_factor", "copy_fraction"]

SCHEMA_VERSION = 1
RATIO_CONVENTION = (
    "ratio > 1 means ours is better: reference / ours for times (ms), ours / reference for rates (GB/s, TFLOP/s)"
)
# Device names as torch.cuda.get_device_name() reports them; any other name is slugged by `gpu_slug`.
KNOWN_SLUGS = {
    "NVIDIA H200": "h200",
    "NVIDIA H100 80GB HBM3": "h100",  # the SXM card; the PCIe one slugs to h100-pcie
    "NVIDIA A100-SXM4-80GB": "a100-sxm-80gb",
}


@dataclass(frozen=True)
class Target:
    """A goal for one result: ratio >= threshold, time <= threshold x reference, or GB/s >= threshold x copy."""

    kind: TargetKind
    threshold: float

    def describe(self) -> str:
        """The target as a short phrase for the table."""
        if self.kind == "ratio":
            return f"ratio >= {self.threshold:g}"
        if self.kind == "time_factor":
            return f"time <= {self.threshold:g} x reference"
        return f">= {self.threshold:g} x copy GB/s"

    def met(self, result: Result, copy_gbps: float | None) -> bool:
        """Whether ``result`` reaches this target; False when a value it needs is missing."""
        if result.error is not None or result.ours is None:
            return False
        if self.kind == "copy_fraction":
            if result.unit != "GB/s":
                raise ValueError(f"a copy-bandwidth target needs a GB/s result, {result.name} is in {result.unit}")
            return copy_gbps is not None and result.ours >= self.threshold * copy_gbps
        if result.reference is None:
            return False
        if self.kind == "time_factor":
            if result.unit != "ms":
                raise ValueError(f"a time target needs a result in ms, {result.name} is in {result.unit}")
            return result.ours <= self.threshold * result.reference
        ratio = result.ratio
        return ratio is not None and ratio >= self.threshold


@dataclass
class Result:
    """One row of the report: our kernel and PyTorch's reference measured on the same input."""

    name: str
    shape: list[int]
    dtype: str
    unit: Unit
    reference_name: str
    ours: float | None = None
    reference: float | None = None
    targets: list[Target] = field(default_factory=list)
    context: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        """Ours against the reference, > 1 when ours is better; None when either is missing."""
        if self.ours is None or self.reference is None or self.ours <= 0 or self.reference <= 0:
            return None
        return self.reference / self.ours if self.unit == "ms" else self.ours / self.reference

    def judge_against_fastest(self, measured: dict[str, float]) -> None:
        """Make the best of ``measured`` (label -> value in this row's unit) the reference; the others become context.

        The row's ratio and targets are then judged against the fastest thing PyTorch offers for the
        same work, not against whichever reference is most convenient.
        """
        if not measured:
            raise ValueError(f"{self.name}: none of its references could be measured")
        best = (min if self.unit == "ms" else max)(measured, key=measured.__getitem__)
        self.reference, self.reference_name = measured[best], best
        self.context.update({label: value for label, value in measured.items() if label != best})
        self.notes.append(f"reference: the fastest of {', '.join(measured)}, measured in the same run")

    def met(self, copy_gbps: float | None) -> bool | None:
        """Whether every target is met; None for a context row without targets."""
        if not self.targets:
            return None
        return all(target.met(self, copy_gbps) for target in self.targets)

    def line(self, copy_gbps: float | None) -> str:
        """One line of progress output for this row."""
        if self.error is not None:
            return f"{self.name}: error: {_one_line(self.error)}"
        ratio = "" if self.ratio is None else f", ratio {self.ratio:.2f}"
        verdict = {None: "", True: ", target met", False: ", target not met"}[self.met(copy_gbps)]
        return f"{self.name}: ours {_num(self.ours)}, reference {_num(self.reference)} {self.unit}{ratio}{verdict}"

    def to_dict(self, copy_gbps: float | None) -> dict[str, Any]:
        """The row as written to JSON, with its ratio and each target's verdict."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "unit": self.unit,
            "ours": self.ours,
            "reference": self.reference,
            "reference_name": self.reference_name,
            "ratio": self.ratio,
            "targets": [
                {
                    "kind": t.kind,
                    "threshold": t.threshold,
                    "description": t.describe(),
                    "met": t.met(self, copy_gbps),
                }
                for t in self.targets
            ],
            "met": self.met(copy_gbps),
            "context": dict(self.context),
            "notes": list(self.notes),
            "error": self.error,
        }


@dataclass
class Report:
    """A whole run: where it ran, the copy bandwidth measured alongside, and every result."""

    device: str
    torch_version: str
    triton_version: str
    date: str
    copy_gbps: float | None
    quick: bool = False
    results: list[Result] = field(default_factory=list)

    @property
    def slug(self) -> str:
        """The file stem for this device, with ``-quick`` for a smoke run."""
        return gpu_slug(self.device) + ("-quick" if self.quick else "")

    def summary(self) -> dict[str, int]:
        """How many rows have targets, how many of those met them, and how many rows failed."""
        verdicts = [r.met(self.copy_gbps) for r in self.results]
        return {
            "rows": len(self.results),
            "with_targets": sum(v is not None for v in verdicts),
            "met": sum(v is True for v in verdicts),
            "errors": sum(r.error is not None for r in self.results),
        }

    def to_dict(self) -> dict[str, Any]:
        """The report as written to ``<slug>.json``."""
        return {
            "schema_version": SCHEMA_VERSION,
            "device": self.device,
            "slug": self.slug,
            "torch": self.torch_version,
            "triton": self.triton_version,
            "date": self.date,
            "quick": self.quick,
            "copy_gbps": self.copy_gbps,
            "ratio_convention": RATIO_CONVENTION,
            "summary": self.summary(),
            "results": [r.to_dict(self.copy_gbps) for r in self.results],
        }

    def to_markdown(self) -> str:
        """The report as a readable table with a header and the notes and errors below it."""
        copy = "n/a" if self.copy_gbps is None else f"{self.copy_gbps:,.0f} GB/s"
        s = self.summary()
        lines = [
            f"# Benchmarks on {self.device}" + (" (quick smoke run, small shapes)" if self.quick else ""),
            "",
            f"- torch {self.torch_version}, triton {self.triton_version}, {self.date}",
            f"- device-to-device copy (bytes read + written, same run): {copy}",
            f"- {RATIO_CONVENTION}",
            f"- targets met: {s['met']} of {s['with_targets']}; rows with errors: {s['errors']}",
            "",
            "| case | shape | dtype | ours | reference | unit | ratio | target | met | context |",
            "|---|---|---|---:|---:|---|---:|---|---|---|",
        ]
        for r in self.results:
            verdict = r.met(self.copy_gbps)
            met = "error" if r.error is not None else {None: "", True: "met", False: "not met"}[verdict]
            context = "; ".join(f"{k} {_num(v)}" for k, v in r.context.items())
            reference = f"{_num(r.reference)} ({r.reference_name})" if r.reference_name else _num(r.reference)
            lines.append(
                f"| {r.name} | {'x'.join(map(str, r.shape))} | {r.dtype} | {_num(r.ours)} "
                f"| {_one_line(reference)} | {r.unit} "
                f"| {'' if r.ratio is None else f'{r.ratio:.2f}'} "
                f"| {', '.join(t.describe() for t in r.targets)} | {met} | {context} |"
            )
        rows_by_note: dict[str, list[str]] = {}
        for r in self.results:
            for note in r.notes:
                rows_by_note.setdefault(note, []).append(r.name)
        notes = [f"- {', '.join(names)}: {_one_line(note)}" for note, names in rows_by_note.items()]
        errors = [f"- {r.name}: {_one_line(r.error)}" for r in self.results if r.error is not None]
        for title, items in (("Notes", notes), ("Errors", errors)):
            if items:
                lines += ["", f"## {title}", "", *items]
        return "\n".join(lines) + "\n"

    def write(self, out_dir: Path) -> tuple[Path, Path]:
        """Write ``<slug>.json`` and ``<slug>.md`` into ``out_dir``; return both paths."""
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path, md_path = out_dir / f"{self.slug}.json", out_dir / f"{self.slug}.md"
        json_path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        md_path.write_text(self.to_markdown())
        return json_path, md_path


def gpu_slug(device_name: str) -> str:
    """A file-name stem for a GPU: ``KNOWN_SLUGS`` first, else the name lower-cased, minus "NVIDIA", dashed."""
    if device_name in KNOWN_SLUGS:
        return KNOWN_SLUGS[device_name]
    name = re.sub(r"^nvidia\s+", "", device_name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def _num(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _one_line(text: str) -> str:
    """``text`` on one line, safe inside a markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")
