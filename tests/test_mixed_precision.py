"""Tests of course_lib.mixed_precision and course_lib.fp8 against PyTorch's own GradScaler, autocast, casts and _scaled_mm."""

from __future__ import annotations

import json
import math

import pytest
import torch

from course_lib import fp8
from course_lib import memory_math as mm
from course_lib import mixed_precision as mp
from course_lib.floating_point import FORMATS
from course_lib.models import GPT, GPTConfig, random_batch

TINY = GPTConfig(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=16)


def _run_scalers(flags, growth_interval, init_scale=2.0**16, poison=math.inf):
    """Drive torch's GradScaler and ours on one parameter; inject ``poison`` where flags[i] is True."""
    p_ref = torch.nn.Parameter(torch.ones(4))
    p_our = torch.nn.Parameter(torch.ones(4))
    opt_ref = torch.optim.SGD([p_ref], lr=0.1)
    opt_our = torch.optim.SGD([p_our], lr=0.1)
    ref = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    our = mp.DynamicLossScaler(init_scale=init_scale, growth_interval=growth_interval)
    for bad in flags:
        for p, opt, s in ((p_ref, opt_ref, ref), (p_our, opt_our, our)):
            opt.zero_grad()
            s.scale((p * torch.arange(1.0, 5.0)).sum()).backward()
            if bad:
                p.grad[1] = poison
            s.step(opt)
            s.update()
        assert our.get_scale() == ref.get_scale()
        assert our.growth_tracker == int(ref._growth_tracker)
        torch.testing.assert_close(p_our.detach(), p_ref.detach(), rtol=0, atol=0)
    return our


