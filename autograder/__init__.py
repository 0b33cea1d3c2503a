"""Grading tools of the course: nbgrader configuration, release, grading and validation.

Modules: ``config`` (the shared nbgrader settings), ``course`` (chapters and graded cells),
``release`` (solutions/ -> notebooks/), ``grade`` (a folder of submissions -> grade tables and
feedback), ``intake`` (what the grader reads of a submission: folder names, files opened without
following links, notebooks checked in a child), ``worker`` (one submission, in a child process),
``sandbox`` (bubblewrap and cgroup limits of a submission's kernel), ``kernel`` (the grading
kernel, with its memory limit), ``tester`` (the trusted process
that runs the test cells), ``agent`` (the kernel's side of a test: answers the tester's calls),
``wire`` (the channel's frames and its safe loader of plain data), ``execute`` (nbgrader's
Execute step, with test cells judged by the tester), ``bench`` (grading throughput),
``feedback`` (feedback without hidden tests, the submission's content inert), ``logs`` (the line
of an nbgrader log that matters), ``validate`` (a notebook's tests, run the way the grader runs
them) and ``cli`` (``python -m autograder``).
"""

__all__ = [
    "agent", "bench", "cli", "config", "course", "execute", "feedback", "grade", "intake", "kernel", "logs", "maths", "pin",
    "release", "sandbox", "tester", "validate", "wire", "worker",
]
