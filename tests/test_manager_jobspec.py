"""The job spec's schedule: the default kind unless the spec names one (the manager never reads
the script's arguments), validated against the schedule kinds, carried over the wire
(manager/domain/jobspec.py, manager/transport/convert.py); its chunks (interleaved kinds)
likewise, and on into the planner's layout and the workers' run plan."""

from __future__ import annotations

import pytest

from manager.domain.jobspec import JobSpec
from manager.transport.convert import spec_from_pb, spec_to_pb
from varuna.core.schedule import DEFAULT_SCHEDULE

BASE = dict(script="/t.py", global_batch_size=8, checkpoint_dir="/c", max_vms=2, target_steps=5)


def test_schedule_is_the_specs_or_the_default_never_the_scripts_argument():
    assert DEFAULT_SCHEDULE == "varuna"
    assert JobSpec(**BASE).schedule == DEFAULT_SCHEDULE
    assert JobSpec(**BASE, schedule="").schedule == DEFAULT_SCHEDULE  # unset on the wire
    assert JobSpec(**BASE, schedule="gpipe").schedule == "gpipe"
    # The script's own --schedule is the engine's to judge against the plan (adopt_plan), not the
    # manager's to sniff: the plan is the spec's.
    assert JobSpec(**BASE, args=["--schedule", "1f1b"]).schedule == DEFAULT_SCHEDULE
    assert JobSpec(**BASE, args=["--schedule=gpipe"], schedule="1f1b").schedule == "1f1b"


def test_bad_schedules_are_refused_with_one_line():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'; use one of varuna, gpipe, 1f1b"):
        JobSpec(**BASE, schedule="pipedream")
    with pytest.raises(ValueError, match="'schedule' must be one of"):
        JobSpec(**BASE, schedule=3)
    # An argument the script may parse is no job-spec error (the manager does not read it).
    assert JobSpec(**BASE, args=["--schedule", "zigzag"]).schedule == DEFAULT_SCHEDULE


def test_schedule_survives_the_wire_and_the_store():
    spec = JobSpec(**BASE, schedule="1f1b")
    assert spec_from_pb(spec_to_pb(spec)).schedule == "1f1b"
    assert JobSpec.from_dict(spec.to_dict()).schedule == "1f1b"
    # A spec stored before the field existed reads as the default schedule.
    old = {k: v for k, v in spec.to_dict().items() if k != "schedule"}
    assert JobSpec.from_dict(old).schedule == DEFAULT_SCHEDULE


# -- chunks (interleaved kinds, docs/interleaved.md) ---------------------------------------------

IL = dict(BASE, schedule="varuna-interleaved")


def test_chunks_are_validated_with_one_line_naming_the_fix():
    assert JobSpec(**IL, chunks=2, pipeline_depth=2).chunks == 2
    assert JobSpec(**BASE).chunks == 0  # not set: one chunk, nothing exported
    cases = [
        (dict(BASE, chunks=2), "chunks = 2 needs an interleaved schedule, not schedule = varuna; add"),
        (dict(IL, pipeline_depth=2), "schedule = varuna-interleaved needs chunks = V with V >= 2"),
        (dict(IL, chunks=2, pipeline_depth=1), "the job runs at pipeline_depth = 1; raise pipeline_depth"),
        (dict(IL, chunks=3, pipeline_depth=2, num_segments=5),
         "needs 6 virtual stages, i.e. >= 5 cut-points, but num_segments = 5 allows at most 4"),
        (dict(IL, chunks=2), "needs pipeline_depth (>= 2), num_segments, a calibration or [profile]"),
        (dict(IL, chunks=-1), "'chunks' must be an integer >= 0"),
        (dict(IL, chunks="2"), "'chunks' must be an integer"),
        (dict(IL, chunks=2, pipeline_depth=2, live_morph=True), "live_morph does not carry interleaved"),
        (dict(IL, chunks=2, pipeline_depth=2, pool=True), "pool jobs and several VM types"),
    ]
    for spec, needle in cases:
        with pytest.raises(ValueError) as info:
            JobSpec(**spec)
        message = str(info.value)
        assert message.startswith("jobspec: ") and needle in message and "\n" not in message, message


def test_chunks_survive_the_wire_and_reach_the_run_plan(tmp_path):
    from manager.domain.context import ManagerConfig, ManagerContext
    from manager.domain.launches import WorkerLaunches
    from manager.domain.morph_planner import MorphPlanner
    from manager.domain.records import GenerationRecord
    from manager.domain.store import Store

    spec = JobSpec(**IL, chunks=2, pipeline_depth=2)
    assert spec_from_pb(spec_to_pb(spec)).chunks == 2
    assert JobSpec.from_dict(spec.to_dict()).chunks == 2
    store = Store(path=str(tmp_path / "state.db"))
    try:
        config = ManagerConfig(advertise_address="127.0.0.1:1", token_file="/t", state_dir=str(tmp_path))
        ctx = ManagerContext(store, config, provider_factory=None, clock=lambda: 0.0)  # type: ignore[arg-type]
        job = store.add_job("j1", spec.to_dict())
        planner = MorphPlanner(ctx)
        layout = planner.plan(job, [1, 1, 1])
        assert layout.pipeline_depth == 2
        gen = GenerationRecord(job_id="j1", generation=1, state="running", pipeline_depth=2, data_parallel=1,
                               micro_batch_size=0, vms_json="[]", master_addr="127.0.0.1", master_port=1,
                               launched=0.0)
        plan = WorkerLaunches(ctx).run_plan(job, gen)
        assert (plan.schedule, plan.chunks) == ("varuna-interleaved", 2)
        assert plan.to_env()["VARUNA_CHUNKS"] == "2"
    finally:
        store.close()


def test_fallback_layout_keeps_room_for_the_chunks():
    from manager.domain.policy import choose_layout, fallback_layout
    from varuna.core.planning import PlanRequest

    # 8 segments, 2 chunks: P in {2, 4} (P·2 <= 8, P divides 8); 5 slots: 2×2 and 4×1 tie, the
    # smaller P wins.
    plan = fallback_layout(slots=[1] * 5, global_batch_size=24, num_segments=8, chunks=2)
    assert (plan.pipeline_depth, plan.data_parallel) == (2, 2)
    assert fallback_layout(slots=[1] * 3, global_batch_size=24, chunks=2).pipeline_depth >= 2
    with pytest.raises(ValueError, match="no pipeline depth >= 2 with 2 chunks per process fits 1 slots"):
        fallback_layout(slots=[1], global_batch_size=24, chunks=2)
    from varuna.core.calibration import Calibration

    cal = Calibration.synthetic(0.01, num_segments=6, micro_batch_sizes=(1, 2))
    auto = choose_layout(slots=[1] * 6, request=PlanRequest(calibration=cal, global_batch_size=24,
                                                            schedule="interleaved", chunks=3))
    assert auto.pipeline_depth >= 2 and auto.pipeline_depth * 3 <= 6
