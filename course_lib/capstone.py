"""Chapter 16 (capstone): the course GPT trained with the course's own parts, and what each part buys.

**The assembled run** (the chapter's last exercises). ``Parts`` is the seam: one field per part
built in an earlier chapter (attention: 10, fused Adam: 08, mixed precision: 06, checkpointing:
07, gradient averaging: 12), each defaulting to the course's reference; ``Techniques`` says which
are switched on. ``assemble(parts, tech, run, mesh)`` builds the GPT (tensor-parallel blocks and
data-parallel gradients over a ``hybrid`` mesh when one is given) and returns one training step;
``ablation`` switches the techniques on one at a time and measures tokens/s, peak memory and MFU
per row:

    parts, run = capstone.Parts(), capstone.CapstoneRun.for_this_machine()
    step = capstone.assemble(parts, capstone.Techniques(flash=True, bf16=True), run)
    losses = [step(i) for i in range(5)]
    rows = capstone.ablation(capstone.assemble, parts, run, capstone.TECHNIQUES, steps=5, peak_flops=1e12)

``python -m benchmarks.capstone`` writes the GPU record of that ablation.

**The all-at-once comparison** (kept for its committed H200 record). Two runs of the same model on
the same batches, and what separates them:

    baseline   fp32 weights and math (TF32 off), eager mode, AdamW's default (foreach) kernels
    optimized  bf16 autocast (fp32 master weights), SDPA's FlashAttention / cuDNN kernel (is_causal),
               torch.compile, fused AdamW, optional activation checkpointing per block, optional
               (``fused_loss``) LM head and cross-entropy fused by row chunks (``lm_head_loss``: no
               full logits tensor; compiled up to the final LayerNorm, its Triton kernels run as they are),
               optional (``course_adam``) chapter 08's flat fused Adam instead of torch's fused AdamW,
               optional (``bf16_weights``) a bf16 model with fp32 master weights (chapter 06) instead of autocast,
               optional (``fused_mlp``) the MLP's GELU inside its matmuls' epilogues (``kernels.fused_mlp``),
               optional (``fitted_gelu``) the MLP's GELU through chapter 08's fitted erfc (``erfc.fitted_gelu``),
               which torch.compile fuses as it fuses the exact one, with less arithmetic,
               optional (``kernel_gelu``) the MLP's bias + GELU by chapter 08's kernel (``kernels.gelu_op``),
               optional (``cuda_graphs``) the compiled part replayed from CUDA graphs

    from course_lib import capstone
    result = capstone.compare(capstone.RunConfig.for_this_machine(steps=20))
    result["speedup"], result["optimized"].mfu

MFU counts model FLOPs as chapter 03's ``flops.step_flops`` does (6 x matmul parameters x tokens plus
the attention matmuls) against ``flops.device_peak_flops``: the device's dense bf16 peak
(``orientation.H100_SXM`` / ``H200_SXM``); on a CPU, where no datasheet figure applies, a measured
fp32 matmul rate (said so in the result).

    python -m course_lib.capstone --preset gpt2-small --steps 50 --out capstone.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib import env, models
from course_lib.accumulation_checkpointing import checkpointed_sequential, plain_sequential
from course_lib.attention import tiled_attention, tiled_attention_backward
from course_lib.erfc import fitted_gelu
from course_lib.flops import checkpoint_blocks, device_peak_flops, step_flops, utilization
from course_lib.lm_head_loss import linear_cross_entropy
from course_lib.mixed_precision import MasterWeights
from course_lib.optimizers import fused_supported
from course_lib.support.dist import rank_device
from course_lib.tensor_parallel import ParallelBlock

__all__ = [
    "TECHNIQUES", "CapstoneRun", "PartAttention", "Parts", "RunConfig", "RunResult", "Techniques", "TiledFlashAttention",
    "ablation", "assemble", "attention_from", "average_gradients", "bf16_autocast", "checkpointed_blocks", "compare",
    "course_flash_attention", "device_peak_flops", "flops_per_step", "fused_adam", "load_solutions", "main",
    "peak_memory", "tiled_flash_attention", "train", "training_step", "triton_flash_attention",
]

PRESETS = {"tiny": models.GPTConfig.tiny, "gpt2-small": models.GPTConfig.small}


@dataclass(frozen=True)
class RunConfig:
    """What to train and how: model preset, steps, batch (sequences), sequence length, learning rate, and the techniques."""

    preset: str = "tiny"
    steps: int = 20
    batch_size: int = 8
    seq_len: int | None = None  # None: the preset's
    lr: float = 1e-3
    warmup: int = 3  # untimed steps (compilation happens here)
    bf16: bool = True
    compile: bool = True
    fused_adam: bool = True
    checkpointing: bool = False
    fused_loss: bool = False  # the LM head and loss by lm_head_loss.linear_cross_entropy, outside torch.compile
    course_adam: bool = False  # chapter 08's FlatAdam (one kernel per step) instead of torch's AdamW
    bf16_weights: bool = False  # a bf16 model (weights and activations) with fp32 master weights; needs fused_loss
    fused_mlp: bool = False  # the MLP's GELU in the epilogues of its matmuls (kernels.fused_mlp); needs bias
    cuda_graphs: bool = False  # the compiled part replayed from CUDA graphs (torch.compile's "reduce-overhead" mode)
    fitted_gelu: bool = False  # the MLP's GELU through the fitted erfc (erfc.fitted_gelu): within bf16's rounding
    kernel_gelu: bool = False  # the MLP's bias + GELU by chapter 08's kernel, a custom op (kernels.gelu_op)
    seed: int = 0

    @classmethod
    def for_this_machine(cls, steps: int = 20) -> RunConfig:
        """Tiny on a CPU (no compile: it costs more than it saves there); GPT-2 small, batch 32 x 1024 on a GPU."""
        return env.pick(
            cpu=cls("tiny", steps=steps, batch_size=8, compile=False),
            gpu=cls("gpt2-small", steps=steps, batch_size=32, warmup=5),
        )

    def baseline(self) -> RunConfig:
        """The same run with every technique off: fp32, eager, default AdamW, no checkpointing, unfused loss."""
        return replace(self, bf16=False, compile=False, fused_adam=False, checkpointing=False, fused_loss=False,
                       course_adam=False, bf16_weights=False, fused_mlp=False, cuda_graphs=False,
                       fitted_gelu=False, kernel_gelu=False)

    def model_config(self) -> models.GPTConfig:
        """The preset's GPT configuration, with ``seq_len`` if one is given."""
        cfg = PRESETS[self.preset]()
        return cfg if self.seq_len is None else replace(cfg, seq_len=self.seq_len)


