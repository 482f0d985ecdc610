"""The calibration file: schema round-trip, fix-it errors, queries against hand-computed values, and
the optional sections (runtime overheads, which the simulator applies; the profiler's diagnostics)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from simulator.engine import SimConfig, runtime_overheads, simulate
from varuna.core.calibration import (
    CALIBRATION_VERSION,
    AllReduceModel,
    AllReducePoint,
    Calibration,
    LinkModel,
    LinkPoint,
    RuntimeOverheads,
)
from varuna.core.calibration_fit import fit_allreduce_model, fit_link_model
from varuna.core.memory import WORKSPACE_FACTOR


def _cal(**kw) -> Calibration:
    args = dict(
        micro_batch_sizes=(1, 2, 4),
        overhead_s=0.001,
        param_bytes=1000,
        act_bytes_per_example=100,
        intra=LinkModel(latency_s=1e-5, bandwidth_bytes_per_s=1e10, jitter_s=1e-6),
        inter=LinkModel(latency_s=1e-4, bandwidth_bytes_per_s=1e9, jitter_s=1e-5),
        allreduce=AllReduceModel(bandwidth_bytes_per_s=2e9, latency_s=2e-4, contention=0.5),
        optimizer_s_per_param_byte=1e-9,
    )
    args.update(kw)
    return Calibration.synthetic([0.01, 0.02, 0.03], **args)


def test_round_trip_through_a_file(tmp_path):
    cal = _cal()
    path = tmp_path / "cal.json"
    cal.save(path)
    back = Calibration.load(path)
    assert back.to_dict() == cal.to_dict()
    assert back == cal  # dataclass equality ignores the source path
    assert back.source == str(path)
    data = json.loads(path.read_text())
    assert data["version"] == CALIBRATION_VERSION == 2
    assert set(data) >= {
        "version",
        "created",
        "model",
        "host",
        "micro_batch_sizes",
        "segments",
        "cutpoints",
        "links",
        "allreduce",
        "optimizer",
    }
    assert data["model"]["num_segments"] == 3 and len(data["cutpoints"]) == 2


def _one_line_value_error(data, match: str) -> str:
    with pytest.raises(ValueError) as info:
        Calibration.from_dict(data, source="calibration.json")
    text = str(info.value)
    assert "\n" not in text
    assert match in text, text
    return text


def test_wrong_version_names_version_and_fix():
    data = _cal().to_dict()
    data["version"] = 3
    text = _one_line_value_error(data, "unsupported calibration version 3")
    assert "reads versions 1, 2" in text and "re-run varuna-profile" in text
    assert text.startswith("calibration.json:")


def test_missing_field_names_the_path_and_fix():
    data = _cal().to_dict()
    del data["segments"][2]["fwd_s"]
    _one_line_value_error(data, "missing field 'segments[2].fwd_s' — re-run varuna-profile")
    data = _cal().to_dict()
    del data["links"]["inter"]["bandwidth_bytes_per_s"]
    _one_line_value_error(data, "missing field 'links.inter.bandwidth_bytes_per_s'")
    data = _cal().to_dict()
    del data["version"]
    _one_line_value_error(data, "missing field 'version'")


def test_malformed_fields_are_rejected_with_their_path():
    data = _cal().to_dict()
    data["segments"][1]["bwd_s"] = data["segments"][1]["bwd_s"][:2]
    _one_line_value_error(data, "field 'segments[1].bwd_s' has 2 entries but micro_batch_sizes has 3")
    data = _cal().to_dict()
    data["cutpoints"][0]["act_bytes"][1] = "many"
    _one_line_value_error(data, "field 'cutpoints[0].act_bytes[1]' must be an integer")
    data = _cal().to_dict()
    data["micro_batch_sizes"] = [2, 1, 4]
    _one_line_value_error(data, "strictly increasing")


def test_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read calibration file"):
        Calibration.load(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Calibration.load(bad)


def test_queries_interpolate_and_extrapolate_linearly_in_m():
    cal = _cal()  # F_i(m) = 0.001 + f_i·m at m = 1, 2, 4
    assert cal.fwd_s(1, 2) == pytest.approx(0.001 + 0.02 * 2)
    assert cal.fwd_s(1, 3) == pytest.approx(0.001 + 0.02 * 3)  # between 2 and 4
    assert cal.fwd_s(2, 8) == pytest.approx(0.001 + 0.03 * 8)  # beyond 4, from the points 2 and 4
    assert cal.bwd_s(0, 3) == pytest.approx(2 * (0.001 + 0.01 * 3))
    assert cal.recompute_s(0, 4) == pytest.approx(0.001 + 0.01 * 4)
    assert cal.act_bytes(1, 3) == 300


def test_single_measured_size_cannot_be_stretched():
    cal = Calibration.synthetic(0.01, num_segments=2, micro_batch_sizes=(4,))
    assert cal.fwd_s(0, 4) == pytest.approx(0.04)
    with pytest.raises(ValueError) as info:
        cal.fwd_s(0, 8)
    assert str(info.value) == (
        "calibration lacks micro-batch size m=8 (has 4); re-run varuna-profile --update --micro-batch-sizes 8"
    )


def test_link_allreduce_and_optimizer_models_follow_their_formulas():
    cal = _cal()
    assert cal.p2p_s(10**6, intra=True) == pytest.approx(1e-5 + 1e6 / 1e10)
    assert cal.p2p_s(10**6, intra=False) == pytest.approx(1e-4 + 1e6 / 1e9)
    nbytes, D, k = 10**8, 8, 3
    expect = 2 * (D - 1) / D * nbytes / 2e9 * (1 + 0.5 * (k - 1)) + (D - 1) * 2e-4
    assert cal.allreduce_s(nbytes, D, k) == pytest.approx(expect)
    assert cal.allreduce_s(nbytes, 1, 1) == 0.0
    assert cal.optimizer_s(5e9) == pytest.approx(5.0)


def test_stage_memory_parts():
    cal = _cal()  # param 1000, grad 1000, optimizer 2000 per segment; inputs 100·m, activations 400·m
    static = 2 * (1000 + 1000 + 2000)
    # one micro-batch's activations again: the backward's transients (Note [Backward workspace])
    workspace = WORKSPACE_FACTOR * (800 + 800)
    # segments 1 and 2 at m=2, 5 in flight: with recompute, inputs of all + one full set of activations
    assert cal.stage_memory_bytes([1, 2], 2, 5) == static + 5 * 200 + (800 + 800) + workspace
    # without recompute every in-flight micro-batch keeps its activations
    assert cal.stage_memory_bytes([1, 2], 2, 5, recompute=False) == static + 5 * (200 + 1600) + workspace


def test_fits_recover_known_models_and_report_error():
    link = LinkModel(latency_s=5e-5, bandwidth_bytes_per_s=2e9)
    pts = [LinkPoint(bytes=b, mean_s=link.time_s(b), jitter_s=1e-5) for b in (10**3, 10**5, 10**7)]
    fit = fit_link_model(pts)
    assert fit.latency_s == pytest.approx(5e-5, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert fit.jitter_s == pytest.approx(1e-5)

    true = AllReduceModel(bandwidth_bytes_per_s=1e9, latency_s=1e-4, contention=0.7)
    pts = [
        AllReducePoint(segment=0, ring_size=d, concurrent=k, bytes=b, time_s=true.time_s(b, d, k))
        for d in (2, 4, 8)
        for k in (1, 2, 4)
        for b in (10**5, 10**8)
    ]
    fit = fit_allreduce_model(pts)
    assert (fit.bandwidth_bytes_per_s, fit.latency_s, fit.contention) == pytest.approx(
        (1e9, 1e-4, 0.7), rel=1e-6
    )
    assert fit.fit_max_rel_error < 1e-9
    # 10% noise on one point shows up in the reported error
    noisy = list(pts)
    p = noisy[5]
    noisy[5] = AllReducePoint(
        segment=p.segment,
        ring_size=p.ring_size,
        concurrent=p.concurrent,
        bytes=p.bytes,
        time_s=p.time_s * 1.1,
    )
    fit = fit_allreduce_model(noisy)
    assert 0.01 < fit.fit_max_rel_error < 0.2 and fit.fit_rms_rel_error > 0
    # no point with k > 1: contention cannot be fitted, the conservative 1 is kept
    single = [q for q in pts if q.concurrent == 1]
    assert fit_allreduce_model(single).contention == 1.0
    assert math.isfinite(fit_allreduce_model(single).bandwidth_bytes_per_s)


def test_pure_python_modules_do_not_import_torch():
    code = (
        "import sys, simulator.engine, simulator.autoconfig, simulator.cli, varuna.core.calibration, "
        "varuna.core.timeline; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# Optional sections: runtime_overheads and profiler

_OVERHEADS = RuntimeOverheads(
    task_overhead_s=5e-4, placeholder_s=4e-5, step_overhead_s=2e-3, source="validate_simulator W=2"
)
_DIAGNOSTICS = {
    "compute_fit": [{"fwd_s": {"intercept_s": 0.001, "per_example_s": 0.01, "max_rel_error": 0.02}}],
    "link_fit": {"intra": {"rms_rel_error": 0.01, "max_rel_error": 0.03}},
    "allreduce_configs": [[2, 1], [2, 2]],
    "history": [{"at": "2026-01-01T00:00:00Z", "micro_batch_sizes": [1, 2, 4]}],
}


def test_sections_round_trip_through_a_file(tmp_path):
    cal = _cal(runtime_overheads=_OVERHEADS)
    cal.profiler = json.loads(json.dumps(_DIAGNOSTICS))
    path = tmp_path / "cal.json"
    cal.save(path)
    data = json.loads(path.read_text())
    assert data["runtime_overheads"] == {
        "task_overhead_s": 5e-4,
        "placeholder_s": 4e-5,
        "step_overhead_s": 2e-3,
        "source": "validate_simulator W=2",
    }
    assert data["profiler"] == _DIAGNOSTICS
    back = Calibration.load(path)
    assert back == cal and back.runtime_overheads == _OVERHEADS and back.profiler == _DIAGNOSTICS
    assert back.to_dict() == cal.to_dict() == data
    # load -> save -> load keeps both sections as they were
    back.save(path)
    assert json.loads(path.read_text()) == data


def test_a_file_without_the_sections_loads_and_resaves_as_before():
    data = _cal().to_dict()
    assert "runtime_overheads" not in data and "profiler" not in data
    cal = Calibration.from_dict(data)
    assert cal.runtime_overheads is None and cal.profiler is None
    assert cal.to_dict() == data
    # null means absent; unknown top-level keys are still ignored
    cal = Calibration.from_dict({**data, "runtime_overheads": None, "profiler": None, "future": 1})
    assert cal.runtime_overheads is None and cal.profiler is None and cal.to_dict() == data


def test_a_profiler_written_version_1_file_keeps_its_diagnostics():
    # What varuna-profile has always written: the schema plus a "profiler" object (tuples come back
    # as lists from JSON). It used to be dropped on re-save; now it is kept.
    data = {**_cal().to_dict(), "profiler": json.loads(json.dumps(_DIAGNOSTICS)), "version": 1}
    cal = Calibration.from_dict(data)
    assert cal.profiler == _DIAGNOSTICS and cal.runtime_overheads is None
    assert cal.to_dict() == data
    # Neither the input nor the output aliases the calibration's copy.
    data["profiler"]["history"].append({"at": "later"})
    out = cal.to_dict()
    out["profiler"]["allreduce_configs"].clear()
    assert cal.profiler == _DIAGNOSTICS


def test_in_memory_profiler_diagnostics_are_written_as_json():
    cal = _cal()
    cal.profiler = {"allreduce_configs": [(2, 1)]}  # as a tuple, before JSON
    assert cal.to_dict()["profiler"] == {"allreduce_configs": [[2, 1]]}
    cal.profiler = {"bad": object()}
    with pytest.raises(ValueError, match="calibration field 'profiler' must hold JSON values only"):
        cal.to_dict()


@pytest.mark.parametrize(
    "patch, message",
    [
        (
            {"task_overhead_s": -0.001},
            "field 'runtime_overheads.task_overhead_s' must be >= 0, got -0.001",
        ),
        ({"placeholder_s": "fast"}, "field 'runtime_overheads.placeholder_s' must be a finite number"),
        (
            {"step_overhead_s": float("inf")},
            "field 'runtime_overheads.step_overhead_s' must be a finite number",
        ),
        ({"step_overhead_s": True}, "field 'runtime_overheads.step_overhead_s' must be a finite number"),
        ({"step_overhead_s": None}, "missing field 'runtime_overheads.step_overhead_s'"),
        ({"source": 3}, "field 'runtime_overheads.source' must be a string"),
    ],
)
def test_bad_runtime_overheads_are_rejected_with_field_and_fix(patch, message):
    data = _cal(runtime_overheads=_OVERHEADS).to_dict()
    data["runtime_overheads"].update(patch)
    text = _one_line_value_error(data, message)
    assert text.startswith("calibration.json: ")
    assert "measure it again" in text and "remove the 'runtime_overheads' section" in text


def test_malformed_sections_are_rejected():
    data = _cal().to_dict()
    data["runtime_overheads"] = [0.001, 0.0, 0.002]
    _one_line_value_error(data, "field 'runtime_overheads' must be an object")
    data = _cal().to_dict()
    data["profiler"] = "fit errors"
    _one_line_value_error(data, "field 'profiler' must be an object")
    with pytest.raises(ValueError, match="runtime_overheads.placeholder_s must be a finite number >= 0"):
        RuntimeOverheads(placeholder_s=-1e-6)
    # The source note is optional in a file.
    data = _cal(runtime_overheads=_OVERHEADS).to_dict()
    del data["runtime_overheads"]["source"]
    assert Calibration.from_dict(data).runtime_overheads.source == ""


# The simulator applies the calibration's runtime overheads unless SimConfig sets its own.

_P, _NM, _F, _B = 4, 8, 0.01, 0.02  # one segment per stage at m = 1: F = 0.01, B = 2F


def _gpipe(**overrides) -> SimConfig:
    return SimConfig(
        num_stages=_P,
        micro_batch_size=1,
        num_microbatches=_NM,
        schedule="gpipe",
        recompute=False,
        **overrides,
    )


def _uniform(overheads: RuntimeOverheads | None) -> Calibration:
    return Calibration.synthetic(_F, num_segments=_P, micro_batch_sizes=(1, 2), runtime_overheads=overheads)


def test_simulate_adds_the_calibrations_overheads_in_closed_form():
    # gpipe without recompute, free links, D = 1: (Nm + P - 1)·(F + B); a task overhead t lengthens
    # every F and B, a step overhead s is added once.
    t, s = 0.003, 0.007
    assert simulate(_uniform(None), _gpipe()).minibatch_s == pytest.approx((_NM + _P - 1) * (_F + _B))
    cal = _uniform(RuntimeOverheads(task_overhead_s=t, step_overhead_s=s))
    got = simulate(cal, _gpipe()).minibatch_s
    assert got == pytest.approx((_NM + _P - 1) * (_F + _B + 2 * t) + s)
    # the same as giving the values to SimConfig with a calibration that has none
    assert got == simulate(_uniform(None), _gpipe(task_overhead_s=t, step_overhead_s=s)).minibatch_s


def test_calibration_overheads_equal_explicit_ones_on_a_general_config(tmp_path):
    # varuna schedule, D = 2 on 2-slot hosts, real links: placeholders included.
    cal0 = _cal()
    path = tmp_path / "cal.json"
    _cal(runtime_overheads=_OVERHEADS).save(path)
    cal = Calibration.load(path)
    cfg = SimConfig.for_global_batch(
        global_batch_size=20, num_stages=3, num_replicas=2, micro_batch_size=2, host_slots=2
    )
    from_file = simulate(cal, cfg)
    explicit = simulate(
        cal0,
        SimConfig.for_global_batch(
            global_batch_size=20,
            num_stages=3,
            num_replicas=2,
            micro_batch_size=2,
            host_slots=2,
            task_overhead_s=5e-4,
            placeholder_s=4e-5,
            step_overhead_s=2e-3,
        ),
    )
    assert from_file.summary() == explicit.summary() and from_file.executed == explicit.executed
    assert from_file.minibatch_s > simulate(cal0, cfg).minibatch_s + 2e-3
    assert cfg.label() == "3x2 m=2 varuna"  # None fields do not reach the label


def test_explicit_simconfig_values_override_the_calibrations():
    cal = _uniform(RuntimeOverheads(task_overhead_s=0.003, placeholder_s=0.001, step_overhead_s=0.007))
    zero = _gpipe(task_overhead_s=0.0, placeholder_s=0.0, step_overhead_s=0.0)
    assert simulate(cal, zero).minibatch_s == pytest.approx((_NM + _P - 1) * (_F + _B))
    # field by field: an explicit value wins, the others come from the file
    assert runtime_overheads(cal, _gpipe(task_overhead_s=0.001)) == (0.001, 0.001, 0.007)
    assert runtime_overheads(cal, _gpipe(step_overhead_s=0.0)) == (0.003, 0.001, 0.0)
    assert runtime_overheads(_uniform(None), _gpipe()) == (0.0, 0.0, 0.0)
    mixed = _gpipe(task_overhead_s=0.001, placeholder_s=0.0)
    assert simulate(cal, mixed).minibatch_s == pytest.approx((_NM + _P - 1) * (_F + _B + 2 * 0.001) + 0.007)
    with pytest.raises(ValueError, match="task_overhead_s must be >= 0"):
        simulate(cal, _gpipe(task_overhead_s=-1.0))
