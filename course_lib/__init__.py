"""Reference implementations and shared helpers for the Training at Speed course.

One module per topic; a chapter's notebook imports what it needs, starting with ``env``.
"""

import os as _os

# Ask torch to count GPUs through NVML rather than the CUDA runtime: a CUDA-runtime query
# initialises the driver, after which forked processes (the ranks of course_lib.dist.launch,
# DataLoader workers) cannot use the GPU.
_os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
