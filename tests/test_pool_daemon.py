"""The shared pool inside the manager daemon (manager/domain/pool_rounds.py, docs/pool.md), on the
simulated VMs and fake clock of tests/test_manager_controller.py: nothing sleeps, rounds run when
the test moves the clock past the round length or a job arrives or leaves.

The allocation itself is checked against the policies' own unit tests (test_pool_allocation.py);
here: the config's validation, the store round trip, and that a round's placements become the
jobs' VMs and generations (type, count, graceful morphs with the round's reason).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from manager.domain.controller import Manager
from manager.domain.pool_config import PoolConfig, load_pool_config
from manager.domain.pool_store import PoolStore
from manager.domain.store import Store
from manager.providers.base import NewVM
from varuna.core.calibration import Calibration

sys.path.insert(0, str(Path(__file__).parent))
from test_manager_controller import FakeProvider, World  # noqa: E402

ROUND_S = 100.0
POOL = {
    "policy": "las",
    "round_s": ROUND_S,
    "default_morph_s": 10.0,
    "types": [
        {"name": "fast", "price_per_hour": 0.9, "capacity": 2, "speed": 1.0},
        {"name": "slow", "price_per_hour": 0.3, "capacity": 2, "speed": 0.25},
    ],
}


@dataclass
class TypedProvider(FakeProvider):
    """The fake cloud, remembering the type each VM was asked for."""

    def __post_init__(self) -> None:
        self.types: dict[str, Mapping[str, Any]] = {}

    def create_vms(
        self, job_id: str, names: Sequence[str], slots: int, *, created_so_far: int,
        type_options: Mapping[str, Any] | None = None,
    ) -> list[NewVM]:
        out = super().create_vms(job_id, names, slots, created_so_far=created_so_far)
        for nv in out:
            self.types[nv.vm_id] = dict(type_options or {})
        return out


class PoolWorld(World):
    def __init__(self, tmp_path, pool: dict | None = None, **kw) -> None:
        self.pool_config = PoolConfig.from_dict(pool or POOL)
        kw.setdefault("provider", TypedProvider())
        super().__init__(tmp_path, **kw)
        # World made a manager without the pool: make it again with it, on the same store.
        self.mgr = Manager(self.store, self.mgr.config, provider_factory=lambda *a: self.provider,
                           clock=self.clock, pool=self.pool_config)

    def restart(self) -> None:
        self.mgr.stop()
        self.mgr = Manager(self.store, self.mgr.config, provider_factory=lambda *a: self.provider,
                           clock=self.clock)  # no --pool: the stored one

    def submit_pool(self, **kw) -> str:
        cal = Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1, 2))
        kw.setdefault("max_vms", 2)
        return self.submit(pool=True, calibration_json=json.dumps(cal.to_dict()), **kw)

    def placement(self, job: str):
        return self.mgr.ctx.pool.target(self.store.job(job))

    def gen_types(self, job: str) -> set[str]:
        return {self.store.vm(v).ref.get("vm_type") for v in self.gen(job).vm_ids}

    def realised(self, job: str) -> bool:
        """The job runs a generation on exactly its placement."""
        t, gen = self.placement(job), self.gen(job)
        return (t is not None and gen is not None and gen.state == "running"
                and self.gen_types(job) == {t[0]} and len(gen.vm_ids) == t[1])

    def reallocations(self, job: str) -> list[str]:
        return [e.data["reason"] for e in self.event(job, "reallocated")]

    def triggers(self, job: str) -> list[str]:
        """Why the rounds that moved ``job`` ran."""
        return [e.data["trigger"] for e in self.event(job, "reallocated")]


def test_pool_config_validation_one_line_per_bad_field(tmp_path):
    def bad(change: dict, match: str) -> None:
        with pytest.raises(ValueError, match=match) as err:
            PoolConfig.from_dict({**POOL, **change})
        assert "\n" not in str(err.value)

    bad({"policy": "fifo"}, "unknown policy 'fifo'; use one of las, makespan, cost")
    bad({"round_s": 0}, "round_s must be a number > 0")
    bad({"types": []}, "at least one VM type")
    bad({"types": [POOL["types"][0], POOL["types"][0]]}, "fast listed twice")
    bad({"types": [{**POOL["types"][0], "capacity": -1}]}, "'fast': capacity must be an integer >= 0")
    bad({"types": [{**POOL["types"][0], "speed": 0}]}, "'fast': speed must be a number > 0")
    bad({"types": [{**POOL["types"][0], "gpus": 1}]}, r"unknown field\(s\) gpus")
    bad({"capacity_changes": [{"round": 1, "type": "huge", "capacity": 1}]}, "type 'huge', which 'types'")
    bad({"colour": "red"}, r"pool: unknown field\(s\) colour")
    path = tmp_path / "pool.toml"
    path.write_text('policy = "cost"\nround_s = 60\n[[types]]\nname = "a"\nprice_per_hour = 1.0\n'
                    'capacity = 3\n')
    cfg = load_pool_config(path)
    assert (cfg.policy, cfg.round_s, cfg.capacity_at(0)) == ("cost", 60, {"a": 3})
    path.write_text('[[types]]\nname = "a"\n')
    with pytest.raises(ValueError, match="pool.toml: pool: .*price_per_hour"):
        load_pool_config(path)


def test_round_places_jobs_and_their_vms_follow(tmp_path):
    w = PoolWorld(tmp_path)
    a = w.submit_pool(name="a", target_steps=4)
    w.tick()
    # Alone, a gets the fast VMs (4× the slow ones' speed): 2 × fast, and VMs of that type.
    assert w.placement(a) == ("fast", 2)
    assert w.reallocations(a) == ["started on 2 × fast"]
    assert w.triggers(a) == [f"{a} arrived"]
    w.tick(0.1)
    w.tick(0.1)
    assert w.realised(a)
    assert {w.provider.types[v]["vm_type"] for v in w.gen(a).vm_ids} == {"fast"}
    w.steps(a, 1, 3)

    # b arrives: a round at once; b gets what a does not use. Two identical jobs under max-min
    # fairness share the fast VMs over time (about half each), so a later round swaps them.
    b = w.submit_pool(name="b")
    w.tick(0.1)
    assert w.placement(a) == ("fast", 2) and w.placement(b) == ("slow", 2)
    assert w.reallocations(b) == ["started on 2 × slow"]
    assert w.triggers(b) == [f"{b} arrived"]
    assert f"round ran: {b} arrived" in w.event(b, "reallocated")[0].message
    alloc = w.mgr.ctx.pool.state.jobs[a].allocation
    assert set(alloc) == {"2×fast", "2×slow"} and 0.4 < alloc["2×fast"] < 0.6, alloc
    w.until(lambda: w.realised(b))
    w.tick(ROUND_S)
    assert w.reallocations(a)[1:] == ["2 × fast → 2 × slow (allocation)"]
    assert w.reallocations(b)[1:] == ["2 × slow → 2 × fast (allocation)"]
    assert w.triggers(a)[1:] == w.triggers(b)[1:] == ["round due"]
    # Both generations stop gracefully with the round's reason, then relaunch on their placement.
    w.until(lambda: w.realised(a) and w.realised(b))
    stops = [e.data["reason"] for e in w.event(a, "stopping")]
    assert stops == ["pool: round 2 (las): 2 × fast → 2 × slow (allocation)"]
    assert w.store.generation(a, 1).graceful == 1
    released = [e.vm_id for e in w.event(a, "vm-released")]
    assert len(released) == 2 and all(w.store.vm(v).state == "deleted" for v in released)
    assert set(released) <= set(w.provider.deleted)
    w.steps(a, 4, 4, resumed_from=3)

    # a finishes: the next round (at once: a left) gives b the capacity a had.
    before = w.placement(b)
    for vm in w.running(a):
        vm.finish(0)
    w.until(lambda: w.store.job(a).state == "finished")
    assert before == ("fast", 2) and w.placement(b) == before  # already on the best: stays
    assert w.mgr.ctx.pool.state.jobs[b].allocation == {"2×fast": 1.0}
    assert a not in w.mgr.ctx.pool.state.jobs
    # Had the round moved b, its event would say why the round ran: a ended.
    assert w.mgr.ctx.pool._trigger([], [a]) == f"{a} finished"
    w.tick(ROUND_S)
    assert w.realised(b) and len(w.reallocations(b)) == 2


def test_capacity_change_preempts_and_restart_restores_pool_state(tmp_path):
    pool = {**POOL, "capacity_changes": [{"round": 2, "type": "fast", "capacity": 1}]}
    w = PoolWorld(tmp_path, pool=pool)
    a = w.submit_pool(name="a")
    w.tick()
    w.until(lambda: w.realised(a))
    w.steps(a, 1, 2)
    w.tick(ROUND_S)  # round 1: nothing changed for a
    assert w.reallocations(a) == ["started on 2 × fast"]
    w.steps(a, 3, 4)
    w.tick(ROUND_S)  # round 2: fast capacity 2 → 1
    assert w.placement(a) == ("fast", 1)
    assert w.reallocations(a)[-1] == "2 × fast → 1 × fast (fast-1 preempted)"
    w.until(lambda: w.realised(a))

    # Measured throughput feeds the correction; the state survives a restart exactly.
    for step in range(5, 9):  # one step a second: 24 examples/s measured
        w.clock.advance(1.0)
        w.steps(a, step, step, resumed_from=4)
    w.tick(ROUND_S)
    state = w.mgr.ctx.pool.state
    predicted = 8.333  # the synthetic calibration's 1 × fast, checked by the factor below
    assert state.jobs[a].measured == pytest.approx(24.0)
    assert state.jobs[a].factors["fast"] == pytest.approx(0.7 + 0.3 * 24.0 / predicted, rel=1e-3)
    saved = PoolStore(w.store).load()
    w.restart()
    assert w.mgr.ctx.pool is not None and w.mgr.ctx.pool.state == state
    assert w.mgr.ctx.pool.config == w.pool_config
    assert PoolStore(Store(str(tmp_path / "state.sqlite"))).load() == saved
    # And it goes on from there: the next round is round 4, a stays where it is.
    w.tick(ROUND_S)
    assert w.mgr.ctx.pool.state.round_index == state.round_index + 1
    assert w.placement(a) == ("fast", 1) and w.realised(a)


def test_pool_job_needs_a_pool_and_a_calibration(tmp_path):
    from manager.domain.errors import ManagerError

    (tmp_path / "plain").mkdir()
    plain = World(tmp_path / "plain")
    with pytest.raises(ManagerError, match="no shared pool; start it with varuna-manager serve --pool"):
        plain.submit(pool=True)
    w = PoolWorld(tmp_path)
    with pytest.raises(ManagerError, match="a pool job needs 'calibration' or \\[profile\\]"):
        w.submit(pool=True)


MIXED = {
    **POOL,
    "types": [
        {"name": "k8s-spot", "price_per_hour": 0.9, "capacity": 2, "speed": 1.0, "provider": "kubernetes",
         "provider_options": {"image": "varuna:1", "namespace": "ml", "node_selector": {"pool": "spot"}}},
        {"name": "slow", "price_per_hour": 0.3, "capacity": 2, "speed": 0.25},  # the job's provider
    ],
}


def test_a_pool_mixes_vm_types_of_different_providers(tmp_path):
    """Note [Providers in a pool]: a type naming its own provider gets its VMs from it (made with
    the type's options), and they are listed and deleted there; the other type's come from the
    job's provider."""
    cfg = PoolConfig.from_dict(MIXED)
    assert [t.provider for t in cfg.types] == ["kubernetes", ""]
    for change, words in (
        ({"provider": "gcp"}, "pool type 'k8s-spot': unknown provider 'gcp'"),
        ({"provider_options": {}}, "pool type 'k8s-spot': provider_options: kubernetes needs image"),
    ):
        with pytest.raises(ValueError) as err:
            PoolConfig.from_dict({**MIXED, "types": [{**MIXED["types"][0], **change}, MIXED["types"][1]]})
        assert str(err.value).startswith(words) and "\n" not in str(err.value)

    w = PoolWorld(tmp_path, MIXED)
    k8s = TypedProvider(name="kubernetes", created=w.provider.created)  # the world registers both's VMs
    made: list[tuple[str, dict]] = []

    def factory(name: str, options: dict, context: Any) -> Any:
        made.append((name, dict(options)))
        return k8s if name == "kubernetes" else w.provider

    w.mgr = Manager(w.store, w.mgr.config, provider_factory=factory, clock=w.clock, pool=w.pool_config)
    a = w.submit_pool(name="a", target_steps=40)  # the job's own provider is local
    w.until(lambda: w.placement(a) == ("k8s-spot", 2) and w.realised(a))
    ids = set(w.gen(a).vm_ids)
    assert ids <= set(k8s.types) and not ids & set(w.provider.types)
    assert {k8s.types[v]["node_selector"]["pool"] for v in ids} == {"spot"}
    assert {w.store.vm(v).provider for v in ids} == {"kubernetes"}
    assert ("kubernetes", MIXED["types"][0]["provider_options"]) in made
    assert [name for name, _ in made].count("kubernetes") == 1  # one provider per job and provider

    # The kubernetes provider reports one of its VMs gone (its agent still heartbeats: only the
    # provider knows): it is asked (not the job's provider), deletes it, and the job morphs onto
    # a replacement from it.
    victim = sorted(ids)[0]
    k8s.gone.add(victim)
    w.until(lambda: victim in k8s.deleted, max_ticks=4)
    assert victim not in w.provider.deleted
    w.until(lambda: w.realised(a) and victim not in w.gen(a).vm_ids)
    assert set(w.gen(a).vm_ids) <= set(k8s.types)
