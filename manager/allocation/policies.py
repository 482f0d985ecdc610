"""Allocation policies as linear programs over time fractions (Gavel §3–4).

An allocation gives each job j a fraction y[j, (t, c)] ∈ [0, 1] of the time on c VMs of type t
(one configuration at a time: Σ_cfg y[j, cfg] ≤ 1) without holding more VMs of a type than the
pool has on average (Σ_j Σ_c c·y[j, (t, c)] ≤ N_t). Job j's time-averaged rate is
rate_j = Σ_cfg r[j, cfg]·y[j, cfg]. Because a job's rate is given per count, time-sharing between
counts is exact: no linear-scaling assumption (pipelines do not scale linearly). The round
mechanism (:mod:`manager.allocation.rounds`) realises the fractions over time.

Policies (docs/pool.md has the formulas):

- ``max_min_fairness`` (Gavel's LAS, heterogeneity-aware): maximise min_j rate_j / (w_j·E_j),
  E_j the rate j gets from an equal 1/n share of every type; then use what is left for the sum.
- ``min_makespan``: maximise min_j rate_j / remaining_j (= minimise max_j remaining_j / rate_j).
- ``max_throughput_per_dollar``: maximise Σ_j w_j·rate_j/E_j over Σ_t price_t·(VMs of t in use),
  every job keeping at least ``min_share`` of E_j (a linear-fractional program, made linear by the
  Charnes–Cooper substitution).

Each policy also honours per-job floors ``min_rate`` (examples/s; infeasible → ``ValueError``)
and charges a move: a configuration other than the job's current one is worth
r·(1 − morph_s/round_s), the part of a round a morph leaves (Note [Move cost]).

Solver: HiGHS through ``scipy.optimize.linprog`` (docs/pool.md, "Solver").

    >>> from manager.allocation.throughput import ThroughputMatrix
    >>> m = ThroughputMatrix.from_table({"a": {"x": [1.0]}, "b": {"x": [1.0]}})
    >>> alloc = max_min_fairness(AllocationProblem(matrix=m, capacity={"x": 1}, jobs=[Job("a"), Job("b")]))
    >>> round(alloc.fractions["a"][("x", 1)], 6), round(alloc.fractions["b"][("x", 1)], 6)
    (0.5, 0.5)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from manager.allocation.throughput import Config, ThroughputMatrix
from varuna.core.extras import require

__all__ = [
    "Allocation",
    "AllocationProblem",
    "Job",
    "POLICIES",
    "equal_share_rates",
    "max_min_fairness",
    "max_throughput_per_dollar",
    "min_makespan",
    "solve",
]

#: A fraction below this is noise from the solver (or stage 2 spending stage 1's slack), not an
#: allocation: 1e-6 of a 6-minute round is a third of a millisecond.
_EPS = 1e-6
#: Stage 2 keeps stage 1's optimum within this relative slack (HiGHS's feasibility tolerance is
#: 1e-7 absolute; the stage-1 solution must stay feasible in stage 2).
_SLACK = 1e-8


@dataclass(frozen=True)
class Job:
    """A job as the policies see it."""

    job_id: str
    weight: float = 1.0
    """Priority: under max-min fairness a job of weight 2 gets twice the normalised throughput."""
    remaining: float = 0.0
    """Examples left to train (min makespan)."""
    min_rate: float = 0.0
    """Examples/s the job must get (a deadline turned into a rate); 0: none."""


@dataclass(frozen=True, kw_only=True)
class AllocationProblem:
    """Inputs of every policy."""

    matrix: ThroughputMatrix
    capacity: Mapping[str, int]
    """VMs per type in the pool now."""
    jobs: Sequence[Job]
    prices: Mapping[str, float] = field(default_factory=dict)
    """$ per hour per VM of each type (the cost policy)."""
    current: Mapping[str, Config] = field(default_factory=dict)
    """Where each running job is now (Note [Move cost])."""
    morph_s: Mapping[str, float] = field(default_factory=dict)
    """Each job's measured morph cost in seconds."""
    round_s: float = 360.0


