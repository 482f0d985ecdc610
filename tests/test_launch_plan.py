"""The launcher's side of the run contract (varuna.launch.layout, varuna.launch.launcher): auto-config
plans for the ``--schedule`` given, and every worker gets the plan as a ``varuna.core.env.RunPlan``
(``VARUNA_GLOBAL_BATCH_SIZE``, ``VARUNA_SCHEDULE``, ``VARUNA_MICRO_BATCH_SIZE``,
``VARUNA_STAGE_RANGES``); a script whose global batch differs from the plan's is refused at start,
one that leaves the schedule (and the batch) unset runs the plan's.
Also: the ``PYTHONPATH`` agents and remote workers get names the directory holding ``varuna``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from varuna.core.env import RunPlan
from varuna.core.schedule import PLANNED_KINDS
from varuna.launch.launcher import main
from varuna.launch.layout import Layout
from varuna.launch.spec import LaunchConfig

ROOT = Path(__file__).resolve().parent.parent

needs_simulator = pytest.mark.skipif(
    importlib.util.find_spec("simulator.autoconfig") is None, reason="no simulator.autoconfig"
)


def _calibration(tmp_path: Path, num_segments: int = 4) -> str:
    from varuna.core.calibration import Calibration

    path = tmp_path / "cal.json"
    Calibration.synthetic(0.01, num_segments=num_segments, micro_batch_sizes=(1, 2, 4)).save(path)
    return str(path)


def test_run_plan_of_a_layout() -> None:
    given = Layout(pipeline_depth=2, data_parallel=1)
    assert given.run_plan() == RunPlan()
    assert given.run_plan(global_batch_size=32, schedule="gpipe").to_env() == {
        "VARUNA_GLOBAL_BATCH_SIZE": "32",
        "VARUNA_SCHEDULE": "gpipe",
    }
    planned = Layout(
        pipeline_depth=2, data_parallel=1, micro_batch_size=4, stage_ranges=((0, 1), (2, 3)), schedule="1f1b"
    )
    assert planned.run_plan(global_batch_size=16) == RunPlan(
        global_batch_size=16, micro_batch_size=4, schedule="1f1b", stage_ranges=((0, 1), (2, 3))
    )


@needs_simulator
def test_launcher_passes_the_schedule_to_auto_config(
    tmp_path: Path, launched: list[LaunchConfig],
    autoconfig_calls: list[dict[str, Any]]
) -> None:
    seen = autoconfig_calls
    script = tmp_path / "train.py"
    script.write_text("")
    cal = _calibration(tmp_path)
    argv = ["--procs", "2", "--calibration", cal, "--global-batch-size", "16"]
    assert main([*argv, "--schedule", "1f1b", str(script)]) == 0
    assert main([*argv, str(script)]) == 0
    # Without --schedule auto-config weighs every kind that plans by default (Note [Joint plan]).
    assert [kwargs["schedule"] for kwargs in seen] == ["1f1b", None, *PLANNED_KINDS]
    # The plan reaches every worker, with auto-config's m and stage map (and kind).
    for config, schedules in zip(launched, (("1f1b",), PLANNED_KINDS)):
        plan = RunPlan.from_env(config.worker_env)
        assert plan.global_batch_size == 16 and plan.schedule in schedules
        assert plan.micro_batch_size in (1, 2, 4)
        assert plan.stage_ranges is not None and len(plan.stage_ranges) == config.pipeline_depth


def test_given_layout_exports_only_what_was_given(tmp_path: Path, launched: list[LaunchConfig]) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["--procs", "2", "--pipeline-depth", "2", str(script)]) == 0
    # Nothing planned: scripts keep choosing their own batch and schedule, as before.
    assert RunPlan.from_env(launched[-1].worker_env) == RunPlan()
    argv = ["--procs", "2", "--pipeline-depth", "2", "--global-batch-size", "8", "--schedule", "gpipe"]
    assert main([*argv, str(script)]) == 0
    assert RunPlan.from_env(launched[-1].worker_env) == RunPlan(global_batch_size=8, schedule="gpipe")


def test_unknown_schedule_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--procs", "1", "--pipeline-depth", "1", "--schedule", "pipedream", "t.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--schedule" in err[0] and "pipedream" in err[0], err


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_simulator
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_script_with_another_global_batch_is_refused(tmp_path: Path) -> None:
    """Auto-config plans for 32 examples per step; the script trains with 16: the engine refuses
    at start with one line naming both, and the launcher exits non-zero."""
    cal = _calibration(tmp_path, num_segments=3)  # --n-layer 2: 2 CutPoints, 3 segments
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "varuna.launch",
            "--procs",
            "1",
            "--calibration",
            cal,
            "--global-batch-size",
            "32",
            str(ROOT / "examples" / "gpt2" / "train.py"),
            "--global-batch-size",
            "16",
            "--n-layer",
            "2",
            "--n-embd",
            "32",
            "--n-head",
            "2",
            "--block-size",
            "16",
            "--steps",
            "1",
        ],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    both = [line for line in output.splitlines() if re.search(r"\b32\b", line) and re.search(r"\b16\b", line)]
    errors = [line for line in both if "batch" in line.lower()]
    assert len(errors) == 1, output
    assert "error" in errors[0].lower(), output
    assert "step 1" not in output, "the worker must stop before training"


def test_agents_get_the_directory_holding_the_varuna_package() -> None:
    from varuna.launch.job import default_pythonpath

    root = Path(default_pythonpath({"PYTHONPATH": "rel"})[0])
    assert (root / "varuna" / "__init__.py").is_file(), root
    assert default_pythonpath({"PYTHONPATH": "rel"})[1] == os.path.abspath("rel")


# A script with no --schedule (nor --global-batch-size) argument at all: it leaves the planned
# fields unset and takes the launcher's plan (Note [Run plan]); the batch comes from the plan too.
_PLAN_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import torch, varuna
from models import build_model, make_batch

config = varuna.VarunaConfig(micro_batch_size=2).with_plan(defaults={{"global_batch_size": 4}})
batch = make_batch("gpt", config.global_batch_size)
engine = varuna.Engine(build_model("gpt"), config, example_batch=batch,
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
result = engine.train_step(batch)
if engine.layout.rank == 0:
    print("RESULT " + json.dumps({{"schedule": engine.config.schedule, "M": engine.config.global_batch_size,
                                   "loss": result.loss}}), flush=True)
engine.close()
"""


