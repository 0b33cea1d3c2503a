"""Chapter 16 (choosing a strategy): a planner that sizes every (dp, tp, pp, cp, ZeRO, checkpointing, micro-batch) layout.

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
                 per parameter unsharded; ``memory_math.zero_memory_per_gpu``); activations:
                 ``34 s b h / (tp cp)`` bytes per layer and micro-batch (Korthikanti et al. 2022 with
                 sequence parallelism and a FlashAttention-style kernel that keeps no s x s
                 scores), for the ``L / pp`` layers of a stage and ``min(pp, m)`` micro-batches in
                 flight (1F1B); with full activation checkpointing each layer keeps only its
                 ``2 s b h / (tp cp)`` input, plus one layer's full activations while it recomputes.
time per step    compute: hardware FLOPs / (GPUs x peak x efficiency); pipeline bubble: compute x
                 (pp - 1) / m; communication: per-GPU wire bytes of each kind / the bandwidth of the
                 link it crosses, not overlapped by default (a pessimistic, simple choice); the cluster's
                 ``dp_overlap`` / ``tp_overlap`` hide those fractions of the dp / tp seconds under compute.
MFU              model FLOPs (no recomputation) / (GPUs x peak x step time).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from course_lib import memory_math as mm
from course_lib.tensor_parallel import all_reduce_wire_bytes

__all__ = [
    "BF16_BYTES",
    "ClusterSpec",
    "MemoryEstimate",
    "ModelSpec",
    "ParallelConfig",
    "Plan",
    "RULES",
    "Recommendation",
    "StepTime",
    "a100_cluster",
    "best_plan",
    "broken_rules",
    "pick_best",
    "comm_wire_bytes",
    "config_problems",
    "describe",
    "dgx_h100",
    "enumerate_configs",
    "flowchart",
    "hardware_flops",
    "link_bandwidths",
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

    ``efficiency`` is the fraction of ``peak_flops`` that the large matrix multiplies of training
    reach in practice (0.6 by default: a typical figure for well-tuned bf16 GEMMs).
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


@dataclass(frozen=True)
class ParallelConfig:
    """One layout: data, tensor, pipeline and context parallel degrees, ZeRO stage, checkpointing, micro-batch (sequences)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    checkpointing: bool = False
    micro_batch: int = 1

    @property
    def num_gpus(self) -> int:
        """GPUs the layout uses: dp x tp x pp x cp."""
        return self.dp * self.tp * self.pp * self.cp

    def micro_batches(self, model: ModelSpec) -> int:
        """m: micro-batches per step on each pipeline (the gradient-accumulation count): B / (dp x micro_batch)."""
        return model.global_batch // (self.dp * self.micro_batch)

    def short(self) -> str:
        """The layout in one line, e.g. 'dp2 tp4 pp1 cp1 zero1 mb1'."""
        ck = "+ckpt" if self.checkpointing else ""
        return f"dp{self.dp} tp{self.tp} pp{self.pp} cp{self.cp} zero{self.zero}{ck} mb{self.micro_batch}"


# ---- rules --------------------------------------------------------------------------------------


RULES: dict[str, str] = {
    "positive": "every degree and the micro-batch size are at least 1",
    "gpus": "dp * tp * pp * cp equals the number of GPUs",
    "tp_node": "tp divides the GPUs of a node (tensor parallelism stays inside a node)",
    "tp_heads": "tp divides the number of attention heads",
    "pp_layers": "pp divides the number of layers",
    "cp_seq": "cp divides the sequence length",
    "batch": "dp * micro_batch divides the global batch",
    "zero_stage": "the ZeRO stage is 0, 1, 2 or 3",
    "zero_dp": "ZeRO (stage > 0) needs dp * cp > 1: it shards over the ranks that hold the same weights",
    "zero_pp": ("no ZeRO stage 2 or 3 with pipeline parallelism (pp > 1): DeepSpeed's restriction, not a law (its "
                "pipeline engine supports ZeRO stage 1 only); the planner follows it"),
}


def broken_rules(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig) -> set[str]:
    """The keys of the ``RULES`` that ``cfg`` breaks; empty means valid (a degree below 1 is reported as ``positive`` alone)."""
    if min(cfg.dp, cfg.tp, cfg.pp, cfg.cp, cfg.micro_batch) < 1:
        return {"positive"}
    broken = set()
    if cfg.num_gpus != cluster.num_gpus:
        broken.add("gpus")
    if cluster.gpus_per_node % cfg.tp:
        broken.add("tp_node")
    if model.n_head % cfg.tp:
        broken.add("tp_heads")
    if model.n_layer % cfg.pp:
        broken.add("pp_layers")
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
        "positive": f"dp, tp, pp, cp and micro_batch must be >= 1, got {cfg.short()}",
        "gpus": f"dp*tp*pp*cp = {cfg.num_gpus}, but the cluster has {cluster.num_gpus} GPUs",
        "tp_node": f"tp={cfg.tp} must divide the {cluster.gpus_per_node} GPUs of a node (tensor parallelism stays inside a node)",
        "tp_heads": f"tp={cfg.tp} must divide the {model.n_head} attention heads",
        "pp_layers": f"pp={cfg.pp} must divide the {model.n_layer} layers",
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
    s_local = model.seq_len // cfg.cp
    split = cfg.tp  # with sequence parallelism every activation is split over the tp ranks
    full_layer = mm.transformer_activation_bytes(s_local, cfg.micro_batch, model.d_model, model.n_head,
                                                 attention_scores=False) / split
    layers = model.n_layer // cfg.pp
    in_flight = min(cfg.pp, cfg.micro_batches(model))
    if cfg.checkpointing:
        layer_input = BF16_BYTES * s_local * cfg.micro_batch * model.d_model / split
        activations = in_flight * layers * layer_input + full_layer
    else:
        activations = in_flight * layers * full_layer
    return MemoryEstimate(states, float(activations))


