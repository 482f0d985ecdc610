"""Worker: one train_step of the tiny GPT under the engine; dumps loss, gradients and task order.

Parameters are left unchanged by the step (SGD with lr=0) so the dumped ``.grad``\\ s are the
mini-batch gradients (after the engine's clipping, if asked for).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "gpt2"))
sys.path.insert(0, str(ROOT / "tests"))

from models import build_model, make_batch  # noqa: E402

import varuna  # noqa: E402
from varuna.cutting.split import resident_param_bytes  # noqa: E402


def main() -> None:
    try:
        run()
    except ValueError as e:  # bad input: one line, like the example's CLI
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def run() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="gpt")
    p.add_argument("--schedules", default="varuna,gpipe,1f1b")
    p.add_argument("--no-recompute", action="store_true")
    p.add_argument("--global-batch-size", type=int, default=10)
    p.add_argument("--micro-batch-size", type=int, default=3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--plant-inf-stage", type=int, default=-1)
    p.add_argument("--meta", action="store_true")
    p.add_argument("--netem")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.0)
    a = p.parse_args()
    torch.set_num_threads(1)

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")  # one group for all engines built below
    base = build_model(a.model, dropout=a.dropout, meta=a.meta)
    batch = make_batch(a.model, a.global_batch_size)
    if a.netem:
        os.environ["VARUNA_NETEM"] = a.netem  # the engine honours it
    try:
        for kind in a.schedules.split(","):
            model = copy.deepcopy(base)
            engine = varuna.Engine(
                model,
                varuna.VarunaConfig(
                    global_batch_size=a.global_batch_size,
                    micro_batch_size=a.micro_batch_size,
                    schedule=kind,
                    pipeline=varuna.PipelineConfig(recompute=not a.no_recompute),
                    seed=7,
                    max_grad_norm=a.max_grad_norm,
                    precision=a.precision,
                ),
                example_batch=batch,
                optimizer=lambda ps: torch.optim.SGD(ps, lr=a.lr),
            )
            if a.plant_inf_stage == engine.stage:
                # A non-finite gradient on one stage must make every rank skip the step.
                first = next(iter(engine.parameters()))
                first.register_hook(lambda g: torch.full_like(g, float("inf")))
            before = {n: q.detach().clone() for n, q in engine.named_parameters()}
            results = [engine.train_step(batch) for _ in range(a.steps)]
            if a.plant_inf_stage >= 0 and a.precision == "fp16":
                assert results[-1].skipped
            r = results[-1]
            out = a.out / kind
            out.mkdir(parents=True, exist_ok=True)
            rank = engine.layout.rank
            torch.save(
                {
                    "grads": {
                        n: q.grad.detach().clone() for n, q in engine.named_parameters() if q.grad is not None
                    },
                    "params": {n: q.detach().clone() for n, q in engine.named_parameters()},
                    "before": before,
                    "resident_bytes": resident_param_bytes(model),
                },
                out / f"rank{rank}.pt",
            )
            (out / f"rank{rank}.json").write_text(
                json.dumps(
                    {
                        "loss": r.loss,
                        "losses": [x.loss for x in results],
                        "skipped": r.skipped,
                        "grad_norm": r.grad_norm,
                        "loss_scale": r.loss_scale,
                        "stage": engine.stage,
                        "replica": engine.replica,
                        "stage_ranges": engine.stage_ranges,
                        "executed": [[str(t) for t in o] for o in engine.executed_orders],
                        "static": [
                            str(t)
                            for t in varuna.core.schedule.get_schedule(
                                kind,
                                engine.num_stages,
                                len(engine.micro_plan[engine.replica]),
                                not a.no_recompute,
                            ).stages[engine.stage]
                        ],
                    }
                )
            )
            engine.close()
    finally:
        pass


if __name__ == "__main__":
    main()
