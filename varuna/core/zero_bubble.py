"""Zero-bubble schedules: the backward split into B (input gradient) and W (weight gradients).

Qi et al. (ICLR'24, "Zero Bubble Pipeline Parallelism") observe that only the input gradient of
a stage's backward is on the pipeline's critical path: the stage before waits for it, nobody
waits for the weight gradients. So the backward is split into B_i (the gradient w.r.t. the
stage's input, sent upstream at once) and W_i (the parameter gradients of micro-batch i), and
the W tasks are placed where the stage would otherwise idle. Two kinds, both pure data here (the
runtime executes them, the simulator simulates them, through :class:`ZeroBubblePolicy`):

- ``zb-h1`` -- the paper's handcrafted ZB-H1, executed strictly in list order: 1F1B's warm-up
  and steady phase, but every stage keeps up to P micro-batches in flight (forward done, W not
  done) -- what 1F1B's first stage holds -- by deferring W's, which then fill the drain. At unit
  costs F = B = W its bubble is (P-1)(F+B-W), a third of 1F1B's (P-1)(F+B+W). ``recompute``
  inserts R_i before B_i as in 1f1b (not where F_i directly precedes B_i).
- ``varuna-zb`` -- the varuna family member: the same lists, recomputing on every stage but the
  last (as ``varuna`` does), executed *opportunistically* within a stash bound (Note [Zero-bubble
  policy]): when the list's head is not ready the earliest ready task runs instead, so a late
  activation or gradient is filled with deferred W's and graph-less forwards.

Memory: a micro-batch holds its stage input from F until W (not until B), and its graph (the
activations W needs) from F -- or R -- until W. :func:`peak_in_flight` counts the former; with
recompute the deferred W's hold recomputed graphs (the price of the split, shown in the
benchmark's "graphs held" column).

Example::

    >>> from varuna.core.tasks import format_tasks
    >>> format_tasks(zb_h1_order(2, 3, 1))
    'F0 B0 F1 B1 W0 F2 B2 W1 W2'
    >>> format_tasks(zb_h1_order(2, 3, 0, recompute=True))
    'F0 F1 R0 B0 W0 F2 R1 B1 W1 R2 B2 W2'
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from varuna.core.policy import DEFAULT_STASH_HEADROOM
from varuna.core.schedule_kind import ScheduleKind
from varuna.core.tasks import (
    BACKWARD,
    FORWARD,
    RECOMPUTE,
    WEIGHT,
    Task,
    peak_stashed,
    recomputed,
    task_positions,
)

__all__ = [
    "zb_h1_order",
    "peak_in_flight",
    "validate_split_tasks",
    "ZeroBubblePolicy",
    "ZeroBubbleSchedule",
    "ZBH1Kind",
    "VarunaZBKind",
    "get_zero_bubble_schedule",
]


def zb_h1_order(num_stages: int, num_microbatches: int, stage: int, *, recompute: bool = False) -> list[Task]:
    """ZB-H1's task list of ``stage``: min(P-k-1, Nm) warm-up forwards; then per micro-batch a
    forward (while any are left; first a W if P micro-batches are in flight) and a backward;
    after the last forward a W after each B; the remaining W's last."""
    P, N = num_stages, num_microbatches
    nf = min(P - stage - 1, N)
    out = [Task(FORWARD, i) for i in range(nf)]
    nb = nw = 0
    while nb < N:
        if nf < N:
            if nf - nw >= P:
                out.append(Task(WEIGHT, nw))
                nw += 1
            out.append(Task(FORWARD, nf))
            nf += 1
        out.append(Task(BACKWARD, nb))
        nb += 1
        if nf == N and nw < nb:  # the drain: one deferred W per gradient wait
            out.append(Task(WEIGHT, nw))
            nw += 1
    out.extend(Task(WEIGHT, i) for i in range(nw, N))
    if not recompute:
        return out
    with_r: list[Task] = []
    for t in out:
        if t.op == BACKWARD and not (with_r and with_r[-1] == Task(FORWARD, t.microbatch)):
            with_r.append(Task(RECOMPUTE, t.microbatch))
        with_r.append(t)
    return with_r


