"""Unit tests of course_lib.models: shapes, loss at init, causality, parameter formula, training, seeds."""

import dataclasses
import math

import pytest
import torch
from torch import nn

from course_lib.models import (
    GPT,
    MLP,
    GPTConfig,
    gpt_param_count,
    random_batch,
    repeating_batch,
)

TINY = GPTConfig.tiny()


def test_forward_shapes_and_loss_at_init_is_about_ln_vocab() -> None:
    model = GPT(TINY, seed=0)
    x, y = random_batch(TINY, batch_size=4, seed=0)
    assert x.shape == y.shape == (4, TINY.seq_len)
    logits, loss = model(x, y)
    assert logits.shape == (4, TINY.seq_len, TINY.vocab_size)
    assert loss is not None and loss.shape == ()
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.05
    logits_only, no_loss = model(x[:, :5])
    assert logits_only.shape == (4, 5, TINY.vocab_size) and no_loss is None


def test_targets_are_inputs_shifted_by_one() -> None:
    for make in (random_batch, repeating_batch):
        x, y = make(TINY, batch_size=3, seed=1)
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert x.dtype == torch.int64 and int(x.max()) < TINY.vocab_size


def test_repeating_batch_has_the_requested_period() -> None:
    x, _ = repeating_batch(TINY, batch_size=5, period=6, seed=2)
    assert torch.equal(x[:, 6:], x[:, :-6])
    assert len(torch.unique(x)) == 6
    with pytest.raises(ValueError):
        repeating_batch(TINY, batch_size=1, period=TINY.vocab_size + 1)


def test_causality_changing_a_token_leaves_earlier_logits_alone() -> None:
    model = GPT(TINY, seed=0).eval()
    x, _ = random_batch(TINY, batch_size=2, seed=3)
    t = 17
    changed = x.clone()
    changed[:, t] = (changed[:, t] + 1) % TINY.vocab_size
    before, _ = model(x)
    after, _ = model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=0)
    assert not torch.allclose(after[:, t], before[:, t])


def test_too_long_sequence_is_refused() -> None:
    x = torch.zeros(1, TINY.seq_len + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="seq_len"):
        GPT(TINY)(x)


@pytest.mark.parametrize(
    "config",
    [
        TINY,
        GPTConfig(vocab_size=50, seq_len=7, n_layer=3, n_head=2, d_model=18),
        GPTConfig(vocab_size=97, seq_len=16, n_layer=1, n_head=3, d_model=24, bias=False),
        GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=1, d_model=16, tie_embeddings=True),
        GPTConfig(vocab_size=64, seq_len=8, n_layer=4, n_head=4, d_model=32, mlp_ratio=2, bias=False, tie_embeddings=True),
    ],
    ids=["tiny", "odd-sizes", "no-bias", "tied", "ratio2-nobias-tied"],
)
def test_param_formula_equals_the_real_count(config: GPTConfig) -> None:
    model = GPT(config)
    assert model.num_params() == gpt_param_count(config)
    assert model.num_params() == sum(p.numel() for p in set(model.parameters()))


def test_param_formula_for_presets_matches_the_textbook_form() -> None:
    small = GPTConfig.small()
    h, n_layer = small.d_model, small.n_layer
    blocks = n_layer * (12 * h * h + 13 * h)
    assert gpt_param_count(small) == blocks + (small.vocab_size + small.seq_len) * h + 2 * h + small.vocab_size * h
    assert GPTConfig.preset() in (GPTConfig.tiny(), small)


def test_tied_head_shares_the_embedding_tensor() -> None:
    model = GPT(dataclasses.replace(TINY, tie_embeddings=True))
    assert model.lm_head.weight is model.tok_emb.weight


def test_module_names_used_by_the_parallelism_chapters() -> None:
    model = GPT(TINY)
    names = {name for name, _ in model.named_modules()}
    for part in ("ln_1", "attn.qkv", "attn.proj", "ln_2", "mlp.fc", "mlp.proj"):
        assert f"blocks.0.{part}" in names
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == TINY.n_layer
    assert model.blocks[0].attn.qkv.out_features == 3 * TINY.d_model
    assert model.blocks[0].mlp.fc.out_features == TINY.d_ff


def test_forward_equals_embed_blocks_unembed() -> None:
    model = GPT(TINY, seed=0)
    x, _ = random_batch(TINY, batch_size=2, seed=0)
    h = model.embed(x)
    for block in model.blocks:
        h = block(h)
    torch.testing.assert_close(model.unembed(h), model(x)[0])


def test_a_few_steps_learn_a_repeating_sequence() -> None:
    model = GPT(TINY, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = repeating_batch(TINY, batch_size=8, period=8, seed=0)
    losses = []
    for _ in range(30):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_seed_gives_the_same_weights_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b = GPT(TINY, seed=7), GPT(TINY, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    c = GPT(TINY, seed=8)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert torch.equal(random_batch(TINY, 2, seed=4)[0], random_batch(TINY, 2, seed=4)[0])


def test_dropout_is_off_in_eval_mode() -> None:
    model = GPT(dataclasses.replace(TINY, dropout=0.5), seed=0)
    x, _ = random_batch(TINY, batch_size=2, seed=0)
    model.eval()
    torch.testing.assert_close(model(x)[0], model(x)[0], rtol=0, atol=0)
    model.train()
    assert not torch.equal(model(x)[0], model(x)[0])


@pytest.mark.parametrize(
    "kwargs",
    [dict(d_model=30, n_head=4), dict(n_layer=0), dict(dropout=1.0)],
    ids=["heads-do-not-divide", "no-layers", "dropout-1"],
)
def test_bad_configs_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        GPTConfig(**kwargs)


def test_mlp_layers_shapes_and_backward() -> None:
    mlp = MLP([10, 32, 16, 3], activation=nn.Tanh, seed=0)
    kinds = [type(m) for m in mlp]
    assert kinds == [nn.Linear, nn.Tanh, nn.Linear, nn.Tanh, nn.Linear]
    x = torch.randn(5, 10, requires_grad=True)
    out = mlp(x)
    assert out.shape == (5, 3)
    out.square().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert all(p.grad is not None for p in mlp.parameters())
    assert sum(p.numel() for p in MLP([4, 2], bias=False).parameters()) == 8


def test_mlp_seed_is_deterministic_and_sizes_are_checked() -> None:
    a, b = MLP([6, 8, 2], seed=1), MLP([6, 8, 2], seed=1)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    with pytest.raises(ValueError):
        MLP([6])
