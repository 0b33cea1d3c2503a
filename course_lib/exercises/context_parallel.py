"""Chapter 15's harness: seeded inputs, and what a rank's ring or all-to-all did, for the hidden tests to judge.

- ``random_qkv``: the seeded queries, keys and values the tests, demos and self-check draw.
- ``observe(fn, *args)``: run ``fn`` in a rank with every ``torch.distributed`` call recorded and the
  moments it computed marked (matmuls seen by a ``TorchFunctionMode``, calls of
  ``cp.block_attention``/``cp.block_attention_backward``, which may run as Triton kernels on a GPU);
  returns the result and a plain-data ``Traffic``.
- ``ring_problem``: what is wrong with a ring's traffic (non-contiguous buffers, bytes received,
  transfers waited for at once instead of behind a block's compute), or None.
- ``all_to_all_problem``: the same for Ulysses' all-to-alls; ``all_to_all_backward_problem`` for
  the all-to-alls of its backward pass, one by one.
- ``autograd_functions``: the ``torch.autograd.Function`` classes in a tensor's autograd graph,
  and ``borrowed_backward_problem``: whether the all-to-alls' backward is the student's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from course_lib import context_parallel as cp
from course_lib.support.comm import record_collectives
from course_lib.support.timeline import Timeline

__all__ = ["Traffic", "all_to_all_backward_problem", "all_to_all_problem", "autograd_functions", "borrowed_backward_problem",
           "observe", "random_qkv", "ring_problem"]


def random_qkv(batch: int, heads: int, n: int, d: int, dtype: torch.dtype = torch.float32, seed: int = 0,
               count: int = 3) -> list[torch.Tensor]:
    """``count`` seeded random (batch, heads, n, d) tensors on the CPU: queries, keys, values (and more of that shape)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, d, dtype=dtype, generator=g) for _ in range(count)]


_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.bmm,
            torch.Tensor.bmm, torch.mm, torch.Tensor.mm, torch.einsum, torch.baddbmm, torch.Tensor.baddbmm,
            F.scaled_dot_product_attention}


class _ComputeMarks(TorchFunctionMode):
    """Notes the time of every matmul-like torch call made inside the block."""

    def __init__(self, marks: list[float]) -> None:
        super().__init__()
        self.marks = marks

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _MATMULS:
            self.marks.append(Timeline.now())
        return func(*args, **(kwargs or {}))


@dataclass
class Traffic:
    """One rank's distributed calls as (op, bytes, start, waited, async, contiguous), and the times it computed."""

    calls: list[tuple[str, int, float, float | None, bool, bool]] = field(default_factory=list)
    marks: list[float] = field(default_factory=list)


def observe(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Traffic]:
    """``fn(*args, **kwargs)`` in this rank, with its distributed calls and its compute recorded."""
    marks: list[float] = []
    originals = {name: getattr(cp, name) for name in ("block_attention", "block_attention_backward")}

    def marked(original: Callable[..., Any]) -> Callable[..., Any]:
        def block(*a: Any, **k: Any) -> Any:
            marks.append(Timeline.now())
            return original(*a, **k)
        return block

    try:
        for name, original in originals.items():
            setattr(cp, name, marked(original))
        with record_collectives() as log, _ComputeMarks(marks):
            result = fn(*args, **kwargs)
    finally:
        for name, original in originals.items():
            setattr(cp, name, original)
    calls = [(c.op, c.bytes, c.start, c.waited, c.async_op, c.contiguous) for c in log.calls]
    return result, Traffic(calls, sorted(marks))


def _not_contiguous(traffic: Traffic) -> str | None:
    for op, _, _, _, _, contiguous in traffic.calls:
        if not contiguous:
            return (f"a tensor handed to dist.{op} is not contiguous (a view such as a transpose or a chunk along "
                    "another dimension): gloo copies it or refuses it, NCCL reads the wrong memory; call .contiguous()")
    return None


