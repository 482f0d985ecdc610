"""Running a job to completion, the Python API behind ``varuna-launch``: :func:`launch` runs
P×D workers on this machine (or on given :class:`~varuna.launch.spec.Host` s), and
:func:`launch_on_hosts` runs them on several hosts through one agent per host
(:class:`varuna.launch.agent_host.AgentHost`). Both return the launcher's exit code
(:mod:`varuna.launch.supervisor`) and leave no process behind on any exit path (Note [No
orphans] in :mod:`varuna.launch.procs`).

Example::

    >>> from varuna.launch.spec import LaunchConfig
    >>> launch(LaunchConfig(script="train.py", script_args=("--lr", "3e-4"),
    ...                     pipeline_depth=2, data_parallel=2))  # doctest: +SKIP
    0
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import functools
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import TextIO

from varuna.core.progress import Progress
from varuna.launch.agent_host import AgentError, AgentHost, new_job_id, record_of
from varuna.launch.hosts import HostEntry
from varuna.launch.local import LocalHost
from varuna.launch.procs import find_free_port
from varuna.launch.remote import RemoteStart
from varuna.launch.spec import Host, LaunchConfig, WorkerSpec, check_procs_per_host, plan_workers
from varuna.launch.ssh import SshOptions
from varuna.launch.supervisor import (
    EXIT_OK,
    EXIT_RESTART,
    EXIT_WORKER_FAILED,
    FORWARDED_SIGNALS,
    PROG,
    Supervisor,
)

__all__ = [
    "check_hosts_capacity",
    "check_local_script",
    "check_master_port_free",
    "default_pythonpath",
    "launch",
    "launch_on_hosts",
    "prepare_log_dir",
    "write_launch_json",
]


class _ForwardedSignals:
    """While a job runs: SIGINT, SIGTERM and SIGUSR1 are queued until a supervisor exists, then
    handed to it (:meth:`hand_to`); the previous handlers come back on exit. Installs nothing
    outside the main thread (Python handles signals there only; the caller forwards them)."""

    def __init__(self, observe: Callable[[int], None] | None = None) -> None:
        # deque.append is atomic: a signal handler must not take locks the main thread may hold.
        self.pending: collections.deque[int] = collections.deque()
        self._sink = self.pending.append
        self._observe = observe  # told of every signal (appends to a list: no locks either)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _ForwardedSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in FORWARDED_SIGNALS:
                self._previous[signum] = signal.signal(signum, lambda s, _frame: self.notify(s))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            # None means a handler installed outside Python; the default is the best we can do.
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)  # type: ignore[arg-type]

    def notify(self, signum: int) -> None:
        """A signal for the job: the launcher's own (from its handler) or one an srun agent
        reported (from a reader thread); queued, or handed to the supervisor."""
        if self._observe is not None:
            self._observe(signum)
        self._sink(signum)

    def stop_requested(self) -> bool:
        """Whether a signal arrived before a supervisor took over."""
        return bool(self.pending)

    def hand_to(self, supervisor: Supervisor) -> None:
        """From now on the supervisor gets the signals, the queued ones first."""
        self._sink = supervisor.notify_signal
        while self.pending:
            supervisor.notify_signal(self.pending.popleft())

    def take_back(self) -> None:
        """Queue the signals again (the supervisor is done; a relaunch may follow)."""
        self._sink = self.pending.append


def launch(
    config: LaunchConfig,
    *,
    hosts: Sequence[Host] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    progress: bool | None = False,
) -> int:
    """Run the job to completion and return the launcher's exit code (see module docstring).
    ``progress``: a bar while the workers start (``varuna.core.progress``; None: on a terminal).

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
    if config.live_morph and not all(isinstance(h, LocalHost) for h in hosts):
        raise ValueError(
            "live morph runs on this machine's workers only (--procs) for now: its store listens "
            "here; drop --live-morph for --hosts (the restart path)"
        )
    if all(isinstance(h, LocalHost) for h in hosts):
        check_local_script(config)
        check_procs_per_host(config.world_size, "this machine", config.max_procs_per_host)
        check_master_port_free(config)
    prepare_log_dir(config)
    stderr = stderr if stderr is not None else sys.stderr
    with _ForwardedSignals() as signals:
        if not config.live_morph:
            return _run_once(config, hosts, signals, stdout, stderr, progress)[0]
        return _run_live(config, hosts, signals, stdout, stderr, progress)


