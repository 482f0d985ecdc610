"""Tests of the multi-host launcher: host files and their validation (varuna.launch.hosts, .ssh), the
per-host agent (varuna.launch.agent, .agent_host, .protocol), and whole jobs over pretend
``localhost`` hosts and over a real OpenSSH server on loopback.

The sshd tests start Debian's ``/usr/sbin/sshd`` as a child with host and user keys generated
into tmp_path, a non-standard port, and ``AuthorizedKeysFile``/``PidFile`` in tmp_path; they skip
when sshd is not installed (``scripts/setup.sh`` installs it). Both "hosts" are loopback
addresses (127.0.0.1 and 127.0.0.2) of this machine. "No process left behind" is checked by pid
(workers write pid files) and by scanning the process table for the job id that names every
agent's and ssh client's command line, with bounded polling, never by sleeping.
"""

from __future__ import annotations

import getpass
import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import varuna.runtime.engine
from varuna.core.planning import PlanRequest
from varuna.launch.hosts import (
    HostEntry,
    assign_slots,
    parse_host_entry,
    parse_host_file,
    parse_hosts_arg,
    select_hosts,
)
from varuna.launch.job import launch_on_hosts
from varuna.launch.launcher import main
from varuna.launch.layout import Layout, resolve_layout
from varuna.launch.protocol import decode_message, encode_message
from varuna.launch.spec import LaunchConfig
from varuna.launch.ssh import SshOptions, probe_hosts, remote_agent_command
from varuna.testing.sshd import SshKeys, sshd_unavailable, start_sshd, stop_sshd

ROOT = Path(__file__).resolve().parent.parent
PREFIX_RE = re.compile(r"^\[h(\d+)=(\S+) rank (\d+) stage (\d+) replica (\d+)\] (.*)$")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """True if ``pid`` is a live process (a zombie counts as gone: it runs no code)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _processes_mentioning(needle: str) -> list[tuple[int, str]]:
    """Live processes whose command line contains ``needle`` (not this test process)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline and _alive(int(entry.name)):
            found.append((int(entry.name), cmdline))
    return found


def _children(pid: int) -> list[int]:
    """Live direct children of ``pid``."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            kids.append(int(entry.name))
    return kids


def _wait_until(predicate, timeout_s: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


def _assert_nothing_left(job_id: str, pids: list[int], sshd: Sshd | None = None) -> None:
    """No worker pid alive, no agent/ssh client of the job, no sshd session left; polled with a
    bound (a killed process needs a moment to be reaped), not timed."""

    def clean() -> bool:
        return (
            not any(_alive(p) for p in pids)
            and not _processes_mentioning(job_id)
            and (sshd is None or not _children(sshd.pid))
        )

    try:
        _wait_until(clean, timeout_s=15.0, what="the job's processes to disappear")
    except AssertionError:
        left = [p for p in pids if _alive(p)]
        raise AssertionError(
            f"left behind: workers {left}, job processes {_processes_mentioning(job_id)},"
            f" sshd sessions {_children(sshd.pid) if sshd else []}"
        ) from None


def _next_message(stream) -> dict:
    """The agent's next protocol message that is not a beat (it beats every second)."""
    while True:
        msg = decode_message(stream.readline())
        if msg["type"] != "beat":
            return msg


def _kill_leftovers(job_id: str, pids: list[int]) -> None:
    """Test hygiene after a failed assertion."""
    for pid in pids + [p for p, _ in _processes_mentioning(job_id)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "varuna.launch", *args]


def _start_cli(tmp_path: Path, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    # Output to files, not pipes: nobody would drain a pipe while the test waits.
    with open(tmp_path / "launcher.out", "wb") as out, open(tmp_path / "launcher.err", "wb") as err:
        return subprocess.Popen(
            _cli(*args), stdout=out, stderr=err, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}
        )


