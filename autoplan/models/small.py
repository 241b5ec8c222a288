"""Small non-transformer models: a plain MLP and a CNN (capture and planning tests)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SmallMLP", "SmallCNN"]


class SmallMLP(nn.Sequential):
    """``depth`` hidden Linear+ReLU pairs as a flat ``nn.Sequential``."""

    def __init__(self, inputs: int = 64, hidden: int = 128, outputs: int = 10, depth: int = 3) -> None:
        layers: list[nn.Module] = [nn.Linear(inputs, hidden), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.ReLU()]
        layers.append(nn.Linear(hidden, outputs))
        super().__init__(*layers)


class ConvBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


class SmallCNN(nn.Module):
    """A stem, ``depth`` identical residual conv blocks, and a classifier head."""

    def __init__(self, channels: int = 16, depth: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*(ConvBlock(channels) for _ in range(depth)))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.blocks(self.stem(x))).flatten(1))
