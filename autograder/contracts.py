"""What crosses each process boundary of the grader, written down once: the contract of every hand-off.

The processes and what they hand each other::

    grade (the instructor's command)
      --WorkerArgs (command line)-->  worker (one submission, a child process)
      <--WorkerResult (result.json)--
    worker --KernelSettings (a file named in the kernel's environment)-->  kernel (in the sandbox)
    worker --TesterArgs (command line)-->  tester (trusted: runs the test cells)
      <-- TESTER_READY line, then per test cell: --CellRequest line--> ... <--Verdict line--
    a finished submission's Grade --> OUT/.done/ (read back by a later run to resume)

Every reader here accepts exact types only and raises ``ContractError`` on anything else: a
process at the other end may have died half-way through a line, and a file in a scratch folder
is read as if a submission had written it. ``Status`` is the one list of outcomes a row of
grades.csv can have. (The channel between the tester and the student's kernel is of another
kind, a stream of frames with its own safe loader: ``autograder.wire``.)
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

__all__ = [
    "KERNEL_SETTINGS_VARIABLE", "TESTER_READY", "WORKER_STATUSES", "CellRequest", "ContractError", "Grade",
    "KernelSettings", "Status", "TesterArgs", "Verdict", "WorkerArgs", "WorkerResult", "positive_float", "positive_int",
]

# The kernel's environment variable that names its settings file (``KernelSettings``).
KERNEL_SETTINGS_VARIABLE = "AUTOGRADER_KERNEL"


class ContractError(ValueError):
    """A hand-off that breaks its contract: a missing field, a wrong type, a line that is not JSON."""


class Status(StrEnum):
    """The outcome of one submission (the ``status`` column of grades.csv)."""

    OK = "ok"  # graded, whatever the score
    UNKNOWN_CHAPTER = "unknown_chapter"  # no such chapter in solutions/
    MISSING_NOTEBOOK = "missing_notebook"  # no <chapter>.ipynb in the folder
    INVALID_NOTEBOOK = "invalid_notebook"  # empty, too large, or not a readable notebook
    INVALID_SUBMISSION = "invalid_submission"  # a link, or not a plain file or folder: never read
    INVALID_ID = "invalid_id"  # the student folder's name cannot be an id
    TIMEOUT = "timeout"  # stopped at the time limit
    ERROR = "error"  # grading failed (the kernel died, nbgrader failed, ...)


# What a worker may report: the other statuses are decided before a worker starts.
WORKER_STATUSES = frozenset({Status.OK, Status.TIMEOUT, Status.ERROR})


# ---------------------------------------------------------------------------------------------- field checks
def _score(value: object) -> float:
    """A score: a finite number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ContractError(f"not a score: {value!r:.50}")
    return float(value)


def _text(value: object, what: str = "text") -> str:
    """A string."""
    if not isinstance(value, str):
        raise ContractError(f"not a {what}: {value!r:.50}")
    return value


def _status(value: object, allowed: frozenset[Status] | None = None) -> Status:
    """One of ``Status``'s values (of ``allowed`` when given)."""
    try:
        status = Status(_text(value, "status"))
    except ValueError:
        raise ContractError(f"not a status: {value!r:.50}") from None
    if allowed is not None and status not in allowed:
        raise ContractError(f"status {status} cannot come from here")
    return status


def _cells(value: object) -> list[tuple[str, float, float]]:
    """Per-cell grades: ``[[grade_id, score, max_score], ...]``."""
    if not isinstance(value, list) or not all(isinstance(c, list) and len(c) == 3 for c in value):
        raise ContractError("not a list of cell grades")
    return [(_text(name, "grade id"), _score(score), _score(max_score)) for name, score, max_score in value]


