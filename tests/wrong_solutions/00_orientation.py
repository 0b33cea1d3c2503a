"""Plausible wrong solutions of chapter 00's exercises (see harness.py)."""

_REPORT_START = '''
from typing import Any

import torch


def device_report() -> dict[str, Any]:
    report = {
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
        report["gpu_name"] = props.name
        report["sms"] = props.multi_processor_count
'''

_TIMED_CALLS = '''
import statistics
import time


def copy_bandwidth(copy, nbytes, *, clock=time.perf_counter, repeat=5):
    if nbytes <= 0 or repeat < 1:
        raise ValueError(f"need nbytes > 0 and repeat >= 1, got {nbytes}, {repeat}")
    copy()
    times = []
    for _ in range(repeat):
        start = clock()
        copy()
        times.append(clock() - start)
'''

_LINEAR = '''
import torch


def linear_roofline(tokens, d_in, d_out, dtype, flops_per_s, bytes_per_s, bias=True):
    if min(tokens, d_in, d_out) < 1:
        raise ValueError("sizes must be at least 1")
    if not (flops_per_s > 0 and bytes_per_s > 0):
        raise ValueError("rates must be positive")
    flops = 2 * tokens * d_in * d_out + (tokens * d_out if bias else 0)
    elements = tokens * d_in + d_out * d_in + tokens * d_out + (d_out if bias else 0)
    num_bytes = elements * dtype.itemsize
    compute_s, memory_s = flops / flops_per_s, num_bytes / bytes_per_s
'''

_SWEEP = '''
import numpy as np


def fit_launch_overhead(measure, min_bytes, max_bytes, points=16):
    if not (1 <= min_bytes < max_bytes and points >= 2):
        raise ValueError("need 1 <= min_bytes < max_bytes and points >= 2")
    sizes = sorted({round(float(s)) for s in np.geomspace(min_bytes, max_bytes, points)} | {min_bytes, max_bytes})
    seconds = np.array([measure(s) for s in sizes])
    sizes = np.array(sizes, dtype=float)
'''

WRONG = {
    "ex00_1_device_report": {
        "memory in GiB, not rounded": _REPORT_START + '''
        report["gpu_memory_gib"] = props.total_memory / 2**30
    return report
''',
        "memory in GB (10**9 bytes), not GiB": _REPORT_START + '''
        report["gpu_memory_gib"] = round(props.total_memory / 1e9, 1)
    return report
''',
        "device as the torch.device itself": _REPORT_START.replace('"device": str(env.DEVICE)', '"device": env.DEVICE') + '''
        report["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return report
''',
    },
    "ex00_2_copy_bandwidth": {
        "the mean of the timed calls": _TIMED_CALLS + '''
    return 2 * nbytes / (sum(times) / len(times))
''',
        "the fastest call": _TIMED_CALLS + '''
    return 2 * nbytes / min(times)
''',
        "one clock reading around all the timed calls": '''
import time


def copy_bandwidth(copy, nbytes, *, clock=time.perf_counter, repeat=5):
    if nbytes <= 0 or repeat < 1:
        raise ValueError(f"need nbytes > 0 and repeat >= 1, got {nbytes}, {repeat}")
    copy()
    start = clock()
    for _ in range(repeat):
        copy()
    return 2 * nbytes / ((clock() - start) / repeat)
''',
        "counts only the bytes read": _TIMED_CALLS + '''
    return nbytes / statistics.median(times)
''',
        "no untimed first call": '''
import statistics
import time


def copy_bandwidth(copy, nbytes, *, clock=time.perf_counter, repeat=5):
    if nbytes <= 0 or repeat < 1:
        raise ValueError(f"need nbytes > 0 and repeat >= 1, got {nbytes}, {repeat}")
    times = []
    for _ in range(repeat):
        start = clock()
        copy()
        times.append(clock() - start)
    return 2 * nbytes / statistics.median(times)
''',
    },
    "ex00_3_linear_roofline": {
        "a tie counted as memory-bound": _LINEAR + '''
    bound = "memory" if memory_s >= compute_s else "compute"
    return {"flops": flops, "bytes": num_bytes, "seconds": max(compute_s, memory_s), "bound": bound}
''',
        "two bytes per element whatever the dtype": _LINEAR.replace("elements * dtype.itemsize", "elements * 2") + '''
    bound = "memory" if memory_s > compute_s else "compute"
    return {"flops": flops, "bytes": num_bytes, "seconds": max(compute_s, memory_s), "bound": bound}
''',
        "the bias read but its additions not counted": _LINEAR.replace(
            "flops = 2 * tokens * d_in * d_out + (tokens * d_out if bias else 0)", "flops = 2 * tokens * d_in * d_out") + '''
    bound = "memory" if memory_s > compute_s else "compute"
    return {"flops": flops, "bytes": num_bytes, "seconds": max(compute_s, memory_s), "bound": bound}
''',
        "sizes not checked": _LINEAR.replace('''    if min(tokens, d_in, d_out) < 1:
        raise ValueError("sizes must be at least 1")
''', "") + '''
    bound = "memory" if memory_s > compute_s else "compute"
    return {"flops": flops, "bytes": num_bytes, "seconds": max(compute_s, memory_s), "bound": bound}
''',
    },
    "ex00_4_fit_launch_overhead": {
        "the floor of the smallest size, the slope of the largest": _SWEEP + '''
    return float(seconds[0]), float(sizes[-1] / seconds[-1])
''',
        "overhead from the smallest size, bandwidth from the two largest": _SWEEP + '''
    return float(seconds[0]), float((sizes[-1] - sizes[-2]) / (seconds[-1] - seconds[-2]))
''',
        "least squares on absolute errors": _SWEEP + '''
    seconds_per_byte, overhead = np.polyfit(sizes, seconds, 1)
    return float(overhead), float(1.0 / seconds_per_byte)
''',
        "calls the reference": '''
from course_lib import orientation


def fit_launch_overhead(measure, min_bytes, max_bytes, points=16):
    return orientation.fit_launch_overhead(measure, min_bytes, max_bytes, points)
''',
    },
}
