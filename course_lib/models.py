"""Models shared by the chapters: a GPT-style decoder, a plain MLP, and synthetic token batches.

The GPT follows the GPT-2 layout (learned positions, pre-LayerNorm blocks, GELU MLP) with
module names that later chapters rely on when they split it:

    tok_emb, pos_emb                      embeddings (first pipeline stage)
    blocks[i].ln_1, .attn.qkv, .attn.proj  attention half of block i
    blocks[i].ln_2, .mlp.fc, .mlp.proj     MLP half of block i
    ln_f, lm_head                          final norm and output projection (last stage)

    cfg = GPTConfig.preset()              # tiny on a CPU, GPT-2-small sized on a GPU
    model = GPT(cfg, seed=0).to(env.DEVICE)
    x, y = random_batch(cfg, batch_size=8, device=env.DEVICE)
    logits, loss = model(x, y)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import env

__all__ = [
    "INIT_STD",
    "GPTConfig",
    "gpt_param_count",
    "CausalSelfAttention",
    "FeedForward",
    "Block",
    "GPT",
    "MLP",
    "random_batch",
    "repeating_batch",
]

# Standard deviation of the GPT-2 initialisation for weights and embeddings.
INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT: vocabulary, context length, depth, width and a few switches.

    ``bias`` puts biases in every Linear and LayerNorm (as GPT-2 does). ``tie_embeddings``
    defaults to False: the output projection has its own weight, so a pipeline can place the
    token embedding and the LM head on different stages without sharing a tensor between them.
    The LM head never has a bias.
    """

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not a multiple of n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: d_model / n_head."""
        return self.d_model // self.n_head

    @property
    def d_ff(self) -> int:
        """Hidden width of the MLP: mlp_ratio * d_model."""
        return self.mlp_ratio * self.d_model

    @classmethod
    def tiny(cls) -> GPTConfig:
        """A model that trains in seconds on a laptop CPU (about 0.14 M parameters)."""
        return cls(vocab_size=256, seq_len=64, n_layer=2, n_head=4, d_model=64)

    @classmethod
    def small(cls) -> GPTConfig:
        """GPT-2 small's shape (vocabulary padded to 50304, a multiple of 64) for one GPU: about 163 M parameters."""
        return cls(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768)

    @classmethod
    def preset(cls) -> GPTConfig:
        """``tiny()`` on a CPU, ``small()`` on a GPU (chosen by ``env.pick``)."""
        return env.pick(cpu=cls.tiny(), gpu=cls.small())


