"""Worker: a 2bw no-flush window (``Engine.train_steps``, 4 steps) of the tiny GPT at P=2, whose
embedding is tied to the LM head (a copy on each stage), in which stage 0 alone sees a non-finite
gradient: a private parameter's, at step ``--bad-step``. Dumps each rank's tied weight and the
steps reported skipped to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from two_bw_worker import batch_of, build_model, make_batch, make_engine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--bad-step", type=int, default=2)
    a = p.parse_args()
    a.global_batch_size, a.micro_batch_size, a.lr, a.deterministic = 8, 2, 0.1, False
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    base = build_model("gpt", dropout=0.1)
    batches = make_batch("gpt", 4 * a.global_batch_size)
    engine = make_engine(base, a, batches, schedule="2bw", resume="0", ckpt="ckpt_unused")
    shared = set(engine.describe()["shared_params"])
    assert shared, "the tiny GPT ties its embedding to the LM head"
    nm = len(engine.micro_plan[engine.replica])
    if engine.stage == 0:  # one private parameter's gradient goes non-finite at step --bad-step
        name, param = next((n, q) for n, q in engine.named_parameters() if n not in shared)
        calls = [0]

        def poison(grad: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return torch.full_like(grad, float("inf")) if (calls[0] - 1) // nm == a.bad_step - 1 else grad

        param.register_hook(poison)
    results = engine.train_steps([batch_of(batches, t, a.global_batch_size) for t in range(1, 5)])
    tied = {n: q.detach().clone() for n, q in engine.named_parameters() if n in shared}
    a.out.mkdir(parents=True, exist_ok=True)
    torch.save({"tied": tied, "skipped": [r.step for r in results if r.skipped]},
               a.out / f"rank{engine.layout.rank}.pt")
    engine.close()


if __name__ == "__main__":
    main()
