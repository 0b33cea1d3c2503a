"""Chapter 10's "what each step buys": the FlashAttention forward from the teaching kernel to the Hopper one.

    python -m benchmarks.flash_steps [--out PATH] [--quick]

writes ``benchmarks/results/flash_steps_<gpu>.json`` (``-quick`` with ``--quick``), which the
chapter renders with ``course_lib.support.records.load_record``. One shape (B4 H32 N4096 D128,
bf16; ``--quick``: B1 H4 N1024), without and with the causal mask, forward TFLOP/s (4 B H N^2 D,
halved when causal) by the median of ``triton.testing.do_bench``, each mask's rows timed in three
interleaved rounds (one with ``--quick``; each row keeps the median and the spread of its rounds:
rows running the same kernel were seen to differ by 10% on an H100 when timed once each, one after
the other), in five groups:

- ``reference``: SDPA pinned to its FlashAttention-2 backend and to cuDNN's (the fastest on Hopper);
- ``step``: the teaching kernel at the chapter's fixed launch (``launch_config``), then autotuned;
  the TMA kernel (``flash_attention_hopper``) at the teaching tile (128 x 64), at 128 x 128, with
  Triton's warp specialization at 8 and at 4 warps, with FlashAttention-4's softmax tricks (the lazy
  rescale; part of the exponentials on the FMA pipes, by column or by key block; both), then autotuned;
- ``ceiling`` (non-causal): the 128 x 128 TMA kernel with parts of the online softmax taken out:
  the two products alone, then the max and rescale without the exponentials, then all of it. The
  gaps between them are the time the softmax adds to the tensor-core work; cuBLAS's bf16 rate at
  8192^3 in the same run is the device's matmul ceiling;
- ``backward``: the teaching backward (three kernels) against both SDPA backends, TFLOP/s counted
  as 2.5 forwards; then the Hopper backward (``flash_attention_backward_tma``) called directly,
  the dK/dV programs and the dQ programs launched in turn, then in one launch at each of its
  configurations, then autotuned, and autotuned through autograd (``flash_attention_tma(...,
  tma_backward=True)``) as training calls it (each autotuned row records the tile the autotuner chose);
- ``backward parts``: the Hopper backward's dK/dV programs alone and its dQ programs alone, at
  four and at three pipeline stages, each rate counted by the products that kind performs (4 and 3
  of the 7), not by the convention's 2.5 forwards: which kind a change speeds up.

Every row that computes attention (all but the parts) is checked against the FA2 backend's output
(or gradients) before it is timed; a row that fails to compile or to match is recorded with its error.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.provenance import interleaved_rounds, median_ms, record_main, run_facts
from course_lib.kernels import flash_attention as fa
from course_lib.kernels import flash_attention_hopper as fh

# isort: split
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = ["FULL", "QUICK", "ceiling_forward", "main", "measure", "steps"]

FULL: dict[str, Any] = {"batch": 4, "heads": 32, "seq": 4096, "head_dim": 128, "warmup_ms": 25, "rep_ms": 100,
                        "rounds": 3}
QUICK: dict[str, Any] = {"batch": 1, "heads": 4, "seq": 1024, "head_dim": 128, "warmup_ms": 5, "rep_ms": 20,
                         "rounds": 1}
TOLERANCE = 2e-2  # max |row - FA2| / max |FA2|, bf16
CEILINGS = {0: "two products only (P = S)", 1: "+ row max and rescale, no exp2", 2: "+ exp2: the full online softmax"}

Ms = Callable[[Callable[[], Any]], float]


@triton.jit
def _ceiling_kernel(desc_q, desc_k, desc_v, desc_o, qk_scale, N,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTMAX: tl.constexpr):
    # The TMA kernel's non-causal loop with the softmax cut back to SOFTMAX: 0 none (P is S itself),
    # 1 the running max, the rescale and the row sums without the BLOCK_M x BLOCK_N exponentials,
    # 2 all of it. Only 2 computes attention; 0 and 1 exist to be timed.
    row0 = tl.program_id(1) * N + tl.program_id(0) * BLOCK_M
    q = desc_q.load([row0, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in tl.range(0, N, BLOCK_N):
        k = desc_k.load([tl.program_id(1) * N + start_n, 0])
        s = tl.dot(q, k.T)
        if SOFTMAX == 0:
            p = s
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            if SOFTMAX == 1:
                p = s * qk_scale - m_new[:, None]
            else:
                p = tl.math.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        v = desc_v.load([tl.program_id(1) * N + start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
    if SOFTMAX != 0:
        acc = acc / l_i[:, None]
    desc_o.store([row0, 0], acc.to(q.dtype))


def ceiling_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax: int,
                    config: tuple[int, int, int, int] = (128, 128, 8, 3)) -> torch.Tensor:
    """The ceiling kernel's output for (B, H, N, D) ``q, k, v`` (N % BLOCK_M == 0): attention only when ``softmax`` is 2."""
    b, h, n, d = q.shape
    block_m, block_n, warps, stages = config
    if n % block_m or n % block_n:
        raise ValueError(f"config {config}: the blocks must divide seq={n}")
    qm, km, vm = (t.contiguous().view(-1, d) for t in (q, k, v))
    out = torch.empty_like(qm)
    dq, do = (TensorDescriptor.from_tensor(t, [block_m, d]) for t in (qm, out))
    dk, dv = (TensorDescriptor.from_tensor(t, [block_n, d]) for t in (km, vm))
    _ceiling_kernel[(n // block_m, b * h)](dq, dk, dv, do, d ** -0.5 * fa.LOG2E, n, HEAD_DIM=d, BLOCK_M=block_m,
                                           BLOCK_N=block_n, SOFTMAX=softmax, num_warps=warps, num_stages=stages)
    return out.view(b, h, n, d)


def _sdpa(backend: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return attend


def _teaching_fixed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The teaching forward kernel launched as the chapter's exercise launches it: ``launch_config``'s tile, no autotuning."""
    b, h, n, d = q.shape
    block_m, block_n, warps, stages = fa.launch_config("forward", q.dtype)
    out = torch.empty_like(q)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    fa.flash_forward_kernel[(triton.cdiv(n, block_m), b * h)](
        q, k, v, out, lse, d ** -0.5 * fa.LOG2E, n, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
        STEP=fa.attention_step, num_warps=warps, num_stages=stages)
    return out


def _tma(config: tuple[int, int, int, int] | None, **switches: Any) -> Callable[..., torch.Tensor]:
    """The TMA forward at ``config`` (None: autotuned) with ``flash_attention_forward_tma``'s ``switches``."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        return fh.flash_attention_forward_tma(q, k, v, causal, config=config, **switches)[0]
    return attend


def _forward_rows() -> list[tuple[str, str, Callable[..., torch.Tensor]]]:
    """(group, label, attention) in the order the chapter shows them."""
    return [
        ("reference", "SDPA flash (FA2)", _sdpa("FLASH_ATTENTION")),
        ("reference", "SDPA cuDNN", _sdpa("CUDNN_ATTENTION")),
        ("step", "teaching kernel, launch_config tile (no autotuning)", _teaching_fixed),
        ("step", "teaching kernel, autotuned", lambda q, k, v, causal: fa.flash_attention_forward(q, k, v, causal)[0]),
        ("step", "TMA descriptors, 128x64, 8 warps, 3 stages", _tma((128, 64, 8, 3))),
        ("step", "TMA, 128x128, 8 warps, 3 stages", _tma((128, 128, 8, 3))),
        ("step", "TMA 128x128 + warp specialization, 8 warps", _tma((128, 128, 8, 3), warp_specialize=True)),
        ("step", "TMA 128x128 + warp specialization, 4 warps", _tma((128, 128, 4, 3), warp_specialize=True)),
        ("step", "TMA 128x128 + lazy rescale (FA4)", _tma((128, 128, 8, 3), lazy_rescale=True)),
        ("step", "TMA 128x128 + odd columns' exp2 on FMA pipes (FA4)", _tma((128, 128, 8, 3), poly_exp2=1)),
        ("step", "TMA 128x128 + odd key blocks' exp2 on FMA pipes", _tma((128, 128, 8, 3), poly_exp2=2)),
        ("step", "TMA 128x128 + lazy rescale + odd columns on FMA", _tma((128, 128, 8, 3), lazy_rescale=True,
                                                                          poly_exp2=1)),
        ("step", "TMA, autotuned (flash_attention_tma)", _tma(None)),
    ]


def _autotuned(autotuner: Any) -> str | None:
    """The config ``autotuner`` launched last (None if it has not launched one), as the record shows it."""
    config = getattr(autotuner, "best_config", None)
    if config is None:
        return None
    blocks = ", ".join(f"{name} {value}" for name, value in config.kwargs.items())
    return f"{blocks}, {config.num_warps} warps, {config.num_stages} stages"


def _error(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    error = (got.float() - want.float()).abs().max().item() / (want.float().abs().max().item() or 1.0)
    if not error <= TOLERANCE:
        raise AssertionError(f"differs from SDPA flash (FA2): max error {error:.2e} x max|ref|")


Case = Callable[[], tuple[Callable[[], Any], Callable[[], None] | None]]  # builds (timed call, check or None)
Timed = tuple[Callable[[], Any], float]  # a checked row's call and the FLOPs one call is credited with


def _forward_case(attend: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: bool, want: torch.Tensor) -> Case:
    def build() -> tuple[Callable[[], Any], Callable[[], None]]:
        def call() -> torch.Tensor:
            return attend(q, k, v, causal)
        return call, lambda: _close(call(), want)
    return build


def _ceiling_case(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: int, want: torch.Tensor) -> Case:
    def build() -> tuple[Callable[[], Any], Callable[[], None] | None]:
        def call() -> torch.Tensor:
            return ceiling_forward(q, k, v, mode)
        return call, (lambda: _close(call(), want)) if mode == 2 else None  # only the full softmax is attention
    return build


def _backward_case(attend: Callable[..., torch.Tensor], leaves: list[torch.Tensor], dout: torch.Tensor, causal: bool,
                   want: tuple[torch.Tensor, ...]) -> Case:
    def build() -> tuple[Callable[[], Any], Callable[[], None]]:
        out = attend(*leaves, causal)

        def check() -> None:
            for got, expect in zip(torch.autograd.grad(attend(*leaves, causal), leaves, dout), want):
                _close(got, expect)
        return (lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)), check
    return build


def _hopper_backward_case(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, causal: bool,
                          want: tuple[torch.Tensor, ...], **options: Any) -> Case:
    """The Hopper backward called directly (no autograd) with ``options``, after one TMA forward."""
    def build() -> tuple[Callable[[], Any], Callable[[], None]]:
        out, lse = fh.flash_attention_forward_tma(q, k, v, causal)

        def call() -> tuple[torch.Tensor, ...]:
            return fh.flash_attention_backward_tma(q, k, v, out, lse, dout, causal, **options)

        def check() -> None:
            for got, expect in zip(call(), want):
                _close(got, expect)
        return call, check
    return build


def _hopper_backward_rows() -> list[tuple[str, dict[str, Any]]]:
    """(label, options of flash_attention_backward_tma) in the order the chapter shows them."""
    first = fh.TMA_BACKWARD_CONFIGS[0]
    return ([(f"Hopper, {_tile(first)}, 2 launches", {"config": first, "schedule": "two launches"}),
             (f"Hopper, {_tile(first)}, 1 launch, kinds in halves", {"config": first, "schedule": "halves"})]
            + [(f"Hopper, {_tile(c)}, 1 launch, kinds paired", {"config": c}) for c in fh.TMA_BACKWARD_CONFIGS]
            + [("Hopper, autotuned", {})])


def _part_rows() -> list[tuple[str, int, tuple[int, int, int, int], tuple[int]]]:
    """(label, N x N x d products performed, tile, launches): each kind of Hopper backward program launched alone,
    at the first two backward tiles (they differ in the pipeline's stages only)."""
    return [(f"{kind} programs alone, {_tile(tile)} ({products} products)", products, tile, launches)
            for tile in fh.TMA_BACKWARD_CONFIGS[:2]
            for kind, products, launches in (("dK/dV", 4, (1,)), ("dQ", 3, (2,)))]


def _part_case(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, causal: bool,
               tile: tuple[int, int, int, int], launches: tuple[int]) -> Case:
    """One kind of the Hopper backward's programs alone (timed only: the other kind's gradients are not written)."""
    def build() -> tuple[Callable[[], Any], None]:
        out, lse = fh.flash_attention_forward_tma(q, k, v, causal)
        return (lambda: fh.backward_launches(q, k, v, out, lse, dout, causal, None, tile, launches)), None
    return build


def _tile(config: tuple[int, int, int, int]) -> str:
    big, small, warps, stages = config
    return f"{big}x{small}, {warps} warps, {stages} stages"


def _prepared(group: str, label: str, causal: bool, flops: float, case: Case) -> tuple[dict[str, Any], Timed | None]:
    """One row built and checked, not yet timed: (its entry, (call, FLOPs per call)); a failure is the row's error."""
    entry: dict[str, Any] = {"group": group, "label": label, "causal": causal, "error": None}
    try:
        call, check = case()
        if check is not None:
            check()
    except Exception as exc:  # noqa: BLE001 - a variant that fails is a row of the record
        entry["error"] = _error(exc)
        return entry, None
    return entry, (call, flops)


def _timed(prepared: list[tuple[dict[str, Any], Timed | None]], ms: Ms, rounds: int) -> list[dict[str, Any]]:
    """Time the prepared rows in ``rounds`` interleaved rounds (every row once per round, in turn), so that a drift
    of the GPU's clocks over the run reaches all rows alike: a row's ms is the median of its rounds and its
    ``spread`` (max - min) / median, the run's own measure of its noise."""
    calls = {i: timed for i, (_, timed) in enumerate(prepared) if timed is not None}
    samples, failures = interleaved_rounds({i: partial(ms, call) for i, (call, _) in calls.items()}, rounds)
    for i, exc in failures.items():  # a row that fails when timed is recorded with why
        prepared[i][0]["error"] = _error(exc)
    for i, times in samples.items():
        entry, flops = prepared[i][0], calls[i][1]
        entry["ms"] = statistics.median(times)
        entry["tflops"] = flops / entry["ms"] / 1e9
        entry["spread"] = (max(times) - min(times)) / entry["ms"]
    for entry, _ in prepared:
        print(f"{entry['group']:9} causal={entry['causal']!s:5} {entry['label']:52} " +
              (f"{entry['tflops']:6.1f} TFLOP/s (spread {entry['spread']:.0%})" if entry["error"] is None
               else entry["error"]), flush=True)
    return [entry for entry, _ in prepared]


def steps(config: dict[str, Any], ms: Ms, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Every row of the record at ``config``'s shape; ``ms(fn)`` is the median milliseconds of a call."""
    b, h, n, d = (config[key] for key in ("batch", "heads", "seq", "head_dim"))
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, n, d, generator=gen, device=device, dtype=dtype) for _ in range(4))
    fa2 = _sdpa("FLASH_ATTENTION")
    rows: list[dict[str, Any]] = []
    for causal in (False, True):
        flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
        want = fa2(q, k, v, causal)
        prepared = []
        for group, label, attend in _forward_rows():
            prepared.append(_prepared(group, label, causal, flops, _forward_case(attend, q, k, v, causal, want)))
            if label.startswith("TMA, autotuned"):
                prepared[-1][0]["autotuned_config"] = _autotuned(fh._tma_fwd)
        if not causal:
            for mode, label in CEILINGS.items():
                prepared.append(_prepared("ceiling", label, causal, flops, _ceiling_case(q, k, v, mode, want)))
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        want_grads = torch.autograd.grad(fa2(leaves[0], leaves[1], leaves[2], causal), leaves, dout)
        for label, attend in (("SDPA flash (FA2)", fa2), ("SDPA cuDNN", _sdpa("CUDNN_ATTENTION")),
                              ("course_lib, three kernels", fa.flash_attention)):
            prepared.append(_prepared("backward", label, causal, 2.5 * flops,
                                      _backward_case(attend, leaves, dout, causal, want_grads)))
        for label, options in _hopper_backward_rows():
            prepared.append(_prepared("backward", label, causal, 2.5 * flops,
                                      _hopper_backward_case(q, k, v, dout, causal, want_grads, **options)))
        prepared.append(_prepared("backward", "Hopper, autotuned, through autograd", causal, 2.5 * flops,
                                  _backward_case(partial(fh.flash_attention_tma, tma_backward=True), leaves, dout,
                                                 causal, want_grads)))
        for entry, _ in prepared[-2:]:  # the autotuned Hopper rows: which tile the autotuner chose is part of the result
            entry["autotuned_config"] = _autotuned(fh._tma_bwd)
        for label, products, tile, launches in _part_rows():
            prepared.append(_prepared("backward parts", label, causal, products * flops / 2,
                                      _part_case(q, k, v, dout, causal, tile, launches)))
        rows += _timed(prepared, ms, config.get("rounds", 1))
    gemm = torch.randn(8192, 8192, device=device, dtype=dtype) if device == "cuda" else torch.randn(64, 64)
    matmul_tflops = 2.0 * gemm.shape[0] ** 3 / ms(lambda: gemm @ gemm) / 1e9
    return {"batch": b, "heads": h, "seq": n, "head_dim": d, "dtype": str(dtype).removeprefix("torch."),
            "matmul_tflops": matmul_tflops, "matmul_shape": [gemm.shape[0]] * 3, "rows": rows,
            "flops": "forward 4 B H N^2 D, halved when causal; backward 2.5 x forward",
            "rounds": config.get("rounds", 1),
            "timing": "per row, the median over interleaved rounds (every row of a mask once a round) of "
                      "triton.testing.do_bench's median (L2 flushed between calls); spread: (max - min) / median "
                      "over the rounds"}


def measure(quick: bool = False) -> dict[str, Any]:
    """The record: every row at the full (or quick) shape, with the facts of the run."""
    config = QUICK if quick else FULL
    return {**run_facts("python -m benchmarks.flash_steps" + (" --quick" if quick else "")),
            "sections": {"steps": steps(config, partial(median_ms, config))}}


def main(argv: list[str] | None = None) -> int:
    """Measure and write the record (CUDA, sm90 for the TMA rows)."""
    return record_main("flash_steps", __doc__, measure, argv)


if __name__ == "__main__":
    raise SystemExit(main())
