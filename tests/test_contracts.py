"""The grader's hand-offs between processes: each contract round-trips, and each reader refuses what breaks it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autograder import contracts
from autograder.contracts import (
    TESTER_READY,
    WORKER_STATUSES,
    CellRequest,
    ContractError,
    Grade,
    KernelSettings,
    Status,
    Verdict,
    WorkerArgs,
    WorkerResult,
)

ROOT = Path(__file__).resolve().parents[1]
# (TesterArgs is used through its module: pytest would take a Test* name for a test class.)
NOT_JSON_OBJECTS = ["", "not json", "[1, 2]", '"ok"', "null", "{" * 100_000]


def test_worker_args_round_trip_through_the_command_line(tmp_path: Path) -> None:
    for args in (
        WorkerArgs(tmp_path / "s", tmp_path / "solutions", "01_floating_point", "s00042", 90, tmp_path / "r.json", 2**30),
        WorkerArgs(tmp_path, tmp_path, "ch", "s00001", 1, tmp_path / "r", 5, sandboxed=False, memory_bytes=7 * 2**30),
    ):
        assert WorkerArgs.parse(args.argv()) == args


@pytest.mark.parametrize("change", [("--cell-timeout", "0"), ("--disk-bytes", "-1"), ("--memory-bytes", "lots")])
def test_worker_args_refuse_a_limit_that_is_not_one(tmp_path: Path, change: tuple[str, str]) -> None:
    argv = WorkerArgs(tmp_path, tmp_path, "ch", "s1", 60, tmp_path / "r", 10, memory_bytes=10).argv()
    argv[argv.index(change[0]) + 1] = change[1]
    with pytest.raises(SystemExit):
        WorkerArgs.parse(argv)


def test_tester_args_and_cell_requests_round_trip(tmp_path: Path) -> None:
    args = contracts.TesterArgs(tmp_path / "01.ipynb", tmp_path / "tester.sock", 120.0)
    assert contracts.TesterArgs.parse(args.argv()) == args
    request = CellRequest("ex01_1_decode", "ab" * 16)
    line = request.to_line()
    assert line.endswith("\n") and line.count("\n") == 1 and CellRequest.from_line(line) == request
    for bad in [*NOT_JSON_OBJECTS, '{"grade_id": 3, "token": "t"}', '{"grade_id": "x"}']:
        with pytest.raises(ContractError):
            CellRequest.from_line(bad)


def test_a_verdict_is_one_line_and_comes_back_equal() -> None:
    for verdict in (
        Verdict("ex1", True, output="printed\nby the test\n"),
        Verdict("ex2", False, ("AssertionError", "got 13.0,\nexpected 15.0"), hidden=True),
        Verdict("ex3", False, ("ValueError", "bad"), traceback="ValueError: bad"),
        Verdict.failure("ex4", "the grader's tester stopped"),
    ):
        line = verdict.to_line()
        assert line.count("\n") == 1, "a newline inside a message must not split the line"
        assert Verdict.from_line(line) == verdict


@pytest.mark.parametrize("record", [
    {"grade_id": "ex1", "passed": "yes"},
    {"grade_id": "ex1", "passed": 1},
    {"grade_id": "ex1", "passed": False, "error": "AssertionError"},
    {"grade_id": "ex1", "passed": False, "error": ["AssertionError", 3]},
    {"grade_id": "ex1", "passed": False, "error": ["A", "b", "c"]},
    {"grade_id": "ex1", "passed": True, "hidden": "no"},
    {"grade_id": None, "passed": True},
    {"grade_id": "ex1", "passed": True, "output": ["x"]},
])
def test_a_malformed_verdict_is_refused(record: dict) -> None:
    with pytest.raises(ContractError):
        Verdict.from_line(json.dumps(record))


def test_a_verdict_line_that_is_not_json_is_refused() -> None:
    for bad in NOT_JSON_OBJECTS:
        with pytest.raises(ContractError):
            Verdict.from_line(bad)


def test_a_worker_result_round_trips_and_only_worker_statuses_are_accepted() -> None:
    ok = WorkerResult(Status.OK, "failed: ex2", 3.0, 5.0, [("ex1", 3.0, 3.0), ("ex2", 0.0, 2.0)])
    assert WorkerResult.from_json(ok.to_json()) == ok
    timeout = WorkerResult(Status.TIMEOUT, "autograde failed: CellTimeoutError")
    assert WorkerResult.from_json(timeout.to_json()) == timeout
    assert {Status.OK, Status.TIMEOUT, Status.ERROR} == WORKER_STATUSES
    for status in set(Status) - WORKER_STATUSES:  # decided before a worker starts: a worker cannot claim them
        with pytest.raises(ContractError, match="cannot come from here"):
            WorkerResult.from_json(json.dumps({"status": status.value}))


@pytest.mark.parametrize("record", [
    {"status": "ok", "score": 1, "max_score": 2},  # no cells
    {"status": "ok", "score": float("nan"), "max_score": 2, "cells": []},
    {"status": "ok", "score": True, "max_score": 2, "cells": []},
    {"status": "ok", "score": "3", "max_score": 2, "cells": []},
    {"status": "ok", "score": 1, "max_score": 2, "cells": [["ex1", 1]]},
    {"status": "ok", "score": 1, "max_score": 2, "cells": [[1, 1, 2]]},
    {"status": "great", "score": 1, "max_score": 2, "cells": []},
    {"status": "error", "message": 5},
])
def test_a_malformed_worker_result_is_refused(record: dict) -> None:
    with pytest.raises(ContractError):
        WorkerResult.from_json(json.dumps(record))


def test_a_grade_record_round_trips_for_its_own_student_only() -> None:
    grade = Grade("alice", "01_floating_point", 4.5, 6.0, Status.OK, "failed: ex01_3", [("ex01_1", 2.0, 2.0)])
    back = Grade.from_json(grade.to_json(), "alice", "01_floating_point")
    assert back == grade and back.status is Status.OK
    assert Grade.from_json(grade.to_json(), "bob", "02_memory_math").student_id == "bob", \
        "who and which chapter come from the caller, never from the record"
    assert Grade("a", "c", 0, 1, "timeout").status is Status.TIMEOUT, "a plain status string becomes the enum"
    with pytest.raises(ValueError):
        Grade("a", "c", 0, 1, "excellent")
    for bad in [*NOT_JSON_OBJECTS, json.dumps({**json.loads(grade.to_json()), "score": None})]:
        with pytest.raises(ContractError):
            Grade.from_json(bad, "alice", "01_floating_point")


def test_a_result_that_is_not_ok_scores_zero_of_the_chapter() -> None:
    grade = Grade.from_result(WorkerResult(Status.ERROR, "the kernel died", 9.0, 9.0), "alice", "ch", 12.0)
    assert (grade.score, grade.max_score, grade.status, grade.cells) == (0, 12.0, Status.ERROR, [])


def test_kernel_settings_round_trip_and_refuse_a_bad_limit(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    for settings in (KernelSettings(), KernelSettings(2**33)):
        settings.write(path)
        assert KernelSettings.read(path) == settings
    for bad in ('{"memory_bytes": -5}', '{"memory_bytes": "8G"}', '{"memory_bytes": 1.5}', "[]", "x"):
        path.write_text(bad)
        with pytest.raises(ContractError):
            KernelSettings.read(path)


def test_the_tester_speaks_the_contract_from_its_command_line(tmp_path: Path) -> None:
    # The real tester process: it announces itself, and answers a request for a test cell its
    # source notebook lacks, or a line that is no request, with a failed verdict instead of dying.
    source = ROOT / "solutions" / "00_orientation" / "00_orientation.ipynb"
    args = contracts.TesterArgs(source, tmp_path / "tester.sock", 5.0)
    lines = CellRequest("no_such_cell", "t").to_line() + "garbage\n"
    done = subprocess.run([sys.executable, "-m", "autograder.tester", *args.argv()], input=lines, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.splitlines()
    assert out[0] == TESTER_READY and len(out) == 3, out
    unknown, garbage = Verdict.from_line(out[1]), Verdict.from_line(out[2])
    assert unknown.grade_id == "no_such_cell" and not unknown.passed and "no test cell" in unknown.error[1]
    assert not garbage.passed and "not JSON" in garbage.error[1]
