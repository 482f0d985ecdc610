"""The manager's decisions, as pure functions of their inputs: which P×D to run on the usable
VMs, whether growing onto new VMs pays, and which workers are fail-stutter slow.

Nothing here talks to VMs, the network or the database, so every rule is unit-tested directly
(tests/test_manager_policy.py).

Layout (Note [Choosing P×D]): with a calibration the simulator's auto-config ranks every P×D
that fits the G slots and we take its best (paper §4.3: the fastest configuration is often not
the one using every GPU). Without one (or when the simulator cannot be imported) we fall back to
the largest P×D whose P divides the model's segment count (the stages then hold equal numbers of
segments), preferring the shallower pipeline on ties (fewer bubbles, less activation traffic).
The job can also force P.

    >>> plan = choose_layout(slots=[1] * 6, request=PlanRequest(calibration=None, global_batch_size=24),
    ...                      num_segments=4)
    >>> (plan.pipeline_depth, plan.data_parallel)
    (1, 6)
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from varuna.core.calibration import Calibration
from varuna.core.planning import PlanRequest

__all__ = [
    "LayoutPlan",
    "StutterConfig",
    "StutterDetector",
    "StutterVerdict",
    "choose_layout",
    "fallback_layout",
    "grow_gain",
    "predicted_compute_s",
]


@dataclass(frozen=True, kw_only=True)
class LayoutPlan:
    """A P×D choice for the available slots."""

    pipeline_depth: int
    data_parallel: int
    micro_batch_size: int
    """m from auto-config, or the job's own (0: the script decides)."""
    predicted_samples_per_s: float
    """Auto-config's prediction; without a calibration, P×D (throughput assumed to scale with the
    workers used, which is all a grow decision needs)."""
    source: str
    """``simulator`` or ``fallback`` (and why), for the event log."""

    @property
    def world_size(self) -> int:
        return self.pipeline_depth * self.data_parallel


