"""The run watches itself: a rank that left early, froze or went silent is named within seconds
(Note [Peer watch]).

Note [Peer watch]
~~~~~~~~~~~~~~~~~
Without it, a rank whose peer froze (SIGSTOP, a hung host), went silent (its host partitioned or
evicted: packets vanish, no reset ever arrives) or returned early waits silently for
``comm_timeout_s`` (300 s by default) inside a collective or a receive, and then fails with a
message that names no one. Each engine owns one :class:`PeerWatch`, two threads started with the
engine and stopped by ``Engine.close``:

- the **beater** publishes this rank's beat in the rendezvous store every ``interval`` seconds
  (``seq step host pid``; ``seq`` grows each beat; ``exit`` is appended once the engine is
  closed) and reads every peer's beat in one ``multi_get``, on *its own* connection to the store
  (a clone): a TCPStore call has no timeout of its own once the request is sent, so when the
  store's host (rank 0's) goes silent the call blocks, and it must block nothing but this thread;
- the **judge** never touches the store: it looks at what the beater last saw. For each peer,
  how long its value had stood still *when last read* (noted on this process's own monotonic
  clock: no clocks of other hosts are compared); for the store, how long since an exchange last
  completed. A judge woken late (this process starved of CPU) gives the beater a turn before it
  judges again, so a live peer is never blamed for our own stall.

While this rank is inside ``train_step`` (:meth:`PeerWatch.enter` / :meth:`leave`) the judge
reports a peer that closed its engine before the step this rank is in, a peer whose beat stood
still for ``timeout_s``, or a store that has not answered for ``timeout_s`` (its host, rank 0's,
is silent or gone: named from rank 0's last beat). No rank's silence blinds the others: rank 0's
is the store's, and that is a verdict too.

**A stop signal while blocked.** The engine's SIGTERM/SIGUSR1 handler only sets a flag, which
Python runs when the main thread returns from C++; a main thread blocked in a gloo wait on a
silent peer never returns. So the judge also hears the stop signals (``signal.set_wakeup_fd``:
the C-level handler writes the signal number to a pipe the judge reads, whatever the main
thread is blocked in), and after one, inside a step, the bound drops to :data:`STOP_SILENCE_S`
(at most ``timeout_s``): a graceful stop needs every rank's end-of-step agreement, which a peer
silent that long (or a store stuck that long) will not give. A store that *refused* or *reset*
the connection (rank 0 exited after its own graceful stop) is not a stuck one and keeps the
normal bound.

A report is one line on stderr naming the rank(s), host, pid and step, then the process exits
with :data:`PEER_LOST_EXIT_CODE`: the main thread is typically blocked inside a C++ wait that no
Python exception can interrupt, and leaving by ``os._exit`` runs no finaliser that could wait on
the lost peer. A communication error in the step (a peer's process died: its connections were
reset) asks the watch too (:meth:`PeerWatch.report_if_lost`), which waits for the beater's next
exchange (bounded) and names the lost peer, or rank 0 when its store is gone, in one line instead
of a traceback of C++ frames. Checkpoints stay safe: a save is only complete once its manifest is
committed.

Example::

    watch = PeerWatch.start(store, rank=0, world=2, host="h0", timeout_s=20.0)
    watch.enter(step=1)
    ...                      # the step's communication
    watch.leave()
    watch.close()            # publishes "exit", stops both threads
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from varuna.core.env import ProcessEnv

__all__ = [
    "PEER_LOST_EXIT_CODE", "STOP_SILENCE_S", "PeerState", "PeerWatch", "describe_lost_peers", "watching",
]

#: Exit code of a rank that stopped because a peer left or froze (distinct from a crash's 1).
PEER_LOST_EXIT_CODE = 75
#: After a stop signal inside a step: a peer (or the store) silent this long cannot join the
#: graceful stop's agreement (Note [Peer watch]); three beats at the usual 1 s interval.
STOP_SILENCE_S = 3.0


@dataclass
class PeerState:
    """What this watcher last saw of one peer."""

    value: str = ""
    changed_at: float = 0.0
    """This process's monotonic time of the last change of ``value``."""

    @property
    def step(self) -> int:
        parts = self.value.split()
        return int(parts[1]) if len(parts) > 1 else 0

    @property
    def where(self) -> str:
        parts = self.value.split()
        return f"host {parts[2]}, pid {parts[3]}" if len(parts) > 3 else "host unknown"

    @property
    def exited(self) -> bool:
        return self.value.endswith(" exit")


