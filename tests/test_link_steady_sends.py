"""Note [Steady-state sends] in profiler/network.py: the round plan, the send and acknowledge
halves of a paced link session, and ``wire_bytes``, against analytic values.

The link here is a fake with a fake clock: its sender applies the engine's wire rule (Note [One
send per message] in varuna/runtime/comm.py, written out again below as the reference: a larger
or much smaller message is preceded by a resize message of the old size, one between half the old
size and the old size goes padded to it) and each send costs ``LATENCY_S + bytes / BANDWIDTH``.
A steady-state send of a message therefore costs exactly ``LATENCY_S + wire_bytes / BANDWIDTH``;
the negative controls show that timing first sends, or dropping the resets, reads other values.
The real links are measured by tests/test_profile_hosts.py and tests/test_profiler.py.
"""

from __future__ import annotations

import itertools
import queue

import pytest
import torch

from profiler.network import MessageSpec, _ack_rounds, _round_plan, _send_rounds, _tensors, wire_bytes
from varuna.runtime.comm import pack_message

LATENCY_S = 1e-3
BANDWIDTH = 12.5e6  # bytes/s: 100 Mbit/s
HEADER = 512


def _msg(nbytes: int) -> MessageSpec:
    return [((nbytes // 4,), "float32")]


class FakeLink:
    """A sender whose sends complete at once on a fake clock, each acknowledged in ``inbox``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.expects = HEADER  # what the receiver posts next, as LinkSender tracks it
        self.inbox: queue.Queue = queue.Queue()
        self.cost_at: dict[float, float] = {}  # start time of a send -> its cost (s)
        self.sent: list[int] = []  # message bytes of every send (resize messages excluded)

    def clock(self) -> float:
        return self.now

    def send(self, microbatch: int, tensors: tuple[torch.Tensor, ...]) -> None:
        need = pack_message(microbatch, tensors, torch.device("cpu")).numel()
        if self.expects // 2 <= need <= self.expects:
            on_wire = msg = self.expects  # padded to the size the receiver expects
        else:
            on_wire, msg = self.expects + need, need  # a resize message of the old size first
        cost = LATENCY_S + on_wire / BANDWIDTH
        self.cost_at[self.now] = cost
        self.sent.append(msg)
        self.expects = msg
        self.now += cost
        self.inbox.put("ack")


def _timed_costs(msgs: list[MessageSpec], plan) -> tuple[FakeLink, list[list[float]]]:
    link = FakeLink()
    times = _send_rounds(link, link.inbox, [_tensors(m) for m in msgs], plan, 1.0, link.clock)
    return link, [[link.cost_at[t] for t in per_msg] for per_msg in times]


def _steady_s(msg: MessageSpec) -> float:
    return LATENCY_S + wire_bytes(msg) / BANDWIDTH


# -- wire_bytes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("msg", "expected"),
    [
        ([], HEADER),  # a gradient message without floating-point tensors: the header alone
        ([((1024,), "float32")], HEADER + 4096),
        ([((2, 3), "float32"), ((4,), "int64")], 640),  # 512+24 -> 576 (aligned), +32 -> 640
        ([((3,), "bfloat16")], HEADER + 64),  # 6 bytes, padded to the 64-byte alignment
        ([((2, 32, 64), "float32"), ((2, 32), "int64")], HEADER + 16384 + 512),
    ],
)
def test_wire_bytes_is_the_header_plus_aligned_payloads(msg, expected):
    assert wire_bytes(msg) == expected
    # ... which is what the engine packs (an independent reference: the real message).
    assert pack_message(0, _tensors(msg), torch.device("cpu")).numel() == expected


# -- the round plan ------------------------------------------------------------------------------


def test_round_plan_ascends_sends_twice_times_the_last_and_resets_once_per_round():
    plan = _round_plan([5000, 1000, 3000], rounds=3, round_sends=2)
    one_round = [(1, False), (1, True), (2, False), (2, True), (0, False), (0, True)]
    assert plan == one_round + [(None, False)] + one_round + [(None, False)] + one_round


def test_round_plan_keeps_ties_in_order_and_needs_no_reset_for_one_size():
    assert _round_plan([700, 700], rounds=2, round_sends=3) == [
        (0, False), (0, False), (0, True), (1, False), (1, False), (1, True)
    ] * 2


@pytest.mark.parametrize(("rounds", "round_sends", "word"), [(2, 1, "round_sends"), (0, 2, "rounds")])
def test_round_plan_refuses_counts_that_time_no_steady_send(rounds, round_sends, word):
    with pytest.raises(ValueError, match=f"{word} must be >= "):
        _round_plan([100], rounds=rounds, round_sends=round_sends)


# -- the send half, on the fake link -------------------------------------------------------------


def test_every_timed_send_costs_its_steady_state_wire_time():
    # The profiler's real mix: a cut-point's 16 KiB activation, then the sweep up to 4 MiB.
    msgs = [_msg(16 << 10), _msg(1 << 10), _msg(64 << 10), _msg(1 << 20), _msg(4 << 20)]
    _, costs = _timed_costs(msgs, _round_plan([wire_bytes(m) for m in msgs], 4, 2))
    for msg, per_round in zip(msgs, costs):
        assert per_round == pytest.approx([_steady_s(msg)] * 4, rel=1e-12)


def test_negative_control_timing_first_sends_in_the_given_order_pays_resizes():
    # The old session: rounds over the sizes as given, every send timed.
    msgs = [_msg(16 << 10), _msg(1 << 10), _msg(64 << 10), _msg(1 << 20), _msg(4 << 20)]
    naive = [(j, True) for _ in range(3) for j in range(len(msgs))]
    _, costs = _timed_costs(msgs, naive)
    # The 16 KiB point of round 2 pays the 4 MiB resize of round 1's last message ...
    assert costs[0][1] == pytest.approx(_steady_s(msgs[0]) + wire_bytes(msgs[4]) / BANDWIDTH)
    # ... and the 4 MiB one the 1 MiB resize before it (0.44 s against 0.34 s at 100 Mbit/s).
    assert costs[4][1] == pytest.approx(_steady_s(msgs[4]) + wire_bytes(msgs[3]) / BANDWIDTH)
    assert costs[4][1] / _steady_s(msgs[4]) > 1.2


def test_a_size_within_half_of_the_last_is_sent_unpadded_thanks_to_the_reset():
    msgs = [_msg(4000), _msg(3000)]  # 3000 is within half of 4000: it would go padded
    plan = _round_plan([wire_bytes(m) for m in msgs], 3, 2)
    link, costs = _timed_costs(msgs, plan)
    assert costs[1] == pytest.approx([_steady_s(msgs[1])] * 3, rel=1e-12)
    assert link.sent.count(HEADER) == 2  # one reset per round after the first
    # Negative control: without the resets, rounds 2 and 3 time 3000 bytes padded to 4000.
    _, costs = _timed_costs(msgs, [s for s in plan if s[0] is not None])
    assert costs[1][0] == pytest.approx(_steady_s(msgs[1]))
    assert costs[1][1:] == pytest.approx([_steady_s(msgs[0])] * 2)


# -- the acknowledge half ------------------------------------------------------------------------


class AckSink:
    def __init__(self) -> None:
        self.acks: list[tuple[int, int]] = []  # (step, tensors)

    def send(self, microbatch: int, tensors: tuple[torch.Tensor, ...]) -> None:
        self.acks.append((microbatch, len(tensors)))


def test_the_receiver_acknowledges_every_step_and_keeps_the_timed_arrivals():
    plan = _round_plan([300, 100, 200], rounds=2, round_sends=2)
    inbox: queue.Queue = queue.Queue()
    for _ in plan:
        inbox.put("arrival")
    sink, ticks = AckSink(), itertools.count()
    out = _ack_rounds(sink, inbox, 3, plan, 1.0, lambda: float(next(ticks)))
    assert sink.acks == [(step, 0) for step in range(len(plan))]  # header-only acks, one per step
    assert inbox.empty()
    # The clock ticks once per step: the timed arrivals are the steps marked timed.
    assert out == [[float(i) for i, (j, timed) in enumerate(plan) if j == k and timed] for k in range(3)]
    assert [len(t) for t in out] == [2, 2, 2]


def test_a_missing_acknowledgement_is_a_timeout_naming_the_peer():
    plan = _round_plan([100], rounds=1, round_sends=2)
    inbox: queue.Queue = queue.Queue()
    inbox.put("arrival")  # one of two
    with pytest.raises(TimeoutError, match="no message from the peer"):
        _ack_rounds(AckSink(), inbox, 1, plan, 0.01)
