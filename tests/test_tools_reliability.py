"""Issue 17, tools: the calibration's fits on a busy machine (noisy, non-monotone points; the fallback
for hopeless data), and one-line refusals of bad tool input (simulator values, non-UTF-8 files,
calibration of another model, varuna-trace on a model the engine would reject)."""

from __future__ import annotations

import random
import warnings

import pytest

from profiler.assembly import CalibrationState, assemble
from varuna.core.calibration import (
    AllReduceModel,
    AllReducePoint,
    ComputeStat,
    HostInfo,
    LinkModel,
    LinkPoint,
)
from varuna.core.calibration_fit import FitFallbackWarning, fit_allreduce_model, fit_link_model

# ---------------------------------------------------------------------------------------------
# Robust fits (Note [Robust fits] in varuna/core/calibration_fit.py)


def _busy_link_points(true: LinkModel, sizes, *, seed: int, reps: int = 7) -> list[LinkPoint]:
    """Points as a busy 2-core machine gives them: each size measured ``reps`` times (act and grad
    messages, repeated runs) with 5% noise, and one in five repeats hit by a descheduling of up to
    three times the latency."""
    rng = random.Random(seed)
    pts = []
    for b in sizes:
        for _ in range(reps):
            t = true.time_s(b) * (1 + rng.gauss(0, 0.05))
            if rng.random() < 0.2:
                t += rng.uniform(0, 3 * true.latency_s)
            pts.append(LinkPoint(bytes=b, mean_s=t, jitter_s=1e-5))
    return pts


@pytest.mark.parametrize("seed", range(5))
def test_link_fit_recovers_the_truth_from_noisy_non_monotone_points(seed):
    true = LinkModel(latency_s=1e-3, bandwidth_bytes_per_s=1e9)
    sizes = [1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24]
    pts = _busy_link_points(true, sizes, seed=seed)
    # The noise makes the data non-monotone (a larger message measured faster than a smaller one),
    # which is what made the old least-squares fit give up on a busy machine.
    by_size = {}
    for p in pts:
        by_size.setdefault(p.bytes, []).append(p.mean_s)
    assert any(min(by_size[b2]) < max(by_size[b1]) for b1, b2 in zip(sizes, sizes[1:]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FitFallbackWarning)  # a real fit, not the fallback
        fit = fit_link_model(pts)
    assert fit.latency_s == pytest.approx(1e-3, rel=0.25)
    assert fit.bandwidth_bytes_per_s == pytest.approx(1e9, rel=0.15)


def test_link_fit_ignores_one_wild_size():
    """One size measured while the machine stalled (10x its time) does not bend the fit (least
    squares moved the bandwidth by 4%)."""
    true = LinkModel(latency_s=2e-4, bandwidth_bytes_per_s=5e8)
    sizes = [1 << 10, 1 << 16, 1 << 20, 1 << 22, 1 << 24]
    pts = [LinkPoint(bytes=b, mean_s=true.time_s(b) * (10 if b == 1 << 20 else 1), jitter_s=0.0)
           for b in sizes]
    fit = fit_link_model(pts)
    assert fit.latency_s == pytest.approx(2e-4, rel=0.01)
    assert fit.bandwidth_bytes_per_s == pytest.approx(5e8, rel=0.01)


def test_link_fit_falls_back_and_warns_when_times_do_not_grow():
    """The loopback intra-host link under load: a 1 MiB message measured faster than a 1 KiB one.
    The old fit raised ("link measurements do not grow with message size"); now a conservative
    model, with one warning line naming the fallback and the fix."""
    pts = [
        LinkPoint(bytes=1 << 10, mean_s=0.004, jitter_s=1e-3),
        LinkPoint(bytes=1 << 10, mean_s=0.0035, jitter_s=1e-3),
        LinkPoint(bytes=1 << 20, mean_s=0.003, jitter_s=1e-3),
    ]
    with pytest.warns(FitFallbackWarning, match=r"do not grow with message size.*--link-reps") as rec:
        fit = fit_link_model(pts)
    assert len(rec) == 1 and "\n" not in str(rec[0].message)
    assert fit.latency_s == pytest.approx(0.003375)  # median of the per-size medians (3.75 and 3 ms)
    assert fit.bandwidth_bytes_per_s == pytest.approx((1 << 20) / 0.003)  # the largest message's
    for p in pts:  # conservative: never predicts less than the (median) measured time
        assert fit.time_s(p.bytes) >= 0.003


@pytest.mark.parametrize("seed", range(3))
def test_allreduce_fit_recovers_the_truth_from_noisy_points(seed):
    rng = random.Random(seed)
    true = AllReduceModel(bandwidth_bytes_per_s=1e9, latency_s=1e-3, contention=0.6)
    pts = []
    for d in (2, 3, 4):
        for k in (1, 2):
            for b in (1 << 20, 1 << 23, 1 << 25):
                for _ in range(3):
                    t = true.time_s(b, d, k) * (1 + rng.gauss(0, 0.03))
                    if rng.random() < 0.15:
                        t *= 3  # a descheduled ring member
                    pts.append(AllReducePoint(segment=None, ring_size=d, concurrent=k, bytes=b, time_s=t))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FitFallbackWarning)
        fit = fit_allreduce_model(pts)
    assert fit.bandwidth_bytes_per_s == pytest.approx(1e9, rel=0.1)
    assert fit.contention == pytest.approx(0.6, abs=0.15)
    assert fit.points == pts  # the file keeps every measurement


