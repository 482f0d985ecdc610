"""Train the GPT example with varuna at any P×D.

varuna-launch --procs 4 --pipeline-depth 2 examples/gpt2/train.py --steps 20
python examples/gpt2/train.py --steps 20        # one process (P = D = 1)

With ``$VARUNA_LIVE_STORE`` set (``varuna-launch --live-morph``, or a ``live_morph = true`` job of
``varuna-manager``) the steps run through ``varuna.runtime.live_trainer.LiveTrainer``: a lost
peer makes the survivors regroup in their processes (docs/live_morph.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data import ByteBatches  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

import varuna  # noqa: E402
from varuna.core.extras import MissingExtra  # noqa: E402
from varuna.core.schedule import DEFAULT_SCHEDULE, SCHEDULE_KINDS  # noqa: E402
from varuna.runtime.no_flush import no_flush_unsupported  # noqa: E402

#: This script's own values for the planned fields it leaves to the launcher (Note [Run plan] in
#: varuna/core/env.py): used only when neither the command line nor the run plan gives one.
PLAN_DEFAULTS = {"global_batch_size": 32, "micro_batch_size": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="total optimizer steps")
    # Planned fields default to None (unset): the launcher's plan then applies, else PLAN_DEFAULTS.
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="examples per step (default: the launcher's --global-batch-size, else 32)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="examples per micro-batch (default: auto-config's choice, else 4)")
    p.add_argument("--schedule", default=None, choices=list(SCHEDULE_KINDS),
                   help=f"pipeline schedule (default: the launcher's --schedule, else {DEFAULT_SCHEDULE})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-out", type=Path, help="JSON Lines, one object per step")
    p.add_argument(
        "--tensorboard-dir",
        help="also write the per-step metrics as TensorBoard events here (or VARUNA_TENSORBOARD_DIR)",
    )
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--eval-every", type=int, default=10, help="steps between validation losses (0: never)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    p.add_argument("--trace", type=Path, help="write the last step's task timeline (Chrome trace JSON) here")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="bit-identical weights at any P×D and across morphs (docs/determinism.md)",
    )
    # Checkpoints (docs/checkpoints.md); the launcher's VARUNA_CHECKPOINT_DIR / VARUNA_RESUME work too.
    p.add_argument("--checkpoint-dir", help="global checkpoint store (shared filesystem or mounted blob)")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="steps between checkpoints (0: only when stopped by SIGUSR1/SIGTERM)",
    )
    p.add_argument("--keep-checkpoints", type=int, default=2, help="complete checkpoints to keep")
    p.add_argument(
        "--resume",
        nargs="?",
        const="1",
        choices=["1", "auto", "0"],
        help="resume from the newest complete checkpoint (auto: only if one exists); "
        "--steps stays the total step count",
    )
    p.add_argument(
        "--live-freeze-s",
        type=float,
        default=30.0,
        help="live morph ($VARUNA_LIVE_STORE): a peer whose heartbeat stood still this long is declared "
        "dead (frozen) and the others go on without it (docs/live_morph.md)",
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def build_model(args: argparse.Namespace) -> GPT:
    """The GPT model of the command line, initialised from ``--seed``."""
    cfg = GPTConfig(
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
    )
    torch.manual_seed(args.seed)
    return GPT(cfg)


def build_config(args: argparse.Namespace) -> varuna.VarunaConfig:
    """The engine's configuration from the command line (planned fields None where not given)."""
    return varuna.VarunaConfig(
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        schedule=args.schedule,
        seed=args.seed,
        precision=args.precision,
        max_grad_norm=args.max_grad_norm or None,
        determinism=varuna.DeterminismConfig(enabled=args.deterministic, threads=args.threads),
        checkpoints=varuna.CheckpointConfig(
            dir=args.checkpoint_dir, every=args.checkpoint_every, keep=args.keep_checkpoints,
            resume=args.resume,
        ),
        metrics=varuna.MetricsConfig(
            tensorboard_dir=args.tensorboard_dir, record_timeline=args.trace is not None
        ),
    )