def _run_cli(args: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run(
        _cli(*args),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# A real sshd on loopback
# ----------------------------------------------------------------------------------------------


@dataclass
class Sshd:
    port: int
    pid: int
    key: Path
    known_hosts: Path

    def ssh_args(self) -> list[str]:
        return ["--ssh-key", str(self.key), "--ssh-known-hosts", str(self.known_hosts)]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    why = sshd_unavailable()
    if why is not None:
        pytest.skip(why)
    keys = SshKeys.generate(tmp_path_factory.mktemp("sshd"))
    port = _free_port()
    proc = start_sshd(keys, port=port, listen=["127.0.0.1", "127.0.0.2"], name="loopback")
    try:

        def listening() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"sshd exited: {(keys.directory / 'sshd-loopback.log').read_text()}")
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.2", port)) == 0

        _wait_until(listening, timeout_s=10.0, what="sshd to listen")
        yield Sshd(port=port, pid=proc.pid, key=keys.user_key, known_hosts=keys.known_hosts)
    finally:
        stop_sshd(proc)


# ----------------------------------------------------------------------------------------------
# Host entries and validation: fast
# ----------------------------------------------------------------------------------------------


def test_parse_entries() -> None:
    e = parse_host_entry("alice@10.0.0.5:2222 slots=4")
    assert (e.user, e.host, e.port, e.slots, e.is_local) == ("alice", "10.0.0.5", 2222, 4, False)
    assert e.display == "alice@10.0.0.5:2222" and e.address == "10.0.0.5"
    local = parse_host_entry("localhost")
    assert local.is_local and local.address == "127.0.0.1" and local.slots is None
    # localhost with a port or a user is an ssh host (e.g. an sshd on a non-standard port).
    assert not parse_host_entry("localhost:2222").is_local
    assert parse_host_entry("[::1]:22").host == "::1" and parse_host_entry("[::1]:22").display == "[::1]:22"
    assert parse_host_entry("gpu-7.example.com").host == "gpu-7.example.com"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("localhost;touch /tmp/pwned", "not a valid host name"),
        ("$(touch /tmp/pwned)", "not a valid host name"),
        ("`id`", "not a valid host name"),
        ("host name", "only slots=N and type=NAME may follow"),
        ("-oProxyCommand=touch", "not a valid host name"),
        ("a|b", "not a valid host name"),
        ("bad$user@h", "user name 'bad$user' is not valid"),
        ("u;x@h", "user name"),
        ("h:22;id", "is not a TCP port"),
        ("h:0", "is not a TCP port"),
        ("h:65536", "is not a TCP port"),
        ("h:abc", "is not a TCP port"),
        ("h slots=0", "slots must be >= 1"),
        ("h slots=x", "is not a whole number"),
        ("h type=a;b", "is not a VM type name"),
        ("h type=a type=b", "type= given twice"),
        ("256.1.1.1", "not an IPv4 address"),
        ("[::zz]", "not an IPv6 address"),
        ("a..b", "not a valid host name"),
        ("h\nid", "only slots=N and type=NAME may follow"),
    ],
)
def test_bad_entries_are_rejected_naming_the_entry(text: str, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_host_entry(text, origin="hosts.txt line 2")
    message = str(info.value)
    assert message.startswith(f"host entry {text!r} (hosts.txt line 2): ") and needle in message
    assert "\n" not in message.replace(repr(text), "")


def test_host_file_comments_slots_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "hosts.txt"
    path.write_text("# the job's hosts\n\nlocalhost slots=2\n  bob@10.0.0.5:2222   # a VM\nlocalhost\n")
    entries = parse_host_file(path)
    assert [(e.display, e.slots, e.origin) for e in entries] == [
        ("localhost", 2, f"{path} line 3"),
        ("bob@10.0.0.5:2222", None, f"{path} line 4"),
        ("localhost", None, f"{path} line 5"),
    ]
    assert parse_hosts_arg(str(path)) == entries
    assert [e.slots for e in assign_slots(entries, 3)] == [2, 3, 3]
    with pytest.raises(ValueError, match=r"'bob@10.0.0.5:2222' .* has no slots=N; give --procs-per-host"):
        assign_slots(entries, None)
    path.write_text("localhost\nlocalhost;touch /tmp/pwned\n")
    with pytest.raises(
        ValueError, match=rf"^host entry 'localhost;touch /tmp/pwned' \({re.escape(str(path))} line 2\)"
    ):
        parse_host_file(path)
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="lists no hosts"):
        parse_host_file(path)


def test_hosts_list_argument() -> None:
    assert [e.display for e in parse_hosts_arg("localhost, bob@h1:22 slots=2,h2")] == [
        "localhost",
        "bob@h1:22",
        "h2",
    ]
    with pytest.raises(ValueError, match=r"'localhost;touch /tmp/pwned' \(--hosts entry 1\)"):
        parse_hosts_arg("localhost;touch /tmp/pwned")
    with pytest.raises(ValueError, match="entry 2 is empty"):
        parse_hosts_arg("a,,b")
    with pytest.raises(ValueError, match="no host file '/no/such/hosts.txt' exists"):
        parse_hosts_arg("/no/such/hosts.txt")


