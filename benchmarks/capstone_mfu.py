"""Chapter 16's GPU record of the capstone's speed: tokens/s and MFU change by change, each with its profile.

    python -m benchmarks.capstone_mfu [--out PATH] [--steps 20] [--quick]

writes ``benchmarks/results/capstone_mfu_<gpu>.json`` (``-quick`` with ``--quick``). The run is
``capstone.train`` on GPT-2 small's shape (32 x 1024 tokens a step; ``--quick``: the tiny GPT), and
each row (``ROWS``) changes the optimized run of ``capstone_<gpu>.json`` (bf16 autocast,
torch.compile, SDPA, fused AdamW): the LM head and loss fused by row chunks (the course's
cross-entropy kernels, ``RunConfig.fused_loss``), then with it the course's flat fused Adam
(``RunConfig.course_adam``), a bf16 model with fp32 master weights (``RunConfig.bf16_weights``:
the residual stream and LayerNorms in bf16 instead of fp32), with it the MLP's GELU inside the
epilogues of its matmuls (``RunConfig.fused_mlp``, ``kernels.fused_mlp``), or with it the compiled part replayed
from CUDA graphs (``RunConfig.cuda_graphs``: torch.compile's "reduce-overhead" mode), or the GELU through
chapter 08's fitted erfc, once as PyTorch operations that torch.compile fuses (``RunConfig.fitted_gelu``,
``erfc.fitted_gelu``) and once as chapter 08's bias+GELU kernel behind a custom op
(``RunConfig.kernel_gelu``, ``kernels.gelu_op``), or twice the batch (with the fused loss; with it and
bf16 weights; and with those and the bias+GELU kernel).
Per row: tokens/s over the timed steps, MFU against the datasheet's dense bf16 peak and against
cuBLAS's bf16 rate measured in the same run (the fastest rate a GEMM reaches here, at 8192^3 and
at the model's MLP shape), and where the GPU time of a step goes: ``torch.profiler`` over
``PROFILED_STEPS`` steps, kernel time per category and the largest kernels (``course_lib.profiling.profile_categories``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.provenance import run_facts
from benchmarks.report import gpu_slug
from course_lib import capstone
from course_lib.flops import device_peak_flops, utilization
from course_lib.profiling import profile_categories

__all__ = ["PROFILED_STEPS", "PROFILED_TOP", "ROWS", "main", "matmul_peak", "measure"]

RESULTS = Path(__file__).resolve().parent / "results"
PROFILED_STEPS = 3
PROFILED_TOP = 30  # kernels kept by name per row: enough to see what "other" holds
# Each row: (label, the fields it changes in the base run). Each row stands alone, so a change that
# does not pay does not hide inside the rows after it.
ROWS: list[tuple[str, dict[str, Any]]] = [
    ("optimized: bf16, torch.compile, SDPA, fused AdamW", {}),
    ("+ LM head and loss fused by row chunks", {"fused_loss": True}),
    ("+ fused loss and the course's flat Adam", {"fused_loss": True, "course_adam": True}),
    ("+ fused loss, bf16 weights and activations", {"fused_loss": True, "bf16_weights": True}),
    ("+ fused loss, bf16 weights, GELU in matmul epilogues", {"fused_loss": True, "bf16_weights": True,
                                                             "fused_mlp": True}),
    ("+ fused loss, bf16 weights, CUDA graphs", {"fused_loss": True, "bf16_weights": True, "cuda_graphs": True}),
    ("+ fused loss, bf16 weights, fitted-erfc GELU", {"fused_loss": True, "bf16_weights": True, "fitted_gelu": True}),
    ("+ fused loss, bf16 weights, bias+GELU kernel", {"fused_loss": True, "bf16_weights": True, "kernel_gelu": True}),
    ("+ fused loss, batch x2", {"fused_loss": True, "batch_size": 2}),  # batch_size: a factor on the base run's
    ("+ fused loss, bf16 weights, batch x2", {"fused_loss": True, "bf16_weights": True, "batch_size": 2}),
    ("+ fused loss, bf16 weights, bias+GELU kernel, batch x2", {"fused_loss": True, "bf16_weights": True,
                                                             "kernel_gelu": True, "batch_size": 2}),
    ("+ fused loss, bf16 weights, bias+GELU kernel, batch x4", {"fused_loss": True, "bf16_weights": True,
                                                             "kernel_gelu": True, "batch_size": 4}),
    ("+ fused loss, bf16 weights, bias+GELU kernel, batch x8", {"fused_loss": True, "bf16_weights": True,
                                                             "kernel_gelu": True, "batch_size": 8}),
]

def matmul_peak(device: torch.device, shapes: Iterable[tuple[int, int, int]],
                ms: Callable[[Callable[[], Any]], float]) -> dict[str, Any]:
    """The best bf16 (fp32 on a CPU) matmul rate over ``shapes`` (m, n, k), with the rate of each."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rates = {}
    for m, n, k in shapes:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        rates[f"{m}x{n}x{k}"] = 2.0 * m * n * k / (ms(lambda a=a, b=b: a @ b) * 1e-3)  # type: ignore[misc]
    return {"flops": max(rates.values()), "by_shape": rates, "dtype": str(dtype).removeprefix("torch.")}


