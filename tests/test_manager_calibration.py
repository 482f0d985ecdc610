"""Calibration at job start (Note [Calibration at job start] in manager/domain/controller.py): the job
spec's [profile] table, the manager ordering one VM's agent to run varuna-profile, storing and
reusing the result across restarts, timeouts, failures, lost VMs; the agent's side of a run
(manager/agent/calibrate.py) with real processes; the local provider's changing spot capacity.

The control loop runs on a fake clock with simulated agents (tests/test_manager_controller.py's
World); the whole life cycle with real agents, the real profiler and the GPT example is
tests/test_manager_grow.py.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path

import pytest

from manager.agent.calibrate import ProfileRun, failure_reason
from manager.domain.calibration_orders import CALIBRATION_MAX_ATTEMPTS
from manager.domain.errors import ManagerError
from manager.domain.jobspec import JobSpec, ProfileSpec, load_jobspec
from manager.domain.messages import Action, CalibrationReport, Orders
from manager.domain.store import SCHEMA_VERSION, Store
from manager.providers.base import ProviderContext
from manager.providers.local import LocalProvider, LocalProviderOptions
from manager.transport.convert import spec_from_pb, spec_to_pb
from varuna.core.calibration import Calibration

sys.path.insert(0, str(Path(__file__).parent))
from test_manager_controller import FakeProvider, World  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROFILE = {
    "model": "examples/gpt2/profile_target.py:build",
    "model_args": {"n_layer": 2, "n_embd": 32},
    "args": ["--reps", "1"],
    "timeout_s": 60,
}


def _calibration() -> Calibration:
    return Calibration.synthetic(0.002, num_segments=5, micro_batch_sizes=(1, 2, 4), param_bytes=1 << 20)


def _report(w: World, vm_id: str, attempt: int, *, ok: bool = True, text: str | None = None, error: str = ""):
    return w.mgr.report_calibration(
        CalibrationReport(
            vm_id=vm_id,
            attempt=attempt,
            ok=ok,
            calibration_json=(json.dumps(_calibration().to_dict()) if text is None else text) if ok else "",
            error=error,
            wall_s=3.0,
        )
    )


def _orders(w: World, vm_id: str) -> Orders:
    return w.vms[vm_id].beat()


def _profiling_world(
    tmp_path, *, capacity: int = 3, profile: dict | None = None, **config
) -> tuple[World, str]:
    """A job with a [profile] and no calibration, its VMs up and its first VM ordered to profile."""
    w = World(tmp_path, provider=FakeProvider(capacity=capacity), **config)
    job = w.submit(max_vms=capacity, num_segments=0, workdir=str(tmp_path), profile=dict(profile or PROFILE))
    w.tick()
    w.tick(0.1)
    return w, job


@pytest.mark.parametrize(
    "module",
    ["manager.domain.jobspec", "manager.agent.calibrate", "manager.domain.store", "manager.domain.policy"],
)
def test_docstring_examples(module):
    import doctest
    import importlib

    failures, tried = doctest.testmod(importlib.import_module(module))
    assert failures == 0 and tried > 0


# -- the job spec's [profile] -----------------------------------------------------------------------


def test_profile_table_round_trips_and_resolves_the_model_file(tmp_path):
    (tmp_path / "job.toml").write_text(
        """
