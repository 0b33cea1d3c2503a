"""Tests of course_lib.kernels.fusion: tiny fp32 shapes under the interpreter on CPU, real shapes and dtypes on a GPU."""

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib import env
from course_lib.exercises.checks import assert_close
from course_lib.kernels import fusion

DEV = env.DEVICE
GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Forward and gradient tolerances per dtype (outputs are rounded to the dtype; torch computes in fp32 too).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def _rand(*shape, dtype=torch.float32, device=DEV, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _check_bias_gelu(shape, dtype, device):
    rtol, atol = TOL[dtype]
    x, b = _rand(*shape, dtype=dtype, device=device), _rand(shape[-1], dtype=dtype, device=device, seed=1)
    dy = _rand(*shape, dtype=dtype, device=device, seed=2)
    xa, ba = x.clone().requires_grad_(), b.clone().requires_grad_()
    y = fusion.bias_gelu(xa, ba)
    y.backward(dy)
    # Reference in fp32, rounded to the dtype at the end (what the kernel does).
    xr, br = x.float().requires_grad_(), b.float().requires_grad_()
    yr = F.gelu(xr + br)
    yr.backward(dy.float())
    assert_close(y, yr.to(dtype), rtol=rtol, atol=atol, name="bias_gelu")
    assert_close(xa.grad, xr.grad.to(dtype), rtol=rtol, atol=atol, name="bias_gelu dx")
    rows = max(1, x.numel() // shape[-1])
    assert_close(ba.grad, br.grad.to(dtype), rtol=rtol, atol=atol * rows ** 0.5, name="bias_gelu dbias")


# The fitted erfc's error bound (course_lib.erfc) and half an ulp of each dtype, relative.
FAST_ERF_REL = 1.2e-4
HALF_ULP = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _exact_gelu(z):
    """GELU and its derivative in float64 through erfc, which keeps its relative accuracy in the negative tail."""
    cdf = 0.5 * torch.special.erfc(-z / math.sqrt(2.0))
    return z * cdf, cdf + z * torch.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def _check_fast_gelu(shape, dtype, device, scale=4.0):
    """bias_gelu(fast_erf=True) against float64: output within the fit's relative error plus the dtype's rounding."""
    x = _rand(*shape, dtype=dtype, device=device, scale=scale)
    b = _rand(shape[-1], dtype=dtype, device=device, seed=1)
    xa, ba = x.clone().requires_grad_(), b.clone().requires_grad_()
    y = fusion.bias_gelu(xa, ba, fast_erf=True)
    y.backward(torch.ones_like(y))
    z = (x.float() + b.float()).double()  # the kernel adds in fp32
    want, slope = _exact_gelu(z)
    tiny = torch.finfo(dtype).tiny
    bound = (FAST_ERF_REL + HALF_ULP[dtype]) * want.abs() + tiny
    worst = ((y.double() - want).abs() / bound).max().item()
    assert worst <= 1.0, f"fast GELU off by {worst:.2f}x its bound (fit error {FAST_ERF_REL} + half an ulp)"
    # The derivative: the fit's error is relative to Phi, at most ~1e-4 absolute, then the dtype's rounding.
    grad_bound = 1.1e-4 + HALF_ULP[dtype] * slope.abs() + tiny
    worst = ((xa.grad.double() - slope).abs() / grad_bound).max().item()
    assert worst <= 1.0, f"fast GELU's dx off by {worst:.2f}x its bound"


def _check_softmax(shape, dtype, device, block_size=None):
    rtol, atol = TOL[dtype]
    x = _rand(*shape, dtype=dtype, device=device, scale=3.0)
    dy = _rand(*shape, dtype=dtype, device=device, seed=2)
    xa = x.clone().requires_grad_()
    y = fusion.softmax(xa, block_size=block_size)
    y.backward(dy)
    xr = x.float().requires_grad_()
    yr = torch.softmax(xr, dim=-1)
    yr.backward(dy.float())
    assert_close(y, yr.to(dtype), rtol=rtol, atol=atol, name=f"softmax{shape} block_size={block_size}")
    assert_close(xa.grad, xr.grad.to(dtype), rtol=rtol, atol=atol, name=f"softmax{shape} dx")


def _check_flat_adam(decoupled, weight_decay, shapes, device, steps=20, atol=1e-6):
    torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = [_rand(*s, device=device, seed=i).requires_grad_() for i, s in enumerate(shapes)]
    mine = [p.detach().clone().requires_grad_() for p in ref]
    opt_ref = torch_cls(ref, lr=1e-2, weight_decay=weight_decay)
    opt_mine = fusion.FlatAdam(mine, lr=1e-2, weight_decay=weight_decay, decoupled=decoupled)
    for step in range(steps):
        for i, (a, b) in enumerate(zip(ref, mine)):
            g = _rand(*a.shape, device=device, seed=100 * step + i)
            a.grad = g.clone()
            b.grad.copy_(g)  # stays a view of the flat buffer
        opt_ref.step()
        opt_mine.step()
    for i, (a, b) in enumerate(zip(ref, mine)):
        assert_close(b.detach(), a.detach(), rtol=1e-5, atol=atol, name=f"{torch_cls.__name__} parameter {i}")


# ---- interpreter (CPU) and any device: fp32, tiny shapes -----------------------------------

@pytest.mark.parametrize("shape", [(1,), (37,), (5, 33), (2, 3, 7)])
def test_add(shape):
    x, y = _rand(*shape), _rand(*shape, seed=1)
    assert_close(fusion.add(x, y), x + y)
    assert_close(fusion.add(x, y, block_size=16), x + y)


def test_add_rejects_mismatch():
    with pytest.raises(ValueError):
        fusion.add(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError):
        fusion.add(torch.zeros(4, 4).t(), torch.zeros(4, 4))


@pytest.mark.parametrize("shape", [(7,), (5, 33), (3, 4, 20), (70, 3)])
def test_bias_gelu_fp32(shape):
    _check_bias_gelu(shape, torch.float32, DEV)


@pytest.mark.parametrize("shape", [(7,), (5, 33), (70, 3)])
def test_bias_gelu_fast_erf_fp32(shape):
    _check_fast_gelu(shape, torch.float32, DEV)


def test_fast_erf_keeps_the_negative_tail_that_the_exact_formula_cancels():
    """Far left, 1 + erf(z / sqrt 2) in fp32 loses Phi(z) to cancellation; the fitted erfc keeps its digits."""
    x, b = torch.tensor([[-4.0, -5.5, -6.0, -7.0]]), torch.zeros(4)
    want, _ = _exact_gelu(x.double())
    fast = (fusion.bias_gelu(x, b, fast_erf=True).double() - want).abs() / want.abs()
    exact = (fusion.bias_gelu(x, b).double() - want).abs() / want.abs()
    assert fast.max() < FAST_ERF_REL, fast
    assert exact.max() > 1e-2, exact  # if this fails, the lesson's claim about the exact formula is wrong


def test_bias_gelu_rejects_bad_bias():
    with pytest.raises(ValueError):
        fusion.bias_gelu(torch.zeros(3, 4), torch.zeros(3))


def test_bias_gelu_tiles_keep_offsets_within_32_bits():
    # Offsets inside a tile are 32-bit (one 64-bit base per tile): BLOCK_M rows of a row length must stay below 2**31.
    for n_rows, n_cols in [(8192, 8192), (1, 2**30), (3, 37), (2**20, 1024)]:
        block_m, block_n = fusion._bias_gelu_blocks(n_rows, n_cols)
        assert block_m * n_cols < 2**31 and block_n <= 1024 and block_m >= 1
    with pytest.raises(ValueError, match="32-bit offsets"):
        fusion._bias_gelu_blocks(8, 2**30)  # two rows of 2**30 per tile: 2**31


@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (2, 3, 64), (130, 5)])
def test_softmax_single_block_fp32(shape):
    _check_softmax(shape, torch.float32, DEV)


