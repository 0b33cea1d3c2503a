"""Tests for course_lib.capstone: a tiny run trains, reports consistent numbers, and the CLI writes JSON."""

import json
import math

import torch

from course_lib import capstone, models


def test_flops_per_step_is_six_n_plus_attention():
    cfg = models.GPTConfig.small()
    matmul_params = 12 * cfg.n_layer * cfg.d_model**2 + cfg.vocab_size * cfg.d_model
    tokens = 4 * cfg.seq_len
    want = 6 * matmul_params * tokens + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len * tokens
    assert math.isclose(capstone.flops_per_step(cfg, 4), want, rel_tol=1e-12)


def test_device_peak_flops_on_a_cpu_is_measured():
    rate, source = capstone.device_peak_flops(torch.device("cpu"))
    assert rate > 0 and "CPU" in source


def test_tiny_run_learns_and_reports():
    run = capstone.RunConfig("tiny", steps=6, batch_size=4, seq_len=32, compile=False, warmup=2, lr=3e-3)
    res = capstone.train(run, progress=False, peak=(1e12, "test"))
    assert len(res.losses) == 8
    assert res.losses[-1] < res.losses[0]
    assert res.tokens_per_s > 0 and res.mfu > 0
    assert math.isclose(res.mfu, capstone.flops_per_step(run.model_config(), 4) / res.step_s / 1e12, rel_tol=1e-9)
    assert res.params == models.gpt_param_count(run.model_config())


def test_baseline_switches_everything_off():
    base = capstone.RunConfig.for_this_machine().baseline()
    assert not (base.bf16 or base.compile or base.fused_adam or base.checkpointing)


def test_checkpointed_run_same_losses():
    run = capstone.RunConfig("tiny", steps=2, batch_size=2, seq_len=16, compile=False, bf16=False, warmup=1)
    a = capstone.train(run, progress=False, peak=(1e12, "test"))
    b = capstone.train(run.__class__(**{**run.__dict__, "checkpointing": True}), progress=False, peak=(1e12, "test"))
    assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a.losses, b.losses))


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "c.json"
    capstone.main(["--preset", "tiny", "--steps", "2", "--seq-len", "16", "--batch-size", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    assert set(data) == {"baseline", "optimized", "speedup"}
    assert data["baseline"]["config"]["bf16"] is False and data["optimized"]["config"]["bf16"] is True
    assert "RESULT " in capsys.readouterr().out
