"""The rows of the manager's state file as records (:mod:`manager.domain.store` reads and writes them).

:class:`VMRecord` and :class:`GenerationRecord` are frozen: the store hands out the same
snapshot to every reader (no copy per RPC) and replaces it, never changes it, when the row
changes. :class:`JobRecord` stays mutable; the store gives each reader its own copy.

    >>> gen = GenerationRecord(job_id="j", generation=1, state="running", pipeline_depth=1,
    ...     data_parallel=2, micro_batch_size=2, vms_json='["v1", "v2"]', master_addr="h",
    ...     master_port=1, launched=0.0)
    >>> gen.vm_ids, "v2" in gen.vm_set
    (['v1', 'v2'], True)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

__all__ = [
    "EventRecord",
    "GenerationRecord",
    "JobRecord",
    "ProgressRecord",
    "VMRecord",
    "WorkerStatRecord",
]


@dataclass(kw_only=True)
class JobRecord:
    """A row of ``jobs``. ``state``: pending | running | stopping | finished | cancelled | failed."""

    job_id: str
    spec_json: str
    calibration_json: str = ""
    state: str
    message: str = ""
    created: float
    updated: float
    generation: int = 0
    """Newest generation launched (0: none yet)."""
    step: int = 0
    """Highest step any worker reported."""
    detection_time: float | None = None
    """When the manager noticed what the pending morph reacts to (cleared when training resumes)."""
    detection_reason: str = ""
    failed_launches: int = 0
    """Consecutive generations that ended without completing a step."""
    cancel_requested: int = 0
    vm_seq: int = 0
    """Counter for VM names."""
    calibration_state: str = ""
    """given | none | pending | profiling | done | failed (Note [Calibration at job start] in
    :mod:`manager.domain.controller`); '' in rows written before it existed."""
    calibration_source: str = ""
    """Where the calibration came from, for people (``status``)."""
    calibration_attempt: int = 0
    """The current (or last) profiling attempt; agents key their run by it."""
    calibration_vm: str = ""
    """The VM running (or that ran) the profiling attempt."""
    calibration_started: float | None = None
    """When the current attempt was ordered."""
    type_calibrations_json: str = ""
    """Mixed VM types: ``{type: calibration}`` (JSON) of every type calibrated so far."""
    calibration_type: str = ""
    """Mixed VM types: the type the current (or last) profiling attempt calibrates."""

    @property
    def spec(self) -> dict[str, Any]:
        return json.loads(self.spec_json)

    @property
    def terminal(self) -> bool:
        return self.state in ("finished", "cancelled", "failed")

    @property
    def calibration_status(self) -> str:
        """``calibration_state``, with rows written before calibration states existed read as
        ``given`` or ``none`` (``"profiling"`` while a VM runs ``varuna-profile``)."""
        return self.calibration_state or ("given" if self.calibration_json else "none")

    @property
    def type_calibrations(self) -> dict[str, dict]:
        """Mixed VM types: each calibrated type's calibration document (insertion order: the order
        they were profiled in)."""
        return dict(json.loads(self.type_calibrations_json)) if self.type_calibrations_json else {}


@dataclass(frozen=True, kw_only=True)
class GenerationRecord:
    """One launch of a job at one P×D on one set of VMs (a snapshot: frozen).

    ``state``: running | stopping (graceful stop asked) | killing | ended."""

    job_id: str
    generation: int
    state: str
    pipeline_depth: int
    data_parallel: int
    micro_batch_size: int
    vms_json: str
    master_addr: str
    master_port: int
    launched: float
    stop_reason: str = ""
    stop_time: float | None = None
    ended: float | None = None
    first_step_time: float | None = None
    resumed_from: int | None = None
    last_step: int = 0
    graceful: int = 0
    """1 when every worker exited 0 (a clean stop or completion)."""
    predicted_samples_per_s: float = 0.0
    mixed_json: str = ""
    """Mixed VM types: the generation's plan (``rank_hosts``, ``replica_shares``,
    ``stage_speeds``, ``rank_types``) as JSON; '' for VMs of one type."""
    live_json: str = ""
    """A live-morph generation's members (``manager.domain.live_members.LiveMembers`` as JSON: each VM's
    member ids, the next unused id, joiners, leaving VMs); '' otherwise."""

    @cached_property
    def _vm_tuple(self) -> tuple[str, ...]:
        # Parsed once per snapshot: every agent heartbeat asks whether its VM is in the
        # generation, and vms_json lists up to thousands of VMs.
        return tuple(json.loads(self.vms_json))

    @property
    def vm_ids(self) -> list[str]:
        """The generation's VMs, host order (a new list: the caller may change it)."""
        return list(self._vm_tuple)

    @cached_property
    def vm_set(self) -> frozenset[str]:
        """The generation's VMs, for membership tests."""
        return frozenset(self._vm_tuple)

    @cached_property
    def rank_bound(self) -> int:
        """No worker of this generation has a rank (or, live, a member id) at or above this:
        P × D, or in a live-morph generation the next unused member id when that is higher (a
        worker reports its launch rank until it regroups; docs/manager.md, Live morph)."""
        world = self.pipeline_depth * self.data_parallel
        if not self.live_json:
            return world
        return max(world, int(json.loads(self.live_json).get("next_id", 0)))


