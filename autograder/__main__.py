"""``python -m autograder``: see ``autograder.cli``."""

from .cli import main

__all__: list[str] = []

raise SystemExit(main())
