"""Issue #17, bad inputs of ``varuna-launch`` and ``varuna-manager``: each is refused with one line
and a non-zero exit before anything runs (no worker forked, no second daemon supervising a job).
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from manager import cli as manager_cli
from manager.common.daemon_lock import DaemonLock, DaemonLockHeld
from manager.domain.jobspec import MAX_VMS, JobSpec
from manager.transport.server import ManagerServer, ServeConfig, insecure_listen_warning
from varuna.launch.hosts import assign_slots, parse_hosts_arg
from varuna.launch.job import launch, launch_on_hosts
from varuna.launch.launcher import main as launch_main
from varuna.launch.spec import LaunchConfig, default_max_procs_per_host

ROOT = Path(__file__).resolve().parents[1]


def _script(tmp_path: Path) -> str:
    script = tmp_path / "ok.py"
    script.write_text("raise SystemExit('must not run')\n")
    return str(script)


def _one_error_line(text: str, prog: str) -> str:
    lines = text.splitlines()
    assert len(lines) == 1, text
    assert lines[0].startswith(f"{prog}: error: "), text
    return lines[0]


@pytest.fixture
def listening_port():
    """A port something listens on (what a busy --master-port / --listen finds)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# varuna-launch


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--procs", "100000", "--pipeline-depth", "1"], "100000 workers on this machine exceed the limit"),
        (["--procs", "100000", "--calibration", "cal.json"], "100000 workers on this machine exceed"),
        (["--procs", "4", "--pipeline-depth", "1", "--max-procs-per-host", "2"], "--max-procs-per-host 4"),
        (["--procs", "2", "--pipeline-depth", "1", "--max-procs-per-host", "100000"], "must be 1..1024"),
        (["--hosts", "localhost slots=100000", "--pipeline-depth", "1"], "on host localhost exceed"),
        (["--hosts", "localhost,localhost", "--procs-per-host", "3", "--pipeline-depth", "1",
          "--max-procs-per-host", "4"], "6 workers on this machine (its pretend localhost hosts"),
        (["--procs", "2", "--pipeline-depth", "1", "--stop-timeout", "nan"], "--stop-timeout must be >= 0"),
        (["--hosts", "localhost", "--procs-per-host", "1", "--pipeline-depth", "1",
          "--ssh-connect-timeout", "inf"], "--ssh-connect-timeout must be > 0"),
        (["--procs", "4", "--pipeline-depth", "1", "--global-batch-size", "3"], "D=4: global batch size 3"),
        (["--procs", "2", "--pipeline-depth", "1", "--log-dir", "FILE/logs"], "--log-dir"),
        (["--procs", "2", "--pipeline-depth", "1", "--master-port", "BUSY"], "is in use on this machine"),
    ],
)  # fmt: skip
def test_launcher_refuses_before_spawning(argv, needle, tmp_path, capsys, listening_port):
    (tmp_path / "file").write_text("")
    subs = {"FILE/logs": str(tmp_path / "file" / "logs"), "BUSY": str(listening_port)}
    argv = [subs.get(a, a) for a in argv] + [_script(tmp_path)]
    assert launch_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert needle in _one_error_line(captured.err, "varuna-launch")


def test_launch_api_bounds_workers_per_host(tmp_path):
    script = _script(tmp_path)
    with pytest.raises(ValueError, match="100000 workers on this machine exceed"):
        launch(LaunchConfig(script=script, pipeline_depth=1, data_parallel=100000))
    entries = assign_slots(parse_hosts_arg("localhost slots=5000"), None)
    with pytest.raises(ValueError, match="5000 workers on host localhost exceed"):
        launch_on_hosts(LaunchConfig(script=script, pipeline_depth=1, data_parallel=5000), entries)
    assert default_max_procs_per_host() == max(8, 4 * (os.cpu_count() or 1))


# ----------------------------------------------------------------------------------------------
# varuna-manager: job specs


def test_jobspec_caps_max_vms_and_local_processes(tmp_path):
    base = dict(script="train.py", global_batch_size=8, checkpoint_dir="ckpt", target_steps=3)
    with pytest.raises(ValueError, match=f"max_vms 100000 is above the limit of {MAX_VMS}"):
        JobSpec(**base, max_vms=100000, provider="azure")
    with pytest.raises(ValueError, match="procs_per_vm 1000 is above the limit"):
        JobSpec(**base, max_vms=1, procs_per_vm=1000, provider="azure")
    too_many = default_max_procs_per_host() + 1
    with pytest.raises(ValueError, match="the local provider would run"):
        JobSpec(**base, max_vms=too_many)
    # Pretend VMs that will never be created do not count (tests submit such jobs).
    JobSpec(**base, max_vms=too_many, provider_options={"max_created": 0})
    JobSpec(**base, max_vms=MAX_VMS, provider="azure")


# ----------------------------------------------------------------------------------------------
# varuna-manager serve


def _token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(secrets.token_urlsafe(32) + "\n")
    path.chmod(0o600)
    return path


