"""``varuna-launch``: start and supervise the P×D worker processes of a job, on this machine
(``--procs N``), on several hosts through one agent per host (``--hosts``), or on the nodes of the
Slurm allocation it runs in (``--slurm``: agents started with srun).

Each worker runs ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) with the environment
contract of :mod:`varuna.core.env` (torchrun-compatible ``RANK``/``WORLD_SIZE``/... plus the pipeline
layout and the run plan). The launcher prefixes every output line with ``[rank r stage k replica
d]`` (preceded by the host with ``--hosts``), stops the whole job when one worker fails, forwards
SIGINT/SIGTERM/SIGUSR1 (Note [Stop protocol] in :mod:`varuna.launch.supervisor`), and leaves no
process behind on any exit path (Note [No orphans] in :mod:`varuna.launch.procs`).

Command line::

    varuna-launch --procs 4 --pipeline-depth 2 train.py --lr 3e-4
    varuna-launch --hosts hosts.txt --procs-per-host 4 --pipeline-depth 4 --checkpoint-dir /ckpt train.py
    varuna-launch --procs 8 --calibration cal.json --global-batch-size 256 --schedule 1f1b train.py
    varuna-launch --slurm --pipeline-depth 2 --checkpoint-dir /shared/ckpt train.py   # in sbatch

This module is the command line only; the pieces it drives: :func:`varuna.launch.layout.resolve_layout`
picks P×D (auto-config from a calibration when P is not given) and the run plan every worker
gets; :func:`varuna.launch.job.launch` runs the job here, and with ``--hosts``
:func:`varuna.launch.recovery.run_with_restarts` runs it through per-host agents after the host entries
are validated (:mod:`varuna.launch.hosts`) and the ssh hosts probed (:mod:`varuna.launch.ssh`); with
``--slurm`` the same, on the allocation's nodes (:mod:`varuna.launch.slurm`) with srun agents
(:mod:`varuna.launch.srun`).

Exit codes: 0 all workers exited 0; 1 a worker failed or the job could not start; 2 bad usage;
128+N the launcher was stopped by signal N (details in :mod:`varuna.launch.supervisor`).

Note [Slurm stop]: in an allocation Slurm stops a job by signalling its processes: ``scancel
--signal=USR1 JOB`` and ``sbatch --signal=USR1@T`` (T seconds before the time limit) signal every
step (``B:USR1@T`` the batch shell, which is the launcher when the script ``exec``-s it), a
preemption or ``scancel`` sends SIGTERM to all of them and SIGKILL after the grace period. With
``--slurm`` every one of these paths ends in the same graceful stop: the launcher's own signal and
each srun agent's report (Note [Agents as job steps] in :mod:`varuna.launch.srun`) go to the
supervisor, which forwards the first SIGUSR1 or SIGTERM to every worker without a deadline of its
own and ignores the copies (Note [Stop protocol]); every worker finishes its mini-batch, writes its
part of the checkpoint and exits 0. Then, unless ``--no-requeue``, the launcher asks Slurm to
requeue the job (``scontrol requeue``, as Lightning's SLURMEnvironment and submitit do): the batch
script runs again on whatever nodes the job gets and ``--checkpoint-dir`` (``VARUNA_RESUME=auto``)
resumes from the newest complete checkpoint at the P×D those nodes hold. A job already ending
(``scancel``, a preemption Slurm requeues itself, ``--no-requeue`` in the script) is not requeued;
the launcher says why in one line. A SIGTERM to the batch step also reaches the srun clients there,
and srun kills its step at once on SIGTERM: only the signals that reach the steps alone (``--signal``
without ``B:``, ``scancel --signal``, ``PreemptParameters=send_user_signal``) give the workers time
to checkpoint (docs/slurm.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import signal
import sys
import time

from varuna.core.batching import microbatch_counts
from varuna.core.cli import OneLineParser, add_planning_args, positive_int
from varuna.core.planning import PlanRequest
from varuna.core.schedule import DEFAULT_SCHEDULE, SCHEDULE_KINDS, chunks_problem, schedule_kind
from varuna.launch.events import EventLog
from varuna.launch.hosts import HostEntry, assign_slots, check_types, parse_hosts_arg, select_hosts
from varuna.launch.job import check_hosts_capacity, check_local_script, launch
from varuna.launch.layout import LAYOUT_REQUIRED, Layout, resolve_layout
from varuna.launch.mixed import parse_type_speeds, place_ranks, plan_cluster
from varuna.launch.procs import is_loopback
from varuna.launch.protocol import SILENCE_TIMEOUT_S
from varuna.launch.recovery import CannotPlace, Placement, run_with_restarts
from varuna.launch.slurm import allocation_from_env
from varuna.launch.spec import (
    MAX_PROCS_PER_HOST_CEILING,
    LaunchConfig,
    check_procs_per_host,
    resolve_data_parallel,
)
from varuna.launch.srun import SrunOptions, requeue
from varuna.launch.ssh import SshOptions, probe_hosts
from varuna.launch.supervisor import EXIT_USAGE, EXIT_WORKER_FAILED, PROG

__all__ = ["main"]

_MANAGER_RE = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")
_JOB_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


# ----------------------------------------------------------------------------------------------
# The parser
# ----------------------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="Start P×D pipeline/data-parallel workers on this machine (--procs), on several hosts"
        " through per-host agents (--hosts) or on the nodes of this Slurm allocation (--slurm), and"
        " supervise them.",
        epilog="Workers get MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and "
        "VARUNA_* variables (rank = replica * P + stage); see docs/launch.md. Exit codes: 0 ok, "
        "1 a worker failed or the job could not start, 2 bad usage, 128+N stopped by signal N.",
    )
    _add_placement_args(parser)
    _add_layout_args(parser)
    _add_job_args(parser)
    _add_cut_args(parser)
    _add_ssh_args(parser)
    parser.add_argument(
        "-m", "--module", action="store_true", help="SCRIPT is a module: run python -m SCRIPT"
    )
    parser.add_argument(
        # nargs="?" and a check in main(): a REMAINDER after a required positional makes argparse
        # report "required: SCRIPT, ARGS" although ARGS may be empty.
        "script",
        nargs="?",
        metavar="SCRIPT",
        help="Python script (or module with -m) every worker runs",
    )
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for SCRIPT")
    return parser


def _add_placement_args(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("where the workers run (one of)")
    where.add_argument(
        "--procs", type=positive_int, default=None, metavar="N", help="N workers on this machine"
    )
    where.add_argument(
        "--hosts",
        default=None,
        metavar="FILE|H1,H2,...",
        help="host file or comma-separated list of [user@]host[:port] [slots=N] [type=NAME]; a plain"
        " 'localhost' is a pretend host on this machine (no ssh)",
    )
    where.add_argument(
        "--slurm",
        action="store_true",
        help="run on the nodes of the Slurm allocation this runs in (sbatch/salloc): slots from its tasks"
        " (or GPUs) per node, agents started with srun; Slurm's SIGUSR1/SIGTERM stop the job with a"
        " checkpoint and requeue it (docs/slurm.md)",
    )
    where.add_argument(
        "--no-requeue",
        action="store_true",
        help="with --slurm: do not requeue the job after Slurm's signal stopped it",
    )
    where.add_argument(
        "--type-speeds",
        default=None,
        metavar="T1=S1,...",
        help="relative speed of each VM type named by the hosts' type= (e.g. fast=1.6,slow=1): ranks are"
        " placed by type and each replica's share and stage's speed go to the workers (docs/launch.md)",
    )
    where.add_argument(
        "--procs-per-host", type=int, default=None, metavar="K",
        help="slots of hosts without slots=N (with --slurm: of every node, instead of its tasks)",
    )
    where.add_argument(
        "--max-procs-per-host",
        type=int,
        default=None,
        metavar="K",
        help="refuse to start more than K workers on one host (default: 4 × this machine's CPU cores,"
        f" at least 8; at most {MAX_PROCS_PER_HOST_CEILING})",
    )


def _add_layout_args(parser: argparse.ArgumentParser) -> None:
    layout = parser.add_argument_group("layout (P×D given, or chosen by the simulator's auto-config)")
    # P and D are checked here, where the user gives them (positive_int), and nowhere after.
    layout.add_argument(
        "--pipeline-depth", type=positive_int, default=None, metavar="P", help="pipeline stages"
    )
    layout.add_argument(
        "--data-parallel",
        type=positive_int,
        default=None,
        metavar="D",
        help="replicas per stage (default: N // P, or as many as the hosts' slots hold)",
    )
    # The options auto-config shares with varuna-simulate; the planned ones reach every worker in
    # its run plan, where a script that leaves them unset gets them (Note [Run plan]).
    add_planning_args(
        parser, title="the job's plan (auto-config with --calibration; every worker gets it)",
        schedules=SCHEDULE_KINDS,
    )


def _add_job_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--master-addr",
        default=None,
        metavar="ADDR",
        help="rendezvous address (default: the first host's address)",
    )
    parser.add_argument(
        "--master-port", type=int, default=None, metavar="PORT", help="rendezvous port (default: a free one)"
    )
    parser.add_argument(
        "--log-dir", default=None, metavar="DIR", help="write launch.json and per-rank rank{r}.log here"
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping workers (default 10)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="checkpoint directory (VARUNA_CHECKPOINT_DIR for every worker): SIGUSR1/SIGTERM save there,"
        " a relaunch resumes from it",
    )
    parser.add_argument(
        "--resume",
        default=None,
        choices=("auto", "1", "0"),
        help="VARUNA_RESUME for every worker: auto resumes from the newest complete checkpoint if there"
        " is one (the default with --checkpoint-dir, so the same command resumes), 1 requires one, 0 starts"
        " afresh",
    )
    parser.add_argument(
        "--live-morph",
        action="store_true",
        help="a lost worker does not stop the job: the survivors regroup in their processes and go on"
        " (docs/live_morph.md; the script must use varuna.runtime.live_morph); when a stage lost every"
        " replica, the job restarts from its newest checkpoint. Needs --checkpoint-dir",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="N",
        help="relaunch after a failed worker or a lost host (on the hosts still reachable, P×D planned"
        " again), resuming from the newest checkpoint, at most N times (default 0; 3 with --live-morph,"
        " where only a stage that lost every replica restarts). Needs --checkpoint-dir",
    )
    parser.add_argument(
        "--tensorboard-dir",
        default=None,
        metavar="DIR",
        help="rank 0 also writes the per-step metrics as TensorBoard events there"
        " (VARUNA_TENSORBOARD_DIR for every worker; needs pip install 'varuna[tensorboard]')",
    )
    parser.add_argument(
        "--manager", default=None, metavar="HOST:PORT", help="manager daemon address (VARUNA_MANAGER)"
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bars on a terminal (also: VARUNA_QUIET=1)"
    )


def _add_cut_args(parser: argparse.ArgumentParser) -> None:
    cuts = parser.add_argument_group("where the model is cut (for a model without CutPoints of its own)")
    cuts.add_argument(
        "--cut-after",
        default=None,
        metavar="PATTERNS",
        help="cut after each module these comma-separated names/patterns select, e.g. 'model.layers.*'"
        " ('*' matches one level of a dotted name; VARUNA_CUT_AFTER, VarunaConfig.cut_after)",
    )
    cuts.add_argument(
        "--auto-cutpoints",
        type=int,
        default=None,
        metavar="N",
        help="let the engine place up to N cut-points from a dry run (VARUNA_AUTO_CUTPOINTS)",
    )
    cuts.add_argument(
        "--plan-cost",
        default=None,
        choices=("flop", "time"),
        help="what automatic cut-points and the stage split balance: FLOPs (default; the same plan every"
        " run) or measured time (VARUNA_PLAN_COST)",
    )


def _add_ssh_args(parser: argparse.ArgumentParser) -> None:
    remote = parser.add_argument_group("ssh hosts")
    remote.add_argument(
        "--ssh-key",
        default=None,
        metavar="FILE",
        help="private key (default $VARUNA_SSH_KEY, else ssh's own)",
    )
    remote.add_argument(
        "--ssh-known-hosts",
        default=None,
        metavar="FILE",
        help="known_hosts file to use (default $VARUNA_SSH_KNOWN_HOSTS, else ~/.ssh/known_hosts)",
    )
    remote.add_argument(
        "--ssh-connect-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="ssh ConnectTimeout and reachability probe bound (default 10)",
    )
    remote.add_argument(
        "--job-id", default=None, metavar="ID", help="names the agents' command lines (default: random)"
    )
    remote.add_argument(
        "--host-timeout",
        type=float,
        default=SILENCE_TIMEOUT_S,
        metavar="S",
        help="a host whose agent says nothing for S seconds (a partition, a dead VM) is declared silent"
        " and its ranks lost; its agent stops its workers after the same silence"
        f" (default {SILENCE_TIMEOUT_S:g})",
    )


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``varuna-launch``; returns the exit code.

    Example::

        >>> main(["--procs", "6", "--pipeline-depth", "4", "train.py"])  # doctest: +SKIP
        varuna-launch: error: --procs 6 is not --pipeline-depth 4 × --data-parallel D for any D; ...
        2
    """
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, message already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    problem = _usage_problem(args)
    if problem is not None:
        return _usage_error(problem)
    try:
        # Validate every option before anything runs (one worker of one stage stands in for P×D).
        config = LaunchConfig(
            script=args.script,
            script_args=tuple(args.script_args),
            module=args.module,
            pipeline_depth=1,
            data_parallel=1,
            master_addr=args.master_addr,
            master_port=args.master_port,
            log_dir=args.log_dir,
            stop_timeout_s=args.stop_timeout,
            worker_env=_worker_env_from_args(args),
            max_procs_per_host=args.max_procs_per_host,
            live_morph=args.live_morph,
            max_restarts=args.max_restarts,
        )
        if args.procs is not None:
            # Before auto-config too: planning for 100000 slots would take as long as forking them.
            check_procs_per_host(args.procs, "this machine", args.max_procs_per_host)
            layout = _local_layout(args)
            check_local_script(config)
            return launch(_with_layout(config, layout, args), progress=_progress(args))
        if args.slurm:
            return _main_slurm(args, config)
        return _main_hosts(args, config)
    except ValueError as exc:
        return _usage_error(str(exc))