@dataclass
class RunResult:
    """Losses per step and the throughput of the timed steps."""

    config: RunConfig
    losses: list[float]
    step_s: float
    tokens_per_s: float
    mfu: float
    peak_flops: float
    peak_source: str
    params: int
    device: str
    extra: dict = field(default_factory=dict)


def flops_per_step(cfg: models.GPTConfig, batch_size: int) -> float:
    """Model FLOPs of one step of ``cfg`` at ``batch_size`` sequences (``flops.step_flops``)."""
    return float(step_flops(cfg, batch_size)[0])


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def training_step(run: RunConfig, device: torch.device | None = None) -> tuple[Callable[[], torch.Tensor], models.GPT, dict]:
    """``run``'s GPT, optimizer and fixed synthetic batch, built once: (step, model, facts); ``step()`` trains one step.

    ``facts`` says which kernels the step uses where the configuration leaves a choice
    (``fused_adam``: torch's fused AdamW ran; ``course_adam``; ``fused_loss``; ``bf16_weights``; ``fused_mlp``;
    ``cuda_graphs``: the compiled part was recorded into CUDA graphs, which happens on a GPU only;
    ``fitted_gelu``; ``kernel_gelu``).
    """
    device = device or env.DEVICE
    cfg = run.model_config()
    model = models.GPT(cfg, seed=run.seed).to(device)
    if run.checkpointing:
        checkpoint_blocks(model)
    if run.bf16_weights and not (run.bf16 and run.fused_loss):
        raise ValueError("bf16_weights needs bf16 and fused_loss (whose loss is computed in fp32)")
    if run.fitted_gelu + run.kernel_gelu + run.fused_mlp > 1:
        raise ValueError("fitted_gelu, kernel_gelu and fused_mlp each replace the MLP's GELU: choose one")
    if run.cuda_graphs and not run.compile:
        raise ValueError("cuda_graphs needs compile: torch.compile's reduce-overhead mode records the graphs")
    # With bf16_weights (chapter 06's MasterWeights) the model itself is bf16, so are its activations,
    # the residual stream included; the optimizer updates fp32 master copies.
    master = MasterWeights(model, torch.bfloat16) if run.bf16_weights else None
    if master is not None:
        model = cast(models.GPT, master.model)
        for p in master.params:
            p.grad = torch.zeros_like(p)  # filled by a copy each step
    if run.fused_mlp:  # the same fc and proj parameters, run by the fused kernels
        from course_lib.kernels.fused_mlp import FusedFeedForward

        for block in cast(list[models.Block], model.blocks):
            block.mlp = FusedFeedForward(block.mlp)
    if run.fitted_gelu:
        for block in cast(list[models.Block], model.blocks):
            block.mlp.activation = fitted_gelu
    if run.kernel_gelu:  # the same parameters; fc's bias moves into the kernel
        from course_lib.kernels.gelu_op import KernelGeluFeedForward

        for block in cast(list[models.Block], model.blocks):
            block.mlp = KernelGeluFeedForward(block.mlp)
    params: list[torch.Tensor] = list(master.params if master is not None else model.parameters())
    fused = run.fused_adam and fused_supported(device) and not run.course_adam
    opt: torch.optim.Optimizer
    if run.course_adam:  # chapter 08's flat Adam, as AdamW (decoupled decay, torch's default 0.01)
        from course_lib.kernels.fusion import FlatAdam

        opt = FlatAdam(params, lr=run.lr, weight_decay=0.01, decoupled=True)
    else:
        opt = torch.optim.AdamW(params, lr=run.lr, fused=fused or None)
    compile_ = functools.partial(torch.compile, mode="reduce-overhead") if run.cuda_graphs else torch.compile
    if run.fused_loss:  # compiled up to the final LayerNorm; the chunked LM head and loss run their kernels as they are
        final_hidden = functools.partial(_final_hidden, model)
        step_hidden = compile_(final_hidden) if run.compile else final_hidden
    else:
        step_model = compile_(model) if run.compile else model
    x, y = models.repeating_batch(cfg, run.batch_size, period=16, device=device, seed=run.seed)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if run.bf16 and master is None else contextlib.nullcontext()
    lowp: list[torch.Tensor] = list(model.parameters())

    def step() -> torch.Tensor:
        if run.cuda_graphs:  # a new iteration: the graphs may reuse the memory of the last step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        (model if master is not None else opt).zero_grad(set_to_none=True)
        with amp:
            if run.fused_loss:
                loss = linear_cross_entropy(step_hidden(x), model.lm_head.weight, y)
            else:
                _, loss = step_model(x, y)
        loss.backward()
        if master is not None:  # one fused copy each way: bf16 grads up to fp32, fp32 weights down to bf16
            torch._foreach_copy_(cast(list[torch.Tensor], [p.grad for p in params]),
                                 [torch.zeros_like(p) if p.grad is None else p.grad for p in lowp])
        opt.step()
        if master is not None:
            with torch.no_grad():
                torch._foreach_copy_(lowp, params)
        # A graph's output lives in memory the next replay overwrites: the loss the caller keeps is a copy.
        return loss.detach().clone() if run.cuda_graphs else loss.detach()

    facts = {"fused_adam": fused, "course_adam": run.course_adam, "fused_loss": run.fused_loss,
             "bf16_weights": run.bf16_weights, "fused_mlp": run.fused_mlp,
             "cuda_graphs": run.cuda_graphs and device.type == "cuda", "fitted_gelu": run.fitted_gelu,
             "kernel_gelu": run.kernel_gelu}
    return step, model, facts


