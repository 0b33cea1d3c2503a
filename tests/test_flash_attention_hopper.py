"""Chapter 10's Hopper forward: the TMA kernel against SDPA, which path runs where, and the fallback.

CPU tier: the TMA kernel under Triton's interpreter (tensor descriptors work there) in fp32 on tiny
shapes, forward, logsumexp and the gradients through the teaching backward and through the Hopper
backward; the rule that picks the TMA path and the fallback for sequences that are not a multiple
of the block.
GPU tier (marked gpu): compiled and autotuned in bf16/fp16 against SDPA on sm90+; the fallback for
ragged sequences, fp32 and older GPUs.
"""

import pytest
import torch
import torch.nn.functional as F

from course_lib import attention as att
from course_lib import env
from course_lib.kernels import flash_attention as fa
from course_lib.kernels import flash_attention_hopper as fh


def _qkv(shape, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, generator=gen, device=device, dtype=dtype) for _ in range(3)]


def _compare(shape, dtype, causal, device, tol, scale=None):
    """Output, logsumexp and the three gradients of flash_attention_tma against fp32 SDPA."""
    q, k, v = _qkv(shape, dtype, device)
    dout = torch.randn(shape, dtype=dtype, device=device, generator=torch.Generator(device=device).manual_seed(9))
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = fh.flash_attention_tma(*leaves, causal, scale)
    got = (out, *torch.autograd.grad(out, leaves, dout))
    ref_leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref_leaves, is_causal=causal, scale=scale)
    ref = (ref_out, *torch.autograd.grad(ref_out, ref_leaves, dout.float()))
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert g.dtype == dtype and g.shape == r.shape, name
        torch.testing.assert_close(g.float(), r, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")
    if fh.tma_applies(q):
        _, lse = fh.flash_attention_forward_tma(q, k, v, causal, scale)
        assert lse.dtype == torch.float32 and lse.shape == shape[:3]
        torch.testing.assert_close(lse, att.attention_lse(q.float(), k.float(), causal, scale), rtol=tol, atol=tol)


def _forbid(monkeypatch, name):
    """Make ``fa.<name>`` raise, to prove a call does not take that path."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} was called")
    monkeypatch.setattr(fa, name, refuse)


# ---------------------------------------------------------------- interpreter tier


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 64, 16), (2, 1, 32, 32)])
def test_tma_forward_interpreter(shape, causal):
    _compare(shape, torch.float32, causal, "cpu", 2e-4)


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
def test_tma_forward_scale_and_single_block():
    # One key block per head (N = the block): the causal diagonal block is the whole loop.
    _compare((1, 3, 16, 16), torch.float32, True, "cpu", 2e-4, scale=0.3)
    _compare((1, 3, 16, 16), torch.float32, False, "cpu", 2e-4, scale=0.3)


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
def test_tma_path_is_taken_where_it_applies(monkeypatch):
    q, k, v = _qkv((1, 2, 48, 16))
    assert fh.tma_applies(q)
    _forbid(monkeypatch, "flash_attention_forward")  # the teaching forward must not run
    out = fh.flash_attention_tma(q, k, v, True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=2e-4, atol=2e-4)


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
@pytest.mark.parametrize("n", [5, 40])
def test_ragged_sequences_fall_back_to_the_teaching_forward(n, monkeypatch):
    q, k, v = _qkv((1, 2, n, 16))
    assert not fh.tma_applies(q)
    with pytest.raises(ValueError, match="seq %"):
        fh.flash_attention_forward_tma(q, k, v)
    _compare((1, 2, n, 16), torch.float32, True, "cpu", 2e-4)
    _forbid(monkeypatch, "flash_attention_forward")
    with pytest.raises(AssertionError, match="flash_attention_forward was called"):
        fh.flash_attention_tma(q, k, v)


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
def test_non_contiguous_and_bf16_inputs_interpreter():
    # (batch, seq, heads, dim) transposed, as attention layers hand it over; bf16 is computed in fp32 here.
    q, k, v = (t.transpose(1, 2) for t in _qkv((1, 32, 2, 16), torch.bfloat16))
    out = fh.flash_attention_tma(q, k, v, True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_tma_applies_rules():
    assert not fh.tma_applies(torch.zeros(1, 1, 32, 24))  # head dim the kernels do not take
    assert not fh.tma_applies(torch.zeros(1, 32, 16))  # not (batch, heads, seq, head_dim)
    q, k, v = _qkv((1, 1, 8, 24))
    with pytest.raises(ValueError, match="head_dim"):
        fh.flash_attention_tma(q, k, v)


def test_autotuner_tries_one_warpgroup_tiles_only_at_small_head_dims():
    # In 4 warps a 128 x 128 fp32 accumulator of head_dim 128 spills: such configs would only slow autotuning.
    configs = fh._tma_fwd.configs
    small = fh._fitting_configs(configs, {}, HEAD_DIM=64)
    large = fh._fitting_configs(configs, {}, HEAD_DIM=128)
    assert len(small) == len(fh.TMA_CONFIGS) and any(c.num_warps == 4 for c in small)
    assert large and all(c.num_warps == 8 for c in large)


# ---------------------------------------------------------------- the steps benchmark, on stand-ins


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
def test_ceiling_kernel_computes_what_it_keeps():
    from benchmarks import flash_steps as fs

    q, k, v = _qkv((1, 2, 32, 16))
    # The full softmax is attention; with none, P is the raw scores and O = (Q K^T) V.
    torch.testing.assert_close(fs.ceiling_forward(q, k, v, 2, (16, 16, 1, 1)), F.scaled_dot_product_attention(q, k, v),
                               rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(fs.ceiling_forward(q, k, v, 0, (16, 16, 1, 1)), (q @ k.transpose(-1, -2)) @ v,
                               rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="must divide seq=32"):
        fs.ceiling_forward(q, k, v, 2)  # 128-row tiles: no program would run


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
def test_steps_benchmark_records_rates_and_errors():
    from benchmarks import flash_steps as fs

    calls = []

    def ms(fn):
        calls.append(fn())
        return 0.5

    record = fs.steps({"batch": 1, "heads": 2, "seq": 32, "head_dim": 16}, ms, device="cpu", dtype=torch.float32)
    rows = {(r["group"], r["label"], r["causal"]): r for r in record["rows"]}
    assert {g for g, _, _ in rows} == {"reference", "step", "ceiling", "backward", "backward parts"}
    assert not any(g == "ceiling" and causal for g, _, causal in rows)  # the ceilings are non-causal only
    ok = rows[("step", "TMA, autotuned (flash_attention_tma)", True)]
    assert ok["error"] is None and ok["tflops"] == pytest.approx(4 * 2 * 32 * 32 * 16 / 2 / 0.5e-3 / 1e12)
    backward = rows[("backward", "course_lib, three kernels", False)]
    assert backward["error"] is None and backward["tflops"] == pytest.approx(2.5 * 4 * 2 * 32 * 32 * 16 / 0.5e-3 / 1e12)
    # Rows that cannot run here are recorded with why: cuDNN has no CPU kernel, 128-row tiles do not divide 32.
    assert "backend" in rows[("reference", "SDPA cuDNN", False)]["error"]
    assert "must divide seq=32" in rows[("step", "TMA, 128x128, 8 warps, 3 stages", False)]["error"]
    assert "must divide seq=32" in rows[("ceiling", "+ exp2: the full online softmax", False)]["error"]
    # The autotuned rows say which tile was chosen (none here: the interpreter launches one fixed tile).
    assert [r["autotuned_config"] for r in record["rows"] if "autotuned_config" in r] == [None] * 6
    parts = [r for r in record["rows"] if r["group"] == "backward parts"]
    assert len(parts) == 8 and all("must divide seq=32" in r["error"] for r in parts)  # 2 kinds x 2 tiles x 2 masks
    assert record["matmul_tflops"] > 0 and len(calls) == sum(r["error"] is None for r in record["rows"]) + 1
    assert record["rounds"] == 1 and all(r["spread"] == 0 for r in record["rows"] if r["error"] is None)


def test_steps_benchmark_times_rows_in_interleaved_rounds():
    from benchmarks import flash_steps as fs

    order, clock = [], iter([1.0, 2.0, 4.0, 1.0, 3.0, 4.0])  # two rows, three rounds

    def ms(fn):
        order.append(fn())
        return next(clock)

    def case(name):
        return lambda: ((lambda: name), None)

    def failing():
        raise RuntimeError("does not compile")

    prepared = [fs._prepared("step", "a", False, 1e9, case("a")), fs._prepared("step", "b", False, 2e9, case("b")),
                fs._prepared("step", "c", False, 1e9, failing)]
    a, b, c = fs._timed(prepared, ms, rounds=3)
    assert order == ["a", "b", "a", "b", "a", "b"]  # every row once a round: a drift reaches both alike
    assert a["ms"] == 3.0 and a["spread"] == pytest.approx((4 - 1) / 3) and a["tflops"] == pytest.approx(1 / 3)
    assert b["ms"] == 2.0 and b["spread"] == pytest.approx((4 - 1) / 2) and b["tflops"] == pytest.approx(1.0)
    assert "does not compile" in c["error"] and "ms" not in c


def test_steps_benchmark_names_the_autotuners_choice():
    import triton

    from benchmarks import flash_steps as fs

    class Tuned:
        best_config = triton.Config({"BIG": 128, "SMALL": 64}, num_warps=8, num_stages=4)

    assert fs._autotuned(Tuned()) == "BIG 128, SMALL 64, 8 warps, 4 stages"
    assert fs._autotuned(object()) is None


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
def test_exp2_fma_is_within_its_stated_error():
    import triton
    import triton.language as tl

    @triton.jit
    def apply(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, fh.exp2_fma(tl.load(x_ptr + offs, mask=offs < n, other=0.0)), mask=offs < n)

    x = torch.cat([torch.linspace(-126, 8, 4001), torch.arange(-20.0, 9.0), torch.tensor([-127.5, -300.0])])
    y = torch.empty_like(x)
    apply[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    want = torch.exp2(x.double())
    normal = x >= -126
    relative = ((y.double() - want) / want)[normal].abs()
    assert relative.max() < 1e-4, f"worst relative error {relative.max():.2e} at x = {x[normal][relative.argmax()]}"
    assert torch.equal(y[4001:4030], torch.exp2(torch.arange(-20.0, 9.0))), "2^k for integer k must be exact"
    assert (y[-2:] < 1e-37).all() and (y[-2:] >= 0).all(), f"far below -126: about 0, got {y[-2:]}"


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lazy_rescale, poly_exp2", [(True, 0), (False, 1), (False, 2), (True, 1), (True, 2)])
@pytest.mark.parametrize("scores", ["flat", "rising"])
def test_softmax_switches_compute_the_same_attention(lazy_rescale, poly_exp2, causal, scores):
    # "flat": small scores, the running max never moves by 8 after the first block, so the stale max is
    # used throughout; "rising": every key block's scores are larger than the last's, so it moves often.
    q, k, v = _qkv((1, 2, 64, 16), seed=3)
    if scores == "flat":
        q = q * 0.1
    else:
        k = k + torch.linspace(0, 12, 64).view(1, 1, 64, 1) * torch.sign(q.mean(2, keepdim=True))
    want, want_lse = fh.flash_attention_forward_tma(q, k, v, causal)
    out, lse = fh.flash_attention_forward_tma(q, k, v, causal, lazy_rescale=lazy_rescale, poly_exp2=poly_exp2)
    tol = 2e-4 if poly_exp2 else 1e-5  # the cubic's 1e-4 relative error in P
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, want_lse, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="poly_exp2"):
        fh.flash_attention_forward_tma(q, k, v, causal, poly_exp2=3)


# ---------------------------------------------------------------- GPU tier


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, n, d", [(torch.bfloat16, 128, 64), (torch.bfloat16, 1024, 128),
                                         (torch.bfloat16, 4096, 128), (torch.float16, 2048, 64),
                                         (torch.bfloat16, 512, 32)])
def test_tma_forward_gpu(dtype, n, d, causal):
    shape = (2, 4, n, d) if n < 4096 else (1, 2, n, d)
    q = torch.empty(shape, dtype=dtype, device="cuda")
    assert fh.tma_applies(q) == _hopper()
    _compare(shape, dtype, causal, "cuda", 4e-2 if dtype == torch.bfloat16 else 1e-2)


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
def test_fixed_config_and_its_checks_interpreter():
    q, k, v = _qkv((1, 2, 64, 16))
    out, lse = fh.flash_attention_forward_tma(q, k, v, True, config=(32, 16, 1, 1))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(lse, att.attention_lse(q, k, True), rtol=2e-4, atol=2e-4)
    with pytest.raises(ValueError, match="BLOCK_M must divide"):
        fh.flash_attention_forward_tma(q, k, v, config=(48, 16, 1, 1))
    with pytest.raises(ValueError, match="multiple of BLOCK_N"):
        fh.flash_attention_forward_tma(q, k, v, config=(16, 32, 1, 1))
    with pytest.raises(ValueError, match="needs a config"):
        fh.flash_attention_forward_tma(q, k, v, warp_specialize=True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config, switches", [
    ((128, 64, 8, 3), {}), ((128, 128, 8, 3), {"warp_specialize": True}), ((128, 128, 8, 3), {"lazy_rescale": True}),
    ((128, 128, 8, 3), {"poly_exp2": 1}), ((128, 128, 8, 3), {"poly_exp2": 2}),
    ((128, 128, 8, 3), {"lazy_rescale": True, "poly_exp2": 1}), ((128, 128, 4, 3), {})])
def test_fixed_configs_gpu(config, switches, causal):
    # The launches the benchmark measures one by one: warp specialization (it compiles at 8 warps), FA4's tricks;
    # and the one-warpgroup tile the autotuner tries at head_dim 64 only.
    if not _hopper():
        pytest.skip("TMA needs sm90+: this GPU runs the teaching kernels, tested in test_flash_attention.py")
    q, k, v = _qkv((2, 4, 1024, 64 if config[2] == 4 else 128), torch.bfloat16, "cuda")
    out, lse = fh.flash_attention_forward_tma(q, k, v, causal, config=config, **switches)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    torch.testing.assert_close(out.float(), ref, rtol=4e-2, atol=4e-2)
    torch.testing.assert_close(lse, att.attention_lse(q.float(), k.float(), causal), rtol=1e-2, atol=1e-2)


def _hopper_backward_against_sdpa(shape, dtype, causal, device, tol, scale=None, **options):
    """dQ, dK, dV of flash_attention_backward_tma (after the TMA forward) against fp32 SDPA's."""
    q, k, v = _qkv(shape, dtype, device)
    dout = torch.randn(shape, dtype=dtype, device=device, generator=torch.Generator(device=device).manual_seed(9))
    out, lse = fh.flash_attention_forward_tma(q, k, v, causal, scale)
    got = fh.flash_attention_backward_tma(q, k, v, out, lse, dout, causal, scale, **options)
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale), leaves,
                              dout.float())
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        assert g.dtype == dtype and g.shape == r.shape, name
        torch.testing.assert_close(g.float(), r, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
@pytest.mark.parametrize("schedule", list(fh.SCHEDULES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 64, 16), (2, 3, 48, 32)])
def test_hopper_backward_interpreter(shape, causal, schedule):
    # Three heads and three blocks a head: each program, in each order, must find its own head's rows and block.
    _hopper_backward_against_sdpa(shape, torch.float32, causal, "cpu", 2e-4, schedule=schedule)


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
@pytest.mark.parametrize("causal", [False, True])
def test_each_kind_of_backward_program_alone_writes_its_own_gradients(causal):
    # The benchmark times the dK/dV programs (launch 1) and the dQ programs (launch 2) alone: each must do its whole job.
    q, k, v = _qkv((1, 2, 64, 16))
    dout = torch.randn_like(q)
    out, lse = fh.flash_attention_forward_tma(q, k, v, causal)
    dq, dk, dv = fh.flash_attention_backward_tma(q, k, v, out, lse, dout, causal)
    _, dk1, dv1 = fh.backward_launches(q, k, v, out, lse, dout, causal, None, None, (1,))
    dq2, _, _ = fh.backward_launches(q, k, v, out, lse, dout, causal, None, None, (2,))
    for got, want in ((dk1, dk), (dv1, dv), (dq2, dq)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
def test_hopper_backward_wide_blocks_scale_and_checks_interpreter():
    # BIG = 2 x SMALL: the diagonal block of a key block spans two query blocks, each partly masked.
    _hopper_backward_against_sdpa((1, 2, 64, 16), torch.float32, True, "cpu", 2e-4, scale=0.3, config=(32, 16, 1, 1))
    q, k, v = _qkv((1, 2, 64, 16))
    out, lse = fh.flash_attention_forward_tma(q, k, v)
    with pytest.raises(ValueError, match="BIG must divide"):
        fh.flash_attention_backward_tma(q, k, v, out, lse, out, config=(48, 16, 1, 1))
    with pytest.raises(ValueError, match="multiple of SMALL"):
        fh.flash_attention_backward_tma(q, k, v, out, lse, out, config=(16, 32, 1, 1))
    with pytest.raises(ValueError, match="schedule must be one of 'paired'"):
        fh.flash_attention_backward_tma(q, k, v, out, lse, out, schedule="one launch")
    with pytest.raises(ValueError, match="lse must be float32"):
        fh.flash_attention_backward_tma(q, k, v, out, lse[:, :1], out)
    with pytest.raises(ValueError, match="TMA backward needs"):
        r = _qkv((1, 2, 40, 16))
        fh.flash_attention_backward_tma(*r, r[0], torch.zeros(1, 2, 40), r[0])


@pytest.mark.skipif(not env.INTERPRET, reason="interpreter tier")
def test_tma_backward_switch_picks_the_backward(monkeypatch):
    # flash_attention_tma: the Hopper backward by default, the teaching one with tma_backward=False;
    # a stride-0 dO (the gradient of out.sum()) goes through either.
    q, k, v = (t.requires_grad_(True) for t in _qkv((1, 2, 32, 16)))
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(), (q, k, v))
    real = fh.flash_attention_backward_tma
    monkeypatch.setattr(fh, "flash_attention_backward_tma", lambda *a, **kw: pytest.fail("Hopper backward called"))
    for g, w in zip(torch.autograd.grad(fh.flash_attention_tma(q, k, v, True, tma_backward=False).sum(), (q, k, v)),
                    want):
        torch.testing.assert_close(g, w, rtol=2e-4, atol=2e-4)
    monkeypatch.setattr(fh, "flash_attention_backward_tma", real)
    _forbid(monkeypatch, "flash_attention_backward")
    for g, w in zip(torch.autograd.grad(fh.flash_attention_tma(q, k, v, True).sum(), (q, k, v)), want):
        torch.testing.assert_close(g, w, rtol=2e-4, atol=2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", list(fh.SCHEDULES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, n, d", [(torch.bfloat16, 1024, 128), (torch.bfloat16, 4096, 128),
                                         (torch.float16, 2048, 64), (torch.bfloat16, 256, 32)])