def _usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the combination of options, or None."""
    given = [o for o, v in (("--procs", args.procs), ("--hosts", args.hosts), ("--slurm", args.slurm or None))
             if v is not None]
    if len(given) > 1:
        return (f"give one of --procs N (this machine), --hosts (several hosts) or --slurm (this allocation),"
                f" not both {given[0]} and {given[1]}")
    if not given:
        job = os.environ.get("SLURM_JOB_ID")
        inside = f" (this shell is in Slurm job {job}: --slurm)" if job else ""
        return f"argument required: --procs N (this machine), --hosts FILE|H1,H2,... or --slurm{inside}"
    if args.procs_per_host is not None and args.hosts is None and not args.slurm:
        return "--procs-per-host needs --hosts or --slurm"
    if args.no_requeue and not args.slurm:
        return "--no-requeue needs --slurm"
    if args.type_speeds is not None and args.hosts is None:
        return "--type-speeds needs --hosts whose lines say type=NAME"
    if args.pipeline_depth is None and args.calibration is None:
        return LAYOUT_REQUIRED
    if args.script is None:
        return "no SCRIPT given; pass the training script (or -m MODULE) to run"
    problem = _chunks_problem(args)
    if problem is not None:
        return problem
    kind = schedule_kind(args.schedule or DEFAULT_SCHEDULE)
    if args.recompute_segments is not None and kind.splits_backward:
        return (f"--recompute-segments is not supported with --schedule {args.schedule} (its split backward "
                "needs one graph per stage); drop one of them")
    if args.max_restarts and args.checkpoint_dir is None:
        return (f"--max-restarts {args.max_restarts} needs --checkpoint-dir DIR: a restart resumes from the"
                " newest checkpoint there")
    if args.live_morph and args.checkpoint_dir is None:
        return ("--live-morph needs --checkpoint-dir DIR: when a stage loses every replica the job restarts"
                " from its newest checkpoint there")
    return None


def _chunks_problem(args: argparse.Namespace, pipeline_depth: int | None = None) -> str | None:
    """``--chunks`` against ``--schedule``, the pipeline depth (given, or chosen by auto-config)
    and ``--auto-cutpoints`` (the most cut-points the model will have), or None."""
    if args.chunks is None and not schedule_kind(args.schedule or DEFAULT_SCHEDULE).chunked:
        return None
    if args.live_morph and (args.chunks or 1) > 1:
        return (f"--live-morph does not carry interleaved stages (--chunks {args.chunks}) yet; drop "
                "--live-morph (a lost worker then restarts the job from its checkpoint) or --chunks")
    return chunks_problem(
        args.schedule or DEFAULT_SCHEDULE,
        args.chunks if args.chunks is not None else 1,
        pipeline_depth=pipeline_depth if pipeline_depth is not None else args.pipeline_depth,
        max_cutpoints=args.auto_cutpoints,
    )


def _usage_error(text: str) -> int:
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return EXIT_USAGE


def _worker_env_from_args(args: argparse.Namespace) -> dict[str, str]:
    # This launcher's start: every generation it launches outranks those of the runs before it
    # on the same checkpoint store (Note [Checkpoint fence] in checkpoint_fence.py).
    epoch = str(time.time_ns() // 1_000_000)
    env = {} if "VARUNA_FENCE_EPOCH" in os.environ else {"VARUNA_FENCE_EPOCH": epoch}
    if args.checkpoint_dir is not None:
        # Absolute: workers on other hosts (and in other working directories) resolve it alike.
        env["VARUNA_CHECKPOINT_DIR"] = os.path.abspath(args.checkpoint_dir)
        if args.resume is None and "VARUNA_RESUME" not in os.environ:
            # Relaunching the command that was stopped (SIGUSR1/SIGTERM) continues the job.
            env["VARUNA_RESUME"] = "auto"
    if args.resume is not None:
        if args.checkpoint_dir is None and "VARUNA_CHECKPOINT_DIR" not in os.environ:
            raise ValueError("--resume needs --checkpoint-dir DIR (or $VARUNA_CHECKPOINT_DIR)")
        env["VARUNA_RESUME"] = args.resume
    if args.cut_after is not None and args.auto_cutpoints is not None:
        raise ValueError("--cut-after and --auto-cutpoints both given: cut-points are placed by name or "
                         "automatically; drop one")
    if args.cut_after is not None:
        if not [x for x in args.cut_after.split(",") if x.strip()]:
            raise ValueError("--cut-after needs module names or patterns, e.g. --cut-after 'model.layers.*'")
        env["VARUNA_CUT_AFTER"] = args.cut_after
    if args.auto_cutpoints is not None:
        if args.auto_cutpoints < 1:
            raise ValueError(f"--auto-cutpoints must be >= 1, got {args.auto_cutpoints}")
        env["VARUNA_AUTO_CUTPOINTS"] = str(args.auto_cutpoints)
    if args.plan_cost is not None:
        env["VARUNA_PLAN_COST"] = args.plan_cost
    if args.tensorboard_dir is not None:
        if not args.tensorboard_dir.strip():
            raise ValueError("--tensorboard-dir needs a directory, e.g. --tensorboard-dir runs/tb")
        # Absolute, like --checkpoint-dir: workers in other working directories write to the same place.
        env["VARUNA_TENSORBOARD_DIR"] = os.path.abspath(args.tensorboard_dir)
    if args.manager is not None:
        if not _MANAGER_RE.match(args.manager) or not 0 < int(args.manager.rsplit(":", 1)[1]) < 65536:
            raise ValueError(f"--manager {args.manager!r} is not HOST:PORT")
        env["VARUNA_MANAGER"] = args.manager
    return env


def _plan_request(args: argparse.Namespace) -> PlanRequest | None:
    """What auto-config plans (:class:`varuna.core.planning.PlanRequest`; the hosts' slots are
    filled in by ``resolve_layout``), or None without ``--calibration``."""
    if args.calibration is None:
        return None
    return PlanRequest.from_args(args)


def _local_layout(args: argparse.Namespace) -> Layout:
    """``--procs N``: P×D as given, or auto-config for N accelerators."""
    if args.pipeline_depth is not None:
        data_parallel = resolve_data_parallel(args.procs, args.pipeline_depth, args.data_parallel)
        return Layout(pipeline_depth=args.pipeline_depth, data_parallel=data_parallel)
    return resolve_layout(
        slots=[args.procs], data_parallel=args.data_parallel, request=_plan_request(args),
        progress=_progress(args),
    )


def _progress(args: argparse.Namespace) -> bool | None:
    """Progress bars (auto-config, agents and workers starting): on a terminal unless --quiet."""
    return False if args.quiet else None


def _with_layout(config: LaunchConfig, layout: Layout, args: argparse.Namespace) -> LaunchConfig:
    """``config`` with P×D of ``layout`` and the run plan (:class:`varuna.core.env.RunPlan`) in
    every worker's environment."""
    if layout.note:
        print(f"{PROG}: {layout.note}", file=sys.stderr, flush=True)
    plan = layout.run_plan(
        global_batch_size=args.global_batch_size, schedule=args.schedule, chunks=args.chunks,
        micro_batch_size=args.micro_batch_size, recompute_segments=args.recompute_segments,
    )
    problem = _chunks_problem(args, layout.pipeline_depth)  # P chosen by auto-config is known now
    if problem is not None:
        raise ValueError(problem)
    if args.global_batch_size is not None:
        # What every rank's engine would refuse (one traceback per rank), said once before spawning.
        try:
            microbatch_counts(args.global_batch_size, plan.micro_batch_size or 1, layout.data_parallel)
        except ValueError as exc:
            raise ValueError(f"P={layout.pipeline_depth} × D={layout.data_parallel}: {exc}") from None
    return dataclasses.replace(
        config,
        pipeline_depth=layout.pipeline_depth,
        data_parallel=layout.data_parallel,
        worker_env={**config.worker_env, **plan.to_env()},
    )


