"""scripts/validate_simulator.py and profiler/overheads.py: the configuration design, the
measurement analysis (the runtime-overhead fit), the
simulator's runtime-overhead terms (fast), and a 2-configuration end-to-end run (slow, < 90 s)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from profiler.overheads import fit_task_costs, task_overheads, waiting_hops
from simulator.engine import SimConfig, simulate
from varuna.core.calibration import Calibration, RuntimeOverheads

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "validate_simulator.py"


def _load(script: Path = SCRIPT):
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def test_default_configs_cover_every_factor_pair_within_budget():
    v = _load()
    configs = v.default_configs()
    assert len(configs) <= 25
    assert len({c.label for c in configs}) == len(configs)
    factors = {
        "layout": lambda c: (c.num_stages, c.num_replicas),
        "schedule": lambda c: c.schedule,
        "nm": lambda c: c.num_microbatches,
        "level": lambda c: c.level,
    }
    levels = {"layout": set(v.LAYOUTS), "schedule": set(v.SCHEDULES), "nm": set(v.NUM_MICROBATCHES),
              "level": set(v.LEVEL_NAMES)}
    for (a, fa), (b, fb) in itertools.combinations(factors.items(), 2):
        seen = {(fa(c), fb(c)) for c in configs}
        assert seen == set(itertools.product(levels[a], levels[b])), (a, b)
    # ~10 minutes at most: compute alone, 6 steps per configuration.
    assert sum(c.ideal_s() for c in configs) * 6 < 300


def test_new_kind_configs_cover_the_issue18_kinds_and_simulate():
    v = _load()
    k = _load(ROOT / "scripts" / "validate_kinds.py")
    configs = k.new_kind_configs()
    assert len({c.label for c in configs}) == len(configs)
    for kind in k.NEW_KINDS:
        mine = [c for c in configs if c.schedule == kind]
        assert {c.num_stages for c in mine} == {2, 4}, kind
        assert {c.num_replicas for c in mine} == {1, 2}, kind
        assert {"none", "moderate"} <= {c.level for c in mine} <= {"none", "moderate", "heavy"}, kind
    assert not set(v.default_configs()) & set(configs)
    f = v.BLOCKS_PER_STAGE * v.BLOCK_FWD_S
    for c in configs:
        cfg = v.sim_config(c, v.known_costs_only())
        v_ = k.CHUNKS if "interleaved" in c.schedule else 1
        assert (c.chunks, cfg.chunks) == (v_, v_) and len(cfg.stage_segments) == c.num_stages * v_
        assert cfg.weight_grad_fraction == v.WEIGHT_FRAC
        # Known costs only: no faster than a stage's F + B per micro-batch and chunk, no slower
        # than F + R + B each plus a (P−1)(F + B) bubble.
        t = v.simulate_config(c, v.known_costs_only(), seeds=2)
        work = c.num_microbatches * v_ * f
        assert 3 * work <= t <= 4 * work + (c.num_stages - 1) * 3 * f + 0.02 * c.num_stages, c.label
    assert [c.label for c in configs if c.chunks > 1][0] == "2x1 interleaved(v=2) Nm=4 none"


def test_simulated_split_backward_matches_the_runtimes_first_stage():
    # The runtime's first stage has no input gradient (its input is data), so its B is empty and
    # its W the whole backward (measured in the validation runs: B 0.1 ms, W 41 ms of 40 ms);
    # other stages split B = 40 ms by weight_grad_fraction.
    cal = Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1,))
    cfg = SimConfig(num_stages=2, micro_batch_size=1, num_microbatches=4, schedule="zb-h1", recompute=False,
                    weight_grad_fraction=0.25, task_overhead_s=0.0, placeholder_s=0.0, jitter_scale=0)
    events = simulate(cal, cfg, record=True).timeline.events
    durations = {(e.stage, e.op): e.duration_s for e in events if e.op in ("B", "W")}
    assert durations == pytest.approx({(0, "B"): 0.0, (0, "W"): 0.04, (1, "B"): 0.03, (1, "W"): 0.01})


def test_fit_task_costs_recovers_terms_and_drops_negative_ones():
    per_op = {"F": 0.6e-3, "R": 0.3e-3, "B": 0.5e-3}  # F and B send a message, R does not
    cells = {(b, k, op): [per_op[op] + 0.5e-3 * b + (0.05e-3 * b * k if op != "B" else 0.0)]
             for b in (1, 3) for k in range(8) for op in "FRB"}
    t, s, p, rms = fit_task_costs(cells)
    assert t == pytest.approx(per_op, abs=1e-9)
    assert (s, p) == pytest.approx((0.5e-3, 0.05e-3), abs=1e-9)
    assert rms < 1e-9
    # Costs that fall with the stage index would need p < 0: the term is dropped, not negative.
    cells = {(b, k, op): [1e-3 * b - (1e-5 * k if op != "B" else 0.0)]
             for b in (1, 3) for k in range(4) for op in "FRB"}
    assert fit_task_costs(cells)[2] == 0.0


def test_runtime_constants_become_the_calibrations_runtime_overheads():
    from profiler.overheads import RuntimeConstants

    rc = RuntimeConstants(handoff_s=1e-4, handoff_netem_s=1e-4, probe_handoff_s=1e-4, task_overhead_s=5e-4,
                          segment_overhead_s=1e-4, placeholder_s=4e-5, step_overhead_s=2e-3, allreduce_s=1e-3)
    ro = rc.to_runtime_overheads(source="W=2")
    assert ro == RuntimeOverheads(task_overhead_s=5e-4, placeholder_s=4e-5, step_overhead_s=2e-3,
                                  source="W=2")


def test_measurement_analysis_on_a_hand_made_step():
    v = _load()
    f = v.BLOCKS_PER_STAGE * v.BLOCK_FWD_S
    # (stage, replica, op, microbatch, start, end): stage 1 idle until F0 arrives 1 ms after it
    # is produced; stage 0 idle until B0's gradient arrives 2 ms after it is produced.
    events = [(0, 0, "F", 0, 0.0, f + 0.001), (1, 0, "F", 0, f + 0.002, 2 * f + 0.003),
              (1, 0, "B", 0, 2 * f + 0.003, 4 * f + 0.004), (0, 0, "B", 0, 4 * f + 0.006, 6 * f + 0.006)]
    assert sorted(waiting_hops(events)) == pytest.approx([0.001, 0.002])
    over = task_overheads(events)
    assert over["F"] == pytest.approx([0.001, 0.001]) and over["B"] == pytest.approx([0.001, 0.0])
    ranks = [{"runs": {"x": {"steps": [{"t0": 0.0, "t1": 1.0}]}}},
             {"runs": {"x": {"steps": [{"t0": -0.5, "t1": 1.2}]}}}]
    # The step starts when stage 0 (rank 0) starts, not at rank 1's earlier barrier exit.
    assert v.step_times(ranks, "x", num_stages=2) == pytest.approx([1.2])


def test_simulator_runtime_overhead_terms():
    cal = Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1, 2))
    P, nm, f, b = 2, 4, 0.02, 0.04
    base = SimConfig(num_stages=P, micro_batch_size=1, num_microbatches=nm, schedule="gpipe", recompute=False)
    assert simulate(cal, base).minibatch_s == pytest.approx((nm + P - 1) * (f + b))
    # A per-task overhead lengthens every F and B; a per-step overhead is added once.
    o, step = 0.001, 0.005
    cfg = SimConfig(num_stages=P, micro_batch_size=1, num_microbatches=nm, schedule="gpipe", recompute=False,
                    task_overhead_s=o, step_overhead_s=step)
    assert simulate(cal, cfg).minibatch_s == pytest.approx((nm + P - 1) * (f + b + 2 * o) + step)
    # Placeholders: the F of stage 1 (segments 2-3) passes segments 0-1 first; stage 0 pays nothing.
    ph = 0.002
    cfg = SimConfig(num_stages=P, micro_batch_size=1, num_microbatches=nm, schedule="gpipe", recompute=False,
                    placeholder_s=ph)
    res = simulate(cal, cfg, record=True)
    durations = {(e.stage, e.op): e.duration_s for e in res.timeline.events if e.op in ("F", "B")}
    assert durations[(0, "F")] == pytest.approx(f)
    assert durations[(1, "F")] == pytest.approx(f + 2 * ph)
    assert durations[(1, "B")] == pytest.approx(b)
    with pytest.raises(ValueError, match="must be >= 0"):
        simulate(cal, SimConfig(num_stages=P, micro_batch_size=1, num_microbatches=nm, task_overhead_s=-1.0))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_validation_runs_end_to_end_quick(tmp_path):
    out = tmp_path / "validation.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--json", str(out), "--gantt-dir", str(tmp_path),
           "--timeout", "100"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "median |error|" in proc.stdout
    data = json.loads(out.read_text())
    assert [r["label"] for r in data["rows"]] == ["2x1 varuna Nm=3 none", "2x1 gpipe Nm=4 moderate"]
    for r in data["rows"]:
        # Compute alone takes 0.24 s (varuna, Nm=3) and 0.38 s (gpipe, Nm=4); the runtime adds a little.
        assert 0.2 < r["real_s"] < 0.6 and 0.2 < r["sim_s"] < 0.6
        # A loose bound: the 5% goal is checked by the full run on a quiet host (docs/simulator.md).
        assert abs(r["error"]) < 0.10, r
        assert len(r["real_steps_s"]) == 3
    rc = data["constants"]["2"]
    assert 0 < rc["handoff_s"] < 0.02 and rc["step_overhead_s"] >= 0
    for name in ("real", "sim"):
        png = tmp_path / f"sim_vs_real_{name}.png"
        assert png.exists() and png.stat().st_size < 200_000
