"""A whole training step of the course GPT four ways, on a GPU: ``python -m benchmarks.step_graphs [--out PATH]``.

Chapter 03 renders this record (``benchmarks/results/step_graphs_<gpu>.json``). Each model runs the
same step (bf16 autocast, forward, backward, ``AdamW(fused=True, capturable=True)``) as

- ``eager``: PyTorch as written, one kernel launch at a time from Python;
- ``compile``: the model under ``torch.compile`` (default mode: fused kernels), the optimizer eager;
- ``graph``: the eager step captured whole by ``graphs.graph_step`` and replayed (no Python, one launch);
- ``compile + graph``: the compiled model's step, captured whole the same way.

For each: the median step time with its spread (``profiling.benchmark``), tokens per second, MFU
against the datasheet peak, and the one-off cost (compilation, capture) measured apart. Two
models: a small one, where launching kernels is most of the step, and GPT-2 small, where the
matmuls are.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.provenance import run_facts
from course_lib import flops, graphs, models
from course_lib.profiling import benchmark

__all__ = ["MODES", "main", "measure", "measure_model"]

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("eager", "compile", "graph", "compile + graph")
MODELS = {
    "small (4 layers, width 256, 256 tokens)": (models.GPTConfig(vocab_size=8192, seq_len=256, n_layer=4, n_head=4,
                                                                 d_model=256), 16),
    "GPT-2 small (12 layers, width 768, 1024 tokens)": (models.GPTConfig.small(), 8),
}


def _step_for(cfg: models.GPTConfig, compiled: bool) -> tuple[Callable[..., torch.Tensor], torch.nn.Module]:
    """A training step of a fresh GPT(cfg) on the GPU, and its model."""
    model = models.GPT(cfg, seed=0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)
    run = torch.compile(model) if compiled else model

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):  # no autocast cache in a graph
            _, loss = run(x, y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step, model


def _one_off(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()``'s result and its seconds, the GPU waited for."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _prepared(cfg: models.GPTConfig, mode: str, x: torch.Tensor, y: torch.Tensor) -> tuple[Callable[..., Any], float]:
    """The step of ``mode``, ready to time, and its one-off seconds (compilation; warm-up and capture)."""
    step, _ = _step_for(cfg, compiled="compile" in mode)
    if "graph" in mode:
        return _one_off(lambda: graphs.graph_step(step, (x, y), graphs.CudaGraphs(), warmup=3))
    _, first = _one_off(lambda: step(x, y))
    _, second = _one_off(lambda: step(x, y))
    return step, first - second


def measure_model(cfg: models.GPTConfig, batch: int, repeat: int = 50) -> dict[str, Any]:
    """Each of ``MODES`` on one model: step time (median, p10, p90), tokens/s, MFU and the one-off seconds."""
    x, y = models.random_batch(cfg, batch, device="cuda", seed=0)
    peak, peak_source = flops.device_peak_flops(torch.device("cuda"))
    model_flops, _ = flops.step_flops(cfg, batch)
    rows: list[dict[str, Any]] = []
    for mode in MODES:
        try:
            run, one_off = _prepared(cfg, mode, x, y)
            timing = benchmark(run, x, y, warmup=5, repeat=repeat)
        except Exception as exc:  # a mode that cannot run here is recorded as such, not dropped
            rows.append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        lo, hi = timing.spread
        rows.append({"mode": mode, "step_ms": timing.median * 1e3, "p10_ms": lo * 1e3, "p90_ms": hi * 1e3,
                     "tokens_per_s": batch * cfg.seq_len / timing.median,
                     "mfu": model_flops / timing.median / peak, "one_off_s": one_off})
        del run
        torch.cuda.empty_cache()
    return {"config": {k: getattr(cfg, k) for k in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model")},
            "batch": batch, "model_flops_per_step": model_flops, "peak_flops": peak, "peak_source": peak_source,
            "rows": rows}


def measure(repeat: int = 50) -> dict[str, Any]:
    """Every model of ``MODELS``, with the facts of the run (date, GPU, driver, versions)."""
    return {
        **run_facts("python -m benchmarks.step_graphs"),
        "sections": {"step_modes": {"unit": "ms per training step (median, p10, p90)",
                                    "models": {name: measure_model(cfg, batch, repeat)
                                               for name, (cfg, batch) in MODELS.items()}}},
    }


def main(argv: list[str] | None = None) -> int:
    """Measure and write the record (CUDA only)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_graphs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/step_graphs_<gpu>.json")
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    record = measure(args.repeat)
    slug = record["gpu"].lower().replace("nvidia", "").strip().split()[0]
    out = args.out or RESULTS / f"step_graphs_{slug}.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    for name, section in record["sections"]["step_modes"]["models"].items():
        print(name)
        for row in section["rows"]:
            print("  " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
