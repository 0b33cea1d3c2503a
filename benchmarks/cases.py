"""The measurements: each case times our Triton kernel and PyTorch's reference on the same input.

Where PyTorch offers several ways to do the same work (attention: SDPA's FA2 and cuDNN backends and
FlexAttention; bias+GELU: eager and torch.compile), all are measured and the row is judged against
the fastest (``Result.judge_against_fastest``); the others stay in the row as context.

Every time is the median of ``triton.testing.do_bench`` (imported when a case runs: it needs a
CUDA GPU). Our kernel's output is checked against the reference before it is timed, and any
exception from our side (a missing module, a compile error, a wrong result) becomes that row's
error while the reference is still recorded. ``run`` goes through the cases, prints progress,
and frees GPU memory between them.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._functorch.config  # noqa: F401  read by the attention rows; not imported by ``import torch`` alone
import torch.nn.functional as F

from benchmarks.provenance import interleaved_rounds
from benchmarks.report import Result, Target
from course_lib import env

__all__ = ["CASES", "DEVICE", "FULL", "QUICK", "AttentionShape", "Sizes", "run"]

DEVICE = "cuda"  # what the suite measures; the CPU tests point it at "cpu" to check the plumbing
MAX_ERROR_CHARS = 300
ADAM_HPARAMS: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


@dataclass(frozen=True)
class AttentionShape:
    """One attention workload: sizes, dtype, and what its rows' names carry (the main shape's carry nothing)."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    dtype: str = "bfloat16"
    label: str = ""


@dataclass(frozen=True)
class Sizes:
    """The shapes of one run, how long ``do_bench`` warms up and repeats (milliseconds), and in how many rounds."""

    copy_numel: int
    softmax: tuple[int, int]
    bias_gelu: tuple[int, int]
    adam: tuple[int, int, int]  # tensors, rows, cols
    matmul: tuple[int, ...]  # square sizes M = N = K
    attention: tuple[AttentionShape, ...]  # each without and with the causal mask
    add_numel: int
    transpose: tuple[int, int]
    warmup_ms: int
    rep_ms: int
    rounds: int = 1  # attention: every implementation timed once a round, in turn; each keeps its median


FULL = Sizes(
    copy_numel=2**28,
    softmax=(8192, 8192),
    bias_gelu=(8192, 8192),
    adam=(16, 4096, 4096),
    matmul=(4096, 8192),
    attention=(
        AttentionShape(4, 32, 4096, 128),
        AttentionShape(4, 32, 8192, 64, label="_n8192_d64"),
        AttentionShape(8, 16, 2048, 128, "float16", "_fp16_b8_h16_n2048"),
    ),
    add_numel=2**28,
    transpose=(8192, 8192),
    warmup_ms=25,
    rep_ms=100,
    rounds=3,
)
QUICK = Sizes(
    copy_numel=2**24,
    softmax=(1024, 1024),
    bias_gelu=(1024, 1024),
    adam=(4, 512, 512),
    matmul=(512, 1024),
    attention=(
        AttentionShape(1, 4, 512, 128),
        AttentionShape(1, 4, 1024, 64, label="_n1024_d64"),
        AttentionShape(2, 2, 256, 128, "float16", "_fp16_b2_h2_n256"),
    ),
    add_numel=2**22,
    transpose=(1024, 1024),
    warmup_ms=5,
    rep_ms=20,
)


# --------------------------------------------------------------------------------------------
# Timing, rates, checks
# --------------------------------------------------------------------------------------------


def _ms(fn: Callable[[], Any], sizes: Sizes, grad_to_none: list[torch.Tensor] | None = None) -> float:
    """Median milliseconds per call of ``fn`` by ``triton.testing.do_bench`` (which flushes L2 between calls)."""
    from triton.testing import do_bench

    return float(
        do_bench(fn, warmup=sizes.warmup_ms, rep=sizes.rep_ms, grad_to_none=grad_to_none, return_mode="median")
    )


