"""The grading harness: what the test cells of the notebooks call, apart from the taught references.

``checks`` holds the comparisons every test cell uses (``assert_close``, ``call``, ``hidden_seed``,
``student_side`` ...); ``<topic>`` holds one chapter's training cases, expected results, checkers
and hints, named like the chapter's reference module (``exercises.data_parallel`` goes with
``course_lib.data_parallel``). A change to grading is made here, with the hidden tests; a change to
what is taught, in the reference module and its notebook.
"""

__all__ = ["checks"]
