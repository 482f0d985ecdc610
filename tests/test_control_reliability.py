"""Issue #17, the manager's control loop: the fail-stutter rule at P ≥ 2 with the stage ranges the
engine really reports, and a generation that stops after the target step is not relaunched.

Same fake-clock harness as tests/test_manager_controller.py (nothing sleeps, one process).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from manager.domain.policy import StutterConfig
from manager.transport import varuna_manager_pb2 as pb
from manager.worker.reporter import WorkerReporter
from varuna.core.calibration import Calibration
from varuna.core.env import RunPlan
from varuna.core.partition import balanced_stages
from varuna.core.schedule import schedule_kind
from varuna.runtime.config import StepResult, StepTimings

sys.path.insert(0, str(Path(__file__).parent))
from test_manager_controller import FakeProvider, World  # noqa: E402

NUM_SEGMENTS = 6
M = 2


# ----------------------------------------------------------------------------------------------
# Workers that heartbeat through the real WorkerReporter


@dataclass
class _Layout:
    rank: int
    stage: int
    replica: int
    P: int
    D: int


@dataclass
class _Engine:
    """What WorkerReporter reads from a ``varuna.Engine``: layout, step count, ``describe()``."""

    layout: _Layout
    stage_ranges: list[tuple[int, int]]
    step_count: int = 0

    def describe(self) -> dict[str, Any]:
        return {"stage_ranges": self.stage_ranges, "m": M}

    def add_step_callback(self, fn: Any) -> None:  # present: the reporter uses StepResult.timings
        raise AssertionError("not used here")


@dataclass
class _RecordingClient:
    """Stands in for ManagerClient: keeps the requests; the test hands them to the manager in a
    fixed order once the reporter's thread is joined (no race between ranks)."""

    sent: list[pb.WorkerHeartbeatRequest] = field(default_factory=list)

    def worker_heartbeat(self, request: pb.WorkerHeartbeatRequest, *, timeout_s: float | None = None) -> bool:
        self.sent.append(request)
        return True

    def close(self) -> None:
        pass


def _engine_stage_ranges(P: int) -> list[tuple[int, int]]:
    """The ranges ``varuna.runtime.stages.assign_stages`` computes for equal segments: the same
    ``balanced_stages`` call over the schedule kind's balancing costs (inclusive ranges)."""
    costs = [1.0] * NUM_SEGMENTS
    full, last = schedule_kind("varuna").balancing_costs(costs, costs, [2.0] * NUM_SEGMENTS, recompute=True)
    return balanced_stages(full, last, P)


def _true_times(cal: Calibration, first: int, last: int, *, recompute: bool) -> StepTimings:
    """What a healthy VM measures for one micro-batch on segments first..last (both included)."""
    segs = range(first, last + 1)
    return StepTimings(
        fwd_s=sum(cal.fwd_s(s, M) for s in segs),
        bwd_s=sum(cal.bwd_s(s, M) for s in segs),
        recompute_s=sum(cal.recompute_s(s, M) for s in segs) if recompute else 0.0,
        num_forwards=4,
    )


