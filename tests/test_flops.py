"""course_lib.flops: the operator counter agrees with FlopCounterMode; the config's count, with what the kernels execute."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from course_lib import flops, models

SMALL = models.GPTConfig(vocab_size=50, seq_len=12, n_layer=2, n_head=2, d_model=16)


def _train_step_of(cfg: models.GPTConfig, batch: int, checkpointing: bool = False):
    model = models.GPT(cfg, seed=0)
    if checkpointing:
        flops.checkpoint_blocks(model)
    x, y = models.random_batch(cfg, batch, seed=0)

    def forward_backward() -> None:
        _, loss = model(x, y)
        loss.backward()

    return forward_backward


def test_op_costs_match_flop_counter_on_a_training_step() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4, bias=False))
    x = torch.randn(5, 8)

    def step() -> None:
        net(x).square().sum().backward()

    costs = flops.op_costs(step)
    with FlopCounterMode(display=False) as counter:
        step()
    expected = {f"aten::{op.__name__}": n for op, n in counter.get_flop_counts()["Global"].items()}
    assert {name: c[1] for name, c in costs.items() if c[1]} == expected
    calls, flop, moved = costs["aten::addmm"]
    assert calls == 1 and flop == 2 * 5 * 8 * 32
    assert moved == (32 + 5 * 8 + 8 * 32 + 5 * 32) * 4, "bias, input, weight read; output written"
    assert all(not name.startswith(("aten::t", "aten::view")) for name in costs), "views move nothing"


def test_op_costs_batched_matmul_and_lists() -> None:
    a, b = torch.randn(3, 4, 5), torch.randn(3, 5, 6)
    costs = flops.op_costs(lambda: (torch.bmm(a, b), torch.cat([a, a], dim=0)))
    assert costs["aten::bmm"] == (1, 2 * 3 * 4 * 5 * 6, (60 + 90 + 72) * 4)
    assert costs["aten::cat"] == (1, 0, 4 * 60 * 4), "the tensors inside a list argument are read too"


def test_count_flops_adds_cpu_attention() -> None:
    q = k = v = torch.randn(2, 3, 16, 8, requires_grad=True)

    def attention() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    # Forward QK^T and PV; backward recomputes QK^T, then four more products: PyTorch's GPU formula.
    assert flops.count_flops(attention) == (2 + 5) * 2 * 2 * 3 * 16 * 16 * 8


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("cfg", [SMALL, replace(SMALL, mlp_ratio=3, tie_embeddings=True, bias=False, n_layer=3)])
def test_step_flops_is_what_the_kernels_execute(cfg: models.GPTConfig, checkpointing: bool) -> None:
    model_flops, hardware_flops = flops.step_flops(cfg, 3, checkpointing)
    assert hardware_flops == flops.count_flops(_train_step_of(cfg, 3, checkpointing))
    h, L, s, V, r = cfg.d_model, cfg.n_layer, cfg.seq_len, cfg.vocab_size, cfg.mlp_ratio
    n = L * (4 + 2 * r) * h * h + V * h
    assert model_flops == (6 * n + 12 * L * s * h) * 3 * s, "6N + 12 L s h per token (PaLM)"


def test_utilization() -> None:
    model_flops, hardware_flops = flops.step_flops(SMALL, 2, checkpointing=True)
    mfu, hfu = flops.utilization(SMALL, 2, 0.5, 1e9, checkpointing=True)
    assert mfu == pytest.approx(model_flops / 0.5e9) and hfu == pytest.approx(hardware_flops / 0.5e9)
    assert hfu > mfu
    for bad in [(0.0, 1e9), (1.0, 0.0)]:
        with pytest.raises(ValueError):
            flops.utilization(SMALL, 2, *bad)


def test_checkpointed_blocks_give_the_same_gradients() -> None:
    x, y = models.random_batch(SMALL, 2, seed=1)
    plain, ck = models.GPT(SMALL, seed=0), flops.checkpoint_blocks(models.GPT(SMALL, seed=0))
    for m in (plain, ck):
        m(x, y)[1].backward()
    for p, q in zip(plain.parameters(), ck.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_device_peak_flops_on_a_cpu_is_measured() -> None:
    rate, source = flops.device_peak_flops(torch.device("cpu"))
    assert rate > 0 and "measured" in source