def _row(label: str, run: capstone.RunConfig, device: torch.device, peak: tuple[float, str],
         matmul: float) -> dict[str, Any]:
    """Train ``run``, then profile steps of the same configuration."""
    result = capstone.train(run, device, progress=False, peak=peak)
    cfg = run.model_config()
    step, _, _ = capstone.training_step(run, device)
    for _ in range(2):  # compiled and warm before the profiler starts
        step()
    return {"label": label, "config": asdict(run), "tokens_per_s": result.tokens_per_s, "step_ms": result.step_s * 1e3,
            "mfu": result.mfu, "mfu_vs_matmul": utilization(cfg, run.batch_size, result.step_s, matmul)[0],
            "final_loss": result.losses[-1], "profile": profile_categories(step, device, PROFILED_STEPS, top=PROFILED_TOP)}


def measure(device: torch.device, quick: bool, steps: int = 20,
            on_row: Callable[[dict[str, Any]], Any] | None = None, rows: list[int] | None = None) -> dict[str, Any]:
    """The rows of ``ROWS`` (all, or those numbered in ``rows``) on ``device`` (GPT-2 small, or with ``quick``
    the tiny GPT), with the run's facts.

    ``on_row`` receives the record so far after each row (``complete`` false until the last), so that a
    run cut short still leaves the rows it measured.
    """
    chosen = [ROWS[i] for i in (range(len(ROWS)) if rows is None else rows)]
    run = capstone.RunConfig.for_this_machine(steps=min(steps, 3) if quick else steps)
    if quick:
        run = replace(run, preset="tiny", batch_size=4, warmup=1)
    if device.type == "cuda":
        from triton.testing import do_bench

        def ms(fn: Callable[[], Any]) -> float:
            return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    else:
        from course_lib.profiling import benchmark

        def ms(fn: Callable[[], Any]) -> float:
            return benchmark(fn, repeat=5).median * 1e3
    cfg = run.model_config()
    tokens = run.batch_size * cfg.seq_len
    matmul = matmul_peak(device, [(8192, 8192, 8192), (tokens, cfg.d_ff, cfg.d_model)] if device.type == "cuda"
                         else [(256, 256, 256)], ms)
    peak = device_peak_flops(device)
    command = ("python -m benchmarks.capstone_mfu" + (" --quick" if quick else "")
               + ("" if rows is None else " --rows " + " ".join(map(str, rows))))
    record = {**run_facts(command), "peak_flops": peak[0], "peak_source": peak[1], "matmul_peak": matmul,
              "complete": False, "rows": []}
    for label, fields in chosen:
        # Each row compiles its own model: without a reset their guards pile up on the same code, and past
        # dynamo's recompile limit (8) a later row would silently run its blocks eagerly.
        torch._dynamo.reset()
        changed = replace(run, **{**fields, "batch_size": run.batch_size * fields.get("batch_size", 1)})
        row = _row(label, changed, device, peak, matmul["flops"])
        record["rows"].append(row)
        record["complete"] = len(record["rows"]) == len(chosen)
        print(f"{label:52} {row['tokens_per_s']:12,.0f} tokens/s  MFU {row['mfu']:.1%} "
              f"(vs measured matmul {row['mfu_vs_matmul']:.1%})", flush=True)
        if on_row is not None:
            on_row(record)
    return record


def main(argv: list[str] | None = None) -> int:
    """Measure and write the record."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.capstone_mfu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/capstone_mfu_<gpu>.json")
    parser.add_argument("--quick", action="store_true", help="the tiny GPT, three timed steps: a smoke run")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, nargs="+", choices=range(len(ROWS)), metavar="N",
                        help="measure only these rows of ROWS (numbered from 0); default: all")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.quick:
        parser.error("needs a CUDA GPU (a CPU run is a smoke run: add --quick)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    slug = gpu_slug(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu"
    out = args.out or RESULTS / f"capstone_mfu_{slug}{'-quick' if args.quick else ''}.json"

    def write(record: dict[str, Any]) -> None:
        out.write_text(json.dumps(record, indent=1) + "\n")

    measure(device, args.quick, args.steps, on_row=write, rows=args.rows)  # rewritten after every row
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