# ----------------------------------------------------------------------------------------------
# --hosts
# ----------------------------------------------------------------------------------------------


def _main_hosts(args: argparse.Namespace, config: LaunchConfig) -> int:
    """``--hosts``: validate, probe, choose P×D for what answered, start agents. Usage errors
    raise ``ValueError`` (exit 2); a job that cannot be placed exits 1."""
    entries = assign_slots(parse_hosts_arg(args.hosts), args.procs_per_host)
    check_hosts_capacity(entries, args.max_procs_per_host)
    speeds = _type_speeds(args, entries)
    ssh = SshOptions(
        key_file=args.ssh_key or os.environ.get("VARUNA_SSH_KEY") or None,
        known_hosts_file=args.ssh_known_hosts or os.environ.get("VARUNA_SSH_KNOWN_HOSTS") or None,
        connect_timeout_s=args.ssh_connect_timeout,
    )
    if args.job_id is not None and not _JOB_ID_RE.fullmatch(args.job_id):
        raise ValueError(f"--job-id {args.job_id!r} may only use letters, digits, '_', '.', '-' (1..64)")
    if any(e.is_local for e in entries):
        check_local_script(config)

    _check_host_timeout(args)
    reachable, unreachable = probe_hosts(entries, ssh)
    for entry, why in unreachable:
        _say(f"host {entry.display} ({entry.origin}) is unreachable, leaving it out: {why}")
    left_out = f" ({len(unreachable)} of {len(entries)} host(s) unreachable)" if unreachable else ""
    if not reachable:
        _say(f"cannot launch: no host is reachable{left_out}")
        return EXIT_WORKER_FAILED
    plan = functools.partial(_plan_hosts, args, config, speeds, left_out)
    return run_with_restarts(
        config, reachable, plan, ssh=ssh, job_id=args.job_id, unreachable=unreachable,
        host_timeout_s=args.host_timeout, progress=_progress(args),
    )


