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

from varuna.core.netif import source_address
from varuna.core.progress import Progress
from varuna.launch.agent_host import AgentError, AgentHost, new_job_id, record_of
from varuna.launch.events import EventLog
from varuna.launch.hosts import HostEntry
from varuna.launch.local import LocalHost
from varuna.launch.procs import find_free_port
from varuna.launch.protocol import SILENCE_TIMEOUT_S
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
    "ForwardedSignals",
    "HostsAttempt",
    "attempt_on_hosts",
    "check_before_agents",
    "check_hosts_capacity",
    "check_local_paths",
    "check_local_script",
    "check_master_port_free",
    "default_pythonpath",
    "launch",
    "launch_on_hosts",
    "prepare_log_dir",
    "write_launch_json",
]


class ForwardedSignals:
    """While a job runs: SIGINT, SIGTERM and SIGUSR1 are queued until a supervisor exists, then
    handed to it (:meth:`hand_to`); the previous handlers come back on exit. Installs nothing
    outside the main thread (Python handles signals there only; the caller forwards them)."""

    def __init__(self, observe: Callable[[int], None] | None = None) -> None:
        # deque.append is atomic: a signal handler must not take locks the main thread may hold.
        self.pending: collections.deque[int] = collections.deque()
        self._sink = self.pending.append
        self._observe = observe  # told of every signal (appends to a list: no locks either)
        self._previous: dict[int, object] = {}

    def __enter__(self) -> ForwardedSignals:
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
        check_local_paths(config)
    prepare_log_dir(config)
    stderr = stderr if stderr is not None else sys.stderr
    with ForwardedSignals() as signals:
        return _run_restarting(config, hosts, signals, stdout, stderr, progress)


def _run_once(
    config: LaunchConfig,
    hosts: Sequence[Host],
    signals: ForwardedSignals,
    stdout: TextIO | None,
    stderr: TextIO,
    progress: bool | None,
    *,
    on_lost: Callable[[int], None] | None = None,
    frozen: Callable[[int], str | None] | None = None,
    joined: Callable[[int], bool] | None = None,
    failure_word: str = "job failed",
) -> tuple[int, str]:
    """One launch of every worker, supervised to the end: the supervisor's code, and why a
    relaunch could help ("" when it could not; :func:`restart_reason`)."""
    port = config.master_port or find_free_port()
    specs = plan_workers(config, hosts, master_port=port, cwd=os.getcwd(), lifecycle_lines=True)
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
        joined=joined,
        failure_word=failure_word,
    )
    signals.hand_to(supervisor)
    try:
        supervisor.start()
        if config.log_dir is not None:
            write_launch_json(config, specs, supervisor, Path(config.log_dir) / "launch.json")
        code = supervisor.wait()
        return code, restart_reason(code, supervisor, live=on_lost is not None)
    finally:
        signals.take_back()
        supervisor.close()


def restart_reason(code: int, supervisor: Supervisor, *, live: bool) -> str:
    """Why relaunching from the newest checkpoint could help after the supervisor returned
    ``code``, or "": with live morph when a live morph was impossible (EXIT_RESTART); without it
    when a worker failed or a host was lost -- not when a worker could not be started (it would
    not start again), exited before building its Engine (the script would do it again: Note
    [Lifecycle lines] in varuna/core/lifecycle.py) or a signal stopped the job."""
    if live:
        return supervisor.restart_reason if code == EXIT_RESTART else ""
    if code != EXIT_WORKER_FAILED or supervisor.received_signals:
        return ""
    if supervisor.start_failed or supervisor.early_exit:
        return ""
    return supervisor.failure or "a worker failed"


