"""A real corpus present on every machine: the bytes of the Python standard library's sources.

Batches are a pure function of (split, seed, step): every rank of every P×D layout reads the
same mini-batch for the same step, so training semantics do not depend on the layout.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import torch


def load_corpus(max_bytes: int = 4 << 20) -> np.ndarray:
    """The first ``max_bytes`` of the stdlib's ``*.py`` files in sorted path order, as uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1 << 16:
        raise RuntimeError(f"found only {total} bytes of Python sources under {root}")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


class ByteBatches:
    """Deterministic (input, target) batches of byte windows; 90/10 train/validation split."""

    def __init__(self, block_size: int, seed: int = 0, max_bytes: int = 4 << 20):
        data = load_corpus(max_bytes)
        cut = int(len(data) * 0.9)
        self.splits = {
            "train": torch.from_numpy(data[:cut].copy()),
            "val": torch.from_numpy(data[cut:].copy()),
        }
        self.block_size, self.seed = block_size, seed
        self.fingerprint = hashlib.sha256(data.tobytes()).hexdigest()[:12]

    def get(self, split: str, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = self.splits[split]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 2 + (split == "val"))
        starts = torch.randint(0, len(src) - self.block_size - 1, (batch_size,), generator=g)
        idx = torch.stack([src[s : s + self.block_size + 1] for s in starts.tolist()]).long()
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