def adopt_run_plan(args: argparse.Namespace) -> None:
    """Fill the batch sizes and schedule the command line left unset from the launcher's run plan
    (else ``PLAN_DEFAULTS``): the data below needs the global batch before the engine exists.
    A value that differs from the plan stops here with one line (rank 0 says what it adopted)."""
    config = build_config(args).with_plan(defaults=PLAN_DEFAULTS)
    args.global_batch_size, args.micro_batch_size = config.global_batch_size, config.micro_batch_size
    args.schedule = config.schedule


def build_engine(args: argparse.Namespace, data: ByteBatches) -> varuna.Engine:
    """The GPT model and its varuna engine, configured from the command line."""
    return varuna.Engine(
        build_model(args),
        build_config(args),
        example_batch=data.get("train", 0, args.global_batch_size),
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0),
    )


def run_live(args: argparse.Namespace, data: ByteBatches) -> int:
    """Train through ``LiveTrainer`` (``$VARUNA_LIVE_STORE`` set): survivors of a lost peer go on in
    this process at a new layout; rank 0 of the current layout writes the metrics."""
    from varuna.launch.live_store import LIVE_NOTICE_ENV
    from varuna.runtime.live_trainer import LiveTrainer

    # The peer watch would take a peer that closed its engine to regroup for a lost one and end
    # this worker (exit 75) before it regroups, so it is off here as in the live tests; frozen
    # peers are the live watch's (freeze_s: docs/live_morph.md, Frozen peers).
    config = build_config(args)
    config = dataclasses.replace(config, timeouts=dataclasses.replace(config.timeouts, peer_s=0))
    trainer = LiveTrainer(
        lambda: build_model(args),
        config,
        example_batch=data.get("train", 0, args.global_batch_size),
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0),
        # SIGUSR1 stays what it is without live morph, the graceful stop of the whole job (the
        # manager's STOP order); a per-worker eviction notice (hand over and leave) comes as the
        # signal the supervisor names ($VARUNA_LIVE_NOTICE_SIGNAL: varuna-manager's SIGUSR2).
        notice_signals=tuple(s for s in [os.environ.get(LIVE_NOTICE_ENV, "")] if s and s != "SIGUSR1"),
        freeze_s=args.live_freeze_s,
    )

    def on_step(r: varuna.StepResult) -> None:
        engine = trainer.engine
        if engine is None or engine.layout.rank != 0:
            return
        print(f"step {r.step:5d}/{args.steps} loss {r.loss:.4f} |g| {r.grad_norm:.3f} "
              f"{r.samples_per_s:8.1f} samples/s (P={engine.layout.P} D={engine.layout.D})", flush=True)
        if args.metrics_out:
            with open(args.metrics_out, "a") as out:
                out.write(json.dumps({"step": r.step, "loss": r.loss, "samples_per_s": r.samples_per_s,
                                      "P": engine.layout.P, "D": engine.layout.D, "wall_time": r.wall_time,
                                      "step_s": r.step_s, "grad_norm": r.grad_norm, "skipped": r.skipped,
                                      "tflops": r.tflops, "mfu": r.mfu, "pid": os.getpid()}) + "\n")

    engine = trainer.run(args.steps, lambda step: data.get("train", step, args.global_batch_size), on_step)
    if engine is not None:  # None: this worker left (a spare at the end)
        engine.close()
    return 0


def write_trace(engine: varuna.Engine, path: Path, info: dict) -> None:
    """Gather every rank's task timeline (a collective) and write it, on rank 0, with a Gantt chart."""
    tl = engine.gather_timeline()
    if tl is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tl.to_chrome_trace(path)
        try:
            tl.plot_gantt(path.with_suffix(".png"), title=f"GPT example, P={info['P']} D={info['D']}")
        except MissingExtra as e:  # the trace is the result; the chart is a convenience
            print(f"wrote {path}; no Gantt chart: {e}", flush=True)
            return
        print(f"wrote {path} and {path.with_suffix('.png')}", flush=True)



