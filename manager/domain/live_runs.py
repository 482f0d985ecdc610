"""Live morph in the control loop (docs/manager.md, Live morph): the rendezvous store of each
generation of a ``live_morph = true`` job, and the reaction to a VM lost from a running one, to
an eviction notice on one of its VMs, and to new VMs it can grow onto.

The daemon hosts one :class:`varuna.launch.live_store.LiveStore` per generation (a fresh one per
launch, as ``varuna-launch --live-morph`` does: member ids and ``dead/{id}`` keys must never be
reused, and a relaunch numbers its ranks from 0 again), bound to the manager's advertise host
only; its address is every worker's ``$VARUNA_LIVE_STORE`` and its secret (a fresh one per
store) their ``$VARUNA_LIVE_STORE_KEY``, sent in the RUN orders over the authenticated gRPC
channel (Note [Store authentication] in varuna/runtime/auth_store.py). It is closed when the generation ends,
when the job ends and when the manager stops (the store's server thread ends with its last
handle, and the listening socket is closed with it).

When VMs of a running generation are lost (no heartbeat for T, or the provider says gone),
:meth:`LiveRuns.on_failure` asks :func:`manager.domain.live_morph.decide`. Live: the dead ranks and the
simulator's P×D go into the store (``tell_workers``), the generation keeps running on the
surviving VMs at the new P×D (updated in place: no kill, no relaunch), and the ``live-morph``
event is written once a survivor reports a step past the one in flight (its ``duration_s``:
detection → that heartbeat). Impossible (a stage lost every replica, no layout fits, a worker
exited with 75, the store is gone with a manager restart): a ``live-morph-fallback`` event, and
the caller takes today's kill + relaunch from the newest checkpoint.

A notice (:meth:`LiveRuns.on_notice`): the P×D of the workers that stay goes into the store
first, then the VM is marked ``leaving`` (its agent's RUN orders say ``leave``: the notice signal
to its workers, which finish the step, hand over and exit 0); :meth:`LiveRuns.drop_leavers` takes
it out of the generation once they exited 0. Growth (:meth:`LiveRuns.on_grow`): new VMs join the
running generation, their workers started as joiners with fresh member ids. The generation's
members (``manager.domain.live_members.LiveMembers``) change in the same write as its VMs and P×D.

A frozen member (:meth:`LiveRuns.drop_frozen`): its peers declared it dead for lack of heartbeats
(``LiveStore.frozen``: the verdict, once the store too has heard no heartbeat from it, Note
[Verdict check] in varuna/launch/live_store.py) and regrouped without it; the manager, polling the
store on its loop, drops it from the members (its VM and the VM's other workers stay), orders its
agent to kill it (``kill`` in the RUN orders) and takes its exit — 76 if it resumed first, -9 —
as no failure (:meth:`LiveRuns.member_views`).

    >>> LiveRuns.bind_host("[::1]:7878"), LiveRuns.bind_host("10.0.0.4:7878")
    ('::1', '10.0.0.4')
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from manager.domain import live_morph
from manager.domain.context import ManagerContext
from manager.domain.live_members import LiveMembers
from manager.domain.policy import LayoutPlan
from manager.domain.ports import Planner
from manager.domain.records import GenerationRecord, JobRecord, VMRecord
from varuna.launch.live_store import LiveStore
from varuna.launch.supervisor import PEER_LOST_EXIT_CODE

__all__ = ["LiveRuns", "PendingMorph"]


@dataclass(frozen=True)
class PendingMorph:
    """A live morph decided, its event waiting for the survivors' next step."""

    decision: live_morph.LiveMorphDecision
    old: tuple[int, int]
    detected: float
    step: int  # the generation's last reported step at detection: the next higher one ends it
    expect: tuple[int, int] | None = None
    """The P×D the workers report once the morph is done (a notice or growth regroups only at the
    next step boundary: steps at the old layout come first); None: any step past ``step``."""
    wait_leavers: bool = False
    """A notice whose layout does not change: done at the first step after the leavers exited."""


