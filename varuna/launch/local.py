"""Workers on this machine: :class:`LocalHost` spawns each worker in its own session with a
parent-death signal, and :class:`LocalWorker` kills the worker's whole process group when it
exits (Note [No orphans] in :mod:`varuna.launch.procs`). ``varuna-launch --procs N`` uses one
``LocalHost``; every per-host agent (:mod:`varuna.launch.agent`) spawns through one too.

Example::

    >>> import time
    >>> from varuna.launch.spec import LaunchConfig, plan_workers
    >>> cfg = LaunchConfig(script="-c", script_args=("print('hi')",), pipeline_depth=1, data_parallel=1)
    >>> host = LocalHost(slots=1)
    >>> worker = host.spawn(plan_workers(cfg, [host], master_port=29500)[0])
    >>> worker.output_streams[0].read()
    b'hi\\n'
    >>> while worker.poll() is None:
    ...     time.sleep(0.01)
    >>> worker.poll()
    0
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from typing import IO

from varuna.launch.procs import KILL_REAP_TIMEOUT_S, pdeathsig_preexec
from varuna.launch.spec import WorkerSpec

__all__ = ["LocalHost", "LocalWorker"]


class LocalWorker:
    """A worker process on this machine, in its own session (Note [No orphans])."""

    def __init__(self, spec: WorkerSpec, popen: subprocess.Popen[bytes]) -> None:
        self.spec = spec
        self._popen = popen
        self._returncode: int | None = None

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def output_streams(self) -> tuple[IO[bytes], IO[bytes]]:
        assert self._popen.stdout is not None and self._popen.stderr is not None
        return self._popen.stdout, self._popen.stderr

    def poll(self) -> int | None:
        if self._returncode is not None:
            return self._returncode
        if hasattr(os, "waitid"):
            try:
                # WNOWAIT: learn that it exited but leave the zombie, which pins the group id.
                info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                info = True  # already reaped (by Popen itself); fall through to read the code
            if info is None:
                return None
            self._kill_group(signal.SIGKILL)  # leftovers: children the worker did not wait for
            returncode = self._popen.wait(timeout=KILL_REAP_TIMEOUT_S)  # a zombie: returns at once
        else:  # no waitid (not Linux): reap first, then a best-effort group kill
            returncode = self._popen.poll()
            if returncode is None:
                return None
            self._kill_group(signal.SIGKILL)
        self._returncode = returncode
        return returncode

    def send_signal(self, sig: int) -> None:
        if self._returncode is None:
            self._kill_group(sig)

    def _kill_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


@dataclass(kw_only=True)
class LocalHost:
    """This machine.

    Example::

        >>> LocalHost(slots=4).address
        '127.0.0.1'
    """

    slots: int
    """How many workers it may run (the launcher passes P×D)."""
    address: str = "127.0.0.1"
    """Loopback: every worker is on this machine."""

    def spawn(self, spec: WorkerSpec) -> LocalWorker:
        popen = subprocess.Popen(
            list(spec.argv),
            cwd=spec.cwd,
            env={**os.environ, **spec.set_vars},
            # Workers share no terminal: N processes reading one stdin would steal each other's
            # input, and outside the terminal's session a read would fail anyway.
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=pdeathsig_preexec(),
            close_fds=True,
        )
        return LocalWorker(spec, popen)
