"""Pipeline schedules as data: the schedule kinds, their registry and their static task lists.

This module is the single source of truth for *what* a pipeline stage does and *in which
order*: the runtime's stage executor and the simulator both drive
:class:`varuna.core.policy.StagePolicy` over the static task lists produced by
:func:`build_schedule`. Every fact that differs between kinds (which stages recompute, stash
peaks, balancing costs) is owned by the kind's object, :func:`schedule_kind` (Note [Schedule
kinds]). It is pure Python (no torch) so the simulator can import it on a machine without an
accelerator.

Terms: a *task* is F (forward), R (recompute) or B (backward) of one micro-batch on one
stage. Micro-batch indices are 0-based and local to one replica pipeline; stages are 0-based
(stage ``num_stages - 1`` is the last, which computes the loss).

Example::

    >>> from varuna.core.tasks import format_tasks
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

Note [Schedule kinds]: a kind is a :class:`varuna.core.schedule_kind.ScheduleKind` registered
here by name (like torch pipelining's ``get_schedule_class``). Callers ask it -- never compare
the name -- so a fact such as "the last 1f1b stage never recomputes" is stated once: the
partitioner's costs (:meth:`~varuna.core.schedule_kind.ScheduleKind.balancing_costs`), the
simulator's memory estimates and the auto-configurator's bounds all follow from it, and the
tests check it against the task lists. ``SCHEDULE_KINDS`` are the kinds the runtime executes
(every registered one today, the chunked ``interleaved`` kinds of ``varuna/core/interleaved.py``
included); ``ALL_SCHEDULE_KINDS`` adds any simulation-only kind; ``LIST_SCHEDULE_KINDS`` are those
with one flat list per stage (:func:`build_schedule`).

Note [2BW]: ``2bw`` is PipeDream-2BW (Narayanan et al., ICML'21), the one asynchronous kind
(``weight_versions == 2``): the gradient of step t is computed on the weights W(t-2) (after t-2
updates) while the update applies to the newest, W(t) = W(t-1) - lr * grad f_t(W(t-2)) with the
optimizer's rule -- the update of step t is first used by step t+2. That lets mini-batch t+1's
forwards start while mini-batch t's backwards drain: no pipeline flush, each micro-batch on one
weight version on every stage. Its window (:meth:`TwoBWKind.window`) is therefore 1F1B over
several mini-batches back to back (micro-batch s*Nm + i is micro-batch i of the s-th): what
``Engine.train_steps`` executes (each stage updating right after its own last backward of each
mini-batch, Note [No-flush window] in ``varuna/runtime/no_flush.py``) and what the simulator runs
to price a step in steady state. ``Engine.train_step`` runs one mini-batch's list (the window of
one) with a flush after it, on the same weight versions (``varuna/runtime/weight_versions.py``).
Training is NOT the same as on one device with the synchronous rule.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from varuna.core.interleaved import InterleavedKind, VarunaInterleavedKind
from varuna.core.policy import DEFAULT_STASH_HEADROOM, StagePolicy, _PolicyTemplate
from varuna.core.schedule_kind import ScheduleKind
from varuna.core.tasks import BACKWARD, FORWARD, RECOMPUTE, Task, recomputed
from varuna.core.zero_bubble import VarunaZBKind, ZBH1Kind, ZeroBubbleSchedule

__all__ = [
    "DEFAULT_SCHEDULE",
    "PLANNED_KINDS",
    "SCHEDULE_KINDS",
    "ALL_SCHEDULE_KINDS",
    "LIST_SCHEDULE_KINDS",
    "Schedule",
    "ListScheduleKind",
    "TwoBWKind",
    "schedule_kind",
    "CHUNK_FLAGS",
    "chunks_problem",
    "build_schedule",
    "get_schedule",
]


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
        return schedule_kind(self.kind).opportunistic

    def recomputed(self, stage: int) -> frozenset[int]:
        """Micro-batches whose forward on ``stage`` runs without a graph and is recomputed."""
        return recomputed(self.stages[stage])

    def recomputes(self, stage: int) -> bool:
        """Whether ``stage``'s list recomputes any micro-batch."""
        return bool(self.recomputed(stage))

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


# ---------------------------------------------------------------------------------------------
# The kinds the runtime executes (Note [Schedule kinds])


