"""Worker for ``varuna-launch --live-morph`` (tests/test_launch_live.py): the tiny GPT trained by
:class:`varuna.runtime.live_trainer.LiveTrainer` (the live-morph entry point) with periodic
checkpoints, so that the launcher's fallback restart can resume. Some members SIGKILL themselves
after a step, on the first launch only (``$VARUNA_RESTARTS`` = 0).

Writes, per member, ``member{m}.json`` (pid, restarts, the step it resumed at, the (step, loss)
pairs it ran, its morphs, the final P×D) and ``member{m}.pt`` (its final parameters).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from live_worker import GLOBAL_BATCH, MICRO_BATCH, batch_for  # noqa: E402 (same data as the runtime test)
from models import build_model  # noqa: E402

import varuna  # noqa: E402
from varuna.runtime.live_trainer import LiveTrainer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--checkpoint-every", type=int, default=2)
    p.add_argument("--die-members", default="", help="comma-separated members that SIGKILL themselves")
    p.add_argument("--die-after", type=int, default=-1)
    a = p.parse_args()
    torch.set_num_threads(1)
    restarts = int(os.environ.get("VARUNA_RESTARTS", "0"))
    config = varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=7,
                                 checkpoints=varuna.CheckpointConfig(every=a.checkpoint_every),
                                 determinism=varuna.DeterminismConfig(enabled=True),
                                 # a kill -9 resets the sockets (the regroup starts at once); on a busy host
                                 # the peer watch could take a starved peer for a frozen one and end the run
                                 timeouts=varuna.TimeoutConfig(comm_s=60.0, peer_s=0))
    trainer = LiveTrainer(lambda: build_model("gpt", dropout=0.1), config, example_batch=batch_for(1),
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-8))
    member = trainer.live.member
    resumed_at = trainer.engine.committed_step if trainer.engine is not None else -1
    losses = []
    dies = restarts == 0 and str(member) in a.die_members.split(",")

    def on_step(r) -> None:
        losses.append([r.step, r.loss])
        if dies and r.step == a.die_after:
            os.kill(os.getpid(), signal.SIGKILL)

    engine = trainer.run(a.steps, batch_for, on_step=on_step)
    if engine is None:
        return  # left the run (a spare at the end): nothing of its own to report
    torch.save({n: q.detach().clone() for n, q in engine.named_parameters()}, a.out / f"member{member}.pt")
    (a.out / f"member{member}.json").write_text(json.dumps({
        "pid": os.getpid(), "restarts": restarts, "resumed_at": resumed_at, "losses": losses,
        "morphs": [dataclasses.asdict(m) for m in trainer.morphs],
        "P": engine.layout.P, "D": engine.layout.D}))
    engine.close()


if __name__ == "__main__":
    main()