def _run_once(
    config: LaunchConfig,
    hosts: Sequence[Host],
    signals: _ForwardedSignals,
    stdout: TextIO | None,
    stderr: TextIO,
    progress: bool | None,
    on_lost: Callable[[int], None] | None = None,
    frozen: Callable[[int], str | None] | None = None,
) -> tuple[int, str]:
    """One launch of every worker, supervised to the end: the supervisor's code, and why a live
    morph was impossible when that code is EXIT_RESTART."""
    port = config.master_port or find_free_port()
    specs = plan_workers(config, hosts, master_port=port, cwd=os.getcwd())
    supervisor = Supervisor(
        specs,
        hosts,
        stop_timeout_s=config.stop_timeout_s,
        stdout=stdout,
        stderr=stderr,
        log_dir=config.log_dir,
        progress=progress,
        on_lost=on_lost,
        frozen=frozen,
    )
    signals.hand_to(supervisor)
    try:
        supervisor.start()
        if config.log_dir is not None:
            write_launch_json(config, specs, supervisor, Path(config.log_dir) / "launch.json")
        return supervisor.wait(), supervisor.restart_reason
    finally:
        signals.take_back()
        supervisor.close()


def _run_live(
    config: LaunchConfig,
    hosts: Sequence[Host],
    signals: _ForwardedSignals,
    stdout: TextIO | None,
    stderr: TextIO,
    progress: bool | None,
) -> int:
    """Live morph (Note [Live morph supervision]): each launch gets a fresh rendezvous store the
    launcher hosts; a launch that ends in EXIT_RESTART is relaunched whole, resuming from the newest
    checkpoint, at most ``config.max_restarts`` times."""
    from varuna.launch.live_store import LIVE_STORE_ENV, RESTARTS_ENV, LiveStore

    for restarts in range(config.max_restarts + 1):
        with LiveStore() as store:
            env = {**config.worker_env, LIVE_STORE_ENV: store.address, RESTARTS_ENV: str(restarts)}
            code, reason = _run_once(
                dataclasses.replace(config, worker_env=env), hosts, signals, stdout, stderr, progress,
                on_lost=store.declare_dead, frozen=store.frozen,
            )
        if code != EXIT_RESTART:
            return code
        if signals.stop_requested():  # a stop asked while the workers exited: no relaunch
            signum = signals.pending[0]
            _say(stderr, f"live morph impossible ({reason}); received {signal.Signals(signum).name}: not"
                         " restarting")
            return EXIT_OK if signum == signal.SIGUSR1 else 128 + signum
        if restarts == config.max_restarts:
            _say(stderr, f"job failed: live morph impossible ({reason}) and no restart left"
                         f" (--max-restarts {config.max_restarts})")
            return EXIT_WORKER_FAILED
        _say(stderr, f"live morph impossible ({reason}); fallback: restarting all {config.world_size}"
                     f" workers from the newest checkpoint (restart {restarts + 1} of {config.max_restarts})")
    raise AssertionError("unreachable")  # the loop returns on its last round


