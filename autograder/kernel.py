"""The grading kernel: ipykernel with the grader's memory limit, started inside the sandbox.

Started by the grader's kernelspec (``python -m autograder.kernel -f CONNECTION_FILE``, inside
bubblewrap; see ``autograder.sandbox``). Before the first cell it reads its settings
(``autograder.contracts.KernelSettings``) from the file named by ``AUTOGRADER_KERNEL`` (then
deletes the file and the variable), drops
``NBGRADER_EXECUTION`` so that student code cannot tell it is being graded, and on a CPU sets
``RLIMIT_AS`` (a memory bomb gets ``MemoryError``; never with CUDA, which reserves huge virtual
ranges: there the grader's memory cgroup holds).

Nothing in this process judges anything: test cells run in the trusted tester
(``autograder.tester``), which calls the notebook's functions through ``autograder.agent``.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

from .contracts import KERNEL_SETTINGS_VARIABLE, KernelSettings

__all__ = ["main"]


def _read_settings() -> KernelSettings:
    """The kernel's settings from the grader, read once and then deleted with their variable."""
    os.environ.pop("NBGRADER_EXECUTION", None)
    path = os.environ.pop(KERNEL_SETTINGS_VARIABLE, None)
    if not path:
        return KernelSettings()
    settings = KernelSettings.read(Path(path))
    os.unlink(path)
    return settings


def main() -> None:
    """Start an ipykernel with the memory limit in place."""
    from ipykernel.kernelapp import IPKernelApp

    settings = _read_settings()
    if settings.memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (settings.memory_bytes, settings.memory_bytes))
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path.pop(0)  # as ipykernel_launcher does: the notebook's folder is not a package root
    app = IPKernelApp.instance()
    app.initialize(sys.argv[1:])
    app.start()


if __name__ == "__main__":
    main()
