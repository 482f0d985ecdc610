"""The manager's brain: the job life cycle, VM liveness, morphs (paper §4.6).

A :class:`Manager` owns the :class:`~manager.store.Store` and a control loop that runs every
``tick_s``; the gRPC handlers call its methods (``submit``, ``vm_heartbeat``...). All decisions
are taken under one lock, from the state in the store, so a restarted manager picks up where the
old one stopped; provider calls (which may take seconds on a cloud) run outside the lock.

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

import json
import re
import secrets
import shlex
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from manager import varuna_manager_pb2 as pb
from manager.jobspec import JobSpec, ProfileSpec, spec_from_pb
from manager.policy import (
    LayoutPlan,
    StutterConfig,
    StutterDetector,
    choose_layout,
    grow_gain,
    predicted_compute_s,
)
from manager.providers import Provider, ProviderContext, make_provider
from manager.store import GenerationRecord, JobRecord, ProgressRecord, Store, VMRecord, WorkerStatRecord
from varuna.core.calibration import Calibration

__all__ = ["CALIBRATION_MAX_ATTEMPTS", "Manager", "ManagerConfig", "ManagerError"]

LIVE_GENERATION_STATES = ("running", "stopping", "killing")

#: Profiling attempts per job: a VM lost during the run re-issues it on another one, this often.
CALIBRATION_MAX_ATTEMPTS = 3
#: Calibration states after which the job may be planned (Note [Calibration at job start]).
CALIBRATION_SETTLED = ("given", "none", "done", "failed")


class ManagerError(Exception):
    """A request the manager refuses; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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
    """T: a VM silent this long is gone."""
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
class _JobCache:
    """Per-job soft state, rebuilt from the store after a restart."""

    spec: JobSpec
    calibration: Calibration | None
    profile: ProfileSpec | None = None
    provider: Provider | None = None
    plans: dict[tuple[int, ...], LayoutPlan | str] = field(default_factory=dict)
    launches: dict[int, dict[str, list[pb.WorkerLaunch]]] = field(
        default_factory=dict
    )  # gen -> vm -> workers
    compute: dict[int, dict[int, tuple[int, float]]] = field(
        default_factory=dict
    )  # gen -> rank -> (stage, s)
    marked: dict[int, set[int]] = field(default_factory=dict)  # gen -> ranks marked slow
    create_after: float = 0.0
    provider_error_logged: float = 0.0


