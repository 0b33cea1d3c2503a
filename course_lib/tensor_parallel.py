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

*Sequence parallelism* (Korthikanti et al., 2022) replaces f and g by an all-gather and a
reduce-scatter along the sequence, so that the LayerNorms, dropouts and residual additions between
two tensor-parallel regions run on 1/n of the sequence each (``sequence_parallel=True``,
``ParallelSublayer``). At the model's end, ``VocabParallelCrossEntropy`` computes the loss from
logits split by vocabulary with three all-reduces of one number per token.

Construction needs no process group (rank and world size are arguments); ``forward`` does.
Everything takes an optional ``group`` (default: the whole world) for use with device meshes.
The torchrun self-check of every layer, forward and backward, on GPUs or gloo CPU ranks, is
``benchmarks.checks.tensor_parallel``.
"""

from __future__ import annotations

from typing import Any, overload

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import models

__all__ = [
    "ColumnParallelLinear",
    "CopyToParallelRegion",
    "GatherFromParallelRegion",
    "GatherFromSequenceParallelRegion",
    "ParallelAttention",
    "ParallelBlock",
    "ParallelMLP",
    "ParallelSublayer",
    "ReduceFromParallelRegion",
    "ReduceScatterToSequenceParallelRegion",
    "RowParallelLinear",
    "ScatterToParallelRegion",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "all_reduce_wire_bytes",
    "copy_to_parallel_region",
    "gather_from_parallel_region",
    "gather_from_sequence_parallel_region",
    "parallel_sublayer_block",
    "reduce_from_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "regroup_qkv_for_sharding",
    "scatter_to_parallel_region",
    "sequence_dropout",
    "shard_range",
    "tp_activation_bytes_per_layer",
    "tp_comm_bytes_per_layer",
    "vocab_parallel_cross_entropy",
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
# Sequence parallelism: the conjugate pair all-gather / reduce-scatter along the sequence
# --------------------------------------------------------------------------------------------
# Activations are (batch, sequence, features); a sequence shard is x[:, r*s/n:(r+1)*s/n]. Such a
# slice of a (b, s, h) tensor is not contiguous when b > 1, and NCCL needs flat buffers: every
# buffer handed to a collective below is made contiguous first.


def _all_gather_sequence(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Concatenate every rank's (b, s/n, h) shard into the (b, s, h) tensor, in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=1)


def _reduce_scatter_sequence(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """This rank's sequence shard of the sum of every rank's (b, s, h) ``x``."""
    world = dist.get_world_size(group)
    if x.shape[1] % world:
        raise ValueError(f"sequence length {x.shape[1]} does not split evenly over {world} ranks")
    parts = [p.contiguous() for p in x.chunk(world, dim=1)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Enter a tensor-parallel region from a sequence-parallel one: all-gather along the sequence forward,
    reduce-scatter of the gradient backward (each rank used the whole sequence, so the gradient of
    its shard is the sum over ranks of their gradients of that shard)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        ctx.group = group
        return _all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_sequence(grad, ctx.group), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Leave a tensor-parallel region into a sequence-parallel one: reduce-scatter along the sequence forward
    (sum the partial outputs, keep this rank's shard), all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_sequence(grad, ctx.group), None


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-gather (b, s/n, h) shards into (b, s, h) (backward: reduce-scatter)."""
    return GatherFromSequenceParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum (b, s, h) partial results over the ranks and keep this rank's sequence shard (backward: all-gather)."""
    return ReduceScatterToSequenceParallelRegion.apply(x, group)


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
    With ``sequence_parallel`` the input is this rank's sequence shard, all-gathered instead of f.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, *, gather_output: bool = False, group: Any = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.bias = _param(bias)
        self.gather_output = gather_output
        self.group = group
        self.sequence_parallel = sequence_parallel

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, rank: int, world_size: int, gather_output: bool = False, group: Any = None,
        sequence_parallel: bool = False,
    ) -> ColumnParallelLinear:
        """Rank ``rank``'s shard of ``linear`` (output features split evenly over ``world_size``)."""
        rows = shard_range(linear.out_features, rank, world_size, "out_features")
        bias = None if linear.bias is None else linear.bias[rows]
        return cls(linear.weight[rows], bias, gather_output=gather_output, group=group,
                   sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Local slice of ``x @ W.T + b`` (or the full output with ``gather_output``)."""
        enter = gather_from_sequence_parallel_region if self.sequence_parallel else copy_to_parallel_region
        y = F.linear(enter(x, self.group), self.weight, self.bias)
        return gather_from_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"local weight {tuple(self.weight.shape)}, bias={self.bias is not None}, gather_output={self.gather_output}"


class RowParallelLinear(nn.Module):
    """A Linear whose input features are split over the ranks: rank r holds columns r*k/n : (r+1)*k/n of W.

    Forward: the local matmul gives a partial sum of the full output; ``g`` all-reduces the
    partial sums, and the bias (replicated, not split) is added once, after the reduction.
    With ``input_is_parallel=False`` the layer first takes this rank's slice of a full input.
    With ``sequence_parallel`` the partial sums are reduce-scattered along the sequence instead of
    all-reduced; the bias is then added to a sequence shard, so its gradient is a partial sum too,
    and f (identity forward, all-reduce backward) applied to it makes every rank's gradient the whole.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, *, input_is_parallel: bool = True, group: Any = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.bias = _param(bias)
        self.input_is_parallel = input_is_parallel
        self.group = group
        self.sequence_parallel = sequence_parallel

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, rank: int, world_size: int, input_is_parallel: bool = True, group: Any = None,
        sequence_parallel: bool = False,
    ) -> RowParallelLinear:
        """Rank ``rank``'s shard of ``linear`` (input features split evenly over ``world_size``; bias replicated)."""
        cols = shard_range(linear.in_features, rank, world_size, "in_features")
        return cls(linear.weight[:, cols], linear.bias, input_is_parallel=input_is_parallel, group=group,
                   sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` from this rank's slice of the input features (or the full input)."""
        if not self.input_is_parallel:
            x = scatter_to_parallel_region(x, self.group)
        if not self.sequence_parallel:
            y = reduce_from_parallel_region(F.linear(x, self.weight), self.group)
            return y if self.bias is None else y + self.bias
        y = reduce_scatter_to_sequence_parallel_region(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + copy_to_parallel_region(self.bias, self.group)

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
        cls, ff: models.FeedForward, rank: int | None = None, world_size: int | None = None, group: Any = None,
        sequence_parallel: bool = False,
    ) -> ParallelMLP:
        """Rank ``rank``'s shard of a ``models.FeedForward`` (rank and world size default to the group's).

        With ``sequence_parallel`` it takes and returns this rank's sequence shard (all-gather in, reduce-scatter out).
        """
        rank, world_size = _rank_world(rank, world_size, group)
        fc = ColumnParallelLinear.from_linear(ff.fc, rank, world_size, gather_output=False, group=group,
                                              sequence_parallel=sequence_parallel)
        proj = RowParallelLinear.from_linear(ff.proj, rank, world_size, input_is_parallel=True, group=group,
                                             sequence_parallel=sequence_parallel)
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
    sums the ranks' contributions. The forward pass is ``models.CausalSelfAttention``'s, except that
    the number of heads and the sequence length are read from qkv's output (with sequence
    parallelism the input holds 1/n of the sequence and qkv's output all of it).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention of this rank's heads; the output is replicated (or this rank's sequence shard)."""
        qkv = self.qkv(x)
        batch, time = qkv.shape[:2]
        q, k, v = (t.view(batch, time, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, time, -1)))

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
        sequence_parallel: bool = False,
    ) -> ParallelAttention:
        """Rank ``rank``'s heads of a ``models.CausalSelfAttention`` (the head count must divide evenly)."""
        rank, world_size = _rank_world(rank, world_size, group)
        n_head = attn.proj.in_features // attn.head_dim
        heads = shard_range(n_head, rank, world_size, "the number of heads")
        weight, bias = _head_shard_qkv(attn.qkv, heads, attn.head_dim)
        qkv = ColumnParallelLinear(weight, bias, gather_output=False, group=group, sequence_parallel=sequence_parallel)
        cols = slice(heads.start * attn.head_dim, heads.stop * attn.head_dim)
        proj = RowParallelLinear(attn.proj.weight[:, cols], attn.proj.bias, input_is_parallel=True, group=group,
                                 sequence_parallel=sequence_parallel)
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
# The sublayer around a parallel region: LayerNorm, dropout, residual, replicated or sequence-parallel
# --------------------------------------------------------------------------------------------


def sequence_dropout(x: torch.Tensor, p: float, seed: int, start: int = 0, total: int | None = None) -> torch.Tensor:
    """Dropout of ``x`` (b, s, h) holding positions ``start:start + s`` of a sequence of ``total`` positions.

    The mask is drawn for the whole (b, total, h) sequence from ``seed`` and sliced, so a position
    is dropped or kept the same way whichever rank computes it: a sequence shard gets the slice of
    the single-process mask, and replicated ranks all get the same mask. (Megatron forks the CUDA
    generator instead, which is faster and not reproducible on one device.)
    """
    if p == 0.0:
        return x
    b, s, h = x.shape
    total = start + s if total is None else total
    gen = torch.Generator().manual_seed(seed)
    keep = (torch.rand(b, total, h, generator=gen)[:, start:start + s] >= p).to(x.device)
    return x * keep / (1.0 - p)


class ParallelSublayer(nn.Module):
    """``x + dropout(inner(ln(x)))`` around a tensor-parallel ``inner`` (a ParallelMLP or ParallelAttention).

    Replicated (``sequence_parallel=False``): ``x`` is the full (b, s, h) activation on every rank,
    and LayerNorm and dropout run on all of it, the same on every rank. Sequence-parallel: ``x`` is
    this rank's shard (b, s/n, h), ``inner`` was built with ``sequence_parallel=True``; each rank
    normalises and drops its own positions, and the LayerNorm's gradients, partial sums over the
    sequence shards, are summed over the group by f applied to its weight and bias.
    """

    def __init__(self, ln: nn.LayerNorm, inner: nn.Module, p: float = 0.0, seed: int = 0,
                 sequence_parallel: bool = False, group: Any = None) -> None:
        super().__init__()
        self.ln, self.inner = _copy_layernorm(ln), inner
        self.p, self.seed, self.sequence_parallel, self.group = p, seed, sequence_parallel, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The sublayer on ``x`` (replicated, or this rank's sequence shard)."""
        weight: torch.Tensor = self.ln.weight
        bias: torch.Tensor | None = self.ln.bias
        start, total = 0, x.shape[1]
        if self.sequence_parallel:
            weight = copy_to_parallel_region(weight, self.group)
            bias = None if bias is None else copy_to_parallel_region(bias, self.group)
            world = dist.get_world_size(self.group)
            start, total = dist.get_rank(self.group) * x.shape[1], world * x.shape[1]
        h = F.layer_norm(x, self.ln.normalized_shape, weight, bias, self.ln.eps)
        return x + sequence_dropout(self.inner(h), self.p, self.seed, start, total)


def parallel_sublayer_block(block: models.Block, rank: int | None = None, world_size: int | None = None, *,
                            sequence_parallel: bool = False, p: float = 0.0, seed: int = 0,
                            group: Any = None) -> nn.Sequential:
    """A ``models.Block`` as two ``ParallelSublayer``s (attention, then MLP), dropout ``p`` after each.

    The dropouts of the block's own modules are switched off: ``p`` takes their place.
    """
    rank, world_size = _rank_world(rank, world_size, group)
    attn = ParallelAttention.from_module(block.attn, rank, world_size, group, sequence_parallel)
    mlp = ParallelMLP.from_module(block.mlp, rank, world_size, group, sequence_parallel)
    attn.dropout, attn.resid_dropout.p, mlp.dropout.p = 0.0, 0.0, 0.0
    return nn.Sequential(ParallelSublayer(block.ln_1, attn, p, seed, sequence_parallel, group),
                         ParallelSublayer(block.ln_2, mlp, p, seed + 1, sequence_parallel, group))


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


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logits split by vocabulary; this rank holds ids ``vocab_start`` onwards.

    Forward: three all-reduces of one number per token (the maximum, for a stable exponent; the
    sum of exponentials; the target's logit, which one rank holds and the others add as zero).
    Backward: the gradient of the loss for logit j is softmax_j - [j == target], and each rank
    has all it needs for its own columns (the softmax from the saved sum): no communication.
    """

    @staticmethod
    def forward(ctx: Any, local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                group: Any = None) -> torch.Tensor:
        part = local_logits.shape[-1]
        peak = local_logits.max(dim=-1).values.contiguous()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = local_logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1).contiguous()
        dist.all_reduce(sum_exp, group=group)
        local_t = targets - vocab_start
        mine = (local_t >= 0) & (local_t < part)
        index = local_t.clamp(0, part - 1).unsqueeze(-1)
        target_logit = (shifted.gather(-1, index).squeeze(-1) * mine).contiguous()
        dist.all_reduce(target_logit, group=group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), index, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, index, mine = ctx.saved_tensors
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, index, -mine.to(softmax.dtype).unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int | None = None,
                                 group: Any = None, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` of logits split by vocabulary, through ``VocabParallelCrossEntropy``.

    ``targets`` hold global token ids; ``vocab_start`` is this rank's first id (default: an even
    split, rank * local width). ``reduction`` is "mean", "sum" or "none".
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if vocab_start is None:
        vocab_start = dist.get_rank(group) * local_logits.shape[-1]
    loss = VocabParallelCrossEntropy.apply(local_logits, targets, vocab_start, group)
    if reduction == "mean":
        return loss.mean()
    return loss.sum() if reduction == "sum" else loss


