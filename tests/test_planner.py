"""Tests for course_lib.planner: the rules, the memory and time models, and the published figures they reproduce."""

import dataclasses
import itertools
import math

import pytest

from course_lib import memory_math as mm
from course_lib import planner as pl

# Narayanan et al. 2021 (SC21), Table 1: params (B), heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU.
MEGATRON = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


@pytest.mark.parametrize("row", MEGATRON, ids=[f"{r[0]}B" for r in MEGATRON])
def test_megatron_table(row):
    P, a, h, L, tp, pp, n, B, tflops = row
    model = pl.ModelSpec(f"{P}B", L, h, a, 2048, 51200, B)
    assert round(model.num_params / 1e9, 1) == P
    cfg = pl.ParallelConfig(dp=n // (tp * pp), tp=tp, pp=pp, recompute="full")
    cluster = pl.a100_cluster(n // 8)
    assert pl.config_problems(model, cluster, cfg) == {}
    t = pl.step_time(model, cluster, cfg)
    rel = t.hardware_flops_per_gpu / 1e12 / tflops - 1
    assert abs(rel) <= 0.12, rel
    assert pl.memory_per_gpu(model, cfg).total < cluster.memory_bytes


def test_zero_figure_7_5b():
    model = pl.ModelSpec("7.5B", 1, 1, 1, 1, 1, 64, params=7.5e9)
    got = [pl.memory_per_gpu(model, pl.ParallelConfig(dp=64, zero=z)).states.total / 1e9 for z in range(4)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


def test_memory_model_parts():
    model = pl.ModelSpec("m", 8, 1024, 16, 2048, 50000, 64)
    cfg = pl.ParallelConfig(dp=2, tp=2, pp=2, micro_batch=2)
    mem = pl.memory_per_gpu(model, cfg)
    assert mem.states == mm.zero_memory_per_gpu(model.num_params / 4, 0, 2)
    per_layer = 34 * 2048 * 2 * 1024 / 2
    assert math.isclose(mem.activations, 2 * 4 * per_layer)
    ck = pl.memory_per_gpu(model, pl.ParallelConfig(dp=2, tp=2, pp=2, micro_batch=2, recompute="full"))
    assert math.isclose(ck.activations, 2 * 4 * 2 * 2048 * 2 * 1024 / 2 + per_layer)
    scores = 5 * 16 * 2048 * 2048 * 2 / 2
    none = pl.memory_per_gpu(model, pl.ParallelConfig(dp=2, tp=2, pp=2, micro_batch=2, recompute="none"))
    assert math.isclose(none.activations, 2 * 4 * (per_layer + scores))
    no_sp = pl.memory_per_gpu(model, pl.ParallelConfig(dp=2, tp=2, pp=2, micro_batch=2, sequence_parallel=False))
    assert math.isclose(no_sp.activations, 2 * 4 * 2048 * 2 * 1024 * (10 + 24 / 2))   # Korthikanti et al. 2022, eq. 2
    inter = pl.memory_per_gpu(model, pl.ParallelConfig(dp=2, tp=2, pp=2, micro_batch=2, interleave=2))
    assert math.isclose(inter.activations, mem.activations * (1 + 1 / 4))


def test_rules():
    model = pl.ModelSpec("m", 12, 768, 12, 1024, 50304, 64)
    c = pl.dgx_h100(2)
    assert pl.config_problems(model, c, pl.ParallelConfig(dp=16)) == {}
    assert set(pl.config_problems(model, c, pl.ParallelConfig(dp=8))) == {"gpus"}
    assert set(pl.config_problems(model, c, pl.ParallelConfig(tp=16))) == {"tp_node", "tp_heads"}
    assert set(pl.config_problems(model, pl.dgx_h100(1), pl.ParallelConfig(tp=8))) == {"tp_heads"}
    assert set(pl.config_problems(model, c, pl.ParallelConfig(dp=2, pp=8))) == {"pp_layers"}
    assert set(pl.config_problems(model, c, pl.ParallelConfig(dp=8, pp=2, zero=3))) == {"zero_pp"}
    assert set(pl.config_problems(model, c, pl.ParallelConfig(tp=4, pp=4, zero=1))) == {"zero_dp"}
    assert set(pl.config_problems(model, c, pl.ParallelConfig(dp=16, micro_batch=8))) == {"batch"}
    assert set(pl.config_problems(model, c, pl.ParallelConfig(dp=16, zero=5))) == {"zero_stage"}
    assert set(pl.config_problems(model, c, pl.ParallelConfig(dp=0))) == {"positive"}
    assert set(pl.config_problems(model, c, pl.ParallelConfig(dp=1, cp=16))) == set()
    assert set(pl.config_problems(model, c, pl.ParallelConfig(dp=1, cp=16, tp=1).__class__(cp=3))) >= {"gpus", "cp_seq"}
    assert set(pl.RULES) >= {"gpus", "tp_node", "tp_heads", "pp_layers", "cp_seq", "batch", "zero_dp", "zero_pp"}


def test_plan_sorted_and_best():
    model = pl.ModelSpec("7B", 32, 4096, 32, 2048, 51200, 256)
    plans = pl.plan(model, pl.dgx_h100(1))
    assert plans and all(p.fits for p in plans)
    assert [p.time.total for p in plans] == sorted(p.time.total for p in plans)
    assert pl.best_plan(plans) is plans[0] or pl.best_plan(plans).time.total == plans[0].time.total
    assert pl.best_plan(plans, memory_limit=1.0) is None
    assert all(0 < p.time.mfu < 1 for p in plans)


def test_step_time_parts():
    model = pl.ModelSpec("m", 8, 1024, 16, 2048, 50000, 64)
    cluster = pl.dgx_h100(2)
    cfg = pl.ParallelConfig(dp=4, tp=2, pp=2)
    t = pl.step_time(model, cluster, cfg)
    assert math.isclose(t.compute, pl.compute_seconds(model, cluster, cfg))
    hw = pl.hardware_flops(model, "selective")
    assert math.isclose(sum(f for f, _ in pl.gemm_shapes(model, cfg)), hw)   # every FLOP is in one GEMM
    assert t.compute >= hw / (16 * cluster.peak_flops * 0.6)                # the shape factor only slows
    assert math.isclose(t.bubble, t.compute * 1 / 16)
    inter = pl.step_time(model, cluster, dataclasses.replace(cfg, interleave=2))
    assert math.isclose(inter.bubble, inter.compute * 1 / 32) and math.isclose(inter.comm["pp"], 2 * t.comm["pp"])
    bw = pl.link_bandwidths(cluster, cfg)
    assert bw["tp"] == cluster.intra_node_bw and bw["pp"] == cluster.inter_node_bw and bw["dp"] == cluster.intra_node_bw
    assert math.isclose(t.mfu, pl.model_flops(model) / (16 * cluster.peak_flops * t.total))


def test_flowchart():
    small = pl.ModelSpec("gpt2", 12, 768, 12, 1024, 50304, 64)
    c = pl.dgx_h100(1)
    assert pl.flowchart(small, c, 1e9).strategy == "single device"
    assert pl.flowchart(small, c, 1e13).strategy == "data parallelism"
    big = pl.ModelSpec("70B", 80, 8192, 64, 2048, 51200, 64)
    assert pl.flowchart(big, c, 1e9).strategy == "model parallelism"
    assert pl.flowchart(big, c, 1e13).strategy == "hybrid parallelism"
    with pytest.raises(ValueError):
        pl.flowchart(big, c, 1e13, priority="speed")


def test_pick_best_matches_plan_and_breaks_ties_by_memory():
    model = pl.ModelSpec("7B", 32, 4096, 32, 2048, 51200, 256)
    cluster = pl.dgx_h100(1)
    configs = pl.enumerate_configs(model, cluster)
    best = pl.pick_best(model, cluster, configs)
    assert best.time.total == pl.plan(model, cluster)[0].time.total
    same_time = [pl.ParallelConfig(dp=8, zero=z) for z in (0, 1, 2)]
    small = pl.ModelSpec("gpt2", 12, 768, 12, 1024, 50304, 64)
    assert pl.pick_best(small, cluster, same_time).config.zero == 2
    assert pl.pick_best(small, cluster, same_time, memory_limit=1.0) is None
    assert pl.pick_best(small, cluster, [pl.ParallelConfig(dp=4)]) is None


@pytest.mark.parametrize("checkpointing", [False, True])
def test_comm_wire_bytes_context_parallel(checkpointing: bool) -> None:
    # Counted from the ring itself: one GPU's K and V shards are b (s/cp) h / tp values each (bf16).
    model = pl.ModelSpec("m", 8, 1024, 16, 4096, 50000, 64)
    b, cp, tp = 2, 4, 2
    cfg = pl.ParallelConfig(dp=2, tp=tp, cp=cp, micro_batch=b, recompute="full" if checkpointing else "selective")
    shard = b * (model.seq_len // cp) * model.d_model // tp * pl.BF16_BYTES
    forward = (cp - 1) * 2 * shard                  # K and V: cp - 1 shifts to the next rank
    backward = (cp - 1) * 2 * shard + (cp - 1) * 2 * shard  # K and V again, and the dK, dV accumulators
    recompute = forward if checkpointing else 0     # full checkpointing repeats the forward ring
    per_layer_and_micro_batch = forward + recompute + backward
    want = cfg.micro_batches(model) * model.n_layer * per_layer_and_micro_batch
    assert math.isclose(pl.comm_wire_bytes(model, cfg)["cp"], want)
    assert pl.comm_wire_bytes(model, pl.ParallelConfig(dp=8, micro_batch=b))["cp"] == 0.0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_comm_wire_bytes_tensor_parallel(checkpointing: bool) -> None:
    # Megatron-LM: 2 all-reduces per layer in the forward, 2 in the backward, 2 more in a recomputed forward.
    model = pl.ModelSpec("m", 8, 1024, 16, 2048, 50000, 64)
    b, tp = 2, 4
    cfg = pl.ParallelConfig(dp=2, tp=tp, micro_batch=b, recompute="full" if checkpointing else "selective")
    payload = b * model.seq_len * model.d_model * pl.BF16_BYTES
    ring_all_reduce = 2 * (tp - 1) / tp * payload
    want = cfg.micro_batches(model) * model.n_layer * (6 if checkpointing else 4) * ring_all_reduce
    assert math.isclose(pl.comm_wire_bytes(model, cfg)["tp"], want)


def test_overlap_hides_dp_and_tp_seconds_within_the_compute():
    model = pl.ModelSpec("7B", 32, 4096, 32, 2048, 51200, 512)
    cfg = pl.ParallelConfig(dp=16, tp=2, zero=1)
    plain = pl.step_time(model, pl.dgx_h100(4), cfg)
    assert plain.hidden == {}
    half = pl.step_time(model, dataclasses.replace(pl.dgx_h100(4), dp_overlap=0.5, tp_overlap=0.5), cfg)
    assert math.isclose(half.hidden["dp"], 0.5 * plain.comm["dp"]) and math.isclose(half.hidden["tp"], 0.5 * plain.comm["tp"])
    assert math.isclose(half.total, plain.total - 0.5 * (plain.comm["dp"] + plain.comm["tp"]))
    # Never more hidden than there is compute to hide it under: a slow link with full overlap.
    slow = dataclasses.replace(pl.dgx_h100(4), inter_node_bw=1e8, dp_overlap=1.0, tp_overlap=1.0)
    t = pl.step_time(model, slow, pl.ParallelConfig(dp=32))
    assert math.isclose(t.hidden["dp"], t.compute * 2 / 3) and t.total > t.compute


def test_overlap_changes_the_choice_for_7b_on_32_h100s():
    # Nothing overlapped: a pipeline (pp4) wins; with 90% of dp and tp traffic under compute, no pipeline does.
    model = pl.ModelSpec("7B", 32, 4096, 32, 2048, 51200, 512)
    assert pl.plan(model, pl.dgx_h100(4))[0].config.pp == 4
    overlapped = dataclasses.replace(pl.dgx_h100(4), dp_overlap=0.9, tp_overlap=0.9)
    assert pl.plan(model, overlapped)[0].config.pp == 1


def test_gemm_shape_factor_is_measured_and_bounded():
    assert pl.gemm_shape_factor(8192, 8192, 8192) > 0.9
    assert pl.gemm_shape_factor(128, 64, 64) < 0.05
    assert 0 < pl.gemm_shape_factor(2048, 2048, 128) < pl.gemm_shape_factor(2048, 2048, 2048) <= 1
    assert pl.gemm_shape_factor(1, 1, 1) == pl.gemm_shape_factor(128, 64, 64)       # clamped to the grid
    assert pl.gemm_shape_factor(1e6, 1e6, 1e6) == pl.gemm_shape_factor(16384, 32768, 32768)


def test_mesh_links_checks_every_group():
    assert pl.mesh_links([("pp", 2), ("dp", 2), ("tp", 4)], 8) == {"pp": False, "dp": True, "tp": True}
    assert pl.mesh_links([("dp", 3), ("tp", 4)], 6) == {"dp": False, "tp": False}      # ranks 4-7 straddle two nodes
    assert pl.mesh_links([("tp", 4), ("dp", 3)], 6) == {"tp": False, "dp": True}
    assert pl.mesh_links([("tp", 1), ("dp", 16)], 8) == {"tp": True, "dp": False}


def test_mesh_order_beats_heaviest_first():
    four = pl.ClusterSpec("4-GPU nodes", 4, 4, 80e9, 300e9, 25e9, 989e12)
    degrees, wire = {"tp": 4, "cp": 2, "dp": 2}, {"tp": 10e9, "cp": 9e9, "dp": 8e9}
    order, seconds = pl.mesh_order(degrees, wire, four)
    assert order[-2:] in (("cp", "dp"), ("dp", "cp")) and order[0] == "tp"             # cp and dp inside, tp across
    greedy = pl.mesh_seconds(("dp", "cp", "tp"), degrees, wire, four)
    assert sum(seconds.values()) < sum(greedy.values())
    brute = min(sum(pl.mesh_seconds(o, degrees, wire, four).values()) for o in itertools.permutations(degrees))
    assert math.isclose(sum(seconds.values()), brute)


def test_fit_cheapest():
    model = pl.ModelSpec("7B", 32, 4096, 32, 2048, 51200, 512)
    node = pl.dgx_h100(1)
    fits = pl.ParallelConfig(dp=8, zero=1)
    assert pl.fit_cheapest(model, node, fits)[0] == fits
    decision, options = pl.fit_cheapest(model, node, pl.ParallelConfig(dp=8))
    assert list(options) == list(pl.FIT_MOVES)
    fitting = [p for p in options.values() if p is not None and p.fits]
    assert decision == min(fitting, key=lambda p: (p.time.total, p.memory.total)).config
    assert options["micro_batch"] is None                                              # micro-batch 1 is odd
    two = pl.ClusterSpec("2 x 4", 4, 2, 80e9, 300e9, 25e9, 989e12)
    _, opts = pl.fit_cheapest(model, two, pl.ParallelConfig(dp=2, tp=4))
    assert opts["tp"] is None                                                          # tp 8 leaves the node
    _, opts = pl.fit_cheapest(model, two, pl.ParallelConfig(dp=4, pp=2, zero=1))
    assert opts["zero"] is None                                                        # ZeRO 2 with a pipeline
    assert pl.fit_cheapest(model, node, pl.ParallelConfig(dp=8, zero=3, recompute="full"), memory_limit=1e6)[0] is None


def test_interleave_and_recompute_rules():
    model = pl.ModelSpec("m", 12, 768, 12, 1024, 50304, 64)
    c = pl.dgx_h100(1)
    assert set(pl.config_problems(model, c, pl.ParallelConfig(dp=8, interleave=2))) == {"interleave"}
    assert pl.config_problems(model, c, pl.ParallelConfig(dp=4, pp=2, interleave=2)) == {}
    assert set(pl.config_problems(model, c, pl.ParallelConfig(dp=2, pp=4, interleave=2))) == {"pp_layers"}   # 8 chunks, 12 layers
    assert set(pl.config_problems(model, c, pl.ParallelConfig(dp=8, recompute="some"))) == {"recompute"}
