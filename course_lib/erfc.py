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

    fit = fit_erfc(degree=4, p=ERFC_P)        # fit.coeffs, fit.max_rel_error (about 1e-4)
    y = erfc_approx(x)                        # the kernel's formula in PyTorch, any dtype
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ERFC_COEFFS", "ERFC_P", "ErfcFit", "erfc_approx", "fit_erfc"]

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
