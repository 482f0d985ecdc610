"""The reachability probe (manager/common/reachability.py, Note [Reachability probe]): real sockets
for the answered cases, an injected connect for silence (no root, no address that drops SYNs)."""

from __future__ import annotations

import errno
import socket
import threading

import pytest

from manager.common.reachability import ANSWERED, SILENT, UNKNOWN, Prober


def _finished(prober: Prober, address: str, port: int):
    prober.close()  # joins the connect in flight: the result is there afterwards
    return prober.result(address, port)


def test_a_listening_port_answers():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        prober = Prober(timeout_s=2.0)
        assert prober.probe("127.0.0.1", port)
        result = _finished(prober, "127.0.0.1", port)
    assert (result.outcome, result.detail) == (ANSWERED, "connected")


def test_a_closed_port_answers_with_a_reset():
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        prober = Prober(timeout_s=2.0)
        prober.probe("127.0.0.1", port)
        result = _finished(prober, "127.0.0.1", port)
    assert (result.outcome, result.detail) == (ANSWERED, "refused")


@pytest.mark.parametrize(
    ("error", "outcome", "detail"),
    [
        (TimeoutError("timed out"), SILENT, "timed out after 0.5 s"),
        (OSError(errno.ENETUNREACH, "Network is unreachable"), SILENT, "network is unreachable"),
        (OSError(errno.EHOSTUNREACH, "No route to host"), SILENT, "no route to host"),
        # Negative control: an error that says nothing about the host is no evidence of silence.
        (OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"), UNKNOWN, None),
        (socket.gaierror(-2, "Name or service not known"), UNKNOWN, None),
    ],
)
def test_silence_and_what_is_not_evidence_of_it(error, outcome, detail):
    calls = []

    def connect(address, port, timeout_s):
        calls.append((address, port, timeout_s))
        raise error

    prober = Prober(timeout_s=0.5, clock=lambda: 42.0, connect=connect)
    prober.probe("10.9.9.9", 1234)
    result = _finished(prober, "10.9.9.9", 1234)
    assert calls == [("10.9.9.9", 1234, 0.5)]
    assert result.outcome == outcome and result.started == 42.0
    if detail is not None:
        assert result.detail == detail


def test_one_connect_per_target_at_a_time():
    release = threading.Event()
    entered = threading.Event()
    calls = []

    def connect(address, port, timeout_s):
        calls.append(port)
        entered.set()
        assert release.wait(10)
        raise TimeoutError

    prober = Prober(timeout_s=1.0, connect=connect)
    assert prober.probe("h", 1)
    assert entered.wait(10)
    assert prober.in_flight("h", 1)
    assert not prober.probe("h", 1)  # the one in flight answers for it
    assert prober.result("h", 1) is None
    release.set()
    prober.close()
    assert calls == [1] and prober.result("h", 1).outcome == SILENT
    assert not prober.probe("h", 1)  # closed: no new probe


def test_a_bad_timeout_is_refused_in_one_line():
    with pytest.raises(ValueError, match="probe timeout must be positive"):
        Prober(timeout_s=0)
