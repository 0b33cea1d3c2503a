"""Chapter 06's GPU record: one training step per precision, and fp8 matmuls: ``python -m benchmarks.mixed_precision``.

Writes ``benchmarks/results/mixed_precision_<gpu>.json`` (``--out`` to choose), which chapter 06
renders with ``course_lib.support.records``. Two sections:

- ``train_step``: the course's GPT at GPT-2 small's shape (batch 8 x 1024 tokens), AdamW, one
  step per variant: fp32; fp32 with tf32 matmuls; autocast bf16; autocast fp16 with GradScaler;
  bf16 weights with fp32 master weights (the chapter's ``mixed_precision_step``); and the fastest
  reference: autocast bf16 with the model compiled by ``torch.compile`` and a fused AdamW. Per
  variant: seconds per step (median, p10, p90, ``profiling.benchmark``), tokens per second, the
  allocator's peak during a step, the bytes of weights + gradients + optimizer states, and the
  peak of what autograd saved for the backward pass (``mixed_precision.measure_step``; not counted
  for the compiled model, null there).
- ``fp8_matmul``: square bf16 matrices of 2048, 4096 and 8192: TFLOP/s of ``torch.mm`` (cuBLAS,
  bf16) and of ``torch._scaled_mm`` on e4m3 operands with per-tensor scales and a bf16 output
  (``use_fast_accum`` off and on); the time of one current-scaling cast (amax, scale, cast) of
  an operand; the relative error of each product against the fp64 product of the same bf16 inputs.

``--quick`` runs small shapes (a smoke run); ``--device cpu --quick --no-compile`` runs the same
code on a CPU (the unit tests do), where the times mean little.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.provenance import driver_version
from course_lib import fp8
from course_lib import mixed_precision as mp
from course_lib.models import GPT, GPTConfig, random_batch
from course_lib.profiling import benchmark

__all__ = ["fp8_matmul", "main", "measure", "train_step"]

RESULTS = Path(__file__).resolve().parent / "results"


def _variants(compile_model: bool) -> list[tuple[str, Callable[..., Any]]]:
    """(name, builder) per training-step variant; a builder returns (step, trained tensors, optimizer)."""

    def autocast(dtype: torch.dtype | None, tf32: bool = False, scaled: bool = False,
                 compiled: bool = False) -> Callable[..., Any]:
        def build(cfg: GPTConfig, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> Any:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            model = GPT(cfg, seed=0).to(device)
            fused = compiled and device.type == "cuda"
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
            run = torch.compile(model) if compiled else model
            scaler = torch.amp.GradScaler(device.type) if scaled else None
            return (lambda: mp.autocast_step(run, opt, *batch, dtype, scaler)), list(model.parameters()), opt
        return build

    def master(cfg: GPTConfig, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> Any:
        torch.backends.cuda.matmul.allow_tf32 = False
        mw = mp.MasterWeights(GPT(cfg, seed=0).to(device), torch.bfloat16)
        opt = torch.optim.AdamW(mw.params, lr=1e-4)
        loss_fn = mp.gpt_loss(*batch)
        return (lambda: mp.mixed_precision_step(mw.model, mw.params, opt, None, loss_fn)), \
            list(mw.model.parameters()) + mw.params, opt

    variants = [("fp32", autocast(None)), ("fp32 + tf32 matmuls", autocast(None, tf32=True)),
                ("autocast bf16", autocast(torch.bfloat16)),
                ("autocast fp16 + GradScaler", autocast(torch.float16, scaled=True)),
                ("bf16 weights + fp32 master (mixed_precision_step)", master)]
    if compile_model:
        variants.append(("autocast bf16 + torch.compile + fused AdamW (fastest reference)",
                         autocast(torch.bfloat16, compiled=True)))
    return variants


def _measure_variant(build: Callable[..., Any], cfg: GPTConfig, batch: tuple[torch.Tensor, torch.Tensor],
                     device: torch.device, repeat: int, count_saved: bool) -> dict[str, Any]:
    """One variant's row; its model and optimizer are freed when it returns."""
    step, params, opt = build(cfg, batch, device)
    got = mp.measure_step(step, params, opt, device, warmup=1 if repeat < 5 else 3, repeat=repeat,
                          count_saved=count_saved)
    lo, hi = got.seconds.spread
    return {"ms_per_step": got.seconds.median * 1e3, "ms_p10": lo * 1e3, "ms_p90": hi * 1e3,
            "tokens_per_s": batch[0].numel() / got.seconds.median, "peak_bytes": got.cuda_peak_bytes,
            "state_bytes": got.state_bytes, "saved_bytes": got.saved_bytes, "error": None}


