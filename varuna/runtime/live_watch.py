"""Heartbeats of a live run and the failure cascade (Note [Live watch]).

Note [Live watch]
~~~~~~~~~~~~~~~~~
A killed worker's sockets are reset by the kernel, so every direct wait on it fails within
milliseconds. A *frozen* one (SIGSTOP, a hung VM) keeps them open: waits on it end only at their
timeout, and so do waits on a survivor that is itself blocked on it. Two mechanisms bound both:

- **Heartbeats.** Each member's :class:`LiveWatch` thread (started by ``LiveWorld.join``, owned
  and joined by ``LiveWorld.close``) writes ``varuna/live/beat/{member}`` every ``beat_s`` and
  reads every other member's beat. A value (once there: a member still starting has none) that
  has not changed for ``freeze_s``, measured on
  this process's own monotonic clock from when it last *saw* a change (no clocks of other hosts
  are compared; a watcher whose own loop ran late, starved of CPU, restarts every clock instead
  of judging), makes this member declare it dead (``declare_dead``, with the reason in
  ``dead_why/{member}``). A slow step is not a freeze: the beats come from a thread, which runs
  while the main thread computes or waits. A member that closed its world beats ``exit`` and is
  never declared frozen.
- **Severing.** Once any member of the current generation is dead (declared by the supervisor or
  by a watch), the generation is over for everyone: the watch severs every group of it that this
  process holds (:func:`sever`), so its own main thread fails out of any gloo wait at once, and,
  because severing closes this process's sockets, so does every peer blocked on *this* process:
  the failure cascades through the survivors in milliseconds instead of at ``comm_timeout_s``.
  A live morph's tear-down after a failed step severs the same way (a survivor blocked on a
  survivor that is blocked on the lost member is released at once).

:func:`sever` relies on gloo's own timeout path: a receive that times out makes the group's
transport context signal the error to *every* pair and close their sockets (measured on torch
2.13: the blocked thread of this process fails with "Application timeout caused pair closure",
a peer blocked on it with "Connection closed by peer" within milliseconds). ``abort()``,
``shutdown()`` and ``destroy_process_group`` do not unblock such waits on gloo
(docs/live_morph.md, Background). A receive with a tag nobody sends and a 1 ms timeout is that
timeout, on purpose.

A member declared dead that runs again (SIGCONT) finds its own ``dead/{member}`` key at its
next beat and exits at once with :data:`DECLARED_DEAD_EXIT_CODE` and one line, before it can
touch the new generation: it is not in it, and its old groups' peers are gone.

Example::

    watch = LiveWatch.start(store, member=2, watched=lambda: [0, 1, 3], freeze_s=20.0,
                            on_dead=lambda dead: print("lost", dead))
    ...
    watch.close()     # beats "exit", joins the thread
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["DECLARED_DEAD_EXIT_CODE", "LiveWatch", "frozen_verdict", "sever"]

#: Exit code of a member that found itself declared dead (it was frozen, the run went on without
#: it). Not PEER_LOST_EXIT_CODE: the job is fine, only this process is stale.
DECLARED_DEAD_EXIT_CODE = 76
_KEYS = "varuna/live/"
_SEVER_TAG = 0x5E7E  # never used by a real message (links and collectives use tag 0)


def sever(groups: Iterable[object], dead: Iterable[int] = ()) -> None:
    """Close every connection of ``groups`` now (Note [Live watch]): waits of this process on
    them fail at once, and so do peers' waits on this process. ``dead``: ranks of the group's
    generation (the default group's numbering) known lost; the timed-out receive then goes to one
    of them when it is in the group, so the pair to a *silent* peer (no reset will ever come) is
    surely among those closed. Gloo groups only; others are asked to ``abort()``. Never raises (a
    group already broken is what we want).

    Example::

        sever([dist.group.WORLD], dead=[2])
    """
    dead = list(dead)
    for g in groups:
        if g is None or g == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        try:
            size, rank = g.size(), g.rank()
            if size < 2:
                continue
            if _backend_name(g) != "gloo":
                g.abort()
                continue
            peers = [p for p in (_group_rank(g, r, size) for r in dead) if p is not None and p != rank]
            for peer in peers or [(rank + 1) % size]:
                with contextlib.suppress(Exception):  # the timeout we asked for (or closed already)
                    g.recv([torch.empty(1)], peer, _SEVER_TAG).wait(timedelta(milliseconds=1))
        except Exception:  # a group already broken
            pass


def _group_rank(g, rank: int, size: int) -> int | None:
    """``rank`` (the generation's numbering) in ``g``, or None when it is not a member. A group
    torch does not know (a live transfer's) is numbered as the generation's list it was made of."""
    try:
        return dist.get_group_rank(g, rank)
    except Exception:
        return rank if 0 <= rank < size and g not in dist.distributed_c10d._world.pg_group_ranks else None


def frozen_verdict(store, member: int) -> str | None:
    """Why the watches declared ``member`` dead while its process may still exist (a freeze), or
    None (alive, or declared dead for another reason: its exit, a notice). A supervisor kills such
    a process: stopped for good, it would never exit on its own.

    Example::

        if frozen_verdict(store, 3) is not None:
            os.kill(pid_of_member_3, signal.SIGKILL)
    """
    key = f"{_KEYS}dead_why/{member}"
    return store.get(key).decode() if store.check([key]) else None


def _backend_name(g) -> str:
    try:
        return str(g._get_backend_name()) if hasattr(g, "_get_backend_name") else str(g.name())
    except Exception:
        return ""


def _exit_declared_dead(member: int, why: str) -> None:
    print(f"varuna: member {member} was declared dead ({why}); the run went on without it, this process "
          "exits without touching it", file=sys.stderr, flush=True)
    os._exit(DECLARED_DEAD_EXIT_CODE)  # no finaliser may wait on the old generation's groups


@dataclass
class _Seen:
    value: bytes
    changed_at: float


@dataclass(eq=False)
class LiveWatch:
    """One member's heartbeat thread (Note [Live watch]); build it with :meth:`start`."""

    store: object
    member: int
    watched: Callable[[], list[int]]
    """The members to watch now (called from the thread; must be cheap and thread-safe)."""
    on_dead: Callable[[set[int]], None]
    """Called from the thread with every watched member known dead, after each beat that found one."""
    freeze_s: float
    beat_s: float
    on_self_dead: Callable[[int, str], None] = _exit_declared_dead
    dead: set[int] = field(default_factory=set)
    """Members seen dead so far (declared by anyone); read by other threads."""
    _seen: dict[int, _Seen] = field(default_factory=dict)
    _seq: int = 0
    _last_look: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def start(cls, store, *, member: int, watched: Callable[[], list[int]], freeze_s: float,
              on_dead: Callable[[set[int]], None], beat_s: float | None = None) -> LiveWatch:
        """Publish the first beat and start the thread (``freeze_s`` <= 0: beats only, no verdicts)."""
        beat = beat_s if beat_s is not None else max(0.05, min(1.0, freeze_s / 8 if freeze_s > 0 else 1.0))
        watch = cls(store=store, member=member, watched=watched, on_dead=on_dead, freeze_s=freeze_s,
                    beat_s=beat)
        watch._beat()
        # daemon only so that a process ending by SystemExit is not held up; close() joins it
        watch._thread = threading.Thread(target=watch._loop, name=f"varuna-live-watch-{member}", daemon=True)
        watch._thread.start()
        # A process that ends without close() (an uncaught error, a script that forgot it) must
        # not finalise the interpreter with this thread inside a store call: that aborts the
        # process ("terminate called without an active exception", exit -6).
        atexit.register(watch.close)
        return watch

    def alive(self, member: int) -> bool:
        """Did ``member``'s beat change within ``freeze_s`` (as this thread last saw it)?"""
        seen = self._seen.get(member)
        if seen is None or seen.value.endswith(b" exit") or member in self.dead:
            return False
        return self.freeze_s <= 0 or time.monotonic() - seen.changed_at <= self.freeze_s

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop and join the thread, then beat ``exit`` (nobody declares this member frozen)."""
        if self._stop.is_set():
            return
        self._stop.set()
        atexit.unregister(self.close)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        try:
            self._beat(exited=True)
        except Exception:  # the supervisor's store is gone: nobody is left to watch us
            pass

    # ------------------------------------------------------------------ the thread

    def _beat(self, exited: bool = False) -> None:
        self._seq += 1
        value = f"{self._seq} {os.getpid()}" + (" exit" if exited else "")
        self.store.set(f"{_KEYS}beat/{self.member}", value)

    def _loop(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self._beat()
                self._check_self()
                dead = self._look()
            except Exception:  # the store is unreachable for a moment: the next beat tries again
                continue
            if dead and not self._stop.is_set():
                self.on_dead(dead)

    def _check_self(self) -> None:
        key = f"{_KEYS}dead/{self.member}"
        if self.store.check([key]) and not self._stop.is_set():
            why_key = f"{_KEYS}dead_why/{self.member}"
            why = (self.store.get(why_key).decode() if self.store.check([why_key])
                   else "its process was seen to exit")
            self.on_self_dead(self.member, why)

    def _look(self) -> set[int]:
        """Read the watched members' beats and dead keys; declare the frozen ones dead."""
        store, now = self.store, time.monotonic()
        if self._last_look is not None and now - self._last_look > 2 * self.beat_s + 1.0:
            # This thread itself got no CPU for a while (a starved host): the others may have been
            # starved as well and not beaten yet. It cannot judge: everyone starts afresh.
            for seen in self._seen.values():
                seen.changed_at = now
        self._last_look = now
        watched = [m for m in self.watched() if m != self.member]
        dead = {m for m in watched if store.check([f"{_KEYS}dead/{m}"])}
        keys = [f"{_KEYS}beat/{m}" for m in watched]
        if keys and store.check(keys):  # every member beats already: one round trip for all
            values = dict(zip(watched, store.multi_get(keys)))
        else:
            values = {m: store.get(k) if store.check([k]) else b"" for m, k in zip(watched, keys)}
        for m in watched:
            value = values[m]
            seen = self._seen.get(m)
            if seen is None or seen.value != value:
                self._seen[m] = _Seen(value, now)
        if self.freeze_s > 0:
            for m in watched:
                seen = self._seen[m]
                # No beat yet: still starting (imports, a busy host) -- a process that never runs
                # is the supervisor's to declare (its exit) or the rendezvous' to time out.
                if m in dead or not seen.value or seen.value.endswith(b" exit"):
                    continue
                if now - seen.changed_at <= self.freeze_s:
                    continue
                silent = now - seen.changed_at
                why = f"no heartbeat for {silent:.0f}s, seen by member {self.member}: frozen or hung"
                store.compare_set(f"{_KEYS}dead_why/{m}", "", why)
                store.set(f"{_KEYS}dead/{m}", "1")
                print(f"varuna: member {self.member}: declaring member {m} dead ({why})",
                      file=sys.stderr, flush=True)
                dead.add(m)
        self.dead = self.dead | dead  # a new set: other threads iterate the old one unlocked
        return dead
