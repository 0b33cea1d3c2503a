"""Unit tests of course_lib.floating_point against torch, numpy, struct and the definitions."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from course_lib import floating_point as fp

FORMATS = fp.FORMATS
E3M2 = fp.FloatFormat("e3m2", 3, 2)


def torch_decode(patterns: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Values of bit patterns read through torch's own dtype."""
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[torch.finfo(dtype).bits // 8]
    signed = {torch.int16: np.int16, torch.int32: np.int32, torch.uint8: np.uint8}[int_dtype]
    ints = torch.from_numpy(patterns.astype(np.int64).astype(signed)).view(dtype)
    return ints.to(torch.float64).numpy()


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal element by element, NaN matching NaN and the sign of zero counting."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(both_nan | ((a == b) & (np.signbit(a) == np.signbit(b)))))


# ---- formats -------------------------------------------------------------------------------

@pytest.mark.parametrize("key", list(FORMATS))
def test_format_limits_match_torch_finfo(key: str) -> None:
    f = FORMATS[key]
    info = torch.finfo(f.torch_dtype)
    assert f.bits == info.bits
    assert f.max_normal == info.max
    assert f.min_normal == info.smallest_normal
    assert f.eps == info.eps
    # the smallest subnormal is the pattern 0...01, read through torch
    assert f.min_subnormal == torch_decode(np.array([1]), f.torch_dtype)[0]


def test_known_formats_by_definition() -> None:
    assert fp.FORMATS["fp16"].max_normal == 65504.0
    assert fp.FORMATS["fp8_e4m3"].max_normal == 448.0
    assert fp.FORMATS["fp8_e5m2"].max_normal == 57344.0
    assert fp.FORMATS["bf16"].bias == fp.FORMATS["fp32"].bias == 127
    # e3m2: bias 3, top normal exponent 6 - 3 = 3, so max = 1.75 * 8
    assert fp.format_limits(3, 2) == {"bias": 3, "max": 14.0, "min_normal": 0.25, "min_subnormal": 0.0625, "eps": 0.25}


@pytest.mark.parametrize("key", list(FORMATS))
def test_format_limits_agree_with_format(key: str) -> None:
    f = FORMATS[key]
    limits = fp.format_limits(f.exp_bits, f.man_bits, f.finite_only)
    assert limits == {"bias": f.bias, "max": f.max_normal, "min_normal": f.min_normal,
                      "min_subnormal": f.min_subnormal, "eps": f.eps}


# ---- decoding ------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_decode_every_pattern_matches_torch(key: str) -> None:
    f = FORMATS[key]
    patterns = np.arange(2**f.bits)
    ours = np.array([fp.decode_bits(int(b), f.exp_bits, f.man_bits, f.finite_only) for b in patterns])
    assert same_values(ours, torch_decode(patterns, f.torch_dtype))


def test_decode_fp16_matches_numpy() -> None:
    patterns = np.arange(2**16, dtype=np.uint16)
    ours = np.array([fp.decode_bits(int(b), 5, 10) for b in patterns])
    assert same_values(ours, patterns.view(np.float16))


def test_decode_fp32_matches_struct() -> None:
    rng = np.random.default_rng(1)
    specials = [0, 0x80000000, 1, 0x007FFFFF, 0x00800000, 0x3F800000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000]
    for b in specials + rng.integers(0, 2**32, 20_000).tolist():
        expected = struct.unpack("<f", struct.pack("<I", b))[0]
        assert same_values(fp.decode_bits(b, 8, 23), expected), hex(b)


def test_decode_special_values() -> None:
    assert math.copysign(1.0, fp.decode_bits(0x8000, 5, 10)) == -1.0  # negative zero
    assert fp.decode_bits(0x7C00, 5, 10) == math.inf
    assert fp.decode_bits(0xFC00, 5, 10) == -math.inf
    assert math.isnan(fp.decode_bits(0x7C01, 5, 10))
    assert fp.decode_bits(0x7E, 4, 3, finite_only=True) == 448.0  # S.1111.110 is a number in e4m3fn
    assert math.isnan(fp.decode_bits(0x7F, 4, 3, finite_only=True))
    assert fp.decode_bits(0x78, 4, 3) == math.inf  # the IEEE-like e4m3 has infinities


def test_fields_and_bit_string() -> None:
    f = FORMATS["fp16"]
    assert fp.fields(0xC100, f) == (1, 0b10000, 0b0100000000)  # -2.5
    assert fp.bit_string(0xC100, f) == "1 10000 0100000000"
    assert fp.bit_string(0x3F80, FORMATS["bf16"]) == "0 01111111 0000000"


@pytest.mark.parametrize("fmt", [FORMATS["fp16"], FORMATS["fp8_e4m3"], FORMATS["fp8_e5m2"], E3M2], ids=lambda f: f.name)
def test_encode_inverts_decode(fmt: fp.FloatFormat) -> None:
    for b in range(2**fmt.bits):
        v = fp.decode_bits(b, fmt.exp_bits, fmt.man_bits, fmt.finite_only)
        if math.isnan(v):
            assert math.isnan(fp.decode_bits(fp.encode_bits(v, fmt), fmt.exp_bits, fmt.man_bits, fmt.finite_only))
        else:
            assert fp.encode_bits(v, fmt) == b, (fmt.name, hex(b))


@pytest.mark.parametrize("key", list(FORMATS))
def test_encode_matches_torch_conversion(key: str) -> None:
    f = FORMATS[key]
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(2000) * np.exp2(rng.uniform(-20, 20, 2000))).astype(np.float32)
    x = x[np.abs(x) < f.max_normal]
    expected = torch.from_numpy(x).to(f.torch_dtype)
    width = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[f.bits]
    expected_bits = (expected.view(width).to(torch.int64) & (2**f.bits - 1)).tolist()
    assert [fp.encode_bits(float(v), f) for v in x] == expected_bits


