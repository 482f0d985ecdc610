"""What each VM of a generation runs: its workers' command lines and environments, with the run
plan the manager made for them (Note [Run plan] in varuna/core/env.py).

Every worker runs ``python -m manager.worker.shim SCRIPT ARGS`` (the shim reports to the manager
and applies the checkpoint interval). Its environment is the launcher's env contract for its rank
(``varuna.launch.spec.plan_workers``), the job's ``env``, where checkpoints go and that it resumes,
and the run plan: the global batch, the schedule (``JobSpec.schedule``: the manager never reads
the script's arguments), the chunks and, when the manager chose them, m, the stage ranges and
the mixed types' shares and speeds. This part is the :class:`~manager.domain.ports.Launches` of
the VM book; a live-morph job's launches name its generation's store (the context's ``live``).

    >>> _PlannedHost(address="10.0.0.4", slots=2).slots
    2
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from manager.domain.context import ManagerContext
from manager.domain.live_members import LiveMembers
from manager.domain.messages import WorkerLaunch
from manager.domain.records import GenerationRecord, JobRecord
from varuna.core.env import RunPlan
from varuna.launch.live_store import LIVE_JOIN_ENV, LIVE_NOTICE_ENV, LIVE_STORE_ENV

__all__ = ["MANAGER_NOTICE_SIGNAL", "WORKER_SHIM", "WorkerLaunches"]

#: ``python -m`` module every worker runs its script through (manager/worker/shim.py).
WORKER_SHIM = "manager.worker.shim"


class WorkerLaunches:
    """A generation's workers per VM and the run plan they get. Callers hold ``ctx.lock``.

    Example::

        launches = WorkerLaunches(ctx)
        launches.launches(job, generation)   # vm_id -> [WorkerLaunch], the same after a restart
        launches.run_plan(job, generation)   # what VARUNA_SCHEDULE, VARUNA_GLOBAL_BATCH_SIZE... say
    """

    def __init__(self, ctx: ManagerContext) -> None:
        self.ctx = ctx

    def run_plan(self, job: JobRecord, gen: GenerationRecord) -> RunPlan:
        """What the manager planned ``gen`` for, as the workers' ``VARUNA_*`` run plan: the job's
        global batch, schedule and chunks, m when auto-config chose it (the spec did not fix it), and with
        mixed VM types each replica's share and each stage's speed."""
        spec = self.ctx.cache(job).spec
        planned_m = gen.micro_batch_size if gen.micro_batch_size and not spec.micro_batch_size else None
        mixed = json.loads(gen.mixed_json) if gen.mixed_json else {}
        shares, speeds = mixed.get("replica_shares"), mixed.get("stage_speeds")
        ranges = mixed.get("stage_ranges")
        return RunPlan(
            global_batch_size=spec.global_batch_size,
            micro_batch_size=planned_m,
            schedule=spec.schedule,
            chunks=spec.chunks or None,
            stage_ranges=tuple(tuple(r) for r in ranges) if ranges else None,
            replica_shares=tuple(shares) if shares else None,
            stage_speeds=tuple(speeds) if speeds else None,
        )

    def launches(self, job: JobRecord, gen: GenerationRecord) -> dict[str, list[WorkerLaunch]]:
        """This generation's workers per VM (deterministic from the stored generation, so a
        restarted manager hands out the same ones)."""
        from varuna.launch.spec import LaunchConfig, plan_workers

        cache = self.ctx.cache(job)
        if gen.generation in cache.launches:
            return cache.launches[gen.generation]
        spec = cache.spec
        vms = [self.ctx.store.vm(v) for v in gen.vm_ids]
        hosts = [
            _PlannedHost(address=vm.address or "127.0.0.1", slots=vm.slots) for vm in vms if vm is not None
        ]
        env = dict(spec.env)
        env.update(
            {
                "VARUNA_CHECKPOINT_DIR": spec.checkpoint_dir,
                "VARUNA_RESUME": "auto",
                "VARUNA_JOB_ID": job.job_id,
                "VARUNA_GENERATION": str(gen.generation),
                # The job's creation: its generations outrank any earlier run's on the same
                # checkpoint store (Note [Checkpoint fence] in varuna/runtime/checkpoint_fence.py).
                "VARUNA_FENCE_EPOCH": str(int(job.created * 1000)),
            }
        )
        if spec.checkpoint_every:
            env["VARUNA_CHECKPOINT_EVERY"] = str(spec.checkpoint_every)
        live_env = self.ctx.live.worker_env(job, gen.generation) if self.ctx.live_morph_job(job) else {}
        address = live_env.get(LIVE_STORE_ENV)
        if address is not None:
            env.update(live_env)  # docs/live_morph.md, API for the launcher: address and secret
            env[LIVE_NOTICE_ENV] = MANAGER_NOTICE_SIGNAL
        env.update(self.run_plan(job, gen).to_env())
        config = LaunchConfig(
            script=spec.script,
            script_args=tuple(spec.args),
            module=spec.module,
            pipeline_depth=gen.pipeline_depth,
            data_parallel=gen.data_parallel,
            master_addr=gen.master_addr,
            master_port=gen.master_port,
            worker_env=env,
            rank_hosts=json.loads(gen.mixed_json)["rank_hosts"] if gen.mixed_json else None,
        )
        # No lifecycle lines (lifecycle_lines=False): nothing on this path reads them, so a rank
        # exiting 0 before its Engine still waits out the others' timeouts (docs/launch.md).
        specs = plan_workers(
            config, hosts, master_port=gen.master_port, launcher_environ={}, cwd=spec.workdir
        )
        argv = ("-m", WORKER_SHIM, *(["-m"] if spec.module else []), spec.script, *spec.args)
        out: dict[str, list[WorkerLaunch]] = {}
        for s in specs:
            vm_id = gen.vm_ids[s.env.host_id]
            out.setdefault(vm_id, []).append(
                WorkerLaunch(rank=s.env.rank, argv=argv, env=dict(s.set_vars), cwd=s.cwd or "")
            )
        if gen.live_json:
            _as_joiners(out, LiveMembers.from_json(gen.live_json).joiners, live_store=address is not None)
        cache.launches[gen.generation] = out
        return out


#: The notice signal of a live-morph job's workers (``$VARUNA_LIVE_NOTICE_SIGNAL``): SIGUSR1 is the
#: manager's graceful stop of the whole job (STOP orders), so a per-worker hand-over needs another.
MANAGER_NOTICE_SIGNAL = "SIGUSR2"


def _as_joiners(
    out: dict[str, list[WorkerLaunch]], joiners: dict[str, list[int]], *, live_store: bool
) -> None:
    """The launches of VMs added to a running live-morph generation: one joiner per member id,
    with it as ``RANK`` and ``VARUNA_LIVE_JOIN=1`` (docs/live_morph.md, API for the launcher), the
    rest of the environment as every worker's. Without the generation's store (a restarted
    manager: it died with the old process) they could not join, so they get no workers; the
    generation falls back when its workers fail."""
    template = next(launch for launches in out.values() for launch in launches)
    for vm_id, ids in joiners.items():
        out[vm_id] = []
        for local, member in enumerate(ids if live_store else ()):
            env = {**template.env, "RANK": str(member), "LOCAL_RANK": str(local), LIVE_JOIN_ENV: "1"}
            out[vm_id].append(WorkerLaunch(rank=member, argv=template.argv, env=env, cwd=template.cwd))


@dataclass(frozen=True)
class _PlannedHost:
    """Just enough of a ``varuna.launch.spec.Host`` for ``plan_workers`` (address and slots)."""

    address: str
    slots: int
