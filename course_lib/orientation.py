"""Chapter 00 (orientation): the environment check and first back-of-the-envelope timings.

Reference implementations of the chapter's exercises, plus datasheet figures of the GPUs the
course quotes, so that later chapters reason from the same numbers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from course_lib import env

__all__ = [
    "GPUSpec",
    "H100_SXM",
    "H200_SXM",
    "device_report",
    "tensor_read_time",
    "roofline",
]


@dataclass(frozen=True)
class GPUSpec:
    """Vendor figures for one GPU: memory, bandwidths, peak rates and on-chip storage per SM."""

    name: str
    sms: int
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_dense_flops: float
    fp32_flops: float
    l2_bytes: float
    smem_per_sm_bytes: float
    registers_per_sm_bytes: float


# NVIDIA H100 Tensor Core GPU Architecture whitepaper (Hopper) and the H100 datasheet, SXM5 part.
H100_SXM = GPUSpec(
    name="H100 SXM",
    sms=132,
    hbm_bytes=80e9,
    hbm_bytes_per_s=3.35e12,
    bf16_dense_flops=989e12,
    fp32_flops=67e12,
    l2_bytes=50 * 2**20,
    smem_per_sm_bytes=228 * 2**10,
    registers_per_sm_bytes=256 * 2**10,
)

# NVIDIA H200 datasheet: the same Hopper chip as the H100 SXM with 141 GB of HBM3e at 4.8 TB/s.
H200_SXM = dataclasses.replace(H100_SXM, name="H200 SXM", hbm_bytes=141e9, hbm_bytes_per_s=4.8e12)


def device_report() -> dict[str, Any]:
    """What this process runs on, as a dict with exactly these keys.

    device              "cuda" or "cpu" (``str(env.DEVICE)``)
    gpu_name            the GPU's name, or None without a GPU
    sms                 its number of streaming multiprocessors, or None
    gpu_memory_gib      its total memory in GiB (2**30 bytes) rounded to 1 decimal, or None
    cpu_threads         ``torch.get_num_threads()``
    torch               ``torch.__version__``
    triton              Triton's version, or None where it is not installed
    triton_interpreter  True when Triton runs kernels in its CPU interpreter
    """
    report: dict[str, Any] = {
        "device": str(env.DEVICE),
        "gpu_name": None,
        "sms": None,
        "gpu_memory_gib": None,
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": env.triton_version(),
        "triton_interpreter": env.INTERPRET,
    }
    if env.HAS_GPU:
        props = torch.cuda.get_device_properties(0)
        report.update(
            gpu_name=props.name,
            sms=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
        )
    return report


def tensor_read_time(shape: tuple[int, ...], dtype: torch.dtype, bytes_per_s: float) -> float:
    """Seconds to read a tensor of ``shape`` and ``dtype`` once at ``bytes_per_s``; ValueError unless bytes_per_s > 0."""
    if not bytes_per_s > 0:
        raise ValueError(f"bandwidth must be positive, got {bytes_per_s}")
    return math.prod(shape) * dtype.itemsize / bytes_per_s


def roofline(
    flops: float, num_bytes: float, flops_per_s: float, bytes_per_s: float
) -> tuple[float, Literal["compute", "memory"]]:
    """Lower bound on an operation's time and what sets it, when arithmetic and memory traffic overlap fully.

    Returns ``(seconds, bound)``: seconds is the larger of flops / flops_per_s and
    num_bytes / bytes_per_s; bound is "memory" when the memory time is the larger one and
    "compute" otherwise (a tie counts as "compute"). Raises ValueError unless both rates are
    positive and both amounts are at least zero.
    """
    if not (flops_per_s > 0 and bytes_per_s > 0):
        raise ValueError(f"rates must be positive, got flops_per_s={flops_per_s}, bytes_per_s={bytes_per_s}")
    if flops < 0 or num_bytes < 0:
        raise ValueError(f"amounts must not be negative, got flops={flops}, num_bytes={num_bytes}")
    compute_s, memory_s = flops / flops_per_s, num_bytes / bytes_per_s
    if memory_s > compute_s:
        return memory_s, "memory"
    return compute_s, "compute"
