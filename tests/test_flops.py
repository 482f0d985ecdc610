"""TFLOP/s and MFU (issue 31): the engine's per-step FLOP fields against a hand count, the peak
table, and where the peak comes from.

Hand count (Note [Model FLOPs] in varuna/core/flops.py): a linear layer's forward is 2·in·out
FLOPs per example (one multiply and one add per weight; the bias add, the ReLU and the MSE are
not matmuls and are not counted). A step is forward + backward = 3 forwards over the mini-batch;
a recomputed forward counts in the hardware FLOPs only.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from distributed import check_ok, run_world  # noqa: E402

import varuna  # noqa: E402
from varuna.core.batching import plan_microbatches  # noqa: E402
from varuna.core.flops import DEVICE_PEAKS, device_peak, model_flops_utilization, peak_tflops, training_flops  # noqa: E402
from varuna.runtime.config import VarunaConfig  # noqa: E402
from varuna.runtime.flops import PEAK_ENV, resolve_peak, step_flops  # noqa: E402
from varuna.runtime.layout import Layout  # noqa: E402

IN, HID, OUT = 8, 16, 4


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(IN, HID), nn.Linear(HID, OUT)

    def forward(self, x, y):
        return F.mse_loss(self.b(torch.relu(self.a(x))), y)


def hand_count(examples: int) -> float:
    """Forward FLOPs of the MLP on ``examples`` examples, by hand."""
    return examples * (2 * IN * HID + 2 * HID * OUT)


def _engine(M: int, m: int, **config):
    torch.manual_seed(0)
    batch = (torch.randn(M, IN), torch.randn(M, OUT))
    eng = varuna.Engine(MLP(), varuna.VarunaConfig(global_batch_size=M, micro_batch_size=m, stop_signals=(),
                                                   device="cpu", **config),
                        example_batch=batch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    return eng, batch


def test_step_result_fields_match_the_hand_count(monkeypatch):
    monkeypatch.delenv(PEAK_ENV, raising=False)
    eng, batch = _engine(8, 4)
    try:
        r = eng.train_step(batch)
    finally:
        eng.close()
    assert r.model_flops == 3 * hand_count(8) == 9216
    assert r.tflops == pytest.approx(r.model_flops / r.step_s / 1e12, rel=1e-12)
    assert r.hardware_tflops == r.tflops  # 1×1: the only stage is the last one, which never recomputes
    assert r.mfu is None  # a CPU has no known peak: MFU unknown, TFLOP/s still reported


def test_short_last_micro_batch_is_counted_exactly(monkeypatch):
    """FLOPs are linear in the examples: M=10 at m=4 is micro-batches of 4, 4, 2."""
    monkeypatch.delenv(PEAK_ENV, raising=False)
    eng, batch = _engine(10, 4)
    try:
        r = eng.train_step(batch)
    finally:
        eng.close()
    assert r.model_flops == 3 * hand_count(10)


def test_mfu_against_a_given_peak(monkeypatch):
    monkeypatch.setenv(PEAK_ENV, "4.0")  # the config's value wins over the environment's
    eng, batch = _engine(8, 4, metrics=varuna.MetricsConfig(peak_tflops=2.0))
    try:
        r = eng.train_step(batch)
    finally:
        eng.close()
    assert eng.flops.peak_tflops == 2.0 and eng.flops.peak_source == "config"
    assert r.mfu == pytest.approx(r.tflops / 2.0, rel=1e-12)


def test_recompute_counts_in_hardware_flops_only():
    """P=2, varuna schedule: stage 0 (segment 0) recomputes every micro-batch, the last stage none;
    gpipe without recompute recomputes nothing. D=2 splits the micro-batches, not the count."""
    per_example = [2.0 * IN * HID, 2.0 * HID * OUT]
    ranges = [(0, 0), (1, 1)]
    for D in (1, 2):
        cfg = VarunaConfig(global_batch_size=8, micro_batch_size=2)
        f = step_flops(per_example, config=cfg, layout=Layout(world=2 * D, rank=0, P=2, D=D),
                       micro_plan=plan_microbatches(8, 2, D), stage_ranges=ranges, device_name="cpu")
        assert f.model_flops == 3 * hand_count(8)
        assert f.hardware_flops == f.model_flops + 8 * per_example[0]  # stage 0's forward, once more
        assert f.devices == 2 * D
    cfg = VarunaConfig(global_batch_size=8, micro_batch_size=2, schedule="gpipe",
                       pipeline=varuna.PipelineConfig(recompute=False))
    f = step_flops(per_example, config=cfg, layout=Layout(world=2, rank=0, P=2, D=1),
                   micro_plan=plan_microbatches(8, 2, 1), stage_ranges=ranges, device_name="cpu")
    assert f.hardware_flops == f.model_flops  # negative control: no recompute, nothing extra


def test_metrics_divide_by_time_and_devices():
    f = step_flops([1e12], config=VarunaConfig(global_batch_size=4, micro_batch_size=1,
                                        metrics=varuna.MetricsConfig(peak_tflops=10.0)),
                   layout=Layout(world=4, rank=0, P=1, D=4), micro_plan=plan_microbatches(4, 1, 4),
                   stage_ranges=[(0, 0)], device_name="cpu")
    got = f.metrics(step_s=2.0)
    assert got["model_flops"] == 12e12 and got["tflops"] == 1.5 and got["mfu"] == 0.15  # 12 / 2 s / 4 devices
    assert f.metrics(step_s=0.0)["tflops"] is None


@pytest.mark.slow
def test_every_rank_reports_the_job_count_at_p2():
    """Only rank 0 counts FLOPs in the dry run; the others get its count (a broadcast) and every
    rank reports the same job-wide numbers, hardware FLOPs including stage 0's recompute."""
    results = run_world(ROOT / "tests" / "workers" / "flops_worker.py", 2, ["2"], timeout_s=180)
    check_ok(results)
    rows = [json.loads(line) for r in results for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4
    model = 3 * hand_count(8)
    for row in rows:
        assert row["model_flops"] == model
        assert row["tflops"] == pytest.approx(model / row["step_s"] / 2 / 1e12, rel=1e-12)
        stage0_forward = 8 * 2 * IN * HID  # every micro-batch recomputed once on stage 0
        hw = (model + stage0_forward) / row["step_s"] / 2 / 1e12
        assert row["hardware_tflops"] == pytest.approx(hw, rel=1e-12)
        assert row["mfu"] == pytest.approx(row["tflops"] / 2.0, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# the peak table


@pytest.mark.parametrize("name,entry", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"), ("NVIDIA A10G", "A10G"), ("NVIDIA A10", "A10"), ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", "L40S"), ("Tesla T4", "T4"), ("Tesla V100-SXM2-16GB", "V100 SXM2"),
    ("Tesla V100-PCIE-32GB", "V100 PCIe"), ("NVIDIA GeForce RTX 4090", "RTX 4090"),
])
def test_device_names_find_their_entry(name, entry):
    assert device_peak(name).name == entry


