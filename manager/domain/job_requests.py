"""The requests of ``varuna-manager`` users: submit a job, cancel it, read its status and its
events. Validation happens here, at submit time, so a bad spec is refused with one line instead
of failing at the first tick.

    >>> job_id_for("GPT tiny (test)")[:14]
    'gpt-tiny-test-'
"""

from __future__ import annotations

import json
import math
import re
import secrets

from manager.domain.context import ManagerContext
from manager.domain.errors import ErrorKind, ManagerError
from manager.domain.jobspec import JobSpec
from manager.domain.messages import JobStatus, ThroughputPoint, VMStatus, WorkerStatus
from manager.domain.ports import Calibrations
from manager.domain.records import EventRecord, GenerationRecord, JobRecord, VMRecord, WorkerStatRecord
from manager.providers.registry import provider_entry
from varuna.core.calibration import Calibration
from varuna.core.extras import MissingExtra

__all__ = ["JobRequests", "job_id_for"]


def job_id_for(display_name: str) -> str:
    """A new job id: a slug of the job's name and 6 random hex digits.

    >>> len(job_id_for("x"))
    8
    """
    slug = re.sub(r"[^a-z0-9]+", "-", display_name.lower()).strip("-")[:24] or "job"
    return f"{slug}-{secrets.token_hex(3)}"


def _nan_if_none(value: float | None) -> float:
    """A value stored as NULL (non-finite when reported) as NaN: what the wire and ``status``
    show for "not a number" (Note [Non-finite values] in manager/domain/store.py)."""
    return math.nan if value is None else value


def _not_found(job_id: str) -> ManagerError:
    return ManagerError(ErrorKind.NOT_FOUND, f"no job {job_id!r}; see varuna-manager status")


