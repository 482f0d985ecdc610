"""The simulator's event loop: one mini-batch of pipeline + data-parallel training.

Given a calibration and a config (P stages × D replicas, micro-batch size m, micro-batches per
replica, segment→stage map, schedule kind, host placement), replay the mini-batch as discrete
events and report its time, throughput, per-stage busy/idle time and peak stashed activations.

What decides the order of work: each stage's tasks come from ``varuna.core.schedule.get_schedule``
and are picked one at a time by the same :class:`varuna.core.schedule.StagePolicy` the runtime runs
(``arrived`` when an activation or gradient lands, ``next_task`` when the stage is idle,
``complete`` when a task ends). The simulator never orders tasks itself — except for the
simulation-only interleaved 1F1B schedule (``simulator/interleaved.py``).

What is modelled (see docs/simulator.md for formulas):

- compute: a task's time is the sum over the stage's segments of the calibrated F, R or B at m
  (the replica's final micro-batch may be smaller: costs and sizes at its size), plus the
  runtime's per-task overhead ``task_overhead_s`` and, for F and R, its placeholder glue
  ``placeholder_s`` per segment before the stage (these and ``step_overhead_s``: the
  ``SimConfig`` field where set, else the calibration's ``runtime_overheads``, else 0;
  :func:`runtime_overheads`);
- point-to-point sends: the fitted link model, intra- or inter-host from the rank placement
  (rank = replica·P + stage; consecutive ranks fill a host's slots), applied as varuna/testing/netem.py
  emulates a link: FIFO serialization (bytes/bandwidth, ``max_sends_per_link`` at once), then the
  latency with a seeded exponential jitter per message, no overtaking (Note [Link model]); sends
  never block compute;
- the per-stage gradient all-reduce over D replicas, starting when the last replica finishes the
  stage's last backward, with k = the number of rings sharing a host's NIC;
- the optimizer step after the all-reduce;
- a fixed per-mini-batch runtime overhead ``step_overhead_s`` (step set-up and the end-of-step
  agreement all-reduce), added to the mini-batch time.

Example::

    >>> from varuna.core.calibration import Calibration
    >>> cal = Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1, 2))
    >>> r = simulate(cal, SimConfig(num_stages=2, micro_batch_size=1, num_microbatches=4, schedule="gpipe",
    ...                             recompute=False))
    >>> round(r.minibatch_s, 6)   # (Nm + P - 1)·(F + B) = 5 · (0.02 + 0.04)
    0.3
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from simulator.interleaved import InterleavedPolicy, interleaved_order
from varuna.core.calibration import Calibration, RuntimeOverheads
from varuna.core.partition import balanced_stages
from varuna.core.schedule import DEFAULT_STASH_HEADROOM, SCHEDULE_KINDS, get_schedule
from varuna.core.timeline import Timeline

__all__ = [
    "SIM_SCHEDULE_KINDS",
    "SimConfig",
    "SimResult",
    "simulate",
    "split_minibatch",
    "stage_segments_for",
    "segment_costs",
    "sync_costs",
    "host_of_ranks",
    "allreduce_concurrency",
    "stage_memory",
    "runtime_overheads",
]

#: Schedules the simulator knows: the runtime's, plus interleaved 1F1B (simulation only).
SIM_SCHEDULE_KINDS = SCHEDULE_KINDS + ("interleaved",)

# Events closer than this are simultaneous: sums of the same costs in another order differ by
# rounding, and a stage must see every arrival of "now" before it picks its next task.
_EPS_S = 1e-9

_DONE, _ACT, _GRAD = 0, 1, 2


def split_minibatch(
    global_batch_size: int, micro_batch_size: int, num_replicas: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Micro-batches per replica and each replica's last micro-batch size.

    Mirrors ``varuna.core.batching.plan_microbatches``: ceil(M/m) micro-batches, the last one possibly
    smaller, dealt to replicas in contiguous runs whose lengths differ by at most one.

    >>> split_minibatch(10, 4, 2)
    ((2, 1), (4, 2))
    """
    M, m, D = global_batch_size, micro_batch_size, num_replicas
    if M < 1 or m < 1 or D < 1:
        raise ValueError(f"global batch size, micro-batch size and D must be >= 1 (got {M}, {m}, {D})")
    n = -(-M // m)
    if n < D:
        raise ValueError(
            f"global batch {M} at micro-batch size {m} gives {n} micro-batch(es), fewer than D={D} "
            f"replicas; use a micro-batch size <= {M // D} or fewer replicas"
        )
    counts = tuple(n // D + (1 if d < n % D else 0) for d in range(D))
    last = [m] * D
    last[-1] = M - (n - 1) * m
    return counts, tuple(last)


@dataclass(kw_only=True, frozen=True)
class SimConfig:
    """One configuration to simulate.

    >>> SimConfig.for_global_batch(global_batch_size=10, num_stages=2, num_replicas=2, micro_batch_size=4)
    ... # doctest: +ELLIPSIS
    SimConfig(num_stages=2, num_replicas=2, micro_batch_size=4, num_microbatches=(2, 1), ...)
    """

    num_stages: int
    """P: pipeline depth (devices per replica)."""
    num_replicas: int = 1
    """D: data-parallel degree."""
    micro_batch_size: int
    """m: examples per micro-batch."""
    num_microbatches: int | tuple[int, ...]
    """Nm per replica (an int: the same for every replica)."""
    last_microbatch_sizes: tuple[int, ...] | None = None
    """Per replica, the size of its final micro-batch (None: all are m)."""
    stage_segments: tuple[tuple[int, int], ...] | None = None
    """Inclusive segment ranges per (virtual) stage, P·chunks of them; None: balanced by cost."""
    schedule: str = "varuna"
    """One of SIM_SCHEDULE_KINDS."""
    recompute: bool = True
    """Recompute for gpipe / 1f1b / interleaved (varuna always recomputes, except on the last stage)."""
    chunks: int = 1
    """v: model chunks per device (interleaved only)."""
    host_slots: int | tuple[int, ...] = 1
    """Accelerators per host (an int: every host alike); consecutive ranks fill a host."""
    jitter_scale: float = 1.0
    """Multiplies the calibration's per-message jitter (0: deterministic mean times)."""
    seed: int = 0
    """Seed of the jitter generator."""
    extra_latency_s: float = 0.0
    """Added to every point-to-point message (what-if studies)."""
    stash_headroom: int = DEFAULT_STASH_HEADROOM
    """As ``VarunaConfig.stash_headroom``: how far past its list's stash peak a varuna stage may
    run graph-less forwards out of list order."""
    max_sends_per_link: int = 1
    """Messages one directed link serializes at once (each at full bandwidth); more wait, FIFO."""
    allreduce: bool = True
    """Simulate the per-stage gradient all-reduce."""
    optimizer: bool = True
    """Simulate the optimizer step."""
    task_overhead_s: float | None = None
    """Runtime time added to every F, R and B task beyond its segments' calibrated compute: the
    executor's per-task work (dispatch, RNG re-seeding, slicing, queueing the send). None: the
    calibration's ``runtime_overheads.task_overhead_s`` (0 when the file has none); measured by
    running the engine (scripts/validate_simulator.py)."""
    placeholder_s: float | None = None
    """Runtime time added to a stage's F and R per segment *before* the stage: every stage runs
    the user's forward from the start, and each earlier segment's modules return placeholders
    (Note [Placeholders] in varuna/cutting/split.py) -- cheap, but not free. None: from the calibration,
    as ``task_overhead_s``."""
    task_jitter_s: float = 0.0
    """Run-to-run spread of a task's duration (sleep overshoot, a descheduled thread): each F, R
    and B lasts its cost − j + Exp(mean j), j = min(task_jitter_s, cost), so its mean is
    unchanged. 0: every task takes exactly its cost. Like link jitter it only matters where the
    policy forks on sub-millisecond timing (docs/simulator.md, Finding 7); seeded by ``seed``."""
    step_overhead_s: float | None = None
    """Runtime time added once per mini-batch beyond compute, all-reduce and optimizer: step
    set-up and the end-of-step agreement all-reduce (norm, overflow, loss) over every rank.
    None: from the calibration, as ``task_overhead_s``."""

    @classmethod
    def for_global_batch(
        cls, *, global_batch_size: int, num_replicas: int, micro_batch_size: int, **kwargs
    ) -> SimConfig:
        """Config whose micro-batches split ``global_batch_size`` as the runtime does."""
        counts, last = split_minibatch(global_batch_size, micro_batch_size, num_replicas)
        return cls(
            num_replicas=num_replicas,
            micro_batch_size=micro_batch_size,
            num_microbatches=counts,
            last_microbatch_sizes=last,
            **kwargs,
        )

    def microbatches_of(self, replica: int) -> int:
        n = self.num_microbatches
        return n if isinstance(n, int) else n[replica]

    def last_size_of(self, replica: int) -> int:
        return (
            self.micro_batch_size
            if self.last_microbatch_sizes is None
            else self.last_microbatch_sizes[replica]
        )

    @property
    def num_gpus(self) -> int:
        return self.num_stages * self.num_replicas

    def label(self) -> str:
        """Short human-readable form, e.g. ``4x8 m=2 varuna``."""
        kind = self.schedule + (f"(v={self.chunks})" if self.schedule == "interleaved" else "")
        if self.schedule != "varuna" and self.recompute:
            kind += "+recompute"
        return f"{self.num_stages}x{self.num_replicas} m={self.micro_batch_size} {kind}"


@dataclass(kw_only=True)
class SimResult:
    """What one simulated mini-batch cost. Per-stage tuples are indexed by device (0..P-1)."""

    config: SimConfig
    minibatch_s: float
    """Time of the whole mini-batch: pipeline, all-reduce and optimizer."""
    examples_per_s: float
    pipeline_s: float
    """When the last backward of any stage ended."""
    examples: int
    stage_busy_s: tuple[float, ...]
    """Compute time per stage (the busiest replica)."""
    stage_idle_s: tuple[float, ...]
    """minibatch_s minus busy, all-reduce and optimizer time."""
    stage_allreduce_s: tuple[float, ...]
    stage_optimizer_s: tuple[float, ...]
    peak_stashed: tuple[int, ...]
    """Most micro-batches (chunk activations for interleaved) alive at once: F started, B not done."""
    stage_memory_bytes: tuple[int, ...]
    """Peak memory estimate per stage from the calibration and ``peak_stashed``."""
    stage_segments: tuple[tuple[int, int], ...]
    executed: tuple[tuple[tuple, ...], ...]
    """Per simulated replica, per device: the tasks in the order they ran."""
    simulated_replicas: tuple[int, ...]
    """Which replicas were simulated (identical replicas are simulated once when there is no jitter)."""
    timeline: Timeline | None = None

    def summary(self) -> dict:
        """JSON-friendly digest (no timeline, no task lists)."""
        c = self.config
        return {
            "P": c.num_stages,
            "D": c.num_replicas,
            "m": c.micro_batch_size,
            "Nm": list(c.num_microbatches) if not isinstance(c.num_microbatches, int) else c.num_microbatches,
            "schedule": c.schedule,
            "recompute": c.recompute,
            "chunks": c.chunks,
            "minibatch_s": self.minibatch_s,
            "examples_per_s": self.examples_per_s,
            "pipeline_s": self.pipeline_s,
            "stage_busy_s": list(self.stage_busy_s),
            "stage_idle_s": list(self.stage_idle_s),
            "stage_allreduce_s": list(self.stage_allreduce_s),
            "stage_optimizer_s": list(self.stage_optimizer_s),
            "peak_stashed": list(self.peak_stashed),
            "stage_memory_bytes": list(self.stage_memory_bytes),
            "stage_segments": [list(r) for r in self.stage_segments],
        }


def segment_costs(
    cal: Calibration, m: int, schedule: str = "varuna", recompute: bool = True
) -> tuple[list[float], list[float]]:
    """Per segment, its cost on a non-last stage and on the last stage, for balancing stages.

    F+R+B where the schedule recomputes there, else F+B: varuna and 1f1b never recompute on the
    last stage (1f1b's last stage runs each B right after its F); gpipe with recompute does.
    """
    n = cal.num_segments
    f = [cal.fwd_s(i, m) for i in range(n)]
    b = [cal.bwd_s(i, m) for i in range(n)]
    fb = [f[i] + b[i] for i in range(n)]
    if schedule != "varuna" and not recompute:
        return fb, fb
    full = [fb[i] + cal.recompute_s(i, m) for i in range(n)]
    return full, (full if schedule in ("gpipe", "interleaved") else fb)


def stage_segments_for(
    cal: Calibration, num_virtual_stages: int, m: int, schedule: str = "varuna", recompute: bool = True
) -> tuple[tuple[int, int], ...]:
    """Balanced ranges (see ``varuna.core.partition``) of the calibration's segments at m."""
    full, last = segment_costs(cal, m, schedule, recompute)
    return tuple(balanced_stages(full, last, num_virtual_stages))


def _validate(cal: Calibration, c: SimConfig) -> tuple[tuple[int, int], ...]:
    if c.schedule not in SIM_SCHEDULE_KINDS:
        raise ValueError(
            f"unknown schedule kind {c.schedule!r}; choose one of {', '.join(SIM_SCHEDULE_KINDS)}"
        )
    if c.num_stages < 1 or c.num_replicas < 1 or c.micro_batch_size < 1:
        raise ValueError(
            f"P, D and m must be >= 1 (got P={c.num_stages}, D={c.num_replicas}, m={c.micro_batch_size})"
        )
    v = c.chunks if c.schedule == "interleaved" else 1
    if c.schedule != "interleaved" and c.chunks != 1:
        raise ValueError(
            f"chunks={c.chunks} applies to the interleaved schedule only; use chunks=1 for {c.schedule}"
        )
    if not isinstance(c.num_microbatches, int) and len(c.num_microbatches) != c.num_replicas:
        raise ValueError(
            f"num_microbatches has {len(c.num_microbatches)} entries for D={c.num_replicas} replicas"
        )
    if c.last_microbatch_sizes is not None and len(c.last_microbatch_sizes) != c.num_replicas:
        raise ValueError(
            f"last_microbatch_sizes has {len(c.last_microbatch_sizes)} entries for "
            f"D={c.num_replicas} replicas"
        )
    for d in range(c.num_replicas):
        if c.microbatches_of(d) < 1:
            raise ValueError(
                f"replica {d} has {c.microbatches_of(d)} micro-batches; every replica needs >= 1"
            )
        if not 1 <= c.last_size_of(d) <= c.micro_batch_size:
            raise ValueError(f"replica {d}'s last micro-batch size {c.last_size_of(d)} is outside 1..m")
    if c.stash_headroom < 0:
        raise ValueError(f"stash_headroom must be >= 0 (got {c.stash_headroom})")
    if c.max_sends_per_link < 1:
        raise ValueError("max_sends_per_link must be >= 1")
    if c.jitter_scale < 0:
        raise ValueError("jitter_scale must be >= 0")
    if not c.task_jitter_s >= 0:
        raise ValueError(f"task_jitter_s must be >= 0 seconds, got {c.task_jitter_s}")
    for name in ("task_overhead_s", "placeholder_s", "step_overhead_s"):
        value = getattr(c, name)
        if value is not None and not value >= 0:
            raise ValueError(f"{name} must be >= 0 seconds or None (from the calibration), got {value}")
    V = c.num_stages * v
    if V > cal.num_segments:
        raise ValueError(
            f"P·chunks={V} stages but the calibration has only {cal.num_segments} segments "
            f"({cal.num_cutpoints} cut-points); use P <= {cal.num_segments // v}"
        )
    ranges = c.stage_segments
    if ranges is None:
        ranges = stage_segments_for(cal, V, c.micro_batch_size, c.schedule, c.recompute)
    ranges = tuple(tuple(r) for r in ranges)
    if len(ranges) != V:
        raise ValueError(f"stage_segments has {len(ranges)} ranges; P·chunks={V} are needed")
    expect = 0
    for a, b in ranges:
        if a != expect or b < a:
            raise ValueError(
                f"stage_segments {list(ranges)} must be contiguous, non-empty and start at segment 0"
            )
        expect = b + 1
    if expect != cal.num_segments:
        raise ValueError(
            f"stage_segments cover segments 0..{expect - 1} but the calibration has {cal.num_segments}"
        )
    if isinstance(c.host_slots, int):
        if c.host_slots < 1:
            raise ValueError("host_slots must be >= 1")
    elif sum(c.host_slots) < c.num_gpus or any(s < 1 for s in c.host_slots):
        raise ValueError(
            f"hosts with slots {list(c.host_slots)} hold {sum(c.host_slots)} ranks; "
            f"P×D={c.num_gpus} are needed"
        )
    return ranges


def _host_of_ranks(c: SimConfig) -> list[int]:
    n = c.num_gpus
    if isinstance(c.host_slots, int):
        return [r // c.host_slots for r in range(n)]
    out: list[int] = []
    for h, slots in enumerate(c.host_slots):
        out.extend([h] * slots)
    return out[:n]


def _make_policies(c: SimConfig, nm: int):
    P = c.num_stages
    if c.schedule == "interleaved":
        return [
            InterleavedPolicy(
                interleaved_order(P, nm, c.chunks, stage=k, recompute=c.recompute),
                stage=k,
                num_stages=P,
                chunks=c.chunks,
            )
            for k in range(P)
        ], None
    sched = get_schedule(c.schedule, P, nm, True if c.schedule == "varuna" else c.recompute)
    return [sched.policy(k, stash_headroom=c.stash_headroom) for k in range(P)], sched


def runtime_overheads(cal: Calibration, config: SimConfig) -> tuple[float, float, float]:
    """(task_overhead_s, placeholder_s, step_overhead_s) that ``simulate`` applies: each
    ``config`` field that is set, else the calibration's ``runtime_overheads`` value, else 0.

    >>> from varuna.core.calibration import RuntimeOverheads
    >>> cal = Calibration.synthetic(0.01, num_segments=2, runtime_overheads=RuntimeOverheads(
    ...     task_overhead_s=1e-3, placeholder_s=1e-4, step_overhead_s=2e-3))
    >>> runtime_overheads(cal, SimConfig(num_stages=2, micro_batch_size=1, num_microbatches=4,
    ...                                  step_overhead_s=0.0))
    (0.001, 0.0001, 0.0)
    """
    ro = cal.runtime_overheads or RuntimeOverheads()  # none in the file: all 0
    c = config
    return (
        float(ro.task_overhead_s if c.task_overhead_s is None else c.task_overhead_s),
        float(ro.placeholder_s if c.placeholder_s is None else c.placeholder_s),
        float(ro.step_overhead_s if c.step_overhead_s is None else c.step_overhead_s),
    )


def simulate(cal: Calibration, config: SimConfig, *, record: bool = False) -> SimResult:
    """Simulate one mini-batch of ``config`` with ``cal``'s costs.

    ``record=True`` also returns a :class:`varuna.core.timeline.Timeline` of every task, send,
    all-reduce and optimizer step (slower: one object per event).
    """
    c = config
    ranges = _validate(cal, c)
    P, D, m = c.num_stages, c.num_replicas, c.micro_batch_size
    interleaved = c.schedule == "interleaved"
    v = c.chunks if interleaved else 1
    V = P * v
    host = _host_of_ranks(c)

    # -- per (virtual) stage costs at m and at each distinct short last size --------------------
    over, placeholder_s, step_overhead_s = runtime_overheads(cal, c)
    glue = [over + placeholder_s * a for a, _ in ranges]  # F and R also pass segments 0..a-1

    def costs_at(size: int):
        fwd = [g + sum(cal.fwd_s(s, size) for s in range(a, b + 1)) for g, (a, b) in zip(glue, ranges)]
        rec = [g + sum(cal.recompute_s(s, size) for s in range(a, b + 1)) for g, (a, b) in zip(glue, ranges)]
        bwd = [over + sum(cal.bwd_s(s, size) for s in range(a, b + 1)) for a, b in ranges]
        # Bytes leaving virtual stage c forwards (and its gradient backwards): the cut-point
        # after its last segment. The last virtual stage sends nothing.
        nbytes = [cal.act_bytes(b, size) if b < cal.num_segments - 1 else 0 for _, b in ranges]
        # Serialization time on an (inter, intra) link; latency is added per link kind below.
        wire = [(x / cal.inter.bandwidth_bytes_per_s, x / cal.intra.bandwidth_bytes_per_s) for x in nbytes]
        return fwd, rec, bwd, wire

    sizes = {m} | {c.last_size_of(d) for d in range(D)}
    cost_tables = {s: costs_at(s) for s in sorted(sizes)}
    # Note [Link model]: as varuna/testing/netem.py emulates it. A directed link serializes messages
    # (bytes / bandwidth, FIFO, ``max_sends_per_link`` at once); each then arrives after the
    # latency plus an exponential jitter draw, and never overtakes an earlier message. The
    # calibration's latency_s is the *mean* delay, so the fixed part is latency_s - jitter_s and
    # the exponential (mean = std = jitter_s) adds the rest back (a delay cannot go below 0).
    sigma_inter = cal.inter.jitter_s * c.jitter_scale
    sigma_intra = cal.intra.jitter_s * c.jitter_scale
    lat_inter = max(0.0, cal.inter.latency_s + c.extra_latency_s - sigma_inter)
    lat_intra = max(0.0, cal.intra.latency_s + c.extra_latency_s - sigma_intra)
    task_jitter = c.task_jitter_s
    jitter = sigma_inter > 0 or sigma_intra > 0 or task_jitter > 0

    # -- which replicas to simulate ------------------------------------------------------------
    # Replicas interact only through the all-reduce, which starts after the slowest one. Without
    # jitter, replicas with the same micro-batches and the same intra/inter link pattern run
    # identically: simulate one of each kind.
    def pattern(d: int):
        base = d * P
        links = tuple(host[base + k] == host[base + (k + 1) % P] for k in range(P))
        return c.microbatches_of(d), c.last_size_of(d), links

    if jitter:
        sim_replicas = list(range(D))
    else:
        seen: dict = {}
        for d in range(D):
            seen.setdefault(pattern(d), d)
        sim_replicas = sorted(seen.values())
    nsim = len(sim_replicas)

    # -- flat per-rank state (idx = j·P + k for the j-th simulated replica) -------------------
    policies: list = []
    schedules: dict[int, object] = {}
    for d in sim_replicas:
        nm = c.microbatches_of(d)
        pols, sched = _make_policies(c, nm)
        policies.extend(pols)
        schedules[nm] = sched
    n = nsim * P
    # -- flat per-rank tables, so the event loop does list lookups only ------------------------
    stage_of = [idx % P for idx in range(n)]
    replica_of = [sim_replicas[idx // P] for idx in range(n)]
    act_dst = [idx + 1 if idx % P != P - 1 else idx - (P - 1) for idx in range(n)]  # next device
    grad_dst = [idx - 1 if idx % P != 0 else idx + (P - 1) for idx in range(n)]  # previous device
    act_intra = [
        host[replica_of[idx] * P + stage_of[idx]] == host[replica_of[idx] * P + (stage_of[idx] + 1) % P]
        for idx in range(n)
    ]
    grad_intra = [
        host[replica_of[idx] * P + stage_of[idx]] == host[replica_of[idx] * P + (stage_of[idx] - 1) % P]
        for idx in range(n)
    ]
    short_mb = [
        c.microbatches_of(replica_of[idx]) - 1 if c.last_size_of(replica_of[idx]) != m else -1
        for idx in range(n)
    ]
    short_tab = [cost_tables[c.last_size_of(replica_of[idx])] for idx in range(n)]

    def durations(tab, idx: int) -> dict[str, float] | list[dict[str, float]]:
        """Rank idx's {op: seconds}; interleaved: a list of them, one per chunk."""
        fwd, rec, bwd, _ = tab
        per_chunk = [
            {"F": fwd[vs], "R": rec[vs], "B": bwd[vs]} for vs in (ch * P + stage_of[idx] for ch in range(v))
        ]
        return per_chunk if interleaved else per_chunk[0]

    def sends(tab, idx: int, forward: bool) -> list[tuple | None]:
        """Per chunk of rank idx: what its F (forward) or B sends, or None if nothing:
        (receiving rank, serialization s at m, at the short size, latency s, jitter s, the
        receiver's chunk)."""
        intra = act_intra[idx] if forward else grad_intra[idx]
        out: list[tuple | None] = []
        for ch in range(v):
            vs = ch * P + stage_of[idx]
            cut_vs = vs if forward else vs - 1  # a gradient crosses the cut-point before vs
            if not 0 <= cut_vs < V - 1:
                out.append(None)  # the last virtual stage's F and the first one's B send nothing
                continue
            out.append(
                (
                    act_dst[idx] if forward else grad_dst[idx],
                    cost_tables[m][3][cut_vs][intra],
                    tab[3][cut_vs][intra],
                    lat_intra if intra else lat_inter,
                    sigma_intra if intra else sigma_inter,
                    (vs + 1) // P if forward else (vs - 1) // P,
                )
            )
        return out

    dur_m = [durations(cost_tables[m], idx) for idx in range(n)]
    dur_short = [durations(short_tab[idx], idx) for idx in range(n)]
    act_out = [sends(short_tab[idx], idx, True) for idx in range(n)]
    grad_out = [sends(short_tab[idx], idx, False) for idx in range(n)]

    running: list = [None] * n
    run_end = [0.0] * n
    busy = [0.0] * n
    live = [0] * n
    peak = [0] * n
    last_b_end = [0.0] * n
    slots = c.max_sends_per_link
    act_free: list = [0.0] * n if slots == 1 else [[0.0] * slots for _ in range(n)]
    grad_free: list = [0.0] * n if slots == 1 else [[0.0] * slots for _ in range(n)]
    act_delivered = [0.0] * n  # last delivery time on each link (FIFO: no overtaking)
    grad_delivered = [0.0] * n
    uniform = random.Random(c.seed).random
    log = math.log
    tl = Timeline(metadata={"config": c.label(), "source": "simulator"}) if record else None
    add = tl.add if tl is not None else None
    next_task = [p.next_task for p in policies]
    complete = [p.complete for p in policies]
    arrived = [p.arrived for p in policies]

    # Heap entries: (time, code, rank, x) with x the micro-batch (interleaved: mb·v + chunk).
    # No sequence number: events within _EPS_S of each other are applied together before any
    # stage picks its next task, so their order inside a batch does not matter.
    # Note [Event loop speed]: this loop runs once per task (P=36, Nm=228: 25k tasks in a 50 ms
    # budget), so everything it needs per task is precomputed per rank above and looked up by
    # list index; the interleaved schedule only adds a chunk index.
    heap: list = []
    push, pop = heapq.heappush, heapq.heappop
    dirty = list(range(n))
    now = 0.0
    while True:
        # Dispatch: every stage that became idle or received an input asks its policy for work.
        for idx in dirty:
            if running[idx] is not None:
                continue
            task = next_task[idx]()
            if task is None:
                continue
            op = task.op
            i = task.microbatch
            dur = (dur_short if i == short_mb[idx] else dur_m)[idx]
            dur = dur[task.chunk][op] if interleaved else dur[op]
            if task_jitter > 0.0:
                j = task_jitter if task_jitter < dur else dur
                dur -= j + j * log(1.0 - uniform())  # cost - j + Exponential(mean j)
            if op == "F":
                lv = live[idx] + 1
                live[idx] = lv
                if lv > peak[idx]:
                    peak[idx] = lv
            running[idx] = task
            busy[idx] += dur
            end = now + dur
            run_end[idx] = end
            push(heap, (end, _DONE, idx, 0))
            if add is not None:
                add(stage_of[idx], replica_of[idx], op, i, now, end)
        dirty = []
        if not heap:
            break
        limit = heap[0][0] + _EPS_S
        while heap and heap[0][0] <= limit:
            te, code, idx, x = pop(heap)
            now = te
            if code != _DONE:
                if interleaved:
                    arrived[idx]("F" if code == _ACT else "B", x // v, x % v)
                else:
                    arrived[idx]("F" if code == _ACT else "B", x)
                dirty.append(idx)
                continue
            task = running[idx]
            running[idx] = None
            complete[idx](task)
            dirty.append(idx)
            op = task.op
            if op == "F":
                out = act_out[idx][task.chunk if interleaved else 0]
                if out is None:
                    continue
                free, delivered, dcode, kind = act_free, act_delivered, _ACT, "F"
            elif op == "B":
                live[idx] -= 1
                last_b_end[idx] = te  # B's of a stage end in time order: the last one wins
                out = grad_out[idx][task.chunk if interleaved else 0]
                if out is None:
                    continue
                free, delivered, dcode, kind = grad_free, grad_delivered, _GRAD, "B"
            else:
                continue
            dst, wire, wire_short, delay, sigma, dch = out
            i = task.microbatch
            if i == short_mb[idx]:
                wire = wire_short
            # Note [Link model]. The sender's messages on a link are issued in time order, so
            # each takes the earliest free serialization slot.
            if slots == 1:
                f = free[idx]
                start = f if f > te else te
                done_s = start + wire
                free[idx] = done_s
            else:
                q = free[idx]
                start = q[0] if q[0] > te else te
                done_s = start + wire
                heapq.heapreplace(q, done_s)
            ta = done_s + delay
            if sigma > 0.0:
                ta -= sigma * log(1.0 - uniform())  # Exponential(mean sigma)
            if ta < delivered[idx]:
                ta = delivered[idx]
            delivered[idx] = ta
            if add is not None:
                add(stage_of[idx], replica_of[idx], "SEND_ACT" if kind == "F" else "SEND_GRAD", i, start, ta)
            if ta <= limit or (running[dst] is not None and run_end[dst] >= ta):
                # Deliver now, without an event: either it arrives "now" (a free link), or the
                # receiver is busy until after it lands, so it cannot look before then anyway
                # (policies have no clock; they only answer next_task, asked when idle).
                if interleaved:
                    arrived[dst](kind, i, dch)
                else:
                    arrived[dst](kind, i)
                if ta <= limit:
                    dirty.append(dst)
            else:
                push(heap, (ta, dcode, dst, i * v + dch if interleaved else i))

    for idx, pol in enumerate(policies):
        if not pol.finished:
            # A schedule/policy bug, not user input: the pipeline deadlocked.
            raise RuntimeError(
                f"simulation deadlocked: stage {idx % P} of replica {sim_replicas[idx // P]} "
                f"stopped after {len(pol.executed)} of {len(pol.tasks)} tasks"
            )

    # -- gradient all-reduce and optimizer step, per device ------------------------------------
    device_ranges: list[list[tuple[int, int]]] = [[] for _ in range(P)]
    for vs, r in enumerate(ranges):
        device_ranges[vs % P].append(r)
    device_segments = [[s for a, b in rs for s in range(a, b + 1)] for rs in device_ranges]
    pipeline_s = max(last_b_end)
    ar_s, opt_s, end_s = [], [], []
    sync = sync_costs(cal, c, device_segments)
    for k in range(P):
        stage_end = max(last_b_end[j * P + k] for j in range(nsim))
        ar, opt = sync[k]
        ar_s.append(ar)
        opt_s.append(opt)
        end_s.append(stage_end + ar + opt)
        if tl is not None:
            for d in sim_replicas:
                if ar > 0:
                    tl.add(k, d, "AR", None, stage_end, stage_end + ar)
                if opt > 0:
                    tl.add(k, d, "OPT", None, stage_end + ar, stage_end + ar + opt)
    minibatch_s = max(end_s) + step_overhead_s
    stage_busy = [max(busy[j * P + k] for j in range(nsim)) for k in range(P)]
    stage_peak = [max(peak[j * P + k] for j in range(nsim)) for k in range(P)]
    examples = sum((c.microbatches_of(d) - 1) * m + c.last_size_of(d) for d in range(D))
    memory = []
    for k in range(P):
        sched = schedules.get(c.microbatches_of(sim_replicas[0]))
        recomputes = bool(sched.recomputed(k)) if sched is not None else c.recompute
        memory.append(stage_memory(cal, device_ranges[k], m, stage_peak[k], recomputes))
    if tl is not None:
        tl.metadata.update({"minibatch_s": minibatch_s, "P": P, "D": D, "m": m})
    return SimResult(
        config=c,
        minibatch_s=minibatch_s,
        examples_per_s=examples / minibatch_s if minibatch_s > 0 else math.inf,
        pipeline_s=pipeline_s,
        examples=examples,
        stage_busy_s=tuple(stage_busy),
        stage_idle_s=tuple(minibatch_s - stage_busy[k] - ar_s[k] - opt_s[k] for k in range(P)),
        stage_allreduce_s=tuple(ar_s),
        stage_optimizer_s=tuple(opt_s),
        peak_stashed=tuple(stage_peak),
        stage_memory_bytes=tuple(memory),
        stage_segments=ranges,
        executed=tuple(tuple(tuple(policies[j * P + k].executed) for k in range(P)) for j in range(nsim)),
        simulated_replicas=tuple(sim_replicas),
        timeline=tl,
    )


def host_of_ranks(config: SimConfig) -> list[int]:
    """Host index of every rank (rank = replica·P + stage; consecutive ranks fill a host)."""
    return _host_of_ranks(config)


def sync_costs(
    cal: Calibration, config: SimConfig, device_segments: Sequence[Sequence[int]]
) -> list[tuple[float, float]]:
    """Per device: (gradient all-reduce seconds, optimizer step seconds) after its last backward.

    A ring that never leaves one host uses the intra link (latency, bandwidth) in the ring
    formula; otherwise the calibration's fitted model with k = :func:`allreduce_concurrency`.
    """
    c = config
    P, D = c.num_stages, c.num_replicas
    concurrency = allreduce_concurrency(_host_of_ranks(c), P, D)
    out = []
    for k in range(P):
        ar = 0.0
        if c.allreduce and D > 1:
            nbytes = cal.grad_bytes(device_segments[k])
            if concurrency[k] == 0:
                ar = (
                    2.0 * (D - 1) / D * nbytes / cal.intra.bandwidth_bytes_per_s
                    + (D - 1) * cal.intra.latency_s
                )
            else:
                ar = cal.allreduce_s(nbytes, D, concurrency[k])
        opt = cal.optimizer_s(cal.param_bytes(device_segments[k])) if c.optimizer else 0.0
        out.append((ar, opt))
    return out


def allreduce_concurrency(host: Sequence[int], P: int, D: int) -> list[int]:
    """Per stage, k: how many all-reduce rings share the busiest host NIC on its ring (0: the
    ring never leaves one host). A static upper bound: we count every ring that crosses the host,
    whether or not their all-reduces overlap in time.

    >>> allreduce_concurrency([0, 0, 1, 1], P=2, D=2)   # 2 hosts × 2 slots: both rings cross both hosts
    [2, 2]
    """
    if D <= 1:
        return [0] * P
    ring_hosts = [{host[d * P + k] for d in range(D)} for k in range(P)]
    crosses = [len(h) > 1 for h in ring_hosts]
    rings_on: dict[int, int] = {}
    for k in range(P):
        if crosses[k]:
            for h in ring_hosts[k]:
                rings_on[h] = rings_on.get(h, 0) + 1
    return [max(rings_on[h] for h in ring_hosts[k]) if crosses[k] else 0 for k in range(P)]


def stage_memory(
    cal: Calibration, ranges: Sequence[tuple[int, int]], m: int, stashed: int, recompute: bool
) -> int:
    """Peak memory of one device holding the segment ``ranges`` (one per model chunk) with
    ``stashed`` micro-batches in flight (``Calibration.stage_memory_bytes``)."""
    if len(ranges) == 1:
        a, b = ranges[0]
        return cal.stage_memory_bytes(range(a, b + 1), m, stashed, recompute=recompute)
    # Interleaved: the static memory of every chunk; in-flight activations are counted per chunk
    # and sized by the largest chunk (an upper bound).
    static = sum(cal.stage_memory_bytes(range(a, b + 1), m, 0, recompute=False) for a, b in ranges)
    dynamic = max(
        cal.stage_memory_bytes(range(a, b + 1), m, stashed, recompute=recompute)
        - cal.stage_memory_bytes(range(a, b + 1), m, 0, recompute=False)
        for a, b in ranges
    )
    return int(static + dynamic)
