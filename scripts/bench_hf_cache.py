"""Hugging Face models (small random configs) at P×1: step time with ``use_cache`` at its default
(True) vs ``use_cache=False``, and the placeholder-cache entries after N steps (issue #16).

Runs tests/workers/hf_worker.py as a P-process local world (gloo on 127.0.0.1) once per model,
depth and setting, and prints a table. The two settings should be within 10% of each other and
the entries flat; before the fix the default was 2.5-10x slower on later stages and their entries
grew linearly. Run it on a quiet machine: the two settings are timed one after the other.

    python scripts/bench_hf_cache.py --models gpt2,llama,qwen2,t5 --depths 2,4 --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from distributed import check_ok, run_world  # noqa: E402


def run(model: str, depth: int, use_cache: str, steps: int, size: str) -> dict:
    """One depth×1 run; per-step times (max over the ranks) and the last stage's cache entries."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        res = run_world(ROOT / "tests" / "workers" / "hf_worker.py", depth,
                        ["--out", str(out), "--model", model, "--steps", str(steps),
                         "--use-cache", use_cache, "--size", size],
                        env={"VARUNA_PIPELINE_DEPTH": str(depth)}, timeout_s=600)
        check_ok(res)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(depth)]
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(steps)]
    return {"step_s": step_s, "entries": ranks[-1]["entries"]}


def plain_step_s(model_name: str, use_cache: str, steps: int, size: str) -> float:
    """Median time of one step's forwards+backwards of the model alone (one process, no engine):
    what ``use_cache`` costs the model itself, to tell apart from the engine's overhead."""
    import time

    import torch

    sys.path.insert(0, str(ROOT / "tests" / "workers"))
    from hf_worker import SIZES, build, loss_of, step_batch

    torch.set_num_threads(1)
    z = SIZES[size]
    model, _ = build(model_name, use_cache, size)
    times = []
    for step in range(1, steps + 1):
        batch = step_batch(step, size, model_name)
        t0 = time.perf_counter()
        for s in range(0, z["global_batch"], z["micro"]):
            mb = {k: v[s:s + z["micro"]] for k, v in batch.items()}
            loss_of(model(**mb), mb).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[min(3, steps - 1):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,llama,qwen2,t5", help="comma-separated hf_worker model names")
    p.add_argument("--depths", default="2,4", help="comma-separated pipeline depths")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per setting, the two settings interleaved (True, False, True, ...): a run's "
                        "placement of processes on cores moves its time by more than 10%%, so one run each "
                        "is not a comparison")
    p.add_argument("--size", default="bench", help="hf_worker size preset (bench: 4 layers, d=128, seq 64)")
    a = p.parse_args()
    print(f"{a.size} preset, {a.steps} steps, median step time after {a.warmup} warm-ups, median over "
          f"{a.repeats} interleaved runs per setting (min-max of the runs' ratios in brackets); 'model "
          "alone': the same step's forwards+backwards in one process without the engine")
    print(f"{'model':<7}{'P':>2}  {'use_cache':<15}{'step (ms)':>10}{'vs False':>9}{'  (run ratios)':<16}"
          f"{'model alone (ms)':>17}{'vs False':>9}  placeholder entries at step 1 / {a.steps}")
    for model in a.models.split(","):
        plain = {s: plain_step_s(model, s, a.steps, a.size) for s in ("default", "false")}
        for depth in (int(x) for x in a.depths.split(",")):
            meds: dict[str, list[float]] = {"default": [], "false": []}
            entries: dict[str, list[int]] = {}
            for _ in range(a.repeats):
                for setting in ("default", "false"):
                    r = run(model, depth, setting, a.steps, a.size)
                    meds[setting].append(statistics.median(r["step_s"][a.warmup:] or r["step_s"]))
                    entries[setting] = r["entries"]
            base = statistics.median(meds["false"])
            ratios = [t / f for t, f in zip(meds["default"], meds["false"])]
            for setting in ("default", "false"):
                med = statistics.median(meds[setting])
                label = "default (True)" if setting == "default" else "False"
                spread = f"  ({min(ratios):.2f}-{max(ratios):.2f})" if setting == "default" else ""
                print(f"{model:<7}{depth:>2}  {label:<15}{med * 1e3:>10.1f}{med / base:>9.2f}{spread:<16}"
                      f"{plain[setting] * 1e3:>17.1f}{plain[setting] / plain['false']:>9.2f}"
                      f"  {entries[setting][0]} / {entries[setting][-1]}", flush=True)


if __name__ == "__main__":
    main()
