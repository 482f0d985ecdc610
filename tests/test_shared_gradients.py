"""Tied parameters in the calibration and the simulator (Note [Shared gradients] in
simulator/costs.py): the file's ``model.shared_params`` round-trips and is checked on load; the
simulator sums a parameter that two stages hold over their ranks (also at D = 1) instead of with
the replicas, and one that a single stage holds once."""

from __future__ import annotations

import json

import pytest

from simulator.config import SimConfig
from simulator.costs import sync_costs
from varuna.core.calibration import Calibration, SharedParams

TIED = 4096 * 64


def _cal(shared: bool) -> Calibration:
    cal = Calibration.synthetic(0.01, num_segments=3)
    if shared:
        cal.model.shared_params = [SharedParams(segments=(0, 2), grad_bytes=TIED)]
    return cal


def test_shared_params_round_trip_and_bad_entries_are_one_line(tmp_path):
    path = tmp_path / "cal.json"
    _cal(True).save(path)
    assert Calibration.load(path).model.shared_params == [SharedParams(segments=(0, 2), grad_bytes=TIED)]
    _cal(False).save(path)
    assert "shared_params" not in json.loads(path.read_text())["model"]  # old readers see no change
    data = json.loads(path.read_text())
    data["model"]["shared_params"] = [{"segments": [0, 7], "grad_bytes": 1}]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as err:
        Calibration.load(path)
    assert "shared_params[0]" in str(err.value) and "\n" not in str(err.value)


def test_a_parameter_two_stages_hold_is_summed_across_the_pipeline_even_at_d1():
    config = SimConfig(num_stages=2, num_replicas=1, micro_batch_size=1, num_microbatches=4, host_slots=1)
    stages = [[0], [1, 2]]
    cal = _cal(True)
    expected = cal.allreduce_s(TIED, 2, 1)  # one ring of 2 ranks on 2 hosts
    assert [ar for ar, _ in sync_costs(cal, config, stages)] == pytest.approx([expected, expected])
    # Negative control: the same model without the entry has nothing to sum at D = 1.
    assert [ar for ar, _ in sync_costs(_cal(False), config, stages)] == [0.0, 0.0]


def test_a_parameter_one_stage_holds_is_summed_once_with_the_replicas():
    config = SimConfig(num_stages=1, num_replicas=2, micro_batch_size=1, num_microbatches=4, host_slots=1)
    cal = _cal(True)
    [(ar, _)] = sync_costs(cal, config, [[0, 1, 2]])
    assert ar == pytest.approx(cal.allreduce_s(cal.grad_bytes([0, 1, 2]) - TIED, 2, 1))
    [(counted_twice, _)] = sync_costs(_cal(False), config, [[0, 1, 2]])
    assert counted_twice > ar  # without the entry the tied bytes ride twice


def test_the_profiler_groups_shared_parameters_by_their_segments():
    from types import SimpleNamespace

    from profiler.compute import SegmentProfiler

    profile = SimpleNamespace(
        param_segments={"wte.weight": (0, 2), "wpe.weight": (0,), "a": (1, 3), "b": (1, 3)},
        param_bytes={"wte.weight": 65536, "wpe.weight": 8192, "a": 10, "b": 20},
    )
    profile.shared_params = lambda: {n: s for n, s in profile.param_segments.items() if len(s) > 1}
    prof = SegmentProfiler.__new__(SegmentProfiler)  # only its dry-run profile matters here
    prof.profile = profile
    assert prof.shared_params() == [{"segments": [0, 2], "grad_bytes": 65536},
                                    {"segments": [1, 3], "grad_bytes": 30}]