def _plan_hosts(
    args: argparse.Namespace,
    config: LaunchConfig,
    speeds: dict[str, float] | None,
    left_out: str,
    reachable: list[HostEntry],
) -> Placement:
    """P×D and placement for ``reachable`` (at start, and again for what is left after a lost
    host: Note [Restarts on hosts] in varuna/launch/recovery.py). ``CannotPlace`` when they
    cannot hold the job; another ``ValueError`` for a usage error."""
    try:
        if speeds is not None and args.data_parallel is None and args.calibration and args.global_batch_size:
            # Auto-config on hosts of several types: the mixed planner picks P×D, m, the map, the shares.
            layout, used, config = _place_by_type(None, reachable, speeds, config, args)
        else:
            layout = resolve_layout(
                slots=[e.slots or 0 for e in reachable],
                pipeline_depth=args.pipeline_depth,
                data_parallel=args.data_parallel,
                request=_plan_request(args),
                progress=_progress(args),
            )
            if speeds is not None:
                layout, used, config = _place_by_type(layout, reachable, speeds, config, args)
            else:
                used = select_hosts(reachable, layout.pipeline_depth * layout.data_parallel)
    except ValueError as exc:
        raise CannotPlace(f"{exc}{left_out}") from None
    config = _with_layout(config, layout, args)
    problem = _unreachable_master(config, used)
    if problem is not None:
        raise CannotPlace(problem)
    return Placement(config, used, _placement_line(config, used))


