"""Worker: deterministic-mode training of attention models with PyTorch's SDPA (issue #16); dumps
per-step losses and the sha256 of every parameter this rank holds, like det_worker.py.

``--model``: ``biased`` (:class:`BiasedAttention`, below) or a name ``hf_worker.build`` knows
("gpt2", "llama", ...), built from its tiny config with its default attention implementation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import varuna  # noqa: E402

SEED, VOCAB, SEQ, GLOBAL_BATCH, MICRO = 7, 64, 16, 8, 2


class BiasedBlock(nn.Module):
    """Self-attention with a learned additive bias (T5's relative position bias, reduced).

    The bias is a float ``attn_mask`` that requires grad: with autograd on, PyTorch's CPU SDPA
    cannot use its flash kernel (no mask gradient there) and takes the math one; with autograd
    off it takes flash. The two round differently (~1e-7), which is what issue #16 is about.
    """

    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.bias = nn.Parameter(0.1 * torch.randn(heads, SEQ, SEQ))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = (t.view(B, L, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(D, -1))
        # A materialised (B, H, L, L) mask, as T5 builds from its bias plus the padding mask: the CPU
        # flash kernel declines a broadcast (stride-0) mask, and then both modes take math.
        mask = self.bias[:, :L, :L].expand(B, -1, -1, -1).contiguous()
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.drop(self.proj(a.transpose(1, 2).reshape(B, L, D)))


class BiasedAttention(nn.Module):
    """Token embedding, ``layers`` :class:`BiasedBlock` with a CutPoint after each, LM head."""

    def __init__(self, d: int = 32, heads: int = 2, layers: int = 2, dropout: float = 0.1):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(BiasedBlock(d, heads, dropout) for _ in range(layers))
        self.cuts = nn.ModuleList(varuna.CutPoint() for _ in range(layers))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for blk, cut in zip(self.blocks, self.cuts):
            h = cut(blk(h))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def build(name: str) -> tuple[nn.Module, object, object]:
    """(model with CutPoints, batch of step s, loss_fn) for ``name``."""
    if name == "biased":
        torch.manual_seed(1234)

        def batch(step: int):
            g = torch.Generator().manual_seed(1000 + step)
            idx = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
            return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

        return BiasedAttention(), batch, None
    import hf_worker

    model, blocks = hf_worker.build(name)
    varuna.apply_cutpoints(model, blocks)
    return model, lambda step: hf_worker.step_batch(step, "test", name), hf_worker.loss_of


def optimizer_elements(optimizer: torch.optim.Optimizer) -> int:
    """Elements of the optimizer state this rank holds (sharded: about 1/D of its stage's)."""
    return sum(v.numel() for st in optimizer.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="biased")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--shard", action="store_true", help="optimizer state sharded over the replicas")
    a = p.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    model, batch, loss_fn = build(a.model)
    first = batch(1)
    engine = varuna.Engine(
        model,
        varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO, seed=SEED,
                            max_grad_norm=1.0, determinism=varuna.DeterminismConfig(enabled=True),
                            optimizer_state=varuna.OptimizerStateConfig(shard=a.shard)),
        example_batch=first,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        loss_fn=loss_fn,
    )
    losses = [engine.train_step(batch(step)).loss for step in range(1, a.steps + 1)]
    digests = {n: hashlib.sha256(q.detach().contiguous().numpy().tobytes()).hexdigest()
               for n, q in engine.named_parameters()}
    a.out.mkdir(parents=True, exist_ok=True)
    report = {"losses": losses, "digests": digests, "opt_elems": optimizer_elements(engine.optimizer)}
    (a.out / f"rank{engine.layout.rank}.json").write_text(json.dumps(report))
    engine.close()


if __name__ == "__main__":
    main()
