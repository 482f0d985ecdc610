"""Mixed VM types in ``varuna-launch`` (issue #19): ``type=`` on host lines, ``--type-speeds``,
the mixed plan (``varuna.launch.mixed``) and rank placement by type. Fast: nothing is started.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import varuna.launch.launcher
from varuna.core.batching import check_shares
from varuna.core.env import RunPlan
from varuna.launch.hosts import HostEntry, check_types, parse_host_entry, parse_hosts_arg
from varuna.launch.launcher import main
from varuna.launch.local import LocalHost
from varuna.launch.mixed import parse_type_speeds, place_ranks, plan_types
from varuna.launch.spec import LaunchConfig, plan_workers

needs_simulator = pytest.mark.skipif(
    importlib.util.find_spec("simulator.autoconfig") is None, reason="no simulator.autoconfig"
)


# -- host lines ------------------------------------------------------------------------------------


def test_type_is_parsed_next_to_slots_in_any_order() -> None:
    a = parse_host_entry("alice@10.0.0.5:2222 slots=4 type=v100")
    b = parse_host_entry("10.0.0.6 type=k80 slots=2")
    assert (a.vm_type, a.slots, a.display) == ("v100", 4, "alice@10.0.0.5:2222")
    assert (b.vm_type, b.slots) == ("k80", 2)
    assert parse_host_entry("h").vm_type is None


@pytest.mark.parametrize(
    "text, needle",
    [
        ("h type=", "is not a VM type name"),
        ("h type=$(id)", "is not a VM type name"),
        ("h type=-x", "is not a VM type name"),
        ("h type=a type=a", "type= given twice"),
        ("h kind=a", "only slots=N and type=NAME may follow"),
    ],
)
def test_bad_type_is_one_line_naming_the_entry(text: str, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_host_entry(text, origin="hosts.txt line 3")
    message = str(info.value)
    assert message.startswith(f"host entry {text!r} (hosts.txt line 3): ") and needle in message
    assert "\n" not in message


def test_types_on_every_host_or_none(tmp_path: Path) -> None:
    path = tmp_path / "hosts.txt"
    path.write_text("localhost slots=2 type=fast\nlocalhost slots=2   # forgot the type\n")
    with pytest.raises(ValueError, match=r"hosts.txt line 2\) has no type= but other hosts do"):
        check_types(parse_hosts_arg(str(path)))
    assert check_types(parse_hosts_arg("a,b")) is False


def test_type_speeds_parsing() -> None:
    assert parse_type_speeds("fast=1.6, slow=1") == {"fast": 1.6, "slow": 1.0}
    for bad, needle in [("fast", "TYPE=SPEED"), ("fast=0", "SPEED > 0"), ("fast=x", "TYPE=SPEED"),
                        ("a=1,a=2", "names 'a' twice"), ("=1", "not a valid name")]:
        with pytest.raises(ValueError, match=needle):
            parse_type_speeds(bad)


# -- the plan ------------------------------------------------------------------------------------


def _rate(grid: tuple[tuple[str, ...], ...], speeds: dict[str, float], split: tuple[float, ...]) -> float:
    """Reference: the mini-batch rate of a grid whose stages hold fractions ``split`` of the
    model, each replica running at its bottleneck stage's pace (work / speed)."""
    return sum(1.0 / max(w / speeds[t] for w, t in zip(split, row)) for row in grid)


def test_equal_speeds_plan_nothing_uneven() -> None:
    plan = plan_types(["a", "b", "a", "b"], {"a": 1.0, "b": 1.0}, pipeline_depth=2, data_parallel=2,
                      num_microbatches=8)
    assert plan.replica_shares is None and plan.stage_speeds is None


def test_two_fast_two_slow_single_stage_gives_proportional_shares() -> None:
    # P=1, D=4 on 2 × 1.6 and 2 × 1.0: shares ∝ speed, 16 micro-batches -> 16·1.6/5.2 = 4.92 and
    # 16/5.2 = 3.08, largest remainders: (5, 5, 3, 3).
    plan = plan_types(["slow", "fast", "slow", "fast"], {"fast": 1.6, "slow": 1.0}, pipeline_depth=1,
                      data_parallel=4, num_microbatches=16)
    assert plan.slot_types == (("fast",), ("fast",), ("slow",), ("slow",))
    assert plan.replica_shares == (5, 5, 3, 3) and plan.stage_speeds is None
    assert check_shares(plan.replica_shares, 16, 4) is None


