#!/usr/bin/env python
"""The schedule benchmark's emulated cluster in the simulator: every schedule kind, no noise.

``scripts/bench_schedules.py`` measures the engine on a shared 2-core machine, where load moves
the numbers by 10-30%; this script asks the simulator (which drives the same per-stage policies
over the same task lists as the runtime) the same question: P stages of F = 10 ms, B = 20 ms,
R = F per micro-batch, Nm = 16 micro-batches of m = 4, D = 1, the network levels of the
benchmark (none; moderate = 1 ms + Exp(2 ms); heavy = 2 ms + Exp(10 ms) per message) on top of a
per-message hand-off of ``--handoff-ms`` (the runtime's, measured by scripts/validate_simulator.py),
mean over ``--seeds`` jitter draws. The interleaved kinds split each stage into v chunks of F/v.
Prints one Markdown table per P: mini-batch ms, fraction of the with-recompute ideal
Nm(F+R+B)+(P−1)(F+B), and the peak stashed (chunk) activations per stage.

Usage::

    python scripts/sim_schedules.py                  # P = 4 and 8, v = 2, about 10 s
    python scripts/sim_schedules.py --stages 4 --chunks 2 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from simulator.engine import SimConfig, simulate  # noqa: E402
from varuna.core.calibration import Calibration, LinkModel  # noqa: E402
from varuna.core.schedule import schedule_kind  # noqa: E402

#: name -> (fixed latency s, mean exponential jitter s), as scripts/bench_schedules_results.LEVELS
LEVELS = {"none": (0.0, 0.0), "moderate": (0.001, 0.002), "heavy": (0.002, 0.010)}
KINDS = ("varuna", "1f1b", "interleaved", "varuna-interleaved")


def simulate_kind(P: int, kind: str, v: int, level: str, a: argparse.Namespace) -> tuple[float, tuple]:
    """(mean mini-batch s, peak stashed per stage of seed 0)."""
    lat, jit = LEVELS[level]
    handoff = a.handoff_ms / 1e3
    link = LinkModel(latency_s=lat + jit + handoff, bandwidth_bytes_per_s=1e12, jitter_s=jit)
    chunks = v if schedule_kind(kind).chunked else 1
    per_stage = max(chunks, 2)  # segments per stage: enough for v chunks
    cal = Calibration.synthetic(a.fwd_ms / 1e3 / per_stage / a.m, num_segments=P * per_stage,
                                micro_batch_sizes=(a.m,), intra=link, inter=link, bwd_factor=2.0,
                                recompute_factor=1.0)
    V = P * chunks
    seg = P * per_stage // V
    ranges = tuple((j * seg, j * seg + seg - 1) for j in range(V))
    times, peak = [], ()
    for s in range(a.seeds if jit > 0 else 1):
        cfg = SimConfig(num_stages=P, micro_batch_size=a.m, num_microbatches=a.nm, schedule=kind,
                        recompute=True, chunks=chunks, stage_segments=ranges, seed=s, host_slots=1)
        r = simulate(cal, cfg)
        times.append(r.minibatch_s)
        peak = peak or r.peak_stashed
    return statistics.mean(times), peak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--chunks", type=int, nargs="+", default=[2], help="v for the interleaved kinds")
    ap.add_argument("--nm", type=int, default=16)
    ap.add_argument("--m", type=int, default=4)
    ap.add_argument("--fwd-ms", type=float, default=10.0, help="F per stage per micro-batch")
    ap.add_argument("--handoff-ms", type=float, default=0.9, help="the runtime's per-message hand-off")
    ap.add_argument("--seeds", type=int, default=25)
    a = ap.parse_args(argv)
    f = a.fwd_ms / 1e3
    for P in a.stages:
        ideal = a.nm * 4 * f + (P - 1) * 3 * f
        print(f"\nP={P} Nm={a.nm} F={a.fwd_ms:g}ms, ideal with recompute {ideal * 1e3:.0f} ms\n")
        cols = " | ".join(f"{lv} ms (of ideal)" for lv in LEVELS)
        print(f"| schedule | {cols} | stashed/stage (heavy) |")
        print("|---|" + "---:|" * len(LEVELS) + "---|")
        for kind in KINDS:
            for v in (a.chunks if schedule_kind(kind).chunked else [1]):
                cells, peak = [], ()
                for level in LEVELS:
                    t, peak = simulate_kind(P, kind, v, level, a)
                    cells.append(f"{t * 1e3:.0f} ({ideal / t:.3f})")
                label = schedule_kind(kind).label(recompute=True, chunks=v)
                print(f"| {label} | " + " | ".join(cells) + f" | {' '.join(map(str, peak))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
