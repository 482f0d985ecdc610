"""Pipeline schedules as data, and the next-task policy that executes them.

This module is the single source of truth for *what* a pipeline stage does and *in which
order*: the runtime's stage executor and the simulator both drive :class:`StagePolicy`
over the static task lists produced by :func:`build_schedule`. It is pure Python (no torch)
so the simulator can import it on a machine without an accelerator.

Terms: a *task* is F (forward), R (recompute) or B (backward) of one micro-batch on one
stage. Micro-batch indices are 0-based and local to one replica pipeline; stages are 0-based
(stage ``num_stages - 1`` is the last, which computes the loss).

Example::

    >>> from varuna.core.schedule import build_schedule, format_tasks
    >>> format_tasks(build_schedule("gpipe", 2, 3)[0])
    'F0 F1 F2 B2 R1 B1 R0 B0'

Note [Varuna schedule]: the ``varuna`` kind follows the rules of the Varuna paper (EuroSys'22,
§3.2): (1) the recompute of micro-batch i on stage k-1 is placed so that it finishes just
before the gradient of i arrives from stage k; (2) after a recompute the stage waits for that
micro-batch's backward, never starting a new forward in between (that would hold two sets of
full activations); (3) when a forward and a backward are both ready the backward wins; the last
stage never recomputes. Simulating those rules with unit costs F=1, R=1, B=2 and instantaneous
communication (iterated to a fixed point, since rule (1) needs each gradient's arrival time
before it happens) yields lists with a simple closed form, which :func:`_varuna` builds
directly: the rule simulation is kept as the reference in ``tests/schedule_reference.py``, and
the tests check the two agree for every P <= 12, Nm <= 40 and larger samples. (The closed form
matters for speed: the simulator re-plans on every preemption, and the lists of a P=36, Nm=228
pipeline took 25-45 ms to derive by simulation, ~1 ms in closed form.)
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "FORWARD",
    "RECOMPUTE",
    "BACKWARD",
    "SCHEDULE_KINDS",
    "DEFAULT_STASH_HEADROOM",
    "Task",
    "Schedule",
    "StagePolicy",
    "build_schedule",
    "get_schedule",
    "format_tasks",
    "parse_tasks",
    "validate_stage_tasks",
    "peak_stashed",
]

FORWARD = "F"
RECOMPUTE = "R"
BACKWARD = "B"

#: How many boundary inputs past its list's own peak a varuna stage may stash by running
#: forwards out of list order (Notes [Filling the wait] and [Keeping the next stage fed]).
DEFAULT_STASH_HEADROOM = 4

#: Schedule kinds the runtime can execute. ``1f1b`` is PipeDream-Flush.
SCHEDULE_KINDS = ("varuna", "gpipe", "1f1b")

_OP_CODE = {FORWARD: 0, RECOMPUTE: 1, BACKWARD: 2}


@dataclass(frozen=True, slots=True, order=True)
class Task:
    """One unit of work of a stage: ``op`` in {"F", "R", "B"} on ``microbatch`` (0-based).

    >>> Task("F", 3)
    Task(op='F', microbatch=3)
    >>> str(Task("B", 0))
    'B0'
    """

    op: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Task:
        """Parse the string form (``"F3"``) back into a Task."""
        text = text.strip()
        if len(text) < 2 or text[0] not in (FORWARD, RECOMPUTE, BACKWARD) or not text[1:].isdigit():
            raise ValueError(f"cannot parse task {text!r}: expected F<i>, R<i> or B<i> with i >= 0")
        return cls(text[0], int(text[1:]))


def format_tasks(tasks: Iterable[Task]) -> str:
    """Space-separated string form of a task list (``"F0 F1 R0 B0"``)."""
    return " ".join(str(t) for t in tasks)


def parse_tasks(text: str) -> list[Task]:
    """Inverse of :func:`format_tasks`."""
    return [Task.parse(tok) for tok in text.split()]


@dataclass(frozen=True)
class Schedule:
    """The static task lists of one pipeline: ``stages[k]`` is stage k's ordered tasks.

    ``opportunistic`` says whether the executor may run a ready task ahead of a blocked one
    (true for ``varuna``; the baselines execute their list strictly, as their papers define).
    """

    kind: str
    num_stages: int
    num_microbatches: int
    recompute: bool
    stages: tuple[tuple[Task, ...], ...]

    @property
    def opportunistic(self) -> bool:
        return self.kind == "varuna"

    def recomputed(self, stage: int) -> frozenset[int]:
        """Micro-batches whose forward on ``stage`` runs without a graph and is recomputed."""
        return _recomputed(self.stages[stage])

    def policy(self, stage: int, *, stash_headroom: int = DEFAULT_STASH_HEADROOM) -> StagePolicy:
        """A fresh :class:`StagePolicy` for executing ``stage``'s list once."""
        return StagePolicy(
            self.stages[stage],
            stage,
            self.num_stages,
            self.opportunistic,
            stash_headroom=stash_headroom,
            _template=self._templates[stage],
        )

    @functools.cached_property
    def _templates(self) -> tuple[_PolicyTemplate, ...]:
        # Shared by every policy built from this (cached, immutable) schedule.
        return tuple(_PolicyTemplate.of(s) for s in self.stages)


