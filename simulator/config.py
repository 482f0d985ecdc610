"""What the simulator is asked and what it answers: :class:`SimConfig`, :class:`SimResult`, and
the checks that a config fits a calibration (:func:`validate_config`).

Example::

    >>> c = SimConfig.for_global_batch(global_batch_size=9, num_replicas=2, micro_batch_size=2, num_stages=2)
    >>> c.num_microbatches, c.last_microbatch_sizes, c.label()
    ((3, 2), (2, 1), '2x2 m=2 varuna')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from varuna.core.batching import microbatch_counts
from varuna.core.calibration import Calibration
from varuna.core.partition import balanced_stages
from varuna.core.policy import DEFAULT_STASH_HEADROOM
from varuna.core.schedule import ALL_SCHEDULE_KINDS, DEFAULT_SCHEDULE, schedule_kind
from varuna.core.timeline import Timeline

__all__ = [
    "MAX_MICROBATCHES",
    "MAX_GPUS",
    "SIM_SCHEDULE_KINDS",
    "SimConfig",
    "SimResult",
    "validate_config",
    "host_of_ranks",
    "segment_costs",
    "stage_segments_for",
]

#: Most micro-batches per replica one simulation takes: each is simulated event by event, and
#: beyond this a simulation runs for hours (a mistyped batch size, not a real job).
MAX_MICROBATCHES = 100_000
#: Most P×D one simulation takes (every rank has its host index, list, ...).
MAX_GPUS = 1_000_000
#: Bound of the time knobs (seconds) and of jitter_scale: beyond it a value is a mistake, and the
#: event times lose all precision.
_MAX_KNOB = 1e6

#: Schedules the simulator knows: the runtime's, plus interleaved 1F1B (simulation only).
SIM_SCHEDULE_KINDS = ALL_SCHEDULE_KINDS


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
    schedule: str = DEFAULT_SCHEDULE
    """One of SIM_SCHEDULE_KINDS."""
    recompute: bool = True
    """Recompute for gpipe / 1f1b / interleaved (varuna always recomputes, except on the last stage)."""
    recompute_segments: tuple[int, ...] | None = None
    """Selective recompute (``PipelineConfig.recompute_segments``): the segments a recomputed
    micro-batch recomputes; the rest keep their activations. None: all of a recomputing stage's."""
    shard_optimizer: bool = False
    """Optimizer state sharded over the D replicas (``VarunaConfig.optimizer_state.shard``): each
    steps 1/D of it and the weights are all-gathered after (``simulator.costs.sync_costs``)."""
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
    weight_grad_fraction: float = 0.5
    """Zero-bubble kinds (``schedule_kind(...).splits_backward``): the share of a stage's
    calibrated backward charged to its W task (weight gradients); B (input gradient) gets the
    rest. Calibrations measure the whole backward only, so the default splits it in halves
    (docs/simulator.md)."""
    device_types: tuple[tuple[str, ...], ...] | None = None
    """Mixed VM types: per replica, per stage, the VM type of its device (a name in the
    calibration's ``types``, docs/calibration.md): that device's F, R and B are the type's
    (``Calibration.for_type``). None: every device is the profiled host."""
    step_overhead_s: float | None = None
    """Runtime time added once per mini-batch beyond compute, all-reduce and optimizer: step
    set-up and the end-of-step agreement all-reduce (norm, overflow, loss) over every rank.
    None: from the calibration, as ``task_overhead_s``."""

    @classmethod
    def for_global_batch(
        cls, *, global_batch_size: int, num_replicas: int, micro_batch_size: int,
        shares: Sequence[int] | None = None, **kwargs
    ) -> SimConfig:
        """Config whose micro-batches split ``global_batch_size`` as the runtime does
        (``varuna.core.batching.microbatch_counts``; ``shares``: micro-batches per replica, as
        ``VarunaConfig.replica_shares``)."""
        counts, last = microbatch_counts(global_batch_size, micro_batch_size, num_replicas, shares)
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
        kind = schedule_kind(self.schedule).label(recompute=self.recompute, chunks=self.chunks)
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
            "recompute_segments": None if c.recompute_segments is None else list(c.recompute_segments),
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


def segment_costs(cal: Calibration, m: int, schedule: str = DEFAULT_SCHEDULE, recompute: bool = True):
    """Per segment, its cost on a non-last stage and on the last stage at m, for balancing stages
    (the kind's ``balancing_costs`` of the calibration's F, R and B).

    >>> cal = Calibration.synthetic(0.01, num_segments=2, micro_batch_sizes=(1,))
    >>> [round(x, 3) for x in segment_costs(cal, 1, "1f1b")[1]]   # 1f1b's last stage: F+B
    [0.03, 0.03]
    """
    n = cal.num_segments
    f = [cal.fwd_s(i, m) for i in range(n)]
    r = [cal.recompute_s(i, m) for i in range(n)]
    b = [cal.bwd_s(i, m) for i in range(n)]
    return schedule_kind(schedule).balancing_costs(f, r, b, recompute=recompute)


