"""Multi-GPU measurements, in one torchrun run: all-reduce bandwidth, DDP overlap, pipeline bubbles.

Usage, from the project root on a host with N GPUs (NCCL):

    torchrun --nproc_per_node N -m benchmarks.distributed --out DIR
    torchrun --nproc_per_node 2 -m benchmarks.distributed --small --out DIR   # gloo CPU ranks: a smoke run

Sections:
    all_reduce  NCCL's dist.all_reduce and the course's ring (collectives.ring_all_reduce, batched
                isend/irecv) on the same fp32 tensors, 1 KiB to 256 MiB in steps of 4: time (CUDA
                events around back-to-back calls, mean per call, slowest rank) and bus bandwidth
                busbw = size / time * 2 (N - 1) / N.
    ddp         one training step (forward + backward + gradient sync; the optimizer update is left
                out, it is the same for both) of models.GPT(GPTConfig.small()) (about 163 M
                parameters, 8 sequences of 1024 tokens per GPU, bf16 autocast with fp32 weights and
                gradients): data_parallel.BucketedDDP against torch's DistributedDataParallel (25 MiB
                buckets for both; target: ours <= 1.1 x torch), next to compute only (no sync),
                communication only (the same buckets all-reduced with nothing else running),
                naive DDP and torch DDP with gradient_as_bucket_view=True. BucketedDDP, torch DDP
                and communication only run a second time over a process group whose NCCL kernels
                go on a high-priority CUDA stream (ProcessGroupNCCL.Options.is_high_priority_stream;
                on gloo, which has no stream priority, a plain second group). The modes take turns
                over several rounds and each reports its median over the rounds (a mode timed once
                varies by a fifth from run to run). Hidden communication = compute + communication - step.
    pipeline    the bubble fraction measured by chapter 14's torchrun self-check against
                (p - 1) / (m + p - 1), started by rank 0 after the other sections as
                ``torchrun --standalone --nproc_per_node N -m benchmarks.checks.pipeline_parallel``
                (it sets up its own process group).

Before the process group starts, NVLink multicast stays off unless the environment says otherwise:
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1
(``course_lib.support.torchrun.set_nccl_env_defaults``).

Rank 0 writes DIR/multi_gpu.json, DIR/multi_gpu.md and, with matplotlib, DIR/multi_gpu_busbw.png.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.report import RATIO_CONVENTION, Result, Target
from course_lib import collectives, data_parallel, models
from course_lib.support.dist import rank_device
from course_lib.support.torchrun import max_abs_error, report_check, run_as_script, run_entry, set_nccl_env_defaults

__all__ = ["main"]

SCHEMA_VERSION = 1
BUCKET_MB = 25.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: --out DIR, --small."""
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc_per_node N -m benchmarks.distributed",
        description="All-reduce bandwidth, DDP overlap and pipeline bubbles on N GPUs, in one run.",
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for multi_gpu.json, .md and .png")
    parser.add_argument("--small", action="store_true", help="tiny sizes: a smoke run on gloo CPU ranks")
    return parser.parse_args(argv)


# ---- timing ---------------------------------------------------------------------------------------


def _barrier() -> None:
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def time_ms(fn: Callable[[], Any], iters: int, warmup: int) -> float:
    """Mean milliseconds per call of ``fn`` over ``iters`` back-to-back calls, on the slowest rank (call in every rank).

    On a GPU, CUDA events on the current stream bracket the calls (collectives make that stream
    wait for them); on the CPU, ``time.perf_counter``.
    """
    device = rank_device()
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        _barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / iters
    else:
        _barrier()
        begin = time.perf_counter()
        for _ in range(iters):
            fn()
        ms = (time.perf_counter() - begin) * 1e3 / iters
    return _worst_over_ranks(ms)


