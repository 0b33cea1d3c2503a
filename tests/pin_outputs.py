"""Record the outputs of the solution cells marked ``# NBVAL_CHECK_OUTPUT``, for nbval to compare against.

``.venv/bin/python tests/pin_outputs.py [CHAPTER ...]`` (default: every chapter) executes each
chapter's solution notebook and writes ``tests/pinned_outputs/<chapter>.json`` (cell id -> outputs).
Solution notebooks are stored without outputs; the project's ``conftest.py`` hands these outputs to
nbval, and ``tests/test_pinned_outputs.py`` checks that every marked cell has one. Pin only output
that is the same on a CPU and on a GPU. Exit status: 0 recorded; 1 a notebook failed to run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

__all__ = ["PINNED_DIRECTORY", "main", "pin_chapter", "pinned_cell_ids"]

PIN_MARKER = "# NBVAL_CHECK_OUTPUT"
PINNED_DIRECTORY = Path("tests") / "pinned_outputs"
ROOT = Path(__file__).resolve().parents[1]


def pinned_cell_ids(notebook: nbformat.NotebookNode) -> list[str]:
    """Ids of the code cells whose source starts with the pin marker, in notebook order."""
    return [c.id for c in notebook.cells if c.cell_type == "code" and c.source.lstrip().startswith(PIN_MARKER)]


def _comparable(output: nbformat.NotebookNode) -> dict:
    """An output without the fields nbval does not compare (metadata, execution count)."""
    return {k: v for k, v in output.items() if k not in ("metadata", "execution_count")}


def record_pinned_outputs(notebook_path: Path, timeout: int = 600) -> dict[str, list[dict]]:
    """Execute a solution notebook in its own folder and return the outputs of its pinned cells."""
    notebook = nbformat.read(notebook_path, as_version=4)
    NotebookClient(notebook, timeout=timeout, kernel_name="python3", iopub_timeout=60, raise_on_iopub_timeout=True,
                   resources={"metadata": {"path": str(notebook_path.parent)}}).execute()
    wanted = set(pinned_cell_ids(notebook))
    return {c.id: [_comparable(o) for o in c.outputs] for c in notebook.cells if c.id in wanted}


def pin_chapter(course_root: Path, chapter: str) -> Path:
    """Write ``tests/pinned_outputs/<chapter>.json`` from a fresh run of the chapter's solution notebook."""
    outputs = record_pinned_outputs(course_root / "solutions" / chapter / f"{chapter}.ipynb")
    target = course_root / PINNED_DIRECTORY / f"{chapter}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(outputs, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    """Pin the chapters named (every chapter when none is); exit status 1 when a notebook fails to run."""
    parser = argparse.ArgumentParser(prog="python tests/pin_outputs.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapters", nargs="*", metavar="CHAPTER", help="chapter folder names (default: every chapter)")
    known = sorted(p.name for p in (ROOT / "solutions").iterdir() if (p / f"{p.name}.ipynb").is_file())
    chapters = parser.parse_args(argv).chapters or known
    for chapter in chapters:
        if chapter not in known:
            parser.error(f"no chapter {chapter!r} in solutions/ (chapters: {', '.join(known)})")
        try:
            print(f"pinned {pin_chapter(ROOT, chapter).relative_to(ROOT)}", flush=True)
        except CellExecutionError as exc:
            print(f"error: {chapter} failed to run: {str(exc).strip().splitlines()[-1]}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
