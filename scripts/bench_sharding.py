"""Sharded optimizer state (issue #32): per-rank peak memory and step time with and without it.

The GPT example (``examples/gpt2/model.py``, a CutPoint after every block, tied embeddings,
AdamW) is built on ``meta`` and trained at each layout of ``--layouts`` (default 2×2 and 2×4),
once with the optimizer state whole on every replica and once sharded over the D replicas of
each stage (``optimizer_state.shard``), ``--repeats`` times alternating. Per rank it reports:

* the optimizer state it holds, counted (bytes of its tensors);
* its peak RSS above its baseline (``VmHWM`` reset once torch and gloo are up, as in
  ``scripts/bench_too_big.py``), and the *optimizer part* read from RSS: the unsharded run's
  counted state minus what sharding saved (unsharded peak − sharded peak). The goal is that
  part = the unsharded state / D within 10 %;
* the step time: the median over the timed steps (each between two barriers, so it is the whole
  mini-batch on every rank), the first ``--warmup`` steps dropped; goal at D = 2: sharded ≤ 1.05×.

Every process runs one intra-op thread; ``uptime``'s load is printed with the numbers (the machine
is shared: rerun on a quiet one for final figures).

    python scripts/bench_sharding.py                                  # ~6 min here
    python scripts/bench_sharding.py --layouts 2x2 --repeats 3 --json-out runs/sharding.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "scripts", ROOT / "examples" / "gpt2"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

MB = 1 << 20


@dataclass(kw_only=True)
class Setup:
    n_layer: int = 8
    n_embd: int = 640
    n_head: int = 8
    block_size: int = 64
    global_batch_size: int = 16
    micro_batch_size: int = 2
    steps: int = 8
    warmup: int = 2
    timeout_s: float = 900.0


def load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


# ---------------------------------------------------------------------------------------------
# Worker


def _batch(step: int, s: Setup):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 256, (s.global_batch_size, s.block_size + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def worker(a: argparse.Namespace) -> int:
    import bench_too_big as tb

    tb._tune_malloc()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    s = Setup(**json.loads(a.setup))
    rank = int(os.environ.get("RANK", "0"))
    tb._warm_up(splits=a.pipeline_depth > 1)
    dist.init_process_group("gloo")
    from model import GPT, GPTConfig

    import varuna

    tb._reset_peak_rss()
    base = tb.proc_status()
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, block_size=s.block_size, n_layer=s.n_layer, n_head=s.n_head,
                              n_embd=s.n_embd, dropout=0.1))
    engine = varuna.Engine(
        model,
        varuna.VarunaConfig(global_batch_size=s.global_batch_size, micro_batch_size=s.micro_batch_size,
                            pipeline_depth=a.pipeline_depth, seed=0, stop_signals=(), max_grad_norm=1.0,
                            optimizer_state=varuna.OptimizerStateConfig(shard=a.shard)),
        example_batch=_batch(0, s),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
    )
    times = []
    for step in range(1, s.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_step(_batch(step, s))
        dist.barrier()
        times.append(time.perf_counter() - t0)
    opt_bytes = sum(v.numel() * v.element_size() for st in engine.optimizer.state.values()
                    for v in st.values() if isinstance(v, torch.Tensor))
    report = {
        "rank": rank, "stage": engine.stage, "replica": engine.replica, "P": engine.layout.P,
        "D": engine.layout.D, "shard": a.shard,
        "params": sum(p.numel() for p in engine.parameters()),
        "opt_bytes": opt_bytes,
        "peak_rss": tb.proc_status()["VmHWM"] - base["VmRSS"],
        "step_s": times[s.warmup :],
    }
    (Path(a.out) / f"rank{rank}.json").write_text(json.dumps(report))
    engine.close()
    return 0


# ---------------------------------------------------------------------------------------------
# Orchestration


def run_layout(s: Setup, work: Path, P: int, D: int, shard: bool, rep: int) -> list[dict]:
    from varuna.testing.emulated import run_local_world

    out = work / f"{P}x{D}-{'shard' if shard else 'whole'}-{rep}"
    out.mkdir(parents=True, exist_ok=True)
    args = ["--worker", "--setup", json.dumps(asdict(s)), "--out", str(out), "--pipeline-depth", str(P)]
    if shard:
        args.append("--shard")
    return run_local_world(__file__, args, P * D, out, s.timeout_s, what=f"{P}x{D} shard={shard}")


def measure(s: Setup, layouts: list[tuple[int, int]], repeats: int, work: Path) -> dict:
    runs: dict = {}
    for P, D in layouts:
        for rep in range(repeats):
            for shard in (False, True):  # alternating: drift in the machine's load hits both
                t = time.perf_counter()
                ranks = run_layout(s, work, P, D, shard, rep)
                runs.setdefault(f"{P}x{D}", {}).setdefault(str(shard), []).append(ranks)
                print(f"  {P}x{D} shard={shard} repeat {rep + 1}: {time.perf_counter() - t:.0f} s ({load()})",
                      flush=True)
    return runs


def summarize(runs: dict) -> dict:
    """Per layout: per rank (min over repeats) peak RSS and counted optimizer bytes, and the
    median step time over every repeat's timed steps (rank 0: the barriers make it global)."""
    out = {}
    for layout, by_shard in runs.items():
        row: dict = {}
        for shard, reps in by_shard.items():
            world = len(reps[0])
            row[shard] = {
                "ranks": [
                    {**reps[0][r], "peak_rss": min(rep[r]["peak_rss"] for rep in reps)} for r in range(world)
                ],
                "step_s": statistics.median(t for rep in reps for t in rep[0]["step_s"]),
                "step_s_per_repeat": [statistics.median(rep[0]["step_s"]) for rep in reps],
            }
        out[layout] = row
    return out


