"""Worker for the tracer/auto-cut tests: one train_step per model under the engine, gradients dumped.

Also the home of the small test models (the tests import them from here), so the single-process
reference and the workers build exactly the same thing. SGD with lr=0 leaves parameters unchanged,
so the dumped ``.grad``\\ s are the mini-batch gradients.

Models (``--models a,b,...``; ``NAME:K`` asks the engine for K automatic cut-points):

* ``gpt``      — the GPT example with its CutPoints replaced by ``nn.Identity`` (tied embeddings)
* ``tuple``    — HF-style blocks: ``hidden, attn = block(hidden, mask)``, no CutPoints
* ``resnet``   — examples/resnet (BatchNorm, residual blocks), no CutPoints
* ``planted``  — CutPoints by hand; the last block reads a buffer owned by block 0 (read-only)
* ``skip``     — CutPoints by hand; block 0's output skips to the head: a hidden dependency
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "gpt2"))
sys.path.insert(0, str(ROOT / "tests"))

import varuna  # noqa: E402

GLOBAL_BATCH, MICRO_BATCH, SEED = 10, 3, 7


class HFBlock(nn.Module):
    """Transformers-style block: takes an extra argument, returns (hidden, derived statistics)."""

    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = hidden + self.drop(torch.tanh(self.lin(self.ln(hidden)))) * mask
        attn = torch.softmax(h, dim=-1)  # a by-product the caller may ignore
        return h, attn


class HFNet(nn.Module):
    """``h, attn = block(h, mask)`` in a loop; ``read_attn`` also reads every block's attn later."""

    def __init__(self, d: int = 16, n: int = 4, read_attn: bool = False):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(HFBlock(d) for _ in range(n))
        self.out = nn.Linear(d, 1)
        self.read_attn = read_attn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = (x[:, :1] > -5).to(x.dtype)  # from the batch: glue, valid on every stage
        h = self.inp(x)
        attns = []
        for blk in self.blocks:
            h, attn = blk(h, mask)
            attns.append(attn)
        loss = F.mse_loss(self.out(h).squeeze(-1), y)
        if self.read_attn:
            loss = loss + 1e-3 * sum(a.pow(2).mean() for a in attns)
        return loss


class TableBlock(nn.Module):
    """``tanh(lin(h))``, optionally scaled by a table passed in (a buffer owned elsewhere)."""

    def __init__(self, d: int, with_table: bool = False):
        super().__init__()
        self.lin = nn.Linear(d, d)
        if with_table:
            self.register_buffer("table", torch.linspace(0.5, 1.5, d))

    def forward(self, h: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.tanh(self.lin(h))
        return out * table if table is not None else out


class PlantedNet(nn.Module):
    """Four blocks with hand-placed CutPoints. ``mode``:

    * "buffer": the last block reads ``blocks.0.table`` (a read-only buffer of segment 0's module)
    * "skip":   block 0's output is added to the head's input, bypassing the CutPoints (hidden)
    * "counter": block 0 bumps a buffer in place that the last segment reads (mutable, hidden)
    * "none":   a plain chain (negative control)
    """

    def __init__(self, mode: str = "buffer", d: int = 16):
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(TableBlock(d, with_table=(i == 0)) for i in range(4))
        self.cuts = nn.ModuleList(varuna.CutPoint() for _ in range(3))
        self.out = nn.Linear(d, 1)
        self.register_buffer("counter", torch.zeros(()))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        first = None
        for i, blk in enumerate(self.blocks):
            if i == 3 and self.mode == "buffer":
                h = blk(h, self.blocks[0].table)
            else:
                h = blk(h)
            if i == 0:
                first = h
                if self.mode == "counter":
                    self.counter.add_(h.detach().mean())  # written from segment 0's activation
            if i < 3:
                h = self.cuts[i](h)
        if self.mode == "skip":
            h = h + first
        pred = self.out(h).squeeze(-1)
        if self.mode == "counter":
            pred = pred + self.counter
        return F.mse_loss(pred, y)


def resnet_module():
    """examples/resnet/model.py, imported under its own name (examples/gpt2 also has a model.py)."""
    import importlib.util

    mod = sys.modules.get("resnet_model")
    if mod is None:
        path = ROOT / "examples" / "resnet" / "model.py"
        spec = importlib.util.spec_from_file_location("resnet_model", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["resnet_model"] = mod
        spec.loader.exec_module(mod)
    return mod


def build(name: str):
    """(model, global batch) of a test model, deterministic."""
    from models import build_model, make_batch

    torch.manual_seed(1234)
    g = torch.Generator().manual_seed(99)
    xy = (torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, generator=g))
    if name == "gpt":
        model = build_model("gpt")
        model.cuts = nn.ModuleList(nn.Identity() for _ in model.cuts)  # the GPT, un-annotated
        return model, make_batch("gpt", GLOBAL_BATCH)
    if name == "tuple":
        return HFNet(), xy
    if name == "tuple-read-attn":
        return HFNet(read_attn=True), xy
    if name == "resnet":
        return resnet_module().build(batch_size=GLOBAL_BATCH, image_size=8)
    if name in ("planted", "skip", "counter", "chain"):
        mode = {"planted": "buffer", "chain": "none"}.get(name, name)
        return PlantedNet(mode), xy
    raise ValueError(name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", required=True, help="comma-separated NAME or NAME:K (K auto cut-points)")
    a = p.parse_args()
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo")  # one group for every engine built below
    for spec in a.models.split(","):
        name, _, k = spec.partition(":")
        model, batch = build(name)
        names = [n for n, _ in model.named_parameters()]
        out = a.out / name
        out.mkdir(parents=True, exist_ok=True)
        rank = dist.get_rank()
        try:
            engine = varuna.Engine(
                model,
                varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=SEED,
                                    cutting=varuna.CuttingConfig(auto_cutpoints=int(k) if k else None)),
                example_batch=batch,
                optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0),
            )
        except ValueError as e:
            (out / f"rank{rank}.json").write_text(json.dumps({"refused": str(e)}))
            continue
        r = engine.train_step(batch)
        from varuna.cutting.autocut import _auto_cut_modules

        torch.save({n: q.grad.detach().clone() for n, q in engine.named_parameters() if q.grad is not None},
                   out / f"rank{rank}.pt")
        (out / f"rank{rank}.json").write_text(json.dumps({
            "loss": r.loss, "stage": engine.stage, "stage_ranges": engine.stage_ranges,
            "auto_cut_modules": _auto_cut_modules(model), "cutpoints": engine.profile.cutpoint_names,
            "param_names": names, "param_names_after": [n for n, _ in model.named_parameters()],
            "spanning": sorted(engine.profile.spanning_modules),
        }))
        engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
