"""The shared pool inside the daemon (``varuna-manager serve --pool``, docs/pool.md): every round,
the throughput matrix from each pool job's calibration and measurements, the policy's allocation,
the round mechanism's placements, and what each pool job is then told to run on.

Note [Pool VMs]: the pool is a capacity ledger of *slots* per VM type (``fast-0``, ``fast-1``,
...; as many as the type's capacity this round). :class:`~manager.allocation.rounds.RoundScheduler`
places jobs on slots; a job's placement is then (type, count), and the job's own VMs follow it
through the machinery single jobs use: :meth:`PoolRounds.maintain` asks the provider for VMs of
the placed type up to the count and deletes the others once no generation runs on them,
:meth:`PoolRounds.trigger` stops a generation gracefully (checkpoint) when it no longer matches
its placement, and the next generation is planned on :meth:`PoolRounds.usable` VMs only. A VM is
therefore never handed from one job to another: a job that shrinks deletes VMs, one that grows
asks its provider for new ones (on a cloud that is how spot VMs are had anyway). A round that
leaves a job's placement unchanged touches nothing.

Note [Per-type throughput]: the manager calibrates a job once, on one VM. The matrix entry of
type t at count c is auto-config's prediction from that calibration for c VMs of t's slots and
memory, times t's ``speed`` (compute relative to the calibrated VMs). That scales communication
too, so it is optimistic for a slow type and pessimistic for a fast one; the measured correction
(one factor per job × type, from the job's own progress) takes the rest.

    >>> [vm.vm_id for vm in slots({"fast": 2, "slow": 1})]
    ['fast-0', 'fast-1', 'slow-0']
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from functools import partial
from typing import Any

from manager.allocation.policies import Allocation, AllocationProblem, Job, solve
from manager.allocation.pool import PoolVM
from manager.allocation.rounds import Placement, RoundScheduler
from manager.allocation.throughput import JobProfile, ThroughputMatrix, ThroughputModel
from manager.domain.context import ManagerContext
from manager.domain.messages import PoolShare
from manager.domain.pool_config import PoolConfig
from manager.domain.pool_store import PoolJobState, PoolStore
from manager.domain.records import GenerationRecord, JobRecord, VMRecord

__all__ = ["PoolRounds", "cfg_key", "slots"]


def slots(capacity: Mapping[str, int]) -> list[PoolVM]:
    """The pool's slots this round (Note [Pool VMs])."""
    return [PoolVM(f"{t}-{i}", t) for t, n in capacity.items() for i in range(n)]


def cfg_key(vm_type: str, count: int) -> str:
    """How a configuration is written in the stored state and in ``status``."""
    return f"{count}×{vm_type}"


def _parse_cfg(key: str) -> tuple[str, int]:
    count, _, vm_type = key.partition("×")
    return vm_type, int(count)


