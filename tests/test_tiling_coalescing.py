"""Tests of course_lib.kernels.tiling_coalescing: under the interpreter (fp32, tiny) and compiled on a GPU."""

import math

import pytest
import torch

from course_lib import env
from course_lib.exercises.checks import assert_close
from course_lib.kernels import tiling_coalescing as tc
from course_lib.profiling import matmul_flops_bytes

DEVICE = env.DEVICE


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, device: torch.device = DEVICE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


# ------------------------------------------------------------------ copies and transposes (any device)

@pytest.mark.parametrize("shape", [(1, 1), (33, 70), (64, 64), (130, 17)])
def test_copies_and_transposes_are_exact(shape):
    x = randn(*shape, seed=shape[0])
    assert torch.equal(tc.copy(x), x)
    assert torch.equal(tc.copy_columns(x), x)
    for coalesced in (True, False):
        y = tc.transpose(x, coalesced=coalesced)
        assert y.is_contiguous() and torch.equal(y, x.T), f"transpose(coalesced={coalesced}) at {shape}"


def test_copies_read_strided_views():
    x = randn(48, 90)[:, ::3]  # a non-contiguous view
    assert torch.equal(tc.copy(x), x) and tc.copy(x).is_contiguous()
    assert torch.equal(tc.transpose(x.T), x)
    assert torch.equal(tc.transpose(x, coalesced=False), x.T)


def test_copy_rejects_non_2d():
    with pytest.raises(ValueError, match="2-D"):
        tc.copy(torch.zeros(4))
    with pytest.raises(ValueError, match="2-D"):
        tc.transpose(torch.zeros(2, 3, 4))


# ------------------------------------------------------------------ matmul under the interpreter (fp32)

@pytest.mark.parametrize("m,k,n,blocks,group_m", [
    (64, 48, 80, (16, 16, 16), 8),
    (37, 29, 53, (16, 32, 16), 2),    # ragged in every dimension
    (16, 100, 16, (16, 16, 32), 1),   # K not a multiple of BLOCK_K
    (50, 16, 70, (32, 16, 16), 3),
])
def test_matmul_with_blocks(m, k, n, blocks, group_m):
    a, b = randn(m, k, seed=1), randn(k, n, seed=2)
    assert_close(tc.matmul_with_blocks(a, b, *blocks, group_m=group_m), a @ b, rtol=1e-4, atol=1e-4)


def test_matmul_and_naive():
    a, b = randn(40, 36, seed=3), randn(36, 70, seed=4)
    assert_close(tc.matmul(a, b), a @ b, rtol=1e-4, atol=1e-4)
    assert_close(tc.matmul_naive(a, b, block_n=32, block_k=16), a @ b, rtol=1e-4, atol=1e-4)
    bt = randn(70, 36, seed=5)
    assert_close(tc.matmul(a, bt.T), a @ bt.T, rtol=1e-4, atol=1e-4)  # strided B


def test_matmul_checks_operands():
    with pytest.raises(ValueError, match="inner"):
        tc.matmul(randn(4, 5), randn(4, 5))
    with pytest.raises(ValueError, match="dtype"):
        tc.matmul(randn(4, 5), randn(5, 4, dtype=torch.float64))


@pytest.mark.skipif(not env.INTERPRET, reason="the fp32-only rule is the interpreter's")
def test_interpreter_refuses_16_bit_matmul():
    with pytest.raises(ValueError, match="fp32"):
        tc.matmul(randn(16, 16, dtype=torch.bfloat16), randn(16, 16, dtype=torch.bfloat16))


# ------------------------------------------------------------------ the arithmetic