def _recomputed(tasks: Sequence[Task]) -> frozenset[int]:
    return frozenset(t.microbatch for t in tasks if t.op == RECOMPUTE)


def _check_args(kind: str, num_stages: int, num_microbatches: int) -> None:
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}; choose one of {', '.join(SCHEDULE_KINDS)}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def build_schedule(
    kind: str, num_stages: int, num_microbatches: int, *, recompute: bool = True
) -> list[list[Task]]:
    """Static task list of every stage for ``kind`` with P=num_stages, Nm=num_microbatches.

    ``recompute`` applies to ``gpipe`` and ``1f1b``; ``varuna`` always recomputes (on every stage
    but the last). A recompute R_i is placed right before B_i unless F_i directly precedes B_i
    (then F_i simply keeps its graph).

    >>> format_tasks(build_schedule("1f1b", 2, 3, recompute=False)[0])
    'F0 F1 B0 F2 B1 B2'
    """
    _check_args(kind, num_stages, num_microbatches)
    if kind == "varuna":
        return [list(s) for s in _varuna(num_stages, num_microbatches)]
    if kind == "gpipe":
        base = [
            [Task(FORWARD, i) for i in range(num_microbatches)]
            + [Task(BACKWARD, i) for i in reversed(range(num_microbatches))]
            for _ in range(num_stages)
        ]
    else:  # 1f1b (PipeDream-Flush)
        base = []
        for k in range(num_stages):
            warmup = min(num_stages - k - 1, num_microbatches)
            tasks = [Task(FORWARD, i) for i in range(warmup)]
            nf, nb = warmup, 0
            while nb < num_microbatches:
                if nf < num_microbatches:
                    tasks.append(Task(FORWARD, nf))
                    nf += 1
                tasks.append(Task(BACKWARD, nb))
                nb += 1
            base.append(tasks)
    return [_insert_recompute(t) for t in base] if recompute else base


def _insert_recompute(tasks: list[Task]) -> list[Task]:
    out: list[Task] = []
    for t in tasks:
        if t.op == BACKWARD and not (out and out[-1] == Task(FORWARD, t.microbatch)):
            out.append(Task(RECOMPUTE, t.microbatch))
        out.append(t)
    return out


@functools.lru_cache(maxsize=256)
def get_schedule(kind: str, num_stages: int, num_microbatches: int, recompute: bool = True) -> Schedule:
    """Cached, immutable :class:`Schedule` (what the runtime and the simulator use)."""
    stages = build_schedule(kind, num_stages, num_microbatches, recompute=recompute)
    rec = True if kind == "varuna" else recompute
    return Schedule(
        kind, num_stages, num_microbatches, rec and num_stages > 0, tuple(tuple(s) for s in stages)
    )


# ---------------------------------------------------------------------------------------------
# Varuna list derivation (see Note [Varuna schedule])


def _varuna(num_stages: int, num_microbatches: int) -> tuple[tuple[Task, ...], ...]:
    """The varuna lists in closed form (Note [Varuna schedule]).

    Stage k < P-1, with d = P-1-k stages after it: min(3d, Nm) forwards (at F=R=1, B=2 its first
    gradient arrives after 3d units: d forwards down, the last stage's F+B, d-1 backwards up),
    then blocks of three just-in-time R_i B_i pairs alternating with the next three forwards
    until the forwards run out, then the remaining pairs. The last stage alternates F_i B_i.
    """
    P, N = num_stages, num_microbatches
    F = [Task(FORWARD, i) for i in range(N)]
    RB = [(Task(RECOMPUTE, i), Task(BACKWARD, i)) for i in range(N)]
    last = tuple(t for i in range(N) for t in (F[i], RB[i][1]))
    stages = []
    for k in range(P - 1):
        nf = min(3 * (P - 1 - k), N)
        tasks = F[:nf]
        nb = 0
        while nb < N:
            e = min(nb + 3, nf)
            for i in range(nb, e):
                tasks.extend(RB[i])
            nb = e
            if nf < N:
                e = min(nf + 3, N)
                tasks.extend(F[nf:e])
                nf = e
        stages.append(tuple(tasks))
    stages.append(last)
    return tuple(stages)


