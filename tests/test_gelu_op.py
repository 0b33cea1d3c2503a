"""kernels.gelu_op: chapter 08's bias + GELU kernels as a custom op, and the MLP that uses them."""

import math

import pytest
import torch

from course_lib import env, models
from course_lib.kernels.gelu_op import KernelGeluFeedForward, bias_gelu_op

DEV = torch.device("cuda") if env.HAS_GPU else torch.device("cpu")


def _exact(h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    z = h.double() + bias.double()
    return 0.5 * z * torch.special.erfc(-z / math.sqrt(2.0))


def test_matches_the_exact_gelu_and_its_gradients():
    # Ragged rows and columns (5 x 3 x 37), a bias, and an upstream gradient: values and both
    # gradients against float64 autograd, within the fitted erfc's 1e-4.
    gen = torch.Generator().manual_seed(0)
    h = (3 * torch.randn(5, 3, 37, generator=gen)).to(DEV).requires_grad_()
    bias = torch.randn(37, generator=gen).to(DEV).requires_grad_()
    dy = torch.randn(5, 3, 37, generator=gen).to(DEV)
    y = bias_gelu_op(h, bias)
    y.backward(dy)
    h64, b64 = h.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    want = _exact(h64, b64)
    want.backward(dy.double())
    assert y.shape == h.shape and y.dtype == h.dtype
    torch.testing.assert_close(y.double(), want, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(h.grad.double(), h64.grad, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(bias.grad.double(), b64.grad, atol=2e-3, rtol=1e-4)  # a sum over 15 rows


def test_rejects_a_bias_that_does_not_fit():
    h = torch.zeros(4, 8, device=DEV)
    with pytest.raises(ValueError, match="bias"):
        bias_gelu_op(h, torch.zeros(7, device=DEV))
    with pytest.raises(ValueError, match="dtype"):
        bias_gelu_op(h, torch.zeros(8, device=DEV, dtype=torch.float64))


def test_the_op_passes_torch_librarys_checks():
    # Fake (meta) implementation, autograd registration and schema agree with the real op.
    h = torch.randn(6, 16, device=DEV, requires_grad=True)
    bias = torch.randn(16, device=DEV, requires_grad=True)
    torch.library.opcheck(torch.ops.training_at_speed.bias_gelu.default, (h, bias),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_feed_forward_shares_the_parameters_and_computes_the_mlp():
    cfg = models.GPTConfig(d_model=16, n_head=2, n_layer=1, vocab_size=32, seq_len=8)
    torch.manual_seed(0)
    mlp = models.FeedForward(cfg).to(DEV)
    kernel = KernelGeluFeedForward(mlp)
    assert kernel.fc is mlp.fc and kernel.proj is mlp.proj
    assert [p.data_ptr() for p in kernel.parameters()] == [p.data_ptr() for p in mlp.parameters()]
    x = torch.randn(2, 8, 16, device=DEV)
    torch.testing.assert_close(kernel(x), mlp(x), atol=1e-4, rtol=1e-4)
    kernel(x).sum().backward()
    got = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    mlp(x).sum().backward()
    for a, b in zip(got, (p.grad for p in mlp.parameters())):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
    no_bias = models.FeedForward(models.GPTConfig(d_model=16, n_head=2, n_layer=1, vocab_size=32, seq_len=8,
                                                  bias=False))
    with pytest.raises(ValueError, match="bias"):
        KernelGeluFeedForward(no_bias)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compiled_op_matches_eager_gpu(dtype):
    # torch.compile keeps the op whole: compiled and eager run the same kernels, so the same values.
    h = (4 * torch.randn(1024, 3072, device="cuda")).to(dtype).requires_grad_()
    bias = torch.randn(3072, device="cuda").to(dtype).requires_grad_()
    dy = torch.randn_like(h)
    y = torch.compile(bias_gelu_op)(h, bias)
    y.backward(dy)
    got = (y.detach(), h.grad.clone(), bias.grad.clone())
    h.grad = bias.grad = None
    y_eager = bias_gelu_op(h, bias)
    y_eager.backward(dy)
    torch.testing.assert_close(got[0], y_eager.detach(), atol=0, rtol=0)
    torch.testing.assert_close(got[1], h.grad, atol=0, rtol=0)
    torch.testing.assert_close(got[2], bias.grad, atol=0, rtol=0)
    exact = _exact(h.detach(), bias.detach())
    rel = ((y_eager.double() - exact).abs().max() / exact.abs().max()).item()  # rounding to dtype, relative
    assert rel < {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