class ListScheduleKind(ScheduleKind):
    """A kind the runtime executes: static per-stage lists of :class:`Task`, run by
    :class:`StagePolicy`. Subclasses implement :meth:`_lists`."""

    @abstractmethod
    def _lists(self, num_stages: int, num_microbatches: int, recompute: bool) -> list[list[Task]]:
        """The lists, arguments already checked."""

    def build(self, num_stages: int, num_microbatches: int, *, recompute: bool = True) -> list[list[Task]]:
        """Static task list of every stage (see :func:`build_schedule`)."""
        _check_sizes(num_stages, num_microbatches)
        return self._lists(num_stages, num_microbatches, recompute)

    def pipeline(
        self, num_stages: int, num_microbatches: int, *, recompute: bool = True, chunks: int = 1
    ) -> Schedule:
        """The cached :class:`Schedule` (``chunks`` must be 1)."""
        self.check_chunks(chunks)
        return get_schedule(self.name, num_stages, num_microbatches, self.effective_recompute(recompute))


class VarunaKind(ListScheduleKind):
    """The paper's schedule (Note [Varuna schedule]): opportunistic, recomputing on every stage
    but the last, whatever ``recompute`` says."""

    name: ClassVar[str] = "varuna"
    opportunistic: ClassVar[bool] = True
    recompute_optional: ClassVar[bool] = False
    planned_by_default: ClassVar[bool] = True

    def _recomputes(self, *, last: bool, recompute: bool) -> bool:
        return not last

    def stash_peak(self, num_stages: int, stage: int, num_microbatches: int, *, chunks: int = 1) -> int:
        # The list's leading forwards: 3 per later stage (F, R and B in flight), capped.
        d = num_stages - 1 - stage
        return 1 if d == 0 else min(num_microbatches, 3 * d)

    def _lists(self, num_stages: int, num_microbatches: int, recompute: bool) -> list[list[Task]]:
        return [list(s) for s in _varuna(num_stages, num_microbatches)]


class GPipeKind(ListScheduleKind):
    """GPipe: every forward, then every backward in reverse; recomputes everywhere if asked
    (but the last micro-batch, whose F directly precedes its B)."""

    name: ClassVar[str] = "gpipe"

    def _recomputes(self, *, last: bool, recompute: bool) -> bool:
        return recompute

    def stash_peak(self, num_stages: int, stage: int, num_microbatches: int, *, chunks: int = 1) -> int:
        return num_microbatches

    def _lists(self, num_stages: int, num_microbatches: int, recompute: bool) -> list[list[Task]]:
        N = num_microbatches
        one = [Task(FORWARD, i) for i in range(N)] + [Task(BACKWARD, i) for i in reversed(range(N))]
        base = [list(one) for _ in range(num_stages)]
        return [_insert_recompute(t) for t in base] if recompute else base


class OneFOneBKind(ListScheduleKind):
    """PipeDream-Flush (1F1B): P-k-1 warm-up forwards, then one forward, one backward. Its last
    stage runs each B right after its F, so it never recomputes."""

    name: ClassVar[str] = "1f1b"
    planned_by_default: ClassVar[bool] = True

    def _recomputes(self, *, last: bool, recompute: bool) -> bool:
        return recompute and not last

    def stash_peak(self, num_stages: int, stage: int, num_microbatches: int, *, chunks: int = 1) -> int:
        return min(num_microbatches, num_stages - stage)

    def _lists(self, num_stages: int, num_microbatches: int, recompute: bool) -> list[list[Task]]:
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


class TwoBWKind(OneFOneBKind):
    """PipeDream-2BW (Narayanan et al., ICML'21), an opt-in ASYNCHRONOUS mode (Note [2BW]): two
    weight versions per stage, gradients one step stale, mini-batches back to back in 1F1B order.

    >>> from varuna.core.tasks import format_tasks
    >>> format_tasks(schedule_kind("2bw").window(2, 2, 2, recompute=False).stages[0])
    'F0 F1 B0 F2 B1 F3 B2 B3'
    """

    name: ClassVar[str] = "2bw"
    planned_by_default: ClassVar[bool] = False
    weight_versions: ClassVar[int] = 2

    def unsupported(self, num_stages: int, num_microbatches: int) -> str | None:
        if num_microbatches < num_stages:
            return (
                f"the 2bw schedule needs at least P={num_stages} micro-batches per replica (got "
                f"{num_microbatches}): with fewer, a mini-batch would start before the update two steps "
                "back is made and two weight versions would not suffice; raise the global batch size or "
                "lower the micro-batch size"
            )
        return None

    def window(
        self, num_stages: int, num_microbatches: int, steps: int, *, recompute: bool = True, chunks: int = 1
    ) -> Schedule:
        """1F1B over ``steps`` mini-batches without a flush between them (Note [2BW])."""
        self.check_chunks(chunks)
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if steps == 1:
            return self.pipeline(num_stages, num_microbatches, recompute=recompute)
        return _two_bw_window(num_stages, num_microbatches, steps, self.effective_recompute(recompute))