@pytest.mark.parametrize("poison", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("interval", [1, 3, 2000])
def test_dynamic_scaler_matches_gradscaler(poison, interval):
    flags = [False, True, True, False, False, False, True, False, False, False, False, False]
    our = _run_scalers(flags, interval, poison=poison)
    assert [f for _, f in our.history] == flags


def test_scale_growth_stops_at_fp32_max():
    s, t = mp.update_scale(2.0**127, 0, False, growth_interval=1)
    assert s == 2.0**127 and t == 0


def test_unscale_and_check():
    g = [torch.tensor([2.0, 4.0]), None, torch.tensor([1.0, math.nan])]
    assert mp.unscale_and_check(g, 2.0)
    assert g[0].tolist() == [1.0, 2.0]
    assert not mp.unscale_and_check([torch.tensor([3.0])], 3.0)


def test_static_scaler_skips():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    s = mp.StaticLossScaler(8.0)
    s.scale(p.sum()).backward()
    p.grad[0] = math.inf
    assert not s.step(opt)
    s.update()
    assert p.tolist() == [1.0, 1.0] and s.get_scale() == 8.0 and s.skipped_steps == 1
    with pytest.raises(RuntimeError):
        s.update()


def test_underflow_fraction():
    sub = FORMATS["fp16"].min_subnormal
    x = torch.tensor([0.0, 1.0, -sub / 4, sub / 2, sub * 0.75, -1e-30])
    assert mp.underflow_fraction(x, torch.float16) == pytest.approx(3 / 5)
    assert mp.underflow_fraction([x, None], torch.bfloat16) == 0.0
    assert mp.underflow_fraction(torch.zeros(3), torch.float16) == 0.0
    assert mp.subnormal_fraction(torch.tensor([sub * 3, 1.0]), torch.float16) == 0.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_step_with_our_scaler_equals_gradscaler(dtype):
    model = GPT(TINY, seed=0)
    x, y = random_batch(TINY, 2, seed=1)
    runs = []
    for scaler in (mp.DynamicLossScaler(growth_interval=2), torch.amp.GradScaler("cpu", growth_interval=2)):
        mw = mp.MasterWeights(model, dtype)
        opt = torch.optim.AdamW(mw.params, lr=1e-2)
        out = [mp.mixed_precision_step(mw.model, mw.params, opt, scaler, mp.gpt_loss(x, y)) for _ in range(4)]
        runs.append((out, [p.detach().clone() for p in mw.params]))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(p.dtype == dtype for p in mw.model.parameters())


def test_mixed_step_fp16_first_step_overflows():
    # the fp16 loss gradient times 2**16 is above fp16's max, so the first step must be skipped
    model = GPT(TINY, seed=0)
    x, y = random_batch(TINY, 2, seed=1)
    mw = mp.MasterWeights(model, torch.float16)
    opt = torch.optim.SGD(mw.params, lr=0.1)
    sc = mp.DynamicLossScaler()
    _, loss = mw.model(x, y)
    assert loss.dtype == torch.float16
    before = [p.detach().clone() for p in mw.params]
    mp.mixed_precision_step(mw.model, mw.params, opt, sc, lambda m: m(x, y)[1])
    assert sc.history == [(2.0**16, True)] and sc.get_scale() == 2.0**15
    for a, b in zip(before, mw.params):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def test_autocast_dtypes_cpu_bf16():
    lin = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    rec = mp.autocast_dtypes(lin, (torch.randn(2, 4),), "cpu", torch.bfloat16)
    ops = dict(rec)
    assert ops["addmm"] == torch.bfloat16
    assert ops["relu"] == torch.bfloat16
    assert "_to_copy" in ops


def test_sample_values_keeps_small_inputs_and_samples_large_ones() -> None:
    g = [torch.arange(6.0).reshape(2, 3), None, torch.tensor([7.0])]
    assert torch.equal(mp.sample_values(g), torch.tensor([0.0, 1, 2, 3, 4, 5, 7], dtype=torch.float64))
    big = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    a, b = mp.sample_values(big, limit=500, seed=3), mp.sample_values(big, limit=500, seed=3)
    assert a.shape == (500,) and torch.equal(a, b), "same seed, same sample"
    assert torch.isin(a, big.double()).all(), "a sample holds values of the input only"
    # The fraction of a sample estimates the whole's: here within 5 points of 50% negative.
    assert abs(float((mp.sample_values(big, limit=2000) < 0).double().mean()) - 0.5) < 0.05


# ---- loss scaling with clipping ---------------------------------------------------------------


def _clip_setup(seed=0):
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    unused = torch.nn.Parameter(torch.ones(2))  # in a group, never gets a gradient
    opt = torch.optim.SGD([{"params": list(model[0].parameters()) + [unused], "lr": 0.05},
                           {"params": model[2].parameters(), "lr": 0.02, "momentum": 0.9}], lr=0.1)
    x, y = torch.randn(6, 5, generator=gen), torch.randn(6, 3, generator=gen)
    poison: dict = {"value": None}

    def hook(g):
        if poison["value"] is None:
            return None
        g = g.clone()
        g.view(-1)[0] = poison["value"]
        return g

    model[2].weight.register_hook(hook)
    return model, opt, (lambda: torch.nn.functional.mse_loss(model(x), y)), poison


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("poison", [math.inf, math.nan])
def test_clipped_scaled_step_equals_gradscaler_unscale_clip(max_norm, poison):
    flags = [False, False, True, False, False, False, True, True, False, False]
    ours, torch_run = _clip_setup(), _clip_setup()
    state = {"scale": 2.0**10, "growth_tracker": 0}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for bad in flags:
        ours[3]["value"] = torch_run[3]["value"] = poison if bad else None
        norm = mp.clipped_scaled_step(ours[2], ours[1], state, max_norm, growth_interval=2)
        torch_run[1].zero_grad(set_to_none=True)
        scaler.scale(torch_run[2]()).backward()
        scaler.unscale_(torch_run[1])
        ref_norm = torch.nn.utils.clip_grad_norm_(torch_run[0].parameters(), max_norm)
        scaler.step(torch_run[1])
        scaler.update()
        assert (norm is None) == bad
        if not bad:
            assert norm == pytest.approx(float(ref_norm), rel=1e-6)
            for a, b in zip(ours[0].parameters(), torch_run[0].parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
        assert state["scale"] == scaler.get_scale() and state["growth_tracker"] == int(scaler._growth_tracker)
        for a, b in zip(ours[0].parameters(), torch_run[0].parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)


# ---- autocast step and its measurement --------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_autocast_step_keeps_fp32_weights_and_runs_matmuls_in_dtype(dtype):
    model = GPT(TINY, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = random_batch(TINY, 2, seed=1)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    losses = [mp.autocast_step(model, opt, x, y, dtype, scaler) for _ in range(3)]
    assert all(math.isfinite(v) for v in losses)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    ops = dict(mp.autocast_dtypes(lambda a, b: model(a, b), (x, y), "cpu", dtype or torch.bfloat16))
    assert ops["addmm"] == (dtype or torch.bfloat16)


def test_autocast_step_fp16_skips_an_overflow():
    model = GPT(TINY, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = random_batch(TINY, 2, seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    mp.autocast_step(model, opt, x, y, torch.float16, scaler)
    assert scaler.get_scale() == 2.0**39, "an fp16 backward at scale 2^40 overflows: the step is skipped"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_measure_step_counts_states_and_saved_activations():
    model = GPT(TINY, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = random_batch(TINY, 2, seed=1)
    got = mp.measure_step(lambda: mp.autocast_step(model, opt, x, y), list(model.parameters()), opt, "cpu",
                          warmup=1, repeat=2)
    n = model.num_params()
    # fp32 weights and gradients, two Adam moments, and Adam's step counters (one 4-byte scalar per tensor)
    assert got.state_bytes == 16 * n + 4 * len(list(model.parameters()))
    assert got.saved_bytes == _saved_peak(model, x, y) and got.cuda_peak_bytes is None
    assert len(got.seconds.times) == 2
    quick = mp.measure_step(lambda: mp.autocast_step(model, opt, x, y), list(model.parameters()), opt, "cpu",
                            warmup=0, repeat=1, count_saved=False)
    assert quick.saved_bytes is None and quick.state_bytes == got.state_bytes


def _saved_peak(model, x, y):
    with mm.SavedBytesTracker() as t:
        model(x, y)[1].backward()
    return t.peak


# ---- fp8 ----------------------------------------------------------------------------------------


def test_to_fp8_scales_from_amax_and_round_trips():
    x = torch.tensor([[1.0, -3.5], [0.25, 2.0]])
    q, s = fp8.to_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.dim() == 0
    assert float(s) == pytest.approx(448 / 3.5) and float(q.float().abs().max()) == 448.0
    torch.testing.assert_close(fp8.from_fp8(q, s), x, rtol=2**-4, atol=0)
    q0, s0 = fp8.to_fp8(torch.zeros(3))
    assert float(s0) == 1.0 and not q0.float().any()


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_to_fp8_saturates_with_a_stale_amax(dtype):
    x = torch.tensor([1.0, -40.0, 4.0])
    q, s = fp8.to_fp8(x, dtype, amax=4.0)  # delayed scaling: the history says 4, the tensor holds 40
    assert q.float().tolist()[1] == -fp8.FP8_MAX[dtype]
    assert torch.isfinite(q.float()).all()


def test_to_fp8_upcasts_16_bit_inputs_before_scaling():
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0)).bfloat16()
    q, s = fp8.to_fp8(x)
    expected = (x.float() * s).to(fp8.E4M3)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))


def test_fp8_matmul_matches_scaled_mm_on_cpu_and_bounds_the_error():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 48, generator=gen), torch.randn(48, 16, generator=gen)
    qa, sa = fp8.to_fp8(a)
    qb, sb = fp8.to_fp8(b)
    real = fp8.scaled_mm(qa, qb, sa, sb, torch.float32)  # torch 2.13 runs _scaled_mm on a CPU (slowly)
    torch.testing.assert_close(fp8.fp8_matmul(a, b), real, rtol=1e-5, atol=1e-5)
    err = fp8.relative_error(fp8.fp8_matmul(a, b), a.double() @ b.double())
    assert 1e-3 < err < 0.06, "e4m3 keeps 4 significant bits: a few percent of error, not more"


def test_delayed_scaling_uses_the_history():
    ds = fp8.DelayedScaling(history=2)
    _, s1 = ds.cast(torch.tensor([2.0]))
    _, s2 = ds.cast(torch.tensor([8.0]))
    assert float(s1) == 224.0 and float(s2) == 224.0, "the second cast uses the first one's amax"
    _, s3 = ds.cast(torch.tensor([1.0]))
    assert float(s3) == 56.0
    with pytest.raises(ValueError):
        fp8.DelayedScaling(torch.float16)


@pytest.mark.gpu
def test_fp8_matmul_runs_scaled_mm_on_the_gpu():
    if not fp8.has_fp8_matmul("cuda"):
        pytest.skip("this GPU has no fp8 tensor cores (compute capability below 8.9)")
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=gen).cuda(), torch.randn(512, 128, generator=gen).cuda()
    qa, sa = fp8.to_fp8(a)
    qb, sb = fp8.to_fp8(b)
    got = fp8.fp8_matmul(a, b)
    torch.testing.assert_close(got, fp8.emulated_scaled_mm(qa, qb, sa, sb), rtol=1e-3, atol=1e-3 * float(got.abs().max()))
    assert fp8.relative_error(fp8.scaled_mm(qa, qb, sa, sb), a.double() @ b.double()) < 0.06


def test_benchmark_writes_the_record_the_notebook_reads(tmp_path):
    # the GPU command, run small on a CPU: every variant and every field the notebook renders
    from benchmarks import mixed_precision as bench

    out = tmp_path / "record.json"
    assert bench.main(["--device", "cpu", "--quick", "--no-compile", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    rows = record["sections"]["train_step"]["rows"]
    assert [r["error"] for r in rows] == [None] * 5
    assert {"ms_per_step", "ms_p10", "ms_p90", "tokens_per_s", "peak_bytes", "state_bytes", "saved_bytes"} <= set(rows[0])
    assert rows[2]["saved_bytes"] < rows[0]["saved_bytes"], "autocast saves 16-bit activations"
    fp8_rows = record["sections"]["fp8_matmul"]["rows"]
    assert [r["n"] for r in fp8_rows] == [16, 32]
    assert all(r["bf16_rel_error"] < r["fp8_rel_error"] < 0.06 for r in fp8_rows)
