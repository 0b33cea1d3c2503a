"""``python -m autograder``: see ``autograder.cli``."""

from .cli import main

raise SystemExit(main())
