"""What a job is and where each rank runs: :class:`LaunchConfig` (script and P×D), one
:class:`WorkerSpec` per rank from :func:`plan_workers`, and the two interfaces a place to run
workers implements (:class:`Host`, which spawns; :class:`WorkerHandle`, what it returns).

The supervisor only talks to handles, so it does not care whether a worker runs on this machine
(:class:`varuna.launch.local.LocalHost`) or through a per-host agent
(:class:`varuna.launch.agent_host.AgentHost`).

Example::

    >>> from varuna.launch.local import LocalHost
    >>> cfg = LaunchConfig(script="train.py", pipeline_depth=2, data_parallel=2)
    >>> [s.label for s in plan_workers(cfg, [LocalHost(slots=2), LocalHost(slots=2)], master_port=29500)][2]
    'rank 2 stage 0 replica 1'
"""

from __future__ import annotations

import math
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Protocol

from varuna.core.env import CONTRACT_VARS, PASSTHROUGH_PREFIX, WorkerEnv, is_passthrough
from varuna.core.lifecycle import LIFECYCLE_VAR
from varuna.core.planning import check_count

__all__ = [
    "MAX_PROCS_PER_HOST_CEILING",
    "Host",
    "LaunchConfig",
    "WorkerHandle",
    "WorkerSpec",
    "check_procs_per_host",
    "default_max_procs_per_host",
    "plan_workers",
    "resolve_data_parallel",
]

#: The most workers one host may ever be asked to run, ``--max-procs-per-host`` included: far
#: more than any accelerator host holds, far fewer than a typo (``--procs 100000``) would fork.
MAX_PROCS_PER_HOST_CEILING = 1024


def default_max_procs_per_host() -> int:
    """Workers per host allowed without ``--max-procs-per-host``: 4 × this machine's CPU cores,
    at least 8 (an 8-accelerator host; emulated devices on a small machine).

    >>> default_max_procs_per_host() >= 8
    True
    """
    return max(8, 4 * (os.cpu_count() or 1))


def check_procs_per_host(count: int, where: str, limit: int | None = None) -> None:
    """ValueError (one line naming the fix) when ``count`` workers on one host (``where``: "this
    machine", "host h1") exceed ``limit`` (None: :func:`default_max_procs_per_host`). Without
    it, a mistyped count forks workers until the machine gives out, with no message.

    >>> check_procs_per_host(4, "this machine", 8)
    >>> check_procs_per_host(100000, "this machine", 8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: 100000 workers on this machine exceed the limit of 8 per host; ...
    """
    if limit is None:
        limit = default_max_procs_per_host()
        why = f"4 × {os.cpu_count() or 1} CPU cores, at least 8"
    else:
        why = "--max-procs-per-host"
    if count <= limit:
        return
    if count > MAX_PROCS_PER_HOST_CEILING:
        fix = f"no host may run more than {MAX_PROCS_PER_HOST_CEILING}; check the number"
    else:
        fix = f"pass --max-procs-per-host {count} if you mean it"
    raise ValueError(f"{count} workers on {where} exceed the limit of {limit} per host ({why}); {fix}")


