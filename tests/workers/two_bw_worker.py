"""Worker: the tiny GPT trained with ``schedule="2bw"`` under the engine at P×D.

Engine A trains ``--steps`` steps with 2bw, saving a checkpoint after ``--save-at``; engine B
resumes from it and trains the same remaining steps. Each dumps its weights after every step:
``<out>/<name>/rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "gpt2"))
sys.path.insert(0, str(ROOT / "tests"))

from models import build_model, make_batch  # noqa: E402

import varuna  # noqa: E402
from varuna.core.schedule import get_schedule  # noqa: E402


def batch_of(batches, step: int, m_total: int):
    return tuple(t[(step - 1) * m_total : step * m_total] for t in batches)


def train(name, base, a, batches, *, schedule, steps, resume="0", save_at=0):
    engine = varuna.Engine(
        copy.deepcopy(base),
        varuna.VarunaConfig(
            global_batch_size=a.global_batch_size,
            micro_batch_size=a.micro_batch_size,
            schedule=schedule,
            seed=7,
            stop_signals=(),
            checkpoint_dir=str(a.out / "ckpt"),
            resume=resume,
        ),
        example_batch=batch_of(batches, 1, a.global_batch_size),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=a.lr, momentum=0.9),
    )
    weights, losses = {}, {}
    for step in steps:
        if step <= engine.step_count:
            continue
        losses[step] = engine.train_step(batch_of(batches, step, a.global_batch_size)).loss
        weights[step] = {n: p.detach().clone() for n, p in engine.named_parameters()}
        if step == save_at:
            engine.save_checkpoint(wait=True)
            if dist.is_initialized():
                dist.barrier()  # rank 0's manifest is written before anyone resumes from it
    # 2bw runs 1f1b's per-step list strictly (no opportunistic reordering): always that order.
    nm = len(engine.micro_plan[engine.replica])
    static = get_schedule(schedule, engine.num_stages, nm).stages[engine.stage]
    assert all(tuple(o) == static for o in engine.executed_orders), (name, engine.executed_orders[0], static)
    out = a.out / name
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"weights": weights, "losses": losses}, out / f"rank{engine.layout.rank}.pt")
    engine.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-at", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    a = p.parse_args()
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    base = build_model("gpt", dropout=0.1)
    batches = make_batch("gpt", a.steps * a.global_batch_size)
    steps = range(1, a.steps + 1)
    train("2bw", base, a, batches, schedule="2bw", steps=steps, save_at=a.save_at)
    train("resumed", base, a, batches, schedule="2bw", steps=steps, resume="1")


if __name__ == "__main__":
    main()
