"""Unit tests of the manager's pure parts: job specs, the state store, the decision rules,
Scheduled Events parsing and polling, the worker shim's engine swap."""

from __future__ import annotations

import http.server
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from manager.agent.scheduled_events import ScheduledEventsClient, parse_notices
from manager.domain.jobspec import JobSpec, load_jobspec
from manager.domain.policy import StutterConfig, StutterDetector, choose_layout, fallback_layout, grow_gain
from manager.domain.store import GenerationRecord, ProgressRecord, Store, VMRecord
from manager.transport.convert import spec_from_pb, spec_to_pb
from manager.worker.reporter import compute_times
from varuna.core.calibration import Calibration
from varuna.core.planning import PlanRequest
from varuna.core.timeline import Event

ROOT = Path(__file__).resolve().parents[1]

# A Scheduled Events document as Azure's Instance Metadata Service returns it (the example of
# https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events, with a Preempt).
RECORDED_EVENTS = {
    "DocumentIncarnation": 2,
    "Events": [
        {
            "EventId": "C7061BAC-AFDC-4513-B24B-AA5F13A16123",
            "EventStatus": "Scheduled",
            "EventType": "Preempt",
            "ResourceType": "VirtualMachine",
            "Resources": ["vm-evicted"],
            "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT",
            "Description": "Virtual machine is being evicted from Azure Spot.",
            "EventSource": "Platform",
            "DurationInSeconds": -1,
        },
        {
            "EventId": "F1A6A7D2-7B52-4BFF-8C8E-2A0F21E9E0B1",
            "EventStatus": "Scheduled",
            "EventType": "Freeze",
            "ResourceType": "VirtualMachine",
            "Resources": ["vm-other"],
            "NotBefore": "Mon, 11 Apr 2022 22:30:00 GMT",
            "Description": "Host maintenance",
            "EventSource": "Platform",
            "DurationInSeconds": 9,
        },
    ],
}


# -- job specs ------------------------------------------------------------------------------------


def test_jobspec_round_trip_and_paths(tmp_path):
    (tmp_path / "job.toml").write_text(
        textwrap.dedent("""
        name = "gpt"
        script = "train.py"
        args = ["--steps", "40"]
        global_batch_size = 24
        micro_batch_size = 2
        checkpoint_dir = "ckpt"
        checkpoint_every = 2
        max_vms = 6
        min_vms = 2
        target_steps = 40
        calibration = "cal.json"
        [env]
        OMP_NUM_THREADS = "1"
    """)
    )
    spec = load_jobspec(tmp_path / "job.toml")
    assert spec.script == str(tmp_path / "train.py") and spec.workdir == str(tmp_path)
    assert spec.checkpoint_dir == str(tmp_path / "ckpt") and spec.calibration == str(tmp_path / "cal.json")
    back = spec_from_pb(spec_to_pb(spec))
    assert back.to_dict() == {**spec.to_dict(), "calibration": ""}  # the content travels, not the path


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"script": ""}, "'script' is required"),
        ({"global_batch_size": 0}, "'global_batch_size' must be an integer >= 1"),
        ({"max_vms": True}, "'max_vms' must be an integer"),
        ({"min_vms": 3, "max_vms": 2}, "min_vms 3 exceeds max_vms 2"),
        ({"provider": "gcp"}, "unknown provider 'gcp'"),
        ({"env": {"VARUNA_MANAGER": "x"}}, "may not set VARUNA_MANAGER"),
        ({"pipeline_depth": 9}, "pipeline_depth 9 exceeds"),
        ({"args": "--steps 3"}, "'args' must be a list"),
    ],
)
def test_jobspec_errors_are_one_line_with_the_fix(patch, message):
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


def test_jobspec_missing_fields():
    with pytest.raises(ValueError, match="missing required field"):
        JobSpec.from_dict({"script": "x"})


# -- store ----------------------------------------------------------------------------------------