def peak_in_flight(tasks: Sequence[Task]) -> int:
    """Most micro-batches whose forward is done and W not yet, along ``tasks``
    (:func:`varuna.core.tasks.peak_stashed` of a split list).

    >>> from varuna.core.tasks import parse_tasks
    >>> peak_in_flight(parse_tasks("F0 F1 B0 B1 W0 W1"))
    2
    """
    return peak_stashed(tasks)


def validate_split_tasks(tasks: Sequence[Task], num_microbatches: int) -> None:
    """Raise ValueError unless every micro-batch has one F, one B and one W, in that order, and at
    most one R, directly before its B."""
    seen = task_positions(tasks, num_microbatches)
    for i in range(num_microbatches):
        f, b, w = (seen.get(Task(op, i), -1) for op in (FORWARD, BACKWARD, WEIGHT))
        if min(f, b, w) < 0 or not f < b < w:
            raise ValueError(f"micro-batch {i} needs F{i}, B{i} and W{i} in that order")
        r = seen.get(Task(RECOMPUTE, i))
        if r is not None and r != b - 1:
            raise ValueError(f"R{i} must directly precede B{i}")


# Per-micro-batch status bits of ZeroBubblePolicy._st.
_A, _G, _F, _R, _B, _W = 1, 2, 4, 8, 16, 32


