"""Interleaved 1F1B (Megatron-LM, v model chunks per device) — SIMULATION ONLY.

The runtime does not execute this schedule (``InterleavedKind.runtime`` is false, and it is not
in ``SCHEDULE_KINDS``); it is here so the simulator can compare Varuna with the interleaved
schedule of Narayanan et al. (SC'21). Do not use it to drive a real pipeline.

Device d (0-based, of P) holds model chunks d, d+P, ..., d+(v-1)·P of the P·v virtual stages.
The order follows Megatron's ``forward_backward_pipelining_with_interleaving``: virtual
micro-batch k (0 ≤ k < v·Nm) is micro-batch ``(k // (P·v))·P + k % P`` of local chunk
``(k % (P·v)) // P`` (backwards: ``v - 1 -`` that chunk); each device runs
``min(2·(P-d-1) + (v-1)·P, v·Nm)`` warm-up forwards (all of them when Nm == P), then alternates
one forward and one backward, then drains the remaining backwards. Megatron requires Nm to be a
multiple of P; so do we. Execution is strict (in list order), as in Megatron.

Example::

    >>> [str(t) for t in interleaved_order(2, 2, 2, stage=1)]
    ['F0.0', 'F1.0', 'F0.1', 'F1.1', 'B0.1', 'B1.1', 'B0.0', 'B1.0']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from varuna.core.schedule_kind import ScheduleKind

__all__ = ["ChunkTask", "interleaved_order", "InterleavedPolicy", "InterleavedSchedule", "InterleavedKind"]


@dataclass(frozen=True, slots=True)
class ChunkTask:
    """F/R/B of ``microbatch`` on local model chunk ``chunk`` of a device. String form ``F3.1``."""

    op: str
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.op}{self.microbatch}.{self.chunk}"


def _check(num_stages: int, num_microbatches: int, chunks: int) -> None:
    if chunks < 2:
        raise ValueError(
            f"the interleaved schedule needs --chunks >= 2 (got {chunks}); with one chunk use 1f1b"
        )
    if num_stages < 2:
        raise ValueError("the interleaved schedule needs at least 2 pipeline stages")
    if num_microbatches % num_stages:
        raise ValueError(
            f"the interleaved schedule needs the number of micro-batches ({num_microbatches}) to be a "
            f"multiple of P={num_stages}; change the micro-batch size or the global batch size"
        )


def interleaved_order(
    num_stages: int, num_microbatches: int, chunks: int, *, stage: int, recompute: bool = False
) -> list[ChunkTask]:
    """Task order of device ``stage``. With ``recompute``, R precedes each B unless that
    micro-batch's F on the same chunk runs directly before it (then it keeps its graph)."""
    _check(num_stages, num_microbatches, chunks)
    P, v, N = num_stages, chunks, num_microbatches
    total = N * v
    if N == P:
        warmup = total
    else:
        warmup = min((P - stage - 1) * 2 + (v - 1) * P, total)

    def task(k: int, op: str) -> ChunkTask:
        in_group = k % (P * v)
        chunk = in_group // P
        if op == "B":
            chunk = v - 1 - chunk
        return ChunkTask(op, (k // (P * v)) * P + k % P, chunk)

    order = [task(k, "F") for k in range(warmup)]
    for k in range(total - warmup):
        order.append(task(k + warmup, "F"))
        order.append(task(k, "B"))
    order.extend(task(k, "B") for k in range(total - warmup, total))
    if not recompute:
        return order
    out: list[ChunkTask] = []
    for t in order:
        if t.op == "B" and not (out and out[-1] == ChunkTask("F", t.microbatch, t.chunk)):
            out.append(ChunkTask("R", t.microbatch, t.chunk))
        out.append(t)
    return out


class InterleavedPolicy:
    """Strict in-order executor of one device's interleaved list; the simulator drives it through
    the same calls as :class:`varuna.core.policy.StagePolicy` (``arrived`` takes the chunk too).

    >>> p = InterleavedPolicy(interleaved_order(2, 2, 2, stage=1), stage=1, num_stages=2, chunks=2)
    >>> p.next_task() is None   # waiting for micro-batch 0's activation of chunk 0
    True
    >>> p.arrived("F", 0, 0); str(p.next_task())
    'F0.0'
    """

    __slots__ = ("tasks", "stage", "num_stages", "chunks", "_pos", "_act", "_grad", "_done", "executed")

    def __init__(self, tasks: list[ChunkTask], stage: int, num_stages: int, chunks: int):
        self.tasks = tuple(tasks)
        self.stage = stage
        self.num_stages = num_stages
        self.chunks = chunks
        self._pos = 0
        self._act: set[tuple[int, int]] = set()
        self._grad: set[tuple[int, int]] = set()
        self._done: set[ChunkTask] = set()
        self.executed: list[ChunkTask] = []

    @property
    def finished(self) -> bool:
        return self._pos == len(self.tasks)

    def arrived(self, kind: str, microbatch: int, chunk: int) -> None:
        (self._act if kind == "F" else self._grad).add((chunk, microbatch))

    def next_task(self) -> ChunkTask | None:
        if self._pos == len(self.tasks):
            return None
        t = self.tasks[self._pos]
        virtual = t.chunk * self.num_stages + self.stage
        key = (t.chunk, t.microbatch)
        if t.op == "F":
            ok = virtual == 0 or key in self._act
        elif t.op == "R":
            ok = True  # F precedes it in the list
        else:
            ok = virtual == self.num_stages * self.chunks - 1 or key in self._grad
        return t if ok else None

    def complete(self, task: ChunkTask) -> None:
        if self.tasks[self._pos] != task:
            raise RuntimeError(f"task {task} completed out of order on device {self.stage}")
        self._pos += 1
        self.executed.append(task)


@dataclass(frozen=True)
class InterleavedSchedule:
    """One interleaved pipeline as the simulator drives it (``varuna.core.schedule_kind.Pipeline``).

    >>> pipe = InterleavedSchedule(2, 2, 2, recompute=False)
    >>> [str(t) for t in pipe.policy(1).tasks][:2]
    ['F0.0', 'F1.0']
    """

    num_stages: int
    num_microbatches: int
    chunks: int
    recompute: bool

    def policy(self, stage: int, *, stash_headroom: int = 0) -> InterleavedPolicy:
        """A fresh strict policy for device ``stage`` (``stash_headroom`` does not apply)."""
        P, v = self.num_stages, self.chunks
        order = interleaved_order(P, self.num_microbatches, v, stage=stage, recompute=self.recompute)
        return InterleavedPolicy(order, stage=stage, num_stages=P, chunks=v)

    def recomputes(self, stage: int) -> bool:
        return self.recompute


class InterleavedKind(ScheduleKind):
    """The facts of interleaved 1F1B: strict, chunked, recomputing when asked to on every virtual
    stage but the last, which (with Nm > P, so that it has a steady phase) runs each B right
    after its F, as 1f1b's last stage does. (With Nm == P every forward runs first and it
    recomputes too: the balancing costs then undercharge that one stage's R.)

    >>> InterleavedKind().stash_peak(4, 3, 8, chunks=2)   # (v-1)·P + 1 warm-up chunk activations
    5
    """

    name: ClassVar[str] = "interleaved"
    runtime: ClassVar[bool] = False
    chunked: ClassVar[bool] = True

    def _recomputes(self, *, last: bool, recompute: bool) -> bool:
        return recompute and not last

    def stash_peak(self, num_stages: int, stage: int, num_microbatches: int, *, chunks: int = 1) -> int:
        # The warm-up forwards plus the one of the first steady step (an estimate: exact unless
        # Nm == P, where every forward runs before the first backward).
        return min(num_microbatches * chunks, 2 * (num_stages - stage - 1) + (chunks - 1) * num_stages + 1)

    def pipeline(
        self, num_stages: int, num_microbatches: int, *, recompute: bool = True, chunks: int = 1
    ) -> InterleavedSchedule:
        return InterleavedSchedule(num_stages, num_microbatches, chunks, recompute)

    def unsupported(self, num_stages: int, num_microbatches: int) -> str | None:
        return "interleaved needs Nm divisible by P" if num_microbatches % num_stages else None
