"""Tests of course_lib.accumulation_checkpointing (chapter 07)."""

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib import accumulation_checkpointing as ac
from course_lib import memory_math as mm
from course_lib.models import MLP


def _batch(seed=0, n=12, d=6, c=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, c, (n,), generator=g)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 12])
def test_accumulated_equals_full_batch(k):
    model = MLP([6, 16, 3], seed=1).double()
    x, y = _batch()
    batch = (x.double(), y)
    full = ac.full_batch_gradients(model, nn.functional.cross_entropy, batch)
    acc = ac.accumulated_gradients(model, nn.functional.cross_entropy, batch, k)
    for a, f in zip(acc, full):
        torch.testing.assert_close(a, f)


def test_uneven_split_raises():
    with pytest.raises(ValueError):
        ac.split_micro_batches(_batch(), 5)
    with pytest.raises(ValueError):
        ac.split_micro_batches(_batch(), 0)


def test_accumulation_step_matches_big_step():
    x, y = _batch(3)
    m1, m2 = MLP([6, 8, 3], seed=2), MLP([6, 8, 3], seed=2)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    l1 = ac.accumulation_step(m1, o1, nn.functional.cross_entropy, (x, y), 4)
    l2 = ac.accumulation_step(m2, o2, nn.functional.cross_entropy, (x, y), 1)
    assert abs(l1 - l2) < 1e-5
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q)


def test_batchnorm_breaks_equality():
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    batch = _batch()
    full = ac.full_batch_gradients(model, nn.functional.cross_entropy, batch)
    acc = ac.accumulated_gradients(model, nn.functional.cross_entropy, batch, 3)
    assert not torch.allclose(full[0], acc[0], atol=1e-4)


@pytest.mark.parametrize("n,s", [(1, 1), (10, 3), (7, 7), (8, 2), (5, 1)])
def test_segment_bounds(n, s):
    b = ac.segment_bounds(n, s)
    assert len(b) == s and b[0][0] == 0 and b[-1][1] == n
    assert all(b[i][1] == b[i + 1][0] for i in range(s - 1))
    lengths = [e - a for a, e in b]
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)


@pytest.mark.parametrize("n,s", [(0, 1), (4, 0), (4, 5)])
def test_segment_bounds_invalid(n, s):
    with pytest.raises(ValueError):
        ac.segment_bounds(n, s)


@pytest.mark.parametrize("segments", [1, 2, 3, 5, 7])
def test_checkpointed_sequential_matches(segments):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.3)) for _ in range(7)]
    x = torch.randn(5, 8, requires_grad=True)
    torch.manual_seed(1)
    out = ac.checkpointed_sequential(layers, segments, x)
    out.square().sum().backward()
    g_ck = [x.grad.clone()] + [p.grad.clone() for m in layers for p in m.parameters()]
    x.grad = None
    for m in layers:
        m.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    ref = ac.plain_sequential(layers, x)
    ref.square().sum().backward()
    g_ref = [x.grad.clone()] + [p.grad.clone() for m in layers for p in m.parameters()]
    torch.testing.assert_close(out, ref)
    for a, b in zip(g_ck, g_ref):
        torch.testing.assert_close(a, b)


def test_checkpointing_saves_less():
    layers = list(MLP([32] * 9, activation=nn.GELU, seed=0))
    x = torch.randn(16, 32, requires_grad=True)
    plain = mm.measure_saved_activation_bytes(lambda t: ac.plain_sequential(layers, t), x)
    ck = mm.measure_saved_activation_bytes(lambda t: ac.checkpointed_sequential(layers, 3, t), x)
    assert ck == 3 * x.numel() * 4
    assert ck < plain


def _gelu_chain(n_layers, width, seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(n_layers)]


def test_plain_peak_is_every_layers_saved_bytes():
    layers = _gelu_chain(6, 32)
    x = torch.randn(8, 32, requires_grad=True)
    peak = ac.peak_saved_bytes(lambda t: ac.plain_sequential(layers, t), x)
    # each layer keeps its Linear's input and its GELU's input, 8 x 32 float32 each; no weights
    assert peak == mm.measure_saved_activation_bytes(lambda t: ac.plain_sequential(layers, t), x) == 6 * 2 * 8 * 32 * 4