@pytest.mark.parametrize("shape, block_size", [((3, 37), 8), ((2, 64), 16), ((2, 17), 16), ((1, 100), 32)])
def test_softmax_online_fp32(shape, block_size):
    _check_softmax(shape, torch.float32, DEV, block_size=block_size)


@pytest.mark.parametrize("block_size", [None, 8])
def test_softmax_masked_and_large_values(block_size):
    x = _rand(3, 40, scale=50.0)
    x[0, :24] = -float("inf")  # whole first blocks masked out, as with an attention mask
    x[1, 5] = 1e4  # exp would overflow without subtracting the max
    assert_close(fusion.softmax(x, block_size=block_size), torch.softmax(x, dim=-1))


@pytest.mark.parametrize("shape, block_size", [((4, 37), None), ((3, 50), 16)])
def test_softmax_backward_standalone(shape, block_size):
    x = _rand(*shape).requires_grad_()
    dy = _rand(*shape, seed=1)
    y = torch.softmax(x, dim=-1)
    (expected,) = torch.autograd.grad(y, x, dy)
    assert_close(fusion.softmax_backward(y.detach(), dy, block_size=block_size), expected, atol=1e-7)


def test_softmax_and_its_backward_take_views():
    x = _rand(20, 3, scale=3.0).t()  # (3, 20), rows not packed
    wide = _rand(4, 40)[:, 5:22]  # rows of 17 with a stride of 40
    for v in (x, wide, _rand(9, 3, 2).permute(2, 1, 0)):
        assert_close(fusion.softmax(v), torch.softmax(v, dim=-1), name=f"softmax of a view {tuple(v.shape)}")
        y = torch.softmax(v, dim=-1)
        dy = _rand(*reversed(v.shape), seed=1).permute(*reversed(range(v.dim())))
        xr = v.clone().requires_grad_()
        (expected,) = torch.autograd.grad(torch.softmax(xr, dim=-1), xr, dy)
        assert_close(fusion.softmax_backward(y, dy), expected, atol=1e-7, name=f"softmax_backward of a view {tuple(v.shape)}")
        xa = v.clone().requires_grad_()
        (got,) = torch.autograd.grad(fusion.softmax(xa), xa, dy)
        assert_close(got, expected, atol=1e-7, name=f"softmax autograd with a view {tuple(v.shape)}")