def _say(stderr: TextIO, text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        stderr.write(f"{PROG}: {text}\n")
        stderr.flush()


def check_hosts_capacity(entries: Sequence[HostEntry], limit: int | None) -> None:
    """ValueError (one line) when a host's slots, or the pretend ``localhost`` hosts' slots
    together (they all run on this machine), exceed ``limit`` workers per host
    (:func:`varuna.launch.spec.check_procs_per_host`).

    Example::

        >>> from varuna.launch.hosts import assign_slots, parse_hosts_arg
        >>> check_hosts_capacity(assign_slots(parse_hosts_arg("localhost,localhost"), 2), 8)
    """
    for entry in entries:
        check_procs_per_host(entry.slots or 0, f"host {entry.display}", limit)
    local = sum(e.slots or 0 for e in entries if e.is_local)
    if local:
        check_procs_per_host(local, "this machine (its pretend localhost hosts together)", limit)


def check_master_port_free(config: LaunchConfig) -> None:
    """ValueError (one line) when ``config.master_port`` is taken on this machine, where rank 0
    would bind it: otherwise every rank fails its rendezvous with a traceback of its own.

    Example::

        >>> check_master_port_free(LaunchConfig(script="t.py", pipeline_depth=1, data_parallel=1))
    """
    if not config.master_port:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR as torch's store sets it: a port in TIME_WAIT is free, a listening one not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", config.master_port))
        except OSError as exc:
            why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
            raise ValueError(
                f"--master-port {config.master_port} {why} on this machine; pick another, or leave it"
                " out to use a free one"
            ) from None


def prepare_log_dir(config: LaunchConfig) -> None:
    """Create ``config.log_dir`` and make sure files can be written there, before any worker
    starts: ValueError (one line) instead of a traceback once they run.

    Example::

        >>> prepare_log_dir(LaunchConfig(script="t.py", pipeline_depth=1, data_parallel=1))
    """
    if config.log_dir is None:
        return
    path = Path(config.log_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".varuna-launch-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"--log-dir {config.log_dir}: cannot write there ({exc.strerror or exc});"
            " pick a writable directory"
        ) from None


def check_local_script(config: LaunchConfig) -> None:
    """ValueError unless ``config.script`` is a file here (modules are found by the workers).

    Example::

        >>> check_local_script(LaunchConfig(script="json.tool", module=True, pipeline_depth=1,
        ...                                 data_parallel=1))
    """
    if not config.module and not os.path.isfile(config.script):
        raise ValueError(f"script {config.script!r} not found (working directory {os.getcwd()})")


def write_launch_json(
    config: LaunchConfig,
    specs: Sequence[WorkerSpec],
    sup: Supervisor,
    path: Path,
    extra: Mapping[str, object] | None = None,
) -> None:
    """Write the resolved config beside the run's logs (``launch.json``), so a run can be
    understood (and repeated) later. ``extra`` adds top-level keys (the hosts of a multi-host job).

    Example::

        >>> write_launch_json(config, specs, supervisor, Path("logs/launch.json"))  # doctest: +SKIP
    """
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


def default_pythonpath(environ: Mapping[str, str] | None = None) -> list[str]:
    """``PYTHONPATH`` for agents and remote workers: the directory holding this ``varuna``
    package (same path on every host: identical images or a shared file system), then the
    launcher's own ``PYTHONPATH`` entries made absolute.

    Example::

        >>> default_pythonpath({"PYTHONPATH": "/opt/lib"})[1:]
        ['/opt/lib']
    """
    environ = os.environ if environ is None else environ
    root = str(Path(__file__).resolve().parents[2])  # .../ROOT/varuna/launch/job.py
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
    progress: bool | None = False,
    remote: RemoteStart | None = None,
    stop_seen: Callable[[int], None] | None = None,
) -> int:
    """Run the job on ``entries`` (:class:`varuna.launch.hosts.HostEntry`, slots assigned) through one
    agent per host; return the launcher's exit code. The hosts must hold ``config.world_size``
    workers; the caller has probed them (:func:`varuna.launch.ssh.probe_hosts`).

    Signals are handled as in :func:`launch` (called from the main thread), including while the
    agents start. Every exit path closes every agent: each kills what is left of its workers.
    ``progress``: bars while the agents and the workers start, as in :func:`launch`.

    ``remote``: how agents start on hosts other than pretend ``localhost`` ones (default ``ssh``;
    :class:`varuna.launch.srun.SrunOptions` in a Slurm allocation: the scheduler's SIGUSR1/SIGTERM,
    reported by the agents, are then one graceful stop, Note [Stop protocol]). ``stop_seen`` is
    called with every stop signal the job got (the launcher's own or an agent's report).

    Example::

        >>> from varuna.launch.hosts import parse_hosts_arg
        >>> cfg = LaunchConfig(script="train.py", pipeline_depth=2, data_parallel=2)
        >>> launch_on_hosts(cfg, parse_hosts_arg("localhost slots=2,localhost slots=2"))  # doctest: +SKIP
        0
    """
    stderr = stderr if stderr is not None else sys.stderr
    out_lock = threading.Lock()

    def message(text: str) -> None:
        with out_lock, contextlib.suppress(OSError, ValueError):
            stderr.write(f"{PROG}: {text}\n")
            stderr.flush()

    _check_before_agents(config, entries)
    job_id = job_id or new_job_id()
    scheduler_stop = remote is not None and remote.reports_signals
    signals = _ForwardedSignals(observe=stop_seen)
    agent_host = functools.partial(
        AgentHost,
        job_id=job_id,
        ssh=ssh,
        python=config.python,
        pythonpath=default_pythonpath() if pythonpath is None else pythonpath,
        heartbeat_timeout_s=heartbeat_timeout_s,
        message=message,
        remote=remote,
        on_signal=signals.notify,
    )
    hosts = [agent_host(entry, host_id) for host_id, entry in enumerate(entries)]
    supervisor: Supervisor | None = None
    with signals:  # queued until the supervisor exists
        try:
            stopped = _start_agents(hosts, signals, message, progress, stderr)
            if stopped is not None:
                return stopped
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
                progress=progress,
                scheduler_stop=scheduler_stop,
            )
            signals.hand_to(supervisor)
            supervisor.start()
            if config.log_dir is not None:
                extra = {"job_id": job_id, **record_of(hosts, unreachable)}
                write_launch_json(config, specs, supervisor, Path(config.log_dir) / "launch.json", extra)
            return supervisor.wait()
        except AgentError as exc:
            message(f"job failed: {exc}")
            return EXIT_WORKER_FAILED
        finally:
            _close_all(supervisor, hosts)


