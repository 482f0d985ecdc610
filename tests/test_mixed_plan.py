"""Mixed VM types, planning side (issue #19): calibration schema v2 ``types``, the simulator on
uneven stages and replicas, and ``simulator.mixed_plan.plan_mixed`` against brute force and
hand-computed cases. Fast: pure Python, no processes."""

from __future__ import annotations

import itertools
import json

import pytest

from simulator.cli import main as simulate_main
from simulator.config import SimConfig
from simulator.engine import simulate
from simulator.mixed_plan import plan_mixed
from varuna.core.calibration import Calibration, VmType
from varuna.core.env import RunPlan

F = 0.01  # forward seconds per example and segment on the 1x type


def _cal(fwd: float = F, n: int = 4, **kw) -> Calibration:
    return Calibration.synthetic(fwd, num_segments=n, micro_batch_sizes=(1, 2), **kw)


def _typed(speeds: dict[str, float], n: int = 4) -> Calibration:
    cal = _cal(n=n)
    cal.types = {t: VmType(name=t, speed=v) for t, v in speeds.items()}
    return cal


# -- schema -------------------------------------------------------------------------------------


def test_types_round_trip_through_a_file_as_version_2(tmp_path):
    slow = _cal(2 * F)
    cal = _cal().with_types({"slow": slow}, memory_bytes={"slow": 1 << 30})
    cal.types["fast"] = VmType(name="fast", speed=1.6, memory_bytes=2 << 30, device="A100")
    path = tmp_path / "cal.json"
    cal.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 2 and set(data["types"]) == {"slow", "fast"}
    back = Calibration.load(path)
    assert back == cal and back.to_dict() == data
    # Own costs: the slow file's; speed only: the base's over the speed (independent arithmetic).
    assert back.for_type("slow").bwd_s(2, 2) == pytest.approx(2 * 2 * F * 2)
    assert back.for_type("fast").fwd_s(1, 2) == pytest.approx(2 * F / 1.6)
    assert back.for_type("fast").recompute_s(0, 1) == pytest.approx(F / 1.6)
    assert back.for_type("fast").param_bytes([0, 1]) == cal.param_bytes([0, 1])  # sizes are the model's
    assert back.types["slow"].memory_bytes == 1 << 30 and back.for_type("fast").types == {}


def test_version_1_file_loads_and_types_need_version_2():
    data = _cal().to_dict()
    data["version"] = 1
    cal = Calibration.from_dict(data)
    assert cal.types == {} and cal.to_dict() == data  # re-saves as it was
    data["types"] = {"fast": {"speed": 2.0}}
    with pytest.raises(ValueError, match="needs calibration version 2") as info:
        Calibration.from_dict(data, source="c.json")
    assert "\n" not in str(info.value) and str(info.value).startswith("c.json:")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({}, "has neither 'speed' nor 'segments'"),
        ({"speed": 0}, "'types.t.speed' must be > 0"),
        ({"speed": 1.0, "segments": []}, "'types.t.segments' has 0 entries but model.num_segments is 4"),
        ({"speed": "fast"}, "'types.t.speed' must be a finite number"),
    ],
)
def test_bad_type_entries_are_one_line_errors(entry, message):
    data = {**_cal().to_dict(), "types": {"t": entry}}
    with pytest.raises(ValueError, match=message) as info:
        Calibration.from_dict(data)
    assert "\n" not in str(info.value)


def test_unknown_type_and_mismatched_sizes_are_refused():
    with pytest.raises(ValueError, match="has no VM type 'gpu'"):
        _typed({"a": 1.0}).for_type("gpu")
    other = Calibration.synthetic(F, num_segments=4, micro_batch_sizes=(1, 4))
    with pytest.raises(ValueError, match="measured micro-batch sizes"):
        _cal().with_types({"x": other})


# -- simulator: uneven stages and replicas ------------------------------------------------------