def _server(tmp_path: Path, db: Path) -> ManagerServer:
    return ManagerServer(
        ServeConfig(
            db=str(db), listen="127.0.0.1:0", token_file=str(_token(tmp_path)), manager={"tick_s": 0.05}
        )
    )


def test_second_manager_on_one_database_refuses(tmp_path, capsys):
    db = tmp_path / "state.sqlite"
    first = _server(tmp_path, db)
    first.start()
    try:
        with pytest.raises(
            DaemonLockHeld, match=f"another varuna-manager \\(PID {os.getpid()}\\) is serving"
        ):
            _server(tmp_path, db)
        argv = ["serve", "--db", str(db), "--token-file", str(tmp_path / "token"), "--listen", "127.0.0.1:0"]
        assert manager_cli.main(argv) == 1
        line = _one_error_line(capsys.readouterr().err, "varuna-manager")
        assert "another varuna-manager" in line and "state.sqlite.lock" in line
    finally:
        first.stop()
    # Stopped: the state file is free again.
    second = _server(tmp_path, db)
    second.stop()


@pytest.mark.slow
def test_killed_manager_does_not_block_its_successor(tmp_path):
    db = str(tmp_path / "state.sqlite")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from manager.common.daemon_lock import DaemonLock; DaemonLock.acquire(sys.argv[1]);"
            " print('locked', flush=True); sys.stdin.read()",
            db,
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DaemonLockHeld, match=f"PID {holder.pid}"):
            DaemonLock.acquire(db)
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(timeout=30) == -signal.SIGKILL
        DaemonLock.acquire(db).release()  # the kernel dropped the dead holder's lock
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
        holder.stdin.close()
        holder.stdout.close()


def test_serve_port_in_use_and_unwritable_db_are_one_line(tmp_path, capfd, listening_port):
    token = str(_token(tmp_path))
    argv = ["serve", "--db", str(tmp_path / "s.sqlite"), "--token-file", token]
    assert manager_cli.main([*argv, "--listen", f"127.0.0.1:{listening_port}"]) == 1
    # capfd: grpc's own logging would write to file descriptor 2 directly.
    line = _one_error_line(capfd.readouterr().err, "varuna-manager")
    assert "the port is in use" in line
    (tmp_path / "file").write_text("")
    bad = [*argv[:1], "--db", str(tmp_path / "file" / "s.sqlite"), *argv[3:], "--listen", "127.0.0.1:0"]
    assert manager_cli.main(bad) == 1
    assert "cannot create the state file" in _one_error_line(capfd.readouterr().err, "varuna-manager")
    (tmp_path / "junk.sqlite").write_text("not a database\n" * 100)
    junk = [*argv[:1], "--db", str(tmp_path / "junk.sqlite"), *argv[3:], "--listen", "127.0.0.1:0"]
    assert manager_cli.main(junk) == 1
    assert "cannot open the state file" in _one_error_line(capfd.readouterr().err, "varuna-manager")
    # Every failed start let go of its state file's lock.
    DaemonLock.acquire(str(tmp_path / "s.sqlite")).release()
    DaemonLock.acquire(str(tmp_path / "junk.sqlite")).release()


@pytest.mark.parametrize(
    "option", ["--heartbeat-timeout", "--stop-timeout", "--kill-timeout", "--gather-timeout",
               "--register-timeout", "--orphan-timeout", "--heartbeat-interval", "--create-retry"]
)  # fmt: skip
def test_serve_refuses_negative_timeouts(option, tmp_path, capsys):
    argv = ["serve", "--db", str(tmp_path / "s.sqlite"), "--token-file", str(_token(tmp_path)), option, "-1"]
    assert manager_cli.main(argv) == 2
    assert option in capsys.readouterr().err.splitlines()[0]
    assert not (tmp_path / "s.sqlite").exists()


def test_non_loopback_listen_without_tls_warns():
    assert insecure_listen_warning("127.0.0.1", tls=False) is None
    assert insecure_listen_warning("localhost", tls=False) is None
    assert insecure_listen_warning("[::1]", tls=False) is None
    assert insecure_listen_warning("0.0.0.0", tls=True) is None
    for host in ("0.0.0.0", "[::]", "10.0.0.5", "myhost"):
        warning = insecure_listen_warning(host, tls=False)
        assert warning is not None and "without TLS" in warning and "--tls-cert" in warning


@pytest.mark.parametrize(
    "extra, code, needle",
    [
        (["--state-dir", "FILE/vms"], 1, "--state-dir"),
        (["--advertise", "nonsense"], 2, "--advertise 'nonsense' is not HOST:PORT"),
    ],
)
def test_serve_refuses_bad_paths_and_addresses_before_serving(extra, code, needle, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    extra = [str(tmp_path / "file" / "vms") if a == "FILE/vms" else a for a in extra]
    db = tmp_path / "s.sqlite"
    argv = [
        "serve",
        "--db",
        str(db),
        "--token-file",
        str(_token(tmp_path)),
        "--listen",
        "127.0.0.1:0",
        *extra,
    ]
    assert manager_cli.main(argv) == code
    assert needle in _one_error_line(capsys.readouterr().err, "varuna-manager")
    DaemonLock.acquire(str(db)).release()
