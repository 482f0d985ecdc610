"""Live morph in the control loop (docs/manager.md, Live morph): the rendezvous store of each
generation of a ``live_morph = true`` job, and the reaction to a VM lost from a running one.

The daemon hosts one :class:`varuna.launch.live_store.LiveStore` per generation (a fresh one per
launch, as ``varuna-launch --live-morph`` does: member ids and ``dead/{id}`` keys must never be
reused, and a relaunch numbers its ranks from 0 again), bound to the manager's advertise host
only; its address is every worker's ``$VARUNA_LIVE_STORE``. It is closed when the generation ends,
when the job ends and when the manager stops (the store's server thread ends with its last
handle, and the listening socket is closed with it).

When VMs of a running generation are lost (no heartbeat for T, or the provider says gone),
:meth:`LiveRuns.on_lost` asks :func:`manager.live_morph.decide`. Live: the dead ranks and the
simulator's P×D go into the store (``tell_workers``), the generation keeps running on the
surviving VMs at the new P×D (updated in place: no kill, no relaunch), and the ``live-morph``
event is written once a survivor reports a step past the one in flight (its ``duration_s``:
detection → that heartbeat). Impossible (a stage lost every replica, no layout fits, a worker
exited with 75, the store is gone with a manager restart): a ``live-morph-fallback`` event, and
the caller takes today's kill + relaunch from the newest checkpoint.

    >>> LiveRuns.bind_host("[::1]:7878"), LiveRuns.bind_host("10.0.0.4:7878")
    ('::1', '10.0.0.4')
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from manager import live_morph
from manager.context import ManagerContext
from manager.morph_planner import MorphPlanner
from manager.store import GenerationRecord, JobRecord, VMRecord
from varuna.launch.supervisor import PEER_LOST_EXIT_CODE

__all__ = ["LiveRuns", "PendingMorph"]


@dataclass(frozen=True)
class PendingMorph:
    """A live morph decided, its event waiting for the survivors' next step."""

    decision: live_morph.LiveMorphDecision
    old: tuple[int, int]
    detected: float
    step: int  # the generation's last reported step at detection: the next higher one ends it


class LiveRuns:
    """See the module docstring. Callers hold ``ctx.lock``.

    Example::

        live = LiveRuns(ctx, planner)
        address = live.open_store(job, 3)        # before generation 3's launches are made
        handled = live.on_lost(job, gen, lost_vms, now)   # False: kill + relaunch
    """

    def __init__(self, ctx: ManagerContext, planner: MorphPlanner) -> None:
        self.ctx = ctx
        self.planner = planner
        self._stores: dict[tuple[str, int], Any] = {}  # (job, generation) -> LiveStore
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
        from varuna.launch.live_store import LiveStore  # torch: only for live-morph jobs

        key = (job.job_id, generation)
        if key not in self._stores:
            self._stores[key] = LiveStore(self.bind_host(self.ctx.config.advertise_address))
        return self._stores[key].address

    def address(self, job: JobRecord, generation: int) -> str | None:
        """The store of a generation this manager process launched (None after a restart)."""
        store = self._stores.get((job.job_id, generation))
        return store.address if store is not None else None

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
        survivors = [v for v in gen.vm_ids if v not in {vm.vm_id for vm in gone}]
        self.ctx.store.update_generation(
            job.job_id, gen.generation, vms_json=json.dumps(survivors),
            pipeline_depth=plan.pipeline_depth, data_parallel=plan.data_parallel,
            predicted_samples_per_s=plan.predicted_samples_per_s,
        )
        detected = job.detection_time if job.detection_time is not None else now
        # The morph is over without a relaunch: the next relaunch's latency starts afresh.
        self.ctx.store.update_job(job.job_id, detection_time=None, detection_reason="")
        self._pending[(job.job_id, gen.generation)] = PendingMorph(decision, old, detected, gen.last_step)
        return True

    def _decide(
        self, job: JobRecord, gen: GenerationRecord, gone: list[VMRecord]
    ) -> live_morph.LiveMorphDecision:
        slots = {}
        for vm_id in gen.vm_ids:
            vm = self.ctx.store.vm(vm_id)
            slots[vm_id] = vm.slots if vm is not None else 0
        return live_morph.decide(
            lambda s: self.planner.plan(job, s), pipeline_depth=gen.pipeline_depth,
            data_parallel=gen.data_parallel, slots=slots, vm_ids=gen.vm_ids,
            lost_vm_ids=[vm.vm_id for vm in gone],
        )

    # -- the survivors' next step --------------------------------------------------------------

    def step_reported(self, job: JobRecord, generation: int, step: int, now: float) -> None:
        """A worker heartbeat: the first step past the one in flight ends a pending live morph."""
        key = (job.job_id, generation)
        pending = self._pending.get(key)
        if pending is not None and step > pending.step:
            del self._pending[key]
            self._record(job.job_id, generation, pending, now - pending.detected)

    def _record(self, job_id: str, generation: int, pending: PendingMorph, duration_s: float | None) -> None:
        live_morph.record(self.ctx.event, job_id, generation, pending.decision, old=pending.old,
                          duration_s=duration_s)
