"""Pipeline schedules as data, and the next-task policy that executes them.

This module is the single source of truth for *what* a pipeline stage does and *in which
order*: the runtime's stage executor and the simulator both drive :class:`StagePolicy`
over the static task lists produced by :func:`build_schedule`. It is pure Python (no torch)
so the simulator can import it on a machine without an accelerator.

Terms: a *task* is F (forward), R (recompute) or B (backward) of one micro-batch on one
stage. Micro-batch indices are 0-based and local to one replica pipeline; stages are 0-based
(stage ``num_stages - 1`` is the last, which computes the loss).

Example::

    >>> from varuna.schedule import build_schedule, format_tasks
    >>> format_tasks(build_schedule("gpipe", 2, 3)[0])
    'F0 F1 F2 B2 R1 B1 R0 B0'

Note [Varuna schedule]: the ``varuna`` kind follows the rules of the Varuna paper (EuroSys'22,
§3.2): (1) the recompute of micro-batch i on stage k-1 is placed so that it finishes just
before the gradient of i arrives from stage k; (2) after a recompute the stage waits for that
micro-batch's backward, never starting a new forward in between (that would hold two sets of
full activations); (3) when a forward and a backward are both ready the backward wins; the last
stage never recomputes. We derive the lists by simulating those rules with unit costs F=1,
R=1, B=2 and instantaneous communication. Rule (1) needs the gradient's arrival time before it
happens, so the simulation is iterated to a fixed point: each pass plans recomputes with the
arrival times observed in the previous pass.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "FORWARD",
    "RECOMPUTE",
    "BACKWARD",
    "SCHEDULE_KINDS",
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

#: Schedule kinds the runtime can execute. ``1f1b`` is PipeDream-Flush.
SCHEDULE_KINDS = ("varuna", "gpipe", "1f1b")

_OP_CODE = {FORWARD: 0, RECOMPUTE: 1, BACKWARD: 2}

# Unit costs used to derive the varuna lists (paper §3.2).
_UNIT_F, _UNIT_R, _UNIT_B = 1, 1, 2


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

    def policy(self, stage: int) -> StagePolicy:
        """A fresh :class:`StagePolicy` for executing ``stage``'s list once."""
        return StagePolicy(self.stages[stage], stage, self.num_stages, self.opportunistic)


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
    if num_stages == 1:
        # A single stage is the last stage: it never recomputes.
        return (tuple(t for i in range(num_microbatches) for t in (Task(FORWARD, i), Task(BACKWARD, i))),)
    inf = math.inf
    est = [[inf] * num_microbatches for _ in range(num_stages)]
    seen: list[tuple[tuple[int, ...], ...]] = []
    orders: tuple[tuple[int, ...], ...] = ()
    for _ in range(64):
        orders, arrivals = _varuna_pass(num_stages, num_microbatches, est)
        if orders in seen:
            # Fixed point (or a short cycle, which we break deterministically by taking the
            # first order of the cycle that was found).
            break
        seen.append(orders)
        est = arrivals
    else:
        orders = seen[-1]
    # Passes work on integer task codes (3·i + op); one Task object per code, shared by stages.
    table = [Task(op, i) for i in range(num_microbatches) for op in (FORWARD, RECOMPUTE, BACKWARD)]
    return tuple(tuple(table[c] for c in o) for o in orders)


