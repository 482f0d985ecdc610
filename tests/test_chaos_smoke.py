"""scripts/chaos.py: its checks themselves (fast), and one small chaos run end to end (slow): a
reference job, one ``kill -9`` at a random moment and one during a checkpoint write, each
ending bit-identical to the reference with its newest complete checkpoint intact and no process
left behind (docs/reliability.md)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "chaos.py"


def _chaos():
    spec = importlib.util.spec_from_file_location("varuna_chaos_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bit_identical_compares_bytes_not_values():
    chaos = _chaos()
    a = {"w": torch.tensor([0.0, 1.0]), "opt:w:step": torch.tensor(3.0)}
    assert chaos.bit_identical(a, {k: v.clone() for k, v in a.items()}) == ""
    # -0.0 == 0.0 as values, but a resumed run that produced it is not bit-identical.
    assert "w differs" in chaos.bit_identical(a, {**a, "w": torch.tensor([-0.0, 1.0])})
    nan = {"w": torch.tensor([float("nan")])}
    assert chaos.bit_identical(nan, {"w": nan["w"].clone()}) == ""
    assert "names differ" in chaos.bit_identical(a, {"w": a["w"]})
    assert "float64" in chaos.bit_identical(a, {**a, "w": a["w"].double()})


def test_write_in_progress_sees_temporary_files_and_missing_manifests(tmp_path):
    chaos = _chaos()
    assert chaos.write_in_progress(tmp_path / "absent") == ""
    done = tmp_path / "step_00000002"
    done.mkdir()
    (done / "seg000-00.pt").write_bytes(b"x")
    (done / "manifest.json").write_text("{}")
    assert chaos.write_in_progress(tmp_path) == ""
    writing = tmp_path / "step_00000004"
    writing.mkdir()
    assert chaos.write_in_progress(tmp_path) == ""  # nothing written yet
    (writing / ".seg000-00.pt.tmp-123").write_bytes(b"")
    assert chaos.write_in_progress(tmp_path) == "step_00000004: temporary file"
    (writing / ".seg000-00.pt.tmp-123").rename(writing / "seg000-00.pt")
    assert "no manifest yet" in chaos.write_in_progress(tmp_path)


def test_trial_plans_are_seeded():
    chaos = _chaos()
    opts = chaos.Options(seed=3)
    assert [chaos.plan_trial(opts, i, False) for i in range(5)] == [
        chaos.plan_trial(opts, i, False) for i in range(5)
    ]
    assert {chaos.plan_trial(opts, i, True).target for i in range(5)} == {"worker"}
    targets = {chaos.plan_trial(opts, i, False).target for i in range(40)}
    assert targets == set(chaos.TARGETS)


@pytest.mark.slow
def test_one_kill_and_one_kill_during_a_checkpoint_write(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--trials", "1", "--ckpt-trials", "1", "--steps", "16",
         "--seed", "0", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    out = proc.stdout
    print(out, proc.stderr)
    assert proc.returncode == 0, out + proc.stderr
    rows = {
        line.split()[0]: line for line in out.splitlines() if line.startswith(("reference", "kill-", "ckpt-"))
    }
    assert set(rows) == {"reference", "kill-1", "ckpt-2"}
    for name in ("kill-1", "ckpt-2"):
        cells = rows[name].split()
        # ... ckpt intact, bit-identical, orphans, wall s
        assert cells[-4:-1] == ["yes", "yes", "0"], rows[name]
    assert "killed while writing: step_" in out
    assert "2/2 trials kept every property" in out
    assert not list(tmp_path.iterdir())  # the trial directories are removed


def test_a_trial_fails_on_any_broken_property():
    chaos = _chaos()
    assert chaos.TrialResult(name="t", intact=True, identical=True).ok
    assert not chaos.TrialResult(name="t", orphans=1).ok
    assert not chaos.TrialResult(name="t", intact=False).ok
    assert not chaos.TrialResult(name="t", identical=False).ok
    assert not chaos.TrialResult(name="t", error="timed out").ok


@pytest.mark.slow
def test_load_script_measures_a_small_fleet_and_its_wave():
    """scripts/load_manager.py at 30 VMs: it runs to the end by itself and reports the wave
    detected and the morph decided without a false loss (heartbeat latency goals are not
    asserted here: they depend on what else this machine runs)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "load_manager.py"), "--vms", "30", "--steady", "4",
         "--heartbeat-interval", "0.5", "--heartbeat-timeout", "3", "--step-s", "0.5", "--max-s", "120"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    out = proc.stdout
    print(out, proc.stderr)
    rows = {line[:38].strip(): line[38:] for line in out.splitlines()}
    assert rows["false losses (healthy VMs gone)"].split()[0] == "0", out
    wave = rows["wave detected (first / last VM gone)"]
    assert "3/3 VMs" in wave and "MISSED" not in wave, out
    assert "MISSED" not in rows["morph decided (next launch)"], out
    assert "P=1 × D=30 → P=1 × D=27" in rows["new generation"], out
    for name in ("VMHeartbeat p50 / p99, steady", "WorkerHeartbeat p50 / p99, steady"):
        assert rows[name].split()[0] != "nan", out