def test_softmax_rejects_bad_block():
    with pytest.raises(ValueError):
        fusion.softmax(torch.zeros(2, 3), block_size=12)


@pytest.mark.parametrize("decoupled, weight_decay", [(False, 0.0), (False, 0.1), (True, 0.1)])
def test_adam_step_matches_torch(decoupled, weight_decay):
    n = 300
    p, g = _rand(n), _rand(n, seed=1)
    m, v = _rand(n, seed=2) * 0.1, _rand(n, seed=3).abs() * 0.01
    ref = p.clone().requires_grad_()
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([ref], lr=1e-2, weight_decay=weight_decay, betas=(0.8, 0.99), eps=1e-6)
    opt.state[ref] = {"step": torch.tensor(4.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    ref.grad = g.clone()
    opt.step()
    fusion.adam_step_(p, g, m, v, step=5, lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6,
                      weight_decay=weight_decay, decoupled=decoupled, block_size=128)
    assert_close(p, ref.detach(), rtol=1e-5, atol=1e-6, name="params")
    assert_close(m, opt.state[ref]["exp_avg"], name="exp_avg")
    assert_close(v, opt.state[ref]["exp_avg_sq"], name="exp_avg_sq")


def test_adam_step_rejects_bad_input():
    z = torch.zeros(4)
    with pytest.raises(ValueError):
        fusion.adam_step_(z, z.clone(), z.clone(), z.clone(), step=0, lr=1e-3)
    with pytest.raises(ValueError):
        fusion.adam_step_(z, torch.zeros(5), z.clone(), z.clone(), step=1, lr=1e-3)


@pytest.mark.parametrize("decoupled, weight_decay", [(False, 0.0), (False, 0.05), (True, 0.05)])
def test_flat_adam_matches_torch_over_20_steps(decoupled, weight_decay):
    _check_flat_adam(decoupled, weight_decay, [(4, 3), (5,), (2, 3, 2)], DEV)


def test_flat_adam_params_are_views_and_training_works():
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(DEV)
    ref_model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(DEV)
    ref_model.load_state_dict(model.state_dict())
    opt = fusion.FlatAdam(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    flat = opt.flat_groups[0]
    assert flat.flat_param.numel() == sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        assert p.untyped_storage().data_ptr() == flat.flat_param.untyped_storage().data_ptr()
        assert p.grad.untyped_storage().data_ptr() == flat.flat_grad.untyped_storage().data_ptr()
    x, y = _rand(16, 6), _rand(16, 1, seed=1)
    for step in range(5):
        for mod, o in ((model, opt), (ref_model, opt_ref)):
            o.zero_grad(set_to_none=False)
            F.mse_loss(mod(x), y).backward()
            o.step()
        if step == 2:
            model.zero_grad(set_to_none=True)  # grads replaced from outside: gathered back at the next step
            opt_ref.zero_grad(set_to_none=False)
            F.mse_loss(model(x), y).backward()
            F.mse_loss(ref_model(x), y).backward()
            opt.step()
            opt_ref.step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_flat_adam_rejects_non_fp32():
    with pytest.raises(ValueError):
        fusion.FlatAdam([torch.zeros(3, dtype=torch.float64, requires_grad=True)])


# ---- GPU: compiled kernels, real shapes, fp32 / fp16 / bf16 --------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(1000,), (1023, 4097), (4, 333, 769)])
def test_add_gpu(dtype, shape):
    x, y = _rand(*shape, dtype=dtype), _rand(*shape, dtype=dtype, seed=1)
    assert_close(fusion.add(x, y), x + y)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(8, 3), (1000, 1000), (2, 513, 3072), (4096, 1025)])
def test_bias_gelu_gpu(dtype, shape):
    _check_bias_gelu(shape, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(8, 3), (1000, 1000), (2, 513, 3072)])
