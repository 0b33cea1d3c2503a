"""Chapter 11's grading harness: run a student's collective on gloo ranks and check what every rank returns.

``check_collective(fn, collective, world_size, cases)`` is what the test cells call. In every rank
it builds the case's input (``collectives.rank_input``), runs PyTorch's own collective on it where
one has the same meaning, then the student's ``fn`` with every ``torch.distributed`` collective
forbidden (``support.comm.record_collectives``); back in the test's process each rank's result is
compared with the single-process answer (``expected_result``) and with PyTorch's.

``check_all_to_all`` does the same for an all-to-all of ragged chunks (``all_to_all_case``: who
sends how many rows to whom), against ``dist.all_to_all_single`` and the single-process answer,
and refuses a non-contiguous tensor handed to a point-to-point call (gloo takes one, NCCL does
not). ``check_hierarchical_all_reduce`` runs a two-level all-reduce on ``nodes x ranks_per_node``
ranks against ``dist.all_reduce`` and checks its collectives: reduce-scatter, then an all-reduce
of 1/ranks_per_node of the bytes, then all-gather.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from course_lib.collectives import chunk_sizes, rank_input
from course_lib.exercises.checks import assert_close
from course_lib.exercises.ranks import launch_on_cpu
from course_lib.support import comm
from course_lib.support.dist import rank_device

__all__ = ["ANY", "CHECKED_COLLECTIVES", "all_to_all_case", "call_collective", "check_all_to_all", "check_collective",
           "check_hierarchical_all_reduce", "expected_result", "strided_input"]

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


def strided_input(seed: int, rank: int, length: int, dtype: torch.dtype = torch.float32, width: int = 0) -> torch.Tensor:
    """``rank_input``'s values in a tensor that is not contiguous: every other element (1-D) or a transposed matrix (2-D)."""
    x = rank_input(seed, rank, length, dtype, width)
    if width:
        return x.t().contiguous().t()
    spaced = torch.zeros(2 * length, dtype=dtype)
    spaced[::2] = x
    return spaced[::2]


def _rank_cases(fn: Callable[..., Any], collective: str, cases: list[tuple], point_to_point_only: bool) -> list[tuple]:
    """In a rank: (``fn``'s result, PyTorch's, the non-contiguous calls) per case, the collectives forbidden while ``fn`` runs."""
    forbid = tuple(comm.COLLECTIVES) if point_to_point_only else ()
    results = []
    for seed, length, dtype, root, width, strided in cases:
        x = rank_input(seed, dist.get_rank(), length, dtype, width).to(rank_device())
        theirs = _torch_version_of(collective, x, root)
        given = strided_input(seed, dist.get_rank(), length, dtype, width).to(rank_device()) if strided else x.clone()
        with comm.record_collectives(forbid=forbid, reason=_P2P_ONLY) as log:
            mine = call_collective(fn, collective, given, root)
        results.append((mine, theirs, _not_contiguous(log)))
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

    ``cases`` holds ``(seed, length[, dtype[, root[, width[, strided]]]])`` tuples (defaults float32,
    root 0, 1-D, contiguous; ``strided``: the input is ``strided_input``, not contiguous). How ``fn``
    is called follows ``collective`` (``call_collective``). Each rank's result is compared with the
    single-process reference (``expected_result``) and with PyTorch's own collective run on the
    same ranks where one exists; a tensor handed to a point-to-point call must be contiguous (NCCL
    needs it; gloo does not check). With ``point_to_point_only`` the torch
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
    defaults = (torch.float32, 0, 0, False)  # dtype, root, width, strided
    for seed, length, *rest in cases:
        full.append((seed, length, *rest, *defaults[len(rest):]))
    name = getattr(fn, "__name__", repr(fn))
    per_rank = _launch(name, world_size, timeout, _rank_cases, fn, collective, full, point_to_point_only)
    for i, (seed, length, dtype, root, width, strided) in enumerate(full):
        want = expected_result(collective, [rank_input(seed, r, length, dtype, width) for r in range(world_size)], root)
        label = (f"{name} with {world_size} ranks, length {length}{f'x{width}' if width else ''}, {dtype}, seed {seed}"
                 f"{', a non-contiguous input' if strided else ''}")
        if collective in ("broadcast", "scatter", "gather", "reduce"):
            label += f", root {root}"
        for r in range(world_size):
            mine, theirs, loose = per_rank[r][i]
            if loose:
                raise AssertionError(
                    f"{label}: rank {r} handed a non-contiguous tensor to {', '.join(loose[:3])}: gloo copes, NCCL needs "
                    "contiguous buffers (send x.contiguous(); receive into torch.empty(..., memory_format="
                    "torch.contiguous_format) and copy)")
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


