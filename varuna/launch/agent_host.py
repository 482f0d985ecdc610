"""The launcher's side of a per-host agent (:mod:`varuna.launch.agent`): :class:`AgentHost`
starts the agent (over ssh, as a Slurm job step with srun, or as a local process for a pretend
``localhost`` entry: Note [Remote start] in :mod:`varuna.launch.remote`), speaks the
line protocol (:mod:`varuna.launch.protocol`) with it, and hands the supervisor one
:class:`RemoteWorker` per rank the agent runs.

Example::

    >>> from varuna.launch.hosts import parse_host_entry
    >>> host = AgentHost(parse_host_entry("localhost slots=2"), 0, job_id="j1")
    >>> host.agent_argv()[1:4], host.label
    (['-m', 'varuna.launch.agent', '--job-id'], 'h0=localhost')
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from varuna.launch.hosts import HostEntry
from varuna.launch.procs import KILL_REAP_TIMEOUT_S, pdeathsig_preexec
from varuna.launch.protocol import (
    BEAT_INTERVAL_S,
    PROTOCOL_VERSION,
    SILENCE_TIMEOUT_S,
    decode_message,
    encode_message,
)
from varuna.launch.remote import RemoteStart, agent_environ
from varuna.launch.spec import WorkerSpec
from varuna.launch.ssh import SshOptions

__all__ = [
    "AGENT_READY_TIMEOUT_S",
    "LOST_EXIT_CODE",
    "AgentError",
    "AgentHost",
    "RemoteWorker",
    "new_job_id",
    "record_of",
]

#: How often the silence of each agent is judged (Note [Silent hosts] in varuna/launch/protocol.py).
SILENCE_CHECK_S = 0.25
#: How long an agent may take from ``ssh`` (or ``python``) start to its "ready" line: an ssh
#: handshake plus a Python start-up, on a loaded VM.
AGENT_READY_TIMEOUT_S = 60.0
#: How long a spawn request may wait for the agent's answer (forking P×D/hosts processes).
SPAWN_REPLY_TIMEOUT_S = 60.0
#: How long :meth:`AgentHost.close` waits for an agent to stop its workers and exit before it
#: kills the agent (or its ssh client; the remote agent then sees EOF and kills its workers).
AGENT_EXIT_TIMEOUT_S = 10.0
#: Exit code reported for a worker whose agent vanished (ssh's own code for "connection lost").
LOST_EXIT_CODE = 255

_JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: Signals an agent may report (``--report-signals``); the launcher handles them as its own.
_REPORTED_SIGNALS = frozenset({"SIGUSR1", "SIGTERM", "SIGINT"})


class AgentError(OSError):
    """An agent could not be started or stopped answering."""


class _LineBuffer:
    """An unbounded in-memory byte stream with ``readline``/``close``: one worker stream, split
    out of its agent's stdout and read by the supervisor's relay thread. Unbounded (unlike a
    pipe) so that the thread reading the agent's stdout never blocks on one worker's lines while
    a spawn request waits for its answer behind them."""

    def __init__(self) -> None:
        self._lines: collections.deque[bytes] = collections.deque()
        self._cond = threading.Condition()
        self._eof = False
        self._closed = False

    def put(self, data: bytes) -> None:
        with self._cond:
            if not self._eof and not self._closed:
                self._lines.append(data)
                self._cond.notify()

    def finish(self) -> None:
        """No more data: readers get EOF once the buffer is drained."""
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def readline(self) -> bytes:
        with self._cond:
            while not self._lines and not self._eof and not self._closed:
                self._cond.wait()
            if self._closed:
                raise ValueError("readline on a closed stream")
            return self._lines.popleft() if self._lines else b""

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._lines.clear()
            self._cond.notify_all()


class RemoteWorker:
    """A worker run by an agent: the :class:`~varuna.launch.spec.WorkerHandle` the supervisor uses."""

    def __init__(self, spec: WorkerSpec, host: AgentHost, pid: int) -> None:
        self.spec = spec
        self._host = host
        self._pid = pid
        self._streams = (_LineBuffer(), _LineBuffer())
        self._returncode: int | None = None
        #: Why the worker ended when its exit code cannot say it (its agent vanished).
        self.exit_detail: str | None = None

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def host_label(self) -> str:
        """Output prefix part naming the host, e.g. ``h1=bob@10.0.0.5``."""
        return self._host.label

    @property
    def output_streams(self) -> tuple[IO[bytes], IO[bytes]]:
        return self._streams  # type: ignore[return-value]  # duck-typed: readline() and close()

    def poll(self) -> int | None:
        # The agent killed the worker's leftovers and reaped it before it reported the exit.
        return self._returncode

    def send_signal(self, sig: int) -> None:
        if self._returncode is None:
            self._host.send(
                {"type": "signal", "rank": self.spec.env.rank, "signal": signal.Signals(sig).name}
            )

    def _set_exit(self, code: int, detail: str | None = None) -> None:
        if self._returncode is None:
            self.exit_detail = detail
            self._returncode = code
        for stream in self._streams:
            stream.finish()


class AgentHost:
    """A host whose workers are run by a per-host agent (:mod:`varuna.launch.agent`): over ssh, as a
    Slurm job step (``remote``: :class:`varuna.launch.srun.SrunOptions`), or as a local process for a
    pretend ``localhost`` entry. Implements the launcher's ``Host``.

    Lifecycle: :meth:`start_process` (from the thread that supervises the job: the agent or its
    ssh client gets a parent-death signal), :meth:`start_threads`, :meth:`wait_ready`,
    :meth:`spawn_many` (or ``spawn``), then :meth:`close` on every exit path.
    """

    def __init__(
        self,
        entry: HostEntry,
        host_id: int,
        *,
        job_id: str,
        ssh: SshOptions | None = None,
        python: str | None = None,
        pythonpath: Sequence[str] = (),
        heartbeat_timeout_s: float | None = None,
        message: Callable[[str], None] | None = None,
        local_environ: Mapping[str, str] | None = None,
        silence_timeout_s: float = SILENCE_TIMEOUT_S,
        event: Callable[..., None] | None = None,
        remote: RemoteStart | None = None,
        on_signal: Callable[[int], None] | None = None,
    ) -> None:
        if entry.slots is None:
            raise ValueError(f"host {entry.display} has no slot count; call assign_slots first")
        if not _JOB_ID_RE.match(job_id):
            raise ValueError(f"job id {job_id!r} may only use letters, digits, '_', '.', '-' (1..64)")
        self.entry = entry
        self.host_id = host_id
        self.address = entry.address
        self.slots = entry.slots
        self.label = f"h{host_id}={entry.display}"
        self._job_id = job_id
        # How a host that is not a pretend localhost is reached: ssh (default) or srun.
        self._remote: RemoteStart = remote or ssh or SshOptions()
        # A signal the agent's scheduler gave it (srun agents report them, Note [Agents as job steps]).
        self._on_signal = on_signal
        self._python = python or sys.executable
        self._pythonpath = list(pythonpath)
        # The agent gives up on the launcher after the same silence as the launcher on the agent.
        self._heartbeat_timeout_s = silence_timeout_s if heartbeat_timeout_s is None else heartbeat_timeout_s
        self._silence_timeout_s = silence_timeout_s
        self._message = message or (lambda text: print(f"varuna-launch: {text}", file=sys.stderr))
        self._event = event or (lambda kind, **fields: None)
        self._last_heard = time.monotonic()
        #: Set when the host was declared silent: how long its agent had said nothing.
        self.silent_s: float | None = None
        self._local_environ = os.environ if local_environ is None else local_environ
        self._proc: subprocess.Popen[bytes] | None = None
        self._send_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        self._ready = threading.Event()
        self._gone = threading.Event()  # the agent's stdout reached EOF
        self._reply: dict | None = None
        self._reply_cond = threading.Condition()
        self._workers: dict[int, RemoteWorker] = {}
        self._pending: dict[int, WorkerSpec] = {}  # rank -> spec of the spawn request in flight
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=5)
        #: From the agent's "ready" line.
        self.agent_pid: int | None = None
        self.free_port: int | None = None
        self.remote_hostname: str | None = None

    # -- start-up ------------------------------------------------------------------------------

    @property
    def _direct(self) -> bool:
        """A pretend ``localhost`` host of ``--hosts``: its agent starts here, without ssh."""
        return self.entry.is_local and isinstance(self._remote, SshOptions)

    def agent_argv(self) -> list[str]:
        """What runs the agent: ``python -m varuna.launch.agent ...`` here, or the remote-start
        method's argv (``ssh ... HOST CMD``, ``srun ... --nodelist=NODE python ...``)."""
        agent_args = ["--job-id", self._job_id, "--host-id", str(self.host_id),
                      "--heartbeat-timeout", f"{self._heartbeat_timeout_s:g}"]
        if self._direct:
            return [self._python, "-m", "varuna.launch.agent", *agent_args]
        if self._remote.reports_signals:
            agent_args.append("--report-signals")
        return self._remote.agent_argv(
            self.entry, python=self._python, pythonpath=self._pythonpath, agent_args=agent_args
        )

    def start_process(self) -> None:
        """Start the agent (or its ssh client). Raises :class:`AgentError`."""
        if self._direct:
            # The agent must import varuna before it can read its first request.
            env = agent_environ(self._local_environ, self._pythonpath)
        else:
            env = self._remote.agent_env(self._local_environ, self._pythonpath)
        try:
            self._proc = subprocess.Popen(
                self.agent_argv(),
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                # Its own session: a Ctrl-C in the launcher's terminal reaches the launcher only,
                # which then stops the job in order.
                start_new_session=True,
                preexec_fn=pdeathsig_preexec(),
                close_fds=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise AgentError(f"host {self.label}: cannot start its agent: {exc}") from exc

    def start_threads(self) -> None:
        """Start the reader and heartbeat threads (after every fork of the launcher)."""
        assert self._proc is not None
        for target, name in (
            (self._read_stdout, "stdout"),
            (self._read_stderr, "stderr"),
            (self._heartbeat, "heartbeat"),
        ):
            thread = threading.Thread(target=target, name=f"varuna-agent-{self.host_id}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wait_ready(
        self, timeout_s: float = AGENT_READY_TIMEOUT_S, abort: Callable[[], bool] | None = None
    ) -> bool:
        """Wait for the agent's "ready" line. False if ``abort()`` became true first; raises
        :class:`AgentError` when the agent failed or did not answer in time."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.05):
            if abort is not None and abort():
                return False
            if time.monotonic() >= deadline:
                raise AgentError(f"host {self.label}: its agent did not start within {timeout_s:g} s")
        if self.agent_pid is None:
            raise AgentError(f"host {self.label}: its agent failed to start{self._why_gone()}")
        return True

    # -- liveness (Note [Silent hosts]) ------------------------------------------------------------

    @property
    def silence_timeout_s(self) -> float:
        """How long this agent may say nothing before its host is declared silent."""
        return self._silence_timeout_s

    @property
    def lost(self) -> bool:
        """The host went silent, or its agent vanished while the job ran (not closed by us)."""
        return self.silent_s is not None or (self._gone.is_set() and not self._closing.is_set())

    def quiet_s(self) -> float | None:
        """Seconds since the agent's last word when over two beats and not yet judged (the host
        may be about to be declared silent), else None."""
        if self.agent_pid is None or self.silent_s is not None or self._gone.is_set():
            return None
        quiet = time.monotonic() - self._last_heard
        return quiet if quiet > 2 * BEAT_INTERVAL_S else None

    # -- the Host interface ---------------------------------------------------------------------

    def spawn(self, spec: WorkerSpec) -> RemoteWorker:
        """Start one worker (see :meth:`spawn_many`)."""
        workers, failure = self.spawn_many([spec])
        if failure is not None:
            raise AgentError(failure[1])
        return workers[0]

    def spawn_many(
        self, specs: Sequence[WorkerSpec]
    ) -> tuple[list[RemoteWorker], tuple[WorkerSpec, str] | None]:
        """Start this host's workers with one request (the agent forks them all before it
        starts any output thread). Returns the started workers and, if one could not be started,
        ``(its spec, why)``; the agent then starts none after it."""
        if self._gone.is_set():
            return [], (specs[0], f"on host {self.label}: its agent is gone{self._why_gone()}")
        request = {
            "type": "spawn",
            "workers": [
                {"rank": s.env.rank, "argv": list(s.argv), "env": dict(s.set_vars), "cwd": s.cwd}
                for s in specs
            ],
        }
        with self._reply_cond:
            self._reply = None
            # The reader thread turns the reply into workers itself, before it reads the output
            # lines that follow the reply, so no first line can arrive for an unknown rank.
            self._pending = {s.env.rank: s for s in specs}
            self.send(request)
            deadline = time.monotonic() + SPAWN_REPLY_TIMEOUT_S
            while self._reply is None and not self._gone.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._reply_cond.wait(remaining)
            reply, self._reply = self._reply, None
            by_rank, self._pending = self._pending, {}
            if reply is None:
                why = (
                    "is gone" + self._why_gone()
                    if self._gone.is_set()
                    else f"did not answer within {SPAWN_REPLY_TIMEOUT_S:g} s"
                )
                return [], (specs[0], f"on host {self.label}: its agent {why}")
            workers = [self._workers[int(started["rank"])] for started in reply.get("started", [])]
        failed = reply.get("failed")
        if failed is not None:
            return workers, (by_rank[failed["rank"]], f"on host {self.label}: {failed['error']}")
        return workers, None

    # -- shutdown ------------------------------------------------------------------------------

    def close(self, timeout_s: float = AGENT_EXIT_TIMEOUT_S) -> None:
        """Ask the agent to kill what still runs and exit; wait (bounded), then kill the agent
        process (or ssh client) if needed. Safe to call more than once, and on a failed start."""
        self._closing.set()
        proc = self._proc
        if proc is not None:
            self.send({"type": "shutdown"})
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                proc.stdin.close()  # EOF: the agent stops even if it missed "shutdown"
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._message(f"host {self.label}: agent did not exit within {timeout_s:g} s; killing it")
                # Kill the agent's group: a local agent's workers die of their parent-death signal,
                # a remote agent sees EOF once its ssh client is gone.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=KILL_REAP_TIMEOUT_S)
        for thread in self._threads:
            thread.join(timeout=KILL_REAP_TIMEOUT_S)
        for stream in (proc.stdout, proc.stderr) if proc is not None else ():
            with contextlib.suppress(OSError, ValueError):
                assert stream is not None
                stream.close()
        for worker in self._workers.values():
            worker._set_exit(LOST_EXIT_CODE, f"was still running when host {self.label} was closed")

    # -- internals -----------------------------------------------------------------------------

    def send(self, message: Mapping[str, object]) -> None:
        """Write one request to the agent; a dead agent is noticed by the stdout reader."""
        proc = self._proc
        if proc is None or proc.stdin is None:
            return
        with self._send_lock, contextlib.suppress(OSError, ValueError):
            proc.stdin.write(encode_message(message))
            proc.stdin.flush()

    def _why_gone(self) -> str:
        code = self._proc.poll() if self._proc is not None else None
        parts = []
        if code is not None:
            parts.append(f"exit code {code}")
        if self._stderr_tail:
            parts.append(self._stderr_tail[-1])
        return f" ({'; '.join(parts)})" if parts else ""

    def _read_stdout(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            for raw in iter(self._proc.stdout.readline, b""):
                self._last_heard = time.monotonic()
                self._dispatch(raw)
        except (OSError, ValueError):
            pass  # closed under us by close()
        finally:
            self._on_agent_gone()

    def _dispatch(self, raw: bytes) -> None:
        try:
            msg = decode_message(raw)
        except ValueError:
            # Not ours: e.g. a login script that prints on a non-interactive shell.
            text = raw.decode("utf-8", errors="replace").rstrip("\n")
            self._message(f"[{self.label}] {text}")
            return
        kind = msg.get("type")
        if kind == "out":
            worker = self._workers.get(msg["rank"])
            if worker is not None:
                index = 0 if msg.get("stream") == "stdout" else 1
                worker._streams[index].put(str(msg["line"]).encode("utf-8"))
        elif kind == "exit":
            with self._reply_cond:
                worker = self._workers.get(msg["rank"])
            if worker is not None:
                worker._set_exit(int(msg["code"]))
        elif kind == "spawned":
            with self._reply_cond:
                for started in msg.get("started", []):
                    spec = self._pending[int(started["rank"])]
                    self._workers[spec.env.rank] = RemoteWorker(spec, self, int(started["pid"]))
                self._reply = msg
                self._reply_cond.notify_all()
        elif kind == "ready":
            if msg.get("protocol") != PROTOCOL_VERSION:
                self._message(
                    f"host {self.label}: agent speaks protocol {msg.get('protocol')}, this launcher"
                    f" {PROTOCOL_VERSION}; install the same varuna on every host"
                )
                self._ready.set()
                return
            self.free_port = int(msg["free_port"])
            self.remote_hostname = str(msg.get("hostname"))
            self.agent_pid = int(msg["pid"])
            self._ready.set()
        elif kind == "message":
            self._message(f"[{self.label}] {msg.get('text')}")
        elif kind == "signaled":
            name = str(msg.get("signal"))
            if self._on_signal is not None and name in _REPORTED_SIGNALS:
                self._on_signal(int(getattr(signal, name)))
        # "bye" and unknown types: nothing to do (newer agents may say more).

    def _on_agent_gone(self) -> None:
        self._gone.set()
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_REAP_TIMEOUT_S)
        # Let the stderr reader collect the last words (ssh's reason) before we quote them.
        for thread in self._threads:
            if thread.name.endswith("-stderr") and thread is not threading.current_thread():
                thread.join(timeout=1.0)
        with self._reply_cond:
            self._reply_cond.notify_all()
            workers = list(self._workers.values())
        if not self._closing.is_set():
            detail = f"lost: the agent on host {self.label} is gone{self._why_gone()}"
            for worker in workers:
                worker._set_exit(LOST_EXIT_CODE, detail)
        self._ready.set()  # wake wait_ready(); agent_pid None means it failed

    def _read_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        try:
            for raw in iter(self._proc.stderr.readline, b""):
                # ssh ends its own messages with "\r\n" ("Timeout, server ... not responding.\r").
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                self._stderr_tail.append(text)
                self._message(f"[{self.label}] {text}")
        except (OSError, ValueError):
            pass

    def _heartbeat(self) -> None:
        """Ping the agent every beat interval; judge its silence (Note [Silent hosts])."""
        last_ping = last_tick = time.monotonic()
        while not self._closing.wait(SILENCE_CHECK_S) and not self._gone.is_set():
            now = time.monotonic()
            if now - last_ping >= BEAT_INTERVAL_S:
                last_ping = now
                self.send({"type": "ping"})
            starved = now - last_tick > BEAT_INTERVAL_S  # this launcher stalled: judge next time
            last_tick = now
            silent_s = now - self._last_heard
            if (
                not starved
                and self._silence_timeout_s > 0
                and self.agent_pid is not None  # up and said "ready": its start has its own bound
                and silent_s > self._silence_timeout_s
                and not self._pending_output()
            ):
                self._declare_silent(silent_s)
                return

    def _pending_output(self) -> bool:
        """Whether the agent's stdout has data not read yet (it spoke; our reader is late)."""
        proc = self._proc
        if proc is None or proc.stdout is None:
            return False
        try:
            readable, _, _ = select.select([proc.stdout], [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(readable)

    def _declare_silent(self, silent_s: float) -> None:
        """No word from the agent for ``silent_s``: the host is partitioned or gone. Its workers
        are lost (named), and its channel is cut (its agent, hearing nothing either, kills them)."""
        self.silent_s = silent_s
        with self._reply_cond:
            workers = [w for w in self._workers.values() if w.poll() is None]
        ranks = [w.spec.env.rank for w in workers]
        self._message(f"host {self.label} went silent: no word from its agent for {silent_s:.1f} s (a"
                      f" partition or a dead VM); its rank(s) {', '.join(map(str, ranks)) or '-'} are lost")
        self._event("host-silent", host=self.label, silent_s=round(silent_s, 3), ranks=ranks,
                    timeout_s=self._silence_timeout_s)
        detail = (f"lost: host {self.label} went silent, no word from its agent for {silent_s:.1f} s"
                  " (a partition or a dead VM)")
        for worker in workers:
            worker._set_exit(LOST_EXIT_CODE, detail)
        proc = self._proc
        if proc is not None:  # cut the channel: nothing late from a healed partition is taken
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


def new_job_id() -> str:
    """A short random job id (names the agents' command lines, for operators and tests)."""
    return os.urandom(6).hex()


def record_of(hosts: Sequence[AgentHost], unreachable: Sequence[tuple[HostEntry, str]]) -> dict:
    """The hosts part of ``launch.json``."""
    return {
        "hosts": [
            {
                "host_id": h.host_id,
                "entry": h.entry.display,
                "slots": h.slots,
                "local": h.entry.is_local,
                "agent_pid": h.agent_pid,
                "hostname": h.remote_hostname,
            }
            for h in hosts
        ],
        "unreachable": [{"entry": e.display, "reason": why} for e, why in unreachable],
    }
