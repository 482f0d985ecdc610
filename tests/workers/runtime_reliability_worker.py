"""Worker for tests/test_runtime_reliability.py: a small engine driven the way user scripts drive it.

Modes (``--mode``):

- ``teardown``: join the default group itself (like a user script), build a deterministic engine,
  run ``--steps`` steps, ``engine.close()`` and return *without* ``destroy_process_group`` -- the
  exit path that aborted under load ("terminate called without an active exception").
- ``nan``: every step's batch is NaN from step ``--nan-from`` on; prints each StepResult.
- ``early-exit``: rank ``--victim`` leaves after ``--victim-steps`` steps (closing its engine);
  the others keep training and must be told which rank left, within seconds.
- ``freeze``: rank ``--victim`` stops itself (SIGSTOP) after ``--victim-steps`` steps.

``--count-groups`` prints how many process-group handles are reachable from the engine just
before and just after ``engine.close()`` (Note [Teardown at exit]: none may be left after).
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from models import build_model, make_batch  # noqa: E402

import varuna  # noqa: E402


def reachable_groups(root) -> int:
    """Process-group handles reachable from ``root`` through Python objects' data (not through
    functions, whose module globals reach torch's own registry of groups)."""
    seen, count, stack = set(), 0, [root]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, type | types.ModuleType | types.FunctionType | types.MethodType):
            continue
        seen.add(id(o))
        if isinstance(o, dist.ProcessGroup):
            count += 1
            continue
        stack.extend(gc.get_referents(o))
    return count


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="teardown", choices=["teardown", "nan", "early-exit", "freeze"])
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--nan-from", type=int, default=1)
    p.add_argument("--max-nonfinite", type=int, default=3)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--victim-steps", type=int, default=1)
    p.add_argument("--peer-timeout", type=float, default=3.0)
    p.add_argument("--count-groups", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")  # the script owns the default group, as det_worker does
    M = 8
    cfg = varuna.VarunaConfig(
        global_batch_size=M,
        micro_batch_size=2,
        determinism=varuna.DeterminismConfig(enabled=True),
        numerics=varuna.NumericsConfig(max_nonfinite_steps=a.max_nonfinite),
        timeouts=varuna.TimeoutConfig(peer_s=a.peer_timeout, comm_s=120.0),
    )
    batch = make_batch("onecut", M)
    engine = varuna.Engine(
        build_model("onecut"), cfg, example_batch=batch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)
    )
    rank = engine.layout.rank
    for step in range(1, a.steps + 1):
        if a.mode in ("early-exit", "freeze") and rank == a.victim and step > a.victim_steps:
            if a.mode == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)
            break
        x, y = batch
        if a.mode == "nan" and step >= a.nan_from:
            x = torch.full_like(x, float("nan"))
        r = engine.train_step((x, y))
        print(f"step {r.step} loss {r.loss} skipped {r.skipped}", flush=True)
    before = reachable_groups(engine) if a.count_groups else 0
    engine.close()
    if a.count_groups:
        print(f"groups reachable before close {before} after {reachable_groups(engine)}", flush=True)


if __name__ == "__main__":
    main()
