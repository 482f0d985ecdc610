"""The run watches itself: a rank that left early or froze is named within seconds (Note [Peer watch]).

Note [Peer watch]
~~~~~~~~~~~~~~~~~
Without it, a rank whose peer froze (SIGSTOP, a hung host) or returned early waits silently for
``comm_timeout_s`` (300 s by default) inside a collective or a receive, and then fails with a
message that names no one. Each engine owns one :class:`PeerWatch` thread (started with the
engine, stopped and joined by ``Engine.close``) that, every ``interval`` seconds:

- publishes this rank's beat in the rendezvous store: ``seq step host pid`` (``seq`` grows each
  beat; ``exit`` is appended once the engine is closed);
- reads every peer's beat in one ``multi_get`` and notes, on this process's own monotonic clock,
  when each value last changed (no clocks of other hosts are compared, and a watcher that was
  itself starved of CPU sees changed values when it wakes, so it never blames a live peer);
- while this rank is inside ``train_step`` (:meth:`PeerWatch.enter` / :meth:`leave`), reports a
  peer that closed its engine before the step this rank is in, a peer whose beat has not moved
  for ``timeout_s``, or a store that stayed unreachable that long (its host, rank 0, is gone).

A report is one line on stderr naming the rank(s), host, pid and step, then the process exits
with :data:`PEER_LOST_EXIT_CODE`: the main thread is typically blocked inside a C++ wait that no
Python exception can interrupt, and leaving by ``os._exit`` runs no finaliser that could wait on
the lost peer. Checkpoints stay safe: a save is only complete once its manifest is committed.

Example::

    watch = PeerWatch.start(store, rank=0, world=2, host="h0", timeout_s=20.0)
    watch.enter(step=1)
    ...                      # the step's communication
    watch.leave()
    watch.close()            # publishes "exit", joins the thread
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["PEER_LOST_EXIT_CODE", "PeerState", "PeerWatch", "describe_lost_peers", "watching"]

#: Exit code of a rank that stopped because a peer left or froze (distinct from a crash's 1).
PEER_LOST_EXIT_CODE = 75


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
    """The peers to report while this rank is in ``step``: closed before it, or silent too long.

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
                f"(last seen in step {p.step}; frozen or killed)"
            )
    return lost


def _exit_process(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    os._exit(PEER_LOST_EXIT_CODE)


@dataclass(eq=False)
class PeerWatch:
    """One engine's liveness thread (see Note [Peer watch]); build it with :meth:`start`."""

    store: object
    rank: int
    world: int
    prefix: str
    timeout_s: float
    interval_s: float
    host: str = field(default_factory=socket.gethostname)
    on_lost: Callable[[str], None] = _exit_process
    """Called once, from the watch thread, with the report line (tests replace it)."""
    _step: int = 0
    _inside: bool = False
    _seq: int = 0
    _closed: bool = False
    _peers: dict[int, PeerState] = field(default_factory=dict)
    _store_down_since: float | None = None
    _reported: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def start(
        cls, store, *, rank: int, world: int, timeout_s: float, host: str | None = None,
        on_lost: Callable[[str], None] | None = None,
    ) -> PeerWatch:
        """Publish the first beat and start the thread. Every rank builds its engines in the same
        order, so a per-rank counter gives every rank the same key prefix for one engine."""
        n = store.add(f"varuna/watch/engines/{rank}", 1)
        watch = cls(
            store=store,
            rank=rank,
            world=world,
            prefix=f"varuna/watch/{n}/",
            timeout_s=timeout_s,
            interval_s=max(0.05, min(1.0, timeout_s / 5)),
        )
        if host is not None:
            watch.host = host
        if on_lost is not None:
            watch.on_lost = on_lost
        watch._beat()
        # A daemon thread, owned: close() stops and joins it; daemon only so that a script that
        # never closes its engine still reaches the atexit guard that does (engine.py).
        watch._thread = threading.Thread(target=watch._loop, name=f"varuna-peer-watch-{rank}", daemon=True)
        watch._thread.start()
        return watch

    @classmethod
    def for_world(cls, rank: int, world: int, timeout_s: float) -> PeerWatch | None:
        """The engine's watch over the default group's store; None in one process or when off."""
        if world < 2 or timeout_s <= 0:
            return None
        from torch.distributed.distributed_c10d import _get_default_store

        return cls.start(_get_default_store(), rank=rank, world=world, timeout_s=timeout_s)

    def enter(self, step: int) -> None:
        """This rank is now inside ``step`` (waiting on peers may follow)."""
        self._step, self._inside = step, True

    def leave(self) -> None:
        """This rank left the step (time between steps is the script's, never reported)."""
        self._inside = False

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop and join the thread, then publish that this engine is closed."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        try:
            self._beat(exited=True)
        except Exception:  # the store's host (rank 0) may already be gone at shutdown
            pass

    def report_if_lost(self) -> None:
        """Called when a wait inside the step failed (e.g. gloo's "connection closed by peer"):
        if a peer closed its engine before this step, or is silent, report it now (one line, exit)
        instead of letting the error surface as a traceback that names no rank."""
        if not self._inside or self._closed:
            return
        now = time.monotonic()
        try:
            self._read_peers(now)
        except Exception:  # rank 0's store is gone: no more to learn; let the error surface
            return
        exited = {r: p for r, p in self._peers.items() if p.exited}
        lost = describe_lost_peers(exited or self._peers, step=self._step, now=now, timeout_s=self.timeout_s)
        if lost:
            self._report(lost)

    # ------------------------------------------------------------------ the thread

    def _key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def _beat(self, exited: bool = False) -> None:
        self._seq += 1
        value = f"{self._seq} {self._step} {self.host} {os.getpid()}" + (" exit" if exited else "")
        self.store.set(self._key(self.rank), value)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self._beat()
                self._read_peers(now)
                self._store_down_since = None
            except Exception as e:  # the store lives on rank 0: unreachable means rank 0 is gone
                if self._store_down_since is None:
                    self._store_down_since = now
                if self._inside and now - self._store_down_since > self.timeout_s:
                    self._report([f"the rendezvous store on rank 0 has been unreachable for "
                                  f"{now - self._store_down_since:.0f}s ({e}); rank 0 is gone"])
                    return
                continue
            if self._inside:
                lost = describe_lost_peers(self._peers, step=self._step, now=now, timeout_s=self.timeout_s)
                if lost:
                    self._report(lost)
                    return

    def _read_peers(self, now: float) -> None:
        peers = [r for r in range(self.world) if r != self.rank]
        keys = [self._key(r) for r in peers]
        if not keys or not self.store.check(keys):  # a peer's first beat is not there yet
            for r in peers:
                self._peers.setdefault(r, PeerState("", now))
            return
        for r, raw in zip(peers, self.store.multi_get(keys)):
            value = raw.decode() if isinstance(raw, bytes) else str(raw)
            seen = self._peers.get(r)
            if seen is None or seen.value != value:
                self._peers[r] = PeerState(value, now)

    def _report(self, lost: list[str]) -> None:
        if not self._reported.acquire(blocking=False):  # the thread and the main thread: once
            return
        self.on_lost(
            f"varuna: rank {self.rank} (host {self.host}) stopped waiting in step {self._step}: "
            + "; ".join(lost)
            + " -- see that rank's log; the run cannot continue without it"
        )


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
