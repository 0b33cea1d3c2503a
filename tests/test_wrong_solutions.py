"""Plausible wrong solutions score 0 on their exercise, graded as the grader grades (tests/wrong_solutions/).

For each chapter with a file of wrong solutions, one kernel runs the course's solution and every
wrong one of each exercise through that exercise's test cell, in the trusted tester with hidden
tests and a fresh secret. The course's solution must pass (the short notebook is a fair context),
every wrong one must fail. One class per chapter, so that pytest-xdist's loadscope spreads the
chapters over the workers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.wrong_solutions.harness import (
    REPLAY_VARIABLE,
    RIGHT,
    Outcome,
    chapters_with_wrong_solutions,
    grade_wrong_solutions,
    wrong_solutions,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="class")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Outcome]:
    """Every outcome of the class's chapter, from one run."""
    chapter = request.cls.chapter
    source = ROOT / "solutions" / chapter / f"{chapter}.ipynb"
    got = grade_wrong_solutions(source, wrong_solutions(chapter), tmp_path_factory.mktemp(chapter))
    return {(o.grade_id, o.label): o for o in got}


class _Chapter:
    chapter = ""

    def test_the_course_solution_passes(self, outcomes: dict[tuple[str, str], Outcome]) -> None:
        failed = [o for o in outcomes.values() if o.label == RIGHT and not o.passed]
        assert not failed, (f"the course's own solution failed in the short notebook ({_replay(failed[0])}):\n"
                            + "\n".join(f"{o.grade_id}: {o.message}" for o in failed))


def _replay(outcome: Outcome) -> str:
    return f"hidden inputs from secret {outcome.secret}; {REPLAY_VARIABLE}={outcome.secret} replays them"


def _chapter_class(chapter: str) -> type:
    cases = [(grade_id, label) for grade_id, variants in wrong_solutions(chapter).items() for label in variants]

    @pytest.mark.parametrize(("grade_id", "label"), cases, ids=[f"{g}-{i}" for i, (g, _) in enumerate(cases)])
    def test_wrong_solution_scores_zero(self: _Chapter, outcomes: dict[tuple[str, str], Outcome], grade_id: str,
                                        label: str) -> None:
        outcome = outcomes[grade_id, label]
        assert not outcome.passed, (f"{self.chapter} {grade_id}: a wrong solution passed its test cell: {label} "
                                    f"({_replay(outcome)})")
        assert outcome.message, f"{self.chapter} {grade_id}: failed without a message for the student: {label}"

    name = "TestWrongSolutions_" + chapter.split("_", 1)[0]
    return type(name, (_Chapter,), {"chapter": chapter, "test_wrong_solution_scores_zero": test_wrong_solution_scores_zero})


for _chapter in chapters_with_wrong_solutions():
    _cls = _chapter_class(_chapter)
    globals()[_cls.__name__] = _cls


def test_a_run_replays_the_secret_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.wrong_solutions.harness import run_secret

    monkeypatch.setenv(REPLAY_VARIABLE, " 19763417 ")
    assert run_secret() == 19763417
    monkeypatch.setenv(REPLAY_VARIABLE, "-5")
    with pytest.raises(ValueError, match="non-negative integer"):
        run_secret()
    monkeypatch.delenv(REPLAY_VARIABLE)
    drawn = {run_secret() for _ in range(8)}
    assert len(drawn) > 1 and all(0 <= s < 2**31 - 1 for s in drawn)
