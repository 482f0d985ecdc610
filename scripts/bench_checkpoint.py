"""Step time of the GPT example with a checkpoint after every step vs without (goal: <= 1.2x).

For each layout, one ``varuna-launch`` job trains the example (``examples/gpt2``: same model,
data, AdamW and clipping as ``train.py``) in alternating blocks of steps: a block without
checkpoints, then a block with a checkpoint after every step (``engine.save_checkpoint()``, what
``--checkpoint-every 1`` does), and so on. Comparing adjacent blocks of one job keeps the
comparison fair on a shared machine whose load drifts (separate runs for "with" and "without"
were dominated by other processes' load). A step's time is rank 0's wall time from the start of
``train_step`` to the end of the save call; the first step of each block (which may still overlap
the previous block's background copy) and the warm-up steps are left out. The table also gives
the CPU time per step summed over all ranks (all threads, the background copy included): on a
CPU-bound host shared with other jobs it is the steadier measure of what checkpointing costs.

    python scripts/bench_checkpoint.py                       # 1x1, 2x1, 2x2; the example's default model
    python scripts/bench_checkpoint.py --layouts 2x2 --blocks 8 --json-out runs/bench_ckpt.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gpt2"


def parse_layout(text: str) -> tuple[int, int]:
    """``"2x2"`` -> (P, D).

    >>> parse_layout("4x1")
    (4, 1)
    """
    try:
        P, D = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad layout {text!r}; write PxD, e.g. 2x2") from None
    if P < 1 or D < 1:
        raise argparse.ArgumentTypeError(f"bad layout {text!r}: P and D must be >= 1")
    return P, D


def worker(a: argparse.Namespace) -> int:
    """One rank of the benchmark job (run under varuna-launch)."""
    import torch

    sys.path.insert(0, str(EXAMPLE))
    from data import ByteBatches
    from model import GPT, GPTConfig

    import varuna

    torch.set_num_threads(1)
    data = ByteBatches(64, seed=0)
    torch.manual_seed(0)
    engine = varuna.Engine(
        GPT(GPTConfig()),  # the example's defaults: 4 layers, n_embd 128, block 64
        varuna.VarunaConfig(global_batch_size=32, micro_batch_size=4, max_grad_norm=1.0,
                            checkpoints=varuna.CheckpointConfig(dir=str(a.ckpt_dir), keep=2, resume="0")),
        example_batch=data.get("train", 0, 32),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0),
    )
    rows = []
    step = 0
    for block in range(-1, 2 * a.blocks):  # block -1: warm-up
        saving = block % 2 == 1
        for i in range(a.block):
            step += 1
            t0, c0 = time.perf_counter(), time.process_time()
            engine.train_step(data.get("train", step, 32))
            if saving:
                engine.save_checkpoint()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if block >= 0 and i > 0:
                rows.append({"step": step, "saving": saving, "step_s": dt, "cpu_s": dc,
                             "stall_s": engine.checkpointer.last_stall_s if saving else 0.0})
    engine.checkpointer.wait()
    a.out.with_name(f"{a.out.stem}-rank{engine.layout.rank}.json").write_text(
        json.dumps({"rows": rows, "last_ok": engine.checkpointer.last_ok}))
    engine.close()
    return 0


def run_layout(P: int, D: int, a: argparse.Namespace, work: Path) -> dict:
    out, ckpt = work / f"{P}x{D}.json", work / f"ckpt-{P}x{D}"
    cmd = [sys.executable, "-m", "varuna.launch", "--procs", str(P * D), "--pipeline-depth", str(P),
           str(Path(__file__).resolve()), "--_worker", "--out", str(out), "--ckpt-dir", str(ckpt),
           "--block", str(a.block), "--blocks", str(a.blocks)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if res.returncode != 0:
        tail = (res.stdout + res.stderr)[-3000:]
        raise SystemExit(f"bench_checkpoint: the {P}x{D} job failed:\n{tail}")
    from varuna.runtime.checkpoint import list_checkpoints, read_manifest, verify_checkpoint

    recs = [json.loads(out.with_name(f"{out.stem}-rank{r}.json").read_text()) for r in range(P * D)]
    done = [c for c in list_checkpoints(ckpt) if c.complete]
    if not recs[0]["last_ok"] or not done or verify_checkpoint(done[-1].path):
        raise SystemExit(f"bench_checkpoint: the {P}x{D} job's last checkpoint is not complete and sound")
    rows = recs[0]["rows"]
    cpu = [sum(rec["rows"][i]["cpu_s"] for rec in recs) for i in range(len(rows))]  # all ranks
    base = [i for i, r in enumerate(rows) if not r["saving"]]
    save = [i for i, r in enumerate(rows) if r["saving"]]
    row = {"P": P, "D": D, "samples": len(base),
           "base_step_s": statistics.median(rows[i]["step_s"] for i in base),
           "ckpt_step_s": statistics.median(rows[i]["step_s"] for i in save),
           "base_cpu_s": statistics.median(cpu[i] for i in base),
           "ckpt_cpu_s": statistics.median(cpu[i] for i in save),
           "stall_s": statistics.median(rows[i]["stall_s"] for i in save),
           "ckpt_bytes": sum(f["bytes"] for f in read_manifest(done[-1].path)["files"])}
    row["ratio"] = row["ckpt_step_s"] / row["base_step_s"]
    row["cpu_ratio"] = row["ckpt_cpu_s"] / row["base_cpu_s"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="1x1,2x1,2x2", help="comma-separated PxD")
    p.add_argument("--block", type=int, default=4, help="steps per block")
    p.add_argument("--blocks", type=int, default=6, help="pairs of blocks (without, with checkpoints)")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.block < 2 or a.blocks < 1:
        p.error("--block must be >= 2 and --blocks >= 1")
    if a._worker:
        return worker(a)
    layouts = [parse_layout(x) for x in a.layouts.split(",") if x]
    results = []
    with tempfile.TemporaryDirectory(prefix="varuna-bench-ckpt-") as tmp:
        for P, D in layouts:
            results.append(run_layout(P, D, a, Path(tmp)))
            r = results[-1]
            print(f"  {P}x{D}: {r['base_step_s'] * 1e3:.1f} ms -> {r['ckpt_step_s'] * 1e3:.1f} ms",
                  file=sys.stderr, flush=True)
    print("| P×D | step wall, no checkpoint (ms) | step wall, checkpoint every step (ms) | wall ratio | "
          "CPU/step, all ranks: without → with (ms) | CPU ratio | stall per save (ms) | checkpoint (MB) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['P']}×{r['D']} | {r['base_step_s'] * 1e3:.1f} | {r['ckpt_step_s'] * 1e3:.1f} | "
              f"{r['ratio']:.2f}× | {r['base_cpu_s'] * 1e3:.0f} → {r['ckpt_cpu_s'] * 1e3:.0f} | "
              f"{r['cpu_ratio']:.2f}× | {r['stall_s'] * 1e3:.1f} | {r['ckpt_bytes'] / 1e6:.2f} |")
    print(f"(medians of {results[0]['samples']} steps each way, alternating blocks of {a.block} steps; "
          f"goal <= 1.20×; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps({"layouts": results, "block": a.block, "blocks": a.blocks},
                                         indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
