"""The manager with real processes: ``varuna-manager serve`` in a subprocess, the local provider's
pretend VMs (agent process groups) and a torch-free stand-in training script
(tests/workers/manager_fake_worker.py). One job goes through every kind of trouble: a VM killed
with ``kill -9``, a fail-stutter VM, an Azure Scheduled Events eviction notice (served by a local
HTTP server from a recorded document), and a ``kill -9`` of the manager itself; it must still
finish, redo at most a checkpoint interval per unannounced loss, and leave no process behind.
The same with the real GPT example is tests/test_manager_e2e.py."""

from __future__ import annotations

import http.server
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from manager import cli
from manager.common.procs import find_free_port
from manager.transport.client import ClientConfig, ManagerClient

ROOT = Path(__file__).resolve().parents[1]
FAKE_WORKER = ROOT / "tests" / "workers" / "manager_fake_worker.py"

pytestmark = pytest.mark.slow


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


class ManagerProcess:
    """``varuna-manager serve`` as a child process, restartable on the same state file."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.tmp_path = tmp_path
        self.token = tmp_path / "token"
        self.token.write_text(secrets.token_urlsafe(32))
        self.token.chmod(0o600)
        self.address = f"127.0.0.1:{find_free_port('127.0.0.1')}"
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.tmp_path / f"manager-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "manager.cli",
                "serve",
                "--db",
                str(self.tmp_path / "state.sqlite"),
                "--listen",
                self.address,
                "--token-file",
                str(self.token),
                *self.extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        log.close()
        client = self.client()
        wait_for(lambda: _answers(client), 30, "the manager to answer")
        client.close()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def kill_vms(self) -> None:
        """Terminate every pretend VM the state file knows (cleanup after a failed test: a live job
        keeps its agents running, by design, until their orphan timeout)."""
        from manager.common.procs import terminate_group
        from manager.domain.store import Store

        db = self.tmp_path / "state.sqlite"
        if not db.exists():
            return
        store = Store(str(db))
        try:
            for job in store.jobs():
                for vm in store.vms(job.job_id):
                    pid = int(vm.ref.get("pid", 0) or 0)
                    if pid:
                        terminate_group(pid, vm.ref.get("start_time"), 3.0)
        finally:
            store.close()

    def client(self) -> ManagerClient:
        # A generous deadline: the test machine may be loaded far beyond its 2 cores.
        return ManagerClient(
            ClientConfig(address=self.address, token=self.token.read_text().strip(), timeout_s=30.0)
        )

    def cli(self, *args: str) -> int:
        return cli.main([*args, "--manager", self.address, "--token-file", str(self.token)])


def _answers(client: ManagerClient) -> bool:
    try:
        client.status()
        return True
    except Exception:
        return False


class MetadataServer:
    """Azure's Scheduled Events endpoint, replaying a recorded document (empty until armed)."""

    def __init__(self) -> None:
        self.document = {"DocumentIncarnation": 1, "Events": []}
        self.approvals: list[dict] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = json.dumps(outer.document).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                outer.approvals.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = (
            f"http://127.0.0.1:{self.httpd.server_address[1]}/metadata/scheduledevents?api-version=2020-07-01"
        )
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def preempt(self, vm_name: str) -> None:
        """Arm a recorded Preempt event (format of Azure's documentation) for ``vm_name``."""
        self.document = {
            "DocumentIncarnation": 2,
            "Events": [
                {
                    "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
                    "EventStatus": "Scheduled",
                    "EventType": "Preempt",
                    "ResourceType": "VirtualMachine",
                    "Resources": [vm_name],
                    "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
                    "Description": "",
                    "EventSource": "Platform",
                    "DurationInSeconds": -1,
                }
            ],
        }

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def status(mp: ManagerProcess, job_id: str):
    with mp.client() as c:
        return c.status(job_id)[0]


def events(mp: ManagerProcess, job_id: str):
    with mp.client() as c:
        return c.events(job_id)