def _graph_ms(fn: Callable[[], Any], sizes: Sizes) -> float:
    """Median milliseconds per call of ``fn`` replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``).

    No host work lies between the calls, so against ``_ms`` it tells kernel time from launch overhead;
    it does not flush L2: use it where the working set is several times larger than L2.
    """
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=sizes.rep_ms, return_mode="median"))


def _gbps(num_bytes: float, ms: float) -> float:
    return num_bytes / (ms * 1e-3) / 1e9


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def _describe(exc: BaseException) -> str:
    """An exception as one short line for the report."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def _kernel(module: str, name: str) -> Callable[..., Any]:
    """``name`` from ``course_lib.kernels.<module>``, imported only when a case asks for it."""
    return getattr(importlib.import_module(f"course_lib.kernels.{module}"), name)


def _check_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "output") -> None:
    """Raise unless max |actual - expected| <= tol x max |expected| (shapes must agree)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    scale = expected.float().abs().max().item() or 1.0
    error = (actual.float() - expected.float()).abs().max().item() / scale
    if not error <= tol:  # NaN fails too
        raise AssertionError(f"{what} differs from the reference: max error {error:.2e} x max|ref| > {tol:g}")


def _ours(result: Result, measure: Callable[[], float]) -> None:
    """Set ``result.ours`` from ``measure()``, or its error when that raises."""
    try:
        result.ours = measure()
    except Exception as exc:
        result.error = _describe(exc)


def _fastest_reference(result: Result, candidates: dict[str, Callable[[], float]]) -> None:
    """Measure every candidate reference and judge ``result`` against the fastest; one that fails becomes a note."""
    measured: dict[str, float] = {}
    for label, measure in candidates.items():
        try:
            measured[label] = measure()
        except Exception as exc:
            result.notes.append(f"{label} failed: {_describe(exc)}")
    result.judge_against_fastest(measured)


def _extra(result: Result, label: str, measure: Callable[[], float]) -> None:
    """Add ``measure()`` to ``result.context`` as ``label``, or a note saying why it failed."""
    try:
        result.context[label] = measure()
    except Exception as exc:
        result.notes.append(f"{label} failed: {_describe(exc)}")


# --------------------------------------------------------------------------------------------
# The cases: each yields its rows
# --------------------------------------------------------------------------------------------


def copy_gbps(sizes: Sizes) -> float:
    """Device-to-device bandwidth of ``dst.copy_(src)`` on a large fp32 buffer, bytes read + written."""
    src = torch.randn(sizes.copy_numel, device=DEVICE)
    dst = torch.empty_like(src)
    return _gbps(2 * src.numel() * src.element_size(), _ms(lambda: dst.copy_(src), sizes))


def softmax(sizes: Sizes) -> Iterator[Result]:
    """Row softmax, fp32."""
    x = torch.randn(*sizes.softmax, device=DEVICE)
    num_bytes = 2 * x.numel() * x.element_size()
    result = Result(
        "softmax", list(x.shape), "float32", "GB/s", "torch.softmax(x, dim=-1)",
        targets=[Target("ratio", 1.0), Target("copy_fraction", 0.8)],
        notes=["GB/s counts the input read and the output written once: 2 x rows x cols x 4 bytes"],
    )
    result.reference = _gbps(num_bytes, _ms(lambda: torch.softmax(x, dim=-1), sizes))

    def measure() -> float:
        ours = _kernel("fusion", "softmax")
        _check_close(ours(x), torch.softmax(x, dim=-1), 1e-4)
        return _gbps(num_bytes, _ms(lambda: ours(x), sizes))

    _ours(result, measure)
    yield result


def _bias_gelu_eager(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias)


def _bias_gelu_tanh(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias, approximate="tanh")