@dataclass(frozen=True, kw_only=True)
class VMRecord:
    """A VM of a job (a snapshot: frozen). ``state``: requested | up | gone | deleted."""

    vm_id: str
    job_id: str
    provider: str
    seq: int
    state: str
    slots: int
    address: str = ""
    hostname: str = ""
    agent_instance: str = ""
    agent_pid: int = 0
    created: float
    registered: float | None = None
    last_heartbeat: float | None = None
    free_port: int = 0
    reported_generation: int = 0
    workers_json: str = "[]"
    slow: int = 0
    slow_reason: str = ""
    notice_json: str = ""
    gone_reason: str = ""
    provider_ref: str = "{}"

    @cached_property
    def _workers(self) -> tuple[dict[str, Any], ...]:
        # Parsed once per snapshot: the control loop looks at every VM's workers every tick.
        return tuple(json.loads(self.workers_json))

    @property
    def workers(self) -> list[dict[str, Any]]:
        """The agent's last report: ``[{"rank", "pid", "running", "exit_code"}]`` (read-only
        dicts, shared by the readers of this snapshot)."""
        return list(self._workers)

    @property
    def notice(self) -> dict[str, Any] | None:
        return json.loads(self.notice_json) if self.notice_json else None

    @property
    def ref(self) -> dict[str, Any]:
        return dict(json.loads(self.provider_ref or "{}"))


@dataclass(kw_only=True)
class EventRecord:
    id: int
    job_id: str
    time: float
    kind: str
    vm_id: str = ""
    generation: int = 0
    message: str = ""
    data_json: str = "{}"

    @property
    def data(self) -> dict[str, Any]:
        return dict(json.loads(self.data_json or "{}"))


@dataclass(kw_only=True)
class ProgressRecord:
    """A throughput point (rank 0's heartbeat of one step). ``samples_per_s`` and ``loss`` are
    None where the worker sent a non-finite value (a diverged, skipped step: Note [Non-finite
    values] in manager/domain/store.py)."""

    job_id: str
    generation: int
    step: int
    time: float
    samples_per_s: float | None
    loss: float | None
    pipeline_depth: int
    data_parallel: int


@dataclass(kw_only=True)
class WorkerStatRecord:
    """The latest heartbeat of one worker of one generation."""

    job_id: str
    generation: int
    rank: int
    vm_id: str
    stage: int
    replica: int
    step: int
    resumed_from: int
    time: float
    fwd_s: float
    bwd_s: float
    recompute_s: float = 0.0
    micro_batch_size: int = 0
    first_segment: int = 0
    end_segment: int = 0
