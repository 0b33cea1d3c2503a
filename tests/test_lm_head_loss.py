"""Tests of course_lib.lm_head_loss: tiny shapes under Triton's interpreter on CPU, GPT-2-small sizes on a GPU."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from course_lib import capstone, env
from course_lib.exercises.checks import assert_close
from course_lib.kernels import fusion
from course_lib.lm_head_loss import LOGITS_CHUNK_BYTES, default_chunk_rows, linear_cross_entropy

DEV = env.DEVICE


def _inputs(n, vocab, d, *, ignored=(), ignore_index=-100, seed=0, device=DEV, lead=None):
    """hidden (n, d) (or ``lead`` + (d,)), weight (vocab, d), targets with the rows ``ignored`` set to ``ignore_index``."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen)
    weight = torch.randn(vocab, d, generator=gen) / math.sqrt(d) * 3  # logits of a few units: a peaked softmax
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[list(ignored)] = ignore_index
    if lead is not None:
        hidden, targets = hidden.reshape(*lead, d), targets.reshape(lead)
    return hidden.to(device), weight.to(device), targets.to(device)


def _fused(hidden, weight, targets, grad=1.0, **kwargs):
    """(loss, dhidden, dweight) of linear_cross_entropy, backward from ``grad * loss``."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, targets, **kwargs)
    (grad * loss).backward()
    return loss.detach(), h.grad, w.grad


def _reference(hidden, weight, targets, grad=1.0, ignore_index=-100):
    """The same through F.linear and F.cross_entropy: the whole (n, vocab) logits."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = F.linear(h, w)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)
    (grad * loss).backward()
    return loss.detach(), h.grad, w.grad


def _check_fp32(hidden, weight, targets, *, grad=1.0, ignore_index=-100, chunk_rows=None, what=""):
    mine = _fused(hidden, weight, targets, grad, ignore_index=ignore_index, chunk_rows=chunk_rows)
    want = _reference(hidden, weight, targets, grad, ignore_index)
    for name, a, b in zip(("loss", "dhidden", "dweight"), mine, want):
        assert_close(a, b, rtol=1e-5, atol=1e-6, name=f"{what} {name}")


# ---- fp32: the same loss and gradients as the unfused head --------------------------------------

@pytest.mark.parametrize("n, vocab, d, chunk_rows", [
    (40, 97, 16, None),   # the default: one chunk
    (37, 150, 8, 10),     # ragged: 10 + 10 + 10 + 7
    (13, 60, 8, 1),       # one row per chunk
    (20, 300, 16, 64),    # chunk_rows > n
    (48, 64, 16, 16),     # exact multiple
])
def test_matches_unfused_fp32(n, vocab, d, chunk_rows):
    hidden, weight, targets = _inputs(n, vocab, d, ignored=(1, n - 1))
    # grad 3: the backward must scale by the incoming gradient; ignored rows: the mean is over the rows that count.
    _check_fp32(hidden, weight, targets, grad=3.0, chunk_rows=chunk_rows, what=f"n={n} vocab={vocab} chunk_rows={chunk_rows}")


def test_ignored_rows_whole_chunk_and_other_ignore_index():
    ignored = (4, 5, 6, 7, 10)  # rows 4-7: the second chunk is ignored whole
    hidden, weight, targets = _inputs(12, 80, 8, ignored=ignored, ignore_index=3)
    targets[torch.tensor([0, 1], device=DEV)] = torch.tensor([4, 2], device=DEV)  # classes next to ignore_index count
    _check_fp32(hidden, weight, targets, grad=-0.5, ignore_index=3, chunk_rows=4, what="ignore_index=3")
    loss, dh, _ = _fused(hidden, weight, targets, ignore_index=3, chunk_rows=4)
    assert not dh[list(ignored)].any(), "ignored rows must get no gradient"


def test_all_rows_ignored_is_nan_like_torch():
    hidden, weight, targets = _inputs(10, 40, 8, ignored=range(10))
    loss, dh, dw = _fused(hidden, weight, targets, chunk_rows=3)
    ref_loss, ref_dh, ref_dw = _reference(hidden, weight, targets)
    assert torch.isnan(loss) and torch.isnan(ref_loss)
    assert_close(dh, ref_dh, rtol=0, atol=0, name="dhidden")  # zeros, as torch gives
    assert_close(dw, ref_dw, rtol=0, atol=0, name="dweight")


