"""Plausible wrong solutions of chapter 16's exercises (see harness.py).

Most are the course's solution with one mistake a student makes, written as an edit of the solution
cell (``_edited``: each edit must apply, so a change of the solution shows up here); the others are
written out whole.
"""

from tests.wrong_solutions.harness import solution_cells

_CELLS, _edited = solution_cells("16_hybrid_capstone")


WRONG = {
    "ex16_1_mesh_coords": {
        "NumPy integers instead of Python ints": '''
def mesh_coords(rank, shape):
    if not 0 <= rank < math.prod(shape):
        raise ValueError("rank out of range")
    return tuple(np.unravel_index(rank, shape))
''',
        "no check for a negative rank": _edited(
            "ex1-solution", ("    if not 0 <= rank < size:\n", "    if rank >= size:\n")),
        "first dimension fastest": _edited("ex1-solution", ("for extent in reversed(shape):", "for extent in shape:")),
        "calls the reference": '''
def mesh_coords(rank, shape):
    return hybrid.mesh_coords(rank, shape)
''',
    },
    "ex16_2_mesh_groups": {
        "transpose instead of movedim (wrong group order in 3 dimensions)": _edited(
            "ex2-solution", ("grid.movedim(dim, -1)", "grid.transpose(dim, -1)")),
        "no ValueError for a dim outside the shape": _edited(
            "ex2-solution", ("    if not -len(shape) <= dim < len(shape):\n"
                             "        raise ValueError(f\"dim {dim} is outside a mesh of {len(shape)} dimensions\")\n", "")),
        "calls the reference": '''
def mesh_groups(shape, dim):
    return hybrid.mesh_groups(shape, dim)
''',
    },
    "ex16_3_memory_per_gpu": {
        "all pp micro-batches in flight, even when there are fewer": _edited(
            "ex3-solution", ("in_flight = min(cfg.pp, cfg.micro_batches(model))", "in_flight = cfg.pp")),
        "ZeRO shards over dp only, not dp x cp": _edited(
            "ex3-solution", ("cfg.zero, cfg.dp * cfg.cp)", "cfg.zero, cfg.dp)")),
        "checkpointing without the layer being recomputed": _edited(
            "ex3-solution", (" / cfg.tp + one_layer", " / cfg.tp")),
        "calls the reference": '''
def memory_per_gpu(model, cfg):
    return pl.memory_per_gpu(model, cfg)
''',
    },
    "ex16_4_step_time": {
        "bubble over pp instead of m": _edited(
            "ex4-solution", ("(cfg.pp - 1) / cfg.micro_batches(model)", "(cfg.pp - 1) / cfg.pp")),
        "compute without the recomputation": _edited(
            "ex4-solution", ("compute = hw / (", "compute = pl.model_flops(model) / (")),
        "efficiency left out": _edited(
            "ex4-solution", (" * cluster.peak_flops * cluster.efficiency)", " * cluster.peak_flops)")),
        "calls the reference": '''
def step_time(model, cluster, cfg):
    return pl.step_time(model, cluster, cfg)
''',
    },
    "ex16_5_broken_rules": {
        "ZeRO-1 refused with a pipeline too": _edited(
            "ex5-solution", ("if cfg.zero >= 2 and cfg.pp > 1:", "if cfg.zero >= 1 and cfg.pp > 1:")),
        "the first broken rule only": '''
def broken_rules(model, cluster, cfg):
    if min(cfg.dp, cfg.tp, cfg.pp, cfg.cp, cfg.micro_batch) < 1:
        return {"positive"}
    checks = [("gpus", cfg.dp * cfg.tp * cfg.pp * cfg.cp != cluster.gpus_per_node * cluster.nodes),
              ("tp_node", cluster.gpus_per_node % cfg.tp), ("tp_heads", model.n_head % cfg.tp),
              ("pp_layers", model.n_layer % cfg.pp), ("cp_seq", model.seq_len % cfg.cp),
              ("batch", model.global_batch % (cfg.dp * cfg.micro_batch)), ("zero_stage", cfg.zero not in (0, 1, 2, 3)),
              ("zero_dp", cfg.zero > 0 and cfg.dp * cfg.cp == 1), ("zero_pp", cfg.zero >= 2 and cfg.pp > 1)]
    for key, broken in checks:
        if broken:
            return {key}
    return set()
''',
        "calls the planner's config_problems": '''
def broken_rules(model, cluster, cfg):
    return set(pl.config_problems(model, cluster, cfg))
''',
        "calls the reference": '''
def broken_rules(model, cluster, cfg):
    return pl.broken_rules(model, cluster, cfg)
''',
    },
    "ex16_6_pick_best": {
        "ties in time not broken by memory": _edited(
            "ex6-solution", ("if best is None or (t.total, mem.total) < (best.time.total, best.memory.total):",
                             "if best is None or t.total < best.time.total:")),
        "memory_limit ignored": _edited(
            "ex6-solution", ("limit = cluster.memory_bytes if memory_limit is None else memory_limit",
                             "limit = cluster.memory_bytes")),
        "illegal layouts not skipped": _edited(
            "ex6-solution", ("        if pl.config_problems(model, cluster, cfg):\n            continue\n", "")),
        "calls the reference": '''
def pick_best(model, cluster, configs, memory_limit=None):
    return pl.pick_best(model, cluster, configs, memory_limit)
''',
    },
    "ex16_7_assemble": {
        "its own SDPA attention: parts.attention never used": _edited(
            "ex7-solution", ("    if tech.flash:\n        for block in model.blocks:\n"
                             "            block.attn = capstone.PartAttention(block.attn, parts.attention)\n", "")),
        "torch.autocast instead of parts.autocast": _edited(
            "ex7-solution", ("with parts.autocast(device) if tech.bf16",
                             "with torch.autocast(device.type, dtype=torch.bfloat16) if tech.bf16")),
        "parts.optimizer used even with fused_adam off": _edited(
            "ex7-solution", ("        opt = torch.optim.Adam(model.parameters(), lr=run.lr)\n",
                             "        opt = parts.optimizer(model.parameters(), run.lr)\n")),
        "torch's checkpoint instead of parts.checkpoint": _edited(
            "ex7-solution", ("                h = parts.checkpoint(model.blocks, len(model.blocks), h)\n",
                             "                for block in model.blocks:\n"
                             "                    h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)\n")),
        "each rank reports its own loss, not the global batch's": _edited(
            "ex7-solution", ("        if dp > 1:\n            dist.all_reduce(value, group=mesh.groups[\"dp\"])\n"
                             "            value /= dp\n", "")),
        "every rank holds the whole model (no tensor parallelism)": _edited(
            "ex7-solution", ("        model.blocks = torch.nn.ModuleList(\n"
                             "            ParallelBlock.from_module(b, mesh.coords[\"tp\"], tp, group=mesh.groups[\"tp\"])"
                             " for b in model.blocks)\n",
                             "")),
        "calls the reference": '''
def assemble(parts, tech, run, mesh=None):
    return capstone.assemble(parts, tech, run, mesh)
''',
    },
    "ex16_8_ablation": {
        "every row after the first switches everything on at once": _edited(
            "ex8-solution", ("            tech = dataclasses.replace(tech, **{added: True})",
                             "            tech = dataclasses.replace(tech, **{t: True for t in order})")),
        "each row switches on its own technique only, not the ones before": _edited(
            "ex8-solution", ("            tech = dataclasses.replace(tech, **{added: True})",
                             "            tech = capstone.Techniques(**{added: True})")),
        "MFU with the recomputation counted": _edited(
            "ex8-solution", ("        rows.append(",
                             "        model_flops = flops.step_flops(run.model, run.batch_size, tech.checkpointing)[1]\n"
                             "        rows.append(")),
        "peak memory measured once, on the plain run": _edited(
            "ex8-solution", ("        peak = capstone.peak_memory(lambda: step(warmup + steps))\n",
                             "        if added is None:\n"
                             "            peak = capstone.peak_memory(lambda: step(warmup + steps))\n")),
        "capstone.assemble instead of the assemble_fn it is given": _edited(
            "ex8-solution", ("        step = assemble_fn(parts, tech, run)",
                             "        step = capstone.assemble(parts, tech, run)")),
        "the rate copied from the library's capstone run": _edited(
            "ex8-solution",
            ("        rows.append(",
             "        step_s = run.tokens_per_step / capstone.train(capstone.RunConfig(steps=2, warmup=1, compile=False),\n"
             "                                                      progress=False, peak=(1.0, 'x')).tokens_per_s\n"
             "        rows.append(")),
        "calls the reference": '''
def ablation(assemble_fn, parts, run, order, steps, peak_flops, warmup=1):
    return capstone.ablation(assemble_fn, parts, run, order, steps, peak_flops, warmup)
''',
    },
}
