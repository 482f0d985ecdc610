"""Auto-configuration on a cluster of several VM types (issue #19): :func:`plan_mixed`.

API (stable; the manager and the launcher call it)::

    plan_mixed(cluster: Mapping[str, int],
               costs_by_type: Mapping[str, Calibration] | Calibration,
               *, global_batch_size: int, micro_batch_size: int | None = None,
               memory_by_type: Mapping[str, int] | None = None, schedule: str = "varuna",
               recompute: bool = True, host_slots: int = 1, max_layouts: int = 500,
               refine_shares: bool = True,
               pipeline_depths: Sequence[int] | None = None) -> MixedPlan

- ``cluster``: VM type name -> how many VMs (one accelerator each) of it the job may use.
- ``costs_by_type``: one calibration per type (one file per type, e.g. profiled on the first VM of
  each type; all of one model at the same micro-batch sizes; the first is the base whose sizes,
  links and all-reduce are used), or one calibration whose ``types`` section holds every type
  (docs/calibration.md, "types").
- The global batch and the micro-batch size never change with the layout (virtual nodes); m is
  chosen as ``autoconfig.choose_micro_batch_size`` chooses it when not given.

:class:`MixedPlan` holds P, D, the VM type of every stage of every replica (``stage_types``; rank
``d·P + k`` must run on a VM of type ``stage_types[d][k]``, :meth:`MixedPlan.rank_types`), the
stage ranges (one split for all replicas: a stage's parameters are all-reduced over the replicas),
each replica's micro-batch share and the predicted step time, and converts to the runtime's
configuration: :meth:`MixedPlan.run_plan` (a ``varuna.core.env.RunPlan``: ``VARUNA_STAGE_RANGES``,
``VARUNA_REPLICA_SHARES``, ``VARUNA_STAGE_SPEEDS``, m) or :meth:`MixedPlan.config_overrides`
(``VarunaConfig`` fields). ``alternatives`` holds what the planner compared against: the best plan
treating every VM as the slowest type, and the best plan on the fastest type only.

The search (docs/mixed_types.md):

1. layouts: for each depth P, replicas are sets of P VMs in some stage order (Note [Stage
   order]). Every multiset of replica kinds the cluster can hold is a layout (up to
   ``max_layouts`` per P; the homogeneous-by-speed and the striped layouts come first);
2. stage ranges: ``varuna.core.partition.balanced_stages`` with per-stage speeds (the runtime's
   partitioner), tried with each distinct replica kind's speeds and with equal speeds; kept: the
   split whose estimate (below) is best;
3. shares (Note [Shares]): proportional to each replica's speed, 1 / its slowest stage's time
   per micro-batch τ_d, as integers >= 1 summing to the micro-batch count N: one each, then each
   next micro-batch to the replica that would finish it first (n_d·τ_d plus its fill/drain);
4. every layout is estimated analytically (replica d ends no earlier than n_d·τ_d plus its
   fill/drain Σ_k t_dk − τ_d; then the slowest stage's all-reduce and optimizer step); the best
   few, and the best of each (P, D), are simulated event by event (``simulate`` with
   ``SimConfig.device_types``; the all-reduce waits for the slowest replica), and the best one's
   shares are refined by moving single micro-batches between replicas while the simulated step
   time improves.

Note [Stage order]: which type runs which stage matters beyond the split: varuna's and 1f1b's
last stage does not recompute, so the same segments cost it less, and a fast VM there can take
a larger share of the model (brute force on 5 segments, 2 fast + 2 slow VMs, a costly
all-reduce: the best single pipeline is slow, fast, slow, fast... with the last, fast stage
holding two segments). Every replica in one order rule (fastest first, slowest first, fastest
last) is tried, and when all replicas are alike, every distinct order of their types.

Note [Shares]: for identical jobs (micro-batches) on machines of different speeds, giving each
next job to the machine that would finish it earliest minimises the latest finish; that is
VirtualFlow's "more virtual nodes to faster devices" made exact for integers, and with the fill
term it accounts for a deeper or slower pipeline needing longer to fill and drain. Pure
proportional rounding can be a whole micro-batch worse: speeds (1.6, 1.6, 1, 1) and N = 8 round
to (2, 2, 2, 2), while (3, 3, 1, 1) finishes 6% sooner.

Example::

    >>> from varuna.core.calibration import Calibration
    >>> fast = Calibration.synthetic(0.005, num_segments=4, micro_batch_sizes=(1,))
    >>> slow = Calibration.synthetic(0.010, num_segments=4, micro_batch_sizes=(1,))
    >>> plan = plan_mixed({"fast": 2, "slow": 2}, {"fast": fast, "slow": slow}, global_batch_size=12)
    >>> plan.num_stages * plan.num_replicas <= 4 and sum(plan.replica_shares) == 12
    True
    >>> plan.examples_per_s > max(a.examples_per_s for a in plan.alternatives)
    True
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from simulator.autoconfig import choose_micro_batch_size
from simulator.config import SimConfig
from simulator.costs import stage_memory, sync_costs
from simulator.engine import simulate
from varuna.core.batching import microbatch_counts
from varuna.core.calibration import Calibration
from varuna.core.env import RunPlan
from varuna.core.partition import balanced_stages
from varuna.core.schedule import DEFAULT_SCHEDULE, schedule_kind

__all__ = ["MixedPlan", "MixedAlternative", "TypeCosts", "plan_mixed", "resolve_types"]

#: Layouts simulated event by event after the analytic ranking (the rest only estimated).
SIMULATED_LAYOUTS = 6
#: Layouts simulated for every (P, D) beyond those, among those estimated within
#: SHAPE_ESTIMATE_SLACK of the best estimate.
SIMULATED_PER_SHAPE = 3
SHAPE_ESTIMATE_SLACK = 1.25
#: Most stage orders tried for a layout whose replicas are alike (P! of them).
MAX_ORDERS = 24
#: Replicas at each end (latest, earliest estimated finish) a refining move takes from / gives to.
REFINE_ENDS = 3
#: Rounds of single-micro-batch moves when refining the best plan's shares.
REFINE_ROUNDS = 8


@dataclass(frozen=True)
class MixedAlternative:
    """A plan the planner compared against (simulated on the same cluster)."""

    label: str
    """"all-as-slowest" (even shares and splits, as if every VM were the slowest type) or
    "fast-only" (the fastest type's VMs only, homogeneous)."""
    num_stages: int
    num_replicas: int
    stage_types: tuple[tuple[str, ...], ...]
    stage_ranges: tuple[tuple[int, int], ...]
    replica_shares: tuple[int, ...]
    minibatch_s: float
    examples_per_s: float


@dataclass(frozen=True)
class MixedPlan:
    """What :func:`plan_mixed` chose (see the module docstring)."""

    num_stages: int
    num_replicas: int
    global_batch_size: int
    micro_batch_size: int
    schedule: str
    stage_types: tuple[tuple[str, ...], ...]
    """Per replica, per stage: the VM type (rank d·P + k runs on a VM of type stage_types[d][k])."""
    stage_ranges: tuple[tuple[int, int], ...]
    """Inclusive segment range of each stage (the same for every replica)."""
    replica_shares: tuple[int, ...]
    """Micro-batches per replica, summing to ceil(global batch / m)."""
    stage_speeds: tuple[float, ...]
    """The per-stage relative speeds the split was balanced with (``VarunaConfig.stage_speeds``)."""
    minibatch_s: float
    """Predicted (simulated) step time."""
    examples_per_s: float
    type_speeds: dict[str, float]
    """Relative speed of each type at m (F+R+B of the whole model; the slowest type = 1)."""
    alternatives: tuple[MixedAlternative, ...] = ()
    layouts_considered: int = 0
    simulations: int = 0
    notes: tuple[str, ...] = field(default=())

    @property
    def vms_used(self) -> dict[str, int]:
        """VMs of each type the plan uses."""
        out: dict[str, int] = {}
        for row in self.stage_types:
            for t in row:
                out[t] = out.get(t, 0) + 1
        return out

    def rank_types(self) -> list[str]:
        """VM type of every rank (rank = replica·P + stage), for placing hosts."""
        return [t for row in self.stage_types for t in row]

    def run_plan(self) -> RunPlan:
        """The runtime's run plan (``RunPlan.to_env()`` gives the ``VARUNA_*`` variables)."""
        return RunPlan(
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size,
            schedule=self.schedule,
            stage_ranges=self.stage_ranges,
            replica_shares=self.replica_shares,
            stage_speeds=self.stage_speeds,
        )

    def config_overrides(self) -> dict:
        """``VarunaConfig`` fields of the plan (``VarunaConfig(**fields, **overrides)``)."""
        return {
            "pipeline_depth": self.num_stages,
            "data_parallel": self.num_replicas,
            "micro_batch_size": self.micro_batch_size,
            "stage_ranges": [tuple(r) for r in self.stage_ranges],
            "replica_shares": tuple(self.replica_shares),
            "stage_speeds": tuple(self.stage_speeds),
        }

    def explain(self) -> str:
        """Several lines: the chosen map and shares, and why (against the alternatives)."""
        lines = [
            f"mixed plan: P={self.num_stages} D={self.num_replicas} m={self.micro_batch_size} "
            f"({', '.join(f'{n} {t}' for t, n in sorted(self.vms_used.items()))}): "
            f"{self.minibatch_s:.4f} s per mini-batch, {self.examples_per_s:.2f} samples/s",
            "type speeds: " + ", ".join(f"{t} {v:.3g}" for t, v in sorted(self.type_speeds.items())),
            "stage ranges: " + " ".join(f"{a}-{b}" for a, b in self.stage_ranges)
            + "  (split with stage speeds " + ",".join(f"{v:.3g}" for v in self.stage_speeds) + ")",
        ]
        for d, (row, n) in enumerate(zip(self.stage_types, self.replica_shares)):
            lines.append(f"  replica {d}: stages on {','.join(row)}, {n} micro-batch(es)")
        for a in self.alternatives:
            ratio = self.examples_per_s / a.examples_per_s if a.examples_per_s > 0 else math.inf
            lines.append(
                f"  vs {a.label}: P={a.num_stages} D={a.num_replicas} "
                f"shares {','.join(map(str, a.replica_shares))}"
                f" -> {a.examples_per_s:.2f} samples/s (this plan is {ratio:.2f}x)"
            )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "P": self.num_stages,
            "D": self.num_replicas,
            "m": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
            "schedule": self.schedule,
            "stage_types": [list(r) for r in self.stage_types],
            "stage_ranges": [list(r) for r in self.stage_ranges],
            "replica_shares": list(self.replica_shares),
            "stage_speeds": list(self.stage_speeds),
            "minibatch_s": self.minibatch_s,
            "examples_per_s": self.examples_per_s,
            "type_speeds": dict(self.type_speeds),
            "vms_used": self.vms_used,
            "layouts_considered": self.layouts_considered,
            "simulations": self.simulations,
            "alternatives": [
                {"label": a.label, "P": a.num_stages, "D": a.num_replicas,
                 "stage_types": [list(r) for r in a.stage_types], "replica_shares": list(a.replica_shares),
                 "minibatch_s": a.minibatch_s, "examples_per_s": a.examples_per_s}
                for a in self.alternatives
            ],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class TypeCosts:
    """Per type, its per-segment balancing costs at m (non-last stage, last stage)."""

    full: dict[str, list[float]]
    last: dict[str, list[float]]
    speed: dict[str, float]

    def stage_times(self, row: Sequence[str], ranges: Sequence[tuple[int, int]]) -> list[float]:
        """Seconds per micro-batch of each stage of a replica on the types ``row``."""
        P = len(ranges)
        return [
            sum((self.last if k == P - 1 else self.full)[row[k]][a : b + 1])
            for k, (a, b) in enumerate(ranges)
        ]


def resolve_types(
    cluster: Mapping[str, int], costs_by_type: Mapping[str, Calibration] | Calibration
) -> Calibration:
    """One calibration whose ``types`` hold every type of ``cluster`` (``ValueError`` naming a
    missing type or a bad count)."""
    if not cluster:
        raise ValueError("the cluster is empty; give at least one VM type with a count >= 1")
    for name, n in cluster.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"cluster count of VM type {name!r} must be an integer >= 0, got {n!r}")
    if sum(cluster.values()) < 1:
        raise ValueError("the cluster has no VMs; give at least one VM type with a count >= 1")
    if isinstance(costs_by_type, Calibration):
        cal = costs_by_type
    else:
        if not costs_by_type:
            raise ValueError("costs_by_type is empty; give one calibration per VM type")
        base = next(iter(costs_by_type.values()))
        cal = base.with_types(dict(costs_by_type))
    missing = sorted(t for t, n in cluster.items() if n > 0 and t not in cal.types)
    if missing:
        raise ValueError(
            f"no costs for VM type(s) {', '.join(missing)} (have: {', '.join(sorted(cal.types)) or 'none'}); "
            "calibrate one VM of each type (varuna-profile) or add the type to the calibration's 'types'"
        )
    return cal


