"""Where the profiler's processes run: emulated hosts on this machine.

Calibration needs links *between hosts*. On one machine the profiler emulates H hosts in one of two
ways (:func:`open_hosts` picks; ``auto`` prefers the first):

- **netns** (root and iproute2 needed): one network namespace per host, each with an ``eth0``
  veth to a bridge living in another namespace of its own, addresses 10.213.0.(h+1)/24 that exist
  only inside these namespaces. Traffic between hosts crosses real kernel sockets and, when a
  bandwidth is asked for, a ``tbf`` qdisc on each host's ``eth0`` (egress, i.e. the NIC's transmit
  rate) — so collectives (all-reduce) see the bandwidth too, and the k processes of one host share
  it as they would a NIC. Kernel latency emulation (``netem``) is not available here, so latency
  and jitter are added to point-to-point sends by :mod:`varuna.testing.netem`. In each namespace
  ``net.ipv4.tcp_slow_start_after_idle`` is 0: with it on, every step of a ring all-reduce (idle
  for a moment while the previous chunk is reduced) restarts TCP slow start behind the tbf, and
  all-reduce times grow with the number of steps instead of the bytes (measured: 2x at 4 ranks).
- **ssh** (``varuna-profile --host-list``): the job's real hosts, reached with OpenSSH as
  ``varuna-launch --hosts`` reaches them (key authentication, ``BatchMode``, ``accept-new`` host
  keys; Note [Calibrating real links]). Nothing is emulated: the links are what they are.
- **loopback**: every process on 127.0.0.1; links between "hosts" get the whole emulated network
  (latency, jitter, bandwidth) from :mod:`varuna.testing.netem`, which delays point-to-point messages only:
  all-reduces run at loopback speed (a documented limit of that mode).

Note [Calibrating real links]: with ``--host-list`` the profiler's workers run on the listed hosts
(``k`` = ``--procs-per-host`` on each, rank 0's host first), so the intra-host link, the inter-host
links and the all-reduces are measured on the job's own machines and network, not emulated. Each
worker is started by ``ssh HOST 'cd CWD && export VARUNA_PARENT_PID=$PPID && exec env K=V...
python -m profiler.worker RUN_DIR'`` (every word but ``$PPID`` quoted: Note [No shell injection]
in varuna/launch/ssh.py): ssh forwards no environment, and the worker dies with its ssh session
(its parent is the session's sshd once the shell exec'd it). The run directory (plan and results)
must be on a file system every host shares, at the same path (``TMPDIR`` picks where), as the
launcher's checkpoint directory is. The clocks of different machines are related from the links'
ping-pongs (``same_clock`` False in :func:`profiler.network.link_stats`); a constant clock error
moves the fitted latency, never the bandwidth (the slope). The workers find the interface that
routes to ``MASTER_ADDR`` themselves (Note [Interface towards a host] in varuna/core/netif.py).
The profiler sits below ``varuna.launch`` (pyproject.toml's layers), so its ssh command line is its
own, with the launcher's options.

Namespaces are named ``vprof<pid>h<i>`` / ``vprof<pid>br`` and deleted on exit; namespaces left by
a profiler that was killed (its pid gone) are deleted the next time one starts.

Example::

    with open_hosts("auto", num_hosts=2, bandwidth_bytes_per_s=125e6) as hosts:
        argv = hosts.wrap(1, [sys.executable, "-m", "profiler.worker", plan])   # runs on host 1
        env = hosts.env(1)          # GLOO_SOCKET_IFNAME etc.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from varuna.core.process import PARENT_PID_VAR

__all__ = ["HostSet", "RemoteHost", "open_hosts", "netns_available", "HostEmulationError"]

_PREFIX = "vprof"
_SUBNET = "10.213.0"  # only ever configured inside namespaces this module creates


class HostEmulationError(RuntimeError):
    """The requested host emulation could not be set up."""


@dataclass(kw_only=True)
class HostSet:
    """H emulated hosts: how to start a process on host h and where rank 0's store listens."""

    mode: str
    """``netns`` or ``loopback``."""
    num_hosts: int
    namespaces: list[str] = field(default_factory=list)
    bandwidth_shaped: bool = False
    """True when the kernel (tbf) applies the inter-host bandwidth, so netem must not add it again."""
    remote: list[RemoteHost] = field(default_factory=list)
    """The hosts of the ``ssh`` mode (Note [Calibrating real links])."""

    @property
    def same_clock(self) -> bool:
        """Whether every process reads one clock (one machine)."""
        return self.mode != "ssh"

    def address(self, host: int) -> str:
        if self.mode == "ssh":
            return self.remote[host].host
        return f"{_SUBNET}.{host + 1}" if self.mode == "netns" else "127.0.0.1"

    def wrap(self, host: int, argv: Sequence[str], env: dict[str, str] | None = None) -> list[str]:
        """The command line that runs ``argv`` on ``host``; ``env``: what the ``ssh`` mode passes
        to the remote process (the other modes hand the whole environment to ``Popen``)."""
        if self.mode == "ssh":
            return self.remote[host].argv(argv, env or {})
        if self.mode == "netns":
            return ["ip", "netns", "exec", self.namespaces[host], *argv]
        return list(argv)

    def env(self, host: int) -> dict[str, str]:
        if self.mode == "ssh":
            return {}  # the worker picks the interface towards MASTER_ADDR (Note [Calibrating real links])
        iface = "eth0" if self.mode == "netns" else "lo"
        return {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface}

    def free_port(self) -> int:
        if self.mode == "ssh":
            return SSH_MASTER_PORT
        if self.mode == "netns":
            return 29500  # a fresh namespace: nothing else listens there
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def describe(self) -> str:
        if self.mode == "ssh":
            names = ", ".join(h.display for h in self.remote)
            return f"{self.num_hosts} hosts over ssh ({names}, real links)"
        if self.mode == "netns":
            shaped = "tbf-shaped" if self.bandwidth_shaped else "unshaped"
            return f"{self.num_hosts} network namespaces on a bridge ({shaped} veths)"
        return f"{self.num_hosts} emulated hosts on loopback"


