"""Point-to-point and all-reduce measurements over the runtime's own communication path.

**Point-to-point** (Act/Grad, intra/inter): two ranks ``a`` (the earlier stage) and ``b`` (the
later one) set up exactly what two neighbouring stages of the engine own — per direction a
two-rank process group, a :class:`varuna.runtime.comm.LinkSender` on the sending side and a
:class:`varuna.runtime.comm.LinkReceiver` thread on the receiving side — and send messages in the
engine's wire format (one contiguous message: an int64 header, then the payload). The time of a
message is from the sender's ``send()`` call (the compute loop handing it off) to the moment the
receiver's main thread takes the arrival from its inbox: what a stage waiting for its input sees.
Messages are paced (the receiver acknowledges each one on the reverse link before the next is
sent), so none waits behind another. Activations go a → b, gradients b → a.

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

Worker side: :func:`link_session`, :func:`allreduce_session` (called by :mod:`profiler.worker`,
they return raw timestamps). Parent side: :func:`link_stats`, :func:`allreduce_times` reduce them.

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

from varuna.runtime.comm import Arrival, LinkReceiver, LinkSender

__all__ = [
    "MessageSpec",
    "link_session",
    "allreduce_session",
    "link_stats",
    "allreduce_times",
    "mean_std",
    "payload_bytes",
]

#: One message: the (shape, dtype name) of each tensor it carries.
MessageSpec = list[tuple[tuple[int, ...], str]]

_TINY: tuple[torch.Tensor, ...] = ()  # pings and acks: a header only (the engine never sends less)


def payload_bytes(msg: MessageSpec) -> int:
    """Bytes of the tensors of ``msg`` (the header's 512 bytes are not counted).

    >>> payload_bytes([((2, 3), "float32"), ((4,), "int64")])
    56
    """
    return sum(
        math.prod(shape) * torch.empty((), dtype=getattr(torch, dt)).element_size() for shape, dt in msg
    )


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
) -> dict:
    """Run one side (``role`` "a" or "b") of a paced link measurement; returns raw timestamps.

    ``rounds`` = warm-up + measured repetitions of each message. Both sides must pass the same
    message lists. a's result: ``ping_t0``, ``ping_t3``, ``act_send_t`` and ``grad_recv_t`` (one
    list per message); b's: ``ping_t1``, ``ping_t2``, ``act_recv_t``, ``grad_send_t``.
    """
    if role not in ("a", "b"):
        raise ValueError(f"role must be 'a' or 'b', got {role!r}")
    inbox: queue.Queue = queue.Queue()
    device = torch.device("cpu")
    total = pings + rounds * (len(act_msgs) + len(grad_msgs))
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
            out["act_send_t"] = [[] for _ in act_msgs]
            for r in range(rounds):  # Note [Interleaved rounds]
                for times, payload in zip(out["act_send_t"], payloads):
                    times.append(now())
                    sender.send(r, payload)
                    _take(inbox, timeout_s)  # b's acknowledgement: the link is idle again
            out["grad_recv_t"] = [[] for _ in grad_msgs]
            for r in range(rounds):
                for times in out["grad_recv_t"]:
                    _take(inbox, timeout_s)
                    times.append(now())
                    sender.send(r, _TINY)
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
            out["act_recv_t"] = [[] for _ in act_msgs]
            for r in range(rounds):
                for times in out["act_recv_t"]:
                    _take(inbox, timeout_s)
                    times.append(now())
                    sender.send(r, _TINY)
            payloads = [_tensors(msg) for msg in grad_msgs]
            out["grad_send_t"] = [[] for _ in grad_msgs]
            for r in range(rounds):
                for times, payload in zip(out["grad_send_t"], payloads):
                    times.append(now())
                    sender.send(r, payload)
                    _take(inbox, timeout_s)
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
