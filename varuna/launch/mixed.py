"""Mixed VM types in one job (issue #19): which slot of which VM type runs which (replica,
stage), each replica's share of the micro-batches and each stage's speed for the split, and which
host each rank lands on so the stage→type map holds.

Used by ``varuna-launch --hosts`` (host lines with ``type=``) and by the manager (pools of several
VM types). :func:`plan_cluster` is the **one place** a mixed plan is made: with costs (a
calibration) it is the simulator's heterogeneous auto-config, ``simulator.mixed_plan.plan_mixed``
(P, D, m, the stage→type map, the stage ranges, the shares; docs/simulator.md); without costs,
or with P×D fixed by the user, the speed-only rule :func:`plan_types`.

Note [Interim mixed planner]: with no calibration (P given, speeds only), P×D is the caller's;
this rule then takes the P·D fastest slots and tries two
arrangements of them — *grouped* (each replica's pipeline on VMs of one speed, fastest replica
first: uneven shares) and *striped* (stage s of every replica on the same type, fastest stages
first: uneven stage split) — and keeps the one with the higher predicted rate. For an
arrangement, stage i's speed for the (shared) split is the slowest of its VMs across replicas;
replica d's rate is Σ speeds / max_i (speed_i / v(d, i)) (its bottleneck stage with that split);
shares are proportional to the rates (``varuna.core.batching.proportional_shares``). It ignores
bubbles and communication: the simulator-based planner is what accounts for them.

Example::

    >>> plan = plan_types(["fast", "fast", "slow", "slow"], {"fast": 1.6, "slow": 1.0},
    ...                   pipeline_depth=2, data_parallel=2, num_microbatches=8)
    >>> plan.slot_types, plan.replica_shares, plan.stage_speeds
    ((('fast', 'fast'), ('slow', 'slow')), (5, 3), None)
    >>> place_ranks(plan, [("slow", 2), ("fast", 2)])
    (1, 1, 0, 0)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from varuna.core.batching import proportional_shares
from varuna.core.calibration import Calibration, VmType
from varuna.core.schedule import DEFAULT_SCHEDULE, schedule_kind

__all__ = [
    "TYPE_NAME_RE",
    "MixedPlan",
    "check_type_name",
    "costs_with_types",
    "parse_type_speeds",
    "place_ranks",
    "plan_cluster",
    "plan_types",
]

#: A VM type's name: what host lines (``type=``) and job specs (``vm_types``) may call it.
TYPE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_type_name(name: str, where: str) -> str:
    """``name`` if it is a valid VM type name, else ``ValueError`` (one line naming ``where``).

    >>> check_type_name("Standard_NC6s_v3", "x")
    'Standard_NC6s_v3'
    """
    if not isinstance(name, str) or not TYPE_NAME_RE.match(name):
        raise ValueError(
            f"{where}: VM type {name!r} is not a valid name (1-64 letters, digits, '_', '.', '-',"
            " starting with a letter or digit)"
        )
    return name


def parse_type_speeds(text: str) -> dict[str, float]:
    """``--type-speeds fast=1.6,slow=1``: relative speed of each VM type.

    >>> parse_type_speeds("fast=1.6,slow=1")
    {'fast': 1.6, 'slow': 1.0}
    """
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        try:
            speed = float(value) if sep else math.nan
        except ValueError:
            speed = math.nan
        if not (math.isfinite(speed) and speed > 0):
            raise ValueError(
                f"--type-speeds entry {part.strip()!r} is not TYPE=SPEED with SPEED > 0, e.g. fast=1.6"
            )
        check_type_name(name, "--type-speeds")
        if name in out:
            raise ValueError(f"--type-speeds names {name!r} twice; give each type once")
        out[name] = speed
    return out


@dataclass(frozen=True, kw_only=True)
class MixedPlan:
    """Where the VM types go in a P×D job, and what the workers' run plan says about them.

    ``replica_shares`` / ``stage_speeds`` are None when even (nothing to tell the workers).
    """

    pipeline_depth: int
    data_parallel: int
    slot_types: tuple[tuple[str, ...], ...]
    """``slot_types[d][s]``: the VM type of replica d's stage s (the stage→type map per replica)."""
    replica_shares: tuple[int, ...] | None
    """Micro-batches per replica (``VARUNA_REPLICA_SHARES``), None when even or m is unknown."""
    stage_speeds: tuple[float, ...] | None
    """Relative speed per stage for the split (``VARUNA_STAGE_SPEEDS``), None when equal."""
    relative_rate: float
    """Predicted throughput in units of one speed-1 VM doing the whole model (grow decisions)."""
    arrangement: str
    """``grouped`` or ``striped`` (Note [Interim mixed planner]) or ``simulator`` (plan_mixed)."""
    micro_batch_size: int | None = None
    """m the simulator planned with (None: the speed-only rule, the script's m)."""
    stage_ranges: tuple[tuple[int, int], ...] | None = None
    """The simulator's segment→stage map (one for all replicas), else None."""
    examples_per_s: float = 0.0
    """The simulator's prediction (0 without costs)."""
    explanation: str = ""
    """``MixedPlan.explain()`` of the simulator: the map, the shares and the alternatives."""

    @property
    def rank_types(self) -> tuple[str, ...]:
        """The VM type of each rank (rank = replica · P + stage)."""
        return tuple(t for replica in self.slot_types for t in replica)

    def describe(self) -> str:
        """One line for logs and events.

        >>> plan_types(["a", "b"], {"a": 2, "b": 1}, pipeline_depth=2, data_parallel=1).describe()
        'stage types [a,b] (grouped); stage speeds 2,1'
        """
        maps = " ".join("[" + ",".join(r) + "]" for r in self.slot_types)
        text = f"stage types {maps} ({self.arrangement})"
        if self.micro_batch_size is not None:
            text = f"P={self.pipeline_depth} D={self.data_parallel} m={self.micro_batch_size} " + text
        if self.replica_shares is not None:
            text += "; replica shares " + ",".join(str(x) for x in self.replica_shares)
        if self.stage_speeds is not None:
            text += "; stage speeds " + ",".join(f"{v:g}" for v in self.stage_speeds)
        return text