class PoolRounds:
    """The daemon's side of the pool (module docstring). Methods other than :meth:`tick` are
    called by the manager's parts for pool jobs, under ``ctx.lock``.

    Example::

        pool = PoolRounds(ctx, load_pool_config("pool.toml"))
        with ctx.lock:
            pool.tick(now)                  # a round when one is due
        target = pool.target(job)           # ("fast", 2): where the job should run
    """

    def __init__(self, ctx: ManagerContext, config: PoolConfig | None) -> None:
        self.ctx = ctx
        self.pstore = PoolStore(ctx.store)
        stored_config, self.state = self.pstore.load()
        if config is None:
            if not stored_config:
                raise ValueError("no pool config given and none stored: start serve with --pool POOL.toml")
            try:
                config = PoolConfig.from_dict(json.loads(stored_config))
            except ValueError as exc:  # written by an older manager, before a limit existed
                raise ValueError(
                    f"the pool config stored in the state file is not valid any more: {exc};"
                    " start serve with --pool POOL.toml"
                ) from None
        self.config = config
        self.config_json = json.dumps(config.to_dict(), sort_keys=True)
        self.model = ThroughputModel([t.vm_type() for t in config.types])
        self._reasons: dict[str, str] = {}  # job -> why its placement last changed
        self._dirty = True  # membership may have changed: run a round at once
        self._failed_for: frozenset[str] | None = None
        """The jobs of the last round that failed: the same jobs wait for the next due round,
        instead of retrying (and writing a pool-error event) every tick."""
        self.pstore.save(self.config_json, self.state)

    # -- hooks for the manager's parts (the context's SharedPool: manager/domain/ports.py) -------

    #: A daemon with this object has a pool (without one, the context holds ``ports.NoPool``).
    active = True

    def is_pool(self, job: JobRecord) -> bool:
        """Whether ``job`` takes its VMs from the pool (``pool = true``)."""
        return bool(self.ctx.cache(job).spec.pool)

    def target(self, job: JobRecord) -> tuple[str, int] | None:
        """(VM type, count) the last round gave ``job``; None when it has no VMs this round."""
        s = self.state.jobs.get(job.job_id)
        if s is not None and s.vm_type and s.count:
            return s.vm_type, s.count
        if s is None and job.calibration_state in ("pending", "profiling"):
            # Not in the rounds until calibrated: one VM of the first type to profile on
            # (outside the capacity ledger; docs/pool.md).
            return self.config.types[0].name, 1
        return None

    @staticmethod
    def vm_type_of(vm: VMRecord) -> str:
        return str(vm.ref.get("vm_type", ""))

    def usable(self, job: JobRecord, vms: list[VMRecord]) -> list[VMRecord]:
        """The VMs a pool job may plan its next generation on: of its placed type, at most its
        count (lowest numbers first)."""
        t = self.target(job)
        if t is None:
            return []
        mine = sorted((vm for vm in vms if self.vm_type_of(vm) == t[0]), key=lambda vm: vm.seq)
        return mine[: t[1]]

    def trigger(
        self, job: JobRecord, gen: GenerationRecord, vms: list[VMRecord], now: float
    ) -> str | None:
        """Why a pool job's running generation must stop (graceful), or None: it runs on another
        type than its placement, on more VMs, or on fewer while the missing ones are ready."""
        t = self.target(job)
        by_id = {vm.vm_id: vm for vm in vms}
        why = self._reasons.get(job.job_id, "pool round")
        if t is None:
            return f"pool: {why}"
        types = {self.vm_type_of(by_id[v]) for v in gen.vm_ids if v in by_id}
        if types != {t[0]} or len(gen.vm_ids) > t[1]:
            return f"pool: {why}"
        if len(gen.vm_ids) < t[1] and gen.first_step_time is not None:
            ready = [
                vm for vm in self.usable(job, vms) if vm.vm_id in gen.vm_set or self.ctx.usable(vm, now, 0.0)
            ]
            starting = [vm for vm in vms if vm.state == "requested" and self.vm_type_of(vm) == t[0]]
            if len(ready) >= t[1] and not starting:
                return f"pool: {why}"
        return None

    def maintain(
        self, job: JobRecord, vms: list[VMRecord], now: float
    ) -> tuple[int, int, dict[str, Any] | None]:
        """Delete the job's VMs its placement does not use (once no generation runs on them);
        returns what :meth:`manager.domain.vm_book.VMBook.maintain_pool` asks the provider for: (VMs
        wanted, slots per VM, the type's options)."""
        ctx = self.ctx
        gen = ctx.live_generation(job)
        in_gen = gen.vm_set if gen is not None else frozenset()
        live = [vm for vm in vms if vm.state in ("requested", "up") and not vm.slow and not vm.notice]
        keep = {vm.vm_id for vm in self.usable(job, live)}
        for vm in vms:
            if vm.state in ("requested", "up") and vm.vm_id not in keep and vm.vm_id not in in_gen:
                ctx.store.update_vm(vm.vm_id, state="deleted", gone_reason="released to the pool")
                ctx.event(job.job_id, "vm-released", f"{vm.vm_id} ({self.vm_type_of(vm) or '?'}): not in the "
                          "job's pool placement", vm_id=vm.vm_id)
                ctx.actions.append(partial(ctx.provider_of(job, vm).delete_vm, vm))
        t = self.target(job)
        if t is None:
            return 0, 1, None
        ptype = self.config.type(t[0])
        options: dict[str, Any] = {**ptype.provider_options, "vm_type": t[0]}
        if ptype.speed < 1.0:
            options["vm_slowdown"] = 1.0 / ptype.speed
        return t[1] - len([v for v in live if self.vm_type_of(v) == t[0]]), ptype.slots, options

    def type_provider(self, vm_type: str) -> tuple[str, dict[str, Any]] | None:
        """(provider, options) of a pool type that names its own provider (Note [Providers in a
        pool]); None: its VMs come from each job's provider."""
        ptype = next((t for t in self.config.types if t.name == vm_type), None)
        if ptype is None or not ptype.provider:
            return None
        return ptype.provider, ptype.base_options()

    def share(self, job: JobRecord) -> PoolShare:
        """The job's place in the pool, for ``status``."""
        s = self.state.jobs.get(job.job_id) or PoolJobState()
        return PoolShare(
            vm_type=s.vm_type,
            vm_count=s.count,
            weight=float(self.ctx.cache(job).spec.weight),
            allocation=", ".join(f"{y:.2f} of {k}" for k, y in sorted(s.allocation.items())),
            predicted_samples_per_s=s.predicted,
            measured_samples_per_s=s.measured,
            round=s.round_index,
            policy=self.config.policy,
        )

    # -- rounds --------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Run a round when one is due, or at once when a pool job arrived or left."""
        active = [j for j in self.ctx.store.jobs(active_only=True) if self.is_pool(j)]
        ready = {j.job_id for j in active if self.ctx.cache(j).calibration is not None}
        if ready != set(self.state.jobs) and ready != self._failed_for:  # a job arrived or left
            self._dirty = True
        if self._dirty or now >= self.state.next_round_at:
            self.run_round(now)

    def _left(self, active: set[str]) -> set[str]:
        return {j for j in self.state.jobs if j not in active}

    def run_round(self, now: float) -> None:
        """One round: observe, solve the policy, place, record, tell (events), persist."""
        ctx, cfg = self.ctx, self.config
        self._dirty = False
        jobs = [j for j in ctx.store.jobs(active_only=True) if self.is_pool(j)]
        left = sorted(self._left({j.job_id for j in jobs}))
        for job_id in left:
            self.state.jobs.pop(job_id)
            self.model.remove_job(job_id)
        jobs = [j for j in jobs if ctx.cache(j).calibration is not None]
        trigger = self._trigger([j.job_id for j in jobs if j.job_id not in self.state.jobs], left)
        for job in jobs:
            self._add_to_model(job)
            self._observe(job)
        capacity = cfg.capacity_at(self.state.round_index)
        sched = self._scheduler()
        morph = {j.job_id: self._morph_s(j) for j in jobs}
        matrix = self.model.matrix([j.job_id for j in jobs])
        problem = AllocationProblem(
            matrix=matrix,
            capacity=capacity,
            jobs=[self._job(j) for j in jobs],
            prices={t.name: t.price_per_hour for t in cfg.types},
            current=sched.current_configs(),
            morph_s=morph,
            round_s=cfg.round_s,
        )
        try:
            alloc = solve(cfg.policy, problem) if jobs else Allocation(cfg.policy, {}, {}, 0.0)
        except ValueError as exc:
            for job in jobs:
                ctx.event(job.job_id, "pool-error", f"round {self.state.round_index}: {exc}; placements kept")
            self._failed_for = frozenset(j.job_id for j in jobs)  # again when due, or the jobs change
            self.state.next_round_at = now + cfg.round_s
            self.pstore.save(self.config_json, self.state)
            return
        fill = None if cfg.policy == "cost" else matrix  # cost releases VMs on purpose
        plan = sched.plan(alloc, slots(capacity), morph_s=morph, fill=fill)
        sched.record(plan)
        self._failed_for = None
        self._apply(jobs, alloc, plan, sched, capacity, matrix, trigger)
        self.state.round_index += 1
        self.state.next_round_at = now + cfg.round_s
        self.pstore.save(self.config_json, self.state)

    def _trigger(self, arrived: list[str], left: list[str]) -> str:
        """Why a round runs, for its ``reallocated`` events: the jobs that arrived or ended, else
        its time had come."""
        ended = []
        for job_id in left:
            job = self.ctx.store.job(job_id)
            ended.append(f"{job_id} {job.state if job is not None else 'left'}")
        return ", ".join([f"{j} arrived" for j in sorted(arrived)] + ended) or "round due"

    def _apply(self, jobs: list[JobRecord], alloc: Allocation, plan: Any, sched: RoundScheduler,
               capacity: Mapping[str, int], matrix: ThroughputMatrix, trigger: str) -> None:
        """Write the round into the state and tell every job whose placement changed (and why the
        round ran: ``trigger``)."""
        moved = {m.job_id: m for m in plan.moves}
        r = self.state.round_index
        for job in jobs:
            s = self.state.jobs.setdefault(job.job_id, PoolJobState())
            p = plan.placements.get(job.job_id)
            s.vm_type, s.vm_ids = (p.vm_type, list(p.vm_ids)) if p is not None else ("", [])
            fractions = alloc.fractions.get(job.job_id, {})
            s.allocation = {cfg_key(t, c): round(y, 6) for (t, c), y in fractions.items()}
            s.predicted = matrix.rate(job.job_id, *p.config) if p is not None else 0.0
            s.factors = self.model.factors(job.job_id)
            s.received = {cfg_key(t, c): n for (t, c), n in sched.received(job.job_id).items()}
            s.age = sched.age(job.job_id)
            s.round_index = r
            move = moved.get(job.job_id)
            if move is None:
                continue
            share = ", ".join(f"{y:.2f} of {k}" for k, y in sorted(s.allocation.items())) or "none"
            reason = f"round {r} ({self.config.policy}): {move.reason}"
            self._reasons[job.job_id] = reason
            self.ctx.event(
                job.job_id,
                "reallocated",
                f"{reason}; allocation {share}; predicted {s.predicted:.1f} examples/s; round ran: {trigger}",
                data={
                    "round": r,
                    "policy": self.config.policy,
                    "reason": move.reason,
                    "trigger": trigger,
                    "before": list(move.before) if move.before else None,
                    "after": list(move.after) if move.after else None,
                    "morph_s": move.morph_s,
                    "allocation": s.allocation,
                    "capacity": dict(capacity),
                    "predicted_samples_per_s": s.predicted,
                },
            )

    def _scheduler(self) -> RoundScheduler:
        """The round mechanism with the stored counters (the state is the one truth)."""
        current, received, age = {}, {}, {}
        for job_id, s in self.state.jobs.items():
            if s.vm_type and s.vm_ids:
                current[job_id] = Placement(job_id, s.vm_type, tuple(s.vm_ids))
            received.update({(job_id, _parse_cfg(k)): n for k, n in s.received.items()})
            age[job_id] = s.age
        return RoundScheduler(
            round_s=self.config.round_s,
            hysteresis=self.config.hysteresis,
            rounds=self.state.round_index,
            _current=current,
            _received=received,
            _age=age,
        )

    def _job(self, job: JobRecord) -> Job:
        spec = self.ctx.cache(job).spec
        remaining = max(1, spec.target_steps - job.step) * spec.global_batch_size
        return Job(job.job_id, weight=float(spec.weight), remaining=float(remaining))

    def _add_to_model(self, job: JobRecord) -> None:
        """Predict the job's rates once (Note [Per-type throughput]); restore its corrections."""
        if self.model.has_job(job.job_id):
            return
        cache = self.ctx.cache(job)
        spec = cache.spec
        self.model.add_job(JobProfile(
            job_id=job.job_id,
            global_batch_size=spec.global_batch_size,
            calibrations={t.name: cache.calibration for t in self.config.types},
            max_vms=spec.max_vms,
            schedule=spec.schedule,
        ))
        speed = {t.name: t.speed for t in self.config.types}
        rates = {(t, c): self.model.predicted(job.job_id, t, c) * speed[t]
                 for t in speed for c in range(1, spec.max_vms + 1)}
        self.model.set_predicted(job.job_id, rates)
        s = self.state.jobs.get(job.job_id)
        for t, f in (s.factors.items() if s is not None else ()):
            self.model.set_factor(job.job_id, t, f)

    def _observe(self, job: JobRecord) -> None:
        """Fold the job's measured rate on its running generation into the model."""
        gen = self.ctx.live_generation(job)
        s = self.state.jobs.get(job.job_id)
        if gen is None or s is None or gen.first_step_time is None:
            return
        types = {self.vm_type_of(vm) for vm in (self.ctx.store.vm(v) for v in gen.vm_ids) if vm is not None}
        if len(types) != 1:
            return
        measured = measured_rate(self.ctx, job, gen)
        if measured > 0:
            s.measured = measured
            self.model.observe(job.job_id, types.pop(), len(gen.vm_ids), measured)

    def _morph_s(self, job: JobRecord) -> float:
        """The job's latest measured morph latency, else the config's default."""
        resumed = self.ctx.store.events(job.job_id, kinds=["resumed"])
        for e in reversed(resumed):
            latency = (e.data or {}).get("morph_latency_s")
            if isinstance(latency, (int, float)) and math.isfinite(latency) and latency > 0:
                self.state.jobs.setdefault(job.job_id, PoolJobState()).morph_s = float(latency)
                return float(latency)
        return self.config.default_morph_s


def measured_rate(ctx: ManagerContext, job: JobRecord, gen: GenerationRecord) -> float:
    """Examples/s of ``gen`` from its progress (steps × global batch over the time between the
    first and the last reported step; 0 with fewer than two steps). Measured by the manager's
    clock, so it includes everything that slows a step (checkpoints, a slow VM)."""
    rows = [p for p in ctx.store.progress(job.job_id, last=64) if p.generation == gen.generation]
    if len(rows) < 2 or rows[-1].time <= rows[0].time:
        return 0.0
    spec = ctx.cache(job).spec
    return (rows[-1].step - rows[0].step) * spec.global_batch_size / (rows[-1].time - rows[0].time)
