"""Unit tests of course_lib.orientation: the environment report and the timing arithmetic."""

import math

import pytest
import torch

from course_lib import env
from course_lib.orientation import H100_SXM, H200_SXM, device_report, read_gpu_spec, roofline, tensor_read_time


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


@pytest.mark.parametrize(
    "shape, dtype, expected_bytes",
    [
        ((1024, 1024), torch.float32, 4 * 2**20),
        ((3, 5, 7), torch.bfloat16, 210),
        ((), torch.float64, 8),
        ((0, 128), torch.float16, 0),
        ((10,), torch.int8, 10),
        (torch.Size([2, 2]), torch.bool, 4),
    ],
)
def test_tensor_read_time_is_bytes_over_bandwidth(shape: tuple, dtype: torch.dtype, expected_bytes: int) -> None:
    assert tensor_read_time(shape, dtype, 2e9) == pytest.approx(expected_bytes / 2e9, rel=1e-12)


@pytest.mark.parametrize("bandwidth", [0.0, -1.0, math.nan])
def test_tensor_read_time_refuses_a_bad_bandwidth(bandwidth: float) -> None:
    with pytest.raises(ValueError):
        tensor_read_time((4,), torch.float32, bandwidth)


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