def test_allreduce_fit_falls_back_and_warns_when_times_do_not_grow():
    pts = [
        AllReducePoint(segment=None, ring_size=2, concurrent=1, bytes=1 << 10, time_s=0.01),
        AllReducePoint(segment=None, ring_size=2, concurrent=1, bytes=1 << 20, time_s=0.004),
    ]
    with pytest.warns(FitFallbackWarning, match=r"do not grow.*--allreduce-reps"):
        fit = fit_allreduce_model(pts)
    assert fit.contention == 1.0 and fit.bandwidth_bytes_per_s > 0
    assert fit.time_s(1 << 20, 2, 1) >= 0.004


def test_profiler_assembly_prints_one_warning_line_and_records_the_fallback(capsys):
    """A calibration from hopeless network data is written (not an error), with the warning on
    stderr and in the file's diagnostics."""
    flat = [LinkPoint(bytes=b, mean_s=0.003, jitter_s=0.0) for b in (1 << 10, 1 << 20)]
    good = [LinkPoint(bytes=b, mean_s=1e-3 + b / 1e9, jitter_s=0.0) for b in (1 << 10, 1 << 20)]
    st = CalibrationState(cutpoint_names=[], num_segments=1)
    st.seg_static[0] = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8, "optimizer_step_s": 0.0}
    stat = ComputeStat(median=0.01)
    st.seg_at[(0, 1)] = {"fwd_s": stat, "bwd_s": stat, "recompute_s": stat, "stashed_input_bytes": 1,
                         "activation_bytes": 1, "peak_bytes": 1}
    st.link_points = {"intra": flat, "inter": good}
    true = AllReduceModel(bandwidth_bytes_per_s=1e9, latency_s=1e-4)
    st.ar_points = [
        AllReducePoint(segment=None, ring_size=2, concurrent=1, bytes=b, time_s=true.time_s(b, 2, 1))
        for b in (1 << 20, 1 << 24)
    ]
    host = HostInfo(device="cpu", hostname="h", torch_version="x", cpu_count=2)
    cal, extra = assemble(st, created="now", host=host, model_name="m")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("varuna-profile: warning: link measurements do not grow")
    assert extra["fit_warnings"] == [err[0].removeprefix("varuna-profile: warning: ")]
    assert cal.intra.bandwidth_bytes_per_s > 0 and cal.inter.latency_s == pytest.approx(1e-3)


# ---------------------------------------------------------------------------------------------
# varuna-trace: what the engine would refuse is not OK


_TRACE_TARGETS = '''
import torch, varuna
from torch import nn


class Cut(nn.Module):
    def __init__(self, dict_output=False):
        super().__init__()
        self.a, self.cut, self.b = nn.Linear(4, 4), varuna.CutPoint(), nn.Linear(4, 3)
        self.dict_output = dict_output

    def forward(self, x):
        y = self.b(self.cut(self.a(x)))
        return {"logits": y} if self.dict_output else y.sum()


def no_cutpoint():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), torch.randn(2, 4)


def hf_output():
    return Cut(dict_output=True), torch.randn(2, 4)


def hf_output_with_loss_fn():
    return Cut(dict_output=True), torch.randn(2, 4), lambda out, batch: out["logits"].sum()


def fine():
    return Cut(), torch.randn(2, 4)
'''


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        ("no_cutpoint", "the model has no CutPoint"),
        ("hf_output", "returns a dict with keys ['logits'] (no scalar 'loss'), not a scalar loss"),
    ],
)
def test_trace_refuses_what_the_engine_would_refuse_in_one_line(factory, words, tmp_path, capsys):
    from varuna.cutting.trace_cli import main

    path = tmp_path / "targets.py"
    path.write_text(_TRACE_TARGETS)
    assert main([f"{path}:{factory}"]) == 1
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("varuna-trace: ") and words in err[0], out.err
    assert "VERDICT: OK" not in out.out


@pytest.mark.parametrize("factory", ["fine", "hf_output_with_loss_fn"])
def test_trace_still_passes_a_model_the_engine_takes(factory, tmp_path, capsys):
    from varuna.cutting.trace_cli import main

    path = tmp_path / "targets.py"
    path.write_text(_TRACE_TARGETS)
    assert main([f"{path}:{factory}"]) == 0
    assert "VERDICT: OK" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Simulator and calibration values: NaN / Inf / negative / absurd refused in one line naming the field


def _cal_file(tmp_path, edit=None):
    import json

    from varuna.core.calibration import Calibration

    path = tmp_path / "cal.json"
    Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1, 2)).save(path)
    if edit is not None:
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))  # json writes NaN / Infinity literals, as a bad tool would
    return path