# ----------------------------------------------------------------------------------------------
# --slurm
# ----------------------------------------------------------------------------------------------


def _main_slurm(args: argparse.Namespace, config: LaunchConfig) -> int:
    """``--slurm``: the allocation's nodes and slots (Note [Slurm slots] in
    :mod:`varuna.launch.slurm`), then what ``--hosts`` does after its probe — P×D planned by
    :func:`_plan_hosts`, one agent per node used (started with srun), restarts after a lost node
    or a failed worker (``--max-restarts``, Note [Restarts on hosts] in
    :mod:`varuna.launch.recovery`) — and after Slurm's stop signal a requeue (Note [Slurm stop]).
    Usage errors raise ``ValueError`` (exit 2); a job that cannot be placed exits 1."""
    alloc = allocation_from_env(os.environ)
    entries = alloc.entries()
    if args.procs_per_host is not None:
        entries = [dataclasses.replace(e, slots=None) for e in entries]
        entries = assign_slots(entries, args.procs_per_host)
    check_hosts_capacity(entries, args.max_procs_per_host)
    if args.job_id is not None and not _JOB_ID_RE.fullmatch(args.job_id):
        raise ValueError(f"--job-id {args.job_id!r} may only use letters, digits, '_', '.', '-' (1..64)")
    _check_host_timeout(args)
    slots = [e.slots or 0 for e in entries]
    where = f"Slurm job {alloc.job_id}: " + (
        alloc.describe() if args.procs_per_host is None
        else f"{len(entries)} node(s) × --procs-per-host {args.procs_per_host}"
    )
    if args.pipeline_depth is not None and sum(slots) < args.pipeline_depth:
        raise ValueError(
            f"{where}: fewer slots than the {args.pipeline_depth} stages of --pipeline-depth"
            f" {args.pipeline_depth}; ask for more nodes or tasks (sbatch -N/--ntasks-per-node) or lower P"
        )
    if alloc.restart_count:
        _say(f"Slurm job {alloc.job_id} requeued {alloc.restart_count} time(s); {len(entries)} node(s) now")
    # No probe: srun reaches every node of the allocation, and a node Slurm lost ends the job.
    plan = functools.partial(_plan_hosts, args, config, None, "")
    cpus = {n: c for n, c in zip(alloc.nodes, alloc.cpus) if c is not None}
    stops: list[int] = []  # appended from a signal handler or a reader thread: no lock needed
    code = run_with_restarts(
        config, entries, plan, job_id=args.job_id, host_timeout_s=args.host_timeout, progress=_progress(args),
        remote=SrunOptions(cpus=cpus), stop_seen=stops.append,
    )
    graceful = [s for s in stops if s in (signal.SIGUSR1, signal.SIGTERM)]
    if graceful and not args.no_requeue:
        name = signal.Signals(graceful[0]).name
        _say(f"stopped by {name} from Slurm; requeueing job {alloc.job_id} (the next run resumes from the"
             " newest checkpoint)")
        why = requeue(alloc.job_id)
        if why is not None:
            _say(f"job {alloc.job_id} not requeued: {why}; submit the script again to resume")
        EventLog(config.log_dir).record("requeue", job=alloc.job_id, signal=name, requeued=why is None,
                                        why=why or "")
    return code