def test_one_pipeline_of_two_types_splits_by_speed() -> None:
    # P=2, D=1 on a 2.0 and a 1.0 VM: the split gives the fast stage 2/3 of the model.
    plan = plan_types(["b", "a"], {"a": 2.0, "b": 1.0}, pipeline_depth=2, data_parallel=1)
    assert plan.slot_types == (("a", "b"),) and plan.stage_speeds == (2.0, 1.0)
    assert plan.relative_rate == pytest.approx(_rate(plan.slot_types, {"a": 2.0, "b": 1.0}, (2 / 3, 1 / 3)))


def test_plan_is_as_good_as_every_grid_of_its_kind() -> None:
    """Against brute force: no assignment of the chosen slots to the P×D grid whose replicas all
    run with one shared split proportional to the stage-wise minimum speeds beats the plan by
    more than rounding (the interim planner's model), on random small clusters."""
    rng = random.Random(7)
    speeds = {"x": 1.0, "y": 1.6, "z": 2.5}
    for _ in range(60):
        P, D = rng.randint(1, 3), rng.randint(1, 3)
        slots = [rng.choice("xyz") for _ in range(P * D + rng.randint(0, 2))]
        plan = plan_types(slots, speeds, pipeline_depth=P, data_parallel=D)
        chosen = sorted(plan.rank_types)
        assert chosen == sorted(sorted(slots, key=lambda t: -speeds[t])[: P * D])
        best = 0.0
        for perm in set(itertools.permutations(chosen)):
            grid = tuple(tuple(perm[d * P : (d + 1) * P]) for d in range(D))
            stage = [min(speeds[row[i]] for row in grid) for i in range(P)]
            best = max(best, _rate(grid, speeds, tuple(v / sum(stage) for v in stage)))
        split = plan.stage_speeds or (1.0,) * P
        got = _rate(plan.slot_types, speeds, tuple(v / sum(split) for v in split))
        # The two arrangements tried are not always the best grid; they must stay close to it.
        assert got >= 0.85 * best, (slots, P, D, plan)


def test_too_few_slots_or_unknown_type_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"P=2 × D=2 needs 4 slots but 3 are available"):
        plan_types(["a"] * 3, {"a": 1.0}, pipeline_depth=2, data_parallel=2)
    with pytest.raises(ValueError, match=r"no speed for VM type\(s\) b"):
        plan_types(["a", "b"], {"a": 1.0}, pipeline_depth=1, data_parallel=2)


# -- placement -------------------------------------------------------------------------------------


