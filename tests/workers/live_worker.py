"""Worker: the tiny GPT trained by a LiveTrainer (varuna/runtime/live_trainer.py) in a live world.

Scenario options (member:step pairs, comma-separated): ``--die`` SIGKILLs the member after the
step; ``--freeze`` SIGSTOPs it after the step (the survivors' heartbeat watch must declare it
dead; ``--freeze-s`` is their verdict time); ``--notice`` sends it SIGUSR1 after the step (it
leaves at the next boundary);
``--die-in-transfer member:generation`` SIGKILLs it when that regroup starts its transfer;
``--fail-before-commit member:step``: its optimizer step of that step raises (after the end-of-step
agreement: the others commit the step, it does not) and it regroups a step behind the others;
``--joiners-after step:n``: member 0 sets ``test/joiners`` after the step (the harness starts n
joiners) and, after the next step, waits (bounded) until they registered, so growth happens at
a known boundary.

Dumps, per member: pid, the (step, loss) pairs it ran, steps that failed, its morphs, its final
role and parameters, and every attempt to open anything under ``--ckpt-dir`` (an audit hook: a
live morph must read none).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from models import build_model  # noqa: E402

import varuna  # noqa: E402
from varuna.runtime.live_morph import ROOT as KEYS  # noqa: E402
from varuna.runtime.live_morph import LiveWorld  # noqa: E402
from varuna.runtime.live_trainer import LiveTrainer  # noqa: E402

GLOBAL_BATCH, MICRO_BATCH = 8, 2


def batch_for(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 256, (GLOBAL_BATCH, 17), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def audit_opens(root: Path, seen: list[str]) -> None:
    prefix = str(root)

    def hook(event: str, args) -> None:
        if event in ("open", "os.listdir", "os.scandir") and args and str(args[0]).startswith(prefix):
            seen.append(f"{event} {args[0]}")

    sys.addaudithook(hook)


def fail_next_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """The next ``optimizer.step()`` raises, once, as a peer lost right after the agreement would."""
    def step(*args, **kwargs):
        optimizer.step = original
        raise RuntimeError("injected: a peer was lost after the end-of-step agreement")

    original = optimizer.step
    optimizer.step = step


def pairs(text: str) -> dict[int, int]:
    return {int(a): int(b) for a, b in (p.split(":") for p in text.split(",") if p)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--die", default="")
    p.add_argument("--notice", default="")
    p.add_argument("--freeze", default="")
    p.add_argument("--freeze-s", type=float, default=30.0)
    p.add_argument("--die-in-transfer", default="")
    p.add_argument("--fail-before-commit", default="")
    p.add_argument("--joiners-after", default="")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--shard", action="store_true", help="optimizer state sharded over the replicas")
    a = p.parse_args()
    torch.set_num_threads(1)
    opened: list[str] = []
    audit_opens(a.ckpt_dir, opened)
    die, notice, die_xfer, freeze = pairs(a.die), pairs(a.notice), pairs(a.die_in_transfer), pairs(a.freeze)
    fail_commit = pairs(a.fail_before_commit)
    join_step, n_joiners = (int(x) for x in a.joiners_after.split(":")) if a.joiners_after else (-9, 0)
    member = int(os.environ["RANK"])

    def on_phase(phase: str, gen: int) -> None:
        if phase == "transfer" and die_xfer.get(member) == gen:
            os.kill(os.getpid(), signal.SIGKILL)  # a second failure, inside the regroup

    config = varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=7,
                                 checkpoints=varuna.CheckpointConfig(dir=str(a.ckpt_dir), resume=False),
                                 determinism=varuna.DeterminismConfig(enabled=True),
                                 optimizer_state=varuna.OptimizerStateConfig(shard=a.shard),
                                 # member 0 may wait for joiners to start (seconds on a busy host) between
                                 # steps; the peer watch would take that for a frozen peer and end the run
                                 timeouts=varuna.TimeoutConfig(comm_s=a.timeout, peer_s=0))
    trainer = LiveTrainer(lambda: build_model("gpt", dropout=0.1), config, example_batch=batch_for(1),
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-8), on_phase=on_phase,
                          live=LiveWorld.join(timeout_s=a.timeout, freeze_s=a.freeze_s), wait_s=120.0)
    losses = []

    def on_step(r) -> None:
        losses.append([r.step, r.loss])
        store = trainer.live.store
        if member == 0 and r.step == join_step:
            store.set("test/joiners", "1")
        if member == 0 and r.step == join_step + 1:  # growth at the next boundary, not by chance later
            store.wait([f"{KEYS}join/{i}" for i in range(1, n_joiners + 1)], timedelta(seconds=a.timeout))
        if fail_commit.get(member) == r.step + 1:
            fail_next_optimizer_step(trainer.engine.optimizer)
        if die.get(member) == r.step:
            os.kill(os.getpid(), signal.SIGKILL)
        if freeze.get(member) == r.step:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen, sockets open; SIGCONT from the harness at the end
        if notice.get(member) == r.step:
            os.kill(os.getpid(), signal.SIGUSR1)

    engine = trainer.run(a.steps, batch_for, on_step=on_step)
    a.out.mkdir(parents=True, exist_ok=True)
    if engine is not None:
        params = {n: q.detach().clone() for n, q in engine.named_parameters()}
        torch.save(params, a.out / f"member{member}.pt")
    (a.out / f"member{member}.json").write_text(json.dumps({
        "pid": os.getpid(), "losses": losses, "morphs": [dataclasses.asdict(m) for m in trainer.morphs],
        "failed_steps": trainer.failed_steps, "role": trainer.live.role, "finished": trainer.live.finished,
        "P": engine.layout.P if engine else None, "D": engine.layout.D if engine else None,
        "opened": opened}))
    if engine is not None:
        engine.close()


if __name__ == "__main__":
    main()