script = "train.py"
global_batch_size = 24
micro_batch_size = 2
checkpoint_dir = "ckpt"
max_vms = 2
target_steps = 4
[profile]
model = "examples/gpt2/profile_target.py:build"
model_args = { n_layer = 2, name = "tiny" }
args = ["--reps", "1", "--host-emulation", "loopback"]
timeout_s = 90
required = true
"""
    )
    spec = load_jobspec(tmp_path / "job.toml")
    profile = spec.profile_spec
    assert profile.model == f"{tmp_path}/examples/gpt2/profile_target.py:build"
    assert profile.profiler_args(job_micro_batch_size=spec.micro_batch_size) == [
        "--model",
        profile.model,
        "--model-arg",
        "n_layer=2",
        "--model-arg",
        'name="tiny"',
        "--micro-batch-sizes",
        "2",  # the job's m when the table names none
        "--reps",
        "1",
        "--host-emulation",
        "loopback",
    ]
    assert spec_from_pb(spec_to_pb(spec)).profile == spec.profile
    # A module target is left alone; no m anywhere: the profiler's usual sizes.
    mod = ProfileSpec.from_dict({"model": "profiler.targets:mlp"}).resolved(tmp_path)
    assert mod.model == "profiler.targets:mlp"
    assert "1,2,4" in mod.profiler_args()


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"profile": {"model": "nofactory"}}, "module_or_file:factory"),
        ({"profile": {**PROFILE, "bogus": 1}}, "unknown profile field(s) bogus"),
        ({"profile": {**PROFILE, "args": ["--out", "x.json"]}}, "may not contain --out"),
        ({"profile": {**PROFILE, "args": ["--model=x:y"]}}, "may not contain --model"),
        ({"profile": {**PROFILE, "micro_batch_sizes": [0]}}, "micro_batch_sizes must be a list of integers"),
        ({"profile": {**PROFILE, "timeout_s": 0}}, "timeout_s must be a number of seconds > 0"),
        ({"profile": {**PROFILE, "required": "yes"}}, "required must be true or false"),
        ({"profile": PROFILE, "calibration": "cal.json"}, "either 'calibration'"),
    ],
)
def test_bad_profile_tables_are_one_line_errors(patch, message):
    base = {
        "script": "/t.py",
        "global_batch_size": 8,
        "checkpoint_dir": "/c",
        "max_vms": 2,
        "target_steps": 3,
    }
    with pytest.raises(ValueError) as info:
        JobSpec.from_dict({**base, **patch})
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "profile, words",
    [
        ({"model": "profiler.targets:mlp", "args": ["--no-such-flag"]}, "varuna-profile refuses"),
        ({"model": "missing.py:build"}, "does not exist"),
    ],
)
def test_submit_refuses_a_profile_the_profiler_would_refuse(tmp_path, capsys, profile, words):
    from manager import cli

    (tmp_path / "train.py").write_text("")
    spec = {
        "script": "train.py",
        "global_batch_size": 8,
        "checkpoint_dir": "ckpt",
        "max_vms": 1,
        "target_steps": 1,
        "profile": profile,
    }
    (tmp_path / "job.json").write_text(json.dumps(spec))
    token = tmp_path / "token"
    token.write_text("x" * 32)
    token.chmod(0o600)
    # Refused before any connection is tried (nothing listens on port 9).
    argv = ["submit", str(tmp_path / "job.json"), "--manager", "127.0.0.1:9", "--token-file", str(token)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


# -- the control loop ---------------------------------------------------------------------------------


def test_first_vm_profiles_then_the_stored_calibration_plans_the_job(tmp_path):
    from simulator.autoconfig import autoconfigure

    w, job = _profiling_world(tmp_path)
    first = w.store.vms(job)[0].vm_id
    orders = _orders(w, first)
    assert orders.action == Action.PROFILE and orders.profile.attempt == 1
    # (World submits without the CLI's path resolution: a relative file is relative to the workdir.)
    assert list(orders.profile.argv[:2]) == ["--model", "examples/gpt2/profile_target.py:build"]
    assert orders.profile.timeout_s == 60 and orders.profile.cwd == str(tmp_path)
    others = [vm.vm_id for vm in w.store.vms(job)[1:]]
    assert all(_orders(w, v).action == Action.IDLE for v in others)
    w.tick(1.0)
    assert w.store.job(job).generation == 0, "no launch before the calibration is in"
    status = w.mgr.status(job, 0)[0]
    assert status.calibration_state == "profiling" and status.calibration.startswith(f"profiling on {first}")

    assert _report(w, first, 1).accepted
    stored = w.store.job(job)
    assert stored.calibration_state == "done" and Calibration.from_dict(json.loads(stored.calibration_json))
    finished = w.event(job, "calibration-finished")
    assert len(finished) == 1 and finished[0].vm_id == first and finished[0].data["wall_s"] == 3.0
    w.tick(0.1)
    launched = w.event(job, "launched")[0].data
    best = autoconfigure(_calibration(), gpus=3, global_batch_size=24, micro_batch_size=2).best
    gen = w.gen(job)
    assert launched["source"].startswith("simulator")
    assert (gen.pipeline_depth, gen.data_parallel) == (best.num_stages, best.num_replicas)
    assert gen.predicted_samples_per_s == pytest.approx(best.examples_per_s)
    assert launched["calibration"] == f"profiled on {first} in 3.0 s"
    assert w.mgr.status(job, 0)[0].calibration == f"profiled on {first} in 3.0 s"
    # Once stored, never again: no PROFILE order, a repeated report is refused.
    assert _orders(w, first).action != Action.PROFILE
    again = _report(w, first, 1, text="{}")
    assert not again.accepted and w.store.job(job).calibration_json == stored.calibration_json
    assert len(w.event(job, "calibration-started")) == 1


def test_a_restarted_manager_awaits_the_same_attempt_and_reuses_the_result(tmp_path):
    w, job = _profiling_world(tmp_path)
    first = w.store.vms(job)[0].vm_id
    assert _orders(w, first).profile.attempt == 1

    def restart(old: World) -> World:
        old.store.close()
        old.clock.advance(5.0)
        new = World(
            tmp_path, store=Store(str(tmp_path / "state.sqlite")), clock=old.clock, provider=old.provider
        )
        for vm_id, vm in old.vms.items():  # the same agents keep running
            vm.mgr = new.mgr
            new.vms[vm_id] = vm
        return new

    w = restart(w)
    w.tick(0.1)
    orders = _orders(w, first)
    assert orders.action == Action.PROFILE and orders.profile.attempt == 1  # the same run, awaited
    assert len(w.event(job, "calibration-started")) == 1
    assert _report(w, first, 1).accepted
    w = restart(w)
    w.tick(0.1)
    assert w.store.job(job).generation == 1
    assert w.event(job, "launched")[0].data["source"].startswith("simulator")  # the stored file, reloaded
    assert len(w.event(job, "calibration-started")) == 1
    assert all(_orders(w, v).action != Action.PROFILE for v in w.vms)


def test_timeout_falls_back_to_the_layout_rule(tmp_path):
    w, job = _profiling_world(tmp_path, profile={**PROFILE, "timeout_s": 10})
    w.tick(5.0)
    assert w.store.job(job).calibration_state == "profiling"
    w.tick(10.0)  # past timeout_s + the heartbeat timeout (3 s)
    failed = w.event(job, "calibration-failed")
    assert (
        len(failed) == 1 and "timeout_s = 10 s" in failed[0].message and "fallback rule" in failed[0].message
    )
    w.tick(0.1)
    assert w.event(job, "launched")[0].data["source"].startswith("fallback")
    status = w.mgr.status(job, 0)[0]
    assert status.calibration_state == "failed" and status.calibration.startswith("fallback rule")
    # A late result of the timed-out attempt is refused, and nothing is profiled again.
    assert not _report(w, w.store.vms(job)[0].vm_id, 1).accepted
    assert w.store.job(job).calibration_json == ""


def test_required_calibration_that_fails_fails_the_job(tmp_path):
    w, job = _profiling_world(tmp_path, profile={**PROFILE, "required": True})
    first = w.store.vms(job)[0].vm_id
    line = "varuna-profile exited with 2: error: bad --model-arg 'x'"
    assert _report(w, first, 1, ok=False, error=line + "\nmore").accepted
    event = w.event(job, "calibration-failed")[0]
    assert line in event.message and "\n" not in event.message and event.data["required"]
    created = len(w.provider.created)
    w.tick(0.1)
    job_row = w.store.job(job)
    assert job_row.state == "failed" and line in job_row.message
    assert w.store.job(job).generation == 0
    w.tick(0.1)
    assert len(w.provider.created) == created, "a failed job asks for no more VMs"
    assert sorted(w.provider.deleted) == sorted(w.provider.created)


def test_an_invalid_calibration_file_is_refused_with_the_reason(tmp_path):
    w, job = _profiling_world(tmp_path)
    first = w.store.vms(job)[0].vm_id
    assert _report(w, first, 1, text='{"version": 1}').accepted
    event = w.event(job, "calibration-failed")[0]
    assert "invalid calibration file" in event.message and w.store.job(job).calibration_json == ""
    w.tick(0.1)
    assert w.event(job, "launched")[0].data["source"].startswith("fallback")


def test_a_vm_lost_while_profiling_gets_the_order_reissued_elsewhere(tmp_path):
    w, job = _profiling_world(tmp_path, capacity=CALIBRATION_MAX_ATTEMPTS + 1)
    lost = []
    for attempt in range(1, CALIBRATION_MAX_ATTEMPTS + 1):
        vm_id = w.store.job(job).calibration_vm
        assert _orders(w, vm_id).profile.attempt == attempt and vm_id not in lost
        w.vms[vm_id].alive = False  # kill -9 of the VM
        lost.append(vm_id)
        w.until(
            lambda n=attempt: len(w.event(job, "calibration-lost")) >= n or w.event(job, "calibration-failed")
        )
        w.tick(0.1)
    # The last attempt's VM died too: no more attempts, fallback.
    failed = w.event(job, "calibration-failed")
    assert (
        len(failed) == 1
        and f"attempt {CALIBRATION_MAX_ATTEMPTS} of {CALIBRATION_MAX_ATTEMPTS}" in failed[0].message
    )
    assert len(w.event(job, "calibration-lost")) == CALIBRATION_MAX_ATTEMPTS - 1
    assert [e.vm_id for e in w.event(job, "calibration-started")] == lost


def test_a_restarted_agent_on_the_profiling_vm_gets_a_new_attempt(tmp_path):
    w, job = _profiling_world(tmp_path)
    first = w.store.vms(job)[0].vm_id
    w.vms[first].instance = "a-new-agent"
    w.vms[first].register()
    assert w.event(job, "calibration-lost")[0].data["attempt"] == 1
    w.tick(0.1)
    orders = _orders(w, w.store.job(job).calibration_vm)
    assert orders.action == Action.PROFILE and orders.profile.attempt == 2
    assert not _report(w, first, 1).accepted  # the lost attempt's result, should one still come


def test_a_job_without_calibration_or_profile_says_fallback(tmp_path):
    w = World(tmp_path, provider=FakeProvider(capacity=2))
    job = w.submit(max_vms=2)
    w.tick()
    w.tick(0.1)
    status = w.mgr.status(job, 0)[0]
    assert status.calibration_state == "none" and "fallback rule" in status.calibration
    assert w.gen(job).generation == 1 and not w.event(job, "calibration-started")
    cal = json.dumps(_calibration().to_dict())
    job2 = w.submit(max_vms=2, calibration_json=cal)
    assert w.mgr.status(job2, 0)[0].calibration == "from the job spec"
    with pytest.raises(ManagerError, match="either 'calibration'"):
        w.submit(max_vms=2, calibration_json=cal, profile=PROFILE)


def test_vm_names_stay_dense_while_capacity_is_short(tmp_path):
    provider = FakeProvider(capacity=1)
    w = World(tmp_path, provider=provider, create_retry_s=1.0)
    job = w.submit(max_vms=3)
    for _ in range(5):
        w.tick(1.5)
    provider.capacity = 2
    w.tick(1.5)
    assert [v.vm_id for v in w.store.vms(job)] == [f"{job}-vm1", f"{job}-vm2"]


# -- the store ----------------------------------------------------------------------------------------


def test_a_version_1_state_file_is_migrated(tmp_path):
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        CREATE TABLE jobs (job_id TEXT PRIMARY KEY, spec_json TEXT NOT NULL,
            calibration_json TEXT NOT NULL DEFAULT '', state TEXT NOT NULL, message TEXT NOT NULL DEFAULT '',
            created REAL NOT NULL, updated REAL NOT NULL, generation INTEGER NOT NULL DEFAULT 0,
            step INTEGER NOT NULL DEFAULT 0, detection_time REAL, detection_reason TEXT NOT NULL DEFAULT '',
            failed_launches INTEGER NOT NULL DEFAULT 0, cancel_requested INTEGER NOT NULL DEFAULT 0,
            vm_seq INTEGER NOT NULL DEFAULT 0);
        INSERT INTO jobs (job_id, spec_json, state, created, updated) VALUES ('j', '{}', 'running', 1, 1);
        """
    )
    conn.commit()
    conn.close()
    store = Store(str(path))
    job = store.job("j")
    assert job.state == "running" and job.calibration_state == "" and job.calibration_attempt == 0
    store.update_job("j", calibration_state="done")
    assert store.get_meta("schema_version") == str(SCHEMA_VERSION)
    store.close()
    assert Store(str(path)).job("j").calibration_state == "done"