def test_grouped_program_id_is_a_permutation_in_bands():
    for num_m, num_n, group in [(1, 1, 1), (5, 3, 2), (7, 4, 8), (4, 9, 4), (6, 6, 1)]:
        tiles = [tc.grouped_program_id(p, num_m, num_n, group) for p in range(num_m * num_n)]
        assert sorted(tiles) == [(i, j) for i in range(num_m) for j in range(num_n)]
        if group == 1:
            assert tiles == [(p // num_n, p % num_n) for p in range(num_m * num_n)]
    # 5 x 3 tiles, bands of 2 rows: down the band column by column, then the last band of 1 row
    assert [tc.grouped_program_id(p, 5, 3, 2) for p in range(8)] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (2, 0), (3, 0)]
    assert [tc.grouped_program_id(p, 5, 3, 2) for p in range(12, 15)] == [(4, 0), (4, 1), (4, 2)]
    with pytest.raises(ValueError):
        tc.grouped_program_id(15, 5, 3, 2)
    with pytest.raises(ValueError):
        tc.grouped_program_id(0, 5, 3, 0)


def test_tiled_matmul_hbm_bytes():
    # one tile covers everything: the minimum traffic
    assert tc.tiled_matmul_hbm_bytes(64, 64, 64, 64, 64, 2) == matmul_flops_bytes(64, 64, 64, torch.bfloat16)[1]
    # block_m = block_n = 1: every output reads a row of A and a column of B
    assert tc.tiled_matmul_hbm_bytes(8, 6, 5, 1, 1, 4) == 4 * (8 * 5 * 6 + 5 * 6 * 8 + 8 * 6)
    # ragged: 100 / 32 -> 4 tile rows, 70 / 64 -> 2 tile columns
    assert tc.tiled_matmul_hbm_bytes(100, 70, 30, 32, 64, 4) == 4 * (100 * 30 * 2 + 30 * 70 * 4 + 100 * 70)
    with pytest.raises(ValueError):
        tc.tiled_matmul_hbm_bytes(8, 8, 8, 0, 8, 4)


def test_matmul_rates():
    r = tc.matmul_rates(4096, 2048, 1024, torch.bfloat16, 2e-3)
    flops, num_bytes = 2 * 4096 * 2048 * 1024, 2 * (4096 * 1024 + 1024 * 2048 + 4096 * 2048)
    assert set(r) == {"flops", "bytes", "intensity", "flops_per_s", "bytes_per_s"}
    assert r["flops"] == flops and r["bytes"] == num_bytes
    assert math.isclose(r["intensity"], flops / num_bytes)
    assert math.isclose(r["flops_per_s"], flops / 2e-3) and math.isclose(r["bytes_per_s"], num_bytes / 2e-3)
    with pytest.raises(ValueError):
        tc.matmul_rates(8, 8, 8, torch.float32, 0.0)


# ------------------------------------------------------------------ compiled on a GPU

# fp32 follows torch's default float32 matmul precision ("highest": exact fp32 products in tl.dot,
# input_precision="ieee"), so it is compared tightly; fp16/bf16 round the fp32 accumulator once.
GPU_TOL = {torch.float32: (1e-4, 1e-3), torch.float16: (2e-3, 2e-2), torch.bfloat16: (2e-2, 1e-1)}
GPU_DTYPES = list(GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", [(1000, 1000), (129, 257), (4096, 4095), (1, 8193)])
def test_gpu_copies_and_transposes(dtype, shape):
    x = randn(*shape, dtype=dtype, seed=7)
    assert torch.equal(tc.copy(x), x)
    assert torch.equal(tc.copy_columns(x), x)
    assert torch.equal(tc.transpose(x), x.T)
    assert torch.equal(tc.transpose(x, coalesced=False), x.T)
    assert torch.equal(tc.transpose(x.T), x)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("m,k,n", [(1000, 1000, 1000), (129, 63, 257), (512, 4096, 384), (4096, 4096, 4096), (1, 64, 1)])
def test_gpu_matmul(dtype, m, k, n):
    a, b = randn(m, k, dtype=dtype, seed=8), randn(k, n, dtype=dtype, seed=9)
    rtol, atol = GPU_TOL[dtype]
    assert_close(tc.matmul(a, b), a @ b, rtol=rtol, atol=atol)
    assert_close(tc.matmul(a, b, group_m=1), a @ b, rtol=rtol, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_matmul_blocks_naive_and_strided(dtype):
    a, b = randn(300, 200, dtype=dtype, seed=10), randn(200, 170, dtype=dtype, seed=11)
    rtol, atol = GPU_TOL[dtype]
    expected = a @ b
    for blocks in [(16, 16, 16), (64, 128, 32), (128, 64, 64)]:
        assert_close(tc.matmul_with_blocks(a, b, *blocks, group_m=4), expected, rtol=rtol, atol=atol)
    assert_close(tc.matmul_naive(a, b), expected, rtol=rtol, atol=atol)
    bt = b.T.contiguous()
    assert_close(tc.matmul(a, bt.T), expected, rtol=rtol, atol=atol)


@pytest.mark.gpu
def test_gpu_matmul_tf32_when_allowed():
    a, b = randn(512, 512, seed=12), randn(512, 512, seed=13)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        # TF32 keeps 10 mantissa bits: about 1e-3 relative per product
        assert_close(tc.matmul(a, b), a.double().matmul(b.double()).float(), rtol=1e-2, atol=5e-2)
    finally:
        torch.set_float32_matmul_precision(before)