def _run_restarting(
    config: LaunchConfig,
    hosts: Sequence[Host],
    signals: ForwardedSignals,
    stdout: TextIO | None,
    stderr: TextIO,
    progress: bool | None,
) -> int:
    """Launch; relaunch every worker after a failure a restart could fix, at most
    ``config.restart_limit`` times, each resuming from the newest checkpoint. With live morph each
    launch gets a fresh rendezvous store the launcher hosts and only EXIT_RESTART (a live morph was
    impossible) relaunches (Note [Live morph supervision])."""
    from varuna.launch.live_store import RESTARTS_ENV, LiveStore

    limit, events = config.restart_limit, EventLog(config.log_dir)
    for restarts in range(limit + 1):
        with contextlib.ExitStack() as stack:
            env, live = dict(config.worker_env), {}
            if limit or config.live_morph:
                env[RESTARTS_ENV] = str(restarts)
            if config.live_morph:
                store = stack.enter_context(LiveStore())
                env.update(store.worker_env())  # the address and the run's secret, never in argv
                live = {"on_lost": store.declare_dead, "frozen": store.frozen, "joined": store.joined}
            word = "job failed" if restarts == limit else f"launch {restarts + 1} failed"
            code, reason = _run_once(dataclasses.replace(config, worker_env=env), hosts, signals, stdout,
                                     stderr, progress, failure_word=word, **live)
        if not reason:
            return code
        stopped = stop_before_restart(signals, stderr, reason, live=config.live_morph)
        if stopped is not None:
            return stopped
        if restarts == limit:
            if config.live_morph:
                _say(stderr, f"job failed: live morph impossible ({reason}) and no restart left"
                             f" (--max-restarts {limit})")
            events.record("job-failed", cause=reason, attempt=restarts + 1)
            return EXIT_WORKER_FAILED
        what = "restarting"
        if config.live_morph:
            what = f"live morph impossible ({reason}); fallback: restarting"
        _say(stderr, f"{what} all {config.world_size} workers from the newest checkpoint (restart"
                     f" {restarts + 1} of {limit})")
        events.record("restart", attempt=restarts + 1, of=limit, reason=reason, P=config.pipeline_depth,
                      D=config.data_parallel)
    raise AssertionError("unreachable")  # the loop returns on its last round


def stop_before_restart(signals: ForwardedSignals, stderr: TextIO, reason: str, *, live: bool) -> int | None:
    """The exit code when a stop signal came while the workers exited (no relaunch then), else None."""
    if not signals.stop_requested():
        return None
    signum = signals.pending[0]
    what = f"live morph impossible ({reason})" if live else reason
    _say(stderr, f"{what}; received {signal.Signals(signum).name}: not restarting")
    return EXIT_OK if signum == signal.SIGUSR1 else 128 + signum


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


def _setting(config: LaunchConfig, name: str) -> str | None:
    """A pass-through setting as the workers will get it (the launcher's environment, then
    ``worker_env``: ``plan_workers`` merges them so)."""
    return config.worker_env.get(name) or os.environ.get(name) or None


def _writable_dir(path: Path, flag: str) -> None:
    """Create ``path`` (and its parents) and write a probe there; ValueError (one line) if not."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a directory; pick a directory (it is created "
                         "when missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".varuna-launch-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write there ({exc.strerror or exc}); pick a writable "
                         "directory") from None


def check_local_paths(config: LaunchConfig) -> None:
    """The workers' directories, checked here before any of them starts (they would each fail
    with a traceback once running): ``--checkpoint-dir`` and ``--tensorboard-dir`` must be
    writable directories, and ``--resume 1`` needs something to resume from.

    Example::

        >>> check_local_paths(LaunchConfig(script="t.py", pipeline_depth=1, data_parallel=1))
    """
    ckpt = _setting(config, "VARUNA_CHECKPOINT_DIR")
    if ckpt is not None:
        path = Path(ckpt)
        if _setting(config, "VARUNA_RESUME") == "1" and (not path.is_dir() or not any(path.iterdir())):
            state = "does not exist" if not path.exists() else "is empty" if path.is_dir() else "is a file"
            raise ValueError(f"--resume 1 needs a checkpoint to resume from, but --checkpoint-dir {ckpt} "
                             f"{state}; use --resume auto (resume when there is one) or drop --resume")
        _writable_dir(path, "--checkpoint-dir")
    tb = _setting(config, "VARUNA_TENSORBOARD_DIR")
    if tb is not None:
        _writable_dir(Path(tb), "--tensorboard-dir")


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


@dataclasses.dataclass
class HostsAttempt:
    """How one launch on a set of hosts ended (:func:`attempt_on_hosts`)."""

    code: int
    """The launcher's exit code for this launch."""
    lost: list[HostEntry] = dataclasses.field(default_factory=list)
    """Hosts that went silent, whose agent vanished, or whose agent could not start."""
    restart_reason: str = ""
    """Why relaunching could help ("" when it could not: success, a signal, a worker that could
    not be started)."""


