"""Silent hosts (issue #30, the launcher's side): hosts in network namespaces whose packets vanish
(varuna/testing/netns.py), the launcher naming the silent host and rank within 5 s whichever rank
it holds, recovery by itself (--max-restarts, or live morph across hosts) ending bit-identical to
an undisturbed run, nothing left in any namespace; the peer watch never blocks on a silent store;
gloo on the interface towards MASTER_ADDR when the host name resolves to loopback.

Detection is judged on the launcher's own measurement (its ``host-silent`` event's ``silent_s``,
the silence it saw before naming the host) against the 5 s claim, and on the event's wall-clock
time against the fault's with a documented margin for a loaded machine
(``chaos_hosts.LOAD_MARGIN_S``): never on the duration of the whole test.
"""

from __future__ import annotations

import importlib.util
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from varuna.launch.hosts import parse_hosts_arg
from varuna.launch.job import launch_on_hosts
from varuna.launch.spec import LaunchConfig
from varuna.launch.ssh import SshOptions
from varuna.launch.supervisor import _CppFrames
from varuna.runtime.peer_watch import STOP_SILENCE_S, PeerWatch
from varuna.testing.netns import NetHosts, netns_unavailable, remove_stale_sets
from varuna.testing.sshd import sshd_unavailable

ROOT = Path(__file__).resolve().parents[1]
WHY_NOT = netns_unavailable() or sshd_unavailable()
needs_net = pytest.mark.skipif(WHY_NOT is not None, reason=f"hosts in namespaces: {WHY_NOT}")


def _chaos_hosts():
    name = "varuna_chaos_hosts_script"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "chaos_hosts.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)
    return value


# ---------------------------------------------------------------- the peer watch (in-process)


class _Store:
    """A store whose calls block while ``stuck`` is set (its host went silent), or fail with a
    reset once ``gone`` (its process exited)."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.stuck = threading.Event()
        self.gone = False
        self.released = threading.Event()

    def _call(self) -> None:
        if self.gone:
            raise RuntimeError("Connection reset by peer\nException raised from recvBytes ...")
        while self.stuck.is_set() and not self.released.wait(0.05):
            pass

    def add(self, key: str, n: int) -> int:
        self.data[key] = str(int(self.data.get(key, "0")) + n)
        return int(self.data[key])

    def set(self, key: str, value: str) -> None:
        self._call()
        self.data[key] = value

    def check(self, keys: list[str]) -> bool:
        self._call()
        return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._call()
        return [self.data[k].encode() for k in keys]


def _two_watches(store: _Store, timeout_s: float, reports: list[str], **kw) -> tuple[PeerWatch, PeerWatch]:
    w1 = PeerWatch.start(store, rank=1, world=2, timeout_s=timeout_s, host="h1", on_lost=reports.append, **kw)
    w0 = PeerWatch.start(store, rank=0, world=2, timeout_s=timeout_s, host="h0", on_lost=lambda _: None)
    return w0, w1


def test_a_silent_store_is_named_and_blocks_nothing_but_the_beater():
    """Rank 0's host goes silent: the store's calls never return. Rank 1's watch names rank 0
    after timeout_s while inside a step, from its judge; before the fix its only thread blocked in
    the call and nothing was ever reported."""
    store, reports = _Store(), []
    w0, w1 = _two_watches(store, 0.5, reports)
    try:
        _wait(lambda: w1._exchanges >= 2, 10, "two exchanges")
        w1.enter(3)
        store.stuck.set()
        _wait(lambda: reports, 30, "a report")
        assert "rank 1 (host h1) stopped waiting in step 3: the rendezvous store of rank 0" in reports[0]
        assert "has not answered" in reports[0] and "host h0" in reports[0]
    finally:
        store.released.set()
        w0.close(1.0)
        w1.close(1.0)


def test_a_stop_signal_while_blocked_on_a_silent_store_ends_the_wait():
    """SIGUSR1 (a graceful stop) while inside a step whose store is silent: the judge hears it
    through the wakeup fd and ends the wait after STOP_SILENCE_S, not timeout_s (60 s here)."""
    store, reports = _Store(), []
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)  # the engine's flag-setting handler
    w0, w1 = _two_watches(store, 60.0, reports, stop_signals=("SIGUSR1",))
    try:
        _wait(lambda: w1._exchanges >= 1, 10, "an exchange")
        w1.enter(2)
        store.stuck.set()
        _wait(lambda: w1._calling_since is not None, 10, "the beater to be stuck")
        assert w1._verdict(time.monotonic() + STOP_SILENCE_S + 1) == [], "no signal: the 60 s bound holds"
        os.kill(os.getpid(), signal.SIGUSR1)
        _wait(lambda: reports, 30, "the report after the signal")
        assert "received SIGUSR1, and a graceful stop needs every rank" in reports[0]
    finally:
        store.released.set()
        w0.close(1.0)
        w1.close(1.0)
        signal.signal(signal.SIGUSR1, previous)


def test_a_step_error_after_rank0_died_is_one_line_naming_its_store():
    """Rank 0's process died (its store resets): the failed step's error becomes one line naming
    rank 0's store, not a traceback of C++ frames."""
    store, reports = _Store(), []
    w0, w1 = _two_watches(store, 60.0, reports)
    try:
        _wait(lambda: w1._exchanges >= 2, 10, "two exchanges")
        w1.enter(4)
        store.gone = True
        w1.report_if_lost()
        assert len(reports) == 1 and "is gone (Connection reset by peer)" in reports[0]
        assert "\n" not in reports[0]
    finally:
        w0.close(1.0)
        w1.close(1.0)


