"""Issue 35, items 5-6: a live run's rendezvous store is authenticated (Note [Store
authentication] in varuna/runtime/auth_store.py) and the launcher checks a frozen verdict against
its own view before killing (Note [Verdict check] in varuna/launch/live_store.py).

A neighbour who knows the store's port (``ss -ltn`` shows it to every local user) but not the
run's secret can neither read, write nor grow it; once it wrote ``varuna/live/dead/3`` and member
3 left, or ``dead_why/3`` and the launcher SIGKILLed it, and 300 MiB it stored grew the launcher
from 221 to 523 MB.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from varuna.launch import live_store as live_store_module
from varuna.launch.live_store import LiveStore
from varuna.runtime.auth_store import MAX_PENDING, AuthStore, AuthStoreServer, new_key

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "live_store_worker.py"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def forge(port: int) -> str:
    """What a neighbour tried (issue 35): a TCPStore client writing the two verdict keys of member 1.
    Returns how it ended."""
    try:
        c = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1))
        c.set("varuna/live/dead_why/1", "forged")
        c.set("varuna/live/dead/1", "1")
    except (RuntimeError, OSError) as exc:
        return f"refused: {type(exc).__name__}"
    return "written"


def flood(port: int, total: int) -> int:
    """Push ``total`` bytes at the store without the secret; how many it took before closing."""
    sent, chunk = 0, b"\0" * (1 << 20)
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        while sent < total:
            s.sendall(chunk)
            sent += len(chunk)
    return sent


# -------------------------------------------------------------------------------- the store itself


def test_the_store_answers_like_a_tcpstore():
    """The same requests to a real TCPStore (the reference) and to the authenticated store: the
    same answers, blocking waits that run out included."""
    key = new_key()
    server = AuthStoreServer("127.0.0.1", key=key)
    ref = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    ours = AuthStore("127.0.0.1", server.port, key=key, timeout=timedelta(seconds=10))
    try:
        answers = []
        for store in (ref, ours):
            store.set("a", "1")
            store.set("bin", b"\x00\xff")
            got = [store.add("a", 41), store.add("n", 3), store.get("a"), store.get("bin"),
                   store.check(["a", "n"]), store.check(["a", "missing"]),
                   store.compare_set("c", "", "new"), store.compare_set("c", "other", "x"),
                   store.compare_set("c", "new", "newer"), store.compare_set("absent", "expected", "x"),
                   store.check(["absent"]), store.multi_get(["a", "c"]), store.delete_key("c"),
                   store.check(["c"]), store.delete_key("c")]
            with pytest.raises(dist.DistStoreError):
                store.wait(["never"], timedelta(milliseconds=200))
            pg = dist.PrefixStore("gen0/pg", store)  # what gloo's rendezvous goes through
            pg.set("k", b"v")
            got.append(store.get("gen0/pg/k"))
            answers.append(got)
        assert answers[0] == answers[1]
    finally:
        ours.close()
        server.close()


def test_a_client_without_the_secret_reads_writes_and_stores_nothing():
    key = new_key()
    server = AuthStoreServer("127.0.0.1", key=key)
    member = AuthStore("127.0.0.1", server.port, key=key, timeout=timedelta(seconds=10))
    try:
        member.set("varuna/live/beat/1", "7 4242")
        held = server.stored_bytes
        assert forge(server.port).startswith("refused")
        with pytest.raises(dist.DistNetworkError, match="refused this process's key"):
            AuthStore("127.0.0.1", server.port, key=new_key(), timeout=timedelta(seconds=5))
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            hello = s.recv(64)  # all it ever says before a proof: its magic and a fresh nonce
            assert len(hello) == 36 and hello.startswith(b"VLS1")
            s.sendall(b"x" * 64)  # a wrong proof
            assert s.recv(64) == b"", "closed without a word"
        assert server.refused >= 3 and server.stored_bytes == held
        assert not member.check(["varuna/live/dead/1"]) and not member.check(["varuna/live/dead_why/1"])
        assert member.get("varuna/live/beat/1") == b"7 4242"
    finally:
        member.close()
        server.close()


def test_a_flood_without_the_secret_is_bounded_and_does_not_keep_members_out():
    """300 MiB pushed at the port and twice MAX_PENDING idle connections: the server holds none of
    it (its process grows by far less than the flood) and a member still gets in at once."""
    key = new_key()
    server = AuthStoreServer("127.0.0.1", key=key)
    idle = []
    try:
        before = rss_bytes(os.getpid())
        sent = flood(server.port, 300 << 20)
        assert sent < 300 << 20, "the server stopped reading long before the flood's end"
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10)
                for _ in range(2 * MAX_PENDING)]
        member = AuthStore("127.0.0.1", server.port, key=key, timeout=timedelta(seconds=10))
        member.set("k", "v")
        assert member.get("k") == b"v"
        member.close()
        assert server.stored_bytes == len("k") + len("v")
        assert rss_bytes(os.getpid()) - before < 48 << 20
    finally:
        for s in idle:
            s.close()
        server.close()


def test_a_full_store_refuses_a_write_with_one_line():
    """Members that know the secret are bounded too: past ``max_bytes`` a write is refused (one
    line) and what is stored stays."""
    key = new_key()
    server = AuthStoreServer("127.0.0.1", key=key, max_bytes=1 << 20)
    member = AuthStore("127.0.0.1", server.port, key=key, timeout=timedelta(seconds=10))
    try:
        member.set("a", b"x" * (600 << 10))
        with pytest.raises(dist.DistStoreError, match="the live store is full") as err:
            member.set("b", b"x" * (600 << 10))
        assert "\n" not in str(err.value)
        assert server.stored_bytes <= 1 << 20 and not member.check(["b"])
        member.set("a", b"small")  # the connection is still good, and a smaller value fits again
        assert member.get("a") == b"small"
    finally:
        member.close()
        server.close()


def test_a_verdict_on_a_member_the_store_still_hears_is_not_acted_on(monkeypatch):
    """Note [Verdict check]: ``frozen(m)`` answers only once the store itself has not heard a
    beat from ``m`` for FROZEN_CONFIRM_S; a member that still beats leaves by itself."""
    with LiveStore() as store:
        c = store.store
        c.set("varuna/live/dead_why/1", "no heartbeat for 31s, seen by member 0: frozen or hung")
        c.set("varuna/live/dead_why/2", "no heartbeat for 31s, seen by member 0: frozen or hung")
        c.set("varuna/live/beat/1", "12 4242")  # member 1 beats; member 2 never did
        monkeypatch.setattr(live_store_module, "FROZEN_CONFIRM_S", 1e9)
        assert store.frozen(1) is None, "a member the store hears is not killed"
        assert store.frozen(2) is not None and store.frozen(3) is None
        monkeypatch.setattr(live_store_module, "FROZEN_CONFIRM_S", 0.0)
        assert "no heartbeat for 31s" in (store.frozen(1) or "")


# ---------------------------------------------------------------------------------- a live run


@pytest.mark.slow
def test_a_neighbour_who_knows_the_port_cannot_make_a_member_leave_or_be_killed(tmp_path):
    """``varuna-launch --live-morph`` with two members waiting in their group: a neighbour that
    read the port (here: from a worker's environment) writes the verdict keys of member 1 with a
    TCPStore client and pushes 300 MiB at the port. Both members stay (old code: member 1 found
    ``dead/1`` and left, or the launcher killed it for ``dead_why/1``), the launcher grows by far
    less than the flood, and the run ends 0."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "varuna.launch", "--procs", "2", "--pipeline-depth", "1", "--live-morph",
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs"), "--quiet",
           str(WORKER), str(out)]
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        while not ((out / "ready0").exists() and (out / "ready1").exists()):  # bounded: both joined
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate(timeout=60)
            time.sleep(0.05)
        pid = json.loads((tmp_path / "logs" / "launch.json").read_text())["workers"][1]["pid"]
        environ = dict(x.split("=", 1) for x in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
                       if "=" in x)
        port = int(environ["VARUNA_LIVE_STORE"].rsplit(":", 1)[1])  # all the neighbour knows
        before = rss_bytes(launcher.pid)
        assert forge(port).startswith("refused")
        threads = [threading.Thread(target=flood, args=(port, 100 << 20)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        grown = rss_bytes(launcher.pid) - before
        (out / "go").write_text("1")
        stdout, stderr = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate(timeout=30)
    assert launcher.returncode == 0, stderr[-3000:]
    assert "killing it" not in stderr and "regroup" not in stderr, stderr[-3000:]
    for m in (0, 1):
        report = json.loads((out / f"member{m}.json").read_text())
        assert report == {"declared_dead": False, "known_dead": [], "role": "working"}, (m, report)
    assert grown < 48 << 20, f"the launcher grew by {grown >> 20} MiB"
