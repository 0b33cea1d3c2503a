"""Chapter 10's GPU table: FlashAttention forward and forward + backward, the course's Triton kernels beside PyTorch's.

    python -m benchmarks.attention [--out PATH] [--quick]

writes ``benchmarks/results/attention_<gpu>.json`` (``attention_<gpu>-quick.json`` with ``--quick``),
which the chapter renders with ``course_lib.support.records.load_record``. For bf16 inputs of
(batch 4, heads 32, N, head dim 128), N from 1024 to 8192, without and with the causal mask, it
times four implementations of the same attention on the same inputs:

- ``course_lib`` (``course_lib.kernels.flash_attention.flash_attention``): the kernels of the
  chapter's exercises (``flash_forward_kernel``, ``dkdv_kernel``) and its dQ kernel, autotuned;
- ``course_lib TMA`` (``course_lib.kernels.flash_attention_hopper.flash_attention_tma``): the
  Hopper forward (TMA tensor descriptors, 128 x 128 tiles) with the same backward;
- ``SDPA flash``: PyTorch's ``scaled_dot_product_attention`` pinned to its FlashAttention-2 backend;
- ``SDPA cuDNN``: the same pinned to cuDNN's fused attention, the fastest PyTorch offers on Hopper.

Each is checked against the flash backend's output and gradients before it is timed. ``forward``
is one call; ``forward + backward`` is a call and ``out.backward(dout)``, as a training step runs
them. Each time is the median of ``triton.testing.do_bench`` (which flushes L2 between calls).
Beside each, the host's time per call (``benchmarks.provenance.host_ms``: calls issued back to
back, nothing waiting for the GPU): where it is the larger, the GPU idled between the calls and
the row measures Python and launches, not the kernels.
FLOPs: the forward 4 B H N^2 D, halved when causal; forward + backward 3.5 times that (the
backward counted as 2.5 forwards, the usual convention). An implementation that fails at a size is
recorded with its error and the run goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.provenance import host_ms, median_ms, record_main, run_facts

__all__ = ["FULL", "QUICK", "attention_flops", "host_bound", "implementations", "main", "measure", "relative_error", "sweep"]

FULL: dict[str, Any] = {"batch": 4, "heads": 32, "head_dim": 128, "seq_lens": [1024, 2048, 4096, 8192],
                        "warmup_ms": 25, "rep_ms": 100}
QUICK: dict[str, Any] = {"batch": 1, "heads": 4, "head_dim": 128, "seq_lens": [512, 1024], "warmup_ms": 5, "rep_ms": 20}
TRAIN_FACTOR = 3.5  # forward + backward, in forwards: 1 + 2.5
TOLERANCE = 2e-2  # max |ours - reference| / max |reference|, bf16

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]
Timer = Callable[[Callable[[], Any], list[torch.Tensor]], float]  # ms per call of fn, given the grads to reset


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> float:
    """FLOPs of one attention forward: 4 B H N^2 D (two N x N x D products), halved under a causal mask."""
    return 4.0 * batch * heads * seq * seq * head_dim / (2 if causal else 1)


def _sdpa(backend_name: str) -> Attention:
    """SDPA pinned to one backend (``SDPBackend.<backend_name>``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return attend


def implementations() -> dict[str, Attention]:
    """The implementations the table compares, by label; the first is the reference of the correctness checks."""
    from course_lib.kernels.flash_attention import flash_attention
    from course_lib.kernels.flash_attention_hopper import flash_attention_tma

    return {
        "SDPA flash": _sdpa("FLASH_ATTENTION"),
        "SDPA cuDNN": _sdpa("CUDNN_ATTENTION"),
        "course_lib": lambda q, k, v, causal: flash_attention(q, k, v, causal),
        "course_lib TMA": lambda q, k, v, causal: flash_attention_tma(q, k, v, causal),
    }


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (over 1 where want is all zeros), in fp32."""
    return (got.float() - want.float()).abs().max().item() / (want.float().abs().max().item() or 1.0)


def _measure(fn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, causal: bool,
             flops: float, expected: tuple[torch.Tensor, ...], reference: str, ms: Timer,
             host: Timer | None) -> tuple[dict[str, float], tuple[torch.Tensor, ...]]:
    """Check ``fn`` against ``expected`` (none yet: it is the reference), then time it; its times, rates and results."""
    inputs = [q, k, v]
    out = fn(q, k, v, causal)
    got = (out.detach(), *torch.autograd.grad(out, inputs, dout))
    for label, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        error = relative_error(a, b)
        if not error <= TOLERANCE:  # NaN fails too
            raise AssertionError(f"{label} differs from {reference}'s: max error {error:.2e} x max|ref|")
    def forward() -> Any:
        return fn(q, k, v, causal)

    def train() -> None:
        fn(q, k, v, causal).backward(dout)

    forward_ms, train_ms = ms(forward, inputs), ms(train, inputs)
    rates = {"forward_ms": forward_ms, "train_ms": train_ms, "forward_tflops": flops / forward_ms / 1e9,
             "train_tflops": TRAIN_FACTOR * flops / train_ms / 1e9}
    if host is not None:
        rates.update(forward_host_ms=host(forward, inputs), train_host_ms=host(train, inputs))
    return rates, got


def sweep(impls: dict[str, Attention], config: dict[str, Any], ms: Timer, device: str = "cuda",
          dtype: torch.dtype = torch.bfloat16, host: Timer | None = None) -> dict[str, Any]:
    """Time every implementation at every (causal, N) of ``config``; one row each, with its error or its times and rates.

    ``host`` (optional) times the host's share of the same calls (``forward_host_ms``, ``train_host_ms``).
    """
    batch, heads, dim = config["batch"], config["heads"], config["head_dim"]
    reference = next(iter(impls))
    rows = []
    for causal in (False, True):
        for seq in config["seq_lens"]:
            gen = torch.Generator(device=device).manual_seed(seq)
            q, k, v, dout = (torch.randn(batch, heads, seq, dim, generator=gen, device=device, dtype=dtype)
                             for _ in range(4))
            q, k, v = (t.requires_grad_(True) for t in (q, k, v))
            expected: tuple[torch.Tensor, ...] = ()
            flops = attention_flops(batch, heads, seq, dim, causal)
            for name, fn in impls.items():
                row: dict[str, Any] = {"implementation": name, "causal": causal, "seq": seq, "error": None}
                try:
                    rates, got = _measure(fn, q, k, v, dout, causal, flops, expected, reference, ms, host)
                    row.update(rates)
                    if name == reference:
                        expected = got
                except Exception as exc:  # noqa: BLE001 - a failing implementation is a row of the record
                    row["error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                rows.append(row)
                print(f"causal={causal!s:5} N={seq:5d} {name:14s} " + (
                    f"forward {row['forward_tflops']:6.1f} TFLOP/s, forward+backward {row['train_tflops']:6.1f}"
                    + "".join(f", {what} host-bound ({row[what + '_host_ms']:.3f} ms host, {row[what + '_ms']:.3f} GPU)"
                              for what in ("forward", "train") if host_bound(row, what))
                    if row["error"] is None else row["error"]), flush=True)
            del q, k, v, dout, expected
            if device == "cuda":
                torch.cuda.empty_cache()
    return {
        "batch": batch, "heads": heads, "head_dim": dim, "dtype": str(dtype).removeprefix("torch."),
        "seq_lens": list(config["seq_lens"]), "implementations": list(impls), "rows": rows,
        "flops": "forward 4 B H N^2 D, halved when causal; forward + backward 3.5 x forward",
        "timing": "median of triton.testing.do_bench (L2 flushed between calls); forward + backward is a call and "
                  "out.backward(dout), input grads reset to None before each",
        "host_timing": None if host is None else "*_host_ms: median host time per call, 20 calls issued back to back "
                       "without waiting for the GPU (benchmarks.provenance.host_ms); above the GPU time: host-bound",
    }


def host_bound(row: dict[str, Any], what: str) -> bool:
    """Whether a row's ``what`` ("forward" or "train") took the host longer per call than the GPU (False if not timed)."""
    host = row.get(f"{what}_host_ms")
    return row.get("error") is None and host is not None and host >= row[f"{what}_ms"]


def measure(quick: bool = False) -> dict[str, Any]:
    """The record: the sweep, with the facts of the run (date, GPU, driver, versions)."""
    config = QUICK if quick else FULL
    return {
        **run_facts("python -m benchmarks.attention" + (" --quick" if quick else "")),
        "sections": {"sweep": sweep(implementations(), config, partial(median_ms, config),
                                    host=host_ms)},
    }


def main(argv: list[str] | None = None) -> int:
    """Measure and write the record (CUDA only)."""
    return record_main("attention", __doc__, measure, argv)


if __name__ == "__main__":
    raise SystemExit(main())
