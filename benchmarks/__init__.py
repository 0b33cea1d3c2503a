"""The GPU benchmark suite: the course's Triton kernels against PyTorch's own, measured in one run.

``benchmarks.cases`` measures (CUDA only), ``benchmarks.report`` writes what was measured as
JSON and markdown; ``python -m benchmarks --help`` says how to run it. Beside it:
``benchmarks.figures`` (the GPU figures the chapters render), ``benchmarks.distributed`` (the
NCCL benchmark, under torchrun), ``benchmarks.checks`` (the
distributed chapters' self-checks, under torchrun), ``benchmarks.notebooks`` (notebook run times)
and ``benchmarks.grading`` (the grader's throughput, on any machine).
"""

__all__ = ["cases", "checks", "distributed", "figures", "grading", "notebooks", "report"]
