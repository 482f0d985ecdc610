"""VM bookkeeping: registration, agent heartbeats and the orders they get back, VMs lost
(silent for T, or quiet for S with a host that does not answer a probe: Note [Silence probes]
in manager/domain/silence.py; never registered; reported gone by the provider) and asking the
provider for the VMs a job still lacks.

An agent's heartbeat reply is the full desired state of its VM (Note [Orders] in
manager/agent/vm_agent.py): RUN the generation's workers, STOP, KILL, PROFILE, IDLE or SHUTDOWN.

    >>> VMBook.__name__
    'VMBook'
"""

from __future__ import annotations

import json
from typing import Any

from manager.domain.context import ManagerContext
from manager.domain.errors import ErrorKind, ManagerError
from manager.domain.messages import Action, Orders, Registered, RegisterVM, VMHeartbeat
from manager.domain.ports import Calibrations, Launches
from manager.domain.records import JobRecord, VMRecord
from manager.domain.silence import SilenceProbes
from manager.domain.vm_types import type_options as options_of_type
from manager.domain.vm_types import vm_type_of

__all__ = ["VMBook", "ranks_of", "vm_label"]


def ranks_of(vm: VMRecord, generation: int) -> list[int]:
    """The ranks ``vm``'s agent last reported running for ``generation`` (empty: none known).

    >>> vm = VMRecord(vm_id="v", job_id="j", provider="local", seq=1, state="up", slots=1, created=0.0,
    ...               reported_generation=2, workers_json='[{"rank": 3}]')
    >>> ranks_of(vm, 2), ranks_of(vm, 3)
    ([3], [])
    """
    if vm.reported_generation != generation:
        return []
    return sorted(int(w["rank"]) for w in vm.workers if "rank" in w)


def vm_label(vm_id: str, ranks: list[int]) -> str:
    """``vm3 (rank 2)``: how events name a VM of a generation (Note [Blame] in generations.py).

    >>> vm_label("j-vm3", [2]), vm_label("j-vm3", [0, 1]), vm_label("j-vm3", [])
    ('j-vm3 (rank 2)', 'j-vm3 (ranks 0, 1)', 'j-vm3')
    """
    if not ranks:
        return vm_id
    return f"{vm_id} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"


