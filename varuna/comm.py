r"""Threaded asynchronous point-to-point transfer of activations and gradients between stages.

Each stage owns up to two receiver threads -- activations from the previous stage, gradients
from the next -- and up to two thread-less senders (activations to the next stage, gradients to
the previous). Each direction of each link has its own two-rank process group. The compute loop
issues a send's asynchronous ``isend``\ s itself and never blocks on a send (completions are
reaped later, Note [Sender without a thread]); it reads arrivals from a single inbox queue
filled by the receiver threads.

Wire format: every message is a batch (one ``batch_isend_irecv`` call, i.e. one logical
message for the network emulation) of an int64 header followed by the payload tensors. The
header carries the micro-batch index and each tensor's dtype and shape, so shapes may differ
between micro-batches (last micro-batch, variable sequence length). Receivers post receives
only for the number of messages expected in the current step, so no receive is left pending
between steps and every wait has a timeout.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["Arrival", "LinkSender", "LinkReceiver", "HEADER_LEN"]

HEADER_LEN = 64
_MAX_DIMS = 8
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


@dataclass
class Arrival:
    """An input that landed: ``kind`` "F" (activation) or "B" (gradient) of ``microbatch``."""

    kind: str
    microbatch: int
    tensors: tuple[torch.Tensor, ...]


def encode_header(microbatch: int, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if 2 + len(tensors) * (2 + _MAX_DIMS) > HEADER_LEN:
        raise ValueError(f"too many tensors cross one cut-point ({len(tensors)}); at most 6 are supported")
    vals = [microbatch, len(tensors)]
    for t in tensors:
        if t.dim() > _MAX_DIMS:
            raise ValueError(
                f"a tensor crossing a cut-point has {t.dim()} dims; at most {_MAX_DIMS} are supported"
            )
        if t.dtype not in _DTYPE_CODE:
            raise ValueError(f"dtype {t.dtype} cannot cross a cut-point")
        vals += [_DTYPE_CODE[t.dtype], t.dim(), *t.shape, *([0] * (_MAX_DIMS - t.dim()))]
    vals += [0] * (HEADER_LEN - len(vals))
    return torch.tensor(vals, dtype=torch.int64)  # one op: per-element writes cost ~0.3 ms


def decode_header(h: torch.Tensor) -> tuple[int, list[tuple[torch.dtype, tuple[int, ...]]]]:
    vals = h.tolist()
    mb, n = vals[0], vals[1]
    specs, pos = [], 2
    for _ in range(n):
        dtype, nd = _DTYPES[vals[pos]], vals[pos + 1]
        specs.append((dtype, tuple(vals[pos + 2 : pos + 2 + nd])))
        pos += 2 + _MAX_DIMS
    return mb, specs


class _Worker:
    def __init__(self, name: str, inbox: queue.Queue, timeout_s: float):
        self.inbox = inbox
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.commands: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            cmd = self.commands.get()
            if cmd is None:
                return
            try:
                self._handle(cmd)
            except Exception as e:  # surfaced to the compute loop, which raises it
                self.inbox.put(e)
                return

    def close(self, timeout_s: float = 10.0) -> None:
        self.commands.put(None)
        self.thread.join(timeout_s)


class LinkSender:
    """Sends (micro-batch, tensors) messages to ``peer`` over ``group``; never blocks the caller.

    No thread: ``isend`` is asynchronous (the backend's own I/O thread moves the bytes), so the
    compute loop issues it and keeps the requests, with their tensors alive, in a FIFO until they
    complete. Completed requests are reaped at the next :meth:`send`; :meth:`flush` waits for the
    rest (end of step). Note [Sender without a thread]: a thread that only waits for completions
    wakes once per message and takes the GIL from the compute loop each time; on a busy 2-core
    host that cost ~0.1-0.3 ms per task (scripts/bench_schedules.py, docs/benchmarks.md).

    ``inbox`` is accepted for symmetry with :class:`LinkReceiver` and unused.
    """

    def __init__(
        self,
        name: str,
        peer: int,
        group,
        device: torch.device,
        inbox: queue.Queue | None = None,
        timeout_s: float = 300.0,
    ):
        self.name, self.peer, self.group, self.device = name, peer, group, device
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self._pending: collections.deque = collections.deque()  # (works, header, payload, issued)

    def send(self, microbatch: int, tensors: tuple[torch.Tensor, ...]) -> None:
        self._reap()
        header = encode_header(microbatch, tensors).to(self.device)
        payload = [t.contiguous() for t in tensors]
        ops = [dist.P2POp(dist.isend, header, self.peer, self.group)]
        ops += [dist.P2POp(dist.isend, t, self.peer, self.group) for t in payload]
        self._pending.append((dist.batch_isend_irecv(ops), header, payload, time.monotonic()))

    def _reap(self) -> None:
        pending = self._pending
        while pending and all(w.is_completed() for w in pending[0][0]):
            for w in pending.popleft()[0]:
                w.wait(self.timeout)  # returns at once; raises if the send failed
        if pending and time.monotonic() - pending[0][3] > self.timeout_s:
            self._wait_oldest()  # raises after the remaining part of the timeout

    def _wait_oldest(self) -> None:
        works, _header, _payload, issued = self._pending.popleft()
        for w in works:
            left = max(0.001, self.timeout_s - (time.monotonic() - issued))
            try:
                w.wait(timedelta(seconds=left))
            except Exception as e:
                raise RuntimeError(
                    f"{self.name}: a send to rank {self.peer} did not complete within "
                    f"{self.timeout_s:g}s ({e}); the peer is stuck or gone"
                ) from e

    def flush(self) -> None:
        """Wait (each within the timeout) until every message sent so far has completed."""
        while self._pending:
            self._wait_oldest()

    def close(self, timeout_s: float = 10.0) -> None:
        """Give outstanding sends up to ``timeout_s`` in all to complete (their tensors must stay
        alive until then), then forget them; a peer that is gone does not hold up shutdown."""
        deadline = time.monotonic() + timeout_s
        while self._pending:
            works = self._pending[0][0]
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                for w in works:
                    w.wait(timedelta(seconds=left))
            except Exception:  # the peer is gone or the group is torn down: nothing to save
                break
            self._pending.popleft()
        self._pending.clear()


class LinkReceiver(_Worker):
    """Receives messages from ``peer`` and puts :class:`Arrival`\\ s into the inbox."""

    def __init__(
        self,
        name: str,
        kind: str,
        peer: int,
        group,
        device: torch.device,
        inbox: queue.Queue,
        timeout_s: float,
    ):
        self.kind, self.peer, self.group, self.device = kind, peer, group, device
        super().__init__(name, inbox, timeout_s)

    def expect(self, count: int) -> None:
        """Receive ``count`` messages (the current step's) and then idle."""
        if count > 0:
            self.commands.put(count)

    def _handle(self, count: int) -> None:
        for _ in range(count):
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            dist.irecv(header, self.peer, self.group).wait(self.timeout)
            mb, specs = decode_header(header)
            bufs = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in specs]
            works = [dist.irecv(b, self.peer, self.group) for b in bufs]
            for w in works:
                w.wait(self.timeout)
            self.inbox.put(Arrival(self.kind, mb, tuple(bufs)))