@dataclass(frozen=True)
class Allocation:
    """A policy's answer: per job, the time fraction on each configuration."""

    policy: str
    fractions: Mapping[str, Mapping[Config, float]]
    """Only entries > 0; a job absent or empty gets nothing."""
    rates: Mapping[str, float]
    """Time-averaged examples/s from the matrix (move costs not subtracted)."""
    objective: float
    """max-min fairness: the smallest weighted normalised throughput; min makespan: the predicted
    makespan in seconds; cost: weighted normalised throughput per $/h."""
    notes: tuple[str, ...] = ()

    def vms(self, job: str, vm_type: str) -> float:
        """VMs of ``vm_type`` the job holds on average."""
        return sum(c * y for (t, c), y in self.fractions.get(job, {}).items() if t == vm_type)


# Note [Move cost]: a job that moves to another configuration (type or count) morphs: it stops,
# checkpoints and restarts, losing morph_s of the round (measured per job by the manager). The
# policies value such a configuration at r·max(0, 1 − morph_s/round_s), so a move must win more
# than it costs, and among equally good allocations the one that keeps jobs in place wins. A job
# that is not running pays its start-up whichever configuration it gets, so nothing is charged.


class _LP:
    """Rows of ``A x ≤ b`` / ``A x = b`` over named columns, solved by HiGHS (maximisation)."""

    def __init__(self, columns: Sequence[object]) -> None:
        self.index = {col: i for i, col in enumerate(columns)}
        self.ub: list[tuple[dict[int, float], float]] = []
        self.eq: list[tuple[dict[int, float], float]] = []

    def row(self, coeffs: Mapping[object, float], rhs: float, *, equal: bool = False) -> None:
        (self.eq if equal else self.ub).append(({self.index[k]: v for k, v in coeffs.items()}, rhs))

    def maximise(self, objective: Mapping[object, float]) -> np.ndarray | None:
        """The optimal x ≥ 0, or None when infeasible."""
        n = len(self.index)
        c = np.zeros(n)
        for k, v in objective.items():
            c[self.index[k]] = -v

        def dense(rows):
            if not rows:
                return None, None
            a = np.zeros((len(rows), n))
            for i, (coeffs, _) in enumerate(rows):
                for j, v in coeffs.items():
                    a[i, j] += v
            return a, np.array([rhs for _, rhs in rows])

        a_ub, b_ub = dense(self.ub)
        a_eq, b_eq = dense(self.eq)
        # Imported here: scipy is the manager extra's, and the rest of the package needs only numpy.
        linprog = require("scipy.optimize", "manager", "pool allocation (manager/allocation)").linprog
        res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=(0.0, None), method="highs")
        if res.status == 2:
            return None
        if res.status != 0:  # unbounded or iteration limit: a bug in the formulation, say so
            raise RuntimeError(f"the allocation LP did not solve: {res.message}")
        return res.x


