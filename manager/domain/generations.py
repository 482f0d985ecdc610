"""The job controller: the life cycle of a job's generations (Note [Generations] in
manager/domain/controller.py): launch one when none is live, supervise it, stop it gracefully or kill
it, record its end, and finish the job.

Each method takes one step from the state in the store (callers hold ``ctx.lock``), so the
control loop can be restarted at any point.

Note [Blame]: when a VM goes silent (a partition, an eviction without notice: its packets
vanish, nothing is reset), its peers' peer watches may give up on it before the manager's
heartbeat timeout does: the healthy VMs' workers then exit with :data:`PEER_LOST_EXIT_CODE`
(75: "a peer was lost") while the silent VM still counts as up. Those exits are *symptoms*; the
generation's failure must name its *cause*, as ``varuna-launch`` does (Note [Blame] in
varuna/launch/supervisor.py). So a generation whose only failures are such exits waits
(:meth:`JobController._await_cause`): :data:`BLAME_WINDOW_S` for a racing report, and while a VM
of the generation has been quiet for over two heartbeat intervals, at most the heartbeat timeout
plus the window, for a primary cause (a VM declared gone, a worker that failed otherwise). The
``killing`` event, and the cause the relaunch records (``resumed``), then name only the causes,
each with its ranks (``vm3 (rank 2) gone (no heartbeat for 4.1 s)``); the survivors are named
only when no cause shows up. A silent VM is named S + P + up to two ticks after its last
heartbeat when its host does not answer a probe (Note [Silence probes] in
manager/domain/silence.py: about 4.4 s with the defaults), which ends the wait early; T plus a tick
otherwise. The wait's bound stays T + the window even when a quiet VM's probe *answered*: a
kernel that answers says the host is there, not that its workers are (a frozen or swapping VM
answers too, and T names it, as before), and ending the wait then would blame the survivors
and plan the frozen VM into the relaunch.

    >>> vm = VMRecord(vm_id="v", job_id="j", provider="local", seq=1, state="gone", slots=1, created=0.0)
    >>> vm_progress(vm, 1)   # (done, failed, clean): a VM gone before reporting the generation
    (True, True, False)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from manager.domain.context import ManagerContext
from manager.domain.live_members import LiveMembers
from manager.domain.ports import Calibrations, Placement, Planner
from manager.domain.records import GenerationRecord, JobRecord, VMRecord, WorkerStatRecord
from manager.domain.vm_book import ranks_of, vm_label

__all__ = ["JobController", "stopped_at", "vm_progress"]


def vm_progress(vm: VMRecord, g: int) -> tuple[bool, bool, bool]:
    """``(done, failed, clean)`` of one VM for generation ``g``: done = no worker of g runs there
    any more (or the VM is gone); failed = a worker of g exited non-zero or the VM vanished
    first; clean = every worker of g exited 0."""
    if vm.state != "up":
        reported = (
            vm.reported_generation == g
            and vm.workers
            and all(not w["running"] and w["exit_code"] == 0 for w in vm.workers)
        )
        return True, not reported, bool(reported)
    if vm.reported_generation < g:
        return False, False, False
    workers = vm.workers if vm.reported_generation == g else []
    done = all(not w["running"] for w in workers)
    failed = any(not w["running"] and w["exit_code"] != 0 for w in workers)
    return done, failed, done and not failed


def stopped_at(gen: GenerationRecord, stats: list[WorkerStatRecord]) -> int:
    """The step every worker of ``gen`` reached: the lowest of the ranks' latest steps (``stats``:
    the generation's worker rows), or ``gen.last_step`` when no worker reported a step past the
    one it resumed from (Note [Trusted progress] in manager/domain/worker_reports.py). Ranks at
    or above the current P × D (members a live morph let go) do not count."""
    world = gen.pipeline_depth * gen.data_parallel
    steps = [s.step for s in stats if 0 <= s.rank < world]
    return min(steps) if steps else gen.last_step


#: Note [Blame]: how long workers that exited as symptoms wait for their cause to show (an
#: agent's report of a kill -9 and the survivors' own exits race by a heartbeat or two).
BLAME_WINDOW_S = 1.0
#: A worker's exit code when it stopped because a peer was lost (its peer watch named the peer):
#: ``varuna.runtime.peer_watch.PEER_LOST_EXIT_CODE``, not imported (the domain does not load torch).
PEER_LOST_EXIT_CODE = 75


def _symptom_only(vm: VMRecord, g: int) -> bool:
    """Note [Blame]: ``vm`` is up and every worker of generation ``g`` that failed there exited
    with :data:`PEER_LOST_EXIT_CODE` (it stopped because of another)."""
    if vm.state != "up" or vm.reported_generation != g:
        return False
    codes = [w["exit_code"] for w in vm.workers if not w["running"] and w["exit_code"] != 0]
    return bool(codes) and all(c == PEER_LOST_EXIT_CODE for c in codes)


def _failure(vm: VMRecord, g: int) -> str:
    """How a failed VM of generation ``g`` is named in events: ``vm3 (rank 2) gone (no heartbeat
    for 4.1 s)``, ``vm1 (rank 0): worker failed (exit code 1)``."""
    label = vm_label(vm.vm_id, ranks_of(vm, g))
    if vm.state != "up":
        return f"{label} gone" + (f" ({vm.gone_reason})" if vm.gone_reason else "")
    codes = sorted({w["exit_code"] for w in vm.workers if not w["running"] and w["exit_code"] != 0})
    return f"{label}: worker failed (exit code {', '.join(map(str, codes))})"


class JobController:
    """Launch, supervise, stop, relaunch and finish a job's generations.

    Example::

        controller = JobController(ctx, CalibrationOrders(ctx), MorphPlanner(ctx))
        with ctx.lock:
            controller.maybe_launch(job, ctx.store.vms(job.job_id), now)
    """

    def __init__(self, ctx: ManagerContext, calibration: Calibrations, planner: Planner) -> None:
        self.ctx = ctx
        self.calibration = calibration
        self.planner = planner

    # -- a live generation ---------------------------------------------------------------------

    def supervise(self, job: JobRecord, gen: GenerationRecord, vms: list[VMRecord], now: float) -> None:
        """One step of a live generation: react to failures, completion and morph triggers."""
        by_id = {vm.vm_id: vm for vm in vms}
        if self.ctx.live_morph_job(job):
            if gen.state == "running":
                gen = self.ctx.live.drop_frozen(job, gen, by_id, now)  # the others went on without them
            by_id = self.ctx.live.member_views(gen, by_id)  # a dropped member's exit is no failure
            if gen.state == "running":
                gen = self.ctx.live.drop_leavers(job, gen, by_id)  # handed over after a notice
        gen_vms = [by_id[v] for v in gen.vm_ids if v in by_id]
        progress = [vm_progress(vm, gen.generation) for vm in gen_vms]
        all_done = all(p[0] for p in progress)
        failed = [vm for vm, p in zip(gen_vms, progress) if p[1]]
        all_clean = all(p[2] for p in progress)
        if gen.state == "running":
            self._supervise_running(job, gen, gen_vms, vms, failed, all_done and all_clean, now)
        elif gen.state == "stopping":
            cfg = self.ctx.config
            if all_done:
                self.end_generation(job, gen, now, graceful=all_clean, reason=gen.stop_reason)
                if all_clean:
                    self._finish_if_target_reached(job, gen)
            elif failed:
                what = ", ".join(vm.vm_id for vm in failed)
                self.ctx.begin_kill(job, gen, f"failure during the graceful stop on {what}", now)
            elif now - (gen.stop_time or now) > cfg.stop_timeout_s:
                self.ctx.begin_kill(job, gen, f"graceful stop took more than {cfg.stop_timeout_s:g} s", now)
        elif all_done or now - (gen.stop_time or now) > self.ctx.config.kill_timeout_s:  # killing
            self.end_generation(job, gen, now, graceful=False, reason=gen.stop_reason)

    def _supervise_running(
        self,
        job: JobRecord,
        gen: GenerationRecord,
        gen_vms: list[VMRecord],
        vms: list[VMRecord],
        failed: list[VMRecord],
        all_clean_exit: bool,
        now: float,
    ) -> None:
        causes: list[str] = []
        if failed:
            causes = [_failure(vm, gen.generation) for vm in failed if not _symptom_only(vm, gen.generation)]
            # Note [Blame]: only symptoms. A VM this generation already lost (a live morph went on
            # without it) is their cause; else the cause may yet show.
            causes = causes or self._lost_by(job, gen)
            if not causes and self._await_cause(job, gen, gen_vms, now):
                return
        if failed and self.ctx.live_morph_job(job) and self.ctx.live.on_failure(job, gen, failed, now):
            return  # the survivors go on in their processes (manager/domain/live_runs.py)
        if failed:
            what = ", ".join(causes or [_failure(vm, gen.generation) for vm in failed])
            self.ctx.cache(job).suspects_since.pop(gen.generation, None)
            self.ctx.note_detection(job, f"generation {gen.generation} failed: {what}", now)
            self.ctx.begin_kill(job, gen, f"failure on {what}", now)
            return
        if all_clean_exit:
            self._workers_exited_cleanly(job, gen, gen_vms, now)
            return
        trigger = self._graceful_trigger(job, gen, gen_vms, vms, now)
        if trigger is not None:
            if not trigger.startswith("cancel"):
                self.ctx.note_detection(job, trigger, now)
            self.ctx.begin_stop(job, gen, trigger, now)

    def _lost_by(self, job: JobRecord, gen: GenerationRecord) -> list[str]:
        """The VMs ``gen`` lost while it ran (its ``vm-gone`` events), named as causes."""
        out = []
        for e in self.ctx.store.events(job.job_id, kinds=["vm-gone"]):
            if e.generation == gen.generation:
                data = e.data
                label = vm_label(e.vm_id, [int(r) for r in data.get("ranks", [])])
                out.append(f"{label} gone" + (f" ({data['reason']})" if data.get("reason") else ""))
        return out

    def _await_cause(
        self, job: JobRecord, gen: GenerationRecord, gen_vms: list[VMRecord], now: float
    ) -> bool:
        """Note [Blame]: whether to wait before blaming workers that exited as symptoms: for
        :data:`BLAME_WINDOW_S` after the first, and while a VM of the generation has been quiet
        for over two heartbeat intervals (it may yet be declared gone), at most the heartbeat
        timeout plus the window."""
        cfg = self.ctx.config
        since = self.ctx.cache(job).suspects_since.setdefault(gen.generation, now)
        waited = now - since
        if waited < BLAME_WINDOW_S:
            return True
        quiet_after = max(2 * cfg.heartbeat_interval_s, BLAME_WINDOW_S)
        quiet = [vm for vm in gen_vms if vm.state == "up" and self.ctx.age(vm, now) > quiet_after]
        return bool(quiet) and waited < cfg.heartbeat_timeout_s + BLAME_WINDOW_S

    def _workers_exited_cleanly(
        self, job: JobRecord, gen: GenerationRecord, gen_vms: list[VMRecord], now: float
    ) -> None:
        """Every worker of a running generation exited 0: a stop we did not order, or the end."""
        noticed = [vm for vm in gen_vms if vm.notice]
        if noticed or job.cancel_requested:
            # The agents stopped the workers themselves (eviction notice): a clean stop.
            why = "eviction notice on " + ", ".join(vm.vm_id for vm in noticed) if noticed else "cancel"
            self.ctx.note_detection(job, why, now)
            self.end_generation(job, gen, now, graceful=True, reason=why)
            return
        spec = self.ctx.cache(job).spec
        progressed = gen.last_step > (gen.resumed_from or 0)
        # What every worker reached, not the highest step anyone claimed (Note [Trusted progress]
        # in manager/domain/worker_reports.py); a generation that trained nothing stopped where
        # the job already was.
        last = self._stopped_at(job, gen) if progressed else max(gen.last_step, job.step)
        if last < spec.target_steps and progressed:
            # Every worker stopped cleanly short of the target (a graceful stop this manager did
            # not ask for, e.g. one asked by a manager process that has since been restarted):
            # relaunch and resume. A generation that makes no progress at all ends the job below
            # instead, so a script whose own --steps is lower than the target cannot make the
            # manager loop.
            why = f"workers stopped cleanly at step {last}, before target step {spec.target_steps}"
            self.ctx.note_detection(job, why, now)
            self.end_generation(job, gen, now, graceful=True, reason=why)
            return
        self.end_generation(job, gen, now, graceful=True, reason="completed")
        msg = f"reached step {last}" + (
            ""
            if last >= spec.target_steps
            else f" (before target step {spec.target_steps}: the script stopped)"
        )
        self.ctx.finish_job(job, "finished", msg)

    def _finish_if_target_reached(self, job: JobRecord, gen: GenerationRecord) -> None:
        """A graceful stop whose workers had already reached the target step: the job is done.
        Relaunching would start a generation with nothing left to train (it would only load the
        checkpoint and exit), so this branch checks the target as the running branch does."""
        fresh = self.ctx.store.job(job.job_id) or job
        gen = self.ctx.store.generation(job.job_id, gen.generation) or gen
        spec = self.ctx.cache(fresh).spec
        last = self._stopped_at(fresh, gen)
        if fresh.terminal or fresh.cancel_requested or last < spec.target_steps:
            return
        self.ctx.finish_job(
            fresh, "finished", f"reached step {last} (generation {gen.generation} stopped at the target)"
        )

    def _stopped_at(self, job: JobRecord, gen: GenerationRecord) -> int:
        """:func:`stopped_at` of ``gen`` from its workers' rows (the deferred ones included)."""
        return stopped_at(gen, self.ctx.store.peek_worker_stats(job.job_id, gen.generation))

    def _graceful_trigger(
        self, job: JobRecord, gen: GenerationRecord, gen_vms: list[VMRecord], vms: list[VMRecord], now: float
    ) -> str | None:
        if job.cancel_requested:
            return "cancel requested"
        live = self.ctx.live_morph_job(job)
        noticed = [vm for vm in gen_vms if vm.notice]
        if noticed and not (live and self.ctx.live.on_notice(job, gen, noticed, now)):
            return f"eviction notice on {', '.join(vm.vm_id for vm in noticed)}"
        slow = [vm.vm_id for vm in gen_vms if vm.slow]
        if slow:
            return f"fail-stutter slow VM {', '.join(slow)}"
        if self.ctx.pool_job(job):  # the pool's rounds decide its VMs, not the grow rule
            return self.ctx.pool.trigger(job, gen, vms, now)
        grow = self.planner.grow_trigger(job, gen, vms, now)
        if grow is not None and live:
            extra = [vm for vm in vms if vm.vm_id not in gen.vm_set and self.ctx.usable(vm, now, since=0.0)]
            if self.ctx.live.on_grow(job, gen, extra, now):
                return None  # the new VMs' workers join the running generation
        return grow

    # -- ending a generation (begun by ManagerContext.begin_stop / begin_kill) ------------------

    def end_generation(
        self, job: JobRecord, gen: GenerationRecord, now: float, *, graceful: bool, reason: str
    ) -> None:
        """Record that no worker of ``gen`` runs any more; the job is then re-planned (or fails
        after too many generations in a row ended before their first step)."""
        ctx = self.ctx
        gen = ctx.store.generation(job.job_id, gen.generation) or gen
        ctx.store.update_generation(
            job.job_id, gen.generation, state="ended", ended=now, graceful=int(graceful)
        )
        ctx.detector.forget(lambda k: k[0] == job.job_id and k[1] == gen.generation)
        ctx.live.close(job.job_id, gen.generation)
        cache = ctx.cache(job)
        cache.compute.pop(gen.generation, None)
        cache.launches.pop(gen.generation, None)
        cache.suspects_since.pop(gen.generation, None)
        ctx.event(
            job.job_id,
            "generation-ended",
            f"generation {gen.generation} ended {'cleanly' if graceful else 'by kill'} at step "
            f"{gen.last_step}: {reason}",
            generation=gen.generation,
            data={
                "graceful": graceful,
                "last_step": gen.last_step,
                "reason": reason,
                "duration_s": round(now - gen.launched, 3),
            },
        )
        if gen.first_step_time is None and reason != "completed":
            failures = job.failed_launches + 1
            ctx.store.update_job(job.job_id, failed_launches=failures, state="pending")
            if failures >= ctx.config.max_failed_launches:
                ctx.finish_job(
                    job,
                    "failed",
                    f"{failures} generations in a row ended before their first step; see the worker logs",
                )
        else:
            ctx.store.update_job(job.job_id, state="pending")

    # -- launching -----------------------------------------------------------------------------

    def maybe_launch(self, job: JobRecord, vms: list[VMRecord], now: float) -> None:
        """With no live generation: calibrate if needed, wait for VMs, then launch the next one."""
        ctx = self.ctx
        if not self.calibration.ready(job, vms, now):
            return
        job = ctx.store.job(job.job_id) or job
        last = ctx.store.generation(job.job_id, job.generation) if job.generation else None
        usable = self._usable_vms(job, vms, last, now)
        if usable is None:
            return
        try:
            placement = self.planner.place(job, usable)
        except ValueError as exc:
            ctx.set_message(job, f"no configuration fits {len(usable)} VM(s): {exc}")
            return
        self._launch(job, placement, last, len(usable), now)

    def _usable_vms(
        self, job: JobRecord, vms: list[VMRecord], last: GenerationRecord | None, now: float
    ) -> list[VMRecord] | None:
        """The VMs to plan the next generation on, or None (with a status message) to wait."""
        ctx, spec = self.ctx, self.ctx.cache(job).spec
        # Proof of life must postdate the moment the last generation was told to stop (or ended).
        since = (last.stop_time or last.ended or 0.0) if last is not None else 0.0
        candidates = [vm for vm in vms if vm.state == "up" and not vm.slow and not vm.notice]
        max_vms, min_vms = spec.max_vms, spec.min_vms
        if ctx.pool_job(job):  # only the VMs of its placement (Note [Pool VMs] in pool_rounds.py)
            candidates = ctx.pool.usable(job, candidates)
            target = ctx.pool.target(job)
            if target is None:
                ctx.set_message(job, "waiting for the pool: no VMs this round")
                return None
            # All of its placement before a relaunch (one morph, not one per VM as they boot),
            # unless they do not come within the gather timeout.
            max_vms = target[1]
            patient = now - (since or job.created) < ctx.config.gather_timeout_s
            min_vms = target[1] if patient else min(spec.min_vms, target[1])
        usable = [vm for vm in candidates if ctx.usable(vm, now, since)]
        usable_ids = {vm.vm_id for vm in usable}  # by id: a list test is quadratic in the VMs
        unconfirmed = [vm for vm in candidates if vm.vm_id not in usable_ids]
        if last is not None and unconfirmed and now - since <= ctx.config.heartbeat_timeout_s:
            # After a failure, relaunch only once every VM proved alive since (heartbeat after the
            # generation ended, its old workers gone) or was declared gone: a VM that died with
            # the generation would otherwise be planned in and fail the next one too. After T,
            # go on without the ones that did not (a silent one is declared gone by then anyway;
            # one whose old workers will not die is left out).
            ctx.set_message(job, f"waiting for {len(unconfirmed)} VM(s) to confirm they are alive")
            return None
        if last is None:
            pending = [vm for vm in vms if vm.state == "requested"]
            if (
                len(usable) < max_vms
                and (pending or unconfirmed)
                and now - job.created < ctx.config.gather_timeout_s
            ):
                ctx.set_message(job, f"gathering VMs: {len(usable)} of {max_vms} ready")
                return None
        if len(usable) < min_vms:
            ctx.set_message(job, f"waiting for VMs: {len(usable)} usable, min_vms is {min_vms}")
            return None
        return usable

    def _launch(
        self,
        job: JobRecord,
        placement: Placement,
        last: GenerationRecord | None,
        usable: int,
        now: float,
    ) -> None:
        """Store the next generation (agents start its workers from their next orders)."""
        ctx, spec = self.ctx, self.ctx.cache(job).spec
        plan, chosen = placement.plan, placement.vms
        master = chosen[0]
        generation = job.generation + 1
        gen = GenerationRecord(
            job_id=job.job_id,
            generation=generation,
            state="running",
            pipeline_depth=plan.pipeline_depth,
            data_parallel=plan.data_parallel,
            micro_batch_size=plan.micro_batch_size or spec.micro_batch_size,
            vms_json=json.dumps([vm.vm_id for vm in chosen]),
            master_addr=master.address or "127.0.0.1",
            master_port=master.free_port,
            launched=now,
            predicted_samples_per_s=plan.predicted_samples_per_s,
            mixed_json=json.dumps(placement.mixed) if placement.mixed else "",
        )
        if ctx.live_morph_job(job):
            ctx.live.open_store(job, generation)  # before its launches name it
            slots = {vm.vm_id: vm.slots for vm in chosen}
            gen = dataclasses.replace(gen, live_json=LiveMembers.at_launch(
                list(slots), slots, plan.pipeline_depth * plan.data_parallel).to_json())
        ctx.store.add_generation(gen)
        ctx.store.update_job(job.job_id, message="")
        why = job.detection_reason or "initial launch"
        data: dict[str, Any] = {
            "P": plan.pipeline_depth,
            "D": plan.data_parallel,
            "m": gen.micro_batch_size,
            "vms": [vm.vm_id for vm in chosen],
            "usable": usable,
            "source": plan.source,
            "predicted_samples_per_s": plan.predicted_samples_per_s,
            "calibration": self.calibration.text(job, now),
            "reason": why,
        }
        if placement.mixed:
            data["mixed"] = placement.mixed
        change = ""
        if last is not None:
            data["previous"] = {
                "generation": last.generation,
                "P": last.pipeline_depth,
                "D": last.data_parallel,
                "vms": len(last.vm_ids),
            }
            change = f"P={last.pipeline_depth} × D={last.data_parallel} → "
        ctx.event(
            job.job_id,
            "launched",
            f"generation {generation}: {change}P={plan.pipeline_depth} × D={plan.data_parallel} on "
            f"{len(chosen)} VM(s) {', '.join(vm.vm_id for vm in chosen)} [{plan.source}]; {why}",
            generation=generation,
            data=data,
        )
