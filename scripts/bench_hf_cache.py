"""Hugging Face GPT-2 (small random config) at 2×1: step time with ``use_cache`` at its default (True)
vs ``use_cache=False``, and the placeholder-cache entries after N steps (issue #16).

Runs tests/workers/hf_worker.py as a 2-process local world (gloo on 127.0.0.1) once per setting
and prints a table. The two should be within ~10% of each other and the entries flat; before the
fix the default was 2.5-10x slower on the later stage and its entries grew linearly.

    python scripts/bench_hf_cache.py --steps 20
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


def run(use_cache: str, steps: int, size: str) -> dict:
    """One 2×1 run; per-step times (max over the ranks) and the last stage's cache entries."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        res = run_world(ROOT / "tests" / "workers" / "hf_worker.py", 2,
                        ["--out", str(out), "--model", "gpt2", "--steps", str(steps),
                         "--use-cache", use_cache, "--size", size],
                        env={"VARUNA_PIPELINE_DEPTH": "2"}, timeout_s=600)
        check_ok(res)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(steps)]
    return {"step_s": step_s, "entries": ranks[-1]["entries"]}


def plain_step_s(use_cache: str, steps: int, size: str) -> float:
    """Median time of one step's forwards+backwards of the model alone (one process, no engine):
    what ``use_cache`` costs the model itself, to tell apart from the engine's overhead."""
    import time

    import torch

    sys.path.insert(0, str(ROOT / "tests" / "workers"))
    from hf_worker import SIZES, build, loss_of, step_batch

    torch.set_num_threads(1)
    z = SIZES[size]
    model, _ = build("gpt2", use_cache, size)
    times = []
    for step in range(1, steps + 1):
        batch = step_batch(step, size)
        t0 = time.perf_counter()
        for s in range(0, z["global_batch"], z["micro"]):
            mb = {k: v[s:s + z["micro"]] for k, v in batch.items()}
            loss_of(model(**mb), mb).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[min(3, steps - 1):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--size", default="bench", help="hf_worker size preset (bench: 4 layers, d=128, seq 64)")
    a = p.parse_args()
    rows = []
    for setting in ("default", "false"):
        r = run(setting, a.steps, a.size)
        timed = r["step_s"][a.warmup:] or r["step_s"]
        rows.append((setting, statistics.median(timed), r["entries"], plain_step_s(setting, a.steps, a.size)))
    base, pbase = rows[1][1], rows[1][3]
    print(f"GPT-2 ({a.size} preset) at 2x1, {a.steps} steps, median step time after {a.warmup} warm-ups; "
          "'model alone': the same step's forwards+backwards in one process without the engine")
    print(f"{'use_cache':<16}{'2x1 step (ms)':>14}{'vs False':>9}{'model alone (ms)':>18}{'vs False':>9}"
          f"  placeholder entries at step 1 / {a.steps}")
    for setting, med, entries, plain in rows:
        label = "default (True)" if setting == "default" else "False"
        print(f"{label:<16}{med * 1e3:>14.1f}{med / base:>9.2f}{plain * 1e3:>18.1f}{plain / pbase:>9.2f}"
              f"  {entries[0]} / {entries[-1]}")


if __name__ == "__main__":
    main()
