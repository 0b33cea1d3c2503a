"""Benchmark the course's Triton kernels against PyTorch's own on a CUDA GPU, in one run.

Usage, from the project root (or ``make bench``, which runs the first line in the venv):

    python -m benchmarks                          # every case at full size (about 4 minutes on an H200)
    python -m benchmarks --only softmax matmul    # some cases (names below)
    python -m benchmarks --quick                  # small shapes: a smoke run, written as <slug>-quick.*
    python -m benchmarks --out /tmp/bench         # write somewhere else than benchmarks/results/

Cases (targets in brackets; ratio > 1 means ours is better):
    softmax    row softmax fp32 8192x8192 vs torch.softmax [ratio >= 1, GB/s >= 0.8 x copy]
    bias_gelu  fused bias + GELU bf16 8192x8192 vs the faster of eager F.gelu(x + bias) and torch.compile of
               it; the exact-erf kernel, torch.compile's tanh approximation and its bias add alone as context
               [ratio >= 1, GB/s >= 0.85 x copy]
    adam       FlatAdam.step() over 16 x 4096x4096 fp32 vs torch.optim.Adam(fused=True), foreach and
               for-loop as context [time <= 1.1 x fused]
    matmul     bf16 4096^3 and 8192^3 vs torch.matmul (cuBLAS) [TFLOP/s ratio >= 0.8]
    attention  flash_attention_tma (the Hopper forward and backward) for the shapes of
               cases.FULL (head dims 64 and 128, causal and not, bf16 and fp16), forward and backward,
               vs the fastest of SDPA's flash (FA2) and cuDNN backends and FlexAttention; the teaching
               kernels as context [forward ratio >= 0.9, backward >= 0.85]
    add        vector add fp32 vs torch.add (context, no target)
    transpose  coalesced vs naive transpose fp32 (context, no target)

Each time is the median of ``triton.testing.do_bench``; an attention shape's implementations are
checked first, then timed in interleaved rounds (``Sizes.rounds``: three in the full run, each
implementation once a round, in turn) and keep the median, so that a drift of the GPU's clocks
reaches ours and the references alike. The device-to-device copy bandwidth
(``dst.copy_(src)``, bytes read + written) is measured in the same run. Attention FLOPs are
4 B H N^2 D for the forward, halved when causal, and 2.5 x that for the backward, which is timed
alone (one forward, then ``backward(retain_graph=True)`` repeated).

Writes ``<slug>.json`` and ``<slug>.md`` (slug from the device name: "NVIDIA H200" -> h200).
The JSON holds: schema_version, device, slug, torch, triton, date (UTC, ISO 8601), quick,
copy_gbps, ratio_convention, summary {rows, with_targets, met, errors}, and results, a list of
{name, shape, dtype, unit ("ms" | "GB/s" | "TFLOP/s"), ours, reference, reference_name, ratio,
targets [{kind ("ratio" | "time_factor" | "copy_fraction"), threshold, description, met}],
met (null without targets), context {label: value in unit}, notes [str], error (null or str)}.
A kernel that raises or gives a wrong result is recorded as its row's error and the run goes on.

Exit status: 0 when the report is written, 2 on a machine without CUDA.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch

from benchmarks import cases
from benchmarks.report import Report

__all__ = ["main"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NO_GPU_MESSAGE = (
    "benchmarks need a CUDA GPU; on CPU the kernels run in Triton's interpreter, where timing means nothing"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: --only NAME ..., --out DIR, --quick."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description="Benchmark the course's Triton kernels against PyTorch's own."
    )
    parser.add_argument("--only", nargs="+", choices=list(cases.CASES), metavar="NAME",
                        help=f"run only these cases, of: {', '.join(cases.CASES)}")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for <slug>.json and <slug>.md")
    parser.add_argument("--quick", action="store_true", help="small shapes, short timing: a smoke run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the suite and write the report; 2 without a CUDA GPU."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2
    import triton

    names = [name for name in cases.CASES if args.only is None or name in args.only]
    device = torch.cuda.get_device_name()
    mode = "quick" if args.quick else "full"
    print(f"{device} | torch {torch.__version__} | triton {triton.__version__} | {mode} run")
    copy, results = cases.run(names, cases.QUICK if args.quick else cases.FULL, log=partial(print, flush=True))
    report = Report(
        device=device,
        torch_version=torch.__version__,
        triton_version=triton.__version__,
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        copy_gbps=copy,
        quick=args.quick,
        results=results,
    )
    json_path, md_path = report.write(args.out)
    summary = report.summary()
    print(f"targets met: {summary['met']} of {summary['with_targets']}; rows with errors: {summary['errors']}")
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
