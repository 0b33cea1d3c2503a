"""The exercise-test helpers fail with messages that tell the student what is wrong."""

import math

import numpy as np
import pytest
import torch

from course_lib.exercises import checks as testing


def test_assert_close_passes_within_dtype_tolerance() -> None:
    x = torch.randn(8, 8)
    testing.assert_close(x + 1e-7, x)
    testing.assert_close(x.half(), x.half())
    testing.assert_close(np.ones(3), np.ones(3))
    testing.assert_close(2.0, 2.0)


def test_assert_close_names_shape_dtype_and_location() -> None:
    with pytest.raises(AssertionError, match=r"shape \(2, 3\), expected \(3, 2\)"):
        testing.assert_close(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(AssertionError, match="dtype torch.float16, expected torch.float32"):
        testing.assert_close(torch.zeros(2).half(), torch.zeros(2))
    expected = torch.zeros(3, 4)
    actual = expected.clone()
    actual[1, 2] = 0.5
    with pytest.raises(AssertionError, match=r"1 of 12 .* index \(1, 2\): got 0.5, expected 0.0; max abs error 0.5"):
        testing.assert_close(actual, expected, name="out")
    with pytest.raises(AssertionError, match="expected a torch.Tensor, got list"):
        testing.assert_close([1.0], torch.ones(1))


def test_assert_close_handles_nan_and_inf() -> None:
    special = torch.tensor([math.nan, math.inf, -math.inf, 1.0])
    testing.assert_close(special.clone(), special)
    with pytest.raises(AssertionError, match="differ"):
        testing.assert_close(torch.tensor([1.0, math.inf, -math.inf, 1.0]), special)
    with pytest.raises(AssertionError, match="differ"):
        testing.assert_close(torch.tensor([math.nan, -math.inf, -math.inf, 1.0]), special)
    with pytest.raises(AssertionError, match="differ"):
        testing.assert_close(special.clone(), special, equal_nan=False)


def test_assert_close_on_integers_is_exact() -> None:
    testing.assert_close(torch.arange(5), torch.arange(5))
    with pytest.raises(AssertionError, match="index \\(4,\\)"):
        testing.assert_close(torch.tensor([0, 1, 2, 3, 5]), torch.arange(5))


def test_assert_equal() -> None:
    testing.assert_equal((1, "a"), (1, "a"))
    testing.assert_equal(math.nan, math.nan)
    with pytest.raises(AssertionError, match="max: got 1, expected 2"):
        testing.assert_equal(1, 2, name="max")


def _todo(x: int) -> int:
    raise NotImplementedError()


def _ok(x: int) -> int:
    return x + 1


def _bad(x: int) -> int:
    raise ValueError("negative")


def test_assert_raises() -> None:
    exc = testing.assert_raises(ValueError, _bad, 1)
    assert str(exc) == "negative"
    with pytest.raises(AssertionError, match=r"_ok\(1\) returned normally; expected it to raise ValueError"):
        testing.assert_raises(ValueError, _ok, 1)
    with pytest.raises(AssertionError, match="raised ValueError: negative; expected KeyError"):
        testing.assert_raises(KeyError, _bad, 1)
    with pytest.raises(testing.NotDoneYet, match="_todo is not implemented yet"):
        testing.assert_raises(ValueError, _todo, 1)


def test_call_and_is_implemented() -> None:
    assert testing.call(_ok, 1) == 2
    with pytest.raises(testing.NotDoneYet, match="replace `raise NotImplementedError\\(\\)`"):
        testing.call(_todo, 1)
    assert testing.is_implemented(_ok, 1)
    assert not testing.is_implemented(_todo, 1)


def test_python_floats_are_compared_in_double_precision() -> None:
    testing.assert_close(0.1 + 0.2, 0.3, rtol=1e-15, atol=0)
    with pytest.raises(AssertionError, match="dtype torch.float64"):
        testing.assert_close(1.0, 1.0 + 1e-9, rtol=1e-12, atol=0)
