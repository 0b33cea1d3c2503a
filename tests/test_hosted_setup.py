"""A notebook opened on a hosted service sets itself up: its setup cell installs the course where it is missing.

The fast tests check that every chapter notebook (solution and released) carries the same setup
cell, right after its title, and that the cell installs the release of this version from this
repository. The slow one runs the cell offline in a fresh virtual environment where
``course_lib`` is missing, with ``COURSE_INSTALL_FROM`` pointing at a wheel built from this
checkout: it must say what it did, leave ``course_lib`` and the benchmark records importable from
the wheel (not from this checkout), and the chapter's import cell must then run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import nbformat
import pytest

from course_lib.support.hosted import INSTALL_REQUIREMENT, REPOSITORY, SETUP_CELL, SETUP_CELL_ID

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(ROOT.glob("solutions/[0-9][0-9]_*/*.ipynb")) + sorted(ROOT.glob("notebooks/[0-9][0-9]_*/*.ipynb"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[f"{p.parts[-3]}/{p.parent.name}" for p in NOTEBOOKS])
def test_every_notebook_opens_with_the_setup_cell(path: Path) -> None:
    cells = nbformat.read(path, as_version=4).cells
    assert cells[0].cell_type == "markdown", f"{path.name}: the title comes first"
    cell = cells[1]
    assert cell.cell_type == "code" and cell.get("id") == SETUP_CELL_ID, (
        f"{path.name}: the second cell must be the setup cell (id {SETUP_CELL_ID!r}); "
        "insert course_lib.support.hosted.SETUP_CELL there in the solution notebook and release again")
    assert cell.source == SETUP_CELL, f"{path.name}: the setup cell differs from course_lib.support.hosted.SETUP_CELL"


def test_the_setup_cell_installs_this_release_from_this_repository() -> None:
    version = PYPROJECT["project"]["version"]
    assert PYPROJECT["project"]["urls"]["Repository"] == REPOSITORY
    assert f"{PYPROJECT['project']['name']} @ git+{REPOSITORY}@v{version}" == INSTALL_REQUIREMENT


def _wheel(out: Path) -> Path:
    """A wheel of this checkout, built from a copy (so that no build/ folder appears in the checkout)."""
    src = out / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    for package in ("course_lib", "autograder", "benchmarks"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    return next((out / "dist").glob("training_at_speed-*.whl"))


def _fresh_venv(path: Path) -> Path:
    """A new venv whose dependencies are this venv's packages, minus the course itself."""
    subprocess.run([sys._base_executable, "-m", "venv", str(path)], check=True, timeout=300)  # type: ignore[attr-defined]
    python = path / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    ours = Path(next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_relative_to(sys.prefix)))
    deps = path / "deps"
    deps.mkdir()
    for entry in ours.iterdir():  # everything but the course's own install (its editable finder and metadata)
        if entry.name.startswith(("__editable__", "training_at_speed")) or entry.suffix == ".pth":
            continue
        (deps / entry.name).symlink_to(entry)
    (site / "deps.pth").write_text(f"{deps}\n")
    return python


@pytest.mark.slow
def test_the_setup_cell_installs_the_course_into_a_fresh_venv(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path)
    python = _fresh_venv(tmp_path / "venv")
    work = tmp_path / "work"  # not the checkout: course_lib must not be importable from the working directory
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(COURSE_INSTALL_FROM=str(wheel), PIP_NO_INDEX="1", PIP_NO_DEPS="1", PIP_DISABLE_PIP_VERSION_CHECK="1")

    def run(code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(python), "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=600)

    missing = run("import course_lib")
    assert missing.returncode != 0 and "No module named 'course_lib'" in missing.stderr, "course_lib is there before setup"

    chapter = nbformat.read(ROOT / "notebooks" / "01_floating_point" / "01_floating_point.ipynb", as_version=4)
    setup, imports = chapter.cells[1].source, chapter.cells[2].source
    first = run(setup)
    assert first.returncode == 0, f"the setup cell failed:\n{first.stdout}\n{first.stderr}"
    assert f"course_lib is not installed here: installing {wheel}" in first.stdout, first.stdout
    assert "installed: course_lib is now at " + str(tmp_path / "venv") in first.stdout, first.stdout

    check = run(imports + "\nimport course_lib\nfrom course_lib.support.records import load_record\n"
                "print(course_lib.__file__)\nprint(load_record('h200.json').name)")
    assert check.returncode == 0, f"the chapter's imports failed after setup:\n{check.stderr}"
    assert str(tmp_path / "venv") in check.stdout and "h200.json" in check.stdout, check.stdout

    again = run(setup)
    assert again.returncode == 0 and again.stdout.strip() == "course_lib is installed: nothing to set up", again.stdout
