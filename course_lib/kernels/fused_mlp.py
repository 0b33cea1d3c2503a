"""Chapter 16 (capstone): the transformer's MLP with its GELU moved into the matmuls' epilogues.

    y = fused_mlp(x, fc_weight, fc_bias, proj_weight, proj_bias)   # proj(gelu(fc(x))), differentiable
    block.mlp = FusedFeedForward(block.mlp)                         # the same parameters, the fused path

Unfused, the GELU costs two memory-bound passes a layer: forward, a kernel reads the first matmul's
output h and writes gelu(h); backward, one reads the incoming gradient dg and h and writes dh. Here
the first matmul adds the bias and applies the GELU before its tile leaves registers (it stores h,
which the backward needs, and gelu(h)); in the backward, the matmul that makes dg = dy W_proj
multiplies by GELU's derivative before it stores, so dg never reaches memory. A tile of h is read
in that epilogue instead. The GELU is chapter 08's fitted erfc (``fusion._normal_cdf``); the tile
product is chapter 09's (``tiling_coalescing._tile_product``, same autotuned configurations); the
other four matmuls stay with cuBLAS. The MLP's forward and the fused backward matmul are
``torch.library`` custom ops, so ``torch.compile`` keeps each whole and traces the backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from course_lib import env, models  # env sets TRITON_INTERPRET=1 without a GPU; must come before triton
from course_lib.kernels import fusion
from course_lib.kernels import tiling_coalescing as tc

# isort: split
import triton
import triton.language as tl

__all__ = ["FusedFeedForward", "fused_mlp", "gemm_bias_gelu", "gemm_gelu_backward"]


@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _gemm_gelu_kernel(
    a_ptr, b_ptr, out_ptr, h_ptr, bias_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, EVEN_K: tl.constexpr, BACKWARD: tl.constexpr,
):
    # One tile of A @ B (fp32 in registers), then the epilogue. Forward: z = tile + bias, store z to
    # h and gelu(z) to out. Backward: the tile is dg; read z from h, store dg * gelu'(z) to out.
    # out and h are contiguous (M, N); a 64-bit row offset keeps M x N past 2**31 in range.
    pid_m, pid_n = tc._grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    acc = tc._tile_product(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, pid_m, pid_n,
                           BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, EVEN_K)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if BACKWARD:
        z = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        cdf, e = fusion._normal_cdf(z, True)
        out = acc * (cdf + z * e * 0.3989422804014327)  # d/dz [z Phi(z)] = Phi(z) + z phi(z)
    else:
        z = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(h_ptr + offs, z.to(h_ptr.dtype.element_ty), mask=mask)
        cdf, _ = fusion._normal_cdf(z, True)
        out = z * cdf
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


if not env.INTERPRET:
    _gemm_gelu_autotuned = triton.autotune(configs=tc._GPU_CONFIGS, key=["M", "N", "K", "BACKWARD"])(_gemm_gelu_kernel)


def _launch(a: Tensor, b_kn: Tensor, out: Tensor, h: Tensor, bias: Tensor, backward: bool) -> None:
    # out (and h) = epilogue(a @ b_kn); b_kn is any (K, N) view, a transposed weight included.
    (M, K), N = a.shape, b_kn.shape[1]
    args = (a, b_kn, out, h, bias, M, N, K, a.stride(0), a.stride(1), b_kn.stride(0), b_kn.stride(1))
    precision = tc._precision(a.dtype)
    if env.INTERPRET:
        bm, bn, bk = tc._INTERPRETER_BLOCKS
        _gemm_gelu_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
            *args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PRECISION=precision, BACKWARD=backward)
    else:
        _gemm_gelu_autotuned[lambda m: (triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"]),)](
            *args, GROUP_M=8, PRECISION=precision, BACKWARD=backward)


def _check(name: str, t: Tensor, shape: tuple[int, ...], like: Tensor) -> None:
    if tuple(t.shape) != shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{name} must be {shape} {like.dtype} on {like.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    if env.INTERPRET and t.dtype != torch.float32:
        raise ValueError(f"the Triton interpreter computes fp32 matmuls only, got {t.dtype}")


def gemm_bias_gelu(x: Tensor, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """(gelu(x @ weight.T + bias), x @ weight.T + bias) by one kernel; x (M, K), weight (N, K), bias (N,)."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
    (M, K), N = x.shape, weight.shape[0]
    _check("x", x, (M, K), x)
    _check("weight", weight, (N, K), x)
    _check("bias", bias, (N,), x)
    g, h = torch.empty(M, N, device=x.device, dtype=x.dtype), torch.empty(M, N, device=x.device, dtype=x.dtype)
    if g.numel():
        _launch(x, weight.t(), g, h, bias.contiguous(), backward=False)
    return g, h