def test_cpp_frames_are_swallowed_by_the_relay():
    lines = [
        "[W1128 TCPStore.cpp:106] [c10d] sendBytes failed on SocketImpl(fd=33): Broken pipe\n",
        "Exception raised from sendBytes at Utils.hpp:758 (most recent call first):\n",
        "frame #0: c10::Error::Error(...) + 0x9d (0x7f in libc10.so)\n",
        "<omitting python frames>\n",
        "frame #21: <unknown function> + 0x891f5 (0x7f in libc.so.6)\n",
        "\n",
        "varuna: rank 1 (host h) stopped waiting in step 6: ...\n",
    ]
    frames = _CppFrames()
    shown = [line for line in lines if not frames.swallow(line)]
    assert shown == [lines[0], lines[-1]]


# ---------------------------------------------------------------- the launcher, without namespaces


def test_ssh_carriage_returns_do_not_reach_the_launcher_lines(tmp_path: Path):
    """ssh ends its own messages with "\\r\\n"; the "agent is gone" line quotes it without the \\r."""
    fake = tmp_path / "ssh"
    fake.write_text("#!/bin/sh\nprintf 'Timeout, server 10.0.0.9 not responding.\\r\\n' >&2\nexit 255\n")
    fake.chmod(0o755)
    err = io.StringIO()
    config = LaunchConfig(script=str(fake), pipeline_depth=1, data_parallel=1)
    code = launch_on_hosts(config, parse_hosts_arg("10.0.0.9 slots=1"), ssh=SshOptions(ssh=str(fake)),
                           job_id=f"cr{os.getpid()}", stderr=err)
    assert code == 1
    last = err.getvalue().splitlines()[-1]
    assert last.endswith("failed to start (exit code 255; Timeout, server 10.0.0.9 not responding.)")
    assert "\r" not in err.getvalue()


# ---------------------------------------------------------------- namespaces


@pytest.fixture
def net(tmp_path: Path):
    with NetHosts.create(2, workdir=tmp_path, loopback_hostname=True) as hosts:
        yield hosts


def _ssh(net: NetHosts, host: int, command: str, timeout_s: float = 20.0) -> subprocess.CompletedProcess:
    assert net.keys is not None
    argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new", "-o",
            f"UserKnownHostsFile={net.keys.known_hosts}", "-i", str(net.keys.user_key), "-o",
            "ConnectTimeout=2", net.address(host), command]
    return subprocess.run(net.control(argv), capture_output=True, text=True, timeout=timeout_s)