def test_unknown_devices_and_modes_have_no_peak():
    assert device_peak("cpu") is None and device_peak("NVIDIA L40") is None  # "L40" is not an L4
    assert peak_tflops("Tesla T4", "bf16") is None  # no bf16 tensor cores
    assert peak_tflops("NVIDIA A10G", "bf16") is None  # no published figure: no guess
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32") == 67.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32", tf32=True) == 494.7
    assert model_flops_utilization(tflops=1.0, peak=None) is None


def test_table_is_dense_and_ordered():
    """Dense figures (datasheets quote sparsity at twice these); bf16 >= tf32 >= fp32 where known."""
    for e in DEVICE_PEAKS:
        known = [v for v in (e.fp32, e.tf32, e.bf16) if v is not None]
        assert known == sorted(known), e.name
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") < 1000  # 1979 is the sparse figure


def test_peak_from_config_env_or_table():
    assert resolve_peak("NVIDIA L4", "bf16", None, {}) == (121.0, "L4")
    assert resolve_peak("NVIDIA L4", "bf16", None, {PEAK_ENV: "100"}) == (100.0, f"${PEAK_ENV}")
    assert resolve_peak("NVIDIA L4", "bf16", 50.0, {PEAK_ENV: "100"}) == (50.0, "config")
    assert resolve_peak("cpu", "fp32", None, {}) == (None, "unknown")
    with pytest.raises(ValueError, match=PEAK_ENV):
        resolve_peak("cpu", "fp32", None, {PEAK_ENV: "fast"})
    with pytest.raises(ValueError, match="peak_tflops"):
        VarunaConfig(global_batch_size=4, micro_batch_size=2,
                     metrics=varuna.MetricsConfig(peak_tflops=-1.0)).validate()


def test_training_flops_is_three_forwards():
    assert training_flops(2.0) == training_flops(2.0, recompute_flops=0.0)
    c = training_flops(2.0, recompute_flops=1.0)
    assert (c.model, c.hardware) == (6.0, 7.0)
    with pytest.raises(ValueError):
        training_flops(-1.0)
    assert math.isclose(model_flops_utilization(tflops=494.7, peak=989.4), 0.5)
