"""The next-task policy that executes a stage's task list: :class:`StagePolicy`.

The runtime's stage executor and the simulator both drive it over the static lists of
``varuna.core.schedule`` (pure Python, no torch). It owns every out-of-list decision: Notes
[StagePolicy speed], [Filling the wait] and [Keeping the next stage fed] below.

Example::

    >>> from varuna.core.tasks import parse_tasks
    >>> p = StagePolicy(parse_tasks("F0 B0"), stage=1, num_stages=2)
    >>> p.arrived("F", 0); p.next_task()
    Task(op='F', microbatch=0)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from varuna.core.tasks import BACKWARD, FORWARD, RECOMPUTE, Task

__all__ = ["DEFAULT_STASH_HEADROOM", "StagePolicy"]

#: How many boundary inputs past its list's own peak a varuna stage may stash by running
#: forwards out of list order (Notes [Filling the wait] and [Keeping the next stage fed]).
DEFAULT_STASH_HEADROOM = 4

_OP_CODE = {FORWARD: 0, RECOMPUTE: 1, BACKWARD: 2}


class StagePolicy:
    """Picks the next task of one stage given what has arrived. Pure bookkeeping, no I/O.

    The executor (and the simulator) calls :meth:`arrived` when an input lands, asks
    :meth:`next_task` for something to run (``None``: wait for the next arrival) and calls
    :meth:`complete` when it finishes. Readiness: F_i needs its activation (stage 0 reads data,
    always ready); R_i needs F_i done; B_i needs its gradient (the last stage: F_i done) and
    R_i done if R_i is in the list.

    When the list's head is not ready and ``opportunistic`` is set, the earliest ready task in
    list order runs instead, except an R whose gradient has not arrived (it would block the
    stage under rule 2) and forwards out of micro-batch order. Rule (2) holds for everything
    that keeps a graph: after R_i, no other R or B and no graph-keeping forward runs before B_i.
    An opportunistic policy may also run the next forward early if it keeps no graph (it only
    stashes its input) and fewer than ``peak + stash_headroom`` inputs are stashed, ``peak``
    being the list's own :func:`peak_stashed`: while the stage waits for B_i's gradient (Note
    [Filling the wait]), and in place of an R when fewer of its micro-batches are still
    downstream than the list plans at that R (Note [Keeping the next stage fed]).

    >>> p = StagePolicy([Task("F", 0), Task("B", 0)], stage=1, num_stages=2)
    >>> p.next_task() is None  # activation 0 has not arrived
    True
    >>> p.arrived("F", 0); p.next_task()
    Task(op='F', microbatch=0)
    """

    # Note [StagePolicy speed]: the simulator drives one policy per stage and replica for every
    # task of a mini-batch (P=36, Nm=228: ~25k tasks in a 50 ms budget), so the bookkeeping is
    # integer-keyed: a position table and one status byte per micro-batch instead of hashing
    # Task objects, and the opportunistic search looks only at the tasks that can be ready --
    # F of the next micro-batch, and R/B of the micro-batches whose forward is done and whose
    # gradient has arrived (on the last stage: whose forward is done) -- taking the earliest in
    # list order. That is exactly the task the plain scan of the remaining list would return
    # (tests/test_simulator.py checks it against that scan on random arrival orders).
    #
    # Note [Filling the wait]: the varuna lists place R_i to end just as B_i's gradient arrives
    # (rule 1), with unit costs and instant links. On a real network the gradient is often late
    # and rule (2) idles the stage. A forward on a recomputing stage keeps no graph, so running
    # the next one in that gap costs one more stashed boundary input, not a second set of
    # activations. It is done only when the stage would otherwise idle, so with on-time inputs
    # the executed order is still the static list. The cap keeps the stash within what the list
    # itself needs plus ``stash_headroom`` (simulating the schedule benchmark's P=4 cluster with
    # the runtime's 0.9 ms hand-off, headroom 0 -> 1 -> 2 gives 0.95 -> 0.99 of ideal without
    # jitter, 0.92 -> 0.96 at moderate and 0.80 -> 0.84 -> 0.86 at heavy jitter; with the rule
    # of the next Note, 2 -> 4 gives 0.875 -> 0.881 at heavy and more gains little, hence
    # DEFAULT_STASH_HEADROOM = 4; see docs/benchmarks.md).
    #
    # Note [Keeping the next stage fed]: the lists send forwards in blocks (stage P-2: three
    # forwards, three R/B pairs, three forwards, ...) timed so that, at unit costs and instant
    # links, the next stage's inputs run out just as the next block arrives. When the
    # gradients come back *early* relative to that plan (typically after this stage itself was
    # held up by a slow link), the next stage has drained its inputs and idles through the
    # whole R/B block. So where the list would run R_i, the policy counts this stage's
    # micro-batches still downstream (forwards done minus gradients arrived) and, if that is
    # below what the list has at that point with on-time inputs (forwards listed before R_i
    # minus i), runs the next graph-less forward first, within the same stash cap. On-time
    # inputs never trigger it (the counts are equal), so the executed order is still the
    # static list. Late gradients do not trigger it directly (more are downstream, not fewer),
    # but a forward that filled their wait runs ahead of the list, after which on-time
    # gradients look early and this rule keeps the lead -- as intended under jitter.
    # Simulating the schedule benchmark's cluster at heavy jitter (2 ms + Exp(10 ms) per
    # message), this rule with headroom 4 gives 0.859 -> 0.881 of ideal at P=4, 0.748 -> 0.770
    # at P=8, and leaves none/moderate unchanged (docs/benchmarks.md, Finding 6).

    __slots__ = (
        "tasks",
        "stage",
        "num_stages",
        "opportunistic",
        "stash_headroom",
        "executed",
        "_pos",
        "_rec",
        "_st",
        "_last",
        "_cap",
        "_awaiting_b",
        "_head",
        "_next_f",
        "_live",
        "_done_pos",
        "_extra_done",
        "_ndone",
        "_cand",
        "_plan",
        "_ngrad",
        "_feeds",
        "_first",
    )

    def __init__(
        self,
        tasks: Sequence[Task],
        stage: int,
        num_stages: int,
        opportunistic: bool = True,
        *,
        stash_headroom: int = DEFAULT_STASH_HEADROOM,
        chunked: bool = False,
        _template: _PolicyTemplate | None = None,
    ):
        if stash_headroom < 0:
            raise ValueError(f"stash_headroom must be >= 0, got {stash_headroom}")
        self.tasks = tuple(tasks)
        self.stage = stage
        self.num_stages = num_stages
        self.opportunistic = opportunistic
        self.stash_headroom = stash_headroom
        #: tasks in the order they were run (for tests and timelines)
        self.executed: list[Task] = []
        tpl = _template if _template is not None else _PolicyTemplate.of(self.tasks)
        self._pos = tpl.pos  # shared, read-only
        self._rec = tpl.recomputed  # shared, read-only
        self._plan = tpl.planned_downstream  # shared, read-only
        self._ngrad = 0  # gradients arrived for micro-batches whose forward is done
        # ``chunked``: one device of an interleaved pipeline (varuna/core/interleaved.py): no
        # micro-batch is implicitly a source or a sink, its caller marks them with ``arrived``;
        # the feeding rule assumes backwards in micro-batch order, which interleaved lists lack.
        self._first = stage == 0 and not chunked
        self._last = stage == num_stages - 1 and not chunked
        self._feeds = opportunistic and not self._last and not chunked  # Note [Keeping the next stage fed]
        self._st = bytearray(tpl.num_microbatches)
        self._cap = tpl.peak + stash_headroom
        self._awaiting_b: int | None = None
        self._head = 0
        self._next_f = 0
        self._live = 0
        self._done_pos = bytearray(len(self.tasks))  # by list position
        self._extra_done: set[Task] = set()  # completed tasks that are not in the list
        self._ndone = 0
        # Micro-batches whose R or B may be ready: forward done, backward not, and (except on
        # the last stage) gradient arrived.
        self._cand: set[int] = set()

    @property
    def is_first(self) -> bool:
        return self._first

    @property
    def is_last(self) -> bool:
        return self._last

    @property
    def finished(self) -> bool:
        return self._ndone == len(self.tasks)

    def _position(self, task: Task) -> int:
        j = 3 * task.microbatch + _OP_CODE.get(task.op, 0)
        if 0 <= j < len(self._pos):
            p = self._pos[j]
            if p >= 0:
                t = self.tasks[p]
                if t is task or t == task:
                    return p
        return -1

    def is_done(self, task: Task) -> bool:
        p = self._position(task)
        return self._done_pos[p] == 1 if p >= 0 else task in self._extra_done

    def arrived(self, kind: str, microbatch: int) -> None:
        """Record an input: ``kind`` "F" for an activation, "B" for a gradient."""
        st = self._st
        if not 0 <= microbatch < len(st):
            raise ValueError(
                f"stage {self.stage}: input for micro-batch {microbatch} arrived, but its list has "
                f"micro-batches 0..{len(st) - 1}; sender and receiver disagree on the schedule"
            )
        if kind == FORWARD:
            st[microbatch] |= _A
            return
        s = st[microbatch]
        if s & (_G | _F) == _F:  # counted once, and only for a forward done (else: at complete)
            self._ngrad += 1
        s |= _G
        st[microbatch] = s
        if s & (_F | _B) == _F:
            self._cand.add(microbatch)

    def ready(self, task: Task) -> bool:
        """Whether ``task`` could run now (ignoring rule 2 and the list order)."""
        i = task.microbatch
        if self.is_done(task) or not 0 <= i < len(self._st):
            return False
        s = self._st[i]
        if task.op == FORWARD:
            return i == self._next_f and (self._first or s & _A != 0)
        if task.op == RECOMPUTE:
            return s & _F != 0
        if not s & _F:
            return False
        if self._rec[i] and not s & _R:
            return False
        return self._last or s & _G != 0

    def next_task(self) -> Task | None:
        """The task to run now, or ``None``: wait for the next arrival."""
        if self._awaiting_b is not None:  # rule (2)
            return self._next_awaiting_b(self._awaiting_b)
        tasks, done_pos = self.tasks, self._done_pos
        n = len(tasks)
        head = self._head
        while head < n and done_pos[head]:
            head += 1
        self._head = head
        if head == n:
            return None
        first = tasks[head]
        # ready(first), inlined (hot path); ``first`` is not done.
        i, op = first.microbatch, first.op
        s = self._st[i]
        if op == FORWARD:
            if i == self._next_f and (self._first or s & _A):
                return first
        elif op == RECOMPUTE:
            if s & _F:
                # Note [Keeping the next stage fed]; the cheap test inline (hot path).
                if self._next_f - self._ngrad < self._plan[i] and self._feeds:
                    return self._feed_first(first)
                return first
        elif s & _F and (s & _R or not self._rec[i]) and (self._last or s & _G):
            return first
        if not self.opportunistic:
            return None
        return self._earliest_ready()

    def _next_awaiting_b(self, i: int) -> Task | None:
        """Rule (2): after R_i only B_i, or (Note [Filling the wait]) a graph-less forward."""
        tasks, done_pos, st, pos = self.tasks, self._done_pos, self._st, self._pos
        p = pos[3 * i + 2]
        if p < 0:  # B_i is not in the list (a malformed list): the general check
            b = Task(BACKWARD, i)
            return b if self.ready(b) else None
        s = st[i]
        if not done_pos[p] and s & _F and (s & _R or not self._rec[i]) and (self._last or s & _G):
            return tasks[p]
        # Note [Filling the wait]: a graph-less forward may use the gap.
        if self.opportunistic and self._live < self._cap:
            i = self._next_f
            if i < len(st) and self._rec[i] and (self._first or st[i] & _A):
                p = pos[3 * i]
                if p >= 0 and not done_pos[p]:
                    return tasks[p]
        return None

    def _earliest_ready(self) -> Task | None:
        """Earliest ready task after the head (the head is not ready, and all before it are
        done); see Note [StagePolicy speed]."""
        tasks, done_pos, st, pos = self.tasks, self._done_pos, self._st, self._pos
        n = len(tasks)
        size = len(pos)
        best = n
        i = self._next_f
        j = 3 * i
        if j < size and pos[j] >= 0 and not done_pos[pos[j]] and (self._first or st[i] & _A):
            best = pos[j]
        rec = self._rec
        for i in self._cand:
            j = 3 * i
            s = st[i]
            p = pos[j + 1]  # R_i: F_i done; opportunistically only once its gradient is here
            if 0 <= p < best and not done_pos[p] and s & _G:
                best = p
            p = pos[j + 2]  # B_i: F_i done, R_i done if listed, gradient here (or last stage)
            if 0 <= p < best and not done_pos[p] and (s & _R or not rec[i]):
                best = p
        if best == n:
            return None
        task = tasks[best]
        if task.op == RECOMPUTE and self._next_f - self._ngrad < self._plan[task.microbatch] and self._feeds:
            return self._feed_first(task)
        return task

    def _feed_first(self, r: Task) -> Task:
        """``r`` (an R the list would run now), or the next forward in its place: Note [Keeping
        the next stage fed]."""
        i = self._next_f
        if i - self._ngrad >= self._plan[r.microbatch] or self._live >= self._cap or not self._feeds:
            return r
        st = self._st
        if i < len(st) and self._rec[i] and (self._first or st[i] & _A):
            p = self._pos[3 * i]
            if p >= 0 and not self._done_pos[p]:
                return self.tasks[p]
        return r

    def complete(self, task: Task) -> None:
        i, op = task.microbatch, task.op
        st = self._st
        if not 0 <= i < len(st):
            raise ValueError(f"stage {self.stage}: task {task} is outside this stage's micro-batches")
        # self._position(task), inlined (hot path).
        p = self._pos[3 * i + (0 if op == FORWARD else 1 if op == RECOMPUTE else 2)]
        if p >= 0:
            t = self.tasks[p]
            if t is not task and t != task:
                p = -1
        if p >= 0:
            if self._done_pos[p]:
                raise RuntimeError(f"task {task} completed twice on stage {self.stage}")
            self._done_pos[p] = 1
        else:  # not in the list: the executor ran something else; remember it all the same
            if task in self._extra_done:
                raise RuntimeError(f"task {task} completed twice on stage {self.stage}")
            self._extra_done.add(task)
        self._ndone += 1
        self.executed.append(task)
        if op == FORWARD:
            self._next_f += 1
            self._live += 1
            s = st[i] | _F
            st[i] = s
            if s & _G:  # its gradient came first (only a hand-driven policy sees that)
                self._ngrad += 1
            if (self._last or s & _G) and not s & _B:
                self._cand.add(i)
            # A forward run while waiting for B_i (Note [Filling the wait]) leaves rule 2 in force.
        elif op == RECOMPUTE:
            st[i] |= _R
            self._awaiting_b = i
        else:
            st[i] |= _B
            self._live -= 1
            self._cand.discard(i)
            self._awaiting_b = None


# Per-micro-batch status bits of StagePolicy._st.
_F, _R, _B, _G, _A = 1, 2, 4, 8, 16


@dataclass(frozen=True, slots=True)
class _PolicyTemplate:
    """What every policy over one task list shares: built once per list (Note [StagePolicy speed])."""

    pos: list[int]
    """pos[3·i + {F: 0, R: 1, B: 2}]: that task's position in the list, -1 if absent."""
    recomputed: bytes
    """recomputed[i] = 1 if the list recomputes micro-batch i."""
    num_microbatches: int
    peak: int
    """peak_stashed(list)."""
    planned_downstream: list[int]
    """planned_downstream[i]: forwards listed before R_i minus i -- the micro-batches still
    downstream when R_i runs with on-time inputs (0 where R_i is not listed)."""

    @classmethod
    def of(cls, tasks: Sequence[Task]) -> _PolicyTemplate:
        # Comprehensions and C-level helpers: built on the simulator's cold path (25k tasks).
        mbs = [t.microbatch for t in tasks]
        ops = [t.op for t in tasks]
        if mbs and min(mbs) < 0:
            raise ValueError(f"task list has a negative micro-batch index ({min(mbs)})")
        n = max(mbs, default=-1) + 1
        code = _OP_CODE
        keys = [3 * i + code[op] for i, op in zip(mbs, ops)]
        pos = [-1] * (3 * n)
        for p in range(len(keys) - 1, -1, -1):  # backwards: the first occurrence wins
            pos[keys[p]] = p
        rec = bytearray(n)
        for i in {i for i, op in zip(mbs, ops) if op == RECOMPUTE}:
            rec[i] = 1
        step = {FORWARD: 1, RECOMPUTE: 0, BACKWARD: -1}
        peak = max(itertools.accumulate(map(step.__getitem__, ops), initial=0))
        plan = [0] * n
        nf = 0
        for i, op in zip(mbs, ops):
            if op == FORWARD:
                nf += 1
            elif op == RECOMPUTE:
                plan[i] = nf - i
        return cls(pos, bytes(rec), n, peak, plan)
