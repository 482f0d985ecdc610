"""What every row of the GPU check shares: sizes per device, logging, the GPT example, the plain
PyTorch loop the engine is compared with, and bitwise digests of weights.

The sizes on ``cuda`` are chosen so that each row exercises the hardware (tens of milliseconds
per step where time is measured) yet the whole check fits in a few minutes on one H100; on
``cpu`` they are tiny, so CI can run every row on two cores.
"""

from __future__ import annotations

import copy
import hashlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, ROOT / "examples" / "gpt2", ROOT / "scripts"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"

#: Sizes per device. GPT: the example of examples/gpt2 (tied embeddings, a raw position parameter,
#: dropout); "big" is the row 2 model (a step of ~4 × 1.4 TFLOP forward: tens of ms on an H100).
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "cuda": {
        "gpt": dict(n_layer=4, n_head=8, n_embd=512, block_size=256, M=32, m=8, steps=6),
        "big": dict(
            n_layer=12, n_head=16, n_embd=1024, block_size=1024, M=16, m=4, warmup=3, steps=8, rounds=3
        ),
        "llama": dict(
            hidden=1024, inter=2816, layers=8, heads=16, kv_heads=8, vocab=32000, seq=512, M=16, m=4, steps=5
        ),
        "pipe": dict(n_layer=4, n_head=8, n_embd=512, block_size=256, M=16, m=4, steps=4),
        "meta": dict(n_layer=16, n_head=16, n_embd=2048, block_size=256, M=4, m=1, steps=2),
        "ckpt": dict(n_layer=4, n_head=4, n_embd=256, block_size=128, M=8, m=4, steps=4),
        "profile": dict(n_layer=4, n_head=8, n_embd=512, block_size=256, ms="1,2"),
    },
    "cpu": {
        "gpt": dict(n_layer=2, n_head=2, n_embd=32, block_size=16, M=8, m=2, steps=3),
        "big": dict(n_layer=2, n_head=2, n_embd=64, block_size=32, M=8, m=2, warmup=1, steps=3, rounds=2),
        "llama": dict(
            hidden=64, inter=128, layers=2, heads=4, kv_heads=2, vocab=256, seq=16, M=8, m=4, steps=3
        ),
        "pipe": dict(n_layer=2, n_head=2, n_embd=32, block_size=16, M=8, m=2, steps=3),
        "meta": dict(n_layer=4, n_head=2, n_embd=64, block_size=16, M=4, m=1, steps=2),
        "ckpt": dict(n_layer=2, n_head=2, n_embd=32, block_size=16, M=8, m=4, steps=4),
        "profile": dict(n_layer=2, n_head=2, n_embd=32, block_size=16, ms="1,2"),
    },
}

#: Tolerances of the engine against the plain loop (bf16 autocast, the same weights, data and
#: micro-batches). The first step's loss comes from identical weights through the same kernels; later
#: ones drift through rounding: bf16 keeps 8 bits of mantissa, and the engine and the loop differ in
#: the order of a few sums (gradient norm in float64 vs float32, deterministic mode's canonical tree
#: of micro-batch gradients, non-deterministic atomics in the default mode).
FIRST_LOSS_RTOL = 1e-3
LOSS_RTOL = 2e-2


@dataclass
class RowResult:
    """What a row reports: a status, one line for the table, and the numbers behind it."""

    status: str
    summary: str
    metrics: dict[str, Any] = field(default_factory=dict)


_ROW = {"name": "?"}


def set_row(name: str) -> None:
    _ROW["name"] = name


def log(message: str) -> None:
    """One progress line, timestamped and unbuffered: a partial log of a killed run still tells."""
    print(f"[{time.strftime('%H:%M:%S')} row {_ROW['name']}] {message}", flush=True)


def sizes(device: str, what: str) -> dict[str, Any]:
    return dict(SIZES["cuda" if device == "cuda" else "cpu"][what])


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def gpt_model(z: dict[str, Any], *, dropout: float, seed: int = 0, meta: bool = False):
    """The GPT example at sizes ``z`` (on CPU, or on ``meta``), initialised from ``seed``."""
    import torch
    from model import GPT, GPTConfig

    cfg = GPTConfig(
        block_size=z["block_size"],
        n_layer=z["n_layer"],
        n_head=z["n_head"],
        n_embd=z["n_embd"],
        dropout=dropout,
    )
    if meta:
        with torch.device("meta"):
            return GPT(cfg)
    torch.manual_seed(seed)
    return GPT(cfg)


def gpt_batches(z: dict[str, Any], count: int, first: int = 1) -> list:
    """``count`` mini-batches (steps ``first``...) of byte windows of the stdlib's sources."""
    from data import ByteBatches

    data = ByteBatches(z["block_size"], seed=0)
    return [data.get("train", s, z["M"]) for s in range(first, first + count)]


class PlainTrainer:
    """The reference: a model trained the textbook way on ``device`` -- gradient accumulation over
    micro-batches of m, the loss of each scaled by its share of the mini-batch, clip, AdamW -- with
    one host sync per step (reading the loss, as a loop that logs it does).

    ``loss_of(model, micro_batch)``: the micro-batch's mean loss (default: ``model(*micro_batch)``)."""

    def __init__(
        self,
        model,
        *,
        M: int,
        m: int,
        device,
        precision: str,
        lr: float,
        max_grad_norm: float | None,
        loss_of: Callable | None = None,
    ) -> None:
        import torch

        self.dev = torch.device(device)
        self.model = model.to(self.dev)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.M, self.m, self.max_grad_norm = M, m, max_grad_norm
        self.loss_of = loss_of or (lambda model, mb: model(*mb))

    def step(self, batch) -> float:
        import torch

        from varuna.cutting.batches import slice_batch, to_device

        self.opt.zero_grad(set_to_none=True)
        batch = to_device(batch, self.dev)
        total = torch.zeros((), device=self.dev)
        for s in range(0, self.M, self.m):
            n = min(s + self.m, self.M) - s
            with torch.autocast(
                self.dev.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None
            ):
                loss = self.loss_of(self.model, slice_batch(batch, s, s + n))
            (loss * (n / self.M)).backward()
            total += loss.detach().float() * (n / self.M)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        return float(total)


def copy_model(model):
    return copy.deepcopy(model)


def tensor_digest(t) -> str:
    """sha256 of a tensor's bytes (on the host): equal digests mean bit-identical tensors."""
    import torch

    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def state_digests(state: dict) -> dict[str, str]:
    """Digest of every tensor of an ``Engine.state_dict()`` (parameters and optimizer state)."""
    import torch

    out = {}

    def walk(prefix: str, x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out[prefix] = tensor_digest(x)
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(f"{prefix}/{i}", v)

    walk("", {"params": state.get("params", {}), "optimizer": state.get("optimizer", {}).get("state", {})})
    return out


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)


def fmt(x: float | None, spec: str = ".3g") -> str:
    return "n/a" if x is None else format(x, spec)


def _nccl_version() -> str | None:
    try:
        import torch.cuda.nccl as nccl

        v = nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # an informative field only: never fail the check over it
        return None


def env_info() -> dict[str, Any]:
    """Versions and the device, for the table's header."""
    import torch

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "pid": os.getpid(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            device=torch.cuda.get_device_name(0),
            devices=torch.cuda.device_count(),
            memory_gib=round(p.total_memory / 2**30, 1),
            capability=f"{p.major}.{p.minor}",
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            nccl=_nccl_version(),
        )
    return info