class ZeroBubblePolicy:
    """Picks the next task of one stage of a split-backward list; the same calls as
    :class:`varuna.core.policy.StagePolicy` (``arrived``, ``next_task``, ``complete``).

    Readiness: F_i needs its activation (stage 0: always) and every earlier forward done; R_i
    needs F_i; B_i needs F_i, R_i if listed, and its gradient (the last stage: none); W_i needs
    B_i. Strict (``opportunistic=False``): the list's head or nothing.

    Note [Zero-bubble policy]: opportunistically, when the head is not ready the earliest ready
    task in list order runs instead, except an R whose gradient has not arrived (rule 2 would
    then idle the stage) and a forward that would put more than ``cap`` micro-batches in flight
    (``cap`` = the list's :func:`peak_in_flight` + ``stash_headroom``). After R_i (rule 2 of
    varuna) only B_i, a W (it frees a graph, keeps none new) or a forward that keeps no graph
    (a recomputed micro-batch: its input is stashed) may run. With inputs on time the head is
    always ready, so the executed order is the static list.

    >>> p = ZeroBubblePolicy(zb_h1_order(2, 2, 1), stage=1, num_stages=2)
    >>> p.next_task() is None      # activation 0 has not arrived
    True
    >>> p.arrived("F", 0); p.next_task()
    Task(op='F', microbatch=0)
    """

    __slots__ = (
        "tasks", "stage", "num_stages", "opportunistic", "stash_headroom", "executed",
        "_pos", "_st", "_rec", "_done", "_head", "_ndone", "_next_f", "_live", "_cap",
        "_awaiting_b", "_open",
    )

    def __init__(
        self,
        tasks: Sequence[Task],
        stage: int,
        num_stages: int,
        opportunistic: bool = False,
        *,
        stash_headroom: int = DEFAULT_STASH_HEADROOM,
    ) -> None:
        if stash_headroom < 0:
            raise ValueError(f"stash_headroom must be >= 0, got {stash_headroom}")
        self.tasks = tuple(tasks)
        self.stage, self.num_stages = stage, num_stages
        self.opportunistic, self.stash_headroom = opportunistic, stash_headroom
        #: tasks in the order they were run
        self.executed: list[Task] = []
        self._pos = {t: p for p, t in enumerate(self.tasks)}
        n = 1 + max((t.microbatch for t in self.tasks), default=-1)
        self._st = bytearray(n)
        self._rec = recomputed(self.tasks)
        self._done = bytearray(len(self.tasks))
        self._head = self._ndone = self._next_f = self._live = 0
        self._cap = peak_in_flight(self.tasks) + (stash_headroom if opportunistic else 0)
        self._awaiting_b: int | None = None
        self._open: set[int] = set()  # forward done, W not: where an R, B or W may be ready

    @property
    def finished(self) -> bool:
        return self._ndone == len(self.tasks)

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def arrived(self, kind: str, microbatch: int) -> None:
        """Record an input: ``kind`` "F" for an activation, "B" for a gradient."""
        if not 0 <= microbatch < len(self._st):
            raise ValueError(
                f"stage {self.stage}: input for micro-batch {microbatch} arrived, but its list has "
                f"micro-batches 0..{len(self._st) - 1}; sender and receiver disagree on the schedule"
            )
        self._st[microbatch] |= _A if kind == FORWARD else _G

    def ready(self, task: Task) -> bool:
        """Whether ``task`` could run now (ignoring rule 2 and the list order)."""
        i = task.microbatch
        p = self._pos.get(task)
        if p is None or self._done[p]:
            return False
        s = self._st[i]
        if task.op == FORWARD:
            return i == self._next_f and (self.stage == 0 or bool(s & _A))
        if task.op == RECOMPUTE:
            return bool(s & _F)
        if task.op == BACKWARD:
            return bool(s & _F) and (bool(s & _R) or i not in self._rec) and (self.is_last or bool(s & _G))
        return bool(s & _B)

    def next_task(self) -> Task | None:
        """The task to run now, or ``None``: wait for the next arrival."""
        if self._awaiting_b is not None:  # rule (2)
            b = Task(BACKWARD, self._awaiting_b)
            if self.ready(b):
                return b
            return self._filler() if self.opportunistic else None
        while self._head < len(self.tasks) and self._done[self._head]:
            self._head += 1
        if self._head == len(self.tasks):
            return None
        head = self.tasks[self._head]
        if self.ready(head):
            return head
        return self._earliest_ready() if self.opportunistic else None

    def _candidates(self) -> list[Task]:
        out = [Task(FORWARD, self._next_f)]
        for i in self._open:
            out += [Task(RECOMPUTE, i), Task(BACKWARD, i), Task(WEIGHT, i)]
        return out

    def _earliest_ready(self) -> Task | None:
        best: tuple[int, Task] | None = None
        for t in self._candidates():
            p = self._pos.get(t)
            if p is None or (best is not None and p >= best[0]) or not self.ready(t):
                continue
            if t.op == FORWARD and self._live >= self._cap:
                continue
            if t.op == RECOMPUTE and not self._st[t.microbatch] & _G:
                continue
            best = (p, t)
        return best[1] if best else None

    def _filler(self) -> Task | None:
        """While B_i waits for its gradient after R_i: a ready W, else a graph-less forward."""
        ws = [Task(WEIGHT, i) for i in self._open if self._st[i] & _B and not self._st[i] & _W]
        if ws:
            return min(ws, key=self._pos.__getitem__)
        f = Task(FORWARD, self._next_f)
        if self._next_f in self._rec and self._live < self._cap and self.ready(f):
            return f
        return None

    def complete(self, task: Task) -> None:
        """Record that ``task`` finished."""
        p = self._pos.get(task)
        if p is None:
            raise ValueError(f"stage {self.stage}: task {task} is not in this stage's list")
        if self._done[p]:
            raise RuntimeError(f"task {task} completed twice on stage {self.stage}")
        self._done[p] = 1
        self._ndone += 1
        self.executed.append(task)
        i, op = task.microbatch, task.op
        if op == FORWARD:
            self._st[i] |= _F
            self._next_f += 1
            self._live += 1
            self._open.add(i)
        elif op == RECOMPUTE:
            self._st[i] |= _R
            self._awaiting_b = i
        elif op == BACKWARD:
            self._st[i] |= _B
            self._awaiting_b = None
        else:
            self._st[i] |= _W
            self._live -= 1
            self._open.discard(i)


