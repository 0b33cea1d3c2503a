"""Reference implementations and shared helpers for the Training at Speed course.

One module per topic; a chapter's notebook imports what it needs, starting with ``env``.
"""

import os as _os

# The topics are submodules: ``from course_lib import env, models``.
__all__ = [
    "accumulation_checkpointing",
    "activations",
    "attention",
    "capstone",
    "collectives",
    "context_parallel",
    "data_parallel",
    "data_pipelines",
    "env",
    "exercises",
    "floating_point",
    "hybrid",
    "kernels",
    "memory_math",
    "mixed_precision",
    "models",
    "optimizers",
    "orientation",
    "pipeline_parallel",
    "planner",
    "profiling",
    "support",
    "tensor_parallel",
]

# Ask torch to count GPUs through NVML rather than the CUDA runtime: a CUDA-runtime query
# initialises the driver, after which forked processes (the ranks of course_lib.support.dist.launch,
# DataLoader workers) cannot use the GPU.
_os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
