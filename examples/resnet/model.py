"""A small ResNet-style CNN written for one device: no CutPoints, no varuna import.

Residual blocks (the skip connection lives inside each block), BatchNorm (buffers the forward
updates), down-sampling stages whose activations shrink as the network deepens, and a
classifier head. It is the example for automatic cut-points: the valid boundaries are the ends
of the stem and of every block, and later ones carry smaller activations.

Example::

    >>> import torch
    >>> model, (images, labels) = build(batch_size=2)
    >>> float(model(images, labels).detach()) > 0
    True

Split it over 2 stages without touching this file::

    engine = varuna.Engine(model, varuna.VarunaConfig(global_batch_size=32, micro_batch_size=4,
                                                      cutting=varuna.CuttingConfig(auto_cutpoints=3)), ...)

or look at where it can be cut: ``varuna-trace examples/resnet/model.py:build --cuts 3``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True)
class ResNetConfig:
    in_channels: int = 3
    num_classes: int = 10
    widths: tuple[int, ...] = (16, 32, 64)
    """Channels of each stage; every stage after the first halves the resolution."""
    blocks_per_stage: int = 2


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, plus the (projected when shapes change) input."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """``ResNet(cfg)(images, labels)`` returns the mean cross-entropy (a scalar)."""

    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        w0 = cfg.widths[0]
        self.stem = nn.Sequential(nn.Conv2d(cfg.in_channels, w0, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(w0), nn.ReLU())
        stages, c_in = [], w0
        for i, w in enumerate(cfg.widths):
            blocks = [BasicBlock(c_in if j == 0 else w, w, 2 if (i > 0 and j == 0) else 1)
                      for j in range(cfg.blocks_per_stage)]
            stages.append(nn.Sequential(*blocks))
            c_in = w
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(c_in, cfg.num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(images))
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return F.cross_entropy(logits, labels)


def build(batch_size: int = 8, image_size: int = 16,
          seed: int = 0) -> tuple[ResNet, tuple[torch.Tensor, torch.Tensor]]:
    """A model and one example batch ``(images, labels)``: the factory ``varuna-trace`` expects."""
    torch.manual_seed(seed)
    cfg = ResNetConfig()
    model = ResNet(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    images = torch.randn(batch_size, cfg.in_channels, image_size, image_size, generator=g)
    labels = torch.randint(0, cfg.num_classes, (batch_size,), generator=g)
    return model, (images, labels)
