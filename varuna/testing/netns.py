"""Hosts that are real network hosts, on one machine: one network namespace per host, a bridge, an
sshd per host, rate-limited links, and the faults a cloud inflicts on them (Note [Hosts in
namespaces]). Tests, ``scripts/chaos.py`` and calibration runs use it to run ``varuna-launch
--hosts`` against hosts whose packets can *vanish* (a partition, an evicted VM), which a process
killed on loopback never shows: the kernel resets a killed process's connections at once.

Note [Hosts in namespaces]
~~~~~~~~~~~~~~~~~~~~~~~~~~
- **Topology.** A namespace ``<set>br`` holds the bridge ``br0``; each host ``i`` is a namespace
  ``<set>h<i>`` whose ``eth0`` (a veth with a fixed MAC) is plugged into port ``p<i>`` of the
  bridge, address ``10.214.0.<i+1>/24``; a *control* namespace ``<set>c`` (address
  ``10.214.0.254``) is the head node where the launcher runs, so that a silent host cuts the
  launcher off from that host only. Nothing appears in the machine's own namespace; the
  addresses exist only inside these namespaces (the set's prefix ``<set>`` is ``vn<pid>s<n>``).
- **No ARP.** Every namespace has permanent neighbour entries for every other one. Without them a
  host whose port is down would become *unreachable* (a failed ARP makes connects fail with
  EHOSTUNREACH after ~3 s) instead of *silent*, which a cloud fabric never does.
- **Links.** With ``rate_bytes_per_s``, a ``tbf`` qdisc on both ends of each host's link (the
  host's ``eth0`` and the bridge port towards it) caps each direction, as a full-duplex NIC.
  ``net.ipv4.tcp_slow_start_after_idle`` is 0 in every namespace (as in profiler/hosts.py).
  (``netem`` does not exist in this kernel; latency is :mod:`varuna.testing.netem`'s business.)
- Note [Link bucket]: the ``tbf`` bucket is 1 ms of traffic, at least 32 KiB. A link is meant to
  be a NIC of rate R, and a bucket lets its first bytes after a pause pass at line rate instead:
  with 128 KiB (this set's bucket until 2026-11), a 256 KiB message after 0.2 s idle crossed a
  100 Mbit/s link in 12.0 ms, an all-reduce of 256 KiB in 13.8 ms, against 21.3 / 22.2 ms with a
  16 KiB bucket and 21.4 ms from the latency + bytes / bandwidth line the profiler fits to
  back-to-back sends -- a pipeline's activations, sent once per task, then ran ~2x faster than
  any calibration says (docs/profiling.md, "Calibrating real links"). 32 KiB: 21.4 / 20.6 ms.
  Back-to-back traffic hardly moves: 4 MiB sends 349 / 350 ms (32 / 128 KiB), a 4 MiB all-reduce
  of 2 ranks 365 / 345 ms and of 4 ranks (2 per host) 477 / 525 ms.
- **Faults.** :meth:`NetHosts.blackhole` sets the host's bridge port down: its packets, in both
  directions, vanish, no reset ever arrives, its processes keep running; :meth:`NetHosts.heal`
  sets it up again (TCP connections that did not time out meanwhile resume). :meth:`NetHosts.kill`
  SIGKILLs every process of the host but its sshd (the kernel then resets their connections: the
  fast failure); :meth:`NetHosts.set_rate` cuts (or restores) the link's bandwidth.
- **Cleanup.** :meth:`NetHosts.close` (every exit path of the ``with`` block) SIGKILLs every
  process left in every namespace of the set (``ip netns pids``: a namespace deleted with
  processes in it lives on), waits for them, then deletes the namespaces by name. sshd dies with
  the process that started it (parent-death signal); a set whose creator died anyway (SIGKILL) is
  removed by the next :meth:`NetHosts.create` of any process. While a set is open in the main
  thread, SIGTERM raises ``SystemExit`` (when no other handler was installed) so an interrupted
  run still reaches the cleanup.

Root and iproute2 are needed (:func:`netns_unavailable` says why not, in one line).

Example::

    with NetHosts.create(3, workdir=tmp_path, rate_bytes_per_s=125e6) as net:
        subprocess.run(net.control(["ssh", *net.ssh_options(), net.address(1), "true"]), check=True)
        net.blackhole(1)      # host 1 goes silent
        net.heal(1)
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from varuna.testing.sshd import SshKeys, sshd_unavailable, start_sshd, stop_sshd

__all__ = ["NetHosts", "netns_unavailable", "remove_stale_sets"]

_SUBNET = "10.214.0"
_CONTROL_OCTET = 254
_SET_RE = re.compile(r"^vn(\d+)s\d+(?:h\d+|br|c)$")
_counter = itertools.count()
#: How long the processes of a namespace may take to die after SIGKILL (stuck in the kernel).
_KILL_WAIT_S = 10.0
SSH_PORT = 22


def netns_unavailable() -> str | None:
    """Why hosts in namespaces cannot be built here (one line naming the fix), or None.

    Example::

        >>> netns_unavailable() is None or "root" in netns_unavailable() or "install" in netns_unavailable()
        True
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "hosts in network namespaces need root (ip netns add); run as root"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install -y {package})"
    return None


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, timeout=30)