def test_out_of_range_target_makes_the_loss_nan():
    hidden, weight, targets = _inputs(10, 40, 8)
    targets[3] = 40  # one past the vocabulary: no column to read
    loss, dh, _ = _fused(hidden, weight, targets, chunk_rows=4)
    assert torch.isnan(loss), f"a target outside the vocabulary must make the loss NaN, got {loss}"
    assert torch.isnan(dh[3]).all() and torch.isfinite(dh[torch.arange(10, device=DEV) != 3]).all()


def test_batch_time_input():
    hidden, weight, targets = _inputs(24, 70, 8, ignored=(5,), lead=(3, 8))
    loss, dh, dw = _fused(hidden, weight, targets, grad=2.0, chunk_rows=5)
    assert dh.shape == hidden.shape and dw.shape == weight.shape
    _check_fp32(hidden, weight, targets, grad=2.0, chunk_rows=5, what="(batch, time, d)")


def test_only_the_inputs_that_need_a_gradient_get_one():
    hidden, weight, targets = _inputs(11, 40, 8, ignored=(2,))
    want = _reference(hidden, weight, targets)
    w = weight.clone().requires_grad_()
    linear_cross_entropy(hidden, w, targets, chunk_rows=4).backward()  # hidden needs none
    assert_close(w.grad, want[2], rtol=1e-5, atol=1e-6, name="dweight alone")
    h = hidden.clone().requires_grad_()
    linear_cross_entropy(h, weight, targets, chunk_rows=4).backward()
    assert_close(h.grad, want[1], rtol=1e-5, atol=1e-6, name="dhidden alone")
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, targets, chunk_rows=4)
    assert_close(loss, want[0], rtol=1e-5, atol=1e-6, name="loss under no_grad")
    assert loss.grad_fn is None


# ---- bf16 autocast -------------------------------------------------------------------------------

def _relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_bf16_autocast_matches_unfused_under_autocast(monkeypatch):
    hidden, weight, targets = _inputs(30, 120, 16, ignored=(0, 7))
    seen = []
    both = fusion.cross_entropy_forward_backward
    monkeypatch.setattr(fusion, "cross_entropy_forward_backward",
                        lambda logits, *args, **kwargs: seen.append(logits.dtype) or both(logits, *args, **kwargs))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, dh, dw = _fused(hidden, weight, targets, grad=3.0, chunk_rows=8)
        ref_loss, ref_dh, ref_dw = _reference(hidden, weight, targets, grad=3.0)
    assert seen and set(seen) == {torch.bfloat16}, f"the GEMM must run in autocast's bf16, the logits were {seen}"
    assert loss.dtype == torch.float32 and dh.dtype == torch.float32 and dw.dtype == torch.float32
    # The logits are the same bf16 GEMMs and the loss reads them in fp32: as close as fp32 sums of them.
    assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, name="bf16 loss")
    # Gradients: bf16 dlogits and bf16 GEMMs in both, rounded in different places: within bf16's 2**-8.
    assert _relative_error(dh, ref_dh) < 1e-2 and _relative_error(dw, ref_dw) < 1e-2
    assert _relative_error(dh, _reference(hidden, weight, targets, grad=3.0)[1]) < 2e-2  # and near the fp32 gradient


def test_bf16_inputs_without_autocast_keep_their_dtypes():
    hidden, weight, targets = _inputs(12, 40, 8)
    loss, dh, dw = _fused(hidden.bfloat16(), weight.bfloat16(), targets, chunk_rows=5)
    ref_loss, ref_dh, ref_dw = _reference(hidden.bfloat16().float(), weight.bfloat16().float(), targets)
    assert loss.dtype == torch.float32 and dh.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16
    assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2, name="bf16 loss")
    assert _relative_error(dh, ref_dh) < 2e-2 and _relative_error(dw, ref_dw) < 2e-2


# ---- memory: what is kept and what is allocated ----------------------------------------------------

def test_saves_only_the_two_gradients():
    n, vocab, d = 48, 200, 8
    hidden, weight, targets = _inputs(n, vocab, d, ignored=(3,))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = linear_cross_entropy(h, w, targets, chunk_rows=16)
    assert sorted(tuple(t.shape) for t in saved) == [(n, d), (vocab, d)], [tuple(t.shape) for t in saved]
    assert max(t.numel() for t in saved) < n * vocab
    loss.backward()


