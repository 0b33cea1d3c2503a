"""Chapter 16 (choosing a strategy): a planner that sizes every (dp, tp, pp, cp, ZeRO, recomputation, micro-batch) layout.

Given a transformer (``ModelSpec``) and a cluster (``ClusterSpec``), the planner lists the layouts
that obey the rules of the earlier chapters, estimates each one's memory per GPU and time per
step with simple, stated models, and ranks the ones that fit:

    from course_lib import planner as pl
    model = pl.ModelSpec("gpt-7b", n_layer=32, d_model=4096, n_head=32, seq_len=2048, vocab_size=51200, global_batch=512)
    plans = pl.plan(model, pl.dgx_h100(nodes=4))
    plans[0].config, plans[0].time.mfu

The models, in one place (every exercise of the chapter implements one of them):

memory per GPU   model states: the ``P / (tp pp)`` parameters of one GPU under ZeRO ``stage`` over
                 the ``dp cp`` ranks that hold the same weights (mixed-precision Adam, 16 bytes
                 per parameter unsharded; ``memory_math.zero_memory_per_gpu``); activations per layer
                 and micro-batch (Korthikanti et al. 2022, s = seq_len / cp): ``34 s b h / tp`` with
                 sequence parallelism, ``s b h (10 + 24 / tp)`` without; recompute "none" also keeps
                 the ``5 a s^2 b / tp`` bytes of attention scores, "selective" recomputes the attention
                 core instead (as FlashAttention does), "full" keeps only each layer's input plus one
                 layer's activations while it recomputes. A stage has ``L / pp`` layers; its first holds
                 ``min(pp, m)`` micro-batches in flight (1F1B), times ``1 + (pp - 1) / (pp v)`` when
                 interleaved with v chunks per rank.
time per step    compute: every matrix multiply of the step at its own rate: ``peak x efficiency x
                 gemm_shape_factor(M, N, K)``, the size dependence measured with cuBLAS on an H200
                 (``benchmarks/results/gemm_h200.json``); pipeline bubble: compute x (pp - 1) / (m v);
                 communication: per-GPU wire bytes of each kind / the bandwidth of the link it crosses,
                 not overlapped by default (a pessimistic, simple choice); the cluster's
                 ``dp_overlap`` / ``tp_overlap`` hide those fractions of the dp / tp seconds under compute.
MFU              model FLOPs (no recomputation) / (GPUs x peak x step time).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from course_lib import memory_math as mm
from course_lib.support.records import load_record
from course_lib.tensor_parallel import all_reduce_wire_bytes

__all__ = [
    "BF16_BYTES",
    "ClusterSpec",
    "MemoryEstimate",
    "ModelSpec",
    "RECOMPUTE",
    "ParallelConfig",
    "Plan",
    "RULES",
    "Recommendation",
    "StepTime",
    "a100_cluster",
    "mesh_order",
    "best_plan",
    "fit_cheapest",
    "FIT_MOVES",
    "broken_rules",
    "pick_best",
    "comm_wire_bytes",
    "compute_seconds",
    "config_problems",
    "describe",
    "dgx_h100",
    "enumerate_configs",
    "flowchart",
    "gemm_shape_factor",
    "gemm_shapes",
    "hardware_flops",
    "link_bandwidths",
    "mesh_links",
    "mesh_seconds",
    "memory_per_gpu",
    "model_flops",
    "plan",
    "step_time",
]

BF16_BYTES = 2


@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style transformer and its training batch.

    Layers L, width h, heads a, sequence s, vocabulary V, global batch B (sequences).

    ``params`` defaults to Megatron-LM's count 12 L h^2 + 13 L h + (V + s) h (tied embeddings).
    """

    name: str
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab_size: int
    global_batch: int
    params: float | None = None

    @property
    def num_params(self) -> float:
        """Parameter count: ``params`` if given, else 12 L h^2 + 13 L h + (V + s) h."""
        if self.params is not None:
            return float(self.params)
        L, h = self.n_layer, self.d_model
        return float(12 * L * h * h + 13 * L * h + (self.vocab_size + self.seq_len) * h)