def _object(text: str | bytes, what: str) -> dict[str, Any]:
    """A JSON object, parsed."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ContractError(f"{what} is not JSON: {type(exc).__name__}") from None
    if type(value) is not dict:
        raise ContractError(f"{what} is not a JSON object")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer above zero."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above zero."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


# ---------------------------------------------------------------------------------------------- grade -> worker
@dataclass(frozen=True)
class WorkerArgs:
    """What the grader tells the worker of one submission (its command line)."""

    scratch: Path  # the submission's scratch course directory
    source: Path  # the course's solutions/ folder
    chapter: str
    student: str  # the internal name it is graded under (s00042)
    cell_timeout: int  # seconds per cell
    result: Path  # where the worker writes its WorkerResult
    disk_bytes: int  # size of the kernel's /tmp and of its working folder, each
    sandboxed: bool = True  # the kernel runs in bubblewrap
    memory_bytes: int | None = None  # the kernel's RLIMIT_AS (CPU grading; None on a GPU machine)

    def argv(self) -> list[str]:
        """The worker's arguments after ``python -m autograder.worker``."""
        args = ["--scratch", str(self.scratch), "--source", str(self.source), "--chapter", self.chapter,
                "--student", self.student, "--cell-timeout", str(self.cell_timeout), "--result", str(self.result),
                "--disk-bytes", str(self.disk_bytes)]
        args += ["--no-sandbox"] * (not self.sandboxed)
        args += ["--memory-bytes", str(self.memory_bytes)] if self.memory_bytes else []
        return args

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> WorkerArgs:
        """Read a worker's command line (argparse exits with status 2 on a bad one)."""
        parser = argparse.ArgumentParser(prog="python -m autograder.worker",
                                         description="Grade one submission (started by the grader, not by hand).")
        parser.add_argument("--scratch", type=Path, required=True)
        parser.add_argument("--source", type=Path, required=True)
        parser.add_argument("--chapter", required=True)
        parser.add_argument("--student", required=True)
        parser.add_argument("--cell-timeout", type=positive_int, required=True)
        parser.add_argument("--result", type=Path, required=True)
        parser.add_argument("--disk-bytes", type=positive_int, required=True)
        parser.add_argument("--no-sandbox", action="store_true")
        parser.add_argument("--memory-bytes", type=positive_int, default=None)
        a = parser.parse_args(argv)
        return cls(a.scratch, a.source, a.chapter, a.student, a.cell_timeout, a.result, a.disk_bytes,
                   not a.no_sandbox, a.memory_bytes)


# ---------------------------------------------------------------------------------------------- worker -> grade
@dataclass(frozen=True)
class WorkerResult:
    """What the worker reports of one submission (its result.json): a status, and the scores when it is ok."""

    status: Status
    message: str = ""
    score: float = 0.0
    max_score: float = 0.0
    cells: list[tuple[str, float, float]] = field(default_factory=list)

    def to_json(self) -> str:
        """The result file's text."""
        return json.dumps({**asdict(self), "status": self.status.value})

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerResult:
        """Read a result file; ContractError when it is not a worker's result."""
        record = _object(text, "the worker's result")
        status = _status(record.get("status"), WORKER_STATUSES)
        message = _text(record.get("message", ""), "message")
        if status is not Status.OK:
            return cls(status, message)
        return cls(status, message, _score(record.get("score")), _score(record.get("max_score")),
                   _cells(record.get("cells")))


# ---------------------------------------------------------------------------------------------- worker -> kernel
@dataclass(frozen=True)
class KernelSettings:
    """What the worker tells the sandboxed kernel before its first cell (a file the kernel reads, then deletes)."""

    memory_bytes: int | None = None  # RLIMIT_AS to set on itself (CPU grading only)

    def write(self, path: Path) -> None:
        """Write the settings file."""
        path.write_text(json.dumps(asdict(self)), encoding="utf-8")

    @classmethod
    def read(cls, path: Path) -> KernelSettings:
        """Read a settings file; ContractError when it is not one."""
        record = _object(path.read_bytes(), "the kernel's settings")
        memory = record.get("memory_bytes")
        if memory is not None and (type(memory) is not int or memory <= 0):
            raise ContractError(f"not a memory limit: {memory!r:.50}")
        return cls(memory)


# ---------------------------------------------------------------------------------------------- worker <-> tester
TESTER_READY = json.dumps({"ready": True})  # the tester's first line: its imports are done and it listens


