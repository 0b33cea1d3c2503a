"""course_lib.erfc: the fitted erfc that the fast GELU kernel uses, re-fitted and measured against float64; fitted_gelu."""

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib.erfc import ERFC_COEFFS, ERFC_P, erfc_approx, fit_erfc, fitted_gelu


def test_the_kernels_constants_are_the_fit() -> None:
    fit = fit_erfc(4, ERFC_P)
    assert fit.max_rel_error < 1e-4
    assert fit.coeffs == pytest.approx(ERFC_COEFFS, abs=1e-4), "ERFC_COEFFS no longer match fit_erfc(4, ERFC_P)"


def test_relative_error_below_1e4_everywhere() -> None:
    x = torch.linspace(-6.0, 26.0, 64001, dtype=torch.float64)
    want = torch.special.erfc(x)
    rel = ((erfc_approx(x) - want).abs() / want).max().item()
    assert rel < 1e-4, f"largest relative error {rel:.2e}"
    assert erfc_approx(torch.tensor([0.0], dtype=torch.float64)).item() == pytest.approx(1.0, rel=1e-4)


def test_a_higher_degree_fits_better_and_a_lower_one_worse() -> None:
    """The fit is a real fit: the error falls with the degree (degree 2 is far too coarse for bf16's 2e-3)."""
    errors = [fit_erfc(d, ERFC_P, samples=2001, rounds=100).max_rel_error for d in (2, 3, 4, 5)]
    assert errors == sorted(errors, reverse=True) and errors[0] > 2e-3 > 1e-4 > errors[2]


def test_fp32_evaluation_keeps_the_bound() -> None:
    x = torch.linspace(0.0, 9.0, 10001)
    want = torch.special.erfc(x.double())
    keep = want > 1e-30  # fp32 underflows further out
    rel = ((erfc_approx(x).double() - want).abs() / want)[keep].max().item()
    assert rel < 1.1e-4 and math.isfinite(rel)


def _gelu_and_slope_fp64(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GELU and its derivative in float64 through erfc, which keeps its digits in the left tail."""
    zd = z.double()
    cdf = 0.5 * torch.special.erfc(-zd / math.sqrt(2.0))
    return zd * cdf, cdf + zd * torch.exp(-0.5 * zd * zd) / math.sqrt(2.0 * math.pi)


def test_fitted_gelu_rounds_to_bf16_as_the_exact_gelu_does() -> None:
    # Every bf16 input in [-12, 12]: at most about half a bf16 unit in the last place from the true
    # GELU, i.e. rounded as well as it can be. torch's own bf16 GELU (1 + erf, in fp32) loses the
    # left tail to cancellation; the fitted erfc keeps it.
    z = torch.linspace(-12.0, 12.0, 400001).bfloat16().unique()
    want, _ = _gelu_and_slope_fp64(z)
    ulp = torch.ldexp(torch.ones_like(want), torch.floor(torch.log2(want.abs().clamp_min(1e-38))).long() - 7)
    got = fitted_gelu(z)
    assert got.dtype == torch.bfloat16
    ulps = ((got.double() - want).abs() / ulp).max().item()
    assert ulps < 0.6, f"fitted GELU is {ulps:.2f} bf16 ulps from the true GELU"
    assert ((F.gelu(z).double() - want).abs() / ulp).max().item() > 10  # the exact formula's tail, for contrast


def test_fitted_gelu_gradient_is_gelus_slope() -> None:
    z = torch.linspace(-9.0, 9.0, 20001, requires_grad=True)
    fitted_gelu(z).backward(torch.ones_like(z))
    _, slope = _gelu_and_slope_fp64(z.detach())
    err = (z.grad.double() - slope).abs().max().item()
    assert err < 1e-4, f"gradient off by {err:.1e}"  # Phi's absolute error: half the fit's 1e-4 relative, plus fp32
    zb = z.detach().bfloat16().requires_grad_()
    dy = torch.randn_like(zb)
    fitted_gelu(zb).backward(dy)
    assert zb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(zb.grad.float(), (dy.float() * slope.float()).bfloat16().float(), atol=1e-2, rtol=1e-2)


def test_fitted_gelu_refuses_integers() -> None:
    with pytest.raises(ValueError, match="floating-point"):
        fitted_gelu(torch.arange(3))
