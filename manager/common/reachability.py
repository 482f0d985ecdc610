"""Whether a host is there at all: one TCP connect, in the background, read later.

Note [Reachability probe]: a host's *kernel* answers a TCP SYN (it accepts, or resets a closed
port) even when the process that should talk to us is starved, stopped or swapping, or the
machine is loaded; a *silent* host (its link down, a partition, an evicted VM) answers nothing:
the connect times out, or fails at once with ENETUNREACH/EHOSTUNREACH/EHOSTDOWN. So "no
heartbeat for a while AND no answer to a connect within the probe timeout" means silence, and
load alone never makes it true. Both ends of the manager's link use this rule: the manager
probes a quiet VM (manager/domain/silence.py), an agent probes a manager that stopped answering
(Note [Fencing under the manager] in manager/agent/vm_agent.py).

What it cannot tell: a host whose firewall DROPs SYNs to closed ports looks silent while alive
(the manager therefore trusts a VM's probes only after one of them answered), and a listening
port whose accept backlog is full drops SYNs too (a connect to it then times out).

A :class:`Prober` runs at most one connect per target at a time on its own threads, each
bounded by ``timeout_s``; :meth:`Prober.probe` never blocks, :meth:`Prober.result` reads the
latest finished one.

    >>> import socket
    >>> listener = socket.create_server(("127.0.0.1", 0))
    >>> prober = Prober(timeout_s=1.0)
    >>> prober.probe("127.0.0.1", listener.getsockname()[1])
    True
    >>> prober.close()   # waits for the connect in flight (at most timeout_s)
    >>> prober.result("127.0.0.1", listener.getsockname()[1]).outcome
    'answered'
    >>> listener.close()
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

__all__ = ["ANSWERED", "SILENT", "SILENT_ERRNOS", "UNKNOWN", "ProbeResult", "Prober", "classify",
           "silent_since"]

#: The host's kernel answered (a connection, or a reset of a closed port): the host is there.
ANSWERED = "answered"
#: Nothing answered within the timeout, or the network says the host cannot be reached.
SILENT = "silent"
#: The probe could not tell (a bad address, no free local port...): never evidence of silence.
UNKNOWN = "unknown"

#: Errors that mean "no way to that host right now" (as good as a timeout, only faster).
SILENT_ERRNOS = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EHOSTDOWN})

#: Results kept (the latest per target); a VM reports a new free port every heartbeat.
MAX_RESULTS = 4096


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """One finished probe."""

    outcome: str
    """:data:`ANSWERED`, :data:`SILENT` or :data:`UNKNOWN`."""
    started: float
    """When the connect began, on the prober's clock."""
    elapsed_s: float
    detail: str
    """For people: ``connected``, ``refused``, ``timed out after 1 s``, ``network is unreachable``."""


def classify(connect: Callable[[], object], timeout_s: float) -> tuple[str, str]:
    """``(outcome, detail)`` of one connect attempt (``connect()`` returns a socket or raises).

    >>> def refused(): raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")
    >>> def cut_off(): raise OSError(errno.EHOSTUNREACH, "No route to host")
    >>> classify(refused, 1.0), classify(cut_off, 1.0)
    (('answered', 'refused'), ('silent', 'no route to host'))
    """
    try:
        sock = connect()
    except ConnectionRefusedError:
        return ANSWERED, "refused"
    except TimeoutError:  # socket.timeout is TimeoutError since Python 3.10
        return SILENT, f"timed out after {timeout_s:g} s"
    except OSError as exc:
        if exc.errno in SILENT_ERRNOS:
            return SILENT, (exc.strerror or errno.errorcode.get(exc.errno or 0, "unreachable")).lower()
        return UNKNOWN, f"{type(exc).__name__}: {exc}"
    close = getattr(sock, "close", None)
    if close is not None:
        close()
    return ANSWERED, "connected"


class Prober:
    """Background TCP probes (Note [Reachability probe]). ``clock`` stamps results (the
    caller's clock: ``time.time`` for the manager, ``time.monotonic`` for an agent, a test's fake);
    ``connect(address, port, timeout_s)`` opens a socket (``socket.create_connection``; tests
    inject a fake that raises ``TimeoutError``).

    Example::

        prober = Prober(timeout_s=1.0)
        prober.probe("10.0.0.7", 41234)          # returns at once
        ...                                      # later, e.g. on the next tick
        result = prober.result("10.0.0.7", 41234)  # None until it finished
        prober.close()
    """

    def __init__(
        self,
        *,
        timeout_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        connect: Callable[[str, int, float], object] | None = None,
        max_workers: int = 8,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"probe timeout must be positive, got {timeout_s:g} s")
        self.timeout_s = timeout_s
        self._clock = clock
        self._connect = connect or (lambda a, p, t: socket.create_connection((a, p), timeout=t))
        self._lock = threading.Lock()
        self._in_flight: set[tuple[str, int]] = set()
        self._results: OrderedDict[tuple[str, int], ProbeResult] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reachability")
        self._closed = False

    def probe(self, address: str, port: int) -> bool:
        """Start a connect to ``address:port`` unless one is in flight (or the prober is closed);
        True when one was started. Never blocks."""
        target = (address, int(port))
        with self._lock:
            if self._closed or target in self._in_flight:
                return False
            self._in_flight.add(target)
        self._pool.submit(self._run, target)
        return True

    def result(self, address: str, port: int) -> ProbeResult | None:
        """The latest finished probe of ``address:port``; None when none finished."""
        with self._lock:
            return self._results.get((address, int(port)))

    def in_flight(self, address: str, port: int) -> bool:
        """Whether a probe of ``address:port`` is running now."""
        with self._lock:
            return (address, int(port)) in self._in_flight

    def close(self) -> None:
        """Refuse new probes and wait for those in flight (each ends within ``timeout_s``)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, target: tuple[str, int]) -> None:
        started = self._clock()
        t0 = time.monotonic()
        try:
            outcome, detail = classify(lambda: self._connect(target[0], target[1], self.timeout_s),
                                       self.timeout_s)
        except Exception as exc:  # a fake or a resolver failing oddly: no evidence either way
            outcome, detail = UNKNOWN, f"{type(exc).__name__}: {exc}"
        result = ProbeResult(outcome=outcome, started=started, elapsed_s=time.monotonic() - t0, detail=detail)
        with self._lock:
            self._in_flight.discard(target)
            self._results[target] = result
            self._results.move_to_end(target)
            while len(self._results) > MAX_RESULTS:
                self._results.popitem(last=False)


def silent_since(reach: Any, address: str, port: int, *, since: float, now: float,
                 timeout_s: float) -> tuple[ProbeResult | None, bool]:
    """The rule both ends of the manager's link share: ``(result, started)`` where ``result`` is
    the latest probe of ``address:port`` when it began after ``since`` (the last sign of life) and
    found the host silent, else None; ``started``: whether a new probe was started because none
    began after ``since`` or the latest answer is older than ``timeout_s`` (the host may have gone
    silent since). ``reach``: a :class:`Prober` or anything with its ``probe`` and ``result``."""
    result = reach.result(address, port)
    fresh = result is not None and result.started >= since
    if fresh and result is not None and result.outcome == SILENT:
        return result, False
    if not fresh or result is None or (result.outcome == ANSWERED and now - result.started > timeout_s):
        return None, bool(reach.probe(address, port))
    return None, False
