"""Morph latency and steps redone: live morph vs the restart path (issue #22, docs/live_morph.md).

One morph = a real ``SIGKILL`` of one worker of a 2×2 job (member 3, right after it finished step
``--kill-after``); the three left go on at 1×3.

- **live**: the survivors keep their processes, regroup (``varuna.runtime.live_morph.recover``:
  new store generation, each gets the half of the model and AdamW state it lacks from a peer) and
  redo the step in flight. This script plays the launcher's part (it hosts the store and declares
  the dead worker when it sees the exit, as ``varuna-launch --live-morph`` does).
- **restart**: today's path (``varuna-manager`` on a lost VM): SIGKILL the survivors, start three
  fresh workers at 1×3 that resume from the newest complete checkpoint (a synchronous checkpoint
  every ``--checkpoint-every`` steps, the job's policy) in the global store (a local directory).

Latency = from the kill (the dying worker's clock just before ``SIGKILL``) to the moment the last
rank of the new layout starts the next step (``train_step`` called); all processes share this
machine's clock. Steps redone = completed steps trained again (the kill came after step k; a
resume at step c redoes k - c; the live path resumes at k: only the step in flight is redone,
which is not a completed step). Each morph is a fresh job; the table gives medians (min-max).

    python scripts/bench_live_morph.py                     # both models, 10 morphs per path
    python scripts/bench_live_morph.py --morphs 3 --models example --json-out runs/bench_live.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gpt2"


@dataclass(frozen=True)
class ModelSize:
    """A GPT of the example (examples/gpt2/model.py) and the batch it trains on."""

    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    global_batch: int
    micro_batch: int

    def args(self) -> list[str]:
        return [f"--{k.replace('_', '-')}={v}" for k, v in vars(self).items()]


#: "example": the example's default GPT (examples/gpt2/train.py); "large": 30x its parameters.
MODELS = {
    "example": ModelSize(n_layer=4, n_embd=128, n_head=4, block_size=64, global_batch=8, micro_batch=2),
    "large": ModelSize(n_layer=8, n_embd=512, n_head=8, block_size=16, global_batch=4, micro_batch=1),
}
WAIT_S = 600.0  # bound of every wait on a worker (a busy 2-core machine, the large model)


# ---------------------------------------------------------------------------------- the worker


def worker(a: argparse.Namespace) -> None:
    """One rank: train, kill itself when told, survive a lost peer (live) or resume (restart)."""
    import torch

    sys.path.insert(0, str(EXAMPLE))
    from model import GPT, GPTConfig

    import varuna
    from varuna.runtime.live_morph import LiveWorld, recover

    torch.set_num_threads(1)
    cfg = GPTConfig(n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head, block_size=a.block_size)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(cfg)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, cfg.vocab_size, (a.global_batch, a.block_size + 1), generator=g)
        return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

    phases = _time_phases()
    live = LiveWorld.join(timeout_s=WAIT_S)
    config = varuna.VarunaConfig(global_batch_size=a.global_batch, micro_batch_size=a.micro_batch, seed=0,
                                 timeouts=varuna.TimeoutConfig(comm_s=WAIT_S),
                                 checkpoints=varuna.CheckpointConfig(dir=a.ckpt,
                                                                     resume="auto" if a.ckpt else "0"))
    engine = varuna.Engine(build(), config, example_batch=batch(1),
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    report: dict = {"pid": os.getpid(), "resumed_at": engine.step_count}
    step, first = engine.step_count + 1, True
    while step <= a.steps:
        if first:
            report["t_first_step"], first = time.time(), False
        try:
            engine.train_step(batch(step))
            failed = False
        except RuntimeError:  # a peer died inside the step
            failed = True
        if failed:  # outside the except block, as LiveTrainer: its traceback's frames hold group handles
            report["t_failed"], before = time.time(), dict(phases)
            # the model factory, as LiveTrainer does: the fresh model is built after the tear down
            # (which fails the peers still waiting on this rank) and the rendezvous, not before
            engine = recover(engine, build, live)
            if engine is None:
                raise SystemExit("spare in the new layout: nothing to measure")
            report["morph"] = vars(live.last_morph)
            report["phases"] = {k: v - before.get(k, 0.0) for k, v in phases.items()}
            step, first = engine.step_count + 1, True
            continue
        if a.ckpt and step % a.checkpoint_every == 0 and step <= a.kill_after:
            engine.save_checkpoint(wait=True)
        if step == a.kill_after and live.member == a.kill_member:
            Path(a.out, "kill.json").write_text(json.dumps({"t_kill": time.time(), "step": step}))
            os.kill(os.getpid(), signal.SIGKILL)
        step += 1
    Path(a.out, f"member{live.member}.json").write_text(json.dumps(report))
    engine.close()
    live.close()  # joins the heartbeat thread


def _time_phases() -> dict[str, float]:
    """Seconds spent in each phase of ``recover`` (wrapping its steps in varuna.runtime.live_morph;
    measurement only, the functions are unchanged)."""
    import functools

    from varuna.runtime import live_morph

    spent: dict[str, float] = {}
    names = {"_tear_down": "tear down", "_close": "rendezvous", "_init_group": "new group",
             "Engine": "new engine", "_hand_over": "transfer"}
    for attr, label in names.items():
        fn = getattr(live_morph, attr, None)
        if fn is None:
            continue

        def timed(*args, _fn=fn, _label=label, **kwargs):
            t0 = time.monotonic()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.monotonic() - t0

        setattr(live_morph, attr, functools.wraps(fn)(timed) if attr != "Engine" else timed)
    return spent


# ---------------------------------------------------------------------------------- the harness


class World:
    """Workers of one job around a store this process hosts (the launcher's role)."""

    def __init__(self, n: int, P: int, argv: list[str], out: Path, tag: str) -> None:
        from varuna.launch.live_store import LiveStore
        from varuna.launch.procs import pdeathsig_preexec

        self.live = LiveStore(timeout_s=WAIT_S)  # the launcher's authenticated store
        self.store = self.live.store
        self.out = out
        self.procs: list[subprocess.Popen] = []
        for r in range(n):
            env = {**os.environ, **self.live.worker_env(), "RANK": str(r),
                   "WORLD_SIZE": str(n), "LOCAL_RANK": str(r), "VARUNA_PIPELINE_DEPTH": str(P),
                   "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            log = open(out / f"{tag}-rank{r}.log", "w")  # noqa: SIM115 (the child keeps its copy)
            self.procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *argv], env=env,
                                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                               preexec_fn=pdeathsig_preexec()))  # no orphans
            log.close()

    def wait(self, rank: int) -> int:
        return self.procs[rank].wait(WAIT_S)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(WAIT_S)
        self.live.close()

    def check(self, ranks: list[int]) -> None:
        bad = {r: self.procs[r].returncode for r in ranks if self.procs[r].returncode != 0}
        if bad:
            logs = "\n".join(f.read_text()[-1500:] for f in sorted(self.out.glob("*.log")))
            raise RuntimeError(f"workers failed {bad}:\n{logs}")


