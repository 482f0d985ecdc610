"""Calibration at job start: the PROFILE orders and their results (Note [Calibration at job
start] in manager/domain/controller.py).

A job whose spec has ``[profile]`` and no calibration file is calibrated once, on its first
usable VM (Note [Calibration per VM type]: once per type, on the first VM of each, when the job
has ``[[vm_types]]``): the VM's agent runs ``varuna-profile`` and sends the file back with
``ReportCalibration``. Everything is kept in the job's row, so a restarted manager re-sends the
same attempt and reuses a stored result.

Note [Calibration per VM type]: a job with several VM types is profiled once per type, on the
first usable VM of that type, one type at a time (the same attempt/VM/deadline state machine in
the job row, with ``calibration_type`` naming the type; between types the state is ``pending``
again). Each result is kept in ``type_calibrations_json``; the first also becomes the job's
calibration. The job is planned once every type among its usable VMs is calibrated; a type that
first appears later is calibrated before the next launch (its VMs join at that morph).

    >>> CALIBRATION_SETTLED
    ('given', 'none', 'done', 'failed')
"""

from __future__ import annotations

import json
import shlex

from manager.domain.context import ManagerContext
from manager.domain.jobspec import ProfileSpec
from manager.domain.messages import CalibrationReply, CalibrationReport, ProfileOrder
from manager.domain.records import JobRecord, VMRecord
from manager.domain.vm_types import vm_type_of
from varuna.core.calibration import Calibration

__all__ = ["CALIBRATION_MAX_ATTEMPTS", "CALIBRATION_SETTLED", "CalibrationOrders"]

#: Profiling attempts per job: a VM lost during the run re-issues it on another one, this often.
CALIBRATION_MAX_ATTEMPTS = 3
#: Calibration states after which the job may be planned (Note [Calibration at job start]).
CALIBRATION_SETTLED = ("given", "none", "done", "failed")


