"""The GPT example as a ``varuna-profile`` target.

    varuna-profile --model examples/gpt2/profile_target.py:build --micro-batch-sizes 1,2,4 --out calib.json
    varuna-profile --model examples/gpt2/profile_target.py:build --model-arg n_embd=256 ...

``build(**kwargs)`` returns ``(model, make_batch)``: the model of ``model.py`` (its forward returns
the loss) and ``make_batch(m)``, m random byte sequences and their next-byte targets (compute
does not depend on the token values, so the corpus is not read).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model import GPT, GPTConfig  # noqa: E402


def build(
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    block_size: int = 64,
    dropout: float = 0.1,
    seed: int = 0,
):
    """GPT(cfg) and make_batch(m) -> (idx, targets) of shape (m, block_size).

    >>> model, make_batch = build(n_layer=2, n_embd=32)
    >>> idx, targets = make_batch(3)
    >>> tuple(idx.shape), float(model(idx, targets).detach()) > 0
    ((3, 64), True)
    """
    cfg = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, dropout=dropout)
    torch.manual_seed(seed)
    model = GPT(cfg)

    def make_batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + m)
        tokens = torch.randint(0, cfg.vocab_size, (m, block_size + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return model, make_batch
