"""Grading tools of the course: nbgrader configuration, release, grading and validation.

One module per concern, shaped by the processes grading runs in:

- the instructor's command: ``cli`` (``python -m autograder``), ``release`` (solutions/ ->
  notebooks/), ``grade`` (a folder of submissions -> grade tables and feedback), ``intake`` (what
  the grader reads of a submission: folder names, files opened without following links, notebooks
  checked in a child), ``validate`` (a notebook's tests, run the way the grader runs them);
- one submission's worker: ``worker`` (nbgrader autograde and feedback, in a child process),
  ``execute`` (nbgrader's Execute step, with test cells judged by the tester), ``feedback``
  (feedback without hidden tests, the submission's content inert), ``maths`` (LaTeX as MathML in
  it), ``logs`` (the line of an nbgrader log that matters);
- the sandboxed kernel: ``kernel`` (the grading kernel), ``agent`` (its side of a test: answers
  the tester's calls); the trusted tester: ``tester`` (runs the test cells), ``wire`` (the
  channel's frames and its safe loader of plain data);
- shared by all of them: ``contracts`` (every hand-off between these processes, and the status
  enum), ``limits`` (the confinement policy: memory, processes, disk), ``sandbox`` (bubblewrap and
  cgroups, which enforce it), ``config`` (the nbgrader settings), ``course`` (chapters and graded cells).

Test tooling (``tests/pin_outputs.py``) and the grading benchmark (``benchmarks.grading``) live
outside the package.
"""

__all__ = [
    "agent", "cli", "config", "contracts", "course", "execute", "feedback", "grade", "intake", "kernel", "limits", "logs",
    "maths", "release", "sandbox", "tester", "validate", "wire", "worker",
]
