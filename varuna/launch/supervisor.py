"""The :class:`Supervisor`: starts the planned workers on their hosts, relays their output
prefixed with ``[rank r stage k replica d]`` (preceded by the host in a multi-host job), stops
the whole job when one worker fails, and forwards SIGINT/SIGTERM/SIGUSR1 to the workers.

Note [Stop protocol]: the engine treats SIGUSR1 and SIGTERM as "finish the current mini-batch,
run the stop callbacks (a checkpoint), exit 0". The launcher forwards SIGUSR1 (through the
agents on other hosts) with no deadline, so the job ends with the workers' code, 0 after a
complete checkpoint; SIGINT/SIGTERM are forwarded with a SIGKILL deadline (``--stop-timeout``)
and the launcher exits 128+N. Any second signal (SIGUSR1, SIGINT, SIGTERM) while stopping kills
every worker at once.

With ``scheduler_stop`` (``varuna-launch --slurm``, Note [Slurm stop] in
:mod:`varuna.launch.launcher`) SIGTERM is a graceful stop too, forwarded like SIGUSR1 without a
deadline (the scheduler's own grace period bounds it), and a repeated SIGUSR1/SIGTERM while the
graceful stop runs is the same stop arriving by another path (the launcher, each agent, each srun):
ignored. SIGINT then still kills every worker at once.

Note [Live morph supervision]: with ``on_lost`` (``varuna-launch --live-morph``) a worker that
dies is not a reason to stop the others: the supervisor declares it dead (``on_lost(rank)``, the
rendezvous store's word that survivors need not wait for it) and lets the survivors regroup in
their processes (docs/live_morph.md). A worker exiting with :data:`PEER_LOST_EXIT_CODE` says a
live morph is impossible (a stage lost every replica): the others get ``stop_timeout_s`` to exit
on their own, and :meth:`Supervisor.wait` returns :data:`EXIT_RESTART` so that the caller takes
the restart path (relaunch, resume from the newest checkpoint). The job succeeds when the
workers still standing exit 0. A worker the others declared dead for lack of heartbeats
(``frozen(rank)``: SIGSTOP, a hung host; Note [Live watch] in varuna/runtime/live_watch.py) is
SIGKILLed: they went on without it, and stopped for good it would never exit.

Note [Blame]: a worker that exits with :data:`PEER_LOST_EXIT_CODE` (without live morph) stopped
because of another: its peer watch named a peer that left, froze, or went silent with its host.
It is the *symptom*; the job's last line must name the cause. So such an exit starts a short
wait (:data:`BLAME_WINDOW_S`, extended while a host has been quiet for over two beats and may
yet be declared silent, at most the hosts' silence timeout) for a primary cause: another
worker's failure or a host declared silent. Only if none comes is the job's failure this
worker's exit, quoted with its own one-line reason (which names the peer it lost).

Note [Lifecycle lines] (varuna/core/lifecycle.py): the engine's ``VARUNA_LIFECYCLE <phase>``
lines are not relayed (the logs keep them); a worker that exits 0 before building its Engine while
another waits for it (:mod:`varuna.launch.early_exit`) ends the job at once with one line, exit 1,
the others stopped without a word, no restart.

Exit codes: 0 all workers exited 0 (with live morph: every worker not lost); 1 a worker failed
(the message names its rank and exit code) or could not be started, an agent failed, or the job
does not fit the reachable hosts; 2 bad usage, also found by a worker (it exited 78 with one
``varuna: error:`` line, quoted as the job's last line; Note [One-line refusals] in
varuna/core/config_error.py); 128+N the launcher was stopped by signal N (130
for SIGINT, 143 for SIGTERM).

Example::

    >>> from varuna.launch.local import LocalHost
    >>> from varuna.launch.spec import LaunchConfig, plan_workers
    >>> cfg = LaunchConfig(script="-c", script_args=("pass",), pipeline_depth=2, data_parallel=1)
    >>> hosts = [LocalHost(slots=2)]
    >>> sup = Supervisor(plan_workers(cfg, hosts, master_port=29500), hosts)
    >>> sup.start(); code = sup.wait(); sup.close()
    >>> code
    0
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TextIO

from varuna.core.config_error import CONFIG_EXIT_CODE, ERROR_PREFIX
from varuna.core.lifecycle import split_marker
from varuna.core.progress import Progress
from varuna.launch.early_exit import EarlyExits, early_exit_line
from varuna.launch.procs import KILL_REAP_TIMEOUT_S
from varuna.launch.spec import Host, WorkerHandle, WorkerSpec

__all__ = [
    "EXIT_OK",
    "EXIT_RESTART",
    "EXIT_USAGE",
    "EXIT_WORKER_FAILED",
    "FORWARDED_SIGNALS",
    "PEER_LOST_EXIT_CODE",
    "PROG",
    "Supervisor",
]

PROG = "varuna-launch"

EXIT_OK = 0
EXIT_WORKER_FAILED = 1
EXIT_USAGE = 2
#: :meth:`Supervisor.wait` with live morph: the job must restart from its newest checkpoint (never
#: the launcher's own exit code; :func:`varuna.launch.job.launch` relaunches or fails).
EXIT_RESTART = 75
#: A worker's exit code when it cannot go on without a restart. The same number as
#: ``varuna.runtime.peer_watch.PEER_LOST_EXIT_CODE`` (a test keeps them equal): the launcher does
#: not import the runtime, which would load torch.
PEER_LOST_EXIT_CODE = 75
#: How long the supervisor waits for a lost worker's last output lines (its reason) to be relayed.
LAST_WORDS_TIMEOUT_S = 2.0
#: Note [Blame]: how long an exit with PEER_LOST_EXIT_CODE waits for a primary cause (a kill -9
#: seen by the agent and the survivor's own report of it race by milliseconds).
BLAME_WINDOW_S = 1.0

#: Note [Echoes of an exit]: how long a c10d error line waits to learn whether the job is ending
#: on another rank's configuration error (then it is only logged). A worker that refuses its
#: configuration prints its line and exits; the others' gloo sockets see the close within
#: milliseconds and log "Connection closed by peer", which under load reached the terminal
#: before the refusal's own line was read (a stressed test run).
ECHO_HOLD_S = 1.0
_C10_ERROR = re.compile(r"\[[EF]\d{4} \d{2}:\d{2}:\d{2}\.\d+ ")

#: How often the supervisor polls worker exits. Signals wake it at once (self-pipe), so this
#: only bounds how late a worker exit is noticed.
POLL_INTERVAL_S = 0.05
FROZEN_CHECK_S = 0.5  # live morph: how often the store is asked about frozen workers
#: After the last worker exits, how long to wait for its output to drain. Only a process that
#: escaped the worker's group (its own setsid) and still holds the pipe makes this expire.
OUTPUT_DRAIN_TIMEOUT_S = 5.0

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: The signals the launcher handles while a job runs and forwards to its workers.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


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


class _CppFrames:
    """Note [C++ frames]: c10d logs a failed store or socket call with the C++ backtrace of its
    error (``Exception raised from sendBytes at ... (most recent call first):`` and 20-30 ``frame
    #N: ...`` lines), and does so in every survivor when rank 0's process goes away: ~100 lines of
    noise around the one line that says what happened. The relay shows the first line of such a
    message and swallows the backtrace; ``--log-dir``'s ``rank{r}.log`` keeps all of it."""

    def __init__(self) -> None:
        self._inside = False

    def swallow(self, line: str) -> bool:
        """Whether ``line`` belongs to a C++ backtrace (not shown)."""
        text = line.strip()
        if text.startswith("Exception raised from ") and text.endswith("(most recent call first):"):
            self._inside = True
            return True
        if self._inside and (not text or text.startswith("frame #") or text == "<omitting python frames>"):
            return True
        self._inside = False
        return False


class _Echoes:
    """Note [Echoes of an exit]: c10d's error line in a rank is most often the echo of another
    rank's exit (its sockets closed); if that exit was a refused configuration, the job's answer
    is that one line, and the echo is noise. A c10d line waits up to ECHO_HOLD_S for the refusal
    to be read (``quiet`` set), once per rank: a survivor's many lines do not add up to a stall."""

    def __init__(self, quiet: threading.Event) -> None:
        self._quiet, self._until = quiet, 0.0

    def hidden(self, line: str) -> bool:
        """Whether ``line`` is a c10d error line and the job went quiet within the hold."""
        if not _C10_ERROR.match(line):
            return False
        self._until = self._until or time.monotonic() + ECHO_HOLD_S
        return self._quiet.wait(max(0.0, self._until - time.monotonic()))


def _joined(threads: Sequence[threading.Thread], timeout_s: float) -> bool:
    """Join ``threads`` within ``timeout_s`` in all; whether they all ended."""
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


class _Suspects:
    """Workers that exited with PEER_LOST_EXIT_CODE, waiting for a primary cause (Note [Blame])."""

    def __init__(self) -> None:
        self.workers: list[tuple[WorkerHandle, str]] = []
        self.since = 0.0

    def add(self, worker: WorkerHandle, detail: str) -> None:
        if not self.workers:
            self.since = time.monotonic()
        self.workers.append((worker, detail))

    def due(self, now: float, hosts: Sequence[Host], force: bool) -> tuple[WorkerHandle, str] | None:
        """The first suspect once the wait is over (a host still quiet may yet be declared
        silent: wait for it, at most its silence timeout), else None."""
        if not self.workers:
            return None
        quiet = [q for q in (getattr(h, "quiet_s", lambda: None)() for h in hosts) if q is not None]
        patience = max([BLAME_WINDOW_S, *(getattr(h, "silence_timeout_s", 0.0) for h in hosts)])
        waited = now - self.since
        if not force and (waited < BLAME_WINDOW_S or (quiet and waited < patience + 1.0)):
            return None
        return self.workers[0]


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
        progress: bool | None = False,
        on_lost: Callable[[int], None] | None = None,
        frozen: Callable[[int], str | None] | None = None,
        joined: Callable[[int], bool] | None = None,
        failure_word: str = "job failed",
        scheduler_stop: bool = False,
    ) -> None:
        self._specs = list(specs)
        self._failure_word = failure_word  # the last line's start ("launch 1 failed" before a restart)
        self._scheduler_stop = scheduler_stop  # Note [Stop protocol]: SIGTERM graceful, repeats ignored
        self._on_lost = on_lost  # live morph (Note [Live morph supervision])
        self._frozen = frozen
        self._joined = joined  # live morph: did member r ever join the live run (its heartbeat)?
        self._frozen_checked = 0.0
        self._frozen_killed: set[int] = set()
        #: ranks lost to a live morph, in the order their exits were seen
        self.lost: list[int] = []
        #: why a live morph was impossible (set when :meth:`wait` returns EXIT_RESTART)
        self.restart_reason = ""
        #: a worker could not be started (a restart would not help)
        self.start_failed = False
        #: a worker exited before building its Engine while others waited (a restart runs the same
        #: script: it would not help; Note [Lifecycle lines] in varuna/core/lifecycle.py)
        self.early_exit = False
        self._lifecycle = EarlyExits()
        #: the signals handled (a job stopped by one is never restarted)
        self.received_signals: list[int] = []
        self._last_note: dict[int, str] = {}  # rank -> its last "varuna: ..." output line
        self._config_lines: dict[int, str] = {}  # rank -> its "varuna: error: ..." line
        #: a worker refused its configuration (exit 78): the job ends with its line, exit 2
        self.config_error = False
        # After a configuration error (or an early exit): the others' output goes to the logs only.
        self._quiet = threading.Event()
        self._suspects = _Suspects()  # Note [Blame]
        self._readers_of: dict[int, list[threading.Thread]] = {}
        self._progress = progress  # a bar while the workers start (varuna.core.progress)
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
        #: The signal of the graceful stop the workers were asked for, None without one.
        self.graceful_signal: int | None = None
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
        # Closed before any output is relayed: the bar never interleaves with the workers' lines.
        with Progress(
            "starting workers",
            total=len(self._specs),
            unit="worker",
            enabled=self._progress,
            file=self._stderr,
        ) as bar:
            self._spawn_all(bar)
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
                self._readers_of.setdefault(worker.spec.env.rank, []).append(thread)

    def _spawn_all(self, bar: Progress) -> None:
        # One batch per host, also when a mixed-type placement interleaves hosts across ranks: an
        # agent forks its whole batch before any output thread starts (agent.py).
        by_host = sorted(self._specs, key=lambda s: s.env.host_id)
        for host_id, group in itertools.groupby(by_host, key=lambda s: s.env.host_id):
            if self._cause is not None:
                break
            host = self._hosts[host_id]
            batch = list(group)
            spawn_many = getattr(host, "spawn_many", None)
            if spawn_many is not None:
                # A host with an agent starts its workers in one request (one round trip).
                started, failure = spawn_many(batch)
                self.workers.extend(started)
                bar.update(len(started))
                if failure is not None:
                    self.start_failed = True
                    self._fail(f"{failure[0].label} could not be started {failure[1]}")
                continue
            for spec in batch:
                try:
                    worker = host.spawn(spec)
                except (OSError, subprocess.SubprocessError) as exc:
                    self.start_failed = True
                    self._fail(f"{spec.label} could not be started: {exc}")
                    break
                self.workers.append(worker)
                bar.update()

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
            self._check_early_exit(running)
            if not running:
                self._blame(time.monotonic(), force=True)
                unreaped = False
                break
            now = time.monotonic()
            self._blame(now)
            self._kill_frozen(running, now)
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
        if not _joined(self._readers, OUTPUT_DRAIN_TIMEOUT_S):
            self._message("some worker output may be missing: a pipe is still held open by a process"
                          " outside the job")
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
        self._lifecycle.exited(worker.spec.env.rank, code)
        # Non-zero codes after we began stopping are our own doing (SIGTERM/SIGKILL), not failures.
        if code != 0 and self._cause is None:
            detail = getattr(worker, "exit_detail", None) or _describe_exit(code)
            if code == CONFIG_EXIT_CODE:
                self._config_error(worker)
            elif self._on_lost is None and code == PEER_LOST_EXIT_CODE:
                self._suspects.add(worker, detail)  # Note [Blame]
            elif self._on_lost is None:
                self._fail(f"{_where(worker)} {detail}")
            elif code == PEER_LOST_EXIT_CODE:
                self._live_morph_impossible(worker)
            else:
                self._live_lost(worker, detail)

    def _config_error(self, worker: WorkerHandle) -> None:
        """Note [One-line refusals] (varuna/core/config_error.py): a worker refused its
        configuration. The others are stopped without a word and their output is only logged;
        the job's one line quotes this worker's."""
        rank = worker.spec.env.rank
        for thread in self._readers_of.get(rank, []):  # its line relayed (and recorded) first
            thread.join(timeout=LAST_WORDS_TIMEOUT_S)
        line = self._config_lines.get(rank) or (f"exited with code {CONFIG_EXIT_CODE} (a configuration "
                                                "error; see its log)")
        self.config_error = True
        self._quiet.set()
        self._cause = ("failed", f"{_where(worker)}: {line}")
        self._begin_stop(signal.SIGTERM)

    def _check_early_exit(self, running: list[WorkerHandle]) -> None:
        """Note [Lifecycle lines]: a worker exited 0 before building its Engine while others wait
        for it: the job fails with one line at once (the others stopped without a word, their
        output only logged), instead of their rendezvous timeouts minutes later."""
        ranks = [w.spec.env.rank for w in running]
        # After a stop the launcher forwarded (SIGUSR1), an exit 0 before the Engine is the answer to it.
        stopping = self._cause is not None or self._graceful_stop
        rank = None if stopping else self._lifecycle.culprit(ranks)
        if rank is None:
            return
        for thread in self._readers_of.get(rank, []):  # a "built" line still in its pipe counts
            thread.join(timeout=LAST_WORDS_TIMEOUT_S)
        if self._lifecycle.culprit(ranks) != rank:
            return
        worker = next(w for w in self.workers if w.spec.env.rank == rank)
        self.early_exit = True
        self._quiet.set()
        line = early_exit_line(_where(worker), self._exit_codes[rank], waiting=self._lifecycle.waiting(ranks))
        self._cause = ("failed", line)
        self._begin_stop(signal.SIGTERM)

    def _blame(self, now: float, *, force: bool = False) -> None:
        """Note [Blame]: the first suspect becomes the cause once no primary cause can come
        (``force``: every worker has exited, none can)."""
        due = None if self._cause is not None else self._suspects.due(now, self._hosts, force)
        if due is None:
            return
        worker, detail = due
        rank = worker.spec.env.rank
        for thread in self._readers_of.get(rank, []):  # its last line (the reason) relayed first
            thread.join(timeout=LAST_WORDS_TIMEOUT_S)
        note = self._last_note.get(rank, "").removeprefix("varuna: ")
        self._fail(f"{_where(worker)} {detail}" + (f": {note}" if note else ""))

    def _kill_frozen(self, running: list[WorkerHandle], now: float) -> None:
        """Live morph: SIGKILL workers the others declared dead for lack of heartbeats (checked
        twice a second: one store read per running worker)."""
        if self._frozen is None or self._cause is not None or now - self._frozen_checked < FROZEN_CHECK_S:
            return
        self._frozen_checked = now
        for worker in running:
            rank = worker.spec.env.rank
            if rank in self._frozen_killed:
                continue
            try:
                why = self._frozen(rank)
            except (OSError, RuntimeError):  # the store is ours; a failed read is retried next time
                return
            if why is not None:
                self._frozen_killed.add(rank)
                self._message(f"{_where(worker)} was declared dead by the others ({why}); killing it")
                worker.send_signal(signal.SIGKILL)

    def _live_lost(self, worker: WorkerHandle, detail: str) -> None:
        """A worker died under live morph: declare it dead, let the survivors regroup -- unless no
        worker ever joined the live run (a script without LiveTrainer): nobody can regroup, the
        run takes the restart path at once, the others' dying output only logged."""
        rank = worker.spec.env.rank
        if self._joined is not None and not any(self._joined(w.spec.env.rank) for w in self.workers):
            self.restart_reason = (f"{_where(worker)} {detail}, and no worker ever joined the live run: the "
                                   "script does not use varuna.runtime.live_trainer.LiveTrainer (or "
                                   "LiveWorld.join), so the others cannot regroup")
            self._cause = ("restart", self.restart_reason)
            self._quiet.set()
            self._begin_stop(signal.SIGTERM)
            return
        self.lost.append(rank)
        try:
            assert self._on_lost is not None
            self._on_lost(rank)
        except (OSError, RuntimeError) as exc:  # the store is ours; failing it ends the live run
            self._fail(f"{_where(worker)} {detail}; cannot tell the survivors ({exc})")
            return
        others = len(self._running())
        if others:
            self._message(f"{_where(worker)} {detail}; live morph: the {others} other worker(s) regroup"
                          " without a restart")

    def _live_morph_impossible(self, worker: WorkerHandle) -> None:
        """A survivor said the run cannot go on live: the others exit the same way, bounded."""
        rank = worker.spec.env.rank
        for thread in self._readers_of.get(rank, []):  # its last line (the reason) relayed first
            thread.join(timeout=LAST_WORDS_TIMEOUT_S)
        note = self._last_note.get(rank, "").removeprefix("varuna: ").removeprefix("live morph impossible: ")
        self.restart_reason = note or f"{_where(worker)} exited with code {PEER_LOST_EXIT_CODE}"
        self._cause = ("restart", self.restart_reason)
        self._kill_at = time.monotonic() + self._stop_timeout_s

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
        self.received_signals.append(signum)
        name = signal.Signals(signum).name
        graceful = (signal.SIGUSR1, signal.SIGTERM) if self._scheduler_stop else (signal.SIGUSR1,)
        if self._graceful_stop and self._scheduler_stop and signum in graceful:
            return  # the scheduler's one stop, arriving again by another path (Note [Stop protocol])
        if self._graceful_stop and (signum in _STOP_SIGNALS or signum == signal.SIGUSR1):
            # The workers were already asked to finish their mini-batch and checkpoint: a second
            # request means "now" (Note [Stop protocol]).
            self._message(f"received {name} after SIGUSR1; killing {len(self._running())} worker(s) now")
            if self._cause is None:
                self._cause = ("signal", signum)
            self._kill_all()
            return
        if signum not in _STOP_SIGNALS or signum in graceful:
            # SIGUSR1: relay only, without a SIGKILL deadline (a checkpoint takes as long as it
            # takes); the workers' exit codes (0 after a graceful stop) decide the outcome.
            self._graceful_stop = signum in graceful
            if self._graceful_stop:
                self.graceful_signal = signum
            what = (
                ": finish the mini-batch, checkpoint, exit (a second signal kills them at once)"
                if self._graceful_stop
                else ""
            )
            if self._graceful_stop and self._scheduler_stop:
                what = ": finish the mini-batch, checkpoint, exit (SIGINT kills them at once)"
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

    @property
    def failure(self) -> str:
        """Why the job failed (the last line's text), or ""."""
        if self._cause is None or self._cause[0] != "failed":
            return ""
        return str(self._cause[1])

    def _finish(self) -> int:
        """The exit code; names the failed rank once more as the last line."""
        if self._cause is None:
            return self._finish_live() if self.lost else EXIT_OK
        kind, detail = self._cause
        if kind == "restart":
            return EXIT_RESTART
        if kind == "signal":
            assert isinstance(detail, int)
            return 128 + detail
        # A refused configuration or an early exit is not restarted (the script would do it again).
        word = "job failed" if self.config_error or self.early_exit else self._failure_word
        self._message(f"{word}: {detail}")
        return EXIT_USAGE if self.config_error else EXIT_WORKER_FAILED

    def _finish_live(self) -> int:
        """Workers were lost to live morphs: ok when the ones still standing finished."""
        if not [r for r, c in self._exit_codes.items() if c == 0 and r not in self.lost]:
            self._message(f"job failed: every worker was lost (ranks {self.lost})")
            return EXIT_WORKER_FAILED
        self._message(f"job finished live: rank(s) {', '.join(map(str, self.lost))} lost, the survivors"
                      " went on without a restart")
        return EXIT_OK

    def _relay(self, worker: WorkerHandle, stream: IO[bytes], sink: TextIO) -> None:
        """Copy one worker stream to ``sink`` line by line, prefixed; runs in a reader thread."""
        prefix = f"[{_where(worker)}] "
        rank = worker.spec.env.rank
        frames = _CppFrames()
        echoes = _Echoes(self._quiet)
        try:
            for raw in iter(stream.readline, b""):
                text = raw.decode("utf-8", errors="replace")
                if not text.endswith("\n"):
                    text += "\n"  # a last line without newline must not glue onto the next prefix
                head, phase = split_marker(text)
                if phase is not None:  # Note [Lifecycle lines]: for the launcher and the log only
                    self._lifecycle.saw(rank, phase)
                    self._log_line(rank, text)
                    if head and not self._quiet.is_set():  # the script's unfinished line, shown as its own
                        with self._out_lock:
                            self._write(sink, prefix + head + "\n")
                    continue
                if text.startswith(ERROR_PREFIX):  # the job's last line quotes it (_config_error)
                    self._config_lines[rank] = text.strip().removeprefix(ERROR_PREFIX)
                    self._quiet.set()  # now, not when its exit is polled: Note [Echoes of an exit]
                elif text.startswith("varuna: "):
                    self._last_note[rank] = text.strip()
                shown = not (frames.swallow(text) or self._quiet.is_set() or text.startswith(ERROR_PREFIX))
                shown = shown and not echoes.hidden(text)
                with self._out_lock:
                    if shown:
                        self._write(sink, prefix + text)
                self._log_line(rank, text)
        except (OSError, ValueError):
            pass  # the pipe closed under us (launcher shutting down): nothing left to relay
        finally:
            with contextlib.suppress(OSError):
                stream.close()

    def _log_line(self, rank: int, text: str) -> None:
        """Append ``text`` to ``rank``'s ``--log-dir`` log, if there is one."""
        with self._out_lock:
            log = self._log_files.get(rank)
            if log is not None:
                log.write(text)
                log.flush()

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