def _check_host_timeout(args: argparse.Namespace) -> None:
    if not math.isfinite(args.host_timeout) or args.host_timeout <= 0:
        raise ValueError(f"--host-timeout must be > 0 seconds, got {args.host_timeout}")


def _type_speeds(args: argparse.Namespace, entries: list[HostEntry]) -> dict[str, float] | None:
    """Each VM type's speed when the hosts say their types, else None (ValueError: one line)."""
    if not check_types(entries):
        if args.type_speeds is not None:
            raise ValueError("--type-speeds given but no host line says type=NAME; add type= to the hosts")
        return None
    types = sorted({e.vm_type for e in entries if e.vm_type is not None})
    if args.type_speeds is None:
        if len(types) > 1 and args.calibration and args.data_parallel is None and args.global_batch_size:
            return {}  # the calibration's 'types' give each type's costs (varuna.launch.mixed)
        if len(types) > 1:
            raise ValueError(
                f"the hosts are of {len(types)} VM types ({', '.join(types)}); give their relative speeds,"
                f" e.g. --type-speeds {','.join(f'{t}=1' for t in types)}"
            )
        return {types[0]: 1.0}
    speeds = parse_type_speeds(args.type_speeds)
    missing = [t for t in types if t not in speeds]
    if missing:
        raise ValueError(f"--type-speeds has no speed for VM type(s) {', '.join(missing)} named by the hosts")
    return speeds