def train_step(device: torch.device, quick: bool = False, compile_model: bool = True) -> dict[str, Any]:
    """Time and memory of one training step per variant (see the module's docstring)."""
    cfg = GPTConfig.tiny() if quick else GPTConfig.small()
    batch_size = 2 if quick else 8
    batch = random_batch(cfg, batch_size, device=device, seed=0)
    rows = []
    for name, build in _variants(compile_model):
        try:
            rows.append({"variant": name, **_measure_variant(build, cfg, batch, device, 3 if quick else 15,
                                                             count_saved="torch.compile" not in name)})
        except Exception as exc:  # a variant that fails (no compiler for torch.compile) is recorded; the others run
            rows.append({"variant": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"model": "GPT, GPT-2 small's shape" if not quick else "GPT, tiny", "params": GPT(cfg).num_params(),
            "batch": batch_size, "seq_len": cfg.seq_len, "optimizer": "AdamW", "rows": rows}


def fp8_matmul(device: torch.device, quick: bool = False) -> dict[str, Any]:
    """bf16 torch.mm against torch._scaled_mm on e4m3 with per-tensor scales: TFLOP/s, cast time, error."""
    rows = []
    for n in ((16, 32) if quick else (2048, 4096, 8192)):
        gen = torch.Generator(device=device).manual_seed(n)
        a = torch.randn(n, n, device=device, generator=gen).to(torch.bfloat16)
        b = torch.randn(n, n, device=device, generator=gen).to(torch.bfloat16)
        exact = a.double() @ b.double()
        qa, sa = fp8.to_fp8(a)
        qb, sb = fp8.to_fp8(b)
        # laid out and inverted once, outside the timed call, as a training step would keep them
        qb_col, inv_a, inv_b = qb.t().contiguous().t(), sa.reciprocal(), sb.reciprocal()
        repeat = 3 if quick else 20
        flops = 2 * n**3
        row: dict[str, Any] = {"n": n}
        row["bf16_tflops"] = flops / benchmark(torch.mm, a, b, repeat=repeat, device=device).median / 1e12
        row["bf16_rel_error"] = fp8.relative_error(a @ b, exact)
        for fast in (False, True):
            key = "fp8_fast_accum" if fast else "fp8"
            t = benchmark(torch._scaled_mm, qa, qb_col, scale_a=inv_a, scale_b=inv_b, out_dtype=torch.bfloat16,
                          use_fast_accum=fast, repeat=repeat, device=device)
            row[f"{key}_tflops"] = flops / t.median / 1e12
            row[f"{key}_rel_error"] = fp8.relative_error(fp8.scaled_mm(qa, qb, sa, sb, torch.bfloat16, fast), exact)
        row["cast_ms"] = benchmark(fp8.to_fp8, a, repeat=repeat, device=device).median * 1e3
        rows.append(row)
    return {"inputs": "bf16, N(0, 1)", "output": "bf16", "scales": "per tensor, current (amax of the operand)",
            "rows": rows}


def measure(device: torch.device | str = "cuda", quick: bool = False, compile_model: bool = True) -> dict[str, Any]:
    """Both sections, with the facts of the run (date, GPU, versions)."""
    device = torch.device(device)
    sections: dict[str, Any] = {"train_step": train_step(device, quick, compile_model)}
    if fp8.has_fp8_matmul(device) or quick:
        sections["fp8_matmul"] = fp8_matmul(device, quick)
    facts: dict[str, Any] = {"device": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts = {"gpu": props.name, "capability": list(torch.cuda.get_device_capability(device)),
                 "driver": driver_version(), "cuda": torch.version.cuda}
    return {"schema_version": 1, "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), **facts,
            "torch": torch.__version__, "python": platform.python_version(), "quick": quick,
            "command": "python -m benchmarks.mixed_precision", "sections": sections}


def main(argv: list[str] | None = None) -> int:
    """Measure and write the record."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mixed_precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/mixed_precision_<gpu>.json")
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke run")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu with --quick")
    parser.add_argument("--no-compile", dest="compile_model", action="store_false",
                        help="leave out the torch.compile variant")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --device cpu --quick)")
    if args.device != "cuda" and not args.quick:
        parser.error("a CPU run is a smoke run: add --quick")
    record = measure(args.device, args.quick, args.compile_model)
    slug = str(record.get("gpu", "cpu")).lower().replace("nvidia", "").strip().split()[0]
    out = args.out or RESULTS / f"mixed_precision_{slug}{'-quick' if args.quick else ''}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    for row in record["sections"]["train_step"]["rows"]:
        print(row["variant"], "|", row.get("error") or f"{row['ms_per_step']:.1f} ms/step")
    for row in record["sections"].get("fp8_matmul", {}).get("rows", []):
        print(f"n={row['n']}: bf16 {row['bf16_tflops']:.3g} TFLOP/s, fp8 {row['fp8_tflops']:.3g}, "
              f"fast accum {row['fp8_fast_accum_tflops']:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
