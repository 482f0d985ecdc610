"""``varuna-launch``: start and supervise the P×D worker processes of a job, on this machine
(``--procs N``) or on several hosts through one agent per host (``--hosts``).

Each worker runs ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) with the environment
contract of :mod:`varuna.core.env` (torchrun-compatible ``RANK``/``WORLD_SIZE``/... plus the pipeline
layout). The launcher prefixes every output line with ``[rank r stage k replica d]`` (preceded by
the host with ``--hosts``), stops the whole job when one worker fails, forwards
SIGINT/SIGTERM/SIGUSR1, and leaves no process behind on any exit path (Note [No orphans]).

Command line::

    varuna-launch --procs 4 --pipeline-depth 2 train.py --lr 3e-4
    varuna-launch --hosts hosts.txt --procs-per-host 4 --pipeline-depth 4 --checkpoint-dir /ckpt train.py

Python API (what tests and the manager use)::

    >>> from varuna.launch.launcher import LaunchConfig, launch
    >>> launch(LaunchConfig(script="train.py", script_args=("--lr", "3e-4"),
    ...                     pipeline_depth=2, data_parallel=2))  # doctest: +SKIP
    0

Structure: :func:`plan_workers` turns a config and a list of hosts into one :class:`WorkerSpec`
per rank; a host (:class:`LocalHost` for ``--procs``, :class:`varuna.launch.hosts.AgentHost` for a
per-host agent started locally or over ssh) spawns specs and returns :class:`WorkerHandle` s;
the :class:`Supervisor` only talks to handles, so it does not care where a worker runs. With
``--hosts``, :func:`main` validates the host entries (:mod:`varuna.launch.hosts`), probes the ssh
hosts, picks P×D for what answered (:func:`resolve_layout`, auto-config from a calibration when
P is not given) and runs :func:`launch_on_hosts`.

Note [Stop protocol]: the engine treats SIGUSR1 and SIGTERM as "finish the current mini-batch,
run the stop callbacks (a checkpoint), exit 0". The launcher forwards SIGUSR1 (through the
agents on other hosts) with no deadline, so the job ends with the workers' code, 0 after a
complete checkpoint; SIGINT/SIGTERM are forwarded with a SIGKILL deadline (``--stop-timeout``)
and the launcher exits 128+N. Any second signal (SIGUSR1, SIGINT, SIGTERM) while stopping kills
every worker at once.

Exit codes: 0 all workers exited 0; 1 a worker failed (the message names its rank and exit
code) or could not be started, an agent failed, or the job does not fit the reachable hosts; 2
bad usage; 128+N the launcher was stopped by signal N (130 for
SIGINT, 143 for SIGTERM).

Note [No orphans]: every worker is started in its own session (``start_new_session=True``), so
its process group holds the worker and any children it forks, and we signal the *group*. A
worker's exit is detected with ``waitid(WNOWAIT)``, which leaves the worker a zombie; while the
zombie exists its pid (= the group id) cannot be reused, so SIGKILL to the group reaches only
leftovers of that worker, never an unrelated process; only then is the zombie reaped. If the
launcher itself is killed (SIGKILL, OOM killer) no cleanup code runs, so each worker also asks
the kernel for ``PR_SET_PDEATHSIG=SIGKILL`` before exec. Caveats: the parent-death signal fires
when the *thread* that spawned the worker exits, so :func:`launch` spawns and supervises in the
calling thread; and grandchildren of a worker do not inherit it, so they survive a SIGKILL of
the launcher unless the worker arranges its own cleanup.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import functools
import ipaddress
import itertools
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol, TextIO

from varuna.core.cli import OneLineParser
from varuna.core.env import CONTRACT_VARS, PASSTHROUGH_PREFIX, WorkerEnv, is_passthrough

if TYPE_CHECKING:  # varuna.launch.hosts imports this module; at run time it is imported where needed
    from varuna.launch.hosts import HostEntry, SshOptions

__all__ = [
    "EXIT_OK",
    "EXIT_WORKER_FAILED",
    "EXIT_USAGE",
    "LaunchConfig",
    "WorkerSpec",
    "WorkerHandle",
    "Host",
    "LocalHost",
    "Supervisor",
    "check_local_script",
    "find_free_port",
    "launch",
    "main",
    "plan_workers",
    "resolve_data_parallel",
]

PROG = "varuna-launch"

EXIT_OK = 0
EXIT_WORKER_FAILED = 1
EXIT_USAGE = 2

#: How often the supervisor polls worker exits. Signals wake it at once (self-pipe), so this
#: only bounds how late a worker exit is noticed.
POLL_INTERVAL_S = 0.05
#: After SIGKILL, how long to wait for the kernel to reap workers before giving up on them
#: (a process stuck in uninterruptible I/O cannot be killed sooner).
KILL_REAP_TIMEOUT_S = 5.0
#: After the last worker exits, how long to wait for its output to drain. Only a process that
#: escaped the worker's group (its own setsid) and still holds the pipe makes this expire.
OUTPUT_DRAIN_TIMEOUT_S = 5.0

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


# ----------------------------------------------------------------------------------------------
# Configuration and the per-rank plan
# ----------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class LaunchConfig:
    """What to run and in which layout. Runtime objects (hosts, output streams) go to
    :func:`launch` separately.

    Example::

        >>> cfg = LaunchConfig(script="train.py", pipeline_depth=2, data_parallel=3)
        >>> cfg.world_size
        6
    """

    script: str
    """Path of the Python script each worker runs, or a module name when ``module`` is set."""
    script_args: Sequence[str] = ()
    """Arguments passed to the script unchanged."""
    module: bool = False
    """Run ``python -m script`` instead of ``python script``."""
    pipeline_depth: int
    """P, the number of pipeline stages."""
    data_parallel: int
    """D, the number of replicas; the job has P×D workers."""
    master_addr: str | None = None
    """Rendezvous address given to workers; None means the first host's address."""
    master_port: int | None = None
    """Rendezvous port; None (or 0) picks a free one by binding port 0."""
    log_dir: str | None = None
    """When set: the resolved config goes to ``launch.json`` and each rank's raw output (stdout
    and stderr, unprefixed) to ``rank{r}.log`` in this directory."""
    stop_timeout_s: float = 10.0
    """Grace period between SIGTERM (or a forwarded SIGINT/SIGTERM) and SIGKILL."""
    python: str = field(default_factory=lambda: sys.executable or "python3")
    """Interpreter that runs the workers."""
    worker_env: Mapping[str, str] = field(default_factory=dict)
    """Extra variables for every worker (e.g. ``OMP_NUM_THREADS``); ``VARUNA_*`` ones are
    passed like the launcher's own. Contract variables (``RANK``, ...) cannot be set here."""

    def __post_init__(self) -> None:
        if not self.script:
            raise ValueError("no script given; pass the training script (or -m MODULE) to run")
        if self.pipeline_depth < 1:
            raise ValueError(f"--pipeline-depth must be >= 1, got {self.pipeline_depth}")
        if self.data_parallel < 1:
            raise ValueError(f"--data-parallel must be >= 1, got {self.data_parallel}")
        if self.master_port is not None and not 0 <= self.master_port < 65536:
            raise ValueError(f"--master-port {self.master_port} is not a TCP port; use 1..65535 or 0 for any")
        if self.stop_timeout_s < 0:
            raise ValueError(f"--stop-timeout must be >= 0 seconds, got {self.stop_timeout_s}")
        bad = sorted(set(self.worker_env) & set(CONTRACT_VARS))
        if bad:
            raise ValueError(
                f"worker_env cannot set contract variables {bad}; the launcher sets them per rank"
            )
        self.script_args = tuple(self.script_args)
        self.worker_env = dict(self.worker_env)

    @property
    def world_size(self) -> int:
        """P×D, the number of worker processes."""
        return self.pipeline_depth * self.data_parallel

    def worker_argv(self) -> tuple[str, ...]:
        """The command every worker runs."""
        if self.module:
            return (self.python, "-m", self.script, *self.script_args)
        return (self.python, self.script, *self.script_args)