def gpt_param_count(config: GPTConfig) -> int:
    """Number of parameters of ``GPT(config)``, by formula.

    With width h, depth L, MLP ratio r, vocabulary V, context T and b = 1 if ``bias`` else 0,
    one block holds (4 + 2r) h^2 weights + b (r + 5) h Linear biases + 2 (1 + b) h LayerNorm
    parameters; for r = 4 and biases that is the familiar 12 h^2 + 13 h. Around the blocks:
    V h token and T h position embeddings, (1 + b) h for the final LayerNorm, and V h for
    the LM head unless it is tied to the token embedding.
    """
    h, r, b = config.d_model, config.mlp_ratio, int(config.bias)
    per_block = (4 + 2 * r) * h * h + b * (r + 5) * h + 2 * (1 + b) * h
    embeddings = (config.vocab_size + config.seq_len) * h
    head = 0 if config.tie_embeddings else config.vocab_size * h
    return config.n_layer * per_block + embeddings + (1 + b) * h + head


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Draw from torch's CPU generator seeded with ``seed`` inside, leaving the global state untouched."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape (batch, time, d_model); return the same shape."""
        batch, time, _ = x.shape
        # The head count comes from the projection's output width, so a tensor-parallel
        # shard that holds only some of the heads runs this same code.
        q, k, v = (
            t.view(batch, time, -1, self.head_dim).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(batch, time, -1)
        return self.resid_dropout(self.proj(y))


class FeedForward(nn.Module):
    """The transformer's position-wise MLP: Linear (d -> r d), GELU, Linear (r d -> d)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        # The exact GELU; the capstone may swap in another of the same function (erfc.fitted_gelu).
        self.activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to every position of ``x``."""
        return self.dropout(self.proj(self.activation(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the block on hidden states of shape (batch, time, d_model)."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2 style language model; ``forward(idx, targets)`` returns (logits, loss or None).

    The forward pass is ``embed`` -> each of ``blocks`` -> ``unembed``; pipeline-parallel code
    can call these three pieces on different stages. With ``seed`` the initial weights are drawn
    from a generator seeded with it, without touching torch's global random state.
    """

    def __init__(self, config: GPTConfig, *, seed: int | None = None) -> None:
        super().__init__()
        self.config = config
        with _seeded(seed):
            self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
            self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
            if config.tie_embeddings:
                self.lm_head.weight = self.tok_emb.weight
            self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases, residual outputs scaled by 1/sqrt(2 L)."""
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(("attn.proj", "mlp.proj")) else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)

    def num_params(self) -> int:
        """Number of distinct parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings of ``idx`` (batch, time) -> (batch, time, d_model)."""
        time = idx.shape[1]
        if time > self.config.seq_len:
            raise ValueError(f"sequence of length {time} is longer than seq_len={self.config.seq_len}")
        positions = torch.arange(time, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(positions))

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and LM head: hidden states (batch, time, d_model) -> logits (batch, time, vocab)."""
        return self.lm_head(self.ln_f(x))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for token ids ``idx`` (batch, time); with ``targets``, also the mean cross-entropy."""
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.unembed(x)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


class MLP(nn.Sequential):
    """A plain multilayer perceptron: Linear layers between consecutive ``sizes``, ``activation`` between them.

    ``MLP([784, 256, 10])`` is Linear(784, 256), activation, Linear(256, 10). It is an
    ``nn.Sequential``, so ``mlp[i]`` and slicing give its layers (handy to split it across devices).
    """

    def __init__(
        self,
        sizes: Sequence[int],
        activation: Callable[[], nn.Module] = nn.ReLU,
        *,
        bias: bool = True,
        seed: int | None = None,
    ) -> None:
        if len(sizes) < 2:
            raise ValueError(f"an MLP needs at least an input and an output size, got sizes={list(sizes)}")
        layers: list[nn.Module] = []
        with _seeded(seed):
            for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
                if i > 0:
                    layers.append(activation())
                layers.append(nn.Linear(n_in, n_out, bias=bias))
        super().__init__(*layers)


def random_batch(
    config: GPTConfig,
    batch_size: int,
    *,
    device: torch.device | str | None = None,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random token ids (inputs, next-token targets), each (batch_size, seq_len).

    Nothing in them can be learned (the best loss stays ln(vocab_size)): use it to time
    and to measure memory, not to watch a loss fall.
    """
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    tokens = torch.randint(config.vocab_size, (batch_size, config.seq_len + 1), generator=generator)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def repeating_batch(
    config: GPTConfig,
    batch_size: int,
    *,
    period: int = 8,
    device: torch.device | str | None = None,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (inputs, next-token targets) that cycle through one random pattern of ``period`` tokens.

    Every row starts at a random point of the same pattern, so a model can learn to predict
    the next token and its loss falls towards zero: use it to check that training works.
    """
    if not 1 <= period <= config.vocab_size:
        raise ValueError(f"period must be between 1 and vocab_size={config.vocab_size}, got {period}")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    pattern = torch.randperm(config.vocab_size, generator=generator)[:period]
    starts = torch.randint(period, (batch_size, 1), generator=generator)
    tokens = pattern[(starts + torch.arange(config.seq_len + 1)) % period].to(device)
    return tokens[:, :-1], tokens[:, 1:]
