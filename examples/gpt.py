"""A small character-level GPT and its data, for ``examples/transformer_char.py``.

No external model library. The corpus is English text that ships with CPython:
``pydoc_data.topics`` (the help texts of ``help("topics")``), joined in the module's own order,
about 465,000 characters over 103 distinct ones. The split is fixed: the first
``1 - VAL_FRACTION`` of the characters train, the rest validate.

The model (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", GPT-2):
token and learned position embeddings, ``n_layer`` pre-norm blocks
``x + attn(LN(x))``, ``x + mlp(LN(x))`` with causal multi-head self-attention and a 4x GELU MLP,
a final LayerNorm, and the output projection tied to the token embedding (logits = h·Eᵀ).
GPT-2 initialisation: every Linear and Embedding weight ~ N(0, 0.02²), biases 0, LayerNorms
(1, 0), and the two residual projections of each block (attention output, MLP output)
~ N(0, (0.02/√(2·n_layer))²). No dropout. With the defaults (d_model 128, 4 heads, 3 layers,
context 64, vocabulary 103) it has 616,448 parameters.

Determinism: :func:`build` seeds torch's generator before creating the weights, so every rank
builds the same model from the same seed; :class:`Batches` draws window offsets from its own
generator seeded ``seed * 1000 + rank`` (the MNIST examples' rule), so ranks see different data
and a rerun sees the same.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

#: Fraction of the corpus (its tail) held out for validation.
VAL_FRACTION = 0.1
#: GPT-2's standard deviation of the initial weights.
INIT_STD = 0.02
#: The MLP's hidden width relative to d_model (GPT-2).
MLP_RATIO = 4


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    context: int = 64
    d_model: int = 128
    n_head: int = 4
    n_layer: int = 3


# ============================================================================ data
@dataclass(frozen=True)
class Corpus:
    """The encoded corpus, its character table and its fixed split."""

    chars: str               #: the vocabulary, sorted; token id = index
    train: torch.Tensor      #: int64 token ids
    val: torch.Tensor
    fingerprint: str         #: sha256 of the text (first 16 hex digits)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def load_text() -> str:
    """The corpus text: every value of ``pydoc_data.topics.topics``, concatenated in order."""
    from pydoc_data import topics

    return "".join(topics.topics.values())


def load_corpus(val_fraction: float = VAL_FRACTION) -> Corpus:
    """Encode :func:`load_text` by its sorted character set and split it: the first
    ⌊(1 − val_fraction)·N⌋ characters train, the rest validate."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    text = load_text()
    chars = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
    cut = int(len(ids) * (1.0 - val_fraction))
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    return Corpus(chars=chars, train=ids[:cut], val=ids[cut:], fingerprint=digest)


class Batches:
    """Random training windows for one rank: each batch is ``batch`` offsets drawn uniformly
    from [0, len(train) − context − 1] by a generator seeded ``seed * 1000 + rank``; inputs are
    the ``context`` characters at an offset, targets the same shifted by one."""

    def __init__(self, train: torch.Tensor, context: int, batch: int, *, seed: int,
                 rank: int) -> None:
        if len(train) <= context + 1:
            raise ValueError(f"the training text ({len(train)} tokens) is shorter than one "
                             f"window of {context + 1}")
        self.train, self.context, self.batch = train, context, batch
        self.generator = torch.Generator().manual_seed(seed * 1000 + rank)
        self._arange = torch.arange(context + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.train) - self.context - 1, (self.batch,),
                               generator=self.generator)
        windows = self.train[starts[:, None] + self._arange]
        return windows[:, :-1], windows[:, 1:]


def val_windows(val: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation set: every non-overlapping window of ``context`` inputs (and their next
    characters as targets) that fits in ``val``, in order."""
    n = (len(val) - 1) // context
    x = val[:n * context].view(n, context)
    y = val[1:n * context + 1].view(n, context)
    return x, y


def subset(n_windows: int, count: int) -> torch.Tensor:
    """``count`` window indices spread evenly over ``n_windows`` (⌊i·n/count⌋): the cheap
    validation subset evaluated during training; all of them when count ≥ n_windows."""
    if count >= n_windows:
        return torch.arange(n_windows)
    return torch.tensor([i * n_windows // count for i in range(count)])


# ============================================================================ model
class Block(nn.Module):
    """x + attn(LN(x)), then x + mlp(LN(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model {cfg.d_model} is not a multiple of n_head {cfg.n_head}")
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, MLP_RATIO * cfg.d_model)
        self.fc_proj = nn.Linear(MLP_RATIO * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
                   for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final LayerNorm, tied output head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self._init_weights()

    def _init_weights(self) -> None:
        residual_std = INIT_STD / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith("proj") else INIT_STD   # proj, fc_proj
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (batch, time, vocab) for token ids (batch, time), time ≤ context."""
        t = idx.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence of {t} tokens exceeds the context {self.cfg.context}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok.weight)      # tied: logits = h·Eᵀ


def build(cfg: GPTConfig, seed: int) -> GPT:
    """The model of ``cfg`` with the initial weights of ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    return GPT(cfg)


def fingerprint(model: nn.Module) -> str:
    """sha256 of the model's weights in state_dict order (first 16 hex digits): runs that print
    the same one started from the same weights."""
    digest = hashlib.sha256()
    for value in model.state_dict().values():
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
            reduction: str = "mean") -> torch.Tensor:
    """Next-character cross-entropy in nats."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                           reduction=reduction)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on the matrices (every parameter of ≥ 2 dimensions: the
    Linear weights and the embeddings, the tied head included), none on biases and LayerNorm
    parameters."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps to ``peak`` (step s gets peak·(s+1)/warmup), then
    cosine decay to ``min_ratio·peak`` at step ``total``:
    peak·(min_ratio + (1 − min_ratio)·(1 + cos(π·(s − warmup)/(total − warmup)))/2)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


BITS_PER_NAT = 1.0 / math.log(2.0)


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, rank: int, size: int,
             allreduce_sum, batch: int = 64) -> float:
    """Bits per character of ``model`` on the windows (x, y): rank r scores windows r, r + P, …
    (``batch`` at a time), ``allreduce_sum`` adds the ranks' (summed nats, characters), and
    bpc = nats / characters / ln 2, the same on every rank. Train/eval mode is restored."""
    was_training = model.training
    model.eval()
    nats = count = 0.0
    with torch.no_grad():
        mine = torch.arange(rank, len(x), size)
        for i in range(0, len(mine), batch):
            idx = mine[i:i + batch]
            nats += float(loss_fn(model, x[idx], y[idx], reduction="sum"))
            count += float(y[idx].numel())
    model.train(was_training)
    sums = allreduce_sum(torch.tensor([nats, count], dtype=torch.float64))
    return float(sums[0] / sums[1]) * BITS_PER_NAT
