"""Chapter 16 under torchrun: the mesh's groups built by hand, and DP x TP training, against init_device_mesh and one process.

    torchrun --standalone --nproc_per_node N -m benchmarks.checks.hybrid [--small]

Layouts: dp1 x tp2 and dp2 x tp1 on 2 ranks, dp(N/2) x tp2 on an even N >= 4, dpN x tp1 on an
odd N. Per layout two checks: each rank's dp and tp groups from ``hybrid.new_mesh_groups`` equal
``init_device_mesh``'s, and the shard each rank trained (parameters and gradients) equals the
matching shard of the block trained in one process. The RESULT holds each layout's step time
(slowest rank) and which node each rank of each tensor-parallel group ran on (torchrun's
``GROUP_RANK``: under ``--nnodes 2`` a dp x tp layout keeps every tp group inside one node, as a
cluster must, since tensor parallelism talks in every layer). ``--small``: the default
``HybridCase`` (width 32); otherwise width 512, 8 heads, 256 tokens, 8 sequences per rank.
On a multiple of 8 ranks one more check trains a pipeline too: pp2 x dp(N/4) x tp2
(``hybrid.train_pp_dp_tp``), every stage's shards against the stack trained in one process.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from course_lib import hybrid
from course_lib.exercises.hybrid import reference_shard, train_single_block, train_single_stack
from course_lib.support.dist import rank_device
from course_lib.support.torchrun import entry_main, report_check

__all__ = ["check"]


def _layouts(world: int) -> list[tuple[int, int]]:
    """The (dp, tp) layouts checked on ``world`` ranks."""
    if world == 2:
        return [(1, 2), (2, 1)]
    return [(world // 2, 2)] if world % 2 == 0 else [(world, 1)]


def check(small: bool) -> dict[str, Any]:
    """In every rank: check each layout's groups and training against init_device_mesh and one process; return step times."""
    world = dist.get_world_size()
    case = hybrid.HybridCase() if small else hybrid.HybridCase(d_model=512, n_head=8, seq_len=256,
                                                               global_batch=8 * world, steps=5)
    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", "0")))  # the node (agent) of every rank
    result: dict[str, Any] = {"world_size": world, "backend": dist.get_backend(), "layouts": {}}
    single = train_single_block(case, rank_device())
    names = ("dp", "tp")
    for dp, tp in _layouts(world):
        if case.global_batch % dp or case.n_head % tp:
            continue
        mesh = hybrid.new_mesh_groups((dp, tp), names)
        theirs = hybrid.device_mesh_groups((dp, tp), names)
        report_check(f"mesh_dp{dp}xtp{tp}", [torch.tensor(mesh.ranks[n]) for n in names],
                     [torch.tensor(theirs[n]) for n in names])
        out = hybrid.train_dp_tp(case, dp, tp, mesh=mesh)
        err = report_check(f"dp{dp}xtp{tp}_vs_single_process", out["model"],
                           reference_shard(single, mesh.coords["tp"], tp), rtol=1e-4, atol=1e-5)
        slowest = torch.tensor([out["step_s"]], dtype=torch.float64, device=rank_device())
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        tp_groups: list[Any] = [None] * world
        dist.all_gather_object(tp_groups, mesh.ranks["tp"])
        result["layouts"][f"dp{dp}xtp{tp}"] = {
            "step_s": slowest.item(), "max_abs_err": err,
            "tp_group_nodes": sorted({tuple(nodes[r] for r in group) for group in tp_groups}),
        }
    if world % 8 == 0:
        pp, dp, tp = 2, world // 4, 2
        pipe = hybrid.PipelineCase(d_model=case.d_model, n_head=case.n_head, seq_len=case.seq_len,
                                   global_batch=2 * dp * 2, steps=2)
        out = hybrid.train_pp_dp_tp(pipe, pp, dp, tp)
        s, _, t = out["coords"]
        ref = train_single_stack(pipe, rank_device())
        name = f"pp{pp}xdp{dp}xtp{tp}_vs_single_process"
        report_check(name, out["stage"][0], reference_shard(ref[s], t, tp), rtol=1e-4, atol=1e-5)  # one block per stage
        result["layouts"][f"pp{pp}xdp{dp}xtp{tp}"] = {"step_s": out["step_s"]}
    return result


if __name__ == "__main__":
    entry_main(check, __doc__)