_KINDS: Mapping[str, ScheduleKind] = MappingProxyType(
    {
        k.name: k
        for k in (
            VarunaKind(), GPipeKind(), OneFOneBKind(), TwoBWKind(),
            InterleavedKind(), VarunaInterleavedKind(), ZBH1Kind(), VarunaZBKind(),
        )
    }
)

#: The kind a job runs when nobody names one: the script, the launcher (``--schedule``), the
#: manager's job spec and the simulator all default to it (one source for the default).
DEFAULT_SCHEDULE = "varuna"
#: Schedule kinds the runtime can execute. ``1f1b`` is PipeDream-Flush.
SCHEDULE_KINDS: tuple[str, ...] = tuple(name for name, k in _KINDS.items() if k.runtime)
#: The kinds auto-config weighs when the job names none (``planned_by_default``; Note [Joint
#: plan] in simulator/autoconfig.py).
PLANNED_KINDS: tuple[str, ...] = tuple(name for name, k in _KINDS.items() if k.planned_by_default)
#: Every registered kind: the runtime's plus any simulation-only one.
ALL_SCHEDULE_KINDS: tuple[str, ...] = tuple(_KINDS)
#: The kinds with one flat list per stage (:func:`build_schedule`); the chunked ones
#: (``interleaved``, ``varuna-interleaved``) build per-device chunk lists instead.
LIST_SCHEDULE_KINDS: tuple[str, ...] = tuple(
    n for n, k in _KINDS.items() if isinstance(k, (ListScheduleKind, ZBH1Kind))
)


def schedule_kind(name: str) -> ScheduleKind:
    """The object that owns every fact of schedule kind ``name`` (Note [Schedule kinds]).

    >>> schedule_kind("varuna").opportunistic
    True
    >>> schedule_kind("pipedream")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: unknown schedule kind 'pipedream'; choose one of varuna, gpipe, 1f1b, 2bw, ...
    """
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown schedule kind {name!r}; choose one of {', '.join(ALL_SCHEDULE_KINDS)}")
    return kind


#: How :func:`chunks_problem` names the settings by default: ``varuna-launch``'s flags.
CHUNK_FLAGS: Mapping[str, str] = MappingProxyType(
    {"schedule": "--schedule {}", "chunks": "--chunks {}", "depth": "--pipeline-depth {}"}
)


