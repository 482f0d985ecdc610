"""Small models and batches shared by the tests (and their single-process references)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "gpt2"))

import varuna  # noqa: E402
from varuna.cutting.split import keyed_seed  # noqa: E402


class TupleBlock(nn.Module):
    """Returns a tuple and takes an extra argument, like HF-transformers blocks."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x, mask):
        h = self.drop(torch.tanh(self.lin(x))) * mask
        return h, h.mean()


class GlueNet(nn.Module):
    """Glue code between modules: a mask from the inputs, a raw parameter, residual adds, tuples."""

    def __init__(self, d: int = 16, n: int = 4):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.scale = nn.Parameter(torch.ones(d))
        self.blocks = nn.ModuleList(TupleBlock(d) for _ in range(n))
        self.cuts = nn.ModuleList(varuna.CutPoint() for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x, y):
        mask = (x[:, :1] > -5).to(x.dtype)  # from the data: available on every stage
        h = self.inp(x) * self.scale
        aux = 0.0
        for blk, cut in zip(self.blocks, self.cuts):
            r, m = blk(h, mask)
            h = cut(h + r)
            aux = aux + 0.0 * m
        return F.mse_loss(self.out(h).squeeze(-1), y) + aux


class OneCut(nn.Module):
    """Two segments (one CutPoint)."""

    def __init__(self, calls: int = 1):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)
        self.cut = varuna.CutPoint()
        self.calls = calls

    def forward(self, x, y):
        h = self.a(x)
        for _ in range(self.calls):
            h = self.cut(h)
        return F.mse_loss(self.b(h).squeeze(-1), y)


class NoCut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 1)

    def forward(self, x, y):
        return F.mse_loss(self.a(x).squeeze(-1), y)


def build_model(kind: str, *, dropout: float = 0.1, meta: bool = False) -> nn.Module:
    torch.manual_seed(1234)
    if kind == "gpt":
        from model import GPT, GPTConfig

        cfg = GPTConfig(block_size=16, n_layer=4, n_head=2, n_embd=32, dropout=dropout)
        if meta:
            with torch.device("meta"):
                return GPT(cfg)
        return GPT(cfg)
    if kind == "glue":
        return GlueNet()
    if kind == "onecut":
        return OneCut()
    if kind == "twice":
        return OneCut(calls=2)
    if kind == "nocut":
        return NoCut()
    raise ValueError(kind)


def make_batch(kind: str, size: int):
    g = torch.Generator().manual_seed(99)
    if kind == "gpt":
        idx = torch.randint(0, 256, (size, 17), generator=g)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    x = torch.randn(size, 8, generator=g)  # glue, onecut, twice, nocut
    return x, torch.randn(size, generator=g)


def reference_step(model: nn.Module, batch, global_batch: int, micro: int, *, seed: int = 7, step: int = 1):
    """Plain single-process gradient of the mini-batch mean loss, with dropout masks keyed like the
    engine's documented rule: seed (seed, step, global micro-batch, segment) at each segment."""
    cuts = [m for m in model.modules() if isinstance(m, varuna.CutPoint)]
    state = {"mb": 0}

    def reseed(segment: int):
        def hook(mod, inputs, output):
            torch.manual_seed(keyed_seed(seed, step, state["mb"], segment))  # returns None: output kept

        return hook

    handles = [c.register_forward_hook(reseed(s + 1)) for s, c in enumerate(cuts)]
    total = 0.0
    try:
        for g, start in enumerate(range(0, global_batch, micro)):
            end = min(start + micro, global_batch)
            state["mb"] = g
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(keyed_seed(seed, step, g, 0))
                loss = model(*[t[start:end] for t in batch])
            (loss * (end - start) / global_batch).backward()
            total += float(loss.detach()) * (end - start) / global_batch
    finally:
        for h in handles:
            h.remove()
    return total
