"""The two editions of every chapter page, and the graft that keeps solutions off the site.

A chapter page is the *released* notebook (no solution bodies, no hidden tests). ``graft`` gives
each of its code cells the outputs of the executed notebook's cell with the same id, but only
when the two sources are identical and neither cell is an nbgrader exercise or test cell: what
an exercise or a hidden test printed never reaches the page. The CPU edition grafts the solution
notebooks that the build itself executes; the H200 edition is a committed record
(``website/editions/h200/``: grafted notebooks and ``provenance.json``) that ``record`` writes
from a GPU run of ``python -m benchmarks.notebooks``.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import nbformat
from nbformat import NotebookNode

from website import ROOT

__all__ = [
    "EDITIONS_DIR", "Edition", "cpu_edition", "graft", "is_graded", "load_edition", "record", "released_notebook", "run_facts",
]

EDITIONS_DIR = ROOT / "website" / "editions"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
PROVENANCE = "provenance.json"


@dataclass
class Edition:
    """One edition of the course: its key (``cpu``), its title (``CPU``), its notebooks and where they ran."""

    key: str
    title: str
    notebooks: dict[str, Path] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    def seconds(self, chapter: str) -> float | None:
        """The chapter's measured run time in this edition (None when not recorded)."""
        return self.provenance.get("seconds", {}).get(chapter)


def released_notebook(chapter: str) -> Path:
    """The student notebook of ``chapter`` (e.g. ``01_floating_point``)."""
    return ROOT / "notebooks" / chapter / f"{chapter}.ipynb"


def is_graded(cell: NotebookNode) -> bool:
    """Whether nbgrader marks the cell as an exercise (solution) or a test (grade) cell."""
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return bool(meta.get("solution") or meta.get("grade"))


def _shown_outputs(outputs: list[NotebookNode]) -> list[NotebookNode]:
    """The outputs a static page can show: widget views (live progress bars) dropped, no execution counts."""
    shown = []
    for out in outputs:
        if WIDGET_MIME in out.get("data", {}):
            continue
        out = copy.deepcopy(out)
        if out.get("output_type") == "execute_result":
            out["execution_count"] = None
        shown.append(out)
    return shown


def graft(released: NotebookNode, executed: NotebookNode) -> NotebookNode:
    """The released notebook with the executed notebook's outputs on its identical, ungraded code cells."""
    ran = {cell.get("id"): cell for cell in executed.cells if cell.cell_type == "code"}
    page = copy.deepcopy(released)
    page.metadata.pop("widgets", None)
    for cell in page.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs, cell.execution_count = [], None
        twin = ran.get(cell.get("id"))
        if twin is None or is_graded(cell) or is_graded(twin) or twin.source != cell.source:
            continue
        cell.outputs = _shown_outputs(twin.get("outputs", []))
    return page