def test_placement_puts_every_rank_on_its_type_within_slots() -> None:
    rng = random.Random(3)
    speeds = {"x": 1.0, "y": 2.0}
    for _ in range(100):
        hosts = [(rng.choice("xy"), rng.randint(1, 3)) for _ in range(rng.randint(1, 5))]
        total = sum(n for _, n in hosts)
        P = rng.randint(1, total)
        D = rng.randint(1, total // P)
        slot_types = [t for t, n in hosts for _ in range(n)]
        plan = plan_types(slot_types, speeds, pipeline_depth=P, data_parallel=D)
        placed = place_ranks(plan, hosts)
        assert [hosts[h][0] for h in placed] == list(plan.rank_types)
        for h, (_, n) in enumerate(hosts):
            assert placed.count(h) <= n


def test_plan_workers_follows_rank_hosts() -> None:
    cfg = LaunchConfig(script="t.py", pipeline_depth=2, data_parallel=2, rank_hosts=(0, 1, 0, 1))
    specs = plan_workers(cfg, [LocalHost(slots=2), LocalHost(slots=2)], master_port=1)
    assert [(s.env.rank, s.env.host_id, s.env.local_rank, s.env.local_world_size) for s in specs] == [
        (0, 0, 0, 2), (1, 1, 0, 2), (2, 0, 1, 2), (3, 1, 1, 2)
    ]
    bad = LaunchConfig(script="t.py", pipeline_depth=2, data_parallel=1, rank_hosts=(0, 0))
    with pytest.raises(ValueError, match="puts 2 ranks on host 0, which has 1 slot"):
        plan_workers(bad, [LocalHost(slots=1), LocalHost(slots=1)], master_port=1)
    with pytest.raises(ValueError, match="for each of the 4 ranks"):
        LaunchConfig(script="t.py", pipeline_depth=2, data_parallel=2, rank_hosts=(0, 1))
    # Not an integer index, or rank 0 (the rendezvous) away from host 0: one line each.
    for hosts in [(0, 1.5, 0, 1), (0, "a", 0, 1), (1, 0, 1, 0), (0, True, 0, 1)]:
        with pytest.raises(ValueError, match="integer host index >= 0 .* rank 0 on host 0") as err:
            LaunchConfig(script="t.py", pipeline_depth=2, data_parallel=2, rank_hosts=hosts)
        assert "\n" not in str(err.value)


# -- the launcher ----------------------------------------------------------------------------------


@pytest.fixture
def on_hosts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[LaunchConfig, list[HostEntry]]]:
    """What main() would run with --hosts: (config, hosts) of the first launch's placement, as
    ``run_with_restarts`` plans it (nothing is started)."""
    runs: list[tuple[LaunchConfig, list[HostEntry]]] = []

    def fake(config: LaunchConfig, reachable: list[HostEntry], plan: Any, **_: Any) -> int:
        placement = plan(list(reachable))
        runs.append((placement.config, list(placement.hosts)))
        return 0

    monkeypatch.setattr(varuna.launch.launcher, "run_with_restarts", fake)
    return runs


def _rank_types(config: LaunchConfig, used: list[HostEntry]) -> list[str | None]:
    assert config.rank_hosts is not None
    return [used[h].vm_type for h in config.rank_hosts]


@needs_simulator
def test_auto_config_on_typed_hosts_runs_the_mixed_planner_and_places_by_type(
    tmp_path: Path, on_hosts: list[tuple[LaunchConfig, list[HostEntry]]]
) -> None:
    from simulator.mixed_plan import plan_mixed
    from varuna.core.calibration import Calibration, VmType

    script = tmp_path / "train.py"
    script.write_text("")
    cal = Calibration.synthetic(0.05, num_segments=2, micro_batch_sizes=(2,))
    cal.types = {"fast": VmType(name="fast", speed=1.6), "slow": VmType(name="slow", speed=1.0)}
    cal.save(tmp_path / "cal.json")
    hosts = "localhost type=slow,localhost type=fast,localhost type=slow,localhost type=fast"
    argv = ["--hosts", hosts, "--procs-per-host", "1", "--calibration", str(tmp_path / "cal.json"),
            "--global-batch-size", "32", "--quiet", str(script)]
    assert main(argv) == 0  # no --type-speeds: the calibration's types give the costs
    (config, used), = on_hosts
    plan = RunPlan.from_env(config.worker_env)
    costs = Calibration.load(tmp_path / "cal.json")
    expected = plan_mixed({"slow": 2, "fast": 2}, costs, global_batch_size=32)
    assert (config.pipeline_depth, config.data_parallel) == (expected.num_stages, expected.num_replicas)
    assert plan.micro_batch_size == expected.micro_batch_size == 2
    assert plan.replica_shares == expected.replica_shares and plan.stage_ranges == expected.stage_ranges
    assert check_shares(plan.replica_shares, 16, config.data_parallel) is None
    # Every rank on a host of the type the plan put there; rank 0's host is host 0 (the rendezvous).
    assert _rank_types(config, used) == expected.rank_types()
    assert used[0].vm_type == expected.rank_types()[0]


