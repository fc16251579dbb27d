"""Models shared by the benchmarks.

* :class:`SmallCNN` — the Fashion-MNIST classifier of ``variance.py`` and ``accuracy.py``: two
  5×5 convolutions (16 and 32 channels) with 2×2 max-pooling, then 512 → 512 → 10 fully
  connected (281,034 parameters in 8 tensors; the flattened gradient spans 35 buckets of 8192,
  275 of 1024). Narrow convolutions keep a step cheap (4 ranks share 2 cores here); the wide
  first dense layer keeps the gradient long enough for large buckets to matter.
* :func:`evaluate` — test loss and accuracy over the whole test set, split across the ranks.
* :func:`mlp` — the ``cluster.py`` workload: a plain MLP whose gradients are large enough for
  the network to matter (default 784 → 4096 → 1536 → 10, ≈ 9.5M parameters = 38 MB of fp32
  gradient per step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

#: Layer widths of the cluster benchmark's MLP (input, hidden..., classes).
CLUSTER_MLP = (784, 4096, 1536, 10)
#: A small MLP for the cluster benchmark's quick mode (plumbing, not speed).
CLUSTER_MLP_QUICK = (784, 1024, 10)


class SmallCNN(nn.Module):
    """conv5×5(w) → pool → conv5×5(2w) → pool → fc 32w→hidden → fc hidden→10 (ReLU between)."""

    def __init__(self, width: int = 16, hidden: int = 512, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 5)
        self.conv2 = nn.Conv2d(width, 2 * width, 5)
        self.fc1 = nn.Linear(2 * width * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def mlp(sizes: Sequence[int] = CLUSTER_MLP) -> nn.Sequential:
    """Linear layers of the given widths with ReLU between them."""
    if len(sizes) < 2:
        raise ValueError(f"an MLP needs at least input and output widths, got {sizes}")
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def backward_order(model: nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Trainable parameters in reverse registration order (≈ the order backward produces their
    gradients; what the packed optimizer fuses and what the paper flattens network-wide)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1]


def flat_gradient(model: nn.Module) -> torch.Tensor:
    """All gradients flattened into one float32 vector in :func:`backward_order`."""
    return torch.cat([p.grad.reshape(-1) for _, p in backward_order(model)]).float()


def evaluate(model: nn.Module, test, *, name: str) -> tuple[float, float]:
    """(test loss, test accuracy) of ``model`` on the whole test set, across the Horovod ranks.

    Rank r evaluates images r, r + P, r + 2P, … of ``test`` (a ``fashion_mnist.Split``); the
    per-rank (summed cross-entropy, correct, count) are summed by an allreduce named ``name``,
    so every rank returns the same numbers. The model's train/eval mode is restored.
    """
    import horovod.torch as hvd

    rank, size = hvd.rank(), hvd.size()
    was_training = model.training
    model.eval()
    with torch.no_grad():
        part = slice(rank, None, size)
        xt, yt = torch.from_numpy(test.images[part]), torch.from_numpy(test.labels[part])
        logits = model(xt)
        sums = torch.tensor([float(F.cross_entropy(logits, yt, reduction="sum")),
                             float((logits.argmax(1) == yt).sum()), float(len(yt))],
                            dtype=torch.float64)
    model.train(was_training)
    sums = hvd.allreduce(sums, op=hvd.Sum, name=name)
    return float(sums[0] / sums[2]), float(sums[1] / sums[2])
