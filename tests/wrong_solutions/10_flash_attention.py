"""Plausible wrong solutions of chapter 10's exercises (see harness.py).

Most are the course's solution with one mistake a student makes, written as an edit of the solution
cell (``_edited``: each edit must apply, so a change of the solution shows up here); the others are
written out whole.
"""

from tests.wrong_solutions.harness import solution_cells

_CELLS, _edited = solution_cells("10_flash_attention")


_DELTA = "delta = (dout.float() * out.float()).sum(-1)"  # the course's line, which three mistakes change

WRONG = {
    "ex10_1_online_softmax": {
        "the row maximum first, then the sum in blocks (two passes)": '''
def online_softmax_stats(x, block):
    m = x.amax(dim=-1)
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    l = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    for start in range(0, x.shape[-1], block):
        l = l + torch.exp(x[..., start:start + block] - safe[..., None]).sum(dim=-1)
    return m, l
''',
        "no guard for a fully masked block: -inf - (-inf) gives NaN": _edited(
            "ex1-solution",
            ("        ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)\n", "        ref = m_new\n")),
        "calls the reference": '''
def online_softmax_stats(x, block):
    return att.online_softmax_stats(x, block)
''',
    },
    "ex10_2_tiled_attention": {
        "causal: every key block computed, then masked (no block skipping)": _edited(
            "ex2-solution", ("range(0, qe if causal else n, block_k)", "range(0, n, block_k)")),
        "the ragged last key block skipped": _edited(
            "ex2-solution",
            ("range(0, qe if causal else n, block_k)", "range(0, (qe if causal else n) - block_k + 1, block_k)")),
        "logsumexp without the running max": _edited(
            "ex2-solution", ("lse[..., qs:qe] = m + torch.log(l)", "lse[..., qs:qe] = torch.log(l)")),
    },
    "ex10_3_attention_step": {
        "the accumulator not rescaled when the max grows": _edited(
            "ex3-solution", ("acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)", "acc = acc + tl.dot(p.to(v.dtype), v)")),
        "masked scores set to -inf (NaN for a row masked in a whole block)": _edited(
            "ex3-solution", ('s = tl.where(keep, s, -1.0e30)', 's = tl.where(keep, s, float("-inf"))')),
        "natural exponentials on base-2 scores": _edited(
            "ex3-solution",
            ("alpha = tl.math.exp2(m_i - m_new)", "alpha = tl.exp(m_i - m_new)"),
            ("p = tl.math.exp2(s - m_new[:, None])", "p = tl.exp(s - m_new[:, None])")),
        "calls the library's step": '''
@triton.jit
def attention_step(acc, m_i, l_i, q, k, v, qk_scale, keep):
    return fa.attention_step(acc, m_i, l_i, q, k, v, qk_scale, keep)
''',
    },
    "ex10_4_flash_forward": {
        "causal: the diagonal block without the causal mask": _edited(
            "ex4-solution",
            ("        if CAUSAL:\n            keep = keep & (offs_m[:, None] >= cols[None, :])\n", "")),
        "non-causal: the ragged last block skipped": _edited(
            "ex4-solution", ("        hi = N                            # the ragged last block, if any: masked\n",
                             "        hi = lo\n")),
        "logsumexp stored without the running max": _edited(
            "ex4-solution",
            ("lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453", "lse = tl.math.log2(l_i) * 0.6931471805599453")),
        "logsumexp stored in log2 units": _edited(
            "ex4-solution", ("lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453", "lse = m_i + tl.math.log2(l_i)")),
        "logsumexp never stored": _edited(
            "ex4-solution", ("    tl.store(LSE + tl.program_id(1) * N + offs_m, lse, mask=offs_m < N)\n", "")),
        "one loop that masks every block": _edited(
            "ex4-solution",
            ("        lo = start_m * BLOCK_M            # blocks left of the diagonal: no mask\n", "        lo = 0\n"),
            ("        hi = tl.minimum(lo + BLOCK_M, N)  # the diagonal: masked; beyond it: skipped\n",
             "        hi = tl.minimum((start_m + 1) * BLOCK_M, N)\n"),
            ("        lo = (N // BLOCK_N) * BLOCK_N     # every whole block: no mask\n", "        lo = 0\n")),
        "causal: one masked block on the diagonal, however wide BLOCK_M is": _edited(
            "ex4-solution", ("        hi = tl.minimum(lo + BLOCK_M, N)  # the diagonal: masked; beyond it: skipped\n",
                             "        hi = tl.minimum(lo + BLOCK_N, N)\n")),
    },
    "ex10_5_backward": {
        "delta from the block's own probabilities (a partial row sum)": _edited(
            "ex5-solution",
            ("        ds = p * (dof @ vf[..., ks:ke, :].transpose(-2, -1) - delta)\n",
             "        dp = dof @ vf[..., ks:ke, :].transpose(-2, -1)\n"
             "        ds = p * (dp - (p * dp).sum(-1, keepdim=True))\n")),
        "dK without the softmax scale": _edited(
            "ex5-solution",
            ("dk[..., ks:ke, :] = ds.transpose(-2, -1) @ qf * scale", "dk[..., ks:ke, :] = ds.transpose(-2, -1) @ qf")),
        "calls the reference": '''
def tiled_attention_backward(q, k, v, out, lse, dout, causal=False, block_k=16, scale=None):
    return att.tiled_attention_backward(q, k, v, out, lse, dout, causal, block_k, scale)
''',
    },
    "ex10_6_dkdv": {
        "dK stored without the softmax scale": _edited(
            "ex6-solution", ("(dk * sm_scale).to(DK.dtype.element_ty)", "dk.to(DK.dtype.element_ty)")),
        "lse left in natural-log units against base-2 scores": _edited(
            "ex6-solution", ('other=float("inf")) * 1.4426950408889634', 'other=float("inf"))')),
        "delta broadcast along the keys instead of the queries": _edited(
            "ex6-solution", ("- delta[None, :])", "- delta[:, None])")),
        "causal: every query block visited, each masked": _edited(
            "ex6-solution",
            ("        diagonal = tl.minimum(start_n + BLOCK_N, N)\n", "        diagonal = N\n"),
            ("LSE + rows, DELTA + rows, start_n, diagonal,", "LSE + rows, DELTA + rows, 0, diagonal,")),
        "causal: the diagonal block without the mask": _edited(
            "ex6-solution",
            ("        if MASKED:\n            pT = tl.where(rows[None, :] >= offs_n[:, None], pT, 0.0)\n", "")),
        "the ragged last query block skipped": _edited(
            "ex6-solution",
            ("    for start_m in range(lo, hi, BLOCK_M):", "    for start_m in range(lo, hi - BLOCK_M + 1, BLOCK_M):")),
        "P rounded to bf16 before the products": _edited(
            "ex6-solution",
            ("dv = tl.dot(pT.to(do.dtype), do, dv)", "dv = tl.dot(pT.to(tl.bfloat16).to(do.dtype), do, dv)")),
        "calls the library's inner loop": _edited(
            "ex6-solution", ("    offs_d = tl.arange(0, HEAD_DIM)\n    for start_m in range(lo, hi, BLOCK_M):",
                             "    return fa._bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, lo, hi, offs_n, N, qk_scale,\n"
                             "                              HEAD_DIM, BLOCK_M, MASKED)\n"
                             "    offs_d = tl.arange(0, HEAD_DIM)\n    for start_m in range(lo, hi, BLOCK_M):")),
    },
    "ex10_7_autograd": {
        "the result computed by PyTorch, the kernels never launched": '''
class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.scale = causal, scale
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=ctx.causal, scale=ctx.scale)
        return (*torch.autograd.grad(out, (q, k, v), dout), None, None)


def flash_attention(q, k, v, causal=False, scale=None):
    return FlashAttention.apply(q, k, v, causal, scale)
''',
        "delta kept as (batch, heads, N, 1)": _edited(
            "ex7-solution", (_DELTA, _DELTA.replace("sum(-1)", "sum(-1, keepdim=True)"))),
        "delta as a product of two row sums": _edited(
            "ex7-solution", (_DELTA, "delta = dout.float().sum(-1) * out.float().sum(-1)")),
        "delta in the inputs' dtype": _edited("ex7-solution", (_DELTA, "delta = (dout * out).sum(-1)")),
        "the backward runs the forward again": _edited(
            "ex7-solution", ("        q, k, v, out, lse = ctx.saved_tensors\n",
                             "        q, k, v, _, _ = ctx.saved_tensors\n"
                             "        out, lse = flash_forward(q, k, v, ctx.causal, ctx.scale)\n")),
        "calls the reference": '''
class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        return fa.flash_attention(q, k, v, causal, scale)

    @staticmethod
    def backward(ctx, dout):
        raise RuntimeError("unused")


def flash_attention(q, k, v, causal=False, scale=None):
    return fa.flash_attention(q, k, v, causal, scale)
''',
    },
}
