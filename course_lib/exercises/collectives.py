"""Chapter 11's grading harness: run a student's collective on gloo ranks and check what every rank returns.

``check_collective(fn, collective, world_size, cases)`` is what the test cells call. In every rank
it builds the case's input (``collectives.rank_input``), runs PyTorch's own collective on it where
one has the same meaning, then the student's ``fn`` with every ``torch.distributed`` collective
forbidden (``support.comm.record_collectives``); back in the test's process each rank's result is
compared with the single-process answer (``expected_result``) and with PyTorch's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from course_lib.collectives import chunk_sizes, rank_input
from course_lib.exercises.checks import assert_close
from course_lib.exercises.ranks import launch_on_cpu
from course_lib.support import comm
from course_lib.support.dist import rank_device

__all__ = ["ANY", "CHECKED_COLLECTIVES", "call_collective", "check_collective", "expected_result"]

# The collectives ``check_collective`` knows how to call and check.
CHECKED_COLLECTIVES = (
    "broadcast", "scatter", "gather", "reduce", "all_gather", "reduce_scatter",
    "ring_reduce_scatter", "ring_all_gather", "all_reduce",
)
ANY = "__any__"  # an expected result that is not checked
_P2P_ONLY = "build this collective from send/recv (isend/irecv)"


def expected_result(collective: str, inputs: list[torch.Tensor], root: int = 0) -> list[Any]:
    """What each rank should end with, computed in one process from every rank's input (sums in float64)."""
    world = len(inputs)
    dtype = inputs[0].dtype
    total = torch.stack([x.to(torch.float64) if dtype.is_floating_point else x for x in inputs]).sum(0).to(dtype)
    if collective == "broadcast":
        return [inputs[root].clone() for _ in range(world)]
    if collective == "scatter":
        return [c.clone() for c in torch.tensor_split(inputs[root], world)]
    if collective == "gather":
        return [[x.clone() for x in inputs] if r == root else None for r in range(world)]
    if collective == "reduce":  # what the other ranks return is not specified
        return [total if r == root else ANY for r in range(world)]
    if collective == "all_gather":
        return [[x.clone() for x in inputs] for _ in range(world)]
    if collective in ("reduce_scatter", "ring_reduce_scatter"):
        return [c.clone() for c in torch.tensor_split(total, world)]
    if collective == "ring_all_gather":  # rank r contributes chunk r of its own input
        full = torch.cat([torch.tensor_split(x, world)[r] for r, x in enumerate(inputs)])
        return [full for _ in range(world)]
    if collective == "all_reduce":
        return [total for _ in range(world)]
    raise ValueError(f"unknown collective {collective!r}; expected one of {CHECKED_COLLECTIVES}")


def _torch_version_of(collective: str, x: torch.Tensor, root: int) -> Any:
    """In a rank: PyTorch's own collective on ``x`` (a copy), or None where it has no equal-semantics version."""
    rank, world = dist.get_rank(), dist.get_world_size()
    y = x.clone()
    if collective == "broadcast":
        dist.broadcast(y, root)
        return y
    if collective == "reduce":
        dist.reduce(y, root)
        return y if rank == root else None
    if collective == "all_reduce":
        dist.all_reduce(y)
        return y
    if collective == "all_gather":
        out = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(out, y)
        return out
    if collective == "gather":
        gathered = [torch.empty_like(y) for _ in range(world)] if rank == root else None
        dist.gather(y, gathered, dst=root)
        return gathered
    if collective == "ring_all_gather" and x.shape[0] % world == 0 and x.numel():
        out = [torch.empty_like(torch.tensor_split(y, world)[rank]) for _ in range(world)]
        dist.all_gather(out, torch.tensor_split(y, world)[rank].contiguous())
        return torch.cat(out)
    if collective in ("reduce_scatter", "ring_reduce_scatter", "scatter") and x.shape[0] % world == 0 and x.numel():
        if collective == "scatter":
            piece = torch.empty_like(torch.tensor_split(y, world)[rank])
            dist.scatter(piece, list(torch.tensor_split(y, world)) if rank == root else None, src=root)
            return piece
        chunks = [c.contiguous() for c in torch.tensor_split(y, world)]
        piece = torch.empty_like(chunks[rank])
        dist.reduce_scatter(piece, chunks)
        return piece
    return None