def one_morph(path: str, size: ModelSize, a: argparse.Namespace, tmp: Path) -> dict:
    """One 2×2 job, one SIGKILL, the morph to 1×3 by ``path``; what it cost."""
    out = tmp / "out"
    out.mkdir(parents=True)
    ckpt = str(tmp / "ckpt") if path == "restart" else ""
    argv = [*size.args(), "--out", str(out), "--steps", str(a.kill_after + 1),
            "--kill-after", str(a.kill_after), "--kill-member", "3",
            "--checkpoint-every", str(a.checkpoint_every), "--ckpt", ckpt]
    world = World(4, 2, argv, out, "first")
    try:
        world.wait(3)  # the kill
        if path == "live":
            from varuna.runtime.live_morph import declare_dead

            declare_dead(world.store, 3)  # the launcher saw the exit
            for r in range(3):
                world.wait(r)
            world.check([0, 1, 2])
            reports = [json.loads((out / f"member{m}.json").read_text()) for m in range(3)]
            resumed = reports[0]["morph"]["resumed_after"]
        else:
            world.kill_all()  # today's path: the generation is killed...
            again = World(3, 1, argv, out, "relaunch")  # ...and relaunched on what is left, resuming
            try:
                for r in range(3):
                    again.wait(r)
                again.check([0, 1, 2])
            finally:
                again.kill_all()
            reports = [json.loads((out / f"member{m}.json").read_text()) for m in range(3)]
            resumed = reports[0]["resumed_at"]
    finally:
        world.kill_all()
    kill = json.loads((out / "kill.json").read_text())
    phases = {k: max(r.get("phases", {}).get(k, 0.0) for r in reports) for k in reports[0].get("phases", {})}
    return {"latency_s": max(r["t_first_step"] for r in reports) - kill["t_kill"],
            "redone": kill["step"] - resumed, "phases": phases}


