"""Floating-point formats from their bit widths: decoding, rounding, spacing, low-precision sums, tensor bytes.

Every number here is computed from a format's exponent and mantissa widths, never typed in,
so the same code describes fp32, fp16, bf16, the two fp8 formats and made-up ones like e3m2.

    from course_lib import floating_point as fp
    fp.FORMATS["bf16"].max_normal            # 3.3895313892515355e+38
    fp.decode_bits(0x3C00, 5, 10)            # 1.0 (fp16)
    fp.round_to_bf16(torch.tensor([1/3]))    # tensor([0.3340], dtype=torch.bfloat16)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "FloatFormat",
    "FORMATS",
    "format_limits",
    "fields",
    "bit_string",
    "decode_bits",
    "round_to_format",
    "encode_bits",
    "fp32_to_bf16_bits",
    "round_to_bf16",
    "ulp",
    "representable_values",
    "tensor_nbytes",
    "running_sums",
    "sequential_sum",
    "kahan_sum",
]


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: 1 sign bit, ``exp_bits`` exponent bits, ``man_bits`` mantissa bits.

    ``finite_only`` marks the OCP "fn" variant (fp8 e4m3fn): no infinities, and the only NaN
    patterns are S.1111.111, so the top exponent also holds normal numbers.
    """

    name: str
    exp_bits: int
    man_bits: int
    finite_only: bool = False
    torch_dtype: torch.dtype | None = None

    @property
    def bits(self) -> int:
        """Total width in bits."""
        return 1 + self.exp_bits + self.man_bits

    @property
    def bias(self) -> int:
        """Exponent bias: the stored exponent minus the bias is the power of two."""
        return 2 ** (self.exp_bits - 1) - 1

    @property
    def max_normal(self) -> float:
        """Largest finite value."""
        top_exponent = 2**self.exp_bits - 1 if self.finite_only else 2**self.exp_bits - 2
        top_mantissa = 2**self.man_bits - 2 if self.finite_only else 2**self.man_bits - 1
        return math.ldexp(2**self.man_bits + top_mantissa, top_exponent - self.bias - self.man_bits)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value (implicit leading 1)."""
        return math.ldexp(1.0, 1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value: a subnormal with only the last mantissa bit set."""
        return math.ldexp(1.0, 1 - self.bias - self.man_bits)

    @property
    def eps(self) -> float:
        """Machine epsilon: the gap between 1.0 and the next larger value."""
        return math.ldexp(1.0, -self.man_bits)


FORMATS: dict[str, FloatFormat] = {
    "fp32": FloatFormat("fp32", 8, 23, torch_dtype=torch.float32),
    "fp16": FloatFormat("fp16", 5, 10, torch_dtype=torch.float16),
    "bf16": FloatFormat("bf16", 8, 7, torch_dtype=torch.bfloat16),
    "fp8_e4m3": FloatFormat("fp8_e4m3", 4, 3, finite_only=True, torch_dtype=torch.float8_e4m3fn),
    "fp8_e5m2": FloatFormat("fp8_e5m2", 5, 2, torch_dtype=torch.float8_e5m2),
}


def format_limits(exp_bits: int, man_bits: int, finite_only: bool = False) -> dict[str, float]:
    """Bias, max, smallest normal, smallest subnormal and epsilon of a format with these bit widths."""
    f = FloatFormat(f"e{exp_bits}m{man_bits}", exp_bits, man_bits, finite_only)
    return {"bias": f.bias, "max": f.max_normal, "min_normal": f.min_normal,
            "min_subnormal": f.min_subnormal, "eps": f.eps}


def fields(bits: int, fmt: FloatFormat) -> tuple[int, int, int]:
    """Split a bit pattern into its (sign, stored exponent, mantissa) fields."""
    sign = (bits >> (fmt.bits - 1)) & 1
    return sign, (bits >> fmt.man_bits) & (2**fmt.exp_bits - 1), bits & (2**fmt.man_bits - 1)


def bit_string(bits: int, fmt: FloatFormat) -> str:
    """The pattern as 'sign exponent mantissa' groups of 0s and 1s, e.g. '0 01111 0000000000'."""
    s = format(bits, f"0{fmt.bits}b")
    return f"{s[0]} {s[1:1 + fmt.exp_bits]} {s[1 + fmt.exp_bits:]}"


def decode_bits(bits: int, exp_bits: int, man_bits: int, finite_only: bool = False) -> float:
    """Value of a bit pattern in the format with these widths (normal, subnormal, zero, inf, NaN)."""
    sign = (bits >> (exp_bits + man_bits)) & 1
    exponent = (bits >> man_bits) & (2**exp_bits - 1)
    mantissa = bits & (2**man_bits - 1)
    bias = 2 ** (exp_bits - 1) - 1
    if exponent == 2**exp_bits - 1:
        if not finite_only:
            return math.nan if mantissa else (-math.inf if sign else math.inf)
        if mantissa == 2**man_bits - 1:
            return math.nan  # e4m3fn: the rest of the top exponent holds ordinary normal numbers
    if exponent == 0:
        magnitude = math.ldexp(mantissa, 1 - bias - man_bits)
    else:
        magnitude = math.ldexp(2**man_bits + mantissa, exponent - bias - man_bits)
    return -magnitude if sign else magnitude