def _worst_over_ranks(value: float) -> float:
    """The largest of every rank's ``value``."""
    t = torch.tensor([value], dtype=torch.float64, device=rank_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ---- all-reduce -----------------------------------------------------------------------------------


def all_reduce_section(small: bool) -> dict[str, Any]:
    """NCCL (or gloo) all-reduce and the course's ring on the same tensors: time and busbw against size."""
    world, device = dist.get_world_size(), rank_device()
    x = collectives.rank_input(0, dist.get_rank(), 2**16 + 1).to(device)
    ours, theirs = collectives.ring_all_reduce(x.clone()), x.clone()
    dist.all_reduce(theirs)
    error = report_check("ring_all_reduce vs dist.all_reduce (65537 fp32)", ours, theirs, rtol=1e-5, atol=1e-5 * world)
    sizes = [2**k for k in range(10, 17, 2)] if small else [2**k for k in range(10, 29, 2)]
    rows = []
    for n_bytes in sizes:
        t = torch.zeros(n_bytes // 4, device=device)  # zeros stay zeros however often they are summed
        theirs_ms = time_ms(functools.partial(dist.all_reduce, t), iters=5 if small else 20, warmup=2 if small else 5)
        ours_ms = time_ms(functools.partial(collectives.ring_all_reduce, t), iters=3 if small else 10, warmup=1 if small else 3)
        busbw = {
            name: collectives.bus_bandwidth(n_bytes, ms / 1e3, world) / 1e9
            for name, ms in (("ours", ours_ms), ("ref", theirs_ms))
        }
        rows.append(Result(
            f"all_reduce {_human(n_bytes)}", [n_bytes // 4], "float32", "GB/s", f"dist.all_reduce ({dist.get_backend()})",
            ours=busbw["ours"], reference=busbw["ref"], context={"ring ms": ours_ms, f"{dist.get_backend()} ms": theirs_ms},
            notes=["busbw = bytes / time * 2 (N - 1) / N; ours = collectives.ring_all_reduce"],
        ))
    return {"check_max_abs_err": error, "sizes_bytes": sizes, "rows": rows}


# ---- DDP ------------------------------------------------------------------------------------------


def high_priority_group() -> dist.ProcessGroup:
    """A process group over all ranks whose NCCL kernels run on a high-priority CUDA stream (a plain group on gloo)."""
    if dist.get_backend() != "nccl":
        return dist.new_group()
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return dist.new_group(backend="nccl", pg_options=options)


STREAM_LABEL = {"nccl": "NCCL on a high-priority CUDA stream", "gloo": "a second gloo group (gloo has no stream priority)"}
# Modes timed twice: over the default process group and over high_priority_group() (suffix "_hp").
TWICE = ("communication_only", "bucketed", "torch_ddp")


def ddp_section(small: bool) -> dict[str, Any]:
    """One GPT step under BucketedDDP and torch's DDP, next to compute only, communication only and naive DDP."""
    device = rank_device()
    hp_group = high_priority_group()
    cfg = models.GPTConfig.tiny() if small else models.GPTConfig.small()
    batch = 2 if small else 8
    base = models.GPT(cfg, seed=0)
    x, y = models.random_batch(cfg, batch, device=device, seed=dist.get_rank())
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    models_by_mode: dict[str, nn.Module] = {}

    params = [p for p in base.parameters() if p.requires_grad]
    flats = [torch.zeros(sum(params[i].numel() for i in bucket), device=device)
             for bucket in data_parallel.assign_buckets(params, BUCKET_MB * 2**20)]

    def training_step(mode: str) -> Callable[[], None]:
        group = hp_group if mode.endswith("_hp") else None
        kind = mode.removesuffix("_hp")
        if kind == "communication_only":
            def all_reduce_buckets() -> None:
                for work in [dist.all_reduce(f, group=group, async_op=True) for f in flats]:
                    work.wait()

            return all_reduce_buckets
        model = models_by_mode[mode] = copy.deepcopy(base).to(device)
        net: Any = model
        if kind == "bucketed":
            net = data_parallel.BucketedDDP(model, bucket_cap_mb=BUCKET_MB, group=group)
        elif kind == "torch_ddp":
            net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB, process_group=group)
        elif kind == "torch_ddp_view":
            net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            with autocast:
                _, loss = net(x, y)
            loss.backward()
            if kind == "naive":
                data_parallel.average_gradients(model)
            elif kind == "bucketed":
                net.finish_gradient_sync()

        return step

    iters, warmup, rounds = (2, 1, 1) if small else (10, 3, 5)
    modes = ["compute_only", "communication_only", "bucketed", "torch_ddp", "torch_ddp_view", "naive"]
    modes += [f"{m}_hp" for m in TWICE]
    steps = {mode: training_step(mode) for mode in modes}
    per_round: dict[str, list[float]] = {mode: [] for mode in steps}
    for _ in range(rounds):  # modes take turns, so a slow spell of the machine hits all of them
        for mode, step in steps.items():
            per_round[mode].append(time_ms(step, iters, warmup))
    ms = {mode: statistics.median(values) for mode, values in per_round.items()}
    # Recorded, not asserted: with bf16 autocast, kernels such as flash attention's backward are not bitwise
    # deterministic, so the two runs differ a little even before the all-reduce (the chapter's entry checks exactly).
    grad_error = _worst_over_ranks(max_abs_error(
        [p.grad for p in models_by_mode["bucketed"].parameters()],
        [p.grad for p in models_by_mode["torch_ddp"].parameters()],
    ))
    overlap = {}
    for mode in ("bucketed", "torch_ddp", "torch_ddp_view", "bucketed_hp", "torch_ddp_hp"):
        comm = ms["communication_only_hp" if mode.endswith("_hp") else "communication_only"]
        hidden = min(max(ms["compute_only"] + comm - ms[mode], 0.0), comm)
        overlap[mode] = {"hidden_ms": hidden, "hidden_fraction": hidden / comm}
    precision = "bf16 autocast, fp32 weights and gradients" if device.type == "cuda" else "fp32"
    notes = [f"GPT {cfg.n_layer} layers x {cfg.d_model}, {batch} x {cfg.seq_len} tokens per rank, {BUCKET_MB:g} MiB buckets; "
             f"step = forward + backward + gradient sync; median of {rounds} interleaved rounds of {iters} steps"]
    rows = [
        Result(f"ddp_step{suffix}", [base.num_params()], precision, "ms", "torch DistributedDataParallel",
               ours=ms[f"bucketed{suffix}"], reference=ms[f"torch_ddp{suffix}"], targets=[Target("time_factor", 1.1)],
               context={"compute only": ms["compute_only"], "communication only": ms[f"communication_only{suffix}"]},
               notes=[*notes, f"process group: {label}"])
        for suffix, label in (("", "the default one"), ("_hp", STREAM_LABEL[dist.get_backend()]))
    ]
    return {
        "model": {"params": base.num_params(), "n_layer": cfg.n_layer, "d_model": cfg.d_model, "vocab_size": cfg.vocab_size,
                  "batch_per_rank": batch, "seq_len": cfg.seq_len, "precision": precision},
        "bucket_mb": BUCKET_MB,
        "rounds": rounds,
        "iters_per_round": iters,
        "ms": ms,
        "ms_per_round": per_round,
        "overlap": overlap,
        "grad_max_abs_err_vs_torch": grad_error,
        "rows": rows,
    }


# ---- pipeline (chapter 14's torchrun self-check) --------------------------------------------------

_PIPELINE_CHECK = "benchmarks.checks.pipeline_parallel"


def pipeline_section(world: int, small: bool, timeout: float = 300.0) -> dict[str, Any]:
    """Run chapter 14's torchrun self-check on ``world`` ranks; keep its CHECK lines and RESULT."""
    args = ["--small"] if small else []
    shown = f"torchrun --standalone --nproc_per_node {world} -m {_PIPELINE_CHECK} {' '.join(args)}".rstrip()
    try:
        run = run_entry(_PIPELINE_CHECK, world, *args, timeout=timeout)
    except RuntimeError as err:
        return {"command": shown, "error": str(err)}
    return {
        "command": shown,
        "checks": [f"CHECK {name} ok" for name in run.checks],
        "result": run.result,
        "formula": "(p - 1) / (m + p - 1) for p stages and m micro-batches",
    }


# ---- the run --------------------------------------------------------------------------------------


def measure(small: bool) -> dict[str, Any]:
    """In every rank: the all-reduce and DDP sections, and where the run happens (rank 0's view)."""
    gpus = [torch.cuda.get_device_name(i) for i in range(dist.get_world_size())] if rank_device().type == "cuda" else []
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    sections = {"all_reduce": all_reduce_section(small)}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    sections["ddp"] = ddp_section(small)
    return {"backend": dist.get_backend(), "world_size": dist.get_world_size(), "gpus": gpus, "nccl": nccl, "sections": sections}


def to_json(run: dict[str, Any]) -> dict[str, Any]:
    """The run with every ``Result`` turned into its JSON row."""
    def convert(obj: Any) -> Any:
        if isinstance(obj, Result):
            return obj.to_dict(None)
        if isinstance(obj, dict):
            return {k: convert(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [convert(v) for v in obj]
        return obj

    return convert(run)


def to_markdown(run: dict[str, Any]) -> str:
    """The report: where and how it ran, then a table per section."""
    s = run["sections"]
    lines = [
        f"# Multi-GPU measurements: {run['world_size']} x {', '.join(sorted(set(run['gpus']))) or 'CPU (gloo)'}"
        + (" (small smoke run)" if run["small"] else ""),
        "",
        f"- command: `{run['command']}`",
        f"- {run['date']}; backend {run['backend']}; torch {run['torch']}; NCCL {run['nccl'] or 'n/a'}",
        f"- environment: {', '.join(f'{k}={v}' for k, v in run['env'].items())}",
        f"- {RATIO_CONVENTION}",
        "",
        "## All-reduce: bus bandwidth against size",
        "",
        f"Ring vs `dist.all_reduce` on random data: max abs error {s['all_reduce']['check_max_abs_err']:.3g}.",
        "",
        "| size | ring busbw (GB/s) | torch busbw (GB/s) | ring ms | torch ms | ratio |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s["all_reduce"]["rows"]:
        ring_ms, torch_ms = r.context.values()
        size = r.name.split(" ", 1)[1]
        lines.append(f"| {size} | {r.ours:.3g} | {r.reference:.3g} | {ring_ms:.3g} | {torch_ms:.3g} | {r.ratio:.3f} |")
    ddp = s["ddp"]
    m = ddp["model"]
    lines += [
        "",
        "## DDP step: BucketedDDP against torch DDP",
        "",
        f"GPT of {m['params'] / 1e6:.1f} M parameters ({m['n_layer']} layers x {m['d_model']}), "
        f"{m['batch_per_rank']} x {m['seq_len']} tokens per rank, {m['precision']}, {ddp['bucket_mb']:g} MiB buckets; "
        "a step is forward + backward + gradient sync. "
        f"Max abs difference of the gradients: {ddp['grad_max_abs_err_vs_torch']:.3g}. "
        f"Each mode: median of {ddp['rounds']} rounds of {ddp['iters_per_round']} steps, the modes taking turns; "
        "the range is the fastest and slowest round.",
        "",
        "| what | ms per step (median) | range over rounds | communication hidden (ms) | hidden fraction |",
        "|---|---:|---:|---:|---:|",
    ]
    second = STREAM_LABEL[run["backend"]]
    for mode, label in (("compute_only", "compute only (no sync)"), ("communication_only", "communication only (same buckets)"),
                        ("naive", "naive DDP (all-reduce per tensor after backward)"),
                        ("bucketed", "BucketedDDP (course)"), ("torch_ddp", "torch DistributedDataParallel"),
                        ("torch_ddp_view", "torch DDP, gradient_as_bucket_view=True"),
                        ("communication_only_hp", f"communication only, {second}"),
                        ("bucketed_hp", f"BucketedDDP, {second}"), ("torch_ddp_hp", f"torch DDP, {second}")):
        hidden = ddp["overlap"].get(mode)
        extra = f"{hidden['hidden_ms']:.3g} | {hidden['hidden_fraction']:.0%}" if hidden else " | "
        values = ddp["ms_per_round"][mode]
        lines.append(f"| {label} | {ddp['ms'][mode]:.3g} | {min(values):.3g}-{max(values):.3g} | {extra} |")
    lines.append("")
    for row, group in zip(ddp["rows"], ("default process group", second)):
        verdict = {True: "met", False: "not met", None: ""}[row.met(None)]
        lines.append(f"- BucketedDDP / torch DDP time, {group}: {row.ours / row.reference:.3f} (target <= 1.1: {verdict}).")
    pipe = s["pipeline"]
    lines += ["", "## Pipeline bubble fraction", ""]
    if "error" in pipe:
        lines += [f"`{pipe['command']}` failed:", "", "```", pipe["error"], "```"]
    else:
        lines += [f"From `{pipe['command']}`; formula {pipe['formula']}.", "", "| key | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in _flatten(pipe["result"]).items()]
    return "\n".join(lines) + "\n"


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one dict with dotted keys."""
    if not isinstance(obj, dict):
        return {prefix: obj}
    out: dict[str, Any] = {}
    for k, v in obj.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def plot_busbw(run: dict[str, Any], path: Path) -> bool:
    """Bus bandwidth against size, ring and torch, into ``path``; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = run["sections"]["all_reduce"]["rows"]
    sizes = run["sections"]["all_reduce"]["sizes_bytes"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.semilogx(sizes, [r.reference for r in rows], "o-", label=rows[0].reference_name)
    ax.semilogx(sizes, [r.ours for r in rows], "s--", label="course ring_all_reduce")
    best = max(r.reference for r in rows)
    ax.set(xlabel="all-reduce size (bytes)", ylabel="bus bandwidth (GB/s)",
           title=f"All-reduce on {run['world_size']} ranks: busbw peaks at {best:.0f} GB/s for large messages")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _human(n_bytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:g} {unit}"
    return f"{n_bytes} B"


def main(argv: list[str] | None = None) -> int:
    """Measure in every rank; rank 0 adds the pipeline section and writes the report."""
    args = parse_args(argv)
    env = set_nccl_env_defaults()
    run = run_as_script(measure, args.small)
    if int(os.environ["RANK"]) != 0:
        return 0
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    run["sections"]["pipeline"] = pipeline_section(run["world_size"], args.small)
    run.update(
        command=f"torchrun --nproc_per_node {run['world_size']} -m benchmarks.distributed "
        + " ".join(sys.argv[1:] if argv is None else argv),
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        torch=torch.__version__,
        env=env,
        small=args.small,
        schema_version=SCHEMA_VERSION,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "multi_gpu.json").write_text(json.dumps(to_json(run), indent=2) + "\n")
    (args.out / "multi_gpu.md").write_text(to_markdown(run))
    plotted = plot_busbw(run, args.out / "multi_gpu_busbw.png")
    print(f"wrote {args.out / 'multi_gpu.json'}, {args.out / 'multi_gpu.md'}" + (" and the busbw plot" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
