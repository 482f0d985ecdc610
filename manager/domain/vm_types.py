"""A job's pool of several VM types (issue #19): the job spec's ``[[vm_types]]`` tables, the type
each VM is of, and what the provider is told when it creates VMs of a type.

A job spec without ``vm_types`` runs on VMs of one type as before. With them, every type says how
many VMs the job may hold of it, its relative speed (what the mixed plan divides the work by;
with the local provider also the *emulated* speed: a pretend VM of a slower type has its workers'
steps stretched, ``manager.providers.local.SLOWDOWN_ENV``) and provider options of its own (the
azure ``vm_size``)::

    [[vm_types]]
    name = "fast"
    max_vms = 2
    speed = 1.6
    provider_options = { vm_size = "Standard_NC24ads_A100_v4" }     # azure

    [[vm_types]]
    name = "slow"
    max_vms = 2

Example::

    >>> types = parse_vm_types([{"name": "fast", "max_vms": 2, "speed": 1.6},
    ...                         {"name": "slow", "max_vms": 1}])
    >>> [(t.name, t.max_vms, t.speed) for t in types]
    [('fast', 2, 1.6), ('slow', 1, 1.0)]
    >>> type_options(types[1], types)["vm_slowdown"]
    1.6
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from varuna.launch.mixed import check_type_name

__all__ = ["VMTypeSpec", "parse_vm_types", "type_options", "vm_type_of"]


@dataclass(frozen=True, kw_only=True)
class VMTypeSpec:
    """One ``[[vm_types]]`` table of a job spec."""

    name: str
    max_vms: int
    """Most VMs of this type the manager asks the provider for."""
    speed: float = 1.0
    """Relative speed (1.6: 1.6 times as fast as a type of speed 1)."""
    provider_options: dict[str, Any] = field(default_factory=dict)
    """Provider options that differ for this type (azure: ``vm_size``; local: ``max_created``):
    the provider's registry entry says which (``type_options``) and the job spec checks them."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_vm_types(data: Any) -> tuple[VMTypeSpec, ...]:
    """The validated ``vm_types`` of a job spec; ``ValueError`` (one line naming the table and the
    fix) for anything else."""
    if not isinstance(data, list):
        raise ValueError("jobspec: 'vm_types' must be a list of tables ([[vm_types]] in TOML)")
    out: list[VMTypeSpec] = []
    known = {"name", "max_vms", "speed", "provider_options"}
    for i, item in enumerate(data, start=1):
        where = f"jobspec: vm_types[{i}]"
        if not isinstance(item, Mapping):
            raise ValueError(f"{where} must be a table with name, max_vms, speed, provider_options")
        unknown = sorted(set(item) - known)
        if unknown:
            raise ValueError(
                f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        name = check_type_name(item.get("name", ""), where)
        count = item.get("max_vms")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{where} ({name}): max_vms must be a whole number >= 1, got {count!r}")
        speed = item.get("speed", 1.0)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not (
            math.isfinite(speed) and speed > 0
        ):
            raise ValueError(f"{where} ({name}): speed must be a number > 0, got {speed!r}")
        options = item.get("provider_options", {})
        if not isinstance(options, Mapping):
            raise ValueError(f"{where} ({name}): provider_options must be a table")
        if any(t.name == name for t in out):
            raise ValueError(f"{where}: type {name!r} is listed twice; list each VM type once")
        out.append(VMTypeSpec(name=name, max_vms=count, speed=float(speed), provider_options=dict(options)))
    if not out:
        raise ValueError("jobspec: 'vm_types' is empty; list at least one type or leave it out")
    return tuple(out)


def type_options(vm_type: VMTypeSpec, types: Sequence[VMTypeSpec]) -> dict[str, Any]:
    """What ``Provider.create_vms`` gets as ``type_options`` for VMs of ``vm_type``: its name,
    its provider options and, for a type slower than the fastest, the emulated slowdown (the
    local provider stretches its workers' steps by it; this machine stands for the fastest type).
    """
    fastest = max(t.speed for t in types)
    options: dict[str, Any] = {**vm_type.provider_options, "vm_type": vm_type.name}
    if vm_type.speed < fastest:
        options["vm_slowdown"] = fastest / vm_type.speed
    return options


def vm_type_of(ref: Mapping[str, Any]) -> str:
    """The VM type recorded in a VM's provider reference ('' when it has none)."""
    return str(ref.get("vm_type") or "")
