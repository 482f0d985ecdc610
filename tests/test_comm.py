"""Point-to-point links: the thread-less LinkSender's bookkeeping (reaping, bounded waits,
clear errors) and the wire format (one contiguous message, Note [One send per message]).

For the bookkeeping the requests are stand-ins with the two methods the sender uses
(``is_completed``, ``wait``), so the timeouts can be checked without a peer; the wire format is
checked in-process and between two real gloo ranks.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch
from distributed import ROOT, check_ok, run_world

from varuna.runtime.comm import HEADER_BYTES, LinkSender, pack_message, unpack_message


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
    sender._pending.append(([work], (), time.monotonic() - age_s))


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


# -- wire format: one contiguous message per (micro-batch, tensors) ---------------------------


def test_pack_unpack_round_trip_keeps_dtype_shape_and_bits():
    tensors = (
        torch.randn(3, 5),
        torch.arange(7),
        torch.tensor([True, False]),
        torch.randn(()).to(torch.bfloat16),
        torch.empty(0, 4),
        torch.randn(4, 6).t(),  # not contiguous
    )
    msg = pack_message(11, tensors, torch.device("cpu"))
    assert msg.dtype == torch.uint8 and msg.dim() == 1
    mb, out = unpack_message(msg)
    assert mb == 11 and len(out) == len(tensors)
    for x, y in zip(out, tensors):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        assert x.data_ptr() % 64 == 0
    with pytest.raises(ValueError, match="at most 6"):
        pack_message(0, tuple(torch.zeros(1) for _ in range(7)), torch.device("cpu"))


def test_padded_messages_unpack_and_short_or_corrupt_ones_are_rejected():
    x = torch.randn(4, 16)
    msg = pack_message(0, (x,), torch.device("cpu"))
    padded = pack_message(0, (x,), torch.device("cpu"), size=msg.numel() + 256)
    assert padded.numel() == msg.numel() + 256 and not padded[msg.numel():].any()  # zeroed padding
    assert torch.equal(unpack_message(padded)[1][0], x)
    with pytest.raises(RuntimeError, match="disagree on the wire format"):
        unpack_message(msg[:-64].clone())
    with pytest.raises(RuntimeError, match="corrupt message header"):
        unpack_message(torch.zeros_like(msg))
    bad = msg.clone()
    bad[:HEADER_BYTES].view(torch.int64)[4] = -1  # dtype code of the first tensor
    with pytest.raises(RuntimeError, match="dtype code -1"):
        unpack_message(bad)


@pytest.mark.slow
def test_two_ranks_exchange_changing_shapes_with_one_send_per_steady_message():
    results = run_world(ROOT / "tests" / "workers" / "comm_worker.py", 2, [], timeout_s=120)
    check_ok(results)
    out = {}
    for r in results:
        line = json.loads(r.stdout.strip().splitlines()[-1])
        out[line["rank"]] = line
    assert out[1]["received"] == list(range(13))
    # One send per message, plus a resize announcement where the receive size must change: the
    # first message (the receiver starts at a bare header), the larger mixed one (6), the large
    # one (10) and the one under half of it (11). Smaller ones go padded: the short micro-batch
    # (4), the empty message (7); (8, 8) has the (4, 16) size anyway.
    assert out[0]["sends"] == [2, 1, 1, 1, 1, 1, 2, 1, 1, 1, 2, 2, 1]
