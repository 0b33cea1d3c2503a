"""benchmark() warms up, repeats and summarises; it synchronises on CUDA. The chapter 03 helpers:
time_calls on a simulated device, reading profiles and traces, and the roofline arithmetic."""

import math
import os
import time
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from course_lib import profiling
from course_lib.orientation import H200_SXM
from course_lib.profiling import (
    A100_SXM,
    SimulatedDevice,
    Timing,
    achieved_rates,
    annotation_ranges,
    arithmetic_intensity,
    attention_flops_bytes,
    benchmark,
    classify_bound,
    elementwise_flops_bytes,
    load_trace,
    machine_balance,
    matmul_flops_bytes,
    memory_timeline,
    peak_flops,
    roofline_gaps,
    roofline_point,
    softmax_flops_bytes,
    time_calls,
    top_ops,
)


def test_counts_warmup_and_repeats() -> None:
    calls = []
    timing = benchmark(lambda: calls.append(1), warmup=2, repeat=5, device="cpu")
    assert len(calls) == 7 and len(timing.times) == 5


class FakeClock:
    """A perf_counter that only moves when told: CPU timings checked exactly, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr("course_lib.profiling.time", SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def test_measures_what_the_call_took(clock: FakeClock) -> None:
    durations = iter([0.5, 0.01, 0.03, 0.02, 0.05, 0.04])  # the first call is the warm-up
    timing = benchmark(lambda: clock.advance(next(durations)), warmup=1, repeat=5, device="cpu")
    assert timing.times == pytest.approx([0.01, 0.03, 0.02, 0.05, 0.04]), "the warm-up call is not timed"
    assert timing.median == pytest.approx(0.03) and timing.minimum == pytest.approx(0.01)
    lo, hi = timing.spread
    assert timing.minimum <= lo <= timing.median <= hi


def test_measures_a_real_sleep() -> None:
    # A sleep lasts at least what it was asked for; the upper bound is for a broken timer only (load may stretch it).
    timing = benchmark(time.sleep, 0.01, warmup=0, repeat=5, device="cpu")
    assert 0.009 < timing.median < 5


def test_timing_summary() -> None:
    t = Timing([3e-3, 1e-3, 2e-3])
    assert t.median == 2e-3 and t.minimum == 1e-3
    assert str(t).startswith("2 ms median")
    assert Timing([5e-6]).spread == (5e-6, 5e-6)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="repeat >= 1"):
        benchmark(lambda: None, repeat=0)
    with pytest.raises(ValueError, match="calls >= 1"):
        benchmark(lambda: None, calls=0)


def test_amortised_repeats_report_seconds_per_call(clock: FakeClock) -> None:
    calls = []
    timing = benchmark(lambda: (calls.append(1), clock.advance(0.002)), warmup=1, repeat=3, calls=4, device="cpu")
    assert len(calls) == 1 + 3 * 4 and len(timing.times) == 3
    assert timing.times == pytest.approx([0.002] * 3), "each repeat's time is divided by its number of calls"


@pytest.mark.gpu
def test_cuda_timing_waits_for_the_kernel() -> None:
    a = torch.randn(4096, 4096, device="cuda")
    timing = benchmark(torch.mm, a, a, warmup=2, repeat=5)
    # A 4096^3 matmul is 137 GFLOP: no GPU does it in under 50 us, so a launch-only time would show.
    assert timing.median > 50e-6


def _do_bench_median(fn: object) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["add 1M fp32", "matmul 512 bf16", "matmul 2048 bf16"])
def test_cuda_timing_agrees_with_do_bench(case: str) -> None:
    # An event pair around one call on an idle stream also counts the host's launch gap: on the
    # H200 a 1M-element add read 16 us that way against 8 us with do_bench. The course's timer
    # must read what do_bench reads, within 15%.
    if case.startswith("add"):
        x, y = torch.randn(2**20, device="cuda"), torch.randn(2**20, device="cuda")
        fn = lambda: torch.add(x, y)  # noqa: E731
    else:
        n = int(case.split()[1])
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        fn = lambda: torch.mm(a, a)  # noqa: E731
    ours = benchmark(fn, warmup=10, repeat=200).median
    theirs = _do_bench_median(fn)
    assert abs(ours / theirs - 1) < 0.15, f"{case}: benchmark {ours * 1e6:.1f} us, do_bench {theirs * 1e6:.1f} us"


def test_hold_covers_the_launch_with_margin_and_a_cap() -> None:
    # 1,000 cycles per microsecond (a 1 GHz clock): 1.5 x the launch time plus 20 us, capped.
    assert profiling.hold_cycles(0.0, 1000.0) == 20_000
    assert profiling.hold_cycles(200e-6, 1000.0) == 320_000
    assert profiling.hold_cycles(5.0, 1000.0) == int(profiling.MAX_HOLD_SECONDS * 1e9)


def test_host_seconds_times_the_run_and_not_the_waits() -> None:
    import time

    log = []

    def run() -> None:
        log.append("run")
        time.sleep(0.002)

    def slow_sync() -> None:
        log.append("sync")
        time.sleep(0.03)  # a GPU still busy: not the host's time

    seconds = profiling.host_seconds(run, repeats=3, sync=slow_sync)
    assert 0.002 <= seconds < 0.02, f"{seconds * 1e3:.1f} ms: the syncs (30 ms each) leaked into the timing"
    assert log == ["sync", "run"] * 3 + ["sync"], log


@pytest.mark.gpu
def test_cuda_timing_leaves_a_slow_hosts_launch_outside() -> None:
    # 300 us of Python before a kernel of a few microseconds: the L2 flush alone (tens of us) would not
    # cover it, and the interval would hold the GPU's idle wait for the host.
    x, y = torch.randn(2**20, device="cuda"), torch.randn(2**20, device="cuda")

    def slow_launch() -> torch.Tensor:
        time.sleep(3e-4)
        return torch.add(x, y)

    fast = benchmark(lambda: torch.add(x, y), warmup=5, repeat=50).median
    slow = benchmark(slow_launch, warmup=5, repeat=50).median
    assert slow < 1.5 * fast + 5e-6, f"{slow * 1e6:.1f} us with 300 us of Python against {fast * 1e6:.1f} us without"


@pytest.mark.gpu
def test_cuda_timing_flushes_l2_unless_told_not_to() -> None:
    # 8 MiB read + 8 MiB written fits in any recent GPU's L2: without the flush, back-to-back
    # copies are served from the cache and run faster than with it.
    src = torch.randn(2**21, device="cuda")
    dst = torch.empty_like(src)
    cold = benchmark(dst.copy_, src, warmup=5, repeat=100).median
    warm = benchmark(dst.copy_, src, warmup=5, repeat=100, flush_l2=False, calls=20).median
    assert warm < cold, f"warm L2 {warm * 1e6:.1f} us is not below flushed {cold * 1e6:.1f} us"


@pytest.mark.gpu
def test_cuda_graph_replays_time_the_same_work() -> None:
    x = torch.randn(2**20, device="cuda")
    out = torch.empty_like(x)
    direct = benchmark(torch.mul, x, 2.0, out=out, warmup=5, repeat=50, calls=10).median
    graphed = benchmark(torch.mul, x, 2.0, out=out, warmup=5, repeat=50, calls=10, cuda_graph=True).median
    assert torch.equal(out, x * 2.0), "the replayed graph wrote the same result"
    # Launched from Python, back-to-back multiplies of 4 MiB wait for the host; replayed, they do not.
    assert 0.3e-6 < graphed <= direct * 1.1, f"graph {graphed * 1e6:.2f} us against direct {direct * 1e6:.2f} us"


# ---- time_calls on a simulated asynchronous device -------------------------------------------


def test_simulated_device_queues_work() -> None:
    dev = SimulatedDevice(launch_overhead=1e-5)
    dev.launch(1e-3)
    dev.launch(2e-3)
    assert dev.clock() == pytest.approx(2e-5)  # the host only paid for two launches
    dev.sync()
    assert dev.clock() == pytest.approx(1e-5 + 3e-3)  # the kernels ran back to back
    dev.host_work(1.0)
    dev.launch(1e-3)  # the device was idle: this kernel starts at its launch
    dev.sync()
    assert dev.clock() == pytest.approx(1e-5 + 3e-3 + 1.0 + 1e-5 + 1e-3)
    assert (dev.launches, dev.syncs) == (3, 2)
    with pytest.raises(ValueError):
        dev.launch(-1.0)


def test_time_calls_with_sync_measures_the_kernels() -> None:
    dev = SimulatedDevice(launch_overhead=1e-5)
    durations = iter([5.0, 5.0, 1e-3, 2e-3, 3e-3])  # two slow warm-up calls, then three timed ones
    median, times = time_calls(lambda: dev.launch(next(durations)), warmup=2, repeat=3, clock=dev.clock, sync=dev.sync)
    assert times == pytest.approx([1e-5 + 1e-3, 1e-5 + 2e-3, 1e-5 + 3e-3])
    assert median == pytest.approx(1e-5 + 2e-3)
    assert dev.launches == 5


def test_time_calls_without_sync_measures_launches() -> None:
    dev = SimulatedDevice(launch_overhead=1e-5)
    _, times = time_calls(lambda: dev.launch(1e-3), warmup=0, repeat=4, clock=dev.clock)
    assert times == pytest.approx([1e-5] * 4)


def test_time_calls_median_ignores_an_outlier_and_averages_the_middle_pair() -> None:
    dev = SimulatedDevice(launch_overhead=0.0)
    durations = iter([1e-3, 1e-3, 9e-3, 2e-3])
    median, times = time_calls(lambda: dev.launch(next(durations)), warmup=0, repeat=4, clock=dev.clock, sync=dev.sync)
    assert times == pytest.approx([1e-3, 1e-3, 9e-3, 2e-3])
    assert median == pytest.approx(1.5e-3), "the mean of the two middle durations, not the mean of all four"


def test_time_calls_with_perf_counter_and_sleep() -> None:
    median, times = time_calls(lambda: time.sleep(0.005), warmup=1, repeat=3)
    assert len(times) == 3 and all(0.004 < t < 5 for t in times) and median in times


def test_time_calls_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="repeat >= 1"):
        time_calls(lambda: None, repeat=0)
    with pytest.raises(ValueError, match="warmup >= 0"):
        time_calls(lambda: None, warmup=-1)


# ---- reading profiles and traces ------------------------------------------------------------


def _rows(**values: float) -> list[SimpleNamespace]:
    return [SimpleNamespace(key=name, self_cpu_time_total=v, count=1) for name, v in values.items()]


def test_top_ops_on_synthetic_rows() -> None:
    rows = _rows(**{"aten::mm": 50.0, "aten::add": 10.0, "aten::gelu": 50.0, "aten::copy_": 1.0})
    assert top_ops(rows, k=3) == [("aten::gelu", 50.0), ("aten::mm", 50.0), ("aten::add", 10.0)]
    assert top_ops(rows, k=10)[-1] == ("aten::copy_", 1.0)
    assert top_ops(rows, by="count", k=1)[0][1] == 1
    with pytest.raises(ValueError):
        top_ops(rows, k=0)


def test_top_ops_reads_new_device_names_for_old_cuda_names() -> None:
    rows = [SimpleNamespace(key="k", self_device_time_total=3.0)]
    assert top_ops(rows, by="self_cuda_time_total") == [("k", 3.0)]


def _small_profile(tmp_path) -> tuple:
    a = torch.randn(128, 128)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, record_function("work"):
        b = a @ a
        c = b + 1
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    return prof, path, c


def test_top_ops_on_a_real_profile(tmp_path, recwarn) -> None:
    prof, _, _ = _small_profile(tmp_path)
    by_total = top_ops(prof, by="cpu_time_total", k=50)
    names = [name for name, _ in by_total]
    assert "aten::mm" in names and "work" in names
    assert by_total[0][0] == "work"  # the range encloses everything else
    assert top_ops(prof.key_averages(), k=50) == top_ops(prof, k=50)
    assert top_ops(prof, by="self_cuda_time_total", k=1)[0][1] == 0  # no CUDA here, and no warning
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


def test_trace_ranges_and_memory(tmp_path) -> None:
    _, path, _ = _small_profile(tmp_path)
    events = load_trace(path)
    ranges = annotation_ranges(events)
    assert [name for name, _, _ in ranges] == ["work"] and ranges[0][2] > 0
    times, allocated = memory_timeline(events, "cpu")
    assert len(times) == len(allocated) >= 2 and times == sorted(times)
    assert max(allocated) >= 2 * 128 * 128 * 4  # b and c were alive together
    assert memory_timeline(events, "cuda") == ([], [])


def test_kineto_is_quiet() -> None:
    assert os.environ.get("KINETO_LOG_LEVEL") is not None


# ---- roofline arithmetic --------------------------------------------------------------------


def test_flops_bytes_formulas() -> None:
    assert matmul_flops_bytes(2, 3, 4, torch.float32) == (48, (8 + 12 + 6) * 4)
    assert matmul_flops_bytes(2, 3, 4, torch.bfloat16, batch=5) == (240, 5 * 26 * 2)
    assert elementwise_flops_bytes(1000, torch.float32) == (1000, 12_000)
    assert elementwise_flops_bytes(10, torch.float16, n_inputs=1, flops_per_element=8) == (80, 40)
    assert softmax_flops_bytes(4, 8, torch.float32) == (160, 256)


def test_attention_flops_bytes() -> None:
    b, h, s, d = 2, 3, 8, 16
    flops, nbytes = attention_flops_bytes(b, h, s, d, torch.bfloat16)
    assert flops == 2 * matmul_flops_bytes(s, s, d, torch.bfloat16, batch=b * h)[0]
    assert nbytes == 4 * b * h * s * d * 2
    assert attention_flops_bytes(b, h, s, d, torch.bfloat16, causal=True)[0] == 4 * d * (s * (s + 1) // 2) * b * h
    unfused = attention_flops_bytes(b, h, s, d, torch.float32, causal=True, fused=False)[1]
    assert unfused == (4 * b * h * s * d + 4 * b * h * s * s) * 4
    # Fused attention at GPT-2 small's shape is far above an H200's ridge; unfused sits below it.
    f, by = attention_flops_bytes(8, 12, 1024, 64, torch.bfloat16)
    f2, by2 = attention_flops_bytes(8, 12, 1024, 64, torch.bfloat16, fused=False)
    ridge = machine_balance(H200_SXM.bf16_dense_flops, H200_SXM.hbm_bytes_per_s)
    assert arithmetic_intensity(f, by) > ridge > arithmetic_intensity(f2, by2)


def test_intensity_balance_and_peaks() -> None:
    assert arithmetic_intensity(12.0, 4.0) == 3.0
    assert arithmetic_intensity(0.0, 4.0) == 0.0
    with pytest.raises(ValueError):
        arithmetic_intensity(1.0, 0.0)
    assert machine_balance(A100_SXM.bf16_dense_flops, A100_SXM.hbm_bytes_per_s) == pytest.approx(153.0, rel=1e-3)
    with pytest.raises(ValueError):
        machine_balance(1.0, 0.0)
    assert peak_flops(A100_SXM, torch.bfloat16) == 312e12 == peak_flops(A100_SXM, torch.float16)
    assert peak_flops(H200_SXM, torch.float32) == 67e12
    with pytest.raises(ValueError):
        peak_flops(A100_SXM, torch.int8)


def test_achieved_rates() -> None:
    assert achieved_rates(2e9, 4e9, 0.5) == (4e9, 8e9)
    assert achieved_rates(0, 0, 1.0) == (0.0, 0.0)
    for bad in [(1.0, 1.0, 0.0), (1.0, 1.0, -1.0), (-1.0, 1.0, 1.0), (1.0, -1.0, 1.0)]:
        with pytest.raises(ValueError):
            achieved_rates(*bad)


def test_classify_bound() -> None:
    peak, bw = H200_SXM.bf16_dense_flops, H200_SXM.hbm_bytes_per_s
    assert classify_bound(*elementwise_flops_bytes(2**20, torch.bfloat16), peak, bw) == "memory"
    assert classify_bound(*matmul_flops_bytes(4096, 4096, 4096, torch.bfloat16), peak, bw) == "compute"
    assert classify_bound(10.0, 10.0, 1.0, 1.0) == "compute"  # a tie counts as compute


def test_roofline_point() -> None:
    point = roofline_point(1e12, 1e9, 0.01, 100e12, 1e12)  # intensity 1000 > balance 100
    assert list(point) == [
        "intensity", "balance", "bound", "attainable_flops_per_s", "achieved_flops_per_s", "fraction_of_roof",
    ]
    assert point["intensity"] == 1000 and point["balance"] == 100 and point["bound"] == "compute"
    assert point["attainable_flops_per_s"] == 100e12 and point["achieved_flops_per_s"] == 1e14
    assert point["fraction_of_roof"] == pytest.approx(1.0)
    copy = roofline_point(0.0, 2e9, 0.004, 100e12, 1e12)  # a copy: no FLOPs, half the bandwidth
    assert copy["bound"] == "memory" and copy["attainable_flops_per_s"] == 0.0
    assert copy["fraction_of_roof"] == pytest.approx(0.5)
    tie = roofline_point(100.0, 1.0, 1.0, 100.0, 1.0)
    assert tie["bound"] == "compute" and math.isclose(tie["fraction_of_roof"], 1.0)
    bad_arguments = [(1.0, 0.0, 1.0, 1.0, 1.0), (1.0, 1.0, 0.0, 1.0, 1.0), (-1.0, 1.0, 1.0, 1.0, 1.0), (1.0, 1.0, 1.0, 0.0, 1.0)]
    for bad in bad_arguments:
        with pytest.raises(ValueError):
            roofline_point(*bad)


def test_plot_timings_shows_medians_with_their_spread_from_zero() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib.profiling import Timing, plot_timings

    fig, ax = plt.subplots()
    slow = Timing([0.050, 0.052, 0.051, 0.090])
    plot_timings(ax, [1, 2], [Timing([0.049, 0.050, 0.051]), slow], label="ms")
    line = ax.lines[0]
    assert list(line.get_ydata()) == pytest.approx([50.0, slow.median * 1e3]), "the markers are the medians, in ms"
    assert ax.get_ylim()[0] == 0, "a timing axis starts at zero, so a 2% change does not look like a cliff"
    assert ax.get_ylim()[1] >= slow.spread[1] * 1e3, "the p90 whisker of the slowest point is inside the axis"
    plot_timings(ax, [1, 2], [slow, slow], relative_to=slow)
    assert any(list(line.get_ydata()) == pytest.approx([1.0, 1.0]) for line in ax.lines), "relative_to divides by its median"
    plt.close(fig)


def test_roofline_gaps_rank_by_the_time_above_the_roof() -> None:
    costs = {"aten::mm": (2, 2_000, 100), "aten::add": (3, 10, 1_000), "aten::copy_": (1, 0, 500), "only_here": (1, 1, 1)}
    seconds = {"aten::mm": 25.0, "aten::add": 12.0, "aten::copy_": 5.0, "only_timed": 3.0}
    rows = roofline_gaps(costs, seconds, peak_flops_per_s=100.0, peak_bytes_per_s=100.0)
    assert rows == [("aten::add", "memory", 2.0), ("aten::mm", "compute", 5.0)][::-1] + [("aten::copy_", "memory", 0.0)]
    tie = roofline_gaps({"a": (1, 100, 100), "b": (1, 100, 100)}, {"a": 2.0, "b": 2.0}, 100.0, 100.0)
    assert tie == [("a", "compute", 1.0), ("b", "compute", 1.0)]


def test_step_profile_categories():
    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7": "attention",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>": "attention",
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*)": "attention",
        "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int)": "attention",
        "tma_forward_kernel": "attention",
        "tma_backward_kernel": "attention",
        "dkdv_kernel": "attention",
        "dq_kernel": "attention",
        "_bwd_preprocess": "attention",
        "triton_poi_fused_cat_transpose_view_5": "other",
        "triton_red_fused_native_layer_norm_backward_12": "layer norm",
        "triton_poi_fused_gelu_gelu_backward_5": "gelu",
        "_cross_entropy_fwd_kernel": "loss",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, LogSoftMaxForwardEpilogue>": "loss",
        "void at::native::fused_adam_kernel<float>": "optimizer",
        "_adam_kernel": "optimizer",
        "aten::addmm": "matmul",
        "aten::mm": "matmul",
        "aten::mul": "other",
    }
    assert {name: profiling.step_category(name) for name in names} == names
    summary = profiling.time_by_category([("aten::mm", 3000.0), ("aten::mul", 600.0), ("_adam_kernel", 300.0),
                                          ("idle", 0.0)], steps=3, top=2, what="CPU operators")
    assert summary["categories"] == pytest.approx({"matmul": 1.0, "other": 0.2, "optimizer": 0.1})
    assert summary["ms_per_step"] == pytest.approx(1.3)
    assert [row["name"] for row in summary["top"]] == ["aten::mm", "aten::mul"]
    with pytest.raises(ValueError, match="steps"):
        profiling.time_by_category([], steps=0)
