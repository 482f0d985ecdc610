"""A job's pool of several VM types (issue #19, manager side): the job spec's ``[[vm_types]]``,
the provider asked per type (local: emulated speed; azure: one scale set per type with its own
VM size), calibration once per type on the first VM of each, and generations planned with the mix
(each rank on a VM of the planned type; shares and stage speeds in the run plan), re-planned after
a preemption. Fast: the control loop on a fake clock with simulated agents
(tests/test_manager_controller.py's World); with real pretend VMs: tests/test_manager_mixed_e2e.py.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from manager.domain.jobspec import JobSpec
from manager.domain.messages import Action, CalibrationReport
from manager.domain.policy import StutterConfig, predicted_compute_s
from manager.domain.vm_types import parse_vm_types, type_options
from manager.providers.base import NewVM
from manager.transport.convert import spec_from_pb, spec_to_pb
from varuna.core.batching import check_shares
from varuna.core.calibration import Calibration
from varuna.core.env import RunPlan

sys.path.insert(0, str(Path(__file__).parent))
from test_manager_controller import FakeProvider, World  # noqa: E402

TYPES = [
    {"name": "fast", "max_vms": 2, "speed": 2.0},
    {"name": "slow", "max_vms": 2, "speed": 1.0},
]
PROFILE = {"model": "examples/gpt2/profile_target.py:build", "args": ["--reps", "1"], "timeout_s": 60}


def _spec(**overrides: Any) -> dict[str, Any]:
    spec = {"script": "/t.py", "global_batch_size": 24, "checkpoint_dir": "/c", "max_vms": 4,
            "target_steps": 5, "vm_types": TYPES}
    spec.update(overrides)
    return spec


# -- the job spec ----------------------------------------------------------------------------------


def test_vm_types_round_trip_and_tell_the_provider_their_speed() -> None:
    spec = JobSpec.from_dict(_spec())
    assert spec_from_pb(spec_to_pb(spec)).vm_types == spec.vm_types
    fast, slow = spec.vm_type_specs
    # This machine stands for the fastest type: the slow one's steps take 2.0 / 1.0 as long.
    assert type_options(fast, spec.vm_type_specs) == {"vm_type": "fast"}
    assert type_options(slow, spec.vm_type_specs) == {"vm_type": "slow", "vm_slowdown": 2.0}
    assert JobSpec.from_dict(_spec(vm_types=[], max_vms=3)).vm_type_specs == ()


@pytest.mark.parametrize(
    "patch, needle",
    [
        ({"max_vms": 3}, "max_vms 3 differs from the sum of the vm_types' max_vms (4); set max_vms = 4"),
        ({"vm_types": [TYPES[0], TYPES[0]]}, "type 'fast' is listed twice"),
        ({"vm_types": [{**TYPES[0], "speed": 0}], "max_vms": 2}, "speed must be a number > 0"),
        ({"vm_types": [{**TYPES[0], "max_vms": 0}], "max_vms": 2}, "max_vms must be a whole number >= 1"),
        ({"vm_types": [{**TYPES[0], "name": "a b"}], "max_vms": 2}, "is not a valid name"),
        ({"vm_types": [{**TYPES[0], "cost": 1}], "max_vms": 2}, "unknown key(s) cost"),
        ({"vm_types": [{**TYPES[0], "provider_options": {"vm_size": "x"}}], "max_vms": 2},
         "provider_options vm_size is not a per-type local option; use max_created"),
        ({"vm_types": "fast"}, "must be a list of tables"),
        ({"pool": True}, "a pool job (pool = true) gets its VM types from the pool"),
    ],
)
def test_bad_vm_types_are_one_line(patch: dict, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        JobSpec.from_dict(_spec(**patch))
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_azure_types_may_set_their_vm_size() -> None:
    options = {"vm_size": "Standard_NC24ads_A100_v4"}
    types = parse_vm_types([{"name": "a100", "max_vms": 1, "provider_options": options}])
    assert type_options(types[0], types) == {"vm_size": "Standard_NC24ads_A100_v4", "vm_type": "a100"}


# -- the control loop --------------------------------------------------------------------------------


@dataclass
class TypedProvider(FakeProvider):
    """A fake cloud with a spot capacity per VM type (``per_type``), recording what it was asked."""

    per_type: dict[str, int] = field(default_factory=dict)
    asked: list[dict] = field(default_factory=list)

    def create_vms(  # type: ignore[override]
        self, job_id: str, names: Sequence[str], slots: int, *, created_so_far: int,
        type_options: Mapping[str, Any] | None = None,
    ) -> list[NewVM]:
        options = dict(type_options or {})
        self.asked.append(options)
        limit = self.per_type.get(options.get("vm_type", ""), self.capacity)
        n = max(0, min(len(names), limit - created_so_far))
        self.created.extend(names[:n])
        return [NewVM(vm_id=name, ref={"fake": True}) for name in names[:n]]


SPEED = {"fast": 2.0, "slow": 1.0}


def _calibration_json(vm_type: str) -> str:
    """What profiling a VM of the type measures (a slow VM's compute takes twice as long)."""
    fwd = 0.004 / SPEED[vm_type]
    cal = Calibration.synthetic(fwd, num_segments=4, micro_batch_sizes=(2,), param_bytes=1 << 20)
    return json.dumps(cal.to_dict())


def _type_of(w: World, vm_id: str) -> str:
    return w.store.vm(vm_id).ref["vm_type"]


def _check_generation(w: World, job: str) -> dict:
    """Every rank of the running generation is on a VM of its planned type, and the run plan's
    shares and speeds are valid for its P×D (independent checks: core batching and the env)."""
    gen = w.gen(job)
    mixed = json.loads(gen.mixed_json)
    P, D = gen.pipeline_depth, gen.data_parallel
    for vm in w.running(job):
        for rank, launch in vm.launches.items():
            assert _type_of(w, vm.vm_id) == mixed["rank_types"][rank], (rank, vm.vm_id, mixed)
            plan = RunPlan.from_env(launch.env)
            if plan.replica_shares is not None:
                assert check_shares(plan.replica_shares, 24 // 2, D) is None
                # A replica whose every stage is on a faster type than another's runs more.
                rows = [mixed["rank_types"][d * P : (d + 1) * P] for d in range(D)]
                for a, b in itertools.permutations(range(D), 2):
                    if all(SPEED[x] > SPEED[y] for x, y in zip(rows[a], rows[b])):
                        assert plan.replica_shares[a] > plan.replica_shares[b], (rows, plan.replica_shares)
            if plan.stage_speeds is not None:
                assert len(plan.stage_speeds) == P
    return mixed


def test_calibrates_once_per_type_plans_the_mix_and_replans_after_a_preemption(tmp_path: Path) -> None:
    provider = TypedProvider(per_type={"fast": 2, "slow": 2})
    # A tight fail-stutter threshold: a slow type must still not look like a slow VM.
    w = World(tmp_path, provider=provider, stutter=StutterConfig(threshold_pct=20.0, heartbeats=3))
    job = w.submit(max_vms=4, num_segments=0, workdir=str(tmp_path), profile=dict(PROFILE), vm_types=TYPES)
    w.tick()
    w.tick(0.1)
    assert {o.get("vm_type") for o in provider.asked} == {"fast", "slow"}
    assert {"vm_type": "slow", "vm_slowdown": 2.0} in provider.asked
    assert sorted(_type_of(w, vm.vm_id) for vm in w.store.vms(job)) == ["fast", "fast", "slow", "slow"]

    # One PROFILE order at a time, on the first VM of each type; never a second one of a type.
    profiled: list[str] = []
    for _ in range(2):
        ordered = [v for v in w.vms if w.vms[v].beat().action == Action.PROFILE]
        assert len(ordered) == 1, ordered
        attempt = w.store.job(job).calibration_attempt
        text = _calibration_json(_type_of(w, ordered[0]))
        reply = w.mgr.report_calibration(CalibrationReport(
            vm_id=ordered[0], attempt=attempt, ok=True, calibration_json=text, wall_s=1.0))
        assert reply.accepted
        profiled.append(_type_of(w, ordered[0]))
        w.tick(0.1)
    assert sorted(profiled) == ["fast", "slow"]
    finished = [e for e in w.store.events(job) if e.kind == "calibration-finished"]
    assert sorted(json.loads(e.data_json)["vm_type"] for e in finished) == ["fast", "slow"]
    assert sorted(json.loads(w.store.job(job).type_calibrations_json)) == ["fast", "slow"]

    w.until(lambda: w.store.job(job).generation >= 1)
    w.tick(0.1)
    first = _check_generation(w, job)
    assert w.store.job(job).calibration_state == "done"

    # Fail-stutter: each VM is judged against its own type's calibration. Every VM computing at
    # its type's predicted speed (+10 %) is healthy -- no "slow", no "calibration-mismatch".
    # Negative control: the slow type's time is > +20 % of the replicas' median here (2 fast,
    # 2 slow at D = 4), so judged on raw times the slow VMs would be marked.
    predicted = {
        t: predicted_compute_s(
            Calibration.from_dict(json.loads(_calibration_json(t))), 0, 0, 2, recompute=False
        )
        for t in SPEED
    }
    assert (w.gen(job).pipeline_depth, w.gen(job).data_parallel) == (1, 4)
    assert predicted["slow"] / ((predicted["slow"] + predicted["fast"]) / 2) > 1.2

    def at_speed() -> dict[str, float]:
        return {vm.vm_id: predicted[_type_of(w, vm.vm_id)] * 1.1 for vm in w.running(job)}

    w.steps(job, 1, 6, slow=at_speed())
    w.tick(0.1)
    assert not w.event(job, "slow") and not w.event(job, "calibration-mismatch"), w.kinds(job)

    # Preempt a fast VM of the running generation; its type has no capacity left: the relaunch
    # is planned with what remains (one fast, two slow).
    fast_vm = next(vm.vm_id for vm in w.running(job) if _type_of(w, vm.vm_id) == "fast")
    w.vms[fast_vm].alive = False
    provider.gone.add(fast_vm)
    w.until(lambda: w.store.job(job).generation >= 2, max_ticks=80)
    w.tick(0.1)
    second = _check_generation(w, job)
    assert fast_vm not in w.gen(job).vm_ids
    assert sorted(first["rank_types"]) == ["fast", "fast", "slow", "slow"]  # every VM, by type
    assert sorted(second["rank_types"]) == ["fast", "slow", "slow"]
    launched = [json.loads(e.data_json) for e in w.store.events(job) if e.kind == "launched"]
    assert launched[-1]["mixed"] == second
    # Planned by the simulator's mixed auto-config on the per-type calibrations, both times.
    assert all(e["source"].startswith("simulator, mixed VM types: ") for e in launched), launched
    # Calibration happened once per type, not again at the relaunch.
    assert len([e for e in w.store.events(job) if e.kind == "calibration-started"]) == 2


    # At D = 3 (1 fast, 2 slow) a slow-type VM at three times its type's prediction is caught.
    w.steps(job, 7, 9, slow=at_speed(), resumed_from=6)
    outlier = next(vm.vm_id for vm in w.running(job) if _type_of(w, vm.vm_id) == "slow")
    w.steps(job, 10, 14, slow={**at_speed(), outlier: predicted["slow"] * 3}, resumed_from=6)
    w.tick(0.1)
    assert [e.message.split()[0] for e in w.event(job, "slow")] == [outlier], w.kinds(job)