def train(
    run: RunConfig, device: torch.device | None = None, progress: bool = True, peak: tuple[float, str] | None = None
) -> RunResult:
    """Train ``run``'s GPT for ``warmup + steps`` steps on learnable synthetic batches; time the last ``steps``.

    ``peak`` is (FLOP/s, source) to state MFU against; None asks ``device_peak_flops``.
    """
    from tqdm.auto import tqdm

    device = device or env.DEVICE
    cfg = run.model_config()
    step, model, facts = training_step(run, device)
    losses: list[torch.Tensor] = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    label = "optimized" if run.bf16 or run.compile else "baseline"
    with _tf32(False):
        bar = tqdm(range(run.warmup + run.steps), desc=f"{label} {run.preset}", disable=not progress, leave=False)
        for i in bar:
            if i == run.warmup:
                sync()
                start = time.perf_counter()
            losses.append(step())
        sync()
        elapsed = time.perf_counter() - start if run.steps else float("nan")
    step_s = elapsed / max(run.steps, 1)
    peak_rate, source = peak if peak is not None else device_peak_flops(device)
    tokens = run.batch_size * cfg.seq_len
    return RunResult(
        config=run,
        losses=[float(v) for v in losses],
        step_s=step_s,
        tokens_per_s=tokens / step_s,
        mfu=utilization(cfg, run.batch_size, step_s, peak_rate, run.checkpointing)[0],
        peak_flops=peak_rate,
        peak_source=source,
        params=model.num_params(),
        device=str(device),
        extra=facts,
    )