@dataclass(frozen=True)
class ClusterSpec:
    """Identical nodes of GPUs.

    Memory per GPU, per-GPU bandwidth inside a node and between nodes (bytes/s, one direction), peak FLOP/s.

    ``efficiency`` is the fraction of ``peak_flops`` that large matrix multiplies reach in practice
    (0.6 by default: a typical figure for well-tuned bf16 GEMMs); smaller ones reach less, by the
    measured ``gemm_shape_factor``.
    ``dp_overlap`` and ``tp_overlap`` are the fractions of the data- and tensor-parallel
    communication that run under compute instead of after it (0 by default: nothing overlapped;
    chapter 12's bucketed DDP hides most of the gradient all-reduce behind the backward pass).
    """

    name: str
    gpus_per_node: int
    nodes: int
    memory_bytes: float
    intra_node_bw: float
    inter_node_bw: float
    peak_flops: float
    efficiency: float = 0.6
    dp_overlap: float = 0.0
    tp_overlap: float = 0.0

    @property
    def num_gpus(self) -> int:
        """GPUs in the cluster."""
        return self.gpus_per_node * self.nodes


def dgx_h100(nodes: int = 1) -> ClusterSpec:
    """DGX H100 nodes.

    8 H100 SXM (80 GB, 989 TFLOP/s dense bf16), NVLink 450 GB/s per direction, 8 x 400 Gb/s InfiniBand (50 GB/s per GPU).
    """
    return ClusterSpec("DGX H100", 8, nodes, 80e9, 450e9, 50e9, 989e12)


def a100_cluster(nodes: int = 1) -> ClusterSpec:
    """DGX A100 nodes as in Megatron-LM's Selene runs.

    8 A100 80 GB (312 TFLOP/s bf16), NVLink 300 GB/s per direction, 8 x 200 Gb/s HDR InfiniBand (25 GB/s per GPU).
    """
    return ClusterSpec("DGX A100 80GB", 8, nodes, 80e9, 300e9, 25e9, 312e12)


RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class ParallelConfig:
    """One layout: parallel degrees, ZeRO stage, activation recomputation, micro-batch (sequences), pipeline chunks per rank.

    ``recompute``: "none" keeps every activation (attention scores included), "selective"
    recomputes the attention core in the backward pass (FlashAttention does so by construction),
    "full" recomputes each layer from its input (chapter 07). ``interleave`` is v, the chunks of
    layers per pipeline rank (interleaved 1F1B, chapter 14); ``sequence_parallel`` splits the
    activations outside the tensor-parallel matmuls over the tp ranks too (chapter 13).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    recompute: str = "selective"
    micro_batch: int = 1
    interleave: int = 1
    sequence_parallel: bool = True

    @property
    def num_gpus(self) -> int:
        """GPUs the layout uses: dp x tp x pp x cp."""
        return self.dp * self.tp * self.pp * self.cp

    def micro_batches(self, model: ModelSpec) -> int:
        """m: micro-batches per step on each pipeline (the gradient-accumulation count): B / (dp x micro_batch)."""
        return model.global_batch // (self.dp * self.micro_batch)

    def short(self) -> str:
        """The layout in one line, e.g. 'dp2 tp4 pp1 cp1 zero1 mb1' (+full / +none recomputation, vN chunks, -sp)."""
        extra = "" if self.recompute == "selective" else f"+{self.recompute}"
        extra += f" v{self.interleave}" if self.interleave != 1 else ""
        extra += "" if self.sequence_parallel else " -sp"
        return f"dp{self.dp} tp{self.tp} pp{self.pp} cp{self.cp} zero{self.zero} mb{self.micro_batch}{extra}"


# ---- rules --------------------------------------------------------------------------------------


RULES: dict[str, str] = {
    "positive": "every degree and the micro-batch size are at least 1",
    "gpus": "dp * tp * pp * cp equals the number of GPUs",
    "tp_node": "tp divides the GPUs of a node (tensor parallelism stays inside a node)",
    "tp_heads": "tp divides the number of attention heads",
    "pp_layers": "pp divides the number of layers (pp x interleave with interleaved chunks)",
    "interleave": "interleave (chunks per pipeline rank) is above 1 only with pp > 1 and pp dividing the micro-batches",
    "recompute": "recompute is 'none', 'selective' or 'full'",
    "cp_seq": "cp divides the sequence length",
    "batch": "dp * micro_batch divides the global batch",
    "zero_stage": "the ZeRO stage is 0, 1, 2 or 3",
    "zero_dp": "ZeRO (stage > 0) needs dp * cp > 1: it shards over the ranks that hold the same weights",
    "zero_pp": ("no ZeRO stage 2 or 3 with pipeline parallelism (pp > 1): DeepSpeed's restriction, not a law (its "
                "pipeline engine supports ZeRO stage 1 only); the planner follows it"),
}


def broken_rules(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig) -> set[str]:
    """The keys of the ``RULES`` that ``cfg`` breaks; empty means valid (a degree below 1 is reported as ``positive`` alone)."""
    if min(cfg.dp, cfg.tp, cfg.pp, cfg.cp, cfg.micro_batch, cfg.interleave) < 1:
        return {"positive"}
    broken = set()
    if cfg.num_gpus != cluster.num_gpus:
        broken.add("gpus")
    if cluster.gpus_per_node % cfg.tp:
        broken.add("tp_node")
    if model.n_head % cfg.tp:
        broken.add("tp_heads")
    if model.n_layer % (cfg.pp * cfg.interleave):
        broken.add("pp_layers")
    if cfg.interleave > 1 and (cfg.pp == 1 or (model.global_batch // (cfg.dp * cfg.micro_batch)) % cfg.pp):
        broken.add("interleave")
    if cfg.recompute not in RECOMPUTE:
        broken.add("recompute")
    if model.seq_len % cfg.cp:
        broken.add("cp_seq")
    if model.global_batch % (cfg.dp * cfg.micro_batch):
        broken.add("batch")
    if cfg.zero not in (0, 1, 2, 3):
        broken.add("zero_stage")
    else:
        if cfg.zero > 0 and cfg.dp * cfg.cp == 1:
            broken.add("zero_dp")
        if cfg.zero >= 2 and cfg.pp > 1:
            broken.add("zero_pp")
    return broken


def config_problems(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig) -> dict[str, str]:
    """The rules ``cfg`` breaks (``broken_rules``), as {key: explanation with the numbers}; empty means valid."""
    explain = {
        "positive": f"dp, tp, pp, cp, micro_batch and interleave must be >= 1, got {cfg.short()}",
        "gpus": f"dp*tp*pp*cp = {cfg.num_gpus}, but the cluster has {cluster.num_gpus} GPUs",
        "tp_node": f"tp={cfg.tp} must divide the {cluster.gpus_per_node} GPUs of a node (tensor parallelism stays inside a node)",
        "tp_heads": f"tp={cfg.tp} must divide the {model.n_head} attention heads",
        "pp_layers": f"pp x interleave = {cfg.pp * cfg.interleave} must divide the {model.n_layer} layers",
        "interleave": (f"interleave={cfg.interleave} needs pp > 1 (pp={cfg.pp}) and pp dividing the "
                       f"{model.global_batch // max(1, cfg.dp * cfg.micro_batch)} micro-batches"),
        "recompute": f"recompute must be one of {RECOMPUTE}, got {cfg.recompute!r}",
        "cp_seq": f"cp={cfg.cp} must divide the sequence length {model.seq_len}",
        "batch": f"dp*micro_batch = {cfg.dp * cfg.micro_batch} must divide the global batch {model.global_batch}",
        "zero_stage": f"ZeRO stage must be 0, 1, 2 or 3, got {cfg.zero}",
        "zero_dp": "ZeRO shards over data-parallel ranks; with dp*cp = 1 there is nothing to shard",
        "zero_pp": (f"ZeRO stage {cfg.zero} with pipeline parallelism (pp={cfg.pp}): DeepSpeed's pipeline engine "
                    "supports ZeRO stage 1 only, and this planner follows it"),
    }
    return {key: explain[key] for key in sorted(broken_rules(model, cluster, cfg), key=list(RULES).index)}


# ---- memory -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU: model states (params, grads, optimizer) and saved activations."""

    states: mm.MemoryBreakdown
    activations: float

    @property
    def total(self) -> float:
        """Bytes of model states and activations together."""
        return self.states.total + self.activations


def memory_per_gpu(model: ModelSpec, cfg: ParallelConfig) -> MemoryEstimate:
    """Memory of one GPU (the first pipeline stage, which holds most micro-batches) under ``cfg``; see the module docstring."""
    params_gpu = model.num_params / (cfg.tp * cfg.pp)
    states = mm.zero_memory_per_gpu(params_gpu, cfg.zero, cfg.dp * cfg.cp)
    s, b, h, t = model.seq_len // cfg.cp, cfg.micro_batch, model.d_model, cfg.tp
    if cfg.sequence_parallel:  # every activation split over the tp ranks
        linear, layer_input = 34 * s * b * h / t, BF16_BYTES * s * b * h / t
    else:  # LayerNorm, dropout and residual tensors replicated on every tp rank (Korthikanti et al. 2022)
        linear, layer_input = s * b * h * (10 + 24 / t), BF16_BYTES * s * b * h
    scores = 5 * model.n_head * s * s * b / t
    layers = model.n_layer // cfg.pp
    in_flight = float(min(cfg.pp, cfg.micro_batches(model)))
    if cfg.interleave > 1:
        in_flight *= 1 + (cfg.pp - 1) / (cfg.pp * cfg.interleave)
    if cfg.recompute == "full":
        activations = in_flight * layers * layer_input + linear
    else:
        activations = in_flight * layers * (linear + (scores if cfg.recompute == "none" else 0))
    return MemoryEstimate(states, float(activations))