def test_no_logits_larger_than_a_chunk(monkeypatch):
    n, vocab, d, chunk = 23, 90, 8, 5
    hidden, weight, targets = _inputs(n, vocab, d, ignored=(0,))
    calls = []
    both, forward = fusion.cross_entropy_forward_backward, fusion.cross_entropy_forward

    def watch_both(logits, *args, **kwargs):
        losses, dlogits = both(logits, *args, **kwargs)
        calls.append((tuple(logits.shape), dlogits.data_ptr() == logits.data_ptr()))
        return losses, dlogits

    def no_forward_alone(*args, **kwargs):
        raise AssertionError("with gradients wanted, the loss comes from the one-launch kernel")

    monkeypatch.setattr(fusion, "cross_entropy_forward_backward", watch_both)
    monkeypatch.setattr(fusion, "cross_entropy_forward", no_forward_alone)
    _check_fp32(hidden, weight, targets, grad=1.5, chunk_rows=chunk, what="watched")
    assert [shape for shape, _ in calls] == [(5, vocab)] * 4 + [(3, vocab)], calls
    assert all(in_place for _, in_place in calls), "dlogits are written over the chunk's logits"
    monkeypatch.setattr(fusion, "cross_entropy_forward", forward)
    calls.clear()
    with torch.no_grad():  # no gradient wanted: the forward kernel alone
        linear_cross_entropy(hidden, weight, targets, chunk_rows=chunk)
    assert calls == []


def test_default_chunk_rows_bounds_the_logits():
    assert default_chunk_rows(32768, 50304, torch.bfloat16) == 8192  # 4 equal chunks of 0.77 GiB
    assert default_chunk_rows(100, 300, torch.float32) == 100
    assert default_chunk_rows(0, 300, torch.float32) == 1
    assert default_chunk_rows(7, 2**30, torch.float32) == 1  # one row is past the budget: still one row a chunk
    for n, vocab, dtype in [(32768, 50304, torch.bfloat16), (50000, 128256, torch.float32), (10**6, 1000, torch.float16)]:
        rows = default_chunk_rows(n, vocab, dtype)
        assert rows * vocab * dtype.itemsize <= LOGITS_CHUNK_BYTES < 2 * rows * vocab * dtype.itemsize, (n, vocab, rows)


def test_cross_entropy_backward_in_place_is_the_same():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 70, generator=gen).to(DEV)
    targets = torch.tensor([0, 69, -100, 5, 5, 33], device=DEV)
    _, lse = fusion.cross_entropy_forward(logits, targets, block_size=32)
    scale = torch.tensor([0.2], device=DEV)
    want = fusion.cross_entropy_backward(logits, targets, lse, scale, block_size=32)
    buffer = logits.clone()
    got = fusion.cross_entropy_backward(buffer, targets, lse, scale, block_size=32, out=buffer)
    assert got.data_ptr() == buffer.data_ptr()
    assert_close(got, want, rtol=0, atol=0, name="in-place dlogits")
    with pytest.raises(ValueError, match="out"):
        fusion.cross_entropy_backward(logits, targets, lse, scale, out=torch.empty(6, 71, device=DEV))
    wide = torch.randn(6, 140, device=DEV)
    with pytest.raises(ValueError, match="memory"):  # another view of the logits' memory
        fusion.cross_entropy_backward(wide[:, :70], targets, lse, scale, out=wide[:3].reshape(6, 70))


# ---- arguments -------------------------------------------------------------------------------------

def test_rejects_bad_arguments():
    hidden, weight, targets = _inputs(6, 20, 4)
    bad = [
        dict(hidden=hidden[0]),                                  # 1-D hidden
        dict(weight=weight[:, :3]),                              # d differs
        dict(weight=weight[None]),                               # 3-D weight
        dict(weight=weight[:0]),                                 # empty vocabulary
        dict(targets=targets[:5]),                               # one target short
        dict(targets=targets.float()),                           # probabilities are not class indices
        dict(hidden=hidden.long(), weight=weight.long()),        # integer GEMM
        dict(weight=weight.double()),                            # dtypes differ outside autocast
        dict(chunk_rows=0), dict(chunk_rows=-2), dict(chunk_rows=2.0), dict(chunk_rows=True),
    ]
    for change in bad:
        args = dict(hidden=hidden, weight=weight, targets=targets) | change
        chunk_rows = args.pop("chunk_rows", None)
        with pytest.raises(ValueError):
            linear_cross_entropy(args["hidden"], args["weight"], args["targets"], chunk_rows=chunk_rows)


