"""The manager's part of a live morph (docs/live_morph.md): VMs of a running generation are lost;
can the survivors go on in their processes, and at which P×D?

:func:`decide` maps the generation's ranks onto its VMs (contiguous per VM, as
``varuna.launch.spec.plan_workers`` assigns them), refuses when a stage lost every replica (its
state exists only in a checkpoint: the restart path), and otherwise re-plans P×D for the
surviving workers with the job's planner (the simulator's auto-config, as for a relaunch).
:func:`tell_workers` writes the outcome into the live run's rendezvous store (the dead ranks, the
requested layout: ``varuna.runtime.live_morph.declare_dead`` / ``request_layout``), and
:func:`record` adds the ``live-morph`` or ``live-morph-fallback`` event.

Example::

    >>> from manager.domain.policy import LayoutPlan
    >>> plan = lambda slots: LayoutPlan(pipeline_depth=1, data_parallel=sum(slots), micro_batch_size=0,
    ...                                 predicted_samples_per_s=1.0, source="fallback")
    >>> d = decide(plan, pipeline_depth=2, data_parallel=2, slots={"vm0": 2, "vm1": 2},
    ...            vm_ids=["vm0", "vm1"], lost_vm_ids=["vm1"])
    >>> d.live, d.lost_ranks, (d.plan.pipeline_depth, d.plan.data_parallel)
    (True, (2, 3), (1, 2))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from manager.domain.policy import LayoutPlan
from varuna.core.env import stage_and_replica

__all__ = ["LiveMorphDecision", "decide", "decide_notice", "ranks_by_vm", "record", "tell_workers"]


@dataclass(frozen=True)
class LiveMorphDecision:
    """What the manager decided for the survivors: ``plan`` (None: take the restart path, ``reason``
    says why), the ranks lost (or leaving, or joining) and the ranks that go on. ``kind``: what
    triggered it — ``lost`` (VMs gone), ``notice`` (VMs with an eviction notice hand their state
    over and leave), ``growth`` (new VMs join; ``joined``: their member ids) or ``frozen`` (the
    peers of ``lost_ranks`` declared them dead for lack of heartbeats and regrouped on their own)."""

    plan: LayoutPlan | None
    reason: str
    lost_ranks: tuple[int, ...]
    survivor_ranks: tuple[int, ...]
    kind: str = "lost"
    joined: tuple[int, ...] = ()

    @property
    def live(self) -> bool:
        return self.plan is not None


def ranks_by_vm(vm_ids: Sequence[str], slots: Mapping[str, int], world_size: int) -> dict[str, list[int]]:
    """The generation's ranks on each VM: contiguous, in VM order, as ``plan_workers`` places them.

    >>> ranks_by_vm(["a", "b"], {"a": 2, "b": 2}, 3)
    {'a': [0, 1], 'b': [2]}
    """
    out: dict[str, list[int]] = {}
    nxt = 0
    for vm in vm_ids:
        take = min(slots[vm], world_size - nxt)
        out[vm] = list(range(nxt, nxt + take))
        nxt += take
    return out


def decide(
    plan: Callable[[list[int]], LayoutPlan],
    *,
    pipeline_depth: int,
    data_parallel: int,
    slots: Mapping[str, int],
    vm_ids: Sequence[str],
    lost_vm_ids: Sequence[str],
    members: Mapping[str, Sequence[int]] | None = None,
    check_stages: bool = True,
) -> LiveMorphDecision:
    """Live or restart, for a generation at ``pipeline_depth`` × ``data_parallel`` on ``vm_ids``
    (``slots[vm]`` workers each) that lost ``lost_vm_ids``. ``plan(slots)``: the job's P×D for VMs
    with those workers (``MorphPlanner.plan`` bound to the job: the simulator); it sees the
    surviving VMs, each with as many slots as it has survivors. ``members``: each VM's live member
    ids when known (``manager.domain.live_members``; default: the launch placement). ``check_stages``:
    refuse here when a stage lost every replica; only right while member id = rank (no live morph
    yet) — after one, the workers find that out themselves (exit 75, the restart path)."""
    placed = members if members is not None else ranks_by_vm(vm_ids, slots, pipeline_depth * data_parallel)
    gone = set(lost_vm_ids)
    lost = tuple(sorted(r for vm in vm_ids if vm in gone for r in placed.get(vm, ())))
    alive = tuple(sorted(r for vm in vm_ids if vm not in gone for r in placed.get(vm, ())))
    if not alive:
        return LiveMorphDecision(None, "no worker survived", lost, alive)
    held = {stage_and_replica(r, pipeline_depth)[0] for r in alive}
    for stage in range(pipeline_depth if check_stages else 0):
        if stage not in held:
            where = ", ".join(vm for vm in vm_ids if vm in gone)
            reason = (f"stage {stage} has no live replica (ranks "
                      f"{', '.join(str(d * pipeline_depth + stage) for d in range(data_parallel))} "
                      f"were on lost VMs {where}); restart from the newest checkpoint")
            return LiveMorphDecision(None, reason, lost, alive)
    try:
        chosen = plan([len(placed[vm]) for vm in vm_ids if vm not in gone and placed.get(vm)])
    except ValueError as exc:
        return LiveMorphDecision(None, f"no layout fits the {len(alive)} survivor(s): {exc}", lost, alive)
    return LiveMorphDecision(chosen, chosen.source, lost, alive)


def decide_notice(
    plan: Callable[[list[int]], LayoutPlan],
    *,
    members: Mapping[str, Sequence[int]],
    vm_ids: Sequence[str],
    leaving_vm_ids: Sequence[str],
) -> LiveMorphDecision:
    """Hand-over or restart, for VMs ``leaving_vm_ids`` with an eviction notice: their workers
    finish their step, send what only they hold to the workers that stay and exit 0, so a stage
    they held whole is not lost; it needs at least one worker that stays and a layout for those.

    >>> from manager.domain.policy import LayoutPlan
    >>> plan = lambda slots: LayoutPlan(pipeline_depth=1, data_parallel=sum(slots), micro_batch_size=0,
    ...                                 predicted_samples_per_s=1.0, source="fallback")
    >>> d = decide_notice(plan, members={"a": [0], "b": [1]}, vm_ids=["a", "b"], leaving_vm_ids=["b"])
    >>> d.live, d.kind, d.lost_ranks, d.plan.data_parallel
    (True, 'notice', (1,), 1)
    """
    leaving = set(leaving_vm_ids)
    gone = tuple(sorted(r for vm in vm_ids if vm in leaving for r in members.get(vm, ())))
    stay = tuple(sorted(r for vm in vm_ids if vm not in leaving for r in members.get(vm, ())))
    if not stay:
        why = (f"every worker is on a VM with a notice ({', '.join(sorted(leaving))}): nobody stays to "
               "receive their state; graceful stop (checkpoint) and relaunch")
        return LiveMorphDecision(None, why, gone, stay, kind="notice")
    try:
        chosen = plan([len(members[vm]) for vm in vm_ids if vm not in leaving and members.get(vm)])
    except ValueError as exc:
        return LiveMorphDecision(None, f"no layout fits the {len(stay)} worker(s) that stay: {exc}", gone,
                                 stay, kind="notice")
    return LiveMorphDecision(chosen, chosen.source, gone, stay, kind="notice")


def tell_workers(store: Any, decision: LiveMorphDecision) -> None:
    """Write the decision into the live run's store (a ``torch.distributed.Store``): every lost
    rank is dead (survivors stop waiting for it), and the survivors' next layout is the plan's.
    The workers use the requested P×D when it fits them, else their own rule (docs/live_morph.md)."""
    from varuna.runtime.live_morph import declare_dead, request_layout  # torch: only when live

    if decision.kind == "lost":  # leavers declare themselves dead once their state is handed over
        for rank in decision.lost_ranks:
            declare_dead(store, rank)
    if decision.plan is not None:
        request_layout(store, decision.plan.pipeline_depth, decision.plan.data_parallel)


def record(
    event: Callable[..., Any], job_id: str, generation: int, decision: LiveMorphDecision,
    *, old: tuple[int, int], duration_s: float | None = None,
) -> None:
    """The job's event for ``decision`` (``event`` is ``ManagerContext.event``): ``live-morph`` with
    the chosen layout (and its duration once the workers reported it), or ``live-morph-fallback``
    with the reason."""
    data: dict[str, Any] = {"lost_ranks": list(decision.lost_ranks), "old": list(old),
                            "reason_kind": decision.kind, "joined_ranks": list(decision.joined)}
    if decision.plan is None:
        event(job_id, "live-morph-fallback",
              f"generation {generation}: live morph impossible ({decision.kind}): "
              f"{decision.reason}", generation=generation, data={**data, "reason": decision.reason})
        return
    p = decision.plan
    data.update(pipeline_depth=p.pipeline_depth, data_parallel=p.data_parallel, source=p.source,
                predicted_samples_per_s=p.predicted_samples_per_s)
    took = ""
    if duration_s is not None:
        data["duration_s"] = round(duration_s, 3)
        took = f" in {duration_s:.1f} s"
    what = {
        "lost": f"ranks {list(decision.lost_ranks)} lost",
        "notice": f"eviction notice: ranks {list(decision.lost_ranks)} handed their state over and left",
        "growth": f"growth: ranks {list(decision.joined)} joined",
        "frozen": f"ranks {list(decision.lost_ranks)} frozen (declared dead by their peers)",
    }[decision.kind]
    event(job_id, "live-morph", f"generation {generation}: {what}; {old[0]}×{old[1]} -> P={p.pipeline_depth} "
          f"× D={p.data_parallel} ({p.source}) without a restart{took}", generation=generation, data=data)
