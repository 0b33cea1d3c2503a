"""Chapter 16's GPU record: the capstone ablation on one GPU: ``python -m benchmarks.capstone``.

Writes ``benchmarks/results/capstone_ablation_<gpu>.json`` (``--out`` to choose), which chapter 16
renders with ``course_lib.support.records``. The course GPT at GPT-2 small's shape (12 layers,
width 768, sequence 1024, untied output layer), 16 sequences per step, trained with
``capstone.assemble`` and the course's parts (``capstone.Parts()``: the Triton FlashAttention of
chapter 10, the fused Adam kernel of chapter 08, bf16 autocast, chapter 07's checkpointing);
``capstone.ablation`` switches the techniques on one at a time in ``capstone.TECHNIQUES`` order.
Per row: tokens per second over the timed steps, the allocator's peak during one more step, MFU
against the GPU's dense bf16 datasheet peak (``flops.device_peak_flops``), and the losses.

``measure(device, quick=True)`` is the CPU-testable core (the tiny GPT; the unit tests run it);
``main`` needs a GPU unless given ``--device cpu --quick``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.provenance import run_facts
from course_lib import capstone, models
from course_lib.flops import device_peak_flops

__all__ = ["RESULTS", "main", "measure"]

RESULTS = Path(__file__).resolve().parent / "results"


def measure(device: str, quick: bool, steps: int = 20, warmup: int = 5) -> dict[str, Any]:
    """The ablation's rows on ``device`` (GPT-2 small, or with ``quick`` the tiny GPT for a few steps), with the run's facts."""
    dev = torch.device(device)
    if quick:
        run, steps, warmup = capstone.CapstoneRun(), min(steps, 2), 1
    else:
        run = capstone.CapstoneRun(models.GPTConfig.small(), batch_size=16, lr=6e-4)
    parts = capstone.Parts()
    peak, source = device_peak_flops(dev)
    rows = capstone.ablation(capstone.assemble, parts, run, capstone.TECHNIQUES, steps, peak, warmup)
    command = f"python -m benchmarks.capstone{' --quick' if quick else ''}{' --device cpu' if dev.type == 'cpu' else ''}"
    return {**run_facts(command), "model": vars(run.model), "batch_size": run.batch_size, "tokens_per_step": run.tokens_per_step,
            "steps": steps, "warmup": warmup, "peak_flops": peak, "peak_source": source, "order": list(capstone.TECHNIQUES),
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    """Measure and write the record."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.capstone", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/capstone_ablation_<gpu>.json")
    parser.add_argument("--quick", action="store_true", help="the tiny GPT, two timed steps: a smoke run")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu with --quick")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --device cpu --quick)")
    if args.device != "cuda" and not args.quick:
        parser.error("a CPU run is a smoke run: add --quick")
    if args.device != "cuda" and torch.cuda.is_available():
        parser.error("the run uses the machine's device (course_lib.env): a CPU run needs a machine without a GPU")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    record = measure(args.device, args.quick, args.steps)
    slug = str(record.get("gpu", "cpu")).lower().replace("nvidia", "").strip().split()[0]
    out = args.out or RESULTS / f"capstone_ablation_{slug}{'-quick' if args.quick else ''}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    for row in record["rows"]:
        print(f"{'+ ' + row['added'] if row['added'] else 'plain':<16}{row['tokens_per_s']:12,.0f} tokens/s"
              f"{row['peak_bytes'] / 2**20:10.0f} MiB{row['mfu']:9.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
