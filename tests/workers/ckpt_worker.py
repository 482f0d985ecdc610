"""Worker: train the tiny GPT (AdamW, dropout on) under the engine, saving and resuming checkpoints.

Batches are a pure function of the step number, so a resumed run sees what an uninterrupted one
would. Dumps, per rank, the (step, loss) pairs it ran and its final parameters.

Fault injection (``--kill-event E --kill-count N --kill-rank R --kill-at S``): rank R kills
itself with SIGKILL at the N-th ``E`` progress event of the save at step S (see
``varuna.runtime.checkpoint.Checkpointer.progress_hook``) — a ``kill -9`` at a precise point of a save.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "gpt2"))
sys.path.insert(0, str(ROOT / "tests"))

from models import build_model  # noqa: E402

import varuna  # noqa: E402

GLOBAL_BATCH, MICRO_BATCH = 8, 2


def batch_for(step: int, size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 256, (size, 17), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def killer(event: str, count: int):
    """A progress hook that SIGKILLs this process at the ``count``-th ``event``."""
    seen = {"n": 0}

    def hook(e: str) -> None:
        if e == event:
            seen["n"] += 1
            if seen["n"] == count:
                os.kill(os.getpid(), signal.SIGKILL)

    return hook


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--pipeline-depth", type=int, default=1)
    p.add_argument("--steps", type=int, required=True, help="total steps (a resumed run continues)")
    p.add_argument("--save-at", default="", help="comma-separated steps after which to save (wait=True)")
    p.add_argument("--every", type=int, default=0)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--resume", default="0")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--kill-event", default="")
    p.add_argument("--kill-count", type=int, default=1)
    p.add_argument("--chunk-bytes", type=int, default=0)
    p.add_argument("--eps", type=float, default=1e-6, help="AdamW eps")
    p.add_argument("--deterministic", action="store_true", help="docs/determinism.md")
    p.add_argument("--schedule", default="varuna")
    p.add_argument("--chunks", type=int, default=1, help="model chunks per process (interleaved kinds)")
    p.add_argument("--shard", action="store_true", help="optimizer state sharded over the replicas")
    a = p.parse_args()
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    engine = varuna.Engine(
        build_model("gpt", dropout=0.1),
        varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                            pipeline_depth=a.pipeline_depth, seed=7, schedule=a.schedule,
                            timeouts=varuna.TimeoutConfig(comm_s=a.timeout),
                            checkpoints=varuna.CheckpointConfig(dir=str(a.ckpt_dir), every=a.every,
                                                                keep=a.keep, resume=a.resume),
                            determinism=varuna.DeterminismConfig(enabled=a.deterministic),
                            pipeline=varuna.PipelineConfig(chunks=a.chunks),
                            optimizer_state=varuna.OptimizerStateConfig(shard=a.shard)),
        example_batch=batch_for(1),
        # eps=1e-6, not 1e-8: attention's key bias has a mathematically zero gradient (softmax is
        # shift-invariant), so its gradient is rounding noise (~1e-10) that differs with the
        # summation order of each P×D; with eps=1e-8 Adam turns that noise into ~lr/100 steps and
        # even two *uninterrupted* runs at 2×2 and 4×1 differ by ~3e-4 — a layout effect, not a
        # checkpoint one. 1e-6 keeps such noise below 1e-5 so layouts can be compared.
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=a.eps),
    )
    rank = engine.layout.rank
    ckpt = engine.checkpointer
    if a.chunk_bytes:
        ckpt.copy_chunk_bytes = a.chunk_bytes
    save_at = {int(s) for s in a.save_at.split(",") if s}
    first_step = engine.step_count + 1
    a.out.mkdir(parents=True, exist_ok=True)
    losses = []
    for step in range(first_step, a.steps + 1):
        if step == a.kill_at and rank == a.kill_rank:
            ckpt.progress_hook = killer(a.kill_event, a.kill_count)
        r = engine.train_step(batch_for(step))
        losses.append([r.step, r.loss])
        if step in save_at:
            # What a resume must reproduce: this rank's parameters right after the step.
            torch.save({n: q.detach().clone() for n, q in engine.named_parameters()},
                       a.out / f"step{step}-rank{rank}.pt")
            engine.save_checkpoint(wait=True)
    ckpt.wait()
    torch.save({n: q.detach().clone() for n, q in engine.named_parameters()}, a.out / f"rank{rank}.pt")
    (a.out / f"rank{rank}.json").write_text(json.dumps({
        "first_step": first_step, "losses": losses, "stage": engine.stage, "replica": engine.replica,
        "P": engine.layout.P, "D": engine.layout.D, "last_ok": ckpt.last_ok, "chunks": engine.chunks,
    }))
    engine.close()


if __name__ == "__main__":
    main()