@dataclass(frozen=True)
class ZeroBubbleSchedule:
    """The static task lists of one zero-bubble pipeline (the interface of
    ``varuna.core.schedule.Schedule``: ``stages``, ``recomputed``, ``policy``).

    >>> sched = get_zero_bubble_schedule("zb-h1", 2, 2, False)
    >>> [str(t) for t in sched.stages[1]]
    ['F0', 'B0', 'F1', 'B1', 'W0', 'W1']
    """

    kind: str
    num_stages: int
    num_microbatches: int
    recompute: bool
    stages: tuple[tuple[Task, ...], ...]
    opportunistic: bool

    def recomputed(self, stage: int) -> frozenset[int]:
        """Micro-batches whose forward on ``stage`` runs without a graph and is recomputed."""
        return recomputed(self.stages[stage])

    def recomputes(self, stage: int) -> bool:
        return bool(self.recomputed(stage))

    def policy(self, stage: int, *, stash_headroom: int = DEFAULT_STASH_HEADROOM) -> ZeroBubblePolicy:
        """A fresh :class:`ZeroBubblePolicy` for executing ``stage``'s list once."""
        return ZeroBubblePolicy(
            self.stages[stage], stage, self.num_stages, self.opportunistic, stash_headroom=stash_headroom
        )


class ZBH1Kind(ScheduleKind):
    """ZB-H1 (Qi et al.): strict; recomputes when asked on every stage but the last (whose B_i
    directly follows F_i); up to P micro-batches in flight on every stage."""

    name: ClassVar[str] = "zb-h1"
    splits_backward: ClassVar[bool] = True

    def _recomputes(self, *, last: bool, recompute: bool) -> bool:
        return recompute and not last

    def stash_peak(self, num_stages: int, stage: int, num_microbatches: int, *, chunks: int = 1) -> int:
        return min(num_microbatches, num_stages)

    def build(self, num_stages: int, num_microbatches: int, *, recompute: bool = True) -> list[list[Task]]:
        """Static task list of every stage."""
        if num_stages < 1 or num_microbatches < 1:
            raise ValueError(
                f"need num_stages >= 1 and num_microbatches >= 1, got {num_stages}, {num_microbatches}"
            )
        rec = self.effective_recompute(recompute)
        return [
            zb_h1_order(num_stages, num_microbatches, k, recompute=rec and k < num_stages - 1)
            for k in range(num_stages)
        ]

    def pipeline(
        self, num_stages: int, num_microbatches: int, *, recompute: bool = True, chunks: int = 1
    ) -> ZeroBubbleSchedule:
        self.check_chunks(chunks)
        rec = self.effective_recompute(recompute)
        return get_zero_bubble_schedule(self.name, num_stages, num_microbatches, rec)


class VarunaZBKind(ZBH1Kind):
    """The varuna-family zero-bubble kind: ZB-H1's lists, recomputing on every stage but the last
    whatever ``recompute`` says, executed opportunistically (Note [Zero-bubble policy])."""

    name: ClassVar[str] = "varuna-zb"
    opportunistic: ClassVar[bool] = True
    recompute_optional: ClassVar[bool] = False

    def _recomputes(self, *, last: bool, recompute: bool) -> bool:
        return not last


_ZB_KINDS = {k.name: k for k in (ZBH1Kind(), VarunaZBKind())}


@functools.lru_cache(maxsize=128)
def get_zero_bubble_schedule(
    kind: str, num_stages: int, num_microbatches: int, recompute: bool = True
) -> ZeroBubbleSchedule:
    """Cached, immutable :class:`ZeroBubbleSchedule` of ``kind`` (``zb-h1`` or ``varuna-zb``)."""
    k = _ZB_KINDS.get(kind)
    if k is None:
        raise ValueError(f"unknown zero-bubble kind {kind!r}; choose one of {', '.join(_ZB_KINDS)}")
    stages = k.build(num_stages, num_microbatches, recompute=recompute)
    return ZeroBubbleSchedule(
        kind, num_stages, num_microbatches, k.effective_recompute(recompute),
        tuple(tuple(s) for s in stages), k.opportunistic,
    )