# ---- rounding ------------------------------------------------------------------------------

def test_round_to_format_matches_numpy_fp16() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal(20_000) * np.exp2(rng.uniform(-26, 17, 20_000))
    grid = fp.representable_values(FORMATS["fp16"])
    midpoints = (grid[1:] + grid[:-1]) / 2  # exact ties in float64
    values = np.concatenate([x, midpoints, -midpoints])
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16).astype(np.float64)
    assert same_values([fp.round_to_format(float(v), FORMATS["fp16"]) for v in values], expected)


@pytest.mark.parametrize("key", ["bf16", "fp8_e5m2", "fp8_e4m3"])
def test_round_to_format_matches_torch(key: str) -> None:
    f = FORMATS[key]
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(20_000) * np.exp2(rng.uniform(-30, 30, 20_000))).astype(np.float32)
    x = x[np.abs(x) <= f.max_normal]  # torch saturates e4m3fn overflow; we return NaN
    expected = torch.from_numpy(x).to(f.torch_dtype).to(torch.float64).numpy()
    assert same_values([fp.round_to_format(float(v), f) for v in x], expected)


def test_round_to_format_edges() -> None:
    fp16, e4m3 = FORMATS["fp16"], FORMATS["fp8_e4m3"]
    assert fp.round_to_format(65519.0, fp16) == 65504.0
    assert fp.round_to_format(65520.0, fp16) == math.inf  # the tie goes to the even neighbour, 2**16
    assert fp.round_to_format(-1e6, fp16) == -math.inf
    assert fp.round_to_format(464.0, e4m3) == 448.0  # tie between 448 (even) and 480 (NaN pattern)
    assert math.isnan(fp.round_to_format(465.0, e4m3))
    assert math.isnan(fp.round_to_format(math.inf, e4m3))
    tiny = fp16.min_subnormal
    assert fp.round_to_format(tiny / 2, fp16) == 0.0  # tie between 0 (even) and tiny
    assert fp.round_to_format(tiny * 0.75, fp16) == tiny
    assert math.copysign(1.0, fp.round_to_format(-tiny / 4, fp16)) == -1.0


def test_fp32_to_bf16_bits_matches_torch_on_random_patterns() -> None:
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.integers(-(2**31), 2**31, 1_000_000, dtype=np.int64).astype(np.int32)).view(torch.float32)
    ours = fp.fp32_to_bf16_bits(x)
    assert ours.dtype == torch.int16 and ours.shape == x.shape
    nan = torch.isnan(x)
    assert torch.equal(ours[~nan], x[~nan].to(torch.bfloat16).view(torch.int16))
    assert torch.isnan(ours[nan].view(torch.bfloat16)).all()


def test_fp32_to_bf16_bits_special_patterns() -> None:
    patterns = [
        0x3F808000,  # tie, kept bit even: rounds down
        0x3F818000,  # tie, kept bit odd: rounds up
        0x3F808001, 0x3F807FFF, 0xBF808000, 0xBF818000,
        0x7F7FFFFF,  # fp32 max: carries into the exponent, becomes inf
        0x7F7F7FFF, 0x7F7F8000, 0xFF7FFFFF,
        0x00000000, 0x80000000, 0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x807FFFFF, 0x00800000,
        0x7F800000, 0xFF800000,
    ]
    x = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert torch.equal(fp.fp32_to_bf16_bits(x), x.to(torch.bfloat16).view(torch.int16))
    ties = torch.tensor([0x3F808000, 0x3F818000], dtype=torch.int32).view(torch.float32)
    assert fp.fp32_to_bf16_bits(ties).tolist() == [0x3F80, 0x3F82]


def test_fp32_to_bf16_bits_nan_stays_quiet_nan() -> None:
    nans = torch.tensor([0x7F800001, 0x7FC00000, 0xFF800001, 0x7FFFFFFF], dtype=torch.int64).to(torch.int32)
    bits = fp.fp32_to_bf16_bits(nans.view(torch.float32))
    assert torch.isnan(bits.view(torch.bfloat16)).all()
    assert ((bits.to(torch.int64) & 0x0040) != 0).all()  # quiet bit set
    assert ((bits.to(torch.int64) & 0x8000) != 0).tolist() == [False, False, True, False]  # sign kept


