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


def _token_lm(seed=0, vocab=13, width=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, vocab)).double()


def _token_micro_batches(shapes, seed=0, vocab=13, ignore_index=-100, shortest=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for rows, length in shapes:
        idx = torch.randint(vocab, (rows, length), generator=g)
        tgt = torch.randint(vocab, (rows, length), generator=g)
        real = torch.randint(shortest, length + 1, (rows, 1), generator=g)
        out.append((idx, tgt.masked_fill(torch.arange(length) >= real, ignore_index)))
    return out


@pytest.mark.parametrize("shapes", [[(4, 6), (2, 9), (3, 4)], [(6, 9)], [(1, 4)] * 6, [(3, 5), (3, 5)]])
@pytest.mark.parametrize("ignore_index", [-100, -1])
def test_accumulation_step_equals_the_big_batch_step(shapes, ignore_index):
    mbs = _token_micro_batches(shapes, ignore_index=ignore_index, shortest=0)
    m1, m2 = _token_lm(), _token_lm()
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.5), torch.optim.SGD(m2.parameters(), lr=0.5)
    loss = ac.accumulation_step(m1, o1, mbs, ignore_index)
    whole = ac.join_micro_batches(mbs, ignore_index)
    want = ac.accumulation_step(m2, o2, [whole], ignore_index)
    logits = _token_lm()(whole[0])
    mean = nn.functional.cross_entropy(logits.flatten(0, 1), whole[1].flatten(), ignore_index=ignore_index)
    assert loss == pytest.approx(want, rel=1e-12) and want == pytest.approx(mean.item(), rel=1e-12)
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        torch.testing.assert_close(p, q)


def test_a_micro_batch_of_padding_adds_nothing_and_no_target_raises():
    mbs = _token_micro_batches([(2, 6), (3, 4), (2, 5)], seed=1)
    padded = list(mbs)
    padded[1] = (mbs[1][0], torch.full_like(mbs[1][1], -100))
    grads = ac.lm_gradients(_token_lm(), padded)
    assert all(torch.isfinite(g).all() for g in grads)
    without = ac.lm_gradients(_token_lm(), [padded[0], padded[2]])
    for a, b in zip(grads, without):
        torch.testing.assert_close(a, b)
    m1, m2 = _token_lm(), _token_lm()
    with_padding = ac.accumulation_step(m1, torch.optim.SGD(m1.parameters(), lr=0.1), padded)
    assert with_padding == ac.accumulation_step(m2, torch.optim.SGD(m2.parameters(), lr=0.1), [padded[0], padded[2]])
    model = _token_lm()
    with pytest.raises(ValueError):
        ac.accumulation_step(model, torch.optim.SGD(model.parameters(), lr=0.1), [padded[1]])


def test_mean_of_micro_batch_means_is_not_the_token_mean():
    mbs = _token_micro_batches([(4, 3), (4, 12)], seed=2)
    big = ac.lm_gradients(_token_lm(), [ac.join_micro_batches(mbs)])
    tokens = ac.lm_gradients(_token_lm(), mbs)
    means = ac.lm_gradients(_token_lm(), mbs, per_micro_batch_mean=True)
    torch.testing.assert_close(tokens[0], big[0])
    assert not torch.allclose(means[0], big[0], rtol=1e-3)
    assert ac.count_targets(mbs) == sum(int((t != -100).sum()) for _, t in mbs)


def test_join_micro_batches_pads_on_the_right():
    mbs = [(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long)),
           (torch.full((2, 4), 2), torch.full((2, 4), 3))]
    idx, tgt = ac.join_micro_batches(mbs, ignore_index=-7, pad_token=9)
    assert idx.tolist() == [[1, 1, 9, 9], [2, 2, 2, 2], [2, 2, 2, 2]]
    assert tgt.tolist() == [[1, 1, -7, -7], [3, 3, 3, 3], [3, 3, 3, 3]]


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
@pytest.mark.parametrize("input_grad", [True, False])
def test_checkpointed_sequential_matches_and_leaves_the_random_stream(segments, input_grad):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.3)) for _ in range(7)]
    x = torch.randn(5, 8, requires_grad=input_grad)

    def run(fn):
        x.grad = None
        for m in layers:
            m.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        out = fn(layers, x)
        out.square().sum().backward()
        grads = ([x.grad.clone()] if input_grad else []) + [p.grad.clone() for m in layers for p in m.parameters()]
        return out.detach(), grads, torch.rand(3)

    out, g_ck, after = run(lambda ls, t: ac.checkpointed_sequential(ls, segments, t))
    ref, g_ref, after_ref = run(ac.plain_sequential)
    torch.testing.assert_close(out, ref)
    for a, b in zip(g_ck, g_ref):
        torch.testing.assert_close(a, b)
    assert torch.equal(after, after_ref), "the recomputation must not rewind the random stream"