def round_to_format(x: float, fmt: FloatFormat) -> float:
    """Round a Python float to the nearest value of ``fmt``, ties to even.

    Overflow is non-saturating: a result beyond ``fmt.max_normal`` becomes +-inf, or NaN when
    ``fmt.finite_only`` (e4m3fn has no infinity, so +-inf inputs give NaN there too). PyTorch's own
    ``x.to(torch.float8_e4m3fn)`` returned NaN in version 2.11 but saturates to +-448 in newer
    versions, so the two can disagree beyond 448 (values up to 464 round to 448 in both).
    """
    if x == 0 or math.isnan(x):
        return x
    if math.isinf(x):
        return math.nan if fmt.finite_only else x
    _, e = math.frexp(x)
    quantum = max(e - 1, 1 - fmt.bias) - fmt.man_bits  # power of two of the last mantissa bit at x
    rounded = math.ldexp(round(math.ldexp(x, -quantum)), quantum)  # round() breaks ties to even
    if abs(rounded) > fmt.max_normal:
        return math.nan if fmt.finite_only else math.copysign(math.inf, x)
    return rounded if rounded != 0 else math.copysign(0.0, x)


def encode_bits(x: float, fmt: FloatFormat) -> int:
    """Bit pattern of ``x`` after rounding it to ``fmt`` with round_to_format (the inverse of decode_bits).

    NaN, and an overflow in a finite-only format, give a NaN pattern: the quiet NaN, or in a
    finite-only format all exponent and mantissa bits set.
    """
    r = round_to_format(x, fmt)
    sign = int(math.copysign(1.0, r) < 0) << (fmt.bits - 1)
    top = 2**fmt.exp_bits - 1
    if math.isnan(r):
        man = 2**fmt.man_bits - 1 if fmt.finite_only else 2 ** (fmt.man_bits - 1)
        return sign | top << fmt.man_bits | man
    if math.isinf(r):
        return sign | top << fmt.man_bits
    a = abs(r)
    if a < fmt.min_normal:
        return sign | int(a / fmt.min_subnormal)
    m, e = math.frexp(a)  # a = m * 2**e with 0.5 <= m < 1
    return sign | (e - 1 + fmt.bias) << fmt.man_bits | int(math.ldexp(2 * m - 1, fmt.man_bits))


def fp32_to_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns (as int16) of float32 ``x``, rounded to nearest, ties to even, by integer arithmetic."""
    if x.dtype != torch.float32:
        raise TypeError(f"expected a float32 tensor, got {x.dtype}")
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # the fp32 pattern as an unsigned number
    lsb = (u >> 16) & 1  # last bit that bf16 keeps: decides which way a tie goes
    rounded = (u + 0x7FFF + lsb) >> 16  # a carry out of the mantissa bumps the exponent (up to inf)
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    quiet_nan = (u >> 16) | 0x0040  # keep sign and top payload bits, set the quiet bit
    return torch.where(is_nan, quiet_nan, rounded).to(torch.int16)


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round float32 ``x`` to a torch.bfloat16 tensor with fp32_to_bf16_bits."""
    return fp32_to_bf16_bits(x).view(torch.bfloat16)


def ulp(x: float | np.ndarray, fmt: FloatFormat) -> float | np.ndarray:
    """Unit in the last place: the gap from |x| to the next larger value of ``fmt`` (for finite |x| <= max)."""
    magnitude = np.abs(np.asarray(x, dtype=np.float64))
    _, e = np.frexp(np.maximum(magnitude, fmt.min_normal))  # subnormals share the first binade's spacing
    return np.ldexp(1.0, e - 1 - fmt.man_bits)


def representable_values(fmt: FloatFormat) -> np.ndarray:
    """All non-negative finite values of a format of at most 16 bits, in increasing order."""
    if fmt.bits > 16:
        raise ValueError(f"{fmt.name} has 2**{fmt.bits - 1} non-negative patterns; only formats of <= 16 bits")
    patterns = range(2 ** (fmt.bits - 1))
    values = np.array([decode_bits(b, fmt.exp_bits, fmt.man_bits, fmt.finite_only) for b in patterns])
    return values[np.isfinite(values)]  # positive patterns already sort like their values


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes that the tensor's elements occupy: number of elements times bytes per element."""
    return t.numel() * t.element_size()


def running_sums(values: Iterable[float], fmt: FloatFormat) -> np.ndarray:
    """Partial sums s_1..s_N, adding one element at a time and rounding inputs and each sum to ``fmt``."""
    sums = []
    s = 0.0
    for v in values:
        s = round_to_format(s + round_to_format(float(v), fmt), fmt)
        sums.append(s)
    return np.array(sums, dtype=np.float64)


def sequential_sum(values: Iterable[float], fmt: FloatFormat) -> float:
    """Sum accumulated one element at a time in ``fmt`` (the last of running_sums; 0.0 when empty)."""
    sums = running_sums(values, fmt)
    return float(sums[-1]) if len(sums) else 0.0


def kahan_sum(values: Iterable[float], fmt: FloatFormat) -> float:
    """Compensated (Kahan) sum where inputs and every intermediate result are rounded to ``fmt``."""
    s = c = 0.0  # running sum, and the low-order part lost so far (with its sign flipped)
    for v in values:
        y = round_to_format(round_to_format(float(v), fmt) - c, fmt)
        t = round_to_format(s + y, fmt)
        c = round_to_format(round_to_format(t - s, fmt) - y, fmt)
        s = t
    return s