def _window_end(args: argparse.Namespace, overlap: bool, step: int) -> int:
    """The last step of the window that starts at ``step``: with ``overlap`` (2bw) up to 8
    mini-batches run back to back without a pipeline flush (``Engine.train_steps``), ending at the
    next evaluation; otherwise one step at a time."""
    if not overlap:
        return step
    last = min(args.steps, step + 7)
    if args.eval_every:
        last = min(last, -(-step // args.eval_every) * args.eval_every)
    return last


def _report(engine, args: argparse.Namespace, data, info: dict, r, out, leader: bool) -> None:
    """Evaluate when due, print the step's line and append its metrics row (leader only)."""
    row = {
        "step": r.step,
        "loss": r.loss,
        "samples_per_s": r.samples_per_s,
        "P": info["P"],
        "D": info["D"],
        "m": info["m"],
        "Nm": sum(info["Nm"]),
        "wall_time": r.wall_time,
        "step_s": r.step_s,
        "grad_norm": r.grad_norm,
        "skipped": r.skipped,
        "tflops": r.tflops,
        "hardware_tflops": r.hardware_tflops,
        "mfu": r.mfu,
    }
    if args.eval_every and (r.step % args.eval_every == 0 or r.step == args.steps):
        row["val_loss"] = engine.evaluate(data.get("val", r.step, args.global_batch_size))
    if leader:
        extra = f" val {row['val_loss']:.4f}" if "val_loss" in row else ""
        perf = f" {r.tflops:.3g} TFLOP/s per device" if r.tflops is not None else ""
        perf += f" MFU {r.mfu:.1%}" if r.mfu is not None else ""
        print(
            f"step {r.step:5d}/{args.steps} loss {r.loss:.4f}{extra} |g| {r.grad_norm:.3f} "
            f"{r.samples_per_s:8.1f} samples/s{perf}",
            flush=True,
        )
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = ByteBatches(args.block_size, seed=args.seed)
    adopt_run_plan(args)
    if os.environ.get("VARUNA_LIVE_STORE"):
        return run_live(args, data)
    engine = build_engine(args, data)
    info = engine.describe()
    leader = engine.layout.rank == 0
    if leader:
        print(
            f"varuna: P={info['P']} D={info['D']} m={info['m']} Nm={info['Nm']} "
            f"stages={info['stage_ranges']} "
            f"schedule={args.schedule} corpus={data.fingerprint}",
            flush=True,
        )
        if engine.step_count:
            print(f"varuna: resumed from the checkpoint of step {engine.step_count}", flush=True)
    out = open(args.metrics_out, "a") if (leader and args.metrics_out) else None
    try:
        overlap = engine.config.schedule == "2bw"
        why_not = no_flush_unsupported(engine.config, info["P"]) if overlap else None
        if why_not is not None:
            overlap = False
            if leader:
                print(f"varuna: 2bw runs one step at a time here: {why_not}", flush=True)
        step = engine.step_count + 1
        while step <= args.steps:
            if args.trace is not None:
                engine.timeline.events.clear()  # keep only the last window's events
            last = _window_end(args, overlap, step)
            batches = [data.get("train", s, args.global_batch_size) for s in range(step, last + 1)]
            results = engine.train_steps(batches) if overlap else [engine.train_step(batches[0])]
            for r in results:
                _report(engine, args, data, info, r, out if leader else None, leader)
            step = last + 1
        if args.trace is not None:
            write_trace(engine, args.trace, info)
    finally:
        if out:
            out.close()
        engine.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        sys.exit(main())
    except ValueError as e:  # bad input: one line naming the problem and the fix
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)
