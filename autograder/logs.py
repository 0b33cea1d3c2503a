"""Reading nbgrader's logs and tracebacks: the one line that says what went wrong."""

from __future__ import annotations

import re

__all__ = ["failure_reason", "last_relevant_line"]

# Lines that only say "see above"; the reason is elsewhere.
_GENERIC = re.compile(r"There was an error processing assignment|Please see the|Traceback \(most recent call last\)")
_EXCEPTION_LINE = re.compile(r"^[\w.]*(?:Error|Exception|Exit|Interrupt|Died)\b.*")


def last_relevant_line(text: str) -> str:
    """The last exception line of a log or traceback that is not a generic "see above", else its last error line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line) and not _GENERIC.search(line):
            return line
    errors = [line for line in lines if line.startswith("[ERROR]") and not _GENERIC.search(line)]
    return (errors or lines or ["no log output"])[-1]


def failure_reason(result: dict) -> str:
    """What went wrong in a failed nbgrader API call (a dict with 'log' and 'error')."""
    return last_relevant_line((result.get("log") or "") + "\n" + (result.get("error") or ""))
