"""Process helpers shared by the launcher, its per-host agent and the manager: the parent-death
signal, free TCP ports, loopback addresses, and how long to wait for a killed process to be reaped.

Note [No orphans]: every worker is started in its own session (``start_new_session=True``), so
its process group holds the worker and any children it forks, and we signal the *group*. A
worker's exit is detected with ``waitid(WNOWAIT)``, which leaves the worker a zombie; while the
zombie exists its pid (= the group id) cannot be reused, so SIGKILL to the group reaches only
leftovers of that worker, never an unrelated process; only then is the zombie reaped. If the
launcher itself is killed (SIGKILL, OOM killer) no cleanup code runs, so each worker also asks
the kernel for ``PR_SET_PDEATHSIG=SIGKILL`` before exec (:func:`pdeathsig_preexec`). Caveats:
the parent-death signal fires when the *thread* that spawned the worker exits, so
:func:`varuna.launch.job.launch` spawns and supervises in the calling thread; and grandchildren
of a worker do not inherit it, so they survive a SIGKILL of the launcher unless the worker
arranges its own cleanup.

Example::

    >>> 0 < find_free_port() < 65536
    True
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
from collections.abc import Callable

from varuna.core.process import PR_SET_PDEATHSIG, libc_prctl

__all__ = ["KILL_REAP_TIMEOUT_S", "PR_SET_PDEATHSIG", "find_free_port", "libc_prctl", "pdeathsig_preexec"]

#: After SIGKILL, how long to wait for the kernel to reap workers before giving up on them
#: (a process stuck in uninterruptible I/O cannot be killed sooner).
KILL_REAP_TIMEOUT_S = 5.0

def pdeathsig_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the kernel SIGKILL the child when this process (more
    precisely: the spawning thread) dies, or None where ``prctl`` is unavailable
    (Note [No orphans]).

    Example::

        >>> import subprocess
        >>> subprocess.run(["true"], preexec_fn=pdeathsig_preexec()).returncode
        0
    """
    prctl = libc_prctl()
    if prctl is None:
        return None
    parent_pid = os.getpid()
    sigkill = int(signal.SIGKILL)

    # Runs in the child between fork and exec: keep it to two system calls (prctl was resolved
    # in the parent, so the child loads nothing).
    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        # The parent may have died between fork and prctl; then no signal would ever come.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sigkill)

    return preexec


def find_free_port(host: str = "") -> int:
    """A TCP port that is free right now, found by binding port 0.

    Another process may take it before the workers bind it; the window is short and torch's
    rendezvous then fails loudly (the launcher exits 1), so a retry by the caller is the fix.

    Example::

        >>> 0 < find_free_port("127.0.0.1") < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name, an IPv4/IPv6 literal, brackets allowed) is this machine's loopback.

    Example::

        >>> is_loopback("[::1]"), is_loopback("localhost"), is_loopback("10.0.0.1")
        (True, True, False)
    """
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
