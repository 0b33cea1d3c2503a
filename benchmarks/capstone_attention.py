"""Chapter 16's record of attention at the capstone's own shape and layout: the course's kernels beside SDPA's.

    python -m benchmarks.capstone_attention [--out PATH] [--quick]

writes ``benchmarks/results/capstone_attention_<gpu>.json``. The capstone's model (``models.GPT`` at
GPT-2 small's shape: 12 heads of 64, T = 1024, causal) splits one (B, T, 3 H D) projection into q, k
and v, strided views seen as (B, H, T, D), and reads the output back as (B, T, H D). For each batch
of the config and each implementation of ``benchmarks.attention`` (SDPA flash, SDPA cuDNN, the
course's teaching kernels, its Hopper kernels), a forward and a backward are measured twice: in
that model layout (``"model"``) and on contiguous (B, H, T, D) tensors (``"contiguous"``), each as

- GPU kernel time per call by kernel (``profiling.profile_categories`` over ``PROFILED_CALLS``
  calls: what the GPU spent, whatever the host did), split into attention's own kernels and the
  rest: the copies that bring the inputs into the layout an implementation reads, and the gradient
  accumulation;
- wall time per call (``provenance.median_ms``) and the host's time per call (``provenance.host_ms``).

The contiguous rows price the kernels; the model rows price what the capstone would pay for them.
Each implementation is checked against the first one's output and gradients before it is timed.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from benchmarks.attention import TOLERANCE, TRAIN_FACTOR, Attention, attention_flops, implementations, relative_error
from benchmarks.provenance import host_ms, median_ms, record_main, run_facts
from course_lib.profiling import profile_categories

__all__ = ["FULL", "LAYOUTS", "PROFILED_CALLS", "QUICK", "layout_call", "main", "measure", "sweep"]

FULL: dict[str, Any] = {"batches": [32, 64], "heads": 12, "seq": 1024, "head_dim": 64, "warmup_ms": 25, "rep_ms": 100}
QUICK: dict[str, Any] = {"batches": [2], "heads": 12, "seq": 256, "head_dim": 64, "warmup_ms": 5, "rep_ms": 20}
LAYOUTS = ("model", "contiguous")
PROFILED_CALLS = 10

Timer = Callable[[Callable[[], Any], list[torch.Tensor]], float]  # ms per call of fn, given the grads to reset


def layout_call(attend: Attention, batch: int, heads: int, seq: int, head_dim: int, layout: str, device: str,
                dtype: torch.dtype, seed: int = 0) -> tuple[Callable[[], torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """(forward, its output's gradient, the leaves) of causal ``attend`` with inputs and output in ``layout``.

    ``"model"``: q, k, v are views of one (batch, seq, 3 heads head_dim) leaf, the output is read back
    as (batch, seq, heads head_dim), as ``models.CausalSelfAttention`` does; ``"contiguous"``: three
    (batch, heads, seq, head_dim) leaves and the output as it comes.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    width = heads * head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    if layout == "model":
        qkv = randn(batch, seq, 3 * width).requires_grad_(True)

        def forward() -> torch.Tensor:
            q, k, v = (t.view(batch, seq, heads, head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
            return attend(q, k, v, True).transpose(1, 2).reshape(batch, seq, width)

        return forward, randn(batch, seq, width), [qkv]
    if layout == "contiguous":
        q, k, v = (randn(batch, heads, seq, head_dim).requires_grad_(True) for _ in range(3))
        return (lambda: attend(q, k, v, True)), randn(batch, heads, seq, head_dim), [q, k, v]
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def sweep(impls: dict[str, Attention], config: dict[str, Any], ms: Timer, host: Timer,
          profile: Callable[[Callable[[], Any]], dict[str, Any]], device: str = "cuda",
          dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """One row per (batch, layout, implementation): its error, or its kernel, wall and host times per call.

    ``profile(step)`` returns ``profiling.profile_categories``'s summary of calls of ``step``.
    """
    heads, seq, dim = config["heads"], config["seq"], config["head_dim"]
    rows = []
    for batch in config["batches"]:
        flops = TRAIN_FACTOR * attention_flops(batch, heads, seq, dim, True)
        for layout in LAYOUTS:
            expected: list[torch.Tensor] = []
            reference = next(iter(impls))
            for name, attend in impls.items():
                row: dict[str, Any] = {"batch": batch, "layout": layout, "implementation": name, "error": None}
                forward, grad, leaves = layout_call(attend, batch, heads, seq, dim, layout, device, dtype)

                def call(forward: Callable[[], torch.Tensor] = forward, grad: torch.Tensor = grad) -> None:
                    forward().backward(grad)

                def step(call: Callable[[], None] = call, leaves: list[torch.Tensor] = leaves) -> None:
                    for t in leaves:
                        t.grad = None
                    call()

                try:
                    out = forward()
                    got = [out.detach(), *torch.autograd.grad(out, leaves, grad)]
                    for what, a, b in zip(["out", *(f"grad {i}" for i in range(len(leaves)))], got, expected):
                        error = relative_error(a, b)
                        if not error <= TOLERANCE:  # NaN fails too
                            raise AssertionError(f"{what} differs from {reference}'s: max error {error:.2e} x max|ref|")
                    expected = expected or got
                    step()  # compile and autotune before the profile
                    summary = profile(step)
                    wall = ms(call, leaves)
                    row.update(
                        kernel_ms=summary["ms_per_step"], attention_ms=summary["categories"].get("attention", 0.0),
                        wall_ms=wall, host_ms=host(call, leaves), tflops=flops / wall / 1e9,
                        kernel_tflops=flops / summary["ms_per_step"] / 1e9, kernels=summary["top"])
                    row["other_ms"] = max(row["kernel_ms"] - row["attention_ms"], 0.0)  # never below 0 by rounding
                except Exception as exc:  # noqa: BLE001 - a failing implementation is a row of the record
                    row["error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                rows.append(row)
                print(f"B={batch:3d} {layout:10s} {name:14s} " + (
                    f"kernels {row['kernel_ms']:.3f} ms (attention {row['attention_ms']:.3f}, rest {row['other_ms']:.3f}), "
                    f"wall {row['wall_ms']:.3f} ms, host {row['host_ms']:.3f} ms" if row["error"] is None
                    else row["error"]), flush=True)
            del expected
            if device == "cuda":
                torch.cuda.empty_cache()
    return {
        "heads": heads, "seq": seq, "head_dim": dim, "causal": True, "dtype": str(dtype).removeprefix("torch."),
        "batches": list(config["batches"]), "layouts": list(LAYOUTS), "implementations": list(impls), "rows": rows,
        "flops": "forward + backward: 3.5 x 4 B H N^2 D / 2 (causal)",
        "timing": f"kernel_ms: GPU kernel time per call, torch.profiler over {PROFILED_CALLS} calls "
                  "(course_lib.profiling.profile_categories), attention_ms the kernels it files under attention; "
                  "wall_ms: median of triton.testing.do_bench (L2 flushed between calls), leaf grads reset to None "
                  "before each call; host_ms: host time per call, calls issued back to back (provenance.host_ms)",
    }


def measure(quick: bool = False) -> dict[str, Any]:
    """The record: the sweep, with the facts of the run (date, GPU, driver, versions)."""
    config = QUICK if quick else FULL
    return {
        **run_facts("python -m benchmarks.capstone_attention" + (" --quick" if quick else "")),
        "sections": {"sweep": sweep(implementations(), config, partial(median_ms, config), host_ms,
                                    partial(profile_categories, device="cuda", steps=PROFILED_CALLS, top=8))},
    }


def main(argv: list[str] | None = None) -> int:
    """Measure and write the record (CUDA only)."""
    return record_main("capstone_attention", __doc__, measure, argv)


if __name__ == "__main__":
    raise SystemExit(main())
