"""Point-to-point and all-reduce measurements over the runtime's own communication path.

**Point-to-point** (Act/Grad, intra/inter): two ranks ``a`` (the earlier stage) and ``b`` (the
later one) set up exactly what two neighbouring stages of the engine own — per direction a
two-rank process group, a :class:`varuna.runtime.comm.LinkSender` on the sending side and a
:class:`varuna.runtime.comm.LinkReceiver` thread on the receiving side — and send messages in the
engine's wire format (one contiguous message: an int64 header, then the payload). The time of a
message is from the sender's ``send()`` call (the compute loop handing it off) to the moment the
receiver's main thread takes the arrival from its inbox: what a stage waiting for its input sees.
Messages are paced (the receiver acknowledges each one on the reverse link before the next is
sent), so none waits behind another. Activations go a → b, gradients b → a. Each round sends a
message ``round_sends`` times and times only the last send (Note [Steady-state sends]).

Note [Steady-state sends]: a stage sends the same shapes every micro-batch, so what the simulator
needs is the time of a send on a link that already carries that size, not of the first one. The
first send of a new size is not that: the link remembers the size of its last message (Note [One
send per message] in varuna/runtime/comm.py), so a larger message is preceded by a *resize*
message of the old size, and one between half the old size and the old size goes padded to it.
Measured on 100 Mbit/s ``tbf`` links, timing every first send read the bandwidth 23 % low: the
4 MiB point paid a 1 MiB resize before it (0.44 s against 0.34 s at the cap), a 16 KiB point the
4 MiB resize of the round's previous size (0.35 s). Hence, per round (:func:`_round_plan`):

- messages go in ascending wire size (:func:`wire_bytes`: payload + header + alignment, what
  ``LinkSender`` puts on the wire), so within a round every new size is larger than the last;
- the link is *reset* between message sizes whenever the next one is smaller than what the link
  last carried (with ascending sizes: once per round, before its smallest message): a
  header-only message, so the next size is announced afresh and never padded to a larger one;
- each message is sent ``round_sends >= 2`` times back to back (each acknowledged) and only the
  LAST send is timed: the earlier ones absorb the resize, the ``tbf`` bucket's state after
  the previous size and TCP's window growth for the new size (steady state).

The untimed sends cost link time, not accuracy: about ``round_sends`` times the bytes of the
timed ones. The remaining gap to a ``tbf`` cap is TCP/IP framing, which the cap counts and the
payload does not (docs/profiling.md, "Calibrating real links").

Clocks: the profiler's processes all run on one machine (hosts are emulated), whose
``CLOCK_MONOTONIC`` (``time.perf_counter``) is shared by every process and network namespace, so
one-way times are read directly. For processes on different machines, :func:`link_stats` can
instead relate the clocks NTP-style from the ping-pongs that open every session,
``offset = ((t1 - t0) + (t2 - t3)) / 2`` (t0/t3 on a's clock, t1/t2 on b's) from the ping with the
shortest round trip; on one busy machine that estimate is worse than none (measured: ±2 ms, as a
single descheduled ping skews it), hence the default.

**All-reduce**: each ring runs the engine's gradient sync (``varuna.runtime.grad_sync.allreduce_bucketed``:
``dist.all_reduce`` of flat 32 MiB buckets) on a buffer of the measured size; rings of one
configuration start together after a barrier over all of them, so ``concurrent`` all-reduces share
each host. A ring's time for a repetition is the slowest member's.

Note [Interleaved rounds]: rounds go over all sizes in turn (size 1, 2, ..., n, then again),
not all rounds of one size and then the next. A disturbance (another process taking the core for
a few ms, a slow first use of a connection) then spreads over all sizes instead of skewing one,
which would bend the latency/bandwidth fit.

Worker side: :func:`link_session` (its two halves :func:`_send_rounds` and :func:`_ack_rounds`),
:func:`allreduce_session` (called by :mod:`profiler.worker`, they return raw timestamps). Parent
side: :func:`link_stats`, :func:`allreduce_times` reduce them.

Example (parent side, on hand-made timestamps: a 2 ms one-way delay and b's clock 5 s ahead)::

    >>> a = {"ping_t0": [0.0], "ping_t3": [0.004], "act_send_t": [[0.0, 1.0]],
    ...      "grad_recv_t": [[7.0 - 5 + 0.002]]}
    >>> b = {"ping_t1": [5.002], "ping_t2": [5.002], "act_recv_t": [[5.002, 6.002]], "grad_send_t": [[7.0]]}
    >>> act, grad = link_stats(a, b, warmup=0, same_clock=False)
    >>> [round(x * 1e3, 3) for x in act[0]], [round(x * 1e3, 3) for x in grad[0]]
    ([2.0, 2.0], [2.0])
"""

