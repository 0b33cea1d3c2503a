"""The facts every GPU record starts with: when, on which GPU and driver, with which versions, by which command.

    record = {**run_facts("python -m benchmarks.tiling"), "sections": {...}}
"""

from __future__ import annotations

import datetime as dt
import platform
import subprocess
from typing import Any

import torch

__all__ = ["driver_version", "run_facts"]


def driver_version() -> str:
    """The NVIDIA driver's version, as nvidia-smi reports it ("unknown" without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return out.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def run_facts(command: str) -> dict[str, Any]:
    """Schema, date, GPU (name, SMs, L2), driver, CUDA, cuDNN, Triton and Python versions, and ``command``."""
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "schema_version": 1,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "l2_bytes": props.L2_cache_size,
        "driver": driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": command,
    }
