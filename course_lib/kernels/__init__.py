"""Triton kernels of the course, one module per chapter (import ``course_lib.env`` first: each module does).

- ``fusion`` (chapter 08): vector add, fused bias + GELU, row softmax (online for wide rows), fused Adam.
- ``tiling_coalescing`` (chapter 09): coalesced and strided access, the tiled matmul.
- ``flash_attention`` (chapter 10): FlashAttention forward and backward.
"""

__all__ = ["flash_attention", "fusion", "tiling_coalescing"]
