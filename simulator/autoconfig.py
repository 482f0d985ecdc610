"""Auto-configuration: the fastest P×D (and m) for G accelerators and a global batch size.

Given a calibration, G GPUs, the global batch M_total and (optionally) the memory per GPU:

1. choose the micro-batch size m: the smallest measured m past which F(m)/m (forward time per
   example, whole model) stops improving by more than 5%; on a pipeline depth where that m does
   not fit in memory, the largest smaller measured m that fits;
2. sweep the pipeline depth P from the smallest that fits in memory up to min(K+1, G), with
   D = ⌊G/P⌋ replicas (never more than M_total), micro-batches split as the runtime splits them
   (``varuna.core.batching.microbatch_counts``: replicas differ by at most one, the last
   micro-batch may be smaller),
   and a balanced contiguous segment→stage map (``varuna.core.partition``);
3. bound every candidate's mini-batch time from below analytically (Note [Lower bound]) and
   simulate candidates in increasing order of that bound, stopping as soon as the next bound is
   no better than the best simulated time (branch and bound: the answer is what exhaustive
   simulation would pick);
4. rank by examples/s.

:func:`sweep_gpus` answers "which G is worth asking for": the best configuration's throughput
and throughput per GPU for a range of G.

Example::

    >>> from varuna.core.calibration import Calibration
    >>> cal = Calibration.synthetic(0.01, num_segments=8, micro_batch_sizes=(1, 2, 4))
    >>> plan = autoconfigure(cal, gpus=8, global_batch_size=64)
    >>> plan.best.num_stages * plan.best.num_replicas <= 8
    True
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from simulator.config import MAX_GPUS, MAX_MICROBATCHES, SimConfig, SimResult, host_of_ranks, segment_costs
from simulator.costs import stage_memory, sync_costs
from simulator.engine import simulate
from varuna.core.batching import microbatch_counts
from varuna.core.calibration import Calibration
from varuna.core.partition import balanced_stages, candidate_maxima
from varuna.core.planning import PlanRequest
from varuna.core.progress import Progress
from varuna.core.schedule import DEFAULT_SCHEDULE, PLANNED_KINDS, schedule_kind
from varuna.core.selective_recompute import choose_recompute_segments

__all__ = [
    "Candidate",
    "AutoConfigResult",
    "autoconfigure",
    "autoconfigure_request",
    "autoconfigure_schedules",
    "choose_micro_batch_size",
    "plan_variants",
    "sweep_gpus",
    "GpuSweepPoint",
]

#: m stops growing once F(m)/m improves by this fraction or less (paper §4.3: larger micro-batches
#: help until the accelerator is saturated).
EFFICIENCY_GAIN = 0.05


@dataclass(kw_only=True)
class Candidate:
    """One configuration considered by the auto-configurator."""

    num_stages: int
    num_replicas: int
    micro_batch_size: int
    num_microbatches: tuple[int, ...]
    """Per replica."""
    stage_segments: tuple[tuple[int, int], ...]
    lower_bound_s: float
    """Analytic lower bound on the mini-batch time (Note [Lower bound])."""
    memory_bytes: int
    """Largest per-stage memory estimate (simulated stash counts when simulated)."""
    status: str
    """"simulated", "pruned" (its bound cannot beat the best), or "no-memory" (does not fit)."""
    config: SimConfig
    result: SimResult | None = None
    planner: _Planner | None = field(default=None, repr=False, compare=False)
    """The variant (schedule kind, recompute, sharding) that made it: its memory model."""

    @property
    def recompute(self) -> bool:
        return self.config.recompute

    @property
    def shard_optimizer(self) -> bool:
        return self.config.shard_optimizer

    @property
    def num_gpus(self) -> int:
        return self.num_stages * self.num_replicas

    @property
    def minibatch_s(self) -> float | None:
        return self.result.minibatch_s if self.result is not None else None

    @property
    def examples_per_s(self) -> float | None:
        return self.result.examples_per_s if self.result is not None else None

    def summary(self) -> dict:
        return {
            "P": self.num_stages,
            "D": self.num_replicas,
            "m": self.micro_batch_size,
            "Nm": list(self.num_microbatches),
            "gpus_used": self.num_gpus,
            "status": self.status,
            "lower_bound_s": self.lower_bound_s,
            "minibatch_s": self.minibatch_s,
            "examples_per_s": self.examples_per_s,
            "examples_per_s_per_gpu": None
            if self.examples_per_s is None
            else self.examples_per_s / self.num_gpus,
            "memory_bytes": self.memory_bytes,
            "stage_segments": [list(r) for r in self.stage_segments],
            "schedule": self.config.schedule,
            "recompute": self.config.recompute,
            "recompute_segments": None if self.config.recompute_segments is None
            else list(self.config.recompute_segments),
            "shard_optimizer": self.config.shard_optimizer,
        }


@dataclass(kw_only=True)
class AutoConfigResult:
    """The ranking: ``candidates`` sorted best first (simulated ones by time, then the rest)."""

    best: Candidate
    candidates: list[Candidate]
    gpus: int
    global_batch_size: int
    micro_batch_size: int
    """The efficiency-chosen m (some depths may use a smaller one to fit memory)."""
    simulations: int
    elapsed_s: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "gpus": self.gpus,
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "simulations": self.simulations,
            "elapsed_s": self.elapsed_s,
            "notes": list(self.notes),
            "best": self.best.summary(),
            "candidates": [c.summary() for c in self.candidates],
        }


def choose_micro_batch_size(cal: Calibration) -> int:
    """Smallest measured m past which forward time per example improves by <= 5%.

    >>> cal = Calibration.synthetic(0.01, num_segments=2, overhead_s=0.002, micro_batch_sizes=(1, 2, 4, 8))
    >>> choose_micro_batch_size(cal)   # F(m)/m: 0.024, 0.022 (8% better), 0.021 (4.5% better): stop
    2
    """
    ms = cal.micro_batch_sizes

    def per_example(m: int) -> float:
        return sum(cal.fwd_s(i, m) for i in range(cal.num_segments)) / m

    for a, b in zip(ms, ms[1:]):
        if per_example(b) > (1.0 - EFFICIENCY_GAIN) * per_example(a):
            return a
    return ms[-1]


# Note [Lower bound]: stage k can start micro-batch 0 only after stages 0..k-1 forwarded it (and
# the activations crossed the links), must then run all its tasks one after another (Nm·(F+B)
# plus its recomputes: at least Nm-1 on every stage but the last, for every schedule we run), and
# after its last backward the gradient must still pass back through stages k-1..0 (zero-bubble
# kinds: only the input-gradient half B of each backward is on that path). So stage 0's
# last backward ends no earlier than max_k [Σ_{j<k}(F_j + act_j) + work_k + Σ_{j<k}(B_j + grad_j)],
# and every stage's last backward no earlier than its own first-input time + work. The mini-batch
# ends after the all-reduce and optimizer step that follow. This is exact for a perfectly
# balanced pipeline without bubbles, so pruning by it rarely simulates far from the optimum.


class _Planner:
    """Caches per-(m) segment costs and per-(m, P) partitions across candidates and G values."""

    def __init__(self, cal: Calibration, schedule: str, recompute: bool, chunks: int, host_slots, memory,
                 shard: bool = False, fixed_segments: tuple[int, ...] | None = None):
        self.cal = cal
        self.schedule = schedule
        self.kind = schedule_kind(schedule)
        self.recompute = recompute
        self.shard = shard
        self.chunks = chunks
        self.host_slots = host_slots
        self.memory = memory
        self._seg: dict[int, tuple] = {}
        self._part: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}
        self._fit: dict[tuple[int, int, int, int], tuple[tuple[tuple[int, int], ...], int]] = {}
        self._sel: dict[tuple, tuple[int, ...] | None] = {}
        #: the recompute set the user gave (``--recompute-segments``): planned with, never chosen
        self.fixed_segments = fixed_segments
        #: Note [Selective recompute] (varuna/core/selective_recompute.py): where the stages
        #: recompute and the memory is known, recompute only what it needs
        self.selective = (recompute or not self.kind.recompute_optional) and memory is not None \
            and not self.kind.splits_backward and self.chunks_per_device == 1 and fixed_segments is None

    def seg_costs(self, m: int):
        if m not in self._seg:
            cal, n = self.cal, self.cal.num_segments
            f = [cal.fwd_s(i, m) for i in range(n)]
            r = [cal.recompute_s(i, m) for i in range(n)]
            b = [cal.bwd_s(i, m) for i in range(n)]
            full, last = segment_costs(cal, m, self.schedule, self.recompute)
            self._seg[m] = (f, r, b, full, last, candidate_maxima(full, last))
        return self._seg[m]

    def partition(self, m: int, num_virtual: int) -> tuple[tuple[int, int], ...]:
        key = (m, num_virtual)
        if key not in self._part:
            _, _, _, full, last, cands = self.seg_costs(m)
            self._part[key] = tuple(balanced_stages(full, last, num_virtual, candidates=cands))
        return self._part[key]

    @property
    def chunks_per_device(self) -> int:
        return self.kind.chunks_per_device(self.chunks)

    def stash_estimate(self, P: int, k: int, nm: int) -> int:
        """Peak in-flight micro-batches of stage k (analytic, before any simulation)."""
        return self.kind.stash_peak(P, k, nm, chunks=self.chunks)

    def stage_recomputes(self, P: int, k: int) -> bool:
        """Whether device k of P recomputes (any of its model chunks does)."""
        v = self.chunks_per_device
        return any(self.kind.recomputes(P * v, ch * P + k, recompute=self.recompute) for ch in range(v))

    def shards(self, D: int) -> int:
        """Replicas the optimizer state is split over at D replicas."""
        return D if self.shard else 1

    def stage_memories(
        self, P: int, m: int, nm: int, ranges, stash: Sequence[int] | None = None, *, D: int = 1,
        segments: tuple[int, ...] | None = None,
    ) -> list[int]:
        """Per device, the memory estimate (analytic stash counts unless ``stash`` is given;
        ``segments``: the recompute set, None: whole stages)."""
        return [self._stage_memory(P, k, m, nm, ranges, stash, D, segments) for k in range(P)]

    def _stage_memory(self, P: int, k: int, m: int, nm: int, ranges, stash, D: int, segments) -> int:
        s = stash[k] if stash is not None else self.stash_estimate(P, k, nm)
        return stage_memory(self.cal, list(ranges[k::P]), m, s, self.stage_recomputes(P, k),
                            weight_versions=self.kind.weight_versions, optimizer_shards=self.shards(D),
                            replicas=D, recompute_segments=segments)

    def memory_of(
        self, P: int, m: int, nm: int, ranges, stash: Sequence[int] | None = None, *, D: int = 1,
        segments: tuple[int, ...] | None = None,
    ) -> int:
        return max(self.stage_memories(P, m, nm, ranges, stash, D=D, segments=segments))

    def recompute_segments(
        self, P: int, m: int, nm: int, ranges, D: int, stash: Sequence[int] | None = None
    ) -> tuple[int, ...] | None:
        """The recompute set of a selective plan (Note [Selective recompute]): per recomputing
        stage the fewest seconds of recompute that keep it within the memory; None (whole stages)
        where the plan is not selective or a stage needs every segment recomputed; the user's set
        where one was given."""
        if self.fixed_segments is not None:
            return self.fixed_segments
        if not self.selective:
            return None
        key = (P, m, nm, tuple(ranges), D, None if stash is None else tuple(stash))
        if key not in self._sel:
            cal, chosen, everything = self.cal, set(), set()
            acts = [cal.activation_bytes(i, m) for i in range(cal.num_segments)]
            secs = [cal.recompute_s(i, m) for i in range(cal.num_segments)]
            for k in range(P):
                if not self.stage_recomputes(P, k):
                    continue
                a, b = ranges[k]
                whole = set(range(a, b + 1))

                def fits(s: frozenset[int], k: int = k) -> bool:
                    return self._stage_memory(P, k, m, nm, ranges, stash, D, tuple(sorted(s))) <= self.memory

                got = choose_recompute_segments(a, b, fits, acts, secs)
                chosen |= whole if got is None else got
                everything |= whole
            self._sel[key] = None if chosen == everything else tuple(sorted(chosen))
        return self._sel[key]

    def fit(self, P: int, m: int, nm: int, D: int = 1) -> tuple[tuple[tuple[int, int], ...], int]:
        """The time-balanced map, or, when that overflows memory, the fastest map found whose
        stages keep their static bytes (parameters, gradients, optimizer state: 1/D of it when
        sharded) under the memory left after their activations (Note [Memory-aware split] in
        varuna/core/partition.py). Returns (ranges, largest stage memory)."""
        v = self.chunks_per_device
        ranges = self.partition(m, P * v)
        fixed = self.fixed_segments
        mem = self.memory_of(P, m, nm, ranges, D=D, segments=fixed)
        if self.memory is None or mem <= self.memory or v > 1:
            return ranges, mem
        key = (P, m, nm, self.shards(D))
        if key not in self._fit:
            cal, shards = self.cal, self.shards(D)
            static = [s.param_bytes + s.grad_bytes + s.optimizer_bytes / shards for s in cal.segments]
            _, _, _, full, last, cands = self.seg_costs(m)
            best = (ranges, mem)
            cap_prev = None
            for _ in range(4):  # the activation allowance depends on the map: iterate a little
                per_stage = self.stage_memories(P, m, nm, best[0], D=D, segments=fixed)
                allowance = max(per_stage[k] - sum(static[a : b + 1]) for k, (a, b) in enumerate(best[0]))
                cap = self.memory - allowance
                if cap <= 0 or cap == cap_prev:
                    break
                cap_prev = cap
                try:
                    cand = tuple(
                        balanced_stages(full, last, P, candidates=cands, weights=static, capacity=cap)
                    )
                except ValueError:
                    break
                best = (cand, self.memory_of(P, m, nm, cand, D=D, segments=fixed))
                if best[1] <= self.memory:
                    break
            self._fit[key] = best
        return self._fit[key]

    def config(self, P: int, D: int, m: int, M: int, ranges, nm: int | None = None) -> SimConfig:
        segments = self.fixed_segments if nm is None else self.recompute_segments(P, m, nm, ranges, D)
        return SimConfig.for_global_batch(
            recompute_segments=segments,
            global_batch_size=M,
            num_replicas=D,
            micro_batch_size=m,
            num_stages=P,
            stage_segments=ranges,
            schedule=self.schedule,
            recompute=self.recompute,
            shard_optimizer=self.shard and D > 1,
            chunks=self.chunks_per_device,
            host_slots=self.host_slots,
            jitter_scale=0.0,
        )

    def lower_bound(self, cfg: SimConfig, nm: int, m: int) -> float:
        """Note [Lower bound]."""
        cal, P = self.cal, cfg.num_stages
        f, r, b, _, _, _ = self.seg_costs(m)
        ranges = cfg.stage_segments
        assert ranges is not None
        v = cfg.chunks
        if v > 1:  # interleaved: only the busiest device's work (a loose but valid bound)
            work = [0.0] * P
            for vs, (a, e) in enumerate(ranges):
                work[vs % P] += nm * sum(f[a : e + 1]) + nm * sum(b[a : e + 1])
            segs = [[i for a, e in ranges[k::P] for i in range(a, e + 1)] for k in range(P)]
            sync = sync_costs(cal, cfg, segs)
            return max(work[k] + sync[k][0] + sync[k][1] for k in range(P))
        host = host_of_ranks(cfg)  # replica 0 holds ranks 0..P-1 and the most micro-batches
        fk = [sum(f[a : e + 1]) for a, e in ranges]
        bk = [sum(b[a : e + 1]) for a, e in ranges]
        sel = cfg.recompute_segments  # Note [Selective recompute]: only those are forwarded twice
        rk = [sum(r[i] for i in range(a, e + 1) if sel is None or i in sel) for a, e in ranges]
        hop = []
        for k in range(P - 1):
            nbytes = cal.act_bytes(ranges[k][1], m)
            hop.append(cal.p2p_s(nbytes, host[k] == host[k + 1]))
        sync = sync_costs(cal, cfg, [range(a, e + 1) for a, e in ranges])
        # chain[j] = head_j + work_j + tail_j: when stage 0 can finish at the earliest if stage j
        # is the one that holds it back. Stage k's last backward ends no earlier than
        # max_{j>=k} chain[j] - tail_k (the last gradient from stage j must pass k).
        # A short last micro-batch (replica 0 has one only when D == 1) is counted as free, and
        # when it is the only one, so is the fill: a weaker bound, but still a bound.
        n_full = nm - 1 if cfg.last_size_of(0) != m else nm
        fill = 1.0 if n_full > 0 else 0.0
        chain, tails = [], []
        head = 0.0  # Σ_{j<k} (F_j + act send_j)
        tail = 0.0  # Σ_{j<k} (B_j + grad send_j)
        # A split backward (zero-bubble kinds) sends the gradient after B's input half only.
        b_hop = 1.0 - cfg.weight_grad_fraction if self.kind.splits_backward else 1.0
        for k in range(P):
            # Recomputes: at least Nm-1 where the stage recomputes; none counted on the last stage
            # (gpipe's does recompute, but a weaker bound is still a bound).
            n_rec = max(n_full - 1, 0) if k < P - 1 and self.stage_recomputes(P, k) else 0
            work = n_full * (fk[k] + bk[k]) + n_rec * rk[k]
            chain.append(head + work + tail)
            tails.append(tail)
            if k < P - 1:
                head += fill * (fk[k] + hop[k])
                tail += fill * (b_hop * bk[k] + hop[k])
        bound, suffix = 0.0, 0.0
        for k in range(P - 1, -1, -1):
            suffix = max(suffix, chain[k])
            bound = max(bound, suffix - tails[k] + sync[k][0] + sync[k][1])
        return bound


def _check_schedule(schedule: str) -> None:
    schedule_kind(schedule)  # raises "unknown schedule kind ..." with the choices


def autoconfigure(
    cal: Calibration,
    *,
    gpus: int,
    global_batch_size: int,
    gpu_memory_bytes: int | None = None,
    schedule: str | None = DEFAULT_SCHEDULE,
    recompute: bool | None = True,
    shard_optimizer: bool | None = False,
    chunks: int = 2,
    micro_batch_size: int | None = None,
    host_slots: int | tuple[int, ...] = 1,
    exhaustive: bool = False,
    progress: bool | None = False,
    pipeline_depth: int | None = None,
    recompute_segments: Sequence[int] | None = None,
    _planner: _Planner | None = None,
) -> AutoConfigResult:
    """Rank configurations for ``gpus`` GPUs (see the module docstring).

    Note [Joint plan]: ``schedule``, ``recompute`` and ``shard_optimizer`` may be left to the
    planner (None): it then considers every kind that plans by default
    (``varuna.core.schedule.PLANNED_KINDS``), with and without recompute where the kind makes it
    optional, with and without sharded optimizer state, at every P, D, m and map, and keeps the
    fastest simulated configuration that fits ``gpu_memory_bytes``. So a model that fits without
    recompute runs without it (no forward is paid twice), and recompute or sharding appear only
    where memory needs them. Given values are kept as they are.

    ``micro_batch_size`` fixes m (it must be measured, or interpolable from two measured sizes),
    ``pipeline_depth`` fixes P; ``recompute_segments`` fixes the recompute set (Note [Selective
    recompute]: the memory is counted with it, and it is not chosen);
    ``exhaustive`` simulates every candidate instead of pruning by the lower bound (for tests and
    "why not P=..." questions). Simulations use mean times (no jitter), so the ranking is
    deterministic. ``progress``: a bar over the candidates (:class:`varuna.core.progress.Progress`
    ``enabled``; None: on a terminal), for front-ends only.

    >>> from varuna.core.calibration import Calibration
    >>> cal = Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1, 2))
    >>> autoconfigure(cal, gpus=4, global_batch_size=16, schedule="pipedream")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: unknown schedule kind 'pipedream'; choose one of varuna, gpipe, 1f1b, ...
    """
    t0 = time.perf_counter()
    if schedule is None:  # Note [Joint plan]: the fastest of the kinds that plan by default
        return autoconfigure_schedules(
            cal, gpus=gpus, global_batch_size=global_batch_size, schedules=PLANNED_KINDS,
            chunk_options=(chunks,), gpu_memory_bytes=gpu_memory_bytes, recompute=recompute,
            shard_optimizer=shard_optimizer, micro_batch_size=micro_batch_size, host_slots=host_slots,
            exhaustive=exhaustive, progress=progress, pipeline_depth=pipeline_depth,
            recompute_segments=recompute_segments,
        )
    _check_schedule(schedule)
    fixed = None if recompute_segments is None else tuple(sorted(set(recompute_segments)))
    if fixed and fixed[-1] >= cal.num_segments:
        raise ValueError(f"--recompute-segments names segment {fixed[-1]} but the calibration's model has "
                         f"{cal.num_segments} segments (0-{cal.num_segments - 1}); drop the indices past the "
                         "last one")
    if not 1 <= gpus <= MAX_GPUS:
        raise ValueError(f"gpus must be between 1 and {MAX_GPUS}, got {gpus}")
    if global_batch_size < 1:
        raise ValueError(f"global batch size must be >= 1, got {global_batch_size}")
    planners = [_planner] if _planner is not None else [
        _Planner(cal, schedule, r, chunks, host_slots, gpu_memory_bytes, shard=sh, fixed_segments=fixed)
        for r, sh in plan_variants(schedule, recompute, shard_optimizer)
    ]
    planner = planners[-1]  # the most frugal variant: what "nothing fits" is explained with
    if micro_batch_size is not None:
        cal.fwd_s(0, micro_batch_size)  # raises the "calibration lacks m=..." error when it must
        preferred = micro_batch_size
        m_options = [micro_batch_size]
    else:
        preferred = choose_micro_batch_size(cal)
        m_options = [x for x in reversed(cal.micro_batch_sizes) if x <= preferred]
    notes: list[str] = []
    max_p = min(cal.num_segments // planner.chunks_per_device, gpus)
    depths = range(1, max_p + 1) if pipeline_depth is None else [pipeline_depth]
    candidates = [
        cand
        for P in depths
        for variant in planners
        if (variant.shard is False or gpus // P > 1)  # sharding over one replica is no sharding
        and (cand := _candidate(variant, P, gpus, global_batch_size, m_options, notes)) is not None
    ]
    if not any(c.status == "pruned" for c in candidates):
        _explain_nothing_fits(planner, candidates, notes, gpus, global_batch_size, m_options, max_p)
    live = sum(c.status == "pruned" for c in candidates)  # those _branch_and_bound decides
    with Progress(f"auto-config G={gpus}", total=live, unit="config", enabled=progress) as bar:
        best, simulations = _branch_and_bound(planner, candidates, gpus, exhaustive, bar)
    candidates.sort(key=_rank)
    return AutoConfigResult(
        best=best,
        candidates=candidates,
        gpus=gpus,
        global_batch_size=global_batch_size,
        micro_batch_size=preferred,
        simulations=simulations,
        elapsed_s=time.perf_counter() - t0,
        notes=notes,
    )


def autoconfigure_request(
    request: PlanRequest, *, progress: bool | None = False, exhaustive: bool = False
) -> AutoConfigResult:
    """:func:`autoconfigure` for a :class:`varuna.core.planning.PlanRequest` (the value object the
    launcher, ``varuna-simulate`` and the manager's planner build); its calibration is loaded
    here when it is a path. ``ValueError`` (one line) without a calibration or when nothing fits.

    >>> from varuna.core.calibration import Calibration
    >>> from varuna.core.planning import PlanRequest
    >>> cal = Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1, 2))
    >>> best = autoconfigure_request(PlanRequest(calibration=cal, global_batch_size=16, gpus=4)).best
    >>> best.num_stages * best.num_replicas <= 4
    True
    """
    cal = request.load_calibration()
    if cal is None:
        raise ValueError("auto-config needs a calibration (--calibration FILE, from varuna-profile)")
    return autoconfigure(
        cal,
        gpus=request.gpus,
        global_batch_size=request.global_batch_size,
        gpu_memory_bytes=request.gpu_memory_bytes,
        schedule=request.schedule,
        recompute=request.recompute,
        shard_optimizer=request.shard_optimizer,
        chunks=request.chunks,
        micro_batch_size=request.micro_batch_size,
        host_slots=request.host_slots,
        recompute_segments=request.recompute_segments,
        exhaustive=exhaustive,
        progress=progress,
    )


def plan_variants(
    schedule: str, recompute: bool | None, shard_optimizer: bool | None
) -> list[tuple[bool, bool]]:
    """(recompute, shard) pairs auto-config weighs for ``schedule`` (Note [Joint plan]), the
    likely fastest first: a given value as it is (as the kind runs it), else both where the kind
    makes recompute optional.

    >>> plan_variants("1f1b", None, None)
    [(False, False), (False, True), (True, False), (True, True)]
    >>> plan_variants("varuna", None, False)   # varuna always recomputes
    [(True, False)]
    """
    kind = schedule_kind(schedule)
    if recompute is None:
        recomputes = [False, True] if kind.recompute_optional else [kind.effective_recompute(True)]
    else:
        recomputes = [kind.effective_recompute(recompute)]
    shards = [False, True] if shard_optimizer is None else [shard_optimizer]
    if kind.weight_versions > 1:
        shards = [False]  # the runtime refuses sharded state with two weight versions
    return [(r, sh) for r in recomputes for sh in shards]


def _candidate(
    planner: _Planner, P: int, gpus: int, M: int, m_options: Sequence[int], notes: list[str]
) -> Candidate | None:
    """Depth P's candidate: the largest m (of ``m_options``, descending) whose map fits in memory,
    else a "no-memory" one at the smallest m; None (with a note) when P cannot run at all."""
    D = min(gpus // P, M)
    # m must leave every replica at least one micro-batch.
    usable = [x for x in m_options if -(-M // x) >= D]
    if not usable:
        notes.append(f"P={P}: every micro-batch size leaves a replica empty with D={D}")
        return None
    usable = [x for x in usable if -(-M // (x * D)) <= MAX_MICROBATCHES]
    if not usable:
        notes.append(f"P={P}: more than {MAX_MICROBATCHES} micro-batches per replica at every m (too large "
                     "a global batch to simulate)")
        return None
    fits = False
    for m in usable:
        counts, _ = microbatch_counts(M, m, D)
        ranges, mem = planner.fit(P, m, counts[0], D)
        fits = planner.memory is None or mem <= planner.memory
        if fits:
            break
    # Nothing fits: the smallest m's map is kept, marked "no-memory".
    if fits:
        reason = next((r for n in counts if (r := planner.kind.unsupported(P, n)) is not None), None)
        if reason is not None:
            notes.append(f"P={P}: {reason} (Nm={max(counts)})")
            return None
    cfg = planner.config(P, D, m, M, ranges, counts[0] if fits else None)
    if cfg.recompute_segments is not None:
        mem = planner.memory_of(P, m, counts[0], ranges, D=D, segments=cfg.recompute_segments)
    return Candidate(
        num_stages=P,
        num_replicas=D,
        micro_batch_size=m,
        num_microbatches=counts,
        stage_segments=ranges,
        lower_bound_s=planner.lower_bound(cfg, max(counts), m) if fits else float("inf"),
        memory_bytes=mem,
        status="pruned" if fits else "no-memory",
        config=cfg,
        planner=planner,
    )


def _explain_nothing_fits(
    planner: _Planner,
    candidates: Sequence[Candidate],
    notes: Sequence[str],
    gpus: int,
    M: int,
    m_options: Sequence[int],
    max_p: int,
) -> NoReturn:
    """Raise the ValueError that says why no depth fits and what to change."""
    memory, v = planner.memory, planner.chunks_per_device
    num_segments = planner.cal.num_segments
    if memory is not None and any(c.status == "no-memory" for c in candidates):
        mem_txt = f"{memory / 2**30:.2f} GiB"
        # Which depth would fit if G were larger? Tell the user how many GPUs to ask for.
        m = m_options[-1]
        for P in range(max_p + 1, num_segments // v + 1):
            if planner.fit(P, m, -(-M // m), max(1, gpus // P))[1] <= memory:
                raise ValueError(
                    f"the model needs at least P={P} pipeline stages to fit in {mem_txt} per GPU, but "
                    f"only G={gpus} GPUs were given; ask for at least {P} GPUs or use GPUs with more "
                    f"memory"
                )
        raise ValueError(
            f"the model does not fit in {mem_txt} per GPU even at P={num_segments // v} "
            f"(one segment per stage); use GPUs with more memory or add cut-points"
        )
    more = f" (and {len(notes) - 2} more)" if len(notes) > 2 else ""
    raise ValueError(
        f"no valid configuration for G={gpus}, global batch {M}: "
        + "; ".join(notes[:2])
        + more
        + "; use a smaller --micro-batch-size or a larger global batch"
    )


def _branch_and_bound(
    planner: _Planner, candidates: Sequence[Candidate], gpus: int, exhaustive: bool, bar: Progress
) -> tuple[Candidate, int]:
    """Simulate the candidates in increasing order of their lower bound until the next bound
    cannot beat the best time; returns (best, simulations run)."""
    # On a tie the plan without recompute, then without sharding, is simulated first and kept
    # (Note [Joint plan]: neither is paid for when it buys nothing).
    live = sorted(
        (c for c in candidates if c.status == "pruned"),
        key=lambda c: (c.lower_bound_s, c.num_stages, c.config.recompute, c.config.shard_optimizer),
    )
    best: Candidate | None = None
    simulations = 0
    for cand in live:
        if not exhaustive and best is not None and cand.lower_bound_s >= best.result.minibatch_s:
            bar.set_postfix(f"{len(live) - simulations} pruned by their bound")
            bar.update(len(live) - simulations)  # decided without simulating
            break  # sorted: no later candidate can win either
        bar.set_postfix(f"P={cand.num_stages} D={cand.num_replicas} m={cand.micro_batch_size}")
        own = cand.planner or planner
        cand.result = simulate(own.cal, cand.config)
        simulations += 1
        bar.update()
        cand.status = "simulated"
        cand.memory_bytes = _simulated_memory(own, cand)
        if own.selective and planner.memory is not None and cand.memory_bytes > planner.memory:
            # The simulated stash exceeds the analytic one: choose the recompute set again for it.
            P, m, D = cand.num_stages, cand.micro_batch_size, cand.num_replicas
            segments = own.recompute_segments(P, m, max(cand.num_microbatches), cand.stage_segments, D,
                                              stash=cand.result.peak_stashed)
            cand.config = dataclasses.replace(cand.config, recompute_segments=segments)
            cand.result = simulate(own.cal, cand.config)
            simulations += 1
            cand.memory_bytes = _simulated_memory(own, cand)
        if planner.memory is not None and cand.memory_bytes > planner.memory:
            cand.status = "no-memory"
            continue
        if best is None or cand.result.minibatch_s < best.result.minibatch_s:
            best = cand
    if best is None:
        raise ValueError(
            f"no configuration for G={gpus} fits in memory once simulated stash counts are used; "
            f"use GPUs with more memory or a smaller micro-batch size"
        )
    return best, simulations


def _simulated_memory(planner: _Planner, cand: Candidate) -> int:
    """The candidate's largest stage memory with the stash counts its simulation found."""
    return planner.memory_of(cand.num_stages, cand.micro_batch_size, max(cand.num_microbatches),
                             cand.stage_segments, stash=cand.result.peak_stashed, D=cand.num_replicas,
                             segments=cand.config.recompute_segments)