def chunks_problem(
    schedule: str,
    chunks: object,
    *,
    pipeline_depth: int | None = None,
    max_cutpoints: int | None = None,
    cut_source: str = "--auto-cutpoints",
    flags: Mapping[str, str] = CHUNK_FLAGS,
) -> str | None:
    """What is wrong with running ``chunks`` model chunks per process under ``schedule`` (one line
    naming the setting and the fix), or None. Checked before any worker starts (``varuna-launch
    --chunks``, the manager's job spec); the engine checks the same again with the model at hand.

    ``pipeline_depth`` and ``max_cutpoints`` (the most cut-points the model can have, e.g.
    ``--auto-cutpoints N``, named by ``cut_source``) are checked when known. ``flags`` spells each
    setting with its value (``{}``), e.g. ``{"chunks": "chunks = {}", ...}`` for a job spec.

    >>> chunks_problem("varuna-interleaved", 2, pipeline_depth=2) is None
    True
    >>> chunks_problem("varuna", 2)  # doctest: +ELLIPSIS
    '--chunks 2 needs an interleaved schedule, not --schedule varuna; add ... or drop --chunks'
    """
    f = {k: flags[k].format for k in ("schedule", "chunks", "depth")}
    bare = {k: flags[k].format("").strip(" =") for k in f}
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        return f"{bare['chunks']} must be an integer >= 1 (model chunks per pipeline process), got {chunks!r}"
    kind = schedule_kind(schedule)
    interleaved = [n for n, k in _KINDS.items() if k.chunked]
    if not kind.chunked:
        if chunks == 1:
            return None
        return (f"{f['chunks'](chunks)} needs an interleaved schedule, not {f['schedule'](schedule)}; "
                f"add {f['schedule'](interleaved[-1])} (or {' or '.join(interleaved[:-1])}), "
                f"or drop {bare['chunks']}")
    if chunks < 2:
        return (f"{f['schedule'](schedule)} needs {f['chunks']('V')} with V >= 2 model chunks per process "
                f"(got {chunks}); add {f['chunks'](2)}, or use a one-chunk schedule such as varuna")
    P = pipeline_depth
    if P is not None and P < 2:
        return (f"{f['schedule'](schedule)} spreads each replica's {chunks} chunks over >= 2 pipeline "
                f"processes, but the job runs at {f['depth'](P)}; raise {bare['depth']}, "
                "or use a one-chunk schedule")
    if P is not None and max_cutpoints is not None and P * chunks - 1 > max_cutpoints:
        return (f"{f['depth'](P)} × {f['chunks'](chunks)} needs {P * chunks} virtual stages, i.e. >= "
                f"{P * chunks - 1} cut-points, but {cut_source} allows at most {max_cutpoints}; lower "
                f"{bare['chunks']} or {bare['depth']}, or give the model more cut-points")
    return None


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def _runtime_kind(name: str) -> ListScheduleKind | ZBH1Kind:
    kind = _KINDS.get(name)
    if not isinstance(kind, (ListScheduleKind, ZBH1Kind)):
        raise ValueError(
            f"unknown schedule kind {name!r} for flat lists; choose one of {', '.join(LIST_SCHEDULE_KINDS)} "
            "(a chunked kind builds its lists with schedule_kind(name).pipeline(P, Nm, chunks=v))"
        )
    return kind


def build_schedule(
    kind: str, num_stages: int, num_microbatches: int, *, recompute: bool = True
) -> list[list[Task]]:
    """Static task list of every stage for ``kind`` with P=num_stages, Nm=num_microbatches.

    ``recompute`` applies to ``gpipe`` and ``1f1b``; ``varuna`` always recomputes (on every stage
    but the last). A recompute R_i is placed right before B_i unless F_i directly precedes B_i
    (then F_i simply keeps its graph).

    >>> from varuna.core.tasks import format_tasks
    >>> format_tasks(build_schedule("1f1b", 2, 3, recompute=False)[0])
    'F0 F1 B0 F2 B1 B2'
    """
    return _runtime_kind(kind).build(num_stages, num_microbatches, recompute=recompute)


def _insert_recompute(tasks: list[Task]) -> list[Task]:
    out: list[Task] = []
    for t in tasks:
        if t.op == BACKWARD and not (out and out[-1] == Task(FORWARD, t.microbatch)):
            out.append(Task(RECOMPUTE, t.microbatch))
        out.append(t)
    return out


@functools.lru_cache(maxsize=256)
def get_schedule(
    kind: str, num_stages: int, num_microbatches: int, recompute: bool = True
) -> Schedule | ZeroBubbleSchedule:
    """Cached, immutable :class:`Schedule` (what the runtime and the simulator use); the
    zero-bubble kinds' own (``varuna/core/zero_bubble.py``)."""
    zb = _KINDS.get(kind)
    if isinstance(zb, ZBH1Kind):
        return zb.pipeline(num_stages, num_microbatches, recompute=recompute)
    stages = build_schedule(kind, num_stages, num_microbatches, recompute=recompute)
    rec = schedule_kind(kind).effective_recompute(recompute)
    return Schedule(
        kind, num_stages, num_microbatches, rec and num_stages > 0, tuple(tuple(s) for s in stages)
    )


@functools.lru_cache(maxsize=64)
def _two_bw_window(num_stages: int, num_microbatches: int, steps: int, recompute: bool) -> Schedule:
    _check_sizes(num_stages, num_microbatches)
    lists = _runtime_kind("2bw")._lists(num_stages, steps * num_microbatches, recompute)
    return Schedule("2bw", num_stages, steps * num_microbatches, recompute, tuple(tuple(t) for t in lists))


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