def _bias_add(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x + bias


def bias_gelu(sizes: Sizes) -> Iterator[Result]:
    """Fused bias + GELU, bf16, against the faster of eager PyTorch and torch.compile; as context, torch.compile of
    its tanh approximation and of the bias add alone (the same bytes with almost no arithmetic)."""
    rows, cols = sizes.bias_gelu
    x = torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16)
    bias = torch.randn(cols, device=DEVICE, dtype=torch.bfloat16)
    num_bytes = (2 * x.numel() + bias.numel()) * x.element_size()
    result = Result(
        "bias_gelu", [rows, cols], "bfloat16", "GB/s", "",
        targets=[Target("ratio", 1.0), Target("copy_fraction", 0.85)],
        notes=["GB/s counts x and bias read and the output written once; the reference GELU is exact (erf)",
               "ours is bias_gelu(fast_erf=True): the fitted erfc of course_lib.erfc, relative error below 1e-4"],
    )

    def compiled_rate(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], float]:
        def measure_compiled() -> float:
            compiled = torch.compile(fn)
            compiled(x, bias)
            return _gbps(num_bytes, _ms(lambda: compiled(x, bias), sizes))
        return measure_compiled

    def rate(fast_erf: bool) -> Callable[[], float]:
        def measure() -> float:
            ours = functools.partial(_kernel("fusion", "bias_gelu"), fast_erf=fast_erf)
            _check_close(ours(x, bias), _bias_gelu_eager(x, bias), 2e-2)
            return _gbps(num_bytes, _ms(lambda: ours(x, bias), sizes))
        return measure

    # Ours first: measured after torch.compile in the same process, the same kernel ran at
    # 1,033 instead of 2,681 GB/s on the H200.
    _ours(result, rate(fast_erf=True))
    _extra(result, "ours with the library's exact erf", rate(fast_erf=False))
    # The same call replayed from a CUDA graph: no argument checks or autograd bookkeeping on the
    # host between kernels; a gap to the row's rate is host time do_bench's timed span includes.
    graph_ours = functools.partial(_kernel("fusion", "bias_gelu"), fast_erf=True)
    _extra(result, "ours, CUDA-graph replay (kernel time only)",
           lambda: _gbps(num_bytes, _graph_ms(lambda: graph_ours(x, bias), sizes)))
    _fastest_reference(result, {
        "eager F.gelu(x + bias)": lambda: _gbps(num_bytes, _ms(lambda: _bias_gelu_eager(x, bias), sizes)),
        "torch.compile": compiled_rate(_bias_gelu_eager),
    })
    _extra(result, "torch.compile, tanh GELU", compiled_rate(_bias_gelu_tanh))
    _extra(result, "torch.compile, bias add only", compiled_rate(_bias_add))
    torch.compiler.reset()
    yield result


def _adam_fused(result: Result, params: list[torch.nn.Parameter], grads: list[torch.Tensor], sizes: Sizes) -> None:
    """Time FlatAdam (checked against the fused step) and torch.optim.Adam(fused=True) into ``result``.

    A function of its own so that the fused optimizer and its state are freed when it returns,
    before the foreach and for-loop optimizers are built.
    """
    fused = torch.optim.Adam(params, fused=True, **ADAM_HPARAMS)

    def measure() -> float:
        mine = [torch.nn.Parameter(p.detach().clone()) for p in params]
        flat = _kernel("fusion", "FlatAdam")(mine, **ADAM_HPARAMS)
        for p, g in zip(mine, grads):
            if p.grad is None:
                p.grad = g.clone()
            else:  # FlatAdam may already hold the gradients as views of one flat buffer
                p.grad.copy_(g)
        flat.step()
        fused.step()
        for i, (p, q) in enumerate(zip(mine, params)):
            _check_close(p.detach(), q.detach(), 1e-5, f"parameter {i} after one step")
        return _ms(flat.step, sizes)

    _ours(result, measure)
    result.reference = _ms(fused.step, sizes)