@needs_net
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_namespace_hosts_faults_and_cleanup(net: NetHosts):
    assert _ssh(net, 1, "true").returncode == 0
    net.blackhole(1)
    silent = _ssh(net, 1, "true")
    # Silence, not refusal: the connect times out (a reset would say "refused", a failed ARP "No route").
    assert silent.returncode == 255 and "timed out" in silent.stderr, silent.stderr
    net.heal(1)
    assert _ssh(net, 1, "true").returncode == 0
    sleeper = subprocess.Popen(net.run_in(1, ["sleep", "300"]))
    try:
        _wait(lambda: sleeper.pid in net.pids(1), 10, "the sleeper in host 1")
        assert net.kill(1) == [sleeper.pid]
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()
    # A bandwidth cut: 3 MB through a 1 MB/s link take at least ~3 s (load only makes it slower).
    net.set_rate(1, 1e6)
    started = time.monotonic()
    assert len(_ssh(net, 1, "head -c 3000000 /dev/zero", 60).stdout) == 3_000_000
    assert time.monotonic() - started > 2.5
    names = [net.namespace(h) for h in net.members()] + [net.bridge_namespace]
    sshd = list(net._sshd.values())
    net.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in listed.split()], listed
    assert all(p.poll() is not None for p in sshd)


_PACED = textwrap.dedent("""
    import socket, sys, time
    role, addr, n = sys.argv[1], sys.argv[2], 256 << 10
    if role == "recv":
        srv = socket.create_server((addr, 29661))
        print("ready", flush=True)
        conn, _ = srv.accept()
        while True:
            got = 0
            while got < n:
                chunk = conn.recv(n - got)
                if not chunk:
                    sys.exit(0)
                got += len(chunk)
            conn.sendall(b"k")
    s = socket.create_connection((addr, 29661), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(6):
        time.sleep(0.3)  # the pause under test: a token bucket refills meanwhile
        t = time.perf_counter()
        s.sendall(bytes(n))
        s.recv(1)
        times.append(time.perf_counter() - t)
    print(min(times), flush=True)
""")


