"""Worker: the tiny GPT trained with ``schedule="2bw"`` under the engine at P×D.

Engine A trains ``--steps`` steps with 2bw (``train_step``: a flush after each), saving a
checkpoint after ``--save-at``; engine B resumes from it and trains the same remaining steps
(``--lean``: no checkpoint, no B; ``--deterministic``: in deterministic mode). Each dumps its
weights after every step: ``<out>/<name>/rank<r>.pt``. ``--no-flush``: then the same steps
through ``Engine.train_steps`` (Note [No-flush window] in varuna/runtime/no_flush.py): one
window of every step ("window"); unless ``--lean``, windows ending at ``--save-at``, with a
checkpoint there ("window_ckpt"), and their resume ("window_resumed"); weights dumped at each
window's end. At P=2, D=1 it also records which tasks ran when (``overlap.json``) for an
emulated model with a slow last stage, through ``train_steps`` and through ``train_step``.
"""

from __future__ import annotations

import argparse
import copy
import json
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
from varuna.core.schedule import get_schedule, schedule_kind  # noqa: E402


def batch_of(batches, step: int, m_total: int):
    return tuple(t[(step - 1) * m_total : step * m_total] for t in batches)


def make_engine(base, a, batches, *, schedule, resume, ckpt="ckpt"):
    return varuna.Engine(
        copy.deepcopy(base),
        varuna.VarunaConfig(
            global_batch_size=a.global_batch_size,
            micro_batch_size=a.micro_batch_size,
            schedule=schedule,
            seed=7,
            stop_signals=(),
            checkpoints=varuna.CheckpointConfig(dir=str(a.out / ckpt), resume=resume),
            determinism=varuna.DeterminismConfig(enabled=a.deterministic),
        ),
        example_batch=batch_of(batches, 1, a.global_batch_size),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=a.lr, momentum=0.9),
    )


def train(name, base, a, batches, *, schedule, steps, resume="0", save_at=0):
    engine = make_engine(base, a, batches, schedule=schedule, resume=resume)
    weights, losses = {}, {}
    for step in steps:
        if step <= engine.step_count:
            continue
        losses[step] = engine.train_step(batch_of(batches, step, a.global_batch_size)).loss
        weights[step] = {n: p.detach().clone() for n, p in engine.named_parameters()}
        if step == save_at:
            save_now(engine)
    # 2bw runs 1f1b's per-step list strictly (no opportunistic reordering): always that order.
    nm = len(engine.micro_plan[engine.replica])
    static = get_schedule(schedule, engine.num_stages, nm).stages[engine.stage]
    assert all(tuple(o) == static for o in engine.executed_orders), (name, engine.executed_orders[0], static)
    out = a.out / name
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"weights": weights, "losses": losses}, out / f"rank{engine.layout.rank}.pt")
    engine.close()


def save_now(engine) -> None:
    engine.save_checkpoint(wait=True)
    if dist.is_initialized():
        dist.barrier()  # rank 0's manifest is written before anyone resumes from it


def window(name, base, a, batches, *, parts, resume="0", save_at=0):
    """``train_steps`` over each part (a window each); weights and losses at each window's end."""
    engine = make_engine(base, a, batches, schedule="2bw", resume=resume, ckpt="ckpt_window")
    weights, losses, sizes = {}, {}, []
    for part in parts:
        part = [t for t in part if t > engine.step_count]
        if not part:
            continue
        for r in engine.train_steps([batch_of(batches, t, a.global_batch_size) for t in part]):
            losses[r.step] = r.loss
        sizes.append(len(part))
        weights[engine.step_count] = {n: p.detach().clone() for n, p in engine.named_parameters()}
        if engine.step_count == save_at:
            save_now(engine)
    # Each window ran its static list (1F1B over its mini-batches back to back), strictly.
    nm = len(engine.micro_plan[engine.replica])
    kind = schedule_kind("2bw")
    for order, n in zip(engine.executed_orders, sizes, strict=True):
        assert tuple(order) == kind.window(engine.num_stages, nm, n).stages[engine.stage], (name, n, order)
    out = a.out / name
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"weights": weights, "losses": losses}, out / f"rank{engine.layout.rank}.pt")
    engine.close()


def overlap(a) -> None:
    """Task events (stage, op, mini-batch, start, end) of 3 mini-batches of an emulated model whose
    last stage is 4x the first (blocks sleep: F 10 ms, B 20 ms per block), through ``train_steps``
    and through ``train_step``, gathered on rank 0 into ``overlap.json``."""
    from profiler.overhead_runs import emulated_engine

    found = {}
    with emulated_engine(2, 1, "2bw", 4, True, None, 120.0, blocks_per_stage=1, block_fwd_s=0.01,
                         stage_blocks=(1, 4)) as (engine, batch):
        total = sum(len(p) for p in engine.micro_plan)
        engine.train_step(batch)  # warm-up: buffers, threads
        for mode in ("train_steps", "train_step"):
            engine.timeline.events.clear()
            if mode == "train_steps":
                engine.train_steps([batch] * 3)
            else:
                for _ in range(3):
                    engine.train_step(batch)
            tl = engine.gather_timeline()
            if tl is None:
                continue
            seen: dict = {}
            rows = []
            for e in sorted(tl.events, key=lambda e: e.start_s):
                if e.op not in ("F", "R", "B"):
                    continue
                if mode == "train_steps":  # the window tags s·(micro-batches) + index
                    step = e.microbatch // total
                else:  # the same tags every step: the k-th run of a task is step k's
                    key = (e.stage, e.op, e.microbatch)
                    step = seen[key] = seen.get(key, -1) + 1
                rows.append([e.stage, e.op, step, e.start_s, e.end_s])
            found[mode] = rows
    if found:
        (a.out / "overlap.json").write_text(json.dumps(found))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-at", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--no-flush", action="store_true", help="also train through Engine.train_steps")
    p.add_argument("--lean", action="store_true", help="no checkpoint runs: '2bw' and 'window' only")
    p.add_argument("--deterministic", action="store_true", help="deterministic mode")
    a = p.parse_args()
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    base = build_model("gpt", dropout=0.1)
    batches = make_batch("gpt", a.steps * a.global_batch_size)
    steps = range(1, a.steps + 1)
    train("2bw", base, a, batches, schedule="2bw", steps=steps, save_at=0 if a.lean else a.save_at)
    if not a.lean:
        train("resumed", base, a, batches, schedule="2bw", steps=steps, resume="1")
    if a.no_flush:
        window("window", base, a, batches, parts=[steps])
    if a.no_flush and not a.lean:
        parts = [range(1, a.save_at + 1), range(a.save_at + 1, a.steps + 1)]
        window("window_ckpt", base, a, batches, parts=parts, save_at=a.save_at)
        window("window_resumed", base, a, batches, parts=parts, resume="1")
        if os.environ.get("VARUNA_PIPELINE_DEPTH") == "2" and int(os.environ.get("WORLD_SIZE", "1")) == 2:
            overlap(a)


if __name__ == "__main__":
    main()
