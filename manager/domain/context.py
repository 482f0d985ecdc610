"""What every part of the manager works on: the store, the configuration, the clock, one lock,
per-job soft state, the live-morph and pool collaborators, and the few primitives they all use
(events, liveness of a VM, ending a generation or a job).

The manager is split by job (manager/domain/controller.py composes the parts): VM bookkeeping
(:mod:`manager.domain.vm_book`), calibration orders (:mod:`manager.domain.calibration_orders`), morph
planning (:mod:`manager.domain.morph_planner`), the generation life cycle (:mod:`manager.domain.generations`),
worker reports (:mod:`manager.domain.worker_reports`) and the client requests
(:mod:`manager.domain.job_requests`). They share one :class:`ManagerContext`; every decision is taken
under its lock, from the state in the store.

    >>> ManagerConfig(advertise_address="h:1", token_file="t", state_dir="d").heartbeat_timeout_s
    15.0
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from manager.common.wire import MAX_RECONNECT_BACKOFF_S
from manager.domain.jobspec import JobSpec, ProfileSpec
from manager.domain.messages import WorkerLaunch
from manager.domain.policy import StutterConfig, StutterDetector
from manager.domain.ports import LiveMorph, NoLiveMorph, NoPool, NoReachability, Reachability, SharedPool
from manager.domain.records import GenerationRecord, JobRecord, VMRecord
from manager.domain.store import Store
from manager.providers.base import Provider, ProviderContext
from manager.providers.registry import provider_entry
from varuna.core.calibration import Calibration

__all__ = ["LIVE_GENERATION_STATES", "JobCache", "ManagerConfig", "ManagerContext"]

LIVE_GENERATION_STATES = ("running", "stopping", "killing")


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """Tuning of the control loop; every field is a ``varuna-manager serve`` flag."""

    advertise_address: str
    """``host:port`` that agents and workers use to reach this manager."""
    token_file: str
    tls_ca: str | None = None
    """Certificate agents/workers verify the manager with (when serving TLS)."""
    state_dir: str
    """Directory for pretend-VM logs (local provider)."""
    heartbeat_interval_s: float = 2.0
    """How often agents heartbeat."""
    heartbeat_timeout_s: float = 15.0
    """T: a VM silent this long is gone (whatever a probe says)."""
    silence_probe_after_s: float = 3.0
    """S: a VM quiet this long is probed, and gone at once when its host does not answer (Note
    [Silence probes] in manager/domain/silence.py); 0: never. The CLI's default is 1.5 heartbeat
    intervals."""
    probe_timeout_s: float = 1.0
    """P: how long a probe waits for the VM's kernel to answer."""
    stop_timeout_s: float = 60.0
    """Graceful stop (checkpoint) → SIGKILL after this long."""
    kill_timeout_s: float = 15.0
    """How long a killed generation waits for agents to confirm before it is considered ended."""
    gather_timeout_s: float = 120.0
    """The first launch waits this long for ``max_vms`` VMs (then starts with ≥ ``min_vms``)."""
    register_timeout_s: float = 600.0
    """A requested VM that has not registered after this long is deleted."""
    create_retry_s: float = 30.0
    """Back-off after the provider could not give all the VMs asked for."""
    orphan_timeout_s: float = 300.0
    """Agents kill their workers and exit after this long without the manager."""
    max_failed_launches: int = 5
    """Generations in a row that end before their first step: then the job fails."""
    grow_min_gain_pct: float = 10.0
    """Morph onto new VMs only when the predicted throughput gain is at least this."""
    grow_cooldown_s: float = 60.0
    """A generation runs at least this long (after its first step) before a grow morph."""
    stutter: StutterConfig = field(default_factory=StutterConfig)
    tick_s: float = 0.2


@dataclass
class JobCache:
    """Per-job soft state, rebuilt from the store after a restart."""

    spec: JobSpec
    calibration: Calibration | None
    profile: ProfileSpec | None = None
    provider: Provider | None = None
    other_providers: dict[str, Provider] = field(default_factory=dict)
    """Providers of pool types that name their own (Note [Providers in a pool]), by their key."""
    plans: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    """Layouts per slot tuple (LayoutPlan or why nothing fits); with mixed VM types also the mixed
    placement per (slots, types) (``manager.domain.morph_planner.MorphPlanner.place``)."""
    launches: dict[int, dict[str, list[WorkerLaunch]]] = field(
        default_factory=dict
    )  # gen -> vm -> workers
    compute: dict[int, dict[int, dict[int, float]]] = field(
        default_factory=dict
    )  # gen -> stage -> rank -> latest compute s
    marked: dict[int, set[int]] = field(default_factory=dict)  # gen -> ranks marked slow
    type_calibrations: dict[str, tuple[str, Calibration]] = field(default_factory=dict)
    """VM type -> (its stored calibration JSON, parsed): the fail-stutter reference per type."""
    create_after: float = 0.0
    provider_error_logged: float = 0.0
    suspects_since: dict[int, float] = field(default_factory=dict)
    """gen -> when its first worker exited as a symptom (Note [Blame] in generations.py)."""