@pytest.mark.parametrize(("n_layers", "segments"), [(16, 4), (16, 1), (16, 16), (10, 3), (9, 2)])
def test_checkpointed_peak_counts_the_recomputation_and_follows_the_model(n_layers, segments):
    layers = _gelu_chain(n_layers, 32)
    x = torch.randn(8, 32, requires_grad=True)
    input_bytes = x.numel() * 4
    layer_bytes = mm.measure_saved_activation_bytes(lambda t: ac.plain_sequential(layers, t), x) / n_layers
    measured = ac.peak_saved_bytes(lambda t: ac.checkpointed_sequential(layers, segments, t), x)
    kept_after_forward = mm.measure_saved_activation_bytes(lambda t: ac.checkpointed_sequential(layers, segments, t), x)
    model = ac.peak_activation_model(n_layers, layer_bytes, input_bytes, segments)
    longest = max(e - s for s, e in ac.segment_bounds(n_layers, segments))
    # the recomputed segment is counted: the longest one is live at once, above what the forward keeps
    assert measured >= longest * layer_bytes and measured > kept_after_forward
    # the model counts the recomputed segment's input twice (kept, and saved by its first Linear)
    # and assumes the longest segment is recomputed while every input is kept; it is the first
    # segment, recomputed last: at most one input and one layer above the measurement
    assert model - input_bytes - layer_bytes <= measured <= model - input_bytes
    if n_layers % segments == 0:
        assert measured == model - input_bytes
    plain = ac.peak_saved_bytes(lambda t: ac.plain_sequential(layers, t), x)
    assert measured < plain if segments > 1 else measured == plain  # one segment: all recomputed at once


def test_peak_saved_bytes_does_not_count_a_parameter_view():
    w = nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    # x @ w.t() saves x and the view w.t(); only x is an activation
    assert ac.peak_saved_bytes(lambda t: t @ w.t(), x) == 4 * 16 * 4
    assert ac.peak_saved_bytes(lambda t: checkpoint(lambda u: torch.tanh(u @ w.t()), t, use_reentrant=False), x) \
        == 4 * 16 * 4 + 4 * 16 * 4  # recomputed: x (the kept input, once) and tanh's output


def test_peak_model_and_best():
    assert ac.peak_activation_model(16, 4, 1, None) == 64
    assert ac.peak_activation_model(16, 4, 1, 4) == 4 + 16
    assert ac.peak_activation_model(10, 2, 1, 3) == 3 + 8
    assert ac.best_segments(16, 4, 1, 64) == 0
    s = ac.best_segments(16, 4, 1, 30)
    assert ac.peak_activation_model(16, 4, 1, s) == min(ac.peak_activation_model(16, 4, 1, t) for t in range(1, 17))
    with pytest.raises(ValueError):
        ac.best_segments(16, 4, 1, 5)
    assert ac.sqrt_segments(16) == 4


def test_fit_plan():
    assert ac.fit_plan(16, 4, 1, 8, 1e9) == (1, 0)
    k, s = ac.fit_plan(16, 4, 1, 8, 8 * 20)
    assert k == 1 and s > 0
    k, s = ac.fit_plan(16, 4, 1, 8, 2 * 20)
    assert k == 4
    with pytest.raises(ValueError):
        ac.fit_plan(16, 4, 1, 8, 1)


def test_saved_bytes_of_a_micro_batch_follow_its_size():
    model = MLP([8, 32, 4], seed=0)
    x = torch.randn(16, 8)
    (quarter,) = ac.split_micro_batches((x,), 4)[0]
    # a copy, so that the count holds the micro-batch and not the whole batch its slice views
    assert mm.measure_saved_activation_bytes(model, quarter.clone()) * 4 == mm.measure_saved_activation_bytes(model, x)


def test_sum_reduction():
    model = MLP([6, 8, 3], seed=4)
    batch = _batch(5)
    loss = lambda o, t: nn.functional.cross_entropy(o, t, reduction="sum")  # noqa: E731
    full = ac.full_batch_gradients(model, loss, batch)
    acc = ac.accumulated_gradients(model, loss, batch, 4, reduction="sum")
    for a, f in zip(acc, full):
        torch.testing.assert_close(a, f)
    with pytest.raises(ValueError):
        ac.accumulated_gradients(model, loss, batch, 4, reduction="max")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_saved_bytes_on_cuda_equals_the_cpus_and_stays_under_the_allocators():
    layers_cpu = _gelu_chain(8, 64)
    layers = [copy.deepcopy(m).cuda() for m in layers_cpu]
    x = torch.randn(16, 64, requires_grad=True)
    x_cuda = x.detach().cuda().requires_grad_(True)
    for segments in (1, 2, 3, 8):
        on_cpu = ac.peak_saved_bytes(functools.partial(ac.checkpointed_sequential, layers_cpu, segments), x)
        on_gpu = ac.peak_saved_bytes(functools.partial(ac.checkpointed_sequential, layers, segments), x_cuda)
        assert on_gpu == on_cpu, (segments, on_gpu, on_cpu)
        assert on_gpu <= ac.cuda_peak_bytes(functools.partial(ac.checkpointed_sequential, layers, segments), x_cuda)
