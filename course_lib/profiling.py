"""Timing that tells the truth, reading profiles, and the roofline model (chapter 03).

- ``benchmark`` / ``Timing``: warm-up, repeats, median and spread; on a GPU the device's time
  (launch gap outside the interval however slow the host, L2 flushed, optionally amortised or
  replayed as a CUDA graph); ``hold_cycles``: how long it keeps the GPU busy before each repeat;
  ``host_seconds``: what a call costs the host, measured on an idle GPU.
- ``naive_event_timing``, ``compare_timers``: the timer not to use, and five timers side by side.
- ``plot_timings``: medians with their spread on an axis that starts at zero.
- ``time_calls`` and ``SimulatedDevice``: a timer with an injected clock (median and durations),
  and a fake asynchronous device to test it on.
- ``top_ops``, ``load_trace``, ``annotation_ranges``, ``memory_timeline``: read what
  ``torch.profiler`` recorded (its ``key_averages()`` and its Chrome trace).
- ``profile_categories`` (with ``step_category``, ``time_by_category``): where a training step's
  time goes, kernel or operator self time summed by part (matmul, attention, loss, ...).
- ``*_flops_bytes``, ``arithmetic_intensity``, ``machine_balance``, ``achieved_rates``,
  ``classify_bound``, ``roofline_point``: the roofline model from shapes and dtypes.
- ``roofline_gaps``: every operator of a measured step against its roof, the one with the most
  time to win first (its FLOPs and bytes counted by ``flops.op_costs``, its time read from a profile).
"""

from __future__ import annotations

import functools
import json
import os
import re
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from course_lib import env  # noqa: F401  (quiets the profiler's log before any profile starts)
from course_lib.orientation import GPUSpec, roofline

__all__ = [
    "Timing",
    "benchmark",
    "MAX_HOLD_SECONDS",
    "hold_cycles",
    "host_seconds",
    "naive_event_timing",
    "TIMERS",
    "compare_timers",
    "plot_timings",
    "SimulatedDevice",
    "time_calls",
    "top_ops",
    "STEP_CATEGORIES",
    "step_category",
    "time_by_category",
    "profile_categories",
    "load_trace",
    "annotation_ranges",
    "memory_timeline",
    "matmul_flops_bytes",
    "elementwise_flops_bytes",
    "softmax_flops_bytes",
    "attention_flops_bytes",
    "arithmetic_intensity",
    "machine_balance",
    "peak_flops",
    "achieved_rates",
    "classify_bound",
    "roofline_point",
    "roofline_gaps",
    "A100_SXM",
]


@dataclass(frozen=True)
class Timing:
    """Seconds per call of a benchmarked function, over ``len(times)`` timed repeats."""

    times: list[float] = field(repr=False)

    @property
    def median(self) -> float:
        """Median seconds per call: robust to the odd slow repeat."""
        return statistics.median(self.times)

    @property
    def spread(self) -> tuple[float, float]:
        """The 10th and 90th percentile, in seconds per call."""
        if len(self.times) == 1:
            return (self.times[0], self.times[0])
        deciles = statistics.quantiles(self.times, n=10, method="inclusive")
        return (deciles[0], deciles[-1])

    @property
    def minimum(self) -> float:
        """Fastest repeat, in seconds per call."""
        return min(self.times)

    def __str__(self) -> str:
        lo, hi = self.spread
        return f"{_fmt(self.median)} median (p10 {_fmt(lo)}, p90 {_fmt(hi)}, n={len(self.times)})"