@needs_simulator
def test_given_p_with_a_calibration_restricts_the_mixed_planner(
    tmp_path: Path, on_hosts: list[tuple[LaunchConfig, list[HostEntry]]]
) -> None:
    from simulator.mixed_plan import plan_mixed
    from varuna.core.calibration import Calibration, VmType

    script = tmp_path / "train.py"
    script.write_text("")
    cal = Calibration.synthetic(0.05, num_segments=4, micro_batch_sizes=(2,))
    cal.types = {"a": VmType(name="a", speed=2.0), "b": VmType(name="b", speed=1.0)}
    cal.save(tmp_path / "cal.json")
    argv = ["--hosts", "localhost type=b,localhost type=a,localhost type=b,localhost type=a",
            "--procs-per-host", "1", "--pipeline-depth", "2", "--calibration", str(tmp_path / "cal.json"),
            "--global-batch-size", "16", "--quiet", str(script)]
    assert main(argv) == 0
    (config, used), = on_hosts
    expected = plan_mixed({"b": 2, "a": 2}, Calibration.load(tmp_path / "cal.json"), global_batch_size=16,
                          pipeline_depths=[2])
    assert config.pipeline_depth == expected.num_stages == 2
    assert _rank_types(config, used) == expected.rank_types()
    plan = RunPlan.from_env(config.worker_env)
    assert plan.replica_shares == expected.replica_shares and plan.stage_ranges == expected.stage_ranges


def test_given_p_on_typed_hosts_sets_speeds(
    tmp_path: Path, on_hosts: list[tuple[LaunchConfig, list[HostEntry]]]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    argv = ["--hosts", "localhost slots=1 type=b,localhost slots=1 type=a", "--type-speeds", "a=2,b=1",
            "--pipeline-depth", "2", "--quiet", str(script)]
    assert main(argv) == 0
    (config, used), = on_hosts
    assert _rank_types(config, used) == ["a", "b"]
    assert RunPlan.from_env(config.worker_env).stage_speeds == (2.0, 1.0)


@pytest.mark.parametrize(
    "hosts, extra, needle",
    [
        ("localhost type=a,localhost type=b", [], "of 2 VM types (a, b); give their relative speeds"),
        ("localhost type=a,localhost", ["--type-speeds", "a=1"], "has no type= but other hosts do"),
        ("localhost,localhost", ["--type-speeds", "a=1"], "no host line says type=NAME"),
        ("localhost type=a,localhost type=b", ["--type-speeds", "a=1"], "no speed for VM type(s) b"),
    ],
)
def test_bad_type_input_is_one_usage_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hosts: str, extra: list[str], needle: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    argv = ["--hosts", hosts, "--procs-per-host", "1", *extra, "--pipeline-depth", "1", str(script)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


# -- real processes ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_typed_pretend_hosts_get_their_planned_ranks_and_plan(tmp_path: Path) -> None:
    """Three pretend hosts, slow, fast, slow; P=2 (D=1) at speeds fast=3, slow=1: the pipeline
    runs on the fast host (first: rank 0's) and one slow host, every worker's host (by the agent's
    VARUNA_HOST_ID and the launcher's placement line) is of the type the speed-only rule gives
    its rank, and every worker gets the stage speeds (3, 1)."""
    script = tmp_path / "w.py"
    script.write_text(
        "import os\n"
        "print('|'.join(os.environ.get(k, '') for k in ('RANK', 'VARUNA_HOST_ID', 'LOCAL_RANK',"
        " 'LOCAL_WORLD_SIZE', 'VARUNA_STAGE_SPEEDS')))\n"
    )
    hosts = ",".join(f"localhost slots=1 type={t}" for t in ("slow", "fast", "slow"))
    argv = ["--hosts", hosts, "--type-speeds", "fast=3,slow=1", "--pipeline-depth", "2", "--quiet",
            str(script)]
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "varuna.launch", *argv], capture_output=True, text=True, timeout=100,
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    speeds = {"fast": 3.0, "slow": 1.0}
    expected = plan_types(["slow", "fast", "slow"], speeds, pipeline_depth=2, data_parallel=1)
    assert expected.rank_types == ("fast", "slow") and expected.stage_speeds == (3.0, 1.0)
    placement = next(line for line in result.stderr.splitlines() if " on 2 host(s): " in line)
    host_types = [part.split("[")[1].split("]")[0] for part in placement.split(": ", 2)[2].split(", ")]
    rows = [line.rsplit("] ", 1)[1].split("|") for line in result.stdout.splitlines() if "|" in line]
    assert sorted(int(r[0]) for r in rows) == [0, 1]
    for rank, host_id, local_rank, local_size, speeds in rows:
        assert host_types[int(host_id)] == expected.rank_types[int(rank)], (rows, host_types)
        assert (local_rank, local_size) == ("0", "1")
        assert speeds == "3.0,1.0"