def test_store_is_wal_and_survives_reopen(tmp_path):
    path = str(tmp_path / "state.sqlite")
    store = Store(path)
    store.add_job("j", {"script": "x"}, "")
    store.add_vm(VMRecord(vm_id="v1", job_id="j", provider="local", seq=1, state="up", slots=1, created=1.0))
    store.add_generation(
        GenerationRecord(
            job_id="j",
            generation=1,
            state="running",
            pipeline_depth=2,
            data_parallel=3,
            micro_batch_size=2,
            vms_json='["v1"]',
            master_addr="127.0.0.1",
            master_port=1234,
            launched=2.0,
        )
    )
    store.add_progress(
        ProgressRecord(
            job_id="j",
            generation=1,
            step=5,
            time=3.0,
            samples_per_s=10.0,
            loss=2.0,
            pipeline_depth=2,
            data_parallel=3,
        )
    )
    store.add_event("j", "launched", "hello", data={"P": 2})
    store.close()
    mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    again = Store(path)
    job = again.job("j")
    assert job.state == "running" and job.generation == 1
    assert again.generation("j", 1).vm_ids == ["v1"]
    assert again.vms("j")[0].slots == 1
    assert [p.step for p in again.progress("j")] == [5]
    assert again.events("j")[0].data == {"P": 2}


def test_store_concurrent_writers(tmp_path):
    store = Store(str(tmp_path / "state.sqlite"))
    store.add_job("j", {}, "")

    def write(i: int) -> None:
        for k in range(50):
            store.add_event("j", "x", f"{i}-{k}")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(store.events("j")) == 200


# -- policy ---------------------------------------------------------------------------------------


def test_fallback_layout():
    assert (fallback_layout(slots=[1] * 6, global_batch_size=24, num_segments=4).pipeline_depth) == 1
    assert fallback_layout(slots=[1] * 5, global_batch_size=24, num_segments=5).world_size == 5
    plan = fallback_layout(slots=[2, 2, 1], global_batch_size=24, pipeline_depth=2)
    assert (plan.pipeline_depth, plan.data_parallel) == (2, 2)
    # P must divide the segments: 3 slots and 4 segments -> 1x3 (P=2 would use only 2 slots).
    assert fallback_layout(slots=[1] * 3, global_batch_size=24, num_segments=4).world_size == 3
    # D never exceeds the micro-batches of the mini-batch.
    assert fallback_layout(slots=[1] * 8, global_batch_size=8, micro_batch_size=2).data_parallel == 4
    with pytest.raises(ValueError, match="needs 4 slots"):
        fallback_layout(slots=[1] * 3, global_batch_size=8, pipeline_depth=4)


def test_choose_layout_uses_the_simulator_with_a_calibration():
    cal = Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1, 2, 4))
    request = PlanRequest(calibration=cal, global_batch_size=24, micro_batch_size=2)
    plan = choose_layout(slots=[1] * 6, request=request)
    assert plan.source.startswith("simulator") and plan.world_size <= 6
    assert plan.predicted_samples_per_s > 0 and plan.micro_batch_size == 2
    from simulator.autoconfig import autoconfigure

    best = autoconfigure(cal, gpus=6, global_batch_size=24, micro_batch_size=2).best
    assert (plan.pipeline_depth, plan.data_parallel) == (best.num_stages, best.num_replicas)
    smaller = choose_layout(slots=[1] * 3, request=request)
    assert grow_gain(smaller, plan) > 0


def test_stutter_detector_median_rule_needs_n_in_a_row():
    det = StutterDetector(StutterConfig(threshold_pct=50.0, heartbeats=3))
    peers = [0.010, 0.011, 0.030]
    verdicts = [
        det.observe(key=("j", 1, 2), step=s, compute_s=0.030, replica_compute_s=peers) for s in (1, 2)
    ]
    assert [v.slow_heartbeat for v in verdicts] == [True, True] and not any(v.marked for v in verdicts)
    assert not det.observe(key=("j", 1, 2), step=2, compute_s=0.03, replica_compute_s=peers).marked  # repeat
    assert not det.observe(key=("j", 1, 2), step=3, compute_s=0.012, replica_compute_s=peers).slow_heartbeat
    for s in (4, 5):
        assert not det.observe(key=("j", 1, 2), step=s, compute_s=0.03, replica_compute_s=peers).marked
    v = det.observe(key=("j", 1, 2), step=6, compute_s=0.03, replica_compute_s=peers)
    assert v.marked and v.rule == "median" and v.reference_s == pytest.approx(0.011)


