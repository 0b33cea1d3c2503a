"""Chapter 00 (orientation): the environment check and first measurements of a device.

Reference implementations of the chapter's exercises (an environment report, a copy's bandwidth
timed with a given clock, the roofline of a linear layer, a fit of an operation's fixed per-call
cost and bandwidth), plus the figures of the GPUs the course quotes, so that later chapters reason
from the same numbers. Two kinds of figure, kept apart: what a device reports about itself (SMs,
memory, L2, shared memory and registers per SM: read with ``read_gpu_spec`` wherever a GPU is
present) and what only a datasheet gives (peak rates and memory bandwidth, which must be measured
to be known on a real machine).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from course_lib import env

__all__ = [
    "GPUSpec",
    "H100_SXM",
    "H200_SXM",
    "copy_bandwidth",
    "device_report",
    "fit_launch_overhead",
    "linear_roofline",
    "read_gpu_spec",
    "roofline",
]


@dataclass(frozen=True)
class GPUSpec:
    """Figures of one GPU: memory, bandwidth, peak rates and on-chip storage per SM.

    ``reported`` names the fields read from a device (``read_gpu_spec``); the others are datasheet figures.
    """

    name: str
    sms: int
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_dense_flops: float
    fp32_flops: float
    l2_bytes: float
    smem_per_sm_bytes: float
    registers_per_sm_bytes: float
    reported: tuple[str, ...] = ()


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

# NVIDIA H200 datasheet: the same Hopper chip as the H100 SXM with 141 GB of HBM3e at 4.8 TB/s. The
# datasheet gives no L2 size; the course's H200 reports 62914560 bytes (60 MiB) in
# torch.cuda.get_device_properties(0).L2_cache_size, against the H100 SXM's 50 MiB.
H200_SXM = dataclasses.replace(H100_SXM, name="H200 SXM", hbm_bytes=141e9, hbm_bytes_per_s=4.8e12, l2_bytes=60 * 2**20)


def read_gpu_spec(datasheet: GPUSpec, device: int = 0) -> GPUSpec:
    """``datasheet`` with every figure that CUDA device ``device`` reports about itself read from it instead.

    Read: name, SMs, memory, L2 size, shared memory and registers per SM. Kept from the datasheet:
    bandwidth and peak rates, which a device does not report. ``reported`` lists the fields read.
    """
    props = torch.cuda.get_device_properties(device)
    reported = ["name", "sms", "hbm_bytes", "l2_bytes", "smem_per_sm_bytes"]
    registers = getattr(props, "regs_per_multiprocessor", None)  # not in every torch release
    if registers:
        reported.append("registers_per_sm_bytes")
    return dataclasses.replace(
        datasheet,
        name=props.name,
        sms=props.multi_processor_count,
        hbm_bytes=float(props.total_memory),
        l2_bytes=float(props.L2_cache_size),
        smem_per_sm_bytes=float(props.shared_memory_per_multiprocessor),
        registers_per_sm_bytes=float(registers * 4) if registers else datasheet.registers_per_sm_bytes,  # 32-bit each
        reported=tuple(reported),
    )


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


def copy_bandwidth(copy: Callable[[], Any], nbytes: int, *, clock: Callable[[], float] = time.perf_counter,
                   repeat: int = 5) -> float:
    """Bytes per second that ``copy()``, a copy of ``nbytes`` bytes into a buffer of the same size, moves.

    One untimed call first (fresh memory is slow to touch the first time), then ``repeat`` calls,
    each timed alone between two readings of ``clock()``. The rate counts the bytes read and the
    bytes written, over the median time. ValueError unless nbytes > 0 and repeat >= 1.
    """
    if not (nbytes > 0 and repeat >= 1):
        raise ValueError(f"need nbytes > 0 and repeat >= 1, got nbytes={nbytes}, repeat={repeat}")
    copy()
    times = []
    for _ in range(repeat):
        start = clock()
        copy()
        times.append(clock() - start)
    return 2 * nbytes / statistics.median(times)


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


def linear_roofline(tokens: int, d_in: int, d_out: int, dtype: torch.dtype, flops_per_s: float, bytes_per_s: float,
                    bias: bool = True) -> dict[str, Any]:
    """The roofline of a linear layer's forward pass, ``y = x @ w.T + b``: its counts, time bound and bound.

    ``x`` is (tokens, d_in), ``w`` (d_out, d_in), ``b`` (d_out,) when ``bias``, ``y`` (tokens, d_out),
    all of ``dtype``. Returns ``flops`` (a multiply-add counts 2, the bias one add per output),
    ``bytes`` (each tensor read or written once), and ``seconds`` and ``bound`` as ``roofline``
    gives them. ValueError unless the three sizes are at least 1 and both rates positive.
    """
    if min(tokens, d_in, d_out) < 1:
        raise ValueError(f"sizes must be at least 1, got tokens={tokens}, d_in={d_in}, d_out={d_out}")
    flops = 2 * tokens * d_in * d_out + (tokens * d_out if bias else 0)
    elements = tokens * d_in + d_out * d_in + tokens * d_out + (d_out if bias else 0)
    num_bytes = elements * dtype.itemsize
    seconds, bound = roofline(flops, num_bytes, flops_per_s, bytes_per_s)
    return {"flops": flops, "bytes": num_bytes, "seconds": seconds, "bound": bound}


def fit_launch_overhead(measure: Callable[[int], float], min_bytes: int, max_bytes: int,
                        points: int = 16) -> tuple[float, float]:
    """``(overhead seconds, bytes per second)`` of an operation, fitted to ``measure``'s timings of it.

    ``measure(nbytes)`` gives the seconds of one call that moves ``nbytes`` bytes. It is called once
    at each of at most ``points`` whole sizes spread evenly on a log scale from ``min_bytes`` to
    ``max_bytes`` (both ends included); ``seconds = overhead + nbytes / bytes_per_s`` is then fitted
    by least squares on relative errors, so that the microseconds of the small sizes weigh as much
    as the milliseconds of the large ones. ValueError unless 1 <= min_bytes < max_bytes and points >= 2.
    """
    if not (1 <= min_bytes < max_bytes and points >= 2):
        raise ValueError(f"need 1 <= min_bytes < max_bytes and points >= 2, got {min_bytes}, {max_bytes}, {points}")
    sizes = sorted({round(float(s)) for s in np.geomspace(min_bytes, max_bytes, points)} | {min_bytes, max_bytes})
    seconds = [float(measure(s)) for s in sizes]
    # Row i says overhead / t_i + nbytes_i * (1 / bytes_per_s) / t_i = 1: each residual is a relative error.
    rows = np.array([[1.0 / t, s / t] for s, t in zip(sizes, seconds)])
    (overhead, seconds_per_byte), *_ = np.linalg.lstsq(rows, np.ones(len(sizes)), rcond=None)
    return float(overhead), float(1.0 / seconds_per_byte)
