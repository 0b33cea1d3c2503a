"""Chapter 14 under torchrun: naive split, GPipe, 1F1B and interleaved 1F1B on N stages against one process; bubbles.

    torchrun --standalone --nproc_per_node N -m benchmarks.checks.pipeline_parallel [--small]

Each schedule runs one step of a 2N-layer model on N stages (``run_pipeline``; interleaved: 2N
virtual stages of one layer, two chunks per rank, ``run_interleaved_pipeline``); every stage's
gradients and the last stage's loss are checked against the single-process step. ``--small``:
tiny layers whose "compute" is a sleep (10 ms forward, 20 ms backward), for gloo ranks on a CPU;
otherwise 4096-wide fp32 layers on 1024-row micro-batches and no sleep. The RESULT holds, per
schedule, the measured bubble of each stage next to (p - 1) / (v m + p - 1), the step time and the
peak activation bytes of each stage.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from course_lib import pipeline_parallel as pp
from course_lib.exercises.pipeline_parallel import run_interleaved_pipeline, run_pipeline, stage_reference
from course_lib.support.dist import rank_device
from course_lib.support.timeline import Timeline
from course_lib.support.torchrun import entry_main, report_check

__all__ = ["check"]


def check(small: bool) -> dict[str, Any]:
    """In every rank: check naive, GPipe, 1F1B and interleaved 1F1B against one process; return bubbles, times, peaks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    width, rows, m = (8, 4, 2 * world) if small else (4096, 1024, 4 * world)
    delay = 0.01 if small else 0.0
    tol = dict(rtol=1e-4, atol=1e-6) if small else dict(rtol=1e-3, atol=1e-5)  # fp32 sums in other orders on a GPU
    model = pp.make_model(2 * world, width, seed=0).to(dev)
    gen = torch.Generator().manual_seed(1)
    batch = tuple(torch.randn(rows * m, width, generator=gen).to(dev) for _ in range(2))
    result: dict[str, Any] = {"world_size": world, "micro_batches": m, "bubble_formula": pp.bubble_fraction(world, m)}
    for name, schedule, mbs in (("naive", "gpipe", 1), ("gpipe", "gpipe", m), ("1f1b", "1f1b", m), ("interleaved", "", m)):
        v = 2 if name == "interleaved" else 1
        if v > 1:  # 2N virtual stages of one layer: rank r runs layers r and r + N
            out = run_interleaved_pipeline(model, batch, mbs, v, forward_delay=delay, backward_delay=2 * delay)
            want_loss, all_grads = pp.reference_step(model, batch)
            want_grads = [all_grads[2 * (c * world + rank) + k] for c in range(v) for k in range(2)]
        else:
            out = run_pipeline(model, batch, mbs, schedule, forward_delay=delay, backward_delay=2 * delay)
            want_loss, want_grads = stage_reference(model, batch, out["bounds"], rank)
        got: list[torch.Tensor] = list(out["grads"])
        want: list[torch.Tensor] = list(want_grads)
        if rank == world - 1:  # only the last stage has the loss
            got, want = [out["loss"], *got], [want_loss, *want]
        report_check(name, got, want, **tol)
        timelines: list[Any] = [None] * world
        dist.all_gather_object(timelines, out["timeline"])
        peaks: list[Any] = [None] * world
        dist.all_gather_object(peaks, out["peak_bytes"])
        timeline = Timeline.merged(timelines)
        result[name] = {
            "micro_batches": mbs,
            "chunks_per_rank": v,
            "bubble_formula": pp.bubble_fraction(world, mbs, v),
            "bubble_measured": pp.measured_bubble(timeline, [f"stage {r}" for r in range(world)]),
            "step_seconds": timeline.end - timeline.start,
            "peak_activation_bytes": peaks,
        }
    return result


if __name__ == "__main__":
    entry_main(check, __doc__)