from __future__ import annotations

import math
import queue
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from varuna.runtime.comm import Arrival, LinkReceiver, LinkSender, message_layout

__all__ = [
    "MessageSpec",
    "link_session",
    "allreduce_session",
    "link_stats",
    "allreduce_times",
    "mean_std",
    "payload_bytes",
    "wire_bytes",
    "ROUND_SENDS",
]

#: One message: the (shape, dtype name) of each tensor it carries.
MessageSpec = list[tuple[tuple[int, ...], str]]

_TINY: tuple[torch.Tensor, ...] = ()  # pings, acks, resets: a header only (the engine never sends less)

ROUND_SENDS = 2
"""Sends of each message per round; only the last is timed (Note [Steady-state sends])."""

#: One step of a round: the index of the message sent (None: a header-only reset) and whether
#: this send is timed.
Step = tuple[int | None, bool]


def payload_bytes(msg: MessageSpec) -> int:
    """Bytes of the tensors of ``msg`` (the header's 512 bytes are not counted).

    >>> payload_bytes([((2, 3), "float32"), ((4,), "int64")])
    56
    """
    return sum(
        math.prod(shape) * torch.empty((), dtype=getattr(torch, dt)).element_size() for shape, dt in msg
    )


def wire_bytes(msg: MessageSpec) -> int:
    """Bytes of ``msg`` as ``LinkSender`` sends it on a link already carrying that size: the 512-byte
    header, then each tensor at a 64-byte aligned offset (``varuna.runtime.comm.message_layout``).

    >>> wire_bytes([((2, 3), "float32"), ((4,), "int64")])  # 512 + 24 -> 576, + 32 -> 640
    640
    """
    return message_layout([(getattr(torch, dt), tuple(shape)) for shape, dt in msg])[1]


def _round_plan(sizes: Sequence[int], rounds: int, round_sends: int) -> list[Step]:
    """Every send of a paced session, in order (Note [Steady-state sends]): per round, the messages
    in ascending ``sizes`` (wire bytes; ties keep their order), each ``round_sends`` times with the
    last one timed, and a reset before a message smaller than the link's last one. Both ends of a
    link compute the same plan from the same message list.

    >>> plan = _round_plan([300, 100], rounds=2, round_sends=2)
    >>> plan[:4]  # round 0: 100 bytes, then 300; two sends each, the second timed
    [(1, False), (1, True), (0, False), (0, True)]
    >>> plan[4:]  # round 1 starts with a reset (300 -> 100)
    [(None, False), (1, False), (1, True), (0, False), (0, True)]
    """
    if round_sends < 2:
        raise ValueError(f"round_sends must be >= 2 (the last send of a round is timed), got {round_sends}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    order = sorted(range(len(sizes)), key=lambda j: sizes[j])
    steps: list[Step] = []
    carried = 0  # the link's last message size; pings and acks leave it at the header (smallest)
    for _ in range(rounds):  # Note [Interleaved rounds]
        for j in order:
            if sizes[j] < carried:
                steps.append((None, False))
            steps.extend((j, k == round_sends - 1) for k in range(round_sends))
            carried = sizes[j]
    return steps


def _send_rounds(
    sender: Any, inbox: queue.Queue, payloads: Sequence[tuple[torch.Tensor, ...]], plan: Sequence[Step],
    timeout_s: float, clock: Any = time.perf_counter,
) -> list[list[float]]:
    """Send side of a paced session: each step of ``plan``, acknowledged before the next; the
    times of the timed sends, per message (one per round)."""
    out: list[list[float]] = [[] for _ in payloads]
    for step, (j, timed) in enumerate(plan):
        t = clock()
        sender.send(step, _TINY if j is None else payloads[j])
        _take(inbox, timeout_s)  # the peer's acknowledgement: the link is idle again
        if timed:
            out[j].append(t)
    return out


def _ack_rounds(
    sender: Any, inbox: queue.Queue, num_msgs: int, plan: Sequence[Step], timeout_s: float,
    clock: Any = time.perf_counter,
) -> list[list[float]]:
    """Receive side of a paced session: take each step of ``plan``'s message, acknowledge it; the
    arrival times of the timed sends, per message (one per round)."""
    out: list[list[float]] = [[] for _ in range(num_msgs)]
    for step, (j, timed) in enumerate(plan):
        _take(inbox, timeout_s)
        t = clock()
        sender.send(step, _TINY)
        if timed:
            out[j].append(t)
    return out


def _tensors(msg: MessageSpec) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(tuple(shape), dtype=getattr(torch, dt)) for shape, dt in msg)


