"""One line per kind of trouble, at most once per interval: the daemon's log stays readable
when a client repeats the same bad request thousands of times a second.

Note [Rate-limited lines]: the manager answers hostile or broken input (a malformed dashboard
request, a heartbeat from outside a generation, a row the state file refuses, a descriptor
shortage at ``accept``) with one line on stderr, never a traceback. A flood of the same input
must not become a flood of lines (issue 35: 38 MB of asyncio log in 25 s), so each kind of
line has a key; the first one of a key is written at once, repeats within ``interval_s`` are
counted, and the next line of that key says how many were left out. Keys are few (a kind of
problem, a job), and the table is bounded anyway (oldest keys dropped).

    >>> out = []
    >>> log = RateLimitedLines(interval_s=60.0, clock=lambda: 0.0, write=out.append)
    >>> log.line("bad-request", "varuna-manager: dashboard: bad request from 10.0.0.9")
    True
    >>> log.line("bad-request", "varuna-manager: dashboard: bad request from 10.0.0.9")
    False
    >>> log.clock = lambda: 61.0
    >>> log.line("bad-request", "varuna-manager: dashboard: bad request from 10.0.0.7")
    True
    >>> out[-1]
    'varuna-manager: dashboard: bad request from 10.0.0.7 (and 1 more like it in the last 61 s)'
"""

from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["RateLimitedLines", "stderr_line"]

#: Most keys remembered (the oldest is forgotten first: its next line is written at once).
MAX_KEYS = 1024


def stderr_line(text: str) -> None:
    """Write one line to stderr (flushed: the daemon's log is often a pipe)."""
    print(text, file=sys.stderr, flush=True)


class RateLimitedLines:
    """Lines by key, each key at most once per ``interval_s`` (Note [Rate-limited lines]).
    Thread-safe.

    Example::

        log = RateLimitedLines()
        log.line(("foreign-vm", job_id), f"varuna-manager: job {job_id}: heartbeat from ... ignored")
    """

    def __init__(
        self,
        interval_s: float = 60.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        write: Callable[[str], None] = stderr_line,
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.write = write
        self._lock = threading.Lock()
        # key -> (when its last line was written, repeats left out since)
        self._seen: OrderedDict[object, tuple[float, int]] = OrderedDict()

    def line(self, key: object, text: str) -> bool:
        """Write ``text`` (one line: only its first line is kept) unless a line of ``key`` was
        written less than ``interval_s`` ago; whether it was written."""
        now = self.clock()
        with self._lock:
            last = self._seen.get(key)
            if last is not None and now - last[0] < self.interval_s:
                self._seen[key] = (last[0], last[1] + 1)
                return False
            skipped = last[1] if last is not None else 0
            self._seen[key] = (now, 0)
            self._seen.move_to_end(key)
            while len(self._seen) > MAX_KEYS:
                self._seen.popitem(last=False)
        first = text.splitlines()[0] if text else ""
        if skipped:
            first += f" (and {skipped} more like it in the last {now - last[0]:.0f} s)"  # type: ignore[index]
        self.write(first)
        return True
