"""The manager's live-morph decision (manager/domain/live_morph.py): which ranks a lost VM took, whether
every stage still has a live replica, the simulator's P×D for the survivors, what it writes into
the live run's store and the events it records."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from manager.domain import live_morph
from manager.domain.policy import choose_layout
from manager.domain.store import Store
from varuna.core.calibration import Calibration
from varuna.core.planning import PlanRequest


def simulator_plan():
    cal = Calibration.synthetic(0.002, num_segments=4, micro_batch_sizes=(1, 2, 4))
    request = PlanRequest(calibration=cal, global_batch_size=16)
    return lambda slots: choose_layout(slots=slots, request=request)


def test_ranks_follow_the_launchers_placement() -> None:
    from varuna.launch.spec import LaunchConfig, plan_workers

    class Host:
        def __init__(self, slots: int) -> None:
            self.address, self.slots = "127.0.0.1", slots

    hosts = [Host(2), Host(1), Host(2)]
    specs = plan_workers(LaunchConfig(script="t.py", pipeline_depth=2, data_parallel=2), hosts, master_port=1)
    expected: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for s in specs:
        expected["abc"[s.env.host_id]].append(s.env.rank)
    assert live_morph.ranks_by_vm(["a", "b", "c"], {"a": 2, "b": 1, "c": 2}, 4) == expected


def test_a_lost_vm_with_replicas_elsewhere_goes_on_at_the_simulators_layout() -> None:
    plan = simulator_plan()
    vms = ["v0", "v1", "v2", "v3"]
    d = live_morph.decide(plan, pipeline_depth=2, data_parallel=2, slots=dict.fromkeys(vms, 1), vm_ids=vms,
                          lost_vm_ids=["v3"])
    assert d.live and d.lost_ranks == (3,) and d.survivor_ranks == (0, 1, 2)
    ref = plan([1, 1, 1])  # the simulator asked directly for three one-slot VMs
    assert (d.plan.pipeline_depth, d.plan.data_parallel) == (ref.pipeline_depth, ref.data_parallel)
    assert d.plan.world_size <= 3 and d.reason == ref.source


def test_a_stage_without_live_replica_takes_the_restart_path() -> None:
    vms = ["v0", "v1", "v2", "v3"]
    d = live_morph.decide(simulator_plan(), pipeline_depth=2, data_parallel=2, slots=dict.fromkeys(vms, 1),
                          vm_ids=vms, lost_vm_ids=["v1", "v3"])
    assert not d.live and d.lost_ranks == (1, 3)
    assert d.reason.startswith("stage 1 has no live replica (ranks 1, 3 were on lost VMs v1, v3)")


def test_events_say_what_was_decided(tmp_path) -> None:
    store = Store(str(tmp_path / "m.sqlite"))
    vms = ["v0", "v1", "v2", "v3"]
    live = live_morph.decide(simulator_plan(), pipeline_depth=2, data_parallel=2, slots=dict.fromkeys(vms, 1),
                             vm_ids=vms, lost_vm_ids=["v3"])
    dead = live_morph.decide(simulator_plan(), pipeline_depth=2, data_parallel=2, slots=dict.fromkeys(vms, 1),
                             vm_ids=vms, lost_vm_ids=["v1", "v3"])
    live_morph.record(store.add_event, "j", 4, live, old=(2, 2), duration_s=1.25)
    live_morph.record(store.add_event, "j", 5, dead, old=(2, 2))
    ok, fallback = store.events("j")
    assert ok.kind == "live-morph" and ok.generation == 4
    assert ok.data["duration_s"] == 1.25 and ok.data["lost_ranks"] == [3]
    assert (ok.data["pipeline_depth"], ok.data["data_parallel"]) == (live.plan.pipeline_depth,
                                                                     live.plan.data_parallel)
    assert fallback.kind == "live-morph-fallback" and "stage 1 has no live replica" in fallback.message
    assert json.loads(fallback.data_json)["reason"] == dead.reason
    store.close()


def test_the_decision_reaches_the_live_store() -> None:
    dist = pytest.importorskip("torch.distributed")
    from varuna.runtime.live_morph import ROOT

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    vms = ["v0", "v1", "v2", "v3"]
    d = live_morph.decide(simulator_plan(), pipeline_depth=2, data_parallel=2, slots=dict.fromkeys(vms, 1),
                          vm_ids=vms, lost_vm_ids=["v3"])
    live_morph.tell_workers(store, d)
    assert store.check([f"{ROOT}dead/3"]) and not store.check([f"{ROOT}dead/2"])
    assert store.get(f"{ROOT}plan").decode() == f"{d.plan.pipeline_depth} {d.plan.data_parallel}"


def test_a_notice_is_live_while_someone_stays_to_receive() -> None:
    """Leavers hand their state over (docs/live_morph.md, Protocol): a stage whose every replica is
    on noticed VMs is not lost while some worker stays; with nobody staying it is the fallback."""
    plan = simulator_plan()
    vms = ["v0", "v1", "v2", "v3"]
    members = {v: [i] for i, v in enumerate(vms)}
    both = live_morph.decide_notice(plan, members=members, vm_ids=vms, leaving_vm_ids=["v1", "v3"])
    assert both.live and both.kind == "notice" and both.lost_ranks == (1, 3) and both.survivor_ranks == (0, 2)
    ref = plan([1, 1])
    assert (both.plan.pipeline_depth, both.plan.data_parallel) == (ref.pipeline_depth, ref.data_parallel)
    lost = live_morph.decide(plan, pipeline_depth=2, data_parallel=2, slots=dict.fromkeys(vms, 1), vm_ids=vms,
                             lost_vm_ids=["v1", "v3"])
    assert not lost.live, "the same VMs lost without notice: stage 1 is gone"
    every = live_morph.decide_notice(plan, members=members, vm_ids=vms, leaving_vm_ids=vms)
    assert not every.live and "nobody stays to receive their state" in every.reason