def _rank(c: Candidate):
    if c.status == "simulated":
        return (0, c.result.minibatch_s, c.num_stages)
    if c.status == "pruned":
        return (1, c.lower_bound_s, c.num_stages)
    return (2, 0.0, c.num_stages)


@dataclass(kw_only=True)
class GpuSweepPoint:
    """The best configuration at one G."""

    gpus: int
    best: Candidate | None
    """None when nothing fits at this G."""
    error: str | None = None

    @property
    def examples_per_s(self) -> float:
        return self.best.examples_per_s if self.best is not None else 0.0

    @property
    def examples_per_s_per_gpu(self) -> float:
        return self.examples_per_s / self.gpus


def autoconfigure_schedules(
    cal: Calibration,
    *,
    gpus: int,
    global_batch_size: int,
    schedules: Sequence[str] = ("varuna", "varuna-interleaved"),
    chunk_options: Sequence[int] = (2, 3, 4),
    **kwargs,
) -> AutoConfigResult:
    """:func:`autoconfigure` for every kind of ``schedules`` (the chunked ones at each v of
    ``chunk_options``): the result of the kind and v whose best configuration is fastest; its
    ``best.config`` names them (``schedule``, ``chunks``). A kind or v that cannot run here (too
    few segments for P·v virtual stages, Nm not a multiple of P) is skipped with a note.

    >>> from varuna.core.calibration import Calibration
    >>> cal = Calibration.synthetic(0.01, num_segments=8, micro_batch_sizes=(1, 2))
    >>> res = autoconfigure_schedules(cal, gpus=4, global_batch_size=32)
    >>> res.best.config.schedule in ("varuna", "varuna-interleaved")
    True
    """
    results: list[AutoConfigResult] = []
    notes: list[str] = []
    for name in schedules:
        kind = schedule_kind(name)
        for v in chunk_options if kind.chunked else (1,):
            try:
                results.append(autoconfigure(cal, gpus=gpus, global_batch_size=global_batch_size,
                                             schedule=name, chunks=v, **kwargs))
            except ValueError as e:
                notes.append(f"{kind.label(recompute=True, chunks=v)}: {e}")
    if not results:
        raise ValueError("no schedule kind fits: " + "; ".join(notes))
    best = max(results, key=lambda r: r.best.result.examples_per_s if r.best.result else 0.0)
    best.notes.extend(notes)
    return best


