"""examples/gpt.py: the character GPT and its corpus (shapes, tying, initialisation,
causality, determinism, the split, the schedule, the bpc evaluation). One process, seconds."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402  (examples/gpt.py)


@pytest.fixture(scope="module")
def corpus() -> gpt.Corpus:
    return gpt.load_corpus()


@pytest.fixture(scope="module")
def cfg(corpus) -> gpt.GPTConfig:
    return gpt.GPTConfig(vocab_size=corpus.vocab_size)


def test_corpus_is_pydoc_topics_split_90_10(corpus):
    text = gpt.load_text()
    assert len(text) > 400_000
    assert corpus.chars == "".join(sorted(set(text)))
    assert len(corpus.train) + len(corpus.val) == len(text)
    assert len(corpus.train) == int(0.9 * len(text))
    assert corpus.decode(corpus.val[:200]) == text[len(corpus.train):len(corpus.train) + 200]
    assert corpus.train.dtype == torch.int64 and int(corpus.train.max()) < corpus.vocab_size


def test_parameter_count_and_shapes(cfg):
    model = gpt.build(cfg, 0)
    d, v, t = cfg.d_model, cfg.vocab_size, cfg.context
    # two LayerNorms, qkv, attention output, MLP in and out (weights + biases)
    per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    want = v * d + t * d + cfg.n_layer * per_block + 2 * d
    assert sum(p.numel() for p in model.parameters()) == want == 616_448
    x = torch.randint(0, v, (5, t))
    assert model(x).shape == (5, t, v)
    assert model(x[:, :7]).shape == (5, 7, v)
    with pytest.raises(ValueError, match="exceeds the context"):
        model(torch.zeros(1, t + 1, dtype=torch.int64))


def test_output_head_is_the_token_embedding(cfg):
    model = gpt.build(cfg, 0)
    big = [n for n, p in model.named_parameters() if p.shape[0] == cfg.vocab_size]
    assert big == ["tok.weight"]                       # no separate head matrix
    x = torch.zeros(2, 16, dtype=torch.int64)          # only token 0 in the input
    gpt.loss_fn(model, x, torch.ones_like(x)).backward()
    grad = model.tok.weight.grad
    # rows of tokens absent from the input get gradient only through the tied head
    assert grad[1:].abs().sum() > 0
    h = model.ln_f(model.blocks[-1](model.blocks[-2](model.blocks[0](
        model.tok(x) + model.pos(torch.arange(16))))))
    assert torch.allclose(model(x), h @ model.tok.weight.T, atol=1e-6)


@torch.no_grad()
def test_gpt2_initialisation(cfg):
    model = gpt.build(cfg, 0)
    block = model.blocks[0]
    assert abs(float(block.qkv.weight.std()) - 0.02) < 0.002
    assert abs(float(model.tok.weight.std()) - 0.02) < 0.002
    residual = 0.02 / math.sqrt(2 * cfg.n_layer)
    for w in (block.proj.weight, block.fc_proj.weight):
        assert abs(float(w.std()) - residual) < 0.1 * residual
    assert float(block.qkv.bias.abs().sum()) == 0.0
    assert float(block.ln1.weight.sum()) == cfg.d_model and float(model.ln_f.bias.abs().sum()) == 0


def test_attention_is_causal(cfg):
    model = gpt.build(cfg, 0)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.context))
    y = x.clone()
    y[:, 40:] = (y[:, 40:] + 1) % cfg.vocab_size
    a, b = model(x), model(y)
    assert torch.equal(a[:, :40], b[:, :40])
    assert not torch.allclose(a[:, 40:], b[:, 40:])


def test_same_seed_same_weights_other_seed_other_weights(cfg):
    assert gpt.fingerprint(gpt.build(cfg, 3)) == gpt.fingerprint(gpt.build(cfg, 3))
    assert gpt.fingerprint(gpt.build(cfg, 3)) != gpt.fingerprint(gpt.build(cfg, 4))


def test_batches_are_shifted_windows_per_seed_and_rank(corpus):
    b = gpt.Batches(corpus.train, 64, 32, seed=0, rank=0)
    x, y = b.next()
    assert x.shape == y.shape == (32, 64)
    assert torch.equal(x[:, 1:], y[:, :-1])
    again = gpt.Batches(corpus.train, 64, 32, seed=0, rank=0).next()
    other = gpt.Batches(corpus.train, 64, 32, seed=0, rank=1).next()
    assert torch.equal(again[0], x) and not torch.equal(other[0], x)
    assert not torch.equal(b.next()[0], x)             # the stream moves on
    with pytest.raises(ValueError, match="shorter than one window"):
        gpt.Batches(corpus.train[:10], 64, 1, seed=0, rank=0)


def test_validation_windows_and_subset(corpus):
    x, y = gpt.val_windows(corpus.val, 64)
    assert x.shape == y.shape == ((len(corpus.val) - 1) // 64, 64)
    assert torch.equal(x.reshape(-1)[1:], y.reshape(-1)[:-1])
    sub = gpt.subset(len(x), 128)
    assert len(sub) == 128 and len(set(sub.tolist())) == 128 and int(sub[-1]) < len(x)
    assert torch.equal(gpt.subset(10, 50), torch.arange(10))


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    lrs = [gpt.lr_at(s, 500, 2e-3, 50, 0.1) for s in range(501)]
    assert lrs[0] == pytest.approx(2e-3 / 50) and lrs[49] == pytest.approx(2e-3)
    assert lrs[50] == pytest.approx(2e-3) and lrs[500] == pytest.approx(2e-4)
    assert lrs[275] == pytest.approx(1.1e-3)                     # halfway down the cosine
    assert all(a >= b for a, b in zip(lrs[49:], lrs[50:]))


def test_weight_decay_groups_hold_the_matrices(cfg):
    model = gpt.build(cfg, 0)
    decay, rest = gpt.param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in rest["params"])
    assert len(decay["params"]) + len(rest["params"]) == len(list(model.parameters()))


def test_evaluate_is_cross_entropy_in_bits_summed_over_ranks(cfg, corpus):
    model = gpt.build(cfg, 0)
    x, y = gpt.val_windows(corpus.val, 64)
    x, y = x[:10], y[:10]
    whole = gpt.evaluate(model, x, y, rank=0, size=1, allreduce_sum=lambda t: t, batch=4)
    with torch.no_grad():
        assert whole == pytest.approx(float(gpt.loss_fn(model, x, y)) / math.log(2), rel=1e-6)
    sums: list[torch.Tensor] = []          # two ranks in turn: their (nats, characters)
    for r in range(2):
        gpt.evaluate(model, x, y, rank=r, size=2, batch=3,
                     allreduce_sum=lambda t: sums.append(t.clone()) or t)
    total = sums[0] + sums[1]
    assert float(total[1]) == 10 * 64
    assert float(total[0] / total[1]) / math.log(2) == pytest.approx(whole, rel=1e-6)
    assert abs(whole - math.log2(cfg.vocab_size)) < 0.5       # near uniform at initialisation
    assert model.training
