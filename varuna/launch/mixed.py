"""Mixed VM types in one job (issue #19): which slot of which VM type runs which (replica,
stage), each replica's share of the micro-batches and each stage's speed for the split, and which
host each rank lands on so the stage→type map holds.

Used by ``varuna-launch --hosts`` (host lines with ``type=``) and by the manager (pools of several
VM types). :func:`plan_types` is the **one place** a mixed plan is made: until the simulator's
heterogeneous auto-config exists it is the interim rule below; swapping the planner in changes
this function only (Note [Interim mixed planner]).

Note [Interim mixed planner]: P×D is chosen by the caller as for identical VMs (auto-config on
one calibration, or given); this rule then takes the P·D fastest slots and tries two
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

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from varuna.core.batching import proportional_shares

__all__ = ["TYPE_NAME_RE", "MixedPlan", "check_type_name", "parse_type_speeds", "place_ranks", "plan_types"]

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
    """``grouped`` or ``striped`` (Note [Interim mixed planner]), for the logs."""

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