def ring_problem(traffic: Traffic, expected_bytes: int, overlapped_bytes: int) -> str | None:
    """What is wrong with a ring's traffic, or None.

    ``expected_bytes``: what the rank must receive in all (``irecv``/``recv``); ``overlapped_bytes``:
    how many of them must arrive behind compute, i.e. be posted before some block was computed and
    waited for after it (K/V in the forward; K/V and all but the homecoming dK/dV in the backward).
    """
    problem = _not_contiguous(traffic)
    if problem:
        return problem
    others = sorted({op for op, *_ in traffic.calls if op not in ("isend", "irecv", "send", "recv")})
    if others:
        return f"the ring should only send and receive, but it called {others}"
    recvs = [c for c in traffic.calls if c[0] in ("irecv", "recv")]
    received = sum(c[1] for c in recvs)
    if received != expected_bytes:
        return (f"received {received} bytes in {len(recvs)} receive(s), expected {expected_bytes}: "
                "check what travels (and in which dtype) and how many shifts the ring makes")
    if any(async_op and waited is None for _, _, _, waited, async_op, _ in recvs):
        return "a receive was never waited for: call .wait() on every request before using what it received"
    hidden = sum(n for _, n, start, waited, async_op, _ in recvs
                 if async_op and waited is not None and any(start < t < waited for t in traffic.marks))
    if hidden < overlapped_bytes:
        return (f"only {hidden} of the {overlapped_bytes} bytes that should arrive while this rank computes did: "
                "a transfer was waited for at once. Post the K/V exchange for step s+1 (batch_isend_irecv) before "
                "computing step s's block and wait for it after the compute; in the backward pass, also send the "
                "dK/dV accumulators on without waiting, and wait for the incoming ones after the next step's compute")
    return None


def all_to_all_problem(traffic: Traffic, expected_bytes: int) -> str | None:
    """What is wrong with Ulysses' traffic (only all-to-alls, contiguous, ``expected_bytes`` sent in all), or None."""
    problem = _not_contiguous(traffic)
    if problem:
        return problem
    others = sorted({op for op, *_ in traffic.calls if op not in ("all_to_all", "all_to_all_single")})
    if others:
        return f"Ulysses moves data with all-to-alls only, but it called {others}"
    sent = sum(c[1] for c in traffic.calls)
    if sent != expected_bytes:
        return (f"handed {sent} bytes to all-to-alls, expected {expected_bytes} (Q, K and V in, the output back: "
                "four tensors the size of this rank's shard)")
    return None


def all_to_all_backward_problem(traffic: Traffic, shard_bytes: int) -> str | None:
    """What is wrong with the traffic of Ulysses' backward pass (four contiguous all-to-alls of ``shard_bytes`` each), or None."""
    problem = _not_contiguous(traffic)
    if problem:
        return f"in the backward pass, {problem}"
    others = sorted({op for op, *_ in traffic.calls if op not in ("all_to_all", "all_to_all_single")})
    if others:
        return (f"the backward pass called {others}: the gradient of an all-to-all is the inverse all-to-all, "
                "nothing else (an all-reduce moves P times the bytes, and the sum it makes is not needed)")
    sizes = [c[1] for c in traffic.calls]
    if sizes != [shard_bytes] * 4:
        return (f"the backward pass handed {len(sizes)} all-to-all(s) of {sizes} bytes, expected 4 of {shard_bytes} "
                "(the output's gradient to the heads layout, then dQ, dK and dV back to the sequence layout, each "
                "as big as this rank's shard): is every backward an all-to-all of the gradient, in the gradient's dtype?")
    return None


def autograd_functions(t: torch.Tensor) -> list[str]:
    """``module.qualname`` of every ``torch.autograd.Function`` class whose node is in ``t``'s autograd graph, sorted."""
    found: set[str] = set()
    seen: set[int] = set()
    stack = [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        cls = getattr(node, "_forward_cls", None)  # set on the nodes of Python autograd Functions only
        if cls is not None:
            found.add(f"{cls.__module__}.{cls.__qualname__}")
        stack.extend(parent for parent, _ in node.next_functions)
    return sorted(found)


def borrowed_backward_problem(functions: list[str]) -> str | None:
    """Whether the all-to-alls' backward is someone else's: ``functions`` (``autograd_functions`` of the output) must
    hold a Function of the student's and none of ``torch.distributed`` or ``course_lib``; None if all is well."""
    borrowed = [f for f in functions if f.startswith(("torch.distributed.", "course_lib."))]
    if borrowed:
        return (f"the output's autograd graph holds {borrowed}: that backward is not yours "
                "(torch.distributed.nn.functional's all-to-alls and the course's reference carry their own); "
                "write the torch.autograd.Function subclasses and their backward yourself")
    if not any(not f.startswith(("torch.", "course_lib.")) for f in functions):
        return (f"no torch.autograd.Function of yours in the output's autograd graph (found {functions or 'none'}): "
                "the output must come out of your Function's apply (e.g. HeadsToSequence.apply), so that autograd "
                "runs your backward")
    return None
