"""Worker for tests/test_comm.py: rank 0 sends a sequence of messages of changing shapes over a
LinkSender, rank 1 receives them with a LinkReceiver and checks every tensor bit for bit.

Prints one JSON line per rank: the number of point-to-point sends each message took (rank 0) or
the messages received (rank 1).
"""

from __future__ import annotations

import json
import queue
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from varuna.runtime.comm import LinkReceiver, LinkSender  # noqa: E402


def messages() -> list[tuple[int, tuple[torch.Tensor, ...]]]:
    g = torch.Generator().manual_seed(0)
    f = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return [
        (0, (f(4, 16),)),
        (1, (f(4, 16),)),
        (2, (f(4, 16),)),
        (3, (f(8, 8),)),  # same bytes, other shape: no resize, but the header tells the shape
        (4, (f(2, 16),)),  # a short last micro-batch
        (5, (f(4, 16),)),
        (6, (f(3, 7), torch.arange(7), torch.tensor([True, False, True]), f(()).to(torch.bfloat16))),
        (7, (torch.empty(0, 4),)),
        (8, (f(4, 16).t(),)),  # not contiguous
        (9, (f(4, 16),)),
        (10, (f(64, 16),)),  # larger: announced
        (11, (f(4, 16),)),  # under half the last size: announced (shrinks the receive)
        (12, (f(4, 16),)),
    ]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    cpu = torch.device("cpu")
    if rank == 0:
        counts = []
        real = dist.batch_isend_irecv

        def counting(ops):
            counts.append(len(ops))
            return real(ops)

        dist.batch_isend_irecv = counting
        sender = LinkSender("act-send-0", 1, group, cpu, timeout_s=60)
        for mb, tensors in messages():
            sender.send(mb, tensors)
        sender.flush()
        print(json.dumps({"rank": 0, "sends": counts}))
    else:
        inbox: queue.Queue = queue.Queue()
        receiver = LinkReceiver("act-recv-1", "F", 0, group, cpu, inbox, timeout_s=60)
        expected = messages()
        receiver.expect(len(expected))
        got = []
        for mb, tensors in expected:
            a = inbox.get(timeout=60)
            assert not isinstance(a, Exception), a
            assert a.microbatch == mb, (a.microbatch, mb)
            assert len(a.tensors) == len(tensors)
            for x, y in zip(a.tensors, tensors):
                assert x.dtype == y.dtype and x.shape == y.shape, (mb, x.dtype, x.shape, y.dtype, y.shape)
                assert torch.equal(x, y), mb
                assert x.data_ptr() % 64 == 0  # aligned views into the message
            got.append(mb)
        receiver.close()
        print(json.dumps({"rank": 1, "received": got}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
