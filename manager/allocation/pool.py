"""The pool's vocabulary: VM types (with their spot price and memory), the VMs a manager holds,
and the capacity per type.

A *VM type* is a kind of machine with its own calibration, memory and spot price
(docs/ARCHITECTURE.md, second-wave terms); the *pool* is the VMs one manager holds for all its
jobs; its capacity changes as spot VMs are preempted and come back.

    >>> pool = [PoolVM("a-0", "k80"), PoolVM("a-1", "k80"), PoolVM("b-0", "v100")]
    >>> capacity(pool, [VMType("k80", 0.3), VMType("v100", 0.9), VMType("p100", 0.6)])
    {'k80': 2, 'v100': 1, 'p100': 0}
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["PoolVM", "VMType", "capacity", "check_types"]


@dataclass(frozen=True)
class VMType:
    """One kind of VM in the pool."""

    name: str
    price_per_hour: float
    """Spot price of one VM of this type, $ per hour (the cost policy needs it > 0)."""
    slots: int = 1
    """Accelerators (workers) per VM."""
    gpu_memory_bytes: int = 0
    """Memory per accelerator for auto-config (0: not limited)."""

    def __post_init__(self) -> None:
        # Checked here so a bad pool config fails where it is read, not inside a solver.
        if not self.name:
            raise ValueError("a VM type needs a name")
        if not math.isfinite(self.price_per_hour) or self.price_per_hour < 0:
            raise ValueError(
                f"VM type {self.name!r}: price_per_hour must be a finite number >= 0, "
                f"got {self.price_per_hour}"
            )
        if self.slots < 1:
            raise ValueError(f"VM type {self.name!r}: slots must be >= 1, got {self.slots}")
        if self.gpu_memory_bytes < 0:
            raise ValueError(f"VM type {self.name!r}: gpu_memory_bytes must be >= 0")


@dataclass(frozen=True)
class PoolVM:
    """One VM held by the pool."""

    vm_id: str
    vm_type: str


def check_types(types: Sequence[VMType]) -> dict[str, VMType]:
    """The types by name; ``ValueError`` when a name repeats (one line)."""
    out: dict[str, VMType] = {}
    for t in types:
        if t.name in out:
            raise ValueError(f"VM type {t.name!r} is listed twice in the pool's config; keep one entry")
        out[t.name] = t
    return out


def capacity(vms: Iterable[PoolVM], types: Sequence[VMType]) -> dict[str, int]:
    """VMs per type (every listed type present, 0 when none); ``ValueError`` for a VM of a type
    the pool does not know."""
    out = {t.name: 0 for t in types}
    for vm in vms:
        if vm.vm_type not in out:
            raise ValueError(
                f"VM {vm.vm_id} has type {vm.vm_type!r}, which the pool does not list; add it to the "
                f"pool's types ({', '.join(out) or 'none'})"
            )
        out[vm.vm_type] += 1
    return out
