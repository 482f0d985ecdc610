r"""Threaded asynchronous point-to-point transfer of activations and gradients between stages.

Each stage owns up to four worker threads: activation sender (to the next stage), activation
receiver (from the previous), gradient sender (to the previous) and gradient receiver (from the
next). Each direction of each link has its own two-rank process group. The compute loop issues
a send's asynchronous ``isend``\ s itself and hands the requests to the sender thread, which
waits for their completion (the compute loop never blocks on a send); it reads arrivals from a
single inbox queue filled by the receiver threads.

Wire format: every message is a batch (one ``batch_isend_irecv`` call, i.e. one logical
message for the network emulation) of an int64 header followed by the payload tensors. The
header carries the micro-batch index and each tensor's dtype and shape, so shapes may differ
between micro-batches (last micro-batch, variable sequence length). Receivers post receives
only for the number of messages expected in the current step, so no receive is left pending
between steps and every wait has a timeout.
"""

from __future__ import annotations

import queue
import threading
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


class LinkSender(_Worker):
    """Sends (micro-batch, tensors) messages to ``peer`` over ``group`` from a thread."""

    def __init__(
        self, name: str, peer: int, group, device: torch.device, inbox: queue.Queue, timeout_s: float
    ):
        self.peer, self.group, self.device = peer, group, device
        super().__init__(name, inbox, timeout_s)

    def send(self, microbatch: int, tensors: tuple[torch.Tensor, ...]) -> None:
        # isend is asynchronous, so issuing it here costs the compute loop little and saves a
        # thread hand-off per message (~1 ms on a busy CPU); the worker thread only waits for
        # completion (with a timeout), keeping the tensors alive until then.
        header = encode_header(microbatch, tensors).to(self.device)
        payload = [t.contiguous() for t in tensors]
        ops = [dist.P2POp(dist.isend, header, self.peer, self.group)]
        ops += [dist.P2POp(dist.isend, t, self.peer, self.group) for t in payload]
        self.commands.put((dist.batch_isend_irecv(ops), header, payload))

    def _handle(self, cmd) -> None:
        works, _header, _payload = cmd
        for w in works:
            w.wait(self.timeout)


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
