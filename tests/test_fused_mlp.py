"""The capstone's fused MLP: GELU in the epilogues of its matmuls (interpreter tier on CPU, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib import env, models
from course_lib.kernels import fused_mlp as fm


def _params(d: int, d_ff: int, dtype: torch.dtype, device: str, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(d_ff, d), (d_ff,), (d, d_ff), (d,)]
    return [(torch.randn(s, generator=gen) / s[-1] ** 0.5).to(device, dtype).requires_grad_() for s in shapes]


def _reference(x, fc_w, fc_b, proj_w, proj_b):
    return F.linear(F.gelu(F.linear(x, fc_w, fc_b)), proj_w, proj_b)


def _check_mlp(shape, d_ff, dtype, device, rtol, atol):
    d = shape[-1]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device, dtype).requires_grad_()
    params = _params(d, d_ff, dtype, device)
    ref_inputs = [t.detach().double().requires_grad_() for t in (x, *params)]
    want = _reference(*ref_inputs)
    got = fm.fused_mlp(x, *params)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol, msg=lambda m: f"forward: {m}")
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    got.backward(dy)
    want.backward(dy.double())
    for name, mine, ref in zip(["x", "fc.weight", "fc.bias", "proj.weight", "proj.bias"], (x, *params), ref_inputs):
        scale = ref.grad.abs().max().item()
        torch.testing.assert_close(mine.grad.double(), ref.grad, rtol=rtol, atol=atol * max(scale, 1.0),
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
@pytest.mark.parametrize("shape, d_ff", [((2, 5, 16), 48), ((37, 29), 45), ((1, 1, 8), 8)])
def test_fused_mlp_matches_unfused_fp32(shape, d_ff):
    # Ragged sizes: rows, hidden width and K that are not multiples of the 32-wide tiles.
    _check_mlp(shape, d_ff, torch.float32, "cpu", rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
def test_bf16_runs_in_fp32_under_the_interpreter():
    x = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(1))
    params = [p.detach() for p in _params(16, 32, torch.float32, "cpu")]
    got = fm.fused_mlp(x.bfloat16(), *(p.bfloat16() for p in params))
    assert got.dtype == torch.bfloat16
    want = _reference(x.bfloat16().float(), *(p.bfloat16().float() for p in params))
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
def test_each_kernel_alone_fp32():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(33, 20, generator=gen), torch.randn(40, 20, generator=gen), torch.randn(40, generator=gen)
    g, h = fm.gemm_bias_gelu(x, w, b)
    torch.testing.assert_close(h, x @ w.t() + b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g, F.gelu(x @ w.t() + b), rtol=1e-4, atol=1e-5)
    dy, w2 = torch.randn(33, 12, generator=gen), torch.randn(12, 40, generator=gen)
    z = h.clone().requires_grad_()
    F.gelu(z).backward(dy @ w2)
    torch.testing.assert_close(fm.gemm_gelu_backward(dy, w2, h), z.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
def test_bad_inputs_are_refused():
    x, (fc_w, fc_b, proj_w, proj_b) = torch.randn(4, 8), _params(8, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="must match fc_weight"):
        fm.fused_mlp(torch.randn(4, 7), fc_w, fc_b, proj_w, proj_b)
    with pytest.raises(ValueError, match="bias must be"):
        fm.gemm_bias_gelu(x, fc_w.detach(), fc_b.detach()[:15])
    with pytest.raises(ValueError, match="fp32 matmuls only"):
        fm.gemm_bias_gelu(x.bfloat16(), fc_w.detach().bfloat16(), fc_b.detach().bfloat16())
    with pytest.raises(ValueError, match="biases"):
        fm.FusedFeedForward(models.FeedForward(models.GPTConfig(d_model=8, n_head=2, n_layer=1, bias=False)))


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
def test_fused_feed_forward_keeps_the_modules_and_compiles_whole():
    # The fitted erfc is good to about 1e-4 relative, hence the tolerances.
    torch.manual_seed(0)
    cfg = models.GPTConfig(d_model=16, n_head=2, n_layer=1)
    mlp = models.FeedForward(cfg)
    fused = fm.FusedFeedForward(mlp)
    assert dict(fused.named_parameters()).keys() == dict(mlp.named_parameters()).keys()
    assert all(a is b for a, b in zip(fused.parameters(), mlp.parameters()))
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(fused(x), mlp(x), rtol=1e-3, atol=1e-4)
    # The custom op traces as one node: aot_eager runs its fake and autograd registrations.
    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    compiled(xs[0]).sum().backward()
    mlp(xs[1]).sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, d_ff", [((4, 256, 768), 3072), ((3, 77, 96), 200)])
def test_fused_mlp_bf16_gpu(shape, d_ff):
    _check_mlp(shape, d_ff, torch.bfloat16, "cuda", rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_fused_feed_forward_under_autocast_gpu():
    cfg = models.GPTConfig(d_model=128, n_head=2, n_layer=1)
    mlp = models.FeedForward(cfg).cuda()
    fused = fm.FusedFeedForward(mlp)
    x = torch.randn(4, 64, 128, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, want = fused(x), mlp(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_capstone_compiled_with_the_fused_mlp_gpu():
    # torch.compile around the custom ops, bf16 weights: the same losses as the unfused MLP within bf16.
    import dataclasses

    from course_lib import capstone

    run = capstone.RunConfig("tiny", steps=3, batch_size=4, warmup=1, lr=3e-3, fused_loss=True, bf16_weights=True)
    plain = capstone.train(run, progress=False)
    fused = capstone.train(dataclasses.replace(run, fused_mlp=True), progress=False)
    assert fused.extra["fused_mlp"] is True
    assert fused.losses == pytest.approx(plain.losses, rel=2e-2)
