"""The worker processes of one VM agent (manager/agent/vm_agent.py): start a generation's workers
(from standbys when there are some: Note [Standby]), signal, kill and reap them, and enforce the
graceful-stop deadline.

Workers run as ``python -m manager.worker.shim SCRIPT ARGS``, each in its own session
(SIGUSR1/SIGKILL go to its whole process group) and with a parent-death signal set by the shim.

    >>> pool = WorkerPool(worker_env=dict, log_dir=Path("."), python="python3", say=print)
    >>> pool.any_running
    False
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from manager.common.procs import kill_group, reap, restore_normal_priority
from manager.transport import varuna_manager_pb2 as pb
from varuna.core.env import CONTRACT_VARS
from varuna.launch.live_store import LIVE_NOTICE_ENV

__all__ = ["REAP_TIMEOUT_S", "Worker", "WorkerPool"]

PROG = "varuna-vm-agent"
#: Bound on reaping a SIGKILLed worker (a process stuck in the kernel cannot die sooner).
REAP_TIMEOUT_S = 5.0


@dataclass
class Worker:
    """One worker process of a generation; ``exit_code`` is None while it runs."""

    rank: int
    generation: int
    popen: subprocess.Popen
    log: IO[bytes] | None
    exit_code: int | None = None
    stop_sent: float | None = None


class WorkerPool:
    """The agent's workers and standbys. ``worker_env`` turns a launch's environment into the
    worker's full one (the agent adds how to reach the manager); ``say`` logs one line.

    Example::

        pool = WorkerPool(worker_env=agent_env, log_dir=Path("logs"), python=sys.executable, say=print)
        pool.spawn(orders.workers, generation=3)
        pool.poll()                      # reap the ones that exited
        pool.kill_all()
    """

    def __init__(
        self,
        *,
        worker_env: Callable[[dict[str, str]], dict[str, str]],
        log_dir: Path,
        python: str,
        say: Callable[[str], None],
        standby: int = 0,
        standby_priority: str = "idle",
        standby_delay_s: float = 1.0,
    ) -> None:
        self.workers: list[Worker] = []
        self.stop_deadline: float | None = None
        #: When the manager said our generation trains (standbys wait for it).
        self.training_since: float | None = None
        self._worker_env = worker_env
        self._log_dir = log_dir
        self._python = python
        self._say = say
        self._standby = standby
        self._standby_priority = standby_priority
        self._standby_delay_s = standby_delay_s
        self._standbys: list[subprocess.Popen] = []
        self._job_env: dict[str, str] | None = None  # the last generation's environment, sans rank
        #: The notice signal of the current generation's workers (a live-morph job: hand over and
        #: leave, ``$VARUNA_LIVE_NOTICE_SIGNAL``); None: a notice means SIGUSR1 (checkpoint, stop).
        self.notice_signal: int | None = None

    @property
    def any_running(self) -> bool:
        """Whether a worker of the current generation still runs."""
        return any(w.exit_code is None for w in self.workers)

    def spawn(self, launches: list[pb.WorkerLaunch], generation: int) -> None:
        """Start ``generation``'s workers on this VM (a standby takes a rank when one is ready)."""
        self.workers = []
        self.stop_deadline = None
        names = {launch.env.get(LIVE_NOTICE_ENV, "") for launch in launches}
        self.notice_signal = _signal_number(names.pop()) if len(names) == 1 else None
        standby_ranks: list[int] = []
        for launch in launches:
            env = self._worker_env(dict(launch.env))
            self._job_env = {k: v for k, v in launch.env.items() if k not in CONTRACT_VARS}
            log_path = self._log_dir / f"gen{generation}-rank{launch.rank}.log"
            popen = self._take_standby(launch, env, log_path)
            if popen is not None:
                self.workers.append(Worker(rank=launch.rank, generation=generation, popen=popen, log=None))
                standby_ranks.append(launch.rank)
                continue
            self.workers.append(self._start(launch, env, log_path, generation))
        ranks = ", ".join(f"{w.rank}{' (standby)' if w.rank in standby_ranks else ''}" for w in self.workers)
        self._say(f"generation {generation}: started rank(s) {ranks}")

    def _start(self, launch: pb.WorkerLaunch, env: dict[str, str], log_path: Path, generation: int) -> Worker:
        log = open(log_path, "ab")
        try:
            popen = subprocess.Popen(
                [self._python, *launch.argv],
                cwd=launch.cwd or None,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # No preexec_fn: Python code between fork and exec crashes the child of a process
                # with gRPC threads; the parent-death signal is set by the shim instead.
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            log.write(f"{PROG}: cannot start rank {launch.rank}: {exc}\n".encode())
            log.close()
            self._say(f"cannot start rank {launch.rank}: {exc}")
            # Reported as an exited worker with code 127 (command not runnable).
            return Worker(
                rank=launch.rank, generation=generation, popen=_FailedPopen(), log=None, exit_code=127
            )
        return Worker(rank=launch.rank, generation=generation, popen=popen, log=log)

    # Note [Standby]: most of a small worker's start-up is importing torch (and torch._dynamo,
    # which the engine's dry run pulls in): seconds of CPU per process, on the critical path of
    # every morph. So, once a generation trains (the manager says so in RUN orders: it completed
    # its first step; standbys started earlier would compete with its start-up for the CPU), the
    # agent starts one standby per slot
    # (``python -m manager.worker.shim --standby``: imports done, then blocked reading stdin) and
    # hands the next generation's rank to it as one JSON line (argv, environment, directory, log
    # file). A standby is a normal worker from then on: own session, parent-death signal.

    def _take_standby(
        self, launch: pb.WorkerLaunch, env: dict[str, str], log_path: Path
    ) -> subprocess.Popen | None:
        while self._standbys:
            popen = self._standbys.pop(0)
            if reap(popen) is not None or popen.stdin is None:
                continue  # died while waiting
            job = {"argv": list(launch.argv), "env": env, "cwd": launch.cwd or "", "log": str(log_path)}
            try:
                # Out of SCHED_IDLE first (the standby may still be importing at idle priority).
                restore_normal_priority(popen.pid)
                popen.stdin.write(json.dumps(job).encode() + b"\n")
                popen.stdin.close()
            except OSError:
                kill_group(popen.pid, signal.SIGKILL)
                reap(popen, REAP_TIMEOUT_S)
                continue
            return popen
        return None

    def maintain_standbys(self) -> None:
        """Start one more standby when fewer than configured are ready and the generation has
        trained for ``standby_delay_s``."""
        self._standbys = [p for p in self._standbys if reap(p) is None]
        if (
            self._standby <= len(self._standbys)
            or self._job_env is None
            or self.training_since is None
            or time.monotonic() - self.training_since < self._standby_delay_s
        ):
            return
        env = {**self._worker_env(self._job_env), "VARUNA_STANDBY_PRIORITY": self._standby_priority}
        log = open(self._log_dir / "standby.log", "ab")
        try:
            # One per pass: spreading the imports keeps the running generation's steps smooth.
            self._standbys.append(
                subprocess.Popen(
                    [self._python, "-m", "manager.worker.shim", "--standby"],
                    cwd=self._log_dir,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                )
            )
        except OSError as exc:
            self._say(f"cannot start a standby worker: {exc}")
        finally:
            log.close()

    def kill_standbys(self) -> None:
        """SIGKILL and reap every standby."""
        for popen in self._standbys:
            kill_group(popen.pid, signal.SIGKILL)
        for popen in self._standbys:
            reap(popen, REAP_TIMEOUT_S)
        self._standbys = []

    def signal(self, sig: int) -> None:
        """Send ``sig`` (after SIGCONT) to every running worker that has not had one yet."""
        for w in self.workers:
            # Once per worker: Python resets its handlers while the interpreter shuts down, so a
            # second SIGUSR1 during a clean exit would kill the worker with a failure code.
            if w.exit_code is None and w.stop_sent is None:
                # A worker paused with SIGSTOP cannot act on SIGUSR1 until it is continued.
                kill_group(w.popen.pid, signal.SIGCONT)
                kill_group(w.popen.pid, sig)
                w.stop_sent = time.monotonic()

    def kill_all(self) -> None:
        """SIGKILL and reap every worker; no stop deadline remains."""
        for w in self.workers:
            if w.exit_code is None:
                kill_group(w.popen.pid, signal.SIGKILL)
        for w in self.workers:
            if w.exit_code is None:
                code = reap(w.popen, REAP_TIMEOUT_S)
                w.exit_code = code if code is not None else -int(signal.SIGKILL)
            if w.log is not None:
                w.log.close()
        self.stop_deadline = None

    def kill_ranks(self, ranks: set[int]) -> list[int]:
        """SIGKILL and reap the running workers of ``ranks`` (works on a stopped process: the
        members a live run's peers declared frozen); returns the ranks killed now."""
        killed = [w for w in self.workers if w.rank in ranks and w.exit_code is None]
        for w in killed:
            kill_group(w.popen.pid, signal.SIGKILL)
        for w in killed:
            code = reap(w.popen, REAP_TIMEOUT_S)
            w.exit_code = code if code is not None else -int(signal.SIGKILL)
            if w.log is not None:
                w.log.close()
        return [w.rank for w in killed]

    def poll(self) -> None:
        """Reap the workers that exited (their exit codes go into the next heartbeat)."""
        for w in self.workers:
            if w.exit_code is None:
                code = reap(w.popen)
                if code is None:
                    continue
                w.exit_code = code
                if w.log is not None:
                    w.log.close()
                self._say(f"rank {w.rank} of generation {w.generation} exited with {w.exit_code}")

    def enforce_stop_deadline(self) -> None:
        """SIGKILL the workers still running past the graceful-stop deadline."""
        if self.stop_deadline is not None and time.monotonic() > self.stop_deadline:
            if self.any_running:
                self._say("workers did not stop in time; SIGKILL")
                self.kill_all()
            self.stop_deadline = None


def _signal_number(name: str) -> int | None:
    """``signal.SIGUSR2`` for ``"SIGUSR2"``; None for '' or a name this platform lacks."""
    sig = getattr(signal, name, None) if name.startswith("SIG") else None
    return int(sig) if sig is not None else None


class _FailedPopen:
    """Stands in for a worker that could not be started."""

    pid = 0
    returncode = 127