def test_stutter_detector_calibration_rule_below_three_replicas():
    det = StutterDetector(StutterConfig(threshold_pct=100.0, heartbeats=1))
    v = det.observe(key=("j", 1, 0), step=1, compute_s=0.05, replica_compute_s=[0.05, 0.01], predicted_s=0.02)
    assert v.rule == "calibration" and v.marked
    v = det.observe(key=("j", 1, 1), step=1, compute_s=0.05, replica_compute_s=[0.05])
    assert v.rule == "none" and not v.slow_heartbeat


def test_compute_times_from_a_timeline():
    events = [
        Event(0, 0, "F", 0, 0.0, 0.1),
        Event(0, 0, "F", 1, 0.1, 0.3),
        Event(0, 0, "R", 0, 0.3, 0.4),
        Event(0, 0, "B", 0, 0.4, 0.6),
        Event(1, 0, "F", 0, 0.0, 9.0),
        Event(0, 0, "AR", None, 0.6, 0.7),
    ]
    assert compute_times(events, 0, 0) == (0.15, 0.2, 0.1, 2)


# -- Scheduled Events -----------------------------------------------------------------------------


def test_parse_notices_picks_this_vms_preempt_only():
    assert [n.event_type for n in parse_notices(RECORDED_EVENTS, "vm-evicted")] == ["Preempt"]
    assert parse_notices(RECORDED_EVENTS, "vm-other") == []  # Freeze does not end the VM
    assert parse_notices({"DocumentIncarnation": 1, "Events": []}, "vm-evicted") == []
    done = json.loads(json.dumps(RECORDED_EVENTS))
    done["Events"][0]["EventStatus"] = "Completed"
    assert parse_notices(done, "vm-evicted") == []