class _Setup:
    """Validated inputs, the columns y[j, cfg], effective rates and equal shares."""

    def __init__(self, problem: AllocationProblem) -> None:
        self.p = problem
        self.notes: list[str] = []
        _validate(problem)
        cap = problem.capacity
        self.jobs = list(problem.jobs)
        self.cols: list[tuple[str, Config]] = []
        self.rate: dict[tuple[str, Config], float] = {}
        self.eff: dict[tuple[str, Config], float] = {}
        for job in self.jobs:
            for cfg in problem.matrix.configs(job.job_id):
                if cfg[1] <= cap.get(cfg[0], 0):
                    col = (job.job_id, cfg)
                    self.cols.append(col)
                    self.rate[col] = problem.matrix.rate(job.job_id, *cfg)
                    self.eff[col] = self.rate[col] * _keep(problem, job.job_id, cfg)
        self.equal = equal_share_rates(problem)
        for job in self.jobs:
            if self.equal[job.job_id] <= 0:
                self.notes.append(
                    f"job {job.job_id} runs on no VM type in the pool (every rate is 0 or needs more VMs "
                    "than there are): it gets nothing"
                )
        self.live = [j for j in self.jobs if self.equal[j.job_id] > 0]
        if any(j.min_rate > 0 for j in self.jobs) and self.lp().maximise({}) is None:
            raise self.infeasible()  # even when no policy objective is left to optimise

    def of(self, job_id: str) -> list[tuple[str, Config]]:
        return [col for col in self.cols if col[0] == job_id]

    def lp(self, extra: Sequence[object] = ()) -> _LP:
        """An LP over the columns (+ ``extra``) with the per-job, capacity and floor rows."""
        lp = _LP([*self.cols, *extra])
        for job in self.jobs:
            if self.of(job.job_id):
                lp.row({col: 1.0 for col in self.of(job.job_id)}, 1.0)
        for t, n in sorted(self.p.capacity.items()):
            cols = [col for col in self.cols if col[1][0] == t]
            if cols:
                lp.row({col: float(col[1][1]) for col in cols}, float(n))
        for job in self.jobs:
            if job.min_rate > 0:
                lp.row({col: -self.eff[col] for col in self.of(job.job_id)}, -job.min_rate)
        return lp

    def infeasible(self) -> ValueError:
        """The one-line error for floors the pool cannot meet."""
        cap = ", ".join(f"{t}×{n}" for t, n in sorted(self.p.capacity.items()))
        alone = []
        for job in self.jobs:
            best = max((self.eff[col] for col in self.of(job.job_id)), default=0.0)
            if job.min_rate > best:
                alone.append(
                    f"job {job.job_id} needs {job.min_rate:g} examples/s but gets at most {best:.3g}"
                )
        why = "; ".join(alone) if alone else (
            "the jobs' min_rate floors (" + ", ".join(f"{j.job_id}: {j.min_rate:g}" for j in self.jobs
                                                      if j.min_rate > 0) + " examples/s) do not fit together"
        )
        return ValueError(f"infeasible allocation on the pool ({cap}): {why}; lower min_rate or add VMs")

    def result(self, policy: str, x: np.ndarray, objective: float) -> Allocation:
        fractions: dict[str, dict[Config, float]] = {j.job_id: {} for j in self.jobs}
        rates = {j.job_id: 0.0 for j in self.jobs}
        for i, (job, cfg) in enumerate(self.cols):
            y = min(1.0, float(x[i]))
            if y > _EPS:
                fractions[job][cfg] = y
                rates[job] += y * self.rate[(job, cfg)]
        return Allocation(policy, fractions, rates, objective, tuple(self.notes))

    def empty(self, policy: str, objective: float) -> Allocation:
        return Allocation(policy, {j.job_id: {} for j in self.jobs}, {j.job_id: 0.0 for j in self.jobs},
                          objective, tuple(self.notes))


def _validate(problem: AllocationProblem) -> None:
    seen: set[str] = set()
    for job in problem.jobs:
        if job.job_id in seen:
            raise ValueError(f"job {job.job_id!r} is listed twice; list each job once")
        seen.add(job.job_id)
        if job.job_id not in problem.matrix.rates:
            raise ValueError(
                f"job {job.job_id!r} has no row in the throughput matrix; add the job to the matrix"
            )
        if not (math.isfinite(job.weight) and job.weight > 0):
            raise ValueError(f"job {job.job_id!r}: weight must be a finite number > 0, got {job.weight}")
        for name in ("remaining", "min_rate"):
            v = getattr(job, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"job {job.job_id!r}: {name} must be a finite number >= 0, got {v}")
    for t, n in problem.capacity.items():
        if n < 0:
            raise ValueError(f"capacity of VM type {t!r} is {n}; it must be >= 0")
    if not problem.round_s > 0:
        raise ValueError(f"round_s must be > 0, got {problem.round_s}")


def _keep(problem: AllocationProblem, job: str, cfg: Config) -> float:
    """The part of a round ``cfg`` is worth to ``job`` (Note [Move cost])."""
    now = problem.current.get(job)
    if now is None or now == cfg:
        return 1.0
    return max(0.0, 1.0 - problem.morph_s.get(job, 0.0) / problem.round_s)