def test_bias_gelu_fast_erf_gpu(dtype, shape):
    _check_fast_gelu(shape, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fast_erf, lowest", [(False, -3.5), (True, -8.0)])
def test_bias_gelu_bf16_is_faithfully_rounded_gpu(fast_erf, lowest):
    # Every bf16 z in [lowest, 8] (zero bias): each output within one bf16 ulp of the exact GELU, and
    # the correctly rounded one almost always (the fitted erfc's 1e-4 moves few roundings). The
    # library's formula, 1 + erf in fp32, cancels left of about -4, so it is held to its range.
    from benchmarks.gelu_steps import rounding

    every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    z = every[torch.isfinite(every) & (every >= lowest) & (every <= 8)]
    z = z[: z.numel() // 256 * 256].reshape(-1, 256).cuda()
    got = rounding(fusion.bias_gelu(z, torch.zeros(256, device="cuda", dtype=torch.bfloat16), fast_erf=fast_erf),
                   torch.nn.functional.gelu(z.double()))
    assert got["max_ulps"] < 0.6 and got["misrounded"] < 0.02, got


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape, block_size", [((1000, 3), None), ((513, 1000), None), ((64, 8192), None),
                                                ((7, 30000), None), ((33, 5000), 1024), ((4, 100003), None)])
def test_softmax_gpu(dtype, shape, block_size):
    _check_softmax(shape, dtype, "cuda", block_size=block_size)


@pytest.mark.gpu
@pytest.mark.parametrize("decoupled, weight_decay", [(False, 0.0), (False, 0.01), (True, 0.01)])
def test_flat_adam_gpu(decoupled, weight_decay):
    # On CUDA torch.optim takes its foreach path and the compiler contracts a*b+c into FMAs, so a
    # few of a million values end 20 steps a couple of ulps of the step apart (seen: 1.1e-6).
    _check_flat_adam(decoupled, weight_decay, [(1000, 1000), (4097,), (3, 333, 7)], "cuda", atol=5e-6)