# ---- FLOPs and time -----------------------------------------------------------------------------


def model_flops(model: ModelSpec) -> float:
    """FLOPs of one training step, no recomputation: 72 B s L h^2 + 12 B s^2 L h + 6 B s h V (Narayanan et al. 2021).

    That is 6 x (matmul parameters) x tokens plus the attention score and value matmuls, counted
    in full (no saving for the causal mask), as MFU is usually reported.
    """
    B, s, L, h, V = model.global_batch, model.seq_len, model.n_layer, model.d_model, model.vocab_size
    return float(72 * B * s * L * h * h + 12 * B * s * s * L * h + 6 * B * s * h * V)


def hardware_flops(model: ModelSpec, checkpointing: bool) -> float:
    """FLOPs the GPUs execute: ``model_flops`` plus, with full checkpointing, one more forward pass of every layer."""
    B, s, L, h = model.global_batch, model.seq_len, model.n_layer, model.d_model
    extra = 24 * B * s * L * h * h + 4 * B * s * s * L * h if checkpointing else 0
    return model_flops(model) + extra


def link_bandwidths(cluster: ClusterSpec, cfg: ParallelConfig) -> dict[str, float]:
    """Bandwidth (bytes/s per GPU) of the link each kind of communication crosses.

    The mesh is (pp, dp, cp, tp) with tp fastest, so a group along one dimension spans
    ``stride x size`` consecutive ranks (stride = product of the faster dimensions); it stays
    inside a node (NVLink) when that span fits in one node, else it crosses InfiniBand.
    """
    spans = {"tp": cfg.tp, "cp": cfg.tp * cfg.cp, "dp": cfg.tp * cfg.cp * cfg.dp, "pp": cfg.num_gpus}
    return {k: cluster.intra_node_bw if span <= cluster.gpus_per_node else cluster.inter_node_bw for k, span in spans.items()}


def comm_wire_bytes(model: ModelSpec, cfg: ParallelConfig) -> dict[str, float]:
    """Bytes each GPU sends per step, by kind (bf16 values, ring algorithms).

    tp   per layer and micro-batch, all-reduces of the (b, s/cp, h) activation (Megatron-LM): 2 in the
         forward and 2 in the backward; full checkpointing repeats the forward, so 2 more: 4 or 6 in all.
         Each costs 2 (tp-1)/tp of its payload (with sequence parallelism an all-gather plus a
         reduce-scatter replace each all-reduce: the same volume).
    cp   per layer and micro-batch, ring attention with full multi-head K and V (each b (s/cp) h / tp
         values on one GPU). Forward: the K and V shards pass round the ring, cp-1 shifts, so
         2 (cp-1)/cp x b s h / tp values. Backward: K and V go round again and the dK, dV accumulators
         travel round too, twice the forward's traffic (counting cp-1 shifts for the accumulators; an
         implementation that ships them home with one extra shift, as course_lib.context_parallel
         does, sends 2 b (s/cp) h / tp values more). Full checkpointing repeats the forward, K and V
         included. In all 6 (cp-1)/cp x b s h / tp values, 8 with checkpointing; zero with cp = 1.
    pp   per micro-batch, the stage's output forward and its gradient backward: 2 b (s/cp) h / tp values
         (zero with pp = 1).
    dp   per step, the gradients of the GPU's P / (tp pp) parameters over dp x cp ranks: an all-reduce
         (ZeRO 1 and 2: reduce-scatter + all-gather, the same volume; ZeRO 3: 1.5 x, the weights are
         gathered again for the backward pass).
    """
    b, s, h = cfg.micro_batch, model.seq_len, model.d_model
    m, layers = cfg.micro_batches(model), model.n_layer // cfg.pp
    act = b * (s // cfg.cp) * h * BF16_BYTES
    n_tp_ops = 6 if cfg.checkpointing else 4
    tp = m * layers * n_tp_ops * all_reduce_wire_bytes(act, cfg.tp)
    kv_forward = 2 * (cfg.cp - 1) / cfg.cp * b * s * h * BF16_BYTES / cfg.tp  # K and V round the ring once
    n_kv_rounds = (2 if cfg.checkpointing else 1) + 2  # forward(s), then backward: K, V again plus dK, dV
    cp = m * layers * n_kv_rounds * kv_forward
    pp = 0.0 if cfg.pp == 1 else m * 2 * act / cfg.tp
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
    hw = hardware_flops(model, cfg.checkpointing)
    n = cfg.num_gpus
    compute = hw / (n * cluster.peak_flops * cluster.efficiency)
    bubble = compute * (cfg.pp - 1) / cfg.micro_batches(model)
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
    checkpointing: Sequence[bool] = (False, True),
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
            for zero, ck, mb in itertools.product(zero_stages, checkpointing, micro_batches):
                cfg = ParallelConfig(dp, tp, pp, cp, zero, ck, mb)
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