class _MetadataHandler(http.server.BaseHTTPRequestHandler):
    document: dict = {}
    posts: list = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.headers.get("Metadata") != "true":
            self.send_error(400, "Metadata header missing")
            return
        body = json.dumps(self.document).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length", "0"))
        self.posts.append(json.loads(self.rfile.read(length)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def metadata_server():
    handler = type("Handler", (_MetadataHandler,), {"document": RECORDED_EVENTS, "posts": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield (
        f"http://127.0.0.1:{httpd.server_address[1]}/metadata/scheduledevents?api-version=2020-07-01",
        handler,
    )
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


def test_scheduled_events_client_against_a_recorded_document(metadata_server):
    url, handler = metadata_server
    client = ScheduledEventsClient(url, "vm-evicted")
    notices = client.poll()
    assert [(n.event_id, n.event_type) for n in notices] == [
        ("C7061BAC-AFDC-4513-B24B-AA5F13A16123", "Preempt")
    ]
    assert client.approve(notices[0].event_id)
    assert handler.posts == [{"StartRequests": [{"EventId": "C7061BAC-AFDC-4513-B24B-AA5F13A16123"}]}]
    assert ScheduledEventsClient("http://127.0.0.1:1/none", "vm-evicted", timeout_s=1).poll() == []


# -- worker shim ----------------------------------------------------------------------------------


def test_worker_shim_runs_a_script_like_python_does(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        textwrap.dedent("""
        import sys, os
        here = os.path.dirname(os.path.abspath(__file__))
        print(__name__, sys.argv[1:], os.path.dirname(sys.path[0]) == os.path.dirname(here))
        sys.exit(3)
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("VARUNA_MANAGER", None)
    run = subprocess.run(
        [sys.executable, "-m", "manager.worker.shim", str(script), "a", "--b"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert run.returncode == 3 and run.stdout.split()[:3] == ["__main__", "['a',", "'--b']"]


def test_worker_shim_names_its_engine_plugins_without_importing_torch(tmp_path):
    # The shim patches nothing: it names the engine plugins (the engine calls them once built).
    code = textwrap.dedent("""
        import sys
        from manager.worker import shim as worker_shim
        env = {}
        worker_shim.enable_engine_plugins(env)
        assert "varuna.runtime.engine" not in sys.modules and "torch" not in sys.modules
        print(env["VARUNA_ENGINE_PLUGINS"])
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == (
        "manager.worker.shim:release_early_stop,manager.worker.reporter:attach_to_engine"
    )


def test_standby_worker_takes_a_job_with_its_environment(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\n"
        "print(os.environ.get('JOB_VAR'), os.environ.get('STALE'), sys.argv[1:], os.getcwd())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VARUNA_STANDBY_PRELOAD": "json", "STALE": "from-standby"}
    standby = subprocess.Popen(
        [sys.executable, "-m", "manager.worker.shim", "--standby"], stdin=subprocess.PIPE, env=env, cwd=ROOT
    )
    job = {
        "argv": [str(script), "--x", "1"],
        "env": {"PATH": os.environ["PATH"], "JOB_VAR": "from-job", "PYTHONPATH": str(ROOT)},
        "cwd": str(tmp_path),
        "log": str(tmp_path / "worker.log"),
    }
    standby.stdin.write(json.dumps(job).encode() + b"\n")
    standby.stdin.close()
    assert standby.wait(60) == 0
    # Exactly the job's environment (nothing left over from the standby's), directory and log.
    assert (tmp_path / "worker.log").read_text().split() == [
        "from-job",
        "None",
        "['--x',",
        "'1']",
        str(tmp_path),
    ]
    unused = subprocess.Popen(
        [sys.executable, "-m", "manager.worker.shim", "--standby"], stdin=subprocess.PIPE, env=env, cwd=ROOT
    )
    unused.stdin.close()  # the agent went away without a job for it
    assert unused.wait(60) == 0


def test_worker_shim_fast_exit_keeps_what_a_normal_exit_keeps(tmp_path):
    """Note [Fast exit]: non-daemon threads finish, atexit handlers run, open files are flushed."""
    script = tmp_path / "s.py"
    out = tmp_path / "out"
    script.write_text(
        textwrap.dedent(f"""
        import atexit, threading, time
        f = open({str(out)!r}, "w")          # left open: its buffer must still reach the disk
        f.write("buffered;")
        atexit.register(lambda: open({str(out)!r} + ".atexit", "w").write("ran"))
        threading.Thread(target=lambda: (time.sleep(0.5), f.write("thread;"))).start()
        raise SystemExit(4)
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "manager.worker.shim", str(script)], env=env, timeout=60)
    assert run.returncode == 4
    assert out.read_text() == "buffered;thread;" and (tmp_path / "out.atexit").read_text() == "ran"


@pytest.mark.parametrize(
    "module",
    [
        "manager.common.wire",
        "manager.domain.errors",
        "manager.domain.messages",
        "manager.domain.ports",
        "manager.domain.launches",
        "manager.domain.context",
        "manager.providers.base",
        "manager.providers.registry",
        "manager.providers.agent_start",
        "manager.agent.notices",
        "manager.transport.convert",
        "manager.common.log_lines",
        "manager.common.descriptors",
        "manager.common.daemon_lock",
        "manager.domain.state_file",
        "manager.domain.store_schema",
    ],
)
def test_seam_docstring_examples(module):
    """The examples in the docstrings of the manager's seams (issue 28) run as written."""
    import doctest
    import importlib

    failures, tried = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert failures == 0 and tried > 0


def _port_cases():
    from manager.domain.calibration_orders import CalibrationOrders
    from manager.domain.launches import WorkerLaunches
    from manager.domain.live_runs import LiveRuns
    from manager.domain.morph_planner import MorphPlanner
    from manager.domain.pool_rounds import PoolRounds
    from manager.domain.ports import (
        Calibrations,
        Launches,
        LiveMorph,
        NoLiveMorph,
        NoPool,
        Planner,
        SharedPool,
    )

    return [
        (Calibrations, CalibrationOrders),
        (Planner, MorphPlanner),
        (Launches, WorkerLaunches),
        (LiveMorph, LiveRuns),
        (LiveMorph, NoLiveMorph),
        (SharedPool, PoolRounds),
        (SharedPool, NoPool),
    ]


@pytest.mark.parametrize("port, impl", _port_cases(), ids=lambda c: c.__name__)
def test_the_parts_implement_their_ports(port, impl):
    """Every member of a port (manager/domain/ports.py) exists on each implementation, the real
    one and the null one, with the same parameters: a method added to one side only breaks this."""
    import inspect

    members = [n for n in vars(port) if not n.startswith("_")]
    assert members
    for name in members:
        want = vars(port)[name]
        assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
        if isinstance(want, property):
            continue  # a property on the port; a plain attribute may implement it (NoPool.active)
        got = inspect.signature(getattr(impl, name))
        params = [p for p in inspect.signature(want).parameters if p != "self"]
        assert [p for p in got.parameters if p != "self"] == params, (impl.__name__, name)
