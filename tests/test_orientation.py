"""Unit tests of course_lib.orientation: the environment report, the bandwidth and overhead measurements, the rooflines."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from course_lib import env
from course_lib.orientation import (
    H100_SXM,
    H200_SXM,
    copy_bandwidth,
    device_report,
    fit_launch_overhead,
    linear_roofline,
    read_gpu_spec,
    roofline,
)


def test_device_report_keys_and_values_follow_env() -> None:
    report = device_report()
    assert list(report) == [
        "device", "gpu_name", "sms", "gpu_memory_gib", "cpu_threads", "torch", "triton", "triton_interpreter",
    ]
    assert report["device"] == ("cuda" if env.HAS_GPU else "cpu")
    assert report["torch"] == torch.__version__
    assert report["triton"] == env.triton_version()
    assert report["triton_interpreter"] is env.INTERPRET
    assert report["cpu_threads"] == torch.get_num_threads()
    assert (report["gpu_name"] is None) == (not env.HAS_GPU)
    assert (report["sms"] is None) == (not env.HAS_GPU)


@pytest.mark.gpu
def test_device_report_on_a_gpu() -> None:
    report = device_report()
    props = torch.cuda.get_device_properties(0)
    assert report["sms"] == props.multi_processor_count > 0
    assert report["gpu_memory_gib"] == round(props.total_memory / 2**30, 1)


@pytest.mark.gpu
def test_the_gpu_spec_reads_what_the_device_reports() -> None:
    props = torch.cuda.get_device_properties(0)
    spec = read_gpu_spec(H200_SXM)
    assert spec.l2_bytes == props.L2_cache_size and spec.sms == props.multi_processor_count
    assert spec.hbm_bytes == props.total_memory and spec.smem_per_sm_bytes == props.shared_memory_per_multiprocessor
    assert {"name", "sms", "hbm_bytes", "l2_bytes"} <= set(spec.reported)
    assert spec.hbm_bytes_per_s == H200_SXM.hbm_bytes_per_s, "bandwidth and peak rates stay the datasheet's"
    if "H200" in props.name:
        assert spec.l2_bytes == H200_SXM.l2_bytes, "the H200's L2, as the course's H200 reported it"


def test_datasheet_specs_say_they_are_datasheet_figures() -> None:
    assert H100_SXM.reported == H200_SXM.reported == ()
    assert H200_SXM.l2_bytes == 62914560 and H100_SXM.l2_bytes == 50 * 2**20


def test_device_report_returns_a_fresh_dict() -> None:
    device_report()["device"] = "changed"
    assert device_report()["device"] == str(env.DEVICE)


def scripted_copy(durations: list[float]) -> tuple:
    """copy() advances a fake clock by the next of ``durations``; clock() reads it; calls counts the copies."""
    now, calls = [0.0], []

    def copy() -> None:
        now[0] += durations[len(calls)]
        calls.append(1)

    return copy, lambda: now[0], calls


def test_copy_bandwidth_counts_reads_and_writes_over_the_median_after_one_untimed_call() -> None:
    copy, clock, calls = scripted_copy([9.0, 2.0, 1.0, 40.0])
    assert copy_bandwidth(copy, 100, clock=clock, repeat=3) == pytest.approx(2 * 100 / 2.0)
    assert len(calls) == 4, "one untimed call, then repeat timed ones"
    copy, clock, calls = scripted_copy([5.0, 3.0])
    assert copy_bandwidth(copy, 7, clock=clock, repeat=1) == pytest.approx(14 / 3.0)


def test_copy_bandwidth_of_a_real_copy_is_positive() -> None:
    src = torch.rand(4096)
    dst = torch.empty_like(src)
    assert copy_bandwidth(lambda: dst.copy_(src), src.numel() * src.element_size()) > 0
    assert torch.equal(dst, src)


@pytest.mark.parametrize("nbytes, repeat", [(0, 3), (-4, 3), (1024, 0)])
def test_copy_bandwidth_refuses_bad_arguments(nbytes: int, repeat: int) -> None:
    copy, clock, _ = scripted_copy([1.0] * 5)
    with pytest.raises(ValueError):
        copy_bandwidth(copy, nbytes, clock=clock, repeat=repeat)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_roofline_counts_the_tensors_and_the_flops_of_a_real_linear(dtype: torch.dtype, bias: bool) -> None:
    tokens, d_in, d_out = 5, 7, 3
    x, w = torch.randn(tokens, d_in, dtype=dtype), torch.randn(d_out, d_in, dtype=dtype)
    b = torch.randn(d_out, dtype=dtype) if bias else None
    y = F.linear(x, w, b)
    got = linear_roofline(tokens, d_in, d_out, dtype, 1e12, 1e12, bias=bias)
    assert got["bytes"] == sum(t.numel() * t.element_size() for t in (x, w, b, y) if t is not None)
    with FlopCounterMode(display=False) as counter:
        F.linear(x, w)  # the matmul alone: the counter leaves out the bias's additions
    assert got["flops"] == counter.get_total_flops() + (tokens * d_out if bias else 0)
    assert (got["seconds"], got["bound"]) == roofline(got["flops"], got["bytes"], 1e12, 1e12)


def test_linear_roofline_bound_moves_with_the_tokens_and_a_tie_is_compute() -> None:
    h200 = (H200_SXM.bf16_dense_flops, H200_SXM.hbm_bytes_per_s)
    assert linear_roofline(1, 768, 3072, torch.bfloat16, *h200)["bound"] == "memory"
    assert linear_roofline(4096, 768, 3072, torch.bfloat16, *h200)["bound"] == "compute"
    counts = linear_roofline(7, 3, 5, torch.float32, 1.0, 1.0)
    tie = linear_roofline(7, 3, 5, torch.float32, float(counts["flops"]), float(counts["bytes"]))
    assert (tie["seconds"], tie["bound"]) == (1.0, "compute")


@pytest.mark.parametrize("args", [(0, 1, 1, 1.0, 1.0), (1, 0, 1, 1.0, 1.0), (1, 1, 0, 1.0, 1.0), (1, 1, 1, 0.0, 1.0),
                                  (1, 1, 1, 1.0, -1.0)])
def test_linear_roofline_refuses_bad_arguments(args: tuple) -> None:
    tokens, d_in, d_out, flops_per_s, bytes_per_s = args
    with pytest.raises(ValueError):
        linear_roofline(tokens, d_in, d_out, torch.float32, flops_per_s, bytes_per_s)


def test_fit_launch_overhead_recovers_an_exact_model_from_a_log_spaced_sweep() -> None:
    sizes: list[int] = []

    def measure(nbytes: int) -> float:
        sizes.append(nbytes)
        return 3e-6 + nbytes / 1e10

    overhead, bytes_per_s = fit_launch_overhead(measure, 10, 10**8, points=12)
    assert overhead == pytest.approx(3e-6, rel=1e-9) and bytes_per_s == pytest.approx(1e10, rel=1e-9)
    assert len(sizes) <= 12 and {10, 10**8} <= set(sizes) and all(type(s) is int for s in sizes)
    ratios = np.diff(np.log(sorted(sizes)))
    assert ratios.max() < 1.1 * ratios.min(), "sizes spread evenly on a log scale"


def test_fit_launch_overhead_weighs_relative_errors() -> None:
    # 2 % noise: the largest sizes' noise is worth far more than the overhead, so an absolute fit fails.
    def measure(nbytes: int) -> float:
        return (5e-6 + nbytes / 2e10) * (1 + np.random.default_rng(nbytes).uniform(-0.02, 0.02))

    overhead, bytes_per_s = fit_launch_overhead(measure, 12, 2**26)
    assert overhead == pytest.approx(5e-6, rel=0.05) and bytes_per_s == pytest.approx(2e10, rel=0.05)
    sizes = sorted({round(float(s)) for s in np.geomspace(12, 2**26, 16)})
    seconds_per_byte, absolute_overhead = np.polyfit(sizes, [measure(s) for s in sizes], 1)
    assert abs(absolute_overhead / 5e-6 - 1) > 0.1, "the test's noise no longer tells the two fits apart"


@pytest.mark.parametrize("args", [(0, 10, 16), (10, 10, 16), (10, 5, 16), (1, 10, 1)])
def test_fit_launch_overhead_refuses_bad_ranges(args: tuple) -> None:
    with pytest.raises(ValueError):
        fit_launch_overhead(lambda nbytes: 1e-6, *args)


def test_roofline_picks_the_slower_of_compute_and_memory() -> None:
    # A 4096^3 bf16 matmul on an H200: 2 n^3 flops, 3 n^2 * 2 bytes -> compute bound.
    n = 4096
    t, bound = roofline(2 * n**3, 3 * n * n * 2, H200_SXM.bf16_dense_flops, H200_SXM.hbm_bytes_per_s)
    assert bound == "compute" and t == pytest.approx(2 * n**3 / 989e12)
    # Adding two fp32 vectors: 1 flop per 12 bytes -> memory bound.
    t, bound = roofline(1e6, 12e6, 1e12, 1e12)
    assert (t, bound) == (pytest.approx(12e-6), "memory")
    assert roofline(10.0, 10.0, 1.0, 1.0) == (10.0, "compute")
    assert roofline(0.0, 0.0, 1.0, 1.0) == (0.0, "compute")
    assert roofline(0.0, 5.0, 1.0, 1.0) == (5.0, "memory")


@pytest.mark.parametrize("args", [(1, 1, 0, 1), (1, 1, 1, 0), (-1, 1, 1, 1), (1, -1, 1, 1)])
def test_roofline_refuses_bad_arguments(args: tuple) -> None:
    with pytest.raises(ValueError):
        roofline(*args)


def test_specs_are_consistent() -> None:
    # Same Hopper chip, more and faster memory: the ridge point moves to a lower intensity.
    assert H100_SXM.bf16_dense_flops == H200_SXM.bf16_dense_flops
    assert H200_SXM.hbm_bytes_per_s > H100_SXM.hbm_bytes_per_s
    ridge = H200_SXM.bf16_dense_flops / H200_SXM.hbm_bytes_per_s
    assert 200 < ridge < 210