def test_ssh_argv_and_remote_command_quoting() -> None:
    entry = parse_host_entry("bob@10.0.0.5:2222")
    ssh = SshOptions(key_file="/k/id_ed25519", known_hosts_file="/k/known_hosts", connect_timeout_s=3)
    command = remote_agent_command(
        python="/opt/my env/bin/python", pythonpath=["/src/it's here", "/x"], agent_args=["--job-id", "j;1"]
    )
    argv = ssh.argv(entry, command)
    assert argv[0] == "ssh" and argv[-3:] == ["--", "10.0.0.5", command]
    joined = " ".join(argv)
    for option in (
        "BatchMode=yes",
        "StrictHostKeyChecking=accept-new",
        "ConnectTimeout=3",
        "UserKnownHostsFile=/k/known_hosts",
        "-i /k/id_ed25519",
        "-p 2222",
        "-l bob",
    ):
        assert option in joined
    # The remote shell sees exactly these words: every piece was quoted.
    assert shlex.split(command) == [
        "exec",
        "env",
        "PYTHONPATH=/src/it's here:/x",
        "/opt/my env/bin/python",
        "-m",
        "varuna.launch.agent",
        "--job-id",
        "j;1",
    ]
    with pytest.raises(ValueError, match="must be an absolute path"):
        remote_agent_command(python="python3", pythonpath=[], agent_args=[])
    with pytest.raises(ValueError, match="control characters"):
        remote_agent_command(python="/usr/bin/python3\nid", pythonpath=[], agent_args=[])
    with pytest.raises(ValueError, match="may not contain whitespace"):
        SshOptions(known_hosts_file="/a b")


def test_protocol_round_trip() -> None:
    line = encode_message({"type": "out", "rank": 1, "stream": "stdout", "line": "naïve\nnext"})
    assert line.count(b"\n") == 1 and line.endswith(b"\n")
    assert decode_message(line)["line"] == "naïve\nnext"
    with pytest.raises(ValueError):
        decode_message(b"Welcome to Debian!\n")


# ----------------------------------------------------------------------------------------------
# Layout: fast
# ----------------------------------------------------------------------------------------------


def _planning_args(argv: list[str]):
    from varuna.core.cli import OneLineParser, add_planning_args

    parser = OneLineParser(prog="test")
    add_planning_args(parser)
    return parser.parse_args(argv)


def test_resolve_layout() -> None:
    assert resolve_layout(slots=[2, 2, 2], pipeline_depth=2) == Layout(pipeline_depth=2, data_parallel=3)
    assert resolve_layout(slots=[2, 2], pipeline_depth=2, data_parallel=1).data_parallel == 1
    with pytest.raises(ValueError, match="needs 6 slots but the hosts hold 4; use --data-parallel 2"):
        resolve_layout(slots=[2, 2], pipeline_depth=2, data_parallel=3)
    with pytest.raises(ValueError, match="fewer than the 3 stages of --pipeline-depth 3"):
        resolve_layout(slots=[1, 1], pipeline_depth=3)
    with pytest.raises(ValueError, match="required: --pipeline-depth"):
        resolve_layout(slots=[1, 1])
    with pytest.raises(ValueError, match="--calibration needs --global-batch-size"):
        PlanRequest.from_args(_planning_args(["--calibration", "cal.json"]))
    entries = [HostEntry(host="a", slots=2), HostEntry(host="b", slots=2), HostEntry(host="c", slots=2)]
    assert [e.host for e in select_hosts(entries, 3)] == ["a", "b"]
    assert [e.host for e in select_hosts(entries, 4)] == ["a", "b"]


@pytest.mark.skipif(
    importlib.util.find_spec("simulator.autoconfig") is None, reason="no simulator.autoconfig"
)
def test_auto_config_from_calibration(tmp_path: Path) -> None:
    from varuna.core.calibration import Calibration

    cal = Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1, 2))
    cal.save(tmp_path / "cal.json")
    request = PlanRequest(calibration=str(tmp_path / "cal.json"), global_batch_size=16)
    layout = resolve_layout(slots=[2, 2], request=request)
    assert layout.pipeline_depth * layout.data_parallel <= 4
    assert layout.micro_batch_size in (1, 2) and layout.note.startswith("auto-config for G=4: ")
    # A model that needs more stages than there are slots: auto-config's reason is the error.
    big = Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1, 2))
    big.save(tmp_path / "big.json")
    big_request = PlanRequest(calibration=str(tmp_path / "big.json"), global_batch_size=16,
                              gpu_memory_bytes=1)
    with pytest.raises(ValueError, match="needs at least P=|does not fit"):
        resolve_layout(slots=[1], request=big_request)


