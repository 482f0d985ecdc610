"""The manager's brain: the job life cycle, VM liveness, morphs (paper §4.6).

A :class:`Manager` owns the :class:`~manager.domain.store.Store` and a control loop that runs every
``tick_s``; the transport's handlers call its methods (``submit``, ``vm_heartbeat``...) with the
plain messages of :mod:`manager.domain.messages` (manager/transport/convert.py converts the wire's).
It is a thin facade over parts with one job each, sharing one
:class:`~manager.domain.context.ManagerContext`; the parts never import one another, the facade
hands each the others it needs (Note [Ports] in manager/domain/ports.py):

- :class:`~manager.domain.vm_book.VMBook`: registration, agent heartbeats and their orders, lost VMs,
  asking the provider for VMs;
- :class:`~manager.domain.calibration_orders.CalibrationOrders`: calibration at job start;
- :class:`~manager.domain.morph_planner.MorphPlanner`: P×D for the usable VMs (auto-config for the
  job's schedule), the grow rule;
- :class:`~manager.domain.launches.WorkerLaunches`: each generation's worker launches and run plan;
- :class:`~manager.domain.generations.JobController`: the generation life cycle (launch, supervise,
  stop, kill, relaunch, finish);
- :class:`~manager.domain.worker_reports.WorkerReports`: worker heartbeats (progress, morph latency,
  fail-stutter);
- :class:`~manager.domain.job_requests.JobRequests`: submit, cancel, status, events;
- :class:`~manager.domain.live_runs.LiveRuns` (live morph) and, with ``--pool``,
  :class:`~manager.domain.pool_rounds.PoolRounds` (the shared pool): the context's ``live`` and
  ``pool`` collaborators (``ports.NoPool`` without a pool).

All decisions are taken under one lock, from the state in the store, so a restarted manager
picks up where the old one stopped; provider calls (which may take seconds on a cloud) run
outside the lock.

Job life cycle (Note [Generations]): a job runs as a sequence of *generations*, each one launch
of the script at one P×D on a fixed list of VMs. A generation is ``running``, then possibly
``stopping`` (graceful: SIGUSR1, every rank finishes the mini-batch, checkpoints and exits 0) or
``killing`` (SIGKILL, when a VM vanished and the survivors cannot finish the mini-batch), then
``ended``. While no generation is live the job is re-planned and the next one launched with
``VARUNA_RESUME=auto``, at the same global batch size. Triggers:

=========================  ==============================================================
what                       reaction
=========================  ==============================================================
a new job with [profile]   calibrate on its first usable VM, then plan (Note [Calibration
                           at job start])
VM silent for T s, or the  kill the generation; relaunch without the VM (steps since the
provider says it is gone   last periodic checkpoint are redone)
a worker exits non-zero    kill the generation; relaunch once every other VM of it proved
                           alive after the failure (or was declared gone)
eviction notice on a VM    graceful stop (the agent already sent SIGUSR1); relaunch without it
VM lost, ``live_morph``    the survivors regroup in place when every stage kept a replica
job                        (manager/domain/live_runs.py); else the kill + relaunch above
fail-stutter slow worker   graceful stop; relaunch without its VM
new VMs and ≥ X % gain     graceful stop; relaunch on more VMs (grow)
cancel                     graceful stop; delete the VMs
all workers exit 0         finished; delete the VMs
=========================  ==============================================================

Morph latency (what ``varuna-manager events`` reports): from the moment the manager noticed the
trigger (``jobs.detection_time``) to the first step completed by the next generation.

Note [Calibration at job start]: P×D is chosen by the simulator from a calibration. A job spec
either carries one (``calibration``: state ``given``), or says how to make one (``[profile]``:
state ``pending``), or neither (``none``: the fallback rule). A pending job, as soon as its first
VM is usable, orders that VM's agent to run ``varuna-profile`` (a PROFILE order: attempt number,
arguments, timeout; state ``profiling``); the agent sends the file back with ``ReportCalibration``,
the manager validates it (``Calibration.from_dict``), stores it in the job row (``done``) and only
then plans the first generation. Everything is in the store, so a restarted manager re-sends the
same attempt (the agent keys its run by the attempt number: it is awaited, never started twice)
and a stored result is simply reused. Reports of any other attempt are refused. A VM lost while
profiling gets the order re-issued on the next usable VM (a new attempt, at most
``CALIBRATION_MAX_ATTEMPTS``); a failed run, an invalid file or no result within the profile's
``timeout_s`` ends calibration for good (``failed``): the job plans with the fallback rule, or
fails when the profile says ``required = true``. Once ``done`` or ``failed`` it never runs again.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from manager.common.log_lines import RateLimitedLines, stderr_line
from manager.common.reachability import Prober
from manager.domain.calibration_orders import CalibrationOrders
from manager.domain.context import ManagerConfig, ManagerContext
from manager.domain.generations import JobController
from manager.domain.job_requests import JobRequests
from manager.domain.jobspec import JobSpec
from manager.domain.launches import WorkerLaunches
from manager.domain.live_runs import LiveRuns
from manager.domain.messages import (
    CalibrationReply,
    CalibrationReport,
    JobStatus,
    Orders,
    Registered,
    RegisterVM,
    VMHeartbeat,
    WorkerHeartbeat,
)
from manager.domain.morph_planner import MorphPlanner
from manager.domain.pool_config import PoolConfig
from manager.domain.pool_rounds import PoolRounds
from manager.domain.pool_store import PoolStore
from manager.domain.ports import Reachability
from manager.domain.records import EventRecord, JobRecord, VMRecord
from manager.domain.store import Store
from manager.domain.vm_book import VMBook
from manager.domain.worker_reports import WorkerReports
from manager.providers.base import Provider, ProviderContext
from manager.providers.registry import make_provider

__all__ = ["CHECKPOINT_EVERY_S", "Manager"]

#: How often the control loop copies the state file's WAL into the database (Store.checkpoint).
CHECKPOINT_EVERY_S = 1.0


class Manager:
    """See the module docstring. ``provider_factory`` and ``clock`` (wall-clock seconds) are for
    tests: a fake cloud, and time that moves only when the test says so. ``relock``: take the
    daemon lock again before a vanished state file is put back (``serve``'s
    ``DaemonLock.ensure``; ``OSError`` when another manager holds it now). ``reach``: the
    probes of quiet VMs' hosts (a test's fake; None: a real ``Prober`` unless the configuration
    turns probing off; Note [Silence probes] in manager/domain/silence.py).

    Example::

        manager = Manager(Store("state.sqlite"), ManagerConfig(advertise_address="h:7878",
                          token_file="tok", state_dir="vms"))
        manager.start()            # the control loop, in a thread
        job_id = manager.submit(spec)
    """

    def __init__(
        self,
        store: Store,
        config: ManagerConfig,
        *,
        provider_factory: Callable[[str, dict[str, Any], ProviderContext], Provider] = make_provider,
        clock: Callable[[], float] = time.time,
        pool: PoolConfig | None = None,
        relock: Callable[[], None] = lambda: None,
        reach: Reachability | None = None,
    ) -> None:
        self.ctx = ManagerContext(store, config, provider_factory=provider_factory, clock=clock)
        if reach is not None:
            self.ctx.reach = reach
        elif config.silence_probe_after_s > 0:  # Note [Silence probes] in manager/domain/silence.py
            self.ctx.reach = Prober(timeout_s=config.probe_timeout_s, clock=clock, max_workers=32)
        if pool is not None or PoolStore(store).load()[0]:
            # The shared pool (docs/pool.md); a restart without --pool goes on with the stored one.
            self.ctx.pool = PoolRounds(self.ctx, pool)
        self.calibration = CalibrationOrders(self.ctx)
        self.planner = MorphPlanner(self.ctx)
        self.launches = WorkerLaunches(self.ctx)
        self.ctx.live = LiveRuns(self.ctx, self.planner)
        self.controller = JobController(self.ctx, self.calibration, self.planner)
        self.vms = VMBook(self.ctx, self.calibration, self.launches)
        self.workers = WorkerReports(self.ctx)
        self.requests = JobRequests(self.ctx, self.calibration)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._checkpointed = 0.0  # time.monotonic() of the last WAL checkpoint
        self._relock = relock
        self._tick_errors = RateLimitedLines()
        self.failure: str | None = None
        """Why the manager stopped by itself (its state file replaced), for ``serve`` to say."""
        for line in store.problems:  # job rows quarantined when the file was opened
            stderr_line(f"varuna-manager: {line}")
        for job in store.jobs(active_only=True):
            store.add_event(
                job.job_id,
                "manager-started",
                "manager (re)started; resuming supervision",
                generation=job.generation,
            )

    @property
    def store(self) -> Store:
        """The manager's state."""
        return self.ctx.store

    @property
    def config(self) -> ManagerConfig:
        """The control loop's tuning."""
        return self.ctx.config

    @property
    def clock(self) -> Callable[[], float]:
        """Wall-clock seconds, as the manager reads them (a test's fake clock)."""
        return self.ctx.clock

    def vm_health(self, vm: VMRecord, now: float) -> str:
        """The manager's one word for a VM (``status``, the dashboard)."""
        return self.ctx.health(vm, now)

    @property
    def started_at(self) -> float:
        """When this manager process started (liveness is never judged from before it)."""
        return self.ctx.started_at

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Run the control loop in a background thread (call once the RPC server listens)."""
        self.ctx.serving()
        self._thread = threading.Thread(target=self._run, name="varuna-manager-control", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the control loop (VMs and workers keep running: a restart resumes them)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.ctx.store.flush()  # a stopped manager leaves nothing only in memory
        self.ctx.close_providers()
        self.ctx.reach.close()  # waits for probes in flight: at most the probe timeout
        with self.ctx.lock:
            self.ctx.live.close_all()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # one bad tick must not end supervision; log and go on
                traceback.print_exc(file=sys.stderr)
            self._stop.wait(self.config.tick_s)

    # -- requests (manager/transport/server.py calls them) ----------------------------------------

    def submit(self, spec: JobSpec, calibration_json: str = "") -> str:
        """A new job from ``varuna-manager submit`` (with the calibration file's content, or "");
        returns its id. ``ManagerError`` when it is refused."""
        return self.requests.submit(spec, calibration_json)

    def cancel(self, job_id: str) -> str:
        """Checkpoint, stop and delete the job's VMs; returns the job's state."""
        return self.requests.cancel(job_id)

    def events(self, job_id: str, after_id: int, limit: int) -> list[EventRecord]:
        """The job's events after ``after_id``."""
        return self.requests.events(job_id, after_id, limit)

    def status(self, job_id: str, history: int) -> list[JobStatus]:
        """The job's (every job's, ``job_id`` empty) status."""
        return self.requests.status(job_id, history)

    def register_vm(self, req: RegisterVM) -> Registered:
        """An agent registering its VM."""
        return self.vms.register(req)

    def vm_heartbeat(self, req: VMHeartbeat) -> Orders:
        """An agent's heartbeat; the reply is its VM's orders."""
        return self.vms.heartbeat(req)

    def report_calibration(self, req: CalibrationReport) -> CalibrationReply:
        """An agent's result of a PROFILE order."""
        with self.ctx.lock:
            return self.calibration.report(req, self.vms.registered_vm(req.vm_id))

    def worker_heartbeat(self, req: WorkerHeartbeat) -> bool:
        """A worker's per-step report; False tells a straggler of an ended generation to exit."""
        return self.workers.heartbeat(req)

    # -- the control loop ----------------------------------------------------------------------

    def tick(self) -> None:
        """One pass over every active job (the loop calls it every ``tick_s``; tests call it).
        A job whose pass fails does not stop the others' (Note [Corrupt rows] in
        manager/domain/store_schema.py: an unreadable job is quarantined)."""
        ctx = self.ctx
        with ctx.lock:  # unreadable jobs out first: the pool's round reads every job's spec
            jobs = [job for job in ctx.store.jobs(active_only=True) if self._readable(job)]
            if ctx.pool.active:
                ctx.pool.tick(ctx.clock())  # a round when one is due: placements for this pass
        for job in jobs:
            try:
                self._tick_one(job)
            except Exception as exc:  # this job's trouble is not the others'
                self._job_failed_tick(job, exc)
        # The heartbeats' deferred values, one transaction per tick (Note [Deferred writes] in
        # manager/domain/record_cache.py), and the WAL checkpoint about once a second: outside the
        # state lock, so RPCs are answered meanwhile.
        ctx.store.flush()
        if time.monotonic() - self._checkpointed >= CHECKPOINT_EVERY_S:
            self._guard_state_file()
            ctx.store.checkpoint()
            self._checkpointed = time.monotonic()

    def _tick_one(self, job: JobRecord) -> None:
        ctx = self.ctx
        with ctx.lock:  # each provider sees its own VMs (a pool type may name its own)
            by_provider: dict[int, tuple[Any, list]] = {id(ctx.provider(job)): (ctx.provider(job), [])}
            for vm in ctx.store.vms(job.job_id, states=["requested", "up"]):
                provider = ctx.provider_of(job, vm)
                by_provider.setdefault(id(provider), (provider, []))[1].append(vm)
        # Provider news first, outside the lock (a cloud listing takes time).
        gone: list[str] = []
        for provider, vms in by_provider.values():
            try:
                gone += provider.gone_vms(vms)
            except Exception as exc:  # provider trouble must not stop supervision
                self.vms.provider_error(job, f"listing VMs failed: {exc}")
        with ctx.lock:
            ctx.actions = []
            fresh = ctx.store.job(job.job_id)
            if fresh is None or fresh.terminal:
                return
            now = ctx.clock()
            for vm_id in gone:
                vm = ctx.store.vm(vm_id)
                if vm is not None and vm.state in ("requested", "up"):
                    self.vms.mark_gone(fresh, vm, "the provider reports it gone", now)
            try:
                self._tick_job(fresh, now)
            finally:
                actions, ctx.actions = ctx.actions, []
        # Provider calls run in this thread, in order, without the lock: heartbeats are
        # answered meanwhile. A slow cloud call delays only the next tick.
        for action in actions:
            try:
                action()
            except Exception as exc:
                self.vms.provider_error(job, str(exc))

    def _readable(self, job: JobRecord) -> bool:
        """Whether the job's stored spec and calibration can be read; else the job is quarantined
        (failed, one line; Note [Corrupt rows] in manager/domain/store_schema.py). ``ctx.lock`` held."""
        try:
            self.ctx.cache(job)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            why = " ".join(str(exc).split())[:300] or type(exc).__name__
            message = f"quarantined: its stored spec or calibration cannot be read ({why})"
            self.ctx.store.update_job(job.job_id, state="failed", message=message)
            self.ctx.event(job.job_id, "failed", message)
            vms = [vm.vm_id for vm in self.ctx.store.vms(job.job_id, states=["requested", "up"])]
            left = f"; its VMs {', '.join(vms)} are left to you (no provider without a spec)" if vms else ""
            stderr_line(f"varuna-manager: job {job.job_id}: {message}{left}; the other jobs go on")
            return False
        return True

    def _job_failed_tick(self, job: JobRecord, exc: Exception) -> None:
        """One job's pass failed (a bug, or a row the checks above do not catch): one line a
        minute per job and kind of error, with the traceback (a bug needs it); the next tick
        tries again."""
        key = (job.job_id, type(exc).__name__)
        if self._tick_errors.line(key, f"varuna-manager: job {job.job_id}: control loop pass failed: "
                                  f"{type(exc).__name__}: {exc}".splitlines()[0]):
            traceback.print_exc(file=sys.stderr)

    def _guard_state_file(self) -> None:
        """Note [State file vanishing] in manager/domain/state_file.py: put a vanished state file
        back; a replaced one stops the manager (:attr:`failure`)."""
        store = self.ctx.store
        state = store.file_state()
        if state == "ok":
            return
        if state == "missing":
            try:
                with self.ctx.lock:
                    self._relock()
                    store.restore()
            except OSError as exc:
                self._fail(f"the state file {store.path} was deleted under the running manager and {exc}")
                return
            stderr_line(
                f"varuna-manager: the state file {store.path} was deleted under the running manager;"
                " put it back from the open copy (nothing lost)"
            )
            return
        self._fail(
            f"the state file {store.path} was replaced by another file under the running manager;"
            " stopping (its own state is still in the open file: nothing more is written there)"
        )

    def _fail(self, message: str) -> None:
        """Stop the control loop for good with ``message`` (``serve`` says it and exits 1)."""
        if self.failure is None:
            self.failure = message
        self._stop.set()

    def _tick_job(self, job: JobRecord, now: float) -> None:
        store = self.ctx.store
        self.vms.check_liveness(job, now)
        job = store.job(job.job_id) or job
        gen = self.ctx.live_generation(job)
        if gen is not None:
            self.controller.supervise(job, gen, store.vms(job.job_id), now)
            job = store.job(job.job_id) or job
            if job.terminal:
                return
            gen = self.ctx.live_generation(job)
        if gen is None:
            if job.cancel_requested:
                self.ctx.finish_job(job, "cancelled", "cancelled by the user")
                return
            self.controller.maybe_launch(job, store.vms(job.job_id), now)
            job = store.job(job.job_id) or job
            if job.terminal:  # e.g. a required calibration failed
                return
        self.vms.maintain_pool(job, store.vms(job.job_id), now)
