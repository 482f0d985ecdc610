"""Interleaved 1F1B (v model chunks per device): Megatron's strict order and varuna's tolerant one.

Device d (0-based, of P) holds model chunks d, d+P, ..., d+(v-1)·P of the P·v virtual stages.
The order follows Megatron's ``forward_backward_pipelining_with_interleaving``: virtual
micro-batch k (0 ≤ k < v·Nm) is micro-batch ``(k // (P·v))·P + k % P`` of local chunk
``(k % (P·v)) // P`` (backwards: ``v - 1 -`` that chunk); each device runs
``min(2·(P-d-1) + (v-1)·P, v·Nm)`` warm-up forwards (all of them when Nm == P), then alternates
one forward and one backward, then drains the remaining backwards. Megatron requires Nm to be a
multiple of P; so do we.

Two kinds run it, in the runtime and in the simulator alike (Note [Interleaved as flat lists]):
``interleaved`` executes the list strictly, as Megatron does (recompute when asked);
``varuna-interleaved`` always recomputes (but on the last virtual stage) and runs it through
varuna's opportunistic :class:`~varuna.core.policy.StagePolicy` -- a ready task runs ahead of a
blocked one, a graph-less forward fills a wait for a gradient, within the stash bound.

Example::

    >>> [str(t) for t in interleaved_order(2, 2, 2, stage=1)]
    ['F0.0', 'F1.0', 'F0.1', 'F1.1', 'B0.1', 'B1.1', 'B0.0', 'B1.0']

Note [Interleaved as flat lists]: a device's chunked list becomes a plain :class:`Task` list by
numbering each (micro-batch, chunk) pair by its position in the device's forward order (k
above): forwards then run in index order, which is what :class:`StagePolicy` requires, and the
policy's rules (readiness, rule 2 for R, filling a gradient's wait with a graph-less forward,
the stash cap) apply unchanged. Only the ends differ: chunk 0 of device 0 needs no activation
and chunk v-1 of device P-1 no gradient, so the policy is built ``chunked`` (no implicit first
or last stage) and :class:`ChunkedPolicy` marks those inputs as arrived up front.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from varuna.core.policy import DEFAULT_STASH_HEADROOM, StagePolicy, _PolicyTemplate
from varuna.core.schedule_kind import ScheduleKind
from varuna.core.tasks import BACKWARD, FORWARD, Task

__all__ = [
    "ChunkTask",
    "interleaved_order",
    "InterleavedPolicy",
    "ChunkedPolicy",
    "forward_only_policy",
    "InterleavedSchedule",
    "InterleavedKind",
    "VarunaInterleavedKind",
]


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


def flat_index(num_stages: int, chunks: int, microbatch: int, chunk: int) -> int:
    """Position of (micro-batch, chunk) in a device's forward order (Note [Interleaved as flat lists]).

    >>> [flat_index(2, 2, i, c) for c in range(2) for i in range(4)]
    [0, 1, 4, 5, 2, 3, 6, 7]
    """
    P = num_stages
    return (microbatch // P) * P * chunks + chunk * P + microbatch % P


@dataclass(frozen=True)
class _DeviceList:
    """One device's chunked list and its flat form (Note [Interleaved as flat lists])."""

    tasks: tuple[ChunkTask, ...]
    flat: tuple[Task, ...]
    key: tuple[tuple[int, int], ...]
    """key[flat index] = (micro-batch, chunk)."""
    template: _PolicyTemplate
    recomputed: frozenset[tuple[int, int]]
    """(micro-batch, chunk) pairs whose forward runs without a graph."""


@functools.lru_cache(maxsize=128)
def _device_list(
    P: int, N: int, v: int, stage: int, recompute: bool, forward_only: bool = False
) -> _DeviceList:
    tasks = tuple(interleaved_order(P, N, v, stage=stage, recompute=recompute))
    if forward_only:
        tasks = tuple(t for t in tasks if t.op == "F")
    key = [(0, 0)] * (N * v)
    for i in range(N):
        for c in range(v):
            key[flat_index(P, v, i, c)] = (i, c)
    flat = tuple(Task(t.op, flat_index(P, v, t.microbatch, t.chunk)) for t in tasks)
    rec = frozenset((t.microbatch, t.chunk) for t in tasks if t.op == "R")
    return _DeviceList(tasks, flat, tuple(key), _PolicyTemplate.of(flat), rec)


