"""The thread-less LinkSender's bookkeeping: reaping, bounded waits, clear errors.

The sends themselves are exercised by every multi-process engine test; here the requests are
stand-ins with the two methods the sender uses (``is_completed``, ``wait``), so the timeouts can
be checked without a peer.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

from varuna.comm import LinkSender


class _Work:
    """A send request that completes when ``done`` is set (or fails with ``error``)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.done = threading.Event()
        self.error = error

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("Timed out waiting for send operation to complete")
        if self.error is not None:
            raise self.error
        return True


def _sender(timeout_s: float) -> LinkSender:
    return LinkSender("act-send-0", 1, None, torch.device("cpu"), None, timeout_s)


def _issue(sender: LinkSender, work: _Work, age_s: float = 0.0) -> None:
    sender._pending.append(([work], None, [], time.monotonic() - age_s))


def test_completed_sends_are_reaped_in_order_and_a_failed_one_raises():
    s = _sender(5.0)
    a, b, c = _Work(), _Work(), _Work(error=RuntimeError("connection reset"))
    for w in (a, b, c):
        _issue(s, w)
    b.done.set()
    s._reap()
    assert len(s._pending) == 3  # FIFO: b waits behind the unfinished a
    a.done.set()
    s._reap()
    assert len(s._pending) == 1
    c.done.set()
    with pytest.raises(RuntimeError, match="connection reset"):
        s._reap()


def test_flush_gives_up_after_the_timeout_with_one_clear_line():
    s = _sender(0.2)
    _issue(s, _Work())
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"act-send-0: a send to rank 1 did not complete within 0.2s"):
        s.flush()
    assert time.monotonic() - t0 < 2.0
    # A send already older than the timeout is reported at the next send's reap, not waited on.
    _issue(s, _Work(), age_s=1.0)
    with pytest.raises(RuntimeError, match="peer is stuck or gone"):
        s._reap()


def test_close_waits_for_outstanding_sends_but_is_bounded():
    s = _sender(300.0)
    finished = _Work()
    threading.Timer(0.05, finished.done.set).start()
    _issue(s, finished)
    s.close(timeout_s=5.0)
    assert finished.is_completed() and not s._pending  # it waited for the send to finish
    # Negative control: a send that never completes holds close() up only for its bound.
    _issue(s, _Work())
    t0 = time.monotonic()
    s.close(timeout_s=0.2)
    assert time.monotonic() - t0 < 2.0 and not s._pending