#: Rank 0's store port on the first host in the ``ssh`` mode (torchrun's default MASTER_PORT).
SSH_MASTER_PORT = 29500
_HOST_RE = re.compile(r"^(?:([A-Za-z0-9_][A-Za-z0-9_.-]*)@)?([A-Za-z0-9_][A-Za-z0-9_.-]*)(?::(\d{1,5}))?$")


@dataclass(frozen=True, kw_only=True)
class RemoteHost:
    """One host of ``--host-list`` and how to start a process there (Note [Calibrating real links]).

    Example::

        >>> h = RemoteHost.parse("bob@10.0.0.5:2222", key_file="/k")
        >>> h.host, h.display
        ('10.0.0.5', 'bob@10.0.0.5:2222')
        >>> argv = h.argv(["python3", "-m", "profiler.worker", "/tmp/run"], {"RANK": "1"}, cwd="/src")
        >>> argv[-3:-1]
        ['--', '10.0.0.5']
        >>> argv[-1].split(" && ")
        ['cd /src', 'export VARUNA_PARENT_PID=$PPID', 'exec env RANK=1 python3 -m profiler.worker /tmp/run']
    """

    host: str
    user: str | None = None
    port: int | None = None
    key_file: str | None = None
    known_hosts_file: str | None = None
    connect_timeout_s: float = 10.0

    @classmethod
    def parse(cls, text: str, **ssh: Any) -> RemoteHost:
        """``[user@]host[:port]`` (``ValueError``, one line, otherwise)."""
        m = _HOST_RE.match(text.strip())
        if m is None or (m.group(3) and not 0 < int(m.group(3)) < 65536):
            raise ValueError(f"--host-list entry {text!r} is not [user@]host[:port] (letters, digits, . _ -)")
        return cls(host=m.group(2), user=m.group(1), port=int(m.group(3)) if m.group(3) else None, **ssh)

    @property
    def display(self) -> str:
        return f"{self.user + '@' if self.user else ''}{self.host}{f':{self.port}' if self.port else ''}"

    def argv(self, argv: Sequence[str], env: dict[str, str], *, cwd: str | None = None) -> list[str]:
        """``ssh ... HOST 'cd CWD && export VARUNA_PARENT_PID=$PPID && exec env K=V ... ARGV'``."""
        ssh = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new", "-o",
               f"ConnectTimeout={max(1, round(self.connect_timeout_s))}", "-o", "LogLevel=ERROR"]
        if self.known_hosts_file:
            ssh += ["-o", f"UserKnownHostsFile={self.known_hosts_file}"]
        if self.key_file:
            ssh += ["-i", self.key_file, "-o", "IdentitiesOnly=yes"]
        if self.port is not None:
            ssh += ["-p", str(self.port)]
        if self.user is not None:
            ssh += ["-l", self.user]
        words = " ".join(shlex.quote(w) for w in ["env", *(f"{k}={v}" for k, v in env.items()), *argv])
        remote = f"cd {shlex.quote(cwd or os.getcwd())} && export {PARENT_PID_VAR}=$PPID && exec {words}"
        return [*ssh, "--", self.host, remote]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def netns_available() -> bool:
    """Root and the ``ip`` tool: the preconditions of the netns mode (setup may still fail)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip") is not None


def _delete_stale() -> None:
    """Delete namespaces of profilers that died without cleaning up (their pid is gone)."""
    try:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return
    for line in names.splitlines():
        m = re.match(rf"({_PREFIX}(\d+)(?:h\d+|br))\b", line.strip())
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            subprocess.run(["ip", "netns", "del", m.group(1)], capture_output=True, timeout=30)


def _create_netns(num_hosts: int, bandwidth_bytes_per_s: float | None) -> HostSet:
    pid = os.getpid()
    bridge = f"{_PREFIX}{pid}br"
    hosts = HostSet(
        mode="netns", num_hosts=num_hosts, namespaces=[f"{_PREFIX}{pid}h{h}" for h in range(num_hosts)]
    )
    created: list[str] = []
    try:
        _ip("netns", "add", bridge)
        created.append(bridge)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        for h, ns in enumerate(hosts.namespaces):
            _ip("netns", "add", ns)
            created.append(ns)
            # Created inside the namespaces: the veth never appears in the root namespace.
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{h}", "netns", bridge)
            _ip("-n", ns, "addr", "add", f"{hosts.address(h)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", bridge, "link", "set", f"p{h}", "master", "br0")
            _ip("-n", bridge, "link", "set", f"p{h}", "up")
            subprocess.run(
                ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"],
                capture_output=True,
                timeout=30,
            )
        if bandwidth_bytes_per_s and shutil.which("tc"):
            bits = int(bandwidth_bytes_per_s * 8)
            # Bucket: 1 ms of traffic, at least 128 KiB. Larger buckets let messages of up to a
            # bucket pass at line rate (measured: 1 MiB at 2x the rate with 5 ms), bending the
            # latency + bytes/bandwidth line the links are fitted to; smaller ones (64 KiB) slow
            # the all-reduce's concurrent TCP flows down (measured: 1.9x the ideal time, 4 ranks).
            burst = max(128 << 10, int(bandwidth_bytes_per_s * 0.001))
            for ns in hosts.namespaces:
                subprocess.run(
                    [
                        "tc",
                        "-n",
                        ns,
                        "qdisc",
                        "add",
                        "dev",
                        "eth0",
                        "root",
                        "tbf",
                        "rate",
                        f"{bits}bit",
                        "burst",
                        str(burst),
                        "latency",
                        "1s",
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
            hosts.bandwidth_shaped = True
    except (OSError, subprocess.SubprocessError) as e:
        for ns in reversed(created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        detail = getattr(e, "stderr", "") or str(e)
        raise HostEmulationError(f"cannot set up network namespaces: {detail.strip()}") from e
    hosts.namespaces.append(bridge)  # deleted with the rest; never a host (index >= num_hosts)
    return hosts


@contextlib.contextmanager
def open_hosts(mode: str, *, num_hosts: int, bandwidth_bytes_per_s: float | None = None,
               remote: Sequence[RemoteHost] = ()) -> Iterator[HostSet]:
    """Emulate ``num_hosts`` hosts (``mode``: auto, netns or loopback) for the block's duration;
    with ``remote``, use those hosts over ssh instead (Note [Calibrating real links])."""
    if remote:
        yield HostSet(mode="ssh", num_hosts=len(remote), remote=list(remote))
        return
    if mode not in ("auto", "netns", "loopback"):
        raise ValueError(f"unknown host emulation {mode!r}; choose auto, netns or loopback")
    if num_hosts < 1:
        raise ValueError(f"need at least one host, got {num_hosts}")
    hosts: HostSet | None = None
    if mode in ("auto", "netns") and num_hosts > 1:
        if netns_available():
            _delete_stale()
            try:
                hosts = _create_netns(num_hosts, bandwidth_bytes_per_s)
            except HostEmulationError:
                if mode == "netns":
                    raise
        elif mode == "netns":
            raise HostEmulationError(
                "network namespaces need root and iproute2 (apt-get install -y iproute2)"
            )
    if hosts is None:
        hosts = HostSet(mode="loopback", num_hosts=num_hosts)
    try:
        yield hosts
    finally:
        for ns in reversed(hosts.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
