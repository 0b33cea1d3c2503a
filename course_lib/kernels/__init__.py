"""Triton kernels of the course, one module per chapter (import ``course_lib.env`` first: each module does).

- ``fusion`` (chapter 08): vector add, fused bias + GELU, row softmax (online for wide rows), fused
  cross-entropy over a large vocabulary (forward and backward, or both in one launch), fused Adam.
- ``tiling_coalescing`` (chapter 09): coalesced and strided access, the tiled matmul; with
  ``memory_trace`` (every load and store of a kernel, under the interpreter) and ``bank_conflicts``
  (shared-memory banks and a conflict-free tile layout).
- ``flash_attention`` (chapter 10): FlashAttention forward and backward; ``flash_attention_hopper``
  the forward through TMA tensor descriptors on sm90, with the same backward or, switched on, a
  Hopper backward (TMA, the dK/dV and dQ programs in one launch).
- ``fused_mlp`` (chapter 16's capstone): the transformer MLP with its GELU in the epilogues of
  chapter 09's matmul (chapter 08's fitted erfc), forward and backward; ``gelu_op`` chapter 08's
  bias + GELU kernels as a custom op that ``torch.compile`` keeps whole, and the MLP that uses them.
- ``probes`` (chapter 10's tests and experiments): is a kernel written, which course kernels it calls, which
  tiles it computes and masks under the interpreter.
"""

__all__ = ["flash_attention", "flash_attention_hopper", "fused_mlp", "fusion", "gelu_op", "probes", "tiling_coalescing"]