def launch_on_hosts(
    config: LaunchConfig,
    entries: Sequence[HostEntry],
    *,
    ssh: SshOptions | None = None,
    job_id: str | None = None,
    unreachable: Sequence[tuple[HostEntry, str]] = (),
    pythonpath: Sequence[str] | None = None,
    heartbeat_timeout_s: float | None = None,
    host_timeout_s: float = SILENCE_TIMEOUT_S,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    progress: bool | None = False,
    remote: RemoteStart | None = None,
    stop_seen: Callable[[int], None] | None = None,
) -> int:
    """Run the job on ``entries`` (:class:`varuna.launch.hosts.HostEntry`, slots assigned) through one
    agent per host; return the launcher's exit code. The hosts must hold ``config.world_size``
    workers; the caller has probed them (:func:`varuna.launch.ssh.probe_hosts`). A host whose
    agent says nothing for ``host_timeout_s`` is declared silent and its workers lost (Note
    [Silent hosts] in :mod:`varuna.launch.protocol`); with ``config.live_morph`` the survivors
    regroup (the launcher hosts their store). One launch: relaunching on what is left is
    :func:`varuna.launch.recovery.run_with_restarts`'s.

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
    check_before_agents(config, entries)
    with ForwardedSignals(observe=stop_seen) as signals:
        return attempt_on_hosts(
            config, entries, signals, ssh=ssh, job_id=job_id, unreachable=unreachable, pythonpath=pythonpath,
            heartbeat_timeout_s=heartbeat_timeout_s, host_timeout_s=host_timeout_s, stdout=stdout,
            stderr=stderr, progress=progress, remote=remote,
        ).code


def attempt_on_hosts(
    config: LaunchConfig,
    entries: Sequence[HostEntry],
    signals: ForwardedSignals,
    *,
    ssh: SshOptions | None = None,
    job_id: str | None = None,
    unreachable: Sequence[tuple[HostEntry, str]] = (),
    pythonpath: Sequence[str] | None = None,
    heartbeat_timeout_s: float | None = None,
    host_timeout_s: float = SILENCE_TIMEOUT_S,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    progress: bool | None = False,
    events: EventLog | None = None,
    failure_word: str = "job failed",
    remote: RemoteStart | None = None,
) -> HostsAttempt:
    """One launch of :func:`launch_on_hosts` with the caller's signal handling, telling also
    which hosts were lost and whether a relaunch could help (``config`` checked already).
    ``remote``: as in :func:`launch_on_hosts`; an srun agent's report of the scheduler's signal
    goes to ``signals`` like the launcher's own."""
    stderr = stderr if stderr is not None else sys.stderr
    out_lock = threading.Lock()
    events = events or EventLog(config.log_dir)

    def message(text: str) -> None:
        with out_lock, contextlib.suppress(OSError, ValueError):
            stderr.write(f"{PROG}: {text}\n")
            stderr.flush()

    job_id = job_id or new_job_id()
    scheduler_stop = remote is not None and remote.reports_signals
    agent_host = functools.partial(
        AgentHost,
        job_id=job_id,
        ssh=ssh,
        python=config.python,
        pythonpath=default_pythonpath() if pythonpath is None else pythonpath,
        heartbeat_timeout_s=heartbeat_timeout_s,
        silence_timeout_s=host_timeout_s,
        message=message,
        event=events,
        remote=remote,
        on_signal=signals.notify,  # an srun agent's report of the scheduler's signal
    )
    hosts = [agent_host(entry, host_id) for host_id, entry in enumerate(entries)]
    supervisor: Supervisor | None = None
    with contextlib.ExitStack() as stack:
        try:
            stopped = _start_agents(hosts, signals, message, progress, stderr)
            if stopped is not None:
                return HostsAttempt(stopped)
            port = config.master_port or hosts[0].free_port
            assert port is not None  # set by wait_ready
            live: dict[str, Callable] = {}
            if config.live_morph:
                config, live = _live_store_for(config, hosts, stack)
            specs = plan_workers(config, hosts, master_port=port, cwd=os.getcwd(), lifecycle_lines=True)
            supervisor = Supervisor(
                specs,
                hosts,
                stop_timeout_s=config.stop_timeout_s,
                stdout=stdout,
                stderr=stderr,
                log_dir=config.log_dir,
                out_lock=out_lock,
                progress=progress,
                failure_word=failure_word,
                scheduler_stop=scheduler_stop,
                **live,
            )
            signals.hand_to(supervisor)
            supervisor.start()
            if config.log_dir is not None:
                extra = {"job_id": job_id, **record_of(hosts, unreachable)}
                write_launch_json(config, specs, supervisor, Path(config.log_dir) / "launch.json", extra)
            code = supervisor.wait()
            return _attempt_outcome(code, supervisor, hosts, config.live_morph)
        except AgentError as exc:
            message(f"job failed: {exc}")
            failed = [h.entry for h in hosts if h.agent_pid is None]
            return HostsAttempt(EXIT_WORKER_FAILED, failed, str(exc) if failed else "")
        finally:
            signals.take_back()
            _close_all(supervisor, hosts)


