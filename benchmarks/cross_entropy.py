"""Chapter 08's GPU table: cross-entropy over a large vocabulary, the course's fused kernels beside PyTorch's.

    python -m benchmarks.cross_entropy [--out PATH] [--quick]

writes ``benchmarks/results/cross_entropy_<gpu>.json`` (``cross_entropy_<gpu>-quick.json`` with
``--quick``), which the chapter renders with ``course_lib.support.records.load_record``. For bf16
logits of 8192 tokens over the vocabularies of GPT-2 (50,257) and Llama 3 (128,256), an eighth of
the rows ignored (``ignore_index=-100``), it measures three implementations of the mean loss:

- ``eager F.cross_entropy``: ``log_softmax`` and ``nll_loss``, forward and backward;
- ``torch.compile``: ``torch.compile(F.cross_entropy)``, which Inductor fuses into generated Triton kernels;
- ``course_lib``: ``course_lib.kernels.fusion.cross_entropy``, one forward and one backward kernel.

Each is first checked against ``F.cross_entropy`` in fp32 (loss and gradient, relative to their
largest value). Then, per implementation: the forward alone and the forward + backward
(``loss.backward()``, the gradient reset to None before each call), each the median of
``triton.testing.do_bench`` (which flushes L2 between calls); the peak memory that one forward +
backward allocates beyond what was allocated before it (the logits and the targets), the gradient
included; and the CUDA kernels that one forward + backward launches (``torch.profiler``). The
device-to-device copy bandwidth is measured in the same run. An implementation that fails is
recorded with its error and the run goes on.

``one_pass`` (the record's ``one_pass``): the loss and the gradient for a caller that knows the
gradient's scale up front, as ``course_lib.lm_head_loss`` does, by the forward and backward kernels
in turn against ``fusion.cross_entropy_forward_backward`` (one launch, each row read twice while
L2 may still hold it) at several grids.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.provenance import median_ms, record_main, run_facts

__all__ = ["FULL", "ONE_PASS_LAUNCHES", "QUICK", "case", "implementations", "main", "measure", "one_pass"]

FULL = {"tokens": 8192, "vocabs": [50257, 128256], "warmup_ms": 25, "rep_ms": 100, "copy_numel": 2**28}
QUICK = {"tokens": 1024, "vocabs": [50257], "warmup_ms": 5, "rep_ms": 20, "copy_numel": 2**24}
IGNORED_EVERY = 8  # one row in 8 is padding
TOLERANCE = 5e-2  # max |ours - fp32 reference| / max |reference|: a sanity check, bf16 outputs

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Timer = Callable[[Callable[[], Any], list[torch.Tensor]], float]


def implementations(device: str = "cuda") -> dict[str, Loss]:
    """The cross-entropies compared, by name (``torch.compile`` only on a GPU)."""
    from course_lib.kernels import fusion

    impls: dict[str, Loss] = {"eager F.cross_entropy": F.cross_entropy}
    if device == "cuda":
        impls["torch.compile"] = torch.compile(F.cross_entropy, dynamic=False)
    impls["course_lib"] = fusion.cross_entropy
    return impls


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.float().abs().max().item() or 1.0
    return (actual.float() - expected.float()).abs().max().item() / scale


def _cuda_kernels(fn: Callable[[], Any]) -> list[str]:
    """Names of the CUDA kernels one call of ``fn`` launches (memsets and copies left out)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memset", "Memcpy"))]


def case(tokens: int, vocab: int, dtype: torch.dtype, impls: dict[str, Loss], ms: Timer, device: str = "cuda",
         seed: int = 0) -> dict[str, Any]:
    """One shape: every implementation checked, then timed by ``ms(fn, grads_to_reset)``; a dict of plain data."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=gen) * 2).to(device, dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[::IGNORED_EVERY] = -100
    targets = targets.to(device)
    reference = logits.detach().float().requires_grad_(True)
    ref_loss = F.cross_entropy(reference, targets)
    (ref_grad,) = torch.autograd.grad(ref_loss, reference)
    itemsize = logits.element_size()
    rows = []
    for name, fn in impls.items():
        row: dict[str, Any] = {"name": name, "error": None}
        try:
            def step() -> None:
                fn(logits, targets).backward()  # noqa: B023 - called within this iteration only

            loss = fn(logits, targets)
            (grad,) = torch.autograd.grad(loss, logits)
            row["loss_error"] = _relative_error(loss.detach(), ref_loss.detach())
            row["grad_error"] = _relative_error(grad, ref_grad)
            if not max(row["loss_error"], row["grad_error"]) <= TOLERANCE:  # NaN fails too
                raise AssertionError(f"differs from fp32 F.cross_entropy: loss {row['loss_error']:.2e}, "
                                     f"gradient {row['grad_error']:.2e} (relative to the largest value)")
            del loss, grad
            row["forward_ms"] = ms(lambda: fn(logits, targets), [])  # noqa: B023
            row["step_ms"] = ms(step, [logits])
            logits.grad = None
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                row["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - before
                logits.grad = None
                names = _cuda_kernels(step)
                logits.grad = None
                row["cuda_kernels"], row["kernel_names"] = len(names), sorted(set(names))
        except Exception as exc:  # noqa: BLE001 - a failing implementation is a row of the record
            row["error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        logits.grad = None
        rows.append(row)
        print(f"{tokens} x {vocab:6d} {name:22s} " + (
            f"forward {row['forward_ms']:.3f} ms, forward + backward {row['step_ms']:.3f} ms"
            if row["error"] is None else row["error"]), flush=True)
    return {"tokens": tokens, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."),
            "ignored_rows": int((targets == -100).sum()), "logits_bytes": tokens * vocab * itemsize,
            "fused_bytes": 3 * tokens * vocab * itemsize, "rows": rows}


ONE_PASS_LAUNCHES = ((1, 4096), (2, 4096), (4, 4096), (8, 4096), (1, 16384), (2, 8192), (2, 16384), (4, 8192))
"""(programs per SM, block of columns) that ``one_pass`` times ``fusion.cross_entropy_forward_backward`` at,
beside one program per row: fewer rows in flight keep L2's copy, larger blocks keep more bytes in flight."""


