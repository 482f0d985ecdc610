"""The layout survivors re-form without a restart: a pure function of who is left (docs/live_morph.md).

Every survivor computes it from the same closed member list, so all agree without another
message. Later the manager's simulator plan replaces the choice of P×D; the checks stay.

Example::

    >>> plan = plan_survivor_layout(old_P=2, old_D=2, survivors=[0, 1, 2], max_stages=3, max_replicas=4)
    >>> (plan.P, plan.D, plan.new_rank)
    (1, 3, {0: 0, 1: 1, 2: 2})
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from varuna.core.env import stage_and_replica

__all__ = ["NoLiveReplica", "SurvivorLayout", "plan_generation", "plan_survivor_layout", "transfer_plan"]


class NoLiveReplica(RuntimeError):
    """Some stage lost every replica: the state exists only in a checkpoint (the restart path)."""


@dataclass(frozen=True)
class SurvivorLayout:
    """The new P×D, each working survivor's new rank (by old rank), and the survivors left idle."""

    P: int
    D: int
    new_rank: dict[int, int]
    spares: list[int] = field(default_factory=list)


def plan_survivor_layout(
    *, old_P: int, old_D: int, survivors: Sequence[int], max_stages: int, max_replicas: int
) -> SurvivorLayout:
    """Choose P'×D' for ``survivors`` (old ranks, ``rank = replica * P + stage``).

    Refuses (:class:`NoLiveReplica`) when an old stage has no survivor. Uses as many survivors
    as fit: P'×D' = n with 1 <= P' <= ``max_stages`` (cut-points + 1) and D' <= ``max_replicas``
    (micro-batches per step), P' closest to the old P (fewest parameters moved), the smaller on
    a tie (a shorter pipeline idles less); if no divisor pair fits, fewer survivors work and
    the rest are spares. New ranks follow old-rank order.

    >>> try:
    ...     plan_survivor_layout(old_P=2, old_D=2, survivors=[0, 2], max_stages=2, max_replicas=4)
    ... except NoLiveReplica as e:
    ...     print(str(e)[:40])
    stage 1 has no live replica (old ranks [
    """
    alive = sorted(set(survivors))
    if not alive or any(not 0 <= r < old_P * old_D for r in alive):
        raise ValueError(f"survivors {alive} are not ranks of a {old_P}x{old_D} world")
    held = {stage_and_replica(r, old_P)[0] for r in alive}
    for k in range(old_P):
        if k not in held:
            gone = [d * old_P + k for d in range(old_D)]
            raise NoLiveReplica(f"stage {k} has no live replica (old ranks {gone} are gone); "
                                "the run must restart from its newest checkpoint")
    for n in range(len(alive), 0, -1):
        fits = [p for p in range(1, min(max_stages, n) + 1) if n % p == 0 and n // p <= max_replicas]
        if fits:
            P = min(fits, key=lambda p: (abs(p - old_P), p))
            working = alive[:n]
            return SurvivorLayout(P=P, D=n // P, new_rank={r: i for i, r in enumerate(working)},
                                  spares=alive[n:])
    raise ValueError(f"no layout fits max_stages={max_stages}, max_replicas={max_replicas}")


def plan_generation(
    *, old_P: int, holders: int, newcomers: int, max_stages: int, max_replicas: int,
    hint: tuple[int, int] | None = None,
) -> tuple[int, int, int]:
    """P'×D' and how many members work, for ``holders`` members that keep state (they come first
    in the new rank order) and ``newcomers`` without state (joiners, spares). Returns ``(P, D, n)``:
    the first ``n`` members work, the rest are spares.

    ``hint`` (the manager's or launcher's plan, e.g. from the simulator) wins when it fits the
    members and the limits; otherwise the rule of :func:`plan_survivor_layout`: as many members as
    fit, P' nearest ``old_P``, the smaller on a tie.

    >>> plan_generation(old_P=1, holders=2, newcomers=2, max_stages=3, max_replicas=4, hint=(2, 2))
    (2, 2, 4)
    >>> plan_generation(old_P=2, holders=4, newcomers=1, max_stages=3, max_replicas=4)
    (2, 2, 4)
    """
    total = holders + newcomers
    if total < 1:
        raise ValueError("a generation needs at least one member")
    if hint is not None:
        P, D = hint
        if 1 <= P <= max_stages and 1 <= D <= max_replicas and P * D <= total:
            return P, D, P * D
    for n in range(total, 0, -1):
        fits = [p for p in range(1, min(max_stages, n) + 1) if n % p == 0 and n // p <= max_replicas]
        if fits:
            P = min(fits, key=lambda p: (abs(p - old_P), p))
            return P, n // P, n
    raise ValueError(f"no layout fits max_stages={max_stages}, max_replicas={max_replicas}")


def transfer_plan(
    held: Sequence[Sequence[str]], needs: Sequence[Sequence[str]]
) -> dict[tuple[int, int], list[str]]:
    """Which rank sends which names to whom: ``{(src, dst): names}``.

    ``held[r]``: the parameter names rank ``r`` kept from the old layout; ``needs[r]``: the names
    of its new stage. A name a rank holds itself is never sent; otherwise it comes from one of
    its holders, spread over them round-robin by receiver (a stage with two live replicas serves
    two receivers in parallel). Raises ValueError when nobody holds a needed name.

    >>> transfer_plan([["a", "b"], ["c"], ["a", "b"]], [["a", "b", "c"], ["a", "b", "c"], ["a", "b", "c"]])
    {(1, 0): ['c'], (2, 1): ['a', 'b'], (1, 2): ['c']}
    """
    holders: dict[str, list[int]] = {}
    for r, names in enumerate(held):
        for n in names:
            holders.setdefault(n, []).append(r)
    plan: dict[tuple[int, int], list[str]] = {}
    for dst, names in enumerate(needs):
        mine = set(held[dst]) if dst < len(held) else set()
        for n in sorted(names):
            if n in mine:
                continue
            src = holders.get(n)
            if not src:
                raise ValueError(f"no survivor holds parameter {n!r}; the run must restart from its "
                                 "newest checkpoint")
            plan.setdefault((src[dst % len(src)], dst), []).append(n)
    return plan
