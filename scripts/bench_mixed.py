#!/usr/bin/env python
"""Benchmark: heterogeneity-aware plans on an emulated mixed cluster (issue #19).

For each case (a cluster of emulated devices of several speeds), ``simulator.mixed_plan.plan_mixed``
plans from the emulated model's calibration (known block costs; one VM type per speed) and
returns three plans: the heterogeneity-aware one, the best plan treating every VM as the slowest
type (even shares and split), and the best plan on the fastest type only. Each plan is then run
on the REAL engine (``scripts/validate_simulator.py``'s workers: one process per device, blocks
sleeping F / speed, ``replica_shares`` and ``stage_ranges`` as planned) and simulated again with
the runtime constants measured in the same run. Printed: samples/s real and simulated, the error,
and the aware plan's speed-up over the better of the two others. ``plan/s`` is the planner's own
prediction, from the known costs only (no runtime overheads: it plans before any run).

Cases: 2 fast + 2 slow devices at P = 2, with fast = 1.6x and 2x the slow one; the 1.6x one at
P = 1 (data parallelism only: the gain is all virtual nodes); 3 types (2x, 1.5x, 1x; 4 + 2 + 2
devices) at P = 4. The model: 8 emulated blocks (10 ms forward each on a 1x
device), micro-batch size as in the validation, 16 micro-batches per mini-batch.

Usage::

    python scripts/bench_mixed.py                 # all cases (~5 min)
    python scripts/bench_mixed.py --only 2types   # cases whose name contains it
    python scripts/bench_mixed.py --simulate-only # the plans and their predictions, no real runs

Goal (the issue): aware >= 1.3x the better of the others on the 2-type case; simulated vs real
within 5%. Results: docs/mixed_types.md.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import validate_simulator as vs  # noqa: E402  (after the sys.path set-up)
from validate_mixed import load  # noqa: E402

from profiler.overheads import MICRO_BATCH_SIZE  # noqa: E402
from simulator.mixed_plan import MixedPlan, plan_mixed  # noqa: E402
from varuna.core.schedule import DEFAULT_SCHEDULE  # noqa: E402

NUM_BLOCKS = 8
NUM_MICROBATCHES = 16


@dataclass(frozen=True)
class Case:
    name: str
    cluster: dict[float, int]
    """Device speed -> how many."""
    depth: int
    level: str = "none"
    schedule: str = DEFAULT_SCHEDULE


CASES = (
    Case("2types-1.6x", {1.6: 2, 1.0: 2}, 2),
    Case("2types-2x", {2.0: 2, 1.0: 2}, 2),
    Case("2types-1.6x-dp", {1.6: 2, 1.0: 2}, 1),
    Case("3types", {2.0: 4, 1.5: 2, 1.0: 2}, 4),
)


def plan_case(case: Case) -> MixedPlan:
    """The planner's view: the emulated model's known costs, one VM type per speed."""
    cal = vs.build_calibration(case.depth, case.level, vs.known_costs_only(), num_segments=NUM_BLOCKS,
                               speeds=list(case.cluster))
    cluster = {vs.speed_type(v): n for v, n in case.cluster.items()}
    return plan_mixed(cluster, cal, global_batch_size=MICRO_BATCH_SIZE * NUM_MICROBATCHES,
                      micro_batch_size=MICRO_BATCH_SIZE, schedule=case.schedule, pipeline_depths=[case.depth])


def _val(case: Case, rows, ranges, shares) -> vs.ValConfig:
    speeds = tuple(tuple(float(t[1:]) for t in r) for r in rows)
    return vs.ValConfig(num_stages=len(ranges), num_replicas=len(rows), schedule=case.schedule,
                        num_microbatches=NUM_MICROBATCHES, level=case.level, speeds=speeds,
                        shares=tuple(shares), stage_blocks=tuple(b - a + 1 for a, b in ranges))


def configs_of(case: Case, plan: MixedPlan) -> dict[str, tuple[vs.ValConfig, float]]:
    """label -> (the run's configuration, the planner's predicted samples/s)."""
    aware = _val(case, plan.stage_types, plan.stage_ranges, plan.replica_shares)
    out = {"aware": (aware, plan.examples_per_s)}
    for a in plan.alternatives:
        out[a.label] = (_val(case, a.stage_types, a.stage_ranges, a.replica_shares), a.examples_per_s)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = vs._parser()
    p.description = __doc__
    p.add_argument("--simulate-only", action="store_true", help="plans and predictions only")
    a = p.parse_args(argv)
    cases = [c for c in CASES if a.only in c.name]
    if not cases:
        print("no case matches --only", file=sys.stderr)
        return 2
    M = MICRO_BATCH_SIZE * NUM_MICROBATCHES
    plans = {c.name: (c, plan_case(c)) for c in cases}
    runs: list[vs.ValConfig] = []
    for case, plan in plans.values():
        print(f"\n== {case.name}: " + ", ".join(f"{n} x {v:g}x" for v, n in case.cluster.items())
              + f", P={case.depth}, global batch {M}")
        print(plan.explain())
        runs.extend(c for c, _ in configs_of(case, plan).values() if c not in runs)
    if a.simulate_only:
        return 0
    print(f"\nreal runs: {len(runs)}; {load()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="varuna-bench-mixed-") as tmp:
        best, constants, _ = vs._run_all(a, runs, "", str(a.work_dir) if a.work_dir else tmp)
    errors = []
    print(f"\n{'case':<16}{'plan':<16}{'layout':<58}{'real/s':>8}{'sim/s':>8}{'err':>7}{'plan/s':>8}")
    for case, plan in plans.values():
        got = {}
        for label, (c, predicted) in configs_of(case, plan).items():
            row = best[c.label]
            real, sim = M / row.real_s, M / row.sim_s
            got[label] = (real, sim)
            errors.append(abs(row.error))
            layout = c.label.split(" ", 2)[2].rsplit(" ", 1)[0]
            shape = c.label.split(" ")[0] + " " + layout
            print(f"{case.name:<16}{label:<16}{shape:<58}{real:>8.2f}{sim:>8.2f}"
                  f"{row.error * 100:>+6.1f}%{predicted:>8.2f}")
        others = [v for k, v in got.items() if k != "aware"]
        if others:
            r_real = got["aware"][0] / max(o[0] for o in others)
            r_sim = got["aware"][1] / max(o[1] for o in others)
            print(f"{case.name:<16}aware / better other: real {r_real:.2f}x, simulated {r_sim:.2f}x")
    print(f"\nsimulated vs real: median |error| {statistics.median(errors) * 100:.1f}%, "
          f"max {max(errors) * 100:.1f}% over {len(errors)} runs; {load()}")
    if a.json:
        vs._write_json(a.json, list(best.values()), constants, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