def _live_store_for(
    config: LaunchConfig, hosts: Sequence[AgentHost], stack: contextlib.ExitStack
) -> tuple[LaunchConfig, dict[str, Callable]]:
    """The live run's store (Note [Live morph supervision]), on this machine's address towards the
    rendezvous host so that every host's workers reach it; the config and supervisor hooks for it."""
    from varuna.launch.live_store import LiveStore

    master = config.master_addr or hosts[0].address
    try:
        where = source_address(master)
    except OSError as exc:
        raise AgentError(f"cannot tell this machine's address towards {master} for the live store:"
                         f" {exc}") from exc
    store = stack.enter_context(LiveStore(host=where))
    config = dataclasses.replace(config, worker_env={**config.worker_env, **store.worker_env()})
    return config, {"on_lost": store.declare_dead, "frozen": store.frozen, "joined": store.joined}


def _attempt_outcome(
    code: int, supervisor: Supervisor, hosts: Sequence[AgentHost], live: bool
) -> HostsAttempt:
    lost = [h.entry for h in hosts if h.lost]
    return HostsAttempt(code, lost, restart_reason(code, supervisor, live=live))


def check_before_agents(config: LaunchConfig, entries: Sequence[HostEntry]) -> None:
    """What can be refused (ValueError, one line) before any agent or worker starts."""
    if not entries:
        raise ValueError("no hosts to run workers on")
    check_hosts_capacity(entries, config.max_procs_per_host)
    if any(e.is_local for e in entries):
        check_local_script(config)
        check_local_paths(config)  # the same absolute paths on every host
        if entries[0].is_local:
            check_master_port_free(config)
    prepare_log_dir(config)


def _start_agents(
    hosts: Sequence[AgentHost],
    signals: ForwardedSignals,
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
