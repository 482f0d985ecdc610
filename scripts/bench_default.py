"""The default configuration against torch.distributed.pipelining's best, on real compute (issue #32).

"The default" is what a user gets from ``varuna-launch --calibration FILE`` without ``--schedule``
or a recompute flag: auto-config's joint plan (Note [Joint plan] in simulator/autoconfig.py) picks
the schedule kind, recompute and the stage split for the memory it is told. Here, for the GPT
example (``--layers`` × ``--embd``, ``--block`` tokens, M = 32, m = 4, P = 2, one thread per process):

1. the calibration's costs and memory terms are measured as ``varuna-profile`` measures them
   (``scripts/validate_memory.py``'s ``calibration``: the profiler's per-segment measurement);
2. **memory allows**: the plan without a memory bound; **memory forces recompute**: the plan under
   a per-process memory between what P = 2 needs with and without recompute (the model's
   numbers, printed);
3. each plan runs on ``varuna.Engine`` side by side, in the same processes and the same split,
   with torch's ``Schedule1F1B`` and ``ScheduleGPipe``, each with and without activation
   checkpointing (``scripts/bench_schedules.py``'s runners; rounds alternate the order).

Goals: memory allows → ours ≥ 1.0× torch's best; memory forces recompute → ours ≥ 1.05× torch's
best checkpointed schedule (without checkpointing torch would not fit either).

    python scripts/bench_default.py                  # ~8 min here
    python scripts/bench_default.py --rounds 3 --steps 4 --json-out runs/default.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "scripts", ROOT / "examples" / "gpt2"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

MB = 1 << 20
M, MICRO, P = 32, 4, 2


def load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def plans(cal, **kw) -> dict:
    """The joint plan with room for everything, and under a memory that forces recompute."""
    from simulator.autoconfig import _Planner, autoconfigure

    joint = dict(gpus=P, global_batch_size=M, micro_batch_size=MICRO, pipeline_depth=P, schedule=None,
                 recompute=None, shard_optimizer=None)
    free = autoconfigure(cal, **joint).best
    nm = M // MICRO
    keep = _Planner(cal, "1f1b", False, 1, 1, None).fit(P, MICRO, nm)[1]  # every graph kept
    recompute = _Planner(cal, "varuna", True, 1, 1, None).fit(P, MICRO, nm)[1]
    cap = (keep + recompute) // 2
    tight = autoconfigure(cal, gpu_memory_bytes=cap, **joint).best
    return {"memory allows": (free, None), "memory forces recompute": (tight, cap),
            "_needs": {"no recompute": keep, "recompute": recompute}}


def compare(plan, spec_args: dict, rounds: int, work: Path, name: str) -> list[dict]:
    from bench_schedules import _order_runs, run_world
    from bench_schedules_results import RunSpec, WorldSpec, summarize

    cfg = plan.config
    runs = [RunSpec(system="ours", schedule=cfg.schedule, recompute=cfg.recompute, level="none", model="gpt")]
    runs += [RunSpec(system="torch", schedule=s, recompute=r, level="none", model="gpt")
             for s in ("1f1b", "gpipe") for r in (False, True)]
    spec = WorldSpec(model="gpt", num_stages=P, num_microbatches=M // MICRO, micro_batch_size=MICRO,
                     fwd_s=0.0, width=0, runs=[{**r, "model": "gpt"} for r in _order_runs(runs, rounds)],
                     out_dir=str(work / name), gpt_ranges=[list(r) for r in plan.stage_segments], **spec_args)
    return summarize(spec, run_world(spec, 1800.0))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--block", type=int, default=64, help="tokens per sample (activations grow with it)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run and round")
    p.add_argument("--json-out", type=Path)
    a = p.parse_args(argv)
    import validate_memory as vm

    t0 = time.perf_counter()
    print(f"GPT {a.layers} blocks × {a.embd}, block {a.block}, M={M}, m={MICRO}, P={P}; {load()}", flush=True)
    gpt = {"n_layer": a.layers, "n_embd": a.embd, "block_size": a.block, "n_head": 4}
    cal = vm.calibration("gpt", False, kwargs=gpt, m=MICRO, reps=3)
    planned = plans(cal)
    needs = planned.pop("_needs")
    print(f"the model's peak per process at P=2: {needs['no recompute'] / MB:.0f} MiB keeping every graph, "
          f"{needs['recompute'] / MB:.0f} MiB recomputing", flush=True)
    if needs["recompute"] >= needs["no recompute"]:
        # No memory between the two: the "forced" plan would keep every graph and be compared
        # with torch's checkpointed schedules, a comparison that says nothing.
        print(f"memory cannot force recompute at block {a.block}: the weights, not the activations, "
              "decide the peak; the second case is skipped (use a larger --block)", flush=True)
        del planned["memory forces recompute"]
    spec_args = {"warmup": 1, "steps": a.steps,
                 "gpt": {"vocab_size": 256, "block_size": a.block, "n_layer": a.layers, "n_head": 4,
                         "n_embd": a.embd, "dropout": 0.1}}
    out = []
    with tempfile.TemporaryDirectory(prefix="varuna-default-") as work:
        for case, (plan, cap) in planned.items():
            cfg = plan.config
            flag = "" if cfg.schedule == "varuna" else (" +R" if cfg.recompute else " no R")
            chosen = f"{cfg.schedule}{flag}"
            print(f"{case} ({'no bound' if cap is None else f'{cap / MB:.0f} MiB'}): the plan runs {chosen}, "
                  f"split {list(plan.stage_segments)}", flush=True)
            rows = compare(plan, spec_args, a.rounds, Path(work), case.replace(" ", "_"))
            ours = next(r for r in rows if r["system"] == "ours")
            torch_rows = [r for r in rows if r["system"] == "torch"]
            fits = [r for r in torch_rows if cap is None or r["recompute"]]
            best = max(fits, key=lambda r: r["samples_per_s"])
            out.append({"case": case, "cap": cap, "plan": chosen, "ranges": list(plan.stage_segments),
                        "ours": ours["samples_per_s"], "ours_label": ours["label"],
                        "best_torch": best["label"], "best_torch_samples_per_s": best["samples_per_s"],
                        "ratio": ours["samples_per_s"] / best["samples_per_s"],
                        "rows": [{k: r[k] for k in ("label", "samples_per_s", "median_step_s")}
                                 for r in rows],
                        "load": os.getloadavg()})
    print("\n| case | the default plans | ours (samples/s) | torch's best that fits | torch (samples/s) "
          "| ours / torch | goal |")
    print("|---|---|---|---|---|---|---|")
    for r in out:
        goal = "≥ 1.00" if r["cap"] is None else "≥ 1.05"
        print(f"| {r['case']} | {r['plan']} | {r['ours']:.2f} | {r['best_torch']} | "
              f"{r['best_torch_samples_per_s']:.2f} | {r['ratio']:.3f} | {goal} |")
    print("\nevery row:")
    for r in out:
        print(f"  {r['case']}: " + "; ".join(f"{x['label']} {x['samples_per_s']:.2f}/s" for x in r["rows"]))
    print(f"\n{time.perf_counter() - t0:.0f} s wall; {load()} at the end")
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