def stage_segments_for(
    cal: Calibration,
    num_virtual_stages: int,
    m: int,
    schedule: str = DEFAULT_SCHEDULE,
    recompute: bool = True,
) -> tuple[tuple[int, int], ...]:
    """Balanced ranges (see ``varuna.core.partition``) of the calibration's segments at m."""
    full, last = segment_costs(cal, m, schedule, recompute)
    return tuple(balanced_stages(full, last, num_virtual_stages))


def validate_config(cal: Calibration, c: SimConfig) -> tuple[tuple[int, int], ...]:
    """Raise ValueError unless ``c`` can be simulated with ``cal``; return its (virtual) stage ranges."""
    kind = schedule_kind(c.schedule)
    if not 0.0 <= c.weight_grad_fraction <= 1.0:
        raise ValueError(
            f"weight_grad_fraction must lie in [0, 1], got {c.weight_grad_fraction}; "
            "it is W's share of the backward"
        )
    if c.num_stages < 1 or c.num_replicas < 1 or c.micro_batch_size < 1:
        raise ValueError(
            f"P, D and m must be >= 1 (got P={c.num_stages}, D={c.num_replicas}, m={c.micro_batch_size})"
        )
    if c.num_gpus > MAX_GPUS:
        raise ValueError(
            f"P×D={c.num_gpus} is more than the simulator takes ({MAX_GPUS}); use fewer replicas"
        )
    kind.check_chunks(c.chunks)
    _check_replicas(c)
    _check_types(cal, c)
    _check_knobs(c)
    v = kind.chunks_per_device(c.chunks)
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
    _check_ranges(cal, ranges, V)
    _check_hosts(c)
    return ranges


def _check_replicas(c: SimConfig) -> None:
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
        if c.microbatches_of(d) > MAX_MICROBATCHES:
            raise ValueError(
                f"num_microbatches: replica {d} has {c.microbatches_of(d)} micro-batches, more than the "
                f"simulator takes ({MAX_MICROBATCHES}); use a larger micro-batch size or more replicas"
            )
        if c.microbatches_of(d) < 1:
            raise ValueError(
                f"replica {d} has {c.microbatches_of(d)} micro-batches; every replica needs >= 1"
            )
        if not 1 <= c.last_size_of(d) <= c.micro_batch_size:
            raise ValueError(f"replica {d}'s last micro-batch size {c.last_size_of(d)} is outside 1..m")


def _check_types(cal: Calibration, c: SimConfig) -> None:
    if c.device_types is None:
        return
    types = c.device_types
    if len(types) != c.num_replicas or any(len(row) != c.num_stages for row in types):
        raise ValueError(
            f"device_types needs D={c.num_replicas} rows of P={c.num_stages} VM type names (per replica, "
            f"per stage), got {[list(row) for row in types]}"
        )
    missing = sorted({t for row in types for t in row} - set(cal.types))
    if missing:
        raise ValueError(
            f"device_types names VM type(s) {', '.join(missing)} that the calibration does not have "
            f"(its types: {', '.join(sorted(cal.types)) or 'none'}); add them to its 'types' section"
        )


def _check_knobs(c: SimConfig) -> None:
    # ``not 0 <= x <= max`` so that NaN is refused too (every comparison with NaN is False).
    if c.stash_headroom < 0:
        raise ValueError(f"stash_headroom must be >= 0 (got {c.stash_headroom})")
    if c.max_sends_per_link < 1:
        raise ValueError("max_sends_per_link must be >= 1")
    if not 0 <= c.jitter_scale <= _MAX_KNOB:
        raise ValueError(f"jitter_scale must be >= 0 (and at most {_MAX_KNOB:.0e}), got {c.jitter_scale}")
    for name in ("task_jitter_s", "extra_latency_s"):
        if not 0 <= getattr(c, name) <= _MAX_KNOB:
            value = getattr(c, name)
            raise ValueError(f"{name} must be >= 0 seconds (and at most {_MAX_KNOB:.0e}), got {value}")
    for name in ("task_overhead_s", "placeholder_s", "step_overhead_s"):
        value = getattr(c, name)
        if value is not None and not 0 <= value <= _MAX_KNOB:
            raise ValueError(f"{name} must be >= 0 seconds or None (from the calibration), got {value}")


def _check_ranges(cal: Calibration, ranges: Sequence[tuple[int, int]], V: int) -> None:
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


def _check_hosts(c: SimConfig) -> None:
    if isinstance(c.host_slots, int):
        if c.host_slots < 1:
            raise ValueError("host_slots must be >= 1")
    elif sum(c.host_slots) < c.num_gpus or any(s < 1 for s in c.host_slots):
        raise ValueError(
            f"hosts with slots {list(c.host_slots)} hold {sum(c.host_slots)} ranks; "
            f"P×D={c.num_gpus} are needed"
        )


def host_of_ranks(config: SimConfig) -> list[int]:
    """Host index of every rank (rank = replica·P + stage; consecutive ranks fill a host).

    >>> host_of_ranks(SimConfig(num_stages=2, num_replicas=2, micro_batch_size=1, num_microbatches=2,
    ...                         host_slots=(3, 1)))
    [0, 0, 0, 1]
    """
    c = config
    n = c.num_gpus
    if isinstance(c.host_slots, int):
        return [r // c.host_slots for r in range(n)]
    out: list[int] = []
    for h, slots in enumerate(c.host_slots):
        out.extend([h] * slots)
    return out[:n]
