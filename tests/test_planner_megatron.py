"""The claims of chapter 16's case study "Megatron-LM, assembled", checked against the planner's models."""

import dataclasses

import pytest

from course_lib import planner as pl

# Korthikanti et al. (2022), Table 3 configurations and their reported MFU (A100 80GB, s 2048, V 51200, micro-batch 1):
# name, heads, width, layers, TP, PP, GPUs, global batch, published MFU.
KORTHIKANTI = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 0.415),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 0.514),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 0.560),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 0.563),
]
# Relative error allowed between the planner's MFU and the published one: the time model leaves out element-wise
# work and overlap (the notebook says so), which matters most for the narrow 22B model.
MFU_TOLERANCE = {"22B": 0.25, "175B": 0.15, "530B": 0.15, "1T": 0.15}

GPT530 = pl.ModelSpec("530B", n_layer=105, d_model=20480, n_head=128, seq_len=2048, vocab_size=51200, global_batch=2240)
SELENE = pl.a100_cluster(nodes=280)
RECIPE = pl.ParallelConfig(dp=8, tp=8, pp=35, zero=1, recompute="selective", sequence_parallel=True, interleave=3)
BARE = dataclasses.replace(RECIPE, zero=0, recompute="none", sequence_parallel=False, interleave=1)


def _fits_model(spec: pl.ModelSpec, cluster: pl.ClusterSpec, cfg: pl.ParallelConfig) -> bool:
    return pl.memory_per_gpu(spec, cfg).total <= cluster.memory_bytes


def _fits(cfg: pl.ParallelConfig) -> bool:
    return _fits_model(GPT530, SELENE, cfg)


@pytest.mark.parametrize("row", KORTHIKANTI, ids=[r[0] for r in KORTHIKANTI])
def test_planner_mfu_near_korthikanti(row):
    name, a, h, L, tp, pp, n, B, published = row
    spec = pl.ModelSpec(name, L, h, a, 2048, 51200, B)
    cluster = pl.a100_cluster(n // 8)
    cfg = pl.ParallelConfig(dp=n // (tp * pp), tp=tp, pp=pp, recompute="selective", sequence_parallel=True)
    assert not pl.config_problems(spec, cluster, cfg)
    assert _fits_model(spec, cluster, cfg), f"{name}: the published layout should fit in 80 GB"
    mfu = pl.step_time(spec, cluster, cfg).mfu
    assert abs(mfu / published - 1) <= MFU_TOLERANCE[name], f"{name}: planner MFU {mfu:.3f}, published {published}"


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sequence_parallelism_factor(tp):
    # Korthikanti et al. (2022): s b h (10 + 24 / t) per layer without sequence parallelism, 34 s b h / t with it.
    layer = pl.ModelSpec("layer", 1, 4096, 32, 2048, 51200, 1)
    with_sp = pl.ParallelConfig(tp=tp, recompute="selective", sequence_parallel=True)
    without = dataclasses.replace(with_sp, sequence_parallel=False)
    ratio = pl.memory_per_gpu(layer, without).activations / pl.memory_per_gpu(layer, with_sp).activations
    assert ratio == pytest.approx((10 + 24 / tp) / (34 / tp), rel=1e-9)


def test_sp_and_selective_cut_activations_about_5x():
    # The paper's abstract: sequence parallelism with selective recomputation cut activation memory about 5x.
    layer = pl.ModelSpec("530B layer", 1, 20480, 128, 2048, 51200, 1)
    recipe = pl.ParallelConfig(tp=8, recompute="selective", sequence_parallel=True)
    tp_only = dataclasses.replace(recipe, recompute="none", sequence_parallel=False)
    ratio = pl.memory_per_gpu(layer, tp_only).activations / pl.memory_per_gpu(layer, recipe).activations
    assert 4.5 <= ratio <= 5.5, ratio


def test_ablation_memory_claims():
    assert not pl.config_problems(GPT530, SELENE, RECIPE)
    assert not _fits(BARE), "TP and PP alone should not fit"
    assert not _fits(dataclasses.replace(BARE, sequence_parallel=True)), "SP without recomputation should not fit"
    assert _fits(dataclasses.replace(BARE, sequence_parallel=True, recompute="selective"))
    assert _fits(RECIPE)
    assert _fits(dataclasses.replace(RECIPE, recompute="full", sequence_parallel=False)), "the 2021 recipe fits"
    no_sp = pl.memory_per_gpu(GPT530, dataclasses.replace(RECIPE, sequence_parallel=False))
    assert no_sp.activations > pl.memory_per_gpu(GPT530, RECIPE).activations


def test_selective_recompute_beats_full_recompute():
    # Korthikanti et al. (2022), abstract: 54.2% MFU against 42.1% with full recomputation (1.29x).
    full = pl.step_time(GPT530, SELENE, dataclasses.replace(RECIPE, recompute="full", sequence_parallel=False))
    recipe = pl.step_time(GPT530, SELENE, RECIPE)
    assert 1.1 <= recipe.mfu / full.mfu <= 1.5, recipe.mfu / full.mfu


def test_tp_across_nodes_is_forbidden_and_slower():
    tp16 = dataclasses.replace(RECIPE, tp=16, dp=4)
    assert "tp_node" in pl.config_problems(GPT530, SELENE, tp16)
    assert pl.link_bandwidths(SELENE, tp16)["tp"] == SELENE.inter_node_bw
    assert pl.link_bandwidths(SELENE, RECIPE)["tp"] == SELENE.intra_node_bw
    slow, fast = pl.step_time(GPT530, SELENE, tp16), pl.step_time(GPT530, SELENE, RECIPE)
    assert slow.comm["tp"] > 5 * fast.comm["tp"]
    assert slow.mfu < fast.mfu


def test_interleaving_divides_the_bubble_and_multiplies_pp_traffic():
    plain = dataclasses.replace(RECIPE, interleave=1)
    t1, t3 = pl.step_time(GPT530, SELENE, plain), pl.step_time(GPT530, SELENE, RECIPE)
    assert t3.bubble == pytest.approx(t1.bubble / 3, rel=1e-9)
    assert t3.comm["pp"] == pytest.approx(3 * t1.comm["pp"], rel=1e-9)
    m1, m3 = pl.memory_per_gpu(GPT530, plain), pl.memory_per_gpu(GPT530, RECIPE)
    assert m3.activations == pytest.approx(m1.activations * (1 + 34 / (35 * 3)), rel=1e-9)


def test_distributed_optimizer_saves_memory_not_time():
    no_zero = dataclasses.replace(RECIPE, zero=0)
    assert pl.memory_per_gpu(GPT530, RECIPE).states.total < pl.memory_per_gpu(GPT530, no_zero).states.total
    assert pl.step_time(GPT530, SELENE, RECIPE).total == pytest.approx(pl.step_time(GPT530, SELENE, no_zero).total)