def test_uneven_shares_and_stage_types_match_a_hand_computed_timeline():
    # gpipe without recompute, free links, one segment per stage, m = 1. Replica 0: a fast (2x)
    # stage 0 before a slow stage 1, n0 micro-batches; replica 1: two slow stages, n1.
    cal = _typed({"fast": 2.0, "slow": 1.0}, n=2)
    n0, n1 = 7, 3
    cfg = SimConfig(num_stages=2, num_replicas=2, micro_batch_size=1, num_microbatches=(n0, n1),
                    schedule="gpipe", recompute=False, device_types=(("fast", "slow"), ("slow", "slow")))
    res = simulate(cal, cfg, record=True)
    f_fast, b_fast, f_slow, b_slow = F / 2, 2 * F / 2, F, 2 * F
    # Replica 0: the slow stage sets the pace: its forwards start after the first fast forward,
    # its backwards follow its last forward, and stage 0's last backward follows the last one.
    end0 = f_fast + n0 * (f_slow + b_slow) + b_fast
    # Replica 1 (both slow): the classic (Nm + P - 1)(F + B).
    end1 = (n1 + 1) * (f_slow + b_slow)
    assert res.minibatch_s == pytest.approx(max(end0, end1), abs=1e-9)
    assert res.examples == n0 + n1
    ends = {(e.replica, e.stage): e.end_s for e in res.timeline.events if e.op == "B"}
    assert ends[(0, 0)] == pytest.approx(end0) and ends[(1, 0)] == pytest.approx(end1)


def test_the_all_reduce_waits_for_the_slowest_replica():
    from varuna.core.calibration import AllReduceModel

    cal = _cal(n=2, allreduce=AllReduceModel(bandwidth_bytes_per_s=1e18, latency_s=0.05))
    cal.types = {"fast": VmType(name="fast", speed=3.0), "slow": VmType(name="slow", speed=1.0)}
    cfg = SimConfig(num_stages=1, num_replicas=2, micro_batch_size=1, num_microbatches=(4, 4),
                    schedule="gpipe", recompute=False, device_types=(("fast",), ("slow",)))
    res = simulate(cal, cfg, record=True)
    slow_end = 4 * 3 * 2 * F  # 4 micro-batches of F + B = 3F per segment, 2 segments
    ar = [e for e in res.timeline.events if e.op == "AR"]
    assert ar and all(e.start_s == pytest.approx(slow_end) for e in ar)
    assert res.minibatch_s == pytest.approx(slow_end + res.stage_allreduce_s[0])


def test_device_types_must_name_known_types():
    cfg = SimConfig(num_stages=1, num_replicas=1, micro_batch_size=1, num_microbatches=2,
                    device_types=(("tpu",),))
    with pytest.raises(ValueError, match="VM type.s. tpu that the calibration does not have"):
        simulate(_typed({"a": 1.0}), cfg)


# -- planner ------------------------------------------------------------------------------------


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        b = (0, *cuts, total)
        yield tuple(b[i + 1] - b[i] for i in range(parts))


