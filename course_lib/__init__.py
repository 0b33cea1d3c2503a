"""Reference implementations of the Training at Speed course, and what runs them.

Three kinds of module, three rules for changing them:

- Taught references, one module per chapter topic, read top to bottom after the chapter's exercise;
  changed together with the chapter's notebook (``solutions/NN_name``):

  ===  ==========================  ==================================================================
  ch   notebook                    module(s)
  ===  ==========================  ==================================================================
  00   00_orientation              ``orientation`` (GPU facts, roofline); ``models`` (the course's GPT)
  01   01_floating_point           ``floating_point``
  02   02_memory_math              ``memory_math``
  03   03_profiling                ``profiling``, ``flops`` (FLOP counts, MFU and HFU), ``graphs``
                                  (a training step as a CUDA graph, and its CPU stand-in)
  04   04_activations_optimizers   ``activations``, ``optimizers``
  05   05_data_pipelines           ``data_pipelines``, ``token_data`` (memory-mapped token streams)
  06   06_mixed_precision          ``mixed_precision``, ``fp8`` (scaled fp8 casts and matmuls)
  07   07_accumulation_checkpoint  ``accumulation_checkpointing``
  08   08_fusion                   ``kernels.fusion``
  09   09_tiling_coalescing        ``kernels.tiling_coalescing``, ``kernels.memory_trace`` (loads and
                                  stores, traced), ``kernels.bank_conflicts`` (shared-memory banks)
  10   10_flash_attention          ``attention`` (in PyTorch), ``kernels.flash_attention`` (Triton),
                                  ``kernels.flash_attention_hopper`` (the forward through TMA, sm90),
                                  ``kernels.probes`` (what a kernel calls, which tiles it computes)
  11   11_collectives              ``collectives``
  12   12_data_parallel            ``data_parallel``
  13   13_tensor_parallel          ``tensor_parallel``
  14   14_pipeline_parallel        ``pipeline_parallel``
  15   15_context_parallel         ``context_parallel``
  16   16_hybrid_capstone          ``hybrid`` (meshes, DP x TP), ``planner`` (strategy), ``capstone`` (the run),
                                  ``lm_head_loss`` (LM head and cross-entropy by row chunks, on 08's kernels)
  ===  ==========================  ==================================================================

- ``exercises``: the grading harness the test cells call (``exercises.checks`` for every chapter,
  ``exercises.<topic>`` for one chapter's cases and checkers, ``exercises.ranks`` to run a test in
  ranks); changed together with the hidden tests.
- ``support``: what runs the course without being taught (``support.dist`` launches ranks,
  ``support.torchrun``, ``support.fallback``, ``support.sizes``, ``support.timeline``,
  ``support.comm``, ``support.timing``); changed with its own tests, for every chapter at once.

Ordering rules: a notebook imports ``env`` first (it picks the device, sets ``TRITON_INTERPRET=1``
on a machine without CUDA before any kernel is defined, seeds, filters warnings); ``kernels``
modules import ``env`` themselves for that reason. Taught modules may import ``support`` and each
other (later chapters build on earlier ones); ``support`` imports no taught module (only
``exercises.checks``, for its comparisons and the grader's seam); ``exercises`` may import both.
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
    "flops",
    "fp8",
    "graphs",
    "hybrid",
    "kernels",
    "lm_head_loss",
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
    "token_data",
]

# Ask torch to count GPUs through NVML rather than the CUDA runtime: a CUDA-runtime query
# initialises the driver, after which forked processes (the ranks of course_lib.support.dist.launch,
# DataLoader workers) cannot use the GPU.
_os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