@needs_net
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_message_after_a_pause_crosses_a_capped_link_at_its_cap(net: NetHosts):
    """Note [Link bucket]: a link capped at R carries a pipeline's message (256 KiB, sent after a
    pause) in about bytes / R, as the profiler's back-to-back fit says, not half of it at line rate
    out of a large bucket (128 KiB: 12 ms at 100 Mbit/s, where bytes / R is 21 ms). Load only
    makes the transfer slower, so the fastest of six is held to a floor."""
    rate = 12.5e6
    net.set_rate(1, rate)
    receiver = subprocess.Popen(net.run_in(1, [sys.executable, "-c", _PACED, "recv", net.address(1)]),
                                stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout.readline().strip() == "ready"
        sender = subprocess.run(net.run_in(0, [sys.executable, "-c", _PACED, "send", net.address(1)]),
                                capture_output=True, text=True, timeout=60)
        assert sender.returncode == 0, sender.stderr
        fastest = float(sender.stdout.strip())
    finally:
        receiver.kill()
        receiver.wait()
    floor = 0.75 * (256 << 10) / rate
    assert fastest >= floor, f"256 KiB crossed a {rate / 1e6:g} MB/s link in {fastest * 1e3:.1f} ms"


@needs_net
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_creator_leaves_namespaces_that_the_next_set_removes(tmp_path: Path):
    code = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from varuna.testing.netns import NetHosts
        net = NetHosts.create(1, workdir=Path({str(tmp_path)!r}))
        print(net.prefix, flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        prefix = proc.stdout.readline().strip()
        assert prefix.startswith("vn")
    finally:
        proc.kill()
        proc.wait()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert any(n.startswith(prefix) for n in listed.split()), "the killed process left its namespaces"
    removed = remove_stale_sets()
    assert sorted(removed) == sorted(n for n in listed.split() if n.startswith(prefix))


GLOO_WORKER = """
import os, sys
import torch, torch.distributed as dist
from datetime import timedelta
if sys.argv[1] == "auto":
    from varuna.runtime.layout import choose_gloo_interface
    print("interface", choose_gloo_interface(os.environ["MASTER_ADDR"]), flush=True)
dist.init_process_group("gloo", timeout=timedelta(seconds=float(sys.argv[2])))
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("sum", int(t.item()), flush=True)
dist.destroy_process_group()
"""


@needs_net
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gloo_binds_to_the_interface_towards_master_when_the_host_name_is_loopback(net: NetHosts, tmp_path):
    """In these namespaces the host name resolves to 127.0.1.1: plain gloo binds there and the
    two hosts cannot meet (the negative control); choosing the interface that routes to
    MASTER_ADDR (eth0) makes the same job work. No route at all: one line naming the variable."""
    worker = tmp_path / "gloo_worker.py"
    worker.write_text(GLOO_WORKER)
    hosts = f"{net.address(0)},{net.address(1)}"

    def job(mode: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "varuna.launch", "--hosts", hosts, "--procs-per-host", "1",
               "--pipeline-depth", "2", "--quiet", "--stop-timeout", "2", *net.ssh_options(), str(worker),
               mode, "15"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.run(net.control(cmd), capture_output=True, text=True, timeout=150, cwd=tmp_path,
                              env=env)

    plain = job("plain")
    assert plain.returncode == 1, plain.stdout + plain.stderr
    auto = job("auto")
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert auto.stdout.count("interface eth0") == 2 and auto.stdout.count("sum 3") == 2, auto.stdout
    probe = "from varuna.runtime.layout import choose_gloo_interface as c; c('10.99.0.1', environ={})"
    no_route = subprocess.run(net.run_in(1, [sys.executable, "-c", probe]), capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    last = no_route.stderr.strip().splitlines()[-1]
    assert "cannot tell which network interface reaches the rendezvous address 10.99.0.1" in last
    assert "set GLOO_SOCKET_IFNAME" in last


# ---------------------------------------------------------------- silent hosts under varuna-launch


@pytest.fixture(scope="module")
def chaos_reference(tmp_path_factory: pytest.TempPathFactory):
    chaos = _chaos_hosts()
    opts = chaos.Options(steps=12, checkpoint_every=2)
    return opts, chaos.reference(opts, tmp_path_factory.mktemp("reference") / "run")


@needs_net
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize(("fault", "victim"), [("silent", 0), ("silent", 2), ("silent-live", 0),
                                               ("silent-live", 3)])
def test_a_silent_host_is_named_within_5s_and_the_job_recovers(chaos_reference, tmp_path, fault, victim):
    """P=2 × D=2 GPT on 4 hosts (one worker each: host i holds rank i), deterministic; host
    ``victim``'s link goes down at step 3. The launcher names that host and rank within 5 s, its
    worker is gone (its agent fenced it), the job recovers by itself (restart from the newest
    checkpoint at P=2 × D=1, or the survivors regroup live), ends with the final weights and
    optimizer state of the undisturbed run bit for bit, and leaves no process in any namespace."""
    chaos = _chaos_hosts()
    opts, ref = chaos_reference
    trial = chaos.Trial(name=f"{fault}-{victim}", fault=fault, victims=[victim, 0], step=3)
    outcome = chaos.run_trial(opts, trial, tmp_path / "trial", ref)
    err = (tmp_path / "trial" / "launcher.err").read_text()
    assert outcome.error == "" and outcome.code == 0, f"{outcome}\n{err[-4000:]}"
    address = f"10.214.0.{victim + 1}"
    assert outcome.named == [f"h{victim}={address}"]
    assert outcome.silent_s[0] <= chaos.DETECTION_BOUND_S
    assert outcome.detect_s[0] <= chaos.DETECTION_BOUND_S + chaos.LOAD_MARGIN_S
    host = f"h{victim}={address}"
    where = f"{host} rank {victim} stage {victim % 2} replica {victim // 2} lost: host {host} went silent"
    if fault == "silent":
        assert f"launch 1 failed: {where}" in err, err[-4000:]
        assert outcome.launches == 2
    else:
        assert f"{where}, no word from its agent" in err
        assert "live morph: the 3 other worker(s) regroup" in err
    assert outcome.identical is True and outcome.orphans == 0
    assert outcome.fenced_s and outcome.fenced_s[0] < 4.0 + chaos.LOAD_MARGIN_S


# ---------------------------------------------------------------- blame and restarts on one machine

BLAME_WORKER = """
import os, signal, sys, time
from pathlib import Path
out, mode = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
if rank == 1:
    print("varuna: rank 1 (host h) stopped waiting in step 2: rank 0 (host h, pid 1) has shown no sign of"
          " life for 10s", file=sys.stderr, flush=True)
    (out / "symptom").write_text("")
    os._exit(75)
while not (out / "symptom").exists():  # rank 0 dies only once rank 1 has exited (no sleep as a clock)
    time.sleep(0.01)
if mode == "cause":
    os.kill(os.getpid(), signal.SIGKILL)
signal.pause()  # "symptom only": rank 0 stays blocked until the launcher stops it
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["cause", "symptom"])
def test_the_last_line_names_the_cause_not_a_survivor_that_exited_75(tmp_path: Path, mode: str):
    """Note [Blame]: rank 1 exits 75 first (its peer watch saw rank 0 go); rank 0's own death,
    reported just after, is the cause the last line names. Without a cause, rank 1's exit is
    named with the peer it reported."""
    from varuna.launch.job import launch

    worker = tmp_path / "blame.py"
    worker.write_text(BLAME_WORKER)
    err = io.StringIO()
    code = launch(LaunchConfig(script=str(worker), script_args=(str(tmp_path), mode), pipeline_depth=2,
                               data_parallel=1, stop_timeout_s=5), stderr=err)
    assert code == 1
    last = err.getvalue().strip().splitlines()[-1]
    if mode == "cause":
        assert last == "varuna-launch: job failed: rank 0 stage 0 replica 0 was killed by SIGKILL (9)", last
    else:
        assert last.startswith("varuna-launch: job failed: rank 1 stage 1 replica 0 exited with code 75:"
                               " rank 1 (host h) stopped waiting in step 2: rank 0 (host h, pid 1)"), last


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_procs_max_restarts_relaunches_and_ends_bit_identical(chaos_reference, tmp_path: Path):
    """--procs 4 --max-restarts 1: a worker killed -9 mid-run; the launcher relaunches all four from
    the newest checkpoint and the final state equals the undisturbed run's bit for bit."""
    chaos = _chaos_hosts()
    opts, ref = chaos_reference
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "varuna.launch", "--procs", "4", "--pipeline-depth", "2", "--quiet",
           "--max-restarts", "1", "--checkpoint-dir", str(ckpt), "--log-dir", str(logs),
           *chaos.train_args(opts)]
    with open(tmp_path / "out", "wb") as out, open(tmp_path / "err", "wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=tmp_path, env=chaos._env())
    try:
        _wait(lambda: [s for s in chaos.STEP_RE.findall((tmp_path / "out").read_text()) if int(s) >= 3],
              180, "step 3")
        workers = chaos.json.loads((logs / "launch.json").read_text())["workers"]
        pid = {w["rank"]: w["pid"] for w in workers}[3]
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, (tmp_path / "err").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    text = (tmp_path / "err").read_text()
    assert "launch 1 failed: rank 3 stage 1 replica 1 was killed by SIGKILL (9)" in text, text[-3000:]
    assert "restarting all 4 workers from the newest checkpoint (restart 1 of 1)" in text
    assert chaos.bit_identical(chaos.final_state(ckpt, opts.steps), ref) == ""
