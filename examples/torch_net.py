"""The CNN and the evaluation shared by the PyTorch examples (pytorch_mnist.py, ddp_mnist.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    """Two 5×5 conv layers with max-pooling, then two fully connected layers (≈ 44k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """(test loss, test accuracy) of ``model`` on one batch holding the whole test set."""
    model.eval()
    with torch.no_grad():
        logits = model(images)
        loss = F.cross_entropy(logits, labels).item()
        acc = (logits.argmax(1) == labels).float().mean().item()
    model.train()
    return loss, acc
