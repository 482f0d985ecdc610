"""A GPT-2-style decoder written for one device, annotated with one CutPoint per block.

Tied input/output embeddings (the LM head reads ``wte.weight`` directly in glue code), a raw
``nn.Parameter`` position embedding used outside any module, and dropout everywhere: the
features that make splitting a real model hard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import varuna


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    """Byte-level tokens."""
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.1


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = self.attn_drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn, self.mlp = SelfAttention(cfg), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TokenEmbedding(nn.Embedding):
    """GPT-2's N(0, 0.02) init: the matrix doubles as the LM head, N(0, 1) logits would explode."""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.normal_(0.0, 0.02)


class GPT(nn.Module):
    """``GPT(cfg)(idx, targets)`` returns the mean next-byte cross-entropy (a scalar)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = TokenEmbedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Parameter(torch.zeros(1, cfg.block_size, cfg.n_embd))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.cuts = nn.ModuleList(varuna.CutPoint() for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # GPT-2 init for the root's own raw parameters; submodules keep torch's defaults.
        with torch.no_grad():
            self.wpe.normal_(0.0, 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe[:, :T])
        for block, cut in zip(self.blocks, self.cuts):
            x = cut(block(x))
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied LM head
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