def print_tables(summary: dict) -> None:
    print("\nPer-rank memory (MiB; peak RSS above the baseline, the smaller of the repeats):\n")
    print("| layout | rank | stage | params (M) | optimizer, whole (counted) | optimizer, sharded (counted) "
          "| peak RSS whole | peak RSS sharded | saved | optimizer part, sharded (from RSS) | whole / D "
          "| part ÷ (whole / D) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layout, row in summary.items():
        whole, shard = row["False"]["ranks"], row["True"]["ranks"]
        for w, sh in zip(whole, shard):
            D = w["D"]
            saved = w["peak_rss"] - sh["peak_rss"]
            part = w["opt_bytes"] - saved
            ideal = w["opt_bytes"] / D
            print(f"| {layout} | {w['rank']} | {w['stage']} | {w['params'] / 1e6:.1f} "
                  f"| {w['opt_bytes'] / MB:.0f} | {sh['opt_bytes'] / MB:.0f} "
                  f"| {w['peak_rss'] / MB:.0f} | {sh['peak_rss'] / MB:.0f} "
                  f"| {saved / MB:.0f} | {part / MB:.0f} | {ideal / MB:.0f} | {part / ideal:.2f} |")
    print("\nStep time (median over every repeat's timed steps; per repeat in brackets):\n")
    print("| layout | whole (s) | sharded (s) | sharded / whole |")
    print("|---|---|---|---|")
    for layout, row in summary.items():
        w, sh = row["False"], row["True"]
        per = lambda x: ", ".join(f"{v:.3f}" for v in x["step_s_per_repeat"])  # noqa: E731
        print(f"| {layout} | {w['step_s']:.3f} [{per(w)}] | {sh['step_s']:.3f} [{per(sh)}] "
              f"| {sh['step_s'] / w['step_s']:.3f} |")


# ---------------------------------------------------------------------------------------------
# The largest GPT under a per-process cap (bench_too_big.py's workers: RLIMIT_AS, meta models)

#: The two ways of running 8 processes as 4×2 that ``--largest`` compares.
CHOICES = {
    "today": {"shard": False, "time_balanced": True},  # the time-balanced split, whole optimizer state
    "planner": {"shard": True, "time_balanced": False},  # memory-aware split, sharded optimizer state
}


def _try(tb, s, work: Path, name: str, P: int, D: int) -> dict:
    """One 4×2 training run of 2 steps under the cap: "trains" with each rank's report, or "fails"
    with the rank that ran out of memory and where."""
    try:
        ranks = tb.pipelined(s, work, name, P=P, D=D, steps=2, save_at=0, resume="0")
    except RuntimeError:
        out = work / name
        oom = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
        oom = [r for r in oom if r.get("status") == "out of memory"]
        return {"result": "fails", "where": oom[0]["phase"] if oom else "a worker failed (see its log)",
                "rank": oom[0].get("rank") if oom else None}
    return {"result": "trains", "ranks": ranks}


def largest(a: argparse.Namespace) -> dict:
    """For each choice, the most blocks (at ``--big-embd``) a 4×2 run trains under ``--cap-mb``:
    up from a first guess until a run fails, or down until one trains."""
    import bench_too_big as tb

    P, D = 4, 2
    per_block = 12 * a.big_embd**2 + 13 * a.big_embd  # weights of one GPT block (attention + MLP + norms)
    room = a.cap_mb * MB - 80 * MB  # measured fixed overhead of a stage (docs/too_big.md: 60-70 MiB)
    guesses = {"today": int(4 * (room / (16 * per_block) - 1)), "planner": int(4 * room / (12 * per_block))}
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="varuna-largest-") as work:
        for choice, flags in CHOICES.items():
            tried: dict[int, dict] = {}
            L = max(P, guesses[choice])
            while True:
                s = tb.Setup(n_layer=L, n_embd=a.big_embd, n_head=8, block_size=32, global_batch_size=4,
                             micro_batch_size=1, cap_mb=a.cap_mb, pipeline_depth=P, resume_layouts=(),
                             steps=2, save_at=0, **flags)
                t = time.perf_counter()
                run = _try(tb, s, Path(work), f"{choice}-{L}", P, D)
                tried[L] = {**run, "params": tb.model_summary(s)["params"]}
                print(f"  {choice}: {L} blocks ({tried[L]['params'] / 1e6:.1f}M parameters) {run['result']} "
                      f"({time.perf_counter() - t:.0f} s, {load()})", flush=True)
                ok = tried[L]["result"] == "trains"
                if ok and L + 1 in tried or not ok and L - 1 in tried or (not ok and L <= P):
                    break
                L = L + 1 if ok else L - 1
            best = max((n for n, r in tried.items() if r["result"] == "trains"), default=None)
            out[choice] = {"largest_blocks": best, "tried": tried}
    return out