def _set(path_keys, value):
    def edit(data):
        obj = data
        for k in path_keys[:-1]:
            obj = obj[k]
        obj[path_keys[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("keys", "value", "field"),
    [
        (["segments", 0, "fwd_s", 0, "median"], float("nan"), "segments[0].fwd_s[0].median"),
        (["segments", 1, "bwd_s", 1, "median"], float("inf"), "segments[1].bwd_s[1].median"),
        (["segments", 0, "fwd_s", 0, "median"], -0.5, "segments[0].fwd_s[0].median"),
        (["segments", 0, "fwd_s", 0, "median"], 1e300, "segments[0].fwd_s[0].median"),
        (["segments", 2, "activation_bytes", 0], 10**40, "segments[2].activation_bytes[0]"),
        (["links", "inter", "latency_s"], 1e30, "links.inter.latency_s"),
        (["links", "intra", "bandwidth_bytes_per_s"], 1e-300, "links.intra.bandwidth_bytes_per_s"),
    ],
)
def test_simulator_refuses_a_calibration_with_an_absurd_value_naming_the_field(keys, value, field, tmp_path,
                                                                               capsys):
    from simulator.cli import main

    path = _cal_file(tmp_path, _set(keys, value))
    assert main(["--calibration", str(path), "--gpus", "4", "--global-batch-size", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"'{field}'" in err[0] and "varuna-profile" in err[0], err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--jitter-scale", "nan"], "--jitter-scale"),
        (["--jitter-scale", "inf"], "--jitter-scale"),
        (["--gpus", "1000000000"], "gpus must be between 1 and"),
        (["--global-batch-size", str(10**12)], "micro-batches per replica"),
        (["--config", "2x2", "--global-batch-size", str(10**12)], "num_microbatches"),
    ],
)
def test_simulator_cli_refuses_huge_or_non_finite_values_in_one_line(args, words, tmp_path, capsys):
    """Each used to be accepted: NaN jitter silently, a huge batch or G simulated until killed."""
    from simulator.cli import main

    base = {"--gpus": "4", "--global-batch-size": "8"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["--calibration", str(_cal_file(tmp_path))] + [x for kv in base.items() for x in kv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("jitter_scale", float("nan")),
        ("extra_latency_s", float("nan")),
        ("extra_latency_s", -1.0),
        ("task_jitter_s", float("inf")),
        ("task_overhead_s", 1e300),
        ("step_overhead_s", float("nan")),
    ],
)
def test_simconfig_refuses_non_finite_knobs_naming_them(knob, value):
    from simulator.config import SimConfig
    from simulator.engine import simulate
    from varuna.core.calibration import Calibration

    cal = Calibration.synthetic(0.01, num_segments=2)
    cfg = SimConfig(num_stages=2, micro_batch_size=1, num_microbatches=2, **{knob: value})
    with pytest.raises(ValueError, match=knob):
        simulate(cal, cfg)


# ---------------------------------------------------------------------------------------------
# Non-UTF-8 files: one line naming the file


def test_non_utf8_calibration_is_named_in_one_line(tmp_path, capsys):
    from simulator.cli import main

    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"version": 1, "model": "caf\xe9"}')
    assert main(["--calibration", str(path), "--gpus", "4", "--global-batch-size", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "not UTF-8" in err[0], err


def test_non_utf8_model_file_is_named_in_one_line_by_varuna_trace_and_varuna_profile(tmp_path, capsys):
    from profiler.cli import main as profile_main
    from varuna.cutting.trace_cli import main as trace_main

    path = tmp_path / "model_latin1.py"
    path.write_bytes(b'NAME = "caf\xe9"\ndef build():\n    pass\n')
    with pytest.raises(SystemExit) as exc:
        trace_main([f"{path}:build"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "utf-8" in err[0], err
    out = tmp_path / "cal.json"
    assert profile_main(["--model", f"{path}:build", "--micro-batch-sizes", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "utf-8" in err[0], err
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# A calibration of another model


def test_calibration_of_another_model_is_named_as_such():
    from varuna.core.calibration import Calibration, plan_model_mismatch

    cal = Calibration.synthetic(0.01, num_segments=5)  # 4 cut-points
    cal.check_model([f"cut{i}" for i in range(4)])
    words = r"cal\.json is a calibration of model 'synthetic' with 4 cut-points .* this model has 2 .*"
    words += "varuna-profile"
    with pytest.raises(ValueError, match=words):
        cal.check_model(["blocks.3", "blocks.7"], source="cal.json")
    # The engine's side: ranges planned on that calibration, a model with 3 segments.
    ranges = [(0, 1), (2, 3), (4, 4)]
    message = plan_model_mismatch(ranges, 3)
    assert message is not None and "another model" in message and "\n" not in message
    assert plan_model_mismatch(ranges, 5) is None
    assert plan_model_mismatch([(0, 1), (3, 4)], 3) is None  # malformed: the engine's own range error