class ChunkedPolicy:
    """Executes one device's interleaved list through :class:`StagePolicy` (Note [Interleaved as
    flat lists]); the runtime and the simulator drive it as they drive ``StagePolicy``, with the
    chunk in ``arrived`` and in the tasks.

    >>> p = InterleavedSchedule(2, 2, 2, recompute=False).policy(1)
    >>> p.next_task() is None   # waiting for micro-batch 0's activation of chunk 0
    True
    >>> p.arrived("F", 0, 0); str(p.next_task())
    'F0.0'
    """

    __slots__ = ("stage", "num_stages", "chunks", "tasks", "recomputed", "_list", "_policy", "_v", "_P")

    def __init__(self, dl: _DeviceList, stage: int, num_stages: int, chunks: int, *,
                 opportunistic: bool, stash_headroom: int) -> None:
        self.stage, self.num_stages, self.chunks = stage, num_stages, chunks
        self.tasks = dl.tasks
        self.recomputed = dl.recomputed
        self._list, self._P, self._v = dl, num_stages, chunks
        self._policy = StagePolicy(dl.flat, stage, num_stages, opportunistic,
                                   stash_headroom=stash_headroom, chunked=True, _template=dl.template)
        n = len(dl.key) // chunks
        for i in range(n):  # the pipeline's ends: inputs nobody sends
            if stage == 0:
                self._policy.arrived(FORWARD, flat_index(num_stages, chunks, i, 0))
            if stage == num_stages - 1:
                self._policy.arrived(BACKWARD, flat_index(num_stages, chunks, i, chunks - 1))

    @property
    def finished(self) -> bool:
        return self._policy.finished

    @property
    def executed(self) -> list[ChunkTask]:
        key = self._list.key
        return [ChunkTask(t.op, *key[t.microbatch]) for t in self._policy.executed]

    def arrived(self, kind: str, microbatch: int, chunk: int) -> None:
        if not 0 <= chunk < self._v:
            raise ValueError(
                f"device {self.stage}: input for chunk {chunk} arrived; it holds chunks 0..{self._v - 1}"
            )
        self._policy.arrived(kind, flat_index(self._P, self._v, microbatch, chunk))

    def next_task(self) -> ChunkTask | None:
        t = self._policy.next_task()
        return None if t is None else ChunkTask(t.op, *self._list.key[t.microbatch])

    def complete(self, task: ChunkTask) -> None:
        self._policy.complete(Task(task.op, flat_index(self._P, self._v, task.microbatch, task.chunk)))


def forward_only_policy(num_stages: int, num_microbatches: int, chunks: int, stage: int) -> ChunkedPolicy:
    """Device ``stage``'s forwards alone, in the interleaved order (evaluation: no backward).

    >>> [str(t) for t in forward_only_policy(2, 2, 2, 0).tasks]
    ['F0.0', 'F1.0', 'F0.1', 'F1.1']
    """
    _check(num_stages, num_microbatches, chunks)
    dl = _device_list(num_stages, num_microbatches, chunks, stage, False, True)
    return ChunkedPolicy(dl, stage, num_stages, chunks, opportunistic=False, stash_headroom=0)


@dataclass(frozen=True)
class InterleavedSchedule:
    """One interleaved pipeline (``varuna.core.schedule_kind.Pipeline``): strict, or
    ``opportunistic`` (varuna-interleaved).

    >>> pipe = InterleavedSchedule(2, 2, 2, recompute=False)
    >>> [str(t) for t in pipe.policy(1).tasks][:2]
    ['F0.0', 'F1.0']
    """

    num_stages: int
    num_microbatches: int
    chunks: int
    recompute: bool
    opportunistic: bool = False

    def policy(self, stage: int, *, stash_headroom: int = DEFAULT_STASH_HEADROOM) -> ChunkedPolicy:
        """A fresh policy for device ``stage`` (``stash_headroom`` applies when opportunistic)."""
        P, v = self.num_stages, self.chunks
        dl = _device_list(P, self.num_microbatches, v, stage, self.recompute)
        return ChunkedPolicy(dl, stage, P, v, opportunistic=self.opportunistic, stash_headroom=stash_headroom)

    def recomputed(self, stage: int) -> frozenset[tuple[int, int]]:
        """(micro-batch, chunk) pairs device ``stage`` recomputes."""
        P, N, v = self.num_stages, self.num_microbatches, self.chunks
        return _device_list(P, N, v, stage, self.recompute).recomputed

    def recomputes(self, stage: int) -> bool:
        return bool(self.recomputed(stage))


class InterleavedKind(ScheduleKind):
    """The facts of interleaved 1F1B: strict, chunked, recomputing when asked to on every virtual
    stage but the last, which (with Nm > P, so that it has a steady phase) runs each B right
    after its F, as 1f1b's last stage does. (With Nm == P every forward runs first and it
    recomputes too: the balancing costs then undercharge that one stage's R.)

    >>> InterleavedKind().stash_peak(4, 3, 8, chunks=2)   # (v-1)·P + 1 warm-up chunk activations
    5
    """

    name: ClassVar[str] = "interleaved"
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
        _check(num_stages, num_microbatches, chunks)
        return InterleavedSchedule(
            num_stages, num_microbatches, chunks, self.effective_recompute(recompute), self.opportunistic
        )

    def unsupported(self, num_stages: int, num_microbatches: int) -> str | None:
        if num_stages < 2:
            return f"{self.name} needs P >= 2"
        return f"{self.name} needs Nm divisible by P" if num_microbatches % num_stages else None


class VarunaInterleavedKind(InterleavedKind):
    """Interleaved with varuna's jitter tolerance: Megatron's list with a recompute before every
    backward but the last virtual stage's, run opportunistically (Note [Interleaved as flat lists]).

    >>> VarunaInterleavedKind().recomputes(4, 2, recompute=False)
    True
    """

    name: ClassVar[str] = "varuna-interleaved"
    opportunistic: ClassVar[bool] = True
    recompute_optional: ClassVar[bool] = False

    def _recomputes(self, *, last: bool, recompute: bool) -> bool:
        return not last