def test_strided_targets_are_read_as_they_are():
    hidden, weight, targets = _inputs(8, 30, 4)
    wide = torch.stack([targets, torch.zeros_like(targets)], dim=1)[:, 0]  # stride 2
    assert wide.stride() == (2,)
    assert_close(linear_cross_entropy(hidden, weight, wide, chunk_rows=3), _reference(hidden, weight, targets)[0],
                 rtol=1e-5, atol=1e-6)


# ---- the capstone ------------------------------------------------------------------------------------

def test_capstone_fused_loss_matches_the_unfused_run():
    # The brief's run, with 2 sequences instead of 8 to keep the interpreted kernels quick.
    run = capstone.RunConfig(preset="tiny", steps=2, warmup=1, compile=False, batch_size=2, fused_loss=True)
    fused = capstone.train(run, progress=False, peak=(1e12, "test"))
    plain = capstone.train(dataclasses.replace(run, fused_loss=False), progress=False, peak=(1e12, "test"))
    assert fused.extra["fused_loss"] is True and plain.extra["fused_loss"] is False
    assert len(fused.losses) == 3
    assert math.isclose(fused.losses[0], plain.losses[0], rel_tol=1e-5)  # bf16 autocast in both
    assert all(math.isclose(a, b, rel_tol=1e-3) for a, b in zip(fused.losses, plain.losses))


def test_capstone_fused_loss_fp32_trains_the_same():
    # fp32: steps 2 and 3 follow the gradients of the fused loss, so they match only if those are right.
    run = capstone.RunConfig(preset="tiny", steps=2, warmup=1, compile=False, batch_size=2, seq_len=32, bf16=False)
    plain = capstone.train(run, progress=False, peak=(1e12, "test"))
    fused = capstone.train(dataclasses.replace(run, fused_loss=True), progress=False, peak=(1e12, "test"))
    assert plain.losses[-1] < plain.losses[0]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(fused.losses, plain.losses)), (fused.losses, plain.losses)


def test_capstone_baseline_and_cli_flag(tmp_path):
    assert capstone.RunConfig(fused_loss=True).baseline().fused_loss is False
    out = tmp_path / "c.json"
    capstone.main(["--preset", "tiny", "--steps", "1", "--seq-len", "16", "--batch-size", "2", "--fused-loss",
                   "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["optimized"]["config"]["fused_loss"] is True and data["optimized"]["extra"]["fused_loss"] is True
    assert data["baseline"]["config"]["fused_loss"] is False


# ---- GPU: GPT-2-small sizes ---------------------------------------------------------------------------

def _peak_bytes(h, w, fn):
    """Peak bytes that ``fn()``, a forward and backward pass into fresh gradients of h and w, adds to what is allocated."""
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
def test_gpt2_small_sizes_gpu():
    # 8 sequences of 1024 tokens, GPT-2 small's padded vocabulary and width, under bf16 autocast.
    n, vocab, d = 8192, 50304, 768
    hidden, weight, targets = _inputs(n, vocab, d, ignored=range(0, n, 97), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, dh, dw = _fused(hidden, weight, targets, grad=2.0)
        ref_loss, ref_dh, ref_dw = _reference(hidden, weight, targets, grad=2.0)
        # Both read bf16 logits in fp32 (a chunk's GEMM may pick another cuBLAS kernel: last-bit differences).
        assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4, name="loss")
        # Both round dlogits and the GEMM outputs to bf16, in different places: about 2**-9 relative each.
        assert _relative_error(dh, ref_dh) < 1e-2 and _relative_error(dw, ref_dw) < 1e-2
        del dh, dw, ref_dh, ref_dw
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        unfused = _peak_bytes(h, w, lambda: F.cross_entropy(F.linear(h, w), targets).backward())
        fused = _peak_bytes(h, w, lambda: linear_cross_entropy(h, w, targets).backward())
        chunked = _peak_bytes(h, w, lambda: linear_cross_entropy(h, w, targets, chunk_rows=1024).backward())
    logits_bytes = n * vocab * 2
    assert fused < unfused - logits_bytes, (fused, unfused)  # the unfused path holds several logits-sized tensors
    assert chunked < fused - logits_bytes // 2, (chunked, fused)  # 1024-row chunks: an eighth of the logits