def _brute_force(cal: Calibration, cluster: dict[str, int], M: int, schedule: str) -> float:
    """Fastest simulated step over every P, every choice of VMs per rank (order included), every
    contiguous split and every share vector."""
    vms = [t for t, n in cluster.items() for _ in range(n)]
    K = cal.num_segments
    best = float("inf")
    for P in range(1, min(K, len(vms)) + 1):
        for D in range(1, len(vms) // P + 1):
            if D > M:
                continue
            placements = set(itertools.permutations(vms, P * D))
            for ranks in placements:
                rows = tuple(tuple(ranks[d * P : (d + 1) * P]) for d in range(D))
                for sizes in _compositions(K, P):
                    starts = [sum(sizes[:k]) for k in range(P)]
                    ranges = tuple((a, a + s - 1) for a, s in zip(starts, sizes))
                    for shares in _compositions(M, D):
                        cfg = SimConfig(num_stages=P, num_replicas=D, micro_batch_size=1,
                                        num_microbatches=shares, stage_segments=ranges, schedule=schedule,
                                        device_types=rows)
                        best = min(best, simulate(cal, cfg).minibatch_s)
    return best


@pytest.mark.parametrize(
    ("segments", "allreduce_s", "schedule"),
    # A free all-reduce favours data parallelism (P = 1, shares 3,3,1,1), a costly one a single
    # pipeline (the fast VMs last), one in between two mixed pipelines.
    [(5, 0.0, "varuna"), (5, 0.05, "varuna"), (5, 0.3, "1f1b"), (4, 0.02, "gpipe")],
)
def test_planner_finds_the_brute_force_optimum(segments, allreduce_s, schedule):
    from varuna.core.calibration import AllReduceModel

    cal = _cal(n=segments, allreduce=AllReduceModel(bandwidth_bytes_per_s=1e18, latency_s=allreduce_s))
    cal.types = {"fast": VmType(name="fast", speed=1.6), "slow": VmType(name="slow", speed=1.0)}
    cluster, M = {"fast": 2, "slow": 2}, 8
    plan = plan_mixed(cluster, cal, global_batch_size=M, micro_batch_size=1, schedule=schedule)
    optimum = _brute_force(cal, cluster, M, schedule)
    assert optimum * (1 - 1e-9) <= plan.minibatch_s <= 1.01 * optimum
    # The reported time is the simulator's for exactly the planned layout.
    cfg = SimConfig.for_global_batch(global_batch_size=M, num_replicas=plan.num_replicas, micro_batch_size=1,
                                     shares=plan.replica_shares, num_stages=plan.num_stages,
                                     stage_segments=plan.stage_ranges, schedule=schedule,
                                     device_types=plan.stage_types)
    assert simulate(cal, cfg).minibatch_s == pytest.approx(plan.minibatch_s)


def test_data_parallel_shares_are_proportional_to_speed():
    # P = 1, free links: replica d takes n_d (F + B)·K / speed_d; 2x and 1x with 9 micro-batches:
    # (6, 3) makes both take 6·3F·4/2 = 3·3F·4 = 0.36 s, any other split is slower.
    cal = _typed({"fast": 2.0, "slow": 1.0})
    plan = plan_mixed({"fast": 1, "slow": 1}, cal, global_batch_size=9, micro_batch_size=1,
                      schedule="gpipe", recompute=False, pipeline_depths=[1])
    shares = dict(zip((r[0] for r in plan.stage_types), plan.replica_shares))
    assert shares == {"fast": 6, "slow": 3}
    assert plan.minibatch_s == pytest.approx(3 * 3 * F * 4)
    fast_only = next(a for a in plan.alternatives if a.label == "fast-only")
    assert fast_only.minibatch_s == pytest.approx(9 * 3 * F * 4 / 2)
    slowest = next(a for a in plan.alternatives if a.label == "all-as-slowest")
    assert slowest.replica_shares in ((5, 4), (4, 5))


def test_slow_stage_gets_less_of_the_model():
    cal = _typed({"fast": 3.0, "slow": 1.0}, n=8)
    plan = plan_mixed({"fast": 1, "slow": 1}, cal, global_batch_size=8, micro_batch_size=1,
                      schedule="1f1b", pipeline_depths=[2])
    (row,) = plan.stage_types
    size = {t: b - a + 1 for t, (a, b) in zip(row, plan.stage_ranges)}
    assert sorted(row) == ["fast", "slow"] and size["fast"] > size["slow"]
    assert dict(zip(row, plan.stage_speeds)) == {"fast": 3.0, "slow": 1.0}


def test_equal_types_give_equal_shares_and_speeds():
    # Negative control: with two names for one speed, nothing is uneven.
    cal = _typed({"a": 1.0, "b": 1.0}, n=8)
    plan = plan_mixed({"a": 2, "b": 2}, cal, global_batch_size=16, micro_batch_size=1)
    assert len(set(plan.replica_shares)) == 1 and len(set(plan.stage_speeds)) == 1
    assert all(a.examples_per_s <= plan.examples_per_s * (1 + 1e-9) for a in plan.alternatives)
    slowest = next(a for a in plan.alternatives if a.label == "all-as-slowest")
    assert plan.examples_per_s == pytest.approx(slowest.examples_per_s, rel=0.02)


def test_plan_converts_to_the_runtime_run_plan():
    cal = _typed({"fast": 1.6, "slow": 1.0}, n=8)
    plan = plan_mixed({"fast": 2, "slow": 2}, cal, global_batch_size=32, micro_batch_size=2,
                      pipeline_depths=[2])
    env = plan.run_plan().to_env()
    back = RunPlan.from_env(env)
    assert back.replica_shares == plan.replica_shares and back.stage_ranges == plan.stage_ranges
    assert back.stage_speeds == plan.stage_speeds and back.micro_batch_size == 2
    assert sum(plan.replica_shares) == 16 and len(plan.rank_types()) == plan.num_stages * plan.num_replicas
    assert plan.vms_used == {"fast": 2, "slow": 2}
    assert plan.config_overrides()["replica_shares"] == plan.replica_shares


def test_planner_errors_are_one_line():
    cal = _typed({"fast": 1.6})
    for cluster, message in [({"gpu": 1}, "no costs for VM type"), ({"fast": -1}, "integer >= 0"),
                             ({}, "cluster is empty")]:
        with pytest.raises(ValueError, match=message) as info:
            plan_mixed(cluster, cal, global_batch_size=4)
        assert "\n" not in str(info.value)


def test_cli_prints_map_shares_and_alternatives(tmp_path, capsys):
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.json"
    _cal(F / 1.6, n=8).save(fast)
    _cal(F, n=8).save(slow)
    rc = simulate_main(["--type-calibration", f"fast={fast}", "--type-calibration", f"slow={slow}",
                        "--cluster", "fast=2,slow=2", "--global-batch-size", "16", "--micro-batch-size", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "replica 0: stages on" in out and "vs all-as-slowest" in out and "vs fast-only" in out
    assert "VARUNA_REPLICA_SHARES=" in out
    rc = simulate_main(["--cluster", "fast=2,slow=x", "--global-batch-size", "16"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "TYPE=COUNT" in err


# -- emulated mixed cluster (the validation's rig) ----------------------------------------------


def test_emulated_device_speed_divides_every_sleep():
    from varuna.testing.emulated import emulated_model

    base = emulated_model(3, [0.01, 0.02, 0.03], 4)
    fast = emulated_model(3, [0.01, 0.02, 0.03], 4, speed=1.6)
    assert [b.fwd_s * 1.6 for b in fast.blocks] == pytest.approx([b.fwd_s for b in base.blocks])
    assert [b.bwd_s * 1.6 for b in fast.blocks] == pytest.approx([b.bwd_s for b in base.blocks])
    with pytest.raises(ValueError, match="speed must be a finite number > 0"):
        emulated_model(2, 0.01, 4, speed=0)


def _validation_script():
    import importlib.util
    import sys
    from pathlib import Path

    scripts = Path(__file__).resolve().parent.parent / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        spec = importlib.util.spec_from_file_location("validate_simulator", scripts / "validate_simulator.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(scripts))
    return module


def test_validation_config_of_a_mixed_run_survives_json_and_simulates_its_speeds():
    from dataclasses import asdict

    vs = _validation_script()
    c = vs.ValConfig(num_stages=2, num_replicas=2, schedule="gpipe", num_microbatches=4, level="none",
                     speeds=((1.6, 1.6), (1.0, 1.0)), shares=(5, 3), stage_blocks=(3, 1))
    back = vs.ValConfig(**json.loads(json.dumps(asdict(c))))
    assert back == c and back.label == "2x2 gpipe shares=5/3 speeds=1.6-1.6/1-1 blocks=3/1 none"
    assert [c.speed_of(r) for r in range(4)] == [1.6, 1.6, 1.0, 1.0]
    rc = vs.known_costs_only()
    cfg = vs.sim_config(c, rc)
    assert cfg.device_types == (("x1.6", "x1.6"), ("x1", "x1")) and cfg.num_microbatches == (5, 3)
    assert cfg.stage_segments == ((0, 2), (3, 3))
    cal = vs.calibration_of(c, rc)
    assert cal.for_type("x1.6").bwd_s(0, 1) == pytest.approx(2 * vs.BLOCK_FWD_S / 1.6)
    # Stage 0 (3 blocks, F + R + B = 4F each) bounds each replica from below: n·12F / speed.
    t = vs.simulate_config(c, rc)
    assert t >= max(5 * 12 * vs.BLOCK_FWD_S / 1.6, 3 * 12 * vs.BLOCK_FWD_S)
    # Homogeneous events are left as they are by the mixed-aware disturbance check.
    plain = vs.ValConfig(num_stages=2, num_replicas=1, schedule="gpipe", num_microbatches=4, level="none")
    events = [[0, 0, "F", 0, 0.0, 0.021]]
    assert vs._nominal(plain, events) == events
    # ... and a slow device's longer task is not taken for a host freeze.
    slow_b = [[0, 1, "B", 0, 0.0, 2 * 3 * vs.BLOCK_FWD_S + 0.001]]
    assert not vs.disturbed(vs._nominal(c, slow_b))
