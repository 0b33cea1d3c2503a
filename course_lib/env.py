"""The course's runtime environment, decided once per process.

Import this before anything that defines a Triton kernel: on a machine without a
CUDA device it switches Triton to its CPU interpreter (``TRITON_INTERPRET=1``),
which Triton reads when a kernel is decorated.

    from course_lib import env
    print(env.banner())
    n = env.pick(cpu=256, gpu=8192)
"""

from __future__ import annotations

import os
import random
import subprocess
import warnings
from typing import TypeVar

import numpy as np
import torch

__all__ = [
    "HAS_GPU",
    "DEVICE",
    "INTERPRET",
    "SEED",
    "quiet_warnings",
    "seed_everything",
    "pick",
    "triton_version",
    "banner",
]

T = TypeVar("T")

HAS_GPU: bool = torch.cuda.is_available()
DEVICE: torch.device = torch.device("cuda" if HAS_GPU else "cpu")
if not HAS_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
# torch.profiler's backend (Kineto) writes "profiler_start/stop" lines to the process's stderr on
# every profile, which nbgrader would score as a failing test cell. Level 6 silences its own log;
# it is read when the first profile starts, so it is set here, before any chapter profiles.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
SEED: int = 0

# Noise that is not about the student's code. nbgrader scores a test cell that writes to
# stderr as failed, so these must stay quiet. Each filter names what it silences.
_QUIET = [
    # Triton's interpreter and torch both warn about features that are fine for the course.
    (r".*TF32.*", UserWarning),
    (r".*does not have many workers.*", UserWarning),
    (r".*Attempting to run cuBLAS, but there was no current CUDA context.*", UserWarning),
    (r".*torch\.cpu\.amp\.autocast.*", FutureWarning),
    (r".*torch\.cuda\.amp\..*", FutureWarning),
    # torch.profiler on CUDA, when a schedule-less profile ends: a note about its own bookkeeping.
    (r".*Profiler clears events at the end of each cycle.*", UserWarning),
    # torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor to *_single; the GPU
    # runners' torch 2.11 has only the old names, which the course therefore keeps using.
    (r".*torch\.distributed\.\w+. is deprecated\. Please use .torch\.distributed\.\w+_single.*", FutureWarning),
]


# Libraries whose own deprecation notices are not about the student's code (a DeprecationWarning is
# attributed to the module of the frame ``stacklevel`` names: the library's, or the caller's).
_QUIET_DEPRECATIONS = (r"(?:torch|triton|numpy|matplotlib|tqdm|jupyter_client|jupyter_core|ipykernel|IPython|traitlets|zmq)"
                       r"(?:\.|$)")


def quiet_warnings() -> None:
    """Silence the known-harmless warnings listed in ``_QUIET``, and deprecations raised inside libraries.

    A DeprecationWarning attributed to the student's own code (the notebook, ``__main__``) still shows.
    """
    for pattern, category in _QUIET:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=_QUIET_DEPRECATIONS)


def seed_everything(seed: int = SEED) -> None:
    """Seed Python, NumPy and torch (all devices) so that runs repeat."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick(cpu: T, gpu: T) -> T:
    """Return the size preset for this machine: ``gpu`` with a CUDA device, ``cpu`` otherwise."""
    return gpu if HAS_GPU else cpu


def triton_version() -> str | None:
    """Triton's version, or None where Triton is not installed (it ships for Linux only)."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _gpu_description() -> str:
    """GPU 0's name and memory, read through nvidia-smi so that CUDA is not initialised.

    A process that has initialised CUDA can no longer fork ranks or workers that use the GPU,
    and the banner is the first cell of every notebook.
    """
    if not torch.cuda.is_initialized():
        try:
            out = subprocess.run(
                ["nvidia-smi", "-i", "0", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout
            name, mib = (part.strip() for part in out.strip().rsplit(",", 1))
            return f"{name} ({int(mib) / 1024:.0f} GiB)"
        except (OSError, subprocess.SubprocessError, ValueError):
            pass  # no nvidia-smi here: ask CUDA itself
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"


def banner() -> str:
    """One line saying what this process runs on: device, torch, triton and its mode."""
    if HAS_GPU:
        where = _gpu_description()
    else:
        where = f"CPU ({torch.get_num_threads()} threads)"
    tv = triton_version()
    mode = "not installed" if tv is None else f"{tv}, {'interpreter' if INTERPRET else 'compiled'}"
    return f"device: {where} | torch {torch.__version__} | triton {mode} | seed {SEED}"


quiet_warnings()
seed_everything()
# In a notebook: after every cell, note which of the notebook's functions a failing cell used,
# so that the lecture cells below fall back to the reference (course_lib.support.fallback).
from course_lib.support import fallback as _fallback  # noqa: E402 - after the environment above is set

_fallback.watch_cells()
