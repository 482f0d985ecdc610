"""Ready-made profiling targets (``profiler.targets:NAME``) for tests, demos and sanity checks.

Each is a factory in the format of :mod:`profiler.spec`: it returns ``(model, make_batch)``.

- :func:`emulated`: :func:`varuna.testing.emulated_model` — blocks of *known* forward/backward
  time (they sleep), so the profiler's measurements can be checked against the truth.
- :func:`mlp`: a stack of real ``Linear+GELU`` layers with a CutPoint after each, whose cost
  grows with ``width`` and with the micro-batch size.

Example::

    varuna-profile --model profiler.targets:emulated --model-arg fwd_s=0.02 --micro-batch-sizes 1,2 \\
        --out emulated.json
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import varuna

__all__ = ["emulated", "mlp"]


def emulated(
    num_blocks: int = 4, fwd_s: float | list[float] = 0.01, width: int = 16, bwd_factor: float = 2.0
) -> tuple[nn.Module, Callable[[int], tuple[torch.Tensor, torch.Tensor]]]:
    """``num_blocks`` emulated blocks (forward ``fwd_s``, backward ``bwd_factor·fwd_s``), one per segment.

    >>> model, make_batch = emulated(num_blocks=2, fwd_s=0.0, width=4)
    >>> float(model(*make_batch(3)).detach()) >= 0
    True
    """
    from varuna.testing.emulated import emulated_model

    model = emulated_model(num_blocks, fwd_s, width, bwd_factor=bwd_factor)

    def make_batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(m)
        return torch.randn(m, width, generator=g), torch.zeros(m, width)

    return model, make_batch


class _MLP(nn.Module):
    def __init__(self, width: int, depth: int, tokens: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.cuts = nn.ModuleList(varuna.CutPoint() for _ in range(depth - 1))
        self.tokens = tokens

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = F.gelu(layer(x))
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return F.mse_loss(x, target)


def mlp(width: int = 256, depth: int = 3, tokens: int = 32) -> tuple[nn.Module, Callable]:
    """``depth`` Linear+GELU layers of ``width`` on ``(m, tokens, width)`` inputs; ``depth - 1`` cut-points.

    >>> model, make_batch = mlp(width=8, depth=2, tokens=4)
    >>> tuple(make_batch(3)[0].shape)
    (3, 4, 8)
    """
    torch.manual_seed(0)
    model = _MLP(width, depth, tokens)

    def make_batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(m)
        return torch.randn(m, tokens, width, generator=g), torch.zeros(m, tokens, width)

    return model, make_batch