def resolve_data_parallel(num_procs: int, pipeline_depth: int, data_parallel: int | None) -> int:
    """D for ``--procs N --pipeline-depth P [--data-parallel D]``; ValueError unless N == P×D.

    Example::

        >>> resolve_data_parallel(8, 4, None)
        2
        >>> resolve_data_parallel(6, 4, None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: --procs 6 is not --pipeline-depth 4 × --data-parallel D for any D; use ...
    """
    if num_procs < 1:
        raise ValueError(f"--procs must be >= 1, got {num_procs}")
    if pipeline_depth < 1:
        raise ValueError(f"--pipeline-depth must be >= 1, got {pipeline_depth}")
    if data_parallel is None:
        if num_procs % pipeline_depth == 0:
            return num_procs // pipeline_depth
        below = (num_procs // pipeline_depth) * pipeline_depth
        above = below + pipeline_depth
        options = " or ".join(f"--procs {n}" for n in (below, above) if n >= 1)
        raise ValueError(
            f"--procs {num_procs} is not --pipeline-depth {pipeline_depth} × --data-parallel D for any D;"
            f" use {options}"
        )
    if num_procs != pipeline_depth * data_parallel:
        fix = f"use --procs {pipeline_depth * data_parallel}"
        if num_procs % pipeline_depth == 0:
            fix += f" or --data-parallel {num_procs // pipeline_depth}"
        raise ValueError(
            f"--procs {num_procs} is not --pipeline-depth {pipeline_depth}"
            f" × --data-parallel {data_parallel}; {fix}"
        )
    return data_parallel


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything a host needs to start the worker of one rank.

    Example::

        >>> cfg = LaunchConfig(script="train.py", pipeline_depth=2, data_parallel=1)
        >>> specs = plan_workers(cfg, [LocalHost(slots=2)], master_port=29500)
        >>> specs[1].label, specs[1].set_vars["VARUNA_STAGE"]
        ('rank 1 stage 1 replica 0', '1')
    """

    env: WorkerEnv
    """The rank's identity (the environment contract)."""
    argv: tuple[str, ...]
    """Command line; ``argv[0]`` is the interpreter."""
    set_vars: Mapping[str, str]
    """Variables to set in the worker's environment on its host: the contract, pass-through
    ``VARUNA_*`` variables and ``LaunchConfig.worker_env``. A local host adds them to its own
    environment; a remote host has to send them."""
    cwd: str | None = None
    """Working directory on the host; None keeps the host's default."""

    @property
    def label(self) -> str:
        """``rank r stage k replica d``, the output prefix without brackets."""
        return f"rank {self.env.rank} stage {self.env.stage} replica {self.env.replica}"


def plan_workers(
    config: LaunchConfig,
    hosts: Sequence[Host],
    *,
    master_port: int,
    launcher_environ: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> list[WorkerSpec]:
    """One spec per rank; hosts get contiguous rank ranges in order (Note [Rank layout] in
    :mod:`varuna.core.env`), so a host with several slots holds consecutive stages of a pipeline.

    ``launcher_environ`` (default ``os.environ``) supplies the ``VARUNA_*`` pass-through.

    Example::

        >>> cfg = LaunchConfig(script="t.py", pipeline_depth=2, data_parallel=2)
        >>> [(s.env.rank, s.env.host_id, s.env.local_rank)
        ...  for s in plan_workers(cfg, [LocalHost(slots=2), LocalHost(slots=2)], master_port=1)]
        [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    """
    if not hosts:
        raise ValueError("no hosts to run workers on")
    world_size = config.world_size
    capacity = sum(host.slots for host in hosts)
    if capacity < world_size:
        raise ValueError(
            f"{world_size} workers (P={config.pipeline_depth} × D={config.data_parallel}) need {world_size}"
            f" slots but the hosts have {capacity}; add hosts or use a smaller --procs"
        )
    launcher_environ = os.environ if launcher_environ is None else launcher_environ
    passthrough = {k: v for k, v in {**launcher_environ, **config.worker_env}.items() if is_passthrough(k)}
    plain_vars = {k: v for k, v in config.worker_env.items() if not k.startswith(PASSTHROUGH_PREFIX)}
    master_addr = config.master_addr or hosts[0].address
    argv = config.worker_argv()

    specs: list[WorkerSpec] = []
    for host_id, host in enumerate(hosts):
        local_world_size = min(host.slots, world_size - len(specs))
        for local_rank in range(local_world_size):
            env = WorkerEnv(
                master_addr=master_addr,
                master_port=master_port,
                rank=len(specs),
                world_size=world_size,
                local_rank=local_rank,
                local_world_size=local_world_size,
                pipeline_depth=config.pipeline_depth,
                data_parallel=config.data_parallel,
                host_id=host_id,
                extra=passthrough,
            )
            set_vars = {**plain_vars, **env.to_env()}
            # Line-buffered worker output, so prefixed lines reach the launcher as they are
            # printed rather than in 8 KiB blocks at exit; a user's explicit choice wins.
            if "PYTHONUNBUFFERED" not in launcher_environ and "PYTHONUNBUFFERED" not in set_vars:
                set_vars["PYTHONUNBUFFERED"] = "1"
            specs.append(WorkerSpec(env=env, argv=argv, set_vars=set_vars, cwd=cwd))
        if len(specs) == world_size:
            break
    return specs


def find_free_port(host: str = "") -> int:
    """A TCP port that is free right now, found by binding port 0.

    Another process may take it before the workers bind it; the window is short and torch's
    rendezvous then fails loudly (the launcher exits 1), so a retry by the caller is the fix.

    Example::

        >>> 0 < find_free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# Hosts and worker handles
# ----------------------------------------------------------------------------------------------


class WorkerHandle(Protocol):
    """A started worker, wherever it runs; the supervisor needs nothing else."""

    spec: WorkerSpec

    @property
    def pid(self) -> int:
        """Process id on the worker's host (for logs and tests)."""
        ...

    @property
    def output_streams(self) -> tuple[IO[bytes], IO[bytes]]:
        """``(stdout, stderr)`` of the worker as binary streams; EOF when the worker is gone."""
        ...

    def poll(self) -> int | None:
        """Exit code once the worker has exited (negative: killed by that signal), else None.
        On exit, leftover processes of the worker are killed before this returns."""
        ...

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the worker and every process it started; no-op once it exited."""
        ...


class Host(Protocol):
    """A machine that can run workers. ``LocalHost`` is this machine; a remote host type
    (OpenSSH plus a per-host agent) implements the same two attributes and ``spawn``."""

    address: str
    """Address other hosts reach this one at (used as MASTER_ADDR when it is host 0)."""
    slots: int
    """How many workers it runs at most."""

    def spawn(self, spec: WorkerSpec) -> WorkerHandle:
        """Start the worker described by ``spec``; raise ``OSError`` if that is impossible."""
        ...


@functools.lru_cache(maxsize=1)
def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or None where it does not exist (non-Linux)."""
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


def _pdeathsig_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the kernel SIGKILL the worker when the launcher (more
    precisely: the spawning thread) dies, or None where ``prctl`` is unavailable."""
    prctl = _prctl()
    if prctl is None:
        return None
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    parent_pid = os.getpid()
    sigkill = int(signal.SIGKILL)

    # Runs in the child between fork and exec: keep it to two system calls (prctl was resolved
    # in the parent, so the child loads nothing).
    def preexec() -> None:
        prctl(pr_set_pdeathsig, sigkill, 0, 0, 0)
        # The launcher may have died between fork and prctl; then no signal would ever come.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sigkill)

    return preexec


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
            preexec_fn=_pdeathsig_preexec(),
            close_fds=True,
        )
        return LocalWorker(spec, popen)


# ----------------------------------------------------------------------------------------------
# Supervision
# ----------------------------------------------------------------------------------------------


def _where(worker: WorkerHandle) -> str:
    """``rank r stage k replica d``, preceded by the host for workers of a multi-host job."""
    host_label = getattr(worker, "host_label", None)
    return f"{host_label} {worker.spec.label}" if host_label else worker.spec.label


def _describe_exit(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "an unknown signal"
    return f"was killed by {name} ({-returncode})"


class Supervisor:
    """Starts the planned workers, relays their output, and stops them all on failure or on a
    signal. ``notify_signal`` may be called from a signal handler or another thread.

    Example::

        >>> sup = Supervisor(specs, hosts)  # doctest: +SKIP
        >>> sup.start(); code = sup.wait(); sup.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        hosts: Sequence[Host],
        *,
        stop_timeout_s: float = 10.0,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        log_dir: str | None = None,
        out_lock: threading.Lock | None = None,
    ) -> None:
        self._specs = list(specs)
        self._hosts = list(hosts)
        self._stop_timeout_s = stop_timeout_s
        self._stdout = stdout if stdout is not None else sys.stdout
        self._stderr = stderr if stderr is not None else sys.stderr
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self.workers: list[WorkerHandle] = []
        self._exit_codes: dict[int, int] = {}  # rank -> exit code
        # Why the job ends early: ("failed", message) or ("signal", signum); the first one wins.
        self._cause: tuple[str, object] | None = None
        self._kill_at: float | None = None  # monotonic time to SIGKILL stragglers after a stop
        self._killed_at: float | None = None
        self._graceful_stop = False  # SIGUSR1 was forwarded (Note [Stop protocol])
        # One lock for all output, so lines from different workers never interleave mid-line.
        self._out_lock = out_lock if out_lock is not None else threading.Lock()
        self._broken_sinks: set[int] = set()
        self._readers: list[threading.Thread] = []
        self._log_files: dict[int, IO[str]] = {}
        # Signals are queued (deque.append is atomic) and a byte written to a pipe wakes the
        # loop; a signal handler must not take locks the interrupted main thread may hold.
        self._pending_signals: collections.deque[int] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)

    # -- public --------------------------------------------------------------------------------

    def notify_signal(self, signum: int) -> None:
        """Ask the supervisor to handle ``signum`` as if the launcher had received it."""
        self._pending_signals.append(signum)
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def start(self) -> None:
        """Spawn every worker, then start the output readers. A spawn failure stops the
        workers already started; :meth:`wait` still has to be called."""
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
        for host_id, group in itertools.groupby(self._specs, key=lambda s: s.env.host_id):
            if self._cause is not None:
                break
            host = self._hosts[host_id]
            batch = list(group)
            spawn_many = getattr(host, "spawn_many", None)
            if spawn_many is not None:
                # A host with an agent starts its workers in one request (one round trip).
                started, failure = spawn_many(batch)
                self.workers.extend(started)
                if failure is not None:
                    self._fail(f"{failure[0].label} could not be started {failure[1]}")
                continue
            for spec in batch:
                try:
                    worker = host.spawn(spec)
                except (OSError, subprocess.SubprocessError) as exc:
                    self._fail(f"{spec.label} could not be started: {exc}")
                    break
                self.workers.append(worker)
        # Readers start only after all forks: preexec_fn runs between fork and exec, which is
        # only safe while no other thread of ours may hold a lock the child needs.
        for worker in self.workers:
            if self._log_dir is not None:
                path = self._log_dir / f"rank{worker.spec.env.rank}.log"
                self._log_files[worker.spec.env.rank] = open(path, "w", encoding="utf-8")
            for stream, sink in zip(worker.output_streams, (self._stdout, self._stderr)):
                thread = threading.Thread(
                    target=self._relay,
                    args=(worker, stream, sink),
                    name=f"varuna-launch-relay-{worker.spec.env.rank}",
                    daemon=True,  # never keep the launcher alive for a stuck pipe
                )
                thread.start()
                self._readers.append(thread)

    def wait(self) -> int:
        """Supervise until every worker has exited; return the launcher's exit code."""
        unreaped = True
        while True:
            while self._pending_signals:
                self._on_signal(self._pending_signals.popleft())
            for worker in self.workers:
                rank = worker.spec.env.rank
                if rank not in self._exit_codes:
                    code = worker.poll()
                    if code is not None:
                        self._on_exit(worker, code)
            running = self._running()
            if not running:
                unreaped = False
                break
            now = time.monotonic()
            if self._killed_at is None and self._kill_at is not None and now >= self._kill_at:
                ranks = ", ".join(str(w.spec.env.rank) for w in running)
                self._message(
                    f"rank(s) {ranks} did not exit within {self._stop_timeout_s:g} s; sending SIGKILL"
                )
                self._kill_all()
            elif self._killed_at is not None and now >= self._killed_at + KILL_REAP_TIMEOUT_S:
                break
            with contextlib.suppress(InterruptedError):
                select.select([self._wake_r], [], [], POLL_INTERVAL_S)
            with contextlib.suppress(BlockingIOError, OSError):
                os.read(self._wake_r, 4096)
        if unreaped:
            ranks = ", ".join(str(w.spec.env.rank) for w in self._running())
            self._message(f"rank(s) {ranks} still exist {KILL_REAP_TIMEOUT_S:g} s after SIGKILL; giving up")
        self._drain_output()
        return self._finish()

    def close(self) -> None:
        """Kill whatever still runs (any exit path, exceptions included) and free resources."""
        for worker in self._running():
            worker.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + KILL_REAP_TIMEOUT_S
        while self._running() and time.monotonic() < deadline:
            for worker in self._running():
                code = worker.poll()
                if code is not None:
                    self._exit_codes[worker.spec.env.rank] = code
            time.sleep(POLL_INTERVAL_S)
        with self._out_lock:
            for log in self._log_files.values():
                log.close()
            self._log_files.clear()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    # -- internals -----------------------------------------------------------------------------

    def _running(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.spec.env.rank not in self._exit_codes]

    def _on_exit(self, worker: WorkerHandle, code: int) -> None:
        self._exit_codes[worker.spec.env.rank] = code
        # Non-zero codes after we began stopping are our own doing (SIGTERM/SIGKILL), not failures.
        if code != 0 and self._cause is None:
            detail = getattr(worker, "exit_detail", None) or _describe_exit(code)
            self._fail(f"{_where(worker)} {detail}")

    def _fail(self, what: str) -> None:
        self._cause = ("failed", what)  # before `what` gets the "stopping ..." suffix
        others = len(self._running())
        if others:
            what += (
                f"; stopping the other {others} worker(s) (SIGTERM, SIGKILL after {self._stop_timeout_s:g} s)"
            )
        self._message(what)
        self._begin_stop(signal.SIGTERM)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._graceful_stop and (signum in _STOP_SIGNALS or signum == signal.SIGUSR1):
            # The workers were already asked to finish their mini-batch and checkpoint: a second
            # request means "now" (Note [Stop protocol]).
            self._message(f"received {name} after SIGUSR1; killing {len(self._running())} worker(s) now")
            if self._cause is None:
                self._cause = ("signal", signum)
            self._kill_all()
            return
        if signum not in _STOP_SIGNALS:
            # SIGUSR1: relay only, without a SIGKILL deadline (a checkpoint takes as long as it
            # takes); the workers' exit codes (0 after a graceful stop) decide the outcome.
            self._graceful_stop = signum == signal.SIGUSR1
            what = (
                ": finish the mini-batch, checkpoint, exit (a second signal kills them at once)"
                if self._graceful_stop
                else ""
            )
            self._message(f"received {name}; forwarding it to {len(self._running())} worker(s){what}")
            for worker in self._running():
                worker.send_signal(signum)
            return
        if self._kill_at is not None:
            # Already stopping (a first SIGINT/SIGTERM or a failed worker): stop at once.
            self._message(f"received {name} while stopping; killing {len(self._running())} worker(s) now")
            if self._cause is None:
                self._cause = ("signal", signum)
            self._kill_all()
            return
        self._cause = ("signal", signum)
        self._message(
            f"received {name}; forwarding it to {len(self._running())} worker(s)"
            f" (SIGKILL after {self._stop_timeout_s:g} s, or at once on a second SIGINT/SIGTERM)"
        )
        self._begin_stop(signum)

    def _begin_stop(self, signum: int) -> None:
        for worker in self._running():
            worker.send_signal(signum)
        self._kill_at = time.monotonic() + self._stop_timeout_s

    def _kill_all(self) -> None:
        for worker in self._running():
            worker.send_signal(signal.SIGKILL)
        self._killed_at = time.monotonic()
        self._kill_at = self._kill_at or self._killed_at

    def _finish(self) -> int:
        """The exit code; names the failed rank once more as the last line."""
        if self._cause is None:
            return EXIT_OK
        kind, detail = self._cause
        if kind == "signal":
            assert isinstance(detail, int)
            return 128 + detail
        self._message(f"job failed: {detail}")
        return EXIT_WORKER_FAILED

    def _relay(self, worker: WorkerHandle, stream: IO[bytes], sink: TextIO) -> None:
        """Copy one worker stream to ``sink`` line by line, prefixed; runs in a reader thread."""
        prefix = f"[{_where(worker)}] "
        rank = worker.spec.env.rank
        try:
            for raw in iter(stream.readline, b""):
                text = raw.decode("utf-8", errors="replace")
                if not text.endswith("\n"):
                    text += "\n"  # a last line without newline must not glue onto the next prefix
                with self._out_lock:
                    self._write(sink, prefix + text)
                    log = self._log_files.get(rank)
                    if log is not None:
                        log.write(text)
                        log.flush()
        except (OSError, ValueError):
            pass  # the pipe closed under us (launcher shutting down): nothing left to relay
        finally:
            with contextlib.suppress(OSError):
                stream.close()

    def _write(self, sink: TextIO, text: str) -> None:
        # A closed or broken sink (e.g. `varuna-launch ... | head`) must not stop the relay:
        # workers would block on a full pipe. Keep draining, stop writing.
        if id(sink) in self._broken_sinks:
            return
        try:
            sink.write(text)
            sink.flush()
        except (OSError, ValueError):
            self._broken_sinks.add(id(sink))

    def _message(self, text: str) -> None:
        with self._out_lock:
            self._write(self._stderr, f"{PROG}: {text}\n")

    def _drain_output(self) -> None:
        deadline = time.monotonic() + OUTPUT_DRAIN_TIMEOUT_S
        for thread in self._readers:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._readers):
            self._message(
                "some worker output may be missing: a pipe is still held open by a process outside the job"
            )


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------


