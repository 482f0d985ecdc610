"""``varuna-launch --chunks V``: model chunks per process for the interleaved schedules reach every
worker's engine through the run plan (``VARUNA_CHUNKS``, docs/interleaved.md). Bad settings are
one usage line naming the problem and the fix (fast: nothing is started); the slow test trains
examples/gpt2 through the launcher at P = 2 with 2 chunks and compares its losses with the
one-chunk run's, bit for bit in deterministic mode.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from varuna.core.env import RunPlan
from varuna.launch.launcher import main
from varuna.launch.spec import LaunchConfig
from varuna.runtime.config import PipelineConfig, VarunaConfig, adopt_plan

ROOT = Path(__file__).resolve().parent.parent

needs_simulator = pytest.mark.skipif(
    importlib.util.find_spec("simulator.autoconfig") is None, reason="no simulator.autoconfig"
)


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def test_chunks_reach_the_workers_run_plan(script: str, launched: list[LaunchConfig]) -> None:
    argv = ["--procs", "4", "--pipeline-depth", "2", "--schedule", "varuna-interleaved", "--chunks", "3"]
    assert main([*argv, script]) == 0
    plan = RunPlan.from_env(launched[-1].worker_env)
    assert (plan.schedule, plan.chunks) == ("varuna-interleaved", 3)
    assert launched[-1].worker_env["VARUNA_CHUNKS"] == "3"
    # One chunk under a one-chunk kind is allowed (and exported); no --chunks exports nothing.
    assert main(["--procs", "2", "--pipeline-depth", "2", "--chunks", "1", script]) == 0
    assert RunPlan.from_env(launched[-1].worker_env).chunks == 1
    assert main(["--procs", "2", "--pipeline-depth", "2", script]) == 0
    assert "VARUNA_CHUNKS" not in launched[-1].worker_env


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--schedule", "interleaved", "--chunks", "0"], "--chunks must be an integer >= 1"),
        (["--chunks", "2"], "--chunks 2 needs an interleaved schedule, not --schedule varuna; add"),
        (["--schedule", "1f1b", "--chunks", "2"], "not --schedule 1f1b"),
        (["--schedule", "varuna-interleaved"], "needs --chunks V with V >= 2"),
        (["--schedule", "interleaved", "--chunks", "1"], "(got 1); add --chunks 2"),
        (["--schedule", "interleaved", "--chunks", "2", "--auto-cutpoints", "2"],
         "needs 4 virtual stages, i.e. >= 3 cut-points, but --auto-cutpoints allows at most 2"),
        (["--chunks", "two"], "--chunks: invalid int value"),
        (["--live-morph", "--checkpoint-dir", "c", "--schedule", "interleaved", "--chunks", "2"],
         "--live-morph does not carry interleaved stages (--chunks 2) yet"),
    ],
)
def test_bad_chunk_settings_are_one_usage_line(
    argv: list[str], needle: str, script: str, launched: list[LaunchConfig],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--procs", "2", "--pipeline-depth", "2", *argv, script]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert launched == []


def test_interleaved_at_depth_one_is_refused(
    script: str, launched: list[LaunchConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--procs", "1", "--pipeline-depth", "1", "--schedule", "interleaved", "--chunks", "2"]
    assert main([*argv, script]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "over >= 2 pipeline processes, but the job runs at --pipeline-depth 1" in err[0]


@needs_simulator
def test_auto_config_plans_for_the_chunks(
    tmp_path: Path, script: str, launched: list[LaunchConfig],
    autoconfig_calls: list[dict[str, Any]]
) -> None:
    from varuna.core.calibration import Calibration

    seen = autoconfig_calls
    cal = tmp_path / "cal.json"
    Calibration.synthetic(0.01, num_segments=8, micro_batch_sizes=(1, 2)).save(cal)
    argv = ["--procs", "2", "--calibration", str(cal), "--global-batch-size", "16",
            "--schedule", "interleaved", "--chunks", "2"]
    assert main([*argv, script]) == 0
    assert [(k["schedule"], k["chunks"]) for k in seen] == [("interleaved", 2)]
    config = launched[-1]
    plan = RunPlan.from_env(config.worker_env)
    assert plan.chunks == 2 and plan.schedule == "interleaved"
    # The planned map lists P·chunks virtual stages covering the segments in order.
    assert plan.stage_ranges is not None and len(plan.stage_ranges) == 2 * config.pipeline_depth
    assert [s for a, b in plan.stage_ranges for s in range(a, b + 1)] == list(range(8))


def test_run_plan_round_trips_chunks_and_refuses_bad_values() -> None:
    plan = RunPlan(schedule="interleaved", chunks=2)
    assert plan.to_env() == {"VARUNA_SCHEDULE": "interleaved", "VARUNA_CHUNKS": "2"}
    assert RunPlan.from_env(plan.to_env()) == plan
    with pytest.raises(ValueError, match="RunPlan: VARUNA_CHUNKS='x' is not an integer"):
        RunPlan.from_env({"VARUNA_CHUNKS": "x"})
    with pytest.raises(ValueError, match="RunPlan: chunks must be >= 1, got 0"):
        RunPlan(chunks=0)


def test_engine_config_adopts_the_planned_chunks() -> None:
    cfg = VarunaConfig(global_batch_size=8, micro_batch_size=1, schedule="interleaved")
    adopt_plan(cfg, RunPlan(schedule="interleaved", chunks=3))
    assert cfg.pipeline.chunks == 3
    cfg.validate()
    mine = VarunaConfig(global_batch_size=8, micro_batch_size=1, schedule="interleaved",
                        pipeline=PipelineConfig(chunks=2))
    with pytest.raises(ValueError, match=r"plan has chunks=3 \(VARUNA_CHUNKS\) but the script sets 2"):
        adopt_plan(mine, RunPlan(schedule="interleaved", chunks=3))


# ---------------------------------------------------------------------------------------------
# End to end: examples/gpt2 through varuna-launch


def _train(tmp_path: Path, name: str, launch: list[str], schedule: str) -> list[tuple]:
    metrics = tmp_path / f"{name}.jsonl"
    args = ["--schedule", schedule, "--deterministic", "--steps", "3", "--global-batch-size", "8",
            "--micro-batch-size", "2", "--n-layer", "4", "--n-embd", "32", "--n-head", "2",
            "--block-size", "16", "--eval-every", "3", "--metrics-out", str(metrics)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "varuna.launch", "--quiet", *launch,
         str(ROOT / "examples" / "gpt2" / "train.py"), *args],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    if "--chunks" in launch:  # the engine really ran P·chunks virtual stages
        assert "stages=[(0, 0), (1, 1), (2, 2), (3, 4)]" in output, output
    return [(r["step"], r["loss"], r.get("val_loss")) for r in rows]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt2_through_the_launcher_with_two_chunks_equals_one_chunk(tmp_path: Path) -> None:
    """Deterministic mode makes every layout train alike (docs/determinism.md), so the P=2,
    chunks=2 run's losses (and the last step's validation loss) equal the P=2 one-chunk run's
    bit for bit."""
    depth = ["--procs", "2", "--pipeline-depth", "2"]
    two = _train(tmp_path, "two", [*depth, "--schedule", "varuna-interleaved", "--chunks", "2"],
                 "varuna-interleaved")
    one = _train(tmp_path, "one", depth, "varuna")
    assert [s for s, _, _ in two] == [1, 2, 3]
    assert two == one
