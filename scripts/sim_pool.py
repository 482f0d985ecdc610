#!/usr/bin/env python
"""Trace-driven simulation of several jobs sharing one pool of spot VMs (issue #21, docs/pool.md).

Jobs of different models and sizes arrive over time (Poisson, seeded) into a pool of 2–3 VM
types whose capacity changes like spot capacity (seeded preemptions and returns, the same trace
for every policy). Each job's throughput on c VMs of each type comes from the repository's
simulator (``simulator.autoconfig`` via ``manager.allocation.throughput.ThroughputModel``) on a
synthetic calibration per (model, type): the types differ in compute speed, and by how much
depends on the model (Gavel's observation: a transformer gains far more from a newer accelerator
than a recurrent model). A job's *true* rate differs from the prediction by a seeded ±15 % per
(job, type); the policies see the prediction corrected by the measured rates of earlier rounds.

Policies compared, all through the same round mechanism (``manager.allocation.rounds``):

- ``las``: max-min fairness of normalised throughput, heterogeneity-aware;
- ``las-agnostic``: the same policy on a matrix where every type has the job's mean rate (all types
  treated as one), executed on the real types at the real rates;
- ``fifo``: arrival order, each job as many VMs as it may use of the type with the most free VMs,
  kept until it finishes (or loses them);
- ``makespan``: minimum makespan; ``cost``: maximum normalised throughput per dollar.

Usage::

    python scripts/sim_pool.py [--seed 0] [--jobs 24] [--plot docs/img/pool_jct.png] [--json out.json]
    python scripts/sim_pool.py --tiny            # 4 jobs, 2 types: a few seconds (tests)

Simplifications (stated in docs/pool.md): capacity changes, arrivals and placements happen at
round boundaries; a preemption or any other change of a job's VMs costs the job its morph time
(restart + checkpoint load, per job) at the start of the next round; a job that finishes
mid-round leaves its VMs idle until the round ends (as in Gavel).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from manager.allocation.policies import AllocationProblem, Job, solve  # noqa: E402
from manager.allocation.pool import PoolVM, VMType, capacity  # noqa: E402
from manager.allocation.rounds import Placement, RoundScheduler  # noqa: E402
from manager.allocation.throughput import JobProfile, ThroughputModel  # noqa: E402
from varuna.core.calibration import AllReduceModel, Calibration, LinkModel  # noqa: E402
from varuna.core.cli import OneLineParser  # noqa: E402
from varuna.core.extras import MissingExtra, require_extra  # noqa: E402

#: Illustrative spot prices ($/h per VM, one accelerator each) and pool sizes: K80-, P100- and
#: V100-class VMs. Gavel's matrix (Fig. 1) motivates the speed-ups below, not their exact values.
TYPES = (VMType("k80", 0.27), VMType("p100", 0.44), VMType("v100", 0.74))
MAX_CAPACITY = {"k80": 8, "p100": 6, "v100": 4}

#: Compute speed per type relative to k80, per model family.
FAMILIES = {
    "cnn": {"k80": 1.0, "p100": 3.5, "v100": 9.0},
    "transformer": {"k80": 1.0, "p100": 2.5, "v100": 5.0},
    "rnn": {"k80": 1.0, "p100": 1.2, "v100": 1.5},
}

#: Sizes: segments, forward time per example per segment on k80 (s), parameters per segment
#: (bytes), global batch, most VMs, morph cost (s).
SIZES = {
    "small": (4, 0.004, 16 << 20, 64, 2, 60.0),
    "medium": (8, 0.004, 48 << 20, 128, 4, 90.0),
    "large": (12, 0.005, 96 << 20, 256, 8, 120.0),
}

INTER = LinkModel(latency_s=50e-6, bandwidth_bytes_per_s=1.25e9, jitter_s=0.0)
INTRA = LinkModel(latency_s=10e-6, bandwidth_bytes_per_s=10e9, jitter_s=0.0)
ALLREDUCE = AllReduceModel(bandwidth_bytes_per_s=1.25e9, latency_s=100e-6)


@dataclass
class TraceJob:
    job_id: str
    family: str
    size: str
    arrival_s: float
    examples: float
    max_vms: int
    morph_s: float
    error: dict[str, float]
    """True rate / predicted rate per type (the calibration's error)."""


@dataclass
class Trace:
    types: tuple[VMType, ...]
    max_capacity: dict[str, int]
    jobs: list[TraceJob]
    round_s: float
    seed: int
    preempt_p: float = 0.15
    return_p: float = 0.3
    _alive: dict[int, list[PoolVM]] = field(default_factory=dict)

    def vms(self, r: int) -> list[PoolVM]:
        """The pool in round r: each round, per type, a preemption (1–2 VMs, with probability
        preempt_p) and a return (1 VM, with return_p); the same for every policy."""
        if not self._alive:
            self._alive[0] = [PoolVM(f"{t.name}-{i}", t.name) for t in self.types
                              for i in range(self.max_capacity[t.name])]
        for k in range(len(self._alive), r + 1):
            rng = random.Random(self.seed * 1_000_003 + k)
            alive = list(self._alive[k - 1])
            for t in self.types:
                mine = [vm for vm in alive if vm.vm_type == t.name]
                if mine and rng.random() < self.preempt_p:
                    for vm in rng.sample(mine, min(len(mine), rng.choice((1, 2)))):
                        alive.remove(vm)
                gone = [i for i in range(self.max_capacity[t.name])
                        if all(vm.vm_id != f"{t.name}-{i}" for vm in alive)]
                if gone and rng.random() < self.return_p:
                    alive.append(PoolVM(f"{t.name}-{rng.choice(gone)}", t.name))
            self._alive[k] = sorted(alive, key=lambda vm: vm.vm_id)
        return self._alive[r]


def calibration(family: str, size: str, vm_type: str) -> Calibration:
    """The synthetic calibration of a (family, size) model on one VM type."""
    segments, fwd, params, _, _, _ = SIZES[size]
    speed = FAMILIES[family][vm_type]
    return Calibration.synthetic(
        fwd / speed, num_segments=segments, micro_batch_sizes=(1, 2, 4, 8), overhead_s=0.001 / speed,
        param_bytes=params, act_bytes_per_example=1 << 18, intra=INTRA, inter=INTER, allreduce=ALLREDUCE,
        model_name=f"{family}-{size}",
    )


def make_trace(seed: int, n_jobs: int, *, tiny: bool, round_s: float, mean_gap_s: float) -> Trace:
    rng = random.Random(seed)
    types = TYPES[:2] if tiny else TYPES
    cap = {"k80": 2, "p100": 2} if tiny else dict(MAX_CAPACITY)
    sizes = ["small"] if tiny else list(SIZES)
    jobs, t = [], 0.0
    for i in range(n_jobs):
        family, size = rng.choice(list(FAMILIES)), rng.choice(sizes)
        # Duration on one k80 VM: log-uniform 1–10 h (tiny: 0.5–1 h), as examples.
        low, high = (0.5, 1.0) if tiny else (1.0, 10.0)
        hours = math.exp(rng.uniform(math.log(low), math.log(high)))
        segments, fwd, _, _, max_vms, morph = SIZES[size]
        per_example_s = segments * fwd * 4  # F + R + B ≈ 4 F on one VM
        jobs.append(TraceJob(
            job_id=f"j{i:02d}-{family}-{size}", family=family, size=size, arrival_s=t,
            examples=hours * 3600 / per_example_s, max_vms=min(max_vms, 2) if tiny else max_vms,
            morph_s=morph, error={ty.name: rng.uniform(0.85, 1.15) for ty in types},
        ))
        t += rng.expovariate(1.0 / mean_gap_s)
    return Trace(types=types, max_capacity=cap, jobs=jobs, round_s=round_s, seed=seed)


def predicted_rates(trace: Trace) -> dict[str, dict]:
    """Per job, the simulator's predicted rates (cached per (family, size): jobs of one model share)."""
    model = ThroughputModel(trace.types)
    for job in trace.jobs:
        cals = {t.name: calibration(job.family, job.size, t.name) for t in trace.types}
        gbs = SIZES[job.size][3]
        model.add_job(JobProfile(job_id=job.job_id, global_batch_size=gbs, calibrations=cals,
                                 max_vms=job.max_vms, cache_key=f"{job.family}-{job.size}"))
    return {job.job_id: dict(model.matrix([job.job_id]).rates[job.job_id]) for job in trace.jobs}


@dataclass
class Outcome:
    policy: str
    finish_s: dict[str, float]
    morphs: int
    cost_usd: float
    wall_s: float
    active: list[tuple[float, int]]


def fifo_placements(trace: Trace, order: list[TraceJob], vms: list[PoolVM], sched: RoundScheduler,
                    rates: dict) -> dict[str, Placement]:
    """FIFO, heterogeneity-agnostic: running jobs keep the VMs they still have; waiting jobs, in
    arrival order, take up to max_vms of the type with the most free VMs."""
    alive = {vm.vm_id for vm in vms}
    out: dict[str, Placement] = {}
    for job in order:
        here = sched.current.get(job.job_id)
        if here is not None:
            kept = tuple(v for v in here.vm_ids if v in alive)
            if kept and rates[job.job_id].get((here.vm_type, len(kept)), 0.0) > 0:
                out[job.job_id] = Placement(job.job_id, here.vm_type, kept)
    used = {v for p in out.values() for v in p.vm_ids}
    for job in order:
        if job.job_id in out:
            continue
        free = {t.name: [vm.vm_id for vm in vms if vm.vm_type == t.name and vm.vm_id not in used]
                for t in trace.types}
        t = max(sorted(free), key=lambda name: len(free[name]))
        n = min(job.max_vms, len(free[t]))
        if n and rates[job.job_id].get((t, n), 0.0) > 0:
            out[job.job_id] = Placement(job.job_id, t, tuple(free[t][:n]))
            used.update(free[t][:n])
    return out


def run_policy(trace: Trace, policy: str, predicted: dict[str, dict]) -> Outcome:
    """Play the trace under ``policy``; returns each job's finish time."""
    t0 = time.perf_counter()
    model = ThroughputModel(trace.types)
    for job_id, rates in predicted.items():
        model.set_predicted(job_id, rates)
    jobs = {j.job_id: j for j in trace.jobs}
    remaining = {j.job_id: j.examples for j in trace.jobs}
    finish: dict[str, float] = {}
    sched = RoundScheduler(round_s=trace.round_s)
    prices = {t.name: t.price_per_hour for t in trace.types}
    morphs, cost, key, alloc, active_log = 0, 0.0, None, None, []
    r = 0
    while len(finish) < len(jobs):
        start = r * trace.round_s
        vms = trace.vms(r)
        active = [j for j in trace.jobs if j.arrival_s <= start and j.job_id not in finish]
        active_log.append((start, len(active)))
        if policy == "fifo":
            placements = fifo_placements(trace, active, vms, sched, predicted)
            plan = sched.plan_fixed(placements, vms, morph_s={j.job_id: j.morph_s for j in active})
        else:
            now_key = (tuple(j.job_id for j in active), tuple(vm.vm_id for vm in vms))
            if now_key != key:  # re-solve when the jobs or the pool change
                key, (alloc, matrix) = now_key, allocate(trace, policy, model, active, vms, sched, remaining,
                                                         prices)
            plan = sched.plan(alloc, vms, morph_s={j.job_id: j.morph_s for j in active},
                              fill=None if policy == "cost" else matrix)
        morphs += sum(1 for m in plan.moves if m.before is not None and m.after is not None)
        for job_id, p in plan.placements.items():
            moved = any(m.job_id == job_id for m in plan.moves)
            cost += prices[p.vm_type] * len(p.vm_ids) * trace.round_s / 3600
            true = predicted[job_id].get(p.config, 0.0) * jobs[job_id].error[p.vm_type]
            lost = jobs[job_id].morph_s if moved else 0.0
            work = true * max(0.0, trace.round_s - lost)
            if true > 0 and work >= remaining[job_id]:
                finish[job_id] = start + lost + remaining[job_id] / true
            else:
                remaining[job_id] -= work
                model.observe(job_id, p.vm_type, len(p.vm_ids), true)
        sched.record(plan)
        for job_id in finish:
            sched.forget(job_id)
        r += 1
    return Outcome(policy, finish, morphs, cost, time.perf_counter() - t0, active_log)


def allocate(trace, policy, model, active, vms, sched, remaining, prices):
    caps = capacity(vms, trace.types)
    matrix = model.matrix([j.job_id for j in active])
    base = "las" if policy == "las-agnostic" else policy
    if policy == "las-agnostic":
        matrix = matrix.agnostic()
    problem = AllocationProblem(
        matrix=matrix, capacity=caps,
        jobs=[Job(j.job_id, remaining=remaining[j.job_id]) for j in active], prices=prices,
        current=sched.current_configs(), morph_s={j.job_id: j.morph_s for j in active},
        round_s=trace.round_s,
    )
    return solve(base, problem), matrix


def snapshot(trace: Trace, predicted: dict[str, dict], size: str, n: int = 12) -> str:
    """One static allocation: the first ``n`` jobs of ``size`` on the full pool, aware vs agnostic
    LAS, judged on the true rates (normalised by the aware equal share): how much the allocation
    itself gains, without queueing."""
    from manager.allocation.policies import equal_share_rates
    from manager.allocation.throughput import ThroughputMatrix

    jobs = [j for j in trace.jobs if j.size == size][:n]
    true = ThroughputMatrix({j.job_id: {cfg: r * j.error[cfg[0]] for cfg, r in predicted[j.job_id].items()}
                             for j in jobs})
    model = ThroughputMatrix({j.job_id: predicted[j.job_id] for j in jobs})
    cap = dict(trace.max_capacity)
    problem = AllocationProblem(matrix=true, capacity=cap, jobs=[Job(j.job_id) for j in jobs])
    equal = equal_share_rates(problem)
    out = []
    for name, matrix in (("aware", model), ("agnostic", model.agnostic())):
        alloc = solve("las", AllocationProblem(matrix=matrix, capacity=cap, jobs=problem.jobs))
        norm = [sum(true.rate(j, *cfg) * y for cfg, y in alloc.fractions[j].items()) / equal[j]
                for j in alloc.fractions]
        out.append(f"{name}: sum {sum(norm):.2f}, min {min(norm):.2f}")
    return f"snapshot, {len(jobs)} {size} jobs, normalised throughput on the true rates: " + "; ".join(out)


POLICY_NAMES = {
    "las": "LAS, heterogeneity-aware",
    "las-agnostic": "LAS, heterogeneity-agnostic",
    "fifo": "FIFO (agnostic)",
    "makespan": "min makespan (aware)",
    "cost": "max throughput/$ (aware)",
}


def summarise(trace: Trace, out: Outcome) -> dict:
    jct = [out.finish_s[j.job_id] - j.arrival_s for j in trace.jobs]
    return {
        "policy": out.policy,
        "avg_jct_h": sum(jct) / len(jct) / 3600,
        "makespan_h": (max(out.finish_s.values()) - min(j.arrival_s for j in trace.jobs)) / 3600,
        "cost_usd": out.cost_usd,
        "morphs": out.morphs,
        "wall_s": out.wall_s,
        "jct_h": sorted(x / 3600 for x in jct),
    }


def table(rows: list[dict], seeds: int = 1) -> str:
    """Rows of one seed, or (seeds > 1) per-policy means over the seeds with per-seed ratios."""
    head = "mean over seeds: " if seeds > 1 else ""
    lines = [f"{head + 'policy':<30} {'avg JCT (h)':>11} {'makespan (h)':>12} {'VM cost ($)':>11} "
             f"{'morphs':>7} {'wall (s)':>8}"]
    for r in rows:
        lines.append(f"{POLICY_NAMES[r['policy']]:<30} {r['avg_jct_h']:>11.2f} {r['makespan_h']:>12.2f} "
                     f"{r['cost_usd']:>11.2f} {r['morphs']:>7.0f} {r['wall_s']:>8.1f}")
    by = {r["policy"]: r for r in rows}
    for other, name in (("las-agnostic", "agnostic"), ("fifo", "FIFO")):
        if "las" in by and other in by:
            ratio = by[other]["avg_jct_h"] / by["las"]["avg_jct_h"]
            per_seed = by[other].get("ratios")
            extra = f" (per seed: {', '.join(f'{x:.2f}' for x in per_seed)})" if per_seed else ""
            lines.append(f"avg JCT, {name} / aware LAS: {ratio:.2f}x{extra}")
    return "\n".join(lines)


def mean_rows(per_seed: list[list[dict]]) -> list[dict]:
    """Per policy, the mean of each number over the seeds; ``ratios``: each seed's avg JCT over
    the aware LAS's."""
    out = []
    for i, r0 in enumerate(per_seed[0]):
        runs = [rows[i] for rows in per_seed]
        row = {"policy": r0["policy"]}
        for k in ("avg_jct_h", "makespan_h", "cost_usd", "morphs", "wall_s"):
            row[k] = sum(r[k] for r in runs) / len(runs)
        aware = [next((r for r in rows if r["policy"] == "las"), None) for rows in per_seed]
        if all(a is not None for a in aware):
            row["ratios"] = [r["avg_jct_h"] / a["avg_jct_h"] for r, a in zip(runs, aware)]
        out.append(row)
    return out


def plot(trace: Trace, rows: list[dict], outcomes: list[Outcome], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        xs = r["jct_h"]
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax1.step(xs, ys, where="post", label=POLICY_NAMES[r["policy"]])
    ax1.set_xscale("log")
    ax1.set_xlabel("job completion time (h)")
    ax1.set_ylabel("fraction of jobs")
    ax1.legend(fontsize=8)
    ax1.set_title(f"JCT, {len(trace.jobs)} jobs (seed {trace.seed})")
    horizon = max(len(o.active) for o in outcomes)
    hours = [r * trace.round_s / 3600 for r in range(horizon)]
    for t in trace.types:
        ax2.step(hours, [sum(vm.vm_type == t.name for vm in trace.vms(r)) for r in range(horizon)],
                 where="post", label=f"{t.name} VMs")
    arrivals = [j.arrival_s / 3600 for j in trace.jobs]
    ax2.plot(arrivals, [0.2] * len(arrivals), "k|", markersize=10, label="arrivals")
    ax2.set_xlabel("time (h)")
    ax2.set_ylabel("VMs in the pool")
    ax2.legend(fontsize=8)
    ax2.set_title("spot capacity per type")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="sim_pool.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--seeds", type=int, default=1, help="run seeds seed..seed+N-1 and report the means")
    ap.add_argument("--jobs", type=int, default=120)
    ap.add_argument("--round-s", type=float, default=360.0, help="round length (s)")
    ap.add_argument("--mean-gap-min", type=float, default=6.0, help="mean time between arrivals (min)")
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--tiny", action="store_true", help="4 small jobs, 2 types (a quick check)")
    ap.add_argument("--plot", help="write the first seed's JCT CDF and capacity plot here (PNG)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--snapshot", choices=sorted(SIZES),
                    help="only a static allocation of 12 jobs of this size (no trace)")
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    bad = [p for p in policies if p not in POLICY_NAMES]
    if bad:
        ap.error(f"unknown policy {bad[0]!r}; choose from {', '.join(POLICY_NAMES)}")
    if args.jobs < 1 or args.seeds < 1 or args.round_s <= 0 or args.mean_gap_min <= 0:
        ap.error("--jobs and --seeds must be >= 1, --round-s and --mean-gap-min > 0")
    try:  # before minutes of simulation, not after
        require_extra("manager", "sim_pool.py (pool allocation)", ["scipy"])
        if args.plot:
            require_extra("plot", "sim_pool.py --plot")
    except MissingExtra as e:
        print(f"sim_pool.py: error: {e}", file=sys.stderr)
        return 2
    n_jobs = 4 if args.tiny else args.jobs
    per_seed = []
    for seed in range(args.seed, args.seed + args.seeds):
        gap_s = args.mean_gap_min * 60
        trace = make_trace(seed, n_jobs, tiny=args.tiny, round_s=args.round_s, mean_gap_s=gap_s)
        t0 = time.perf_counter()
        predicted = predicted_rates(trace)
        if args.snapshot:
            print(snapshot(trace, predicted, args.snapshot))
            continue
        print(f"seed {seed}: {len(trace.jobs)} jobs, types {', '.join(t.name for t in trace.types)}, round "
              f"{args.round_s:g} s, mean gap {args.mean_gap_min:g} min; throughput matrix from the simulator "
              f"in {time.perf_counter() - t0:.1f} s")
        outcomes = [run_policy(trace, p, predicted) for p in policies]
        per_seed.append([summarise(trace, o) for o in outcomes])
        print(table(per_seed[-1]))
        if args.plot and seed == args.seed:
            plot(trace, per_seed[-1], outcomes, args.plot)
            print(f"plot: {args.plot}")
    if args.seeds > 1 and per_seed:
        print(table(mean_rows(per_seed), seeds=args.seeds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": args.seed, "seeds": args.seeds, "jobs": n_jobs, "round_s": args.round_s,
                       "mean_gap_min": args.mean_gap_min, "results": per_seed}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
