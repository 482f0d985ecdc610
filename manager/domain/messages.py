"""What the manager's domain says to the outside, as plain dataclasses: an agent's registration
and heartbeat and the orders it gets back, a calibration report, a worker's heartbeat, a job's
status. Field names are the wire's (manager/transport/varuna_manager.proto), so
``manager.transport.convert`` maps them one to one; nothing here knows the wire.

Note [Orders] (what each action means to the agent) is in manager/agent/vm_agent.py.

    >>> orders = Orders(action=Action.RUN, generation=3)
    >>> orders.workers.append(WorkerLaunch(rank=0, argv=("-m", "manager.worker.shim", "t.py"), env={}))
    >>> orders.action.name, len(orders.workers)
    ('RUN', 1)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "Action",
    "CalibrationReply",
    "CalibrationReport",
    "JobStatus",
    "Orders",
    "PoolShare",
    "PreemptNotice",
    "ProfileOrder",
    "RegisterVM",
    "Registered",
    "ThroughputPoint",
    "VMHeartbeat",
    "VMStatus",
    "WorkerHeartbeat",
    "WorkerLaunch",
    "WorkerState",
    "WorkerStatus",
]

# -- agents ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RegisterVM:
    """An agent (re)starting on a VM."""

    vm_id: str
    job_id: str = ""
    agent_instance: str = ""
    """Random per agent process: a new one means the old one's workers died with it."""
    hostname: str = ""
    address: str = ""
    """How other VMs reach this one (``MASTER_ADDR`` when it hosts rank 0)."""
    slots: int = 0
    pid: int = 0


@dataclass(frozen=True, kw_only=True)
class Registered:
    """The answer to :class:`RegisterVM`."""

    heartbeat_interval_s: float
    message: str = ""


@dataclass(frozen=True, kw_only=True)
class WorkerState:
    """One worker process as its agent sees it."""

    rank: int
    pid: int = 0
    running: bool = False
    exit_code: int = 0
    """Valid when not running; negative: killed by that signal."""


@dataclass(frozen=True, kw_only=True)
class PreemptNotice:
    """An eviction notice the agent's notice source reported."""

    event_id: str
    event_type: str
    not_before: str = ""
    description: str = ""


@dataclass(frozen=True, kw_only=True)
class VMHeartbeat:
    """An agent's heartbeat: liveness, its workers, a free port, a notice."""

    vm_id: str
    agent_instance: str = ""
    generation: int = 0
    """The newest generation this agent has acted on (0: none)."""
    workers: tuple[WorkerState, ...] = ()
    free_port: int = 0
    """A TCP port free on the VM now (a ``MASTER_PORT`` candidate)."""
    notice: PreemptNotice | None = None


@dataclass(frozen=True, kw_only=True)
class WorkerLaunch:
    """One worker to start: ``python ARGV`` in ``cwd`` with ``env`` added."""

    rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str = ""


@dataclass(frozen=True, kw_only=True)
class ProfileOrder:
    """What a PROFILE order runs: ``varuna-profile ARGV`` (without ``--out``)."""

    attempt: int
    """The job's calibration attempt; a repeated order is the same run."""
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str = ""
    timeout_s: float = 0.0


class Action(enum.Enum):
    """What an agent is told to do (Note [Orders])."""

    IDLE = "idle"
    RUN = "run"
    STOP = "stop"
    KILL = "kill"
    SHUTDOWN = "shutdown"
    PROFILE = "profile"


@dataclass(kw_only=True)
class Orders:
    """The reply to a heartbeat: the full desired state of the VM, so a lost or repeated reply is
    harmless (Note [Orders])."""

    action: Action = Action.IDLE
    generation: int = 0
    workers: list[WorkerLaunch] = field(default_factory=list)
    """RUN: this VM's workers of ``generation``."""
    stop_timeout_s: float = 0.0
    heartbeat_interval_s: float = 0.0
    training: bool = False
    """RUN: the generation completed its first step (standbys may start)."""
    profile: ProfileOrder | None = None
    """PROFILE: what to run."""
    leave: bool = False
    """RUN, live-morph job with a notice here: hand over and leave."""
    kill: list[int] = field(default_factory=list)
    """RUN, live-morph job: SIGKILL these workers (declared frozen by their peers)."""


@dataclass(frozen=True, kw_only=True)
class CalibrationReport:
    """An agent's result of a PROFILE order."""

    vm_id: str
    agent_instance: str = ""
    attempt: int
    ok: bool
    calibration_json: str = ""
    """ok: the calibration file's content."""
    error: str = ""
    """Not ok: one line, why."""
    wall_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class CalibrationReply:
    """Whether the manager took a :class:`CalibrationReport` (only the current attempt counts)."""

    accepted: bool
    message: str = ""


# -- workers -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WorkerHeartbeat:
    """A worker's report after a step (or once at start: ``step == resumed_from``). Stage ranges:
    ``first_segment``..``end_segment``, both included (Note [Stage ranges on the wire] in
    manager/transport/varuna_manager.proto)."""

    job_id: str
    vm_id: str = ""
    generation: int = 0
    rank: int = 0
    stage: int = 0
    replica: int = 0
    pipeline_depth: int = 0
    data_parallel: int = 0
    step: int = 0
    resumed_from: int = 0
    loss: float = 0.0
    samples_per_s: float = 0.0
    wall_time: float = 0.0
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    recompute_s: float = 0.0
    num_microbatches: int = 0
    micro_batch_size: int = 0
    first_segment: int = 0
    end_segment: int = 0


# -- status ------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class WorkerStatus:
    rank: int
    pid: int = 0
    running: bool = False
    exit_code: int = 0
    stage: int = 0
    replica: int = 0
    step: int = 0
    fwd_s: float = 0.0
    bwd_s: float = 0.0


@dataclass(kw_only=True)
class VMStatus:
    vm_id: str
    state: str
    health: str
    """healthy | slow | preempting | silent | starting | gone | deleted."""
    slots: int = 0
    address: str = ""
    heartbeat_age_s: float = -1.0
    """-1: never heard from."""
    in_generation: bool = False
    detail: str = ""
    workers: list[WorkerStatus] = field(default_factory=list)
    agent_pid: int = 0


@dataclass(frozen=True, kw_only=True)
class ThroughputPoint:
    step: int
    generation: int
    time: float
    samples_per_s: float
    loss: float
    pipeline_depth: int
    data_parallel: int


@dataclass(frozen=True, kw_only=True)
class PoolShare:
    """A pool job's place in the shared pool (docs/pool.md)."""

    vm_type: str
    """'' = not placed this round."""
    vm_count: int
    weight: float
    allocation: str
    predicted_samples_per_s: float
    measured_samples_per_s: float
    round: int
    policy: str


@dataclass(kw_only=True)
class JobStatus:
    """What ``varuna-manager status`` shows of one job."""

    job_id: str
    name: str
    state: str
    message: str = ""
    generation: int = 0
    generation_state: str = ""
    pipeline_depth: int = 0
    data_parallel: int = 0
    micro_batch_size: int = 0
    step: int = 0
    target_steps: int = 0
    created: float = 0.0
    vms: list[VMStatus] = field(default_factory=list)
    throughput: list[ThroughputPoint] = field(default_factory=list)
    provider: str = ""
    checkpoint_dir: str = ""
    calibration_state: str = ""
    calibration: str = ""
    pool: PoolShare | None = None
