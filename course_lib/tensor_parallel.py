"""Tensor (operator-level) parallelism in the style of Megatron-LM (Shoeybi et al., 2019).

A weight matrix is split across the ranks of a process group, each rank computes with its
slice, and two conjugate operators stitch the pieces back together:

    f = CopyToParallelRegion      identity forward, all-reduce of the gradient backward
    g = ReduceFromParallelRegion  all-reduce forward, identity backward

A column-parallel Linear (output features split) followed by a row-parallel Linear (input
features split) needs one f before and one g after: that is the Megatron MLP, and the same
pattern split by heads gives parallel attention. Every module here is built from the
single-device module (``from_linear`` / ``from_module``), so a test can run both and compare:

    def rank_fn(ff, x):
        rank, world = dist.get_rank(), dist.get_world_size()
        return ParallelMLP.from_module(ff, rank, world)(x)     # equals ff(x) on every rank

    launch(rank_fn, 2, models.FeedForward(cfg), x)

Construction needs no process group (rank and world size are arguments); ``forward`` does.
Everything takes an optional ``group`` (default: the whole world) for use with device meshes.

On several GPUs (or gloo CPU ranks with ``--small``) the module checks every parallel layer,
forward and backward, against the single-device module, and counts and times a block:

    torchrun --nproc_per_node 4 -m course_lib.tensor_parallel [--small]
"""

from __future__ import annotations

import contextlib
import copy
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast, overload

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import models
from course_lib.exercises.checks import NotDoneYet

T = TypeVar("T")
M = TypeVar("M", bound=nn.Module)

__all__ = [
    "CommLog",
    "ColumnParallelLinear",
    "CopyToParallelRegion",
    "GatherFromParallelRegion",
    "ParallelAttention",
    "ParallelBlock",
    "ParallelMLP",
    "ReduceFromParallelRegion",
    "RowParallelLinear",
    "ScatterToParallelRegion",
    "VocabParallelEmbedding",
    "all_reduce_wire_bytes",
    "copy_to_parallel_region",
    "count_collectives",
    "gather_from_parallel_region",
    "launch_checked",
    "reduce_from_parallel_region",
    "regroup_qkv_for_sharding",
    "scatter_to_parallel_region",
    "shard_range",
    "tp_comm_bytes_per_layer",
    "vocab_parallel_cross_entropy",
    "warm_up_autograd",
    "check_sharded",
    "main",
]


# --------------------------------------------------------------------------------------------
# The conjugate operators f and g, and the gather/scatter pair
# --------------------------------------------------------------------------------------------


def _all_reduce_copy(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum of ``x`` over the ranks, in a fresh contiguous tensor (the input is left untouched)."""
    out = x.clone(memory_format=torch.contiguous_format)  # backends work on flat buffers (NCCL insists)
    dist.all_reduce(out, group=group)
    return out


def shard_range(size: int, rank: int, world_size: int, what: str = "dimension") -> slice:
    """The slice of ``range(size)`` that ``rank`` holds when ``size`` is split evenly over ``world_size``."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got rank={rank}, world_size={world_size}")
    if size % world_size:
        raise ValueError(f"{what} of size {size} does not split evenly over world_size={world_size}")
    part = size // world_size
    return slice(rank * part, (rank + 1) * part)


