"""Unit tests of course_lib.activations and course_lib.optimizers against autograd and torch.optim."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from course_lib import activations as act
from course_lib import models
from course_lib import optimizers as opt
from course_lib.exercises.checks import assert_close
from course_lib.exercises.optimizers import check_against_torch
from course_lib.support.sizes import tensor_bytes

INF = float("inf")


# ---- activations ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(act.ACTIVATIONS))
def test_derivative_matches_autograd(name: str) -> None:
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64).requires_grad_(True)
    (grad,) = torch.autograd.grad(act.ACTIVATIONS[name](x).sum(), x)
    assert_close(act.derivative(name, x.detach()), grad, atol=1e-12, rtol=1e-10, name=name)


def test_derivative_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown activation"):
        act.derivative("swish", torch.zeros(3))


def test_sigmoid_derivative_is_at_most_a_quarter() -> None:
    x = torch.linspace(-10, 10, 2001)
    assert float(act.derivative("sigmoid", x).max()) == pytest.approx(0.25)


@pytest.mark.parametrize("dim", [0, 1, -1, 2])
def test_softmax_and_log_softmax_match_torch_on_any_dim(dim: int) -> None:
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(dim + 5)) * 30
    assert_close(act.softmax(x, dim), torch.softmax(x, dim))
    assert_close(act.log_softmax(x, dim), torch.log_softmax(x, dim), atol=1e-5)


def test_softmax_survives_huge_logits_where_the_naive_one_overflows() -> None:
    x = torch.tensor([[1000.0, 1001.0, 1002.0], [-1000.0, -1001.0, -1002.0]])
    assert torch.isnan(act.naive_softmax(x)).any()
    assert_close(act.softmax(x), torch.softmax(x, -1))
    assert_close(act.log_softmax(x), torch.log_softmax(x, -1))
    assert torch.isfinite(act.log_softmax(torch.tensor([0.0, -200.0]))).all()  # log(softmax) would give -inf


def test_softmax_with_minus_infinity_entries() -> None:
    x = torch.tensor([[1.0, -INF, 2.0], [-INF, -INF, -INF], [-INF, 0.0, -INF]])
    assert_close(act.softmax(x), torch.softmax(x, -1))
    assert_close(act.log_softmax(x), torch.log_softmax(x, -1))
    assert torch.isnan(act.softmax(x)[1]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_softmax_keeps_the_dtype_and_matches_torch(dtype: torch.dtype) -> None:
    x = (torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 20).to(dtype)
    assert act.softmax(x).dtype == dtype
    assert_close(act.softmax(x), torch.softmax(x, -1))
    # torch's own fp16/bf16 log_softmax loses digits next to the maximum (x - logsumexp cancels):
    # compare with the fp32 result rounded once, which is what act.log_softmax returns
    assert_close(act.log_softmax(x), torch.log_softmax(x.to(torch.float64), -1).to(dtype))


def test_softmax_of_empty_and_scalar_tensors() -> None:
    assert act.softmax(torch.zeros(0, 5)).shape == (0, 5)
    assert_close(act.softmax(torch.tensor(3.0), 0), torch.tensor(1.0))


def test_init_and_layer_grad_norms_show_vanishing_sigmoid_gradients() -> None:
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    norms = {}
    for name, activation, scheme in (("sigmoid", nn.Sigmoid, "xavier"), ("relu", nn.ReLU, "kaiming")):
        model = act.init_linear_(models.MLP([32] * 12 + [1], activation, seed=0), scheme)
        nn.functional.mse_loss(model(x), y).backward()
        norms[name] = act.layer_grad_norms(model)
        assert len(norms[name]) == 12
    assert norms["sigmoid"][0] < 1e-4 * norms["sigmoid"][-1]  # shrinks by about 4x per layer
    assert norms["relu"][0] > 1e-2 * norms["relu"][-1]


def test_layer_grad_norms_before_backward_are_zero() -> None:
    assert act.layer_grad_norms(models.MLP([3, 4, 2], seed=0)) == [0.0, 0.0]


def test_init_linear_rejects_unknown_scheme() -> None:
    with pytest.raises(ValueError):
        act.init_linear_(models.MLP([3, 4, 2], seed=0), "orthogonal")


def test_dead_unit_fraction() -> None:
    model = models.MLP([4, 8, 8, 1], seed=0)
    x = torch.randn(100, 4, generator=torch.Generator().manual_seed(0))  # its own seed: not whatever ran before
    assert act.dead_unit_fraction(model, x) == [0.0, 0.0]
    with torch.no_grad():
        model[0].bias[:4] = -100.0  # half the first layer's units can never be positive
        model[2].bias[:] = -100.0
    assert act.dead_unit_fraction(model, x) == [0.5, 1.0]
    assert not any(m._forward_hooks for m in model.modules())  # hooks removed


# ---- step functions against torch.optim, through chapter 04's grading harness ----------------

MODEL = models.MLP([6, 10, 10, 3], nn.Tanh, seed=3)

CASES = [
    (opt.sgd_step, torch.optim.SGD, dict(lr=0.1), ()),
    (opt.sgd_step, torch.optim.SGD, dict(lr=0.05, weight_decay=0.01), ()),
    (opt.sgd_step, torch.optim.SGD, dict(lr=0.05, momentum=0.9), ("momentum_buffer",)),
    (opt.sgd_step, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.5, weight_decay=1e-2), ("momentum_buffer",)),
    (opt.sgd_step, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True), ("momentum_buffer",)),
    (opt.rmsprop_step, torch.optim.RMSprop, dict(lr=1e-2), ("square_avg",)),
    (opt.rmsprop_step, torch.optim.RMSprop, dict(lr=1e-2, alpha=0.9, eps=0.1, weight_decay=0.1), ("square_avg",)),
    (opt.rmsprop_step, torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True),
     ("square_avg", "momentum_buffer", "grad_avg")),
    (opt.adam_step, torch.optim.Adam, dict(lr=1e-2), ("exp_avg", "exp_avg_sq")),
    (opt.adam_step, torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-2, weight_decay=0.1), ("exp_avg", "exp_avg_sq")),
    (opt.adamw_step, torch.optim.AdamW, dict(lr=1e-2), ("exp_avg", "exp_avg_sq")),
    (opt.adamw_step, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.3, eps=1e-3), ("exp_avg", "exp_avg_sq")),
]


@pytest.mark.parametrize("on_model", [False, True], ids=["random-grads", "mlp"])
@pytest.mark.parametrize("step_fn, torch_cls, hyper, keys", CASES, ids=[f"{c[1].__name__}-{i}" for i, c in enumerate(CASES)])
def test_step_functions_match_torch_optim_over_20_steps(step_fn, torch_cls, hyper, keys, on_model: bool) -> None:
    check_against_torch(step_fn, torch_cls, steps=20, model=MODEL if on_model else None, state_keys=keys, **hyper)


def test_adam_step_with_decoupled_flag_is_adamw_bit_for_bit() -> None:
    check_against_torch(opt.adam_step, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, atol=0, rtol=0,
                        step_only={"decoupled_weight_decay": True}, state_keys=("exp_avg", "exp_avg_sq"))


def test_step_functions_in_float64() -> None:
    check_against_torch(opt.adam_step, torch.optim.Adam, dtype=torch.float64, lr=1e-2, atol=1e-12, rtol=1e-12)


def test_nesterov_needs_momentum() -> None:
    with pytest.raises(ValueError):
        opt.sgd_step(torch.zeros(2), torch.zeros(2), {}, lr=0.1, nesterov=True)


def test_step_optimizer_trains_like_torch() -> None:
    x, y = opt.toy_regression(64, 6, seed=1)
    models_ = [models.MLP([6, 16, 1], seed=0) for _ in range(2)]
    optimizers = [opt.StepOptimizer(models_[0].parameters(), opt.adam_step, lr=1e-2, weight_decay=0.0),
                  torch.optim.Adam(models_[1].parameters(), lr=1e-2)]
    for _ in range(20):
        for model, o in zip(models_, optimizers):
            o.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            o.step()
    for a, b in zip(models_[0].parameters(), models_[1].parameters()):
        assert_close(a.detach(), b.detach(), atol=1e-6)
    assert tensor_bytes(optimizers[0].state) > 0


def test_check_against_torch_catches_the_textbook_adam() -> None:
    def textbook_adam(p, grad, state, *, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        m = state.setdefault("exp_avg", torch.zeros_like(p))
        v = state.setdefault("exp_avg_sq", torch.zeros_like(p))
        m.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
        v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
        p.sub_(lr * m / torch.sqrt(v + eps))  # no bias correction, eps inside the root

    with pytest.raises(AssertionError, match="after step 1"):
        check_against_torch(textbook_adam, torch.optim.Adam, lr=1e-2)


def test_check_against_torch_catches_in_place_grad_and_returned_tensors() -> None:
    def changes_grad(p, grad, state, *, lr):
        p.sub_(grad.mul_(lr))

    def returns_new(p, grad, state, *, lr):
        return p - lr * grad

    with pytest.raises(AssertionError, match="changed `grad` in place"):
        check_against_torch(changes_grad, torch.optim.SGD, lr=0.1)
    with pytest.raises(AssertionError, match="in place"):
        check_against_torch(returns_new, torch.optim.SGD, lr=0.1)


# ---- state memory ---------------------------------------------------------------------------

TORCH_OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps),
    "adam": lambda ps: torch.optim.Adam(ps),
    "adamw": lambda ps: torch.optim.AdamW(ps),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(TORCH_OPTIMIZERS))
def test_optimizer_state_bytes_equals_the_real_state(name: str, dtype: torch.dtype) -> None:
    cfg = models.GPTConfig.tiny()
    model = models.GPT(cfg, seed=0).to(dtype)
    model.pos_emb.weight.requires_grad_(False)  # a frozen parameter gets no state
    optimizer = TORCH_OPTIMIZERS[name]([p for p in model.parameters() if p.requires_grad])
    _, loss = model(*models.random_batch(cfg, 2, seed=0))
    loss.backward()
    optimizer.step()
    assert opt.optimizer_state_bytes(model, name) == tensor_bytes(optimizer.state)


def test_state_multiples_of_the_parameter_bytes() -> None:
    model = models.MLP([100, 100], bias=False, seed=0)  # one tensor of 10^4 fp32 numbers
    param_bytes = 40_000
    assert [opt.optimizer_state_bytes(model, n) for n in ("sgd", "sgd_momentum", "rmsprop", "adam")] == [
        0, param_bytes, param_bytes + 4, 2 * param_bytes + 4]
    with pytest.raises(ValueError):
        opt.optimizer_state_bytes(model, "lion")


def test_state_summary_names_torch_keys() -> None:
    model = models.MLP([3, 2], seed=0)
    optimizer = torch.optim.Adam(model.parameters())
    assert opt.state_summary(optimizer) == {}
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    summary = opt.state_summary(optimizer)
    assert list(summary) == ["step", "exp_avg", "exp_avg_sq"]
    assert summary["step"] == ("float32 ()", 2)


# ---- traffic --------------------------------------------------------------------------------

def test_adam_traffic_unfused_and_fused() -> None:
    per_op = opt.op_traffic(opt.ADAM_FOR_LOOP, 10, 4)
    assert [(r // 40, w // 40) for _, r, w in per_op] == [(2, 1), (1, 1), (2, 1), (1, 1), (1, 1), (1, 1), (3, 1)]
    assert opt.step_traffic(opt.ADAM_FOR_LOOP, 10, 4) == (440, 280)  # 18 passes over 40 bytes
    assert opt.step_traffic(opt.ADAM_FOR_LOOP, 10, 4, fused=True) == (160, 120)  # p, g, m, v in; p, m, v out
    assert opt.step_traffic(opt.ADAM_FOR_LOOP, 10, 2, fused=True) == (80, 60)


@pytest.mark.parametrize("name, unfused, fused", [
    ("sgd", (2, 1), (2, 1)),
    ("sgd_momentum", (5, 3), (3, 2)),
    ("rmsprop", (8, 5), (3, 2)),
    ("adam_l2", (13, 8), (4, 3)),
    ("adamw", (12, 8), (4, 3)),
])
def test_traffic_of_other_programs(name: str, unfused: tuple[int, int], fused: tuple[int, int]) -> None:
    program = opt.PROGRAMS[name]
    assert opt.step_traffic(program, 1, 1) == unfused
    assert opt.step_traffic(program, 1, 1, fused=True) == fused


def test_fused_supported() -> None:
    assert opt.fused_supported("cuda")
    assert isinstance(opt.fused_supported("cpu"), bool)


# ---- mini-batch gradients -------------------------------------------------------------------

def test_per_sample_gradients_average_to_the_full_batch_gradient() -> None:
    x, y = opt.toy_regression(32, 5, seed=2)
    model = models.MLP([5, 7, 1], nn.Tanh, seed=0)
    per_sample = opt.per_sample_gradients(model, x, y)
    assert per_sample.shape == (32, sum(p.numel() for p in model.parameters()))
    nn.functional.mse_loss(model(x), y).backward()
    full = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert_close(per_sample.mean(0), full, atol=1e-6)


def test_minibatch_noise_follows_one_over_b() -> None:
    x, y = opt.toy_regression(256, 5, seed=2)
    per_sample = opt.per_sample_gradients(models.MLP([5, 7, 1], seed=0), x, y)
    assert opt.minibatch_noise(per_sample, 256, 3) == pytest.approx(0.0, abs=1e-10)
    assert opt.expected_minibatch_noise(per_sample, 256) == 0.0
    for b in (1, 8, 64):
        measured = opt.minibatch_noise(per_sample, b, 400, seed=b)
        assert measured == pytest.approx(opt.expected_minibatch_noise(per_sample, b), rel=0.25)
    with pytest.raises(ValueError):
        opt.minibatch_noise(per_sample, 0, 3)


def test_toy_regression_is_seeded() -> None:
    a, b = opt.toy_regression(10, 3, seed=4), opt.toy_regression(10, 3, seed=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[1].shape == (10, 1) and math.isfinite(float(a[1].sum()))


def test_check_against_torch_appends_the_hint_but_not_to_not_done_yet() -> None:
    def sgd_without_momentum(p, grad, state, *, lr, momentum=0.0):
        p.sub_(lr * grad)

    def untouched(p, grad, state, *, lr):
        raise NotImplementedError()

    with pytest.raises(AssertionError, match="hint: keep a buffer"):
        check_against_torch(sgd_without_momentum, torch.optim.SGD, lr=0.1, momentum=0.9, hint="keep a buffer")
    with pytest.raises(AssertionError, match="not implemented yet") as info:
        check_against_torch(untouched, torch.optim.SGD, lr=0.1, hint="unused")
    assert "hint" not in str(info.value)
