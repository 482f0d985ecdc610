"""The round-based mechanism (Gavel §5): every round, turn a fractional allocation into concrete
VMs, so that over many rounds each job gets the time fractions the policy chose.

Each round, for every job j and configuration cfg with y[j, cfg] > 0, the rounds it is owed are

    owed[j, cfg] = y[j, cfg]·(rounds j has been in the pool + 1) − rounds j already ran on cfg

(Gavel orders by y / fraction received; the difference form stays finite for a job that has had
nothing yet, and keeps a job's history when the allocation changes). A configuration other than
the job's current one is owed ``hysteresis + morph_s/round_s`` rounds less: a move must make up
for the morph it costs and then some, so a job split 50/50 between two configurations alternates
every few rounds rather than every round (Note [Staying put]). Configurations are granted in
decreasing order of what they are owed, one per job, while the type has VMs free.

Concrete VMs: a job that keeps its type keeps the VMs it has (lowest ids first when it shrinks);
the rest come from the free VMs, lowest id first, so the same inputs give the same VMs. Any
change of a job's VM set is a morph and is charged the job's ``morph_s`` (a start as well: the
launch and checkpoint load cost the same); a job whose VM was preempted keeps the rest and is
charged for the morph it cannot avoid.

    >>> from manager.allocation.policies import Allocation
    >>> from manager.allocation.pool import PoolVM
    >>> alloc = Allocation("x", {"a": {("k80", 1): 1.0}}, {"a": 1.0}, 0.0)
    >>> sched = RoundScheduler(round_s=60.0)
    >>> plan = sched.plan(alloc, [PoolVM("k-1", "k80"), PoolVM("k-0", "k80")])
    >>> plan.placements["a"].vm_ids, plan.moves[0].reason
    (('k-0',), 'started on 1 × k80')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from manager.allocation.policies import Allocation
from manager.allocation.pool import PoolVM
from manager.allocation.throughput import Config, ThroughputMatrix

__all__ = ["Move", "Placement", "RoundPlan", "RoundScheduler"]


@dataclass(frozen=True)
class Placement:
    """A job's VMs for one round (all of one type)."""

    job_id: str
    vm_type: str
    vm_ids: tuple[str, ...]

    @property
    def config(self) -> Config:
        return (self.vm_type, len(self.vm_ids))


@dataclass(frozen=True)
class Move:
    """A change of a job's VMs between two rounds: one morph (or a start, or a stop)."""

    job_id: str
    before: Config | None
    after: Config | None
    morph_s: float
    """What the move costs the job this round (0 for a stop)."""
    reason: str
    """For ``events``: what changed and why."""


@dataclass(frozen=True)
class RoundPlan:
    """One round's decision."""

    round_index: int
    placements: Mapping[str, Placement]
    moves: tuple[Move, ...]
    idle: Mapping[str, int]
    """Free VMs per type this round."""
    jobs: tuple[str, ...] = ()
    """The jobs the allocation gave anything (placed or not): their rounds in the pool count."""

    @property
    def morph_s(self) -> float:
        """Total morph time charged this round."""
        return sum(m.morph_s for m in self.moves)


# Note [Staying put]: with hysteresis h (rounds) and a morph costing m of a round, a job whose
# allocation is unchanged and already realised is owed ≈ 0 on its current configuration and at
# most y·1 − h − m < 0 elsewhere, so it stays; a job moves only when it is owed more than h + m
# rounds on another configuration than on its own. h = 0.5 keeps a 50/50 split from morphing every
# round (it alternates every two) while the long-run fractions still converge to y.