def equal_share_rates(problem: AllocationProblem) -> dict[str, float]:
    """E_j: the best rate job j reaches with 1/n of every type's VMs to itself (n = the number of
    jobs), time-sharing allowed: Gavel's normaliser for max-min fairness.

    >>> from manager.allocation.throughput import ThroughputMatrix
    >>> m = ThroughputMatrix.from_table({"a": {"x": [2.0, 3.0]}, "b": {"x": [1.0]}})
    >>> equal_share_rates(AllocationProblem(matrix=m, capacity={"x": 2}, jobs=[Job("a"), Job("b")]))
    {'a': 2.0, 'b': 1.0}
    """
    n = len(problem.jobs)
    out: dict[str, float] = {}
    for job in problem.jobs:
        cap = problem.capacity
        cfgs = [cfg for cfg in problem.matrix.configs(job.job_id) if cfg[1] <= cap.get(cfg[0], 0)]
        if not cfgs:
            out[job.job_id] = 0.0
            continue
        lp = _LP(cfgs)
        lp.row({cfg: 1.0 for cfg in cfgs}, 1.0)
        for t in sorted({cfg[0] for cfg in cfgs}):
            lp.row({cfg: float(cfg[1]) for cfg in cfgs if cfg[0] == t}, problem.capacity[t] / n)
        rates = {cfg: problem.matrix.rate(job.job_id, *cfg) for cfg in cfgs}
        x = lp.maximise(rates)
        assert x is not None  # y = 0 is always feasible
        out[job.job_id] = float(sum(rates[cfg] * x[i] for i, cfg in enumerate(cfgs)))
    return out


def _per_equal(s: _Setup, job: Job, factor: float = 1.0) -> dict[object, float]:
    """Coefficients of factor·rate_j / E_j over job's columns (its normalised throughput)."""
    scale = factor / s.equal[job.job_id]
    return {col: s.eff[col] * scale for col in s.of(job.job_id)}


def _normalised(s: _Setup, job: Job) -> dict[object, float]:
    """Coefficients of rate_j / (w_j·E_j): the weighted normalised throughput max-min fairness
    levels."""
    return _per_equal(s, job, 1.0 / job.weight)


def max_min_fairness(problem: AllocationProblem) -> Allocation:
    """Gavel's LAS, heterogeneity-aware: maximise min_j rate_j / (w_j·E_j); then, with every job
    kept at that level, maximise Σ_j rate_j / E_j so capacity the bottleneck jobs cannot use goes
    to the others (a two-level water-filling)."""
    s = _Setup(problem)
    if not s.live:
        return s.empty("max-min fairness", 0.0)
    lp = s.lp(extra=["z"])
    for job in s.live:
        lp.row({"z": 1.0, **{k: -v for k, v in _normalised(s, job).items()}}, 0.0)
    x = lp.maximise({"z": 1.0})
    if x is None:
        raise s.infeasible()
    z = float(x[lp.index["z"]])
    lp2 = s.lp()
    for job in s.live:
        lp2.row({k: -v for k, v in _normalised(s, job).items()}, -z * (1 - _SLACK))
    total: dict[object, float] = {}
    for job in s.live:
        total.update(_per_equal(s, job))
    x2 = lp2.maximise(total)
    assert x2 is not None  # stage 1's optimum is feasible here
    return s.result("max-min fairness", x2, z)