class Manager:
    """See the module docstring. ``provider_factory`` and ``clock`` (wall-clock seconds) are for
    tests: a fake cloud, and time that moves only when the test says so."""

    def __init__(
        self,
        store: Store,
        config: ManagerConfig,
        *,
        provider_factory: Callable[[str, dict[str, Any], ProviderContext], Provider] = make_provider,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.config = config
        self._provider_factory = provider_factory
        self._clock = clock
        self._lock = threading.RLock()
        self._jobs: dict[str, _JobCache] = {}
        self._detector = StutterDetector(config.stutter)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Provider calls decided during the current tick, run after the lock is released.
        self._actions: list[Callable[[], None]] = []
        #: Liveness is judged from max(last heartbeat, this): a manager that was down longer
        #: than T must not declare every VM gone the moment it comes back.
        self.started_at = clock()
        self._context = ProviderContext(
            manager_address=config.advertise_address,
            token_file=config.token_file,
            tls_ca=config.tls_ca,
            state_dir=config.state_dir,
            heartbeat_interval_s=config.heartbeat_interval_s,
            orphan_timeout_s=config.orphan_timeout_s,
        )
        for job in store.jobs(active_only=True):
            store.add_event(
                job.job_id,
                "manager-started",
                "manager (re)started; resuming supervision",
                generation=job.generation,
            )

    # ------------------------------------------------------------------------------------------
    # Life cycle

    def start(self) -> None:
        """Run the control loop in a background thread."""
        self._thread = threading.Thread(target=self._run, name="varuna-manager-control", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the control loop (VMs and workers keep running: a restart resumes them)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            for cache in self._jobs.values():
                if cache.provider is not None:
                    cache.provider.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # one bad tick must not end supervision; log and go on
                traceback.print_exc(file=sys.stderr)
            self._stop.wait(self.config.tick_s)

    # ------------------------------------------------------------------------------------------
    # Helpers

    def _cache(self, job: JobRecord) -> _JobCache:
        cache = self._jobs.get(job.job_id)
        if cache is None:
            spec = JobSpec.from_dict(job.spec)
            cal = None
            if job.calibration_json:
                cal = Calibration.from_dict(
                    json.loads(job.calibration_json), source=f"job {job.job_id} calibration"
                )
            cache = self._jobs[job.job_id] = _JobCache(spec=spec, calibration=cal, profile=spec.profile_spec)
        return cache

    def _provider(self, job: JobRecord) -> Provider:
        cache = self._cache(job)
        if cache.provider is None:
            cache.provider = self._provider_factory(
                cache.spec.provider, cache.spec.provider_options, self._context
            )
        return cache.provider

    def _event(self, job_id: str, kind: str, message: str = "", **kw: Any) -> None:
        self.store.add_event(job_id, kind, message, **kw)

    def _live_generation(self, job: JobRecord) -> GenerationRecord | None:
        if job.generation <= 0:
            return None
        gen = self.store.generation(job.job_id, job.generation)
        return gen if gen is not None and gen.state in LIVE_GENERATION_STATES else None

    def _age(self, vm: VMRecord, now: float) -> float:
        return now - max(vm.last_heartbeat or vm.created, self.started_at)

    def _note_detection(self, job: JobRecord, reason: str, now: float) -> None:
        if job.detection_time is None:
            self.store.update_job(job.job_id, detection_time=now, detection_reason=reason)
            job.detection_time, job.detection_reason = now, reason

    def _plan(self, job: JobRecord, slots: list[int]) -> LayoutPlan:
        cache = self._cache(job)
        key = tuple(slots)
        if key not in cache.plans:
            spec = cache.spec
            try:
                cache.plans[key] = choose_layout(
                    slots=slots,
                    global_batch_size=spec.global_batch_size,
                    calibration=cache.calibration,
                    micro_batch_size=spec.micro_batch_size,
                    pipeline_depth=spec.pipeline_depth,
                    num_segments=spec.num_segments,
                    gpu_memory_bytes=int(spec.gpu_memory_gib * 2**30),
                )
            except ValueError as exc:
                cache.plans[key] = str(exc)
        plan = cache.plans[key]
        if isinstance(plan, str):
            raise ValueError(plan)
        return plan

    # ------------------------------------------------------------------------------------------
    # RPCs from the CLI

    def submit(self, msg: pb.JobSpec) -> str:
        try:
            spec = spec_from_pb(msg)
            calibration_json = msg.calibration_json
            if calibration_json:
                Calibration.from_dict(json.loads(calibration_json), source="calibration")
            # The provider options must make sense now, not at the first tick.
            if spec.provider == "local":
                from manager.providers.local import LocalProviderOptions

                LocalProviderOptions.from_dict(spec.provider_options)
            elif spec.provider == "azure":
                from manager.providers.azure import AzureProviderOptions

                AzureProviderOptions.from_dict(spec.provider_options)
        except (ValueError, TypeError) as exc:
            raise ManagerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc).splitlines()[0]) from None
        if calibration_json and spec.profile:
            raise ManagerError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "jobspec: give either 'calibration' (a file) or [profile] (calibrate on the first VM), "
                "not both",
            )
        if calibration_json:
            cal_state, cal_source = "given", "from the job spec"
        elif spec.profile:
            cal_state, cal_source = "pending", ""
        else:
            cal_state = "none"
            cal_source = "none: fallback rule (the job spec has neither a calibration nor [profile])"
        slug = re.sub(r"[^a-z0-9]+", "-", spec.display_name.lower()).strip("-")[:24] or "job"
        job_id = f"{slug}-{secrets.token_hex(3)}"
        with self._lock:
            self.store.add_job(
                job_id,
                spec.to_dict(),
                calibration_json,
                calibration_state=cal_state,
                calibration_source=cal_source,
            )
            self._event(
                job_id,
                "submitted",
                f"{spec.display_name}: {spec.min_vms}..{spec.max_vms} VMs × "
                f"{spec.procs_per_vm} on {spec.provider}, M={spec.global_batch_size}, "
                f"target step {spec.target_steps}; calibration: "
                + (cal_source if cal_state != "pending" else "to be profiled on the first VM"),
            )
        return job_id

    def cancel(self, job_id: str) -> str:
        with self._lock:
            job = self.store.job(job_id)
            if job is None:
                raise ManagerError(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}; see varuna-manager status")
            if not job.terminal and not job.cancel_requested:
                self.store.update_job(job_id, cancel_requested=1)
                self._event(job_id, "cancel-requested", "cancel requested: checkpoint, stop, delete VMs")
            return "cancelling" if not job.terminal else job.state

    def events(self, job_id: str, after_id: int, limit: int) -> list[pb.Event]:
        if job_id and self.store.job(job_id) is None:
            raise ManagerError(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}; see varuna-manager status")
        return [
            pb.Event(
                id=e.id,
                job_id=e.job_id,
                time=e.time,
                kind=e.kind,
                vm_id=e.vm_id,
                generation=e.generation,
                message=e.message,
                data_json=e.data_json,
            )
            for e in self.store.events(job_id, after_id=after_id, limit=limit)
        ]

    def status(self, job_id: str, history: int) -> list[pb.JobStatus]:
        with self._lock:
            if job_id:
                job = self.store.job(job_id)
                if job is None:
                    raise ManagerError(
                        grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}; see varuna-manager status"
                    )
                jobs = [job]
            else:
                jobs = self.store.jobs()
            return [self._job_status(job, history) for job in jobs]

    def _job_status(self, job: JobRecord, history: int) -> pb.JobStatus:
        now = self._clock()
        spec = JobSpec.from_dict(job.spec)
        gen = self.store.generation(job.job_id, job.generation) if job.generation else None
        out = pb.JobStatus(
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
            calibration_state=self._calibration_state(job),
            calibration=self._calibration_text(job, now),
        )
        gen_vms: list[str] = []
        stats: dict[int, WorkerStatRecord] = {}
        if gen is not None:
            out.generation_state = gen.state
            out.pipeline_depth, out.data_parallel = gen.pipeline_depth, gen.data_parallel
            out.micro_batch_size = gen.micro_batch_size
            gen_vms = gen.vm_ids
            stats = {s.rank: s for s in self.store.worker_stats(job.job_id, gen.generation)}
        for vm in self.store.vms(job.job_id):
            st = out.vms.add(
                vm_id=vm.vm_id,
                state=vm.state,
                health=self._health(vm, now),
                slots=vm.slots,
                address=vm.address,
                in_generation=vm.vm_id in gen_vms,
                agent_pid=vm.agent_pid,
                heartbeat_age_s=(now - vm.last_heartbeat) if vm.last_heartbeat else -1.0,
            )
            detail = (
                vm.slow_reason
                or (f"notice {vm.notice['event_type']} {vm.notice['event_id']}" if vm.notice else "")
                or vm.gone_reason
            )
            st.detail = detail
            if gen is not None and vm.reported_generation == gen.generation:
                for w in vm.workers:
                    s = stats.get(int(w["rank"]))
                    st.workers.add(
                        rank=int(w["rank"]),
                        pid=int(w["pid"]),
                        running=bool(w["running"]),
                        exit_code=int(w["exit_code"]),
                        stage=s.stage if s else 0,
                        replica=s.replica if s else 0,
                        step=s.step if s else 0,
                        fwd_s=s.fwd_s if s else 0.0,
                        bwd_s=s.bwd_s if s else 0.0,
                    )
        for p in self.store.progress(job.job_id, last=history):
            out.throughput.add(
                step=p.step,
                generation=p.generation,
                time=p.time,
                samples_per_s=p.samples_per_s,
                loss=p.loss,
                pipeline_depth=p.pipeline_depth,
                data_parallel=p.data_parallel,
            )
        return out

    def _health(self, vm: VMRecord, now: float) -> str:
        if vm.state == "requested":
            return "starting"
        if vm.state in ("gone", "deleted"):
            return vm.state
        if vm.notice:
            return "preempting"
        if vm.slow:
            return "slow"
        if self._age(vm, now) > self.config.heartbeat_timeout_s / 2:
            return "silent"
        return "healthy"

    # ------------------------------------------------------------------------------------------
    # RPCs from agents

    def register_vm(self, req: pb.RegisterVMRequest) -> pb.RegisterVMReply:
        now = self._clock()
        with self._lock:
            vm = self.store.vm(req.vm_id)
            if vm is None:
                job = self.store.job(req.job_id) if req.job_id else None
                if job is None or job.terminal:
                    raise ManagerError(
                        grpc.StatusCode.NOT_FOUND,
                        f"unknown VM {req.vm_id!r} and no active job {req.job_id!r}",
                    )
                # A VM named by its provider (scale set): it takes the place of a placeholder.
                for ph in self.store.vms(job.job_id, states=["requested"]):
                    if ph.ref.get("placeholder"):
                        self.store.update_vm(ph.vm_id, state="deleted", gone_reason=f"became {req.vm_id}")
                        break
                seq = self.store.next_vm_seq(job.job_id)
                self.store.add_vm(
                    VMRecord(
                        vm_id=req.vm_id,
                        job_id=job.job_id,
                        provider=self._cache(job).spec.provider,
                        seq=seq,
                        state="requested",
                        slots=req.slots,
                        created=now,
                    )
                )
                vm = self.store.vm(req.vm_id)
                assert vm is not None
            job = self.store.job(vm.job_id)
            if job is None or job.terminal or vm.state == "deleted":
                raise ManagerError(
                    grpc.StatusCode.FAILED_PRECONDITION, f"VM {req.vm_id} is not wanted any more"
                )
            if vm.agent_instance and vm.agent_instance != req.agent_instance:
                self._agent_restarted(job, vm, now)
            was = vm.state
            self.store.update_vm(
                vm.vm_id,
                state="up",
                address=req.address,
                hostname=req.hostname,
                agent_instance=req.agent_instance,
                agent_pid=req.pid,
                slots=req.slots or vm.slots,
                registered=now,
                last_heartbeat=now,
            )
            if was != "up":
                self._event(
                    job.job_id,
                    "vm-registered" if was == "requested" else "vm-back",
                    f"{vm.vm_id} at {req.address} ({req.slots} slot(s))",
                    vm_id=vm.vm_id,
                )
        return pb.RegisterVMReply(
            heartbeat_interval_s=self.config.heartbeat_interval_s, message=f"job {job.job_id}"
        )

    def _agent_restarted(self, job: JobRecord, vm: VMRecord, now: float) -> None:
        """A new agent process on a known VM: the old one's workers are gone with it."""
        self._event(
            job.job_id,
            "agent-restarted",
            f"{vm.vm_id}: a new agent process replaced the old one",
            vm_id=vm.vm_id,
        )
        gen = self._live_generation(job)
        if gen is not None and vm.vm_id in gen.vm_ids and gen.state != "killing":
            self._note_detection(job, f"agent restarted on {vm.vm_id}", now)
            self._begin_kill(job, gen, f"agent restarted on {vm.vm_id}", now)
        fresh = self.store.job(job.job_id) or job
        if fresh.calibration_state == "profiling" and fresh.calibration_vm == vm.vm_id:
            # The old agent's profiler died with it: this attempt will never report.
            self._calibration_lost(fresh, f"the agent on {vm.vm_id} restarted")

    def _registered_vm(self, vm_id: str):
        """The stored VM ``vm_id``; an RPC from a VM that never registered is NOT_FOUND."""
        vm = self.store.vm(vm_id)
        if vm is None:
            raise ManagerError(grpc.StatusCode.NOT_FOUND, f"unknown VM {vm_id!r}; register first")
        return vm

    def vm_heartbeat(self, req: pb.VMHeartbeatRequest) -> pb.Orders:
        now = self._clock()
        with self._lock:
            vm = self._registered_vm(req.vm_id)
            job = self.store.job(vm.job_id)
            orders = pb.Orders(
                heartbeat_interval_s=self.config.heartbeat_interval_s,
                stop_timeout_s=self.config.stop_timeout_s,
            )
            if job is None or job.terminal or vm.state == "deleted":
                orders.action = pb.Orders.SHUTDOWN
                return orders
            if vm.agent_instance and req.agent_instance and vm.agent_instance != req.agent_instance:
                self._agent_restarted(job, vm, now)
            values: dict[str, Any] = {
                "last_heartbeat": now,
                "reported_generation": req.generation,
                "free_port": req.free_port,
                "agent_instance": req.agent_instance or vm.agent_instance,
                "workers_json": json.dumps(
                    [
                        {"rank": w.rank, "pid": w.pid, "running": w.running, "exit_code": w.exit_code}
                        for w in req.workers
                    ]
                ),
            }
            if vm.state == "gone":
                # Silent for T, then back (a partition, a stalled VM): usable again once it has
                # shed its old workers (IDLE below). Its old generation was already killed.
                values["state"] = "up"
                values["gone_reason"] = ""
                self._event(job.job_id, "vm-back", f"{vm.vm_id} heartbeats again", vm_id=vm.vm_id)
            elif vm.state == "requested":
                values["state"] = "up"
            if req.has_notice and not vm.notice:
                notice = {
                    "event_id": req.notice.event_id,
                    "event_type": req.notice.event_type,
                    "not_before": req.notice.not_before,
                    "description": req.notice.description,
                }
                values["notice_json"] = json.dumps(notice)
                self._event(
                    job.job_id,
                    "preempt-notice",
                    f"{vm.vm_id}: {notice['event_type']} {notice['event_id']} not before "
                    f"{notice['not_before'] or '?'}; its agent sent SIGUSR1 (checkpoint and stop)",
                    vm_id=vm.vm_id,
                    data=notice,
                )
            self.store.update_vm(vm.vm_id, **values)
            gen = self._live_generation(job)
            if gen is None and job.calibration_state == "profiling" and vm.vm_id == job.calibration_vm:
                orders.action = pb.Orders.PROFILE
                orders.profile.CopyFrom(self._profile_order(job))
                return orders
            if gen is None or vm.vm_id not in gen.vm_ids:
                orders.action = pb.Orders.IDLE
                return orders
            orders.generation = gen.generation
            if gen.state == "running":
                orders.action = pb.Orders.RUN
                orders.workers.extend(self._launches(job, gen).get(vm.vm_id, []))
                orders.training = gen.first_step_time is not None
            elif gen.state == "stopping":
                orders.action = pb.Orders.STOP
            else:
                orders.action = pb.Orders.KILL
            return orders

    def _launches(self, job: JobRecord, gen: GenerationRecord) -> dict[str, list[pb.WorkerLaunch]]:
        """This generation's workers per VM (deterministic from the stored generation, so a
        restarted manager hands out the same ones)."""
        from varuna.launch.launcher import LaunchConfig, plan_workers

        cache = self._cache(job)
        if gen.generation in cache.launches:
            return cache.launches[gen.generation]
        spec = cache.spec
        vms = [self.store.vm(v) for v in gen.vm_ids]
        hosts = [
            _PlannedHost(address=vm.address or "127.0.0.1", slots=vm.slots) for vm in vms if vm is not None
        ]
        env = dict(spec.env)
        env.update(
            {
                "VARUNA_CHECKPOINT_DIR": spec.checkpoint_dir,
                "VARUNA_RESUME": "auto",
                "VARUNA_JOB_ID": job.job_id,
                "VARUNA_GENERATION": str(gen.generation),
            }
        )
        if spec.checkpoint_every:
            env["VARUNA_CHECKPOINT_EVERY"] = str(spec.checkpoint_every)
        if gen.micro_batch_size and not spec.micro_batch_size:
            env["VARUNA_MICRO_BATCH_SIZE"] = str(gen.micro_batch_size)
        config = LaunchConfig(
            script=spec.script,
            script_args=tuple(spec.args),
            module=spec.module,
            pipeline_depth=gen.pipeline_depth,
            data_parallel=gen.data_parallel,
            master_addr=gen.master_addr,
            master_port=gen.master_port,
            worker_env=env,
        )
        specs = plan_workers(
            config, hosts, master_port=gen.master_port, launcher_environ={}, cwd=spec.workdir
        )
        argv = ["-m", "manager.worker_shim", *(["-m"] if spec.module else []), spec.script, *spec.args]
        out: dict[str, list[pb.WorkerLaunch]] = {}
        for s in specs:
            vm_id = gen.vm_ids[s.env.host_id]
            out.setdefault(vm_id, []).append(
                pb.WorkerLaunch(rank=s.env.rank, argv=argv, env=dict(s.set_vars), cwd=s.cwd or "")
            )
        cache.launches[gen.generation] = out
        return out

    # ------------------------------------------------------------------------------------------
    # Calibration at job start (Note [Calibration at job start])

    def report_calibration(self, req: pb.ReportCalibrationRequest) -> pb.ReportCalibrationReply:
        """An agent's result of a PROFILE order. Only the job's current attempt, from the VM it
        was ordered on, is taken; anything else is answered ``accepted=False`` and ignored."""
        now = self._clock()
        with self._lock:
            vm = self._registered_vm(req.vm_id)
            job = self.store.job(vm.job_id)
            if job is None or job.terminal:
                return pb.ReportCalibrationReply(accepted=False, message="the job is over")
            current = (
                job.calibration_state == "profiling"
                and job.calibration_attempt == req.attempt
                and job.calibration_vm == vm.vm_id
            )
            if not current:
                return pb.ReportCalibrationReply(
                    accepted=False,
                    message=f"attempt {req.attempt} is not current (job calibration {job.calibration_state}, "
                    f"attempt {job.calibration_attempt} on {job.calibration_vm or '-'}); ignored",
                )
            where = f"on {vm.vm_id} after {req.wall_s:.1f} s"
            if not req.ok:
                reason = (req.error or "varuna-profile failed").splitlines()[0]
                self._calibration_failed(job, f"{reason} ({where})", vm_id=vm.vm_id, wall_s=req.wall_s)
                return pb.ReportCalibrationReply(accepted=True, message="failure recorded")
            try:
                cal = Calibration.from_dict(
                    json.loads(req.calibration_json), source=f"calibration profiled on {vm.vm_id}"
                )
            except (ValueError, TypeError, KeyError) as exc:  # JSONDecodeError is a ValueError
                detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                reason = f"invalid calibration file: {detail}"
                self._calibration_failed(job, f"{reason} ({where})", vm_id=vm.vm_id, wall_s=req.wall_s)
                return pb.ReportCalibrationReply(accepted=True, message="invalid calibration recorded")
            source = f"profiled on {vm.vm_id} in {req.wall_s:.1f} s"
            self.store.update_job(
                job.job_id,
                calibration_json=req.calibration_json,
                calibration_state="done",
                calibration_source=source,
            )
            cache = self._cache(job)
            cache.calibration = cal
            cache.plans.clear()
            self._event(
                job.job_id,
                "calibration-finished",
                f"calibration {source} (attempt {req.attempt}): {cal.num_segments} segments, "
                f"m = {', '.join(str(m) for m in cal.micro_batch_sizes)}; stored with the job",
                vm_id=vm.vm_id,
                data={
                    "attempt": req.attempt,
                    "wall_s": round(req.wall_s, 3),
                    "num_segments": cal.num_segments,
                    "micro_batch_sizes": list(cal.micro_batch_sizes),
                    "bytes": len(req.calibration_json),
                    "ordered_s": round(now - (job.calibration_started or now), 3),
                },
            )
            return pb.ReportCalibrationReply(accepted=True, message="stored")

    @staticmethod
    def _calibration_state(job: JobRecord) -> str:
        # Rows written before calibration states existed: given or none.
        return job.calibration_state or ("given" if job.calibration_json else "none")

    def _calibration_text(self, job: JobRecord, now: float) -> str:
        """Where the job's calibration comes from, for ``status``."""
        state = self._calibration_state(job)
        if state == "pending":
            return "pending: varuna-profile runs on the first usable VM"
        if state == "profiling":
            profile = self._cache(job).profile
            limit = f" of at most {profile.timeout_s:g} s" if profile is not None else ""
            elapsed = now - (job.calibration_started or now)
            return (
                f"profiling on {job.calibration_vm} (attempt {job.calibration_attempt}, "
                f"{elapsed:.0f} s{limit})"
            )
        if state == "given":
            return job.calibration_source or "from the job spec"
        return job.calibration_source or state

    def _profile_order(self, job: JobRecord) -> pb.ProfileOrder:
        cache = self._cache(job)
        profile = cache.profile
        assert profile is not None, "a profiling job has a [profile]"
        return pb.ProfileOrder(
            attempt=job.calibration_attempt,
            argv=profile.profiler_args(job_micro_batch_size=cache.spec.micro_batch_size),
            env=dict(cache.spec.env),
            cwd=cache.spec.workdir,
            timeout_s=profile.timeout_s,
        )

    def _calibration_ready(self, job: JobRecord, vms: list[VMRecord], now: float) -> bool:
        """Drive the job's calibration one step; True once the job may be planned."""
        state = self._calibration_state(job)
        profile = self._cache(job).profile
        if state == "failed" and profile is not None and profile.required:
            self._finish_job(
                job,
                "failed",
                f"calibration failed and the job spec requires one (profile.required): "
                f"{job.calibration_source}",
            )
            return False
        if state in CALIBRATION_SETTLED or profile is None:
            return True
        if state == "pending":
            usable = [vm for vm in vms if self._usable(vm, now, since=0.0)]
            if not usable:
                self._set_message(job, "waiting for a usable VM to calibrate on (varuna-profile)")
                return False
            self._start_calibration(job, usable[0], profile, now)
            return False
        # profiling
        vm = next((v for v in vms if v.vm_id == job.calibration_vm), None)
        if vm is None or vm.state != "up" or vm.notice:
            what = "is gone" if vm is None or vm.state != "up" else "has an eviction notice"
            self._calibration_lost(job, f"{job.calibration_vm} {what}")
            return False
        elapsed = now - (job.calibration_started or now)
        # The agent kills the run at timeout_s and reports it; this deadline is for an agent that
        # cannot report. After a manager restart, give agents a heartbeat timeout to report first.
        grace = self.config.heartbeat_timeout_s
        if elapsed > profile.timeout_s + grace and now - self.started_at > grace:
            self._calibration_failed(
                job,
                f"no result from {vm.vm_id} within the profile's timeout_s = {profile.timeout_s:g} s "
                "(raise profile.timeout_s or make the profile cheaper)",
                vm_id=vm.vm_id,
            )
            return False  # the next tick plans with the fallback rule, or fails the job
        self._set_message(
            job, f"calibrating on {vm.vm_id}: {elapsed:.0f} s of at most {profile.timeout_s:g} s"
        )
        return False

    def _start_calibration(self, job: JobRecord, vm: VMRecord, profile: ProfileSpec, now: float) -> None:
        attempt = job.calibration_attempt + 1
        self.store.update_job(
            job.job_id,
            calibration_state="profiling",
            calibration_attempt=attempt,
            calibration_vm=vm.vm_id,
            calibration_started=now,
        )
        argv = profile.profiler_args(job_micro_batch_size=self._cache(job).spec.micro_batch_size)
        self._event(
            job.job_id,
            "calibration-started",
            f"calibrating on {vm.vm_id} (attempt {attempt}, timeout {profile.timeout_s:g} s): "
            f"varuna-profile {shlex.join(argv)}",
            vm_id=vm.vm_id,
            data={"attempt": attempt, "argv": argv, "timeout_s": profile.timeout_s},
        )
        self._set_message(job, f"calibrating on {vm.vm_id}")

    def _calibration_lost(self, job: JobRecord, reason: str) -> None:
        """The VM running the profile went away: re-issue on another VM, or give up."""
        if job.calibration_attempt >= CALIBRATION_MAX_ATTEMPTS:
            self._calibration_failed(
                job,
                f"{reason} during attempt {job.calibration_attempt} of {CALIBRATION_MAX_ATTEMPTS}",
                vm_id=job.calibration_vm,
            )
            return
        self.store.update_job(job.job_id, calibration_state="pending")
        self._event(
            job.job_id,
            "calibration-lost",
            f"calibration attempt {job.calibration_attempt} lost: {reason}; re-issuing it on the next "
            f"usable VM (at most {CALIBRATION_MAX_ATTEMPTS} attempts)",
            vm_id=job.calibration_vm,
            data={"attempt": job.calibration_attempt, "reason": reason},
        )

    def _calibration_failed(
        self, job: JobRecord, reason: str, *, vm_id: str = "", wall_s: float = 0.0
    ) -> None:
        """Record that calibration is over without a result (never retried)."""
        profile = self._cache(job).profile
        required = profile is not None and profile.required
        source = ("failed" if required else "fallback rule") + f" (calibration failed: {reason})"
        self.store.update_job(job.job_id, calibration_state="failed", calibration_source=source)
        self._event(
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

    # ------------------------------------------------------------------------------------------
    # RPCs from workers

    def worker_heartbeat(self, req: pb.WorkerHeartbeatRequest) -> bool:
        now = self._clock()
        with self._lock:
            job = self.store.job(req.job_id)
            if job is None:
                raise ManagerError(grpc.StatusCode.NOT_FOUND, f"unknown job {req.job_id!r}")
            gen = self.store.generation(job.job_id, req.generation)
            if gen is None or gen.state == "ended":
                return False  # a straggler of an older generation
            if req.step <= req.resumed_from:
                # Started, no step yet: only the step it resumed from (a completed step) counts.
                if req.step > gen.last_step:
                    self.store.update_generation(job.job_id, gen.generation, last_step=req.step)
                if req.step > job.step:
                    self.store.update_job(job.job_id, step=req.step)
                return True
            self.store.put_worker_stat(
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
                    fwd_s=req.fwd_s,
                    bwd_s=req.bwd_s,
                    recompute_s=req.recompute_s,
                    micro_batch_size=req.micro_batch_size,
                    first_segment=req.first_segment,
                    end_segment=req.end_segment,
                )
            )
            if req.rank == 0:
                self.store.add_progress(
                    ProgressRecord(
                        job_id=job.job_id,
                        generation=gen.generation,
                        step=req.step,
                        time=now,
                        samples_per_s=req.samples_per_s,
                        loss=req.loss,
                        pipeline_depth=gen.pipeline_depth,
                        data_parallel=gen.data_parallel,
                    )
                )
            if req.step > gen.last_step:
                self.store.update_generation(job.job_id, gen.generation, last_step=req.step)
            if req.step > job.step:
                self.store.update_job(job.job_id, step=req.step)
            if gen.first_step_time is None and gen.state == "running":
                self._training_resumed(job, gen, req, now)
            self._check_stutter(job, gen, req)
        return True

    def _training_resumed(
        self, job: JobRecord, gen: GenerationRecord, req: pb.WorkerHeartbeatRequest, now: float
    ) -> None:
        self.store.update_generation(
            job.job_id, gen.generation, first_step_time=now, resumed_from=req.resumed_from
        )
        self.store.update_job(job.job_id, failed_launches=0, message="")
        previous = [g for g in self.store.generations(job.job_id) if g.generation < gen.generation]
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
        if job.detection_time is not None:
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
            self._event(
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
            self.store.update_job(job.job_id, detection_time=None, detection_reason="")
        else:
            self._event(
                job.job_id,
                "training-started",
                f"first step {req.step} on P={gen.pipeline_depth} × D={gen.data_parallel} "
                f"{now - gen.launched:.1f} s after launch",
                generation=gen.generation,
                data=data,
            )

    def _check_stutter(self, job: JobRecord, gen: GenerationRecord, req: pb.WorkerHeartbeatRequest) -> None:
        """Fail-stutter rule (paper §4.6): compute time above the replicas' median (D ≥ 3) or the
        calibration's prediction by X % for N heartbeats in a row marks the worker's VM slow."""
        if gen.state != "running" or req.num_microbatches <= 0:
            return
        cache = self._cache(job)
        compute_s = req.fwd_s + req.bwd_s + req.recompute_s
        peers = cache.compute.setdefault(gen.generation, {})
        peers[req.rank] = (req.stage, compute_s)
        replica_s = [s for stage, s in peers.values() if stage == req.stage]
        predicted = None
        if cache.calibration is not None and req.end_segment > req.first_segment and req.micro_batch_size > 0:
            try:
                predicted = predicted_compute_s(
                    cache.calibration,
                    req.first_segment,
                    req.end_segment,
                    req.micro_batch_size,
                    recompute=req.recompute_s > 0,
                )
            except (ValueError, IndexError):
                predicted = None
        verdict = self._detector.observe(
            key=(job.job_id, gen.generation, req.rank),
            step=req.step,
            compute_s=compute_s,
            replica_compute_s=replica_s,
            predicted_s=predicted,
        )
        if not verdict.marked:
            return
        marked = cache.marked.setdefault(gen.generation, set())
        world = gen.pipeline_depth * gen.data_parallel
        slow_now = self._detector.slow_now(lambda k: k[0] == job.job_id and k[1] == gen.generation)
        if verdict.rule == "calibration" and 2 * max(slow_now, len(marked) + 1) > world:
            # Most workers slower than predicted: the calibration does not describe these VMs
            # (another VM type, another software stack); excluding them would stop the job.
            if not self.store.events(job.job_id, kinds=["calibration-mismatch"]):
                self._event(
                    job.job_id,
                    "calibration-mismatch",
                    f"{slow_now} of {world} workers are slower than the calibration predicts; "
                    "not marking VMs slow on the calibration rule (re-run varuna-profile on these VMs)",
                    generation=gen.generation,
                )
            return
        marked.add(req.rank)
        vm = self.store.vm(req.vm_id)
        if vm is None or vm.slow:
            return
        n = self.config.stutter.heartbeats
        reason = (
            f"rank {req.rank} (stage {req.stage}): {compute_s * 1e3:.1f} ms per micro-batch vs "
            f"{verdict.rule} {verdict.reference_s * 1e3:.1f} ms (> +{self.config.stutter.threshold_pct:g} %) "
            f"for {n} heartbeats"
        )
        self.store.update_vm(vm.vm_id, slow=1, slow_reason=reason)
        self._event(
            job.job_id,
            "slow",
            f"{vm.vm_id} is fail-stutter slow: {reason}; it will be left out",
            vm_id=vm.vm_id,
            generation=gen.generation,
            data={
                "rank": req.rank,
                "compute_s": compute_s,
                "reference_s": verdict.reference_s,
                "rule": verdict.rule,
            },
        )

    # ------------------------------------------------------------------------------------------
    # The control loop

    def tick(self) -> None:
        """One pass over every active job (the loop calls it every ``tick_s``; tests call it)."""
        for job in self.store.jobs(active_only=True):
            with self._lock:
                provider = self._provider(job)
            # Provider news first, outside the lock (a cloud listing takes time).
            gone: list[str] = []
            try:
                gone = provider.gone_vms(self.store.vms(job.job_id, states=["requested", "up"]))
            except Exception as exc:  # provider trouble must not stop supervision
                self._provider_error(job, f"listing VMs failed: {exc}")
            with self._lock:
                self._actions = []
                fresh = self.store.job(job.job_id)
                if fresh is None or fresh.terminal:
                    continue
                now = self._clock()
                for vm_id in gone:
                    vm = self.store.vm(vm_id)
                    if vm is not None and vm.state in ("requested", "up"):
                        self._mark_gone(fresh, vm, "the provider reports it gone", now)
                self._tick_job(fresh, now)
                actions, self._actions = self._actions, []
            # Provider calls run in this thread, in order, without the lock: heartbeats are
            # answered meanwhile. A slow cloud call delays only the next tick.
            for action in actions:
                try:
                    action()
                except Exception as exc:
                    self._provider_error(job, str(exc))

    def _provider_error(self, job: JobRecord, text: str) -> None:
        cache = self._cache(job)
        now = self._clock()
        if now - cache.provider_error_logged > 60.0:  # one event a minute, not one per tick
            cache.provider_error_logged = now
            self._event(job.job_id, "provider-error", text.splitlines()[0] if text else "provider error")

    def _mark_gone(self, job: JobRecord, vm: VMRecord, reason: str, now: float) -> None:
        self.store.update_vm(vm.vm_id, state="gone", gone_reason=reason)
        gen = self._live_generation(job)
        in_gen = gen is not None and vm.vm_id in gen.vm_ids
        self._event(
            job.job_id,
            "vm-gone",
            f"{vm.vm_id}: {reason}" + (" (in the running generation)" if in_gen else ""),
            vm_id=vm.vm_id,
            generation=gen.generation if in_gen and gen else 0,
        )
        if in_gen and gen is not None and gen.state == "running":
            self._note_detection(job, f"{vm.vm_id} lost ({reason})", now)
        gone_vm = self.store.vm(vm.vm_id)
        provider = self._provider(job)
        if gone_vm is not None:
            self._actions.append(lambda: provider.delete_vm(gone_vm))

    def _tick_job(self, job: JobRecord, now: float) -> None:
        cfg = self.config
        for vm in self.store.vms(job.job_id, states=["requested", "up"]):
            if vm.state == "up" and self._age(vm, now) > cfg.heartbeat_timeout_s:
                self._mark_gone(job, vm, f"no heartbeat for {self._age(vm, now):.1f} s", now)
            elif vm.state == "requested" and now - max(vm.created, self.started_at) > cfg.register_timeout_s:
                self._mark_gone(job, vm, f"never registered within {cfg.register_timeout_s:g} s", now)
        job = self.store.job(job.job_id) or job
        gen = self._live_generation(job)
        if gen is not None:
            self._supervise(job, gen, self.store.vms(job.job_id), now)
            job = self.store.job(job.job_id) or job
            if job.terminal:
                return
            gen = self._live_generation(job)
        if gen is None:
            if job.cancel_requested:
                self._finish_job(job, "cancelled", "cancelled by the user")
                return
            self._maybe_launch(job, self.store.vms(job.job_id), now)
            job = self.store.job(job.job_id) or job
            if job.terminal:  # e.g. a required calibration failed
                return
        self._maintain_pool(job, self.store.vms(job.job_id), now)

    # -- a live generation ---------------------------------------------------------------------

    def _vm_progress(self, vm: VMRecord, g: int) -> tuple[bool, bool, bool]:
        """``(done, failed, clean)`` of one VM for generation ``g``: done = no worker of g runs
        there any more (or the VM is gone); failed = a worker of g exited non-zero or the VM
        vanished first; clean = every worker of g exited 0."""
        if vm.state != "up":
            reported = (
                vm.reported_generation == g
                and vm.workers
                and all(not w["running"] and w["exit_code"] == 0 for w in vm.workers)
            )
            return True, not reported, bool(reported)
        if vm.reported_generation < g:
            return False, False, False
        workers = vm.workers if vm.reported_generation == g else []
        done = all(not w["running"] for w in workers)
        failed = any(not w["running"] and w["exit_code"] != 0 for w in workers)
        return done, failed, done and not failed

    def _supervise(self, job: JobRecord, gen: GenerationRecord, vms: list[VMRecord], now: float) -> None:
        cfg = self.config
        by_id = {vm.vm_id: vm for vm in vms}
        gen_vms = [by_id[v] for v in gen.vm_ids if v in by_id]
        progress = [self._vm_progress(vm, gen.generation) for vm in gen_vms]
        all_done = all(p[0] for p in progress)
        failed = [vm for vm, p in zip(gen_vms, progress) if p[1]]
        all_clean = all(p[2] for p in progress)

        if gen.state == "running":
            if failed:
                what = ", ".join(
                    f"{vm.vm_id} ({'gone' if vm.state != 'up' else 'worker failed'})" for vm in failed
                )
                self._note_detection(job, f"generation {gen.generation} failed: {what}", now)
                self._begin_kill(job, gen, f"failure on {what}", now)
                return
            if all_done and all_clean:
                noticed = [vm for vm in gen_vms if vm.notice]
                if noticed or job.cancel_requested:
                    # The agents stopped the workers themselves (eviction notice): a clean stop.
                    why = (
                        "eviction notice on " + ", ".join(vm.vm_id for vm in noticed) if noticed else "cancel"
                    )
                    self._note_detection(job, why, now)
                    self._end_generation(job, gen, now, graceful=True, reason=why)
                    return
                spec = self._cache(job).spec
                last = max(gen.last_step, job.step)
                if last < spec.target_steps and gen.last_step > (gen.resumed_from or 0):
                    # Every worker stopped cleanly short of the target (a graceful stop this
                    # manager did not ask for, e.g. one asked by a manager process that has since
                    # been restarted): relaunch and resume. A generation that makes no progress
                    # at all ends the job below instead, so a script whose own --steps is lower
                    # than the target cannot make the manager loop.
                    why = f"workers stopped cleanly at step {last}, before target step {spec.target_steps}"
                    self._note_detection(job, why, now)
                    self._end_generation(job, gen, now, graceful=True, reason=why)
                    return
                self._end_generation(job, gen, now, graceful=True, reason="completed")
                msg = f"reached step {last}" + (
                    ""
                    if last >= spec.target_steps
                    else f" (before target step {spec.target_steps}: the script stopped)"
                )
                self._finish_job(job, "finished", msg)
                return
            trigger = self._graceful_trigger(job, gen, gen_vms, vms, now)
            if trigger is not None:
                if not trigger.startswith("cancel"):
                    self._note_detection(job, trigger, now)
                self._begin_stop(job, gen, trigger, now)
            return

        if gen.state == "stopping":
            if all_done:
                self._end_generation(job, gen, now, graceful=all_clean, reason=gen.stop_reason)
            elif failed:
                what = ", ".join(vm.vm_id for vm in failed)
                self._begin_kill(job, gen, f"failure during the graceful stop on {what}", now)
            elif now - (gen.stop_time or now) > cfg.stop_timeout_s:
                self._begin_kill(job, gen, f"graceful stop took more than {cfg.stop_timeout_s:g} s", now)
            return

        # killing
        if all_done or now - (gen.stop_time or now) > cfg.kill_timeout_s:
            self._end_generation(job, gen, now, graceful=False, reason=gen.stop_reason)

    def _graceful_trigger(
        self, job: JobRecord, gen: GenerationRecord, gen_vms: list[VMRecord], vms: list[VMRecord], now: float
    ) -> str | None:
        if job.cancel_requested:
            return "cancel requested"
        noticed = [vm.vm_id for vm in gen_vms if vm.notice]
        if noticed:
            return f"eviction notice on {', '.join(noticed)}"
        slow = [vm.vm_id for vm in gen_vms if vm.slow]
        if slow:
            return f"fail-stutter slow VM {', '.join(slow)}"
        # Grow: usable VMs outside the generation and a predicted gain worth a morph.
        if gen.first_step_time is None or now - gen.first_step_time < self.config.grow_cooldown_s:
            return None
        extra = [vm for vm in vms if vm.vm_id not in gen.vm_ids and self._usable(vm, now, since=0.0)]
        if not extra:
            return None
        starting = [
            vm for vm in vms if vm.state == "requested" and now - vm.created < self.config.gather_timeout_s
        ]
        if starting:
            # VMs of the same request are still booting: let them join first (at most the gather
            # timeout), so that capacity coming back costs one morph, not one per VM.
            self._set_message(
                job, f"{len(extra)} new VM(s) ready, {len(starting)} still starting: grow waits"
            )
            return None
        self._set_message(job, "")
        candidates = [vm for vm in vms if (vm.vm_id in gen.vm_ids and self._healthy(vm, now)) or vm in extra]
        try:
            plan = self._plan(job, [vm.slots for vm in candidates])
        except ValueError:
            return None
        gain = grow_gain(gen.predicted_samples_per_s, plan)
        if (
            plan.world_size > gen.pipeline_depth * gen.data_parallel
            and gain * 100 >= self.config.grow_min_gain_pct
        ):
            return (
                f"grow: {len(extra)} new VM(s); P={plan.pipeline_depth} × D={plan.data_parallel} predicted "
                f"{gain * 100:+.0f} % over P={gen.pipeline_depth} × D={gen.data_parallel}"
            )
        return None

    def _begin_stop(self, job: JobRecord, gen: GenerationRecord, reason: str, now: float) -> None:
        self._begin_ending(job, gen, "stopping", "graceful stop (SIGUSR1: checkpoint and exit)", reason, now)

    def _begin_kill(self, job: JobRecord, gen: GenerationRecord, reason: str, now: float) -> None:
        self._begin_ending(job, gen, "killing", "SIGKILL to its workers", reason, now)

    def _begin_ending(
        self, job: JobRecord, gen: GenerationRecord, state: str, how: str, reason: str, now: float
    ) -> None:
        """Mark ``gen`` as ending (``state`` "stopping" or "killing", also the event's kind)."""
        self.store.update_generation(
            job.job_id, gen.generation, state=state, stop_reason=reason, stop_time=now
        )
        self.store.update_job(job.job_id, state="stopping")
        self._event(
            job.job_id,
            state,
            f"generation {gen.generation}: {how}: {reason}",
            generation=gen.generation,
            data={"reason": reason},
        )

    def _end_generation(
        self, job: JobRecord, gen: GenerationRecord, now: float, *, graceful: bool, reason: str
    ) -> None:
        gen = self.store.generation(job.job_id, gen.generation) or gen
        self.store.update_generation(
            job.job_id, gen.generation, state="ended", ended=now, graceful=int(graceful)
        )
        self._detector.forget(lambda k: k[0] == job.job_id and k[1] == gen.generation)
        cache = self._cache(job)
        cache.compute.pop(gen.generation, None)
        cache.launches.pop(gen.generation, None)
        self._event(
            job.job_id,
            "generation-ended",
            f"generation {gen.generation} ended {'cleanly' if graceful else 'by kill'} at step "
            f"{gen.last_step}: {reason}",
            generation=gen.generation,
            data={
                "graceful": graceful,
                "last_step": gen.last_step,
                "reason": reason,
                "duration_s": round(now - gen.launched, 3),
            },
        )
        if gen.first_step_time is None and reason != "completed":
            failures = job.failed_launches + 1
            self.store.update_job(job.job_id, failed_launches=failures, state="pending")
            if failures >= self.config.max_failed_launches:
                self._finish_job(
                    job,
                    "failed",
                    f"{failures} generations in a row ended before their first step; see the worker logs",
                )
        else:
            self.store.update_job(job.job_id, state="pending")

    def _finish_job(self, job: JobRecord, state: str, message: str) -> None:
        self.store.update_job(job.job_id, state=state, message=message)
        fresh = self.store.job(job.job_id) or job
        self._event(job.job_id, state, message, data={"step": fresh.step})
        # Delete every VM (their agents get SHUTDOWN meanwhile, should they heartbeat).
        provider = self._provider(job)
        for vm in self.store.vms(job.job_id, states=["requested", "up", "gone"]):
            self.store.update_vm(vm.vm_id, state="deleted")
            self._actions.append(lambda vm=vm: provider.delete_vm(vm))

    # -- launching -----------------------------------------------------------------------------

    def _healthy(self, vm: VMRecord, now: float) -> bool:
        """Up, not slow, not announced for eviction, heard from within T."""
        return (
            vm.state == "up"
            and not vm.slow
            and not vm.notice
            and vm.last_heartbeat is not None
            and self._age(vm, now) <= self.config.heartbeat_timeout_s
        )

    def _usable(self, vm: VMRecord, now: float, since: float) -> bool:
        """Healthy, heard from after ``since``, a port for the rendezvous, no worker running."""
        return (
            self._healthy(vm, now)
            and vm.free_port > 0
            and (vm.last_heartbeat or 0.0) > since
            and not any(w["running"] for w in vm.workers)
        )

    def _maybe_launch(self, job: JobRecord, vms: list[VMRecord], now: float) -> None:
        cfg, spec = self.config, self._cache(job).spec
        if not self._calibration_ready(job, vms, now):
            return
        job = self.store.job(job.job_id) or job
        last = self.store.generation(job.job_id, job.generation) if job.generation else None
        # Proof of life must postdate the moment the last generation was told to stop (or ended).
        since = (last.stop_time or last.ended or 0.0) if last is not None else 0.0
        candidates = [vm for vm in vms if vm.state == "up" and not vm.slow and not vm.notice]
        usable = [vm for vm in candidates if self._usable(vm, now, since)]
        unconfirmed = [vm for vm in candidates if vm not in usable]
        if last is not None and unconfirmed and now - since <= self.config.heartbeat_timeout_s:
            # After a failure, relaunch only once every VM proved alive since (heartbeat after the
            # generation ended, its old workers gone) or was declared gone: a VM that died with
            # the generation would otherwise be planned in and fail the next one too. After T,
            # go on without the ones that did not (a silent one is declared gone by then anyway;
            # one whose old workers will not die is left out).
            self._set_message(job, f"waiting for {len(unconfirmed)} VM(s) to confirm they are alive")
            return
        if last is None:
            pending = [vm for vm in vms if vm.state == "requested"]
            if (
                len(usable) < spec.max_vms
                and (pending or unconfirmed)
                and now - job.created < cfg.gather_timeout_s
            ):
                self._set_message(job, f"gathering VMs: {len(usable)} of {spec.max_vms} ready")
                return
        if len(usable) < spec.min_vms:
            self._set_message(job, f"waiting for VMs: {len(usable)} usable, min_vms is {spec.min_vms}")
            return
        try:
            plan = self._plan(job, [vm.slots for vm in usable])
        except ValueError as exc:
            self._set_message(job, f"no configuration fits {len(usable)} VM(s): {exc}")
            return
        chosen: list[VMRecord] = []
        for vm in usable:
            if sum(v.slots for v in chosen) >= plan.world_size:
                break
            chosen.append(vm)
        master = chosen[0]
        generation = job.generation + 1
        gen = GenerationRecord(
            job_id=job.job_id,
            generation=generation,
            state="running",
            pipeline_depth=plan.pipeline_depth,
            data_parallel=plan.data_parallel,
            micro_batch_size=plan.micro_batch_size or spec.micro_batch_size,
            vms_json=json.dumps([vm.vm_id for vm in chosen]),
            master_addr=master.address or "127.0.0.1",
            master_port=master.free_port,
            launched=now,
            predicted_samples_per_s=plan.predicted_samples_per_s,
        )
        self.store.add_generation(gen)
        self.store.update_job(job.job_id, message="")
        why = job.detection_reason or "initial launch"
        data: dict[str, Any] = {
            "P": plan.pipeline_depth,
            "D": plan.data_parallel,
            "m": gen.micro_batch_size,
            "vms": [vm.vm_id for vm in chosen],
            "usable": len(usable),
            "source": plan.source,
            "predicted_samples_per_s": plan.predicted_samples_per_s,
            "calibration": self._calibration_text(job, now),
            "reason": why,
        }
        change = ""
        if last is not None:
            data["previous"] = {
                "generation": last.generation,
                "P": last.pipeline_depth,
                "D": last.data_parallel,
                "vms": len(last.vm_ids),
            }
            change = f"P={last.pipeline_depth} × D={last.data_parallel} → "
        self._event(
            job.job_id,
            "launched",
            f"generation {generation}: {change}P={plan.pipeline_depth} × D={plan.data_parallel} on "
            f"{len(chosen)} VM(s) {', '.join(vm.vm_id for vm in chosen)} [{plan.source}]; {why}",
            generation=generation,
            data=data,
        )

    def _set_message(self, job: JobRecord, message: str) -> None:
        if job.message != message:
            self.store.update_job(job.job_id, message=message)

    def _maintain_pool(self, job: JobRecord, vms: list[VMRecord], now: float) -> None:
        """Ask the provider for VMs up to ``max_vms`` (slow and evicting ones do not count)."""
        cache = self._cache(job)
        spec = cache.spec
        live = [vm for vm in vms if vm.state in ("requested", "up") and not vm.slow and not vm.notice]
        want = spec.max_vms - len(live)
        if want <= 0 or now < cache.create_after or job.cancel_requested:
            return
        seqs = {
            f"{job.job_id}-vm{seq}": seq for seq in (self.store.next_vm_seq(job.job_id) for _ in range(want))
        }
        created_so_far = len(vms)
        provider = self._provider(job)
        cache.create_after = now + self.config.create_retry_s  # until the result says otherwise

        def create() -> None:
            new: list = []
            try:
                new = provider.create_vms(
                    job.job_id, list(seqs), spec.procs_per_vm, created_so_far=created_so_far
                )
            finally:
                # Numbers of VMs the provider did not start are given back: names stay dense
                # while the manager keeps asking a provider that is out of capacity.
                used = [seqs[nv.vm_id] for nv in new if nv.vm_id in seqs]
                self.store.release_vm_seqs(
                    job.job_id,
                    reserved_up_to=max(seqs.values()),
                    used_up_to=max(used, default=min(seqs.values()) - 1),
                )
            with self._lock:
                for nv in new:
                    if self.store.vm(nv.vm_id) is None:
                        self.store.add_vm(
                            VMRecord(
                                vm_id=nv.vm_id,
                                job_id=job.job_id,
                                provider=spec.provider,
                                seq=seqs.get(nv.vm_id, 0),
                                state="requested",
                                slots=spec.procs_per_vm,
                                created=self._clock(),
                                provider_ref=json.dumps(nv.ref),
                            )
                        )
                    else:  # its agent registered first
                        self.store.update_vm(nv.vm_id, provider_ref=json.dumps(nv.ref))
                if new:
                    self._event(
                        job.job_id,
                        "vm-requested",
                        f"{len(new)} VM(s) from {spec.provider}: {', '.join(nv.vm_id for nv in new)}",
                    )
                if len(new) == len(seqs):
                    cache.create_after = 0.0  # got everything: no back-off
                elif not self.store.events(job.job_id, kinds=["capacity"]):
                    self._event(
                        job.job_id,
                        "capacity",
                        f"{spec.provider} gave {len(new)} of {len(seqs)} VM(s); "
                        f"retrying every {self.config.create_retry_s:g} s",
                    )

        self._actions.append(create)


@dataclass(frozen=True)
class _PlannedHost:
    """Just enough of a ``varuna.launch.Host`` for ``plan_workers`` (address and slots)."""

    address: str
    slots: int