class LiveRuns:
    """See the module docstring. Callers hold ``ctx.lock``.

    Example::

        live = LiveRuns(ctx, planner)
        address = live.open_store(job, 3)        # before generation 3's launches are made
        handled = live.on_lost(job, gen, lost_vms, now)   # False: kill + relaunch
    """

    def __init__(self, ctx: ManagerContext, planner: Planner) -> None:
        self.ctx = ctx
        self.planner = planner
        self._stores: dict[tuple[str, int], LiveStore] = {}  # (job, generation) -> its store
        self._pending: dict[tuple[str, int], PendingMorph] = {}

    @staticmethod
    def bind_host(advertise_address: str) -> str:
        """The host part of ``host:port`` (brackets of an IPv6 literal removed)."""
        host = advertise_address.rsplit(":", 1)[0] if ":" in advertise_address else advertise_address
        return host.strip("[]") or "127.0.0.1"

    # -- the stores ----------------------------------------------------------------------------

    def enabled(self, job: JobRecord) -> bool:
        """Whether ``job`` asked for live morph."""
        return bool(self.ctx.cache(job).spec.live_morph)

    def open_store(self, job: JobRecord, generation: int) -> str:
        """Host generation ``generation``'s store; returns its ``host:port``."""
        key = (job.job_id, generation)
        if key not in self._stores:
            self._stores[key] = LiveStore(self.bind_host(self.ctx.config.advertise_address))
        return self._stores[key].address

    def address(self, job: JobRecord, generation: int) -> str | None:
        """The store of a generation this manager process launched (None after a restart)."""
        store = self._stores.get((job.job_id, generation))
        return store.address if store is not None else None

    def worker_env(self, job: JobRecord, generation: int) -> dict[str, str]:
        """The store's address and secret for the generation's workers ({} after a restart)."""
        store = self._stores.get((job.job_id, generation))
        return store.worker_env() if store is not None else {}

    def close(self, job_id: str, generation: int | None = None) -> None:
        """Close the job's store of ``generation`` (every one of the job's: None)."""
        for key in [k for k in self._stores if k[0] == job_id and generation in (None, k[1])]:
            self._stores.pop(key).close()
            pending = self._pending.pop(key, None)
            if pending is not None:  # the generation ended before a step past the morph
                self._record(job_id, key[1], pending, None)

    def close_all(self) -> None:
        """Close every store (the manager stops)."""
        for job_id in {k[0] for k in self._stores}:
            self.close(job_id)

    @property
    def open_count(self) -> int:
        """Stores open now (tests check that none leaks)."""
        return len(self._stores)

    # -- a lost VM -----------------------------------------------------------------------------

    def on_failure(self, job: JobRecord, gen: GenerationRecord, failed: list[VMRecord], now: float) -> bool:
        """React to ``failed`` VMs of the running ``gen``; True when the generation goes on live,
        False when the caller must kill and relaunch (the fallback event is written here)."""
        gone = [vm for vm in failed if vm.state != "up"]
        crashed = [vm for vm in failed if vm.state == "up"]
        store = self._stores.get((job.job_id, gen.generation))
        members = self.members(gen)
        if gen.live_json and not crashed and gone and not members.ranks(vm.vm_id for vm in gone):
            # Every member of those VMs froze and was dropped already: nothing more to morph.
            lost = {vm.vm_id for vm in gone}
            self.ctx.store.update_generation(job.job_id, gen.generation,
                                             vms_json=json.dumps([v for v in gen.vm_ids if v not in lost]),
                                             live_json=members.without(lost).to_json())
            self.ctx.store.update_job(job.job_id, detection_time=None, detection_reason="")
            return True
        reason = None
        if any(w.get("exit_code") == PEER_LOST_EXIT_CODE for vm in crashed for w in vm.workers):
            reason = (f"a worker exited with {PEER_LOST_EXIT_CODE} (the survivors found no live "
                      "replica or no consistent step; see its log)")
        elif crashed:
            reason = f"a worker failed on {', '.join(vm.vm_id for vm in crashed)} (not a lost VM)"
        elif store is None:
            reason = f"generation {gen.generation}'s store was lost with a manager restart"
        decision = self._decide(job, gen, gone)
        if reason is not None and decision.live:
            decision = live_morph.LiveMorphDecision(
                None, reason, decision.lost_ranks, decision.survivor_ranks)
        old = (gen.pipeline_depth, gen.data_parallel)
        if not decision.live:
            live_morph.record(self.ctx.event, job.job_id, gen.generation, decision, old=old)
            return False
        live_morph.tell_workers(store.store, decision)
        plan = decision.plan
        gone_ids = [vm.vm_id for vm in gone]
        survivors = [v for v in gen.vm_ids if v not in set(gone_ids)]
        # One write: VMs, P×D and members change together (a manager killed here finds either).
        self.ctx.store.update_generation(
            job.job_id, gen.generation, vms_json=json.dumps(survivors),
            pipeline_depth=plan.pipeline_depth, data_parallel=plan.data_parallel,
            predicted_samples_per_s=plan.predicted_samples_per_s,
            live_json=self.members(gen).without(gone_ids).to_json(),
        )
        detected = job.detection_time if job.detection_time is not None else now
        # The morph is over without a relaunch: the next relaunch's latency starts afresh.
        self.ctx.store.update_job(job.job_id, detection_time=None, detection_reason="")
        self._set_pending(job.job_id, gen.generation, PendingMorph(decision, old, detected, gen.last_step))
        return True

    def _decide(
        self, job: JobRecord, gen: GenerationRecord, gone: list[VMRecord]
    ) -> live_morph.LiveMorphDecision:
        members = self.members(gen)
        return live_morph.decide(
            lambda s: self.planner.plan(job, s), pipeline_depth=gen.pipeline_depth,
            data_parallel=gen.data_parallel, slots=self._slots(gen), vm_ids=gen.vm_ids,
            lost_vm_ids=[vm.vm_id for vm in gone], members=members.members,
            check_stages=not members.morphed,
        )

    def _slots(self, gen: GenerationRecord) -> dict[str, int]:
        slots = {}
        for vm_id in gen.vm_ids:
            vm = self.ctx.store.vm(vm_id)
            slots[vm_id] = vm.slots if vm is not None else 0
        return slots

    def members(self, gen: GenerationRecord) -> LiveMembers:
        """``gen``'s members (a generation stored before they were recorded: the launch placement)."""
        if gen.live_json:
            return LiveMembers.from_json(gen.live_json)
        return LiveMembers.at_launch(gen.vm_ids, self._slots(gen), gen.pipeline_depth * gen.data_parallel)

    @staticmethod
    def leaving(gen: GenerationRecord) -> tuple[str, ...]:
        """The VMs of ``gen`` told to hand over and leave (their RUN orders say ``leave``)."""
        return LiveMembers.from_json(gen.live_json).leaving if gen.live_json else ()

    # -- an eviction notice -------------------------------------------------------------------

    def on_notice(self, job: JobRecord, gen: GenerationRecord, noticed: list[VMRecord], now: float) -> bool:
        """VMs of the running ``gen`` have an eviction notice. True: their workers hand over and
        leave (the RUN orders of those VMs say ``leave``; the agent sends the notice signal), the
        others go on; False: the caller stops the generation gracefully (the fallback event is
        written here). Called on every pass while the notice stands: only new VMs count."""
        members = self.members(gen)
        new = [vm.vm_id for vm in noticed if vm.vm_id not in members.leaving]
        if not new:
            return True
        leaving = [*members.leaving, *new]
        key = (job.job_id, gen.generation)
        decision = live_morph.decide_notice(lambda s: self.planner.plan(job, s), members=members.members,
                                            vm_ids=gen.vm_ids, leaving_vm_ids=leaving)
        if key not in self._stores and decision.live:
            decision = dataclasses.replace(
                decision, plan=None,
                reason=f"generation {gen.generation}'s store was lost with a manager restart")
        elif gen.first_step_time is None and decision.live:  # its workers may not listen yet
            decision = dataclasses.replace(
                decision, plan=None, reason=f"generation {gen.generation} has not completed a step yet")
        old = (gen.pipeline_depth, gen.data_parallel)
        if not decision.live:
            live_morph.record(self.ctx.event, job.job_id, gen.generation, decision, old=old)
            return False
        plan = decision.plan
        # The layout first, then the orders that make the workers leave: the survivors read it
        # when they regroup, so it must be in the store before any leaver is signalled.
        live_morph.tell_workers(self._stores[key].store, decision)
        self.ctx.store.update_generation(
            job.job_id, gen.generation, pipeline_depth=plan.pipeline_depth, data_parallel=plan.data_parallel,
            predicted_samples_per_s=plan.predicted_samples_per_s, live_json=members.leave(new).to_json(),
        )
        detected, step = now, gen.last_step
        earlier = self._pending.get(key)
        if (earlier is not None and earlier.decision.kind == "notice"
                and set(earlier.decision.lost_ranks) <= set(decision.lost_ranks)):
            # Notices on several VMs (their agents report one by one): one hand-over, one event,
            # timed from the first; this decision already covers the earlier leavers.
            del self._pending[key]
            old, detected, step = earlier.old, earlier.detected, earlier.step
        new_layout = (plan.pipeline_depth, plan.data_parallel)
        self._set_pending(job.job_id, gen.generation, PendingMorph(
            decision, old, detected, step, expect=new_layout if new_layout != old else None,
            wait_leavers=new_layout == old))
        return True

    def drop_leavers(
        self, job: JobRecord, gen: GenerationRecord, vms: dict[str, VMRecord]
    ) -> GenerationRecord:
        """Leaving VMs whose workers all exited 0 (state handed over) leave the generation; returns
        it as stored now. A leaver that failed stays: the caller's failure path sees it."""
        leaving = self.leaving(gen)
        members = self.members(gen)
        done = []
        for vm_id in leaving:
            vm = vms.get(vm_id)
            if not members.members.get(vm_id):  # every member there froze and was dropped already
                done.append(vm_id)
            elif vm is None or vm.reported_generation != gen.generation or not vm.workers:
                continue
            elif all(not w["running"] and w["exit_code"] == 0 for w in vm.workers):
                done.append(vm_id)
        if not done:
            return gen
        store = self._stores.get((job.job_id, gen.generation))
        if store is not None:
            from varuna.runtime.live_morph import declare_dead  # torch: only when live

            for member in members.ranks(done):  # they said so themselves; the supervisor's word too
                declare_dead(store.store, member)
        self.ctx.store.update_generation(
            job.job_id, gen.generation, vms_json=json.dumps([v for v in gen.vm_ids if v not in done]),
            live_json=members.without(done).to_json(),
        )
        key = (job.job_id, gen.generation)
        pending = self._pending.get(key)
        if pending is not None and pending.wait_leavers:
            self._pending[key] = dataclasses.replace(pending, wait_leavers=False, step=gen.last_step)
        self.ctx.event(job.job_id, "live-left", f"generation {gen.generation}: {', '.join(done)} handed "
                       f"over and left (members {members.ranks(done)})", generation=gen.generation,
                       data={"vms": done, "members": members.ranks(done)})
        return self.ctx.store.generation(job.job_id, gen.generation) or gen

    # -- a frozen member -----------------------------------------------------------------------

    def drop_frozen(
        self, job: JobRecord, gen: GenerationRecord, vms: dict[str, VMRecord], now: float
    ) -> GenerationRecord:
        """Members of the running ``gen`` on VMs that are up whose peers declared them dead for
        lack of heartbeats (frozen or hung: Note [Live watch] in varuna/runtime/live_watch.py), or
        that exited with ``DECLARED_DEAD_EXIT_CODE`` (76: declared dead, then resumed): the others
        severed the old groups and regrouped without them. They leave the members for ``frozen``
        (their agents' RUN orders name them in ``kill``); their VMs and the other workers there
        stay. A ``live-frozen`` event now; the ``live-morph`` event (``reason_kind`` ``frozen``) at
        the first step past the one in flight, at the layout the workers report. Returns ``gen``
        as stored now. No store (a manager restart) or nobody left: nothing here, the failure path
        decides."""
        store = self._stores.get((job.job_id, gen.generation))
        if store is None:
            return gen
        from varuna.runtime.live_watch import DECLARED_DEAD_EXIT_CODE  # torch: only when live

        members = self.members(gen)
        why: dict[int, str] = {}
        for vm_id, ids in members.members.items():
            vm = vms.get(vm_id)
            if vm is None or vm.state != "up":
                continue  # a lost VM: on_failure's
            exited = {w["rank"] for w in vm.workers if vm.reported_generation == gen.generation
                      and not w["running"] and w["exit_code"] == DECLARED_DEAD_EXIT_CODE}
            for m in ids:
                verdict = store.frozen(m)  # checked against the store's own view (Note [Verdict check])
                if verdict is not None or m in exited:
                    why[m] = verdict or f"exited with {DECLARED_DEAD_EXIT_CODE}: declared dead by its peers"
        dropped = members.drop(why)
        counts = [len(ids) for v in gen.vm_ids if (ids := dropped.members.get(v))]
        if not why or not counts:
            return gen
        old = (gen.pipeline_depth, gen.data_parallel)
        try:
            plan = self.planner.plan(job, counts)
        except ValueError as exc:  # the workers' own rule chose; their first step says which
            plan = LayoutPlan(pipeline_depth=old[0], data_parallel=old[1],
                              micro_batch_size=gen.micro_batch_size,
                              predicted_samples_per_s=gen.predicted_samples_per_s,
                              source=f"the workers' rule ({exc})")
        decision = live_morph.LiveMorphDecision(plan, plan.source, tuple(sorted(why)),
                                                tuple(dropped.ranks(gen.vm_ids)), kind="frozen")
        # For their next regroups (this one may be over already: the watches do not wait for us).
        live_morph.tell_workers(store.store, decision)
        self.ctx.store.update_generation(
            job.job_id, gen.generation, pipeline_depth=plan.pipeline_depth, data_parallel=plan.data_parallel,
            predicted_samples_per_s=plan.predicted_samples_per_s, live_json=dropped.to_json())
        where = {m: v for v, ids in members.members.items() for m in ids if m in why}
        said = "; ".join(f"{m} on {where[m]}: {why[m]}" for m in sorted(why))
        self.ctx.event(job.job_id, "live-frozen", f"generation {gen.generation}: member(s) {sorted(why)} "
                       f"dropped ({said}); the others went on without them; their agents kill them",
                       generation=gen.generation,
                       data={"members": sorted(why), "vms": sorted(set(where.values())),
                             "why": {str(m): w for m, w in why.items()}})
        self._set_pending(job.job_id, gen.generation, PendingMorph(decision, old, now, gen.last_step))
        return self.ctx.store.generation(job.job_id, gen.generation) or gen

    @staticmethod
    def member_views(gen: GenerationRecord, vms: dict[str, VMRecord]) -> dict[str, VMRecord]:
        """``vms`` without the workers of members dropped as frozen: their exit (76, or -9 from the
        kill order) is no failure of the generation, and they do not count for its end."""
        return LiveMembers.from_json(gen.live_json).views(gen.generation, vms) if gen.live_json else vms

    @staticmethod
    def to_kill(gen: GenerationRecord, vm_id: str) -> list[int]:
        """The members on ``vm_id`` declared frozen: its agent SIGKILLs them (RUN orders' ``kill``)."""
        return list(LiveMembers.from_json(gen.live_json).frozen.get(vm_id, ())) if gen.live_json else []

    def _adopt_layout(
        self, job: JobRecord, generation: int, pending: PendingMorph, layout: tuple[int, int]
    ) -> PendingMorph:
        """The workers regrouped before the manager's layout reached the store: the generation
        runs at theirs. Its prediction is the plan's scaled by the workers used (the fallback
        rule's own assumption)."""
        plan = pending.decision.plan
        assert plan is not None
        if (plan.pipeline_depth, plan.data_parallel) == layout:
            return pending
        predicted = plan.predicted_samples_per_s * layout[0] * layout[1] / plan.world_size
        chosen = LayoutPlan(pipeline_depth=layout[0], data_parallel=layout[1],
                            micro_batch_size=plan.micro_batch_size, predicted_samples_per_s=predicted,
                            source=f"the workers' rule (they regrouped before the manager's "
                            f"{plan.pipeline_depth}×{plan.data_parallel} [{plan.source}] reached them)")
        self.ctx.store.update_generation(job.job_id, generation, pipeline_depth=layout[0],
                                         data_parallel=layout[1], predicted_samples_per_s=predicted)
        return dataclasses.replace(pending, decision=dataclasses.replace(pending.decision, plan=chosen,
                                                                         reason=chosen.source))

    # -- growth --------------------------------------------------------------------------------

    def on_grow(self, job: JobRecord, gen: GenerationRecord, extra: list[VMRecord], now: float) -> bool:
        """Usable VMs ``extra`` outside the running ``gen`` (the grow rule said growing pays): their
        workers join the running generation as new members at the next step boundary and receive
        their stages from peers, at the simulator's P×D for all the VMs. False: the caller takes the
        graceful stop and relaunch (no store after a manager restart, or no bigger layout fits).
        While VMs of a notice are still leaving it waits (True, nothing done)."""
        key = (job.job_id, gen.generation)
        members = self.members(gen)
        if members.leaving:
            # VMs still handing over after a notice: grow once they left (the layout for all the
            # VMs must not count their workers). True: no restart either; the rule asks again.
            return True
        old = (gen.pipeline_depth, gen.data_parallel)
        have = [(v, len(members.members.get(v, ()))) for v in gen.vm_ids]
        if key not in self._stores:
            why = f"generation {gen.generation}'s store was lost with a manager restart"
            live_morph.record(self.ctx.event, job.job_id, gen.generation, live_morph.LiveMorphDecision(
                None, why, (), tuple(members.ranks(gen.vm_ids)), kind="growth"), old=old)
            return False
        try:
            plan = self.planner.plan(job, [n for _, n in have if n] + [vm.slots for vm in extra])
        except ValueError:
            return False
        need = plan.world_size - sum(n for _, n in have)
        chosen: list[VMRecord] = []
        for vm in extra:
            if need <= 0:
                break
            chosen.append(vm)
            need -= vm.slots
        if not chosen:
            return False
        grown = members.grow([(vm.vm_id, vm.slots) for vm in chosen])
        joined = tuple(grown.ranks(vm.vm_id for vm in chosen))
        decision = live_morph.LiveMorphDecision(plan, plan.source, (), tuple(members.ranks(gen.vm_ids)),
                                                kind="growth", joined=joined)
        live_morph.tell_workers(self._stores[key].store, decision)  # before any joiner starts
        self.ctx.store.update_generation(
            job.job_id, gen.generation, vms_json=json.dumps(gen.vm_ids + [vm.vm_id for vm in chosen]),
            pipeline_depth=plan.pipeline_depth, data_parallel=plan.data_parallel,
            predicted_samples_per_s=plan.predicted_samples_per_s, live_json=grown.to_json(),
        )
        self.ctx.cache(job).launches.pop(gen.generation, None)  # the new VMs' launches: joiners
        detected = job.detection_time if job.detection_time is not None else now
        self.ctx.store.update_job(job.job_id, detection_time=None, detection_reason="")
        self._set_pending(job.job_id, gen.generation, PendingMorph(
            decision, old, detected, gen.last_step, expect=(plan.pipeline_depth, plan.data_parallel)))
        return True

    # -- the survivors' next step --------------------------------------------------------------

    def step_reported(
        self, job: JobRecord, generation: int, step: int, now: float, layout: tuple[int, int] | None = None
    ) -> None:
        """A worker heartbeat (its step and P×D): the first step past the one in flight (at the
        planned layout, for a notice or growth) ends a pending live morph."""
        key = (job.job_id, generation)
        pending = self._pending.get(key)
        if pending is None or pending.wait_leavers:
            return
        if pending.expect is not None and layout is not None and layout != pending.expect:
            return
        if step > pending.step:
            del self._pending[key]
            if pending.decision.kind == "frozen" and layout is not None and min(layout) > 0:
                pending = self._adopt_layout(job, generation, pending, layout)
            self._record(job.job_id, generation, pending, now - pending.detected)

    def _set_pending(self, job_id: str, generation: int, pending: PendingMorph) -> None:
        """A new morph of a generation whose previous one is still pending: that one's event is
        written now, without a duration (the workers went on to the next one)."""
        earlier = self._pending.get((job_id, generation))
        if earlier is not None:
            self._record(job_id, generation, earlier, None)
        self._pending[(job_id, generation)] = pending

    def _record(self, job_id: str, generation: int, pending: PendingMorph, duration_s: float | None) -> None:
        live_morph.record(self.ctx.event, job_id, generation, pending.decision, old=pending.old,
                          duration_s=duration_s)
