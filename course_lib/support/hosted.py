"""The first code cell of every chapter notebook, which makes a notebook opened on a hosted service set itself up.

Where the course is installed (``make install``, ``make lab``, the grader, CI) the cell finds
``course_lib`` and does nothing. On Colab or Binder, where only the notebook was opened, it
installs the course with pip from its repository, pinned to the release tag of this version;
``COURSE_INSTALL_FROM`` (a pip requirement, a wheel or a folder) installs something else, which
is how ``tests/test_hosted_setup.py`` runs the path offline against a locally built wheel.
``SETUP_CELL`` is the cell's source, ``SETUP_CELL_ID`` its id; the test checks that every
chapter notebook starts with it and that its pin matches the package's version.
"""

from __future__ import annotations

__all__ = ["INSTALL_REQUIREMENT", "REPOSITORY", "SETUP_CELL", "SETUP_CELL_ID"]

REPOSITORY = "https://github.com/training-at-speed/training-at-speed"
INSTALL_REQUIREMENT = f"training-at-speed @ git+{REPOSITORY}@v0.1.0"
SETUP_CELL_ID = "hosted-setup"
SETUP_CELL = f'''# Hosted setup. Where the course is installed (make install, the grader) this does nothing; on Colab or
# Binder it first installs the course's release with pip. COURSE_INSTALL_FROM overrides what is installed.
import importlib
import importlib.util
import os
import subprocess
import sys

if importlib.util.find_spec("course_lib") is None:
    _source = os.environ.get("COURSE_INSTALL_FROM", "{INSTALL_REQUIREMENT}")
    print(f"course_lib is not installed here: installing {{_source}} with pip (a minute or two)")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", _source], check=True)
    importlib.invalidate_caches()
    print(f"installed: course_lib is now at {{importlib.util.find_spec('course_lib').origin}}")
else:
    print("course_lib is installed: nothing to set up")'''
