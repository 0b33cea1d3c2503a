"""The nbgrader configuration shared by `release`, `grade`, `validate` and a hand-run `nbgrader`.

Settings that matter for grading:

- ``CourseDirectory.source_directory = "solutions"``, ``release_directory = "notebooks"``.
- The gradebook database always lives in a scratch folder, never in the repository.
- ``ExecutePreprocessor.timeout``: seconds a single cell may run before it is interrupted
  and scored 0 (``DEFAULT_CELL_TIMEOUT``; ``--cell-timeout`` overrides it).
- ``IgnorePattern``: nbgrader scores a test cell 0 when it writes anything to stderr; the
  pattern ``HARMLESS_STDERR`` drops a stderr output only when *every* line of it is library
  noise that the student did not cause (see below).
- ``OverwriteCells.add_missing_cells``: a deleted test cell is put back and run.
- Feedback hides the hidden tests (``autograder.feedback.RedactHiddenTests``) and shows what the
  submission produced as inert text (``autograder.feedback.InertOutputs`` and ``InertHTMLExporter``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from traitlets.config import Config

__all__ = [
    "DEFAULT_CELL_TIMEOUT", "DEFAULT_SUBMISSION_TIMEOUT", "HARMLESS_STDERR", "PACKAGE_PARENT", "RELEASE_DIRECTORY",
    "SECRET_VARIABLE", "SOURCE_DIRECTORY", "child_environment", "course_environment", "nbgrader_config",
]

SOURCE_DIRECTORY = "solutions"
RELEASE_DIRECTORY = "notebooks"
DEFAULT_CELL_TIMEOUT = 120
# The grading run's secret, from which hidden tests draw their inputs (``course_lib.exercises.checks.hidden_seed``):
# set for the workers, handed by each to its tester alone.
SECRET_VARIABLE = "AUTOGRADER_SECRET"
DEFAULT_SUBMISSION_TIMEOUT = 600
PACKAGE_PARENT = Path(__file__).resolve().parent.parent

# Libraries whose own warnings are not about the student's code: PyTorch, Triton and the
# Jupyter machinery that runs the kernel.
_NOISY_LIBRARIES = r"(?:torch|triton|jupyter_client|jupyter_core|ipykernel|IPython|traitlets|zmq)"
# A Python warning raised inside one of those libraries, as `warnings` prints it:
#   /…/site-packages/torch/nn/modules/module.py:1234: UserWarning: message
# optionally followed by the indented source line it points at. (A warning that Python
# attributes to the student's cell, or to any other file, is not matched.)
# ``course_lib.support.dist`` relays a rank's stderr with a "[rank N] " prefix on every line.
_RANK = r"(?:\[rank \d+\] )?"
_LIBRARY_WARNING = (
    _RANK + r"(?:[A-Za-z]:)?[^\n:]*[/\\](?:site|dist)-packages[/\\]" + _NOISY_LIBRARIES + r"[/\\][^\n:]*\.py:\d+: "
    r"\w*Warning: [^\n]*(?:\n|\Z)(?:" + _RANK + r"[ \t]+[^\n]*(?:\n|\Z))?"
)
# A warning that PyTorch's C++ core prints itself, e.g. from gloo's sockets in distributed
# chapters: "[W1129 16:00:00.123456789 socket.cpp:697] [c10d] The client socket has failed
# to connect ...", sometimes after a "[rank0]:" prefix. (The month and day are printed as
# one number, so January 5 is "W105".)
_TORCH_CPP_WARNING = r"(?:\[rank\d+\]:)?\[W\d{3,4} \d\d:\d\d:\d\d\.\d+ [^\]\n]*\] [^\n]*(?:\n|\Z)"
# nbgrader applies this with re.search to each stderr output of a cell and drops the output
# when it matches. Anchored at both ends, it matches only outputs made entirely of the lines
# above: a student's own message on stderr, or a warning attributed to the student's code,
# still fails the test.
HARMLESS_STDERR = r"\A(?:" + _LIBRARY_WARNING + "|" + _TORCH_CPP_WARNING + r")+\Z"


def nbgrader_config(
    root: Path | str,
    *,
    db_path: Path | str | None = None,
    source_directory: str = SOURCE_DIRECTORY,
    release_directory: str = RELEASE_DIRECTORY,
    cell_timeout: int = DEFAULT_CELL_TIMEOUT,
) -> Config:
    """The nbgrader settings for a course directory at ``root`` with its gradebook at ``db_path`` (when one is needed)."""
    c = Config()
    c.CourseDirectory.root = str(root)
    c.CourseDirectory.source_directory = source_directory
    c.CourseDirectory.release_directory = release_directory
    if db_path is not None:
        c.CourseDirectory.db_url = f"sqlite:///{Path(db_path).resolve()}"
    c.ExecutePreprocessor.timeout = cell_timeout
    # nbgrader scores a cell by the outputs it received. After a cell's reply, nbclient waits only
    # 4 s for the rest of its output by default and then drops it silently, so on a loaded machine
    # a late error could be lost and the test scored as passed: wait longer, and fail loudly.
    c.ExecutePreprocessor.iopub_timeout = 60
    c.ExecutePreprocessor.raise_on_iopub_timeout = True
    # The kernel's own start-up warnings (e.g. "running over TCP without encryption") are not about the notebook.
    c.ExecutePreprocessor.extra_arguments = ["--IPKernelApp.log_level=ERROR"]
    c.IgnorePattern.enabled = True
    c.IgnorePattern.pattern = HARMLESS_STDERR
    c.OverwriteCells.add_missing_cells = True
    c.GenerateFeedback.preprocessors = [
        "nbgrader.preprocessors.GetGrades",
        "autograder.feedback.RedactHiddenTests",
        "autograder.feedback.InertOutputs",
        "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
    ]
    c.GenerateFeedback.exporter_class = "autograder.feedback.InertHTMLExporter"
    return c


def child_environment(course_root: Path) -> dict[str, str]:
    """This process's environment with this Python's tools first on PATH and the course importable.

    nbgrader runs the ``alembic`` executable in a subprocess, and the kernel it starts must
    import ``course_lib`` (and the worker ``autograder``) from the course root.
    """
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH", "")]))
    importable = dict.fromkeys([str(course_root), str(PACKAGE_PARENT), env.get("PYTHONPATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, importable))
    return env


@contextmanager
def course_environment(course_root: Path) -> Iterator[None]:
    """Within the block, run nbgrader and kernels in this process with ``child_environment(course_root)``."""
    saved = dict(os.environ)
    os.environ.update(child_environment(course_root))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