class VMBook:
    """The VMs of every job and what their agents are told.

    Example::

        book = VMBook(ctx, calibration, launches)
        reply = book.register(req)      # RegisterVM from an agent
        orders = book.heartbeat(beat)   # VMHeartbeat -> Orders
    """

    def __init__(self, ctx: ManagerContext, calibration: Calibrations, launches: Launches) -> None:
        self.ctx = ctx
        self.calibration = calibration
        self.launches = launches
        self.silence = SilenceProbes(ctx)

    # -- RPCs from agents ----------------------------------------------------------------------

    def register(self, req: RegisterVM) -> Registered:
        """An agent (re)starting on a VM: a known VM, or one its provider named (scale set)."""
        ctx = self.ctx
        now = ctx.clock()
        with ctx.lock:
            vm = ctx.store.vm(req.vm_id) or self._adopt(req, now)
            job = ctx.store.job(vm.job_id)
            if job is None or job.terminal or vm.state == "deleted":
                raise ManagerError(ErrorKind.FAILED_PRECONDITION, f"VM {req.vm_id} is not wanted any more")
            if vm.agent_instance and vm.agent_instance != req.agent_instance:
                self._agent_restarted(job, vm, now)
            was = vm.state
            ctx.store.update_vm(
                vm.vm_id,
                state="up",
                address=req.address,
                hostname=req.hostname,
                agent_instance=req.agent_instance,
                agent_pid=req.pid,
                slots=req.slots or vm.slots,
                registered=now,
                last_heartbeat=now,
            )
            if was != "up":
                ctx.event(
                    job.job_id,
                    "vm-registered" if was == "requested" else "vm-back",
                    f"{vm.vm_id} at {req.address} ({req.slots} slot(s))",
                    vm_id=vm.vm_id,
                )
        return Registered(heartbeat_interval_s=ctx.config.heartbeat_interval_s, message=f"job {job.job_id}")

    def _adopt(self, req: RegisterVM, now: float) -> VMRecord:
        """A VM named by its provider (scale set): it takes the place of a placeholder."""
        ctx = self.ctx
        job = ctx.store.job(req.job_id) if req.job_id else None
        if job is None or job.terminal:
            raise ManagerError(
                ErrorKind.NOT_FOUND, f"unknown VM {req.vm_id!r} and no active job {req.job_id!r}"
            )
        # A scale set names its instances <scale set>_<n>: the placeholder of that scale set (of
        # the VM's type, with several types) gives the VM its type.
        scale_set = req.vm_id.rsplit("_", 1)[0]
        holders = [ph for ph in ctx.store.vms(job.job_id, states=["requested"]) if ph.ref.get("placeholder")]
        holders.sort(key=lambda ph: ph.ref.get("scale_set") != scale_set)
        adopted_ref: dict[str, Any] = {}
        if holders:
            ctx.store.update_vm(holders[0].vm_id, state="deleted", gone_reason=f"became {req.vm_id}")
            if holders[0].ref.get("vm_type"):
                adopted_ref = {"scale_set": scale_set, "vm_type": holders[0].ref["vm_type"]}
        ctx.store.add_vm(
            VMRecord(
                vm_id=req.vm_id,
                job_id=job.job_id,
                provider=ctx.cache(job).spec.provider,
                seq=ctx.store.next_vm_seq(job.job_id),
                state="requested",
                slots=req.slots,
                created=now,
                **({"provider_ref": json.dumps(adopted_ref)} if adopted_ref else {}),
            )
        )
        vm = ctx.store.vm(req.vm_id)
        assert vm is not None
        return vm

    def _agent_restarted(self, job: JobRecord, vm: VMRecord, now: float) -> None:
        """A new agent process on a known VM: the old one's workers are gone with it."""
        ctx = self.ctx
        ctx.event(
            job.job_id,
            "agent-restarted",
            f"{vm.vm_id}: a new agent process replaced the old one",
            vm_id=vm.vm_id,
        )
        gen = ctx.live_generation(job)
        if gen is not None and vm.vm_id in gen.vm_set and gen.state != "killing":
            ctx.note_detection(job, f"agent restarted on {vm.vm_id}", now)
            ctx.begin_kill(job, gen, f"agent restarted on {vm.vm_id}", now)
        fresh = ctx.store.job(job.job_id) or job
        if fresh.calibration_state == "profiling" and fresh.calibration_vm == vm.vm_id:
            # The old agent's profiler died with it: this attempt will never report.
            self.calibration.lost(fresh, f"the agent on {vm.vm_id} restarted")

    def registered_vm(self, vm_id: str) -> VMRecord:
        """The stored VM ``vm_id``; an RPC from a VM that never registered is NOT_FOUND."""
        vm = self.ctx.store.vm(vm_id)
        if vm is None:
            raise ManagerError(ErrorKind.NOT_FOUND, f"unknown VM {vm_id!r}; register first")
        return vm

    def heartbeat(self, req: VMHeartbeat) -> Orders:
        """Record an agent's heartbeat; the reply is its VM's orders."""
        ctx = self.ctx
        now = ctx.clock()
        with ctx.lock:
            vm = self.registered_vm(req.vm_id)
            job = ctx.store.job(vm.job_id)
            orders = Orders(
                heartbeat_interval_s=ctx.config.heartbeat_interval_s, stop_timeout_s=ctx.config.stop_timeout_s
            )
            if job is None or job.terminal or vm.state == "deleted":
                orders.action = Action.SHUTDOWN
                return orders
            if vm.agent_instance and req.agent_instance and vm.agent_instance != req.agent_instance:
                self._agent_restarted(job, vm, now)
            changes = self._heartbeat_values(job, vm, req, now)
            # What only repeats what the manager knows (most heartbeats) costs no transaction:
            # the time heard from and the free port are deferred (Note [Deferred writes] in
            # manager/domain/record_cache.py); any other change is written at once, with them.
            soft = {"last_heartbeat": now, "free_port": req.free_port}
            if changes:
                ctx.store.update_vm(vm.vm_id, **changes, **soft)
            else:
                ctx.store.note_vm(vm.vm_id, **soft)
            self._fill_orders(orders, job, vm)
            return orders

    def _heartbeat_values(
        self, job: JobRecord, vm: VMRecord, req: VMHeartbeat, now: float
    ) -> dict[str, Any]:
        """The values of the VM row that this heartbeat changes (state, workers, notice), with
        the events they are worth; {} when it only says the VM is alive."""
        reported: dict[str, Any] = {
            "reported_generation": req.generation,
            "agent_instance": req.agent_instance or vm.agent_instance,
            "workers_json": json.dumps(
                [
                    {"rank": w.rank, "pid": w.pid, "running": w.running, "exit_code": w.exit_code}
                    for w in req.workers
                ]
            ),
        }
        values = {k: v for k, v in reported.items() if getattr(vm, k) != v}
        if vm.state == "gone":
            # Silent for T, then back (a partition, a stalled VM): usable again once it has shed
            # its old workers (IDLE below). Its old generation was already killed.
            values["state"] = "up"
            values["gone_reason"] = ""
            self.ctx.event(job.job_id, "vm-back", f"{vm.vm_id} heartbeats again", vm_id=vm.vm_id)
        elif vm.state == "requested":
            values["state"] = "up"
        if req.notice is not None and not vm.notice:
            notice = {
                "event_id": req.notice.event_id,
                "event_type": req.notice.event_type,
                "not_before": req.notice.not_before,
                "description": req.notice.description,
            }
            values["notice_json"] = json.dumps(notice)
            self.ctx.event(
                job.job_id,
                "preempt-notice",
                f"{vm.vm_id}: {notice['event_type']} {notice['event_id']} not before "
                f"{notice['not_before'] or '?'}; "
                + ("its workers hand their state over and leave when the manager says so (live morph)"
                   if self.ctx.live_morph_job(job) else "its agent sent SIGUSR1 (checkpoint and stop)"),
                vm_id=vm.vm_id,
                data=notice,
            )
        return values

    def _fill_orders(self, orders: Orders, job: JobRecord, vm: VMRecord) -> None:
        gen = self.ctx.live_generation(job)
        if gen is None and job.calibration_state == "profiling" and vm.vm_id == job.calibration_vm:
            orders.action = Action.PROFILE
            orders.profile = self.calibration.order(job)
            return
        if gen is None or vm.vm_id not in gen.vm_set:
            orders.action = Action.IDLE
            return
        orders.generation = gen.generation
        if gen.state == "running":
            orders.action = Action.RUN
            orders.workers.extend(self.launches.launches(job, gen).get(vm.vm_id, []))
            orders.training = gen.first_step_time is not None
            orders.leave = vm.vm_id in self.ctx.live.leaving(gen)
            orders.kill.extend(self.ctx.live.to_kill(gen, vm.vm_id))  # declared frozen by their peers
        elif gen.state == "stopping":
            orders.action = Action.STOP
        else:
            orders.action = Action.KILL

    # -- liveness ------------------------------------------------------------------------------

    def check_liveness(self, job: JobRecord, now: float) -> None:
        """Declare gone the VMs silent for T, those quiet for S whose host does not answer a
        probe (Note [Silence probes] in manager/domain/silence.py) and those that never
        registered in time."""
        ctx, cfg = self.ctx, self.ctx.config
        for vm in ctx.store.vms(job.job_id, states=["requested", "up"]):
            silent_s = ctx.age(vm, now) if vm.state == "up" else 0.0
            if vm.state == "up" and silent_s > cfg.heartbeat_timeout_s:
                self.mark_gone(job, vm, f"no heartbeat for {silent_s:.1f} s", now, silent_s=silent_s)
            elif vm.state == "up" and (why := self.silence.verdict(vm, silent_s, now)):
                self.mark_gone(job, vm, why, now, silent_s=silent_s)
            elif vm.state == "requested" and now - max(vm.created, ctx.started_at) > cfg.register_timeout_s:
                self.mark_gone(job, vm, f"never registered within {cfg.register_timeout_s:g} s", now)

    def mark_gone(
        self, job: JobRecord, vm: VMRecord, reason: str, now: float, *, silent_s: float | None = None
    ) -> None:
        """The VM is lost: record it, note the morph trigger, have the provider delete it. The
        event names the VM with the ranks it ran (Note [Blame] in manager/domain/generations.py)
        and, for a silent VM, ``silent_s``: how long it had been silent when declared gone."""
        ctx = self.ctx
        gen = ctx.live_generation(job)
        in_gen = gen is not None and vm.vm_id in gen.vm_set
        ranks = ranks_of(vm, gen.generation) if in_gen and gen is not None else []
        ctx.store.update_vm(vm.vm_id, state="gone", gone_reason=reason)
        data: dict[str, Any] = {"ranks": ranks, "reason": reason}
        if silent_s is not None:
            data["silent_s"] = round(silent_s, 3)
        ctx.event(
            job.job_id,
            "vm-gone",
            f"{vm_label(vm.vm_id, ranks)}: {reason}" + (" (in the running generation)" if in_gen else ""),
            vm_id=vm.vm_id,
            generation=gen.generation if in_gen and gen else 0,
            data=data,
        )
        if in_gen and gen is not None and gen.state == "running":
            ctx.note_detection(job, f"{vm_label(vm.vm_id, ranks)} gone ({reason})", now)
        gone_vm = ctx.store.vm(vm.vm_id)
        if gone_vm is not None:
            provider = ctx.provider_of(job, gone_vm)
            ctx.actions.append(lambda: provider.delete_vm(gone_vm))

    # -- the provider --------------------------------------------------------------------------

    def provider_error(self, job: JobRecord, text: str) -> None:
        """Log a provider failure, at most one event a minute (not one per tick)."""
        cache = self.ctx.cache(job)
        now = self.ctx.clock()
        if now - cache.provider_error_logged > 60.0:
            cache.provider_error_logged = now
            self.ctx.event(job.job_id, "provider-error", text.splitlines()[0] if text else "provider error")

    def maintain_pool(self, job: JobRecord, vms: list[VMRecord], now: float) -> None:
        """Ask the provider for VMs up to ``max_vms`` (slow and evicting ones do not count). The
        call itself runs after the tick, outside the lock."""
        ctx = self.ctx
        cache = ctx.cache(job)
        spec = cache.spec
        live = [vm for vm in vms if vm.state in ("requested", "up") and not vm.slow and not vm.notice]
        if now < cache.create_after or job.cancel_requested:
            return
        # (VMs wanted, slots per VM, type options, VMs created so far) per request.
        requests: list[tuple[int, int, dict[str, Any] | None, int]] = []
        if ctx.pool_job(job):  # the pool's placement decides (Note [Pool VMs] in pool_rounds.py)
            want, slots, type_options = ctx.pool.maintain(job, vms, now)
            requests.append((want, slots, type_options, len(vms)))
        elif spec.vm_type_specs:  # a pool of several types of its own: each up to its max_vms
            types = spec.vm_type_specs
            for t in types:
                of_type = [vm for vm in vms if vm_type_of(vm.ref) == t.name]
                live_t = [vm for vm in live if vm_type_of(vm.ref) == t.name]
                options = options_of_type(t, types)
                requests.append((t.max_vms - len(live_t), spec.procs_per_vm, options, len(of_type)))
        else:
            requests.append((spec.max_vms - len(live), spec.procs_per_vm, None, len(vms)))
        for want, slots, options, created_so_far in requests:
            if want <= 0:
                continue
            numbers = [ctx.store.next_vm_seq(job.job_id) for _ in range(want)]
            seqs = {f"{job.job_id}-vm{seq}": seq for seq in numbers}
            cache.create_after = now + ctx.config.create_retry_s  # until the result says otherwise
            ctx.actions.append(
                lambda q=seqs, n=created_so_far, k=slots, o=options: self._create_vms(job, q, n, k, o)
            )

    def _create_vms(
        self,
        job: JobRecord,
        seqs: dict[str, int],
        created_so_far: int,
        slots: int,
        type_options: dict[str, Any] | None,
    ) -> None:
        ctx = self.ctx
        cache = ctx.cache(job)
        spec = cache.spec
        vm_type = str((type_options or {}).get("vm_type", ""))
        provider = ctx.provider(job, vm_type)  # a pool type may name its own (Note [Providers in a pool])
        source = getattr(provider, "name", spec.provider)
        new: list = []
        try:
            extra = {"type_options": type_options} if type_options else {}
            new = provider.create_vms(job.job_id, list(seqs), slots, created_so_far=created_so_far, **extra)
        finally:
            # Numbers of VMs the provider did not start are given back: names stay dense while
            # the manager keeps asking a provider that is out of capacity.
            used = [seqs[nv.vm_id] for nv in new if nv.vm_id in seqs]
            ctx.store.release_vm_seqs(
                job.job_id,
                reserved_up_to=max(seqs.values()),
                used_up_to=max(used, default=min(seqs.values()) - 1),
            )
        with ctx.lock:
            for nv in new:
                # A pool VM's type lives in its provider reference (PoolRounds.vm_type_of).
                ref = {**nv.ref, "vm_type": type_options["vm_type"]} if type_options else nv.ref
                if ctx.store.vm(nv.vm_id) is None:
                    ctx.store.add_vm(
                        VMRecord(
                            vm_id=nv.vm_id,
                            job_id=job.job_id,
                            provider=source,
                            seq=seqs.get(nv.vm_id, 0),
                            state="requested",
                            slots=slots,
                            created=ctx.clock(),
                            provider_ref=json.dumps(ref),
                        )
                    )
                else:  # its agent registered first
                    ctx.store.update_vm(nv.vm_id, provider_ref=json.dumps(ref))
            if new:
                pool = "pool " if ctx.pool_job(job) else ""
                kind = f" of {pool}type {type_options['vm_type']}" if type_options else ""
                ctx.event(
                    job.job_id,
                    "vm-requested",
                    f"{len(new)} VM(s){kind} from {source}: {', '.join(nv.vm_id for nv in new)}",
                )
            if len(new) == len(seqs):
                cache.create_after = 0.0  # got everything: no back-off
            elif not ctx.store.events(job.job_id, kinds=["capacity"]):
                ctx.event(
                    job.job_id,
                    "capacity",
                    f"{source} gave {len(new)} of {len(seqs)} VM(s); "
                    f"retrying every {ctx.config.create_retry_s:g} s",
                )