class JobRequests:
    """Submit, cancel, status and events (the CLI's RPCs).

    Example::

        requests = JobRequests(ctx, calibration)
        job_id = requests.submit(spec, calibration_json="")
        [status] = requests.status(job_id, history=10)
    """

    def __init__(self, ctx: ManagerContext, calibration: Calibrations) -> None:
        self.ctx = ctx
        self.calibration = calibration

    def submit(self, spec: JobSpec, calibration_json: str = "") -> str:
        """Validate and store a new job (``calibration_json``: the calibration file's content, or
        ""); returns its id. ``ManagerError`` INVALID_ARGUMENT, or FAILED_PRECONDITION when the
        provider's extra is missing here."""
        try:
            if calibration_json:
                Calibration.from_dict(json.loads(calibration_json), source="calibration")
            # The provider's options and extra must be right now, not at the first tick.
            entry = provider_entry(spec.provider)
            entry.parse_options(spec.provider_options)
            if entry.extra is not None:
                entry.extra.require()
        except (ValueError, TypeError) as exc:
            raise ManagerError(ErrorKind.INVALID_ARGUMENT, str(exc).splitlines()[0]) from None
        except MissingExtra as exc:
            raise ManagerError(ErrorKind.FAILED_PRECONDITION, str(exc)) from None
        if calibration_json and spec.profile:
            raise ManagerError(
                ErrorKind.INVALID_ARGUMENT,
                "jobspec: give either 'calibration' (a file) or [profile] (calibrate on the first VM), "
                "not both",
            )
        if spec.pool:
            self._check_pool_job(spec, calibration_json)
        if calibration_json:
            cal_state, cal_source = "given", "from the job spec"
        elif spec.profile:
            cal_state, cal_source = "pending", ""
        else:
            cal_state = "none"
            cal_source = "none: fallback rule (the job spec has neither a calibration nor [profile])"
        job_id = job_id_for(spec.display_name)
        with self.ctx.lock:
            self.ctx.store.add_job(
                job_id,
                spec.to_dict(),
                calibration_json,
                calibration_state=cal_state,
                calibration_source=cal_source,
            )
            self.ctx.event(
                job_id,
                "submitted",
                f"{spec.display_name}: {spec.min_vms}..{spec.max_vms} VMs × "
                f"{spec.procs_per_vm} on {spec.provider}, M={spec.global_batch_size}, "
                f"schedule {spec.schedule}, target step {spec.target_steps}; calibration: "
                + (cal_source if cal_state != "pending" else "to be profiled on the first VM"),
            )
        return job_id

    def cancel(self, job_id: str) -> str:
        """Ask for a graceful stop and the deletion of the job's VMs; returns the job's state."""
        with self.ctx.lock:
            job = self.ctx.store.job(job_id)
            if job is None:
                raise _not_found(job_id)
            if not job.terminal and not job.cancel_requested:
                self.ctx.store.update_job(job_id, cancel_requested=1)
                self.ctx.event(job_id, "cancel-requested", "cancel requested: checkpoint, stop, delete VMs")
            return "cancelling" if not job.terminal else job.state

    def events(self, job_id: str, after_id: int, limit: int) -> list[EventRecord]:
        """The job's (or every job's, ``job_id`` empty) events after ``after_id``."""
        if job_id and self.ctx.store.job(job_id) is None:
            raise _not_found(job_id)
        return self.ctx.store.events(job_id, after_id=after_id, limit=limit)

    def _check_pool_job(self, spec: JobSpec, calibration_json: str) -> None:
        """A pool job needs a pool, and a calibration (the throughput matrix is made from it)."""
        if not self.ctx.pool.active:
            raise ManagerError(
                ErrorKind.FAILED_PRECONDITION,
                "this manager has no shared pool; start it with varuna-manager serve --pool POOL.toml "
                "or submit without --pool",
            )
        if not calibration_json and not spec.profile:
            raise ManagerError(
                ErrorKind.INVALID_ARGUMENT,
                "jobspec: a pool job needs 'calibration' or [profile]: the pool allocates by predicted "
                "throughput",
            )

    def status(self, job_id: str, history: int) -> list[JobStatus]:
        """The job's (or every job's) status with its last ``history`` throughput points."""
        with self.ctx.lock:
            if job_id:
                job = self.ctx.store.job(job_id)
                if job is None:
                    raise _not_found(job_id)
                jobs = [job]
            else:
                jobs = self.ctx.store.jobs()
            return [self._job_status(job, history) for job in jobs]

    def _job_status(self, job: JobRecord, history: int) -> JobStatus:
        store = self.ctx.store
        now = self.ctx.clock()
        try:
            spec = JobSpec.from_dict(job.spec)
        except (ValueError, TypeError, KeyError):  # a quarantined row (manager/domain/store_schema.py)
            return JobStatus(
                job_id=job.job_id, name=job.job_id, state=job.state,
                message=job.message or "its stored spec cannot be read", generation=job.generation,
                step=job.step, target_steps=0, created=job.created, provider="", checkpoint_dir="",
                calibration_state=job.calibration_status, calibration="",
            )
        gen = store.generation(job.job_id, job.generation) if job.generation else None
        out = JobStatus(
            job_id=job.job_id,
            name=spec.display_name,
            state=job.state,
            message=job.message,
            generation=job.generation,
            step=job.step,
            target_steps=spec.target_steps,
            created=job.created,
            provider=spec.provider,
            checkpoint_dir=spec.checkpoint_dir,
            calibration_state=job.calibration_status,
            calibration=self.calibration.text(job, now),
        )
        stats: dict[int, WorkerStatRecord] = {}
        if gen is not None:
            out.generation_state = gen.state
            out.pipeline_depth, out.data_parallel = gen.pipeline_depth, gen.data_parallel
            out.micro_batch_size = gen.micro_batch_size
            # Reads that write nothing: a status never waits for (or fails with) a deferred write.
            stats = {s.rank: s for s in store.peek_worker_stats(job.job_id, gen.generation)}
        for vm in store.vms(job.job_id):
            self._add_vm_status(out, vm, gen, stats, now)
        if self.ctx.pool_job(job):
            out.pool = self.ctx.pool.share(job)
        out.throughput = [
            ThroughputPoint(step=p.step, generation=p.generation, time=p.time,
                            samples_per_s=_nan_if_none(p.samples_per_s), loss=_nan_if_none(p.loss),
                            pipeline_depth=p.pipeline_depth, data_parallel=p.data_parallel)
            for p in store.peek_progress(job.job_id, last=history)
        ]
        return out

    def _add_vm_status(
        self,
        out: JobStatus,
        vm: VMRecord,
        gen: GenerationRecord | None,
        stats: dict[int, WorkerStatRecord],
        now: float,
    ) -> None:
        st = VMStatus(
            vm_id=vm.vm_id,
            state=vm.state,
            health=self.ctx.health(vm, now),
            slots=vm.slots,
            address=vm.address,
            in_generation=gen is not None and vm.vm_id in gen.vm_set,
            agent_pid=vm.agent_pid,
            heartbeat_age_s=(now - vm.last_heartbeat) if vm.last_heartbeat else -1.0,
        )
        out.vms.append(st)
        st.detail = (
            vm.slow_reason
            or (f"notice {vm.notice['event_type']} {vm.notice['event_id']}" if vm.notice else "")
            or vm.gone_reason
        )
        if gen is None or vm.reported_generation != gen.generation:
            return
        for w in vm.workers:
            s = stats.get(int(w["rank"]))
            st.workers.append(WorkerStatus(
                rank=int(w["rank"]),
                pid=int(w["pid"]),
                running=bool(w["running"]),
                exit_code=int(w["exit_code"]),
                stage=s.stage if s else 0,
                replica=s.replica if s else 0,
                step=s.step if s else 0,
                fwd_s=s.fwd_s if s else 0.0,
                bwd_s=s.bwd_s if s else 0.0,
            ))