# ---- cross-entropy -------------------------------------------------------------------------------

def _check_cross_entropy(n, vocab, *, dtype=torch.float32, device=DEV, block_size=fusion.CROSS_ENTROPY_BLOCK,
                         ignore_index=-100, ignored=(), scale=2.0, shift=0.0, grad=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=gen) * scale + shift).to(device, dtype)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[list(ignored)] = ignore_index
    targets = targets.to(device)
    mine = logits.clone().requires_grad_()
    loss = fusion.cross_entropy(mine, targets, ignore_index=ignore_index, block_size=block_size)
    (dx,) = torch.autograd.grad(loss, mine, torch.tensor(grad, device=device))
    ref = logits.double().requires_grad_()
    ref_loss = F.cross_entropy(ref, targets, ignore_index=ignore_index)
    (ref_dx,) = torch.autograd.grad(ref_loss, ref, torch.tensor(grad, dtype=torch.float64, device=device))
    what = f"cross_entropy({n}x{vocab} {dtype}, block_size={block_size}, ignored={list(ignored)})"
    assert loss.dtype == torch.float32 and dx.dtype == dtype
    assert_close(loss, ref_loss.float(), rtol=1e-5, atol=1e-5 * (1 + 3 * scale + abs(shift)), name=f"{what} loss")
    # exp(x - lse) of fp32 values near |shift| is good to about an ulp of |shift|, relatively.
    tol = dict(rtol=1e-4 + 2e-7 * abs(shift), atol=1e-7) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-6)
    assert_close(dx, ref_dx.to(dtype), name=f"{what} dlogits", **tol)


@pytest.mark.parametrize("n, vocab, block_size", [(4, 100, 64), (5, 37, 64), (3, 300, 128), (2, 1, 16), (6, 64, 64)])
def test_cross_entropy_fp32(n, vocab, block_size):
    _check_cross_entropy(n, vocab, block_size=block_size, ignored=(1,), grad=2.5)


@pytest.mark.parametrize("scale, shift", [(1000.0, 0.0), (1.0, 1e4), (1.0, -1e4)])
def test_cross_entropy_large_logits(scale, shift):
    _check_cross_entropy(3, 150, block_size=64, scale=scale, shift=shift)


def test_cross_entropy_ignore_index_is_any_class():
    _check_cross_entropy(4, 90, block_size=32, ignore_index=3, ignored=(0, 2), grad=-0.5)


def test_cross_entropy_forward_rows_and_masked_vocabulary():
    logits = _rand(3, 70, scale=3.0)
    logits[1, :40] = -float("inf")  # whole first blocks masked (a restricted vocabulary)
    targets = torch.tensor([5, 50, -100], device=DEV)
    losses, lse = fusion.cross_entropy_forward(logits, targets, block_size=16)
    assert_close(lse, torch.logsumexp(logits, dim=-1), name="lse")
    assert_close(losses, F.cross_entropy(logits, targets, reduction="none"), name="losses")


def test_cross_entropy_all_rows_ignored_is_nan_like_torch():
    logits, targets = _rand(3, 20), torch.full((3,), -100, device=DEV)
    assert torch.isnan(fusion.cross_entropy(logits, targets)) and torch.isnan(F.cross_entropy(logits, targets))


def test_cross_entropy_out_of_range_target_is_nan_and_reads_no_other_row():
    # Targets vocab and -1 would read the next row's first logit and the row before's last one.
    logits = _rand(4, 30).requires_grad_()
    targets = torch.tensor([3, 30, -1, 29], device=DEV)
    losses, _ = fusion.cross_entropy_forward(logits.detach(), targets, block_size=16)
    assert torch.isnan(losses[1:3]).all(), f"rows whose target names no column must get a NaN loss, got {losses}"
    good = torch.tensor([0, 3], device=DEV)
    assert_close(losses[good], F.cross_entropy(logits.detach()[good], targets[good], reduction="none"), name="losses")
    loss = fusion.cross_entropy(logits, targets, block_size=16)
    loss.backward()
    assert torch.isnan(loss), "one out-of-range target must make the mean NaN"
    assert torch.isnan(logits.grad[1:3]).all() and torch.isfinite(logits.grad[good]).all()


