"""Worker for the whole-state tests (tests/test_whole_state.py): a small ResNet with BatchNorm
(examples/resnet/model.py) trained under the engine, with an LR scheduler (OneCycleLR, which also
moves SGD's momentum) and, with ``--data loader``, a torchdata ``StatefulDataLoader`` over a finite
data set through ``StatefulBatches``; otherwise each step's batch is a pure function of the step.

Dumps per rank (``rank<R>.json``/``.pt``; live runs: ``member<M>``): every step it ran with its
loss, learning rate, momentum and (``--data loader``) the sample indices of its mini-batch, and at
the end the stage's parameters and buffers. ``--kill-after S --kill-rank R``: rank R SIGKILLs
itself right after step S. ``--live``: the steps run through ``LiveTrainer`` (a store hosted by
the test), ``--die M:S`` kills member M after step S there. ``--old-buffers``: the engine as it
was before buffers were state (no buffer kept, saved or synchronised; BatchNorm updates itself):
the tests' negative control.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]


def _resnet_module():
    """examples/resnet/model.py under its own module name: tests import the GPT example as
    ``model`` (examples/gpt2 on sys.path), so this one must not take that name."""
    path = ROOT / "examples" / "resnet" / "model.py"
    spec = importlib.util.spec_from_file_location("varuna_resnet_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_resnet = sys.modules.get("varuna_resnet_example") or _resnet_module()
ResNet, ResNetConfig = _resnet.ResNet, _resnet.ResNetConfig

import varuna  # noqa: E402
from varuna.cutting.split import persistent_buffers  # noqa: E402
from varuna.runtime.stateful_data import StatefulBatches  # noqa: E402

GLOBAL_BATCH, MICRO_BATCH, IMAGE, SAMPLES = 8, 2, 8, 48
CUTS = ("net.stem.2", "net.stages.0.0", "net.stages.1.0")


class Images(torch.utils.data.Dataset):
    """A finite data set: sample i is an image drawn from a generator seeded with i, label i % 10."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(10_000 + i)
        return torch.randn(3, IMAGE, IMAGE, generator=g), i % 10, i


