"""Plausible wrong solutions of chapter 09's exercises (see harness.py).

Most pass the visible checks: the hidden tests catch a load past a ragged edge, a launcher that
computes with PyTorch, assumed strides, a short accumulator, masked lanes counted, a floor where a
ceiling belongs, a narrower last band forgotten, a broadcast counted as a conflict, a padding that
fails for 2- or 8-byte elements, and calls of the course's references.
"""

_TRANSPOSE_LAUNCHER = '''

def transpose_tiled(x: torch.Tensor, block_m: int = 32, block_n: int = 32) -> torch.Tensor:
    if "NotImplementedError" in inspect.getsource(transpose_kernel.fn):
        raise NotImplementedError()
    M, N = x.shape
    room = torch.full((N + block_n, M + block_m), float("nan"), device=x.device, dtype=x.dtype)
    y = room[:N, :M]
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    transpose_kernel[grid](x, y, M, N, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                           BLOCK_M=block_m, BLOCK_N=block_n)
    margin = room.clone()
    margin[:N, :M] = float("nan")
    if not torch.isnan(margin).all():
        raise AssertionError(f"transpose_kernel wrote outside the {N}x{M} output: mask the store")
    return y.contiguous()
'''

_TRANSPOSE_KERNEL_HEAD = '''@triton.jit
def transpose_kernel(
    x_ptr, y_ptr, M, N,
    stride_xm, stride_xn, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
'''

_GOOD_TRANSPOSE_BODY = '''    in_bounds = (rm[:, None] < M) & (rn[None, :] < N)
    tile = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :] * stride_xn, mask=in_bounds)
    out_bounds = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(y_ptr + rn[:, None] * stride_ym + rm[None, :] * stride_yn, tl.trans(tile), mask=out_bounds)
'''

_MATMUL_HEAD = '''@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
'''

_MATMUL_TAIL = '''    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))
'''

_GOOD_K_LOOP = '''    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a_tile = tl.load(a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak,
                         mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b_tile = tl.load(b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn,
                         mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a_tile, b_tile, acc)
'''


_LAUNCH = ("matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), "
           "c.stride(0), c.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)")


def _matmul_launcher(result: str = "c", call: str = _LAUNCH) -> str:
    return f'''

def tiled_matmul(a: torch.Tensor, b: torch.Tensor, block_m: int = 16, block_n: int = 16, block_k: int = 16) -> torch.Tensor:
    if "NotImplementedError" in inspect.getsource(matmul_kernel.fn):
        raise NotImplementedError()
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    {call}
    return {result}
'''


_TRAFFIC_FORMULA = '''

def tiled_matmul_hbm_bytes(m, n, k, block_m, block_n, itemsize):
    return (m * k * math.ceil(n / block_n) + k * n * math.ceil(m / block_m) + m * n) * itemsize
'''

_TRAFFIC_COUNTER = '''def bytes_moved(trace, regions):
    totals = {name: [0, 0] for name in regions}
    totals["outside"] = [0, 0]
    for access in trace:
        column = 0 if access.kind == "load" else 1
        addresses = access.addresses[access.mask]
        placed = np.zeros(addresses.shape, dtype=bool)
        for name, (start, size) in regions.items():
            inside = (addresses >= start) & (addresses < start + size)
            totals[name][column] += int(inside.sum()) * access.itemsize
            placed |= inside
        totals["outside"][column] += int((~placed).sum()) * access.itemsize
    return {name: tuple(v) for name, v in totals.items()}
'''

