"""Chapter 10: the pure-PyTorch attention references, the FlashAttention Triton kernels, their probes and benchmark.

CPU tier: the references against torch SDPA, the kernels under Triton's interpreter in fp32 on
tiny shapes, the probes the chapter's tests use on the student's kernels (written? which course
kernels called? which tiles computed and masked?), the GPU benchmark's plumbing with stand-ins.
GPU tier (marked gpu): compiled kernels in fp16/bf16/fp32 against SDPA, autotuned and launched with
the fixed configurations of the chapter's exercises.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib import env  # sets TRITON_INTERPRET=1 without a GPU; must precede triton

# isort: split
import triton
import triton.language as tl

from course_lib import attention as att
from course_lib.kernels import flash_attention as fa
from course_lib.kernels.probes import course_kernels_called, is_written, tile_census


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


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
@pytest.mark.parametrize("causal", [False, True])
def test_dkdv_and_dq_from_lse_and_delta(causal):
    q, k, v = _qkv((1, 2, 40, 16))
    dout = torch.randn_like(q)
    _, *ref = _grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), q, k, v, dout)
    out, lse = fa.flash_attention_forward(q, k, v, causal)
    delta = (dout * out).sum(-1)
    dk, dv = fa.flash_attention_dkdv(q, k, v, dout, lse, delta, causal)
    dq = fa.flash_attention_dq(q, k, v, dout, lse, delta, causal)
    for got, want in zip((dq, dk, dv), ref):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    with pytest.raises(ValueError, match="delta must be float32 of shape"):
        fa.flash_attention_dkdv(q, k, v, dout, lse, delta[..., None], causal)
    with pytest.raises(ValueError, match="lse must be float32"):
        fa.flash_attention_dq(q, k, v, dout, lse.double(), delta, causal)


def test_launch_config():
    if env.INTERPRET:
        assert fa.launch_config("forward", torch.bfloat16) == (fa.INTERPRETER_BLOCK, fa.INTERPRETER_BLOCK, 1, 1)
    else:
        assert fa.launch_config("forward", torch.bfloat16) == (128, 64, 8, 3)
        assert fa.launch_config("dkdv", torch.float32) == (16, 32, 4, 1)


# ---------------------------------------------------------------- probes of a student's kernel


@triton.jit
def _blank_kernel(X):
    raise NotImplementedError()


@triton.jit
def _helper_calling_the_library(acc, m_i, l_i, q, k, v, qk_scale):
    return fa.attention_step(acc, m_i, l_i, q, k, v, qk_scale, None)


@triton.jit
def _kernel_through_a_helper(X):
    tl.store(X, _helper_calling_the_library(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0)[0])


def test_is_written_and_course_kernels_called():
    assert not is_written(_blank_kernel) and is_written(fa.attention_step)
    assert course_kernels_called(_blank_kernel) == []
    assert course_kernels_called(_kernel_through_a_helper) == ["course_lib.kernels.flash_attention.attention_step"]
    assert course_kernels_called(fa.flash_forward_kernel) == ["course_lib.kernels.flash_attention._fwd_blocks"]
    with pytest.raises(TypeError, match="not a @triton.jit function"):
        is_written(len)


@pytest.mark.skipif(not env.INTERPRET, reason="the census watches the interpreter")
@pytest.mark.parametrize("causal", [False, True])
def test_tile_census_sees_skipped_and_masked_tiles(causal):
    q, k, v = _qkv((1, 1, 40, 32))
    with tile_census(32, (16, 16)) as programs:
        _, lse = fa.flash_attention_forward(q, k, v, causal)
    forward = sorted((p.tiles, p.masked) for p in programs)
    # three query blocks; causal: 1, 2, 3 tiles with the diagonal one masked; else 3 each, the ragged one masked
    assert forward == ([(1, 1), (2, 1), (3, 1)] if causal else [(3, 1)] * 3)
    with tile_census(32, (16, 16), dots_per_tile=2) as programs:
        fa.flash_attention_dkdv(q, k, v, torch.randn_like(q), lse, torch.zeros_like(lse), causal)
    backward = sorted((p.tiles, p.masked) for p in programs)
    assert backward == ([(1, 1), (2, 1), (3, 1)] if causal else [(3, 0)] * 3)
    assert [p.program for p in programs] == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]


@pytest.mark.skipif(env.INTERPRET, reason="compiled Triton")
def test_tile_census_refuses_compiled_kernels():
    with pytest.raises(RuntimeError, match="interpreter"), tile_census(64, (16, 16)):
        pass


# ---------------------------------------------------------------- the GPU table's benchmark, on stand-ins


def test_attention_benchmark_sweep_records_rates_and_errors():
    from benchmarks import attention as bench

    def naive(q, k, v, causal):
        return att.naive_attention(q, k, v, causal)

    def broken(q, k, v, causal):
        raise RuntimeError("no kernel\nhere")

    impls = {"math": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
             "naive": naive, "off by one": lambda q, k, v, causal: naive(q, k, v, causal) + 1, "broken": broken}
    config = {"batch": 1, "heads": 2, "head_dim": 16, "seq_lens": [8, 16]}
    host_times = iter([0.1, 0.7] * 16)  # forward then forward + backward: the second above the GPU's 0.5 ms
    result = bench.sweep(impls, config, lambda fn, grads: (fn(), 0.5)[1], device="cpu", dtype=torch.float32,
                         host=lambda fn, grads: (fn(), next(host_times))[1])
    rows = {(r["implementation"], r["causal"], r["seq"]): r for r in result["rows"]}
    assert len(rows) == 4 * 2 * 2 and result["implementations"] == list(impls) and result["dtype"] == "float32"
    ok = rows[("naive", True, 16)]
    flops = bench.attention_flops(1, 2, 16, 16, True)
    assert ok["error"] is None and ok["forward_ms"] == 0.5
    assert (ok["forward_host_ms"], ok["train_host_ms"]) == (0.1, 0.7) and result["host_timing"]
    assert not bench.host_bound(ok, "forward") and bench.host_bound(ok, "train")
    assert not bench.host_bound(rows[("broken", True, 8)], "train"), "a failed row is bound by nothing"
    untimed = bench.sweep({"naive": naive}, config, lambda fn, grads: 0.5, device="cpu", dtype=torch.float32)
    assert "forward_host_ms" not in untimed["rows"][0] and untimed["host_timing"] is None
    assert ok["forward_tflops"] == pytest.approx(flops / 0.5e-3 / 1e12)
    assert ok["train_tflops"] == pytest.approx(3.5 * flops / 0.5e-3 / 1e12)
    assert "differs from math's" in rows[("off by one", False, 8)]["error"]
    assert rows[("broken", True, 8)]["error"] == "RuntimeError: no kernel here"


# ---------------------------------------------------------------- errors


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


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_fixed_configurations_of_the_exercises_gpu(causal):
    # The chapter's exercises launch flash_forward_kernel (with STEP, a @triton.jit function passed as a
    # constexpr) and dkdv_kernel with launch_config's tiles, not autotuned: the same kernels must hold there.
    b, h, n, d = 2, 4, 1000, 128
    q, k, v = _qkv((b, h, n, d), torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    _, lse_ref = fa.flash_attention_forward(q, k, v, causal)
    out, lse = torch.empty_like(q), torch.empty_like(lse_ref)
    block_m, block_n, warps, stages = fa.launch_config("forward", q.dtype)
    scale = 1 / math.sqrt(d)
    fa.flash_forward_kernel[(triton.cdiv(n, block_m), b * h)](
        q, k, v, out, lse, scale * fa.LOG2E, n, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
        STEP=fa.attention_step, num_warps=warps, num_stages=stages)
    ref = _grads(lambda a, c, e: F.scaled_dot_product_attention(a.float(), c.float(), e.float(), is_causal=causal),
                 q, k, v, dout.float())
    torch.testing.assert_close(out.float(), ref[0], rtol=4e-2, atol=4e-2)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-3, atol=1e-3)
    delta = (dout.float() * out.float()).sum(-1)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    block_m, block_n, warps, stages = fa.launch_config("dkdv", q.dtype)
    fa.dkdv_kernel[(triton.cdiv(n, block_n), b * h)](
        q, k, v, dout, dk, dv, lse, delta, scale * fa.LOG2E, scale, n, HEAD_DIM=d, BLOCK_M=block_m,
        BLOCK_N=block_n, CAUSAL=causal, num_warps=warps, num_stages=stages)
    for got, want in ((dk, ref[2]), (dv, ref[3])):
        torch.testing.assert_close(got.float(), want.float(), rtol=4e-2, atol=4e-2)
        assert (got.float() - want.float()).norm() / want.float().norm() < 1e-2
