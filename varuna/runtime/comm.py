r"""Threaded asynchronous point-to-point transfer of activations and gradients between stages.

Each stage owns up to two receiver threads -- activations from the previous stage, gradients
from the next -- and up to two thread-less senders (activations to the next stage, gradients to
the previous). Each direction of each link has its own two-rank process group. The compute loop
issues a send's asynchronous ``isend``\ s itself and never blocks on a send (completions are
reaped later, Note [Sender without a thread]); it reads arrivals from a single inbox queue
filled by the receiver threads.

Wire format: every message is one contiguous byte tensor, sent with one ``isend``: an int64
header, then the payload tensors' bytes (each at a 64-byte aligned offset, so the receiver's
views of them are aligned too). The header carries the micro-batch index and each tensor's
dtype and shape, so shapes may differ between micro-batches (last micro-batch, variable
sequence length). Note [One send per message]: a receive must be posted with the exact size
of the message (gloo aborts the process otherwise), so both ends of a link remember the size
of the last message. A smaller message, down to half that size, is zero-padded to it (the
header says how much is payload); a larger one, or a much smaller one, is preceded, in the
same batch (one logical message for the network emulation), by a *resize* message of the old
size that announces the new one. Steady-state traffic (same shapes every micro-batch, or a
short last micro-batch) costs one send per message -- the header used to be a send of its
own, and each ``isend`` costs the compute thread 0.1-0.5 ms on a busy host
(docs/benchmarks.md, Finding 7). Receivers post receives only for the number of messages
expected in the current step, so no receive is left pending between steps and every wait has a
timeout.

Note [Receiver streams]: on CUDA each receiver thread makes its GPU current (a new thread starts
on device 0, and its first CUDA call there would create a context on the wrong GPU) and receives
on a stream of its own, so a receive never queues behind the compute loop's kernels. NCCL's
``wait()`` orders that stream after the transfer, and decoding the header copies it to the host
on that stream, so a message is complete before its arrival is queued: the compute loop may read
it on its own stream without an event. What the loop must do is ``record_stream`` the tensors it
takes (``ScheduleExecutor._drain``): the block belongs to the receiver's stream, and without it
the caching allocator could hand the memory to the next receive while compute kernels that read
it are still queued.

Note [Host-staged CUDA messages]: gloo's send and receive take a tensor's raw pointer and move it
with the host's sockets, so they cannot carry CUDA tensors (torch's ProcessGroupGloo::send passes
``data_ptr()`` to its TCP transport; only its collectives stage CUDA tensors through the host).
When gloo carries a CUDA job's activations (several processes on one GPU, where NCCL refuses
duplicate devices: ``VarunaConfig.comm_backend``), messages live in pinned host memory: the sender
copies its CUDA tensors in asynchronously and synchronizes the stream once before posting the
send (gloo's thread reads the bytes at once); the receiver lands messages in pinned memory, and
the compute loop copies them to the device asynchronously. Pinned blocks come from PyTorch's
caching host allocator, which keeps a block in use until the copies that read it have finished.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["Arrival", "LinkSender", "LinkReceiver", "HEADER_LEN", "pack_message", "unpack_message"]

HEADER_LEN = 64
"""int64 words in a message's header."""
HEADER_BYTES = HEADER_LEN * 8
_FIELDS = 4  # kind, micro-batch, number of tensors, message bytes
_MAX_DIMS = 8
_MAX_TENSORS = (HEADER_LEN - _FIELDS) // (2 + _MAX_DIMS)
_ALIGN = 64
_DATA, _RESIZE = 1, 2
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

Spec = tuple[torch.dtype, tuple[int, ...]]


@dataclass
class Arrival:
    """An input that landed: ``kind`` "F" (activation) or "B" (gradient) of ``microbatch``."""

    kind: str
    microbatch: int
    tensors: tuple[torch.Tensor, ...]