def _adam_step_ms(params: list[torch.nn.Parameter], foreach: bool, sizes: Sizes) -> float:
    """Milliseconds of one step() of a new torch.optim.Adam(foreach=foreach) over ``params``."""
    return _ms(torch.optim.Adam(params, foreach=foreach, **ADAM_HPARAMS).step, sizes)


def adam(sizes: Sizes) -> Iterator[Result]:
    """One optimizer step over many fp32 tensors: FlatAdam against torch.optim.Adam (fused, foreach, for-loop)."""
    count, rows, cols = sizes.adam
    params = [torch.nn.Parameter(torch.randn(rows, cols, device=DEVICE)) for _ in range(count)]
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    result = Result(
        "adam", [count, rows, cols], "float32", "ms", "torch.optim.Adam(fused=True).step()",
        targets=[Target("time_factor", 1.1)],
        notes=["time of one step() over all tensors; gradients set to random values once, before timing"],
    )
    _adam_fused(result, params, grads, sizes)
    for label, foreach in (("foreach", True), ("for-loop", False)):
        _extra(result, label, functools.partial(_adam_step_ms, params, foreach, sizes))
    yield result


def _matmul_one(n: int, sizes: Sizes) -> Result:
    """The row of one square size; its inputs are freed when it returns."""
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    flops = 2 * n**3
    result = Result(
        f"matmul_{n}", [n, n, n], "bfloat16", "TFLOP/s", "torch.matmul, cuBLAS",
        targets=[Target("ratio", 0.8)],
        notes=["shape is M, N, K; TFLOP/s = 2 M N K / time"],
    )
    result.reference = _tflops(flops, _ms(lambda: torch.matmul(a, b), sizes))

    def measure() -> float:
        ours = _kernel("tiling_coalescing", "matmul")
        _check_close(ours(a, b), torch.matmul(a, b), 2e-2)
        return _tflops(flops, _ms(lambda: ours(a, b), sizes))

    _ours(result, measure)
    return result


def matmul(sizes: Sizes) -> Iterator[Result]:
    """Square bf16 matmuls against torch.matmul (cuBLAS)."""
    for n in sizes.matmul:
        yield _matmul_one(n, sizes)


