"""Execute every solution notebook once, keep the executed copies, and time each one.

    python -m benchmarks.notebooks --out DIR [CHAPTER ...]

Writes ``DIR/<chapter>.ipynb`` (executed, outputs kept: the artefacts a GPU runner uploads) and
``DIR/times.json`` / ``DIR/times.md``: per notebook the wall time, the device it ran on and the
cells that raised. The run goes on after a failing notebook; the exit status is 1 when any
notebook raised (a dead kernel or a cell over the timeout counts), else 0. The table is
rewritten after every notebook, so a run that is stopped (Ctrl-C, or SIGINT from a time limit)
keeps the notebooks that finished, names the one it stopped in, and exits with 130. Used for the
run-time table of docs/gpu-run.md, on a CPU and on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient
from tqdm.auto import tqdm

from benchmarks.provenance import machine_facts

__all__ = ["chapters", "device_name", "main", "run_notebook"]

ROOT = Path(__file__).resolve().parent.parent


def chapters(names: list[str]) -> list[Path]:
    """The solution notebooks to run: the named chapters, or all of them in order."""
    found = sorted(ROOT.glob("solutions/[0-9][0-9]_*/[0-9][0-9]_*.ipynb"))
    if not names:
        return found
    by_name = {p.parent.name: p for p in found}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown chapter(s): {', '.join(unknown)}; known: {', '.join(by_name)}")
    return [by_name[n] for n in names]


def run_notebook(path: Path, out_dir: Path, cell_timeout: int) -> dict:
    """Execute one notebook in its own folder; save the executed copy; return its time and errors."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    stopped = []
    try:
        client.execute()
    except Exception as err:  # a dead kernel or a cell over the timeout ends this notebook, not the run
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        stopped = [f"notebook stopped: {type(err).__name__}: {first_line}"[:300]]
    seconds = time.perf_counter() - start
    errors = [
        f"cell {c.get('id')}: {o.ename}: {o.evalue.splitlines()[0] if o.evalue else ''}"[:300]
        for c in nb.cells if c.cell_type == "code"
        for o in c.get("outputs", []) if o.output_type == "error"
    ] + stopped
    nbformat.write(nb, out_dir / path.name)
    return {"chapter": path.parent.name, "seconds": round(seconds, 1), "errors": errors}


def device_name() -> str:
    """What the notebooks ran on, as the course banner says it."""
    from course_lib import env
    return env.banner()


def write_report(out_dir: Path, rows: list[dict], interrupted: str | None = None,
                 machine: dict[str, Any] | None = None) -> str:
    """Write ``times.json`` and ``times.md`` for the notebooks run so far; return the markdown."""
    report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "device": device_name(),
              "versions": machine or machine_facts(), "notebooks": rows,
              "total_seconds": round(sum(r["seconds"] for r in rows), 1), "interrupted_in": interrupted}
    (out_dir / "times.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# Solution notebooks, executed once", "", f"- {report['device']}", f"- {report['date']}", "",
             "| chapter | seconds | errors |", "|---|---:|---|"]
    lines += [f"| {r['chapter']} | {r['seconds']:.0f} | {'; '.join(r['errors']) or 'none'} |" for r in rows]
    lines += [f"| total | {report['total_seconds']:.0f} | |", ""]
    if interrupted:
        lines += [f"Stopped while running {interrupted}; the notebooks after it did not run.", ""]
    markdown = "\n".join(lines)
    (out_dir / "times.md").write_text(markdown)
    return markdown


def main(argv: list[str] | None = None) -> int:
    """Run the notebooks, write the executed copies and the time table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chapters", nargs="*", help="chapter folder names (default: all)")
    parser.add_argument("--out", type=Path, required=True, help="folder for executed notebooks and times.*")
    parser.add_argument("--cell-timeout", type=int, default=900)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    machine = machine_facts()
    markdown = write_report(args.out, rows, machine=machine)
    for path in tqdm(chapters(args.chapters), desc="notebooks"):
        try:
            rows.append(run_notebook(path, args.out, args.cell_timeout))
        except KeyboardInterrupt:
            print(write_report(args.out, rows, path.parent.name, machine))
            return 130
        tqdm.write(f"{rows[-1]['chapter']}: {rows[-1]['seconds']:.0f} s, errors: {'; '.join(rows[-1]['errors']) or 'none'}")
        markdown = write_report(args.out, rows, machine=machine)
    print(markdown)
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
