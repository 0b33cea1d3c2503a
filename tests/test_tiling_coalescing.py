"""Tests of course_lib.kernels.tiling_coalescing: under the interpreter (fp32, tiny) and compiled on a GPU."""

import math

import numpy as np
import pytest
import torch

from course_lib import env  # sets TRITON_INTERPRET=1 without a GPU: before triton

# isort: split
import triton
import triton.language as tl

from course_lib.exercises import tiling_coalescing as grading
from course_lib.exercises.checks import assert_close
from course_lib.kernels import bank_conflicts as bc
from course_lib.kernels import memory_trace as mt
from course_lib.kernels import tiling_coalescing as tc
from course_lib.profiling import matmul_flops_bytes

interpreter_only = pytest.mark.skipif(not env.INTERPRET, reason="memory tracing watches Triton's interpreter")

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


def test_program_tiles_reads_a_triton_mapping_back():
    for num_m, num_n, group in [(5, 3, 2), (7, 4, 8), (1, 1, 1), (20, 20, 3)]:  # 400 programs: in blocks
        expected = [tc.grouped_program_id(p, num_m, num_n, group) for p in range(num_m * num_n)]
        assert tc.program_tiles(tc._grouped_tile, num_m, num_n, group) == expected


@triton.jit
def _grouped_tile_one_id_at_a_time(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Python's min: right for one program id; under the interpreter, wrong for a block of them.
    per_band = GROUP_M * num_pid_n
    first = (pid // per_band) * GROUP_M
    rows = min(num_pid_m - first, GROUP_M)
    within = pid % per_band
    return first + within % rows, within // rows


@interpreter_only
def test_program_tiles_asks_a_one_id_mapping_one_id_at_a_time():
    got = tc.program_tiles(_grouped_tile_one_id_at_a_time, 17, 16, 3)  # 272 programs
    assert got == [tc.grouped_program_id(p, 17, 16, 3) for p in range(17 * 16)]


def test_l2_traffic_between_no_cache_and_a_cache_that_holds_everything():
    order = [tc.grouped_program_id(p, 4, 6, 2) for p in range(24)]
    assert tc.l2_traffic(order, 3, 10, 20, 0, 5) == 24 * 3 * (10 + 20), "no cache: every read from HBM"
    assert tc.l2_traffic(order, 3, 10, 20, 10**9, 5) == 3 * (4 * 10 + 6 * 20), "each tile once"
    with pytest.raises(ValueError):
        tc.l2_traffic(order, 0, 10, 20, 100, 5)


def test_grouped_order_needs_less_hbm_traffic_through_the_h200_l2():
    tile = 128 * 512 * 2  # 128 x 128 output tiles, K in chunks of 512, bf16
    traffic = {g: tc.l2_traffic([tc.grouped_program_id(p, 64, 64, g) for p in range(64 * 64)], 16, tile, tile,
                                60 * 2**20, 132) for g in (1, 8, 64)}
    assert traffic[8] < traffic[1] / 2, traffic
    assert traffic[64] == traffic[1], "group 64 on a 64 x 64 grid is column-major order: row-major's mirror"


# ------------------------------------------------------------------ memory traces (interpreter)

@triton.jit
def _masked_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    # A tiled matmul (contiguous operands) that loads only elements inside A and B.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def _masked_matmul(a: torch.Tensor, b: torch.Tensor, block_m: int, block_n: int, block_k: int) -> torch.Tensor:
    (m, k), n = a.shape, b.shape[1]
    c = torch.empty(m, n)
    _masked_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        a, b, c, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return c


@interpreter_only
@pytest.mark.parametrize("m,n,k,bm,bn", [(64, 48, 32, 16, 16), (37, 53, 29, 16, 32), (20, 70, 16, 32, 16)])
def test_the_traffic_formula_is_what_a_masked_tiled_matmul_loads(m, n, k, bm, bn):
    a, b = randn(m, k, seed=1), randn(k, n, seed=2)
    with mt.trace_memory() as trace:
        c = _masked_matmul(a, b, bm, bn, 16)
    assert_close(c, a @ b, rtol=1e-4, atol=1e-4)
    moved = mt.bytes_moved(trace, {"a": mt.region_of(a), "b": mt.region_of(b), "c": mt.region_of(c)})
    assert moved["a"] == (m * k * math.ceil(n / bn) * 4, 0) and moved["b"] == (k * n * math.ceil(m / bm) * 4, 0)
    assert moved["c"] == (0, m * n * 4) and moved["outside"] == (0, 0)
    assert sum(sum(v) for v in moved.values()) == tc.tiled_matmul_hbm_bytes(m, n, k, bm, bn, 4)


@interpreter_only
def test_the_library_matmul_loads_its_wrapped_rows_at_ragged_edges():
    a, b = randn(40, 32, seed=3), randn(32, 32, seed=4)  # 40 rows in tiles of 32: the second tile wraps 24 rows
    with mt.trace_memory() as trace:
        tc.matmul_with_blocks(a, b, 32, 32, 32)
    moved = mt.bytes_moved(trace, {"a": mt.region_of(a), "b": mt.region_of(b)})
    assert moved["a"][0] == 64 * 32 * 4 and moved["b"][0] == 2 * 32 * 32 * 4


@interpreter_only
def test_trace_records_each_instruction_of_each_program_with_its_mask():
    x = randn(40, 70).half()  # copies move any dtype; 32 x 64 tiles: 2 x 2 programs, edge lanes masked
    with mt.trace_memory() as trace:
        y = tc.copy(x)
    assert torch.equal(y, x)
    assert [(a.kind, a.program) for a in trace] == [
        (kind, (i, j, 0)) for i in range(2) for j in range(2) for kind in ("load", "store")]
    assert all(a.itemsize == 2 and a.addresses.shape == (32 * 64,) for a in trace)
    assert sum(int(a.mask.sum()) for a in trace if a.kind == "load") == 40 * 70
    assert mt.bytes_moved(trace, {"x": mt.region_of(x), "y": mt.region_of(y)}) == {
        "x": (40 * 70 * 2, 0), "y": (0, 40 * 70 * 2), "outside": (0, 0)}


def test_trace_is_for_the_interpreter_only():
    if env.INTERPRET:
        with mt.trace_memory() as trace:
            pass
        assert trace == []
    else:
        with pytest.raises(RuntimeError, match="interpreter"), mt.trace_memory():
            pass


def _access(kind, addresses, mask=None, itemsize=4):
    addresses = np.asarray(addresses, dtype=np.int64)
    mask = np.ones(addresses.shape, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    return mt.Access(kind, (0, 0, 0), addresses, mask, itemsize)


def test_bytes_moved_counts_active_lanes_by_region_and_outside():
    trace = [
        _access("load", [100, 104, 108, 112], mask=[True, True, False, True]),
        _access("load", [100, 100], itemsize=8),       # the same element twice: traffic twice
        _access("store", [200, 196, 300], itemsize=2),  # 196 is the last byte of... no region: outside
    ]
    regions = {"x": (100, 96), "y": (200, 8)}  # x ends at 196, where nothing begins
    assert mt.bytes_moved(trace, regions) == {"x": (3 * 4 + 2 * 8, 0), "y": (0, 2), "outside": (0, 4)}
    assert mt.bytes_moved([], regions) == {"x": (0, 0), "y": (0, 0), "outside": (0, 0)}
    with pytest.raises(ValueError, match="overlap"):
        mt.bytes_moved(trace, {"x": (100, 96), "y": (190, 8)})


def test_region_of_a_view_spans_from_its_first_to_its_last_element():
    base = torch.zeros(10, 12)
    assert mt.region_of(base) == (base.data_ptr(), 480)
    view = base[2:5, 1:4]
    assert mt.region_of(view) == (base.data_ptr() + (2 * 12 + 1) * 4, (2 * 12 + 2 + 1) * 4)
    assert mt.region_of(base[:0])[1] == 0


# ------------------------------------------------------------------ grading probes

@triton.jit
def _transpose_no_load_mask(x_ptr, y_ptr, M, N, BLOCK: tl.constexpr):
    rm = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tile = tl.load(x_ptr + rm[:, None] * N + rn[None, :])  # no mask: reads past the edges
    tl.store(y_ptr + rn[:, None] * M + rm[None, :], tl.trans(tile), mask=(rn[:, None] < N) & (rm[None, :] < M))


def _launcher(kernel, with_torch=False, launch=True):
    def transpose(x):
        m, n = x.shape
        y = torch.empty(n, m, device=x.device)
        if launch:
            kernel[(triton.cdiv(m, 16), triton.cdiv(n, 16))](x, y, m, n, BLOCK=16)
        return x.T.contiguous() if with_torch else y
    return transpose


@triton.jit
def _transpose_masked(x_ptr, y_ptr, M, N, BLOCK: tl.constexpr):
    rm = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tile = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=(rm[:, None] < M) & (rn[None, :] < N))
    tl.store(y_ptr + rn[:, None] * M + rm[None, :], tl.trans(tile), mask=(rn[:, None] < N) & (rm[None, :] < M))


def test_watch_kernel_passes_a_kernel_that_does_the_work():
    x = randn(20, 36)
    watch = grading.watch_kernel(_transpose_masked, _launcher(_transpose_masked), x)
    assert watch.launches == 1 and torch.equal(watch.result, x.T) and not watch.same_without_kernel
    assert watch.traced == env.INTERPRET and watch.loads_outside == watch.stores_outside == 0
    grading.check_kernel_work(watch, "transpose", "_transpose_masked")


@pytest.mark.parametrize("with_torch,launch,message", [(True, True, "same result"), (True, False, "0 time")])
def test_watch_kernel_catches_a_launcher_that_computes_with_torch(with_torch, launch, message):
    watch = grading.watch_kernel(_transpose_masked, _launcher(_transpose_masked, with_torch, launch), randn(20, 36))
    with pytest.raises(AssertionError, match=message):
        grading.check_kernel_work(watch, "transpose", "_transpose_masked")


@interpreter_only
def test_watch_kernel_catches_loads_past_a_ragged_edge():
    x = randn(20, 36)
    watch = grading.watch_kernel(_transpose_no_load_mask, _launcher(_transpose_no_load_mask), x)
    assert torch.equal(watch.result, x.T), "the stray values never reach the output..."
    # rows 20..31 of the 32 x 48 lanes, and row 19's columns 36..47 (the columns past the edge of rows
    # 0..18 land on the next row's elements: memory of x, read for nothing)
    assert watch.loads_outside == 12 * 48 + 12, "...but every load past the end of x is seen"
    with pytest.raises(AssertionError, match="loaded .* outside"):
        grading.check_kernel_work(watch, "transpose", "_transpose_no_load_mask")


def test_course_lib_names_finds_the_library_in_a_kernel():
    @triton.jit
    def borrowed(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
        return tc._grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)

    assert grading.course_lib_names(borrowed) == ["tc"]
    assert grading.course_lib_names(_transpose_masked) == []


# ------------------------------------------------------------------ shared-memory banks

def test_shared_memory_passes():
    assert bc.shared_memory_passes([4 * i for i in range(32)], 4) == 1, "a row of fp32: 32 banks"
    assert bc.shared_memory_passes([128 * i for i in range(32)], 4) == 32, "a column of a 32 x 32 fp32 tile"
    assert bc.shared_memory_passes([132 * i for i in range(32)], 4) == 1, "rows padded to 33 floats"
    assert bc.shared_memory_passes([0] * 32, 4) == 1, "a broadcast is one pass"
    assert bc.shared_memory_passes([2 * i for i in range(32)], 2) == 1, "two bf16 lanes share a word"
    assert bc.shared_memory_passes([8 * i for i in range(32)], 8) == 2, "256 bytes: two passes at best"
    assert bc.shared_memory_passes([16 * i for i in range(32)], 16) == 4
    assert bc.shared_memory_passes([None] * 31 + [256], 4) == 1 and bc.shared_memory_passes([None] * 32, 4) == 0
    with pytest.raises(ValueError):
        bc.shared_memory_passes([2], 4)
    with pytest.raises(ValueError):
        bc.shared_memory_passes([0], 3)


@pytest.mark.parametrize("width", [32, 64, 128])
@pytest.mark.parametrize("elem_bytes", [2, 4, 8])
def test_padded_tile_is_conflict_free_and_compact(width, elem_bytes):
    table = [[bc.tile_offset(r, c, width, elem_bytes) for c in range(width)] for r in range(width)]
    offsets = [o for row in table for o in row]
    assert len(set(offsets)) == width * width and all(o % elem_bytes == 0 for o in offsets)
    assert max(offsets) + elem_bytes <= width * width * elem_bytes + width * 8
    best = bc.fewest_passes(elem_bytes)
    assert bc.worst_passes_of_table(table, elem_bytes) == (best, best)
    assert bc.worst_passes(bc.tile_offset, width, elem_bytes) == (best, best)
    unpadded = bc.worst_passes(lambda r, c, w, e: (r * w + c) * e, width, elem_bytes)
    assert unpadded[0] == best and unpadded[1] == (16 if (width, elem_bytes) == (32, 2) else 32)


def test_tile_offset_and_worst_passes_check_their_arguments():
    with pytest.raises(ValueError):
        bc.tile_offset(32, 0, 32, 4)
    with pytest.raises(ValueError):
        bc.worst_passes(bc.tile_offset, 48, 4)
    assert [bc.fewest_passes(e) for e in (1, 2, 4, 8, 16)] == [1, 1, 1, 2, 4]


# ------------------------------------------------------------------ the GPU record (python -m benchmarks.tiling)

def test_benchmark_needs_a_gpu_and_reads_triton_shared_layouts():
    from benchmarks import tiling

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exit_info:
            tiling.main([])
        assert exit_info.value.code == 2
    shared = "#shared = #ttg.swizzled_shared<{vec = 4, perPhase = 1, maxPhase = 8, order = [0, 1]}>"
    ttgir = f"#blocked = #ttg.blocked<{{sizePerThread = [1, 4]}}>\n  {shared}\n#smem = #ttg.shared_memory\nmodule {{}}\n"
    assert tiling.shared_layouts(ttgir) == [shared]
    assert "tile[TILE][TILE + (VARIANT == 1 ? 1 : 0)]" in tiling.CUDA_SOURCE and len(tiling.VARIANTS) == 3


def test_the_record_holds_what_the_notebook_renders():
    from course_lib.support.records import RESULTS, load_record

    if not (RESULTS / "tiling_h200.json").is_file():
        pytest.skip("no tiling_h200.json yet: python -m benchmarks.tiling on an H200 writes it")
    record = load_record("tiling_h200.json")
    assert "H200" in record.provenance
    banks = record.section("bank_conflicts")
    assert banks["copy_gbps"] > 0 and len(banks["rows"]) >= 4 and "triton" in banks
    assert all({"variant", "gbps", "error"} <= set(row) for row in banks["rows"])
    grouped = record.section("grouped_order")
    assert {"group_m=1", "group_m=8", "torch.matmul (cuBLAS)"} <= set(grouped["tflops"])


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
