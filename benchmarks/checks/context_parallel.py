"""Chapter 15 under torchrun: ring attention (forward, backward), the all-gather variant and Ulysses, against full attention.

    torchrun --standalone --nproc_per_node N -m benchmarks.checks.context_parallel [--small]

Three cases (non-causal; causal with the zigzag and with the contiguous layout), each checked on
every rank's shard: the ring's output, the ring's dQ/dK/dV, the all-gather's output (9 checks);
then Ulysses' causal output and dQ/dK/dV when the ranks divide the heads (2 checks), and on GPUs the causal ring
in bf16, whose blocks run in chapter 10's Triton kernels (1 check).
The RESULT holds the causal compute time per rank for both layouts next to the causal work per
rank, the bytes each rank received in the ring (recorded) and the formula, the same for the
all-gather, the K/V each scheme holds, and the ring's time with and without overlap. ``--small``:
16 tokens per rank in fp64, for gloo ranks on a CPU; otherwise 1024 tokens per rank, 8 heads of 64, fp32.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

import torch
import torch.distributed as dist

from course_lib import context_parallel as cp
from course_lib.attention import naive_attention
from course_lib.exercises.context_parallel import random_qkv
from course_lib.support.comm import record_collectives
from course_lib.support.dist import rank_device
from course_lib.support.timeline import Timeline
from course_lib.support.timing import time_in_ranks
from course_lib.support.torchrun import entry_main, report_check

__all__ = ["check"]


def _median_seconds(fn: Any, repeat: int) -> float:
    """Median over ``repeat`` calls of ``fn()`` made by all ranks together, each the slowest rank's time."""
    return statistics.median(time_in_ranks(fn, repeat=repeat))