def _backward_ms(
    forward: Callable[[], torch.Tensor], grad_out: torch.Tensor, inputs: list[torch.Tensor], sizes: Sizes
) -> float:
    """Milliseconds of the backward pass alone: one forward, then backward(retain_graph=True) repeated."""
    out = forward()
    return _ms(lambda: out.backward(grad_out, retain_graph=True), sizes, grad_to_none=inputs)


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Callable[[], torch.Tensor]:
    """FlexAttention compiled by torch.compile (the Triton kernels PyTorch generates), causal through a block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = q.shape[-2]
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n, device=str(q.device)) if causal else None
    compiled = torch.compile(flex_attention)
    return lambda: compiled(q, k, v, block_mask=mask)


ATTENTION_TARGETS = {"fwd": 0.9, "bwd": 0.85}
"""Ours against the fastest reference (on Hopper, SDPA's cuDNN backend), forward and backward."""
ATTENTION_NOTES = {
    "fwd": ["FLOPs: forward 4 B H N^2 D, halved when causal; backward 2.5 x forward",
            "ours is flash_attention_tma: the TMA forward on sm90+ (else the teaching kernels), the Hopper backward",
            "q, k, v require grad in the forward timing, as in training"],
    "bwd": ["FLOPs: forward 4 B H N^2 D, halved when causal; backward 2.5 x forward",
            "ours is flash_attention_tma, whose backward is the Hopper one on sm90+ (else the teaching three kernels)",
            "backward timed alone: one forward, then backward(retain_graph=True) repeated, "
            "q/k/v grads reset to None before each call"],
}


def _attention_pair(shape: AttentionShape, causal: bool, sizes: Sizes) -> tuple[Result, Result]:
    """The forward and backward rows of one shape and mask, each against the fastest of PyTorch's attentions."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dims = [shape.batch, shape.heads, shape.seq, shape.head_dim]
    q, k, v = (torch.randn(*dims, device=DEVICE, dtype=getattr(torch, shape.dtype), requires_grad=True) for _ in range(3))
    inputs, grad_out = [q, k, v], torch.randn(*dims, device=DEVICE, dtype=getattr(torch, shape.dtype))
    flops = 4 * shape.batch * shape.heads * shape.seq * shape.seq * shape.head_dim / (2 if causal else 1)
    fwd, bwd = (
        Result(f"attention_{part}{shape.label}{'_causal' if causal else ''}", dims, shape.dtype, "TFLOP/s", "",
               targets=[Target("ratio", ATTENTION_TARGETS[part])], notes=list(ATTENTION_NOTES[part]))
        for part in ("fwd", "bwd")
    )

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        expected = sdpa().detach()
        expected_grads = torch.autograd.grad(sdpa(), inputs, grad_out)

    timers: dict[tuple[str, str], Callable[[], float]] = {}  # (label, part) -> one timing, in TFLOP/s
    failures: dict[tuple[str, str], Exception] = {}

    def prepare(label: str, part: str, make: Callable[[], Callable[[], torch.Tensor]], backend: str | None = None) -> None:
        """Check ``make()``'s call against the flash backend's output or gradients, and keep a timing of it."""
        def context() -> contextlib.AbstractContextManager[Any]:
            return sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext()

        try:
            with context():
                call = make()
                if part == "fwd":
                    _check_close(call().detach(), expected, 2e-2)
                else:
                    for name, got, want in zip("qkv", torch.autograd.grad(call(), inputs, grad_out), expected_grads):
                        _check_close(got, want, 2e-2, f"d{name}")
        except Exception as exc:
            failures[label, part] = exc
            return

        def rate() -> float:
            with context():
                if part == "fwd":
                    return _tflops(flops, _ms(call, sizes))
                return _tflops(2.5 * flops, _backward_ms(call, grad_out, inputs, sizes))
        timers[label, part] = rate

    def course(module: str, name: str) -> Callable[[], Callable[[], torch.Tensor]]:
        attention = _kernel(module, name)
        return lambda: (lambda: attention(q, k, v, causal=causal))

    references = {"SDPA flash (FA2)": (lambda: sdpa, "FLASH_ATTENTION"), "SDPA cuDNN": (lambda: sdpa, "CUDNN_ATTENTION"),
                  "FlexAttention (torch.compile)": (lambda: _flex_attention(q, k, v, causal), None)}
    for part in ("fwd", "bwd"):  # ours before anything torch.compile builds
        # Ours: the Hopper forward and backward where they apply (else the teaching kernels).
        prepare("ours", part, course("flash_attention_hopper", "flash_attention_tma"))
        prepare("course_lib teaching kernels", part, course("flash_attention", "flash_attention"))
    # Without donated buffers, at compile time and when the backward runs (AOTAutograd reads the flag at both):
    # the backward timing calls backward(retain_graph=True) on one graph again and again, which a compiled
    # backward that may overwrite its saved buffers refuses.
    with torch._functorch.config.patch(donated_buffer=False):
        for part in ("fwd", "bwd"):
            for label, (make, backend) in references.items():
                prepare(label, part, make, backend)
        samples, failed = interleaved_rounds(timers, sizes.rounds)
    failures.update(failed)

    def measured(label: str, part: str) -> Callable[[], float]:
        def value() -> float:
            if (label, part) in failures:
                raise failures[label, part]
            return statistics.median(samples[label, part])
        return value

    for result, part in ((fwd, "fwd"), (bwd, "bwd")):
        _ours(result, measured("ours", part))
        _extra(result, "course_lib teaching kernels", measured("course_lib teaching kernels", part))
        _fastest_reference(result, {label: measured(label, part) for label in references})
        if sizes.rounds > 1:
            result.notes.append(f"median of {sizes.rounds} interleaved rounds: every implementation of the shape "
                                "timed once a round, in turn")
    torch.compiler.reset()
    return fwd, bwd


def attention(sizes: Sizes) -> Iterator[Result]:
    """FlashAttention forward and backward for each shape, without and with the causal mask, against the fastest of
    SDPA's flash (FA2) and cuDNN backends and FlexAttention."""
    for shape in sizes.attention:
        for causal in (False, True):
            yield from _attention_pair(shape, causal, sizes)
            _free_memory()


def add(sizes: Sizes) -> Iterator[Result]:
    """Vector add, fp32 (context: the simplest memory-bound kernel)."""
    x = torch.randn(sizes.add_numel, device=DEVICE)
    y = torch.randn_like(x)
    num_bytes = 3 * x.numel() * x.element_size()
    result = Result(
        "add", [x.numel()], "float32", "GB/s", "torch.add",
        notes=["GB/s counts two inputs read and the output written once"],
    )
    result.reference = _gbps(num_bytes, _ms(lambda: torch.add(x, y), sizes))

    def measure() -> float:
        ours = _kernel("fusion", "add")
        _check_close(ours(x, y), torch.add(x, y), 1e-6)
        return _gbps(num_bytes, _ms(lambda: ours(x, y), sizes))

    _ours(result, measure)
    yield result


def transpose(sizes: Sizes) -> Iterator[Result]:
    """Out-of-place transpose, fp32: our coalesced kernel against our naive one; torch as context."""
    x = torch.randn(*sizes.transpose, device=DEVICE)
    num_bytes = 2 * x.numel() * x.element_size()
    expected = x.t().contiguous()
    result = Result(
        "transpose", list(x.shape), "float32", "GB/s", "transpose(x, coalesced=False), our naive kernel",
        notes=["ours is transpose(x, coalesced=True); GB/s counts the input read and the output written once"],
    )
    kernel = _kernel("tiling_coalescing", "transpose")
    _check_close(kernel(x, coalesced=False), expected, 0.0, "naive transpose")
    result.reference = _gbps(num_bytes, _ms(lambda: kernel(x, coalesced=False), sizes))
    _extra(result, "torch x.t().contiguous()", lambda: _gbps(num_bytes, _ms(lambda: x.t().contiguous(), sizes)))

    def measure() -> float:
        _check_close(kernel(x, coalesced=True), expected, 0.0)
        return _gbps(num_bytes, _ms(lambda: kernel(x, coalesced=True), sizes))

    _ours(result, measure)
    yield result


CASES: dict[str, Callable[[Sizes], Iterator[Result]]] = {
    "softmax": softmax,
    "bias_gelu": bias_gelu,
    "adam": adam,
    "matmul": matmul,
    "attention": attention,
    "add": add,
    "transpose": transpose,
}


def _free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def run(
    names: Sequence[str], sizes: Sizes, log: Callable[[str], None] = print
) -> tuple[float, list[Result]]:
    """Measure the copy bandwidth, then the cases ``names`` in order: (copy GB/s, every row).

    A case that raises outside its own kernel's measurement (an out-of-memory input, a failing
    reference) is recorded as one error row named after the case, and the next case runs.
    """
    env.seed_everything()
    copy = copy_gbps(sizes)
    _free_memory()
    log(f"device-to-device copy: {copy:,.0f} GB/s")
    results: list[Result] = []
    for i, name in enumerate(names, 1):
        log(f"[{i}/{len(names)}] {name}")
        start = time.perf_counter()
        try:
            for result in CASES[name](sizes):
                results.append(result)
                log("    " + result.line(copy))
        except Exception as exc:
            results.append(Result(name, [], "", "ms", "", error=_describe(exc)))
            log(f"    {name}: error: {results[-1].error}")
        _free_memory()
        log(f"    ({time.perf_counter() - start:.1f} s)")
    return copy, results
