"""course_lib.erfc: the fitted erfc that the fast GELU kernel uses, re-fitted and measured against float64."""

import math

import pytest
import torch

from course_lib.erfc import ERFC_COEFFS, ERFC_P, erfc_approx, fit_erfc


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