def test_hopper_backward_gpu(dtype, n, d, causal, schedule):
    if not _hopper():
        pytest.skip("TMA needs sm90+: this GPU runs the teaching backward, tested in test_flash_attention.py")
    shape = (2, 3, n, d) if n < 4096 else (1, 2, n, d)
    _hopper_backward_against_sdpa(shape, dtype, causal, "cuda", 4e-2 if dtype == torch.bfloat16 else 2e-2,
                                  schedule=schedule)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", fh.TMA_BACKWARD_CONFIGS)
def test_hopper_backward_configs_gpu(config, causal):
    # Each configuration the autotuner may pick, and the one the benchmark launches in two halves.
    if not _hopper():
        pytest.skip("TMA needs sm90+")
    _hopper_backward_against_sdpa((2, 4, 1024, 128), torch.bfloat16, causal, "cuda", 4e-2, config=config)
    _hopper_backward_against_sdpa((2, 4, 1024, 128), torch.bfloat16, causal, "cuda", 4e-2, config=config,
                                  schedule="two launches")


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype", [((2, 3, 1000, 64), torch.bfloat16), ((1, 2, 256, 64), torch.float32)])
def test_fallback_gpu(shape, dtype):
    q = torch.empty(shape, dtype=dtype, device="cuda")
    assert not fh.tma_applies(q)  # ragged sequence; fp32 tiles do not fit the TMA configs
    _compare(shape, dtype, True, "cuda", 4e-2 if dtype == torch.bfloat16 else 2e-2)