def _check_before_agents(config: LaunchConfig, entries: Sequence[HostEntry]) -> None:
    """What can be refused (ValueError, one line) before any agent or worker starts."""
    if not entries:
        raise ValueError("no hosts to run workers on")
    check_hosts_capacity(entries, config.max_procs_per_host)
    if any(e.is_local for e in entries):
        check_local_script(config)
        if entries[0].is_local:
            check_master_port_free(config)
    prepare_log_dir(config)


def _start_agents(
    hosts: Sequence[AgentHost],
    signals: _ForwardedSignals,
    message: Callable[[str], None],
    progress: bool | None,
    stderr: TextIO,
) -> int | None:
    """Start every agent and wait for each "ready" line (a bar of them: ``progress``); the
    launcher's exit code when a signal came first, else None."""
    # All forks first, then threads (Note [No orphans]: preexec_fn with other threads).
    for host in hosts:
        host.start_process()
    for host in hosts:
        host.start_threads()
    with Progress("starting agents", total=len(hosts), unit="host", enabled=progress, file=stderr) as bar:
        for host in hosts:
            if not host.wait_ready(abort=signals.stop_requested):
                break
            bar.update()
    if not signals.stop_requested():
        return None
    # No worker runs yet, so there is nothing to forward to or to checkpoint. SIGUSR1 ("stop so
    # the job can be resumed") is then a clean stop: the relaunch resumes from the checkpoint the
    # previous run left.
    signum = signals.pending[0]
    message(f"received {signal.Signals(signum).name} while starting the agents; stopping")
    return EXIT_OK if signum == signal.SIGUSR1 else 128 + signum


def _close_all(supervisor: Supervisor | None, hosts: Sequence[AgentHost]) -> None:
    """Kill what still runs: the supervisor's workers, then every agent (and what it runs)."""
    try:
        if supervisor is not None:
            supervisor.close()
    finally:
        for host in hosts:
            host.close()
