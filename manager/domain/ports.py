"""What the manager's parts need from each other, as protocols (Note [Ports]), and the null
collaborators of a daemon without live morph or without a shared pool.

Note [Ports]: the parts of the domain (manager/domain/controller.py lists them) never import one
another. A part that needs another says what it needs here, as a small protocol, and
:class:`manager.domain.controller.Manager` hands it the implementation when it wires the daemon.
So every part can be tested with a fake of its collaborators, every dependency is an import the
contracts in pyproject.toml check, and the import graph stays flat (scripts/import_depth.py):

=================  ==========================================  ================================
protocol           implemented by                              used by
=================  ==========================================  ================================
``Calibrations``   ``calibration_orders.CalibrationOrders``    generations, vm_book, job_requests
``Planner``        ``morph_planner.MorphPlanner``              generations, live_runs
``Launches``       ``launches.WorkerLaunches``                 vm_book
``LiveMorph``      ``live_runs.LiveRuns`` / :class:`NoLiveMorph`   the context's ``live``
``SharedPool``     ``pool_rounds.PoolRounds`` / :class:`NoPool`    the context's ``pool``
``Reachability``   ``manager.common.reachability.Prober`` /    the context's ``reach``
                   :class:`NoReachability`                     (silence.py)
=================  ==========================================  ================================

``LiveMorph``, ``SharedPool`` and ``Reachability`` sit on
:class:`manager.domain.context.ManagerContext` (``live``, ``pool``, ``reach``): several parts and
the context's own ``finish_job`` call them. Their null implementations answer "not this job" (or
"no verdict") and do nothing, so no part tests for None.

    >>> NoPool().active, NoLiveMorph().address(None, 1)
    (False, None)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from manager.common.reachability import ProbeResult
from manager.domain.messages import PoolShare, ProfileOrder, WorkerLaunch
from manager.domain.policy import LayoutPlan
from manager.domain.records import GenerationRecord, JobRecord, VMRecord

__all__ = [
    "Calibrations",
    "Launches",
    "LiveMorph",
    "NoLiveMorph",
    "NoPool",
    "NoReachability",
    "Placement",
    "Planner",
    "Reachability",
    "SharedPool",
]


@dataclass(frozen=True, kw_only=True)
class Placement:
    """A generation to launch: its layout, the VMs in host order (rank 0's first) and, with mixed
    VM types, where each rank goes and what the workers are told (``mixed``, stored as the
    generation's ``mixed_json``)."""

    plan: LayoutPlan
    vms: list[VMRecord]
    mixed: dict | None = None


class Calibrations(Protocol):
    """A job's calibration at its start (Note [Calibration at job start] in controller.py)."""

    def ready(self, job: JobRecord, vms: list[VMRecord], now: float) -> bool:
        """Drive the job's calibration one step; True once the job may be planned."""
        ...

    def text(self, job: JobRecord, now: float) -> str:
        """Where the job's calibration comes from, for people."""
        ...

    def lost(self, job: JobRecord, reason: str) -> None:
        """The VM running the profile went away."""
        ...

    def order(self, job: JobRecord) -> ProfileOrder:
        """The PROFILE order of the job's current attempt."""
        ...


class Planner(Protocol):
    """P×D for a job on given VMs and the grow rule."""

    def plan(self, job: JobRecord, slots: list[int]) -> LayoutPlan:
        """The layout for VMs with ``slots`` workers each; ``ValueError`` when nothing fits."""
        ...

    def place(self, job: JobRecord, vms: list[VMRecord]) -> Placement:
        """The layout for the usable ``vms`` and the VMs it runs on; ``ValueError`` when none."""
        ...

    def grow_trigger(self, job: JobRecord, gen: GenerationRecord, vms: list[VMRecord],
                     now: float) -> str | None:
        """Why to morph onto new VMs now, or None."""
        ...


class Launches(Protocol):
    """A generation's workers."""

    def launches(self, job: JobRecord, gen: GenerationRecord) -> dict[str, list[WorkerLaunch]]:
        """``vm_id -> [WorkerLaunch]``, the same for the same stored generation."""
        ...


class LiveMorph(Protocol):
    """Morphs without a restart (docs/manager.md, Live morph): the stores of live generations and
    the reactions to a lost VM, a notice, new VMs and frozen members. The ``on_*`` methods answer
    True when the generation goes on live, False when the caller takes the restart path."""

    def enabled(self, job: JobRecord) -> bool:
        """Whether ``job`` morphs live when it can."""
        ...

    def open_store(self, job: JobRecord, generation: int) -> str:
        """Host the generation's store before its launches name it; its ``host:port``."""
        ...

    def address(self, job: JobRecord, generation: int) -> str | None:
        """The generation's store, None when this process has none (a restart)."""
        ...

    def worker_env(self, job: JobRecord, generation: int) -> dict[str, str]:
        """What the generation's workers need to reach its store (address and secret); {}: none."""
        ...

    def close(self, job_id: str, generation: int | None = None) -> None:
        """Close a generation's store (every one of the job's: None)."""
        ...

    def close_all(self) -> None:
        """Close every store (the manager stops)."""
        ...

    def on_failure(self, job: JobRecord, gen: GenerationRecord, failed: list[VMRecord],
                   now: float) -> bool:
        """VMs of the running ``gen`` failed or were lost."""
        ...

    def on_notice(self, job: JobRecord, gen: GenerationRecord, noticed: list[VMRecord],
                  now: float) -> bool:
        """VMs of the running ``gen`` have an eviction notice."""
        ...

    def on_grow(self, job: JobRecord, gen: GenerationRecord, extra: list[VMRecord],
                now: float) -> bool:
        """Growing onto ``extra`` pays: their workers join the running generation."""
        ...

    def drop_frozen(self, job: JobRecord, gen: GenerationRecord, vms: dict[str, VMRecord],
                    now: float) -> GenerationRecord:
        """Drop members their peers declared dead; ``gen`` as stored now."""
        ...

    def drop_leavers(self, job: JobRecord, gen: GenerationRecord,
                     vms: dict[str, VMRecord]) -> GenerationRecord:
        """Drop noticed VMs whose workers handed over and left; ``gen`` as stored now."""
        ...

    def member_views(self, gen: GenerationRecord, vms: dict[str, VMRecord]) -> dict[str, VMRecord]:
        """``vms`` without the workers of dropped members (their exit is no failure)."""
        ...

    def leaving(self, gen: GenerationRecord) -> tuple[str, ...]:
        """The VMs told to hand over and leave (RUN orders' ``leave``)."""
        ...

    def to_kill(self, gen: GenerationRecord, vm_id: str) -> list[int]:
        """The members on ``vm_id`` to SIGKILL (RUN orders' ``kill``)."""
        ...

    def step_reported(self, job: JobRecord, generation: int, step: int, now: float,
                      layout: tuple[int, int] | None = None) -> None:
        """A worker's step (and P×D): the first past a pending morph ends it."""
        ...


class SharedPool(Protocol):
    """The daemon's shared pool (``serve --pool``, docs/pool.md; Note [Pool VMs] in
    manager/domain/pool_rounds.py)."""

    @property
    def active(self) -> bool:
        """Whether this daemon has a pool at all."""
        ...

    def is_pool(self, job: JobRecord) -> bool:
        """Whether ``job`` takes its VMs from the pool."""
        ...

    def tick(self, now: float) -> None:
        """Run a round when one is due."""
        ...

    def target(self, job: JobRecord) -> tuple[str, int] | None:
        """(VM type, count) the last round gave ``job``; None: no VMs this round."""
        ...

    def usable(self, job: JobRecord, vms: list[VMRecord]) -> list[VMRecord]:
        """The VMs a pool job may plan its next generation on."""
        ...

    def trigger(self, job: JobRecord, gen: GenerationRecord, vms: list[VMRecord],
                now: float) -> str | None:
        """Why a pool job's running generation must stop, or None."""
        ...

    def maintain(self, job: JobRecord, vms: list[VMRecord],
                 now: float) -> tuple[int, int, dict[str, Any] | None]:
        """Release VMs off the placement; (VMs wanted, slots per VM, the type's options)."""
        ...

    def share(self, job: JobRecord) -> PoolShare:
        """The job's place in the pool, for ``status``."""
        ...

    def type_provider(self, vm_type: str) -> tuple[str, dict[str, Any]] | None:
        """(provider, its options) of a pool type that names its own provider; None: the job's."""
        ...


class Reachability(Protocol):
    """Background probes of a host (Note [Silence probes] in manager/domain/silence.py); neither
    call blocks."""

    def probe(self, address: str, port: int) -> bool:
        """Start a probe of ``address:port`` unless one is in flight; True when one started."""
        ...

    def result(self, address: str, port: int) -> ProbeResult | None:
        """The latest finished probe of ``address:port``; None when none finished."""
        ...

    def close(self) -> None:
        """Stop probing (the manager stops)."""
        ...


class NoReachability:
    """The :class:`Reachability` of a manager that does not probe (``--silence-probe-after 0``):
    no verdict ever, so only T declares a silent VM gone."""

    def probe(self, address: str, port: int) -> bool:
        return False

    def result(self, address: str, port: int) -> ProbeResult | None:
        return None

    def close(self) -> None:
        pass


class NoLiveMorph:
    """The :class:`LiveMorph` of a daemon without live morph: no job is live, nothing is open."""

    def enabled(self, job: JobRecord) -> bool:
        return False

    def open_store(self, job: JobRecord, generation: int) -> str:
        raise RuntimeError("no live morph in this manager")

    def address(self, job: Any, generation: int) -> str | None:
        return None

    def worker_env(self, job: Any, generation: int) -> dict[str, str]:
        return {}

    def close(self, job_id: str, generation: int | None = None) -> None:
        pass

    def close_all(self) -> None:
        pass

    def on_failure(self, job: JobRecord, gen: GenerationRecord, failed: list[VMRecord],
                   now: float) -> bool:
        return False

    def on_notice(self, job: JobRecord, gen: GenerationRecord, noticed: list[VMRecord],
                  now: float) -> bool:
        return False

    def on_grow(self, job: JobRecord, gen: GenerationRecord, extra: list[VMRecord],
                now: float) -> bool:
        return False

    def drop_frozen(self, job: JobRecord, gen: GenerationRecord, vms: dict[str, VMRecord],
                    now: float) -> GenerationRecord:
        return gen

    def drop_leavers(self, job: JobRecord, gen: GenerationRecord,
                     vms: dict[str, VMRecord]) -> GenerationRecord:
        return gen

    def member_views(self, gen: GenerationRecord, vms: dict[str, VMRecord]) -> dict[str, VMRecord]:
        return vms

    def leaving(self, gen: GenerationRecord) -> tuple[str, ...]:
        return ()

    def to_kill(self, gen: GenerationRecord, vm_id: str) -> list[int]:
        return []

    def step_reported(self, job: JobRecord, generation: int, step: int, now: float,
                      layout: tuple[int, int] | None = None) -> None:
        pass


class NoPool:
    """The :class:`SharedPool` of a daemon without ``--pool``: no job is a pool job."""

    active = False

    def is_pool(self, job: JobRecord) -> bool:
        return False

    def tick(self, now: float) -> None:
        pass

    def target(self, job: JobRecord) -> tuple[str, int] | None:
        return None

    def usable(self, job: JobRecord, vms: list[VMRecord]) -> list[VMRecord]:
        return []

    def trigger(self, job: JobRecord, gen: GenerationRecord, vms: list[VMRecord],
                now: float) -> str | None:
        return None

    def maintain(self, job: JobRecord, vms: list[VMRecord],
                 now: float) -> tuple[int, int, dict[str, Any] | None]:
        return 0, 1, None

    def share(self, job: JobRecord) -> PoolShare:
        raise RuntimeError("no shared pool in this manager")

    def type_provider(self, vm_type: str) -> tuple[str, dict[str, Any]] | None:
        return None