def _take(inbox: queue.Queue, timeout_s: float) -> Arrival:
    try:
        item = inbox.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"no message from the peer within {timeout_s:.0f}s; it is stuck or gone") from None
    if isinstance(item, Exception):
        raise RuntimeError(f"communication thread failed: {item}") from item
    return item


def link_session(
    role: str,
    peer: int,
    act_group: Any,
    grad_group: Any,
    act_msgs: Sequence[MessageSpec],
    grad_msgs: Sequence[MessageSpec],
    *,
    pings: int,
    rounds: int,
    timeout_s: float,
    round_sends: int = ROUND_SENDS,
) -> dict:
    """Run one side (``role`` "a" or "b") of a paced link measurement; returns raw timestamps.

    ``rounds`` = warm-up + measured rounds; a round sends every message ``round_sends`` (>= 2)
    times and times the last send only (Note [Steady-state sends]), so each message gets one
    timestamp per round. Both sides must pass the same message lists and counts. a's result:
    ``ping_t0``, ``ping_t3``, ``act_send_t`` and ``grad_recv_t`` (one list per message, in the
    order given); b's: ``ping_t1``, ``ping_t2``, ``act_recv_t``, ``grad_send_t``.
    """
    if role not in ("a", "b"):
        raise ValueError(f"role must be 'a' or 'b', got {role!r}")
    act_plan = _round_plan([wire_bytes(m) for m in act_msgs], rounds, round_sends) if act_msgs else []
    grad_plan = _round_plan([wire_bytes(m) for m in grad_msgs], rounds, round_sends) if grad_msgs else []
    inbox: queue.Queue = queue.Queue()
    device = torch.device("cpu")
    total = pings + len(act_plan) + len(grad_plan)
    now = time.perf_counter
    out: dict[str, list] = {}
    if role == "a":
        sender = LinkSender("profile-act-send", peer, act_group, device, inbox, timeout_s)
        receiver = LinkReceiver("profile-grad-recv", "B", peer, grad_group, device, inbox, timeout_s)
        receiver.expect(total)
        try:
            out["ping_t0"], out["ping_t3"] = [], []
            for j in range(pings):
                out["ping_t0"].append(now())
                sender.send(j, _TINY)
                _take(inbox, timeout_s)
                out["ping_t3"].append(now())
            payloads = [_tensors(msg) for msg in act_msgs]
            out["act_send_t"] = _send_rounds(sender, inbox, payloads, act_plan, timeout_s, now)
            out["grad_recv_t"] = _ack_rounds(sender, inbox, len(grad_msgs), grad_plan, timeout_s, now)
        finally:
            sender.close()
            receiver.close()
    else:
        sender = LinkSender("profile-grad-send", peer, grad_group, device, inbox, timeout_s)
        receiver = LinkReceiver("profile-act-recv", "F", peer, act_group, device, inbox, timeout_s)
        receiver.expect(total)
        try:
            out["ping_t1"], out["ping_t2"] = [], []
            for j in range(pings):
                _take(inbox, timeout_s)
                out["ping_t1"].append(now())
                out["ping_t2"].append(now())
                sender.send(j, _TINY)
            out["act_recv_t"] = _ack_rounds(sender, inbox, len(act_msgs), act_plan, timeout_s, now)
            payloads = [_tensors(msg) for msg in grad_msgs]
            out["grad_send_t"] = _send_rounds(sender, inbox, payloads, grad_plan, timeout_s, now)
        finally:
            sender.close()
            receiver.close()
    return out


