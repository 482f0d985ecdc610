"""Worker reports: the per-step heartbeats of the training processes (``WorkerHeartbeat``).

They carry the job's progress (step, throughput, loss), the first step of a generation (which
ends a morph: its latency is measured here), and per-worker compute times, which feed the
fail-stutter rule (paper §4.6; :class:`manager.domain.policy.StutterDetector`).

Note [Trusted progress]: every worker can read the job's token, so a heartbeat proves only that
its sender has the token, not that it is the worker it names. One heartbeat with ``step = 10**15``
once made the next clean stop declare the job finished (issue 35). So a heartbeat counts only
when it comes from the running generation's own VMs and ranks (a VM of the generation, a rank
below the generation's bound, and the rank its agent reported running there) with a step between
0 and the job's ``target_steps``; anything else is ignored with one rate-limited line. Non-finite
loss and throughput are kept as unknown (None: a diverged step is skipped by the engine, not an
error), non-finite or negative compute times as no measurement (the fail-stutter rule skips it).
And a generation's end is judged from what *every* worker reached (:func:`stopped_at`), never
from the highest step anyone claimed (``manager.domain.generations.stopped_at``).

    >>> WorkerReports.__name__
    'WorkerReports'
"""

from __future__ import annotations

import json
import math
from typing import Any

from manager.common.log_lines import RateLimitedLines
from manager.domain.context import ManagerContext
from manager.domain.errors import ErrorKind, ManagerError
from manager.domain.messages import WorkerHeartbeat
from manager.domain.policy import predicted_compute_s
from manager.domain.records import GenerationRecord, JobRecord, ProgressRecord, WorkerStatRecord
from manager.domain.vm_types import vm_type_of
from varuna.core.calibration import Calibration

__all__ = ["MAX_COMPUTE_S", "WorkerReports"]