class Indexed(nn.Module):
    """The ResNet, taking (images, labels, sample indices): the indices ride in the batch only to be
    recorded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net = ResNet(ResNetConfig(widths=(8, 16), blocks_per_stage=1))

    def forward(self, images, labels, index):
        return self.net(images, labels)


def step_batch(step: int):
    idx = torch.tensor([(step * GLOBAL_BATCH + j) % SAMPLES for j in range(GLOBAL_BATCH)])
    items = [Images()[int(i)] for i in idx]
    return torch.stack([x for x, _, _ in items]), torch.tensor([y for _, y, _ in items]), idx


def make_loader():
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(Images(), batch_size=GLOBAL_BATCH, shuffle=True, drop_last=True,
                              generator=torch.Generator().manual_seed(11))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True, help="total steps (a resumed run continues)")
    p.add_argument("--total-steps", type=int, default=0, help="the LR schedule's length (default --steps)")
    p.add_argument("--pipeline-depth", type=int, default=1)
    p.add_argument("--save-at", default="", help="comma-separated steps after which to save (wait=True)")
    p.add_argument("--every", type=int, default=0)
    p.add_argument("--resume", default="0")
    p.add_argument("--kill-after", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--data", choices=["step", "loader"], default="step")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--old-buffers", action="store_true")
    p.add_argument("--format", default=None)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--live", action="store_true")
    p.add_argument("--die", default="")
    return p.parse_args()


def config(a: argparse.Namespace) -> varuna.VarunaConfig:
    return varuna.VarunaConfig(
        global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=5, comm_timeout_s=a.timeout,
        pipeline_depth=None if a.live else a.pipeline_depth, cut_after=CUTS, deterministic=a.deterministic,
        checkpoint_dir=str(a.ckpt_dir), checkpoint_every=a.every, resume=False if a.live else a.resume,
        checkpoint_format=a.format, peer_timeout_s=0 if a.live else 10.0)


def engine_args(a: argparse.Namespace) -> dict:
    total = a.total_steps or a.steps
    return {
        "example_batch": step_batch(1),
        "optimizer": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        "lr_scheduler": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1,
                                                                        total_steps=total + 1),
    }


def record(engine, batch, step: int) -> dict:
    g = engine.optimizer.param_groups[0]
    return {"step": step, "lr": g["lr"], "momentum": g["momentum"], "index": batch[2].tolist()}


def dump(engine, out: Path, name: str, rows: list, extra: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if engine is not None:
        # The stage's buffers read from the model itself (with --old-buffers the engine keeps none):
        # those of the BatchNorm modules whose weights the stage holds.
        buffers = {n: b for n, b in persistent_buffers(engine.model).items()
                   if f"{n.rpartition('.')[0]}.weight" in engine.stage_params}
        tensors = {n: t.detach().clone() for n, t in {**engine.stage_params, **buffers}.items()}
        torch.save(tensors, out / f"{name}.pt")
        extra = {**extra, "P": engine.layout.P, "D": engine.layout.D, "stage": engine.stage,
                 "buffers": sorted(engine.state_dict()["buffers"])}
    (out / f"{name}.json").write_text(json.dumps({"pid": os.getpid(), "rows": rows, **extra}))


def old_buffers() -> None:
    """The engine before issue 29 (negative control): no buffer kept, saved or synchronised (the
    dry run records none), BatchNorm updates itself, the dry runs move the statistics."""
    import contextlib

    import varuna.cutting.split as split
    import varuna.runtime.engine as engine_module

    split._buffer_segments = lambda *args: {}
    engine_module.preserved_buffers = lambda model: contextlib.nullcontext()


def run_plain(a: argparse.Namespace) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    engine = varuna.Engine(Indexed(), config(a), **engine_args(a))
    data = StatefulBatches(make_loader()) if a.data == "loader" else None
    if data is not None:
        engine.register_state("data", data)
    rank, rows = engine.layout.rank, []
    save_at = {int(s) for s in a.save_at.split(",") if s}
    for step in range(engine.step_count + 1, a.steps + 1):
        batch = data.batch_for(step) if data is not None else step_batch(step)
        row = record(engine, batch, step)
        row["loss"] = engine.train_step(batch).loss
        rows.append(row)
        if step == a.kill_after and rank == a.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        if step in save_at:
            engine.save_checkpoint(wait=True)
    engine.checkpointer.wait()
    dump(engine, a.out, f"rank{rank}", rows, {"resumed": engine.checkpointer.resumed is not None})
    engine.close()


def run_live(a: argparse.Namespace) -> None:
    from varuna.runtime.live_morph import LiveWorld
    from varuna.runtime.live_trainer import LiveTrainer

    member = int(os.environ["RANK"])
    die = {int(x): int(y) for x, y in (p.split(":") for p in a.die.split(",") if p)}
    trainer = LiveTrainer(Indexed, config(a), live=LiveWorld.join(timeout_s=a.timeout), wait_s=120.0,
                          **engine_args(a))
    data = StatefulBatches(make_loader()) if a.data == "loader" else None
    if data is not None:
        trainer.register_state("data", data)
    rows: list = []

    def batch_for(step: int):
        batch = data.batch_for(step) if data is not None else step_batch(step)
        rows.append(record(trainer.engine, batch, step))
        return batch

    def on_step(r) -> None:
        rows[-1]["loss"] = r.loss
        if die.get(member) == r.step:
            os.kill(os.getpid(), signal.SIGKILL)

    engine = trainer.run(a.steps, batch_for, on_step=on_step)
    dump(engine, a.out, f"member{member}", [r for r in rows if "loss" in r],
         {"morphs": len(trainer.morphs), "failed_steps": trainer.failed_steps, "opened": []})
    if engine is not None:
        engine.close()


def main() -> None:
    a = parse()
    torch.set_num_threads(1)
    if a.old_buffers:
        old_buffers()
    (run_live if a.live else run_plain)(a)


if __name__ == "__main__":
    main()
