"""Who is who in a live-morph generation (docs/manager.md, Live morph): each VM's member ids, the
next unused one, the joiners, the VMs told to leave and the members their peers declared frozen.
Stored with the generation (``GenerationRecord.live_json``) and changed in the same write as its
VMs and P×D, so a manager killed at any point finds a consistent record.

A member id is the worker's ``RANK`` at start-up and its name in the live store for its whole
life (``dead/{id}``...); ids are never reused within a generation (its store), so a joiner gets
``next_id`` and the counter only grows. Generation-0 members are the launch ranks, placed as
``varuna.launch.spec.plan_workers`` places them (contiguous, in VM order).

    >>> m = LiveMembers.at_launch(["a", "b"], {"a": 2, "b": 2}, 3)
    >>> m.members, m.next_id
    ({'a': [0, 1], 'b': [2]}, 3)
    >>> g = m.grow([("c", 2)]); g.members["c"], g.joiners, g.next_id
    ([3, 4], {'c': [3, 4]}, 5)
    >>> LiveMembers.from_json(g.without(["a"]).to_json()).members
    {'b': [2], 'c': [3, 4]}
    >>> f = g.drop([3]); f.members["c"], f.joiners["c"], f.frozen
    ([4], [4], {'c': [3]})
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from manager.domain.live_morph import ranks_by_vm
from manager.domain.records import VMRecord

__all__ = ["LiveMembers"]


@dataclass(frozen=True)
class LiveMembers:
    """A live-morph generation's members (module docstring). ``morphed``: the layout changed
    since the launch, so a member id is no longer the worker's rank."""

    members: dict[str, list[int]]
    next_id: int
    joiners: dict[str, list[int]] = field(default_factory=dict)
    leaving: tuple[str, ...] = ()
    morphed: bool = False
    frozen: dict[str, list[int]] = field(default_factory=dict)
    """Members dropped because their peers declared them frozen (or they exited 76), by VM: no
    longer in ``members``; their agents are told to kill them (a VM whose every member froze
    stays in the generation with none, idle, until the next relaunch)."""

    @classmethod
    def at_launch(cls, vm_ids: Sequence[str], slots: Mapping[str, int], world_size: int) -> LiveMembers:
        """Generation 0: member id = launch rank."""
        return cls(members=ranks_by_vm(vm_ids, slots, world_size), next_id=world_size)

    @classmethod
    def from_json(cls, text: str) -> LiveMembers:
        d = json.loads(text)
        return cls(members={k: list(v) for k, v in d["members"].items()}, next_id=int(d["next_id"]),
                   joiners={k: list(v) for k, v in d.get("joiners", {}).items()},
                   leaving=tuple(d.get("leaving", ())), morphed=bool(d.get("morphed", False)),
                   frozen={k: list(v) for k, v in d.get("frozen", {}).items()})

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def ranks(self, vm_ids: Iterable[str]) -> list[int]:
        """The member ids on ``vm_ids``, sorted."""
        return sorted(r for vm in vm_ids for r in self.members.get(vm, ()))

    def without(self, vm_ids: Iterable[str]) -> LiveMembers:
        """After a live morph that lost (or let go) ``vm_ids``."""
        out = set(vm_ids)
        return dataclasses.replace(
            self, members={k: v for k, v in self.members.items() if k not in out},
            joiners={k: v for k, v in self.joiners.items() if k not in out},
            leaving=tuple(v for v in self.leaving if v not in out),
            frozen={k: v for k, v in self.frozen.items() if k not in out}, morphed=True)

    def drop(self, member_ids: Iterable[int]) -> LiveMembers:
        """After the peers of ``member_ids`` declared them dead and went on without them (a freeze):
        each leaves its VM's members for ``frozen`` (the VM and its other members stay)."""
        out = set(member_ids)
        frozen = {k: list(v) for k, v in self.frozen.items()}
        for vm, ids in self.members.items():
            gone = [m for m in ids if m in out]
            if gone:
                frozen[vm] = sorted({*frozen.get(vm, ()), *gone})
        return dataclasses.replace(
            self, members={k: [m for m in v if m not in out] for k, v in self.members.items()},
            joiners={k: kept for k, v in self.joiners.items() if (kept := [m for m in v if m not in out])},
            frozen=frozen, morphed=True)

    def leave(self, vm_ids: Iterable[str]) -> LiveMembers:
        """``vm_ids`` are told to hand over and leave (their members stay until they exit)."""
        return dataclasses.replace(self, leaving=tuple(dict.fromkeys([*self.leaving, *vm_ids])))

    def views(self, generation: int, vms: Mapping[str, VMRecord]) -> dict[str, VMRecord]:
        """``vms`` as the agents reported them, without the workers (of ``generation``) of members
        dropped as frozen."""
        out = dict(vms)
        for vm_id, ids in self.frozen.items():
            vm = vms.get(vm_id)
            if vm is not None and vm.reported_generation == generation:
                out[vm_id] = dataclasses.replace(
                    vm, workers_json=json.dumps([w for w in vm.workers if w["rank"] not in ids]))
        return out

    def grow(self, vms: Sequence[tuple[str, int]]) -> LiveMembers:
        """New VMs ``(vm_id, slots)`` join: fresh ids for each of their workers."""
        members, joiners, nxt = dict(self.members), dict(self.joiners), self.next_id
        for vm_id, slots in vms:
            members[vm_id] = joiners[vm_id] = list(range(nxt, nxt + slots))
            nxt += slots
        return dataclasses.replace(self, members=members, joiners=joiners, next_id=nxt, morphed=True)