def kinds(mp: ManagerProcess, job_id: str) -> list[str]:
    return [e.kind for e in events(mp, job_id)]


def processes_mentioning(text: str) -> list[int]:
    """Live processes with ``text`` in their command line or environment (agents name their job
    on the command line; workers and standby workers carry ``VARUNA_JOB_ID`` in their environment)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (entry / "environ").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (text in cmdline or text in environ) and state != "Z":
            pids.append(int(entry.name))
    return pids


def test_local_provider_through_every_kind_of_trouble(tmp_path):
    md = MetadataServer()
    mp = ManagerProcess(
        tmp_path,
        "--heartbeat-interval",
        "0.25",
        "--heartbeat-timeout",
        "2",
        "--slow-threshold-pct",
        "100",
        "--slow-heartbeats",
        "3",
        "--stop-timeout",
        "20",
        "--orphan-timeout",
        "30",
        "--gather-timeout",
        "30",
    )
    metrics = tmp_path / "metrics.jsonl"
    ckpt = tmp_path / "ckpt"
    spec = {
        "name": "fake",
        "script": str(FAKE_WORKER),
        "args": ["--steps", "70", "--step-time", "0.08", "--metrics-out", str(metrics)],
        "global_batch_size": 8,
        "checkpoint_dir": str(ckpt),
        "checkpoint_every": 3,
        "min_vms": 1,
        "max_vms": 4,
        "target_steps": 70,
        "num_segments": 4,
        "provider_options": {
            "metadata_url": md.url,
            "approve_notices": True,
            "max_created": 4,
            "standby_delay_s": 0.5,
        },
        # Standby workers of a torch-free script need not import torch.
        "env": {"VARUNA_STANDBY_PRELOAD": ""},
    }
    (tmp_path / "job.json").write_text(json.dumps(spec))
    mp.start()
    job = None
    try:
        client = mp.client()
        from manager.domain.jobspec import load_jobspec
        from manager.transport.convert import spec_to_pb

        job = client.submit(spec_to_pb(load_jobspec(tmp_path / "job.json")))
        client.close()
        wait_for(lambda: status(mp, job).step >= 6, 60, "training to start")
        st = status(mp, job)
        assert (st.pipeline_depth, st.data_parallel) == (1, 4)

        # 1. A VM vanishes (kill -9 of its process group, workers included).
        victim = st.vms[1]
        os.killpg(victim.agent_pid, signal.SIGKILL)
        wait_for(lambda: kinds(mp, job).count("resumed") >= 1, 60, "the morph after kill -9")
        st = status(mp, job)
        assert st.data_parallel == 3 and not any(v.in_generation for v in st.vms if v.vm_id == victim.vm_id)

        # 2. A fail-stutter VM: 10x slower compute, detected and left out.
        slow_vm = next(v.vm_id for v in st.vms if v.in_generation and v.vm_id != victim.vm_id)
        (ckpt / f"slow-{slow_vm}").write_text("")
        wait_for(lambda: kinds(mp, job).count("resumed") >= 2, 60, "the morph after the slow VM")
        (ckpt / f"slow-{slow_vm}").unlink()
        slow_events = [e for e in events(mp, job) if e.kind == "slow"]
        assert [e.vm_id for e in slow_events] == [slow_vm]
        st = status(mp, job)
        assert st.data_parallel == 2 and not any(v.in_generation for v in st.vms if v.vm_id == slow_vm)
        assert {v.vm_id: v.health for v in st.vms}[slow_vm] == "slow"

        # 3. The manager is killed; a new one takes over the same state file.
        step_before = status(mp, job).step
        mp.kill()
        time.sleep(1.0)
        mp.start()
        wait_for(lambda: status(mp, job).step > step_before + 3, 30, "progress under the new manager")
        assert "manager-started" in kinds(mp, job)
        assert not [e for e in events(mp, job) if e.kind == "vm-gone" and e.vm_id not in (victim.vm_id,)]

        # 4. An eviction notice (Azure Scheduled Events): checkpoint first, then the VM goes.
        st = status(mp, job)
        noticed = next(v for v in st.vms if v.in_generation)
        md.preempt(noticed.vm_id)
        wait_for(lambda: "preempt-notice" in kinds(mp, job), 30, "the notice")
        wait_for(lambda: kinds(mp, job).count("resumed") >= 3, 60, "the morph after the notice")
        wait_for(lambda: md.approvals, 10, "the agent to approve the event")
        os.killpg(noticed.agent_pid, signal.SIGKILL)  # the platform evicts it

        wait_for(lambda: status(mp, job).state == "finished", 90, "the job to finish")
        evs = events(mp, job)
        ended = [json.loads(e.data_json) for e in evs if e.kind == "generation-ended"]
        assert [e["graceful"] for e in ended] == [False, True, True, True]  # kill -9, slow, notice, done
        resumed = [json.loads(e.data_json) for e in evs if e.kind == "resumed"]
        assert resumed[0]["redone_steps"] <= 2 * spec["checkpoint_every"] - 1  # a save may be committing
        assert all(r["redone_steps"] == 0 for r in resumed[1:])  # graceful stops checkpoint the last step
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert rows[-1]["step"] == 70 and {r["step"] for r in rows} == set(range(1, 71))
        agent_logs = "".join(p.read_text() for p in (tmp_path / "state.sqlite.d").glob("*/*/agent.log"))
        assert "(standby)" in agent_logs  # later generations started from pre-imported workers
        # Output of the CLI a user sees (latencies printed).
        assert mp.cli("events", job) == 0
        # No orphans: the finished job's agents and workers are gone, by themselves.
        wait_for(
            lambda: not processes_mentioning(job) and not processes_mentioning(str(metrics)),
            20,
            "every agent and worker to exit",
        )
    finally:
        mp.stop()
        md.close()
        mp.kill_vms()


def test_agents_and_workers_exit_when_the_manager_never_comes_back(tmp_path):
    """No orphans: an agent that hears nothing from its manager for --orphan-timeout seconds kills
    its workers and exits; an agent that cannot reach any manager at start gives up too."""
    mp = ManagerProcess(
        tmp_path, "--heartbeat-interval", "0.25", "--heartbeat-timeout", "2", "--orphan-timeout", "2"
    )
    spec = {
        "name": "orphan",
        "script": str(FAKE_WORKER),
        "args": ["--steps", "100000", "--step-time", "0.05"],
        "global_batch_size": 8,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "max_vms": 2,
        "target_steps": 100000,
        "provider_options": {"standby": False},
    }
    (tmp_path / "job.json").write_text(json.dumps(spec))
    mp.start()
    try:
        from manager.domain.jobspec import load_jobspec
        from manager.transport.convert import spec_to_pb

        with mp.client() as c:
            job = c.submit(spec_to_pb(load_jobspec(tmp_path / "job.json")))
        wait_for(lambda: status(mp, job).step >= 3, 60, "training to start")
        assert len(processes_mentioning(job)) == 4  # two agents and their workers
    except BaseException:
        mp.kill_vms()
        raise
    finally:
        mp.kill()  # and never restarted
    wait_for(
        lambda: not processes_mentioning(job) and not processes_mentioning(str(FAKE_WORKER)),
        30,
        "agents and workers to give up on the manager",
    )
    lonely = subprocess.run(
        [
            sys.executable,
            "-m",
            "manager.agent.vm_agent",
            "--manager",
            "127.0.0.1:1",
            "--token-file",
            str(mp.token),
            "--vm-id",
            "x",
            "--orphan-timeout",
            "1",
            "--log-dir",
            str(tmp_path / "lonely"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert lonely.returncode == 3 and "no manager" in lonely.stderr
