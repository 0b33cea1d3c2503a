"""Tests of course_lib.mixed_precision against PyTorch's own GradScaler, autocast and casts."""

from __future__ import annotations

import math

import pytest
import torch

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


def test_mixed_precision_bytes_matches_regimes():
    assert mp.mixed_precision_bytes(1000) == mm.training_memory(1000, "mixed_adam")
    assert mp.mixed_precision_bytes(10, fp32_grads=True) == mm.training_memory(10, "mixed_adam_fp32_grads")
    assert mp.mixed_precision_bytes(10, "sgd").total == 2 * 10 + 2 * 10 + 4 * 10
    with pytest.raises(ValueError):
        mp.mixed_precision_bytes(10, "lion")


def test_sample_values_keeps_small_inputs_and_samples_large_ones() -> None:
    g = [torch.arange(6.0).reshape(2, 3), None, torch.tensor([7.0])]
    assert torch.equal(mp.sample_values(g), torch.tensor([0.0, 1, 2, 3, 4, 5, 7], dtype=torch.float64))
    big = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    a, b = mp.sample_values(big, limit=500, seed=3), mp.sample_values(big, limit=500, seed=3)
    assert a.shape == (500,) and torch.equal(a, b), "same seed, same sample"
    assert torch.isin(a, big.double()).all(), "a sample holds values of the input only"
    # The fraction of a sample estimates the whole's: here within 5 points of 50% negative.
    assert abs(float((mp.sample_values(big, limit=2000) < 0).double().mean()) - 0.5) < 0.05
