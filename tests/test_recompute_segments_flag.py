"""``--recompute-segments SET`` (issue #32, docs/memory.md "Selective recompute from the command
line"): one parser for the flag and ``VARUNA_RECOMPUTE_SEGMENTS``, one line for a bad set, the plan
adopted as a set (order-insensitive), auto-config planning with a given set, and one run through
varuna-launch whose losses equal the run without it bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from simulator.autoconfig import autoconfigure
from simulator.costs import stage_memory
from varuna.core.calibration import Calibration
from varuna.core.env import RunPlan
from varuna.core.planning import PlanRequest
from varuna.core.selective_recompute import parse_segment_set
from varuna.runtime.config import PipelineConfig, VarunaConfig, adopt_plan

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text,want", [("0,2-3", (0, 2, 3)), ("3", (3,)), (" 4 , 1-2,2 ", (1, 2, 4)),
                                       ("none", ()), ("NONE", ()), ("5-5", (5,))])
def test_the_set_parses_indices_and_ranges(text, want):
    assert parse_segment_set(text) == want


@pytest.mark.parametrize("text,words", [("", "not segment indices"), ("1,,2", "not segment indices"),
                                        ("a", "not segment indices"), ("-1", "not segment indices"),
                                        ("1-2-3", "not segment indices"), ("1.5", "not segment indices"),
                                        ("3-1", "runs backwards; write 1-3")])
def test_a_malformed_set_is_one_line_naming_the_flag_and_the_form(text, words):
    with pytest.raises(ValueError) as info:
        parse_segment_set(text)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("--recompute-segments") and words in msg, msg


def test_the_environment_variable_takes_the_same_sets():
    assert RunPlan.from_env({"VARUNA_RECOMPUTE_SEGMENTS": "0,2-3"}).recompute_segments == (0, 2, 3)
    assert RunPlan.from_env({"VARUNA_RECOMPUTE_SEGMENTS": "none"}).recompute_segments == ()
    assert RunPlan.from_env({}).recompute_segments is None
    plan = RunPlan(recompute_segments=(3, 1, 1))
    assert plan.recompute_segments == (1, 3)  # a set
    assert RunPlan.from_env(plan.to_env()) == plan
    assert RunPlan.from_env(RunPlan(recompute_segments=()).to_env()).recompute_segments == ()
    with pytest.raises(ValueError) as info:
        RunPlan.from_env({"VARUNA_RECOMPUTE_SEGMENTS": "1-x"})
    assert "\n" not in str(info.value) and "VARUNA_RECOMPUTE_SEGMENTS='1-x'" in str(info.value), info.value


def test_the_plan_is_adopted_as_a_set():
    """The script's set in another order agrees with the plan's; another set is refused in one line."""
    def config(segments):
        return VarunaConfig(global_batch_size=8, micro_batch_size=2,
                            pipeline=PipelineConfig(recompute_segments=segments))

    plan = RunPlan(recompute_segments=(1, 3))
    same = config((3, 1))
    adopt_plan(same, plan)
    assert same.pipeline.recompute_segments == (3, 1)
    unset = config(None)
    assert "recompute_segments=1,3" in adopt_plan(unset, plan)
    assert unset.pipeline.recompute_segments == (1, 3)
    with pytest.raises(ValueError, match=r"VARUNA_RECOMPUTE_SEGMENTS") as info:
        adopt_plan(config((1,)), plan)
    assert "\n" not in str(info.value)


def test_plan_request_checks_the_set_in_one_line():
    req = PlanRequest(calibration=None, global_batch_size=8, recompute_segments=(2, 0))
    assert req.recompute_segments == (0, 2)
    with pytest.raises(ValueError, match=r"^--recompute-segments must be segment indices >= 0"):
        PlanRequest(calibration=None, global_batch_size=8, recompute_segments=(-1,))
    with pytest.raises(ValueError, match=r"^--recompute-segments is not supported with --schedule zb-h1"):
        PlanRequest(calibration=None, global_batch_size=8, schedule="zb-h1", recompute_segments=(0,))


def _cal() -> Calibration:
    return Calibration.synthetic(0.01, num_segments=6, micro_batch_sizes=(1, 2), param_bytes=1 << 20,
                                 act_bytes_per_example=1 << 16, activation_bytes_per_example=4 << 20)


def test_auto_config_plans_with_the_given_set_and_counts_its_memory():
    cal = _cal()
    kw = dict(gpus=2, global_batch_size=8, micro_batch_size=2, pipeline_depth=2, schedule="varuna",
              shard_optimizer=False)
    whole = autoconfigure(cal, **kw).best
    given = autoconfigure(cal, recompute_segments=(4, 0), **kw).best
    assert whole.config.recompute_segments is None and given.config.recompute_segments == (0, 4)
    assert given.stage_segments == whole.stage_segments
    # Its memory is the model's with that set (keeping segment 1's activations costs).
    (a, b), _ = given.stage_segments
    assert a == 0 < b
    own = stage_memory(cal, [(a, b)], 2, given.result.peak_stashed[0], True, recompute_segments=(0, 4))
    assert own > stage_memory(cal, [(a, b)], 2, given.result.peak_stashed[0], True)
    assert given.memory_bytes >= own
    # Under a cap that only recomputing meets, the given set (keep everything) is kept: nothing fits.
    with pytest.raises(ValueError, match="fits in memory"):
        autoconfigure(cal, recompute_segments=(), gpu_memory_bytes=whole.memory_bytes, **kw)
    with pytest.raises(ValueError, match=r"^--recompute-segments names segment 6 but the calibration's model "
                       r"has 6 segments \(0-5\)"):
        autoconfigure(cal, recompute_segments=(6,), **kw)


# ---------------------------------------------------------------------------------------------
# End to end: examples/gpt2 through varuna-launch


def _train(tmp_path: Path, name: str, *flags: str) -> tuple[list, str]:
    metrics = tmp_path / f"{name}.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "varuna.launch", "--quiet", "--procs", "2", "--pipeline-depth", "2", *flags,
         str(ROOT / "examples" / "gpt2" / "train.py"), "--deterministic", "--steps", "2",
         "--global-batch-size", "4", "--micro-batch-size", "1", "--n-layer", "4", "--n-embd", "32",
         "--n-head", "2", "--block-size", "16", "--eval-every", "0", "--metrics-out", str(metrics)],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()], output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_with_recompute_segments_trains_the_bits_of_whole_stage_recompute(tmp_path: Path):
    """varuna at P = 2 (stage 0 recomputes): recomputing segments 0, 2 and 3 only -- two kept
    blocks, a recomputed one, and a stage boundary through the set -- gives the losses of
    whole-stage recompute bit for bit (deterministic mode), and the workers did adopt the set."""
    selective, output = _train(tmp_path, "selective", "--recompute-segments", "0,2-3")
    assert "recompute_segments=0,2,3" in output, output
    whole, output = _train(tmp_path, "whole")
    assert "recompute_segments" not in output
    assert len(selective) == 2 and selective == whole
