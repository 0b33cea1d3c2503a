"""Chapter 10: the pure-PyTorch attention references and the FlashAttention Triton kernels.

CPU tier: the references against torch SDPA, the kernels under Triton's interpreter in fp32 on
tiny shapes. GPU tier (marked gpu): compiled kernels in fp16/bf16/fp32 against SDPA.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib import attention as att
from course_lib import env
from course_lib.kernels import flash_attention as fa


def _qkv(shape, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(3)]


def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


# ---------------------------------------------------------------- pure-PyTorch references


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_naive_and_tiled_match_sdpa(causal, n):
    q, k, v = _qkv((2, 3, n, 16), torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(att.naive_attention(q, k, v, causal), ref)
    for bq, bk in ((64, 64), (5, 3), (1, 8)):
        out, lse = att.tiled_attention(q, k, v, causal, block_q=bq, block_k=bk)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(lse, att.attention_lse(q, k, causal).double(), rtol=1e-6, atol=1e-6)


def test_scale_argument():
    q, k, v = _qkv((1, 2, 10, 16), torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(att.naive_attention(q, k, v, scale=0.3), ref)
    torch.testing.assert_close(att.tiled_attention(q, k, v, block_q=4, block_k=3, scale=0.3)[0], ref)


@pytest.mark.parametrize("block", [1, 3, 16, 100])
def test_online_softmax(block):
    x = torch.randn(4, 37, dtype=torch.float64) * 30
    x[1, :20] = float("-inf")  # a row whose first blocks are all masked
    m, s = att.online_softmax_stats(x, block)
    torch.testing.assert_close(m, x.amax(-1))
    torch.testing.assert_close(m + torch.log(s), torch.logsumexp(x, -1))
    torch.testing.assert_close(att.online_softmax(x, block), torch.softmax(x, -1))
    m, s = att.online_softmax_stats(torch.full((2, 5), float("-inf")), 2)
    assert torch.isinf(m).all() and (s == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_tiled_backward_matches_autograd(causal):
    q, k, v = _qkv((2, 2, 19, 16), torch.float64)
    dout = torch.randn_like(q)
    _, *ref = _grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), q, k, v, dout)
    out, lse = att.tiled_attention(q, k, v, causal, block_q=8, block_k=8)
    got = att.tiled_attention_backward(q, k, v, out, lse, dout, causal, block_k=5)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


def test_merge_attention_splits_keys():
    q, k, v = _qkv((2, 9, 16), torch.float64)
    full, lse = att.tiled_attention(q, k, v)
    a, la = att.tiled_attention(q, k[:, :4], v[:, :4])
    b, lb = att.tiled_attention(q, k[:, 4:], v[:, 4:])
    out, merged = att.merge_attention(a, la, b, lb)
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(merged.double(), lse.double(), rtol=1e-6, atol=1e-6)


def test_causal_tile_counts():
    assert att.causal_tile_counts(4, 1, 1) == {"full": 10, "partial": 0, "skipped": 6}
    assert att.causal_tile_counts(256, 64, 64) == {"full": 6, "partial": 4, "skipped": 6}
    assert att.causal_tile_counts(128, 128, 64) == {"full": 0, "partial": 2, "skipped": 0}
    for n, bm, bn in ((100, 16, 8), (37, 5, 7), (4096, 128, 64)):
        c = att.causal_tile_counts(n, bm, bn)
        assert sum(c.values()) == math.ceil(n / bm) * math.ceil(n / bn)
        # brute force on the mask itself
        mask = att.causal_mask(n, n)
        expect = {"full": 0, "partial": 0, "skipped": 0}
        for r in range(0, n, bm):
            for col in range(0, n, bn):
                tile = mask[r:r + bm, col:col + bn]
                expect["full" if tile.all() else "skipped" if not tile.any() else "partial"] += 1
        assert c == expect
    with pytest.raises(ValueError):
        att.causal_tile_counts(0, 16, 16)


# ---------------------------------------------------------------- Triton, interpreter or GPU


def _tolerance(dtype):
    return {torch.float32: (2e-4, 2e-4) if env.INTERPRET else (2e-2, 2e-2),  # tf32 dots on a GPU
            torch.float16: (1e-2, 1e-2), torch.bfloat16: (4e-2, 4e-2)}[dtype]


def _check_kernel(shape, dtype, causal, device, scale=None, seed=0):
    q, k, v = _qkv(shape, dtype, device, seed)
    dout = torch.randn(shape, dtype=dtype, device=device, generator=torch.Generator(device=device).manual_seed(seed + 1))
    got = _grads(lambda a, b, c: fa.flash_attention(a, b, c, causal, scale), q, k, v, dout)
    # The reference runs in fp32 (math), so its own rounding does not count against the kernel.
    ref = _grads(lambda a, b, c: F.scaled_dot_product_attention(a.float(), b.float(), c.float(), is_causal=causal,
                                                                scale=scale), q, k, v, dout.float())
    rtol, atol = _tolerance(dtype)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert g.dtype == dtype and g.shape == r.shape, name
        torch.testing.assert_close(g.float(), r.float(), rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
    _, lse = fa.flash_attention_forward(q, k, v, causal, scale)
    assert lse.dtype == torch.float32 and lse.shape == shape[:3]
    torch.testing.assert_close(lse, att.attention_lse(q, k, causal, scale), rtol=1e-3 if env.INTERPRET else 1e-2,
                               atol=1e-3 if env.INTERPRET else 1e-2)


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [16, 40])
def test_flash_attention_interpreter(causal, n):
    _check_kernel((1, 2, n, 16), torch.float32, causal, "cpu")


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
def test_flash_attention_interpreter_odd_shapes():
    _check_kernel((2, 1, 5, 32), torch.float32, True, "cpu", scale=0.2)
    # bf16 inputs are computed in fp32 under the interpreter and come back in bf16
    q, k, v = _qkv((1, 1, 20, 16), torch.bfloat16)
    out = fa.flash_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), att.naive_attention(q.float(), k.float(), v.float()), rtol=2e-2, atol=2e-2)


def test_flash_attention_rejects_bad_shapes():
    q, k, v = _qkv((1, 1, 8, 24))
    with pytest.raises(ValueError, match="head_dim"):
        fa.flash_attention(q, k, v)
    q, k, v = _qkv((1, 1, 8, 16))
    with pytest.raises(ValueError, match="shape"):
        fa.flash_attention(q, k[:, :, :4], v)


# Every (dtype, head_dim, causal) autotunes and compiles its own kernels, so the matrix is pruned:
# bf16 everywhere, fp16 and fp32 (tf32 dots, small tiles) on fewer shapes.
_GPU_CASES = (
    [(torch.bfloat16, n, d) for n in (128, 1000, 4096) for d in (64, 128)]
    + [(torch.float16, n, d) for n in (1000, 4096) for d in (64, 128)]
    + [(torch.float32, n, 64) for n in (128, 1000)]
)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, n, d", _GPU_CASES)
def test_flash_attention_gpu(dtype, n, d, causal):
    batch, heads = (2, 4) if n < 4096 else (1, 2)
    _check_kernel((batch, heads, n, d), dtype, causal, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [16, 32])
def test_flash_attention_gpu_small_head_dims(d):
    _check_kernel((2, 3, 333, d), torch.bfloat16, True, "cuda", scale=0.1)
    _check_kernel((2, 3, 333, d), torch.float16, False, "cuda")


@pytest.mark.gpu
def test_flash_attention_gpu_non_contiguous_inputs():
    # (batch, seq, heads, dim) transposed to (batch, heads, seq, dim), as attention layers produce it
    q, k, v = (t.transpose(1, 2) for t in _qkv((2, 300, 4, 64), torch.bfloat16, "cuda"))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(fa.flash_attention(q, k, v, True).float(), ref, rtol=4e-2, atol=4e-2)
