"""The GPU benchmark suite: the course's Triton kernels against PyTorch's own, measured in one run.

``benchmarks.cases`` measures (CUDA only), ``benchmarks.report`` writes what was measured as
JSON and markdown; ``python -m benchmarks --help`` says how to run it. Beside it, the records the
chapters render, one module each: ``benchmarks.figures`` (the GPU figures of chapters 00-04),
``benchmarks.step_graphs`` (a training step eager, compiled and graph-replayed; 03),
``benchmarks.mixed_precision`` (steps per precision and fp8 matmuls; 06),
``benchmarks.cross_entropy`` (the fused cross-entropy; 08), ``benchmarks.gelu_steps`` (bias + GELU with its
arithmetic cut back step by step, toward copy speed; 08), ``benchmarks.tiling`` (bank conflicts
and the grouped order; 09), ``benchmarks.attention`` (FlashAttention beside FA2 and cuDNN; 10),
``benchmarks.flash_steps`` (the forward from the teaching kernel to the Hopper one, step by step; 10),
``benchmarks.gemm`` (cuBLAS rates over a grid of GEMM shapes, the planner's size dependence; 16) and
``benchmarks.capstone`` (the capstone's ablation, one technique added at a time; 16),
``benchmarks.capstone_mfu`` (the capstone's tokens/s and MFU change by change, each with its profile; 16),
``benchmarks.capstone_attention`` (attention at the capstone's shape, in the model's layout and contiguous; 16),
all starting from ``benchmarks.provenance`` (date, GPU, driver, versions). Also:
``benchmarks.distributed`` (the NCCL benchmark, under torchrun), ``benchmarks.checks`` (the
distributed chapters' self-checks, under torchrun; ``python -m benchmarks.checks`` runs them all as a
multi-node job), ``benchmarks.notebooks`` (notebook run times)
and ``benchmarks.grading`` (the grader's throughput, on any machine).
"""

__all__ = [
    "attention", "capstone", "capstone_attention", "capstone_mfu", "cases", "checks", "cross_entropy", "distributed",
    "figures", "flash_steps", "gelu_steps", "gemm", "grading", "mixed_precision", "notebooks", "provenance", "report",
    "step_graphs", "tiling",
]
