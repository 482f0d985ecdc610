"""Engine overhead at 1×1 against a plain PyTorch gradient-accumulation loop on the same model.

    python scripts/bench_step.py [--steps 12] [--n-layer 4] [--n-embd 128]

Also times the engine in deterministic mode (canonical reductions; goal <= 1.1x the default).
Both run the GPT example (dropout on) on the same mini-batches with AdamW, one thread, in one
process; runs alternate in rounds so drift of the machine affects both equally. Prints a table;
goal: engine overhead <= 3%.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "gpt2"))

from data import ByteBatches  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

import varuna  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="timed steps per system per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    a = p.parse_args()
    torch.set_num_threads(1)
    M, m = a.global_batch_size, a.micro_batch_size
    cfg = GPTConfig(n_layer=a.n_layer, n_embd=a.n_embd, n_head=4, block_size=64, dropout=0.1)
    data = ByteBatches(cfg.block_size)
    batches = [data.get("train", s, M) for s in range(a.steps + 2)]

    torch.manual_seed(0)
    plain = GPT(cfg)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)

    def plain_step(batch):
        plain_opt.zero_grad(set_to_none=True)
        x, y = batch
        for s in range(0, M, m):
            (plain(x[s : s + m], y[s : s + m]) * (min(s + m, M) - s) / M).backward()
        plain_opt.step()

    torch.manual_seed(0)
    engine = varuna.Engine(
        GPT(cfg),
        varuna.VarunaConfig(global_batch_size=M, micro_batch_size=m),
        example_batch=batches[0],
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    )
    torch.manual_seed(0)
    det = varuna.Engine(
        GPT(cfg),
        varuna.VarunaConfig(global_batch_size=M, micro_batch_size=m,
                            determinism=varuna.DeterminismConfig(enabled=True)),
        example_batch=batches[0],
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    )
    torch.use_deterministic_algorithms(False)  # only the deterministic engine's steps need it

    def timed(fn) -> list[float]:
        fn(batches[0])  # warm-up
        out = []
        for b in batches[1 : a.steps + 1]:
            t = time.perf_counter()
            fn(b)
            out.append(time.perf_counter() - t)
        return out

    def det_step(batch):
        torch.use_deterministic_algorithms(True)
        try:
            det.train_step(batch)
        finally:
            torch.use_deterministic_algorithms(False)

    times = {"plain PyTorch loop": [], "varuna engine 1x1": [], "varuna deterministic": []}
    for _ in range(a.rounds):
        times["plain PyTorch loop"] += timed(plain_step)
        times["varuna engine 1x1"] += timed(engine.train_step)
        times["varuna deterministic"] += timed(det_step)
    engine.close()
    det.close()
    base = statistics.median(times["plain PyTorch loop"])
    print(f"GPT n_layer={a.n_layer} n_embd={a.n_embd} M={M} m={m}, {a.rounds}x{a.steps} steps each, 1 thread")
    print(f"{'system':<22}{'median step (s)':>16}{'samples/s':>12}{'overhead':>10}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<22}{med:>16.4f}{M / med:>12.1f}{(med / base - 1) * 100:>9.1f}%")
    ov = statistics.median(times["varuna engine 1x1"]) / base - 1
    print(f"goal: overhead <= 3% -> {'met' if ov <= 0.03 else 'MISSED'} ({ov * 100:.1f}%)")
    dr = statistics.median(times["varuna deterministic"]) / statistics.median(times["varuna engine 1x1"])
    print(f"goal: deterministic <= 1.1x default -> {'met' if dr <= 1.1 else 'MISSED'} ({dr:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
