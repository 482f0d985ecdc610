"""What the dashboard shows, as JSON-ready dicts: a narrow, read-only view of the manager's state.

Everything comes from :class:`manager.domain.store.Store` reads that write nothing (rows the store keeps
in memory, ``SELECT`` queries, and the deferred heartbeat values merged in with ``peek_*``
rather than flushed), plus the manager's own health rule for a VM
(:meth:`manager.domain.context.ManagerContext.health`). It never takes the manager's state lock, so a page
being watched cannot slow the control loop down.

    >>> from manager.domain.store import Store
    >>> view = DashboardView(Store(":memory:"), health=lambda vm, now: "healthy")
    >>> view.jobs(), view.job("nope") is None
    ([], True)
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from manager.dashboard.gantt import measured_timeline, timeline_json
from manager.domain.records import GenerationRecord, JobRecord, VMRecord
from manager.domain.store import Store
from varuna.core.flops import check_peak_tflops
from varuna.core.schedule import DEFAULT_SCHEDULE

__all__ = ["DashboardView"]

#: Newest throughput points and events a job page carries (the charts stay light for long jobs).
MAX_POINTS = 2000
MAX_EVENTS = 300
#: The Gantt chart is replayed (a simulation) at most this often per job.
GANTT_EVERY_S = 10.0


class ManagerState(Protocol):
    """What the view reads of a running manager (``manager.domain.controller.Manager`` is one)."""

    @property
    def store(self) -> Store: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    def vm_health(self, vm: VMRecord, now: float) -> str: ...


def _pxd(p: int, d: int) -> str:
    return f"{p}×{d}"


def _flops_per_example(job: JobRecord) -> float | None:
    """Model FLOPs of training one example -- 3 × the forward the job's calibration counted
    (``model.fwd_flops_per_example``, Note [Model FLOPs] in varuna/core/flops.py) -- or None."""
    try:
        model = json.loads(job.calibration_json or "{}").get("model") or {}
    except (ValueError, AttributeError):
        return None
    f = model.get("fwd_flops_per_example")
    if not isinstance(f, list) or not f or not all(isinstance(x, (int, float)) and x >= 0 for x in f):
        return None
    return 3.0 * sum(f)


def _peak_tflops(job: JobRecord) -> float | None:
    """The peak the job's workers are told (``VARUNA_PEAK_TFLOPS`` in its spec's env), else None."""
    try:
        env = _spec_of(job).get("env") or {}
        return check_peak_tflops(env.get("VARUNA_PEAK_TFLOPS"), "VARUNA_PEAK_TFLOPS")
    except (ValueError, AttributeError):
        return None


def _flop_rates(samples_per_s: float, devices: int, flops: float | None, peak: float | None) -> dict:
    """A throughput point's model TFLOP/s per device and MFU: the engine's ``StepResult.tflops``
    (samples/s = M / step_s, so samples/s × FLOPs per example = model FLOPs / step_s)."""
    if flops is None or devices < 1:
        return {"tflops": None, "mfu": None}
    tflops = samples_per_s * flops / devices / 1e12
    return {"tflops": tflops, "mfu": tflops / peak if peak else None}


class DashboardView:
    """Read-only JSON of the jobs (module docstring). ``health(vm, now)`` is the manager's word
    for a VM; ``clock`` gives wall-clock seconds (the store's times are wall-clock).

    Example::

        view = DashboardView.from_manager(manager)
        view.jobs()            # one summary per job
        view.job("gpt-3f9a1c") # VMs, P×D history with morphs, throughput (and TFLOP/s), loss, events, Gantt
    """

    def __init__(
        self,
        store: Store,
        *,
        health: Callable[[VMRecord, float], str],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._health = health
        self._clock = clock
        self._gantt_lock = threading.Lock()
        self._gantt: dict[str, tuple[float, int, dict[str, Any] | None]] = {}

    @classmethod
    def from_manager(cls, manager: ManagerState) -> DashboardView:
        """The view of a running manager's state."""
        return cls(manager.store, health=manager.vm_health, clock=manager.clock)

    def jobs(self) -> list[dict[str, Any]]:
        """Every job, oldest first: id, name, state, step, P×D."""
        return [self._summary(job) for job in self._store.jobs()]

    def job(self, job_id: str) -> dict[str, Any] | None:
        """Everything the job's page shows, or None when there is no such job."""
        job = self._store.job(job_id)
        if job is None:
            return None
        now = self._clock()
        gens = self._store.generations(job_id)
        current = gens[-1] if gens else None
        flops, peak = _flops_per_example(job), _peak_tflops(job)
        return {
            "job": self._summary(job),
            "now": now,
            "vms": [self._vm(vm, current, _spec_of(job), now) for vm in self._store.vms(job_id)],
            "generations": [self._generation(g) for g in gens],
            "morphs": self._morphs(job_id),
            "progress": [
                {
                    "time": p.time,
                    "step": p.step,
                    "generation": p.generation,
                    "samples_per_s": p.samples_per_s,
                    "loss": p.loss,
                    "pxd": _pxd(p.pipeline_depth, p.data_parallel),
                    **_flop_rates(p.samples_per_s, p.pipeline_depth * p.data_parallel, flops, peak),
                }
                for p in self._store.peek_progress(job_id, last=MAX_POINTS)
            ],
            "events": [
                {
                    "id": e.id,
                    "time": e.time,
                    "kind": e.kind,
                    "vm_id": e.vm_id,
                    "generation": e.generation,
                    "message": e.message,
                }
                for e in reversed(self._store.newest_events(job_id, MAX_EVENTS))
            ],
            "gantt": self._gantt_of(job, gens, now),
        }

    # -- parts ---------------------------------------------------------------------------------

    def _summary(self, job: JobRecord) -> dict[str, Any]:
        spec = _spec_of(job)
        gen = self._store.generation(job.job_id, job.generation) if job.generation else None
        return {
            "job_id": job.job_id,
            "name": spec.get("name") or job.job_id,
            "state": job.state,
            "message": job.message,
            "step": job.step,
            "target_steps": spec.get("target_steps", 0),
            "generation": job.generation,
            "generation_state": gen.state if gen else "",
            "P": gen.pipeline_depth if gen else 0,
            "D": gen.data_parallel if gen else 0,
            "pxd": _pxd(gen.pipeline_depth, gen.data_parallel) if gen else "",
            "micro_batch_size": gen.micro_batch_size if gen else 0,
            "provider": spec.get("provider", "local"),
            "created": job.created,
            "calibration_state": job.calibration_state,
        }

    def _vm(
        self, vm: VMRecord, gen: GenerationRecord | None, spec: dict[str, Any], now: float
    ) -> dict[str, Any]:
        size = (spec.get("provider_options") or {}).get("vm_size") or ""  # the Azure VM size
        slots = f"{vm.slots} slot{'s' if vm.slots != 1 else ''}"
        return {
            "vm_id": vm.vm_id,
            "type": f"{vm.provider} {size}, {slots}" if size else f"{vm.provider}, {slots}",
            "state": vm.state,
            "health": self._health(vm, now),
            "heartbeat_age_s": None if vm.last_heartbeat is None else max(0.0, now - vm.last_heartbeat),
            "in_generation": gen is not None and gen.state != "ended" and vm.vm_id in gen.vm_set,
            "slow": bool(vm.slow),
            "detail": vm.slow_reason
            or vm.gone_reason
            or (f"notice {vm.notice.get('event_type', '')}" if vm.notice else ""),
        }

    @staticmethod
    def _generation(g: GenerationRecord) -> dict[str, Any]:
        return {
            "generation": g.generation,
            "state": g.state,
            "P": g.pipeline_depth,
            "D": g.data_parallel,
            "pxd": _pxd(g.pipeline_depth, g.data_parallel),
            "launched": g.launched,
            "first_step_time": g.first_step_time,
            "ended": g.ended,
            "stop_reason": g.stop_reason,
            "resumed_from": g.resumed_from,
            "last_step": g.last_step,
        }

    def _morphs(self, job_id: str) -> list[dict[str, Any]]:
        """Every relaunch after the first launch: when, old → new P×D, why, and its latency."""
        evs = self._store.events(job_id, kinds=("launched", "resumed"))
        latency = {e.generation: e.data.get("morph_latency_s") for e in evs if e.kind == "resumed"}
        out = []
        for e in evs:
            prev = e.data.get("previous")
            if e.kind != "launched" or not prev:
                continue
            out.append(
                {
                    "time": e.time,
                    "generation": e.generation,
                    "from": _pxd(prev["P"], prev["D"]),
                    "to": _pxd(e.data["P"], e.data["D"]),
                    "reason": e.data.get("reason", ""),
                    "latency_s": latency.get(e.generation),
                }
            )
        return out

    def _gantt_of(self, job: JobRecord, gens: list[GenerationRecord], now: float) -> dict[str, Any] | None:
        """The newest generation that has measured every stage, replayed (``manager.dashboard.gantt``);
        cached for GANTT_EVERY_S per job."""
        with self._gantt_lock:
            cached = self._gantt.get(job.job_id)
            if cached is not None and now - cached[0] < GANTT_EVERY_S and cached[1] == job.generation:
                return cached[2]
        spec = _spec_of(job)
        chart = None
        for g in reversed(gens if isinstance(spec.get("global_batch_size"), int) else []):
            stats = self._store.peek_worker_stats(job.job_id, g.generation)
            tl = measured_timeline(
                stats,
                pipeline_depth=g.pipeline_depth,
                data_parallel=g.data_parallel,
                global_batch_size=int(spec["global_batch_size"]),
                schedule=str(spec.get("schedule") or DEFAULT_SCHEDULE),
            )
            if tl is not None:
                chart = {
                    "generation": g.generation,
                    "pxd": _pxd(g.pipeline_depth, g.data_parallel),
                    **timeline_json(tl),
                }
                break
        with self._gantt_lock:
            self._gantt[job.job_id] = (now, job.generation, chart)
        return chart


def _spec_of(job: JobRecord) -> dict[str, Any]:
    """The job's stored spec, or {} when it cannot be read (a quarantined row: Note [Corrupt rows]
    in manager/domain/store_schema.py): one such job must not blank the whole dashboard."""
    try:
        spec = job.spec
    except (ValueError, TypeError):
        return {}
    return spec if isinstance(spec, dict) else {}
