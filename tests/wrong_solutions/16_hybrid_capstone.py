"""Plausible wrong solutions of chapter 16's exercises (see harness.py).

Most are the course's solution with one mistake a student makes, written as an edit of the solution
cell (``_edited``: each edit must apply, so a change of the solution shows up here); the others are
written out whole.
"""

from tests.wrong_solutions.harness import solution_cells

_CELLS, _edited = solution_cells("16_hybrid_capstone")


WRONG = {
    "ex16_1_mesh_order": {
        "heaviest traffic fastest (the usual rule, not always the best)": """
def mesh_order(degrees, wire_bytes, cluster):
    order = tuple(sorted(degrees, key=lambda k: wire_bytes.get(k, 0.0)))  # lightest slowest, heaviest fastest
    return order, pl.mesh_seconds(order, degrees, wire_bytes, cluster)
""",
        "a span that fits in a node counts as inside (groups that straddle a node boundary missed)": _edited(
            "ex1-solution",
            ("            inside = all(r // G == (r + (d - 1) * stride) // G for r in range(world) if (r // stride) % d == 0)\n",
             "            inside = stride * d <= G\n")),
        "tensor parallelism always fastest, the rest in the given order": """
def mesh_order(degrees, wire_bytes, cluster):
    order = tuple([k for k in degrees if k != "tp"] + (["tp"] if "tp" in degrees else []))
    return order, pl.mesh_seconds(order, degrees, wire_bytes, cluster)
""",
        "first dimension fastest (strides taken from the wrong end)": _edited(
            "ex1-solution", ("        for name in reversed(order):\n", "        for name in order:\n")),
        "calls the reference": """
def mesh_order(degrees, wire_bytes, cluster):
    return pl.mesh_order(degrees, wire_bytes, cluster)
""",
    },
    "ex16_2_fit_cheapest": {
        "picks the change that saves the most memory, not the fastest that fits": _edited(
            "ex2-solution", ("key=lambda p: (p.time.total, p.memory.total)", "key=lambda p: (p.memory.total, p.time.total)")),
        "raises tp, pp or cp without halving dp (no longer the same GPUs)": _edited(
            "ex2-solution", ("dataclasses.replace(cfg, dp=cfg.dp // 2, **{dim: 2 * getattr(cfg, dim)})",
                             "dataclasses.replace(cfg, **{dim: 2 * getattr(cfg, dim)})")),
        "does not check the rules of the changed layout (tp across nodes, ZeRO 2 with a pipeline)": _edited(
            "ex2-solution", ("        if moved is None or pl.config_problems(model, cluster, moved):\n",
                             "        if moved is None:\n")),
        "ignores memory_limit (always the cluster's memory)": _edited(
            "ex2-solution", ("    limit = cluster.memory_bytes if memory_limit is None else memory_limit\n",
                             "    limit = cluster.memory_bytes\n")),
        "returns a faster option that does not fit": _edited(
            "ex2-solution", ("    fitting = [p for p in options.values() if p is not None and p.fits]\n",
                             "    fitting = [p for p in options.values() if p is not None]\n")),
        "calls the reference": """
def fit_cheapest(model, cluster, cfg, memory_limit=None):
    return pl.fit_cheapest(model, cluster, cfg, memory_limit)
""",
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