def message_layout(specs: list[Spec]) -> tuple[list[int], int]:
    """Byte offsets of each payload tensor in a message, and the message's size."""
    offsets, end = [], HEADER_BYTES
    for dtype, shape in specs:
        offsets.append(end)
        n = dtype.itemsize
        for d in shape:
            n *= d
        end = -(-(end + n) // _ALIGN) * _ALIGN
    return offsets, end


def encode_header(kind: int, microbatch: int, specs: list[Spec], nbytes: int) -> torch.Tensor:
    if len(specs) > _MAX_TENSORS:
        raise ValueError(
            f"too many tensors cross one cut-point ({len(specs)}); at most {_MAX_TENSORS} are supported"
        )
    vals = [kind, microbatch, len(specs), nbytes]
    for dtype, shape in specs:
        if len(shape) > _MAX_DIMS:
            raise ValueError(
                f"a tensor crossing a cut-point has {len(shape)} dims; at most {_MAX_DIMS} are supported"
            )
        if dtype not in _DTYPE_CODE:
            raise ValueError(f"dtype {dtype} cannot cross a cut-point")
        vals += [_DTYPE_CODE[dtype], len(shape), *shape, *([0] * (_MAX_DIMS - len(shape)))]
    vals += [0] * (HEADER_LEN - len(vals))
    return torch.tensor(vals, dtype=torch.int64)  # one op: per-element writes cost ~0.3 ms


def decode_header(h: torch.Tensor) -> tuple[int, int, list[Spec], int]:
    """(kind, micro-batch, specs, message bytes) of a header (int64, or its bytes)."""
    vals = (h.view(torch.int64) if h.dtype == torch.uint8 else h).tolist()
    kind, mb, n, nbytes = vals[:_FIELDS]
    if kind not in (_DATA, _RESIZE) or not 0 <= n <= _MAX_TENSORS or nbytes < HEADER_BYTES:
        raise RuntimeError(f"corrupt message header (kind {kind}, {n} tensors, {nbytes} bytes); both "
                           "ends must run the same varuna version")
    specs, pos = [], _FIELDS
    for _ in range(n):
        code, nd = vals[pos], vals[pos + 1]
        shape = tuple(vals[pos + 2 : pos + 2 + nd])
        if not 0 <= code < len(_DTYPES) or not 0 <= nd <= _MAX_DIMS or min(shape, default=0) < 0:
            raise RuntimeError(f"corrupt message header (dtype code {code}, shape {shape}); both ends "
                               "must run the same varuna version")
        specs.append((_DTYPES[code], shape))
        pos += 2 + _MAX_DIMS
    return kind, mb, specs, nbytes


def pack_message(
    microbatch: int, tensors: tuple[torch.Tensor, ...], device: torch.device, size: int = 0
) -> torch.Tensor:
    """One byte tensor on ``device``: the header, then each tensor's bytes (Note [One send per
    message]), zero-padded to ``size`` bytes if that is more than it needs. CUDA tensors packed
    into a host message go through pinned memory (Note [Host-staged CUDA messages])."""
    specs = [(t.dtype, tuple(t.shape)) for t in tensors]
    offsets, nbytes = message_layout(specs)
    staged = device.type == "cpu" and any(t.is_cuda for t in tensors)
    msg = torch.empty(max(nbytes, size), dtype=torch.uint8, device=device, pin_memory=staged)
    # Host to device from pageable memory: staged by CUDA before the call returns, no device sync.
    msg[:HEADER_BYTES].copy_(encode_header(_DATA, microbatch, specs, nbytes).view(torch.uint8),
                             non_blocking=device.type == "cuda")
    ends = [*offsets[1:], msg.numel()]
    for t, off, end in zip(tensors, offsets, ends):
        n = t.numel() * t.element_size()
        msg[off : off + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=staged)
        if off + n < end:  # no uninitialised memory on the wire
            msg[off + n : end].zero_()
    if not tensors and nbytes < msg.numel():
        msg[nbytes:].zero_()
    if staged:  # gloo reads the host bytes as soon as the send is posted: they must have landed
        for dev in {t.device for t in tensors if t.is_cuda}:
            torch.cuda.current_stream(dev).synchronize()
    return msg


def unpack_message(
    msg: torch.Tensor, header: tuple[int, int, list[Spec], int] | None = None
) -> tuple[int, tuple[torch.Tensor, ...]]:
    """(micro-batch, tensors) of a data message; the tensors are views of ``msg``. ``header``:
    its :func:`decode_header`, if the caller has it already (on GPU each decode is a sync)."""
    kind, mb, specs, nbytes = header if header is not None else decode_header(msg[:HEADER_BYTES])
    if kind != _DATA or nbytes > msg.numel():
        raise RuntimeError(f"message of {msg.numel()} bytes has a header for kind {kind} of {nbytes} "
                           "bytes; sender and receiver disagree on the wire format")
    offsets, _ = message_layout(specs)
    out = []
    for (dtype, shape), off in zip(specs, offsets):
        n = dtype.itemsize
        for d in shape:
            n *= d
        out.append(msg[off : off + n].view(dtype).view(shape))
    return mb, tuple(out)


def _resize_message(old_nbytes: int, new_nbytes: int, device: torch.device) -> torch.Tensor:
    msg = torch.zeros(old_nbytes, dtype=torch.uint8, device=device)
    msg[:HEADER_BYTES].copy_(encode_header(_RESIZE, -1, [], new_nbytes).view(torch.uint8),
                             non_blocking=device.type == "cuda")
    return msg


class _Worker:
    def __init__(self, name: str, inbox: queue.Queue, timeout_s: float):
        self.inbox = inbox
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.commands: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _context(self) -> contextlib.AbstractContextManager:
        """What the thread runs under (its CUDA device and stream, Note [Receiver streams])."""
        return contextlib.nullcontext()

    def _loop(self) -> None:
        try:
            with self._context():
                while True:
                    cmd = self.commands.get()
                    if cmd is None:
                        return
                    self._handle(cmd)
        except Exception as e:  # surfaced to the compute loop, which raises it
            self.inbox.put(e)

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
        self._pending: collections.deque = collections.deque()  # (works, tensors, issued)
        self._peer_expects = HEADER_BYTES  # the size the receiver posts next (Note [One send per message])

    def send(self, microbatch: int, tensors: tuple[torch.Tensor, ...]) -> None:
        self._reap()
        expects = self._peer_expects
        _, need = message_layout([(t.dtype, tuple(t.shape)) for t in tensors])
        # Note [One send per message]: a message up to the expected size, and not under half of
        # it, goes padded (a short last micro-batch: no announcement now, none when the full
        # size returns); one that is larger, or much smaller, is announced first.
        if expects // 2 <= need <= expects:
            msg = pack_message(microbatch, tensors, self.device, size=expects)
            ops = [dist.P2POp(dist.isend, msg, self.peer, self.group)]
            held: tuple[torch.Tensor, ...] = (msg,)
        else:
            msg = pack_message(microbatch, tensors, self.device)
            resize = _resize_message(expects, need, self.device)
            ops = [dist.P2POp(dist.isend, resize, self.peer, self.group),
                   dist.P2POp(dist.isend, msg, self.peer, self.group)]
            held = (resize, msg)
        works = dist.batch_isend_irecv(ops)
        self._peer_expects = msg.numel()  # only once the sends are issued
        self._pending.append((works, held, time.monotonic()))

    def _reap(self) -> None:
        pending = self._pending
        while pending and all(w.is_completed() for w in pending[0][0]):
            for w in pending.popleft()[0]:
                w.wait(self.timeout)  # returns at once; raises if the send failed
        if pending and time.monotonic() - pending[0][2] > self.timeout_s:
            self._wait_oldest()  # raises after the remaining part of the timeout

    def _wait_oldest(self) -> None:
        works, _tensors, issued = self._pending.popleft()
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
    """Receives messages from ``peer`` and puts :class:`Arrival`\\ s into the inbox.

    ``device``: where messages land; ``compute_device`` (default: the same): where the compute
    loop uses them. CUDA messages are received on the thread's own stream and handed to the
    compute loop's stream (Note [Receiver streams]); host messages for a CUDA compute loop land in
    pinned memory, so the loop's copy to the device is asynchronous (Note [Host-staged CUDA
    messages])."""

    def __init__(
        self,
        name: str,
        kind: str,
        peer: int,
        group,
        device: torch.device,
        inbox: queue.Queue,
        timeout_s: float,
        *,
        compute_device: torch.device | None = None,
    ):
        self.kind, self.peer, self.group, self.device = kind, peer, group, device
        self.compute_device = compute_device if compute_device is not None else device
        self._expected = HEADER_BYTES  # size of the next message (Note [One send per message])
        self._pin = device.type == "cpu" and self.compute_device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        super().__init__(name, inbox, timeout_s)

    def _context(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        if self.compute_device.type == "cuda":
            # A new thread's current device is 0: without this, a rank on cuda:1 would create a
            # context (hundreds of MB) on GPU 0 at its first CUDA call here.
            stack.enter_context(torch.cuda.device(self.compute_device))
        if self._stream is not None:
            stack.enter_context(torch.cuda.stream(self._stream))
        return stack

    def expect(self, count: int) -> None:
        """Receive ``count`` messages (the current step's) and then idle."""
        if count > 0:
            self.commands.put(count)

    def _handle(self, count: int) -> None:
        for _ in range(count):
            msg = self._recv(self._expected)
            header = decode_header(msg[:HEADER_BYTES])
            if header[0] == _RESIZE:  # Note [One send per message]
                self._expected = header[3]
                msg = self._recv(self._expected)
                header = decode_header(msg[:HEADER_BYTES])
            mb, tensors = unpack_message(msg, header)
            self.inbox.put(Arrival(self.kind, mb, tensors))

    def _recv(self, nbytes: int) -> torch.Tensor:
        msg = torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self._pin)
        # NCCL: wait() orders this thread's stream after the receive; decoding the header then
        # copies it to the host on that stream, so the whole message has landed when the
        # arrival is queued (Note [Receiver streams]).
        dist.irecv(msg, self.peer, self.group).wait(self.timeout)
        return msg