# ---- FLOPs and time -----------------------------------------------------------------------------


def model_flops(model: ModelSpec) -> float:
    """FLOPs of one training step, no recomputation: 72 B s L h^2 + 12 B s^2 L h + 6 B s h V (Narayanan et al. 2021).

    That is 6 x (matmul parameters) x tokens plus the attention score and value matmuls, counted
    in full (no saving for the causal mask), as MFU is usually reported.
    """
    B, s, L, h, V = model.global_batch, model.seq_len, model.n_layer, model.d_model, model.vocab_size
    return float(72 * B * s * L * h * h + 12 * B * s * s * L * h + 6 * B * s * h * V)


def hardware_flops(model: ModelSpec, recompute: str) -> float:
    """FLOPs the GPUs execute: ``model_flops`` plus the recomputed forward work.

    "selective" repeats the attention score and value matmuls (4 B s^2 L h), "full" every layer's
    forward (24 B s L h^2 + 4 B s^2 L h), "none" nothing.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    B, s, L, h = model.global_batch, model.seq_len, model.n_layer, model.d_model
    extra = {"none": 0, "selective": 4 * B * s * s * L * h, "full": 24 * B * s * L * h * h + 4 * B * s * s * L * h}
    return model_flops(model) + extra[recompute]


@functools.cache
def _gemm_table() -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], list, float]:
    section = load_record("gemm_h200.json").section("gemm")
    m, n, k, rates = section["m"], section["n"], section["k"], section["tflops"]
    large = [rates[i][j][q] for i, j, q in itertools.product(range(len(m)), range(len(n)), range(len(k)))
             if min(m[i], n[j], k[q]) >= 4096]
    logs = tuple(tuple(math.log2(v) for v in axis) for axis in (m, n, k))
    return logs[0], logs[1], logs[2], rates, statistics.median(large)


def _bracket(axis: tuple[float, ...], x: float) -> tuple[int, float]:
    x = min(max(x, axis[0]), axis[-1])
    i = min(max(bisect.bisect_right(axis, x) - 1, 0), len(axis) - 2)
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])


def gemm_shape_factor(m: float, n: float, k: float) -> float:
    """The rate of an (m x k) @ (k x n) bf16 GEMM relative to large ones, at most 1.

    Interpolated (in log2 of each size, clamped to the grid) from the cuBLAS rates measured on an
    H200 (``benchmarks/results/gemm_h200.json``), divided by the median rate of the grid's GEMMs
    whose sizes are all at least 4096. Applied to other GPUs it is an assumption: the same shape
    of curve.
    """
    lm, ln, lk, rates, large = _gemm_table()
    (i, fi), (j, fj), (q, fq) = _bracket(lm, math.log2(m)), _bracket(ln, math.log2(n)), _bracket(lk, math.log2(k))
    value = 0.0
    for di, dj, dq in itertools.product((0, 1), repeat=3):
        weight = (fi if di else 1 - fi) * (fj if dj else 1 - fj) * (fq if dq else 1 - fq)
        value += weight * rates[i + di][j + dj][q + dq]
    return min(1.0, value / large)


def gemm_shapes(model: ModelSpec, cfg: ParallelConfig) -> list[tuple[float, tuple[float, float, float]]]:
    """The step's matrix multiplies on one GPU as (FLOPs summed over the cluster, (M, N, K) of one of them).

    Per layer and micro-batch of T = b s / cp tokens, forward: QKV (T x h -> 3h/tp), the attention
    output projection (h/tp -> h), the MLP (h -> 4h/tp -> h), and per head the scores (s/cp x d by
    d x s) and their product with V (s/cp x s by s x d), d = h / a, run as one batched GEMM over the
    b a / tp heads (so M counts the rows of all of them); the output layer (h -> V/tp, counted over
    the pipeline as a whole). The backward pass of each GEMM is two of the transposed
    shapes (dX: M x K from M x N and N x K; dW: K x N from K x M and M x N); recomputation repeats
    forward shapes (``hardware_flops``).
    """
    B, s, L, h, a, V = model.global_batch, model.seq_len, model.n_layer, model.d_model, model.n_head, model.vocab_size
    t, T, d = cfg.tp, cfg.micro_batch * s / cfg.cp, h / a
    rows = T * a / t  # the batched attention GEMMs' rows, every head of the micro-batch
    forward = [((T, 3 * h / t, h), 6 * B * s * L * h * h), ((T, h, h / t), 2 * B * s * L * h * h),
               ((T, 4 * h / t, h), 8 * B * s * L * h * h), ((T, h, 4 * h / t), 8 * B * s * L * h * h),
               ((rows, s, d), 2 * B * s * s * L * h), ((rows, d, s), 2 * B * s * s * L * h),
               ((T, V / t, h), 2 * B * s * h * V)]
    out = []
    for (M, N, K), flops in forward:
        out += [(flops, (M, N, K)), (flops, (M, K, N)), (flops, (K, N, M))]
    if cfg.recompute == "full":
        out += [(flops, shape) for shape, flops in forward[:6]]
    elif cfg.recompute == "selective":
        out += [(flops, shape) for shape, flops in forward[4:6]]
    return [(float(f), (float(m), float(n), float(k))) for f, (m, n, k) in out]


def compute_seconds(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig) -> float:
    """Seconds of matrix multiplies per step on one GPU: each of ``gemm_shapes`` at ``peak x efficiency x gemm_shape_factor``."""
    rate = cfg.num_gpus * cluster.peak_flops * cluster.efficiency
    return sum(flops / (rate * gemm_shape_factor(*shape)) for flops, shape in gemm_shapes(model, cfg))


MESH_ORDER = ("pp", "dp", "cp", "tp")


def mesh_links(degrees: Sequence[tuple[str, int]], gpus_per_node: int) -> dict[str, bool]:
    """For a mesh given slowest dimension first as (name, degree) pairs, whether each dimension's groups stay inside nodes.

    Ranks are numbered node by node (node j holds ranks j G ... j G + G - 1); a dimension is inside
    a node when every one of its groups is: always for a degree of 1 or when its groups' span (its
    degree times the degrees of the faster dimensions) divides G; otherwise each group is checked
    (a span of 4 on 6-GPU nodes puts ranks 4-7 across two nodes).
    """
    degrees = list(degrees)
    world = math.prod(degree for _, degree in degrees)
    inside, stride = {}, 1
    for name, degree in reversed(degrees):
        span = stride * degree
        if degree == 1 or (span <= gpus_per_node and gpus_per_node % span == 0):
            inside[name] = True
        else:  # check every group: its first member r (coordinate 0 on this dimension) and its last
            inside[name] = all(r // gpus_per_node == (r + (degree - 1) * stride) // gpus_per_node
                               for r in range(world) if (r // stride) % degree == 0)
        stride = span
    return {name: inside[name] for name, _ in degrees}


def link_bandwidths(cluster: ClusterSpec, cfg: ParallelConfig, order: Sequence[str] = MESH_ORDER) -> dict[str, float]:
    """Bandwidth (bytes/s per GPU) of the link each kind of communication crosses, for a mesh laid out in ``order``.

    ``order`` lists the dimensions slowest first (default (pp, dp, cp, tp): tp fastest, as in
    Megatron-LM); a kind's groups use NVLink when ``mesh_links`` finds them inside nodes, else InfiniBand.
    """
    degrees = {"dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp}
    inside = mesh_links([(k, degrees[k]) for k in order], cluster.gpus_per_node)
    return {k: cluster.intra_node_bw if inside[k] else cluster.inter_node_bw for k in ("tp", "cp", "dp", "pp")}


def mesh_seconds(order: Sequence[str], degrees: dict[str, int], wire_bytes: dict[str, float],
                 cluster: ClusterSpec) -> dict[str, float]:
    """Seconds of each dimension's traffic (``wire_bytes`` per GPU) on its link, for a mesh in ``order`` (slowest first)."""
    inside = mesh_links([(k, degrees[k]) for k in order], cluster.gpus_per_node)
    return {k: wire_bytes.get(k, 0.0) / (cluster.intra_node_bw if inside[k] else cluster.inter_node_bw) for k in order}