# -- the agent's side: a real varuna-profile process --------------------------------------------------


def _run(tmp_path, argv: list[str], timeout_s: float) -> ProfileRun:
    import os

    return ProfileRun(
        attempt=1,
        argv=argv,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=str(tmp_path),
        timeout_s=timeout_s,
        log_dir=tmp_path,
        python=sys.executable,
    )


def _wait(run: ProfileRun, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = run.poll()
        if result is not None:
            return result
        time.sleep(0.05)
    run.kill()
    raise AssertionError(f"the profile run did not end within {timeout_s} s")


def test_a_failing_profile_run_reports_the_profilers_one_line(tmp_path):
    run = _run(tmp_path, ["--model", "profiler.targets:mlp", "--micro-batch-sizes", "0"], timeout_s=120)
    result = _wait(run, 120)
    assert not result.ok and result.calibration_json == ""
    assert result.error.startswith("varuna-profile exited with 2: error:") and "micro-batch" in result.error
    assert "\n" not in result.error


def test_a_profile_run_past_its_timeout_is_killed(tmp_path):
    run = _run(tmp_path, ["--model", "profiler.targets:mlp", "--micro-batch-sizes", "1"], timeout_s=0.5)
    result = _wait(run, 30)
    assert not result.ok and "did not finish within the profile's timeout_s = 0.5 s" in result.error
    assert not run.running


def test_failure_reason_keeps_one_line():
    assert failure_reason("a\nb\n", 1) == "varuna-profile exited with 1: b"
    assert len(failure_reason("x" * 1000, 1)) == 300


# -- the local provider's changing capacity -----------------------------------------------------------


def test_capacity_file_limits_the_local_provider(tmp_path):
    with pytest.raises(ValueError, match="absolute path"):
        LocalProviderOptions.from_dict({"capacity_file": "relative.txt"})
    capacity = tmp_path / "capacity"
    context = ProviderContext(
        manager_address="127.0.0.1:9", token_file=str(tmp_path / "t"), state_dir=str(tmp_path)
    )
    provider = LocalProvider(LocalProviderOptions.from_dict({"capacity_file": str(capacity)}), context)
    with pytest.raises(RuntimeError, match="write a VM count"):
        provider.create_vms("j", ["j-vm1"], 1, created_so_far=0)
    capacity.write_text("2\n")
    # Two VMs exist already: capacity 2 leaves no room (no agent is started).
    assert provider.create_vms("j", ["j-vm3"], 1, created_so_far=2) == []
    capacity.write_text("lots")
    with pytest.raises(RuntimeError, match="not a VM count"):
        provider.create_vms("j", ["j-vm3"], 1, created_so_far=2)