def test_fp32_to_bf16_bits_shapes_and_dtype_check() -> None:
    x = torch.randn(64, 48).t()  # not contiguous
    assert torch.equal(fp.fp32_to_bf16_bits(x), x.to(torch.bfloat16).view(torch.int16))
    assert fp.fp32_to_bf16_bits(torch.tensor(1.5)).shape == ()
    with pytest.raises(TypeError):
        fp.fp32_to_bf16_bits(torch.ones(3, dtype=torch.float64))


def test_round_to_bf16_returns_bfloat16() -> None:
    x = torch.randn(1000) * 1e3
    y = fp.round_to_bf16(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


# ---- spacing -------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"])
def test_ulp_is_the_gap_to_the_next_value(key: str) -> None:
    f = FORMATS[key]
    grid = fp.representable_values(f)
    assert np.array_equal(fp.ulp(grid[:-1], f), np.diff(grid))
    assert np.array_equal(fp.ulp(-grid[:-1], f), np.diff(grid))


def test_ulp_fp32_matches_nextafter() -> None:
    f = FORMATS["fp32"]
    x = torch.randn(10_000) * torch.exp2(torch.randint(-140, 120, (10_000,)).float())
    x = x.abs()
    gap = (torch.nextafter(x, torch.tensor(math.inf)) - x).double().numpy()
    assert np.array_equal(fp.ulp(x.double().numpy(), f), gap)
    assert fp.ulp(1.0, f) == f.eps and fp.ulp(0.0, f) == f.min_subnormal


def test_representable_values() -> None:
    fp16 = fp.representable_values(FORMATS["fp16"])
    assert len(fp16) == 31 * 1024  # stored exponents 0..30, each with every mantissa; includes 0
    assert fp16[0] == 0.0 and fp16[-1] == 65504.0 and np.all(np.diff(fp16) > 0)
    assert len(fp.representable_values(FORMATS["fp8_e4m3"])) == 127  # 128 patterns minus the NaN
    assert len(fp.representable_values(E3M2)) == 7 * 4
    with pytest.raises(ValueError):
        fp.representable_values(FORMATS["fp32"])


# ---- bytes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16,
                                   torch.float8_e4m3fn, torch.int8, torch.bool, torch.complex64])
def test_tensor_nbytes(dtype: torch.dtype) -> None:
    t = torch.zeros(3, 5, dtype=dtype)
    assert fp.tensor_nbytes(t) == t.untyped_storage().nbytes() == t.nbytes
    assert fp.tensor_nbytes(torch.empty(0, dtype=dtype)) == 0


def test_tensor_nbytes_meta_and_scalar() -> None:
    assert fp.tensor_nbytes(torch.empty(7_000_000_000, dtype=torch.bfloat16, device="meta")) == 14_000_000_000
    assert fp.tensor_nbytes(torch.tensor(1.0)) == 4


def test_running_sums_match_numpy_accumulate() -> None:
    rng = np.random.default_rng(6)
    x = rng.uniform(0.01, 1.0, 5000)
    for key, np_dtype in (("fp16", np.float16), ("fp32", np.float32)):
        expected = np.add.accumulate(x.astype(np_dtype)).astype(np.float64)  # rounds after each add
        assert np.array_equal(fp.running_sums(x, FORMATS[key]), expected), key


def test_running_sums_bf16_match_torch_scalar_adds() -> None:
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.uniform(-1.0, 1.0, 1000)).to(torch.bfloat16)
    s = torch.zeros((), dtype=torch.bfloat16)
    expected = []
    for v in x:
        s = s + v
        expected.append(float(s))
    assert fp.running_sums(x.double().numpy(), FORMATS["bf16"]).tolist() == expected


def test_sequential_sum_stagnates() -> None:
    ones = np.ones(5000)
    assert fp.sequential_sum(ones, FORMATS["fp16"]) == 2048.0  # 2048 + 1 is a tie, kept at 2048
    assert fp.sequential_sum(ones, FORMATS["bf16"]) == 256.0
    assert fp.sequential_sum(ones, FORMATS["fp32"]) == 5000.0
    assert fp.sequential_sum([], FORMATS["fp16"]) == 0.0


@pytest.mark.parametrize("key", ["fp16", "bf16"])
def test_kahan_sum_is_accurate(key: str) -> None:
    f = FORMATS[key]
    rng = np.random.default_rng(8)
    for n in (10, 1000, 20_000):
        x = rng.uniform(0.01, 1.0, n)
        exact = math.fsum(fp.round_to_format(v, f) for v in x)
        k = fp.kahan_sum(x, f)
        assert abs(k - exact) <= fp.ulp(exact, f), (key, n, k, exact)
        assert fp.round_to_format(k, f) == k
    assert fp.kahan_sum(np.ones(5000), f) == fp.round_to_format(5000.0, f)  # bf16 cannot hold 5000: 4992
    assert fp.kahan_sum([], f) == 0.0


def test_kahan_sum_fp32_close_to_fsum() -> None:
    x = np.random.default_rng(9).standard_normal(20_000).astype(np.float32).astype(np.float64)
    assert abs(fp.kahan_sum(x, FORMATS["fp32"]) - math.fsum(x)) <= 2 * fp.ulp(np.abs(x).sum(), FORMATS["fp32"])