@dataclass
class RoundScheduler:
    """Keeps the rounds each job has run on each configuration and plans the next round.

    Example::

        sched = RoundScheduler(round_s=360)
        plan = sched.plan(allocation, pool_vms, morph_s={"a": 40.0})
        ...  # apply plan.placements (morph the jobs in plan.moves)
        sched.record(plan)            # once the round has run
    """

    round_s: float = 360.0
    hysteresis: float = 0.5
    rounds: int = 0
    _current: dict[str, Placement] = field(default_factory=dict)
    _received: dict[tuple[str, Config], int] = field(default_factory=dict)
    _age: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.round_s > 0:
            raise ValueError(f"round_s must be > 0, got {self.round_s}")
        if self.hysteresis < 0:
            raise ValueError(f"hysteresis must be >= 0, got {self.hysteresis}")

    @property
    def current(self) -> Mapping[str, Placement]:
        """Where each job ran in the last recorded round."""
        return dict(self._current)

    def current_configs(self) -> dict[str, Config]:
        return {j: p.config for j, p in self._current.items()}

    def received(self, job_id: str) -> dict[Config, int]:
        """Rounds ``job_id`` ran per configuration."""
        return {cfg: n for (j, cfg), n in self._received.items() if j == job_id}

    def age(self, job_id: str) -> int:
        """Rounds ``job_id`` has been in the pool."""
        return self._age.get(job_id, 0)

    def forget(self, job_id: str) -> None:
        """Drop a finished or cancelled job (its VMs are free from the next plan)."""
        self._current.pop(job_id, None)
        self._age.pop(job_id, None)
        for k in [k for k in self._received if k[0] == job_id]:
            del self._received[k]

    def owed(self, allocation: Allocation, job: str, cfg: Config, morph_s: float = 0.0) -> float:
        """Rounds ``job`` is owed on ``cfg`` if it ran there next round, less the cost of moving."""
        y = allocation.fractions.get(job, {}).get(cfg, 0.0)
        owed = y * (self._age.get(job, 0) + 1) - self._received.get((job, cfg), 0)
        here = self._current.get(job)
        if here is not None and here.config != cfg:
            owed -= self.hysteresis + morph_s / self.round_s
        return owed

    def plan(
        self,
        allocation: Allocation,
        vms: Sequence[PoolVM],
        *,
        morph_s: Mapping[str, float] | None = None,
        fill: ThroughputMatrix | None = None,
    ) -> RoundPlan:
        """The next round's placements for the VMs alive now (``vms``). With ``fill`` (the rates the
        allocation was made from), VMs the allocation leaves free go to jobs it could not place
        this round, each at its fastest configuration that fits (work conservation: an idle VM
        helps nobody; the rounds it runs count like any other)."""
        morph_s = morph_s or {}
        free: dict[str, int] = {}
        for vm in vms:
            free[vm.vm_type] = free.get(vm.vm_type, 0) + 1
        wanted = [
            (j, cfg) for j, row in allocation.fractions.items() for cfg, y in row.items() if y > 0
        ]
        # Most owed first; ties: the job's current configuration, then the larger fraction, then
        # names (deterministic).
        wanted.sort(key=lambda jc: (
            -self.owed(allocation, jc[0], jc[1], morph_s.get(jc[0], 0.0)),
            self._current.get(jc[0]) is None or self._current[jc[0]].config != jc[1],
            -allocation.fractions[jc[0]][jc[1]],
            jc,
        ))
        chosen: dict[str, Config] = {}
        for job, (t, c) in wanted:
            if job not in chosen and free.get(t, 0) >= c:
                chosen[job] = (t, c)
                free[t] -= c
        if fill is not None:
            for job in dict.fromkeys(j for j, _ in wanted):  # most owed first
                if job in chosen:
                    continue
                here = self._current.get(job)
                keep = max(0.0, 1.0 - morph_s.get(job, 0.0) / self.round_s)
                # Its current configuration if that fits, unless another is worth the morph.
                fits = [
                    (fill.rate(job, *cfg) * (1.0 if here is not None and here.config == cfg else keep), cfg)
                    for cfg in fill.configs(job)
                    if free.get(cfg[0], 0) >= cfg[1]
                ]
                if fits:
                    _, cfg = max(fits, key=lambda rc: (rc[0], -rc[1][1], rc[1][0]))
                    chosen[job] = cfg
                    free[cfg[0]] -= cfg[1]
        placements = self._assign(chosen, vms)
        moves = self._moves(placements, morph_s, {vm.vm_id for vm in vms})
        jobs = tuple(sorted({j for j, _ in wanted}))
        return RoundPlan(self.rounds, placements, moves, free, jobs)

    def plan_fixed(
        self, placements: Mapping[str, Placement], vms: Sequence[PoolVM], *,
        morph_s: Mapping[str, float] | None = None,
    ) -> RoundPlan:
        """A round whose placements were decided elsewhere (a baseline such as FIFO, an operator):
        the same moves, costs and accounting as :meth:`plan`."""
        free: dict[str, int] = {}
        for vm in vms:
            free[vm.vm_type] = free.get(vm.vm_type, 0) + 1
        for p in placements.values():
            free[p.vm_type] = free.get(p.vm_type, 0) - len(p.vm_ids)
        moves = self._moves(placements, morph_s or {}, {vm.vm_id for vm in vms})
        return RoundPlan(self.rounds, dict(placements), moves, free, tuple(sorted(placements)))

    def _assign(self, chosen: Mapping[str, Config], vms: Sequence[PoolVM]) -> dict[str, Placement]:
        """Concrete VMs: jobs keep what they hold of their type, the rest from the free VMs."""
        alive = {vm.vm_id: vm.vm_type for vm in vms}
        taken: dict[str, list[str]] = {}
        for job, (t, c) in sorted(chosen.items()):
            here = self._current.get(job)
            mine = sorted(v for v in (here.vm_ids if here else ()) if alive.get(v) == t)
            taken[job] = mine[:c]
        used = {v for ids in taken.values() for v in ids}
        pool = sorted((vm.vm_id for vm in vms if vm.vm_id not in used), key=_id_order)
        out = {}
        for job, (t, c) in sorted(chosen.items()):
            need = c - len(taken[job])
            extra = [v for v in pool if alive[v] == t][:need]
            pool = [v for v in pool if v not in extra]
            out[job] = Placement(job, t, tuple(sorted(taken[job] + extra, key=_id_order)))
        return out

    def _moves(
        self, placements: Mapping[str, Placement], morph_s: Mapping[str, float], alive: set[str]
    ) -> tuple[Move, ...]:
        moves = []
        for job in sorted(set(placements) | set(self._current)):
            old, new = self._current.get(job), placements.get(job)
            if old is not None and new is not None and set(old.vm_ids) == set(new.vm_ids):
                continue
            cost = morph_s.get(job, 0.0) if new is not None else 0.0
            if old is None:
                assert new is not None
                why = f"started on {new.config[1]} × {new.vm_type}"
            elif new is None:
                why = f"paused: no VMs this round (was {old.config[1]} × {old.vm_type})"
            else:
                lost = [v for v in old.vm_ids if v not in alive]
                why = (f"{old.config[1]} × {old.vm_type} → {new.config[1]} × {new.vm_type}"
                       + (f" ({', '.join(lost)} preempted)" if lost else " (allocation)"))
            moves.append(Move(job, old.config if old else None, new.config if new else None, cost, why))
        return tuple(moves)

    def record(self, plan: RoundPlan) -> None:
        """The round ran as planned: count it for every job it placed and every job it left out
        that the allocation included (``age`` counts rounds in the pool)."""
        for job in set(self._age) | set(plan.placements) | set(plan.jobs):
            self._age[job] = self._age.get(job, 0) + 1
        for job, p in plan.placements.items():
            self._received[(job, p.config)] = self._received.get((job, p.config), 0) + 1
        self._current = dict(plan.placements)
        self.rounds += 1


def _id_order(vm_id: str) -> tuple:
    """Natural order of VM ids (``k-2`` before ``k-10``), so 'lowest id first' reads as expected."""
    head, _, tail = vm_id.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (vm_id, -1)