def _evaluate(grid: list[list[str]], speeds: Mapping[str, float]) -> tuple[list[float], list[float]]:
    """(stage speeds for the shared split, each replica's rate) of an arrangement."""
    P = len(grid[0])
    stage = [min(speeds[row[i]] for row in grid) for i in range(P)]
    total = sum(stage)
    rates = [total / max(stage[i] / speeds[row[i]] for i in range(P)) for row in grid]
    return stage, rates


def plan_types(
    slot_types: Sequence[str],
    speeds: Mapping[str, float],
    *,
    pipeline_depth: int,
    data_parallel: int,
    num_microbatches: int | None = None,
) -> MixedPlan:
    """The mixed plan of a P×D job on slots of the given types (one name per available slot;
    Note [Interim mixed planner]). ``num_microbatches`` (ceil(M / m)) is needed for shares; None
    leaves the split even. ``ValueError`` (one line) for a type without a speed or too few slots.
    """
    P, D = pipeline_depth, data_parallel
    missing = sorted({t for t in slot_types if t not in speeds})
    if missing:
        raise ValueError(
            f"no speed for VM type(s) {', '.join(missing)}; give every type a speed"
            f" (known: {', '.join(sorted(speeds)) or 'none'})"
        )
    if P < 1 or D < 1 or P * D > len(slot_types):
        raise ValueError(f"P={P} × D={D} needs {P * D} slots but {len(slot_types)} are available")
    # Fastest first; names break ties so that the plan does not depend on the hosts' order.
    ranked = sorted(slot_types, key=lambda t: (-speeds[t], t))[: P * D]
    grouped = [ranked[d * P : (d + 1) * P] for d in range(D)]
    striped = [[ranked[s * D + d] for s in range(P)] for d in range(D)]
    best: tuple[float, str, list[list[str]], list[float], list[float]] | None = None
    for name, grid in (("grouped", grouped), ("striped", striped)):
        stage, rates = _evaluate(grid, speeds)
        if best is None or sum(rates) > best[0] * (1 + 1e-9):
            best = (sum(rates), name, grid, stage, rates)
    assert best is not None
    total, name, grid, stage, rates = best
    shares = None
    if num_microbatches is not None and len(set(rates)) > 1 and num_microbatches >= D:
        shares = proportional_shares(rates, num_microbatches)
    return MixedPlan(
        pipeline_depth=P,
        data_parallel=D,
        slot_types=tuple(tuple(row) for row in grid),
        replica_shares=shares,
        stage_speeds=tuple(stage) if len(set(stage)) > 1 else None,
        relative_rate=total,
        arrangement=name,
    )


def place_ranks(plan: MixedPlan, hosts: Sequence[tuple[str, int]]) -> tuple[int, ...]:
    """The host index of every rank so that rank r runs on a host of ``plan.rank_types[r]``;
    ``hosts`` are (type, slots). Each rank takes the first host of its type with a free slot, so a
    host with several slots holds consecutive ranks where the plan allows (Note [Rank layout] in
    :mod:`varuna.core.env`). ``ValueError`` when the hosts cannot hold the plan.

    >>> p = plan_types(["a", "b", "a", "b"], {"a": 1, "b": 1}, pipeline_depth=2, data_parallel=2)
    >>> place_ranks(p, [("a", 1), ("b", 1), ("a", 1), ("b", 1)])
    (0, 2, 1, 3)
    """
    free = [slots for _, slots in hosts]
    out: list[int] = []
    for rank, vm_type in enumerate(plan.rank_types):
        host = next((i for i, (t, _) in enumerate(hosts) if t == vm_type and free[i] > 0), None)
        if host is None:
            raise ValueError(f"rank {rank} needs a slot of VM type {vm_type!r} but every such host is full")
        free[host] -= 1
        out.append(host)
    return tuple(out)