def describe_lost_peers(
    peers: dict[int, PeerState], *, step: int, now: float, timeout_s: float
) -> list[str]:
    """The peers to report while this rank is in ``step``: closed before it, or silent too long
    (``now``: when the values were read).

    >>> gone = PeerState("7 1 h1 42 exit", 0.0)
    >>> describe_lost_peers({1: gone, 2: PeerState("9 2 h2 43", 5.0)}, step=2, now=6.0, timeout_s=3.0)
    ['rank 1 (host h1, pid 42) closed its engine after step 1']
    """
    lost = []
    for r, p in sorted(peers.items()):
        if p.exited:
            if p.step < step:
                lost.append(f"rank {r} ({p.where}) closed its engine after step {p.step}")
        elif now - p.changed_at > timeout_s:
            lost.append(
                f"rank {r} ({p.where}) has shown no sign of life for {now - p.changed_at:.0f}s "
                f"(last seen in step {p.step}; frozen, killed or its host silent)"
            )
    return lost


def _exit_process(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    os._exit(PEER_LOST_EXIT_CODE)


def _first_line(e: BaseException) -> str:
    """A c10d error's first line (its message goes on with C++ frames)."""
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


@dataclass(eq=False)
class PeerWatch:
    """One engine's liveness threads (see Note [Peer watch]); build it with :meth:`start`."""

    store: object
    rank: int
    world: int
    prefix: str
    timeout_s: float
    interval_s: float
    host: str = field(default_factory=socket.gethostname)
    on_lost: Callable[[str], None] = _exit_process
    """Called once, from a watch thread, with the report line (tests replace it)."""
    stop_signals: frozenset[int] = frozenset()
    """Signal numbers that ask the engine to stop gracefully (the judge hears them)."""
    _step: int = 0
    _inside: bool = False
    _seq: int = 0
    _closed: bool = False
    _peers: dict[int, PeerState] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _exchanged_at: float = 0.0
    """Monotonic time the beater last completed an exchange (beat + read)."""
    _exchanges: int = 0
    _calling_since: float | None = None
    """Monotonic time the beater's current store call began; None between calls."""
    _store_error: str = ""
    """The last exchange's error (refused, reset): the store's process is gone, not silent."""
    _started: bool = False
    """Every peer's first beat has been seen."""
    _signal_at: float | None = None
    _signal_name: str = ""
    _wakeup: tuple[int, int] | None = None
    _reported: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    @classmethod
    def start(
        cls, store, *, rank: int, world: int, timeout_s: float, host: str | None = None,
        on_lost: Callable[[str], None] | None = None, stop_signals: Sequence[str] = (),
    ) -> PeerWatch:
        """Publish the first beat and start the threads. Every rank builds its engines in the
        same order, so a per-rank counter gives every rank the same key prefix for one engine.
        ``stop_signals``: names of the engine's graceful-stop signals (heard only when this runs
        in the main thread and nobody else set a wakeup fd)."""
        n = store.add(f"varuna/watch/engines/{rank}", 1)
        watch = cls(
            store=_own_connection(store),
            rank=rank,
            world=world,
            prefix=f"varuna/watch/{n}/",
            timeout_s=timeout_s,
            interval_s=max(0.05, min(1.0, timeout_s / 5)),
            stop_signals=frozenset(int(getattr(signal, s)) for s in stop_signals),
        )
        if host is not None:
            watch.host = host
        if on_lost is not None:
            watch.on_lost = on_lost
        watch._beat()
        watch._exchanged_at = time.monotonic()
        watch._hear_signals()
        # Daemon threads, owned: close() stops them and joins the judge (and the beater unless
        # it is stuck in a call to a silent store); daemon so that a script that never closes its
        # engine still reaches the atexit guard that does (engine.py).
        for target, name in ((watch._beat_loop, "beat"), (watch._judge_loop, "judge")):
            thread = threading.Thread(target=target, name=f"varuna-peer-{name}-{rank}", daemon=True)
            thread.start()
            watch._threads.append(thread)
        return watch

    @classmethod
    def for_world(
        cls, rank: int, world: int, timeout_s: float, stop_signals: Sequence[str] = ()
    ) -> PeerWatch | None:
        """The engine's watch over the default group's store; None in one process or when off."""
        if world < 2 or timeout_s <= 0:
            return None
        from torch.distributed.distributed_c10d import _get_default_store

        return cls.start(_get_default_store(), rank=rank, world=world, timeout_s=timeout_s,
                         stop_signals=stop_signals)

    def enter(self, step: int) -> None:
        """This rank is now inside ``step`` (waiting on peers may follow)."""
        self._step, self._inside = step, True

    def leave(self) -> None:
        """This rank left the step (time between steps is the script's, never reported)."""
        self._inside = False

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the threads, then publish that this engine is closed (unless the store is stuck)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for thread in self._threads:
            # A beater stuck in a call to a silent store cannot be joined; it is a daemon and
            # holds nothing the process needs (its own store connection).
            thread.join(timeout_s if thread.name.startswith("varuna-peer-judge") else min(timeout_s, 2.0))
        self._unhear_signals()
        if self._calling_since is None and not self._store_error:
            with contextlib.suppress(Exception):  # the store's host may be gone at shutdown
                self._beat(exited=True)

    def report_if_lost(self) -> None:
        """Called when a wait inside the step failed (e.g. gloo's "connection closed by peer"):
        once the beater has exchanged again (bounded), name a peer that closed its engine before
        this step, a silent one, or rank 0 when its store is gone, in one line, and exit; else
        let the error surface (it is not a lost peer)."""
        if not self._inside or self._closed:
            return
        seen = self._exchanges
        deadline = time.monotonic() + max(3 * self.interval_s, 1.0)
        while self._exchanges == seen and not self._store_error and time.monotonic() < deadline:
            self._stop.wait(0.02)
        now = time.monotonic()
        lost = self._store_verdict(now, stuck_after=self.interval_s, gone_after=0.0)
        if not lost:
            with self._lock:
                peers, exchanged_at = dict(self._peers), self._exchanged_at
            exited = {r: p for r, p in peers.items() if p.exited}
            lost = describe_lost_peers(exited or peers, step=self._step, now=exchanged_at,
                                       timeout_s=self.timeout_s)
        if lost:
            self._report(lost)

    # ------------------------------------------------------------------ the beater

    def _key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def _beat(self, exited: bool = False) -> None:
        self._seq += 1
        value = f"{self._seq} {self._step} {self.host} {os.getpid()}" + (" exit" if exited else "")
        self.store.set(self._key(self.rank), value)

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._calling_since = time.monotonic()
            try:
                self._beat()
                self._read_peers()
                error = ""
            except Exception as e:  # refused or reset: rank 0's process (the store's) is gone
                error = _first_line(e)
            with self._lock:
                self._calling_since = None
                self._store_error = error
                if not error:
                    self._exchanged_at = time.monotonic()
                    self._exchanges += 1
            if error:
                # A TCPStore client does not reconnect: every later call would fail the same way
                # (and c10d would log each failure with its C++ frames).
                return

    def _read_peers(self) -> None:
        peers = [r for r in range(self.world) if r != self.rank]
        keys = [self._key(r) for r in peers]
        if not keys:
            return
        if not self._started:
            # Until every peer's first beat is there (engines start at different times), read
            # those that are: multi_get would wait for a missing key.
            present = [(r, k) for r, k in zip(peers, keys) if self.store.check([k])]
            self._started = len(present) == len(peers)
            peers, keys = [r for r, _ in present], [k for _, k in present]
        values = self.store.multi_get(keys) if keys else []
        now = time.monotonic()
        with self._lock:
            for r in range(self.world):
                if r != self.rank:
                    self._peers.setdefault(r, PeerState("", now))  # not beating yet: counts from now
            for r, raw in zip(peers, values):
                value = raw.decode() if isinstance(raw, bytes) else str(raw)
                seen = self._peers.get(r)
                if seen is None or seen.value != value:
                    self._peers[r] = PeerState(value, now)

    # ------------------------------------------------------------------ the judge

    def _judge_loop(self) -> None:
        tick = min(0.25, self.interval_s)
        last = time.monotonic()
        patient_until = 0.0
        while not self._stop.wait(tick):
            self._drain_signals()
            now = time.monotonic()
            if now - last > max(2 * self.interval_s, 1.0):
                patient_until = now + 2 * self.interval_s  # we were starved: let the beater catch up
            last = now
            if now < patient_until or not self._inside:
                continue
            lost = self._verdict(now)
            if lost:
                self._report(lost)
                return

    def _verdict(self, now: float) -> list[str]:
        stopping = self._signal_at is not None
        limit = min(self.timeout_s, STOP_SILENCE_S) if stopping else self.timeout_s
        lost = self._store_verdict(now, stuck_after=limit, gone_after=float("inf") if stopping else limit)
        if lost:
            return lost
        with self._lock:
            peers, exchanged_at = dict(self._peers), self._exchanged_at
        lost = describe_lost_peers(peers, step=self._step, now=exchanged_at, timeout_s=limit)
        if lost and stopping:
            lost[-1] += f"; received {self._signal_name}, and a graceful stop needs every rank"
        return lost

    def _store_verdict(self, now: float, *, stuck_after: float, gone_after: float) -> list[str]:
        """The store's (rank 0's) silence: a call that has not returned for ``stuck_after`` (its
        host is silent), or calls failing (refused, reset: its process is gone) with no exchange
        for ``gone_after``."""
        with self._lock:
            exchanged_at, error, calling = self._exchanged_at, self._store_error, self._calling_since
            rank0 = self._peers.get(0, PeerState())
        if self.rank == 0:
            return []
        seen = f"{rank0.where}, last seen in step {rank0.step}" if rank0.value else "not seen yet"
        where = f"rank 0 ({self._store_address()}; {seen})"
        if calling is not None and now - calling > stuck_after:
            why = (f"the rendezvous store of {where} has not answered for {now - exchanged_at:.0f}s: "
                   "rank 0's host is silent (partitioned or gone)")
        elif error and now - exchanged_at > gone_after:
            why = f"the rendezvous store of {where} is gone ({error}): rank 0 exited or its host is down"
        else:
            return []
        if self._signal_at is not None:
            why += f"; received {self._signal_name}, and a graceful stop needs every rank"
        return [why]

    def _store_address(self) -> str:
        """Where the store listens (``MASTER_ADDR:MASTER_PORT`` when the store does not say)."""
        store = getattr(self.store, "underlying_store", self.store)
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        if host is None:
            env = ProcessEnv.from_env()
            host, port = env.master_addr or "?", env.master_port or "?"
        return f"store {host}:{port}"

    def _report(self, lost: list[str]) -> None:
        if not self._reported.acquire(blocking=False):  # the judge and the main thread: once
            return
        self.on_lost(
            f"varuna: rank {self.rank} (host {self.host}) stopped waiting in step {self._step}: "
            + "; ".join(lost)
            + " -- see that rank's log; the run cannot continue without it"
        )

    # ------------------------------------------------------------------ stop signals

    def _hear_signals(self) -> None:
        """Have the C-level signal handler write stop signals to a pipe the judge reads (only
        from the main thread, and only when no one else uses the wakeup fd)."""
        if not self.stop_signals or threading.current_thread() is not threading.main_thread():
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous = -2
        if previous != -1:  # someone else's (asyncio): put it back, do without
            if previous >= 0:
                signal.set_wakeup_fd(previous)
            os.close(r)
            os.close(w)
            return
        self._wakeup = (r, w)

    def _unhear_signals(self) -> None:
        """Give the wakeup fd back (main thread only: elsewhere the pipe stays open, since the
        C-level handler may still write to its descriptor)."""
        if self._wakeup is None or threading.current_thread() is not threading.main_thread():
            return
        with contextlib.suppress(ValueError, OSError):
            current = signal.set_wakeup_fd(-1)
            if current not in (-1, self._wakeup[1]):
                signal.set_wakeup_fd(current)  # someone set theirs since ours: theirs stays
        for fd in self._wakeup:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wakeup = None

    def _drain_signals(self) -> None:
        if self._wakeup is None:
            return
        with contextlib.suppress(OSError, ValueError):
            ready, _, _ = select.select([self._wakeup[0]], [], [], 0)
            if not ready:
                return
            for signum in os.read(self._wakeup[0], 256):
                if signum in self.stop_signals and self._signal_at is None:
                    self._signal_name = signal.Signals(signum).name
                    self._signal_at = time.monotonic()


def _own_connection(store):
    """A second client of ``store`` (its own TCP connection) when the store can make one, so
    that the beater blocked on a silent store never holds the connection the main thread uses."""
    clone = getattr(store, "clone", None)
    if clone is None:
        return store
    try:
        return clone()
    except Exception:  # a store type without clone (HashStore, FileStore): share it
        return store


@contextlib.contextmanager
def watching(watch: PeerWatch | None, step: int):
    """Mark the block as inside ``step`` for ``watch`` (None: nothing to do). A communication
    error escaping the block first asks the watch to name a lost peer (report and exit)."""
    if watch is None:
        yield
        return
    watch.enter(step)
    try:
        yield
    except (RuntimeError, TimeoutError):
        watch.report_if_lost()
        raise
    finally:
        watch.leave()
