"""Grading tools of the course: nbgrader configuration, release, grading and validation.

Modules: ``config`` (the shared nbgrader settings), ``course`` (chapters and graded cells),
``release`` (solutions/ -> notebooks/), ``grade`` (a folder of submissions -> grade tables
and feedback), ``worker`` (one submission, in a child process), ``sandbox`` (bubblewrap and
cgroup limits of a submission's kernel), ``kernel`` (the grading kernel and its judge),
``execute`` (nbgrader's Execute step, scored from the judge's verdicts), ``bench`` (grading
throughput), ``feedback`` (feedback without hidden tests), ``logs`` (the line of an nbgrader
log that matters), ``validate`` (a notebook's tests, run the way the grader runs them) and
``cli`` (``python -m autograder``).
"""