def _type_costs(
    cal: Calibration, types: Sequence[str], m: int, schedule: str, recompute: bool
) -> TypeCosts:
    kind = schedule_kind(schedule)
    full, last, speed = {}, {}, {}
    for t in types:
        c = cal.for_type(t)
        n = c.num_segments
        f = [c.fwd_s(i, m) for i in range(n)]
        r = [c.recompute_s(i, m) for i in range(n)]
        b = [c.bwd_s(i, m) for i in range(n)]
        full[t], last[t] = kind.balancing_costs(f, r, b, recompute=recompute)
        speed[t] = sum(f) + sum(r) + sum(b)
    ref = max(speed.values())  # the slowest type is 1
    speed = {t: (ref / v if v > 0 else math.inf) for t, v in speed.items()}
    return TypeCosts(full=full, last=last, speed=speed)


@dataclass
class _Layout:
    rows: tuple[tuple[str, ...], ...]
    ranges: tuple[tuple[int, int], ...] = ()
    speeds: tuple[float, ...] = ()
    shares: tuple[int, ...] = ()
    estimate_s: float = math.inf
    minibatch_s: float = math.inf
    examples_per_s: float = 0.0


class _Search:
    """Shared state of one :func:`plan_mixed` call."""

    def __init__(self, cal, cluster, tc: TypeCosts, M, m, schedule, recompute, host_slots, memory):
        self.cal, self.cluster, self.tc = cal, dict(cluster), tc
        self.M, self.m, self.schedule, self.recompute = M, m, schedule, recompute
        self.kind = schedule_kind(schedule)
        self.host_slots, self.memory = host_slots, memory
        self.N = -(-M // m)
        self.simulations = 0
        self._split: dict[tuple, tuple[tuple[int, int], ...]] = {}
        self._sync: dict[tuple, float] = {}
        self._shares: dict[tuple, tuple[int, ...]] = {}
        self._times: dict[tuple, list[float]] = {}
        self.order = sorted((t for t, n in cluster.items() if n > 0), key=lambda t: (-tc.speed[t], t))
        self.base = self.order[-1]  # the slowest type's costs are the reference of the split

    allowed: list[int] | None = None

    def depths(self, vms: int) -> list[int]:
        """Pipeline depths to try with ``vms`` VMs."""
        top = min(self.cal.num_segments, vms)
        return [P for P in (self.allowed or range(1, top + 1)) if 1 <= P <= top]

    def split(self, speeds: tuple[float, ...]) -> tuple[tuple[int, int], ...]:
        if speeds not in self._split:
            full, last = self.tc.full[self.base], self.tc.last[self.base]
            sp = None if len(set(speeds)) <= 1 else list(speeds)
            self._split[speeds] = tuple(balanced_stages(full, last, len(speeds), speeds=sp))
        return self._split[speeds]

    def row_speeds(self, row: Sequence[str]) -> tuple[float, ...]:
        ref = self.tc.speed[self.base]
        return tuple(round(self.tc.speed[t] / ref, 6) for t in row)

    def stage_times(self, row: tuple[str, ...], ranges: tuple[tuple[int, int], ...]) -> list[float]:
        key = (row, ranges)
        if key not in self._times:
            self._times[key] = self.tc.stage_times(row, ranges)
        return self._times[key]

    def shares_for(self, times: Sequence[Sequence[float]]) -> tuple[int, ...] | None:
        """Micro-batches per replica: one each, then each next one to the replica that would
        finish it first (finish = n·τ + fill, Note [Shares]); None when N < D."""
        D = len(times)
        if self.N < D:
            return None
        tau = [max(t) for t in times]
        fill = [sum(t) - x for t, x in zip(times, tau)]
        key = (tuple(tau), tuple(fill))
        if key in self._shares:
            return self._shares[key]
        shares = [1] * D
        heap = [((2 * tau[d] + fill[d]), d) for d in range(D)]
        heapq.heapify(heap)
        for _ in range(self.N - D):
            _, d = heapq.heappop(heap)
            shares[d] += 1
            heapq.heappush(heap, ((shares[d] + 1) * tau[d] + fill[d], d))
        self._shares[key] = tuple(shares)
        return self._shares[key]

    def variants(self, layout: tuple[tuple[str, ...], ...], fixed_shares: tuple[int, ...] | None = None,
                 fixed_ranges: tuple[tuple[int, int], ...] | None = None) -> list[_Layout]:
        """Every (stage order, split) of ``layout`` that fits, with its shares and estimate
        (``fixed_ranges``: only the given order and ranges)."""
        P = len(layout[0])
        out: list[_Layout] = []
        for rows in [layout] if fixed_ranges is not None else self.orders(layout):
            if fixed_ranges is not None:
                options = [(tuple([1.0] * P), fixed_ranges)]
            else:
                vecs = {self.row_speeds(r) for r in rows} | {tuple([1.0] * P)}
                options = [(v, self.split(v)) for v in sorted(vecs)]
            for vec, ranges in options:
                times = [self.stage_times(r, ranges) for r in rows]
                shares = fixed_shares or self.shares_for(times)
                if shares is None or not self._fits(rows, ranges, shares):
                    continue
                if any(self.kind.unsupported(P, n) is not None for n in shares):
                    continue
                est = max(n * max(t) + sum(t) - max(t) for n, t in zip(shares, times))
                est += self.sync_s(rows, ranges, shares)
                out.append(_Layout(rows=rows, ranges=ranges, speeds=vec, shares=shares, estimate_s=est))
        return out

    def sync_s(self, rows, ranges, shares) -> float:
        """The slowest stage's all-reduce + optimizer step (types do not change it: cached)."""
        key = (len(rows), ranges)
        if key not in self._sync:
            trial = _Layout(rows=rows, ranges=ranges, shares=shares)
            sync = sync_costs(self.cal, self.config(trial), [range(a, b + 1) for a, b in ranges])
            self._sync[key] = max(ar + opt for ar, opt in sync)
        return self._sync[key]

    def orders(self, rows: tuple[tuple[str, ...], ...]) -> list[tuple[tuple[str, ...], ...]]:
        """Stage orders to try (Note [Stage order]): every replica fastest first, slowest first,
        or fastest last; where all replicas are alike, every distinct order (up to MAX_ORDERS)."""
        def fast_first(r: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(sorted(r, key=lambda t: (-self.tc.speed[t], t)))

        out = [tuple(fast_first(r) for r in rows)]
        out.append(tuple(fast_first(r)[::-1] for r in rows))
        out.append(tuple(fast_first(r)[1:] + fast_first(r)[:1] for r in rows))
        if len(set(rows)) == 1 and math.factorial(len(rows[0])) <= MAX_ORDERS:
            out.extend((p,) * len(rows) for p in sorted(set(itertools.permutations(rows[0]))))
        return list(dict.fromkeys(out))

    def _fits(self, rows, ranges, shares) -> bool:
        if not self.memory:
            return True
        P = len(ranges)
        for row, n in zip(rows, shares):
            for k, (a, b) in enumerate(ranges):
                cap = self.memory.get(row[k])
                if cap is None:
                    continue
                rec = self.kind.recomputes(P, k, recompute=self.recompute)
                stash = self.kind.stash_peak(P, k, n)
                if stage_memory(self.cal, [(a, b)], self.m, stash, rec,
                                weight_versions=self.kind.weight_versions) > cap:
                    return False
        return True

    def config(self, lay: _Layout) -> SimConfig:
        return SimConfig.for_global_batch(
            global_batch_size=self.M, num_replicas=len(lay.rows), micro_batch_size=self.m,
            shares=lay.shares, num_stages=len(lay.rows[0]), stage_segments=lay.ranges,
            schedule=self.schedule, recompute=self.recompute, host_slots=self.host_slots,
            jitter_scale=0.0, device_types=lay.rows,
        )

    def simulate(self, lay: _Layout) -> None:
        res = simulate(self.cal, self.config(lay))
        self.simulations += 1
        lay.minibatch_s, lay.examples_per_s = res.minibatch_s, res.examples_per_s

    def refine(self, lay: _Layout, rounds: int = REFINE_ROUNDS) -> None:
        """Move one micro-batch at a time between replicas while the simulated time drops: from
        one of the REFINE_ENDS replicas estimated to finish last to one of those finishing first."""
        D = len(lay.rows)
        if D < 2:
            return
        times = [self.tc.stage_times(r, lay.ranges) for r in lay.rows]
        for _ in range(rounds):
            best = None
            finish = sorted(range(D), key=lambda d: lay.shares[d] * max(times[d]) + sum(times[d]))
            late, early = finish[::-1][:REFINE_ENDS], finish[:REFINE_ENDS]
            for src, dst in itertools.product(late, early):
                if src == dst or lay.shares[src] <= 1:
                    continue
                if lay.shares[src] <= 1:
                    continue
                shares = list(lay.shares)
                shares[src] -= 1
                shares[dst] += 1
                trial = _Layout(rows=lay.rows, ranges=lay.ranges, speeds=lay.speeds, shares=tuple(shares))
                if any(self.kind.unsupported(len(lay.rows[0]), n) for n in shares) or not self._fits(
                    trial.rows, trial.ranges, trial.shares
                ):
                    continue
                self.simulate(trial)
                if trial.minibatch_s < (best or lay).minibatch_s * (1 - 1e-9):
                    best = trial
            if best is None:
                return
            lay.shares, lay.minibatch_s = best.shares, best.minibatch_s
            lay.examples_per_s = best.examples_per_s


def _layouts(order: Sequence[str], cluster: Mapping[str, int], P: int, limit: int) -> list[tuple]:
    """Multisets of replica kinds (P types each, fastest first) the cluster can hold: the
    speed-sorted and striped ones first, then every other (up to ``limit``)."""
    vms = [t for t in order for _ in range(cluster[t])]
    rank = {t: i for i, t in enumerate(order)}
    out: list[tuple] = []
    seen: set = set()

    def add(rows) -> None:
        key = tuple(sorted(tuple(sorted(r, key=rank.__getitem__)) for r in rows))
        if key not in seen:
            seen.add(key)
            out.append(key)

    for D in range(1, len(vms) // P + 1):
        add([vms[d * P : (d + 1) * P] for d in range(D)])  # fastest VMs, grouped by speed
        use = vms[: D * P]
        add([use[d::D] for d in range(D)])  # striped: every replica alike
    kinds = list(itertools.combinations_with_replacement(order, P))

    def rec(start: int, left: dict, rows: list) -> bool:
        if rows:
            add(rows)
            if len(out) >= limit:
                return False
        for i in range(start, len(kinds)):
            need: dict = {}
            for t in kinds[i]:
                need[t] = need.get(t, 0) + 1
            if all(left[t] >= n for t, n in need.items()):
                for t, n in need.items():
                    left[t] -= n
                ok = rec(i, left, rows + [kinds[i]])
                for t, n in need.items():
                    left[t] += n
                if not ok:
                    return False
        return True

    rec(0, dict(cluster), [])
    return out


def plan_mixed(
    cluster: Mapping[str, int],
    costs_by_type: Mapping[str, Calibration] | Calibration,
    *,
    global_batch_size: int,
    micro_batch_size: int | None = None,
    memory_by_type: Mapping[str, int] | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    recompute: bool = True,
    host_slots: int = 1,
    max_layouts: int = 500,
    refine_shares: bool = True,
    pipeline_depths: Sequence[int] | None = None,
) -> MixedPlan:
    """The fastest plan for a cluster of several VM types (see the module docstring).

    ``memory_by_type`` (bytes per accelerator; default: each type's ``memory_bytes`` in the
    calibration, unchecked where unknown) rules out layouts whose stages would not fit.
    ``pipeline_depths`` restricts P (the alternatives too); default: 1 to min(segments, VMs).
    ``ValueError`` (one line, with the fix) when nothing can run.
    """
    kind = schedule_kind(schedule)
    if kind.chunked:
        raise ValueError(
            f"plan_mixed plans one model chunk per device; use varuna, gpipe or 1f1b, not {schedule}"
        )
    if global_batch_size < 1:
        raise ValueError(f"global batch size must be >= 1, got {global_batch_size}")
    cal = resolve_types(cluster, costs_by_type)
    m = micro_batch_size or choose_micro_batch_size(cal)
    cal.fwd_s(0, m)  # the "calibration lacks m=..." error, before any search
    present = [t for t, n in cluster.items() if n > 0]
    memory = {t: v.memory_bytes for t, v in cal.types.items() if v.memory_bytes is not None}
    memory.update(memory_by_type or {})
    tc = _type_costs(cal, present, m, schedule, recompute)
    s = _Search(cal, {t: cluster[t] for t in present}, tc, global_batch_size, m, schedule, recompute,
                host_slots, memory)
    s.allowed = None if pipeline_depths is None else sorted({int(p) for p in pipeline_depths})
    total = sum(s.cluster.values())
    candidates: list[_Layout] = []
    considered = 0
    notes: list[str] = []
    for P in s.depths(total):
        rows_list = _layouts(s.order, s.cluster, P, max_layouts)
        if len(rows_list) >= max_layouts:
            notes.append(f"P={P}: layouts capped at {max_layouts} (max_layouts)")
        for rows in rows_list:
            if len(rows) > s.N:
                continue
            considered += 1
            candidates.extend(s.variants(tuple(rows)))
    if not candidates:
        raise ValueError(
            f"no layout of {dict(cluster)} runs global batch {global_batch_size} at m={m} within each "
            "type's memory; use VMs with more memory, a smaller micro-batch size or more cut-points"
        )
    best = _simulate_best(s, candidates)
    alternatives = _alternatives(s)
    if refine_shares:
        s.refine(best)
    return MixedPlan(
        num_stages=len(best.rows[0]), num_replicas=len(best.rows), global_batch_size=global_batch_size,
        micro_batch_size=m, schedule=schedule, stage_types=best.rows, stage_ranges=best.ranges,
        replica_shares=best.shares, stage_speeds=best.speeds, minibatch_s=best.minibatch_s,
        examples_per_s=best.examples_per_s, type_speeds=dict(tc.speed), alternatives=alternatives,
        layouts_considered=considered, simulations=s.simulations, notes=tuple(notes),
    )


def _simulate_best(s: _Search, candidates: list[_Layout]) -> _Layout:
    """Simulate the best few by estimate, and the best few of every (P, D): the estimate ranks
    shapes against each other less well than layouts of one shape (bubbles, the all-reduce's
    overlap). Returns the fastest simulated."""
    candidates.sort(key=lambda c: c.estimate_s)
    chosen = candidates[:SIMULATED_LAYOUTS]
    per_shape: dict[tuple[int, int], int] = {}
    cutoff = candidates[0].estimate_s * SHAPE_ESTIMATE_SLACK
    for c in candidates:
        shape = (len(c.rows[0]), len(c.rows))
        if c.estimate_s > cutoff:
            break
        if c in chosen or per_shape.get(shape, 0) < SIMULATED_PER_SHAPE:
            if c not in chosen:
                chosen.append(c)
            per_shape[shape] = per_shape.get(shape, 0) + 1
    for lay in chosen:
        s.simulate(lay)
    return min(chosen, key=lambda c: c.minibatch_s)


def _alternatives(s: _Search) -> tuple[MixedAlternative, ...]:
    """The best plan treating every VM as the slowest type (even shares, an even split, every
    VM used), and the best on the fastest type only; both simulated on the real types."""
    out = []
    fast = s.order[0]
    total = sum(s.cluster.values())
    vms = [t for t in s.order for _ in range(s.cluster[t])]
    for label, pool in (("all-as-slowest", vms), ("fast-only", [fast] * s.cluster[fast])):
        if label == "fast-only" and len(s.order) == 1:
            continue
        best = None
        for P in s.depths(len(pool)):
            D = len(pool) // P if label == "fast-only" else total // P
            if D < 1 or D > s.N:
                continue
            rows = tuple(tuple(pool[d * P : (d + 1) * P]) for d in range(D))
            counts, _ = microbatch_counts(s.M, s.m, D)
            found = s.variants(rows, fixed_shares=counts, fixed_ranges=s.split(tuple([1.0] * P)))
            if not found:
                continue
            lay = found[0]
            s.simulate(lay)
            if best is None or lay.minibatch_s < best.minibatch_s:
                best = lay
        if best is not None:
            out.append(MixedAlternative(
                label=label, num_stages=len(best.rows[0]), num_replicas=len(best.rows), stage_types=best.rows,
                stage_ranges=best.ranges, replica_shares=best.shares, minibatch_s=best.minibatch_s,
                examples_per_s=best.examples_per_s,
            ))
    return tuple(out)
