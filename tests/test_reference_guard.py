"""Every exercise has a reference the grader can refuse: a course_lib object named like what the exercise defines.

The tester refuses, while an exercise's test runs, every object of a course_lib module imported by
the notebook whose name is a name the exercise's solution cell defines (``Tester.references``). An
exercise whose function is named differently from its reference (``merge_attention_partials``
against ``merge_partials``) could call that reference and pass; this test finds such exercises.
The Triton exercises are judged by another mechanism: which kernels ran and what they called
(``course_lib.exercises.kernels``), so a wrapper around the course's kernel, or a kernel that calls
the course's ``@triton.jit`` helpers, fails there whatever the names (tests/wrong_solutions/09, 10).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autograder import tester as tester_module

ROOT = Path(__file__).resolve().parents[1]
JUDGED_BY_KERNELS = {  # grade_id: the exercise is a Triton kernel, judged by the kernels it launched and called
    "ex09_1_transpose", "ex09_2_tiled_matmul", "ex09_4_grouped_order",
    "ex10_3_attention_step", "ex10_4_flash_forward", "ex10_6_dkdv",
}
CHAPTERS = sorted(p.name for p in (ROOT / "solutions").iterdir() if (p / f"{p.name}.ipynb").is_file())


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_exercise_has_a_reference_to_refuse(chapter: str, tmp_path: Path) -> None:
    tester = tester_module.Tester(ROOT / "solutions" / chapter / f"{chapter}.ipynb", tmp_path / "t.sock", cell_timeout=10)
    try:
        unguarded = {grade_id: names for grade_id, names in tester.exercise_names.items()
                     if names and grade_id not in JUDGED_BY_KERNELS and not tester.references(grade_id)}
    finally:
        tester.server.close()
    assert not unguarded, (f"{chapter}: exercises whose names match no course_lib object, so a solution that calls "
                           f"the reference is not refused: {unguarded}")
