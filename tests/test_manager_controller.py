"""The manager's control loop against simulated VMs, in one process and on a fake clock.

Agents and workers are played by :class:`SimVM`, which calls the domain's methods directly with
its plain messages (manager/domain/messages.py: no protobuf here; the wire is
tests/test_manager_service.py's) and obeys the orders the way ``manager.agent.vm_agent`` does; a
:class:`FakeProvider` hands out VM names. Nothing sleeps: the clock moves when the test says so.
The real agents, workers and providers are exercised by tests/test_manager_local.py and
tests/test_manager_e2e.py.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from manager.domain.context import ManagerConfig
from manager.domain.controller import Manager
from manager.domain.errors import ManagerError
from manager.domain.jobspec import JobSpec
from manager.domain.messages import (
    Action,
    Orders,
    PreemptNotice,
    RegisterVM,
    VMHeartbeat,
    WorkerHeartbeat,
    WorkerLaunch,
    WorkerState,
)
from manager.domain.policy import StutterConfig
from manager.domain.store import Store, VMRecord
from manager.providers.base import NewVM
from manager.transport.convert import spec_to_pb, submission_from_pb
from varuna.core.calibration import Calibration
from varuna.launch.supervisor import PEER_LOST_EXIT_CODE


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeProvider:
    name: str = "local"
    capacity: int = 100
    created: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    gone: set[str] = field(default_factory=set)

    def create_vms(
        self, job_id: str, names: Sequence[str], slots: int, *, created_so_far: int
    ) -> list[NewVM]:
        n = max(0, min(len(names), self.capacity - created_so_far))
        self.created.extend(names[:n])
        return [NewVM(vm_id=name, ref={"fake": True}) for name in names[:n]]

    def delete_vm(self, vm: VMRecord) -> None:
        self.deleted.append(vm.vm_id)

    def gone_vms(self, vms: Sequence[VMRecord]) -> list[str]:
        return [vm.vm_id for vm in vms if vm.vm_id in self.gone]

    def close(self) -> None:
        pass


@dataclass
class SimVM:
    """An agent and its workers, reduced to what the manager sees."""

    mgr: Manager
    vm_id: str
    job_id: str
    instance: str = field(default_factory=lambda: secrets.token_hex(4))
    generation: int = 0
    workers: dict[int, dict] = field(default_factory=dict)
    launches: dict[int, WorkerLaunch] = field(default_factory=dict)
    notice: PreemptNotice | None = None
    alive: bool = True
    port: int = 20000

    def register(self) -> None:
        self.mgr.register_vm(
            RegisterVM(
                vm_id=self.vm_id,
                job_id=self.job_id,
                agent_instance=self.instance,
                address="127.0.0.1",
                slots=1,
                pid=1,
            )
        )

    def beat(self) -> Orders:
        workers = tuple(
            WorkerState(rank=rank, pid=1000 + rank, running=w["running"], exit_code=w["exit_code"])
            for rank, w in self.workers.items()
        )
        req = VMHeartbeat(vm_id=self.vm_id, agent_instance=self.instance, generation=self.generation,
                          free_port=self.port, workers=workers, notice=self.notice)
        orders = self.mgr.vm_heartbeat(req)
        g = orders.generation
        if orders.action == Action.RUN and g > self.generation:
            self.generation = g
            self.workers = {w.rank: {"running": True, "exit_code": 0} for w in orders.workers}
            self.launches = {w.rank: w for w in orders.workers}
        elif orders.action == Action.STOP:
            if g > self.generation:
                self.generation, self.workers = g, {}
            for w in self.workers.values():  # SIGUSR1: checkpoint and exit 0
                if w["running"]:
                    w.update(running=False, exit_code=0)
        elif orders.action == Action.KILL and g >= self.generation:
            self.generation = g
            for w in self.workers.values():
                if w["running"]:
                    w.update(running=False, exit_code=-9)
        elif orders.action == Action.IDLE:
            for w in self.workers.values():
                w.update(running=False, exit_code=-9 if w["running"] else w["exit_code"])
        return orders

    def step(self, step: int, compute_s: float = 0.01, *, resumed_from: int = 0) -> None:
        for rank, w in self.workers.items():
            if not w["running"]:
                continue
            env = self.launches[rank].env
            P, D = int(env["VARUNA_PIPELINE_DEPTH"]), int(env["VARUNA_DATA_PARALLEL"])
            self.mgr.worker_heartbeat(
                WorkerHeartbeat(
                    job_id=self.job_id,
                    vm_id=self.vm_id,
                    generation=self.generation,
                    rank=rank,
                    stage=rank % P,
                    replica=rank // P,
                    pipeline_depth=P,
                    data_parallel=D,
                    step=step,
                    resumed_from=resumed_from,
                    loss=1.0 / step,
                    samples_per_s=100.0,
                    wall_time=time.time(),
                    fwd_s=compute_s / 3,
                    bwd_s=2 * compute_s / 3,
                    num_microbatches=2,
                    micro_batch_size=2,
                    first_segment=rank % P,
                    end_segment=rank % P,  # one segment per stage, last one included
                )
            )

    def finish(self, code: int = 0) -> None:
        for w in self.workers.values():
            w.update(running=False, exit_code=code)


class World:
    """A manager, a fake provider and the simulated VMs it asked for."""

    def __init__(
        self,
        tmp_path,
        *,
        store: Store | None = None,
        clock: Clock | None = None,
        provider: FakeProvider | None = None,
        **config,
    ) -> None:
        self.tmp_path = tmp_path
        self.clock = clock or Clock()
        self.provider = provider or FakeProvider()
        self.store = store or Store(str(tmp_path / "state.sqlite"))
        token = tmp_path / "token"
        if not token.exists():
            token.write_text(secrets.token_urlsafe(32))
            token.chmod(0o600)
        defaults = dict(
            advertise_address="127.0.0.1:1",
            token_file=str(token),
            state_dir=str(tmp_path / "vms"),
            heartbeat_interval_s=0.5,
            heartbeat_timeout_s=3.0,
            stop_timeout_s=10.0,
            kill_timeout_s=5.0,
            gather_timeout_s=30.0,
            grow_cooldown_s=5.0,
            stutter=StutterConfig(threshold_pct=100.0, heartbeats=3),
        )
        defaults.update(config)
        self.mgr = Manager(
            self.store, ManagerConfig(**defaults), provider_factory=lambda *a: self.provider, clock=self.clock
        )
        self.vms: dict[str, SimVM] = {}
        self.hold: set[str] = set()
        """VMs created but not registering yet (still booting)."""

    def submit(self, **overrides) -> str:
        spec = dict(
            script=str(self.tmp_path / "train.py"),
            global_batch_size=24,
            micro_batch_size=2,
            checkpoint_dir=str(self.tmp_path / "ckpt"),
            checkpoint_every=2,
            max_vms=4,
            min_vms=1,
            target_steps=50,
            num_segments=4,
        )
        calibration = overrides.pop("calibration_json", "")
        spec.update(overrides)
        return self.mgr.submit(JobSpec(**spec), calibration)

    def tick(self, seconds: float = 0.0) -> None:
        """Advance the clock, let every live VM heartbeat, run the control loop, and once more
        (new VMs register, everyone picks up the orders of that pass)."""
        self.clock.advance(seconds)
        self._beat()
        self.mgr.tick()
        for vm_id in self.provider.created:
            if vm_id not in self.vms and vm_id not in self.hold:
                self.vms[vm_id] = SimVM(self.mgr, vm_id, self.store.vm(vm_id).job_id)
                self.vms[vm_id].register()
        self._beat()
        self.mgr.tick()

    def _beat(self) -> None:
        for vm in self.vms.values():
            if vm.alive:
                try:
                    vm.beat()
                except ManagerError:  # a deleted VM: its agent would exit
                    vm.alive = False

    def until(self, condition, *, dt: float = 0.5, max_ticks: int = 40) -> None:
        """Tick (``dt`` apart) until ``condition()`` holds; fail after ``max_ticks``."""
        for _ in range(max_ticks):
            if condition():
                return
            self.tick(dt)
        assert condition(), "condition not reached"

    def gen(self, job_id: str):
        job = self.store.job(job_id)
        return self.store.generation(job_id, job.generation)

    def running(self, job_id: str) -> list[SimVM]:
        gen = self.gen(job_id)
        return [self.vms[v] for v in gen.vm_ids]

    def steps(
        self, job_id: str, first: int, last: int, *, resumed_from: int = 0, slow: dict | None = None
    ) -> None:
        for s in range(first, last + 1):
            for vm in self.running(job_id):
                vm.step(s, (slow or {}).get(vm.vm_id, 0.01), resumed_from=resumed_from)

    def kinds(self, job_id: str) -> list[str]:
        return [e.kind for e in self.store.events(job_id)]

    def event(self, job_id: str, kind: str):
        return [e for e in self.store.events(job_id) if e.kind == kind]


def test_launch_gathers_max_vms_then_plans_largest_layout(tmp_path):
    w = World(tmp_path)
    job = w.submit(max_vms=4)
    w.tick()
    assert len(w.provider.created) == 4
    w.tick(0.1)
    gen = w.gen(job)
    assert (gen.pipeline_depth, gen.data_parallel) == (1, 4)  # 4 segments: P ∈ {1, 2, 4}; ties → P=1
    assert gen.master_port == 20000
    vm = w.vms[gen.vm_ids[3]]
    env = vm.launches[3].env
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "4" and env["VARUNA_RESUME"] == "auto"
    assert env["VARUNA_CHECKPOINT_DIR"] == str(tmp_path / "ckpt") and env["VARUNA_CHECKPOINT_EVERY"] == "2"
    assert env["VARUNA_JOB_ID"] == job and env["VARUNA_GENERATION"] == "1"
    assert list(vm.launches[3].argv[:2]) == ["-m", "manager.worker.shim"]
    w.steps(job, 1, 3)
    assert w.store.job(job).step == 3
    assert "training-started" in w.kinds(job)
    assert [p.step for p in w.store.progress(job)] == [1, 2, 3]


def test_lost_vm_kills_generation_and_morphs_with_resume(tmp_path):
    w = World(tmp_path, provider=FakeProvider(capacity=4))
    job = w.submit(max_vms=4)
    w.tick()
    w.tick(0.1)
    w.steps(job, 1, 5)
    victim = w.running(job)[2]
    victim.alive = False  # kill -9: it never heartbeats again
    w.until(lambda: w.store.job(job).generation == 2)
    assert any(e.vm_id == victim.vm_id for e in w.event(job, "vm-gone"))
    gen = w.gen(job)
    assert victim.vm_id not in gen.vm_ids and gen.pipeline_depth * gen.data_parallel == 3
    assert w.store.generation(job, 1).graceful == 0  # killed, not stopped: survivors cannot finish
    w.tick(0.1)
    w.clock.advance(4.0)
    w.steps(job, 5, 6, resumed_from=4)
    resumed = w.event(job, "resumed")[0].data
    assert resumed["redone_steps"] == 1 and resumed["resumed_from"] == 4
    assert resumed["morph_latency_s"] >= 4.0
    assert victim.vm_id in w.provider.deleted


def test_failed_worker_waits_for_every_vm_to_prove_alive(tmp_path):
    w = World(tmp_path, provider=FakeProvider(capacity=3))
    job = w.submit(max_vms=3)
    w.tick()
    w.tick(0.1)
    w.steps(job, 1, 2)
    dead, survivor = w.running(job)[0], w.running(job)[1]
    dead.alive = False
    survivor.finish(code=1)  # its peer vanished: the collective fails
    w.tick(0.1)
    assert w.store.generation(job, 1).state in ("killing", "ended")
    w.tick(0.1)
    # The dead VM has not been silent for T yet: no relaunch may include it, so none happens.
    assert w.store.job(job).generation == 1
    w.until(lambda: w.store.job(job).generation == 2)
    gen = w.gen(job)
    assert gen.generation == 2 and dead.vm_id not in gen.vm_ids


def test_a_silent_vm_is_blamed_not_the_survivors_that_lost_it(tmp_path):
    """Note [Blame] in manager/domain/generations.py: a VM goes silent and the other workers' peer
    watches give up on it first (exit 75) while the manager still counts it as up. The killing
    event and the relaunch's recorded cause name the silent VM with its rank, not the survivors
    (before the fix: "failure on vm1 (worker failed), vm2 (worker failed), ...")."""
    w = World(tmp_path, provider=FakeProvider(capacity=4))
    job = w.submit(max_vms=4)
    w.tick()
    w.tick(0.1)
    w.steps(job, 1, 5)
    w.tick(2.0)  # past the manager's start grace (Note [Restart grace] in manager/domain/context.py)
    silent = w.running(job)[2]
    rank = next(iter(silent.workers))
    silent.alive = False
    w.tick(1.1)  # quiet for two heartbeat intervals: it may be silent
    survivors = [vm for vm in w.running(job) if vm is not silent]
    for vm in survivors:
        vm.finish(code=PEER_LOST_EXIT_CODE)
    w.tick(0.5)
    assert w.gen(job).state == "running", "symptoms only: the cause may yet show"
    w.until(lambda: w.event(job, "killing"))
    [killing] = w.event(job, "killing")
    cause = f"failure on {silent.vm_id} (rank {rank}) gone (no heartbeat for"
    assert cause in killing.message, killing.message
    assert not [vm.vm_id for vm in survivors if vm.vm_id in killing.message], killing.message
    [gone] = w.event(job, "vm-gone")
    assert gone.data["ranks"] == [rank] and gone.data["silent_s"] > w.mgr.config.heartbeat_timeout_s
    assert silent.vm_id in w.store.job(job).detection_reason
    assert not [vm.vm_id for vm in survivors if vm.vm_id in w.store.job(job).detection_reason]


def test_exits_75_without_a_cause_are_blamed_after_the_window(tmp_path):
    """The negative control of the test above: every VM alive and heartbeating, one worker exits
    75 (its peer watch named a peer that then came back): after the blame window that worker's
    VM is the cause."""
    w = World(tmp_path, provider=FakeProvider(capacity=4))
    job = w.submit(max_vms=4)
    w.tick()
    w.tick(0.1)
    w.steps(job, 1, 3)
    vm = w.running(job)[1]
    vm.finish(code=PEER_LOST_EXIT_CODE)
    w.tick(0.1)
    assert not w.event(job, "killing")
    w.until(lambda: w.event(job, "killing"), dt=0.25, max_ticks=8)
    [killing] = w.event(job, "killing")
    assert f"failure on {vm.vm_id} (rank" in killing.message
    assert "worker failed (exit code 75)" in killing.message


def test_preempt_notice_stops_gracefully_and_excludes_vm(tmp_path):
    w = World(tmp_path, provider=FakeProvider(capacity=4))
    job = w.submit(max_vms=4)
    w.tick()
    w.tick(0.1)
    w.steps(job, 1, 3)
    vm = w.running(job)[1]
    vm.notice = PreemptNotice(event_id="ev-1", event_type="Preempt", not_before="soon")
    vm.finish(0)  # its agent sent SIGUSR1 itself: workers checkpoint and exit 0
    w.tick(0.1)
    assert "preempt-notice" in w.kinds(job)
    assert w.store.generation(job, 1).state in ("stopping", "ended")
    w.tick(0.1)
    w.tick(0.1)
    assert w.store.generation(job, 1).graceful == 1
    gen = w.gen(job)
    assert gen.generation == 2 and vm.vm_id not in gen.vm_ids
    w.tick(0.1)  # the agents pick up their RUN orders
    w.steps(job, 4, 4, resumed_from=3)
    assert w.event(job, "resumed")[0].data["redone_steps"] == 0


def test_slow_worker_marked_after_n_heartbeats_and_left_out(tmp_path):
    w = World(tmp_path, provider=FakeProvider(capacity=4))
    job = w.submit(max_vms=4)
    w.tick()
    w.tick(0.1)
    slow_vm = w.running(job)[2].vm_id
    w.steps(job, 1, 2, slow={slow_vm: 0.05})  # 5× the median, but only twice: not yet
    assert not w.event(job, "slow")
    w.steps(job, 3, 3)  # a normal heartbeat resets the count
    w.steps(job, 4, 6, slow={slow_vm: 0.05})
    slow = w.event(job, "slow")
    assert [e.vm_id for e in slow] == [slow_vm] and slow[0].data["rule"] == "median"
    w.tick(0.1)
    assert w.store.generation(job, 1).state in ("stopping", "ended")
    w.tick(0.1)
    w.tick(0.1)
    gen = w.gen(job)
    assert gen.generation == 2 and slow_vm not in gen.vm_ids


def test_calibration_rule_when_few_replicas_and_mismatch_guard(tmp_path):
    cal = Calibration.synthetic(0.01, num_segments=2, micro_batch_sizes=(1, 2))
    predicted = 2 * (cal.fwd_s(0, 2) + cal.bwd_s(0, 2))
    w = World(tmp_path, provider=FakeProvider(capacity=2))
    job = w.submit(max_vms=2, pipeline_depth=2, num_segments=2, calibration_json=json.dumps(cal.to_dict()))
    w.tick()
    w.tick(0.1)
    gen = w.gen(job)
    assert (gen.pipeline_depth, gen.data_parallel) == (2, 1)
    # Both workers far slower than predicted: the calibration is wrong for these VMs, not the VMs.
    w.steps(job, 1, 4, slow={v: 20 * predicted for v in gen.vm_ids})
    assert not w.event(job, "slow") and w.event(job, "calibration-mismatch")


def test_grow_when_new_vms_join_and_gain_is_enough(tmp_path):
    provider = FakeProvider(capacity=2)
    w = World(tmp_path, provider=provider, gather_timeout_s=0.0, create_retry_s=1.0)
    job = w.submit(max_vms=4, min_vms=2)
    w.tick()
    w.tick(0.1)
    assert w.gen(job).data_parallel == 2
    w.steps(job, 1, 2)
    provider.capacity = 4  # spot capacity comes back
    w.tick(1.5)
    w.tick(0.1)
    assert len(provider.created) == 4
    assert w.store.generation(job, 1).state == "running"  # cooldown (5 s) not over yet
    w.tick(5.0)
    assert w.store.generation(job, 1).state in ("stopping", "ended")
    assert "grow" in w.event(job, "stopping")[0].message
    w.tick(0.1)
    w.tick(0.1)
    assert w.gen(job).data_parallel == 4


def test_grow_waits_for_the_vms_still_starting_then_morphs_once(tmp_path):
    provider = FakeProvider(capacity=2)
    w = World(tmp_path, provider=provider, create_retry_s=1.0, grow_cooldown_s=1.0)
    job = w.submit(max_vms=4, min_vms=2)
    w.tick()
    w.tick(0.1)
    assert w.gen(job).data_parallel == 2
    w.steps(job, 1, 2)
    provider.capacity = 4
    w.hold = {f"{job}-vm4"}  # boots slower than vm3
    w.tick(1.5)
    w.tick(2.0)
    assert provider.created[2:] == [f"{job}-vm3", f"{job}-vm4"]
    assert w.store.generation(job, 1).state == "running", "one new VM is still starting: wait for it"
    assert "1 still starting: grow waits" in w.store.job(job).message
    w.hold = set()
    w.tick(0.1)
    stops = w.event(job, "stopping")
    assert len(stops) == 1 and "2 new VM(s)" in stops[0].message
    w.until(lambda: w.store.job(job).generation == 2)
    assert w.gen(job).data_parallel == 4
    launched = w.event(job, "launched")[-1].data
    assert launched["previous"]["D"] == 2 and launched["reason"].startswith("grow")


def test_grow_does_not_wait_past_the_gather_timeout(tmp_path):
    provider = FakeProvider(capacity=2)
    w = World(tmp_path, provider=provider, create_retry_s=1.0, grow_cooldown_s=1.0, gather_timeout_s=5.0)
    job = w.submit(max_vms=4, min_vms=2)
    w.tick()
    w.tick(0.1)
    w.steps(job, 1, 2)
    provider.capacity = 4
    w.hold = {f"{job}-vm4"}  # never boots
    w.tick(1.5)
    w.tick(2.0)
    assert w.store.generation(job, 1).state == "running"
    w.tick(4.0)  # vm4 was requested more than the gather timeout ago: grow onto vm3 alone
    assert "1 new VM(s)" in w.event(job, "stopping")[0].message


def test_completion_and_cancel_delete_vms(tmp_path):
    w = World(tmp_path)
    job = w.submit(max_vms=2, target_steps=3)
    w.tick()
    w.tick(0.1)
    w.steps(job, 1, 3)
    for vm in w.running(job):
        vm.finish(0)
    w.tick(0.1)
    assert w.store.job(job).state == "finished"
    assert sorted(w.provider.deleted) == sorted(w.provider.created)
    with pytest.raises(ManagerError):  # a VM of a finished job: told to shut down, then unknown
        w.vms[w.provider.created[0]].register()

    job2 = w.submit(max_vms=2)
    w.tick()
    w.tick(0.1)
    w.steps(job2, 1, 1)
    assert w.mgr.cancel(job2) == "cancelling"
    w.tick(0.1)
    w.tick(0.1)
    w.tick(0.1)
    assert w.store.job(job2).state == "cancelled"
    assert w.store.vms(job2, states=["up", "requested"]) == []


def test_restarted_manager_resumes_from_the_store(tmp_path):
    w = World(tmp_path, provider=FakeProvider(capacity=3))
    job = w.submit(max_vms=3)
    w.tick()
    w.tick(0.1)
    w.steps(job, 1, 4)
    gen_before = w.gen(job)
    # The manager process dies; a new one opens the same state file 30 s later (> T).
    w.store.close()
    clock = w.clock
    clock.advance(30.0)
    store = Store(str(tmp_path / "state.sqlite"))
    w2 = World(tmp_path, store=store, clock=clock, provider=w.provider)
    for vm_id, vm in w.vms.items():  # the same agents, still running their workers
        vm.mgr = w2.mgr
        w2.vms[vm_id] = vm
    w2.tick(0.1)
    assert "manager-started" in w2.kinds(job)
    assert not w2.event(job, "vm-gone")  # the outage was the manager's, not the VMs'
    gen = w2.gen(job)
    assert gen.generation == gen_before.generation and gen.state == "running"
    orders = w2.vms[gen.vm_ids[0]].beat()
    assert orders.action == Action.RUN and orders.generation == gen.generation
    w2.steps(job, 5, 6)
    assert w2.store.job(job).step == 6


def test_bad_submissions_are_refused(tmp_path):
    """What arrives over the wire: refused when converted (the spec does not validate) or by the
    domain (the provider's options, the calibration), each with one line and its kind."""
    w = World(tmp_path)
    msg = spec_to_pb(
        JobSpec(script="/x.py", global_batch_size=8, checkpoint_dir="/c", max_vms=2, target_steps=3)
    )
    msg.min_vms = 5
    with pytest.raises(ManagerError, match="min_vms 5 exceeds max_vms 2") as refused:
        w.mgr.submit(*submission_from_pb(msg))
    assert refused.value.kind.name == "INVALID_ARGUMENT"
    msg.min_vms = 1
    msg.provider_options_json = json.dumps({"bogus": 1})
    with pytest.raises(ManagerError, match="unknown local option") as refused:
        w.mgr.submit(*submission_from_pb(msg))
    assert refused.value.kind.name == "INVALID_ARGUMENT" and "\n" not in refused.value.message
    msg.provider_options_json = "{}"
    msg.calibration_json = "{}"
    with pytest.raises(ManagerError, match="calibration"):
        w.mgr.submit(*submission_from_pb(msg))


def test_layout_comes_from_the_simulator_with_a_calibration(tmp_path):
    from simulator.autoconfig import autoconfigure

    cal = Calibration.synthetic(0.002, num_segments=5, micro_batch_sizes=(1, 2, 4), param_bytes=1 << 20)
    w = World(tmp_path, provider=FakeProvider(capacity=6))
    # Memory for auto-config: P = 1 does not fit, so the simulator has to pick a pipeline.
    job = w.submit(
        max_vms=6, num_segments=0, gpu_memory_gib=50e6 / 2**30, calibration_json=json.dumps(cal.to_dict())
    )
    w.tick()
    w.tick(0.1)
    launched = w.event(job, "launched")[0].data
    assert launched["source"].startswith("simulator")
    best = autoconfigure(
        cal, gpus=6, global_batch_size=24, micro_batch_size=2, gpu_memory_bytes=50_000_000
    ).best
    gen = w.gen(job)
    assert (gen.pipeline_depth, gen.data_parallel) == (best.num_stages, best.num_replicas)
    assert gen.pipeline_depth > 1 and gen.predicted_samples_per_s == pytest.approx(best.examples_per_s)
    assert w.running(job)[0].launches[0].env["VARUNA_PIPELINE_DEPTH"] == str(best.num_stages)


def test_planner_and_workers_get_the_jobs_schedule(tmp_path, monkeypatch):
    # A 1f1b job (schedule = "1f1b" in its spec): auto-config must rank layouts for 1f1b, and the
    # workers' run plan must say 1f1b and the spec's global batch. The script's own arguments are
    # never read (a --schedule there is the engine's to judge against the plan: adopt_plan).
    import simulator.autoconfig

    seen: list[str] = []
    real = simulator.autoconfig.autoconfigure

    def spy(*args, **kwargs):
        seen.append(kwargs.get("schedule", "varuna"))
        return real(*args, **kwargs)

    monkeypatch.setattr(simulator.autoconfig, "autoconfigure", spy)
    cal = Calibration.synthetic(0.002, num_segments=4, micro_batch_sizes=(1, 2, 4))
    w = World(tmp_path, provider=FakeProvider(capacity=2))
    job = w.submit(
        max_vms=2,
        num_segments=0,
        micro_batch_size=0,
        args=["--steps", "50", "--schedule", "gpipe"],
        schedule="1f1b",
        calibration_json=json.dumps(cal.to_dict()),
    )
    w.tick()
    w.tick(0.1)
    assert seen and set(seen) == {"1f1b"}
    gen = w.gen(job)
    env = w.running(job)[0].launches[0].env
    assert env["VARUNA_SCHEDULE"] == "1f1b" and env["VARUNA_GLOBAL_BATCH_SIZE"] == "24"
    # m chosen by auto-config (the spec left it to the manager) is part of the plan.
    assert env["VARUNA_MICRO_BATCH_SIZE"] == str(gen.micro_batch_size)


def test_run_plan_leaves_out_what_the_spec_fixed(tmp_path):
    w = World(tmp_path, provider=FakeProvider(capacity=2))
    job = w.submit(max_vms=2, micro_batch_size=2)
    w.tick()
    w.tick(0.1)
    env = w.running(job)[0].launches[0].env
    assert env["VARUNA_SCHEDULE"] == "varuna" and env["VARUNA_GLOBAL_BATCH_SIZE"] == "24"
    assert "VARUNA_MICRO_BATCH_SIZE" not in env  # the script's own m stands
    assert "VARUNA_STAGE_RANGES" not in env