def sweep_gpus(
    cal: Calibration,
    gpus: Sequence[int],
    *,
    global_batch_size: int,
    gpu_memory_bytes: int | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    recompute: bool = True,
    chunks: int = 2,
    micro_batch_size: int | None = None,
    host_slots: int | tuple[int, ...] = 1,
    progress: bool | None = False,
) -> list[GpuSweepPoint]:
    """Best throughput and throughput per GPU for each G in ``gpus`` ("which G is worth asking for").
    ``progress``: a bar over the G values, as in :func:`autoconfigure`.

    >>> from varuna.core.calibration import Calibration
    >>> cal = Calibration.synthetic(0.01, num_segments=8, micro_batch_sizes=(1, 2))
    >>> [p.gpus for p in sweep_gpus(cal, [2, 4], global_batch_size=32)]
    [2, 4]
    """
    _check_schedule(schedule)
    planner = _Planner(cal, schedule, recompute, chunks, host_slots, gpu_memory_bytes)
    out = []
    with Progress("sweep over G", total=len(gpus), unit="G", enabled=progress) as bar:
        for g in gpus:
            bar.set_postfix(f"G={g}")
            try:
                res = autoconfigure(
                    cal,
                    gpus=g,
                    global_batch_size=global_batch_size,
                    gpu_memory_bytes=gpu_memory_bytes,
                    schedule=schedule,
                    recompute=recompute,
                    chunks=chunks,
                    micro_batch_size=micro_batch_size,
                    host_slots=host_slots,
                    _planner=planner,
                )
                out.append(GpuSweepPoint(gpus=g, best=res.best))
            except ValueError as e:
                out.append(GpuSweepPoint(gpus=g, best=None, error=str(e)))
            bar.update()
    return out
