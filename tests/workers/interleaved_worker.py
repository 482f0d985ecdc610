"""Worker: a few train_steps of a tiny 8-block GPT (tied embedding / LM head, dropout) under each
given schedule kind; dumps per rank the first step's gradients, every step's loss, the sha256 of
every parameter held at the end, and the first step's executed task order."""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "gpt2"))

from model import GPT, GPTConfig  # noqa: E402

import varuna  # noqa: E402
from varuna.core.schedule import schedule_kind  # noqa: E402
from varuna.testing.negative_controls import with_negative_controls  # noqa: E402


def tiny_gpt(dropout: float = 0.1) -> GPT:
    """8 blocks, so 8 CutPoints: enough for P·v = 8 virtual stages."""
    torch.manual_seed(1234)
    return GPT(GPTConfig(block_size=8, n_layer=8, n_head=2, n_embd=16, dropout=dropout))


def batch_for(step: int, size: int):
    g = torch.Generator().manual_seed(1000 * step)
    idx = torch.randint(0, 256, (size, 9), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--schedules", default="interleaved,varuna-interleaved")
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.0)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--unkeyed-rng", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")  # one group for every engine built below
    base = tiny_gpt()
    M = a.global_batch_size
    for name in a.schedules.split(","):
        chunks = a.chunks if schedule_kind(name).chunked else 1
        engine = varuna.Engine(
            copy.deepcopy(base),
            with_negative_controls(
                varuna.VarunaConfig(global_batch_size=M, micro_batch_size=a.micro_batch_size, seed=7,
                                    schedule=name, pipeline=varuna.PipelineConfig(chunks=chunks),
                                    determinism=varuna.DeterminismConfig(enabled=a.deterministic)),
                rng_keyed=not a.unkeyed_rng,
            ),
            example_batch=batch_for(1, M),
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=a.lr) if a.lr else torch.optim.SGD(ps, lr=0.0),
        )
        losses, grads = [], {}
        for step in range(1, a.steps + 1):
            losses.append(engine.train_step(batch_for(step, M)).loss)
            if step == 1:
                grads = {n: q.grad.detach().clone() for n, q in engine.named_parameters()}
        digests = {n: hashlib.sha256(q.detach().contiguous().numpy().tobytes()).hexdigest()
                   for n, q in engine.named_parameters()}
        out = a.out / name
        out.mkdir(parents=True, exist_ok=True)
        rank = engine.layout.rank
        torch.save(grads, out / f"rank{rank}.pt")
        report = {"losses": losses, "digests": digests, "stage": engine.stage, "replica": engine.replica,
                  "executed": [str(t) for t in engine.executed_orders[0]],
                  "nm": len(engine.micro_plan[engine.replica])}
        (out / f"rank{rank}.json").write_text(json.dumps(report))
        engine.close()  # the default group is this script's: the engine leaves it


if __name__ == "__main__":
    main()