@dataclass(frozen=True)
class TesterArgs:
    """What the worker tells the tester (its command line; the run's secret comes in its environment alone)."""

    source: Path  # the chapter's source notebook in solutions/
    socket: Path  # where the tester listens for the kernel
    cell_timeout: float

    def argv(self) -> list[str]:
        """The tester's arguments after ``python -m autograder.tester``."""
        return ["--source", str(self.source), "--socket", str(self.socket), "--cell-timeout", str(self.cell_timeout)]

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> TesterArgs:
        """Read a tester's command line."""
        parser = argparse.ArgumentParser(prog="python -m autograder.tester",
                                         description="Run a chapter's test cells (started by the worker).")
        parser.add_argument("--source", type=Path, required=True)
        parser.add_argument("--socket", type=Path, required=True)
        parser.add_argument("--cell-timeout", type=positive_float, required=True)
        a = parser.parse_args(argv)
        return cls(a.source, a.socket, a.cell_timeout)


@dataclass(frozen=True)
class CellRequest:
    """One line to the tester: run this test cell for the kernel that connects saying ``token``."""

    grade_id: str
    token: str

    def to_line(self) -> str:
        """The request as one line (newline included)."""
        return json.dumps(asdict(self)) + "\n"

    @classmethod
    def from_line(cls, line: str) -> CellRequest:
        """Read one request line."""
        record = _object(line, "a cell request")
        return cls(_text(record.get("grade_id"), "grade id"), _text(record.get("token"), "token"))


@dataclass(frozen=True)
class Verdict:
    """The tester's judgement of one test cell: one line back to the worker."""

    grade_id: str
    passed: bool
    error: tuple[str, str] | None = None  # the exception's class name and message, when it failed
    hidden: bool = False  # the failing statement is a hidden test
    traceback: str = ""  # the last line of the tester's traceback, for an error that is not a failed check
    output: str = ""  # what the test printed

    @classmethod
    def failure(cls, grade_id: str, message: str) -> Verdict:
        """A failed cell for which the tester gave no verdict (it stopped, or did not answer in time)."""
        return cls(grade_id, False, ("TestFailed", message))

    def to_line(self) -> str:
        """The verdict as one line (newline included)."""
        return json.dumps(asdict(self)) + "\n"

    @classmethod
    def from_line(cls, line: str) -> Verdict:
        """Read one verdict line; ContractError when it is not one."""
        record = _object(line, "a verdict")
        passed, hidden, error = record.get("passed"), record.get("hidden", False), record.get("error")
        if type(passed) is not bool or type(hidden) is not bool:
            raise ContractError("a verdict whose passed or hidden is not a bool")
        if error is not None and not (type(error) is list and len(error) == 2):
            raise ContractError("a verdict whose error is not [name, message]")
        return cls(_text(record.get("grade_id"), "grade id"), passed,
                   None if error is None else (_text(error[0], "name"), _text(error[1], "message")), hidden,
                   _text(record.get("traceback", ""), "traceback"), _text(record.get("output", ""), "output"))


# ---------------------------------------------------------------------------------------------- grade -> tables, OUT/.done/
@dataclass
class Grade:
    """The outcome for one submission: a row of grades.csv, its rows of grades_detail.csv, its record in OUT/.done/."""

    student_id: str
    chapter: str
    score: float
    max_score: float
    status: Status
    message: str = ""
    cells: list[tuple[str, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.status = Status(self.status)  # a plain "ok" becomes Status.OK; anything else raises ValueError

    def to_json(self) -> str:
        """The record kept in OUT/.done/ for resuming."""
        return json.dumps({**asdict(self), "status": self.status.value})

    @classmethod
    def from_json(cls, text: str | bytes, student_id: str, chapter: str) -> Grade:
        """A record of an earlier run, for this student and chapter; ContractError when it is spoiled."""
        record = _object(text, "a grade record")
        return cls(student_id, chapter, _score(record.get("score")), _score(record.get("max_score")),
                   _status(record.get("status")), _text(record.get("message"), "message"), _cells(record.get("cells")))

    @classmethod
    def from_result(cls, result: WorkerResult, student_id: str, chapter: str, max_score: float) -> Grade:
        """The grade of a worker's result (a result that is not ok scores 0 out of the chapter's points)."""
        if result.status is not Status.OK:
            return cls(student_id, chapter, 0, max_score, result.status, result.message)
        return cls(student_id, chapter, result.score, result.max_score, result.status, result.message,
                   list(result.cells))