# ---------------------------------------------------------------------------------------------
# Validation helpers


def validate_stage_tasks(
    tasks: Sequence[Task], num_microbatches: int, *, forbid_recompute: bool = False
) -> None:
    """Raise ValueError unless ``tasks`` is a well-formed list for one stage.

    Every micro-batch has exactly one F and one B, F before B, at most one R placed between them,
    and (rule 2) an R is immediately followed by its own B. ``forbid_recompute``: no R at all
    (varuna's last stage).
    """
    seen: dict[Task, int] = {}
    for pos, t in enumerate(tasks):
        if not 0 <= t.microbatch < num_microbatches:
            raise ValueError(f"task {t} at position {pos} is outside 0..{num_microbatches - 1}")
        if t in seen:
            raise ValueError(f"task {t} appears twice (positions {seen[t]} and {pos})")
        seen[t] = pos
    for i in range(num_microbatches):
        f, b, r = Task(FORWARD, i), Task(BACKWARD, i), Task(RECOMPUTE, i)
        if f not in seen or b not in seen:
            raise ValueError(f"micro-batch {i} lacks its F or B task")
        if seen[f] > seen[b]:
            raise ValueError(f"B{i} comes before F{i}")
        if r in seen:
            if forbid_recompute:
                raise ValueError(f"this stage must not recompute (found R{i})")
            if not seen[f] < seen[r] < seen[b]:
                raise ValueError(f"R{i} must lie between F{i} and B{i}")
            if seen[b] != seen[r] + 1:
                raise ValueError(f"R{i} must be followed directly by B{i} (rule 2)")


def peak_stashed(tasks: Sequence[Task]) -> int:
    """Most micro-batches whose forward is done and backward not yet, along ``tasks``."""
    live = peak = 0
    for t in tasks:
        if t.op == FORWARD:
            live += 1
            peak = max(peak, live)
        elif t.op == BACKWARD:
            live -= 1
    return peak


# ---------------------------------------------------------------------------------------------
# The next-task policy (shared by the runtime executor and the simulator)


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
    )

    def __init__(
        self,
        tasks: Sequence[Task],
        stage: int,
        num_stages: int,
        opportunistic: bool = True,
        *,
        stash_headroom: int = DEFAULT_STASH_HEADROOM,
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
        self._feeds = opportunistic and stage != num_stages - 1  # Note [Keeping the next stage fed]
        self._st = bytearray(tpl.num_microbatches)
        self._last = stage == num_stages - 1
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
        return self.stage == 0

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
            return i == self._next_f and (self.stage == 0 or s & _A != 0)
        if task.op == RECOMPUTE:
            return s & _F != 0
        if not s & _F:
            return False
        if self._rec[i] and not s & _R:
            return False
        return self._last or s & _G != 0

    def next_task(self) -> Task | None:
        tasks, done_pos, st, pos = self.tasks, self._done_pos, self._st, self._pos
        i = self._awaiting_b
        if i is not None:  # rule (2)
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
                if i < len(st) and self._rec[i] and (self.stage == 0 or st[i] & _A):
                    p = pos[3 * i]
                    if p >= 0 and not done_pos[p]:
                        return tasks[p]
            return None
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
        s = st[i]
        if op == FORWARD:
            if i == self._next_f and (self.stage == 0 or s & _A):
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
        # Earliest ready task after the head (the head is not ready, and all before it are done);
        # see Note [StagePolicy speed].
        size = len(pos)
        best = n
        i = self._next_f
        j = 3 * i
        if j < size and pos[j] >= 0 and not done_pos[pos[j]] and (self.stage == 0 or st[i] & _A):
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
        if i < len(st) and self._rec[i] and (self.stage == 0 or st[i] & _A):
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