@dataclass(kw_only=True)
class LaunchConfig:
    """What to run and in which layout. Runtime objects (hosts, output streams) go to
    :func:`launch` separately.

    Example::

        >>> cfg = LaunchConfig(script="train.py", pipeline_depth=2, data_parallel=3)
        >>> cfg.world_size
        6
    """

    script: str
    """Path of the Python script each worker runs, or a module name when ``module`` is set."""
    script_args: Sequence[str] = ()
    """Arguments passed to the script unchanged."""
    module: bool = False
    """Run ``python -m script`` instead of ``python script``."""
    pipeline_depth: int
    """P, the number of pipeline stages."""
    data_parallel: int
    """D, the number of replicas; the job has P×D workers."""
    master_addr: str | None = None
    """Rendezvous address given to workers; None means the first host's address."""
    master_port: int | None = None
    """Rendezvous port; None (or 0) picks a free one by binding port 0."""
    log_dir: str | None = None
    """When set: the resolved config goes to ``launch.json`` and each rank's raw output (stdout
    and stderr, unprefixed) to ``rank{r}.log`` in this directory."""
    stop_timeout_s: float = 10.0
    """Grace period between SIGTERM (or a forwarded SIGINT/SIGTERM) and SIGKILL."""
    python: str = field(default_factory=lambda: sys.executable or "python3")
    """Interpreter that runs the workers."""
    worker_env: Mapping[str, str] = field(default_factory=dict)
    """Extra variables for every worker (e.g. ``OMP_NUM_THREADS``); ``VARUNA_*`` ones are
    passed like the launcher's own. Contract variables (``RANK``, ...) cannot be set here."""
    max_procs_per_host: int | None = None
    """Most workers one host may run (:func:`check_procs_per_host`); None:
    :func:`default_max_procs_per_host`. At most :data:`MAX_PROCS_PER_HOST_CEILING`."""
    rank_hosts: Sequence[int] | None = None
    """Index of the host each rank runs on (mixed VM types: :func:`varuna.launch.mixed.place_ranks`);
    None: hosts get contiguous rank ranges in order."""
    live_morph: bool = False
    """A lost worker does not stop the job: the survivors regroup in their processes
    (docs/live_morph.md); when that is impossible the job restarts from its newest checkpoint."""
    max_restarts: int | None = None
    """How many times the job may be relaunched from its newest checkpoint after a failure
    (``--max-restarts``, torchrun's word); None: 3 with ``live_morph``, else 0."""

    def __post_init__(self) -> None:
        if not self.script:
            raise ValueError("no script given; pass the training script (or -m MODULE) to run")
        # The launcher's command line checked them (positive_int); a library caller gets the same check.
        check_count("--pipeline-depth", self.pipeline_depth)
        check_count("--data-parallel", self.data_parallel)
        if self.master_port is not None and not 0 <= self.master_port < 65536:
            raise ValueError(f"--master-port {self.master_port} is not a TCP port; use 1..65535 or 0 for any")
        if not math.isfinite(self.stop_timeout_s) or self.stop_timeout_s < 0:
            raise ValueError(f"--stop-timeout must be >= 0 seconds, got {self.stop_timeout_s}")
        cap = self.max_procs_per_host
        if cap is not None and not 1 <= cap <= MAX_PROCS_PER_HOST_CEILING:
            raise ValueError(
                f"--max-procs-per-host must be 1..{MAX_PROCS_PER_HOST_CEILING}, got {self.max_procs_per_host}"
            )
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        bad = sorted(set(self.worker_env) & set(CONTRACT_VARS))
        if bad:
            raise ValueError(
                f"worker_env cannot set contract variables {bad}; the launcher sets them per rank"
            )
        self.script_args = tuple(self.script_args)
        self.worker_env = dict(self.worker_env)
        if self.rank_hosts is not None:
            hosts = tuple(self.rank_hosts)
            bad = [h for h in hosts if not isinstance(h, numbers.Integral) or isinstance(h, bool) or h < 0]
            if len(hosts) != self.world_size or bad or hosts[0] != 0:
                raise ValueError(
                    f"rank_hosts {hosts} must give an integer host index >= 0 for each of the"
                    f" {self.world_size} ranks, rank 0 on host 0 (the rendezvous address)"
                )
            self.rank_hosts = tuple(int(h) for h in hosts)

    @property
    def restart_limit(self) -> int:
        """``max_restarts``, or its default (3 with live morph, else 0)."""
        if self.max_restarts is not None:
            return self.max_restarts
        return 3 if self.live_morph else 0

    @property
    def world_size(self) -> int:
        """P×D, the number of worker processes."""
        return self.pipeline_depth * self.data_parallel

    def worker_argv(self) -> tuple[str, ...]:
        """The command every worker runs."""
        if self.module:
            return (self.python, "-m", self.script, *self.script_args)
        return (self.python, self.script, *self.script_args)


