"""The job spec's schedule: defaulted from the script's --schedule, validated against the schedule
kinds, carried over the wire (manager/jobspec.py)."""

from __future__ import annotations

import pytest

from manager.jobspec import JobSpec, script_schedule, spec_from_pb, spec_to_pb

BASE = dict(script="/t.py", global_batch_size=8, checkpoint_dir="/c", max_vms=2, target_steps=5)


def test_schedule_defaults_to_varuna_then_to_the_scripts_argument():
    assert JobSpec(**BASE).schedule == "varuna"
    assert JobSpec(**BASE, args=["--schedule", "1f1b"]).schedule == "1f1b"
    assert JobSpec(**BASE, args=["--schedule=gpipe"]).schedule == "gpipe"
    assert JobSpec(**BASE, schedule="gpipe").schedule == "gpipe"
    assert JobSpec(**BASE, args=["--schedule", "1f1b"], schedule="1f1b").schedule == "1f1b"


def test_bad_schedules_are_refused_with_one_line():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'; use one of varuna, gpipe, 1f1b"):
        JobSpec(**BASE, schedule="pipedream")
    with pytest.raises(ValueError, match="script's --schedule 'zigzag' is not one of"):
        JobSpec(**BASE, args=["--schedule", "zigzag"])
    with pytest.raises(ValueError, match="schedule 'gpipe' differs from the script's --schedule '1f1b'"):
        JobSpec(**BASE, args=["--schedule", "1f1b"], schedule="gpipe")
    with pytest.raises(ValueError, match="'schedule' must be one of"):
        JobSpec(**BASE, schedule=3)


def test_schedule_survives_the_wire_and_the_store():
    spec = JobSpec(**BASE, args=["--schedule", "1f1b"])
    assert spec_from_pb(spec_to_pb(spec)).schedule == "1f1b"
    assert JobSpec.from_dict(spec.to_dict()).schedule == "1f1b"
    # A spec stored before the field existed reads as the script's schedule.
    old = {k: v for k, v in spec.to_dict().items() if k != "schedule"}
    assert JobSpec.from_dict(old).schedule == "1f1b"


def test_script_schedule_takes_the_last_occurrence():
    assert script_schedule(["--schedule", "gpipe", "--schedule", "1f1b"]) == "1f1b"
    assert script_schedule(["--schedule"]) is None
