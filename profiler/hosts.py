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
- **loopback**: every process on 127.0.0.1; links between "hosts" get the whole emulated network
  (latency, jitter, bandwidth) from :mod:`varuna.testing.netem`, which delays point-to-point messages only:
  all-reduces run at loopback speed (a documented limit of that mode).

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
import shutil
import socket
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

__all__ = ["HostSet", "open_hosts", "netns_available", "HostEmulationError"]

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

    def address(self, host: int) -> str:
        return f"{_SUBNET}.{host + 1}" if self.mode == "netns" else "127.0.0.1"

    def wrap(self, host: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` on ``host``."""
        if self.mode == "netns":
            return ["ip", "netns", "exec", self.namespaces[host], *argv]
        return list(argv)

    def env(self, host: int) -> dict[str, str]:
        iface = "eth0" if self.mode == "netns" else "lo"
        return {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface}

    def free_port(self) -> int:
        if self.mode == "netns":
            return 29500  # a fresh namespace: nothing else listens there
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def describe(self) -> str:
        if self.mode == "netns":
            shaped = "tbf-shaped" if self.bandwidth_shaped else "unshaped"
            return f"{self.num_hosts} network namespaces on a bridge ({shaped} veths)"
        return f"{self.num_hosts} emulated hosts on loopback"


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
def open_hosts(mode: str, *, num_hosts: int, bandwidth_bytes_per_s: float | None = None) -> Iterator[HostSet]:
    """Emulate ``num_hosts`` hosts (``mode``: auto, netns or loopback) for the block's duration."""
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