# Note [Restart grace]: after a restart the manager counts a VM's silence from the moment its RPC
# server listens, not from when the process started (loading the store and the jobs can take
# seconds on a loaded host), plus what a live client needs to reach it: gRPC's reconnect back-off
# (at most MAX_RECONNECT_BACKOFF_S, with up to 20 % jitter) and then its next heartbeat. Without
# the allowance a short T (2 s in the tests) left a healthy agent under a second to reconnect, and
# one slow RPC on a loaded machine declared it gone.


class ManagerContext:
    """The shared state of the manager's parts (module docstring). ``provider_factory`` and
    ``clock`` (wall-clock seconds) come from :class:`manager.domain.controller.Manager`; tests give a
    fake cloud and a clock that moves only when they say so. ``live`` and ``pool`` start as the
    null collaborators (:mod:`manager.domain.ports`); the Manager installs the real ones.

    Example::

        ctx = ManagerContext(Store(":memory:"), config, provider_factory=make_provider, clock=time.time)
        with ctx.lock:
            ctx.event(job_id, "note", "something happened")
    """

    def __init__(
        self,
        store: Store,
        config: ManagerConfig,
        *,
        provider_factory: Callable[[str, dict[str, Any], ProviderContext], Provider],
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.lock = threading.RLock()
        self.detector = StutterDetector(config.stutter)
        #: Provider calls decided during the current tick, run after the lock is released.
        self.actions: list[Callable[[], None]] = []
        #: Liveness is judged from max(last heartbeat, this + the reconnect allowance): a manager
        #: that was down longer than T must not declare every VM gone the moment it comes back,
        #: nor one whose last heartbeat times died with the old process before they were written
        #: (they are deferred: Note [Deferred writes] in manager/domain/record_cache.py). Reset by
        #: :meth:`serving` once the RPC server listens.
        self.started_at = clock()
        self._provider_factory = provider_factory
        self._jobs: dict[str, JobCache] = {}
        #: The shared pool (manager.domain.pool_rounds.PoolRounds) when serving with --pool.
        self.pool: SharedPool = NoPool()
        #: Live morph's stores and decisions (manager.domain.live_runs.LiveRuns), set by the Manager.
        self.live: LiveMorph = NoLiveMorph()
        #: Probes of quiet VMs' hosts (manager.common.reachability.Prober), set by the Manager.
        self.reach: Reachability = NoReachability()
        self.provider_context = ProviderContext(
            manager_address=config.advertise_address,
            token_file=config.token_file,
            tls_ca=config.tls_ca,
            state_dir=config.state_dir,
            heartbeat_interval_s=config.heartbeat_interval_s,
            orphan_timeout_s=config.orphan_timeout_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            silence_probe_after_s=config.silence_probe_after_s,
        )

    # -- per-job soft state --------------------------------------------------------------------

    def cache(self, job: JobRecord) -> JobCache:
        """The job's soft state, built from its stored spec and calibration on first use."""
        cache = self._jobs.get(job.job_id)
        if cache is None:
            spec = JobSpec.from_dict(job.spec)
            cal = None
            if job.calibration_json:
                cal = Calibration.from_dict(
                    json.loads(job.calibration_json), source=f"job {job.job_id} calibration"
                )
            cache = self._jobs[job.job_id] = JobCache(spec=spec, calibration=cal, profile=spec.profile_spec)
        return cache

    def pool_job(self, job: JobRecord) -> bool:
        """Whether ``job`` takes its VMs from the shared pool (docs/pool.md)."""
        return self.pool.is_pool(job)

    def provider(self, job: JobRecord, vm_type: str = "") -> Provider:
        """The job's provider, or the one of pool type ``vm_type`` when that type names its own
        (Note [Providers in a pool]); made on first use, closed by :meth:`close_providers`."""
        cache = self.cache(job)
        own = self.pool.type_provider(vm_type) if vm_type and self.pool_job(job) else None
        if own is not None and own[0] != cache.spec.provider:
            name, options = own
            per_type = provider_entry(name).type_options  # the same provider for a pool's types
            key = json.dumps([name, {k: v for k, v in options.items() if k not in per_type}], sort_keys=True)
            if key not in cache.other_providers:
                cache.other_providers[key] = self._provider_factory(name, options, self.provider_context)
            return cache.other_providers[key]
        if cache.provider is None:
            cache.provider = self._provider_factory(
                cache.spec.provider, cache.spec.provider_options, self.provider_context
            )
        return cache.provider

    def provider_of(self, job: JobRecord, vm: VMRecord) -> Provider:
        """The provider that made ``vm`` (its pool type's, else the job's)."""
        return self.provider(job, str(vm.ref.get("vm_type", "")))

    def close_providers(self) -> None:
        """Close every provider made so far (the manager is stopping)."""
        with self.lock:
            for cache in self._jobs.values():
                for provider in [cache.provider, *cache.other_providers.values()]:
                    if provider is not None:
                        provider.close()

    # -- shared primitives ---------------------------------------------------------------------

    def event(self, job_id: str, kind: str, message: str = "", **kw: Any) -> None:
        """Append one event to the job's history (``varuna-manager events``)."""
        self.store.add_event(job_id, kind, message, **kw)

    def set_message(self, job: JobRecord, message: str) -> None:
        """The job's one-line status message (written only when it changes)."""
        if job.message != message:
            self.store.update_job(job.job_id, message=message)

    def live_morph_job(self, job: JobRecord) -> bool:
        """Whether ``job`` morphs without a restart when it can (``live_morph = true``)."""
        return self.live.enabled(job)

    def live_generation(self, job: JobRecord) -> GenerationRecord | None:
        """The job's current generation if it is running, stopping or killing."""
        if job.generation <= 0:
            return None
        gen = self.store.generation(job.job_id, job.generation)
        return gen if gen is not None and gen.state in LIVE_GENERATION_STATES else None

    def note_detection(self, job: JobRecord, reason: str, now: float) -> None:
        """Remember when the first trigger of a morph was noticed (morph latency starts here)."""
        if job.detection_time is None:
            self.store.update_job(job.job_id, detection_time=now, detection_reason=reason)
            job.detection_time, job.detection_reason = now, reason

    def serving(self) -> None:
        """The RPC server listens from now: silence is counted from here (Note [Restart grace])."""
        self.started_at = self.clock()

    def age(self, vm: VMRecord, now: float) -> float:
        """Seconds since the VM was last heard from (never before this manager served, plus the
        clients' reconnect allowance: Note [Restart grace])."""
        since_start = self.started_at + self.reconnect_allowance_s
        return now - max(vm.last_heartbeat or vm.created, since_start)

    @property
    def reconnect_allowance_s(self) -> float:
        """Longest a live client may take to reach a manager that just started listening: its
        reconnect back-off with gRPC's jitter, then its next heartbeat."""
        return 1.2 * MAX_RECONNECT_BACKOFF_S + self.config.heartbeat_interval_s

    def health(self, vm: VMRecord, now: float) -> str:
        """One word for ``status``: starting, healthy, silent, slow, preempting, gone, deleted."""
        if vm.state == "requested":
            return "starting"
        if vm.state in ("gone", "deleted"):
            return vm.state
        if vm.notice:
            return "preempting"
        if vm.slow:
            return "slow"
        if self.age(vm, now) > self.config.heartbeat_timeout_s / 2:
            return "silent"
        return "healthy"

    def healthy(self, vm: VMRecord, now: float) -> bool:
        """Up, not slow, not announced for eviction, heard from within T."""
        return (
            vm.state == "up"
            and not vm.slow
            and not vm.notice
            and vm.last_heartbeat is not None
            and self.age(vm, now) <= self.config.heartbeat_timeout_s
        )

    def usable(self, vm: VMRecord, now: float, since: float) -> bool:
        """Healthy, heard from after ``since``, a port for the rendezvous, no worker running."""
        return (
            self.healthy(vm, now)
            and vm.free_port > 0
            and (vm.last_heartbeat or 0.0) > since
            and not any(w["running"] for w in vm.workers)
        )

    def finish_job(self, job: JobRecord, state: str, message: str) -> None:
        """End the job for good (``finished``, ``failed``, ``cancelled``) and delete its VMs."""
        self.store.update_job(job.job_id, state=state, message=message)
        fresh = self.store.job(job.job_id) or job
        self.event(job.job_id, state, message, data={"step": fresh.step})
        self.live.close(job.job_id)
        # Delete every VM (their agents get SHUTDOWN meanwhile, should they heartbeat).
        for vm in self.store.vms(job.job_id, states=["requested", "up", "gone"]):
            self.store.update_vm(vm.vm_id, state="deleted")
            self.actions.append(partial(self.provider_of(job, vm).delete_vm, vm))

    def begin_stop(self, job: JobRecord, gen: GenerationRecord, reason: str, now: float) -> None:
        """Ask ``gen``'s workers to checkpoint and exit (SIGUSR1 through the agents' orders)."""
        self._begin_ending(job, gen, "stopping", "graceful stop (SIGUSR1: checkpoint and exit)", reason, now)

    def begin_kill(self, job: JobRecord, gen: GenerationRecord, reason: str, now: float) -> None:
        """SIGKILL ``gen``'s workers (the survivors of a failure cannot finish the mini-batch)."""
        self._begin_ending(job, gen, "killing", "SIGKILL to its workers", reason, now)

    def _begin_ending(
        self, job: JobRecord, gen: GenerationRecord, state: str, how: str, reason: str, now: float
    ) -> None:
        """Mark ``gen`` as ending (``state`` "stopping" or "killing", also the event's kind); the
        agents' next orders say so, and the generation ends once they confirm (generations.py)."""
        self.store.update_generation(
            job.job_id, gen.generation, state=state, stop_reason=reason, stop_time=now
        )
        self.store.update_job(job.job_id, state="stopping")
        self.event(
            job.job_id,
            state,
            f"generation {gen.generation}: {how}: {reason}",
            generation=gen.generation,
            data={"reason": reason},
        )