def _version(package: str) -> str:
    """An installed package's version, or "not installed"."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def run_facts(times: dict[str, Any]) -> dict[str, Any]:
    """Where and when a ``benchmarks.notebooks`` run happened, from its ``times.json``.

    The GPU, driver and versions are those the run recorded where it ran; a ``times.json`` older
    than that record gets this machine's, which is right only when it ran here (the CPU edition).
    """
    machine = times.get("versions")
    if machine is None:
        from benchmarks.provenance import machine_facts

        machine = machine_facts()
    return {
        "date": times.get("date"),
        "device": times.get("device"),
        **{key: machine.get(key, "unknown") for key in ("gpu", "driver", "torch", "cuda", "triton", "python")},
        "course": _version("training-at-speed"),
        "seconds": {row["chapter"]: row["seconds"] for row in times.get("notebooks", [])},
        "total_seconds": times.get("total_seconds"),
    }


def _read_times(executed: Path) -> dict[str, Any]:
    """The ``times.json`` of an executed run; fails when it is missing, the run stopped early, or a shown cell raised.

    An error in an exercise or test cell (a timing check that flaked on a busy machine, say) is
    only reported: those cells are shown without outputs.
    """
    path = executed / "times.json"
    if not path.is_file():
        raise SystemExit(f"{path} not found: run `python -m benchmarks.notebooks --out {executed}` first")
    times: dict[str, Any] = json.loads(path.read_text())
    if times.get("interrupted_in"):
        raise SystemExit(f"{executed}: the run stopped in {times['interrupted_in']}; run it again")
    shown: list[str] = []
    hidden: list[str] = []
    for row in times.get("notebooks", []):
        shown += [f"{row['chapter']}: {e}" for e in row["errors"] if e.startswith("notebook stopped")]
        if row["errors"]:
            nb = nbformat.read(executed / f"{row['chapter']}.ipynb", as_version=4)
            for cell in nb.cells:
                for out in cell.get("outputs", []):
                    if out.get("output_type") == "error":
                        where = hidden if is_graded(cell) else shown
                        where.append(f"{row['chapter']}, cell {cell.get('id')}: {out.get('ename')}")
    if hidden:
        print("note: exercise or test cells raised (not shown on the site):\n  " + "\n  ".join(hidden))
    if shown:
        raise SystemExit(f"{executed}: cells that the site shows raised:\n  " + "\n  ".join(shown))
    return times


def _merged_times(runs: list[Path]) -> dict[str, Any]:
    """One ``times.json`` for runs made side by side on one machine (groups of chapters, same versions)."""
    times = [_read_times(run) for run in runs]
    seen = {json.dumps(t.get("versions"), sort_keys=True) for t in times}
    if len(seen) > 1:
        raise SystemExit("the runs were made with different GPUs or versions: " + "; ".join(sorted(seen)))
    rows = [row for t in times for row in t["notebooks"]]
    chapters = [row["chapter"] for row in rows]
    if len(set(chapters)) < len(chapters):
        raise SystemExit(f"a chapter ran in more than one of {', '.join(map(str, runs))}")
    return {**times[0], "date": max(t["date"] for t in times), "notebooks": sorted(rows, key=lambda r: r["chapter"]),
            "total_seconds": round(sum(r["seconds"] for r in rows), 1)}


def record(executed: list[Path], out: Path, machine: str, edition: str) -> Path:
    """Write a committed edition record from ``benchmarks.notebooks`` runs: grafted notebooks and provenance."""
    times = _merged_times(executed)
    where = {row["chapter"]: run for run in executed for row in _read_times(run)["notebooks"]}
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for chapter, run in sorted(where.items()):
        executed_nb = nbformat.read(run / f"{chapter}.ipynb", as_version=4)
        released = nbformat.read(released_notebook(chapter), as_version=4)
        nbformat.write(graft(released, executed_nb), out / f"{chapter}.ipynb")
    facts = {
        "edition": edition,
        "machine": machine,
        **run_facts(times),
        "how": f"python -m benchmarks.notebooks --out DIR [CHAPTER ...] (one or more runs), then python -m website "
               f"record --executed DIR [DIR ...] --edition {edition} --machine {machine!r}",
        "recorded": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    (out / PROVENANCE).write_text(json.dumps(facts, indent=2) + "\n")
    return out


def load_edition(key: str, title: str, folder: Path, provenance: dict[str, Any] | None = None) -> Edition:
    """The edition whose notebooks are ``folder/<chapter>.ipynb``; provenance from the argument or the folder's file."""
    if provenance is None:
        provenance = json.loads((folder / PROVENANCE).read_text())
    notebooks = {p.stem: p for p in sorted(folder.glob("[0-9][0-9]_*.ipynb"))}
    return Edition(key, title, notebooks, provenance)


def cpu_edition(executed: Path, chapters: list[str]) -> Edition:
    """The CPU edition from this build's run (or a reused one) in ``executed``."""
    times = _read_times(executed)
    missing = [c for c in chapters if not (executed / f"{c}.ipynb").is_file()]
    if missing:
        raise SystemExit(f"{executed} has no executed notebook for {', '.join(missing)}")
    facts = {"edition": "cpu", "machine": "the machine that built this site", **run_facts(times),
             "how": "make site (python -m website build)"}
    edition = load_edition("cpu", "CPU", executed, facts)
    edition.notebooks = {c: edition.notebooks[c] for c in chapters}
    return edition