def check(small: bool) -> dict[str, Any]:
    """In every rank: check ring and all-gather attention against full attention; return the chapter's measurements."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    on_gpu = device.type == "cuda"
    b, h, n, d = (1, 2, 16 * world, 8) if small else (1, 8, 1024 * world, 64)
    dtype = torch.float64 if small else torch.float32
    tol = dict(rtol=1e-9, atol=1e-10) if small else dict(rtol=2e-3, atol=2e-4)
    if on_gpu and not small:
        torch.backends.cuda.matmul.allow_tf32 = False
    q, k, v, dout = (t.to(device) for t in random_qkv(b, h, n, d, dtype, seed=0, count=4))
    for causal, layout in ((False, "contiguous"), (True, "zigzag"), (True, "contiguous")):
        name = "causal_" + layout if causal else "noncausal"
        shard = functools.partial(cp.shard_sequence, rank=rank, world_size=world, layout=layout)
        lq, lk, lv = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref = naive_attention(lq, lk, lv, causal=causal)
        ref.backward(dout)
        sq, sk, sv = (shard(t.detach()).requires_grad_(True) for t in (q, k, v))
        out = cp.ring_attention(sq, sk, sv, causal=causal, layout=layout)
        out.backward(shard(dout))
        report_check(f"ring_{name}_forward", out.detach(), shard(ref.detach()), **tol)
        want = [shard(t.grad) for t in (lq, lk, lv) if t.grad is not None]
        report_check(f"ring_{name}_backward", [s.grad for s in (sq, sk, sv)], want, **tol)
        gathered, _ = cp.allgather_attention_forward(sq.detach(), sk.detach(), sv.detach(), causal=causal, layout=layout)
        report_check(f"allgather_{name}_forward", gathered, shard(ref.detach()), **tol)

    result: dict[str, Any] = {}
    if h % world == 0:
        lq, lk, lv = (t.clone().requires_grad_(True) for t in (q, k, v))
        ref = naive_attention(lq, lk, lv, causal=True)
        ref.backward(dout)
        seq_shard = functools.partial(cp.shard_sequence, rank=rank, world_size=world, layout="contiguous")
        uq, uk, uv = (seq_shard(t).transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
        with record_collectives() as ulysses_log:
            out = cp.ulysses_attention(uq, uk, uv, causal=True)
        report_check("ulysses_causal_forward", out.detach().transpose(1, 2), seq_shard(ref.detach()), **tol)
        with record_collectives() as ulysses_back_log:
            out.backward(seq_shard(dout).transpose(1, 2))
        report_check("ulysses_causal_backward", [t.grad.transpose(1, 2) for t in (uq, uk, uv) if t.grad is not None],
                     [seq_shard(t.grad) for t in (lq, lk, lv) if t.grad is not None], **tol)
        result["ulysses_bytes_received_per_rank"] = ulysses_log.bytes() * (world - 1) // world
        result["ulysses_bytes_formula"] = cp.layer_comm_bytes("ulysses", n, h, d, world, batch=b, itemsize=q.element_size())
        result["ulysses_training_bytes_received_per_rank"] = (
            (ulysses_log.bytes() + ulysses_back_log.bytes()) * (world - 1) // world)
        result["ulysses_training_bytes_formula"] = cp.layer_comm_bytes("ulysses", n, h, d, world, batch=b,
                                                                       itemsize=q.element_size(), training=True)
    if on_gpu and not small:
        zz = functools.partial(cp.shard_sequence, rank=rank, world_size=world, layout="zigzag")
        bq, bk, bv = (zz(t).to(torch.bfloat16) for t in (q, k, v))
        out, _ = cp.ring_attention_forward(bq, bk, bv, causal=True, layout="zigzag")
        report_check("ring_bf16_triton_blocks_forward", out.float(), zz(naive_attention(q, k, v, causal=True)),
                     rtol=3e-2, atol=3e-2)

    result.update({"world_size": world, "backend": dist.get_backend(), "seq_len": n, "batch": b,
                   "heads": h, "head_dim": d, "dtype": str(dtype).removeprefix("torch.")})
    repeat = 3 if small else 10
    for layout in cp.LAYOUTS:
        qs, ks, vs = (cp.shard_sequence(t, rank, world, layout) for t in (q, k, v))
        timeline = Timeline()
        cp.ring_attention_forward(qs, ks, vs, causal=True, layout=layout, timeline=timeline)
        compute = torch.tensor([timeline.busy(kind="compute")], dtype=torch.float64, device=device)
        per_rank = [torch.zeros_like(compute) for _ in range(world)]
        dist.all_gather(per_rank, compute)
        result[f"causal_{layout}_compute_s_per_rank"] = [float(t) for t in per_rank]
        result[f"causal_{layout}_time_s"] = _median_seconds(
            functools.partial(cp.ring_attention_forward, qs, ks, vs, causal=True, layout=layout), repeat)
        result[f"causal_{layout}_work_per_rank"] = cp.causal_work_per_rank(n, world, layout)
    qs, ks, vs = (cp.shard_sequence(t, rank, world, "contiguous") for t in (q, k, v))
    with record_collectives() as ring_log:
        cp.ring_attention_forward(qs, ks, vs)
    result["ring_forward_bytes_received_per_rank"] = ring_log.bytes("irecv")
    result["ring_forward_bytes_formula"] = cp.kv_comm_bytes("ring", n, d, world, b * h, q.element_size())
    with record_collectives() as gather_log:
        cp.allgather_attention_forward(qs, ks, vs)
    # An all-gather's recorded payload is this rank's contribution; each of the other ranks sends one as big.
    result["allgather_forward_bytes_received_per_rank"] = (world - 1) * gather_log.bytes("all_gather")
    result["kv_buffer_bytes"] = {s: cp.kv_buffer_bytes(s, n, d, world, b * h, q.element_size()) for s in ("ring", "allgather")}
    for overlap in (True, False):
        key = "time_with_overlap_s" if overlap else "time_without_overlap_s"
        result[key] = _median_seconds(functools.partial(cp.ring_attention_forward, qs, ks, vs, overlap=overlap), repeat)
    result["overlap_measured_on"] = "gpu" if on_gpu else "cpu (gloo; not meaningful for overlap)"
    return result


if __name__ == "__main__":
    entry_main(check, __doc__)
