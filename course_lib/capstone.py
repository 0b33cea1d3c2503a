"""Chapter 16 (capstone): train the course GPT on one device with every single-device technique of the course.

Two runs of the same model on the same batches, and what separates them:

    baseline   fp32 weights and math (TF32 off), eager mode, AdamW's default (foreach) kernels
    optimized  bf16 autocast (fp32 master weights), SDPA's FlashAttention / cuDNN kernel (is_causal),
               torch.compile, fused AdamW, optional activation checkpointing per block

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
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace

import torch

from course_lib import env, models
from course_lib.flops import checkpoint_blocks, device_peak_flops, step_flops, utilization
from course_lib.optimizers import fused_supported

__all__ = ["RunConfig", "RunResult", "compare", "device_peak_flops", "flops_per_step", "main", "train"]

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
    seed: int = 0

    @classmethod
    def for_this_machine(cls, steps: int = 20) -> RunConfig:
        """Tiny on a CPU (no compile: it costs more than it saves there); GPT-2 small, batch 32 x 1024 on a GPU."""
        return env.pick(
            cpu=cls("tiny", steps=steps, batch_size=8, compile=False),
            gpu=cls("gpt2-small", steps=steps, batch_size=32, warmup=5),
        )

    def baseline(self) -> RunConfig:
        """The same run with every technique off: fp32, eager, default AdamW, no checkpointing."""
        return replace(self, bf16=False, compile=False, fused_adam=False, checkpointing=False)

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


def train(
    run: RunConfig, device: torch.device | None = None, progress: bool = True, peak: tuple[float, str] | None = None
) -> RunResult:
    """Train ``run``'s GPT for ``warmup + steps`` steps on learnable synthetic batches; time the last ``steps``.

    ``peak`` is (FLOP/s, source) to state MFU against; None asks ``device_peak_flops``.
    """
    from tqdm.auto import tqdm

    device = device or env.DEVICE
    cfg = run.model_config()
    model = models.GPT(cfg, seed=run.seed).to(device)
    if run.checkpointing:
        checkpoint_blocks(model)
    fused = run.fused_adam and fused_supported(device)
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, fused=fused or None)
    step_model = torch.compile(model) if run.compile else model
    x, y = models.repeating_batch(cfg, run.batch_size, period=16, device=device, seed=run.seed)
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if run.bf16 else contextlib.nullcontext()

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with amp:
            _, loss = step_model(x, y)
        loss.backward()
        opt.step()
        return loss.detach()

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
        extra={"fused_adam": fused},
    )


def compare(run: RunConfig, device: torch.device | None = None, progress: bool = True) -> dict:
    """Run the fp32 eager baseline and ``run``; return both results and the speed-up in tokens/s."""
    device = device or env.DEVICE
    peak = device_peak_flops(device)
    base = train(run.baseline(), device, progress, peak)
    fast = train(run, device, progress, peak)
    return {"baseline": base, "optimized": fast, "speedup": fast.tokens_per_s / base.tokens_per_s}


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
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args(argv)
    run = RunConfig(args.preset, steps=args.steps, seq_len=args.seq_len,
                    batch_size=args.batch_size or (32 if args.preset == "gpt2-small" else 8),
                    compile=not args.no_compile and env.HAS_GPU, checkpointing=args.checkpointing,
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
