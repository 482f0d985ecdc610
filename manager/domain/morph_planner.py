"""Morph planning: which P×D to run on the usable VMs, and whether growing onto new VMs pays
(what each VM of a generation then runs is :mod:`manager.domain.launches`').

The decisions themselves are the pure functions of :mod:`manager.domain.policy` (the simulator's
auto-config, for the schedule the job runs, or the fallback rule); this part feeds them the
job's state and caches their answers per set of VMs. It is the :class:`~manager.domain.ports.Planner`
of the other parts.

    >>> MorphPlanner.__name__
    'MorphPlanner'
"""

from __future__ import annotations

import dataclasses

from manager.domain.context import ManagerContext
from manager.domain.policy import LayoutPlan, choose_layout, grow_gain
from manager.domain.ports import Placement
from manager.domain.records import GenerationRecord, JobRecord, VMRecord
from manager.domain.vm_types import vm_type_of
from varuna.core.calibration import Calibration
from varuna.core.planning import PlanRequest
from varuna.launch.mixed import place_ranks, plan_cluster

__all__ = ["MorphPlanner"]


class MorphPlanner:
    """P×D for a job on given VMs and the grow rule. Callers hold ``ctx.lock``.

    Example::

        planner = MorphPlanner(ctx)
        plan = planner.plan(job, [vm.slots for vm in usable])  # ValueError when nothing fits
        placement = planner.place(job, usable)                 # the layout and its VMs
    """

    def __init__(self, ctx: ManagerContext) -> None:
        self.ctx = ctx

    def plan(self, job: JobRecord, slots: list[int]) -> LayoutPlan:
        """The layout for VMs with ``slots`` workers each (cached: the answer only changes with the
        calibration, which clears the cache). ``ValueError`` (one line) when nothing fits."""
        cache = self.ctx.cache(job)
        key = tuple(slots)
        if key not in cache.plans:
            spec = cache.spec
            try:
                request = PlanRequest(
                    calibration=cache.calibration,
                    global_batch_size=spec.global_batch_size,
                    micro_batch_size=spec.micro_batch_size or None,
                    pipeline_depth=spec.pipeline_depth or None,
                    gpu_memory_bytes=int(spec.gpu_memory_gib * 2**30) or None,
                    schedule=spec.schedule,
                    chunks=spec.chunks or 1,
                )
                cache.plans[key] = choose_layout(slots=slots, request=request, num_segments=spec.num_segments)
            except ValueError as exc:
                cache.plans[key] = str(exc)
        plan = cache.plans[key]
        if isinstance(plan, str):
            raise ValueError(plan)
        return plan

    def place(self, job: JobRecord, vms: list[VMRecord]) -> Placement:
        """The layout for the usable ``vms`` and the VMs it runs on; with mixed VM types also the
        stage→type map, the ranks' hosts, the shares and the stage speeds (:meth:`_mixed`).
        ``ValueError`` (one line) when nothing fits."""
        if self.ctx.cache(job).spec.vm_type_specs:
            return self._mixed(job, vms)
        plan = self.plan(job, [vm.slots for vm in vms])
        chosen: list[VMRecord] = []
        for vm in vms:
            if sum(v.slots for v in chosen) >= plan.world_size:
                break
            chosen.append(vm)
        return Placement(plan=plan, vms=chosen)

    def _mixed(self, job: JobRecord, vms: list[VMRecord]) -> Placement:
        """Mixed VM types, cached per (slots, types) like :meth:`plan`."""
        cache = self.ctx.cache(job)
        types = [vm_type_of(vm.ref) for vm in vms]
        key = ("mixed", tuple(vm.slots for vm in vms), tuple(types))
        if key not in cache.plans:
            try:
                cache.plans[key] = self._mixed_plan(job, vms, types)
            except ValueError as exc:
                cache.plans[key] = str(exc)
        entry = cache.plans[key]
        if isinstance(entry, str):
            raise ValueError(entry)
        plan, order, mixed_info = entry
        return Placement(plan=plan, vms=[vms[i] for i in order], mixed=mixed_info)

    def _mixed_plan(
        self, job: JobRecord, vms: list[VMRecord], types: list[str]
    ) -> tuple[LayoutPlan, list[int], dict]:
        """The adapter to the planner (``varuna.launch.mixed.plan_cluster``): with a calibration
        (each type's own when profiled per type, Note [Calibration per VM type]) the simulator's
        mixed auto-config chooses P (unless forced), D, m, the map, the ranges and the shares;
        without one P×D is :meth:`plan`'s and the types' declared speeds place and share."""
        cache = self.ctx.cache(job)
        spec = cache.spec
        speeds = {t.name: t.speed for t in spec.vm_type_specs}
        slot_types = [t for t, vm in zip(types, vms) for _ in range(vm.slots)]
        by_type = {t: Calibration.from_dict(d, source=f"calibration of VM type {t}")
                   for t, d in job.type_calibrations.items()}
        if cache.calibration is not None:
            mixed = plan_cluster(
                slot_types,
                speeds,
                calibration=cache.calibration,
                costs_by_type=by_type,
                global_batch_size=spec.global_batch_size,
                micro_batch_size=spec.micro_batch_size or None,
                pipeline_depth=spec.pipeline_depth or None,
                schedule=spec.schedule,
                host_slots=max(vm.slots for vm in vms),
                gpu_memory_bytes=int(spec.gpu_memory_gib * 2**30) or None,
            )
            plan = LayoutPlan(
                pipeline_depth=mixed.pipeline_depth,
                data_parallel=mixed.data_parallel,
                micro_batch_size=mixed.micro_batch_size or 0,
                predicted_samples_per_s=mixed.examples_per_s,
                source=f"simulator, mixed VM types: {mixed.describe()}",
            )
        else:
            plan = self.plan(job, [vm.slots for vm in vms])
            m = plan.micro_batch_size or spec.micro_batch_size
            mixed = plan_cluster(
                slot_types,
                speeds,
                calibration=None,
                global_batch_size=spec.global_batch_size,
                micro_batch_size=m or None,
                pipeline_depth=plan.pipeline_depth,
                data_parallel=plan.data_parallel,
            )
            # The homogeneous prediction is for VMs of speed 1; the mix runs at its relative rate.
            factor = mixed.relative_rate / (plan.pipeline_depth * plan.data_parallel)
            plan = dataclasses.replace(
                plan,
                predicted_samples_per_s=plan.predicted_samples_per_s * factor,
                source=f"{plan.source}; mixed VM types: {mixed.describe()}",
            )
        placed = place_ranks(mixed, [(t, vm.slots) for t, vm in zip(types, vms)])
        order = list(dict.fromkeys(placed))  # rank 0's VM first: it hosts the rendezvous
        info = {
            "rank_hosts": [order.index(i) for i in placed],
            "rank_types": list(mixed.rank_types),
            "replica_shares": list(mixed.replica_shares) if mixed.replica_shares else None,
            "stage_speeds": list(mixed.stage_speeds) if mixed.stage_speeds else None,
            "stage_ranges": [list(r) for r in mixed.stage_ranges] if mixed.stage_ranges else None,
            "plan": mixed.describe(),
        }
        return plan, order, info

    def grow_trigger(
        self, job: JobRecord, gen: GenerationRecord, vms: list[VMRecord], now: float
    ) -> str | None:
        """Why to morph onto usable VMs outside the running generation, or None: only after the
        cool-down, once no VM of the same request is still booting, and when the predicted gain
        is worth a morph."""
        ctx, cfg = self.ctx, self.ctx.config
        if gen.first_step_time is None or now - gen.first_step_time < cfg.grow_cooldown_s:
            return None
        extra = [vm for vm in vms if vm.vm_id not in gen.vm_set and ctx.usable(vm, now, since=0.0)]
        typed = bool(ctx.cache(job).spec.vm_type_specs)
        if typed and ctx.cache(job).profile is not None:
            # A type not calibrated yet joins at the next morph, after its calibration.
            done = job.type_calibrations
            extra = [vm for vm in extra if vm_type_of(vm.ref) in done]
        if not extra:
            return None
        starting = [vm for vm in vms if vm.state == "requested" and now - vm.created < cfg.gather_timeout_s]
        if starting:
            # VMs of the same request are still booting: let them join first (at most the gather
            # timeout), so that capacity coming back costs one morph, not one per VM.
            ctx.set_message(job, f"{len(extra)} new VM(s) ready, {len(starting)} still starting: grow waits")
            return None
        ctx.set_message(job, "")
        extra_ids = {vm.vm_id for vm in extra}
        candidates = [
            vm for vm in vms if (vm.vm_id in gen.vm_set and ctx.healthy(vm, now)) or vm.vm_id in extra_ids
        ]
        try:
            plan = self.place(job, candidates).plan
        except ValueError:
            return None
        gain = grow_gain(gen.predicted_samples_per_s, plan)
        # With mixed types a faster VM may pay at the same P×D (it takes a slow one's place).
        bigger = typed or plan.world_size > gen.pipeline_depth * gen.data_parallel
        if bigger and gain * 100 >= cfg.grow_min_gain_pct:
            return (
                f"grow: {len(extra)} new VM(s); P={plan.pipeline_depth} × D={plan.data_parallel} predicted "
                f"{gain * 100:+.0f} % over P={gen.pipeline_depth} × D={gen.data_parallel}"
            )
        return None
