"""Convergence of PipeDream-2BW (``--schedule 2bw``) against the synchronous schedules on the GPT
example, over the same samples (same data, seed and hyper-parameters): docs/schedules.md.

Each schedule trains ``examples/gpt2/train.py`` under ``varuna-launch`` at P×D (default 2×1)
for ``--steps`` mini-batches; the training loss of every step and the validation loss every
``--eval-every`` steps are plotted against samples seen (needs ``pip install 'varuna[plot]'``).

    python scripts/convergence_2bw.py                         # docs/img/convergence_2bw.png
    python scripts/convergence_2bw.py --steps 60 --schedules 1f1b,2bw --out /tmp/c.png
    python scripts/convergence_2bw.py --plain-reference --steps 120   # the rule without varuna

``--plain-reference`` trains the same model on the same batches in plain PyTorch (one process,
whole mini-batch per step) with the synchronous rule and with the 2BW rule (gradient at W(t-2),
applied to W(t-1), then clipped and stepped as the engine does) and prints the mean training
loss per 20 steps: whether a gap between the schedules comes from the rule or from the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "gpt2" / "train.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", default="varuna,1f1b,2bw", help="comma-separated schedule kinds")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--procs", type=int, default=2, help="processes per run (P×D)")
    p.add_argument("--pipeline-depth", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3, help="the example's default")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=1800, help="per run")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "convergence_2bw.png")
    p.add_argument("--plain-reference", action="store_true", help="only the plain-PyTorch check (no plot)")
    return p.parse_args(argv)


def plain_losses(a: argparse.Namespace, *, stale: bool) -> list[float]:
    """Training losses of the GPT example in plain PyTorch under the synchronous or 2BW rule."""
    import copy

    import torch

    sys.path.insert(0, str(TRAIN.parent))
    from data import ByteBatches
    from model import GPT, GPTConfig

    train_args = _example_defaults()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    cur = GPT(GPTConfig(block_size=train_args.block_size, n_layer=train_args.n_layer,
                        n_head=train_args.n_head, n_embd=train_args.n_embd, dropout=train_args.dropout))
    prev = copy.deepcopy(cur)  # W(t-2) under 2BW
    opt = torch.optim.AdamW(cur.parameters(), lr=a.lr, weight_decay=0.0)
    data = ByteBatches(train_args.block_size, seed=a.seed)
    losses = []
    for t in range(1, a.steps + 1):
        at = prev if stale else cur
        at.zero_grad(set_to_none=True)
        loss = at(*data.get("train", t, a.global_batch_size))
        loss.backward()
        newest = [p.detach().clone() for p in cur.parameters()]
        for pc, pa in zip(cur.parameters(), at.parameters()):
            pc.grad = pa.grad.clone()
        torch.nn.utils.clip_grad_norm_(cur.parameters(), train_args.max_grad_norm)
        opt.step()
        with torch.no_grad():
            for p, w in zip(prev.parameters(), newest):
                p.copy_(w)
        losses.append(float(loss.detach()))
    return losses


def _example_defaults() -> argparse.Namespace:
    sys.path.insert(0, str(TRAIN.parent))
    from train import parse_args as example_args

    return example_args([])


def train(schedule: str, a: argparse.Namespace, work: Path) -> list[dict]:
    """One run of the GPT example; its per-step metrics (rank 0's JSON lines)."""
    metrics = work / f"{schedule}.jsonl"
    cmd = [
        sys.executable, "-m", "varuna.launch.launcher", "--procs", str(a.procs),
        "--pipeline-depth", str(a.pipeline_depth), str(TRAIN),
        "--steps", str(a.steps), "--schedule", schedule, "--seed", str(a.seed),
        "--global-batch-size", str(a.global_batch_size), "--micro-batch-size", str(a.micro_batch_size),
        "--lr", str(a.lr), "--eval-every", str(a.eval_every), "--metrics-out", str(metrics),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{schedule}: exit {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def smooth(xs: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot(runs: dict[str, list[dict]], a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in runs.items():
        style = "--" if name == "2bw" else "-"
        samples = [r["step"] * a.global_batch_size for r in rows]
        ax1.plot(samples, smooth([r["loss"] for r in rows], 10), style, label=name)
        val = [(r["step"] * a.global_batch_size, r["val_loss"]) for r in rows if "val_loss" in r]
        ax2.plot([s for s, _ in val], [v for _, v in val], style + "o", markersize=3, label=name)
    ax1.set(xlabel="samples", ylabel="training loss (mean of 10 steps)", title="training loss")
    ax2.set(xlabel="samples", ylabel="validation loss", title="validation loss")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"GPT example, {a.procs // a.pipeline_depth}x{a.pipeline_depth} (D×P), M={a.global_batch_size}, "
        f"m={a.micro_batch_size}, AdamW lr={a.lr}: 2bw (gradients one step stale) vs synchronous"
    , fontsize=9)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.plain_reference:
        sync, stale = plain_losses(a, stale=False), plain_losses(a, stale=True)
        print("steps      synchronous  2bw rule   (plain PyTorch, mean training loss)")
        for i in range(0, a.steps, 20):
            n = len(sync[i : i + 20])
            print(f"{i + 1:4d}-{i + n:<4d}  {sum(sync[i:i + 20]) / n:11.4f}  {sum(stale[i:i + 20]) / n:8.4f}")
        return 0
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in a.schedules.split(","):
            runs[schedule] = train(schedule, a, Path(tmp))
            last = runs[schedule][-1]
            vals = [r["val_loss"] for r in runs[schedule] if "val_loss" in r]
            print(
                f"{schedule:8s} steps {last['step']}  final train loss {last['loss']:.4f}  "
                f"final val loss {vals[-1] if vals else float('nan'):.4f}",
                flush=True,
            )
    plot(runs, a)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