def resolve_data_parallel(num_procs: int, pipeline_depth: int, data_parallel: int | None) -> int:
    """D for ``--procs N --pipeline-depth P [--data-parallel D]``; ValueError unless N == P×D.

    Example::

        >>> resolve_data_parallel(8, 4, None)
        2
        >>> resolve_data_parallel(6, 4, None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: --procs 6 is not --pipeline-depth 4 × --data-parallel D for any D; use ...
    """
    if data_parallel is None:  # N, P (and D) >= 1: checked where given (the command line)
        if num_procs % pipeline_depth == 0:
            return num_procs // pipeline_depth
        below = (num_procs // pipeline_depth) * pipeline_depth
        above = below + pipeline_depth
        options = " or ".join(f"--procs {n}" for n in (below, above) if n >= 1)
        raise ValueError(
            f"--procs {num_procs} is not --pipeline-depth {pipeline_depth} × --data-parallel D for any D;"
            f" use {options}"
        )
    if num_procs != pipeline_depth * data_parallel:
        fix = f"use --procs {pipeline_depth * data_parallel}"
        if num_procs % pipeline_depth == 0:
            fix += f" or --data-parallel {num_procs // pipeline_depth}"
        raise ValueError(
            f"--procs {num_procs} is not --pipeline-depth {pipeline_depth}"
            f" × --data-parallel {data_parallel}; {fix}"
        )
    return data_parallel


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything a host needs to start the worker of one rank.

    Example::

        >>> from varuna.launch.local import LocalHost
        >>> cfg = LaunchConfig(script="train.py", pipeline_depth=2, data_parallel=1)
        >>> specs = plan_workers(cfg, [LocalHost(slots=2)], master_port=29500)
        >>> specs[1].label, specs[1].set_vars["VARUNA_STAGE"]
        ('rank 1 stage 1 replica 0', '1')
    """

    env: WorkerEnv
    """The rank's identity (the environment contract)."""
    argv: tuple[str, ...]
    """Command line; ``argv[0]`` is the interpreter."""
    set_vars: Mapping[str, str]
    """Variables to set in the worker's environment on its host: the contract, pass-through
    ``VARUNA_*`` variables and ``LaunchConfig.worker_env``. A local host adds them to its own
    environment; a remote host has to send them."""
    cwd: str | None = None
    """Working directory on the host; None keeps the host's default."""

    @property
    def label(self) -> str:
        """``rank r stage k replica d``, the output prefix without brackets."""
        return f"rank {self.env.rank} stage {self.env.stage} replica {self.env.replica}"


def _rank_hosts(config: LaunchConfig, hosts: Sequence[Host]) -> list[int]:
    """The host of every rank: ``config.rank_hosts``, checked against the hosts' slots, or
    contiguous ranges in host order."""
    if config.rank_hosts is None:
        out: list[int] = []
        for host_id, host in enumerate(hosts):
            out += [host_id] * min(host.slots, config.world_size - len(out))
        return out
    out = list(config.rank_hosts)
    for host_id, host in enumerate(hosts):
        if out.count(host_id) > host.slots:
            raise ValueError(
                f"rank_hosts puts {out.count(host_id)} ranks on host {host_id}, which has"
                f" {host.slots} slot(s)"
            )
    if max(out) >= len(hosts):
        raise ValueError(f"rank_hosts names host {max(out)} but there are {len(hosts)} host(s)")
    return out


def plan_workers(
    config: LaunchConfig,
    hosts: Sequence[Host],
    *,
    master_port: int,
    launcher_environ: Mapping[str, str] | None = None,
    cwd: str | None = None,
    lifecycle_lines: bool = False,
) -> list[WorkerSpec]:
    """One spec per rank; hosts get contiguous rank ranges in order (Note [Rank layout] in
    :mod:`varuna.core.env`), so a host with several slots holds consecutive stages of a pipeline.

    ``launcher_environ`` (default ``os.environ``) supplies the ``VARUNA_*`` pass-through.
    ``lifecycle_lines``: ask every worker's Engine for its lifecycle lines (``VARUNA_LIFECYCLE=1``),
    which a :class:`~varuna.launch.supervisor.Supervisor` reads (Note [Lifecycle lines] in
    :mod:`varuna.core.lifecycle`); ``varuna-launch`` does, the manager's launches do not.

    Example::

        >>> from varuna.launch.local import LocalHost
        >>> cfg = LaunchConfig(script="t.py", pipeline_depth=2, data_parallel=2)
        >>> [(s.env.rank, s.env.host_id, s.env.local_rank)
        ...  for s in plan_workers(cfg, [LocalHost(slots=2), LocalHost(slots=2)], master_port=1)]
        [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    """
    if not hosts:
        raise ValueError("no hosts to run workers on")
    world_size = config.world_size
    capacity = sum(host.slots for host in hosts)
    if capacity < world_size:
        raise ValueError(
            f"{world_size} workers (P={config.pipeline_depth} × D={config.data_parallel}) need {world_size}"
            f" slots but the hosts have {capacity}; add hosts or use a smaller --procs"
        )
    launcher_environ = os.environ if launcher_environ is None else launcher_environ
    passthrough = {k: v for k, v in {**launcher_environ, **config.worker_env}.items() if is_passthrough(k)}
    plain_vars = {k: v for k, v in config.worker_env.items() if not k.startswith(PASSTHROUGH_PREFIX)}
    master_addr = config.master_addr or hosts[0].address
    argv = config.worker_argv()

    rank_hosts = _rank_hosts(config, hosts)
    per_host = [rank_hosts.count(h) for h in range(len(hosts))]
    next_local = [0] * len(hosts)
    specs: list[WorkerSpec] = []
    for rank, host_id in enumerate(rank_hosts):
        local_rank = next_local[host_id]
        next_local[host_id] += 1
        env = WorkerEnv(
            master_addr=master_addr,
            master_port=master_port,
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=per_host[host_id],
            pipeline_depth=config.pipeline_depth,
            data_parallel=config.data_parallel,
            host_id=host_id,
            extra=passthrough,
        )
        set_vars = {**plain_vars, **env.to_env()}
        # Line-buffered worker output, so prefixed lines reach the launcher as they are
        # printed rather than in 8 KiB blocks at exit; a user's explicit choice wins.
        if "PYTHONUNBUFFERED" not in launcher_environ and "PYTHONUNBUFFERED" not in set_vars:
            set_vars["PYTHONUNBUFFERED"] = "1"
        if lifecycle_lines:
            set_vars[LIFECYCLE_VAR] = "1"
        specs.append(WorkerSpec(env=env, argv=argv, set_vars=set_vars, cwd=cwd))
    return specs


class WorkerHandle(Protocol):
    """A started worker, wherever it runs; the supervisor needs nothing else."""

    spec: WorkerSpec

    @property
    def pid(self) -> int:
        """Process id on the worker's host (for logs and tests)."""
        ...

    @property
    def output_streams(self) -> tuple[IO[bytes], IO[bytes]]:
        """``(stdout, stderr)`` of the worker as binary streams; EOF when the worker is gone."""
        ...

    def poll(self) -> int | None:
        """Exit code once the worker has exited (negative: killed by that signal), else None.
        On exit, leftover processes of the worker are killed before this returns."""
        ...

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the worker and every process it started; no-op once it exited."""
        ...


class Host(Protocol):
    """A machine that can run workers: :class:`varuna.launch.local.LocalHost` (this machine) or
    :class:`varuna.launch.agent_host.AgentHost` (a per-host agent, local or over OpenSSH)."""

    address: str
    """Address other hosts reach this one at (used as MASTER_ADDR when it is host 0)."""
    slots: int
    """How many workers it runs at most."""

    def spawn(self, spec: WorkerSpec) -> WorkerHandle:
        """Start the worker described by ``spec``; raise ``OSError`` if that is impossible."""
        ...
