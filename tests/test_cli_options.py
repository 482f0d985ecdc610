"""One name per concept across the command lines: the auto-config options are one shared group
(varuna.core.cli.add_planning_args) in varuna-launch and varuna-simulate, parsed into one value
object (varuna.core.planning.PlanRequest); renamed options keep their old spelling for a release
with one deprecation line."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from varuna.core.calibration import Calibration
from varuna.core.cli import OneLineParser, add_planning_args
from varuna.core.env import RunPlan
from varuna.core.planning import PlanRequest
from varuna.launch.launcher import _build_parser as launch_parser
from varuna.launch.launcher import main as launch_main
from varuna.launch.spec import LaunchConfig

needs_simulator = pytest.mark.skipif(
    importlib.util.find_spec("simulator.autoconfig") is None, reason="no simulator.autoconfig"
)
PLANNING = ("--calibration", "--global-batch-size", "--schedule", "--chunks", "--micro-batch-size",
            "--gpu-memory", "--recompute-segments")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


@needs_simulator
def test_launch_and_simulate_share_the_planning_options():
    from simulator.cli import build_parser as simulate_parser

    launch, simulate = _options(launch_parser()), _options(simulate_parser())
    for flag in PLANNING:
        a, b = launch[flag], simulate[flag]
        assert (a.dest, a.type, a.help) == (b.dest, b.type, b.help), flag
    # Workers per host: one spelling in every CLI that has the concept.
    assert "--procs-per-host" in launch and "--procs-per-host" in simulate
    from profiler.cli import build_parser as profile_parser

    assert "--procs-per-host" in _options(profile_parser())


def test_gpu_memory_takes_a_size_and_the_gib_spelling_still_works_with_one_line(capsys):
    parser = OneLineParser(prog="demo")
    add_planning_args(parser)
    new = parser.parse_args(["--gpu-memory", "16GiB"]).gpu_memory
    assert new == 16 * 2**30 == parser.parse_args(["--gpu-memory", str(16 * 2**30)]).gpu_memory
    assert capsys.readouterr().err == ""
    old = parser.parse_args(["--gpu-memory-gib", "16"]).gpu_memory
    assert old == new
    warning = "demo: warning: --gpu-memory-gib is deprecated; use --gpu-memory 16GiB\n"
    assert capsys.readouterr().err == warning
    with pytest.raises(SystemExit):
        parser.parse_args(["--gpu-memory", "lots"])
    assert capsys.readouterr().err.count("\n") == 1


@needs_simulator
def test_simulate_keeps_hosts_slots_for_a_release(capsys):
    from simulator.cli import build_parser

    argv = ["--calibration", "c.json", "--gpus", "4", "--global-batch-size", "8"]
    assert build_parser().parse_args([*argv, "--hosts-slots", "2"]).procs_per_host == 2
    assert "--hosts-slots is deprecated; use --procs-per-host 2" in capsys.readouterr().err
    assert build_parser().parse_args([*argv, "--procs-per-host", "2"]).procs_per_host == 2


def test_plan_request_from_the_options_is_checked_once_in_one_line():
    parser = OneLineParser(prog="demo")
    add_planning_args(parser)
    args = parser.parse_args(["--calibration", "c.json", "--global-batch-size", "32", "--chunks", "0"])
    with pytest.raises(ValueError, match=r"^--chunks must be an integer >= 1, got 0$"):
        PlanRequest.from_args(args, gpus=4)
    args = parser.parse_args(["--calibration", "c.json", "--global-batch-size", "32",
                              "--micro-batch-size", "4"])
    req = PlanRequest.from_args(args, gpus=4, host_slots=(2, 2))
    got = (req.global_batch_size, req.micro_batch_size, req.schedule, req.chunks, req.gpus)
    assert got == (32, 4, None, 1, 4)  # no --schedule: planned with the rest (Note [Joint plan])
    assert (req.recompute, req.shard_optimizer) == (None, None)
    for bad, words in [({"pipeline_depth": 0}, "--pipeline-depth"), ({"gpus": 0}, "--gpus"),
                       ({"schedule": "zigzag"}, "unknown schedule kind 'zigzag'"),
                       ({"gpu_memory_bytes": 0}, "--gpu-memory")]:
        with pytest.raises(ValueError, match=words):
            PlanRequest(calibration=None, global_batch_size=8, **bad)


def test_launcher_refuses_a_zero_pipeline_depth_at_the_command_line(tmp_path, capsys):
    script = tmp_path / "t.py"
    script.write_text("")
    assert launch_main(["--procs", "2", "--pipeline-depth", "0", str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--pipeline-depth" in err[0] and "positive integer" in err[0], err


def test_launcher_exports_a_fixed_micro_batch_size_in_the_plan(tmp_path, launched: list[LaunchConfig]):
    script = tmp_path / "t.py"
    script.write_text("")
    argv = ["--procs", "2", "--pipeline-depth", "2", "--global-batch-size", "8", "--micro-batch-size", "2"]
    assert launch_main([*argv, str(script)]) == 0
    assert RunPlan.from_env(launched[-1].worker_env) == RunPlan(global_batch_size=8, micro_batch_size=2)


@needs_simulator
def test_launcher_plans_with_the_gib_spelling_like_the_size_one(
    tmp_path: Path, launched, autoconfig_calls, capsys
):
    cal = tmp_path / "cal.json"
    Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1, 2)).save(cal)
    script = tmp_path / "t.py"
    script.write_text("")
    argv = ["--procs", "2", "--calibration", str(cal), "--global-batch-size", "16"]
    assert launch_main([*argv, "--gpu-memory", "4GiB", str(script)]) == 0
    assert launch_main([*argv, "--gpu-memory-gib", "4", str(script)]) == 0
    assert len(autoconfig_calls) >= 2  # without --schedule: one call per planned kind too
    assert {c["gpu_memory_bytes"] for c in autoconfig_calls} == {4 * 2**30}
    assert "--gpu-memory-gib is deprecated; use --gpu-memory 4GiB" in capsys.readouterr().err
    same = [{k: v for k, v in c.worker_env.items() if k != "VARUNA_FENCE_EPOCH"} for c in launched[:2]]
    assert same[0] == same[1]  # but the fence epoch: each run of the command is a new one


def test_recompute_segments_is_a_planning_option_parsed_once(tmp_path, launched: list[LaunchConfig], capsys):
    """``--recompute-segments`` sits in the shared group, parses ranges, reaches PlanRequest and,
    without auto-config, every worker's run plan; a malformed set is one usage line."""
    parser = OneLineParser(prog="demo")
    add_planning_args(parser)
    args = parser.parse_args(["--calibration", "c.json", "--global-batch-size", "8",
                              "--recompute-segments", "3,0-1"])
    assert args.recompute_segments == (0, 1, 3)
    assert PlanRequest.from_args(args, gpus=2).recompute_segments == (0, 1, 3)
    assert PlanRequest.from_args(parser.parse_args(["--global-batch-size", "8"])).recompute_segments is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--recompute-segments", "1-x"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--recompute-segments" in err and "0,2-3" in err, err
    script = tmp_path / "t.py"
    script.write_text("")
    argv = ["--procs", "2", "--pipeline-depth", "2", "--recompute-segments", "2,0", str(script)]
    assert launch_main(argv) == 0
    assert RunPlan.from_env(launched[-1].worker_env) == RunPlan(recompute_segments=(0, 2))
    assert launched[-1].worker_env["VARUNA_RECOMPUTE_SEGMENTS"] == "0,2"
    capsys.readouterr()
    assert launch_main([*argv[:-1], "--schedule", "zb-h1", str(script)]) == 2  # said before any worker starts
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--recompute-segments is not supported with --schedule zb-h1" in err[0], err