def gemm_gelu_backward(dy: Tensor, weight: Tensor, h: Tensor) -> Tensor:
    """(dy @ weight) * gelu'(h) by one kernel: the gradient at h of proj(gelu(h)); dy (M, K), weight (K, N), h (M, N)."""
    if dy.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"dy and weight must be 2-D, got {tuple(dy.shape)} and {tuple(weight.shape)}")
    (M, K), N = dy.shape, weight.shape[1]
    _check("weight", weight, (K, N), dy)
    _check("h", h, (M, N), dy)
    dh = torch.empty(M, N, device=dy.device, dtype=dy.dtype)
    if dh.numel():
        _launch(dy, weight, dh, h.contiguous(), h, backward=True)  # bias unused: any tensor of the dtype
    return dh


@torch.library.custom_op("training_at_speed::fused_mlp", mutates_args=())
def _fused_mlp_op(x: Tensor, fc_weight: Tensor, fc_bias: Tensor, proj_weight: Tensor,
                  proj_bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    g, h = gemm_bias_gelu(x, fc_weight, fc_bias)
    return torch.addmm(proj_bias, g, proj_weight.t()), g, h


@_fused_mlp_op.register_fake
def _(x: Tensor, fc_weight: Tensor, fc_bias: Tensor, proj_weight: Tensor,
      proj_bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    hidden = x.new_empty(x.shape[0], fc_weight.shape[0])
    return x.new_empty(x.shape[0], proj_weight.shape[0]), hidden, torch.empty_like(hidden)


@torch.library.custom_op("training_at_speed::gemm_gelu_backward", mutates_args=())
def _gemm_gelu_backward_op(dy: Tensor, weight: Tensor, h: Tensor) -> Tensor:
    return gemm_gelu_backward(dy, weight, h)


@_gemm_gelu_backward_op.register_fake
def _(dy: Tensor, weight: Tensor, h: Tensor) -> Tensor:
    return torch.empty_like(h)


def _setup_context(ctx: Any, inputs: tuple[Tensor, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    x, fc_weight, _, proj_weight, _ = inputs
    _, g, h = output
    ctx.save_for_backward(x, fc_weight, proj_weight, g, h)
    ctx.mark_non_differentiable(g, h)


def _backward(ctx: Any, dy: Tensor, _dg: Tensor | None, _dh: Tensor | None) -> tuple[Tensor, ...]:
    x, fc_weight, proj_weight, g, h = ctx.saved_tensors
    dy = dy.contiguous()
    dh = _gemm_gelu_backward_op(dy, proj_weight, h)  # dg = dy W_proj is never stored
    return dh @ fc_weight, dh.t() @ x, dh.sum(0), dy.t() @ g, dy.sum(0)


_fused_mlp_op.register_autograd(_backward, setup_context=_setup_context)


def fused_mlp(x: Tensor, fc_weight: Tensor, fc_bias: Tensor, proj_weight: Tensor, proj_bias: Tensor) -> Tensor:
    """proj(gelu(fc(x))) for x (..., d): fc (d_ff, d) + (d_ff,), proj (d, d_ff) + (d,); GELU in the matmuls' epilogues."""
    if x.shape[-1] != fc_weight.shape[1]:
        raise ValueError(f"x's last dimension {x.shape[-1]} must match fc_weight {tuple(fc_weight.shape)}")
    dtype = x.dtype
    if env.INTERPRET and dtype != torch.float32:  # the interpreter's 16-bit products are wrong: compute in fp32
        x, fc_weight, fc_bias, proj_weight, proj_bias = (t.float() for t in (x, fc_weight, fc_bias, proj_weight, proj_bias))
    y, _, _ = _fused_mlp_op(x.reshape(-1, x.shape[-1]).contiguous(), fc_weight, fc_bias, proj_weight, proj_bias)
    return y.view(*x.shape[:-1], y.shape[-1]).to(dtype)


class FusedFeedForward(models.FeedForward):
    """A ``models.FeedForward`` (fc, GELU, proj, dropout) run by ``fused_mlp``, holding the same modules and parameters."""

    def __init__(self, mlp: models.FeedForward) -> None:
        nn.Module.__init__(self)  # not FeedForward's: it would build new layers; these are mlp's own
        if mlp.fc.bias is None or mlp.proj.bias is None:
            raise ValueError("fused_mlp needs the biases of fc and proj (GPTConfig(bias=True))")
        self.fc: nn.Linear = mlp.fc
        self.proj: nn.Linear = mlp.proj
        self.dropout: nn.Dropout = mlp.dropout

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to every position of ``x``; under autocast, in autocast's dtype."""
        params = [self.fc.weight, self.fc.bias, self.proj.weight, self.proj.bias]
        if torch.is_autocast_enabled(x.device.type):  # a custom op is not autocast: cast as autocast would
            dtype = torch.get_autocast_dtype(x.device.type)
            x, params = x.to(dtype), [p.to(dtype) for p in params]
        return self.dropout(fused_mlp(x, *params))