def link_stats(
    a: dict, b: dict, *, warmup: int, same_clock: bool = True
) -> tuple[list[list[float]], list[list[float]]]:
    """One-way times (s) of every measured round: (per activation message, per gradient message).

    ``same_clock``: a and b read one clock (one machine); else relate them from the pings.
    """
    offset = 0.0  # b's clock minus a's
    if not same_clock:
        samples = list(zip(a["ping_t0"], b["ping_t1"], b["ping_t2"], a["ping_t3"]))
        if not samples:
            raise ValueError("no ping samples: cannot relate the two clocks")
        # The ping with the shortest round trip has the least queueing/jitter, hence the best offset.
        t0, t1, t2, t3 = min(samples, key=lambda s: (s[3] - s[0]) - (s[2] - s[1]))
        offset = ((t1 - t0) + (t2 - t3)) / 2
    act = [
        [max(rv - offset - sd, 0.0) for sd, rv in zip(s[warmup:], r[warmup:])]
        for s, r in zip(a["act_send_t"], b["act_recv_t"])
    ]
    grad = [
        [max(rv + offset - sd, 0.0) for sd, rv in zip(s[warmup:], r[warmup:])]
        for s, r in zip(b["grad_send_t"], a["grad_recv_t"])
    ]
    return act, grad


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and (population) standard deviation.

    >>> mean_std([1.0, 3.0])
    (2.0, 1.0)
    """
    vals = list(values)
    if not vals:
        raise ValueError("no measurements")
    return statistics.fmean(vals), (statistics.pstdev(vals) if len(vals) > 1 else 0.0)


def allreduce_session(
    group: Any, union_group: Any, sizes: Sequence[int], *, rounds: int
) -> list[list[float]]:
    """This rank's duration (s) of each round of all-reducing ``sizes[j]`` bytes over ``group``.

    Every member of ``union_group`` (all rings of one configuration) must call it with the same
    arguments; the barrier before each round starts the concurrent rings together.
    """
    from varuna.runtime.grad_sync import allreduce_bucketed  # the engine's own gradient sync (flat buckets)

    bufs = [[torch.zeros(max(nbytes // 4, 1), dtype=torch.float32)] for nbytes in sizes]
    out: list[list[float]] = [[] for _ in sizes]
    for _ in range(rounds):  # Note [Interleaved rounds]
        for times, buf in zip(out, bufs):
            dist.barrier(group=union_group)
            t0 = time.perf_counter()
            allreduce_bucketed(buf, group)
            times.append(time.perf_counter() - t0)
    return out


def allreduce_times(per_rank: Sequence[Sequence[Sequence[float]]], *, warmup: int) -> list[float]:
    """Median over rounds of the slowest member's time, per size, for one ring.

    ``per_rank[i][j][r]``: member i, size j, round r.

    >>> allreduce_times([[[9.0, 1.0, 2.0]], [[9.0, 3.0, 1.0]]], warmup=1)
    [2.5]
    """
    n_sizes = len(per_rank[0])
    out = []
    for j in range(n_sizes):
        rounds = zip(*(member[j] for member in per_rank))
        slowest = [max(r) for r in rounds][warmup:]
        out.append(statistics.median(slowest))
    return out
