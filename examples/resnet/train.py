"""Train the ResNet example with varuna at any P×D: the whole training state in every checkpoint.

varuna-launch --procs 4 --pipeline-depth 2 examples/resnet/train.py --steps 20
python examples/resnet/train.py --steps 20        # one process (P = D = 1)

What it shows (docs/checkpoints.md, "Whole state"): BatchNorm running statistics (buffers) kept
equal on a stage's replicas and saved; an LR schedule (``Engine(lr_scheduler=...)``); a torchdata
``StatefulDataLoader`` over a finite data set, resumed exactly once across a resize through
``StatefulBatches`` (every sample once per epoch, at any new P×D). Cut-points go after the stem and
after every residual block (``VarunaConfig.cut_after``): the model file has none. With
``$VARUNA_LIVE_STORE`` set the steps run through ``LiveTrainer`` (docs/live_morph.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model import ResNet, ResNetConfig  # noqa: E402

import varuna  # noqa: E402
from varuna.runtime.stateful_data import StatefulBatches  # noqa: E402

#: the number of classes the synthetic images are drawn from
CLASSES = 10


class Images(torch.utils.data.Dataset):
    """A finite synthetic data set: sample i is noise around its class's pattern (seeded by i)."""

    def __init__(self, samples: int, image_size: int, seed: int) -> None:
        self.samples, self.size, self.seed = samples, image_size, seed
        g = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(CLASSES, 3, image_size, image_size, generator=g)

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = i % CLASSES
        return self.patterns[label] + 0.5 * torch.randn(3, self.size, self.size, generator=g), label


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="total optimizer steps")
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--samples", type=int, default=256, help="size of the data set (an epoch)")
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--widths", default="16,32,64", help="channels of each stage of blocks")
    p.add_argument("--blocks", type=int, default=2, help="residual blocks per stage")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (warm-up, then cosine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--deterministic", action="store_true",
                   help="bit-identical at any P×D (docs/determinism.md)")
    p.add_argument("--metrics-out", type=Path, help="JSON Lines, one object per step")
    p.add_argument("--checkpoint-dir", help="global checkpoint store (or VARUNA_CHECKPOINT_DIR)")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument("--checkpoint-format", help="varuna (default), hf or dcp (docs/checkpoints.md, Formats)")
    p.add_argument("--resume", nargs="?", const="1", choices=["1", "auto", "0"])
    args = p.parse_args(argv)
    if args.steps < 1 or args.samples < args.global_batch_size:
        p.error("need --steps >= 1 and --samples >= --global-batch-size (one mini-batch per step)")
    return args


def schedule(step: int, total: int) -> float:
    """The learning rate's factor before step ``step + 1``: warm-up, then a cosine decay."""
    warm = max(1, total // 10)
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


def cut_after(cfg: ResNetConfig) -> tuple[str, ...]:
    """A cut-point after the stem and after every residual block: 2 + blocks segments."""
    blocks = [f"stages.{i}.{j}" for i in range(len(cfg.widths)) for j in range(cfg.blocks_per_stage)]
    return ("stem.2", *blocks)


def setup(args: argparse.Namespace):
    """The model factory, the engine's config and arguments, and the data loader."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    cfg = ResNetConfig(num_classes=CLASSES, widths=tuple(int(w) for w in args.widths.split(",")),
                       blocks_per_stage=args.blocks)

    def build_model() -> ResNet:
        torch.manual_seed(args.seed)
        return ResNet(cfg)

    config = varuna.VarunaConfig(
        global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size, seed=args.seed,
        deterministic=args.deterministic, deterministic_threads=args.threads, cut_after=cut_after(cfg),
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, checkpoint_format=args.checkpoint_format, resume=args.resume)
    data = Images(args.samples, args.image_size, args.seed)
    loader = StatefulDataLoader(data, batch_size=args.global_batch_size, shuffle=True, drop_last=True,
                                generator=torch.Generator().manual_seed(args.seed))
    engine_args = {
        "example_batch": next(iter(StatefulDataLoader(data, batch_size=args.global_batch_size))),
        "optimizer": lambda ps: torch.optim.SGD(ps, lr=args.lr, momentum=0.9, weight_decay=5e-4),
        # linear warm-up over the first tenth, then cosine to zero at --steps
        "lr_scheduler": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s, args.steps)),
    }
    return build_model, config, engine_args, StatefulBatches(loader)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    build_model, config, engine_args, data = setup(args)
    if os.environ.get("VARUNA_LIVE_STORE"):
        from varuna.runtime.live_trainer import LiveTrainer

        trainer = LiveTrainer(build_model, dataclasses.replace(config, peer_timeout_s=0), **engine_args)
        trainer.register_state("data", data)
        engine = trainer.run(args.steps, data.batch_for,
                             on_step=lambda r: report(trainer.engine, r, args, None))
        if engine is not None:
            engine.close()
        return 0
    engine = varuna.Engine(build_model(), config, **engine_args)
    engine.register_state("data", data)  # a resumed engine rewinds the loader to its step here
    info = engine.describe()
    if engine.layout.rank == 0:
        resumed = f"; resumed after step {engine.step_count}, epoch {data.epoch}" if engine.step_count else ""
        print(f"varuna: P={info['P']} D={info['D']} m={info['m']} Nm={info['Nm']} "
              f"stages={info['stage_ranges']}{resumed}", flush=True)
    try:
        for step in range(engine.step_count + 1, args.steps + 1):
            lr = engine.optimizer.param_groups[0]["lr"]  # this step's (the schedule steps after it)
            report(engine, engine.train_step(data.batch_for(step)), args, lr)
    finally:
        engine.close()
    return 0


def report(engine, r: varuna.StepResult, args: argparse.Namespace, lr: float | None) -> None:
    """Rank 0 prints the step (``lr``: the learning rate it ran with) and appends its metrics row."""
    if engine is None or engine.layout.rank != 0:
        return
    if lr is None:  # a live run's callback comes after the step: the schedule's last value
        lr = engine.extras.scheduler.scheduler.get_last_lr()[0]
    print(f"step {r.step:5d}/{args.steps} loss {r.loss:.4f} lr {lr:.4f} |g| {r.grad_norm:.3f} "
          f"{r.samples_per_s:8.1f} samples/s", flush=True)
    if args.metrics_out:
        info = engine.describe()
        with open(args.metrics_out, "a") as out:
            out.write(json.dumps({"step": r.step, "loss": r.loss, "samples_per_s": r.samples_per_s,
                                  "P": info["P"], "D": info["D"], "m": info["m"], "Nm": sum(info["Nm"]),
                                  "wall_time": r.wall_time, "step_s": r.step_s, "grad_norm": r.grad_norm,
                                  "skipped": r.skipped, "lr": lr, "pid": os.getpid()}) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        sys.exit(main())
    except ValueError as e:  # bad input: one line naming the problem and the fix
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)