def _heartbeat_steps(
    w: World, job: str, cal: Calibration, steps: range, *, slow_ranks: dict[int, float] | None = None
) -> list[pb.WorkerHeartbeatRequest]:
    """Every worker of the live generation runs ``steps`` and reports them through a real
    WorkerReporter; the manager then takes the heartbeats step by step."""
    gen = w.gen(job)
    P, D = gen.pipeline_depth, gen.data_parallel
    ranges = _engine_stage_ranges(P)
    per_rank: dict[int, list[pb.WorkerHeartbeatRequest]] = {}
    for vm in w.running(job):
        for rank in vm.workers:
            stage = rank % P
            client = _RecordingClient()
            engine = _Engine(_Layout(rank, stage, rank // P, P, D), ranges)
            reporter = WorkerReporter(engine, client, job_id=job, vm_id=vm.vm_id, generation=gen.generation)
            first, last = ranges[stage]
            times = _true_times(cal, first, last, recompute=stage < P - 1)
            factor = (slow_ranks or {}).get(rank, 1.0)
            times = StepTimings(
                fwd_s=times.fwd_s * factor,
                bwd_s=times.bwd_s * factor,
                recompute_s=times.recompute_s * factor,
                num_forwards=times.num_forwards,
            )
            for s in steps:
                reporter.on_step(StepResult(s, 1.0, 1.0, False, 1.0, 10.0, float(s), times))
            reporter.close(timeout_s=10.0)
            per_rank[rank] = client.sent
    sent: list[pb.WorkerHeartbeatRequest] = []
    for i in range(max(len(v) for v in per_rank.values())):
        for rank in sorted(per_rank):
            if i < len(per_rank[rank]):
                w.mgr.worker_heartbeat(per_rank[rank][i])
                sent.append(per_rank[rank][i])
    return sent


def _p2_world(tmp_path) -> tuple[World, str, Calibration]:
    cal = Calibration.synthetic(0.01, num_segments=NUM_SEGMENTS, micro_batch_sizes=(1, 2))
    w = World(
        tmp_path,
        provider=FakeProvider(capacity=4),
        stutter=StutterConfig(threshold_pct=20.0, heartbeats=3),
    )
    job = w.submit(
        max_vms=4,
        pipeline_depth=2,
        num_segments=NUM_SEGMENTS,
        micro_batch_size=M,
        calibration_json=json.dumps(cal.to_dict()),
    )
    w.tick()
    w.tick(0.1)
    gen = w.gen(job)
    assert (gen.pipeline_depth, gen.data_parallel) == (2, 2)
    return w, job, cal


def test_engine_stage_ranges_are_inclusive_like_the_run_plan():
    # The convention the heartbeat carries (Note [Stage ranges on the wire]): the engine's ranges,
    # which are VARUNA_STAGE_RANGES' inclusive ranges.
    ranges = _engine_stage_ranges(2)
    assert [s for a, b in ranges for s in range(a, b + 1)] == list(range(NUM_SEGMENTS))
    assert all(b > a for a, b in ranges)  # several segments per stage: the last one matters
    text = ",".join(f"{a}-{b}" for a, b in ranges)
    assert list(RunPlan.from_env({"VARUNA_STAGE_RANGES": text}).stage_ranges) == ranges


def test_healthy_vms_at_p2_are_not_evicted_as_slow(tmp_path):
    w, job, cal = _p2_world(tmp_path)
    sent = _heartbeat_steps(w, job, cal, range(1, 7))
    stage0 = [r for r in sent if r.stage == 0 and r.step > 0]
    assert stage0 and all((r.first_segment, r.end_segment) == _engine_stage_ranges(2)[0] for r in stage0)
    # Every VM runs exactly as the calibration predicts: none is slow, and the calibration fits.
    assert not w.event(job, "slow"), [e.message for e in w.event(job, "slow")]
    assert not w.event(job, "calibration-mismatch")
    w.tick(0.1)
    assert w.store.generation(job, 1).state == "running"


def test_truly_slow_stage0_vm_at_p2_is_still_evicted(tmp_path):
    # The positive control: 1.5× the prediction (> +20 %) on one stage-0 worker is caught.
    w, job, cal = _p2_world(tmp_path)
    _heartbeat_steps(w, job, cal, range(1, 7), slow_ranks={2: 1.5})
    slow = w.event(job, "slow")
    assert [e.data["rank"] for e in slow] == [2] and slow[0].data["rule"] == "calibration"
    # The reference is the whole stage (3 segments with recompute), not 2 of them.
    first, last = _engine_stage_ranges(2)[0]
    expected = _true_times(cal, first, last, recompute=True)
    reference = expected.fwd_s + expected.bwd_s + expected.recompute_s
    assert abs(slow[0].data["reference_s"] - reference) < 1e-9


# ----------------------------------------------------------------------------------------------
# A generation stopping after the target step


def test_generation_stopping_past_the_target_finishes_the_job(tmp_path):
    w = World(tmp_path, provider=FakeProvider(capacity=4))
    job = w.submit(max_vms=2, target_steps=10)
    w.tick()
    w.tick(0.1)
    w.steps(job, 1, 8)
    vm = w.running(job)[1]
    vm.notice = pb.PreemptNotice(event_id="ev-1", event_type="Preempt", not_before="soon")
    vm.beat()  # only this agent heartbeats: the others have not picked up a STOP order yet
    w.mgr.tick()  # the notice starts a graceful stop
    assert w.store.generation(job, 1).state == "stopping"
    # The workers were finishing the last steps meanwhile: they report the target step, then exit
    # 0 on SIGUSR1 (a checkpoint at the target step).
    w.steps(job, 9, 10)
    w.until(lambda: w.store.job(job).terminal)
    assert w.store.job(job).state == "finished"
    assert w.store.job(job).generation == 1, "a generation was launched after the target step"
    assert "launched" not in w.kinds(job)[w.kinds(job).index("generation-ended") :]


def test_reporter_close_owns_its_thread_when_the_manager_is_down(monkeypatch):
    """close() while a heartbeat is in flight to a manager that is down (wait_for_ready: the RPC
    waits out its 2 s deadline) and another is queued: the sender thread ends inside close(), and
    never calls into the closed channel (grpc's ValueError killed the thread with a traceback)."""
    import threading

    from manager.transport.client import ClientConfig, ManagerClient
    from varuna.launch.procs import find_free_port

    crashed: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashed.append(args.exc_value))
    client = ManagerClient(ClientConfig(address=f"127.0.0.1:{find_free_port('127.0.0.1')}", token="x" * 32))
    engine = _Engine(_Layout(rank=0, stage=0, replica=0, P=1, D=1), [(0, NUM_SEGMENTS - 1)])
    reporter = WorkerReporter(engine, client, job_id="j", vm_id="v", generation=1)  # heartbeat 1 in flight
    times = StepTimings(fwd_s=0.01, bwd_s=0.02, recompute_s=0.0, num_forwards=M)
    reporter.on_step(StepResult(1, 1.0, 1.0, False, 1.0, 10.0, 1.0, times))  # heartbeat 2 queued
    reporter.close(timeout_s=0.2)
    assert not reporter._thread.is_alive(), "close() returned with the sender thread still running"
    assert crashed == []