def _final_hidden(model: models.GPT, idx: torch.Tensor) -> torch.Tensor:
    """The GPT's hidden states after the final LayerNorm, the LM head's input: (batch, time, d_model)."""
    h = model.embed(idx)
    for block in model.blocks:
        h = block(h)
    return model.ln_f(h)


def compare(run: RunConfig, device: torch.device | None = None, progress: bool = True) -> dict:
    """Run the fp32 eager baseline and ``run``; return both results and the speed-up in tokens/s."""
    device = device or env.DEVICE
    peak = device_peak_flops(device)
    base = train(run.baseline(), device, progress, peak)
    fast = train(run, device, progress, peak)
    return {"baseline": base, "optimized": fast, "speedup": fast.tokens_per_s / base.tokens_per_s}


# ---- the assembled run: the course's parts behind one seam ---------------------------------------


class TiledFlashAttention(torch.autograd.Function):
    """FlashAttention from two of chapter 10's functions: a tiled forward that returns (out, lse), a backward from lse."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                forward_fn: Callable[..., Any], backward_fn: Callable[..., Any]) -> torch.Tensor:
        """Output of attention; only Q, K, V, O and the logsumexp are kept for the backward pass."""
        out, lse = forward_fn(q, k, v, causal, 16, 16)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.backward_fn = causal, backward_fn
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """dQ, dK, dV, block by block, from the saved logsumexp."""
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backward_fn(q, k, v, out, lse, dout, ctx.causal, 16)
        return dq, dk, dv, None, None, None


def tiled_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Attention of (batch, heads, seq, head_dim) tensors by chapter 10's tiled PyTorch kernels, with autograd."""
    return TiledFlashAttention.apply(q, k, v, causal, tiled_attention, tiled_attention_backward)


