"""The grading harness: what the test cells of the notebooks call, apart from the taught references.

- ``checks``: the comparisons every test cell uses (``assert_close``, ``call``, ``hidden_seed``,
  ``student_side``, ``by_reference`` ...), with failure messages a learner can act on.
- ``ranks``: the one way a test runs code in ``torch.distributed`` ranks (``launch_checked``,
  which replays the checks against the reference under the grader; ``launch_on_cpu``).
- ``kernels``: the judge of the Triton exercises: is the student's kernel launched, once, and does it
  do all the work (``launch_evidence`` where the student's code runs, ``check_kernel_work`` in the tester).
- ``<topic>``: one chapter's cases, expected results, checkers and hints, named like the
  chapter's reference module (``exercises.data_parallel`` goes with ``course_lib.data_parallel``).

A change to grading is made here, together with the hidden tests; a change to what is taught, in
the reference module and its notebook.
"""

__all__ = ["checks", "collectives", "context_parallel", "data_parallel", "data_pipelines", "hybrid", "kernels", "optimizers",
           "pipeline_parallel", "ranks"]