def _place_by_type(
    layout: Layout | None,
    reachable: list[HostEntry],
    speeds: dict[str, float],
    config: LaunchConfig,
    args: argparse.Namespace,
) -> tuple[Layout, list[HostEntry], LaunchConfig]:
    """The mixed plan on typed hosts (:func:`varuna.launch.mixed.plan_cluster`): for P×D of
    ``layout``, or (None) the simulator's choice from ``--calibration`` (at ``--pipeline-depth``
    when given). Returns the layout with
    its shares and speeds, the hosts used (rank 0's first) and the config with each rank's host."""
    calibration = None
    if layout is None:
        if (args.chunks or 1) > 1:
            raise ValueError("auto-config for hosts of several VM types plans one chunk per process; with "
                             "--chunks give --pipeline-depth P (and --data-parallel D)")
        from varuna.core.calibration import Calibration

        try:
            calibration = Calibration.load(args.calibration)
        except OSError as exc:
            raise ValueError(f"cannot read calibration {args.calibration!r}: {exc.strerror or exc}") from None
    slot_types = [e.vm_type or "" for e in reachable for _ in range(e.slots or 0)]
    plan = plan_cluster(
        slot_types,
        speeds,
        calibration=calibration,
        global_batch_size=args.global_batch_size,
        micro_batch_size=layout.micro_batch_size if layout is not None else None,
        pipeline_depth=layout.pipeline_depth if layout is not None else args.pipeline_depth,
        data_parallel=layout.data_parallel if layout is not None else None,
        schedule=args.schedule or DEFAULT_SCHEDULE,
        host_slots=max(e.slots or 1 for e in reachable),
        gpu_memory_bytes=args.gpu_memory,
    )
    placed = place_ranks(plan, [(e.vm_type or "", e.slots or 0) for e in reachable])
    order = list(dict.fromkeys(placed))  # hosts in order of their first rank: rank 0's is host 0
    used = [reachable[i] for i in order]
    rank_hosts = tuple(order.index(i) for i in placed)
    if layout is None:
        layout = Layout(
            pipeline_depth=plan.pipeline_depth,
            data_parallel=plan.data_parallel,
            micro_batch_size=plan.micro_batch_size,
            stage_ranges=plan.stage_ranges,
            schedule=args.schedule or DEFAULT_SCHEDULE,
            note=f"auto-config for mixed VM types: {plan.explanation}",
        )
    else:
        note = "; ".join(x for x in (layout.note, f"mixed VM types: {plan.describe()}") if x)
        if plan.replica_shares is None and len(set(plan.rank_types)) > 1:
            note += " (replicas split the mini-batch evenly: shares need auto-config's m)"
        layout = dataclasses.replace(layout, note=note)
    layout = dataclasses.replace(layout, replica_shares=plan.replica_shares, stage_speeds=plan.stage_speeds)
    config = dataclasses.replace(
        config, pipeline_depth=plan.pipeline_depth, data_parallel=plan.data_parallel, rank_hosts=rank_hosts
    )
    return layout, used, config