def attention_from(forward_fn: Callable[..., Any], backward_fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """An ``attention`` part from your chapter 10 ``tiled_attention`` and ``tiled_attention_backward``."""
    return functools.partial(_attention_with, forward_fn, backward_fn)


def _attention_with(forward_fn: Callable[..., Any], backward_fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    return TiledFlashAttention.apply(q, k, v, causal, forward_fn, backward_fn)


def triton_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Chapter 10's Triton FlashAttention (``kernels.flash_attention.flash_attention``); for a GPU."""
    from course_lib.kernels.flash_attention import flash_attention

    return flash_attention(q, k, v, causal)


def course_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """The course's FlashAttention for where the tensors are: the Triton kernel on a GPU, the tiled PyTorch one on a CPU."""
    if q.is_cuda:
        return triton_flash_attention(q, k, v, causal)
    return tiled_flash_attention(q, k, v, causal)


def fused_adam(params: Iterable[torch.Tensor], lr: float, step_fn: Callable[..., None] | None = None) -> torch.optim.Optimizer:
    """Chapter 08's fused Adam: one kernel per step over a flat buffer (``kernels.fusion.FlatAdam``).

    ``step_fn`` replaces the kernel launch: a function with the signature of chapter 08's
    ``adam_step_(params, grads, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
    decoupled)`` on flat fp32 buffers (yours, for example).
    """
    from course_lib.kernels.fusion import FlatAdam

    params = list(params)
    if not (params[0].is_cuda or env.INTERPRET):  # CPU ranks on a GPU host: no Triton for CPU tensors there
        return torch.optim.Adam(params, lr=lr, foreach=True)
    opt = FlatAdam(params, lr=lr)
    if step_fn is not None:
        launch = step_fn

        @torch.no_grad()
        def step(closure: Any = None) -> None:
            for hyper, group in zip(opt.param_groups, opt.flat_groups):
                opt._regather_grads(group)
                group.step += 1
                beta1, beta2 = hyper["betas"]
                launch(group.flat_param, group.flat_grad, group.exp_avg, group.exp_avg_sq, step=group.step,
                       lr=hyper["lr"], beta1=beta1, beta2=beta2, eps=hyper["eps"],
                       weight_decay=hyper["weight_decay"], decoupled=hyper["decoupled"])

        opt.step = step  # type: ignore[method-assign]
    return opt


def bf16_autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Chapter 06's mixed precision: bf16 autocast on ``device``, fp32 master weights (bf16 needs no loss scaling)."""
    return torch.autocast(device.type, dtype=torch.bfloat16)


class _ReplayAutocast(nn.Module):
    """Runs a module under the autocast state it was built in, so a checkpoint's recomputation matches the forward."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.device_type = "cuda" if torch.is_autocast_enabled("cuda") else "cpu"
        self.enabled = torch.is_autocast_enabled(self.device_type)
        self.dtype = torch.get_autocast_dtype(self.device_type)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled):
            return self.module(x)


def checkpointed_blocks(modules: Sequence[nn.Module], segments: int, x: torch.Tensor) -> torch.Tensor:
    """Chapter 07's ``checkpointed_sequential``, with each module replayed under the forward's autocast state.

    Chapter 07's ``CheckpointSegment`` reruns a segment in the backward pass, where no autocast is
    active: under bf16 autocast the recomputed activations would be fp32, not the forward's bf16.
    """
    return checkpointed_sequential([_ReplayAutocast(m) for m in modules], segments, x)


def average_gradients(model: nn.Module, group: Any = None) -> None:
    """Chapter 12's naive DDP over ``group``: every gradient replaced by its mean over the group's ranks."""
    size = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(size)


@dataclass(frozen=True)
class Parts:
    """The seam between the earlier chapters and the capstone: one field per part, each with its call signature.

    attention(q, k, v, causal) -> out        (batch, heads, seq, head_dim); chapter 10
    optimizer(params, lr) -> Optimizer       a fused Adam; chapter 08
    autocast(device) -> context manager      mixed precision; chapter 06
    checkpoint(modules, segments, x) -> y    activation checkpointing; chapter 07
    average_gradients(model, group)          gradients averaged over a process group; chapter 12

    The defaults are the course's references (attention on CPU tensors is chapter 10's tiled PyTorch
    version, on GPU tensors its Triton kernel). ``Parts(attention=my_flash_attention)`` plugs in your own.
    """

    attention: Callable[..., torch.Tensor] = course_flash_attention
    optimizer: Callable[..., torch.optim.Optimizer] = fused_adam
    autocast: Callable[[torch.device], contextlib.AbstractContextManager[Any]] = bf16_autocast
    checkpoint: Callable[..., torch.Tensor] = checkpointed_blocks
    average_gradients: Callable[..., None] = average_gradients


TECHNIQUES = ("flash", "bf16", "fused_adam", "checkpointing")


@dataclass(frozen=True)
class Techniques:
    """Which parts a run uses; each off means the plain PyTorch way (SDPA, fp32, ``torch.optim.Adam``, no checkpointing)."""

    flash: bool = False
    bf16: bool = False
    fused_adam: bool = False
    checkpointing: bool = False

    def on(self) -> list[str]:
        """The names of the techniques switched on."""
        return [name for name in TECHNIQUES if getattr(self, name)]


@dataclass(frozen=True)
class CapstoneRun:
    """The model, the data and the optimizer's learning rate of an assembled run; the same for every layout."""

    model: models.GPTConfig = field(default_factory=lambda: models.GPTConfig(seq_len=32))
    batch_size: int = 8
    lr: float = 3e-3
    seed: int = 0

    @classmethod
    def for_this_machine(cls) -> CapstoneRun:
        """The tiny GPT at 8 x 32 tokens on a CPU; GPT-2 small at 16 x 1024 tokens on a GPU."""
        return env.pick(cpu=cls(), gpu=cls(models.GPTConfig.small(), batch_size=16, lr=6e-4))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of step ``step`` (batch_size, seq_len), on the CPU.

        Every row cycles through one random pattern of 16 tokens (the same at every step), from a
        start drawn anew per step, so the model can learn it and the loss falls.
        """
        cfg = self.model
        pattern = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(self.seed))[:16]
        starts = torch.randint(16, (self.batch_size, 1), generator=torch.Generator().manual_seed(self.seed + 1 + step))
        tokens = pattern[(starts + torch.arange(cfg.seq_len + 1)) % 16]
        return tokens[:, :-1], tokens[:, 1:]

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one global batch."""
        return self.batch_size * self.model.seq_len


class PartAttention(nn.Module):
    """A block's attention (``models.CausalSelfAttention`` or ``tensor_parallel.ParallelAttention``) with its kernel replaced.

    The projections stay the module's own (column- and row-parallel under TP); only the
    ``softmax(q k^T) v`` in between is ``fn(q, k, v, causal=True)``.
    """

    def __init__(self, attn: nn.Module, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.qkv: nn.Module = attn.qkv  # type: ignore[assignment]
        self.proj: nn.Module = attn.proj  # type: ignore[assignment]
        self.resid_dropout: nn.Module = attn.resid_dropout  # type: ignore[assignment]
        self.head_dim: int = attn.head_dim  # type: ignore[assignment]
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        q, k, v = (t.view(batch, time, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = self.fn(q, k, v, True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(batch, time, -1)))


def assemble(parts: Parts, tech: Techniques, run: CapstoneRun, mesh: Any = None) -> Callable[[int], float]:
    """Build the run's GPT with the parts ``tech`` switches on; return ``step(i)``, one training step on batch i.

    ``step(i)`` returns the loss of the global batch i (a float: with data parallelism, the mean
    of the dp ranks' losses). ``mesh`` (a ``hybrid.MeshGroups`` with dims "dp" and "tp", or None for
    one process): every block is tensor-parallel over the tp group (chapter 13), each dp rank takes
    its slice of the batch and gradients are averaged over the dp group (chapter 12).
    """
    device = rank_device() if mesh is not None else env.DEVICE
    model = models.GPT(run.model, seed=run.seed)
    dp = tp = 1
    if mesh is not None:
        dp, tp = len(mesh.ranks["dp"]), len(mesh.ranks["tp"])
        model.blocks = nn.ModuleList(ParallelBlock.from_module(b, mesh.coords["tp"], tp, group=mesh.groups["tp"])  # type: ignore[arg-type]
                                     for b in model.blocks)
    if tech.flash:
        for block in model.blocks:
            block.attn = PartAttention(block.attn, parts.attention)  # type: ignore[arg-type]
    model = model.to(device)
    if tech.fused_adam:
        opt = parts.optimizer(model.parameters(), run.lr)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=run.lr, foreach=False)
    if run.batch_size % dp:
        raise ValueError(f"batch_size={run.batch_size} does not split over dp={dp}")
    per = run.batch_size // dp
    d = mesh.coords["dp"] if mesh is not None else 0

    def step(i: int) -> float:
        x, y = (t[d * per:(d + 1) * per].to(device) for t in run.batch(i))
        opt.zero_grad()
        with parts.autocast(device) if tech.bf16 else contextlib.nullcontext():
            h = model.embed(x)
            h = parts.checkpoint(model.blocks, len(model.blocks), h) if tech.checkpointing else \
                plain_sequential(list(model.blocks), h)
            logits = model.unembed(h)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        if dp > 1:
            parts.average_gradients(model, mesh.groups["dp"])
        opt.step()
        value = loss.detach().float().reshape(1)
        if dp > 1:
            dist.all_reduce(value, group=mesh.groups["dp"])
            value /= dp
        return float(value)

    return step


# ---- the ablation: one change per row ------------------------------------------------------------


def peak_memory(fn: Callable[[], Any], device: torch.device | None = None) -> int:
    """Peak bytes while ``fn()`` runs: the allocator's peak on a GPU; on a CPU, the peak of what autograd saved.

    (A CPU has no allocator statistics: there the figure is the activations kept for the backward
    pass, counted by saved-tensor hooks, parameters excluded; it shows what checkpointing and bf16 save.)
    """
    device = device or env.DEVICE
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    live: dict[int, int] = {}
    peak = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal peak
        if not isinstance(t, nn.Parameter) and t.untyped_storage().data_ptr() not in live:
            live[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            peak = max(peak, sum(live.values()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return peak


def ablation(assemble_fn: Callable[..., Callable[[int], float]], parts: Parts, run: CapstoneRun,
             order: Sequence[str], steps: int, peak_flops: float, warmup: int = 1) -> list[dict[str, Any]]:
    """Rows of an ablation: the plain run, then each technique of ``order`` switched on in turn, one per row.

    Each row: ``added`` (the technique switched on in this row, None for the first), ``techniques``
    (the names on), ``losses`` (of the ``warmup + steps`` steps), ``tokens_per_s`` (over the
    ``steps`` timed steps), ``peak_bytes`` (``peak_memory`` of one more step) and ``mfu`` (model
    FLOPs of a step, ``flops.step_flops``, over ``peak_flops`` x the step time).
    """
    model_flops = step_flops(run.model, run.batch_size)[0]
    tech = Techniques()
    rows = []
    for added in [None, *order]:
        if added is not None:
            tech = replace(tech, **{added: True})
        step = assemble_fn(parts, tech, run)
        losses = [step(i) for i in range(warmup)]
        start = time.perf_counter()
        losses += [step(i) for i in range(warmup, warmup + steps)]
        step_s = (time.perf_counter() - start) / steps
        peak = peak_memory(functools.partial(step, warmup + steps))
        rows.append({"added": added, "techniques": tech.on(), "losses": losses,
                     "tokens_per_s": run.tokens_per_step / step_s, "peak_bytes": peak,
                     "mfu": model_flops / (step_s * peak_flops)})
    return rows


def load_solutions(notebook: str | Path, names: Sequence[str]) -> dict[str, Any]:
    """Your functions ``names`` from one of your chapter notebooks, to plug into ``Parts``.

    Runs, in a fresh namespace of this kernel and in the notebook's order, the exercise (solution)
    cells whole and, of every other code cell, only its ``import`` statements and its ``def`` and
    ``class`` statements (helpers an exercise may use); then returns the requested names. No test,
    experiment or plot runs. It executes your code: load only your own notebooks. KeyError names
    what the notebook does not define.
    """
    import ast

    import nbformat

    nb = nbformat.read(str(notebook), as_version=4)
    namespace: dict[str, Any] = {"__name__": f"solutions_of_{Path(notebook).stem}"}
    keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        if not cell.metadata.get("nbgrader", {}).get("solution"):
            tree.body = [n for n in tree.body if isinstance(n, keep)]
        exec(compile(tree, f"<{Path(notebook).name}>", "exec"), namespace)
    missing = [n for n in names if n not in namespace]
    if missing:
        raise KeyError(f"{notebook} defines no {', '.join(missing)}")
    return {n: namespace[n] for n in names}


def _summary(result: dict) -> dict:
    def one(r: RunResult) -> dict:
        d = asdict(r)
        d["config"] = asdict(r.config)
        return d

    return {"baseline": one(result["baseline"]), "optimized": one(result["optimized"]), "speedup": result["speedup"]}


def main(argv: list[str] | None = None) -> None:
    """``python -m course_lib.capstone --preset gpt2-small --steps N --out FILE``: baseline vs optimized, as JSON."""
    parser = argparse.ArgumentParser(description="the capstone run: fp32 eager baseline vs every single-device technique")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=env.pick(cpu="tiny", gpu="gpt2-small"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--fused-loss", action="store_true", help="LM head + cross-entropy by row chunks (lm_head_loss)")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args(argv)
    run = RunConfig(args.preset, steps=args.steps, seq_len=args.seq_len,
                    batch_size=args.batch_size or (32 if args.preset == "gpt2-small" else 8),
                    compile=not args.no_compile and env.HAS_GPU, checkpointing=args.checkpointing,
                    fused_loss=args.fused_loss,
                    warmup=5 if env.HAS_GPU else 3)
    summary = _summary(compare(run, progress=False))
    text = json.dumps(summary)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    o, b = summary["optimized"], summary["baseline"]
    print(f"baseline  {b['tokens_per_s']:12.0f} tokens/s  MFU {b['mfu']:.1%}")
    print(f"optimized {o['tokens_per_s']:12.0f} tokens/s  MFU {o['mfu']:.1%}  speed-up {summary['speedup']:.2f}x")
    print("RESULT " + text)


if __name__ == "__main__":
    main()
