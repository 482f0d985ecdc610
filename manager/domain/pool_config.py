"""The shared pool's configuration (``varuna-manager serve --pool POOL.toml``, docs/pool.md):
the VM types with their price, size, relative speed, capacity and provider, how the capacity
changes, the policy and the round length.

Note [Providers in a pool]: a pool type may name its own ``provider`` (a spot pool on Kubernetes
beside pretend VMs, Azure beside Kubernetes...): its VMs then come from that provider, made with
the type's ``provider_options``, whatever the job's own provider is (``ManagerContext.provider``
with the VM's type; one provider per job and provider, the per-type options going with each
request), and every later call for such a VM (listing, deleting) goes to the provider that made
it (``ManagerContext.provider_of``). Without ``provider`` a type's VMs come from each job's
provider, its ``provider_options`` merged over the job's.

    >>> cfg = PoolConfig.from_dict({"policy": "las", "round_s": 60,
    ...     "types": [{"name": "fast", "price_per_hour": 0.9, "capacity": 2},
    ...               {"name": "slow", "price_per_hour": 0.3, "capacity": 3, "speed": 0.5}]})
    >>> [t.name for t in cfg.types], cfg.capacity_at(0)
    (['fast', 'slow'], {'fast': 2, 'slow': 3})
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from manager.allocation.pool import VMType
from manager.domain.jobspec import MAX_PROCS_PER_VM, MAX_VMS
from manager.providers.registry import provider_entry

__all__ = ["MAX_POOL_TYPES", "POLICIES", "CapacityChange", "PoolConfig", "PoolType", "load_pool_config"]

#: Policy names of ``manager.allocation.policies.solve`` a pool may use.
POLICIES = ("las", "makespan", "cost")

#: Most VM types in one pool (each is a column group of every round's LP). Every number that
#: sizes something the daemon builds is bounded like a job's ``max_vms`` (issue 35: a capacity of
#: 10^9 passed and the first round built one object per VM): a type's capacity by
#: ``jobspec.MAX_VMS``, its slots by ``jobspec.MAX_PROCS_PER_VM``.
MAX_POOL_TYPES = 64
#: Largest memory per accelerator (GiB) and relative speed a type may declare (beyond them the
#: arithmetic of the allocation overflows, and no accelerator is anywhere near).
MAX_MEMORY_GIB = 1 << 20
MAX_SPEED = 1e3


def _check_keys(data: Any, cls: type, where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a table/object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return dict(data)


def _make(cls: type, data: Any, where: str) -> Any:
    d = _check_keys(data, cls, where)
    missing = [f.name for f in fields(cls) if f.name not in d and f.default is MISSING
               and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")
    return cls(**d)


def _number(
    value: Any,
    where: str,
    *,
    low: float,
    strict: bool = False,
    integer: bool = False,
    high: float | None = None,
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if strict else value >= low) and (not integer or isinstance(value, int))
    if not ok:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{where} must be {kind} {'>' if strict else '>='} {low:g}, got {value!r}")
    if high is not None and value > high:
        limit = f"{int(high)}" if float(high).is_integer() else f"{high:g}"
        raise ValueError(f"{where} {value!r} is above the limit of {limit}; lower it")


@dataclass(frozen=True, kw_only=True)
class PoolType:
    """One VM type of the pool (``[[types]]``)."""

    name: str
    price_per_hour: float
    """Spot price of one VM, $ per hour (the ``cost`` policy needs it > 0)."""
    capacity: int
    """VMs of this type the pool may hold at the start (changed by ``capacity_changes``)."""
    slots: int = 1
    """Workers (accelerators) per VM."""
    memory_gib: float = 0.0
    """Memory per accelerator for auto-config (0: not limited)."""
    speed: float = 1.0
    """Compute speed relative to the VMs the jobs' calibrations were measured on: the type's
    throughput is the calibration's prediction × speed. On the local provider a type with
    speed < 1 is emulated: its pretend VMs' workers take 1/speed as long per step."""
    provider_options: dict[str, Any] = field(default_factory=dict)
    """Merged over a job's ``provider_options`` for VMs of this type (e.g. azure ``vm_size``); with
    ``provider``, that provider's options for this type (checked when the pool is loaded)."""
    provider: str = ""
    """Where this type's VMs come from: a registered provider (Note [Providers in a pool]); empty:
    each job's own provider."""

    def __post_init__(self) -> None:
        where = f"pool type {self.name!r}"
        if not isinstance(self.name, str) or not self.name or not self.name.replace("-", "").isalnum():
            raise ValueError(f"pool type name {self.name!r}: use letters, digits and '-' only")
        _number(self.price_per_hour, f"{where}: price_per_hour", low=0)
        _number(self.capacity, f"{where}: capacity", low=0, integer=True, high=MAX_VMS)
        _number(self.slots, f"{where}: slots", low=1, integer=True, high=MAX_PROCS_PER_VM)
        _number(self.memory_gib, f"{where}: memory_gib", low=0, high=MAX_MEMORY_GIB)
        _number(self.speed, f"{where}: speed", low=0, strict=True, high=MAX_SPEED)
        if not isinstance(self.provider_options, dict):
            raise ValueError(f"{where}: provider_options must be a table/object")
        if self.provider:
            try:
                provider_entry(str(self.provider)).parse_options(self.provider_options)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{where}: {str(exc).splitlines()[0]}") from None

    def base_options(self) -> dict[str, Any]:
        """The options this type's own ``provider`` is made with."""
        return dict(self.provider_options)

    def vm_type(self) -> VMType:
        """The allocation package's view of this type."""
        return VMType(self.name, float(self.price_per_hour), self.slots, int(self.memory_gib * 2**30))


