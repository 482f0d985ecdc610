"""Worker: the tiny GPT trained in a live world (varuna/runtime/live_morph.py); one rank may
SIGKILL itself after a step, the survivors regroup in-process and go on.

Dumps, per member, its pid, the (step, loss) pairs it ran, its morphs, its final parameters, and
every attempt to open anything under ``--ckpt-dir`` (an audit hook: a live morph must read none).
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


def audit_opens(root: Path, seen: list[str]) -> None:
    prefix = str(root)

    def hook(event: str, args) -> None:
        if event in ("open", "os.listdir", "os.scandir") and args and str(args[0]).startswith(prefix):
            seen.append(f"{event} {args[0]}")

    sys.addaudithook(hook)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--die-members", default="", help="comma-separated members that kill themselves")
    p.add_argument("--die-after", type=int, default=-1)
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    opened: list[str] = []
    audit_opens(a.ckpt_dir, opened)
    live = LiveWorld.join(timeout_s=a.timeout)
    config = varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=7,
                                 comm_timeout_s=a.timeout, checkpoint_dir=str(a.ckpt_dir), resume=False,
                                 deterministic=True)
    engine = varuna.Engine(build_model("gpt", dropout=0.1), config, example_batch=batch_for(1),
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-8))
    losses, morphs = [], []
    step = 1
    while step <= a.steps:
        try:
            r = engine.train_step(batch_for(step))
        except RuntimeError as e:  # a peer died inside the step
            print(f"member {live.member}: step {step} failed ({str(e)[:120]}); regrouping", flush=True)
            try:
                engine = recover(engine, build_model("gpt", dropout=0.1), live)
            except LiveMorphFailed as f:
                print(f"varuna: {f}", file=sys.stderr, flush=True)
                raise SystemExit(PEER_LOST_EXIT_CODE) from None
            if engine is None:
                raise SystemExit("this slice has no spare role yet") from None
            morphs.append(vars(live.last_morph))
            step = engine.step_count + 1
            continue
        losses.append([r.step, r.loss])
        if step == a.die_after and str(live.member) in a.die_members.split(","):
            os.kill(os.getpid(), signal.SIGKILL)
        step += 1
    a.out.mkdir(parents=True, exist_ok=True)
    m = live.member
    torch.save({n: q.detach().clone() for n, q in engine.named_parameters()}, a.out / f"member{m}.pt")
    (a.out / f"member{m}.json").write_text(json.dumps({
        "pid": os.getpid(), "losses": losses, "morphs": morphs, "P": engine.layout.P, "D": engine.layout.D,
        "opened": opened}))
    engine.close()


if __name__ == "__main__":
    main()