def call_collective(fn: Callable[..., Any], collective: str, x: torch.Tensor, root: int) -> Any:
    """In a rank: ``fn`` called as ``collective`` is: ``fn(x, root)``, ``fn(chunk, sizes)`` (ring_all_gather) or ``fn(x)``."""
    if collective in ("broadcast", "scatter", "gather", "reduce"):
        return fn(x, root)
    if collective == "ring_all_gather":
        rank, world = dist.get_rank(), dist.get_world_size()
        return fn(torch.tensor_split(x, world)[rank].clone(), chunk_sizes(x.shape[0], world))
    return fn(x)


def _rank_cases(fn: Callable[..., Any], collective: str, cases: list[tuple], point_to_point_only: bool) -> list[tuple]:
    """In a rank: (``fn``'s result, PyTorch's) for every case, with the collectives forbidden while ``fn`` runs."""
    forbid = tuple(comm.COLLECTIVES) if point_to_point_only else ()
    results = []
    for seed, length, dtype, root, width in cases:
        x = rank_input(seed, dist.get_rank(), length, dtype, width).to(rank_device())
        theirs = _torch_version_of(collective, x, root)
        with comm.record_collectives(forbid=forbid, reason=_P2P_ONLY):
            mine = call_collective(fn, collective, x.clone(), root)
        results.append((mine, theirs))
        dist.barrier()
    return results


def check_collective(
    fn: Callable[..., Any],
    collective: str,
    world_size: int,
    cases: Sequence[tuple],
    *,
    point_to_point_only: bool = True,
    timeout: float = 30.0,
) -> None:
    """Run ``fn`` on ``world_size`` ranks for every case and check what each rank returns.

    ``cases`` holds ``(seed, length[, dtype[, root[, width]]])`` tuples (defaults float32, root 0,
    1-D). How ``fn`` is called follows ``collective`` (``call_collective``). Each rank's result is
    compared with the single-process reference (``expected_result``) and with PyTorch's own
    collective run on the same ranks where one exists. With ``point_to_point_only`` the torch
    collectives raise an AssertionError if ``fn`` calls one. Raises ``NotDoneYet`` for an untouched
    exercise and ``AssertionError`` saying which rank, case and element went wrong, or that the
    ranks did not finish (most likely a deadlock). The ranks use gloo on the CPU even where there
    are GPUs: under NCCL, an ``irecv`` and an ``isend`` to the same peer posted one after the
    other queue on one stream, so the "post both, then wait" schedule this chapter teaches would
    hang there.
    """
    if collective not in CHECKED_COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; expected one of {CHECKED_COLLECTIVES}")
    full = []
    defaults = (torch.float32, 0, 0)  # dtype, root, width
    for seed, length, *rest in cases:
        full.append((seed, length, *rest, *defaults[len(rest):]))
    name = getattr(fn, "__name__", repr(fn))
    try:
        per_rank = launch_on_cpu(_rank_cases, world_size, fn, collective, full, point_to_point_only, timeout=timeout)
    except TimeoutError:
        raise AssertionError(
            f"{name} on {world_size} ranks did not finish within {timeout:g} s: most likely a deadlock "
            "(a rank waits in recv for a message nobody sends, or every rank sends before anyone receives; "
            "post isend and irecv together, and check that sender and receiver agree on peers and sizes)"
        ) from None
    for i, (seed, length, dtype, root, width) in enumerate(full):
        want = expected_result(collective, [rank_input(seed, r, length, dtype, width) for r in range(world_size)], root)
        label = f"{name} with {world_size} ranks, length {length}{f'x{width}' if width else ''}, {dtype}, seed {seed}"
        if collective in ("broadcast", "scatter", "gather", "reduce"):
            label += f", root {root}"
        for r in range(world_size):
            mine, theirs = per_rank[r][i]
            _compare(mine, want[r], f"{label}: rank {r}'s result", dtype)
            if theirs is not None:
                torch_name = collective.replace("ring_", "")
                _compare(mine, theirs, f"{label}: rank {r}'s result against PyTorch's dist.{torch_name}", dtype)


def _compare(got: Any, want: Any, label: str, dtype: torch.dtype) -> None:
    """One rank's result against what it should be: a tensor, a list of tensors, None (not the root) or ANY."""
    tol: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    if isinstance(want, str) and want == ANY:
        return
    if want is None:
        if got is not None:
            raise AssertionError(f"{label}: expected None (only the root gets the gathered list), got {type(got).__name__}")
        return
    if isinstance(want, list):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            what = f"a {type(got).__name__} of length {len(got)}" if isinstance(got, (list, tuple)) else type(got).__name__
            raise AssertionError(f"{label}: expected a list of {len(want)} tensors (one per rank), got {what}")
        for j, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, name=f"{label}[{j}]", **tol)
        return
    assert_close(got, want, name=label, **tol)