def _say(text: str) -> None:
    print(f"{PROG}: {text}", file=sys.stderr, flush=True)


def _unreachable_master(config: LaunchConfig, used: list[HostEntry]) -> str | None:
    """Why the other hosts could not reach rank 0's rendezvous, or None."""
    if config.master_addr is not None or not used[0].is_local:
        return None
    remote = [e for e in used if not e.is_local and not is_loopback(e.host)]
    if not remote:
        return None
    return (
        f"host 0 is the pretend host 'localhost', whose address 127.0.0.1 {remote[0].display} cannot"
        " reach; list a real host first or pass --master-addr"
    )


def _placement_line(config: LaunchConfig, used: list[HostEntry]) -> str:
    """``P=2 × D=2 on 2 host(s): a (2 workers), b (2 workers)``."""
    counts, left = [], config.world_size
    for host_id, entry in enumerate(used):
        if config.rank_hosts is not None:
            counts.append(list(config.rank_hosts).count(host_id))
            continue
        counts.append(min(entry.slots or 0, left))  # contiguous rank ranges, as plan_workers assigns them
        left -= counts[-1]
    return f"P={config.pipeline_depth} × D={config.data_parallel} on {len(used)} host(s): " + ", ".join(
        f"{e.display}{f' [{e.vm_type}]' if e.vm_type else ''} ({n} worker{'s' if n > 1 else ''})"
        for e, n in zip(used, counts)
    )


if __name__ == "__main__":
    sys.exit(main())
