"""Unit tests of course_lib.memory_math: hand-computed bytes, ZeRO figures from the paper, measured saved tensors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import memory_math as mm
from course_lib.models import MLP, Block, GPTConfig

# ---- bytes per parameter and training memory -------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("fp32_sgd", (4, 4, 0)),
        ("fp32_momentum", (4, 4, 4)),
        ("fp32_adam", (4, 4, 8)),
        ("mixed_adam", (2, 2, 12)),
        ("mixed_adam_fp32_grads", (2, 4, 12)),
    ],
)
def test_bytes_per_param_by_hand(name: str, expected: tuple[int, int, int]) -> None:
    per = mm.bytes_per_param(name)
    assert (per.params, per.grads, per.optimizer, per.activations) == (*expected, 0)
    assert per == mm.bytes_per_param(mm.REGIMES[name])


def test_adam_costs_16_bytes_in_fp32_and_in_mixed_precision_18_with_fp32_grads() -> None:
    assert mm.bytes_per_param("fp32_adam").total == 16
    assert mm.bytes_per_param("mixed_adam").total == 16
    assert mm.bytes_per_param("mixed_adam_fp32_grads").total == 18
    assert mm.bytes_per_param(mm.Regime("mixed_sgd", "sgd", mixed_precision=True)).total == 2 + 2 + 4


def test_regime_validation() -> None:
    with pytest.raises(ValueError, match="optimizer"):
        mm.Regime("bad", "lion")
    with pytest.raises(ValueError, match="regime"):
        mm.bytes_per_param("fp8_adam")


def test_training_memory_scales_per_param_bytes() -> None:
    m = mm.training_memory(7_000_000_000, "mixed_adam", activation_bytes=5e9)
    assert (m.params, m.grads, m.optimizer, m.activations) == (14e9, 14e9, 84e9, 5e9)
    assert m.total == 117e9
    assert mm.training_memory(0, "fp32_sgd").total == 0
    assert mm.training_memory(1000, mm.REGIMES["fp32_momentum"]).total == 12_000
    with pytest.raises(ValueError):
        mm.training_memory(-1, "fp32_adam")
    with pytest.raises(ValueError):
        mm.training_memory(10, "fp32_adam", activation_bytes=-5)


# ---- ZeRO ------------------------------------------------------------------------------------------


def test_zero_matches_the_papers_figure_1() -> None:
    # Rajbhandari et al. (2020), Figure 1: 7.5 B parameters, 64 GPUs, K = 12.
    gb = [mm.zero_memory_per_gpu(7.5e9, stage, 64).total / 1e9 for stage in range(4)]
    assert gb == pytest.approx([120.0, 31.40625, 16.640625, 1.875], rel=1e-12)


def test_zero_shards_states_then_grads_then_params() -> None:
    p, n = 1000, 4
    stages = [mm.zero_memory_per_gpu(p, s, n, "mixed_adam") for s in range(4)]
    assert [(z.params, z.grads, z.optimizer) for z in stages] == [
        (2000, 2000, 12000),
        (2000, 2000, 3000),
        (2000, 500, 3000),
        (500, 500, 3000),
    ]
    fp32 = mm.zero_memory_per_gpu(p, 2, n, "fp32_adam")
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4000, 1000, 2000)


def test_zero_on_one_gpu_equals_plain_training() -> None:
    for stage in range(4):
        assert mm.zero_memory_per_gpu(123, stage, 1).total == mm.training_memory(123, "mixed_adam").total


def test_zero_rejects_bad_arguments() -> None:
    for stage in (-1, 4):
        with pytest.raises(ValueError, match="stage"):
            mm.zero_memory_per_gpu(10, stage, 8)
    with pytest.raises(ValueError):
        mm.zero_memory_per_gpu(10, 1, 0)


# ---- transformer activation formula -------------------------------------------------------------------


def test_transformer_formula_by_hand() -> None:
    s, b, h, a = 2048, 4, 6144, 48
    per_layer = s * b * h * (34 + 5 * a * s / h)
    assert mm.transformer_activation_bytes(s, b, h, a) == per_layer
    assert mm.transformer_activation_bytes(s, b, h, a, 3) == 3 * per_layer
    assert isinstance(mm.transformer_activation_bytes(s, b, h, a), int)
    assert mm.transformer_activation_bytes(s, b, h, a, attention_scores=False) == 34 * s * b * h
    assert mm.transformer_activation_bytes(s, b, h, a, dropout=False) == 32 * s * b * h + 2 * a * s * s * b
    assert mm.transformer_activation_bytes(s, b, h, a, attention_scores=False, dropout=False) == 32 * s * b * h
    assert mm.transformer_activation_bytes(s, b, h, a, 0) == 0
    with pytest.raises(ValueError):
        mm.transformer_activation_bytes(-1, b, h, a)


@pytest.mark.parametrize(("b", "s", "h", "a"), [(2, 32, 64, 4), (3, 64, 96, 6), (1, 128, 64, 2)])
def test_formula_matches_a_measured_block_within_two_percent(b: int, s: int, h: int, a: int) -> None:
    # The course Block uses SDPA (no s x s scores kept) and no dropout: the formula's 32 s b h,
    # plus small extras (LayerNorm mean/rstd, the attention's logsumexp), within 2 %.
    block = Block(GPTConfig(seq_len=s, n_head=a, d_model=h)).to(torch.bfloat16)
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    measured = mm.measure_saved_activation_bytes(block, x)
    formula = mm.transformer_activation_bytes(s, b, h, a, attention_scores=False, dropout=False)
    assert 1.0 <= measured / formula <= 1.02, (measured, formula)


# ---- why activations are kept -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(5,), (2, 3), (2, 0)])
def test_linear_weight_grad_equals_autograd(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(6, 4).double()
    x = torch.randn(*shape, 6, dtype=torch.float64)
    y = lin(x)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(mm.linear_weight_grad(x, g), lin.weight.grad)


# ---- saved tensors -------------------------------------------------------------------------------------


def test_a_linear_layer_saves_its_input_and_weight_only_the_input_counts() -> None:
    lin = nn.Linear(8, 3)
    x = torch.randn(5, 8, requires_grad=True)
    saved = mm.saved_tensors(lin, x)
    keys = {r.storage for r in saved}
    assert mm.storage_key(x) in keys and mm.storage_key(lin.weight) in keys
    assert [r.is_parameter for r in saved if r.storage == mm.storage_key(lin.weight)] == [True]
    assert mm.measure_saved_activation_bytes(lin, x) == 5 * 8 * 4
    # handed a plain function rather than the module, the weight still does not count
    assert mm.measure_saved_activation_bytes(lambda t: lin(t), x) == 5 * 8 * 4
    # x need not require grad: the weight's gradient still needs it
    assert mm.measure_saved_activation_bytes(lin, x.detach()) == 5 * 8 * 4


def test_relu_shares_its_saved_output_with_the_next_linear_gelu_does_not() -> None:
    x = torch.randn(4, 10)
    relu_net = MLP([10, 16, 2], nn.ReLU, seed=0)
    gelu_net = MLP([10, 16, 2], nn.GELU, seed=0)
    assert mm.measure_saved_activation_bytes(relu_net, x) == (4 * 10 + 4 * 16) * 4
    assert mm.measure_saved_activation_bytes(gelu_net, x) == (4 * 10 + 2 * 4 * 16) * 4
    # a forward hook sees three module outputs in both
    assert mm.forward_hook_activation_bytes(relu_net, x) == (4 * 16 * 2 + 4 * 2) * 4


def test_relu_chain() -> None:
    net = nn.Sequential(*[nn.ReLU() for _ in range(5)])
    x = torch.randn(7, 3, requires_grad=True)
    # each ReLU saves its own output: five distinct storages
    assert mm.measure_saved_activation_bytes(net, x) == 5 * 7 * 3 * 4
    assert mm.measure_saved_activation_bytes(net, x.detach()) == 0  # nothing needs a gradient


def test_views_count_their_whole_storage_once() -> None:
    def halves(x: torch.Tensor) -> torch.Tensor:
        y = x.exp()  # saves y
        return y[:, :2] * y[:, 2:]  # saves two views of y

    x = torch.randn(3, 4, requires_grad=True)
    assert mm.measure_saved_activation_bytes(halves, x) == 3 * 4 * 4

    def slice_of_scaled(x: torch.Tensor) -> torch.Tensor:
        return (x * 3)[:1].sin()  # sin saves a 1-row view of a 3-row storage

    assert mm.measure_saved_activation_bytes(slice_of_scaled, x) == 3 * 4 * 4


def test_parameters_and_their_views_are_excluded_and_dtypes_count() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * self.w.t()) @ self.w[0]

    x = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    model = Scale().double()
    saved = mm.saved_tensors(model, x)
    assert any(r.is_parameter for r in saved)
    # x (saved by the product) and x * w^T (saved by the matrix-vector product), 36 float64 each
    assert mm.measure_saved_activation_bytes(model, x) == 2 * 36 * 8
    assert mm.measure_saved_activation_bytes(model.to(torch.bfloat16), x.to(torch.bfloat16)) == 2 * 36 * 2


def test_parameters_are_excluded_whatever_callable_counts() -> None:
    # a plain function that uses modules' weights: no nn.Module is handed over, yet the
    # transposed weights a Linear saves are still the parameters' memory
    layers = [nn.Linear(8, 8) for _ in range(3)]
    x = torch.randn(5, 8, requires_grad=True)

    def chain(t: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            t = torch.relu(layer(t))
        return t

    saved = mm.saved_tensors(chain, x)
    assert any(r.is_parameter for r in saved)
    # x, and each ReLU output (saved by the ReLU and by the next Linear: once)
    assert mm.measure_saved_activation_bytes(chain, x) == (1 + 3) * 5 * 8 * 4
    assert mm.measure_saved_activation_bytes(chain, x) == mm.measure_saved_activation_bytes(nn.Sequential(
        *[m for layer in layers for m in (layer, nn.ReLU())]), x)
    w = layers[0].weight
    assert mm.is_parameter_storage(w) and mm.is_parameter_storage(w.t()) and mm.is_parameter_storage(w[0])
    assert not mm.is_parameter_storage(w.detach().clone()) and not mm.is_parameter_storage(x)
    assert mm.is_parameter_storage(w.detach(), {mm.storage_key(w)})


def test_ledger_charges_the_innermost_running_module_once_and_adds_up_to_the_total() -> None:
    torch.manual_seed(0)
    mlp = MLP([8, 16, 2], nn.ReLU, seed=0)
    x = torch.randn(5, 8)
    assert mm.saved_bytes_by_module(mlp, x) == {"0": 5 * 8 * 4, "1": 5 * 16 * 4}  # '2' keeps the ReLU output again
    block = Block(GPTConfig(seq_len=16, n_head=2, d_model=32)).to(torch.bfloat16)
    xb = torch.randn(3, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    ledger = mm.saved_bytes_by_module(block, xb)
    assert sum(ledger.values()) == mm.measure_saved_activation_bytes(block, xb)
    sbh = 3 * 16 * 32
    # Q, K, V are views of one qkv output (6 sbh bytes), kept by SDPA inside attn's own forward, with its output
    assert ledger["attn.qkv"] == 2 * sbh and ledger["mlp.fc"] == 2 * sbh
    assert 8 * sbh <= ledger["attn"] < 9 * sbh and "attn.proj" not in ledger
    assert ledger["mlp"] == 8 * sbh and ledger["mlp.proj"] == 8 * sbh  # GELU's input; the second Linear's input


def test_ledger_charges_functional_code_between_children_to_the_parent() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(4, 4), nn.GELU())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x).exp().sum()

    assert mm.saved_bytes_by_module(Outer(), torch.randn(3, 4)) == {"inner.0": 48, "inner.1": 48, "": 48}


def test_ledger_removes_its_hooks_also_when_the_forward_pass_raises() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin(x)
            raise ValueError("boom")

    model = Boom()
    with pytest.raises(ValueError, match="boom"):
        mm.saved_bytes_by_module(model, torch.randn(2, 4))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert mm.saved_bytes_by_module(model.lin, torch.randn(2, 4)) == {"": 32}


def test_tracker_peak_is_the_saved_total_and_falls_back_to_zero() -> None:
    net = MLP([16, 32, 32, 4], nn.GELU, seed=0)
    x = torch.randn(6, 16, requires_grad=True)
    with mm.SavedBytesTracker() as tracker:
        out = net(x).sum()  # a sum saves nothing
        after_forward = tracker.live
        out.backward()
    assert after_forward == tracker.peak == mm.measure_saved_activation_bytes(net, x)
    assert tracker.live == 0  # every saved tensor was freed by the backward pass


def test_tracker_counts_a_storage_once_and_skips_parameter_views() -> None:
    w = nn.Parameter(torch.randn(4, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with mm.SavedBytesTracker() as tracker:
        y = x.exp()  # saves its output y
        z = (y[:, :4] * y[:, 4:]) @ w[:, :4].t()  # two views of y's storage; a view of w
        peak_before_backward = tracker.peak
        z.sum().backward()
    assert peak_before_backward == tracker.peak == 4 * 8 * 4 + 4 * 4 * 4  # y, and the product (saved by @)
    assert tracker.live == 0


def test_dropout_keeps_a_mask_only_when_training() -> None:
    net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    x = torch.randn(2, 8)
    train = mm.measure_saved_activation_bytes(net, x)
    assert train > mm.measure_saved_activation_bytes(net.eval(), x) == 2 * 8 * 4


def test_optimizer_state_is_lazy_and_matches_the_state_count() -> None:
    model = MLP([20, 30, 5], seed=0)
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    x = torch.randn(4, 20)
    for opt, per_param, per_tensor in [
        (torch.optim.SGD(model.parameters(), lr=0.1), 0, 0),
        (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 4, 0),
        (torch.optim.Adam(model.parameters()), 8, 4),  # + a 0-dim fp32 step counter per tensor
    ]:
        assert mm.measured_training_memory(model, opt).optimizer == 0
        model.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        measured = mm.measured_training_memory(model, opt)
        assert measured.optimizer == per_param * n + per_tensor * tensors
        assert (measured.params, measured.grads) == (4 * n, 4 * n)


def test_forward_hooks_see_inplace_outputs_twice() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    x = torch.randn(3, 4)
    assert mm.forward_hook_activation_bytes(net, x) == 2 * 3 * 4 * 4
    assert mm.measure_saved_activation_bytes(net, x) == 2 * 3 * 4 * 4  # x, and the ReLU's output


def test_saved_tensors_reports_what_made_each_tensor() -> None:
    x = torch.randn(2, 5, requires_grad=True)
    saved = mm.saved_tensors(lambda t: F.layer_norm(t, (5,)), x)
    assert [r.produced_by for r in saved][0] == "leaf"
    assert [r.shape for r in saved] == [(2, 5), (2, 1), (2, 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_memory_holds_at_least_the_saved_tensors() -> None:
    block = Block(GPTConfig(seq_len=256, n_head=4, d_model=256)).cuda().to(torch.bfloat16)
    x = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    held, peak = mm.cuda_forward_memory(block, x)
    saved = mm.measure_saved_activation_bytes(block, x)
    # held: the saved tensors except the input (allocated before), plus the output, of the input's size
    assert peak >= held
    assert math.isclose(held, saved, rel_tol=0.1), (held, saved)