def launch(
    config: LaunchConfig,
    *,
    hosts: Sequence[Host] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run the job to completion and return the launcher's exit code (see module docstring).

    ``hosts`` defaults to this machine with P×D slots. Called from the main thread, SIGINT,
    SIGTERM and SIGUSR1 are handled (and forwarded) while the job runs and restored afterwards;
    from another thread the caller forwards signals through :class:`Supervisor` itself. Raises
    ``ValueError`` for an impossible plan or a missing local script.

    Example::

        >>> launch(LaunchConfig(script="train.py", pipeline_depth=2, data_parallel=1))  # doctest: +SKIP
        0
    """
    if hosts is None:
        hosts = [LocalHost(slots=config.world_size)]
    if all(isinstance(h, LocalHost) for h in hosts):
        check_local_script(config)
    port = config.master_port or find_free_port()
    specs = plan_workers(config, hosts, master_port=port, cwd=os.getcwd())
    stderr = stderr if stderr is not None else sys.stderr
    supervisor = Supervisor(
        specs,
        hosts,
        stop_timeout_s=config.stop_timeout_s,
        stdout=stdout,
        stderr=stderr,
        log_dir=config.log_dir,
    )
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _FORWARDED_SIGNALS:
            previous[signum] = signal.signal(signum, lambda s, _frame: supervisor.notify_signal(s))
    try:
        supervisor.start()
        if config.log_dir is not None:
            _write_launch_json(config, specs, supervisor, Path(config.log_dir) / "launch.json")
        return supervisor.wait()
    finally:
        try:
            supervisor.close()
        finally:
            for signum, handler in previous.items():
                # None means a handler installed outside Python; the default is the best we can do.
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)  # type: ignore[arg-type]


def check_local_script(config: LaunchConfig) -> None:
    """ValueError unless ``config.script`` is a file here (modules are found by the workers)."""
    if not config.module and not os.path.isfile(config.script):
        raise ValueError(f"script {config.script!r} not found (working directory {os.getcwd()})")


def _write_launch_json(
    config: LaunchConfig,
    specs: Sequence[WorkerSpec],
    sup: Supervisor,
    path: Path,
    extra: Mapping[str, object] | None = None,
) -> None:
    """The resolved config beside the run's logs, so a run can be understood (and repeated) later."""
    pids = {w.spec.env.rank: w.pid for w in sup.workers}
    record = {
        "config": {**asdict(config), "script_args": list(config.script_args)},
        "master_addr": specs[0].env.master_addr,
        "master_port": specs[0].env.master_port,
        "world_size": config.world_size,
        "workers": [
            {
                "rank": s.env.rank,
                "stage": s.env.stage,
                "replica": s.env.replica,
                "host_id": s.env.host_id,
                "local_rank": s.env.local_rank,
                "argv": list(s.argv),
                "pid": pids.get(s.env.rank),
            }
            for s in specs
        ],
        **(extra or {}),
    }
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# Several hosts: layout, agents
# ----------------------------------------------------------------------------------------------


_LAYOUT_REQUIRED = (
    "argument required: --pipeline-depth P (or --calibration FILE --global-batch-size M for auto-config)"
)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """P×D (and, from auto-config, m) chosen for the slots that are available.

    Example::

        >>> resolve_layout(slots=[2, 2, 1], pipeline_depth=2)
        Layout(pipeline_depth=2, data_parallel=2, micro_batch_size=None, stage_ranges=None, note='')
    """

    pipeline_depth: int
    data_parallel: int
    micro_batch_size: int | None = None
    """m picked by auto-config (exported to workers as ``VARUNA_MICRO_BATCH_SIZE``), else None."""
    stage_ranges: tuple[tuple[int, int], ...] | None = None
    """Segment→stage map auto-config simulated (exported as ``VARUNA_STAGE_RANGES``), else None."""
    note: str = ""
    """How auto-config chose it, for the launcher's log."""


def auto_configure(
    calibration: str,
    *,
    gpus: int,
    global_batch_size: int,
    host_slots: Sequence[int],
    gpu_memory_bytes: int | None = None,
) -> Layout:
    """The simulator's fastest P×D (and m) for ``gpus`` accelerators (``simulator.autoconfig``).

    The simulator is imported here, not at module load: the launcher must work on hosts where
    only the runtime is installed, as long as P is given explicitly. ``ValueError`` carries
    auto-config's reason when nothing fits (e.g. the smallest P that fits in memory exceeds G).
    """
    try:
        from simulator.autoconfig import autoconfigure
    except ImportError as exc:
        raise ValueError(
            f"--calibration needs the simulator (simulator/autoconfig.py), which cannot be imported here"
            f" ({exc}); give --pipeline-depth P instead"
        ) from None
    from varuna.core.calibration import Calibration

    try:
        cal = Calibration.load(calibration)
    except OSError as exc:
        raise ValueError(f"cannot read calibration {calibration!r}: {exc.strerror or exc}") from None
    result = autoconfigure(
        cal,
        gpus=gpus,
        global_batch_size=global_batch_size,
        gpu_memory_bytes=gpu_memory_bytes,
        host_slots=tuple(host_slots),
    )
    best = result.best
    speed = f", simulated {best.examples_per_s:.3g} examples/s" if best.examples_per_s else ""
    return Layout(
        pipeline_depth=best.num_stages,
        data_parallel=best.num_replicas,
        micro_batch_size=best.micro_batch_size,
        stage_ranges=tuple(tuple(r) for r in best.stage_segments),
        note=f"auto-config for G={gpus}: P={best.num_stages} D={best.num_replicas}"
        f" m={best.micro_batch_size}{speed}",
    )


def resolve_layout(
    *,
    slots: Sequence[int],
    pipeline_depth: int | None = None,
    data_parallel: int | None = None,
    calibration: str | None = None,
    global_batch_size: int | None = None,
    gpu_memory_bytes: int | None = None,
) -> Layout:
    """P×D for the available ``slots`` (one count per host): P and D as given; P given, D the
    most replicas that fit; or neither, from auto-config on ``calibration``. ``ValueError``
    says why nothing fits.

    Example::

        >>> resolve_layout(slots=[1, 1], pipeline_depth=4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: the hosts hold 2 slot(s), fewer than the 4 stages of --pipeline-depth 4; ...
    """
    capacity = sum(slots)
    if pipeline_depth is not None:
        if pipeline_depth < 1:
            raise ValueError(f"--pipeline-depth must be >= 1, got {pipeline_depth}")
        if capacity < pipeline_depth:
            raise ValueError(
                f"the hosts hold {capacity} slot(s), fewer than the {pipeline_depth} stages of"
                f" --pipeline-depth {pipeline_depth}; add hosts or use a smaller --pipeline-depth"
            )
        if data_parallel is None:
            return Layout(pipeline_depth=pipeline_depth, data_parallel=capacity // pipeline_depth)
        if data_parallel < 1:
            raise ValueError(f"--data-parallel must be >= 1, got {data_parallel}")
        if pipeline_depth * data_parallel > capacity:
            raise ValueError(
                f"P={pipeline_depth} × D={data_parallel} needs {pipeline_depth * data_parallel} slots but the"
                f" hosts hold {capacity}; use --data-parallel {capacity // pipeline_depth} or add hosts"
            )
        return Layout(pipeline_depth=pipeline_depth, data_parallel=data_parallel)
    if data_parallel is not None:
        raise ValueError("--data-parallel needs --pipeline-depth")
    if calibration is None:
        raise ValueError(_LAYOUT_REQUIRED)
    if global_batch_size is None:
        raise ValueError("--calibration needs --global-batch-size M (the mini-batch size to plan for)")
    return auto_configure(
        calibration,
        gpus=capacity,
        global_batch_size=global_batch_size,
        host_slots=slots,
        gpu_memory_bytes=gpu_memory_bytes,
    )


def select_hosts(entries: Sequence[HostEntry], world_size: int) -> list[HostEntry]:
    """The first hosts, in order, whose slots hold ``world_size`` workers (Note [Rank layout]).

    Example::

        >>> from varuna.launch.hosts import parse_hosts_arg
        >>> [e.display for e in select_hosts(parse_hosts_arg("a slots=2,b slots=2,c slots=2"), 3)]
        ['a', 'b']
    """
    used: list[HostEntry] = []
    capacity = 0
    for entry in entries:
        if capacity >= world_size:
            break
        used.append(entry)
        capacity += entry.slots or 0
    return used


def default_pythonpath(environ: Mapping[str, str] | None = None) -> list[str]:
    """``PYTHONPATH`` for agents and remote workers: the directory holding this ``varuna``
    package (same path on every host: identical images or a shared file system), then the
    launcher's own ``PYTHONPATH`` entries made absolute."""
    environ = os.environ if environ is None else environ
    root = str(Path(__file__).resolve().parent.parent)
    extra = [os.path.abspath(p) for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return list(dict.fromkeys([root, *extra]))


def launch_on_hosts(
    config: LaunchConfig,
    entries: Sequence[HostEntry],
    *,
    ssh: SshOptions | None = None,
    job_id: str | None = None,
    unreachable: Sequence[tuple[HostEntry, str]] = (),
    pythonpath: Sequence[str] | None = None,
    heartbeat_timeout_s: float | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run the job on ``entries`` (:class:`varuna.launch.hosts.HostEntry`, slots assigned) through one
    agent per host; return the launcher's exit code. The hosts must hold ``config.world_size``
    workers; the caller has probed them (:func:`varuna.launch.hosts.probe_hosts`).

    Signals are handled as in :func:`launch` (called from the main thread), including while the
    agents start. Every exit path closes every agent: each kills what is left of its workers.
    """
    from varuna.launch.hosts import AgentError, AgentHost, new_job_id, record_of

    stderr = stderr if stderr is not None else sys.stderr
    out_lock = threading.Lock()

    def message(text: str) -> None:
        with out_lock, contextlib.suppress(OSError, ValueError):
            stderr.write(f"{PROG}: {text}\n")
            stderr.flush()

    if not entries:
        raise ValueError("no hosts to run workers on")
    if any(e.is_local for e in entries):
        check_local_script(config)
    job_id = job_id or new_job_id()
    hosts = [
        AgentHost(
            entry,
            host_id,
            job_id=job_id,
            ssh=ssh,
            python=config.python,
            pythonpath=default_pythonpath() if pythonpath is None else pythonpath,
            heartbeat_timeout_s=heartbeat_timeout_s,
            message=message,
        )
        for host_id, entry in enumerate(entries)
    ]
    # Until the supervisor exists, signals are only queued; then they are handed to it.
    pending: collections.deque[int] = collections.deque()
    sink: list[Callable[[int], None]] = [pending.append]
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _FORWARDED_SIGNALS:
            previous[signum] = signal.signal(signum, lambda s, _frame: sink[0](s))
    supervisor: Supervisor | None = None
    try:
        # All forks first, then threads (Note [No orphans]: preexec_fn with other threads).
        for host in hosts:
            host.start_process()
        for host in hosts:
            host.start_threads()

        def stop_requested() -> bool:
            return any(s in _FORWARDED_SIGNALS for s in pending)

        for host in hosts:
            if not host.wait_ready(abort=stop_requested):
                break
        if stop_requested():
            # No worker runs yet, so there is nothing to forward to or to checkpoint. SIGUSR1
            # ("stop so the job can be resumed") is then a clean stop: the relaunch resumes from
            # the checkpoint the previous run left.
            signum = pending[0]
            message(f"received {signal.Signals(signum).name} while starting the agents; stopping")
            return EXIT_OK if signum == signal.SIGUSR1 else 128 + signum
        port = config.master_port or hosts[0].free_port
        assert port is not None  # set by wait_ready
        specs = plan_workers(config, hosts, master_port=port, cwd=os.getcwd())
        supervisor = Supervisor(
            specs,
            hosts,
            stop_timeout_s=config.stop_timeout_s,
            stdout=stdout,
            stderr=stderr,
            log_dir=config.log_dir,
            out_lock=out_lock,
        )
        sink[0] = supervisor.notify_signal
        while pending:
            supervisor.notify_signal(pending.popleft())
        supervisor.start()
        if config.log_dir is not None:
            extra = {"job_id": job_id, **record_of(hosts, unreachable)}
            _write_launch_json(config, specs, supervisor, Path(config.log_dir) / "launch.json", extra)
        return supervisor.wait()
    except AgentError as exc:
        message(f"job failed: {exc}")
        return EXIT_WORKER_FAILED
    finally:
        try:
            if supervisor is not None:
                supervisor.close()
        finally:
            try:
                for host in hosts:
                    host.close()
            finally:
                for signum, handler in previous.items():
                    signal.signal(signum, handler if handler is not None else signal.SIG_DFL)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------




def _build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Start P×D pipeline/data-parallel workers on this machine (--procs) or on several hosts"
        " through per-host agents (--hosts), and supervise them.",
        epilog="Workers get MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and "
        "VARUNA_* variables (rank = replica * P + stage); see docs/launch.md. Exit codes: 0 ok, "
        "1 a worker failed or the job could not start, 2 bad usage, 128+N stopped by signal N.",
    )
    where = parser.add_argument_group("where the workers run (one of)")
    where.add_argument("--procs", type=int, default=None, metavar="N", help="N workers on this machine")
    where.add_argument(
        "--hosts",
        default=None,
        metavar="FILE|H1,H2,...",
        help="host file or comma-separated list of [user@]host[:port] [slots=N]; a plain 'localhost' is a"
        " pretend host on this machine (no ssh)",
    )
    where.add_argument(
        "--procs-per-host", type=int, default=None, metavar="K", help="slots of hosts without slots=N"
    )
    layout = parser.add_argument_group("layout (P×D given, or chosen by the simulator's auto-config)")
    layout.add_argument("--pipeline-depth", type=int, default=None, metavar="P", help="pipeline stages")
    layout.add_argument(
        "--data-parallel",
        type=int,
        default=None,
        metavar="D",
        help="replicas per stage (default: N // P, or as many as the hosts' slots hold)",
    )
    layout.add_argument(
        "--calibration", default=None, metavar="FILE", help="calibration JSON: pick P×D with auto-config"
    )
    layout.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        metavar="M",
        help="mini-batch size auto-config plans for",
    )
    layout.add_argument(
        "--gpu-memory-gib", type=float, default=None, metavar="GIB", help="accelerator memory for auto-config"
    )
    parser.add_argument(
        "--master-addr",
        default=None,
        metavar="ADDR",
        help="rendezvous address (default: the first host's address)",
    )
    parser.add_argument(
        "--master-port", type=int, default=None, metavar="PORT", help="rendezvous port (default: a free one)"
    )
    parser.add_argument(
        "--log-dir", default=None, metavar="DIR", help="write launch.json and per-rank rank{r}.log here"
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping workers (default 10)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="checkpoint directory (VARUNA_CHECKPOINT_DIR for every worker): SIGUSR1/SIGTERM save there,"
        " a relaunch resumes from it",
    )
    parser.add_argument(
        "--resume",
        default=None,
        choices=("auto", "1", "0"),
        help="VARUNA_RESUME for every worker: auto resumes from the newest complete checkpoint if there"
        " is one (the default with --checkpoint-dir, so the same command resumes), 1 requires one, 0 starts"
        " afresh",
    )
    parser.add_argument(
        "--manager", default=None, metavar="HOST:PORT", help="manager daemon address (VARUNA_MANAGER)"
    )
    remote = parser.add_argument_group("ssh hosts")
    remote.add_argument(
        "--ssh-key",
        default=None,
        metavar="FILE",
        help="private key (default $VARUNA_SSH_KEY, else ssh's own)",
    )
    remote.add_argument(
        "--ssh-known-hosts",
        default=None,
        metavar="FILE",
        help="known_hosts file to use (default $VARUNA_SSH_KNOWN_HOSTS, else ~/.ssh/known_hosts)",
    )
    remote.add_argument(
        "--ssh-connect-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="ssh ConnectTimeout and reachability probe bound (default 10)",
    )
    remote.add_argument(
        "--job-id", default=None, metavar="ID", help="names the agents' command lines (default: random)"
    )
    parser.add_argument(
        "-m", "--module", action="store_true", help="SCRIPT is a module: run python -m SCRIPT"
    )
    parser.add_argument(
        # nargs="?" and a check in main(): a REMAINDER after a required positional makes argparse
        # report "required: SCRIPT, ARGS" although ARGS may be empty.
        "script",
        nargs="?",
        metavar="SCRIPT",
        help="Python script (or module with -m) every worker runs",
    )
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for SCRIPT")
    return parser


_MANAGER_RE = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")


def _usage_error(text: str) -> int:
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return EXIT_USAGE


def _worker_env_from_args(args: argparse.Namespace) -> dict[str, str]:
    env: dict[str, str] = {}
    if args.checkpoint_dir is not None:
        # Absolute: workers on other hosts (and in other working directories) resolve it alike.
        env["VARUNA_CHECKPOINT_DIR"] = os.path.abspath(args.checkpoint_dir)
        if args.resume is None and "VARUNA_RESUME" not in os.environ:
            # Relaunching the command that was stopped (SIGUSR1/SIGTERM) continues the job.
            env["VARUNA_RESUME"] = "auto"
    if args.resume is not None:
        if args.checkpoint_dir is None and "VARUNA_CHECKPOINT_DIR" not in os.environ:
            raise ValueError("--resume needs --checkpoint-dir DIR (or $VARUNA_CHECKPOINT_DIR)")
        env["VARUNA_RESUME"] = args.resume
    if args.manager is not None:
        if not _MANAGER_RE.match(args.manager) or not 0 < int(args.manager.rsplit(":", 1)[1]) < 65536:
            raise ValueError(f"--manager {args.manager!r} is not HOST:PORT")
        env["VARUNA_MANAGER"] = args.manager
    return env


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``varuna-launch``; returns the exit code.

    Example::

        >>> main(["--procs", "6", "--pipeline-depth", "4", "train.py"])  # doctest: +SKIP
        varuna-launch: error: --procs 6 is not --pipeline-depth 4 × --data-parallel D for any D; ...
        2
    """
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, message already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.procs is not None and args.hosts is not None:
        return _usage_error("give --procs N (this machine) or --hosts (several hosts), not both")
    if args.procs is None and args.hosts is None:
        return _usage_error("argument required: --procs N (this machine) or --hosts FILE|H1,H2,...")
    if args.procs_per_host is not None and args.hosts is None:
        return _usage_error("--procs-per-host needs --hosts")
    if args.pipeline_depth is None and args.calibration is None:
        return _usage_error(_LAYOUT_REQUIRED)
    if args.script is None:
        return _usage_error("no SCRIPT given; pass the training script (or -m MODULE) to run")
    gpu_memory_bytes = None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * 2**30)
    try:
        worker_env = _worker_env_from_args(args)
        # Validate every option before anything runs (one worker of one stage stands in for P×D).
        config = LaunchConfig(
            script=args.script,
            script_args=tuple(args.script_args),
            module=args.module,
            pipeline_depth=1,
            data_parallel=1,
            master_addr=args.master_addr,
            master_port=args.master_port,
            log_dir=args.log_dir,
            stop_timeout_s=args.stop_timeout,
            worker_env=worker_env,
        )
        if args.procs is not None:
            if args.pipeline_depth is not None:
                data_parallel = resolve_data_parallel(args.procs, args.pipeline_depth, args.data_parallel)
                layout = Layout(pipeline_depth=args.pipeline_depth, data_parallel=data_parallel)
            else:
                if args.procs < 1:
                    raise ValueError(f"--procs must be >= 1, got {args.procs}")
                layout = resolve_layout(
                    slots=[args.procs],
                    data_parallel=args.data_parallel,
                    calibration=args.calibration,
                    global_batch_size=args.global_batch_size,
                    gpu_memory_bytes=gpu_memory_bytes,
                )
            check_local_script(config)
            return launch(_with_layout(config, layout))
        return _main_hosts(args, config, gpu_memory_bytes)
    except ValueError as exc:
        return _usage_error(str(exc))


def _with_layout(config: LaunchConfig, layout: Layout) -> LaunchConfig:
    if layout.note:
        print(f"{PROG}: {layout.note}", file=sys.stderr, flush=True)
    worker_env = dict(config.worker_env)
    if layout.micro_batch_size is not None:
        worker_env["VARUNA_MICRO_BATCH_SIZE"] = str(layout.micro_batch_size)
    if layout.stage_ranges is not None:
        worker_env["VARUNA_STAGE_RANGES"] = ",".join(f"{a}-{b}" for a, b in layout.stage_ranges)
    return dataclasses.replace(
        config,
        pipeline_depth=layout.pipeline_depth,
        data_parallel=layout.data_parallel,
        worker_env=worker_env,
    )


def _main_hosts(args: argparse.Namespace, config: LaunchConfig, gpu_memory_bytes: int | None) -> int:
    """``--hosts``: validate, probe, choose P×D for what answered, start agents. Usage errors
    raise ``ValueError`` (exit 2); a job that cannot be placed exits 1."""
    from varuna.launch.hosts import SshOptions, assign_slots, parse_hosts_arg, probe_hosts

    entries = assign_slots(parse_hosts_arg(args.hosts), args.procs_per_host)
    ssh = SshOptions(
        key_file=args.ssh_key or os.environ.get("VARUNA_SSH_KEY") or None,
        known_hosts_file=args.ssh_known_hosts or os.environ.get("VARUNA_SSH_KNOWN_HOSTS") or None,
        connect_timeout_s=args.ssh_connect_timeout,
    )
    if args.job_id is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", args.job_id):
        raise ValueError(f"--job-id {args.job_id!r} may only use letters, digits, '_', '.', '-' (1..64)")
    if any(e.is_local for e in entries):
        check_local_script(config)

    reachable, unreachable = probe_hosts(entries, ssh)
    for entry, why in unreachable:
        print(
            f"{PROG}: host {entry.display} ({entry.origin}) is unreachable, leaving it out: {why}",
            file=sys.stderr,
        )
    left_out = f" ({len(unreachable)} of {len(entries)} host(s) unreachable)" if unreachable else ""
    if not reachable:
        print(f"{PROG}: cannot launch: no host is reachable{left_out}", file=sys.stderr)
        return EXIT_WORKER_FAILED
    try:
        layout = resolve_layout(
            slots=[e.slots or 0 for e in reachable],
            pipeline_depth=args.pipeline_depth,
            data_parallel=args.data_parallel,
            calibration=args.calibration,
            global_batch_size=args.global_batch_size,
            gpu_memory_bytes=gpu_memory_bytes,
        )
    except ValueError as exc:
        print(f"{PROG}: cannot launch: {exc}{left_out}", file=sys.stderr)
        return EXIT_WORKER_FAILED
    config = _with_layout(config, layout)
    used = select_hosts(reachable, config.world_size)
    if config.master_addr is None and used[0].is_local:
        remote = [e for e in used if not e.is_local and not _is_loopback(e.host)]
        if remote:
            print(
                f"{PROG}: cannot launch: host 0 is the pretend host 'localhost', whose address 127.0.0.1"
                f" {remote[0].display} cannot reach; list a real host first or pass --master-addr",
                file=sys.stderr,
            )
            return EXIT_WORKER_FAILED
    counts, left = [], config.world_size
    for entry in used:  # contiguous rank ranges, as plan_workers assigns them
        counts.append(min(entry.slots or 0, left))
        left -= counts[-1]
    print(
        f"{PROG}: P={config.pipeline_depth} × D={config.data_parallel} on {len(used)} host(s): "
        + ", ".join(f"{e.display} ({n} worker{'s' if n > 1 else ''})" for e, n in zip(used, counts)),
        file=sys.stderr,
        flush=True,
    )
    return launch_on_hosts(config, used, ssh=ssh, job_id=args.job_id, unreachable=unreachable)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
