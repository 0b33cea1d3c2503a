"""Release checks: notebooks/ is exactly what `make release` makes from solutions/, with no outputs and nothing hidden."""

from __future__ import annotations

import filecmp
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from autograder.course import Course, is_test_cell

ROOT = Path(__file__).resolve().parents[1]
COURSE = Course(ROOT)
CHAPTERS = COURSE.chapters()
ALL_NOTEBOOKS = sorted(COURSE.solutions.glob("*/*.ipynb")) + sorted(COURSE.notebooks.glob("*/*.ipynb"))
MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")


def release_into(out: Path, *chapters: str) -> subprocess.CompletedProcess:
    """Run `python -m autograder release --out OUT` from the project root."""
    return subprocess.run(
        [sys.executable, "-m", "autograder", "release", "--out", str(out), *chapters],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )


def chapter_files(folder: Path) -> set[Path]:
    """Every file under the chapter folders of a release folder, relative to it (hidden ones, like checkpoints, aside)."""
    if not folder.is_dir():
        return set()
    files = (p.relative_to(folder) for p in folder.glob("*/**/*") if p.is_file())
    return {p for p in files if not any(part.startswith(".") for part in p.parts)}


def same_file(a: Path, b: Path) -> bool:
    """Whether two files exist and hold the same bytes."""
    return a.is_file() and b.is_file() and filecmp.cmp(a, b, shallow=False)


def marked_lines(source: str, begin: str, end: str) -> tuple[set[str], set[str]]:
    """The stripped lines of ``source`` inside the begin/end regions, and those outside them."""
    inside, outside, within = set(), set(), False
    for line in source.splitlines():
        if begin in line:
            within = True
        elif end in line:
            within = False
        elif line.strip():
            (inside if within else outside).add(line.strip())
    return inside, outside


@pytest.fixture(scope="module")
def fresh_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every chapter released from solutions/ into a temporary folder."""
    out = tmp_path_factory.mktemp("release")
    result = release_into(out)
    assert result.returncode == 0, f"release failed:\n{result.stdout}\n{result.stderr}"
    return out


def test_there_are_chapters() -> None:
    assert CHAPTERS, f"no chapters found in {COURSE.solutions} (expected NN_name/NN_name.ipynb)"


def test_notebooks_are_in_sync_with_solutions(fresh_release: Path) -> None:
    expected, actual = chapter_files(fresh_release), chapter_files(COURSE.notebooks)
    missing = sorted(str(p) for p in expected - actual)
    extra = sorted(str(p) for p in actual - expected)
    differ = sorted(str(p) for p in expected & actual if not same_file(fresh_release / p, COURSE.notebooks / p))
    assert not (missing or extra or differ), (
        f"notebooks/ is out of date with solutions/: missing {missing}, stale {extra}, different {differ}. "
        "Run `make release` and commit notebooks/."
    )


def test_release_is_deterministic(fresh_release: Path, tmp_path: Path) -> None:
    first = release_into(tmp_path)
    assert first.returncode == 0, first.stderr
    differ = sorted(str(p) for p in chapter_files(fresh_release) if not same_file(fresh_release / p, tmp_path / p))
    assert chapter_files(tmp_path) == chapter_files(fresh_release) and not differ, f"two releases differ in {differ}"
    second = release_into(tmp_path)
    assert second.returncode == 0, second.stderr
    assert "0 file(s) changed" in second.stdout, f"a second release rewrote files:\n{second.stdout}"
    assert not (ROOT / "gradebook.db").exists(), "release left a gradebook.db in the project root"


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_stored_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    stored = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not stored, f"{path.relative_to(ROOT)} stores outputs in cells {stored}; clear them before committing"
    assert "widgets" not in nb.metadata, f"{path.relative_to(ROOT)} stores widget state; clear outputs before committing"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_release_hides_solutions_and_hidden_tests(chapter: str) -> None:
    released_path = COURSE.released_notebook(chapter)
    assert released_path.is_file(), f"{released_path.relative_to(ROOT)} is missing; run `make release`"
    released = nbformat.read(released_path, as_version=4)
    source = nbformat.read(COURSE.source_notebook(chapter), as_version=4)
    released_lines = {line.strip() for cell in released.cells for line in cell.source.splitlines()}
    for marker in MARKERS:
        assert not any(marker in cell.source for cell in released.cells), f"{chapter}: '{marker}' left in the release"
    hidden, solution, visible = set(), set(), set()
    for cell in source.cells:
        inside_tests, outside_tests = marked_lines(cell.source, "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")
        inside_solution, outside_solution = marked_lines(cell.source, "BEGIN SOLUTION", "END SOLUTION")
        hidden |= inside_tests
        solution |= inside_solution
        visible |= outside_tests & outside_solution
    leaked = sorted(((hidden | solution) - visible) & released_lines)
    assert not leaked, f"{chapter}: solution or hidden-test lines appear in the release: {leaked[:5]}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_test_cell_has_hidden_tests(chapter: str) -> None:
    source = nbformat.read(COURSE.source_notebook(chapter), as_version=4)
    tests = [c for c in source.cells if is_test_cell(c)]
    without = [c.metadata.nbgrader["grade_id"] for c in tests if "BEGIN HIDDEN TESTS" not in c.source]
    assert not without, f"{chapter}: test cells without hidden tests (CONTRIBUTING.md asks for them): {without}"


def test_released_chapter_names_are_checked(tmp_path: Path) -> None:
    result = release_into(tmp_path, "99_no_such_chapter")
    assert result.returncode == 2
    assert "unknown chapter" in result.stderr and "99_no_such_chapter" in result.stderr
    assert not any(tmp_path.iterdir()), "a failed release wrote files"


def test_release_help_mentions_exit_status() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "autograder", "release", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "exit status" in result.stdout
    assert re.search(r"--out DIR", result.stdout)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_released_exercise_cells_let_run_all_go_on_and_carry_no_ci_markers(chapter: str) -> None:
    released = nbformat.read(COURSE.released_notebook(chapter), as_version=4)
    exercise = [
        c for c in released.cells
        if is_test_cell(c) or (c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution"))
    ]
    assert exercise, f"{chapter}: no exercise cells in the release"
    stopping = [c.metadata.nbgrader["grade_id"] for c in exercise if "raises-exception" not in c.metadata.get("tags", [])]
    assert not stopping, (f"{chapter}: exercise cells without the raises-exception tag stop JupyterLab's Run All "
                          f"at a student's first unfinished exercise: {stopping}")
    lecture_tags = {t for c in released.cells if c not in exercise for t in c.metadata.get("tags", [])}
    assert "raises-exception" not in lecture_tags, f"{chapter}: a lecture cell is allowed to raise"
    ci = [i for i, c in enumerate(released.cells)
          if re.search(r"#\s*NBVAL_|nbval-", c.source) or any(t.startswith("nbval-") for t in c.metadata.get("tags", []))]
    assert not ci, f"{chapter}: nbval markers left in the student's notebook, cells {ci}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_solutions_do_not_hide_errors_from_nbval(chapter: str) -> None:
    source = nbformat.read(COURSE.source_notebook(chapter), as_version=4)
    tagged = [i for i, c in enumerate(source.cells) if "raises-exception" in c.metadata.get("tags", [])]
    assert not tagged, (f"{chapter}: cells {tagged} of the instructor's notebook are tagged raises-exception, "
                        "so nbval would pass them even when they fail; the release adds the tag")
