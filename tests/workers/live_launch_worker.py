"""Worker for ``varuna-launch --live-morph`` (tests/test_launch_live.py): the tiny GPT in a live
world (varuna/runtime/live_morph.py) with periodic checkpoints, so that the launcher's fallback
restart can resume. Some members SIGKILL themselves after a step, on the first launch only
(``$VARUNA_RESTARTS`` = 0).

Writes, per member, ``member{m}.json`` (pid, restarts, the (step, loss) pairs it ran, its morphs,
the final P×D, whether it resumed from a checkpoint) and ``member{m}.pt`` (its final parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from models import build_model  # noqa: E402

import varuna  # noqa: E402
from varuna.runtime.live_morph import LiveMorphFailed, LiveWorld, recover  # noqa: E402
from varuna.runtime.peer_watch import PEER_LOST_EXIT_CODE  # noqa: E402

GLOBAL_BATCH, MICRO_BATCH = 8, 2


def batch_for(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 256, (GLOBAL_BATCH, 17), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


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
    live = LiveWorld.join(timeout_s=60.0)
    config = varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=7,
                                 comm_timeout_s=60.0, checkpoint_every=a.checkpoint_every, deterministic=True)
    engine = varuna.Engine(build_model("gpt", dropout=0.1), config, example_batch=batch_for(1),
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-8))
    resumed_at = engine.step_count
    losses, morphs = [], []
    step = engine.step_count + 1
    while step <= a.steps:
        try:
            r = engine.train_step(batch_for(step))
        except RuntimeError as e:  # a peer died inside the step
            print(f"member {live.member}: step {step} failed ({str(e)[:100]}); regrouping", flush=True)
            try:
                engine = recover(engine, build_model("gpt", dropout=0.1), live)
            except LiveMorphFailed as f:
                print(f"varuna: {f}", file=sys.stderr, flush=True)
                raise SystemExit(PEER_LOST_EXIT_CODE) from None
            if engine is None:
                raise SystemExit("spare: nothing to do in this layout") from None
            morphs.append(vars(live.last_morph))
            step = engine.step_count + 1
            continue
        losses.append([r.step, r.loss])
        if restarts == 0 and step == a.die_after and str(live.member) in a.die_members.split(","):
            os.kill(os.getpid(), signal.SIGKILL)
        step += 1
    m = live.member
    torch.save({n: q.detach().clone() for n, q in engine.named_parameters()}, a.out / f"member{m}.pt")
    (a.out / f"member{m}.json").write_text(json.dumps({
        "pid": os.getpid(), "restarts": restarts, "resumed_at": resumed_at, "losses": losses,
        "morphs": morphs, "P": engine.layout.P, "D": engine.layout.D}))
    engine.close()


if __name__ == "__main__":
    main()
