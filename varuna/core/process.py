"""The parent-death signal, for every layer that starts processes (launcher, agents, manager,
profiler): a child asks the kernel to SIGKILL it when its parent dies, so no worker outlives a
killed parent.

Prefer :func:`die_with_parent`, called first thing in the child, to a ``preexec_fn``: running
Python between fork and exec in a process with gRPC threads (the manager's agent, a test process
that used the manager's client) can crash the child in gRPC's fork handler ("epoll_wait error:
Bad file descriptor", exit -6).

Example::

    >>> prctl = libc_prctl()
    >>> prctl is None or callable(prctl)
    True
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import sys
from collections.abc import Callable

__all__ = ["PARENT_PID_VAR", "PR_SET_PDEATHSIG", "die_with_parent", "libc_prctl", "pdeathsig_prefix"]

#: Environment variable a parent sets to its pid for a child that calls :func:`die_with_parent`.
PARENT_PID_VAR = "VARUNA_PARENT_PID"

#: ``prctl`` option that asks for a signal when the parent (thread) dies (``<linux/prctl.h>``).
PR_SET_PDEATHSIG = 1


@functools.lru_cache(maxsize=1)
def libc_prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or None where it does not exist (non-Linux).

    Resolved once and cached, so a forked child calling it loads nothing.

    Example::

        >>> prctl = libc_prctl()
        >>> prctl is None or callable(prctl)
        True
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        # CDLL(None): the symbols already loaded into this process, libc among them (no search).
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def die_with_parent(expected_parent: int) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``), and
    exit at once if the parent already changed from ``expected_parent`` (it died before the
    request took effect). False where the call does not exist (non-Linux).

    The signal is tied to the parent *thread* that forked, so a parent spawns from a thread that
    lives as long as the child should.
    """
    prctl = libc_prctl()
    if prctl is None:
        return False
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != expected_parent:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def pdeathsig_prefix() -> list[str]:
    """Words to put before a command that is not Python (a daemon: sshd, slurmd) so the kernel
    SIGKILLs it when the spawning thread dies: util-linux's ``setpriv --pdeathsig KILL``, which
    sets the signal and execs the command, with no Python between fork and exec. Empty where
    setpriv is missing (then a ``preexec_fn`` is the fallback, with the hazard above).

    Example::

        >>> import subprocess
        >>> subprocess.run([*pdeathsig_prefix(), "true"]).returncode
        0
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL"] if setpriv is not None else []