def min_makespan(problem: AllocationProblem) -> Allocation:
    """Minimise the time until every job is done, max_j remaining_j / rate_j, as maximising
    min_j rate_j / remaining_j; then maximise Σ_j rate_j / remaining_j with that kept, so jobs
    that are not on the critical path finish sooner. Weights do not apply."""
    s = _Setup(problem)
    live = [j for j in s.live if j.remaining > 0]
    if not live:
        return s.empty("min makespan", 0.0)
    # Scale rate/remaining by the largest such ratio so the LP's coefficients are O(1).
    scale = max(max(s.eff[col] for col in s.of(j.job_id)) / j.remaining for j in live) or 1.0

    def speed(job: Job) -> dict[object, float]:
        return {col: s.eff[col] / (job.remaining * scale) for col in s.of(job.job_id)}

    lp = s.lp(extra=["z"])
    for job in live:
        lp.row({"z": 1.0, **{k: -v for k, v in speed(job).items()}}, 0.0)
    x = lp.maximise({"z": 1.0})
    if x is None:
        raise s.infeasible()
    z = float(x[lp.index["z"]])
    lp2 = s.lp()
    total: dict[object, float] = {}
    for job in live:
        lp2.row({k: -v for k, v in speed(job).items()}, -z * (1 - _SLACK))
        total.update(speed(job))
    x2 = lp2.maximise(total)
    assert x2 is not None
    makespan = 1.0 / (z * scale) if z > 0 else math.inf
    return s.result("min makespan", x2, makespan)


def max_throughput_per_dollar(problem: AllocationProblem, *, min_share: float = 0.5) -> Allocation:
    """Maximise Σ_j w_j·rate_j/E_j per $/h of VMs in use (idle VMs are released, so they cost
    nothing), each job keeping at least ``min_share``·E_j. Without the floor the optimum runs only
    the single best-value job (a ratio of sums is at most its best term). Then, at that value,
    the most throughput. Needs a price > 0 for every type a job can use."""
    s = _Setup(problem)
    if not 0 <= min_share <= 1:
        raise ValueError(f"min_share must be in [0, 1], got {min_share}")
    for t in sorted({col[1][0] for col in s.cols}):
        if not problem.prices.get(t, 0.0) > 0:
            raise ValueError(
                f"VM type {t!r} has no spot price: throughput per dollar needs a price > 0 for every type "
                "in the pool; set its price_per_hour in the pool's config"
            )
    if not s.live:
        return s.empty("max throughput per dollar", 0.0)
    value: dict[object, float] = {}
    for job in s.live:
        value.update(_per_equal(s, job, job.weight))
    dollars = {col: problem.prices[col[1][0]] * col[1][1] for col in s.cols}
    # Charnes–Cooper: y' = σ·y with σ = 1 / cost(y); maximise value(y') with cost(y') = 1, and every
    # right-hand side of a row of y multiplied by σ (a column "sigma").
    cc = _LP([*s.cols, "sigma"])
    cc.row(dollars, 1.0, equal=True)
    for row, rhs in s.lp().ub:
        named = {s.cols[i]: v for i, v in row.items()}
        cc.row({**named, "sigma": -rhs}, 0.0)
    for job in s.live:
        cc.row({"sigma": min_share, **{k: -v for k, v in _per_equal(s, job).items()}}, 0.0)
    x = cc.maximise(value)
    if x is None:
        raise s.infeasible()
    best = float(sum(value.get(col, 0.0) * x[i] for i, col in enumerate(s.cols)))
    lp2 = s.lp()
    lp2.row({col: dollars[col] * best * (1 - _SLACK) - value.get(col, 0.0) for col in s.cols}, 0.0)
    for job in s.live:
        lp2.row({k: -v for k, v in _per_equal(s, job).items()}, -min_share)
    x2 = lp2.maximise(value)
    if x2 is None:  # the floors alone cannot be met at this value: keep the ratio's own solution
        sigma = float(x[cc.index["sigma"]])
        x2 = x[: len(s.cols)] / sigma
    return s.result("max throughput per dollar", x2, best)


POLICIES: dict[str, Callable[[AllocationProblem], Allocation]] = {
    "las": max_min_fairness,
    "makespan": min_makespan,
    "cost": max_throughput_per_dollar,
}


def solve(policy: str, problem: AllocationProblem) -> Allocation:
    """Run the policy named ``policy`` (a key of :data:`POLICIES`)."""
    try:
        fn = POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}") from None
    return fn(problem)
