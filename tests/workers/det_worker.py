"""Worker: train the tiny GPT (dropout on, AdamW, clipping) for N steps; dump per-step losses and the
sha256 of every parameter this rank holds."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from models import build_model  # noqa: E402

import varuna  # noqa: E402
from varuna.testing.negative_controls import with_negative_controls  # noqa: E402


def batch_for(step: int, size: int, salt: int = 0):
    g = torch.Generator().manual_seed(1000 * step + salt)
    idx = torch.randint(0, 256, (size, 17), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch-size", type=int, default=12)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--no-canonical", action="store_true")
    p.add_argument("--unkeyed-rng", action="store_true")
    p.add_argument("--unkeyed-data", action="store_true")
    p.add_argument("--no-deterministic", action="store_true")
    p.add_argument("--schedule", default="varuna")
    p.add_argument("--replica-shares", default=None, help="micro-batches per replica, e.g. 5,1")
    p.add_argument("--shard", action="store_true", help="optimizer state sharded over the replicas")
    p.add_argument("--offload", action="store_true", help="optimizer state in a host buffer")
    p.add_argument("--grad-reduce", default="auto")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--loss-scale", type=float, default=2.0**16)
    p.add_argument("--recompute-segments", default=None, help="selective recompute, e.g. 1,3 ('none': empty)")
    a = p.parse_args()
    shares = tuple(int(x) for x in a.replica_shares.split(",")) if a.replica_shares else None
    segments = None if a.recompute_segments is None else tuple(
        int(x) for x in a.recompute_segments.split(",") if x not in ("", "none"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    model = build_model("gpt", dropout=0.1)
    M = a.global_batch_size
    engine = varuna.Engine(
        model,
        with_negative_controls(
            varuna.VarunaConfig(global_batch_size=M, micro_batch_size=a.micro_batch_size, seed=3,
                                schedule=a.schedule, max_grad_norm=1.0, precision=a.precision,
                                numerics=varuna.NumericsConfig(loss_scale=a.loss_scale),
                                determinism=varuna.DeterminismConfig(enabled=not a.no_deterministic),
                                pipeline=varuna.PipelineConfig(replica_shares=shares,
                                                               recompute_segments=segments),
                                optimizer_state=varuna.OptimizerStateConfig(
                                    shard=a.shard, offload=a.offload, grad_reduce=a.grad_reduce)),
            canonical_reduction=not a.no_canonical, rng_keyed=not a.unkeyed_rng,
        ),
        example_batch=batch_for(0, M),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    )
    losses, skipped = [], []
    for step in range(1, a.steps + 1):
        # Negative control for data keying: each replica reads data seeded by its own index.
        salt = engine.replica if a.unkeyed_data else 0
        result = engine.train_step(batch_for(step, M, salt))
        losses.append(result.loss)
        skipped.append(result.skipped)
    digests = {n: hashlib.sha256(q.detach().contiguous().numpy().tobytes()).hexdigest()
               for n, q in engine.named_parameters()}
    a.out.mkdir(parents=True, exist_ok=True)
    opt_elems = sum(v.numel() for st in engine.optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
    report = {"losses": losses, "digests": digests, "Nm": [len(p) for p in engine.micro_plan],
              "opt_elems": opt_elems, "skipped": skipped,
              "stage_elems": sum(q.numel() for _, q in engine.named_parameters()),
              "stage_ranges": engine.stage_ranges}
    (a.out / f"rank{engine.layout.rank}.json").write_text(json.dumps(report))
    engine.close()


if __name__ == "__main__":
    main()