class CalibrationOrders:
    """Drives each job's calibration: orders the profile, takes its report, gives up when it
    cannot succeed. Callers hold ``ctx.lock``.

    Example::

        orders = CalibrationOrders(ctx)
        if orders.ready(job, vms, now):  # True once the job may be planned
            ...
    """

    def __init__(self, ctx: ManagerContext) -> None:
        self.ctx = ctx

    # -- the agent's report --------------------------------------------------------------------

    def report(self, req: CalibrationReport, vm: VMRecord) -> CalibrationReply:
        """An agent's result of a PROFILE order. Only the job's current attempt, from the VM it
        was ordered on, is taken; anything else is answered ``accepted=False`` and ignored."""
        ctx = self.ctx
        now = ctx.clock()
        job = ctx.store.job(vm.job_id)
        if job is None or job.terminal:
            return CalibrationReply(accepted=False, message="the job is over")
        current = (
            job.calibration_state == "profiling"
            and job.calibration_attempt == req.attempt
            and job.calibration_vm == vm.vm_id
        )
        if not current:
            return CalibrationReply(
                accepted=False,
                message=f"attempt {req.attempt} is not current (job calibration {job.calibration_state}, "
                f"attempt {job.calibration_attempt} on {job.calibration_vm or '-'}); ignored",
            )
        where = f"on {vm.vm_id} after {req.wall_s:.1f} s"
        if not req.ok:
            reason = (req.error or "varuna-profile failed").splitlines()[0]
            self.failed(job, f"{reason} ({where})", vm_id=vm.vm_id, wall_s=req.wall_s)
            return CalibrationReply(accepted=True, message="failure recorded")
        try:
            cal = Calibration.from_dict(
                json.loads(req.calibration_json), source=f"calibration profiled on {vm.vm_id}"
            )
        except (ValueError, TypeError, KeyError) as exc:  # JSONDecodeError is a ValueError
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            reason = f"invalid calibration file: {detail}"
            self.failed(job, f"{reason} ({where})", vm_id=vm.vm_id, wall_s=req.wall_s)
            return CalibrationReply(accepted=True, message="invalid calibration recorded")
        self._store_result(job, req, vm, cal, now)
        return CalibrationReply(accepted=True, message="stored")

    def _store_result(
        self, job: JobRecord, req: CalibrationReport, vm: VMRecord, cal: Calibration, now: float
    ) -> None:
        ctx = self.ctx
        source = f"profiled on {vm.vm_id} in {req.wall_s:.1f} s"
        cache = ctx.cache(job)
        values: dict[str, object] = {"calibration_state": "done", "calibration_source": source}
        vm_type = job.calibration_type if cache.spec.vm_type_specs else ""
        if vm_type:
            # Every type's own file; the first one also stands for the job (what the P×D choice
            # reads until the planner takes costs per type), and the next type may follow.
            by_type = {**job.type_calibrations, vm_type: json.loads(req.calibration_json)}
            values["type_calibrations_json"] = json.dumps(by_type)
            values["calibration_state"] = "pending"
            values["calibration_source"] = "profiled per VM type: " + ", ".join(by_type)
            if not job.calibration_json:
                values["calibration_json"] = req.calibration_json
                cache.calibration = cal
        else:
            values["calibration_json"] = req.calibration_json
            cache.calibration = cal
        ctx.store.update_job(job.job_id, **values)
        cache.plans.clear()
        of_type = f" for VM type {vm_type}" if vm_type else ""
        ctx.event(
            job.job_id,
            "calibration-finished",
            f"calibration{of_type} {source} (attempt {req.attempt}): {cal.num_segments} segments, "
            f"m = {', '.join(str(m) for m in cal.micro_batch_sizes)}; stored with the job",
            vm_id=vm.vm_id,
            data={
                "vm_type": vm_type,
                "attempt": req.attempt,
                "wall_s": round(req.wall_s, 3),
                "num_segments": cal.num_segments,
                "micro_batch_sizes": list(cal.micro_batch_sizes),
                "bytes": len(req.calibration_json),
                "ordered_s": round(now - (job.calibration_started or now), 3),
            },
        )

    # -- what status and launch events say -----------------------------------------------------

    def text(self, job: JobRecord, now: float) -> str:
        """Where the job's calibration comes from, for ``status``."""
        state = job.calibration_status
        if state == "pending":
            return "pending: varuna-profile runs on the first usable VM"
        if state == "profiling":
            profile = self.ctx.cache(job).profile
            limit = f" of at most {profile.timeout_s:g} s" if profile is not None else ""
            elapsed = now - (job.calibration_started or now)
            return (
                f"profiling on {job.calibration_vm} (attempt {job.calibration_attempt}, "
                f"{elapsed:.0f} s{limit})"
            )
        if state == "given":
            return job.calibration_source or "from the job spec"
        return job.calibration_source or state

    def order(self, job: JobRecord) -> ProfileOrder:
        """The PROFILE order of the job's current attempt (the same after a restart)."""
        cache = self.ctx.cache(job)
        profile = cache.profile
        assert profile is not None, "a profiling job has a [profile]"
        return ProfileOrder(
            attempt=job.calibration_attempt,
            argv=tuple(profile.profiler_args(job_micro_batch_size=cache.spec.micro_batch_size)),
            env=dict(cache.spec.env),
            cwd=cache.spec.workdir,
            timeout_s=profile.timeout_s,
        )

    # -- one step of the control loop ----------------------------------------------------------

    def ready(self, job: JobRecord, vms: list[VMRecord], now: float) -> bool:
        """Drive the job's calibration one step; True once the job may be planned."""
        ctx = self.ctx
        state = job.calibration_status
        profile = ctx.cache(job).profile
        if state == "failed" and profile is not None and profile.required:
            ctx.finish_job(
                job,
                "failed",
                f"calibration failed and the job spec requires one (profile.required): "
                f"{job.calibration_source}",
            )
            return False
        if profile is not None and state in ("pending", "done") and ctx.cache(job).spec.vm_type_specs:
            return self._ready_by_type(job, vms, profile, now)
        if state in CALIBRATION_SETTLED or profile is None:
            return True
        if state == "pending":
            usable = [vm for vm in vms if ctx.usable(vm, now, since=0.0)]
            if not usable:
                ctx.set_message(job, "waiting for a usable VM to calibrate on (varuna-profile)")
                return False
            self._start(job, usable[0], profile, now)
            return False
        self._watch(job, vms, profile, now)
        return False

    def _ready_by_type(self, job: JobRecord, vms: list[VMRecord], profile: ProfileSpec, now: float) -> bool:
        """Mixed VM types (Note [Calibration per VM type]): profile on the first usable VM of
        every type not calibrated yet, one at a time; True once none is left."""
        ctx = self.ctx
        done = job.type_calibrations
        usable = [vm for vm in vms if ctx.usable(vm, now, since=0.0)]
        todo = next((vm for vm in usable if vm_type_of(vm.ref) and vm_type_of(vm.ref) not in done), None)
        if todo is not None:
            self._start(job, todo, profile, now)
            return False
        if done:
            if job.calibration_state != "done":
                ctx.store.update_job(job.job_id, calibration_state="done")
            return True
        ctx.set_message(job, "waiting for a usable VM to calibrate on (varuna-profile)")
        return False

    def _watch(self, job: JobRecord, vms: list[VMRecord], profile: ProfileSpec, now: float) -> None:
        """A profiling job: notice a lost VM or a run past its deadline."""
        ctx = self.ctx
        vm = next((v for v in vms if v.vm_id == job.calibration_vm), None)
        if vm is None or vm.state != "up" or vm.notice:
            what = "is gone" if vm is None or vm.state != "up" else "has an eviction notice"
            self.lost(job, f"{job.calibration_vm} {what}")
            return
        elapsed = now - (job.calibration_started or now)
        # The agent kills the run at timeout_s and reports it; this deadline is for an agent that
        # cannot report. After a manager restart, give agents a heartbeat timeout to report first.
        grace = ctx.config.heartbeat_timeout_s
        if elapsed > profile.timeout_s + grace and now - ctx.started_at > grace:
            self.failed(
                job,
                f"no result from {vm.vm_id} within the profile's timeout_s = {profile.timeout_s:g} s "
                "(raise profile.timeout_s or make the profile cheaper)",
                vm_id=vm.vm_id,
            )
            return  # the next tick plans with the fallback rule, or fails the job
        ctx.set_message(job, f"calibrating on {vm.vm_id}: {elapsed:.0f} s of at most {profile.timeout_s:g} s")

    def _start(self, job: JobRecord, vm: VMRecord, profile: ProfileSpec, now: float) -> None:
        ctx = self.ctx
        attempt = job.calibration_attempt + 1
        vm_type = vm_type_of(vm.ref)
        ctx.store.update_job(
            job.job_id,
            calibration_state="profiling",
            calibration_attempt=attempt,
            calibration_vm=vm.vm_id,
            calibration_started=now,
            calibration_type=vm_type,
        )
        argv = profile.profiler_args(job_micro_batch_size=ctx.cache(job).spec.micro_batch_size)
        of_type = f" (VM type {vm_type})" if vm_type else ""
        ctx.event(
            job.job_id,
            "calibration-started",
            f"calibrating on {vm.vm_id}{of_type} (attempt {attempt}, timeout {profile.timeout_s:g} s): "
            f"varuna-profile {shlex.join(argv)}",
            vm_id=vm.vm_id,
            data={"attempt": attempt, "argv": argv, "timeout_s": profile.timeout_s, "vm_type": vm_type},
        )
        ctx.set_message(job, f"calibrating on {vm.vm_id}")

    def lost(self, job: JobRecord, reason: str) -> None:
        """The VM running the profile went away: re-issue on another VM, or give up."""
        # Attempts are numbered per job: with several VM types each type gets the same budget.
        budget = CALIBRATION_MAX_ATTEMPTS * max(1, len(self.ctx.cache(job).spec.vm_type_specs))
        if job.calibration_attempt >= budget:
            self.failed(
                job,
                f"{reason} during attempt {job.calibration_attempt} of {budget}",
                vm_id=job.calibration_vm,
            )
            return
        self.ctx.store.update_job(job.job_id, calibration_state="pending")
        self.ctx.event(
            job.job_id,
            "calibration-lost",
            f"calibration attempt {job.calibration_attempt} lost: {reason}; re-issuing it on the next "
            f"usable VM (at most {CALIBRATION_MAX_ATTEMPTS} attempts)",
            vm_id=job.calibration_vm,
            data={"attempt": job.calibration_attempt, "reason": reason},
        )

    def failed(self, job: JobRecord, reason: str, *, vm_id: str = "", wall_s: float = 0.0) -> None:
        """Record that calibration is over without a result (never retried)."""
        profile = self.ctx.cache(job).profile
        required = profile is not None and profile.required
        source = ("failed" if required else "fallback rule") + f" (calibration failed: {reason})"
        self.ctx.store.update_job(job.job_id, calibration_state="failed", calibration_source=source)
        self.ctx.event(
            job.job_id,
            "calibration-failed",
            f"calibration failed: {reason}; "
            + (
                "the job spec requires one (profile.required), so the job fails"
                if required
                else "planning with the fallback rule instead (profile.required = true would fail the job)"
            ),
            vm_id=vm_id,
            data={
                "attempt": job.calibration_attempt,
                "reason": reason,
                "wall_s": round(wall_s, 3),
                "required": required,
            },
        )