def _varuna_pass(P: int, N: int, est: list[list[float]]):
    """One event-driven pass with unit costs; returns (orders, observed gradient arrivals).

    Orders are tuples of task codes 3·i + {F: 0, R: 1, B: 2}. The decision rules are those of
    Note [Varuna schedule], inlined in the loop because the varuna lists of a large pipeline
    (P=36, Nm=228: 25k tasks, two passes) are built on the simulator's critical path.
    """
    inf = math.inf
    unit_f, unit_r, unit_b = _UNIT_F, _UNIT_R, _UNIT_B
    act_arrival = [[inf] * N for _ in range(P)]  # when F_i's input is available on stage k
    grad_arrival = [[inf] * N for _ in range(P)]  # when B_i's gradient is available on stage k
    for i in range(N):
        act_arrival[0][i] = 0
    orders: list[list[int]] = [[] for _ in range(P)]
    next_f = [0] * P
    next_r = [0] * P  # next micro-batch to recompute (increasing order)
    pending_b: list[int | None] = [None] * P  # rule (2): micro-batch recomputed and awaiting its backward
    last_fwd_done: list[int | None] = [None] * P  # last stage: F_i done, B_i due
    done_b = [0] * P
    heap = [(0, k) for k in range(P)]
    heapq.heapify(heap)
    push, pop = heapq.heappush, heapq.heappop
    wake_at = [0.0] * P
    last = P - 1
    while heap:
        t, k = pop(heap)
        if t < wake_at[k] or done_b[k] == N:
            continue
        # -- decide: op (0 F, 1 R, 2 B) on micro-batch i, or wait until `wait` --------------
        op = -1
        wait = inf
        if k == last:
            i = last_fwd_done[k]
            if i is not None:
                op = 2
            else:
                f = next_f[k]
                if f < N:
                    if act_arrival[k][f] <= t:
                        op, i = 0, f
                    else:
                        wait = act_arrival[k][f]
        elif pending_b[k] is not None:  # rule (2)
            i = pending_b[k]
            if grad_arrival[k][i] <= t:
                op = 2
            else:
                wait = grad_arrival[k][i]
        else:
            nf = next_f[k]
            f = nf if nf < N else -1
            f_ready = f >= 0 and act_arrival[k][f] <= t
            j = next_r[k] if next_r[k] < nf else -1
            if j >= 0:
                g = grad_arrival[k][j]
                arrival = g if g < inf else est[k][j]
            if f_ready and (j < 0 or t + unit_f + unit_r <= arrival):
                op, i = 0, f
            elif j >= 0:
                if g <= t or t + unit_r >= arrival:
                    op, i = 1, j
                else:
                    wait = arrival - unit_r
                    if f >= 0 and not f_ready:
                        wait = min(wait, act_arrival[k][f])
            elif f >= 0:
                wait = act_arrival[k][f]
        if op < 0:
            if wait < inf:
                wake_at[k] = wait
                push(heap, (wait, k))
            else:
                wake_at[k] = inf  # woken by an arrival below
            continue
        # -- run it -----------------------------------------------------------------------
        orders[k].append(3 * i + op)
        if op == 0:
            end = t + unit_f
            next_f[k] += 1
            if k == last:
                last_fwd_done[k] = i
            else:
                act_arrival[k + 1][i] = end
                if wake_at[k + 1] > end:
                    wake_at[k + 1] = end
                    push(heap, (end, k + 1))
        elif op == 1:
            end = t + unit_r
            next_r[k] += 1
            pending_b[k] = i
        else:
            end = t + unit_b
            done_b[k] += 1
            pending_b[k] = None
            last_fwd_done[k] = None
            if k > 0:
                grad_arrival[k - 1][i] = end
                if wake_at[k - 1] > end:
                    wake_at[k - 1] = end
                    push(heap, (end, k - 1))
        wake_at[k] = end
        push(heap, (end, k))
    return tuple(tuple(o) for o in orders), grad_arrival


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
    R_i done if R_i is in the list. Rule (2) holds always: after R_i only B_i may run.

    When the list's head is not ready and ``opportunistic`` is set, the earliest ready task in
    list order runs instead, except an R whose gradient has not arrived (it would block the
    stage under rule 2) and forwards out of micro-batch order.

    >>> p = StagePolicy([Task("F", 0), Task("B", 0)], stage=1, num_stages=2)
    >>> p.next_task() is None  # activation 0 has not arrived
    True
    >>> p.arrived("F", 0); p.next_task()
    Task(op='F', microbatch=0)
    """

    # Note [StagePolicy speed]: the simulator drives one policy per stage and replica for every
    # task of a mini-batch (P=36, Nm=228: ~25k tasks in a 50 ms budget), so the bookkeeping is
    # integer-keyed: a position table instead of hashing Task objects, and the opportunistic
    # search looks only at the tasks that can be ready — F of the next micro-batch, and R/B of the
    # micro-batches whose forward is done and whose gradient has arrived (on the last stage:
    # whose forward is done) — taking the earliest in list order. That is exactly the task the
    # plain scan of the remaining list would return (tests/test_simulator.py checks it against
    # that scan on random arrival orders).

    __slots__ = (
        "tasks",
        "stage",
        "num_stages",
        "opportunistic",
        "_recomputed",
        "_act",
        "_grad",
        "_awaiting_b",
        "_head",
        "_next_f",
        "executed",
        "_pos",
        "_done_pos",
        "_extra_done",
        "_ndone",
        "_f_done",
        "_r_done",
        "_b_done",
        "_cand",
    )

    def __init__(self, tasks: Sequence[Task], stage: int, num_stages: int, opportunistic: bool = True):
        self.tasks = tuple(tasks)
        self.stage = stage
        self.num_stages = num_stages
        self.opportunistic = opportunistic
        self._recomputed = _recomputed(self.tasks)
        self._act: set[int] = set()
        self._grad: set[int] = set()
        self._awaiting_b: int | None = None
        self._head = 0
        self._next_f = 0
        #: tasks in the order they were run (for tests and timelines)
        self.executed: list[Task] = []
        # _pos[3*i + {F:0, R:1, B:2}] = position of that task in the list (-1: absent).
        size = 3 * (max((t.microbatch for t in self.tasks), default=-1) + 1)
        pos = [-1] * size
        code = _OP_CODE
        for p, t in enumerate(self.tasks):
            j = 3 * t.microbatch + code[t.op]
            if pos[j] < 0:
                pos[j] = p
        self._pos = pos
        self._done_pos = bytearray(len(self.tasks))  # by list position
        self._extra_done: set[Task] = set()  # completed tasks that are not in the list
        self._ndone = 0
        self._f_done: set[int] = set()
        self._r_done: set[int] = set()
        self._b_done: set[int] = set()
        # Micro-batches whose R or B may be ready: forward done, backward not, and (except on
        # the last stage) gradient arrived.
        self._cand: set[int] = set()

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

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
        if kind == FORWARD:
            self._act.add(microbatch)
            return
        self._grad.add(microbatch)
        if microbatch in self._f_done and microbatch not in self._b_done:
            self._cand.add(microbatch)

    def ready(self, task: Task) -> bool:
        i = task.microbatch
        if self.is_done(task):
            return False
        if task.op == FORWARD:
            return i == self._next_f and (self.stage == 0 or i in self._act)
        if task.op == RECOMPUTE:
            return i in self._f_done
        if i not in self._f_done:
            return False
        if i in self._recomputed and i not in self._r_done:
            return False
        return self.stage == self.num_stages - 1 or i in self._grad

    def next_task(self) -> Task | None:
        tasks, done_pos = self.tasks, self._done_pos
        if self._awaiting_b is not None:  # rule (2)
            i = self._awaiting_b
            j = 3 * i + 2
            p = self._pos[j] if j < len(self._pos) else -1
            if p < 0:  # B_i is not in the list (a malformed list): the general check
                b = Task(BACKWARD, i)
                return b if self.ready(b) else None
            if (
                not done_pos[p]
                and i in self._f_done
                and (i not in self._recomputed or i in self._r_done)
                and (self.stage == self.num_stages - 1 or i in self._grad)
            ):
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
        if op == FORWARD:
            if i == self._next_f and (self.stage == 0 or i in self._act):
                return first
        elif op == RECOMPUTE:
            if i in self._f_done:
                return first
        elif (
            i in self._f_done
            and (i not in self._recomputed or i in self._r_done)
            and (self.stage == self.num_stages - 1 or i in self._grad)
        ):
            return first
        if not self.opportunistic:
            return None
        # Earliest ready task after the head (the head is not ready, and all before it are done);
        # see Note [StagePolicy speed].
        pos, size = self._pos, len(self._pos)
        best = n
        i = self._next_f
        j = 3 * i
        if j < size and pos[j] >= 0 and not done_pos[pos[j]] and (self.stage == 0 or i in self._act):
            best = pos[j]
        grad, recomputed, r_done = self._grad, self._recomputed, self._r_done
        for i in self._cand:
            j = 3 * i
            if j >= size:
                continue
            p = pos[j + 1]  # R_i: F_i done; opportunistically only once its gradient is here
            if 0 <= p < best and not done_pos[p] and i in grad:
                best = p
            p = pos[j + 2]  # B_i: F_i done, R_i done if listed, gradient here (or last stage)
            if 0 <= p < best and not done_pos[p] and (i not in recomputed or i in r_done):
                best = p
        return tasks[best] if best < n else None

    def complete(self, task: Task) -> None:
        i, op = task.microbatch, task.op
        # self._position(task), inlined (hot path).
        pos = self._pos
        j = 3 * i + _OP_CODE.get(op, 0)
        p = pos[j] if 0 <= j < len(pos) else -1
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
            self._f_done.add(i)
            if (self.stage == self.num_stages - 1 or i in self._grad) and i not in self._b_done:
                self._cand.add(i)
            self._awaiting_b = None
        elif op == RECOMPUTE:
            self._r_done.add(i)
            self._awaiting_b = i
        else:
            self._b_done.add(i)
            self._cand.discard(i)
            self._awaiting_b = None