def parameter_count(size: ModelSize) -> int:
    import torch

    sys.path.insert(0, str(EXAMPLE))
    from model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=size.n_layer, n_embd=size.n_embd, n_head=size.n_head,
                              block_size=size.block_size))
    return sum(p.numel() for p in model.parameters())


def run(a: argparse.Namespace) -> dict:
    """Every (model, path) row gets ``a.morphs`` morphs, taken round-robin (a drifting machine load
    spreads over all rows); with ``--json-out`` the numbers so far are written after each morph."""
    params = {name: parameter_count(MODELS[name]) for name in a.models}
    results: dict = {(name, path): [] for name in a.models for path in ("live", "restart")}
    for i in range(a.morphs):
        for (name, path), rows in results.items():
            with tempfile.TemporaryDirectory(prefix="bench-live-") as tmp:
                rows.append({**one_morph(path, MODELS[name], a, Path(tmp)), "params": params[name]})
            print(f"{name} {path} {i + 1}/{a.morphs}: {rows[-1]['latency_s']:.2f} s, "
                  f"{rows[-1]['redone']} step(s) redone", file=sys.stderr, flush=True)
            if a.json_out:
                a.json_out.parent.mkdir(parents=True, exist_ok=True)
                a.json_out.write_text(json.dumps({f"{m} {p}": r for (m, p), r in results.items()}, indent=1))
    return results


def table(results: dict, a: argparse.Namespace) -> str:
    lines = ["| model | params | path | morph latency, median (min–max) | completed steps redone | speed-up |",  # noqa: E501
             "|---|---|---|---|---|---|"]
    for (name, path), rows in results.items():
        lat = [r["latency_s"] for r in rows]
        live = statistics.median(x["latency_s"] for x in results[(name, "live")])
        speed = f"{statistics.median(lat) / live:.1f}×" if path == "restart" else ""
        redone = sorted({r["redone"] for r in rows})
        lines.append(f"| {name} | {rows[0]['params'] / 1e6:.2f} M | {path} | {statistics.median(lat):.2f} s "
                     f"({min(lat):.2f}–{max(lat):.2f}) | {'/'.join(map(str, redone))} | {speed} |")
    for (name, path), rows in results.items():
        if path == "live":
            parts = {k: statistics.median(r["phases"].get(k, 0.0) for r in rows) for k in rows[0]["phases"]}
            lines.append(f"\n{name} live, slowest rank per phase (median s): "
                         + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    lines.append(f"\n{a.morphs} morph(s) per row; kill after step {a.kill_after}, restart path checkpoints "
                 f"every {a.checkpoint_every} step(s).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--morphs", type=int, default=10, help="morphs per model and path (default 10)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--kill-after", type=int, default=3, help="the worker dies after this step (default 3)")
    p.add_argument("--checkpoint-every", type=int, default=2, help="restart path's checkpoint interval (2)")
    p.add_argument("--json-out", type=Path, help="write every morph's numbers here (after each morph)")
    p.add_argument("--table-from", type=Path, help="print the table of an earlier --json-out and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for k, v in vars(MODELS["example"]).items():  # the worker's model (set by the harness)
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v, help=argparse.SUPPRESS)
    for k in ("out", "ckpt"):
        p.add_argument(f"--{k}", default="", help=argparse.SUPPRESS)
    for k in ("steps", "kill-member"):
        p.add_argument(f"--{k}", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    if a.morphs < 1 or a.kill_after < 1 or a.checkpoint_every < 1:
        p.error("--morphs, --kill-after and --checkpoint-every must be >= 1")
    t0 = time.monotonic()
    if a.table_from:
        raw = json.loads(a.table_from.read_text())
        results = {tuple(k.split()): rows for k, rows in raw.items() if rows}
        a.morphs = min(len(r) for r in results.values())
    else:
        results = run(a)
    print(table(results, a))
    print(f"total {time.monotonic() - t0:.0f} s; load: {os.getloadavg()[0]:.2f} (1-min average at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