WRONG = {
    "ex09_1_transpose": {
        "only the store is masked: the last tiles load past the edge of x": _TRANSPOSE_KERNEL_HEAD + '''
    tile = tl.load(x_ptr + rm[:, None] * stride_xm + rn[None, :] * stride_xn)
    out_bounds = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(y_ptr + rn[:, None] * stride_ym + rm[None, :] * stride_yn, tl.trans(tile), mask=out_bounds)
''' + _TRANSPOSE_LAUNCHER,
        "the launcher launches the kernel, then returns x.T computed by PyTorch": _TRANSPOSE_KERNEL_HEAD
        + _GOOD_TRANSPOSE_BODY + _TRANSPOSE_LAUNCHER.replace("    return y.contiguous()", "    return x.T.contiguous()"),
        "strides assumed contiguous (N, 1 and M, 1)": _TRANSPOSE_KERNEL_HEAD + '''
    in_bounds = (rm[:, None] < M) & (rn[None, :] < N)
    tile = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=in_bounds)
    out_bounds = (rn[:, None] < N) & (rm[None, :] < M)
    tl.store(y_ptr + rn[:, None] * stride_ym + rm[None, :] * stride_yn, tl.trans(tile), mask=out_bounds)
''' + _TRANSPOSE_LAUNCHER,
        "the launcher calls the library's transpose": _TRANSPOSE_KERNEL_HEAD + _GOOD_TRANSPOSE_BODY + '''

def transpose_tiled(x, block_m=32, block_n=32):
    return tc.transpose(x)
''',
    },
    "ex09_2_tiled_matmul": {
        "only K is masked: rows of A and columns of B past the edge are read": _MATMUL_HEAD + '''\
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a_tile = tl.load(a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak, mask=rk[None, :] < K, other=0.0)
        b_tile = tl.load(b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn, mask=rk[:, None] < K, other=0.0)
        acc = tl.dot(a_tile, b_tile, acc)
''' + _MATMUL_TAIL + _matmul_launcher(),
        "fp16 products 'for the tensor cores'": _MATMUL_HEAD + _GOOD_K_LOOP.replace(
            "acc = tl.dot(a_tile, b_tile, acc)", "acc = tl.dot(a_tile.to(tl.float16), b_tile.to(tl.float16), acc)")
        + _MATMUL_TAIL + _matmul_launcher(),
        "the launcher launches the kernel, then returns a @ b": _MATMUL_HEAD + _GOOD_K_LOOP + _MATMUL_TAIL
        + _matmul_launcher(result="a @ b"),
        "strides assumed contiguous (K, 1 and N, 1)": _MATMUL_HEAD + '''    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a_tile = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b_tile = tl.load(b_ptr + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a_tile, b_tile, acc)
''' + _MATMUL_TAIL + _matmul_launcher(),
        "the launcher calls the library's tiled matmul": _MATMUL_HEAD + _GOOD_K_LOOP + _MATMUL_TAIL
        + _matmul_launcher(result="tc.matmul_with_blocks(a, b, block_m, block_n, block_k)", call="pass"),
    },
    "ex09_3_traffic": {
        "masked-off lanes counted too": _TRAFFIC_COUNTER.replace("addresses = access.addresses[access.mask]",
                                                                 "addresses = access.addresses") + _TRAFFIC_FORMULA,
        "a region includes its end address": _TRAFFIC_COUNTER.replace("(addresses < start + size)",
                                                                      "(addresses <= start + size)") + _TRAFFIC_FORMULA,
        "floor instead of ceiling for the programs per row and column": _TRAFFIC_COUNTER + _TRAFFIC_FORMULA.replace(
            "math.ceil(n / block_n)", "(n // block_n)").replace("math.ceil(m / block_m)", "(m // block_m)"),
        "the counter calls the course's reference": '''def bytes_moved(trace, regions):
    return mt.bytes_moved(trace, regions)
''' + _TRAFFIC_FORMULA,
    },
    "ex09_4_grouped_order": {
        "the last band is taken as GROUP_M rows tall": '''@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    per_band = GROUP_M * num_pid_n
    first_row = (pid // per_band) * GROUP_M
    within = pid % per_band
    return first_row + within % GROUP_M, within // GROUP_M
''',
        "the band walked row by row": '''@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    per_band = GROUP_M * num_pid_n
    first_row = (pid // per_band) * GROUP_M
    within = pid % per_band
    return first_row + within // num_pid_n, within % num_pid_n
''',
        "calls the library's mapping": '''@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    return tc._grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M)
''',
    },
    "ex09_5_bank_passes": {
        "counts lanes per bank: a broadcast counted as a conflict": '''def shared_memory_passes(addresses, access_bytes):
    lanes_in_bank = {}
    for address in addresses:
        if address is None:
            continue
        for word in range(address // 4, (address + access_bytes - 1) // 4 + 1):
            lanes_in_bank[word % 32] = lanes_in_bank.get(word % 32, 0) + 1
    return max(lanes_in_bank.values(), default=0)
''',
        "banks as wide as the element: bank = (address // access_bytes) % 32": '''\
def shared_memory_passes(addresses, access_bytes):
    elements_in_bank = {}
    for address in addresses:
        if address is None:
            continue
        element = address // access_bytes
        elements_in_bank.setdefault(element % 32, set()).add(element)
    return max((len(e) for e in elements_in_bank.values()), default=0)
''',
        "distinct addresses per bank instead of distinct words": '''def shared_memory_passes(addresses, access_bytes):
    addresses_in_bank = {}
    for address in addresses:
        if address is None:
            continue
        for word in range(address // 4, (address + access_bytes - 1) // 4 + 1):
            addresses_in_bank.setdefault(word % 32, set()).add(address)
    return max((len(a) for a in addresses_in_bank.values()), default=0)
''',
    },
    "ex09_6_conflict_free_tile": {
        "rows padded by one element": '''def tile_offset(row, col, width, elem_bytes):
    return (row * (width + 1) + col) * elem_bytes
''',
        "XOR swizzle on element indices": '''def tile_offset(row, col, width, elem_bytes):
    return (row * width + (col ^ (row % 32))) * elem_bytes
''',
        "rows padded by 4 bytes whatever the element size": '''def tile_offset(row, col, width, elem_bytes):
    return row * (width * elem_bytes + 4) + col * elem_bytes
''',
        "calls the course's reference": '''def tile_offset(row, col, width, elem_bytes):
    return bc.tile_offset(row, col, width, elem_bytes)
''',
    },
}
