"""Self-checks of the distributed chapters under ``torchrun``, one module per chapter.

Each module defines ``check(small: bool) -> dict``, which runs in every rank of an initialised
process group: it compares the chapter's parallel algorithms with their single-process references
and PyTorch's own through ``course_lib.support.torchrun.report_check`` (rank 0 prints one
``CHECK <name> ok max_abs_err=<x>`` line each) and returns what it measured, which
``entry_main`` prints as one ``RESULT <json>`` line. Run one with

    torchrun --standalone --nproc_per_node N -m benchmarks.checks.<chapter> [--small]

``make multi-gpu`` runs them all, then the NCCL benchmark (``benchmarks.distributed``).
"""

__all__ = ["CHAPTERS"]

# In the order of the course; each is a module of this package.
CHAPTERS = ("collectives", "data_parallel", "tensor_parallel", "pipeline_parallel", "context_parallel", "hybrid")