def test_cross_entropy_is_two_launches_and_saves_no_probabilities():
    from course_lib.support.launches import watch_launches

    logits, targets = _rand(4, 100).requires_grad_(), torch.tensor([1, -100, 7, 99], device=DEV)
    saved = []
    with watch_launches() as launches, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = fusion.cross_entropy(logits, targets, block_size=32)
        loss.backward()
    assert [launch.name for launch in launches] == ["_cross_entropy_fwd_kernel", "_cross_entropy_bwd_kernel"]
    assert [launch.grid for launch in launches] == [(4,), (4,)]
    assert all(launch.scalars["BLOCK"] == 32 for launch in launches)
    mine = logits.untyped_storage().data_ptr()
    assert not [t for t in saved if t.numel() >= logits.numel() and t.untyped_storage().data_ptr() != mine]


@pytest.mark.parametrize("programs", [1, 3, 7, None])
def test_cross_entropy_forward_backward_is_the_two_launches_in_one(programs):
    # Ragged vocabulary (3 blocks of 16, the last partial), an ignored row, a target past the
    # vocabulary (NaN loss and gradient row, nothing read outside the row), fewer programs than rows
    # (each program loops over rows pid, pid + programs, ...) and as many as rows.
    logits = _rand(7, 41, scale=3.0)
    logits[2, :20] = -float("inf")  # a restricted vocabulary: masked first block
    targets = torch.tensor([5, -100, 30, 40, 41, 0, 17], device=DEV)
    scale = torch.tensor([0.25], device=DEV)
    want_losses, lse = fusion.cross_entropy_forward(logits, targets, block_size=16)
    want_grad = fusion.cross_entropy_backward(logits, targets, lse, scale, block_size=16)
    losses, grad = fusion.cross_entropy_forward_backward(logits, targets, scale, block_size=16, programs=programs)
    assert_close(losses, want_losses, rtol=0, atol=0, name="losses")
    assert_close(grad, want_grad, rtol=0, atol=0, name="dlogits")
    assert torch.isnan(losses[4]) and torch.isnan(grad[4]).all() and losses[1] == 0 and (grad[1] == 0).all()
    good = torch.tensor([0, 2, 3, 5, 6], device=DEV)
    ref = logits[good].clone().requires_grad_()
    F.cross_entropy(ref, targets[good], reduction="sum").backward()
    assert_close(grad[good], 0.25 * ref.grad, name="dlogits against torch")
    in_place = logits.clone()
    losses2, grad2 = fusion.cross_entropy_forward_backward(in_place, targets, scale, block_size=16, out=in_place,
                                                           programs=programs)
    assert grad2.data_ptr() == in_place.data_ptr(), "out=logits writes the gradient over the logits"
    assert_close(losses2, want_losses, rtol=0, atol=0, name="losses, in place")
    assert_close(grad2, want_grad, rtol=0, atol=0, name="dlogits, in place")


def test_cross_entropy_forward_backward_rejects_bad_programs_and_outs():
    logits, targets, scale = _rand(3, 20), torch.tensor([1, 2, 3], device=DEV), torch.ones(1, device=DEV)
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="programs"):
            fusion.cross_entropy_forward_backward(logits, targets, scale, programs=bad)
    with pytest.raises(ValueError, match="out"):
        fusion.cross_entropy_forward_backward(logits, targets, scale, out=torch.empty(3, 21, device=DEV))