# --------------------------------------------------------------------------------------------
# Communication volume
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


def tp_activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int, *, sequence_parallel: bool = False,
                                  attention_scores: bool = True) -> float:
    """Korthikanti et al. (2022)'s activation bytes per rank of one layer (16-bit values, 1-byte dropout masks).

    Tensor parallelism: s b h (10 + 24/t + 5 a s / (h t)); the 10 s b h replicated on every rank are
    the LayerNorm inputs (4), the inputs of qkv and fc (4) and the two dropout masks (2). With
    sequence parallelism those are split too: s b h (34/t + 5 a s / (h t)). ``attention_scores=False``
    drops the 5 a s^2 b term (attention that never stores the s x s scores, as SDPA's kernels).
    """
    if min(s, b, h, a) < 0 or t < 1:
        raise ValueError(f"need non-negative sizes and t >= 1, got s={s}, b={b}, h={h}, a={a}, t={t}")
    scores = 5 * a * s / (h * t) if attention_scores else 0.0
    linear = 34 / t if sequence_parallel else 10 + 24 / t
    return s * b * h * (linear + scores)


def all_reduce_wire_bytes(payload_bytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``payload_bytes``: 2 (n-1)/n of it."""
    return 2 * (world_size - 1) / world_size * payload_bytes


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