def _launch(name: str, world_size: int, timeout: float, rank_fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``launch_on_cpu(rank_fn, world_size, *args)``; a run past ``timeout`` fails as a likely deadlock of ``name``."""
    try:
        return launch_on_cpu(rank_fn, world_size, *args, timeout=timeout)
    except TimeoutError:
        raise AssertionError(
            f"{name} on {world_size} ranks did not finish within {timeout:g} s: most likely a deadlock "
            "(a rank waits in recv for a message nobody sends, or every rank sends before anyone receives; "
            "post isend and irecv together, and check that sender and receiver agree on peers and sizes)"
        ) from None


def _not_contiguous(log: comm.CommLog) -> list[str]:
    """The calls of ``log`` that were handed a non-contiguous tensor, described."""
    return [f"dist.{c.op}" + (f" (peer {c.peer})" if c.peer is not None else "") for c in log.calls if not c.contiguous]


# --------------------------------------------------------------------------------------------
# All-to-all
# --------------------------------------------------------------------------------------------


def all_to_all_case(seed: int, world_size: int, max_rows: int, dtype: torch.dtype = torch.float32, width: int = 0,
                    strided: bool = False) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """(``rows[src][dst]``, ``chunks[src][dst]``): the ragged chunks every rank sends to every rank.

    Row counts are random in 0..max_rows, and rank 0 and rank 1 send each other nothing; with
    ``strided`` every chunk is a non-contiguous view (every other element of a larger tensor).
    """
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, max_rows + 1, (world_size, world_size), generator=gen).tolist()
    if world_size > 1:
        rows[0][1] = rows[1][0] = 0
    chunks = []
    for src in range(world_size):
        total = sum(rows[src])
        if strided:
            full = rank_input(seed, src, 2 * total, dtype, width)[::2] if not width else \
                rank_input(seed, src, total, dtype, 2 * width)[:, ::2]
        else:
            full = rank_input(seed, src, total, dtype, width)
        chunks.append(list(torch.split(full, rows[src])))
    return rows, chunks


def _rank_all_to_all(fn: Callable[..., Any], cases: list[tuple]) -> list[tuple]:
    """In a rank: (``fn``'s result, PyTorch's, the non-contiguous calls) per case, collectives forbidden while ``fn`` runs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for seed, max_rows, dtype, width, strided in cases:
        rows, chunks = all_to_all_case(seed, world, max_rows, dtype, width, strided)
        mine_in = chunks[rank]
        recv = [rows[src][rank] for src in range(world)]
        send_flat = torch.cat([c.contiguous() for c in mine_in])
        theirs = send_flat.new_empty((sum(recv), *send_flat.shape[1:]))
        dist.all_to_all_single(theirs, send_flat, output_split_sizes=recv, input_split_sizes=rows[rank])
        with comm.record_collectives(forbid=tuple(comm.COLLECTIVES), reason=_P2P_ONLY) as log:
            mine = fn(list(mine_in), list(recv))
        results.append((mine, list(torch.split(theirs, recv)), _not_contiguous(log)))
        dist.barrier()
    return results


def check_all_to_all(fn: Callable[..., Any], world_size: int, cases: Sequence[tuple], *, timeout: float = 30.0) -> None:
    """Run ``fn(chunks, recv_sizes)`` on ``world_size`` gloo ranks for every case and check each rank's list.

    ``cases`` holds ``(seed, max_rows[, dtype[, width[, strided]]])`` (``all_to_all_case``; defaults
    float32, 1-D, contiguous chunks). Rank r's result must be the list of the chunks every rank sent
    to r, in rank order, equal to the single-process answer and to ``dist.all_to_all_single`` run
    on the same ranks; every tensor handed to a point-to-point call must be contiguous.
    """
    full = [(seed, max_rows, *rest, *(torch.float32, 0, False)[len(rest):]) for seed, max_rows, *rest in cases]
    name = getattr(fn, "__name__", repr(fn))
    per_rank = _launch(name, world_size, timeout, _rank_all_to_all, fn, full)
    for i, (seed, max_rows, dtype, width, strided) in enumerate(full):
        rows, chunks = all_to_all_case(seed, world_size, max_rows, dtype, width, strided)
        label = (f"{name} with {world_size} ranks, {dtype}{f', {width} columns' if width else ''}"
                 f"{', non-contiguous chunks' if strided else ''}, seed {seed}")
        for r in range(world_size):
            mine, theirs, loose = per_rank[r][i]
            if loose:
                raise AssertionError(
                    f"{label}: rank {r} handed a non-contiguous tensor to {', '.join(loose[:3])}: gloo copes, NCCL "
                    "needs contiguous buffers (send chunk.contiguous(), receive into a fresh torch.empty)")
            want = [chunks[src][r] for src in range(world_size)]
            where = f"{label}: rank {r}'s result"
            if not isinstance(mine, (list, tuple)) or len(mine) != world_size:
                what = f"a {type(mine).__name__} of length {len(mine)}" if isinstance(mine, (list, tuple)) \
                    else type(mine).__name__
                raise AssertionError(f"{where}: expected a list of {world_size} tensors (one from each rank), got {what}")
            for src in range(world_size):
                hint = f" (rows[{src}][{r}] = {rows[src][r]}: the chunk rank {src} sent to rank {r})"
                assert_close(mine[src], want[src], name=f"{where}[{src}]{hint}", rtol=0.0, atol=0.0)
                assert_close(mine[src], theirs[src], name=f"{where}[{src}] against dist.all_to_all_single", rtol=0.0, atol=0.0)


# --------------------------------------------------------------------------------------------
# The two-level all-reduce
# --------------------------------------------------------------------------------------------

_REDUCE_SCATTER = ("reduce_scatter", "reduce_scatter_tensor")
_ALL_GATHER = ("all_gather", "all_gather_into_tensor")


@contextlib.contextmanager
def _groups_used() -> Iterator[list[tuple[str, list[int]]]]:
    """Within the block, note (op, ranks of its group) for every reduce-scatter, all-reduce and all-gather called."""
    seen: list[tuple[str, list[int]]] = []
    originals = {op: getattr(dist, op) for op in (*_REDUCE_SCATTER, "all_reduce", *_ALL_GATHER)}

    def noting(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        def noted(*args: Any, **kwargs: Any) -> Any:
            group = signature.bind(*args, **kwargs).arguments.get("group")
            seen.append((op, dist.get_process_group_ranks(group or dist.group.WORLD)))
            return fn(*args, **kwargs)
        return noted

    try:
        for op, fn in originals.items():
            setattr(dist, op, noting(op, fn))
        yield seen
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)


def _rank_hierarchical(fn: Callable[..., Any], ranks_per_node: int, cases: list[tuple]) -> list[tuple]:
    """In a rank: (``fn``'s result, ``dist.all_reduce``'s, the calls ``fn`` made as (op, bytes), the non-contiguous ones)."""
    results = []
    for seed, length, dtype, width in cases:
        x = rank_input(seed, dist.get_rank(), length, dtype, width)
        theirs = x.clone()
        dist.all_reduce(theirs)
        with _groups_used() as groups, comm.record_collectives() as log:
            mine = fn(x.clone(), ranks_per_node)
        results.append((mine, theirs, [(c.op, c.bytes) for c in log.calls], _not_contiguous(log), groups))
        dist.barrier()
    return results


def check_hierarchical_all_reduce(fn: Callable[..., Any], nodes: int, ranks_per_node: int, cases: Sequence[tuple], *,
                                  timeout: float = 30.0) -> None:
    """Run ``fn(t, ranks_per_node)`` on ``nodes * ranks_per_node`` gloo ranks for every case; check values and collectives.

    ``cases`` holds ``(seed, length[, dtype[, width]])``. Each rank's result must equal the sum over
    ranks and ``dist.all_reduce``; the calls must be reduce-scatter(s), then all-reduce(s) carrying at
    most 1/ranks_per_node of the tensor (the shard, padding included), then all-gather(s), every
    buffer contiguous; reduce-scatter and all-gather on the node's group (consecutive ranks), the
    all-reduce on the cross-node group (the ranks of the same local index).
    """
    world = nodes * ranks_per_node
    full = [(seed, length, *rest, *(torch.float32, 0)[len(rest):]) for seed, length, *rest in cases]
    name = getattr(fn, "__name__", repr(fn))
    per_rank = _launch(name, world, timeout, _rank_hierarchical, fn, ranks_per_node, full)
    for i, (seed, length, dtype, width) in enumerate(full):
        inputs = [rank_input(seed, r, length, dtype, width) for r in range(world)]
        want = expected_result("all_reduce", inputs)[0]
        label = (f"{name} on {nodes} nodes x {ranks_per_node} ranks, length {length}{f'x{width}' if width else ''}, "
                 f"{dtype}, seed {seed}")
        numel, size = want.numel(), want.element_size()
        shard_bytes = math.ceil(numel / ranks_per_node) * size
        for r in range(world):
            mine, theirs, calls, loose, groups = per_rank[r][i]
            _compare(mine, want, f"{label}: rank {r}'s result", dtype)
            _compare(mine, theirs, f"{label}: rank {r}'s result against dist.all_reduce", dtype)
            if numel == 0:
                continue
            where = f"{label}: rank {r}"
            if loose:
                raise AssertionError(f"{where} handed a non-contiguous tensor to {', '.join(loose[:3])}: NCCL needs "
                                     "contiguous buffers")
            other = sorted({op for op, _ in calls if op not in (*_REDUCE_SCATTER, "all_reduce", *_ALL_GATHER)})
            if other:
                raise AssertionError(f"{where} called {other}: build it from dist.reduce_scatter_tensor, dist.all_reduce "
                                     "and dist.all_gather_into_tensor on the node and cross-node groups")
            phases = [("reduce-scatter" if op in _REDUCE_SCATTER else "all-gather" if op in _ALL_GATHER else "all-reduce")
                      for op, _ in calls]
            order = [p for j, p in enumerate(phases) if j == 0 or phases[j - 1] != p]
            if order != ["reduce-scatter", "all-reduce", "all-gather"]:
                raise AssertionError(f"{where}: the collectives ran as {order}, expected reduce-scatter inside the node, "
                                     "then all-reduce across nodes, then all-gather inside the node")
            across = sum(b for op, b in calls if op == "all_reduce")
            if across > shard_bytes:
                raise AssertionError(
                    f"{where}: the cross-node all-reduce carried {across} bytes; the shard is {shard_bytes} bytes "
                    f"(1/{ranks_per_node} of {numel * size}): all-reduce only this rank's shard across nodes")
            node = list(range(r - r % ranks_per_node, r - r % ranks_per_node + ranks_per_node))
            cross = list(range(r % ranks_per_node, world, ranks_per_node))
            for op, ranks in groups:
                should = cross if op == "all_reduce" else node
                if sorted(ranks) != should:
                    kind = "the cross-node group (the ranks with its local index)" if op == "all_reduce" else "its node's group"
                    raise AssertionError(f"{where}: dist.{op} ran on the group of ranks {sorted(ranks)}; expected {kind}, "
                                         f"ranks {should} (node k holds ranks k*{ranks_per_node} .. "
                                         f"k*{ranks_per_node}+{ranks_per_node - 1})")
