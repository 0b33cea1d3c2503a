"""Chapter 06 (mixed precision), fp8 compute: per-tensor scaled casts and the fp8 matrix multiply.

An 8-bit float has 4 exponent and 3 mantissa bits (e4m3, largest value 448: weights and
activations in the forward pass) or 5 and 2 (e5m2, largest value 57344: gradients), as proposed
by Micikevicius et al. 2022, "FP8 Formats for Deep Learning". Too narrow to hold a tensor as it
comes, so each tensor is multiplied by a *scale* that maps its largest magnitude (its amax) onto
the format's largest value before the cast; a product of two such tensors is divided by both
scales afterwards. ``torch._scaled_mm`` does that on fp8 tensor cores (compute capability 8.9 and
up: Ada, Hopper); elsewhere the course emulates it with an fp32 matmul of the fp8 values.

    from course_lib import fp8
    q, scale = fp8.to_fp8(x)                 # e4m3 values and their fp32 scale: x ~ q / scale
    y = fp8.fp8_matmul(a, b)                 # a @ b through e4m3 (torch._scaled_mm on an H100/H200)
    ds = fp8.DelayedScaling(history=16)      # scales from past amaxes, as Transformer Engine's default recipe
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

__all__ = [
    "E4M3",
    "E5M2",
    "FP8_MAX",
    "scale_from_amax",
    "to_fp8",
    "from_fp8",
    "has_fp8_matmul",
    "scaled_mm",
    "emulated_scaled_mm",
    "fp8_matmul",
    "DelayedScaling",
    "relative_error",
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Largest finite value of each format (torch.finfo(dtype).max): e4m3fn gives up infinities for one more binade.
FP8_MAX: dict[torch.dtype, float] = {E4M3: 448.0, E5M2: 57344.0}


def _max_of(dtype: torch.dtype) -> float:
    if dtype not in FP8_MAX:
        raise ValueError(f"not an fp8 format: {dtype} (use torch.float8_e4m3fn or torch.float8_e5m2)")
    return FP8_MAX[dtype]


def scale_from_amax(amax: torch.Tensor | float, dtype: torch.dtype = E4M3,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The fp32 scale (0-dim tensor) that maps ``amax`` onto ``dtype``'s largest value; 1.0 where amax is 0."""
    amax = torch.as_tensor(amax, dtype=torch.float32, device=device)
    return torch.where(amax > 0, torch.tensor(_max_of(dtype), device=amax.device) / amax, torch.ones_like(amax))


def to_fp8(x: torch.Tensor, dtype: torch.dtype = E4M3,
           amax: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` scaled into ``dtype``'s range and cast: ``(q, scale)`` with x ~ q.float() / scale.

    ``amax`` is the magnitude mapped onto the format's largest value: by default ``x``'s own
    (current scaling); one from earlier steps for delayed scaling. The product ``x * scale`` is
    formed in fp32 whatever ``x``'s dtype, and values beyond the largest after scaling saturate to
    it (the cast itself does not promise that: e5m2 gives inf). ``scale`` is an fp32 0-dim tensor
    on ``x``'s device, the form ``torch._scaled_mm`` takes.
    """
    m = _max_of(dtype)
    x32 = x.detach().float()
    scale = scale_from_amax(x32.abs().amax() if amax is None else amax, dtype, device=x.device)
    return (x32 * scale).clamp(-m, m).to(dtype), scale


def from_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``q`` stands for: ``q / scale``, in ``dtype``."""
    return (q.float() / scale).to(dtype)


def has_fp8_matmul(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies fp8 matrices in hardware (CUDA, compute capability 8.9 or later)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm(qa: torch.Tensor, qb: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype = torch.bfloat16, use_fast_accum: bool = False) -> torch.Tensor:
    """``qa @ qb`` of fp8 matrices divided by both scales, with ``torch._scaled_mm``.

    The op wants its first operand row-major and its second column-major, and takes the
    *dequantisation* factors (1 / scale) as fp32 tensors; on a GPU the sizes must be multiples of 16.
    """
    return torch._scaled_mm(qa.contiguous(), qb.t().contiguous().t(), scale_a=scale_a.reciprocal(),
                            scale_b=scale_b.reciprocal(), out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def emulated_scaled_mm(qa: torch.Tensor, qb: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What ``scaled_mm`` computes, on any device: an fp32 matmul of the fp8 values, times 1/scale_a and 1/scale_b.

    A product of two fp8 numbers (4 significant bits each) is exact in fp32; only the sums round.
    """
    return ((qa.float() @ qb.float()) * scale_a.reciprocal() * scale_b.reciprocal()).to(out_dtype)


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``a @ b`` with both operands cast to e4m3, each with its own per-tensor scale (current scaling).

    On a GPU with fp8 tensor cores the product runs in ``torch._scaled_mm``; elsewhere in its emulation.
    """
    qa, sa = to_fp8(a)
    qb, sb = to_fp8(b)
    if has_fp8_matmul(a.device):
        return scaled_mm(qa, qb, sa, sb, out_dtype)
    return emulated_scaled_mm(qa, qb, sa, sb, out_dtype)


class DelayedScaling:
    """Scales from the largest amax of the last ``history`` casts, known before the tensor is read.

    Transformer Engine's default recipe: the cast can then be fused into the kernel that produces
    the tensor, at the price of saturating when a tensor grows faster than its history. The first
    cast, with no history yet, uses the tensor's own amax.
    """

    def __init__(self, dtype: torch.dtype = E4M3, history: int = 16) -> None:
        _max_of(dtype)
        if history < 1:
            raise ValueError(f"history must be at least 1, got {history}")
        self.dtype = dtype
        self.amaxes: deque[float] = deque(maxlen=history)

    def cast(self, x: torch.Tensor,
             cast_fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = to_fp8) -> tuple[torch.Tensor, torch.Tensor]:
        """``cast_fn(x, dtype, amax=...)`` with the amax of the history; then record ``x``'s own amax."""
        now = float(x.detach().abs().amax())
        q, scale = cast_fn(x, self.dtype, amax=max(self.amaxes) if self.amaxes else now)
        self.amaxes.append(now)
        return q, scale


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| (Frobenius norms, in fp64)."""
    exact64 = exact.double()
    return float((approx.double() - exact64).norm() / exact64.norm())