def _fmt(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _uses_cuda(device: torch.device | str | None) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


WARMUP_SECONDS = 0.025


def benchmark(
    fn: Callable[..., Any],
    *args: Any,
    warmup: int = 3,
    repeat: int = 20,
    device: torch.device | str | None = None,
    flush_l2: bool = True,
    calls: int = 1,
    cuda_graph: bool = False,
    **kwargs: Any,
) -> Timing:
    """Time ``fn(*args, **kwargs)``: ``warmup`` untimed calls, then ``repeat`` timed repeats of ``calls`` calls each.

    On a GPU the warm-up also lasts at least ``WARMUP_SECONDS`` (at most 1000 calls), so that the
    clocks of an idle GPU have ramped up.

    Each repeat's time is divided by ``calls``, so a ``Timing`` is always seconds per call.

    On a CUDA device the interval is what the GPU spent, not what the host waited for:

    - before each repeat a buffer twice the size of the L2 cache (as the device reports it, and
      at least 256 MiB) is zeroed (``flush_l2``), so the inputs come from HBM as they would inside a training step;
      with ``flush_l2=False`` a short sleep kernel is queued instead, for working sets meant to
      stay in L2;
    - either way the stream is busy when the start event is recorded, so the host's launch of
      ``fn`` happens while the GPU works on that filler, and the launch gap stays outside the
      interval (an event recorded on an idle stream fires at once, before ``fn``'s kernels are
      even queued). The filler alone covers a few tens of microseconds; a call whose Python takes
      longer (wrappers, autotuner lookups, tensor descriptors) would leave the GPU idle inside the
      interval. So the host's time to launch one call is measured first (from the median of three
      untimed repeats, each on an idle GPU), and a sleep kernel about 1.5 times as long (at most
      ``MAX_HOLD_SECONDS``) follows the filler;
    - events are read after one synchronisation at the end, not after each repeat;
    - ``calls > 1`` amortises what is left of the per-call launch cost over back-to-back calls
      (all but the first see a warm cache); ``cuda_graph=True`` captures the ``calls`` calls in a
      CUDA graph once and times its replays, so the host launches one graph per repeat.

    On the CPU each repeat is timed with ``time.perf_counter`` (``flush_l2`` and ``cuda_graph``
    do nothing there). ValueError unless repeat >= 1, calls >= 1 and warmup >= 0.
    """
    if repeat < 1 or warmup < 0 or calls < 1:
        raise ValueError(f"need repeat >= 1, calls >= 1 and warmup >= 0, got repeat={repeat}, calls={calls}, "
                         f"warmup={warmup}")
    cuda = _uses_cuda(device)
    warm_start, done = time.perf_counter(), 0
    # On a GPU, warm up for at least WARMUP_SECONDS as well, waiting for each call: an idle GPU runs
    # at low clocks, and a few calls of a short kernel end before the clocks have ramped up.
    while done < warmup or (cuda and done < 1000 and time.perf_counter() - warm_start < WARMUP_SECONDS):
        fn(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        done += 1
    if not cuda:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(*args, **kwargs)
            times.append((time.perf_counter() - t0) / calls)
        return Timing(times)
    run = _captured(fn, args, kwargs, calls) if cuda_graph else lambda: [fn(*args, **kwargs) for _ in range(calls)]
    filler = _l2_flush if flush_l2 else _busy_wait
    # Cover the launch of the first call only: with calls > 1 the later ones still run at the host's pace
    # when it is the slower (the loop's throughput as written), and a graph's replay is one launch.
    first_launch = host_seconds(run) / (1 if cuda_graph else calls)
    cycles = hold_cycles(first_launch, _sleep_cycles_per_us(torch.cuda.current_device()))
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    torch.cuda.synchronize()
    for start, end in pairs:
        filler()
        torch.cuda._sleep(cycles)
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return Timing([start.elapsed_time(end) / 1e3 / calls for start, end in pairs])


@functools.cache
def _flush_buffer(device_index: int) -> torch.Tensor:
    """A buffer of twice the L2 size this GPU reports, and at least 256 MiB: zeroing it evicts the cache.

    At 256 MiB the write lasts tens of microseconds: enough for a fast launch; ``benchmark`` adds a
    sleep kernel for slower ones.
    """
    l2 = torch.cuda.get_device_properties(device_index).L2_cache_size
    return torch.empty(max(2 * l2, 2**28) // 4, dtype=torch.int32, device=f"cuda:{device_index}")


def _l2_flush() -> None:
    """Queue a write of the flush buffer on the current stream."""
    _flush_buffer(torch.cuda.current_device()).zero_()


# The longest the GPU is held idle before a repeat: a host slower than this per repeat is not a GPU benchmark.
MAX_HOLD_SECONDS = 0.01


def host_seconds(run: Callable[[], Any], *, repeats: int = 3, sync: Callable[[], Any] | None = None) -> float:
    """Median seconds the host spends inside ``run()``: each run starts on an idle GPU, timed before synchronising.

    Nothing waits for the GPU inside the interval, so this is what ``run`` costs the CPU (Python,
    dispatch, autotuner lookups, launches). ``sync`` (default ``torch.cuda.synchronize``) runs
    before each run and after the last, outside the timing.
    """
    sync = sync or torch.cuda.synchronize
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    sync()
    return statistics.median(times)


@functools.cache
def _sleep_cycles_per_us(device_index: int) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per microsecond on this GPU (it spins on the SM clock), measured once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000)  # a busy stream, and clocks ramping up, before the timed spin
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    end.synchronize()
    return 2_000_000 / (start.elapsed_time(end) * 1e3)


def hold_cycles(launch_seconds: float, cycles_per_us: float) -> int:
    """Sleep-kernel cycles that keep a GPU busy while the host launches a call: 1.5x its launch time plus 20 us,
    at most ``MAX_HOLD_SECONDS``."""
    seconds = min(1.5 * launch_seconds + 20e-6, MAX_HOLD_SECONDS)
    return int(seconds * 1e6 * cycles_per_us)


def _busy_wait() -> None:
    """Queue a kernel that spins for about 0.1 ms (keeps the stream busy while the host launches)."""
    torch.cuda._sleep(200_000)


def _captured(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], calls: int) -> Callable[[], None]:
    """``calls`` calls of ``fn`` captured in a CUDA graph; the returned function replays it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture needs the allocator and kernels warmed on a side stream
        fn(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args, **kwargs)
    return graph.replay


def naive_event_timing(fn: Callable[[], Any], repeat: int = 100) -> Timing:
    """One call between two CUDA events recorded on an idle stream, per repeat: the timer *not* to use.

    The stream is idle when the start event is recorded, so the GPU passes it at once, while the
    host is still launching ``fn``'s kernels: the launch gap is inside the interval. Kept to show
    the error side by side with ``benchmark``.
    """
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return Timing(times)


TIMERS = ("naive event pair", "profiling.benchmark", "triton do_bench", "amortised over 100 calls (warm L2)",
          "CUDA graph of 100 calls (warm L2)")


def compare_timers(fn: Callable[[], Any], repeat: int = 200) -> dict[str, float]:
    """Median seconds per call of ``fn()`` by each timer of ``TIMERS``, in one process (CUDA only)."""
    import triton.testing

    benchmark(fn, warmup=10, repeat=1)  # ramps up the GPU's clocks before the first timer, not during it
    return {
        TIMERS[0]: naive_event_timing(fn, repeat).median,
        TIMERS[1]: benchmark(fn, warmup=10, repeat=repeat).median,
        TIMERS[2]: triton.testing.do_bench(fn, warmup=25, rep=repeat, return_mode="median") / 1e3,
        TIMERS[3]: benchmark(fn, warmup=10, repeat=max(1, repeat // 4), flush_l2=False, calls=100).median,
        TIMERS[4]: benchmark(fn, warmup=10, repeat=max(1, repeat // 4), flush_l2=False, calls=100, cuda_graph=True).median,
    }


def plot_timings(
    ax: Any,
    x: Iterable[float],
    timings: Iterable[Timing],
    *,
    scale: float = 1e3,
    relative_to: Timing | None = None,
    **style: Any,
) -> None:
    """Plot the medians of ``timings`` against ``x`` with p10-p90 error bars, the y axis from zero.

    Seconds are multiplied by ``scale`` (1e3: milliseconds); with ``relative_to`` every repeat is
    divided by that timing's median instead, so the plot shows a ratio. ``style`` goes to
    ``ax.errorbar`` (label, marker, colour ...).
    """
    xs, timings = list(x), list(timings)
    factor = 1.0 / relative_to.median if relative_to is not None else scale
    mid = [t.median * factor for t in timings]
    lo = [m - t.spread[0] * factor for m, t in zip(mid, timings)]
    hi = [t.spread[1] * factor - m for m, t in zip(mid, timings)]
    style.setdefault("marker", "o")
    style.setdefault("capsize", 3)
    ax.errorbar(xs, mid, yerr=[lo, hi], **style)
    ax.set_ylim(0, max(ax.dataLim.y1, 1e-12) * 1.08)  # every series drawn so far fits


# --------------------------------------------------------------------------------------------
# A timer with an injected clock, and a simulated asynchronous device to check it against
# --------------------------------------------------------------------------------------------


class SimulatedDevice:
    """A toy asynchronous accelerator with a fake clock, so that timing code can be checked exactly.

    ``launch(seconds)`` queues a kernel of that duration and returns after ``launch_overhead``
    seconds of host time, as a CUDA launch does; the kernel starts once the device is free.
    ``sync()`` moves the host clock on until all queued work is done (``torch.cuda.synchronize``);
    ``host_work(seconds)`` spends host time (Python, the dispatcher); ``clock()`` reads the host
    clock (``time.perf_counter``). Nothing sleeps: all time is simulated.
    """

    def __init__(self, launch_overhead: float = 5e-6) -> None:
        if launch_overhead < 0:
            raise ValueError(f"launch_overhead must not be negative, got {launch_overhead}")
        self.launch_overhead = launch_overhead
        self.now = 0.0
        self.busy_until = 0.0
        self.launches = 0
        self.syncs = 0

    def clock(self) -> float:
        """The host's current time, in seconds."""
        return self.now

    def launch(self, seconds: float) -> None:
        """Queue a kernel that runs for ``seconds`` once the device is free; return after the launch overhead."""
        if seconds < 0:
            raise ValueError(f"a kernel cannot take negative time, got {seconds}")
        self.now += self.launch_overhead
        self.busy_until = max(self.busy_until, self.now) + seconds
        self.launches += 1

    def host_work(self, seconds: float) -> None:
        """Spend ``seconds`` on the host without touching the device."""
        self.now += seconds

    def sync(self) -> None:
        """Wait until every queued kernel has finished."""
        self.now = max(self.now, self.busy_until)
        self.syncs += 1


def time_calls(
    fn: Callable[[], Any],
    *,
    warmup: int = 3,
    repeat: int = 10,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], Any] | None = None,
) -> tuple[float, list[float]]:
    """(median, durations): seconds taken by each of ``repeat`` timed calls of ``fn()``, after ``warmup`` untimed ones.

    ``clock()`` reads the time in seconds. ``sync()``, when given, waits for queued device work:
    it is called once after the warm-up (so that the warm-up's work does not leak into the first
    timing) and after each timed call, before the clock is read. The median is
    ``statistics.median``'s (the mean of the two middle durations for an even ``repeat``).
    ValueError unless repeat >= 1 and warmup >= 0.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"need repeat >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        if sync is not None:
            sync()
        times.append(clock() - start)
    return statistics.median(times), times


# --------------------------------------------------------------------------------------------
# Reading what torch.profiler recorded
# --------------------------------------------------------------------------------------------


def _read(row: Any, by: str) -> float:
    # torch renamed the profiler's "cuda" fields to "device" ones; the old names warn on access.
    device_name = by.replace("cuda", "device")
    if device_name != by and hasattr(row, device_name):
        return getattr(row, device_name)
    return getattr(row, by)


def top_ops(source: Any, by: str = "self_cpu_time_total", k: int = 5) -> list[tuple[str, float]]:
    """The ``k`` rows of a profiler summary with the largest ``by``, as (name, value) pairs, largest first.

    ``source`` is a ``torch.profiler.profile`` (its ``key_averages()`` is read), the EventList
    that ``key_averages()`` returns, or any iterable of objects with a ``key`` and an attribute
    ``by`` (times are in microseconds, memory in bytes, ``count`` in calls). Old names such as
    ``self_cuda_time_total`` are read as the newer ``self_device_time_total``. Equal values
    are ordered by name. ValueError unless k >= 1.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    # A profiler has key_averages(); so has an EventList (a list), which is already the summary here.
    rows = source if isinstance(source, list) or not hasattr(source, "key_averages") else source.key_averages()
    pairs = [(row.key, _read(row, by)) for row in rows]
    pairs.sort(key=lambda pair: (-pair[1], pair[0]))
    return pairs[:k]