def costs_with_types(
    slot_types: Sequence[str],
    speeds: Mapping[str, float],
    calibration: Calibration,
    costs_by_type: Mapping[str, Calibration] | None = None,
) -> Calibration:
    """One calibration whose ``types`` cover every type of ``slot_types``: each type's own
    calibration (``costs_by_type``, e.g. profiled on its first VM), else the one in
    ``calibration``'s ``types``, else ``calibration`` scaled by the type's speed (a calibration
    without types is taken as measured on a speed-1 VM). ``ValueError`` names a type with none.

    >>> base = Calibration.synthetic(0.01, num_segments=2, micro_batch_sizes=(1,))
    >>> cal = costs_with_types(["a", "b"], {"a": 2.0, "b": 1.0}, base)
    >>> round(cal.for_type("a").fwd_s(0, 1) / cal.for_type("b").fwd_s(0, 1), 6)
    0.5
    """
    own = {t: c for t, c in (costs_by_type or {}).items() if t in set(slot_types)}
    if own:
        cal = calibration.with_types(own)
    else:
        cal = dataclasses.replace(calibration, types=dict(calibration.types))
    missing = []
    for t in dict.fromkeys(slot_types):
        if t in cal.types:
            continue
        if t not in speeds:
            missing.append(t)
            continue
        cal.types[t] = VmType(name=t, speed=float(speeds[t]))
    if missing:
        raise ValueError(
            f"no costs or speed for VM type(s) {', '.join(missing)}: give each type a speed"
            " (--type-speeds T=S, or speed in the job's vm_types) or a calibration whose 'types' hold it"
        )
    return cal


def plan_cluster(
    slot_types: Sequence[str],
    speeds: Mapping[str, float],
    *,
    calibration: Calibration | None,
    global_batch_size: int | None,
    costs_by_type: Mapping[str, Calibration] | None = None,
    micro_batch_size: int | None = None,
    pipeline_depth: int | None = None,
    data_parallel: int | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    host_slots: int = 1,
    gpu_memory_bytes: int | None = None,
) -> MixedPlan:
    """The mixed plan for slots of the given types (one name per slot): the simulator's
    ``plan_mixed`` when there is a ``calibration`` and a global batch and D is not fixed (a given
    ``pipeline_depth`` restricts its search), else :func:`plan_types` with ``pipeline_depth`` ×
    ``data_parallel`` and the ``speeds``. ``ValueError`` (one line) when nothing fits.

    >>> plan_cluster(["a", "b"], {"a": 1, "b": 1}, calibration=None, global_batch_size=None,
    ...              pipeline_depth=1, data_parallel=2).slot_types
    (('a',), ('b',))
    """
    if calibration is None or global_batch_size is None or data_parallel is not None:
        if pipeline_depth is None or data_parallel is None:
            raise ValueError("a mixed plan without a calibration needs P and D")
        m = micro_batch_size
        plan = plan_types(
            slot_types,
            speeds,
            pipeline_depth=pipeline_depth,
            data_parallel=data_parallel,
            num_microbatches=-(-global_batch_size // m) if m and global_batch_size else None,
        )
        kind = schedule_kind(schedule)
        if plan.replica_shares and any(kind.unsupported(pipeline_depth, n) for n in plan.replica_shares):
            # e.g. 2bw needs >= P micro-batches per replica: an even split, or the runtime's own error
            plan = dataclasses.replace(plan, replica_shares=None)
        return plan
    try:
        from simulator.mixed_plan import plan_mixed
    except ImportError as exc:
        raise ValueError(
            f"planning for mixed VM types needs the simulator (simulator/mixed_plan.py), which cannot be"
            f" imported here ({exc}); give --pipeline-depth P and --type-speeds instead"
        ) from None
    cal = costs_with_types(slot_types, speeds, calibration, costs_by_type)
    cluster: dict[str, int] = {}
    for t in slot_types:
        cluster[t] = cluster.get(t, 0) + 1
    result = plan_mixed(
        cluster,
        cal,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        memory_by_type={t: gpu_memory_bytes for t in cluster} if gpu_memory_bytes else None,
        schedule=schedule,
        host_slots=host_slots,
        pipeline_depths=[pipeline_depth] if pipeline_depth else None,
    )
    uneven_speeds = len(set(result.stage_speeds)) > 1
    return MixedPlan(
        pipeline_depth=result.num_stages,
        data_parallel=result.num_replicas,
        slot_types=tuple(tuple(r) for r in result.stage_types),
        replica_shares=tuple(result.replica_shares),
        stage_speeds=tuple(result.stage_speeds) if uneven_speeds else None,
        relative_rate=result.examples_per_s,
        arrangement="simulator",
        micro_batch_size=result.micro_batch_size,
        stage_ranges=tuple(tuple(r) for r in result.stage_ranges),
        examples_per_s=result.examples_per_s,
        explanation=result.explain(),
    )