@pytest.mark.parametrize(("n_layers", "segments"), [(7, 3), (6, 6), (5, 1)])
def test_each_segment_is_one_node_run_once_forward_and_once_again_backward(n_layers, segments):
    layers = _gelu_chain(n_layers, 8)
    calls = []
    for i, m in enumerate(layers):
        m.register_forward_pre_hook(lambda mod, args, i=i: calls.append((i, torch.is_grad_enabled())))
    out = ac.checkpointed_sequential(layers, segments, torch.randn(3, 8))
    assert out.grad_fn._forward_cls is ac.CheckpointSegment
    assert calls == [(i, False) for i in range(n_layers)]
    calls.clear()
    out.sum().backward()
    order = [i for start, end in reversed(ac.segment_bounds(n_layers, segments)) for i in range(start, end)]
    assert calls == [(i, True) for i in order]


def test_checkpointed_sequential_rejects_bad_segment_counts():
    with pytest.raises(ValueError):
        ac.checkpointed_sequential(_gelu_chain(3, 4), 4, torch.randn(2, 4))


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
    # exactly: when segment j (from 1) is recomputed, inputs 1..j are kept and its first layer saves input j
    lengths = [e - s for s, e in ac.segment_bounds(n_layers, segments)]
    assert measured == max(segments * input_bytes,
                           max((j - 1) * input_bytes + n * layer_bytes for j, n in enumerate(lengths, 1)))
    plain = ac.peak_saved_bytes(lambda t: ac.plain_sequential(layers, t), x)
    assert measured < plain if segments > 1 else measured == plain  # one segment: all recomputed at once


def test_peak_saved_bytes_does_not_count_a_parameter_view():
    w = nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    # x @ w.t() saves x and the view w.t(); only x is an activation
    assert ac.peak_saved_bytes(lambda t: t @ w.t(), x) == 4 * 16 * 4
    assert ac.peak_saved_bytes(lambda t: checkpoint(lambda u: torch.tanh(u @ w.t()), t, use_reentrant=False), x) \
        == 4 * 16 * 4 + 4 * 16 * 4  # recomputed: x (the kept input, once) and tanh's output


def test_peak_model():
    assert ac.peak_activation_model(16, 4, 1, None) == 64
    assert ac.peak_activation_model(16, 4, 1, 4) == 4 + 16
    assert ac.peak_activation_model(10, 2, 1, 3) == 3 + 8
    assert ac.sqrt_segments(16) == 4


class _Measure:
    def __init__(self, peak):
        self.peak, self.calls = peak, []

    def __call__(self, b, s):
        self.calls.append((b, s))
        return self.peak(b, s)


def _modelled(b, s):
    return ac.peak_activation_model(16, 4 * b, 1 * b, s or None)


def test_fit_plan_measures_in_order_of_preference_and_stops_at_the_first_fit():
    m = _Measure(_modelled)
    assert ac.fit_plan(m, 16, 8, 1e9) == (1, 0) and m.calls == [(8, 0)]
    m = _Measure(_modelled)
    k, s = ac.fit_plan(m, 16, 8, 8 * 20)
    assert (k, s) == (1, 4) and m.calls == [(8, s) for s in range(5)]
    m = _Measure(_modelled)
    assert ac.fit_plan(m, 16, 8, 2 * 20)[0] == 4 and {b for b, _ in m.calls} == {8, 4, 2}
    assert ac.fit_plan(_Measure(lambda b, s: 7), 3, 6, 7) == (1, 0)  # a peak equal to the budget fits
    with pytest.raises(ValueError):
        ac.fit_plan(_Measure(_modelled), 16, 8, 1)


def test_fit_plan_takes_the_fewest_segments_that_fit_not_the_smallest_peak():
    peaks = {0: 100, 1: 90, 2: 40, 3: 20}
    assert ac.fit_plan(_Measure(lambda b, s: peaks[s] * b), 3, 1, 50) == (1, 2)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checkpoint_segment_replays_the_cuda_random_state():
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.3)).cuda() for _ in range(6)]
    x = torch.randn(16, 64, device="cuda", requires_grad=True)

    def run(fn):
        x.grad = None
        for m in layers:
            m.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        fn(layers, x).square().sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for m in layers for p in m.parameters()], torch.rand(4, device="cuda")

    got, after = run(lambda ls, t: ac.checkpointed_sequential(ls, 3, t))
    want, after_ref = run(ac.plain_sequential)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert torch.equal(after, after_ref)