def fallback_layout(
    *,
    slots: Sequence[int],
    global_batch_size: int,
    num_segments: int = 0,
    pipeline_depth: int = 0,
    micro_batch_size: int = 0,
    note: str = "",
    chunks: int = 1,
) -> LayoutPlan:
    """The largest P×D that fits ``sum(slots)`` with P dividing ``num_segments`` (any P ≤ it when
    0 is not known: P = 1), or with P forced. D never exceeds the micro-batches available. With
    ``chunks`` > 1 (interleaved kinds) P is at least 2 and P·chunks at most ``num_segments``.

    >>> fallback_layout(slots=[1] * 5, global_batch_size=24, num_segments=4).world_size
    5
    >>> fallback_layout(slots=[1] * 3, global_batch_size=24, pipeline_depth=2).data_parallel
    1
    """
    total = sum(slots)
    per_replica = global_batch_size // micro_batch_size if micro_batch_size else global_batch_size
    max_d = max(1, per_replica)
    if pipeline_depth:
        if pipeline_depth > total:
            raise ValueError(
                f"pipeline_depth {pipeline_depth} needs {pipeline_depth} slots but {total} are usable; "
                "wait for more VMs or lower pipeline_depth"
            )
        depths = [pipeline_depth]
    elif num_segments:
        depths = [p for p in range(1, min(num_segments, total) + 1) if num_segments % p == 0]
    else:
        depths = [1]
    if chunks > 1 and not pipeline_depth:
        depths = [p for p in range(2, total + 1) if not num_segments or (
            p * chunks <= num_segments and num_segments % p == 0)]
    if total < 1:
        raise ValueError("no usable slots")
    best: tuple[int, int] | None = None
    for p in depths:
        d = min(total // p, max_d)
        if d < 1:
            continue
        # Larger P×D first; on a tie the smaller P (iteration order keeps the first).
        if best is None or p * d > best[0] * best[1]:
            best = (p, d)
    if best is None:
        if chunks > 1:
            raise ValueError(f"no pipeline depth >= 2 with {chunks} chunks per process fits {total} slots"
                             + (f" and {num_segments} segments" if num_segments else ""))
        raise ValueError(f"no pipeline depth dividing {num_segments} segments fits {total} slots")
    p, d = best
    why = "fallback" + (f" ({note})" if note else "")
    return LayoutPlan(
        pipeline_depth=p,
        data_parallel=d,
        micro_batch_size=micro_batch_size,
        predicted_samples_per_s=float(p * d),
        source=why,
    )


def choose_layout(*, slots: Sequence[int], request: PlanRequest, num_segments: int = 0) -> LayoutPlan:
    """P×D for VMs with ``slots`` workers each (Note [Choosing P×D] in the module docstring),
    for the job ``request`` describes (a :class:`varuna.core.planning.PlanRequest`: global batch,
    schedule kind, chunks, a fixed m or P, memory, calibration): the simulator ranks the layouts
    by that schedule's speed. ``ValueError`` (one line) when nothing fits."""
    if not slots or sum(slots) < 1:
        raise ValueError("no usable slots")
    calibration = request.load_calibration()
    segments = num_segments or (calibration.num_segments if calibration is not None else 0)
    m, depth = request.micro_batch_size or 0, request.pipeline_depth or 0
    if calibration is None or depth:
        return fallback_layout(
            slots=slots,
            global_batch_size=request.global_batch_size,
            num_segments=segments,
            pipeline_depth=depth,
            micro_batch_size=m,
            note="P forced by the job" if depth else "no calibration",
            chunks=request.chunks,
        )
    try:
        from simulator.autoconfig import autoconfigure_request
    except ImportError as exc:  # the simulator is optional on a manager host
        return fallback_layout(
            slots=slots,
            global_batch_size=request.global_batch_size,
            num_segments=segments,
            micro_batch_size=m,
            note=f"simulator unavailable: {exc}",
        )
    # Ranks are placed as if every VM had the most slots of any (Note [Choosing P×D]).
    result = autoconfigure_request(dataclasses.replace(request, gpus=sum(slots), host_slots=max(slots)))
    best = result.best
    return LayoutPlan(
        pipeline_depth=best.num_stages,
        data_parallel=best.num_replicas,
        micro_batch_size=best.micro_batch_size,
        predicted_samples_per_s=float(best.examples_per_s or 0.0),
        source=f"simulator ({result.simulations} simulations)",
    )


def grow_gain(current: LayoutPlan | float, candidate: LayoutPlan) -> float:
    """Relative predicted speed-up of ``candidate`` over ``current`` (0.25 = 25 % faster).

    >>> a = fallback_layout(slots=[1] * 4, global_batch_size=24)
    >>> b = fallback_layout(slots=[1] * 6, global_batch_size=24)
    >>> grow_gain(a, b)
    0.5
    """
    now = current.predicted_samples_per_s if isinstance(current, LayoutPlan) else float(current)
    if now <= 0:
        return float("inf") if candidate.predicted_samples_per_s > 0 else 0.0
    return candidate.predicted_samples_per_s / now - 1.0


def predicted_compute_s(
    calibration: Calibration, first_segment: int, last_segment: int, micro_batch_size: int, *, recompute: bool
) -> float:
    """What the calibration predicts one micro-batch's forward + backward (+ recompute) takes on
    segments ``first_segment..last_segment`` (both included, the engine's stage ranges): the
    reference for the fail-stutter rule.

    >>> cal = Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1, 2))
    >>> one = predicted_compute_s(cal, 0, 0, 2, recompute=False)
    >>> round(predicted_compute_s(cal, 0, 1, 2, recompute=False) / one, 6)  # two segments
    2.0
    """
    if last_segment < first_segment:
        raise ValueError(f"segment range {first_segment}..{last_segment} is empty")
    total = 0.0
    for s in range(first_segment, last_segment + 1):
        total += calibration.fwd_s(s, micro_batch_size) + calibration.bwd_s(s, micro_batch_size)
        if recompute:
            total += calibration.recompute_s(s, micro_batch_size)
    return total


@dataclass(frozen=True, kw_only=True)
class StutterConfig:
    """When a worker counts as fail-stutter slow (paper §4.6)."""

    threshold_pct: float = 50.0
    """X: a heartbeat is slow when compute time > (1 + X/100) × the reference."""
    heartbeats: int = 5
    """N: that many slow heartbeats in a row mark the worker (and its VM) slow."""
    min_replicas_for_median: int = 3
    """The replicas' median is the reference when the stage has at least this many replicas."""


@dataclass(frozen=True, kw_only=True)
class StutterVerdict:
    """One observation's outcome."""

    slow_heartbeat: bool
    """This heartbeat exceeded the reference."""
    marked: bool
    """The worker has now exceeded it for N heartbeats in a row (report once)."""
    compute_s: float
    reference_s: float | None
    rule: str
    """``median`` (replicas), ``calibration``, or ``none`` (no reference available)."""


@dataclass
class StutterDetector:
    """Counts consecutive slow heartbeats per worker. Soft state: a restarted manager starts
    counting again, which only delays a verdict by N heartbeats.

    >>> det = StutterDetector(StutterConfig(threshold_pct=50, heartbeats=2))
    >>> peers = {0: 0.01, 1: 0.01, 2: 0.01}
    >>> det.observe(key=("j", 1, 2), step=1, compute_s=0.05, replica_compute_s=list(peers.values())).marked
    False
    >>> det.observe(key=("j", 1, 2), step=2, compute_s=0.05, replica_compute_s=list(peers.values())).marked
    True
    """

    config: StutterConfig = field(default_factory=StutterConfig)
    _runs: dict[tuple, tuple[int, int]] = field(default_factory=dict)  # key -> (last step, run length)

    def observe(
        self,
        *,
        key: tuple,
        step: int,
        compute_s: float,
        replica_compute_s: Sequence[float] = (),
        predicted_s: float | None = None,
    ) -> StutterVerdict:
        """Record one heartbeat of worker ``key`` at ``step``; ``replica_compute_s`` holds the
        latest compute time of every replica of its stage (itself included)."""
        if len(replica_compute_s) >= self.config.min_replicas_for_median:
            reference: float | None = statistics.median(replica_compute_s)
            rule = "median"
        elif predicted_s is not None and predicted_s > 0:
            reference, rule = predicted_s, "calibration"
        else:
            reference, rule = None, "none"
        last_step, run = self._runs.get(key, (-1, 0))
        if step <= last_step:  # the same step reported twice (a retried heartbeat) counts once
            return StutterVerdict(
                slow_heartbeat=False, marked=False, compute_s=compute_s, reference_s=reference, rule=rule
            )
        slow = reference is not None and compute_s > (1.0 + self.config.threshold_pct / 100.0) * reference
        run = run + 1 if slow else 0
        self._runs[key] = (step, run)
        return StutterVerdict(
            slow_heartbeat=slow,
            marked=slow and run == self.config.heartbeats,
            compute_s=compute_s,
            reference_s=reference,
            rule=rule,
        )

    def slow_now(self, predicate) -> int:
        """How many workers whose key satisfies ``predicate`` exceeded their reference on their
        latest heartbeat."""
        return sum(1 for key, (_, run) in self._runs.items() if run > 0 and predicate(key))

    def forget(self, predicate) -> None:
        """Drop the counters whose key satisfies ``predicate`` (an ended generation)."""
        for key in [k for k in self._runs if predicate(k)]:
            del self._runs[key]
