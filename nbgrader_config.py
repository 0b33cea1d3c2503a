"""nbgrader settings for running `nbgrader` by hand from the project root.

They are the ones `python -m autograder` uses (autograder/config.py); the gradebook goes to
the system's temporary folder, never into the repository.
"""

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from autograder.config import nbgrader_config  # noqa: E402

DB_PATH = Path(tempfile.gettempdir()) / "training-at-speed" / "gradebook.db"
DB_PATH.parent.mkdir(parents=True, exist_ok=True)

c = get_config()  # noqa: F821 (provided by traitlets when it loads this file)
c.merge(nbgrader_config(ROOT, db_path=DB_PATH))