#: A compute time above this (seconds per micro-batch) is no measurement (Note [Trusted progress]).
MAX_COMPUTE_S = 1e6


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class WorkerReports:
    """Takes worker heartbeats: progress, morph latency, fail-stutter verdicts.

    Example::

        reports = WorkerReports(ctx)
        ok = reports.heartbeat(req)  # False: a straggler of an ended generation (it should exit)
    """

    def __init__(self, ctx: ManagerContext) -> None:
        self.ctx = ctx
        self.log = RateLimitedLines()
        """Where ignored heartbeats are said (Note [Rate-limited lines] in manager/common/log_lines.py)."""

    def heartbeat(self, req: WorkerHeartbeat) -> bool:
        """Record one worker heartbeat; False when the worker's generation has ended or the
        heartbeat is not one of its workers' (Note [Trusted progress]: ignored, with a line)."""
        ctx = self.ctx
        now = ctx.clock()
        with ctx.lock:
            job = ctx.store.job(req.job_id)
            if job is None:
                raise ManagerError(ErrorKind.NOT_FOUND, f"unknown job {req.job_id!r}")
            gen = ctx.store.generation(job.job_id, req.generation)
            if gen is None or gen.state == "ended":
                return False  # a straggler of an older generation
            why = self._untrusted(job, gen, req)
            if why is not None:
                kind, detail = why
                self.log.line(
                    (job.job_id, kind),
                    f"varuna-manager: job {job.job_id}: ignored a worker heartbeat (generation "
                    f"{gen.generation}, VM {req.vm_id!r}, rank {req.rank}, step {req.step}): {detail}",
                )
                return False
            if req.step <= req.resumed_from:
                # Started, no step yet: only the step it resumed from (a completed step) counts.
                self._advance(job, gen, req.step)
                return True
            self._record_step(job, gen, req, now)
            self._advance(job, gen, req.step)
            layout = (req.pipeline_depth, req.data_parallel)
            ctx.live.step_reported(job, gen.generation, req.step, now, layout)
            if gen.first_step_time is None and gen.state == "running":
                self._training_resumed(job, gen, req, now)
            self._check_stutter(job, gen, req)
        return True

    def _untrusted(
        self, job: JobRecord, gen: GenerationRecord, req: WorkerHeartbeat
    ) -> tuple[str, str] | None:
        """Why ``req`` is not one of ``gen``'s workers' (a kind for the rate limit, and the
        line's words), or None (Note [Trusted progress])."""
        target = self.ctx.cache(job).spec.target_steps
        bound = gen.rank_bound
        if req.vm_id not in gen.vm_set:
            return "foreign-vm", "the VM is not one of the generation's"
        if not 0 <= req.rank < bound:
            return "foreign-rank", f"the generation's ranks are 0..{bound - 1}"
        if not (0 <= req.stage < bound and 0 <= req.replica < bound):
            return "foreign-rank", f"stage {req.stage}, replica {req.replica} outside the generation"
        layout = req.pipeline_depth * req.data_parallel
        if layout > bound and req.pipeline_depth > 0:
            return "foreign-rank", f"P×D {req.pipeline_depth}×{req.data_parallel} exceeds the generation's"
        if not 0 <= req.step <= target or req.resumed_from < 0:
            return "step-range", f"steps are 0..{target} (the job's target_steps)"
        if not gen.live_json:  # live members are not launch ranks once they regroup
            vm = self.ctx.store.vm(req.vm_id)
            reported = vm is not None and vm.reported_generation == gen.generation
            ranks = {int(w["rank"]) for w in vm.workers} if vm is not None and reported else set()
            if ranks and req.rank not in ranks:
                return "foreign-rank", f"its agent runs ranks {sorted(ranks)} there"
        return None

    def _advance(self, job: JobRecord, gen: GenerationRecord, step: int) -> None:
        if step > gen.last_step:
            self.ctx.store.update_generation(job.job_id, gen.generation, last_step=step)
        if step > job.step:
            self.ctx.store.update_job(job.job_id, step=step)

    def _record_step(
        self, job: JobRecord, gen: GenerationRecord, req: WorkerHeartbeat, now: float
    ) -> None:
        store = self.ctx.store
        fwd_s, bwd_s, recompute_s = (
            (req.fwd_s, req.bwd_s, req.recompute_s) if _measured(req) else (0.0, 0.0, 0.0)
        )
        store.put_worker_stat(
            WorkerStatRecord(
                job_id=job.job_id,
                generation=gen.generation,
                rank=req.rank,
                vm_id=req.vm_id,
                stage=req.stage,
                replica=req.replica,
                step=req.step,
                resumed_from=req.resumed_from,
                time=now,
                fwd_s=fwd_s,
                bwd_s=bwd_s,
                recompute_s=recompute_s,
                micro_batch_size=req.micro_batch_size,
                first_segment=req.first_segment,
                end_segment=req.end_segment,
            )
        )
        if req.rank == 0:
            store.add_progress(
                ProgressRecord(
                    job_id=job.job_id,
                    generation=gen.generation,
                    step=req.step,
                    time=now,
                    samples_per_s=_finite(req.samples_per_s),
                    loss=_finite(req.loss),
                    pipeline_depth=gen.pipeline_depth,
                    data_parallel=gen.data_parallel,
                )
            )

    def _training_resumed(
        self, job: JobRecord, gen: GenerationRecord, req: WorkerHeartbeat, now: float
    ) -> None:
        """The generation's first step: a morph is over (its latency and redone steps logged)."""
        ctx = self.ctx
        ctx.store.update_generation(
            job.job_id, gen.generation, first_step_time=now, resumed_from=req.resumed_from
        )
        ctx.store.update_job(job.job_id, failed_launches=0, message="")
        previous = [g for g in ctx.store.generations(job.job_id) if g.generation < gen.generation]
        last_step = max((g.last_step for g in previous), default=0)
        data: dict[str, Any] = {
            "P": gen.pipeline_depth,
            "D": gen.data_parallel,
            "resumed_from": req.resumed_from,
            "first_step": req.step,
            "start_s": round(now - gen.launched, 3),
        }
        was = ""
        if previous:
            data["previous_P"], data["previous_D"] = previous[-1].pipeline_depth, previous[-1].data_parallel
            was = f" (was P={previous[-1].pipeline_depth} × D={previous[-1].data_parallel})"
        if job.detection_time is None:
            ctx.event(
                job.job_id,
                "training-started",
                f"first step {req.step} on P={gen.pipeline_depth} × D={gen.data_parallel} "
                f"{now - gen.launched:.1f} s after launch",
                generation=gen.generation,
                data=data,
            )
            return
        latency = now - job.detection_time
        redone = max(0, last_step - req.resumed_from)
        data.update(
            {
                "morph_latency_s": round(latency, 3),
                "redone_steps": redone,
                "previous_last_step": last_step,
                "reason": job.detection_reason,
            }
        )
        ctx.event(
            job.job_id,
            "resumed",
            f"training resumed at step {req.step} on P={gen.pipeline_depth} × "
            f"D={gen.data_parallel}{was}: "
            f"morph latency {latency:.1f} s (detection → first step), {redone} step(s) redone "
            f"(checkpoint {req.resumed_from}, previous generation reached {last_step}); "
            f"cause: {job.detection_reason}",
            generation=gen.generation,
            data=data,
        )
        ctx.store.update_job(job.job_id, detection_time=None, detection_reason="")

    def _predicted_s(
        self, job: JobRecord, req: WorkerHeartbeat, calibration: Calibration | None
    ) -> float | None:
        """``calibration``'s compute time for this worker's segments, when it can say.

        ``end_segment`` is the stage's last segment, included (Note [Stage ranges on the wire]
        in manager/transport/varuna_manager.proto): summing up to it excluded left one segment out, so a
        healthy stage looked slower than predicted and its VM was evicted."""
        if calibration is None or req.end_segment < req.first_segment or req.micro_batch_size <= 0:
            return None
        try:
            return predicted_compute_s(
                calibration,
                req.first_segment,
                req.end_segment,
                req.micro_batch_size,
                recompute=req.recompute_s > 0,
            )
        except (ValueError, IndexError):
            return None

    def _calibration_of(self, job: JobRecord, vm_id: str) -> Calibration | None:
        """The calibration that describes ``vm_id``: its VM type's when the job mixes types (a
        slow type is not a slow VM), else the job's."""
        cache = self.ctx.cache(job)
        vm = self.ctx.store.vm(vm_id) if cache.spec.vm_type_specs else None
        vm_type = vm_type_of(vm.ref) if vm is not None else ""
        by_type = job.type_calibrations if vm_type else {}
        if vm_type not in by_type:
            return cache.calibration
        # Parsed once per stored calibration, not on every heartbeat.
        text = json.dumps(by_type[vm_type], sort_keys=True)
        seen = cache.type_calibrations.get(vm_type)
        if seen is None or seen[0] != text:
            parsed = Calibration.from_dict(by_type[vm_type], source=f"calibration of VM type {vm_type}")
            seen = cache.type_calibrations[vm_type] = (text, parsed)
        return seen[1]

    def _check_stutter(self, job: JobRecord, gen: GenerationRecord, req: WorkerHeartbeat) -> None:
        """Fail-stutter rule (paper §4.6): compute time above the replicas' median (D ≥ 3) or the
        calibration's prediction by X % for N heartbeats in a row marks the worker's VM slow."""
        if gen.state != "running" or req.num_microbatches <= 0 or not _measured(req):
            return
        ctx = self.ctx
        cache = ctx.cache(job)
        compute_s = req.fwd_s + req.bwd_s + req.recompute_s
        predicted_s = self._predicted_s(job, req, cache.calibration)
        own_s = self._predicted_s(job, req, self._calibration_of(job, req.vm_id))
        if predicted_s and own_s and own_s != predicted_s:
            # Mixed VM types: a slow type is not a slow VM. Judge every worker in the job
            # calibration's units (its time scaled by the two types' predicted ratio), so both
            # the replicas' median and the calibration rule compare like with like.
            compute_s *= predicted_s / own_s
        # By stage: the replicas of this worker's stage, without a pass over every worker of
        # the generation (D × P of them) on each heartbeat.
        replicas = cache.compute.setdefault(gen.generation, {}).setdefault(req.stage, {})
        replicas[req.rank] = compute_s
        verdict = ctx.detector.observe(
            key=(job.job_id, gen.generation, req.rank),
            step=req.step,
            compute_s=compute_s,
            replica_compute_s=list(replicas.values()),
            predicted_s=predicted_s,
        )
        if not verdict.marked:
            return
        marked = cache.marked.setdefault(gen.generation, set())
        world = gen.pipeline_depth * gen.data_parallel
        slow_now = ctx.detector.slow_now(lambda k: k[0] == job.job_id and k[1] == gen.generation)
        if verdict.rule == "calibration" and 2 * max(slow_now, len(marked) + 1) > world:
            # Most workers slower than predicted: the calibration does not describe these VMs
            # (another VM type, another software stack); excluding them would stop the job.
            if not ctx.store.events(job.job_id, kinds=["calibration-mismatch"]):
                ctx.event(
                    job.job_id,
                    "calibration-mismatch",
                    f"{slow_now} of {world} workers are slower than the calibration predicts; "
                    "not marking VMs slow on the calibration rule (re-run varuna-profile on these VMs)",
                    generation=gen.generation,
                )
            return
        marked.add(req.rank)
        self._mark_slow(job, gen, req, compute_s, verdict.rule, verdict.reference_s)

    def _mark_slow(
        self,
        job: JobRecord,
        gen: GenerationRecord,
        req: WorkerHeartbeat,
        compute_s: float,
        rule: str,
        reference_s: float | None,
    ) -> None:
        ctx = self.ctx
        vm = ctx.store.vm(req.vm_id)
        if vm is None or vm.slow:
            return
        stutter = ctx.config.stutter
        reference = reference_s or 0.0
        reason = (
            f"rank {req.rank} (stage {req.stage}): {compute_s * 1e3:.1f} ms per micro-batch vs "
            f"{rule} {reference * 1e3:.1f} ms (> +{stutter.threshold_pct:g} %) "
            f"for {stutter.heartbeats} heartbeats"
        )
        ctx.store.update_vm(vm.vm_id, slow=1, slow_reason=reason)
        ctx.event(
            job.job_id,
            "slow",
            f"{vm.vm_id} is fail-stutter slow: {reason}; it will be left out",
            vm_id=vm.vm_id,
            generation=gen.generation,
            data={"rank": req.rank, "compute_s": compute_s, "reference_s": reference_s, "rule": rule},
        )


def _measured(req: WorkerHeartbeat) -> bool:
    """Whether the heartbeat's compute times are a measurement: finite, >= 0 and below
    :data:`MAX_COMPUTE_S` (else stored as 0 and left out of the fail-stutter rule)."""
    return all(0.0 <= t <= MAX_COMPUTE_S for t in (req.fwd_s, req.bwd_s, req.recompute_s))
