"""The GPU benchmark suite: the course's Triton kernels against PyTorch's own, measured in one run.

``benchmarks.cases`` measures (CUDA only), ``benchmarks.report`` writes what was measured as
JSON and markdown; ``python -m benchmarks --help`` says how to run it.
"""

__all__ = ["cases", "distributed", "notebooks", "report"]