def one_pass(tokens: int, vocab: int, ms: Timer, device: str = "cuda", seed: int = 0) -> dict[str, Any]:
    """The loss and its gradient by two launches against one, at several grids; each row checked, then timed.

    The two launches read the logits twice from memory and write the gradient once; the one launch
    reads each row twice too, but the second read may come from L2 if few enough rows are in flight.
    GB/s counts one read and one write of the logits (the least any of them must move).
    """
    from course_lib.kernels import fusion

    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=gen) * 2).to(device, torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[::IGNORED_EVERY] = -100
    targets = targets.to(device)
    scale = torch.tensor([1.0 / int((targets != -100).sum())], device=device)
    out = torch.empty_like(logits)

    def two_launches() -> tuple[torch.Tensor, torch.Tensor]:
        losses, lse = fusion.cross_entropy_forward(logits, targets)
        return losses, fusion.cross_entropy_backward(logits, targets, lse, scale, out=out)

    want_losses, want_grad = (t.float() for t in two_launches())
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 1
    def one_launch(programs: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        return fusion.cross_entropy_forward_backward(logits, targets, scale, out=out, programs=programs,
                                                     block_size=block)

    default = fusion.CROSS_ENTROPY_BLOCK
    variants: list[tuple[str, Callable[[], Any]]] = [("two launches (forward, backward)", two_launches)]
    variants += [(f"one launch, {per_sm} per SM, block {block}", partial(one_launch, per_sm * sms, block))
                 for per_sm, block in ONE_PASS_LAUNCHES]
    variants.append((f"one launch, one per row, block {default}", partial(one_launch, tokens, default)))
    rows = []
    for name, fn in variants:
        row: dict[str, Any] = {"name": name, "error": None}
        try:
            out.zero_()
            losses, grad = fn()
            row["loss_error"] = _relative_error(losses, want_losses)
            row["grad_error"] = _relative_error(grad, want_grad)
            if not max(row["loss_error"], row["grad_error"]) <= 2**-8:  # the same arithmetic, compiled apart: bf16 rounding
                raise AssertionError(f"differs from the two launches: losses {row['loss_error']:.2e}, "
                                     f"gradient {row['grad_error']:.2e}")
            row["ms"] = ms(fn, [])
            row["gbps"] = 2 * logits.numel() * logits.element_size() / (row["ms"] * 1e-3) / 1e9
        except Exception as exc:  # noqa: BLE001 - a failing variant is a row of the record
            row["error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        rows.append(row)
        print(f"{tokens} x {vocab:6d} {name:38s} " + (
            f"{row['ms']:.3f} ms, {row['gbps']:7.1f} GB/s" if row["error"] is None else row["error"]), flush=True)
    return {"tokens": tokens, "vocab": vocab, "sms": sms, "rows": rows}


def _copy_gbps(numel: int, ms: Timer) -> float:
    """Device-to-device bandwidth of ``dst.copy_(src)`` on fp32, bytes read + written."""
    src = torch.randn(numel, device="cuda")
    dst = torch.empty_like(src)
    return 2 * numel * 4 / (ms(lambda: dst.copy_(src), []) * 1e-3) / 1e9


def measure(quick: bool = False) -> dict[str, Any]:
    """The record: every shape, with the facts of the run (date, GPU, driver, versions)."""
    config: dict[str, Any] = QUICK if quick else FULL

    def ms(fn: Callable[[], Any], grads: list[torch.Tensor]) -> float:
        return median_ms(config, fn, grads)

    impls = implementations("cuda")
    cases, passes = [], []
    for vocab in config["vocabs"]:
        cases.append(case(config["tokens"], vocab, torch.bfloat16, impls, ms))
        torch.cuda.empty_cache()
        passes.append(one_pass(config["tokens"], vocab, ms))
        torch.cuda.empty_cache()
    return {
        **run_facts("python -m benchmarks.cross_entropy" + (" --quick" if quick else "")),
        "copy_gbps": _copy_gbps(config["copy_numel"], ms),
        "rate": "3 passes over the logits (the fused kernels' bytes) / forward + backward time",
        "cases": cases,
        "one_pass": passes,
    }


def main(argv: list[str] | None = None) -> int:
    """Measure and write the record (CUDA only)."""
    return record_main("cross_entropy", __doc__, measure, argv)


if __name__ == "__main__":
    raise SystemExit(main())