def mesh_order(degrees: dict[str, int], wire_bytes: dict[str, float],
                    cluster: ClusterSpec) -> tuple[tuple[str, ...], dict[str, float]]:
    """The order of the mesh dimensions (slowest first) with the fewest communication seconds, and its ``mesh_seconds``.

    Every order is tried (a mesh has at most a handful of dimensions); ties go to the first order
    ``itertools.permutations`` yields for the keys of ``degrees``.
    """
    best: tuple[tuple[str, ...], dict[str, float]] | None = None
    for order in itertools.permutations(degrees):
        seconds = mesh_seconds(order, degrees, wire_bytes, cluster)
        if best is None or sum(seconds.values()) < sum(best[1].values()):
            best = (order, seconds)
    assert best is not None, "degrees names at least one dimension"
    return best


def comm_wire_bytes(model: ModelSpec, cfg: ParallelConfig) -> dict[str, float]:
    """Bytes each GPU sends per step, by kind (bf16 values, ring algorithms).

    tp   per layer and micro-batch, all-reduces of the (b, s/cp, h) activation (Megatron-LM): 2 in the
         forward and 2 in the backward; full recomputation repeats the forward, so 2 more: 4 or 6 in all.
         Each costs 2 (tp-1)/tp of its payload (with sequence parallelism an all-gather plus a
         reduce-scatter replace each all-reduce: the same volume).
    cp   per layer and micro-batch, ring attention with full multi-head K and V (each b (s/cp) h / tp
         values on one GPU). Forward: the K and V shards pass round the ring, cp-1 shifts, so
         2 (cp-1)/cp x b s h / tp values. Backward: K and V go round again and the dK, dV accumulators
         travel round too, twice the forward's traffic (counting cp-1 shifts for the accumulators; an
         implementation that ships them home with one extra shift, as course_lib.context_parallel
         does, sends 2 b (s/cp) h / tp values more). Full recomputation repeats the forward, K and V
         included. In all 6 (cp-1)/cp x b s h / tp values, 8 with full recomputation; zero with cp = 1.
    pp   per micro-batch, the stage's output forward and its gradient backward: 2 b (s/cp) h / tp values,
         once per chunk with interleaving (v chunks: v times the bytes); zero with pp = 1.
    dp   per step, the gradients of the GPU's P / (tp pp) parameters over dp x cp ranks: an all-reduce
         (ZeRO 1 and 2: reduce-scatter + all-gather, the same volume; ZeRO 3: 1.5 x, the weights are
         gathered again for the backward pass).
    """
    b, s, h = cfg.micro_batch, model.seq_len, model.d_model
    m, layers = cfg.micro_batches(model), model.n_layer // cfg.pp
    act = b * (s // cfg.cp) * h * BF16_BYTES
    full = cfg.recompute == "full"
    n_tp_ops = 6 if full else 4
    tp = m * layers * n_tp_ops * all_reduce_wire_bytes(act, cfg.tp)
    kv_forward = 2 * (cfg.cp - 1) / cfg.cp * b * s * h * BF16_BYTES / cfg.tp  # K and V round the ring once
    n_kv_rounds = (2 if full else 1) + 2  # forward(s), then backward: K, V again plus dK, dV
    cp = m * layers * n_kv_rounds * kv_forward
    pp = 0.0 if cfg.pp == 1 else m * 2 * act / cfg.tp * cfg.interleave
    grads = model.num_params / (cfg.tp * cfg.pp) * BF16_BYTES
    dp = all_reduce_wire_bytes(grads, cfg.dp * cfg.cp) * (1.5 if cfg.zero == 3 else 1.0)
    return {"tp": float(tp), "cp": float(cp), "pp": float(pp), "dp": float(dp)}


@dataclass(frozen=True)
class StepTime:
    """Seconds per step by part, and what they give: MFU and achieved hardware FLOP/s per GPU."""

    compute: float
    bubble: float
    comm: dict[str, float]
    model_flops: float
    hardware_flops: float
    num_gpus: int
    peak_flops: float
    hidden: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """Seconds of the step: compute, bubble and every kind of communication, less what ran under compute (``hidden``)."""
        return self.compute + self.bubble + sum(self.comm.values()) - sum(self.hidden.values())

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over the cluster's peak."""
        return self.model_flops / (self.num_gpus * self.peak_flops * self.total)

    @property
    def hardware_flops_per_gpu(self) -> float:
        """FLOP/s each GPU executes (recomputation included): the figure Megatron-LM reports."""
        return self.hardware_flops / (self.num_gpus * self.total)


def step_time(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig) -> StepTime:
    """Time of one training step under ``cfg``: compute, pipeline bubble and each communication, per the module docstring.

    With ``cluster.dp_overlap`` or ``tp_overlap`` above 0, that fraction of the dp (tp) seconds is
    ``hidden`` under compute: the dp share under the backward pass (at most 2/3 of the compute),
    the tp share under the rest of the compute that the dp share left free.
    """
    hw = hardware_flops(model, cfg.recompute)
    n = cfg.num_gpus
    compute = compute_seconds(model, cluster, cfg)
    bubble = compute * (cfg.pp - 1) / (cfg.micro_batches(model) * cfg.interleave)
    wire, bw = comm_wire_bytes(model, cfg), link_bandwidths(cluster, cfg)
    comm = {k: wire[k] / bw[k] for k in wire}
    hidden: dict[str, float] = {}
    if cluster.dp_overlap > 0 or cluster.tp_overlap > 0:
        hidden["dp"] = min(cluster.dp_overlap * comm["dp"], compute * 2 / 3)
        hidden["tp"] = min(cluster.tp_overlap * comm["tp"], compute - hidden["dp"])
    return StepTime(compute, bubble, comm, model_flops(model), hw, n, cluster.peak_flops, hidden)


# ---- the planner --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A valid layout with its estimates; ``fits`` when its memory is within the GPU's."""

    config: ParallelConfig
    memory: MemoryEstimate
    time: StepTime
    fits: bool


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_configs(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    zero_stages: Sequence[int] = (0, 1, 2, 3),
    recompute: Sequence[str] = ("selective", "full"),
    cps: Sequence[int] | None = (1,),
) -> list[ParallelConfig]:
    """Every layout with ``config_problems`` empty, from the given choices (``cps=None``: every divisor)."""
    n = cluster.num_gpus
    out = []
    for tp, pp in itertools.product(_divisors(n), _divisors(n)):
        for cp in (_divisors(n) if cps is None else cps):
            if n % (tp * pp * cp):
                continue
            dp = n // (tp * pp * cp)
            for zero, rc, mb in itertools.product(zero_stages, recompute, micro_batches):
                cfg = ParallelConfig(dp, tp, pp, cp, zero, rc, mb)
                if not config_problems(model, cluster, cfg):
                    out.append(cfg)
    return out


def pick_best(
    model: ModelSpec, cluster: ClusterSpec, configs: Iterable[ParallelConfig], memory_limit: float | None = None
) -> Plan | None:
    """The fastest of ``configs`` that is valid (no ``config_problems``) and fits in ``memory_limit`` bytes per GPU
    (default: the cluster's); ties go to the smaller memory, then to the earlier config. None if none qualifies."""
    limit = cluster.memory_bytes if memory_limit is None else memory_limit
    best: Plan | None = None
    for cfg in configs:
        if config_problems(model, cluster, cfg):
            continue
        mem = memory_per_gpu(model, cfg)
        if mem.total > limit:
            continue
        candidate = Plan(cfg, mem, step_time(model, cluster, cfg), True)
        if best is None or (candidate.time.total, mem.total) < (best.time.total, best.memory.total):
            best = candidate
    return best


FIT_MOVES = ("zero", "recompute", "tp", "pp", "cp", "micro_batch")


def _moved(cfg: ParallelConfig, move: str) -> ParallelConfig | None:
    half_dp = cfg.dp // 2 if cfg.dp % 2 == 0 else None
    if move == "zero":
        return dataclasses.replace(cfg, zero=cfg.zero + 1) if cfg.zero < 3 else None
    if move == "recompute":
        level = RECOMPUTE.index(cfg.recompute)
        return dataclasses.replace(cfg, recompute=RECOMPUTE[level + 1]) if level + 1 < len(RECOMPUTE) else None
    if move in ("tp", "pp", "cp"):
        if half_dp is None:
            return None
        return dataclasses.replace(cfg, dp=half_dp, **{move: 2 * getattr(cfg, move)})
    if move == "micro_batch":
        return dataclasses.replace(cfg, micro_batch=cfg.micro_batch // 2) if cfg.micro_batch % 2 == 0 else None
    raise ValueError(f"unknown move {move!r}; the moves are {FIT_MOVES}")


def fit_cheapest(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig,
                 memory_limit: float | None = None) -> tuple[ParallelConfig | None, dict[str, Plan | None]]:
    """Decide the one change that makes ``cfg`` fit at the least cost, and show every option's numbers.

    The options are the ``FIT_MOVES``: one ZeRO stage more; the next recomputation level; twice the
    tp, pp or cp degree for half the dp degree (same GPUs); half the micro-batch. Each maps to the
    ``Plan`` of the moved layout, or None when the move is impossible (no further stage or level,
    odd dp or micro-batch) or the moved layout breaks a rule (``config_problems``). The decision is
    ``cfg`` itself when it is legal and fits in ``memory_limit`` (default: the cluster's); else the
    fitting option with the shortest step, ties to the smaller memory, then to the earlier move;
    None when no option fits.
    """
    limit = cluster.memory_bytes if memory_limit is None else memory_limit
    options: dict[str, Plan | None] = {}
    for move in FIT_MOVES:
        moved = _moved(cfg, move)
        if moved is None or config_problems(model, cluster, moved):
            options[move] = None
            continue
        mem = memory_per_gpu(model, moved)
        options[move] = Plan(moved, mem, step_time(model, cluster, moved), mem.total <= limit)
    if not config_problems(model, cluster, cfg) and memory_per_gpu(model, cfg).total <= limit:
        return cfg, options
    fitting = [p for p in options.values() if p is not None and p.fits]
    if not fitting:
        return None, options
    return min(fitting, key=lambda p: (p.time.total, p.memory.total)).config, options


def best_plan(plans: Iterable[Plan], memory_limit: float | None = None) -> Plan | None:
    """The fastest plan whose memory fits (``memory_limit`` bytes, else each plan's own ``fits``), or None if nothing fits.

    Ties go to the plan with less memory.
    """
    fitting = [p for p in plans if (p.fits if memory_limit is None else p.memory.total <= memory_limit)]
    if not fitting:
        return None
    return min(fitting, key=lambda p: (p.time.total, p.memory.total))


def plan(model: ModelSpec, cluster: ClusterSpec, configs: Iterable[ParallelConfig] | None = None, **choices) -> list[Plan]:
    """Estimate every valid layout (or ``configs``); return the ones that fit, fastest first."""
    configs = enumerate_configs(model, cluster, **choices) if configs is None else configs
    plans = []
    for cfg in configs:
        mem = memory_per_gpu(model, cfg)
        plans.append(Plan(cfg, mem, step_time(model, cluster, cfg), mem.total <= cluster.memory_bytes))
    return sorted((p for p in plans if p.fits), key=lambda p: (p.time.total, p.memory.total))


# ---- the seed's decision flowchart --------------------------------------------------------------


@dataclass(frozen=True)
class Recommendation:
    """A strategy name ("single device", "data parallelism", "model parallelism", "hybrid parallelism") and the reasons for it."""

    strategy: str
    reasons: list[str] = field(default_factory=list)


def flowchart(
    model: ModelSpec,
    cluster: ClusterSpec,
    dataset_bytes: float,
    *,
    very_large_dataset_bytes: float = 1e12,
    priority: str = "data",
) -> Recommendation:
    """The textbook's decision chart, question by question.

    Does the model fit on one device (mixed-precision Adam states plus one micro-batch of
    activations)? If yes: is the dataset very large? yes -> data parallelism, no -> single device.
    If not: does the dataset fit on one device? yes -> model parallelism. If not: are both
    constraints significant (the model needs more than two devices' memory and the dataset is very
    large)? yes -> hybrid; no -> whatever ``priority`` ("model" or "data") says scales first.
    """
    if priority not in ("model", "data"):
        raise ValueError(f"priority must be 'model' or 'data', got {priority!r}")
    single = memory_per_gpu(model, ParallelConfig(micro_batch=1))
    need, have = single.total, cluster.memory_bytes
    reasons = [f"one device needs {need / 1e9:.1f} GB for the model (16 B/param + activations); it has {have / 1e9:.0f} GB"]
    large = dataset_bytes > very_large_dataset_bytes
    if need <= have:
        reasons.append("the model fits on one device")
        reasons.append(f"the dataset ({dataset_bytes / 1e9:.0f} GB) is {'very large' if large else 'not very large'}")
        return Recommendation("data parallelism" if large else "single device", reasons)
    reasons.append("the model does not fit on one device")
    if dataset_bytes <= have:
        reasons.append("the dataset fits on one device")
        return Recommendation("model parallelism", reasons)
    reasons.append("the dataset does not fit on one device")
    if need > 2 * have and large:
        reasons.append("both constraints are significant")
        return Recommendation("hybrid parallelism", reasons)
    reasons.append(f"only one constraint is significant; scaling the {priority} comes first")
    return Recommendation(f"{priority} parallelism", reasons)


def describe(p: Plan) -> str:
    """One line: layout, memory per GPU, step time and MFU."""
    return (f"{p.config.short():<34} {p.memory.total / 1e9:7.1f} GB/GPU  step {p.time.total:8.3f} s  "
            f"MFU {p.time.mfu:6.1%}")