# Kernel (GPU) or operator (CPU) names to the part of a training step they belong to; the first
# match wins: attention before matmul (cuDNN's attention kernels carry "sm90" too), the loss before
# the elementwise rest.
STEP_CATEGORIES: list[tuple[str, str]] = [
    # besides the fused kernels' names: cuDNN's backward pre- and post-pass (dot_do_o, convert_dq) and chapter 10's kernels
    ("attention", r"fmha|flash|attention|sdpa|_attn|dot_do_o|convert_dq|tma_(forward|backward)_kernel|dkdv_kernel"
                  r"|^dq_kernel|_bwd_preprocess"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|aten::(mm|addmm|bmm|matmul|linear)\b|sm90_"),
    ("loss", r"cross_entropy|log_?softmax|nll_loss"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("layer norm", r"layer_norm|layernorm"),
    ("gelu", r"gelu"),
]


def step_category(name: str) -> str:
    """The part of a training step a kernel or operator ``name`` belongs to (``STEP_CATEGORIES``), else "other"."""
    lowered = name.lower()
    for category, pattern in STEP_CATEGORIES:
        if re.search(pattern, lowered):
            return category
    return "other"


def time_by_category(rows: Iterable[tuple[str, float]], steps: int, top: int = 12, what: str = "") -> dict[str, Any]:
    """(name, microseconds over ``steps`` steps) pairs -> ms per step by ``step_category`` and the ``top`` names.

    ValueError unless steps >= 1. Names with no time are left out.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    by_name = {name: us / 1e3 / steps for name, us in rows if us > 0}
    totals: dict[str, float] = {}
    for name, ms in by_name.items():
        totals[step_category(name)] = totals.get(step_category(name), 0.0) + ms
    largest = sorted(by_name.items(), key=lambda item: (-item[1], item[0]))[:top]
    return {"what": what, "steps": steps, "ms_per_step": sum(by_name.values()),
            "categories": dict(sorted(totals.items(), key=lambda item: -item[1])),
            "top": [{"name": name[:160], "category": step_category(name), "ms": ms} for name, ms in largest]}


def profile_categories(step: Callable[[], Any], device: torch.device | str, steps: int = 3,
                       top: int = 12) -> dict[str, Any]:
    """Profile ``steps`` calls of ``step``: self time per ``step_category`` and the ``top`` entries, ms per step.

    On a GPU it reads the CUDA kernels' device time (what the GPU spent, whatever the host did);
    on a CPU, the operators' self CPU time. Run ``step`` a few times before: compilation and
    autotuning would count otherwise.
    """
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.device(device).type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        if on_gpu:
            torch.cuda.synchronize(device)
    by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    return time_by_category(((row.key, _read(row, by)) for row in prof.key_averages()), steps, top,
                            "GPU kernels" if on_gpu else "CPU operators")


def load_trace(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The events of a Chrome trace written by ``prof.export_chrome_trace(path)``."""
    return json.loads(Path(path).read_text())["traceEvents"]


def annotation_ranges(events: Iterable[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """The host-side ``record_function`` ranges of a trace as (name, start_us, duration_us), in start order."""
    ranges = [
        (e["name"], float(e["ts"]), float(e["dur"]))
        for e in events
        if e.get("cat") == "user_annotation" and e.get("ph") == "X"
    ]
    return sorted(ranges, key=lambda r: r[1])


def memory_timeline(
    events: Iterable[dict[str, Any]], device: Literal["cpu", "cuda"] = "cpu"
) -> tuple[list[float], list[int]]:
    """Allocated bytes over time on one device, from a trace recorded with ``profile_memory=True``.

    Returns ``(times_us, allocated_bytes)`` in time order: after each allocation or free the
    profiler saw, the bytes allocated on ``device`` counted from the start of the profile
    ("Total Allocated" of the trace's ``[memory]`` events; Device Type 0 is the CPU, 1 CUDA).
    """
    device_type = {"cpu": 0, "cuda": 1}[device]
    points = sorted(
        (float(e["ts"]), int(e["args"]["Total Allocated"]))
        for e in events
        if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == device_type
    )
    return [t for t, _ in points], [b for _, b in points]


# --------------------------------------------------------------------------------------------
# The roofline model: FLOPs and bytes from shapes and dtypes, rates, and bounds
# --------------------------------------------------------------------------------------------

# NVIDIA A100 Tensor Core GPU datasheet (80 GB SXM: 2,039 GB/s, 312 TFLOP/s dense bf16,
# 19.5 TFLOP/s fp32) and the NVIDIA A100 Tensor Core GPU Architecture whitepaper (108 SMs,
# 40 MB L2, up to 164 KB of shared memory and a 256 KB register file per SM).
A100_SXM = GPUSpec(
    name="A100 SXM 80GB",
    sms=108,
    hbm_bytes=80e9,
    hbm_bytes_per_s=2.039e12,
    bf16_dense_flops=312e12,
    fp32_flops=19.5e12,
    l2_bytes=40 * 2**20,
    smem_per_sm_bytes=164 * 2**10,
    registers_per_sm_bytes=256 * 2**10,
)


def matmul_flops_bytes(m: int, n: int, k: int, dtype: torch.dtype, batch: int = 1) -> tuple[int, int]:
    """FLOPs and minimum bytes moved by ``batch`` products (m x k) @ (k x n) in ``dtype``.

    Each of the m n outputs needs k multiplications and k additions: 2 m n k FLOPs. At best each
    operand is read once and the result written once: (m k + k n + m n) elements.
    """
    return 2 * batch * m * n * k, batch * (m * k + k * n + m * n) * dtype.itemsize


def elementwise_flops_bytes(
    numel: int, dtype: torch.dtype, n_inputs: int = 2, flops_per_element: int = 1
) -> tuple[int, int]:
    """FLOPs and bytes of an elementwise op over ``numel`` elements: ``n_inputs`` tensors read, one written."""
    return flops_per_element * numel, (n_inputs + 1) * numel * dtype.itemsize


def softmax_flops_bytes(rows: int, cols: int, dtype: torch.dtype) -> tuple[int, int]:
    """FLOPs and bytes of a row-wise softmax of a (rows, cols) tensor done in one pass over memory.

    Five operations per element (max, subtract, exp, sum, divide; an exp counts as one); the
    input read once and the output written once.
    """
    return 5 * rows * cols, 2 * rows * cols * dtype.itemsize


def attention_flops_bytes(
    batch: int,
    heads: int,
    seq: int,
    head_dim: int,
    dtype: torch.dtype,
    causal: bool = False,
    fused: bool = True,
) -> tuple[int, int]:
    """FLOPs and bytes of the forward pass of scaled dot-product attention, softmax(Q K^T / sqrt(d)) V.

    Q, K, V and the output O are (batch, heads, seq, head_dim). Per (batch, head) the scores
    that count are seq * seq, or seq * (seq + 1) / 2 with a causal mask; each costs 2 head_dim
    FLOPs in Q K^T and 2 head_dim in P V (softmax's few operations per score are not counted).
    A fused kernel (FlashAttention) reads Q, K, V and writes O once. A plain implementation also
    writes the whole seq x seq score matrix, reads it for the softmax, writes the probabilities
    and reads them for P V: 4 seq^2 more elements per (batch, head), masked entries included.
    """
    pairs = seq * (seq + 1) // 2 if causal else seq * seq
    flops = 4 * head_dim * pairs * batch * heads
    elements = 4 * batch * heads * seq * head_dim
    if not fused:
        elements += 4 * batch * heads * seq * seq
    return flops, elements * dtype.itemsize


def arithmetic_intensity(flops: float, num_bytes: float) -> float:
    """FLOPs per byte moved; ValueError unless num_bytes > 0 and flops >= 0."""
    if not num_bytes > 0 or flops < 0:
        raise ValueError(f"need num_bytes > 0 and flops >= 0, got flops={flops}, num_bytes={num_bytes}")
    return flops / num_bytes


def machine_balance(flops_per_s: float, bytes_per_s: float) -> float:
    """The ridge point of a device's roofline: FLOPs it can do per byte its memory delivers."""
    if not (flops_per_s > 0 and bytes_per_s > 0):
        raise ValueError(f"rates must be positive, got flops_per_s={flops_per_s}, bytes_per_s={bytes_per_s}")
    return flops_per_s / bytes_per_s


def peak_flops(spec: GPUSpec, dtype: torch.dtype) -> float:
    """A GPU's datasheet peak for ``dtype``: dense tensor-core bf16 (also fp16) or plain fp32."""
    if dtype in (torch.bfloat16, torch.float16):
        return spec.bf16_dense_flops
    if dtype == torch.float32:
        return spec.fp32_flops
    raise ValueError(f"no peak for {dtype} in a GPUSpec (it lists bf16/fp16 and fp32)")


def achieved_rates(flops: float, num_bytes: float, seconds: float) -> tuple[float, float]:
    """(FLOP/s, bytes/s) an operation reached; ValueError unless seconds > 0 and both amounts >= 0."""
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    if flops < 0 or num_bytes < 0:
        raise ValueError(f"amounts must not be negative, got flops={flops}, num_bytes={num_bytes}")
    return flops / seconds, num_bytes / seconds


def classify_bound(
    flops: float, num_bytes: float, flops_per_s: float, bytes_per_s: float
) -> Literal["compute", "memory"]:
    """"memory" when moving the bytes takes longer than the arithmetic on this device, else "compute"."""
    return roofline(flops, num_bytes, flops_per_s, bytes_per_s)[1]


def roofline_point(
    flops: float, num_bytes: float, seconds: float, peak_flops_per_s: float, peak_bytes_per_s: float
) -> dict[str, Any]:
    """Place a measured operation on a device's roofline, as a dict with exactly these keys.

    intensity               flops / num_bytes (FLOP per byte)
    balance                 peak_flops_per_s / peak_bytes_per_s, the ridge point (FLOP per byte)
    bound                   "memory" if intensity < balance, else "compute"
    attainable_flops_per_s  the roof at this intensity: min(peak_flops_per_s, intensity * peak_bytes_per_s)
    achieved_flops_per_s    flops / seconds
    fraction_of_roof        the roofline's lower bound on the time, max(flops / peak_flops_per_s,
                            num_bytes / peak_bytes_per_s), divided by seconds (1.0 = on the roof)

    ValueError unless num_bytes > 0, seconds > 0, flops >= 0 and both peaks > 0.
    """
    if not (num_bytes > 0 and seconds > 0 and flops >= 0):
        raise ValueError(f"need num_bytes > 0, seconds > 0, flops >= 0; got {flops}, {num_bytes}, {seconds}")
    bound_s, _ = roofline(flops, num_bytes, peak_flops_per_s, peak_bytes_per_s)
    intensity, balance = flops / num_bytes, peak_flops_per_s / peak_bytes_per_s
    return {
        "intensity": intensity,
        "balance": balance,
        "bound": "memory" if intensity < balance else "compute",
        "attainable_flops_per_s": min(peak_flops_per_s, intensity * peak_bytes_per_s),
        "achieved_flops_per_s": flops / seconds,
        "fraction_of_roof": bound_s / seconds,
    }


def roofline_gaps(
    costs: dict[str, tuple[int, int, int]],
    seconds: dict[str, float],
    peak_flops_per_s: float,
    peak_bytes_per_s: float,
) -> list[tuple[str, str, float]]:
    """Each operator in both ``costs`` ((calls, FLOPs, bytes), as ``flops.op_costs`` counts) and ``seconds``
    (measured), as (name, bound, gap_seconds), the largest gap first (equal gaps by name).

    The roof's time is max(FLOPs / peak_flops_per_s, bytes / peak_bytes_per_s); ``bound`` says
    which term it is ("compute" on a tie); the gap is the measured seconds minus the roof's time:
    what the operator could win at most on this machine (negative when a cache beat the roof).
    """
    rows = []
    for name in costs.keys() & seconds.keys():
        _, flops, num_bytes = costs[name]
        compute_s, memory_s = flops / peak_flops_per_s, num_bytes / peak_bytes_per_s
        bound = "compute" if compute_s >= memory_s else "memory"
        rows.append((name, bound, seconds[name] - max(compute_s, memory_s)))
    return sorted(rows, key=lambda row: (-row[2], row[0]))