def _launch_plan_script(tmp_path: Path, *launch: str) -> subprocess.CompletedProcess:
    script = tmp_path / "no_schedule_arg.py"
    script.write_text(_PLAN_SCRIPT.format(tests=str(ROOT / "tests")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "varuna.launch", "--procs", "2", "--pipeline-depth", "2", *launch,
         str(script)],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_script_without_a_schedule_argument_runs_the_launchers_schedule(tmp_path: Path) -> None:
    import json

    planned = _launch_plan_script(tmp_path, "--schedule", "1f1b", "--global-batch-size", "8")
    out = planned.stdout + planned.stderr
    assert planned.returncode == 0, out[-4000:]
    (line,) = [ln for ln in out.splitlines() if "RESULT " in ln]
    assert json.loads(line.split("RESULT ", 1)[1])["schedule"] == "1f1b"
    assert json.loads(line.split("RESULT ", 1)[1])["M"] == 8
    adopted = [ln for ln in out.splitlines() if "run plan adopted" in ln]
    # Said once, on rank 0, naming what came from the plan.
    assert len(adopted) == 1 and "[rank 0 " in adopted[0], out[-4000:]
    assert adopted[0].endswith("global_batch_size=8, schedule=1f1b"), adopted
    # Negative control: no plan, so the defaults (the script's M, the engine's schedule) and no line.
    bare = _launch_plan_script(tmp_path)
    out = bare.stdout + bare.stderr
    assert bare.returncode == 0, out[-4000:]
    (line,) = [ln for ln in out.splitlines() if "RESULT " in ln]
    assert json.loads(line.split("RESULT ", 1)[1]) | {"loss": 0} == {"schedule": "varuna", "M": 4, "loss": 0}
    assert "run plan adopted" not in out
