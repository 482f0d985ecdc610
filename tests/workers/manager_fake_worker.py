"""A torch-free stand-in for a training script, for the manager's tests.

It behaves like ``examples/gpt2/train.py`` under the manager as far as the manager can tell:
``--steps N`` steps of ``--step-time`` seconds; a step counter checkpointed every
``$VARUNA_CHECKPOINT_EVERY`` steps to ``$VARUNA_CHECKPOINT_DIR`` (by rank 0) and resumed from
with ``$VARUNA_RESUME=auto``; SIGUSR1/SIGTERM finish the step, checkpoint and exit 0; and one
heartbeat per step through :class:`manager.worker.reporter.WorkerReporter` (a fake engine supplies the
layout and per-micro-batch F/B times). A file ``slow-<VARUNA_VM_ID>`` in the checkpoint directory
makes its reported compute times ``--slow-factor`` times longer (a fail-stutter VM).

Ranks move in lockstep like real ones, led by rank 0: rank 0 publishes each step it completes
(``progress-g<generation>``) and the others complete step s only after it did, so no rank is
ever ahead of the checkpointing rank; a rank whose leader vanished waits (as a real one hangs in
a collective) until the manager kills it, or gives up after 60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from manager.worker.reporter import WorkerReporter
from varuna.core.timeline import Timeline


@dataclass
class _Layout:
    rank: int
    P: int
    D: int

    @property
    def stage(self) -> int:
        return self.rank % self.P

    @property
    def replica(self) -> int:
        return self.rank // self.P


@dataclass(frozen=True)
class _Metrics:
    record_timeline: bool = False


@dataclass
class _Config:  # VarunaConfig's shape, as far as the reporter reads it
    metrics: _Metrics = field(default_factory=_Metrics)


@dataclass
class _Result:
    step: int
    loss: float
    samples_per_s: float
    wall_time: float


@dataclass
class FakeEngine:
    """What WorkerReporter reads from a varuna.Engine."""

    layout: _Layout
    step_count: int = 0
    config: _Config = field(default_factory=_Config)
    timeline: Timeline = field(default_factory=Timeline)

    def describe(self) -> dict:
        return {"m": 2, "stage_ranges": [(s, s + 1) for s in range(self.layout.P)]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--slow-factor", type=float, default=10.0)
    p.add_argument("--metrics-out", default=None)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    P = int(os.environ["VARUNA_PIPELINE_DEPTH"])
    ckpt = Path(os.environ["VARUNA_CHECKPOINT_DIR"])
    every = int(os.environ.get("VARUNA_CHECKPOINT_EVERY", "0") or 0)
    stop = []
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    engine = FakeEngine(layout=_Layout(rank=rank, P=P, D=world // P))
    latest = ckpt / "latest.json"
    if os.environ.get("VARUNA_RESUME") == "auto" and latest.exists():
        engine.step_count = json.loads(latest.read_text())["step"]
    reporter = WorkerReporter.from_env(engine)
    slow_flag = ckpt / f"slow-{os.environ.get('VARUNA_VM_ID', '')}"

    def save(step: int) -> None:
        if rank == 0:
            ckpt.mkdir(parents=True, exist_ok=True)
            tmp = ckpt / "latest.tmp"
            tmp.write_text(json.dumps({"step": step}))
            tmp.replace(latest)

    progress = ckpt / f"progress-g{os.environ.get('VARUNA_GENERATION', '0')}"

    def leader_step() -> int:
        try:
            return int(progress.read_text() or 0)
        except (OSError, ValueError):
            return 0

    out = open(args.metrics_out, "a") if (args.metrics_out and rank == 0) else None
    for step in range(engine.step_count + 1, args.steps + 1):
        t0 = time.perf_counter()
        f = args.step_time / 6 * (args.slow_factor if slow_flag.exists() else 1.0)
        time.sleep(args.step_time)
        if rank == 0:
            ckpt.mkdir(parents=True, exist_ok=True)
            tmp = progress.with_suffix(".tmp")
            tmp.write_text(str(step))
            tmp.replace(progress)
        else:
            deadline = time.monotonic() + 60.0
            while leader_step() < step and not stop:
                if time.monotonic() > deadline:
                    return 1
                time.sleep(0.005)
            if leader_step() < step:  # stopped before the leader got here: this step never happened
                break
        for mb in range(2):
            engine.timeline.add(engine.layout.stage, engine.layout.replica, "F", mb, 0.0, f)
            engine.timeline.add(engine.layout.stage, engine.layout.replica, "B", mb, 0.0, 2 * f)
        engine.step_count = step
        loss = 5.0 / step
        if every and step % every == 0:
            save(step)
        res = _Result(
            step=step, loss=loss, samples_per_s=8 / (time.perf_counter() - t0), wall_time=time.time()
        )
        if reporter is not None:
            reporter.on_step(res)
        if out:
            out.write(
                json.dumps(
                    {
                        "step": step,
                        "loss": loss,
                        "P": P,
                        "D": world // P,
                        "generation": int(os.environ.get("VARUNA_GENERATION", "0")),
                    }
                )
                + "\n"
            )
            out.flush()
        if stop:
            save(step)
            print(f"rank {rank}: stop requested: checkpointed step {step}, exiting 0", flush=True)
            break
    if reporter is not None:
        reporter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