# ----------------------------------------------------------------------------------------------
# Command line: fast
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--hosts", "localhost", "--procs", "2", "--pipeline-depth", "1", "S"], "not both"),
        (["--pipeline-depth", "1", "S"], "required: --procs N"),
        (
            ["--procs", "2", "--procs-per-host", "1", "--pipeline-depth", "1", "S"],
            "--procs-per-host needs --hosts",
        ),
        (["--hosts", "localhost", "--pipeline-depth", "1", "S"], "has no slots=N"),
        (["--hosts", "h1:99999", "--procs-per-host", "1", "--pipeline-depth", "1", "S"], "not a TCP port"),
        (
            ["--hosts", "localhost", "--procs-per-host", "1", "--data-parallel", "1", "S"],
            "required: --pipeline",
        ),
        (
            [
                "--hosts",
                "localhost",
                "--procs-per-host",
                "1",
                "--pipeline-depth",
                "1",
                "--manager",
                "x;y",
                "S",
            ],
            "--manager 'x;y' is not HOST:PORT",
        ),
        (
            [
                "--hosts",
                "localhost",
                "--procs-per-host",
                "1",
                "--pipeline-depth",
                "1",
                "--job-id",
                "a b",
                "S",
            ],
            "--job-id 'a b'",
        ),
    ],
)
def test_bad_host_arguments_exit_2_with_one_line(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "ok.py"
    script.write_text("raise SystemExit('must not run')\n")
    assert main([str(script) if a == "S" else a for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("varuna-launch: error: ") and needle in lines[0], (
        captured.err
    )


@pytest.mark.parametrize("form", ["list", "file"])
def test_injection_entry_is_rejected_and_nothing_runs(form: str, tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    script = tmp_path / "w.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    entry = f"localhost;touch {pwned}"
    hosts = entry
    if form == "file":
        (tmp_path / "hosts.txt").write_text(f"localhost\n{entry}\n")
        hosts = str(tmp_path / "hosts.txt")
    result = _run_cli(
        ["--hosts", hosts, "--procs-per-host", "1", "--pipeline-depth", "1", str(script)], cwd=tmp_path
    )
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("varuna-launch: error: host entry 'localhost;touch")
    assert not pwned.exists() and not (tmp_path / "ran").exists()


# ----------------------------------------------------------------------------------------------
# Worker scripts
# ----------------------------------------------------------------------------------------------

# Prints its identity, then joins a gloo all-reduce over the whole job.
GLOO_WORKER = textwrap.dedent(
    """
    import datetime, json, os, socket, sys
    import torch
    import torch.distributed as dist
    from varuna.core.env import WorkerEnv

    env = WorkerEnv.from_env()
    print(json.dumps({"rank": env.rank, "host_id": env.host_id, "local_rank": env.local_rank,
                      "local_world_size": env.local_world_size, "master": env.master_addr,
                      "token": os.environ.get("VARUNA_TEST_TOKEN"), "ssh": "SSH_CONNECTION" in os.environ,
                      "cwd": os.getcwd(), "argv": sys.argv[1:]}), flush=True)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    value = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(value)
    print(f"all_reduce={value.item():g}")
    dist.destroy_process_group()
    """
)

# Writes OUT/pid{rank} once its handlers are installed, then blocks; "graceful" exits 0 on
# SIGTERM/SIGUSR1 after writing OUT/{SIGNAME}{rank}.
BLOCKING_WORKER = textwrap.dedent(
    """
    import os, signal, sys, threading
    from pathlib import Path
    from varuna.core.env import WorkerEnv

    env = WorkerEnv.from_env()
    out, mode = Path(sys.argv[1]), sys.argv[2]

    def put(name, text=""):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)

    def graceful(signum, frame):
        put(f"{signal.Signals(signum).name}{env.rank}")
        sys.exit(0)

    if mode == "graceful":
        signal.signal(signal.SIGTERM, graceful)
        signal.signal(signal.SIGUSR1, graceful)
    put(f"pid{env.rank}", str(os.getpid()))
    print(f"ready {env.rank}", flush=True)
    threading.Event().wait()
    """
)


def _parse_prefixed(stdout: str) -> list[tuple[int, str, int, str]]:
    """(host_id, host, rank, body) of every prefixed line; asserts every line has a prefix."""
    rows = []
    for line in stdout.splitlines():
        match = PREFIX_RE.match(line)
        assert match, f"unprefixed line: {line!r}"
        host_id, host, rank, stage, replica, body = match.groups()
        rows.append((int(host_id), host, int(rank), body))
    return rows


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------------------------
# Whole jobs on pretend localhost hosts (no ssh)
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_two_pretend_hosts_gloo(tmp_path: Path) -> None:
    script = _write(tmp_path, "gloo_worker.py", GLOO_WORKER)
    result = _run_cli(
        [
            "--hosts",
            "localhost,localhost",
            "--procs-per-host",
            "1",
            "--pipeline-depth",
            "2",
            "--log-dir",
            "logs",
            str(script),
            "x y",
        ],
        cwd=tmp_path,
        env={"VARUNA_TEST_TOKEN": "t0k", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    rows = _parse_prefixed(result.stdout)
    infos = {rank: json.loads(body) for _, _, rank, body in rows if body.startswith("{")}
    assert sorted(infos) == [0, 1]
    for rank, info in infos.items():
        assert (info["host_id"], info["local_rank"], info["local_world_size"]) == (rank, 0, 1)
        assert info["token"] == "t0k" and info["argv"] == ["x y"] and info["cwd"] == str(tmp_path)
    assert sorted(body for _, _, _, body in rows if body.startswith("all_reduce")) == ["all_reduce=3"] * 2
    assert {(h, host) for h, host, _, _ in rows} == {(0, "localhost"), (1, "localhost")}
    record = json.loads((tmp_path / "logs" / "launch.json").read_text())
    assert [h["entry"] for h in record["hosts"]] == ["localhost", "localhost"] and record["job_id"]
    assert all(h["agent_pid"] for h in record["hosts"])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_unreachable_host_is_left_out(tmp_path: Path) -> None:
    script = _write(
        tmp_path, "w.py", "import os; print('rank', os.environ['RANK'], os.environ['VARUNA_HOST_ID'])\n"
    )
    dead = f"127.0.0.1:{_free_port()}"  # nothing listens there: ssh is refused at once
    args = ["--hosts", f"{dead},localhost,localhost", "--procs-per-host", "1", "--ssh-connect-timeout", "5"]
    result = _run_cli([*args, "--pipeline-depth", "2", str(script)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    unreachable = [line for line in result.stderr.splitlines() if "unreachable" in line]
    assert len(unreachable) == 1 and unreachable[0].startswith(
        f"varuna-launch: host {dead} (--hosts entry 1) is unreachable, leaving it out: "
    )
    assert sorted(body for _, _, _, body in _parse_prefixed(result.stdout)) == ["rank 0 0", "rank 1 1"]

    # Without the dead host, two slots cannot hold three stages: the launch fails and says why.
    result = _run_cli([*args, "--pipeline-depth", "3", str(script)], cwd=tmp_path)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines()[-1] == (
        "varuna-launch: cannot launch: the hosts hold 2 slot(s), fewer than the 3 stages of"
        " --pipeline-depth 3; add hosts or use a smaller --pipeline-depth (1 of 3 host(s) unreachable)"
    )


def test_probe_reports_refused_port() -> None:
    entry = parse_host_entry(f"127.0.0.1:{_free_port()}")
    reachable, unreachable = probe_hosts(
        [parse_host_entry("localhost"), entry], SshOptions(connect_timeout_s=5)
    )
    assert [e.display for e in reachable] == ["localhost"]
    assert [(e, "refused" in why.lower()) for e, why in unreachable] == [(entry, True)]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_agent_kills_its_workers_when_the_launcher_goes_away(tmp_path: Path) -> None:
    """EOF on the agent's stdin (the launcher or its ssh channel gone) kills every worker."""
    script = _write(tmp_path, "block.py", BLOCKING_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    agent = subprocess.Popen(
        # No pings from this test: the agent must not give up on it (0: no heartbeat timeout).
        [sys.executable, "-m", "varuna.launch.agent", "--job-id", "agenttest", "--host-id", "0",
         "--heartbeat-timeout", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    pids: list[int] = []
    try:
        assert agent.stdin is not None and agent.stdout is not None
        ready = decode_message(agent.stdout.readline())
        assert ready["type"] == "ready" and ready["pid"] == agent.pid and 0 < ready["free_port"] < 65536
        beats = [agent.stdout.readline() for _ in range(2)]  # idle: beats every second
        worker_env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1234",
            "RANK": "0",
            "WORLD_SIZE": "1",
            "VARUNA_PIPELINE_DEPTH": "1",
            "VARUNA_DATA_PARALLEL": "1",
        }
        request = {"rank": 0, "argv": [sys.executable, str(script), str(out), "block"], "env": worker_env}
        agent.stdin.write(encode_message({"type": "spawn", "workers": [{**request, "cwd": str(tmp_path)}]}))
        agent.stdin.write(b"this is not json\n")  # must be reported, not fatal
        agent.stdin.flush()
        spawned = _next_message(agent.stdout)
        assert spawned["type"] == "spawned" and spawned["failed"] is None
        pids = [spawned["started"][0]["pid"]]
        seen = [_next_message(agent.stdout) for _ in range(2)]
        assert {"type": "out", "rank": 0, "stream": "stdout", "line": "ready 0\n"} in seen
        assert any(m["type"] == "message" and "bad request" in m["text"] for m in seen)
        agent.stdin.close()  # the launcher is gone
        rest = [decode_message(line) for line in agent.stdout.read().splitlines()]
        assert rest[-1] == {"type": "bye"} and {"type": "exit", "rank": 0, "code": -9} in rest
        assert agent.wait(timeout=10) == 1
        assert not _alive(pids[0])
        assert {"type": "beat"} in [decode_message(line) for line in beats], "the agent beats (protocol 2)"
    finally:
        agent.kill()
        agent.wait()
        _kill_leftovers("agenttest", pids)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_agent_heartbeat_timeout_and_spawn_failure(tmp_path: Path) -> None:
    """A launcher that falls silent (a network partition keeps TCP open) counts as gone; a
    worker that cannot be started is reported, not fatal to the agent."""
    script = _write(tmp_path, "block.py", BLOCKING_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "varuna.launch.agent",
            "--job-id",
            "hbtest",
            "--host-id",
            "3",
            "--heartbeat-timeout",
            "1",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    pids: list[int] = []
    try:
        assert agent.stdin is not None and agent.stdout is not None
        assert _next_message(agent.stdout)["type"] == "ready"
        env = {"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "2"}
        env |= {"VARUNA_PIPELINE_DEPTH": "2", "VARUNA_DATA_PARALLEL": "1"}
        good = {"rank": 0, "argv": [sys.executable, str(script), str(out), "block"], "env": env}
        bad = {"rank": 1, "argv": ["/no/such/python"], "env": {**env, "RANK": "1"}}
        agent.stdin.write(encode_message({"type": "spawn", "workers": [good, bad]}))
        agent.stdin.flush()  # ... and nothing more: no pings
        spawned = _next_message(agent.stdout)
        assert [w["rank"] for w in spawned["started"]] == [0]
        assert spawned["failed"]["rank"] == 1 and "No such file" in spawned["failed"]["error"]
        pids = [spawned["started"][0]["pid"]]
        rest = [decode_message(line) for line in agent.stdout.read().splitlines()]
        assert rest[-1] == {"type": "bye"} and {"type": "exit", "rank": 0, "code": -9} in rest
        assert agent.wait(timeout=10) == 1 and not _alive(pids[0])
    finally:
        agent.kill()
        agent.wait()
        _kill_leftovers("hbtest", pids)


# ----------------------------------------------------------------------------------------------
# Whole jobs through a real sshd
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_sshd_two_hosts_gloo(sshd: Sshd, tmp_path: Path) -> None:
    script = _write(tmp_path, "gloo_worker.py", GLOO_WORKER)
    hosts = f"{getpass.getuser()}@127.0.0.1:{sshd.port} slots=2,127.0.0.2:{sshd.port}"
    job_id = f"sshgloo{os.getpid()}"
    result = _run_cli(
        [
            "--hosts",
            hosts,
            "--procs-per-host",
            "2",
            "--pipeline-depth",
            "2",
            "--job-id",
            job_id,
            *sshd.ssh_args(),
            str(script),
            "it's",
            "$(id)",
        ],
        cwd=tmp_path,
        env={"VARUNA_TEST_TOKEN": "t0k", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    rows = _parse_prefixed(result.stdout)
    infos = {rank: json.loads(body) for _, _, rank, body in rows if body.startswith("{")}
    assert sorted(infos) == [0, 1, 2, 3]
    for rank, info in infos.items():
        # Consecutive stages of a pipeline share a host; replicas are on different hosts.
        assert (info["host_id"], info["local_rank"], info["local_world_size"]) == (rank // 2, rank % 2, 2)
        assert info["ssh"], "workers of ssh hosts run under sshd"
        assert info["master"] == "127.0.0.1"
        # ssh forwards no environment: VARUNA_* reached the remote workers through the agent.
        assert info["token"] == "t0k"
        assert info["argv"] == ["it's", "$(id)"] and info["cwd"] == str(tmp_path)
    assert sorted(body for _, _, _, body in rows if body.startswith("all_reduce")) == ["all_reduce=10"] * 4
    hosts_seen = {(h, host) for h, host, _, _ in rows}
    assert hosts_seen == {(0, f"{getpass.getuser()}@127.0.0.1:{sshd.port}"), (1, f"127.0.0.2:{sshd.port}")}
    _assert_nothing_left(job_id, [], sshd)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sshd_agent_that_cannot_start_fails_the_launch(
    sshd: Sshd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A host that answers ssh but cannot run the agent (no such interpreter there) fails the
    launch with ssh's reason; the agents already started elsewhere are stopped."""
    script = _write(tmp_path, "w.py", "print('must not run')\n")
    entries = assign_slots(parse_hosts_arg(f"127.0.0.2:{sshd.port},localhost"), 1)
    config = LaunchConfig(script=str(script), pipeline_depth=2, data_parallel=1, python="/no/such/python3")
    ssh = SshOptions(key_file=str(sshd.key), known_hosts_file=str(sshd.known_hosts))
    code = launch_on_hosts(config, entries, ssh=ssh, job_id=f"sshbad{os.getpid()}")
    err = capsys.readouterr().err
    assert code == 1
    assert "varuna-launch: job failed: host h1=localhost: cannot start its agent: " in err
    _assert_nothing_left(f"sshbad{os.getpid()}", [], sshd)
    # Only the ssh host is unable to start its agent: the reason comes from the remote side.
    entries = assign_slots(parse_hosts_arg(f"127.0.0.2:{sshd.port}"), 1)
    config = LaunchConfig(script=str(script), pipeline_depth=1, data_parallel=1, python="/no/such/python3")
    assert launch_on_hosts(config, entries, ssh=ssh, job_id=f"sshbad{os.getpid()}") == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(
        f"varuna-launch: job failed: host h0=127.0.0.2:{sshd.port}: its agent failed to start ("
    )
    assert "/no/such/python3" in last, last
    _assert_nothing_left(f"sshbad{os.getpid()}", [], sshd)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sshd_killed_worker_stops_the_job_everywhere(sshd: Sshd, tmp_path: Path) -> None:
    script = _write(tmp_path, "block.py", BLOCKING_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    job_id = f"sshkill{os.getpid()}"
    hosts = f"127.0.0.1:{sshd.port} slots=2,127.0.0.2:{sshd.port},localhost"
    launcher = _start_cli(
        tmp_path,
        [
            "--hosts",
            hosts,
            "--procs-per-host",
            "1",
            "--pipeline-depth",
            "4",
            "--job-id",
            job_id,
            "--stop-timeout",
            "5",
            *sshd.ssh_args(),
            str(script),
            str(out),
            "block",
        ],
    )
    pids: list[int] = []
    try:
        _wait_until(lambda: all((out / f"pid{r}").exists() for r in range(4)), what="4 workers")
        pids = [int((out / f"pid{r}").read_text()) for r in range(4)]
        assert len(_processes_mentioning(job_id)) >= 3, "three agents (two behind ssh clients)"
        os.kill(pids[2], signal.SIGKILL)  # rank 2: the worker on the second ssh host
        assert launcher.wait(timeout=30) == 1
        err = (tmp_path / "launcher.err").read_text()
        assert err.splitlines()[-1] == (
            f"varuna-launch: job failed: h1=127.0.0.2:{sshd.port} rank 2 stage 2 replica 0"
            " was killed by SIGKILL (9)"
        ), err
        _assert_nothing_left(job_id, pids, sshd)
    finally:
        launcher.kill()
        launcher.wait()
        _kill_leftovers(job_id, pids)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sshd_sigterm_and_sigusr1_are_forwarded(sshd: Sshd, tmp_path: Path) -> None:
    script = _write(tmp_path, "block.py", BLOCKING_WORKER)
    for signum, expected in ((signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGUSR1, 0)):
        out = tmp_path / f"out{signum}"
        out.mkdir()
        job_id = f"sshsig{signum}x{os.getpid()}"
        launcher = _start_cli(
            tmp_path,
            [
                "--hosts",
                f"127.0.0.1:{sshd.port},localhost",
                "--procs-per-host",
                "1",
                "--pipeline-depth",
                "2",
                "--job-id",
                job_id,
                *sshd.ssh_args(),
                str(script),
                str(out),
                "graceful",
            ],
        )
        pids: list[int] = []
        try:
            _wait_until(lambda out=out: all((out / f"pid{r}").exists() for r in range(2)), what="workers")
            pids = [int((out / f"pid{r}").read_text()) for r in range(2)]
            launcher.send_signal(signum)
            assert launcher.wait(timeout=30) == expected
            name = signal.Signals(signum).name
            assert all((out / f"{name}{r}").exists() for r in range(2)), "each worker saw the signal"
            _assert_nothing_left(job_id, pids, sshd)
        finally:
            launcher.kill()
            launcher.wait()
            _kill_leftovers(job_id, pids)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sshd_sigkill_of_launcher_leaves_nothing(sshd: Sshd, tmp_path: Path) -> None:
    """No launcher code runs: local agents die of their parent-death signal, the ssh clients
    too, and each remote agent sees EOF and kills its workers."""
    script = _write(tmp_path, "block.py", BLOCKING_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    job_id = f"sshsigkill{os.getpid()}"
    launcher = _start_cli(
        tmp_path,
        [
            "--hosts",
            f"127.0.0.1:{sshd.port},127.0.0.2:{sshd.port},localhost",
            "--procs-per-host",
            "1",
            "--pipeline-depth",
            "3",
            "--job-id",
            job_id,
            *sshd.ssh_args(),
            str(script),
            str(out),
            "block",
        ],
    )
    pids: list[int] = []
    try:
        _wait_until(lambda: all((out / f"pid{r}").exists() for r in range(3)), what="3 workers")
        pids = [int((out / f"pid{r}").read_text()) for r in range(3)]
        launcher.kill()
        launcher.wait(timeout=10)
        _assert_nothing_left(job_id, pids, sshd)
    finally:
        launcher.kill()
        launcher.wait()
        _kill_leftovers(job_id, pids)


GPT_ARGS = [
    "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--global-batch-size", "4",
    "--micro-batch-size", "2", "--eval-every", "0", "--dropout", "0.0",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(
    not hasattr(varuna.runtime.engine.Engine, "save_checkpoint"),
    reason="checkpoints (Engine.save_checkpoint, VARUNA_CHECKPOINT_DIR, VARUNA_RESUME) are not there yet",
)
def test_sshd_sigusr1_checkpoints_and_relaunch_resumes(sshd: Sshd, tmp_path: Path) -> None:
    """The stop protocol end to end: SIGUSR1 to the launcher → every worker finishes its
    mini-batch, writes its part of the checkpoint, exits 0; the same command resumes."""
    train = ROOT / "examples" / "gpt2" / "train.py"
    ckpt = tmp_path / "ckpt"
    job_id = f"sshckpt{os.getpid()}"
    common = ["--hosts", f"127.0.0.1:{sshd.port},localhost", "--procs-per-host", "1", "--pipeline-depth", "2",
              "--checkpoint-dir", str(ckpt), *sshd.ssh_args()]  # fmt: skip
    launcher = _start_cli(tmp_path, [*common, "--job-id", job_id, str(train), "--steps", "1000", *GPT_ARGS])
    step_re = re.compile(r"\] step +(\d+)/")

    def steps() -> list[int]:
        text = (tmp_path / "launcher.out").read_text()
        return [int(m.group(1)) for m in step_re.finditer(text)]

    try:
        _wait_until(lambda: len(steps()) >= 2, timeout_s=60, what="two training steps")
        launcher.send_signal(signal.SIGUSR1)
        assert launcher.wait(timeout=60) == 0, (tmp_path / "launcher.err").read_text()
        manifests = list(ckpt.glob("step_*/manifest.json"))
        assert len(manifests) == 1, "one complete checkpoint"
        # The step in flight when the signal came is finished and saved (train_step exits before
        # the script prints it), so the checkpoint is at least one step past the last printed one.
        stopped_at = int(manifests[0].parent.name.removeprefix("step_"))
        assert stopped_at > steps()[-1]
        from varuna.runtime.checkpoint import verify_checkpoint

        assert verify_checkpoint(manifests[0].parent) == []
        _assert_nothing_left(job_id, [], sshd)
    finally:
        launcher.kill()
        launcher.wait()
        _kill_leftovers(job_id, [])

    result = _run_cli([*common, str(train), "--steps", str(stopped_at + 2), *GPT_ARGS], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    resumed = [int(m.group(1)) for m in step_re.finditer(result.stdout)]
    assert resumed == [stopped_at + 1, stopped_at + 2], result.stdout