class CopyToParallelRegion(torch.autograd.Function):
    """Megatron's f: the identity in the forward pass, an all-reduce (sum) of the gradient in the backward pass.

    Put it where a replicated activation enters a parallel region: every rank uses the same
    input, so the input's gradient is the sum of the partial gradients of all ranks.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce_copy(grad, ctx.group), None


class ReduceFromParallelRegion(torch.autograd.Function):
    """Megatron's g: an all-reduce (sum) in the forward pass, the identity in the backward pass.

    Put it where partial results leave a parallel region: the sum is replicated on every
    rank, so each rank's partial result receives the full (replicated) gradient unchanged.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        return _all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _all_gather_last(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension, in rank order."""
    world = dist.get_world_size(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _my_chunk_last(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """This rank's slice of the last dimension of a replicated ``x`` (a contiguous copy)."""
    sl = shard_range(x.shape[-1], dist.get_rank(group), dist.get_world_size(group), "last dimension")
    return x[..., sl].contiguous()


class GatherFromParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension in the forward pass; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _my_chunk_last(grad, ctx.group), None


class ScatterToParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dimension in the forward pass; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        ctx.group = group
        return _my_chunk_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_last(grad, ctx.group), None


def copy_to_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """f(x): identity forward, all-reduce of the gradient backward."""
    return CopyToParallelRegion.apply(x, group)


def reduce_from_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """g(x): all-reduce forward, identity backward."""
    return ReduceFromParallelRegion.apply(x, group)


def gather_from_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-gather ``x`` along its last dimension (backward: keep this rank's slice)."""
    return GatherFromParallelRegion.apply(x, group)


def scatter_to_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """This rank's slice of the last dimension of ``x`` (backward: all-gather)."""
    return ScatterToParallelRegion.apply(x, group)


# --------------------------------------------------------------------------------------------
# Parallel layers
# --------------------------------------------------------------------------------------------


@overload
def _param(t: torch.Tensor) -> nn.Parameter: ...
@overload
def _param(t: None) -> None: ...


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    """A fresh Parameter holding a contiguous copy of ``t`` (so a shard does not keep the full tensor alive)."""
    return None if t is None else nn.Parameter(t.detach().clone(memory_format=torch.contiguous_format))


class ColumnParallelLinear(nn.Module):
    """A Linear whose output features are split over the ranks: rank r holds rows r*m/n : (r+1)*m/n of W and b.

    Forward: ``f(x)`` (no communication), then the local matmul, giving this rank's slice of the
    output features. With ``gather_output`` the slices are all-gathered into the full output.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, *, gather_output: bool = False, group: Any = None
    ) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.bias = _param(bias)
        self.gather_output = gather_output
        self.group = group

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, rank: int, world_size: int, gather_output: bool = False, group: Any = None
    ) -> ColumnParallelLinear:
        """Rank ``rank``'s shard of ``linear`` (output features split evenly over ``world_size``)."""
        rows = shard_range(linear.out_features, rank, world_size, "out_features")
        bias = None if linear.bias is None else linear.bias[rows]
        return cls(linear.weight[rows], bias, gather_output=gather_output, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Local slice of ``x @ W.T + b`` (or the full output with ``gather_output``)."""
        y = F.linear(copy_to_parallel_region(x, self.group), self.weight, self.bias)
        return gather_from_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"local weight {tuple(self.weight.shape)}, bias={self.bias is not None}, gather_output={self.gather_output}"


class RowParallelLinear(nn.Module):
    """A Linear whose input features are split over the ranks: rank r holds columns r*k/n : (r+1)*k/n of W.

    Forward: the local matmul gives a partial sum of the full output; ``g`` all-reduces the
    partial sums, and the bias (replicated, not split) is added once, after the reduction.
    With ``input_is_parallel=False`` the layer first takes this rank's slice of a full input.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, *, input_is_parallel: bool = True, group: Any = None
    ) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.bias = _param(bias)
        self.input_is_parallel = input_is_parallel
        self.group = group

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, rank: int, world_size: int, input_is_parallel: bool = True, group: Any = None
    ) -> RowParallelLinear:
        """Rank ``rank``'s shard of ``linear`` (input features split evenly over ``world_size``; bias replicated)."""
        cols = shard_range(linear.in_features, rank, world_size, "in_features")
        return cls(linear.weight[:, cols], linear.bias, input_is_parallel=input_is_parallel, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` from this rank's slice of the input features (or the full input)."""
        if not self.input_is_parallel:
            x = scatter_to_parallel_region(x, self.group)
        y = reduce_from_parallel_region(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"local weight {tuple(self.weight.shape)}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}"
        )


class ParallelMLP(nn.Module):
    """The Megatron MLP: column-parallel ``fc``, GELU on the local slice, row-parallel ``proj``.

    One all-reduce in the forward pass (in ``proj``'s g) and one in the backward pass (in ``fc``'s f).
    """

    def __init__(self, fc: ColumnParallelLinear, proj: RowParallelLinear, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = fc
        self.proj = proj
        self.dropout = nn.Dropout(dropout)

    @classmethod
    def from_module(
        cls, ff: models.FeedForward, rank: int | None = None, world_size: int | None = None, group: Any = None
    ) -> ParallelMLP:
        """Rank ``rank``'s shard of a ``models.FeedForward`` (rank and world size default to the group's)."""
        rank, world_size = _rank_world(rank, world_size, group)
        fc = ColumnParallelLinear.from_linear(ff.fc, rank, world_size, gather_output=False, group=group)
        proj = RowParallelLinear.from_linear(ff.proj, rank, world_size, input_is_parallel=True, group=group)
        return cls(fc, proj, ff.dropout.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of a replicated ``x``; the result is replicated on every rank."""
        return self.dropout(self.proj(F.gelu(self.fc(x))))


def _rank_world(rank: int | None, world_size: int | None, group: Any) -> tuple[int, int]:
    """Fill in rank and world size from the process group where they are not given."""
    if rank is None or world_size is None:
        if not dist.is_initialized():
            raise ValueError("rank and world_size are needed when no process group is initialised")
        rank = dist.get_rank(group) if rank is None else rank
        world_size = dist.get_world_size(group) if world_size is None else world_size
    return rank, world_size


def _head_shard_qkv(qkv: nn.Linear, heads: slice, head_dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of the fused qkv projection for the heads in ``heads``, as [q | k | v] of those heads."""
    d = qkv.out_features // 3
    rows = slice(heads.start * head_dim, heads.stop * head_dim)
    weight = torch.cat([qkv.weight[i * d:(i + 1) * d][rows] for i in range(3)])
    bias = None if qkv.bias is None else torch.cat([qkv.bias[i * d:(i + 1) * d][rows] for i in range(3)])
    return weight, bias


class ParallelAttention(nn.Module):
    """Causal self-attention with the heads split over the ranks (Megatron): qkv column-parallel, proj row-parallel.

    Rank r holds heads r*H/n : (r+1)*H/n: their rows of the fused qkv weight (for q, k and v)
    and the matching columns of proj. Each rank attends with its own heads only; proj's g
    sums the ranks' contributions. The forward pass is ``models.CausalSelfAttention``'s own,
    which reads the number of heads from the width of qkv's output.
    """

    forward = models.CausalSelfAttention.forward

    def __init__(
        self, qkv: ColumnParallelLinear, proj: RowParallelLinear, head_dim: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.dropout = dropout
        self.qkv = qkv
        self.proj = proj
        self.resid_dropout = nn.Dropout(dropout)

    @classmethod
    def from_module(
        cls,
        attn: models.CausalSelfAttention,
        rank: int | None = None,
        world_size: int | None = None,
        group: Any = None,
    ) -> ParallelAttention:
        """Rank ``rank``'s heads of a ``models.CausalSelfAttention`` (the head count must divide evenly)."""
        rank, world_size = _rank_world(rank, world_size, group)
        n_head = attn.proj.in_features // attn.head_dim
        heads = shard_range(n_head, rank, world_size, "the number of heads")
        weight, bias = _head_shard_qkv(attn.qkv, heads, attn.head_dim)
        qkv = ColumnParallelLinear(weight, bias, gather_output=False, group=group)
        cols = slice(heads.start * attn.head_dim, heads.stop * attn.head_dim)
        proj = RowParallelLinear(attn.proj.weight[:, cols], attn.proj.bias, input_is_parallel=True, group=group)
        return cls(qkv, proj, attn.head_dim, attn.dropout)


class ParallelBlock(nn.Module):
    """A ``models.Block`` with tensor-parallel attention and MLP; the LayerNorms stay replicated."""

    def __init__(self, ln_1: nn.LayerNorm, attn: ParallelAttention, ln_2: nn.LayerNorm, mlp: ParallelMLP) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = ln_1, attn, ln_2, mlp

    @classmethod
    def from_module(
        cls, block: models.Block, rank: int | None = None, world_size: int | None = None, group: Any = None
    ) -> ParallelBlock:
        """Rank ``rank``'s shard of a transformer block (replicated LayerNorms are copied)."""
        rank, world_size = _rank_world(rank, world_size, group)
        ln_1, ln_2 = (_copy_layernorm(ln) for ln in (block.ln_1, block.ln_2))
        attn = ParallelAttention.from_module(block.attn, rank, world_size, group)
        mlp = ParallelMLP.from_module(block.mlp, rank, world_size, group)
        return cls(ln_1, attn, ln_2, mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same computation as ``models.Block``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _copy_layernorm(ln: nn.LayerNorm) -> nn.LayerNorm:
    """An independent copy of a LayerNorm (same shape, eps and parameters)."""
    new = nn.LayerNorm(ln.normalized_shape, eps=ln.eps, bias=ln.bias is not None,
                       device=ln.weight.device, dtype=ln.weight.dtype)
    new.load_state_dict(ln.state_dict())
    return new


# --------------------------------------------------------------------------------------------
# Vocabulary-parallel embedding and cross-entropy
# --------------------------------------------------------------------------------------------


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows: rank r holds token ids r*V/n : (r+1)*V/n.

    Each rank looks up the ids it owns, writes zeros for the others, and g all-reduces: every
    position then holds exactly one rank's row.
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int, group: Any = None) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.vocab_start = vocab_start
        self.group = group

    @classmethod
    def from_embedding(
        cls, emb: nn.Embedding, rank: int, world_size: int, group: Any = None
    ) -> VocabParallelEmbedding:
        """Rank ``rank``'s rows of ``emb`` (the vocabulary must split evenly)."""
        rows = shard_range(emb.num_embeddings, rank, world_size, "the vocabulary")
        return cls(emb.weight[rows], rows.start, group)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Embeddings of token ids ``idx`` (any shape) -> ``idx.shape + (d,)``, replicated."""
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_parallel_region(out, self.group)


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor, targets: torch.Tensor, group: Any = None, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy from logits split by vocabulary (this rank holds a contiguous slice of the last dimension).

    Three all-reduces of one number per token replace gathering the full logits: the maximum
    (for a stable exponent), the sum of exponentials and the target's logit. ``targets`` hold
    global token ids. ``reduction`` is "mean", "sum" or "none", as in ``F.cross_entropy``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    part = local_logits.shape[-1]
    start = dist.get_rank(group) * part
    # The maximum only keeps exp() in range; the loss does not depend on it, so no gradient flows.
    with torch.no_grad():
        peak = local_logits.max(dim=-1).values.contiguous()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = local_logits - peak.unsqueeze(-1)
    sum_exp = reduce_from_parallel_region(shifted.exp().sum(dim=-1), group)
    local_t = targets - start
    mine = (local_t >= 0) & (local_t < part)
    picked = shifted.gather(-1, local_t.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from_parallel_region(picked * mine.to(picked.dtype), group)
    loss = sum_exp.log() - target_logit
    if reduction == "mean":
        return loss.mean()
    return loss.sum() if reduction == "sum" else loss


# --------------------------------------------------------------------------------------------
# Communication volume: the formula and a counter
# --------------------------------------------------------------------------------------------


def tp_comm_bytes_per_layer(b: int, s: int, h: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Bytes handed to all-reduce per transformer layer under Megatron tensor parallelism.

    Forward: g after attention and g after the MLP, each on the (b, s, h) activation; backward:
    f before attention and f before the MLP, each on a gradient of the same shape. So
    ``{"forward": 2 b s h e, "backward": 2 b s h e}`` with e bytes per element. The count does
    not depend on the number of ranks: each all-reduce carries the full activation.
    """
    for name, v in (("b", b), ("s", s), ("h", h)):
        if v < 0:
            raise ValueError(f"{name} must be non-negative, got {v}")
    per = 2 * b * s * h * torch.empty((), dtype=dtype).element_size()
    return {"forward": per, "backward": per}


def all_reduce_wire_bytes(payload_bytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``payload_bytes``: 2 (n-1)/n of it."""
    return 2 * (world_size - 1) / world_size * payload_bytes


@dataclass
class CommLog:
    """What ``count_collectives`` saw: one (operation, bytes) entry per collective call, in order."""

    calls: list[tuple[str, int]] = field(default_factory=list)

    def count(self, op: str | None = None) -> int:
        """Number of calls (of ``op`` only, if given)."""
        return sum(1 for name, _ in self.calls if op is None or name == op)

    def bytes(self, op: str | None = None) -> int:
        """Total payload bytes (of ``op`` only, if given)."""
        return sum(n for name, n in self.calls if op is None or name == op)

    def clear(self) -> None:
        """Forget what was recorded so far."""
        self.calls.clear()


_COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


@contextlib.contextmanager
def count_collectives() -> Iterator[CommLog]:
    """Record every ``torch.distributed`` collective called inside (payload bytes of this rank's tensor).

    It wraps the functions of the ``torch.distributed`` module, so it sees code that calls
    ``dist.all_reduce(...)`` and friends; DTensor goes through other paths (use
    ``torch.distributed.tensor.debug.CommDebugMode`` there).
    """
    log = CommLog()
    originals = {name: getattr(dist, name) for name in _COUNTED}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            at = 1 if name in ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor") else 0
            tensor = args[at] if len(args) > at else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            log.calls.append((name, tensor.numel() * tensor.element_size()))
            return fn(*args, **kwargs)

        return counted

    try:
        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        yield log
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


# --------------------------------------------------------------------------------------------
# Running checks in ranks
# --------------------------------------------------------------------------------------------


def warm_up_autograd() -> None:
    """Run one tiny backward with an explicit gradient here, so that forked ranks do not each pay its first-call imports.

    (torch imports a few hundred modules, about half a second, on the first such backward of a
    process; ranks forked before that happens all repeat it.)
    """
    x = torch.zeros(2, requires_grad=True)
    (x * 1.0).backward(torch.ones(2))


class _Checked:
    """Runs ``fn`` in a rank and turns a failed check into a value, so the caller can re-raise it plainly."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from course_lib.exercises.checks import recording

        with recording() as records:
            try:
                return ("ok", self.fn(*args, **kwargs), records)
            except NotImplementedError as exc:
                return ("todo", str(exc), records)
            except AssertionError as exc:
                return ("fail", f"{type(exc).__name__}: {exc}" if isinstance(exc, NotDoneYet) else str(exc), records)


def launch_checked(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0, **kwargs: Any) -> list[Any]:
    """``dist.launch`` for tests: a rank's failed assertion is raised here as an AssertionError naming the rank.

    A rank that hits an unfinished exercise (``NotImplementedError``, or ``testing.call``'s
    NotDoneYet) makes this raise ``NotDoneYet``; other exceptions come back as ``RankError``.
    Under the grader the ranks run in the student's kernel, and then once more in the grader's
    own process with the course's reference in place of the student's code: every value a check
    in the ranks compared must equal the reference run's (``testing.reference_run``).
    """
    from course_lib.exercises.checks import compare_recordings, reference_run
    from course_lib.support.dist import launch

    warm_up_autograd()
    results = launch(_Checked(fn), world_size, *args, timeout=timeout, **kwargs)
    for rank, (status, value, _) in enumerate(results):
        if status == "todo" or (status == "fail" and value.startswith("NotDoneYet: ")):
            message = value.removeprefix("NotDoneYet: ") or "not implemented yet"
            raise NotDoneYet(f"{message} (raised in rank {rank})")
    for rank, (status, value, _) in enumerate(results):
        if status == "fail":
            raise AssertionError(f"rank {rank} of {world_size}: {value}")
    reference = reference_run(_Checked(fn), world_size, *args, timeout=timeout, **kwargs)
    for rank, ((_, _, got), (_, _, want)) in enumerate(zip(results, reference or [])):
        compare_recordings(got, want, f"rank {rank} of {world_size}")
    return [value for _, value, _ in results]


# --------------------------------------------------------------------------------------------
# PyTorch's own tensor parallelism (DTensor)
# --------------------------------------------------------------------------------------------


def regroup_qkv_for_sharding(attn: models.CausalSelfAttention, world_size: int) -> models.CausalSelfAttention:
    """Reorder the rows of ``attn.qkv`` in place so that an even split into ``world_size`` row blocks gives each rank
    [q | k | v] of its own heads; return ``attn``.

    PyTorch's ``ColwiseParallel`` cuts the fused qkv weight into contiguous row blocks. In the
    layout [q of all heads | k of all heads | v of all heads] that block would hold, for two
    ranks, all of q and half of k: the wrong tensors. After regrouping, the model computes
    something different on one device (``chunk(3)`` now splits the wrong way), so regroup only
    the copy that is being parallelised.
    """
    n_head = attn.proj.in_features // attn.head_dim
    pieces_w: list[torch.Tensor] = []
    pieces_b: list[torch.Tensor] = []  # stays empty without a bias
    for rank in range(world_size):
        heads = shard_range(n_head, rank, world_size, "the number of heads")
        w, b = _head_shard_qkv(attn.qkv, heads, attn.head_dim)
        pieces_w.append(w)
        if b is not None:
            pieces_b.append(b)
    with torch.no_grad():
        attn.qkv.weight.copy_(torch.cat(pieces_w))
        if attn.qkv.bias is not None:
            attn.qkv.bias.copy_(torch.cat(pieces_b))
    return attn


# --------------------------------------------------------------------------------------------
# torchrun entry: every parallel layer against the single-device module, forward and backward
# --------------------------------------------------------------------------------------------


def _grads_as_module(module: M) -> M:
    """A copy of ``module`` whose parameters hold ``module``'s gradients (shard it to get the expected shard gradients)."""
    grads = copy.deepcopy(module)
    with torch.no_grad():
        for g, p in zip(grads.parameters(), module.parameters()):
            assert p.grad is not None, "every parameter has a gradient after the backward pass"
            g.copy_(p.grad)
    return grads


def check_sharded(name: str, module: M, shard_fn: Callable[[M], nn.Module], x: torch.Tensor) -> None:
    """In a rank: ``shard_fn(module)`` against ``module``: output, input gradient, and the shard's parameters and gradients.

    Both run forward and backward with the same random upstream gradient. The expected shard
    gradients are ``shard_fn`` applied to a copy of ``module`` that holds its gradients.
    """
    from course_lib.support.torchrun import report_check

    reference = copy.deepcopy(module)
    shard = shard_fn(reference)
    x_ref, x_par = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ref = reference(x_ref)
    dy = torch.randn(y_ref.shape, dtype=y_ref.dtype, generator=torch.Generator().manual_seed(1)).to(y_ref.device)
    y_ref.backward(dy)
    y = shard(x_par)
    y.backward(dy)
    expected = shard_fn(reference)
    for p, g in zip(expected.parameters(), shard_fn(_grads_as_module(reference)).parameters()):
        p.grad = g.detach()
    tol = {"rtol": 1e-9, "atol": 1e-11}  # float64: only the order of the additions differs
    report_check(f"{name}: forward", y, y_ref, **tol)
    report_check(f"{name}: input gradient", x_par.grad, x_ref.grad, **tol)
    report_check(f"{name}: shard parameters and gradients", shard, expected, **tol)


def _check_everything(small: bool) -> dict[str, Any]:
    """In a rank: column/row-parallel linear, MLP, attention and block against the single-device modules; then bytes and times."""
    from course_lib.support.dist import rank_device

    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    cfg = models.GPTConfig(d_model=32, n_head=8, seq_len=8) if small else models.GPTConfig(d_model=1024, n_head=16, seq_len=256)
    b, s, h = (2 if small else 4), cfg.seq_len, cfg.d_model
    block = cast(models.Block, models.GPT(cfg, seed=0).blocks[0]).to(device, torch.float64)  # ModuleList: untyped items
    x = torch.randn(b, s, h, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(device)
    x_wide = torch.randn(b, s, cfg.d_ff, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(device)
    check_sharded("ColumnParallelLinear (gather_output)", block.mlp.fc,
                  lambda m: ColumnParallelLinear.from_linear(m, rank, world, gather_output=True), x)
    check_sharded("RowParallelLinear (full input)", block.mlp.proj,
                  lambda m: RowParallelLinear.from_linear(m, rank, world, input_is_parallel=False), x_wide)
    check_sharded("ParallelMLP", block.mlp, lambda m: ParallelMLP.from_module(m, rank, world), x)
    check_sharded("ParallelAttention", block.attn, lambda m: ParallelAttention.from_module(m, rank, world), x)
    check_sharded("ParallelBlock", block, lambda m: ParallelBlock.from_module(m, rank, world), x)
    return {"world_size": world, "backend": dist.get_backend(), **_block_measurements(block.float(), x.float())}


def _block_measurements(block: models.Block, x: torch.Tensor) -> dict[str, Any]:
    """In a rank: all-reduce calls and bytes of one block's forward and backward (against the formula), and fp32 times."""
    from course_lib.collectives import time_in_ranks

    b, s, h = x.shape
    shard = ParallelBlock.from_module(block)
    x_par = x.clone().requires_grad_(True)
    with count_collectives() as fwd:
        y = shard(x_par)
    with count_collectives() as bwd:
        y.sum().backward()

    def fwd_bwd(module: nn.Module) -> Callable[[torch.Tensor], None]:
        return lambda t: module(t.requires_grad_(True)).sum().backward()

    times = {name: statistics.median(time_in_ranks(fwd_bwd(m), x.clone(), repeat=5, warmup=2)) * 1e3
             for name, m in (("single_device", block), ("tensor_parallel", shard))}
    return {
        "block": {"b": b, "s": s, "h": h, "dtype": "float32"},
        "forward_all_reduces": fwd.count("all_reduce"),
        "forward_bytes": fwd.bytes(),
        "backward_all_reduces": bwd.count("all_reduce"),
        "backward_bytes": bwd.bytes(),
        "formula_bytes": tp_comm_bytes_per_layer(b, s, h, x.dtype),
        "fwd_bwd_ms": times,
    }


def main(argv: list[str] | None = None) -> None:
    """Entry for ``torchrun --nproc_per_node N -m course_lib.tensor_parallel [--small]`` (N must divide the head count)."""
    from course_lib.support.torchrun import entry_main

    entry_main(_check_everything, "Check the chapter-13 tensor-parallel layers on N ranks.", argv)


if __name__ == "__main__":
    main()