def test_cross_entropy_one_pass_benchmark_plumbing():
    from benchmarks import cross_entropy as bench

    record = bench.one_pass(6, 50, ms=lambda fn, grads: (fn(), 2.0)[1], device=DEV.type)
    assert [row["name"] for row in record["rows"]][0].startswith("two launches")
    assert len(record["rows"]) == 2 + len(bench.ONE_PASS_LAUNCHES)
    for row in record["rows"]:
        assert row["error"] is None, row
        assert row["ms"] == 2.0 and row["grad_error"] <= 1e-5
        assert row["gbps"] == pytest.approx(2 * 6 * 50 * 2 / 2e-3 / 1e9)


def test_cross_entropy_rejects_bad_input():
    with pytest.raises(ValueError):
        fusion.cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError):
        fusion.cross_entropy(torch.zeros(2, 3), torch.zeros(2))  # float targets: probabilities are not supported
    with pytest.raises(ValueError):
        fusion.cross_entropy_forward(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), block_size=24)


def test_cross_entropy_benchmark_plumbing():
    from benchmarks import cross_entropy as bench

    impls = bench.implementations("cpu")
    assert list(impls) == ["eager F.cross_entropy", "course_lib"]
    record = bench.case(8, 100, torch.float32, impls, ms=lambda fn, grads: (fn(), 1.0)[1], device=DEV.type)
    assert record["logits_bytes"] == 8 * 100 * 4 and record["fused_bytes"] == 3 * record["logits_bytes"]
    assert record["ignored_rows"] == 1
    for row in record["rows"]:
        assert row["error"] is None, row
        assert row["forward_ms"] == row["step_ms"] == 1.0 and row["grad_error"] < 1e-5


def test_cross_entropy_benchmark_needs_a_gpu():
    if env.HAS_GPU:
        pytest.skip("on a GPU the benchmark runs")
    from benchmarks import cross_entropy as bench

    with pytest.raises(SystemExit) as exc:
        bench.main([])
    assert exc.value.code == 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("n, vocab, block_size", [(64, 50257, 4096), (16, 128256, 4096), (33, 1000, 256), (8, 3, 64)])
def test_cross_entropy_gpu(dtype, n, vocab, block_size):
    _check_cross_entropy(n, vocab, dtype=dtype, device="cuda", block_size=block_size, ignored=(0, 5 % n), grad=1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 1, 16400])
def test_cross_entropy_forward_backward_gpu(programs):
    # The one-launch kernel compiled: equal to the two launches on GPT-2's vocabulary, in place, with
    # the default grid (programs per SM), one program, and one program per row.
    n, vocab = 300, 50257
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16) * 2
    targets = torch.randint(0, vocab, (n,), device="cuda")
    targets[::7] = -100
    scale = torch.tensor([1 / 257.0], device="cuda")
    want_losses, lse = fusion.cross_entropy_forward(logits, targets)
    want_grad = fusion.cross_entropy_backward(logits, targets, lse, scale)
    losses, grad = fusion.cross_entropy_forward_backward(logits, targets, scale, out=logits, programs=programs)
    assert grad.data_ptr() == logits.data_ptr()
    assert_close(losses, want_losses, rtol=1e-6, atol=1e-6, name="losses")  # the same arithmetic, compiled apart
    assert_close(grad.float(), want_grad.float(), rtol=2**-8, atol=1e-9, name="dlogits")


@pytest.mark.gpu
def test_cross_entropy_gpu_past_int32_offsets():
    # 16,400 rows x 131,072 columns in bf16: the last rows start past element 2**31.
    n, vocab = 16400, 131072
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, vocab, (n,), device="cuda")
    losses, lse = fusion.cross_entropy_forward(logits, targets)
    tail = slice(n - 8, n)
    assert_close(lse[tail], torch.logsumexp(logits[tail].float(), dim=-1), rtol=1e-5, atol=1e-4, name="lse past 2**31")
    assert_close(losses[tail], F.cross_entropy(logits[tail].float(), targets[tail], reduction="none"),
                 rtol=1e-5, atol=1e-4, name="losses past 2**31")
