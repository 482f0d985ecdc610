"""``varuna-simulate``'s predicted TFLOP/s per device and time and cost to train (issue 31), and the
calibration fields they read (``model.fwd_flops_per_example``, ``types.<t>.price_per_hour``)."""

from __future__ import annotations

import json
import math

import pytest

from simulator.cli import main as simulate_main
from simulator.training import estimate_training, parse_count, parse_prices
from varuna.core.calibration import Calibration, VmType

FLOPS = [1e9, 2e9, 2e9, 1e9]  # forward FLOPs per example, per segment
M = 64


def _cal(path, *, flops=True, device="cuda: NVIDIA H100 80GB HBM3 x8", types=None) -> str:
    cal = Calibration.synthetic([0.01, 0.02, 0.02, 0.01], micro_batch_sizes=(1, 2, 4))
    if flops:
        cal.model.fwd_flops_per_example = list(FLOPS)
    cal.host.device = device
    if types:
        cal.types = types
    cal.save(path)
    return str(path)


def test_estimate_against_hand_numbers():
    e = estimate_training(examples_per_s=50.0, devices=4, global_batch_size=M,
                          flops_per_example=3 * sum(FLOPS), peak=100.0, train_tokens=1e9,
                          tokens_per_example=512, device_price_per_hour=1.5)
    assert e.tflops_per_device == pytest.approx(50.0 * 18e9 / 4 / 1e12)
    assert e.mfu == pytest.approx(e.tflops_per_device / 100.0)
    assert e.steps == math.ceil(1e9 / (M * 512)) == 30518  # rounded up: the last step is whole
    assert e.hours == pytest.approx(30518 * M / 50.0 / 3600)
    assert e.cost == pytest.approx(e.hours * 4 * 1.5)
    none = estimate_training(examples_per_s=50.0, devices=4, global_batch_size=M, flops_per_example=None)
    assert (none.tflops_per_device, none.mfu, none.steps, none.hours, none.cost) == (None,) * 5


def test_counts_and_prices_parse():
    assert parse_count("300B") == 3e11 and parse_count("1_000") == 1000.0 and parse_count("2.5e3") == 2500.0
    assert parse_prices("2") == 2.0 and parse_prices("a=1,b=0.5") == {"a": 1.0, "b": 0.5}
    for bad in ("0", "-1", "x"):
        with pytest.raises(Exception, match="invalid count"):
            parse_count(bad)


def test_cli_json_is_consistent_with_the_prediction(tmp_path, capsys):
    cal = _cal(tmp_path / "c.json")
    rc = simulate_main(["--calibration", cal, "--gpus", "8", "--global-batch-size", str(M), "--json",
                        "--quiet", "--train-tokens", "1B", "--tokens-per-example", "1024",
                        "--price-per-device-hour", "2.5", "--precision", "bf16"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    eps, t = out["best"]["examples_per_s"], out["training"]
    g = out["best"]["P"] * out["best"]["D"]
    assert t["devices"] == g and t["tflops_per_device"] == pytest.approx(eps * 3 * sum(FLOPS) / g / 1e12)
    assert t["peak_tflops"] == 989.4 and t["mfu"] == pytest.approx(t["tflops_per_device"] / 989.4)
    assert t["steps"] == math.ceil(1e9 / (M * 1024))
    assert t["hours"] == pytest.approx(t["steps"] * M / eps / 3600)
    assert t["cost"] == pytest.approx(t["hours"] * g * 2.5)


def test_cli_text_without_a_flop_count(tmp_path, capsys):
    cal = _cal(tmp_path / "c.json", flops=False)
    assert simulate_main(["--calibration", cal, "--gpus", "4", "--global-batch-size", str(M),
                          "--config", "2x2", "--train-steps", "100"]) == 0
    text = capsys.readouterr().out
    assert "TFLOP/s unknown" in text and "100 steps in" in text


@pytest.mark.parametrize("args,needle", [
    (["--train-tokens", "1B"], "--tokens-per-example"),
    (["--train-tokens", "1B", "--tokens-per-example", "0"], "--tokens-per-example must be >= 1"),
    (["--price-per-device-hour", "a=1"], "is for --cluster"),
    (["--train-steps", "0"], "invalid count"),
    (["--peak-tflops", "-3"], "--peak-tflops"),
])
def test_bad_training_options_are_one_line(tmp_path, capsys, args, needle):
    cal = _cal(tmp_path / "c.json")
    assert simulate_main(["--calibration", cal, "--gpus", "4", "--global-batch-size", str(M), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_cluster_cost_from_the_types_prices_or_the_flag(tmp_path, capsys):
    types = {"fast": VmType(name="fast", speed=2.0, price_per_hour=3.0),
             "slow": VmType(name="slow", speed=1.0, price_per_hour=1.0)}
    cal = _cal(tmp_path / "c.json", types=types)
    base = ["--calibration", cal, "--cluster", "fast=2,slow=2", "--global-batch-size", "16", "--json",
            "--train-steps", "1000"]
    assert simulate_main(base) == 0
    out = json.loads(capsys.readouterr().out)
    used = {}
    for row in out["stage_types"]:
        for t in row:
            used[t] = used.get(t, 0) + 1
    t = out["training"]
    assert t["hours"] == pytest.approx(1000 * 16 / out["examples_per_s"] / 3600)
    assert t["cost"] == pytest.approx(t["hours"] * (3.0 * used.get("fast", 0) + 1.0 * used.get("slow", 0)))
    assert simulate_main([*base, "--price-per-device-hour", "fast=10,slow=10"]) == 0
    t2 = json.loads(capsys.readouterr().out)["training"]
    assert t2["cost"] == pytest.approx(t2["hours"] * 10 * sum(used.values()))
    assert simulate_main([*base, "--price-per-device-hour", "fast=10"]) == 2  # no price for slow
    assert "slow" in capsys.readouterr().err


def test_calibration_fields_round_trip_and_are_checked(tmp_path):
    types = {"fast": VmType(name="fast", speed=2.0, price_per_hour=3.0)}
    path = _cal(tmp_path / "c.json", types=types)
    cal = Calibration.load(path)
    assert cal.model.fwd_flops_per_example == FLOPS and cal.types["fast"].price_per_hour == 3.0
    data = json.loads(open(path).read())
    data["model"]["fwd_flops_per_example"] = [1.0, 2.0]
    with pytest.raises(ValueError, match="fwd_flops_per_example"):
        Calibration.from_dict(data)
    data = json.loads(open(path).read())
    data["types"]["fast"]["price_per_hour"] = -1
    with pytest.raises(ValueError, match="price_per_hour"):
        Calibration.from_dict(data)
    data = json.loads(open(path).read())
    del data["model"]["fwd_flops_per_example"]  # a file from before the field: loads, and saves without it
    old = Calibration.from_dict(data)
    assert old.model.fwd_flops_per_example is None and "fwd_flops_per_example" not in old.to_dict()["model"]
