"""Release: nbgrader generate_assignment from solutions/ into notebooks/, written so that a rerun changes no byte."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import nbformat

from .config import course_environment, nbgrader_config
from .course import Course, is_test_cell
from .logs import failure_reason

__all__ = ["ReleaseError", "generate_assignments", "release"]


class ReleaseError(RuntimeError):
    """nbgrader could not generate a chapter's student version."""


def generate_assignments(course: Course, chapters: Sequence[str], release_dir: Path, db_path: Path) -> None:
    """Run nbgrader generate_assignment for each chapter into ``release_dir``, with the gradebook at ``db_path``."""
    from nbgrader.apps import NbGraderAPI

    db_path.parent.mkdir(parents=True, exist_ok=True)
    config = nbgrader_config(course.root, db_path=db_path, release_directory=str(release_dir))
    with course_environment(course.root):
        api = NbGraderAPI(config=config)
        for chapter in chapters:
            result = api.generate_assignment(chapter, force=True, create=True)
            if not result["success"]:
                raise ReleaseError(f"nbgrader generate_assignment failed for {chapter}: {failure_reason(result)}")


# JupyterLab's Run All stops at the first cell that raises unless the cell carries this tag; a
# student's unfinished exercise raises in its own cell and in its test, and Run All goes on.
KEEP_GOING_TAG = "raises-exception"
# nbval's markers steer CI over solutions/; a student's copy has no use for them.
_NBVAL_COMMENT = re.compile(r"^[ \t]*#[ \t]*(NBVAL|PYTEST_VALIDATE)_[A-Z_]+[ \t]*\n?", re.MULTILINE)


def normalise_notebook(path: Path) -> None:
    """Rewrite a released notebook canonically: no outputs, widget state or CI markers; exercise cells keep Run All going."""
    nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
            cell.source = _NBVAL_COMMENT.sub("", cell.source)
        tags = [t for t in cell.metadata.get("tags", []) if not t.startswith("nbval-")]
        if is_test_cell(cell) or cell.metadata.get("nbgrader", {}).get("solution") and cell.cell_type == "code":
            tags = [*tags, KEEP_GOING_TAG] if KEEP_GOING_TAG not in tags else tags
        if tags:
            cell.metadata["tags"] = tags
        else:
            cell.metadata.pop("tags", None)
    text = nbformat.writes(nb)
    path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")


def release(course: Course, chapters: Sequence[str], out_dir: Path | None = None) -> list[str]:
    """Release ``chapters`` (all when empty) into ``out_dir`` (default notebooks/); return a line per file changed.

    The chapters are generated into a scratch folder first, so a failure leaves ``out_dir``
    untouched; then only files whose bytes differ are written. Releasing every chapter also
    removes chapter folders of ``out_dir`` that no longer have a source.
    """
    names = course.resolve(chapters)
    out_dir = course.notebooks if out_dir is None else out_dir
    changes = []
    with tempfile.TemporaryDirectory(prefix="autograder-release-") as scratch:
        staging = Path(scratch) / "release"
        generate_assignments(course, names, staging, Path(scratch) / "gradebook.db")
        for notebook in staging.rglob("*.ipynb"):
            normalise_notebook(notebook)
        for chapter in names:
            changes += _sync_folder(staging / chapter, out_dir / chapter)
    if not chapters and out_dir.is_dir():
        for stale in sorted(d for d in out_dir.iterdir() if d.is_dir() and _looks_like_chapter(d, course)):
            shutil.rmtree(stale)
            changes.append(f"removed {stale} (no {course.solutions / stale.name})")
    return changes


def _looks_like_chapter(folder: Path, course: Course) -> bool:
    """A released chapter folder (``NN_name/NN_name.ipynb``) whose source is gone."""
    return (folder / f"{folder.name}.ipynb").is_file() and not course.source_notebook(folder.name).is_file()


def _files(folder: Path) -> set[Path]:
    """The files under ``folder``, relative to it, leaving out hidden ones such as .ipynb_checkpoints/."""
    if not folder.is_dir():
        return set()
    files = (p.relative_to(folder) for p in folder.rglob("*") if p.is_file())
    return {p for p in files if not any(part.startswith(".") for part in p.parts)}


def _sync_folder(src: Path, dst: Path) -> list[str]:
    """Make ``dst`` hold exactly ``src``'s files (hidden ones aside), writing only those whose bytes differ."""
    changes = []
    wanted = _files(src)
    for rel in sorted(_files(dst) - wanted):
        (dst / rel).unlink()
        changes.append(f"removed {dst / rel}")
    for rel in sorted(wanted):
        target, data = dst / rel, (src / rel).read_bytes()
        if target.is_file() and target.read_bytes() == data:
            continue
        changes.append(f"{'updated' if target.exists() else 'created'} {target}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return changes