@dataclass(frozen=True, kw_only=True)
class CapacityChange:
    """From round ``round`` on, the pool holds ``capacity`` VMs of ``type`` (spot capacity that
    goes and comes back, scripted: ``[[capacity_changes]]``)."""

    round: int
    type: str
    capacity: int

    def __post_init__(self) -> None:
        _number(self.round, "capacity_changes: round", low=0, integer=True)
        where = f"capacity_changes (type {self.type!r}): capacity"
        _number(self.capacity, where, low=0, integer=True, high=MAX_VMS)


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """The pool (module docstring); :meth:`from_dict` validates with one line per bad field."""

    types: list[PoolType]
    policy: str = "las"
    """``las`` (max-min fairness, Gavel's LAS), ``makespan`` or ``cost`` (throughput per dollar)."""
    round_s: float = 360.0
    """Round length: placements may change once per round."""
    hysteresis: float = 0.5
    """Rounds a move must gain beyond its morph cost (Note [Staying put] in rounds.py)."""
    default_morph_s: float = 60.0
    """A job's move cost until one of its morphs has been measured."""
    capacity_changes: list[CapacityChange] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.types:
            raise ValueError("pool: 'types' must list at least one VM type")
        if len(self.types) > MAX_POOL_TYPES:
            raise ValueError(
                f"pool: {len(self.types)} VM types are above the limit of {MAX_POOL_TYPES}; merge some"
            )
        names = [t.name for t in self.types]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"pool: VM type(s) {', '.join(dup)} listed twice; keep one entry each")
        if self.policy not in POLICIES:
            raise ValueError(f"pool: unknown policy {self.policy!r}; use one of {', '.join(POLICIES)}")
        free = [t.name for t in self.types if not t.price_per_hour > 0]
        if self.policy == "cost" and free:
            # Checked here, not at the first round: the round would fail every tick (issue 35).
            raise ValueError(
                f"pool: policy 'cost' (throughput per dollar) needs price_per_hour > 0 for every type;"
                f" {', '.join(free)} has none: set it, or use policy 'las'"
            )
        _number(self.round_s, "pool: round_s", low=0, strict=True)
        _number(self.hysteresis, "pool: hysteresis", low=0)
        _number(self.default_morph_s, "pool: default_morph_s", low=0)
        for ch in self.capacity_changes:
            if ch.type not in names:
                raise ValueError(
                    f"pool: capacity_changes names type {ch.type!r}, which 'types' does not list "
                    f"({', '.join(names)})"
                )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PoolConfig:
        """From a parsed TOML/JSON document; unknown keys are errors."""
        d = _check_keys(data, cls, "pool")
        if "types" not in d or not isinstance(d["types"], list):
            raise ValueError("pool: 'types' is required: a list of VM types ([[types]] in TOML)")
        d["types"] = [_make(PoolType, t, "pool: a [[types]] entry") for t in d["types"]]
        changes = d.get("capacity_changes", [])
        if not isinstance(changes, list):
            raise ValueError("pool: 'capacity_changes' must be a list ([[capacity_changes]] in TOML)")
        where = "pool: a [[capacity_changes]] entry"
        d["capacity_changes"] = [_make(CapacityChange, c, where) for c in changes]
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def type(self, name: str) -> PoolType:
        return next(t for t in self.types if t.name == name)

    def capacity_at(self, round_index: int) -> dict[str, int]:
        """VMs per type in round ``round_index`` (the start capacity, then every change due)."""
        cap = {t.name: t.capacity for t in self.types}
        for ch in sorted(self.capacity_changes, key=lambda c: c.round):
            if ch.round <= round_index:
                cap[ch.type] = ch.capacity
        return cap


def load_pool_config(path: str | os.PathLike) -> PoolConfig:
    """Read a pool config (``.json``, else TOML); ``ValueError`` (one line) on any problem."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read pool config {p}: {exc.strerror or exc}") from None
    try:
        if p.suffix.lower() == ".json" or text.lstrip().startswith("{"):
            data = json.loads(text)
        else:
            import tomllib

            data = tomllib.loads(text)
    except ImportError:  # Python 3.10
        raise ValueError(f"{p}: TOML needs Python >= 3.11; write the pool config as JSON") from None
    except ValueError as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        kind = "JSON" if p.suffix == ".json" else "TOML"
        raise ValueError(f"{p}: not valid {kind}: {exc}".splitlines()[0]) from None
    try:
        return PoolConfig.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{p}: {exc}") from None