def print_largest(res: dict, cap_mb: float) -> None:
    print(f"\nThe largest GPT that trains as 4×2 on 8 processes under {cap_mb:.0f} MiB each:\n")
    print("| choice | blocks | parameters (M) | largest stage (M) | mean stage (M) | largest / mean "
          "| peak RSS − base, max (MiB) | next size up |")
    print("|---|---|---|---|---|---|---|---|")
    params = {}
    for choice, r in res.items():
        L = r["largest_blocks"]
        if L is None:
            print(f"| {choice} | none | | | | | | |")
            continue
        run = r["tried"][L]
        stages = {x["stage"]: x["params"] for x in run["ranks"]}
        peak = max(x["peak_rss"] - x["base_rss"] for x in run["ranks"])
        nxt = r["tried"].get(L + 1, {})
        params[choice] = run["params"]
        where = f" ({nxt['where']})" if nxt.get("where") else ""
        mean = sum(stages.values()) / len(stages)
        print(f"| {choice} | {L} | {run['params'] / 1e6:.1f} | {max(stages.values()) / 1e6:.1f} "
              f"| {mean / 1e6:.1f} | {max(stages.values()) / mean:.3f} | {peak / MB:.0f} "
              f"| {L + 1}: {nxt.get('result', '-')}{where} |")
    if len(params) == 2:
        print(f"\nplanner / today: {params['planner'] / params['today']:.2f}x the parameters")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--setup", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--pipeline-depth", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--shard", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layouts", default="2x2,2x4", help="P×D layouts, comma-separated")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=Setup.n_layer)
    p.add_argument("--n-embd", type=int, default=Setup.n_embd)
    p.add_argument("--steps", type=int, default=Setup.steps)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--largest", action="store_true",
                   help="instead: the largest GPT trained as 4x2 under --cap-mb, today's vs the planner's")
    p.add_argument("--cap-mb", type=float, default=400.0,
                   help="--largest: memory per process above its baseline (MiB)")
    p.add_argument("--big-embd", type=int, default=512, help="--largest: the GPT's width")
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    if a.largest:
        print(f"GPT blocks of width {a.big_embd}, 4x2, cap {a.cap_mb:.0f} MiB per process; {load()}",
              flush=True)
        t0 = time.perf_counter()
        res = largest(a)
        print_largest(res, a.cap_mb)
        print(f"\n{time.perf_counter() - t0:.0f} s wall; {load()} at the end")
        if a.json_out:
            a.json_out.parent.mkdir(parents=True, exist_ok=True)
            a.json_out.write_text(json.dumps(res, indent=1))
        return 0
    try:
        layouts = [tuple(int(x) for x in t.lower().split("x")) for t in a.layouts.split(",") if t]
        if any(len(t) != 2 or min(t) < 1 for t in layouts):
            raise ValueError
    except ValueError:
        p.error(f"--layouts {a.layouts!r}: give P×D pairs like 2x2,2x4")
    s = Setup(n_layer=a.n_layer, n_embd=a.n_embd, steps=a.steps)
    print(f"GPT {s.n_layer} blocks × {s.n_embd}, M={s.global_batch_size}, m={s.micro_batch_size}, "
          f"{s.steps} steps ({s.warmup} warm-up), AdamW; {load()}", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="varuna-shard-bench-") as work:
        runs = measure(s, layouts, a.repeats, Path(work))
    summary = summarize(runs)
    print_tables(summary)
    print(f"\n{time.perf_counter() - t0:.0f} s wall; {load()} at the end")
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps({"setup": asdict(s), "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
