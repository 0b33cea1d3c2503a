"""Chapter 08 (fusion): a cheap erfc for the fused GELU, fitted here, with its error measured.

GELU is z * Phi(z), and Phi(z) = erfc(-z / sqrt 2) / 2. For x >= 0 the fit writes

    erfc(x) = exp(-x^2) * t * P(t),   t = 1 / (1 + p x),   P a polynomial of low degree,

so one exponential, one reciprocal and a few multiply-adds replace the library's erf. The error is
*relative* to erfc, which is what the output of GELU needs: for z < 0, Phi(z) is small and
``1 + erf(z / sqrt 2)`` (the exact formula, in fp32) loses its digits to cancellation, while
``t P(t) exp(-x^2)`` keeps them. The backward pass reuses the same ``exp(-z^2 / 2)`` for the
normal density. ``fit_erfc`` finds P by iteratively reweighted least squares (Lawson's method:
it converges towards the polynomial with the smallest largest relative error), and
``ERFC_P`` / ``ERFC_COEFFS`` are its result for degree 4, which the Triton kernel uses.

``fitted_gelu`` is the same GELU written in PyTorch operations, forward and backward, so that
``torch.compile`` fuses it into one kernel each way in place of its exact-erf GELU: the capstone's
``RunConfig.fitted_gelu`` (chapter 16), where the GELU kernels are compute-bound on an H200.

    fit = fit_erfc(degree=4, p=ERFC_P)        # fit.coeffs, fit.max_rel_error (about 1e-4)
    y = erfc_approx(x)                        # the kernel's formula in PyTorch, any dtype
    y = fitted_gelu(x)                        # GELU through it, differentiable; fp32 inside, x's dtype out
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ERFC_COEFFS", "ERFC_P", "ErfcFit", "erfc_approx", "fit_erfc", "fitted_gelu"]

ERFC_P = 0.565
"""The ``p`` of ``t = 1 / (1 + p x)``: chosen by scanning 0.25-0.70 for the smallest error at degree 4."""
ERFC_COEFFS = (0.3187453441592033, 0.3208518234505131, 0.239910997952613, 0.2901906081421432, -0.16979039678366983)
"""P's coefficients, lowest power first: ``fit_erfc(4, ERFC_P).coeffs`` (a test re-fits them)."""


@dataclass(frozen=True)
class ErfcFit:
    """A fitted ``erfc(x) ~ exp(-x^2) t P(t)``: ``p``, P's coefficients (lowest power first), its largest relative error."""

    p: float
    coeffs: tuple[float, ...]
    max_rel_error: float


def _scaled_erfc(x: np.ndarray) -> np.ndarray:
    """erfc(x) exp(x^2) in float64, with its asymptotic series where exp(x^2) would overflow."""
    out = np.empty_like(x)
    small = x < 25.0
    out[small] = [math.erfc(v) * math.exp(v * v) for v in x[small]]
    big = x[~small]
    out[~small] = (1.0 - 0.5 / big**2 + 0.75 / big**4) / (big * math.sqrt(math.pi))
    return out


def fit_erfc(degree: int, p: float, samples: int = 8001, rounds: int = 300) -> ErfcFit:
    """P of the given degree for ``erfc(x) ~ exp(-x^2) t P(t)`` on x >= 0, minimising the largest relative error."""
    t = 0.5 + 0.5 * np.cos(np.linspace(0.0, math.pi, samples))  # Chebyshev-spaced on (0, 1]: dense near both ends
    t = t[t > 1e-5]
    target = _scaled_erfc((1.0 / t - 1.0) / p) / t  # what P(t) must equal
    powers = np.vander(t, degree + 1, increasing=True) / target[:, None]  # rows scaled: residuals become relative
    weights = np.ones_like(t)
    best: tuple[float, np.ndarray] = (math.inf, np.zeros(degree + 1))
    for _ in range(rounds):
        coeffs = np.linalg.lstsq(powers * weights[:, None], weights, rcond=None)[0]
        error = np.abs(powers @ coeffs - 1.0)
        if error.max() < best[0]:
            best = (float(error.max()), coeffs)
        weights = weights * (error + 1e-300)  # Lawson: weight grows where the error is large
        weights /= weights.mean()
    return ErfcFit(p, tuple(float(c) for c in best[1]), best[0])


def erfc_approx(x: torch.Tensor, p: float = ERFC_P, coeffs: tuple[float, ...] = ERFC_COEFFS) -> torch.Tensor:
    """erfc(x) by the fitted formula (for x < 0 through erfc(x) = 2 - erfc(-x)), computed in ``x``'s dtype."""
    a = x.abs()
    t = 1.0 / (1.0 + p * a)
    poly = torch.full_like(x, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        poly = poly * t + c
    tail = t * poly * torch.exp(-a * a)
    return torch.where(x >= 0, tail, 2.0 - tail)


def _normal_cdf_pdf(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi(z) by the fitted erfc and the normal density phi(z), sharing one exponential; fp32 ``z``."""
    e = torch.exp(-0.5 * z * z)
    t = 1.0 / (1.0 + (ERFC_P / math.sqrt(2.0)) * z.abs())
    poly = torch.full_like(z, ERFC_COEFFS[-1])
    for c in reversed(ERFC_COEFFS[:-1]):
        poly = poly * t + c
    tail = 0.5 * t * poly * e  # Phi(-|z|) = erfc(|z| / sqrt 2) / 2, with its relative accuracy
    return torch.where(z >= 0, 1.0 - tail, tail), e * (1.0 / math.sqrt(2.0 * math.pi))


class _FittedGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(z)  # the input only, as for torch's GELU: the backward recomputes Phi
        cdf, _ = _normal_cdf_pdf(z.float())
        return (z.float() * cdf).to(z.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (z,) = ctx.saved_tensors
        zf = z.float()
        cdf, pdf = _normal_cdf_pdf(zf)
        return (grad.float() * (cdf + zf * pdf)).to(grad.dtype)  # d/dz z Phi(z) = Phi(z) + z phi(z)


def fitted_gelu(z: torch.Tensor) -> torch.Tensor:
    """GELU z Phi(z) with Phi from the fitted erfc (relative error about 1e-4), differentiable, in PyTorch operations."""
    if not z.is_floating_point():
        raise ValueError(f"fitted_gelu needs a floating-point tensor, got {z.dtype}")
    return _FittedGelu.apply(z)