def _netns_names() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _namespace_pids(name: str) -> list[int]:
    out = _run(["ip", "netns", "pids", name], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_and_delete(names: Sequence[str], spare: Sequence[int] = ()) -> None:
    """SIGKILL every process in ``names`` (but ``spare``), wait (bounded), delete the namespaces."""
    deadline = time.monotonic() + _KILL_WAIT_S
    while True:
        left = [p for n in names for p in _namespace_pids(n) if p not in spare]
        if not left or time.monotonic() > deadline:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)  # the kernel needs a moment to tear a killed process down
    for name in names:
        _run(["ip", "netns", "del", name], check=False)
        with contextlib.suppress(OSError):  # a set made with loopback_hostname
            shutil.rmtree(Path("/etc/netns") / name)


def remove_stale_sets() -> list[str]:
    """Delete the namespaces (and kill their processes) of sets whose creating process is gone.

    Example::

        >>> isinstance(remove_stale_sets(), list)
        True
    """
    if netns_unavailable() is not None:
        return []
    stale = [
        n for n in _netns_names() if (m := _SET_RE.match(n)) and not os.path.exists(f"/proc/{m.group(1)}")
    ]
    _kill_and_delete(stale)
    return stale


@dataclass
class NetHosts:
    """A set of hosts in network namespaces (Note [Hosts in namespaces]); build it with
    :meth:`create`, use it as a context manager."""

    prefix: str
    num_hosts: int
    keys: SshKeys | None
    rate_bytes_per_s: float | None = None
    _namespaces: list[str] = field(default_factory=list)
    _sshd: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    _previous_sigterm: object = None
    _closed: bool = False

    # -- names and addresses ---------------------------------------------------------------------

    def namespace(self, host: int | None) -> str:
        """The namespace of ``host`` (None: the control namespace, where the launcher runs)."""
        return f"{self.prefix}c" if host is None else f"{self.prefix}h{host}"

    @property
    def bridge_namespace(self) -> str:
        return f"{self.prefix}br"

    def address(self, host: int | None) -> str:
        """``host``'s IPv4 address (None: the control namespace's)."""
        return f"{_SUBNET}.{_CONTROL_OCTET if host is None else host + 1}"

    @staticmethod
    def _mac(host: int | None) -> str:
        return f"02:76:00:00:00:{_CONTROL_OCTET if host is None else host + 1:02x}"

    def members(self) -> list[int | None]:
        """Every host, then the control namespace (None)."""
        return [*range(self.num_hosts), None]

    def run_in(self, host: int | None, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` in ``host``'s namespace (None: the control namespace)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def control(self, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` on the control host (the launcher's head node)."""
        return self.run_in(None, argv)

    def ssh_options(self) -> list[str]:
        """``varuna-launch`` options to reach the hosts (``--ssh-key``, ``--ssh-known-hosts``)."""
        if self.keys is None:
            raise RuntimeError("this set was created without sshd")
        return self.keys.launcher_args()

    def door(self, path: Path, host: int | None, port: int) -> subprocess.Popen[bytes]:
        """A Unix socket at ``path`` relaying to ``host``'s ``port`` (None: the control host), for a
        client on this machine that must reach a server inside the set (:mod:`varuna.testing.forward`).
        The relay runs in the control namespace (removed with the set) and listens once this returns."""
        proc = subprocess.Popen(
            self.control([sys.executable, "-m", "varuna.testing.forward", str(path), self.address(host),
                          str(port)]),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": _package_root()},
        )
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":  # bounded: it exits (EOF) if it cannot listen
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the door at {path} did not open")
        return proc

    # -- faults ----------------------------------------------------------------------------------

    def blackhole(self, host: int) -> float:
        """Make ``host`` silent: its packets vanish in both directions, nothing is reset.
        Returns ``time.time()`` right after the link went down (the fault's time, for logs)."""
        _run(["ip", "-n", self.bridge_namespace, "link", "set", f"p{host}", "down"])
        return time.time()

    def heal(self, host: int) -> float:
        """Undo :meth:`blackhole`; returns ``time.time()`` after the link came back."""
        _run(["ip", "-n", self.bridge_namespace, "link", "set", f"p{host}", "up"])
        return time.time()

    def kill(self, host: int) -> list[int]:
        """SIGKILL every process of ``host`` except its sshd listener (the VM stays, the job's
        processes are gone: their connections are reset by the kernel). Returns the pids."""
        spare = {p.pid for p in self._sshd.values()}
        pids = [p for p in _namespace_pids(self.namespace(host)) if p not in spare]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def set_rate(self, host: int, rate_bytes_per_s: float) -> None:
        """Cap ``host``'s link (both directions) at ``rate_bytes_per_s`` (a bandwidth cut, or
        back to normal)."""
        for ns, dev in ((self.namespace(host), "eth0"), (self.bridge_namespace, f"p{host}")):
            _shape(ns, dev, rate_bytes_per_s)

    def pids(self, host: int | None) -> list[int]:
        """Processes now in ``host``'s namespace, its sshd listener excluded."""
        spare = {p.pid for p in self._sshd.values()}
        return [p for p in _namespace_pids(self.namespace(host)) if p not in spare]

    # -- life cycle ------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        num_hosts: int,
        *,
        workdir: Path,
        rate_bytes_per_s: float | None = 125e6,
        sshd: bool = True,
        loopback_hostname: bool = False,
    ) -> NetHosts:
        """Build ``num_hosts`` hosts (default links: 1 Gbit/s each way) with an sshd each (keys in
        ``workdir/ssh``). ``loopback_hostname``: inside the namespaces this machine's host name
        resolves to 127.0.1.1 (``/etc/netns/<ns>/hosts``), as on many images, so a process that
        trusts its host name binds to loopback. Raises ``RuntimeError`` (one line) when this
        machine cannot do it."""
        why = netns_unavailable() or (sshd_unavailable() if sshd else None)
        if why is not None:
            raise RuntimeError(why)
        if num_hosts < 1 or num_hosts > 200:
            raise ValueError(f"num_hosts must be 1..200, got {num_hosts}")
        remove_stale_sets()
        net = cls(
            prefix=f"vn{os.getpid()}s{next(_counter)}",
            num_hosts=num_hosts,
            keys=SshKeys.generate(workdir / "ssh") if sshd else None,
            rate_bytes_per_s=rate_bytes_per_s,
        )
        try:
            net._build(loopback_hostname)
            if sshd:
                net._start_sshd()
        except BaseException:
            net.close()
            raise
        return net

    def _build(self, loopback_hostname: bool) -> None:
        br = self.bridge_namespace
        self._add_namespace(br)
        _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        for host in self.members():
            ns, port = self.namespace(host), "pc" if host is None else f"p{host}"
            self._add_namespace(ns)
            _run(["ip", "-n", ns, "link", "add", "eth0", "address", self._mac(host), "type", "veth",
                  "peer", "name", port, "netns", br])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0"])
            for dev in ("eth0", "lo"):
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
            # As profiler/hosts.py's namespaces (measured there): a connection idle for a moment
            # (a paced message, a ring all-reduce's step) must not restart TCP slow start behind
            # the tbf, or a calibrated link reads slower than its cap.
            _run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"],
                 check=False)
            _run(["ip", "-n", br, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", br, "link", "set", port, "up"])
            if loopback_hostname:
                self._hosts_file(ns)
        for host in self.members():
            for other in self.members():
                if other != host:
                    _run(["ip", "-n", self.namespace(host), "neigh", "replace", self.address(other),
                          "lladdr", self._mac(other), "dev", "eth0", "nud", "permanent"])
        if self.rate_bytes_per_s:
            for host in range(self.num_hosts):
                self.set_rate(host, self.rate_bytes_per_s)

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)

    @staticmethod
    def _hosts_file(ns: str) -> None:
        # ip netns exec bind-mounts /etc/netns/<ns>/hosts over /etc/hosts for what runs there.
        directory = Path("/etc/netns") / ns
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n")

    def _start_sshd(self) -> None:
        assert self.keys is not None
        for host in range(self.num_hosts):
            self._sshd[host] = start_sshd(
                self.keys, port=SSH_PORT, listen=[self.address(host)], name=f"h{host}",
                wrap=self.run_in(host, []),
            )
        logs = {h: self.keys.directory / f"sshd-h{h}.log" for h in self._sshd}
        deadline = time.monotonic() + 20.0
        while True:
            waiting = [h for h, log in logs.items() if b"Server listening" not in _read(log)]
            if not waiting:
                return
            dead = [h for h in waiting if self._sshd[h].poll() is not None]
            if dead or time.monotonic() > deadline:
                h = (dead or waiting)[0]
                log = _read(logs[h]).decode(errors="replace")
                raise RuntimeError(f"sshd of host {h} did not start: {log}")
            time.sleep(0.05)

    def close(self) -> None:
        """Kill what runs in the namespaces, stop the sshds, delete everything by name. Safe to
        call more than once."""
        if self._closed:
            return
        self._closed = True
        for proc in self._sshd.values():
            stop_sshd(proc, timeout_s=5.0)
        _kill_and_delete(self._namespaces)
        self._namespaces.clear()

    def __enter__(self) -> NetHosts:
        if _in_main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._previous_sigterm = signal.SIG_DFL
            signal.signal(signal.SIGTERM, _sigterm_to_exit)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.close()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _package_root() -> str:
    root = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)


def _shape(ns: str, dev: str, rate_bytes_per_s: float) -> None:
    bits = max(8, int(rate_bytes_per_s * 8))
    # Note [Link bucket]: 1 ms of traffic, at least 32 KiB; queue: 100 ms.
    burst = max(32 << 10, int(rate_bytes_per_s * 0.001))
    _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
          "burst", str(burst), "latency", "100ms"])


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _sigterm_to_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
