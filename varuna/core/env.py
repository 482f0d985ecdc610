"""The environment contract between ``varuna-launch`` and its worker processes.

The launcher starts P×D workers and tells each one who it is through environment variables;
workers read them back with :meth:`WorkerEnv.from_env`. The torchrun-compatible variables
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``)
mean ``torch.distributed.init_process_group(init_method="env://")`` works unchanged; the
``VARUNA_*`` variables add the pipeline layout. This module is pure Python (no torch import) so
the launcher, the manager and the simulator can use it anywhere.

Rank layout (fixed; see Note [Rank layout])::

    rank = replica * pipeline_depth + stage

Example::

    >>> env = WorkerEnv(master_addr="127.0.0.1", master_port=29500, rank=3, world_size=4,
    ...                 local_rank=3, local_world_size=4, pipeline_depth=2, data_parallel=2)
    >>> (env.stage, env.replica)
    (1, 1)
    >>> WorkerEnv.from_env(env.to_env()) == env
    True

Note [Run plan]: what a job runs with has one source per field. The launcher (``varuna-launch``:
``Layout.run_plan``) or the manager (``MorphPlanner.run_plan``) plans the job -- the global batch,
the schedule kind, the model chunks per process, and when auto-config or the mixed-type planner
ran, the micro-batch size, the segment→stage map, the replicas' shares and the stages' speeds --
and exports it to every worker as a :class:`RunPlan` (``VARUNA_GLOBAL_BATCH_SIZE``,
``VARUNA_SCHEDULE``, ...). The engine applies one rule to every planned field
(``varuna.runtime.config.adopt_plan``): a script that leaves it unset gets the plan's value; one
that sets the same value is accepted; one that sets another value is refused with one line naming
both and the fix. A field nobody planned keeps the script's value, else the engine's default
(applied after adoption, so a default never conflicts with a plan). The plan is made once per
P×D; the user states each value once, to the launcher or the job spec, not again to the script.

Note [One parser]: a worker reads its environment only through this module --
:class:`ProcessEnv` (identity as far as varuna-launch, torchrun or nobody gave it, the run plan,
the launcher's pass-through settings), built on the same integer and list parsing as
:class:`WorkerEnv` and :class:`RunPlan`. A malformed value is one ``ValueError`` line naming the
variable and the fix; an unset one is ``None`` (the caller's default applies).

Note [Rank layout]: consecutive ranks are consecutive stages of one replica pipeline, so
replica d owns ranks [d*P, (d+1)*P). Hosts are given contiguous rank ranges, so when a host has
several slots the stages that exchange activations every micro-batch (the heavy, latency-bound
traffic) share the host, while the gradient all-reduce (once per mini-batch, between equal
stages of different replicas) crosses hosts. The same stage of all replicas is
``{stage + d*P for d in range(D)}``: that set is the stage's data-parallel group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from varuna.core.flops import check_peak_tflops
from varuna.core.schedule import SCHEDULE_KINDS
from varuna.core.selective_recompute import parse_segment_set

__all__ = [
    "COMM_BACKENDS",
    "CONTRACT_VARS",
    "LAUNCHER_VARS",
    "PASSTHROUGH_PREFIX",
    "PLAN_COSTS",
    "SETTING_VARS",
    "TORCHRUN_VAR",
    "is_passthrough",
    "PLAN_VARS",
    "ProcessEnv",
    "RunPlan",
    "WorkerEnv",
    "WorkerSettings",
    "rank_of",
    "stage_and_replica",
]

#: Variables the launcher always sets; any other ``VARUNA_*`` variable is passed through as is.
CONTRACT_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "VARUNA_PIPELINE_DEPTH",
    "VARUNA_DATA_PARALLEL",
    "VARUNA_STAGE",
    "VARUNA_REPLICA",
    "VARUNA_HOST_ID",
)

#: Launcher environment variables with this prefix (other than the contract ones) reach every
#: worker unchanged, e.g. ``VARUNA_NETEM``, ``VARUNA_RESUME``, ``VARUNA_CHECKPOINT_DIR``.
PASSTHROUGH_PREFIX = "VARUNA_"

#: ``VARUNA_*`` variables that configure the launcher itself (ssh credentials); they are never
#: passed to workers, so a key path does not end up in every worker's environment and logs.
LAUNCHER_VARS = ("VARUNA_SSH_KEY", "VARUNA_SSH_KNOWN_HOSTS")


def is_passthrough(name: str) -> bool:
    """Whether the launcher passes variable ``name`` through to every worker unchanged.

    Example::

        >>> [is_passthrough(n) for n in ("VARUNA_NETEM", "VARUNA_STAGE", "VARUNA_SSH_KEY", "HOME")]
        [True, False, False, False]
    """
    return name.startswith(PASSTHROUGH_PREFIX) and name not in CONTRACT_VARS and name not in LAUNCHER_VARS


#: The run plan (:class:`RunPlan`): what the launcher or the manager planned this job for. They
#: travel as pass-through ``VARUNA_*`` variables so older launch paths keep working.
PLAN_VARS = (
    "VARUNA_GLOBAL_BATCH_SIZE",
    "VARUNA_MICRO_BATCH_SIZE",
    "VARUNA_SCHEDULE",
    "VARUNA_CHUNKS",
    "VARUNA_STAGE_RANGES",
    "VARUNA_REPLICA_SHARES",
    "VARUNA_STAGE_SPEEDS",
    "VARUNA_RECOMPUTE",
    "VARUNA_RECOMPUTE_SEGMENTS",
    "VARUNA_SHARD_OPTIMIZER",
)


#: Set by torchrun (``torch.distributed.run``) in every worker, never by varuna-launch.
TORCHRUN_VAR = "TORCHELASTIC_RUN_ID"

#: The launcher's pass-through settings a worker reads (:class:`WorkerSettings`).
SETTING_VARS = (
    "VARUNA_CHECKPOINT_DIR",
    "VARUNA_RESUME",
    "VARUNA_CUT_AFTER",
    "VARUNA_AUTO_CUTPOINTS",
    "VARUNA_PLAN_COST",
    "VARUNA_TENSORBOARD_DIR",
    "VARUNA_NETEM",
    "VARUNA_ENGINE_PLUGINS",
    "VARUNA_LIVE_STORE",
    "VARUNA_LIVE_STORE_KEY",
    "VARUNA_LIVE_JOIN",
    "VARUNA_COMM_BACKEND",
    "VARUNA_PEAK_TFLOPS",
    "VARUNA_FENCE_EPOCH",
    "VARUNA_GENERATION",
    "VARUNA_RESTARTS",
    "VARUNA_LIFECYCLE",
)

#: Backends that may carry a CUDA job's traffic (``VarunaConfig.comm_backend``, ``VARUNA_COMM_BACKEND``).
COMM_BACKENDS = ("nccl", "gloo")

#: What automatic cut-points and the stage split balance: counted FLOPs or measured time.
PLAN_COSTS = ("flop", "time")


# Hint appended to "variable missing" errors: the usual cause is running a worker script by hand.
_HOW_TO_LAUNCH = "start workers with varuna-launch (see docs/launch.md)"


def rank_of(*, stage: int, replica: int, pipeline_depth: int) -> int:
    """Global rank of ``stage`` in ``replica`` (Note [Rank layout]).

    Example::

        >>> rank_of(stage=1, replica=2, pipeline_depth=4)
        9
    """
    return replica * pipeline_depth + stage


def stage_and_replica(rank: int, pipeline_depth: int) -> tuple[int, int]:
    """Inverse of :func:`rank_of`: ``(stage, replica)`` of a global rank.

    Example::

        >>> stage_and_replica(9, 4)
        (1, 2)
    """
    replica, stage = divmod(rank, pipeline_depth)
    return stage, replica


@dataclass(frozen=True, kw_only=True)
class WorkerEnv:
    """Identity of one worker process, as passed by the launcher in environment variables.

    Construction validates the fields and raises ``ValueError`` with a one-line message.

    Example::

        >>> env = WorkerEnv(master_addr="127.0.0.1", master_port=29500, rank=1, world_size=2,
        ...                 local_rank=1, local_world_size=2, pipeline_depth=2, data_parallel=1,
        ...                 extra={"VARUNA_NETEM": "delay=5ms"})
        >>> env.to_env()["VARUNA_STAGE"], env.netem
        ('1', 'delay=5ms')
    """

    master_addr: str
    """Address of rank 0's rendezvous store (``MASTER_ADDR``)."""
    master_port: int
    """TCP port of the rendezvous store (``MASTER_PORT``)."""
    rank: int
    """Global rank, ``replica * pipeline_depth + stage`` (``RANK``)."""
    world_size: int
    """Number of workers, ``pipeline_depth * data_parallel`` (``WORLD_SIZE``)."""
    local_rank: int
    """Index of this worker among the workers on its host (``LOCAL_RANK``)."""
    local_world_size: int
    """Number of workers on this worker's host (``LOCAL_WORLD_SIZE``)."""
    pipeline_depth: int
    """P, the number of pipeline stages (``VARUNA_PIPELINE_DEPTH``)."""
    data_parallel: int
    """D, the number of replicas of each stage (``VARUNA_DATA_PARALLEL``)."""
    host_id: int = 0
    """Index of this worker's host in the launcher's host list (``VARUNA_HOST_ID``)."""
    extra: Mapping[str, str] = field(default_factory=dict, hash=False)  # a dict is unhashable
    """Passed-through ``VARUNA_*`` variables that are not part of the contract (their owners
    define their formats), e.g. ``VARUNA_NETEM``."""

    def __post_init__(self) -> None:
        for name in ("pipeline_depth", "data_parallel", "world_size", "local_world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"WorkerEnv: {name} must be >= 1, got {getattr(self, name)}")
        if self.world_size != self.pipeline_depth * self.data_parallel:
            raise ValueError(
                f"WorkerEnv: WORLD_SIZE={self.world_size} is not VARUNA_PIPELINE_DEPTH={self.pipeline_depth}"
                f" × VARUNA_DATA_PARALLEL={self.data_parallel}; relaunch with matching values"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"WorkerEnv: RANK={self.rank} is outside [0, WORLD_SIZE={self.world_size})")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"WorkerEnv: LOCAL_RANK={self.local_rank} is outside"
                f" [0, LOCAL_WORLD_SIZE={self.local_world_size})"
            )
        if self.local_world_size > self.world_size:
            raise ValueError(
                f"WorkerEnv: LOCAL_WORLD_SIZE={self.local_world_size} exceeds WORLD_SIZE={self.world_size}"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"WorkerEnv: MASTER_PORT={self.master_port} is not a TCP port (1..65535)")
        if not self.master_addr:
            raise ValueError("WorkerEnv: MASTER_ADDR is empty; " + _HOW_TO_LAUNCH)
        if self.host_id < 0:
            raise ValueError(f"WorkerEnv: VARUNA_HOST_ID={self.host_id} must be >= 0")
        for key in self.extra:
            if not key.startswith(PASSTHROUGH_PREFIX) or key in CONTRACT_VARS:
                raise ValueError(f"WorkerEnv: extra variable {key!r} must be a non-contract VARUNA_* name")
        # Freeze a private copy so later changes to the caller's dict cannot leak in.
        object.__setattr__(self, "extra", dict(self.extra))

    @property
    def stage(self) -> int:
        """Pipeline stage of this worker, ``rank % pipeline_depth``."""
        return stage_and_replica(self.rank, self.pipeline_depth)[0]

    @property
    def replica(self) -> int:
        """Data-parallel replica of this worker, ``rank // pipeline_depth``."""
        return stage_and_replica(self.rank, self.pipeline_depth)[1]

    @property
    def plan(self) -> RunPlan:
        """The run plan passed by the launcher or manager (empty fields where nothing was planned)."""
        return RunPlan.from_env(self.extra)

    @property
    def settings(self) -> WorkerSettings:
        """The launcher's pass-through settings (checkpoint directory, resume, netem, ...)."""
        return WorkerSettings.from_env(self.extra)

    @property
    def netem(self) -> str | None:
        """``VARUNA_NETEM``: network emulation config string, or None when not set."""
        return self.settings.netem

    @property
    def resume(self) -> str | None:
        """``VARUNA_RESUME``, or None when not set (format owned by the checkpoint code)."""
        return self.settings.resume

    @property
    def checkpoint_dir(self) -> str | None:
        """``VARUNA_CHECKPOINT_DIR``, or None when not set."""
        return self.settings.checkpoint_dir

    def to_env(self) -> dict[str, str]:
        """The variables to add to a worker's environment (contract plus ``extra``).

        Example::

            >>> env = WorkerEnv(master_addr="h0", master_port=29500, rank=0, world_size=1,
            ...                 local_rank=0, local_world_size=1, pipeline_depth=1, data_parallel=1)
            >>> env.to_env()["WORLD_SIZE"]
            '1'
        """
        out = dict(self.extra)
        out.update(
            {
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port),
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "VARUNA_PIPELINE_DEPTH": str(self.pipeline_depth),
                "VARUNA_DATA_PARALLEL": str(self.data_parallel),
                "VARUNA_STAGE": str(self.stage),
                "VARUNA_REPLICA": str(self.replica),
                "VARUNA_HOST_ID": str(self.host_id),
            }
        )
        return out

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Read and validate a worker's identity from ``environ`` (default ``os.environ``).

        Raises ``ValueError`` with a one-line message when a variable is missing, not an
        integer, or inconsistent with the others (e.g. ``VARUNA_STAGE`` disagrees with ``RANK``).

        Example::

            >>> WorkerEnv.from_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "2",
            ...     "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
            ...     "VARUNA_PIPELINE_DEPTH": "2", "VARUNA_DATA_PARALLEL": "2"}).replica
            1
        """
        environ = os.environ if environ is None else environ

        def get_int(name: str, default: int | None = None) -> int:
            value = _int_var(environ, name, "WorkerEnv")
            if value is None:
                if default is not None:
                    return default
                raise ValueError(f"WorkerEnv: environment variable {name} is not set; " + _HOW_TO_LAUNCH)
            return value

        if "MASTER_ADDR" not in environ:
            raise ValueError("WorkerEnv: environment variable MASTER_ADDR is not set; " + _HOW_TO_LAUNCH)
        env = cls(
            master_addr=environ["MASTER_ADDR"],
            master_port=get_int("MASTER_PORT"),
            rank=get_int("RANK"),
            world_size=get_int("WORLD_SIZE"),
            # torchrun-style scripts sometimes run with only the global variables set: treat the
            # job as single-host then rather than refusing.
            local_rank=get_int("LOCAL_RANK", get_int("RANK")),
            local_world_size=get_int("LOCAL_WORLD_SIZE", get_int("WORLD_SIZE")),
            pipeline_depth=get_int("VARUNA_PIPELINE_DEPTH"),
            data_parallel=get_int("VARUNA_DATA_PARALLEL"),
            host_id=get_int("VARUNA_HOST_ID", 0),
            extra={k: v for k, v in environ.items() if is_passthrough(k)},
        )
        # VARUNA_STAGE / VARUNA_REPLICA are redundant with RANK; when present they must agree, which
        # catches a launcher and a worker that disagree on the rank layout.
        for name, derived in (("VARUNA_STAGE", env.stage), ("VARUNA_REPLICA", env.replica)):
            if name in environ and get_int(name) != derived:
                raise ValueError(
                    f"WorkerEnv: {name}={environ[name]} is inconsistent with RANK={env.rank} and"
                    f" VARUNA_PIPELINE_DEPTH={env.pipeline_depth} (rank = replica * P + stage gives"
                    f" stage {env.stage}, replica {env.replica})"
                )
        return env


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """What the launcher (or the manager) planned the job for, exported to every worker.

    One run contract (Note [Run plan]): the planner decides P×D, and, when it ran auto-config, the
    micro-batch size and the segment→stage map, for a given global batch and schedule kind. For
    every planned field the engine applies one rule: a script that leaves it unset gets the plan's
    value, one that sets the same value is accepted, one that sets another is refused (one line).
    ``None`` means "not planned": the script's own value (else the engine's default) stands.

    Example::

        >>> plan = RunPlan(global_batch_size=32, schedule="1f1b", stage_ranges=((0, 1), (2, 4)))
        >>> plan.to_env()
        {'VARUNA_GLOBAL_BATCH_SIZE': '32', 'VARUNA_SCHEDULE': '1f1b', 'VARUNA_STAGE_RANGES': '0-1,2-4'}
        >>> RunPlan.from_env(plan.to_env()) == plan
        True
    """

    global_batch_size: int | None = None
    """Examples per optimizer step the job was planned for (``VARUNA_GLOBAL_BATCH_SIZE``)."""
    micro_batch_size: int | None = None
    """Micro-batch size chosen by auto-config (``VARUNA_MICRO_BATCH_SIZE``)."""
    schedule: str | None = None
    """Schedule kind the job was planned for (``VARUNA_SCHEDULE``)."""
    chunks: int | None = None
    """Model chunks per process for the interleaved kinds (``VARUNA_CHUNKS``, ``varuna-launch
    --chunks``); the engine adopts it. With it, ``stage_ranges`` lists P·chunks virtual stages."""
    stage_ranges: tuple[tuple[int, int], ...] | None = None
    """Inclusive segment range of each stage chosen by auto-config (``VARUNA_STAGE_RANGES``,
    ``"0-3,4-7"``)."""
    replica_shares: tuple[int, ...] | None = None
    """Micro-batches per replica on a cluster of mixed VM types (``VARUNA_REPLICA_SHARES``,
    ``"3,1"``; docs/determinism.md "Mixed VM types")."""
    stage_speeds: tuple[float, ...] | None = None
    """Relative speed of each stage's VM, for the stage split (``VARUNA_STAGE_SPEEDS``, ``"1,1.6"``)."""
    recompute: bool | None = None
    """Whether the stages recompute, as auto-config chose it with the schedule (``VARUNA_RECOMPUTE``,
    ``"1"``/``"0"``; Note [Joint plan] in simulator/autoconfig.py)."""
    recompute_segments: tuple[int, ...] | None = None
    """The segments a recomputed micro-batch recomputes, as auto-config chose them for the memory
    or the user gave them (``--recompute-segments``) (``VARUNA_RECOMPUTE_SEGMENTS``, ``"1,3"``,
    ``"0,2-3"``, ``"none"`` for the empty set; Note [Selective
    recompute] in varuna/core/selective_recompute.py)."""
    shard_optimizer: bool | None = None
    """Whether the optimizer state is sharded over each stage's replicas, as auto-config chose it
    (``VARUNA_SHARD_OPTIMIZER``, ``"1"``/``"0"``)."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "chunks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"RunPlan: {name} must be >= 1, got {value}")
        if self.schedule is not None and self.schedule not in SCHEDULE_KINDS:
            raise ValueError(
                f"RunPlan: unknown schedule {self.schedule!r} (VARUNA_SCHEDULE); choose one of "
                f"{', '.join(SCHEDULE_KINDS)}"
            )
        if self.stage_ranges is not None:
            object.__setattr__(self, "stage_ranges", tuple((int(a), int(b)) for a, b in self.stage_ranges))
        if self.replica_shares is not None:
            object.__setattr__(self, "replica_shares", tuple(self.replica_shares))
        if self.stage_speeds is not None:
            object.__setattr__(self, "stage_speeds", tuple(float(v) for v in self.stage_speeds))
        if self.recompute_segments is not None:  # a set: order and repeats say nothing
            object.__setattr__(self, "recompute_segments", tuple(sorted(set(self.recompute_segments))))

    def planned(self) -> dict[str, object]:
        """The planned fields (name → value), in declaration order; unplanned ones left out.

        Example::

            >>> RunPlan(schedule="1f1b", global_batch_size=32).planned()
            {'global_batch_size': 32, 'schedule': '1f1b'}
        """
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def to_env(self) -> dict[str, str]:
        """The ``VARUNA_*`` variables for the planned fields (unplanned ones are left out)."""
        out: dict[str, str] = {}
        if self.global_batch_size is not None:
            out["VARUNA_GLOBAL_BATCH_SIZE"] = str(self.global_batch_size)
        if self.micro_batch_size is not None:
            out["VARUNA_MICRO_BATCH_SIZE"] = str(self.micro_batch_size)
        if self.schedule is not None:
            out["VARUNA_SCHEDULE"] = self.schedule
        if self.chunks is not None:
            out["VARUNA_CHUNKS"] = str(self.chunks)
        if self.stage_ranges is not None:
            out["VARUNA_STAGE_RANGES"] = ",".join(f"{a}-{b}" for a, b in self.stage_ranges)
        if self.replica_shares is not None:
            out["VARUNA_REPLICA_SHARES"] = ",".join(str(x) for x in self.replica_shares)
        if self.stage_speeds is not None:
            out["VARUNA_STAGE_SPEEDS"] = ",".join(repr(v) for v in self.stage_speeds)
        if self.recompute is not None:
            out["VARUNA_RECOMPUTE"] = str(int(self.recompute))
        if self.recompute_segments is not None:
            out["VARUNA_RECOMPUTE_SEGMENTS"] = ",".join(str(s) for s in self.recompute_segments) or "none"
        if self.shard_optimizer is not None:
            out["VARUNA_SHARD_OPTIMIZER"] = str(int(self.shard_optimizer))
        return out

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RunPlan:
        """Read the plan from ``environ`` (default ``os.environ``); a malformed value raises
        ``ValueError`` with a one-line message naming the variable."""
        environ = os.environ if environ is None else environ

        def get_int(name: str) -> int | None:
            return _int_var(environ, name, "RunPlan")

        ranges = None
        raw_ranges = environ.get("VARUNA_STAGE_RANGES")
        if raw_ranges:
            try:
                ranges = tuple(_parse_range(part) for part in raw_ranges.split(","))
            except ValueError:
                raise ValueError(
                    f"RunPlan: VARUNA_STAGE_RANGES={raw_ranges!r} is not like '0-3,4-7'"
                ) from None
        return cls(
            global_batch_size=get_int("VARUNA_GLOBAL_BATCH_SIZE"),
            micro_batch_size=get_int("VARUNA_MICRO_BATCH_SIZE"),
            schedule=environ.get("VARUNA_SCHEDULE") or None,
            chunks=get_int("VARUNA_CHUNKS"),
            stage_ranges=ranges,
            replica_shares=_parse_list(environ, "VARUNA_REPLICA_SHARES", int, "3,1"),
            stage_speeds=_parse_list(environ, "VARUNA_STAGE_SPEEDS", float, "1,1.6"),
            recompute=_bool_var(environ, "VARUNA_RECOMPUTE"),
            recompute_segments=_segment_set_var(environ, "VARUNA_RECOMPUTE_SEGMENTS"),
            shard_optimizer=_bool_var(environ, "VARUNA_SHARD_OPTIMIZER"),
        )


def _segment_set_var(environ: Mapping[str, str], name: str) -> tuple[int, ...] | None:
    """A recompute set (``"0,2-3"``, ``"none"``; ``parse_segment_set``), None when unset or empty."""
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return parse_segment_set(raw, f"RunPlan: {name}")
    except ValueError as exc:
        raise ValueError(str(exc).replace(f"{name} {raw!r}", f"{name}={raw!r}")) from None


def _bool_var(environ: Mapping[str, str], name: str, owner: str = "RunPlan") -> bool | None:
    """``$name`` as "1"/"0" (None when unset or empty); one line naming the variable otherwise."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if raw not in ("0", "1"):
        raise ValueError(f"{owner}: {name}={raw!r} is not 1 or 0; set 1 (on), 0 (off) or unset it")
    return raw == "1"


def _parse_list(environ: Mapping[str, str], name: str, kind: type, example: str) -> tuple | None:
    raw = environ.get(name)
    if not raw:
        return None
    try:
        return tuple(kind(part) for part in raw.split(","))
    except ValueError:
        raise ValueError(
            f"RunPlan: {name}={raw!r} is not a comma-separated list of {kind.__name__}s like {example!r}"
        ) from None


def _parse_range(text: str) -> tuple[int, int]:
    first, last = text.split("-")
    return int(first), int(last)


def _int_var(environ: Mapping[str, str], name: str, owner: str) -> int | None:
    """``int($name)``, None when unset or empty; one line naming the variable when malformed (the
    one integer parser of the env contract: Note [One parser])."""
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw)
    except ValueError:
        prefix = f"{owner}: " if owner else ""
        raise ValueError(f"{prefix}{name}={raw!r} is not an integer; set a whole number or unset it") \
            from None


def _str_var(environ: Mapping[str, str], name: str) -> str | None:
    raw = environ.get(name, "").strip()
    return raw or None


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """The launcher's pass-through settings a worker reads (``varuna-launch --checkpoint-dir``,
    ``--resume``, ``--cut-after``, ...): each ``None`` (or empty) when not given, so the script's
    own setting, else the engine's default, stands. Formats owned elsewhere (``resume``: the
    checkpointer; ``netem``: ``varuna.testing.netem``) are kept as the raw strings.

    Example::

        >>> s = WorkerSettings.from_env({"VARUNA_CUT_AFTER": "model.layers.*, lm_head",
        ...                              "VARUNA_AUTO_CUTPOINTS": ""})
        >>> s.cut_after, s.auto_cutpoints
        (('model.layers.*', 'lm_head'), None)
        >>> WorkerSettings.from_env({"VARUNA_PLAN_COST": "flops"})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: WorkerSettings: VARUNA_PLAN_COST='flops' is not flop or time; ...
    """

    checkpoint_dir: str | None = None
    """``VARUNA_CHECKPOINT_DIR``: the global checkpoint store."""
    resume: str | None = None
    """``VARUNA_RESUME``: 1 / auto / 0 (parsed by ``varuna.runtime.checkpoint.resolve_resume``)."""
    cut_after: tuple[str, ...] | None = None
    """``VARUNA_CUT_AFTER``: comma-separated module names or patterns to cut after."""
    auto_cutpoints: int | None = None
    """``VARUNA_AUTO_CUTPOINTS``: how many cut-points the engine may place."""
    plan_cost: str | None = None
    """``VARUNA_PLAN_COST``: flop or time."""
    tensorboard_dir: str | None = None
    """``VARUNA_TENSORBOARD_DIR``: where rank 0 writes TensorBoard events."""
    netem: str | None = None
    """``VARUNA_NETEM``: network emulation (``varuna.testing.netem.NetworkConfig.parse``)."""
    engine_plugins: str = ""
    """``VARUNA_ENGINE_PLUGINS``: ``module:function`` entries (``varuna.runtime.plugins``)."""
    live_store: str | None = None
    """``VARUNA_LIVE_STORE``: host:port of a live run's store (``varuna.runtime.live_morph``)."""
    live_store_key: str | None = field(default=None, repr=False)
    """``VARUNA_LIVE_STORE_KEY``: the run's secret for that store (never printed; Note [Store
    authentication] in varuna/runtime/auth_store.py)."""
    live_join: bool = False
    """``VARUNA_LIVE_JOIN=1``: this worker joins a running live job."""
    checkpoint_format: str | None = None
    """``VARUNA_CHECKPOINT_FORMAT``: the checkpoint format saves write
    (``varuna.runtime.checkpoint_registry``)."""
    checkpoint_format_modules: tuple[str, ...] = ()
    """``VARUNA_CHECKPOINT_FORMAT_MODULES``: comma-separated modules that register checkpoint formats."""
    comm_backend: str | None = None
    """``VARUNA_COMM_BACKEND``: nccl or gloo for a CUDA job's traffic (``VarunaConfig.comm_backend``
    wins; varuna.runtime.layout.choose_transport)."""
    peak_tflops: float | None = None
    """``VARUNA_PEAK_TFLOPS``: one device's dense peak TFLOP/s, for MFU (``VarunaConfig``'s
    ``metrics.peak_tflops`` wins; varuna.runtime.flops.resolve_peak)."""
    fence_epoch: int | None = None
    """``VARUNA_FENCE_EPOCH``: the controller's start in ms (``varuna-launch``'s start, the manager
    job's creation), the first part of the checkpoint fence token (Note [Checkpoint fence] in
    varuna/runtime/checkpoint_fence.py); None: the run is unfenced."""
    generation: int | None = None
    """The launch's generation: the manager's ``VARUNA_GENERATION``, else the launcher's restart
    count ``VARUNA_RESTARTS``; None when neither is set."""
    lifecycle: bool = False
    """``VARUNA_LIFECYCLE=1`` (set by ``varuna-launch``): the engine prints its lifecycle lines on
    stdout for the launcher (``varuna.core.lifecycle``, Note [Lifecycle lines])."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerSettings:
        """Read the settings from ``environ`` (default ``os.environ``); one line when malformed."""
        environ = os.environ if environ is None else environ
        cuts = _str_var(environ, "VARUNA_CUT_AFTER")
        auto = _int_var(environ, "VARUNA_AUTO_CUTPOINTS", "WorkerSettings")
        if auto is not None and auto < 1:
            raise ValueError(
                f"WorkerSettings: VARUNA_AUTO_CUTPOINTS={auto} must be >= 1 (--auto-cutpoints N); "
                "unset it for none"
            )
        cost = _str_var(environ, "VARUNA_PLAN_COST")
        if cost is not None and cost not in PLAN_COSTS:
            raise ValueError(
                f"WorkerSettings: VARUNA_PLAN_COST={cost!r} is not {' or '.join(PLAN_COSTS)}; "
                "set one of them (--plan-cost) or unset it"
            )
        backend = _str_var(environ, "VARUNA_COMM_BACKEND")
        if backend is not None and backend not in COMM_BACKENDS:
            raise ValueError(
                f"WorkerSettings: VARUNA_COMM_BACKEND={backend!r} is not {' or '.join(COMM_BACKENDS)}; "
                "set one of them or unset it (automatic)"
            )
        generation = _int_var(environ, "VARUNA_GENERATION", "WorkerSettings")
        if generation is None:
            generation = _int_var(environ, "VARUNA_RESTARTS", "WorkerSettings")
        epoch = _int_var(environ, "VARUNA_FENCE_EPOCH", "WorkerSettings")
        for name, value in (("VARUNA_FENCE_EPOCH", epoch), ("VARUNA_GENERATION/VARUNA_RESTARTS", generation)):
            if value is not None and value < 0:
                raise ValueError(f"WorkerSettings: {name}={value} must be >= 0 (set by varuna-launch or the"
                                 " manager); unset it")
        return cls(
            fence_epoch=epoch,
            generation=generation,
            checkpoint_dir=_str_var(environ, "VARUNA_CHECKPOINT_DIR"),
            resume=_str_var(environ, "VARUNA_RESUME"),
            cut_after=(tuple(x.strip() for x in cuts.split(",") if x.strip()) or None) if cuts else None,
            auto_cutpoints=auto,
            plan_cost=cost,
            tensorboard_dir=_str_var(environ, "VARUNA_TENSORBOARD_DIR"),
            # An empty VARUNA_NETEM means "no emulation" (varuna.testing.netem).
            netem=environ.get("VARUNA_NETEM") or None,
            engine_plugins=environ.get("VARUNA_ENGINE_PLUGINS", ""),
            live_store=_str_var(environ, "VARUNA_LIVE_STORE"),
            live_store_key=_str_var(environ, "VARUNA_LIVE_STORE_KEY"),
            live_join=environ.get("VARUNA_LIVE_JOIN") == "1",
            checkpoint_format=_str_var(environ, "VARUNA_CHECKPOINT_FORMAT"),
            checkpoint_format_modules=tuple(
                m.strip() for m in environ.get("VARUNA_CHECKPOINT_FORMAT_MODULES", "").split(",") if m.strip()
            ),
            comm_backend=backend,
            peak_tflops=check_peak_tflops(_str_var(environ, "VARUNA_PEAK_TFLOPS"),
                                          "WorkerSettings: VARUNA_PEAK_TFLOPS"),
            lifecycle=bool(_bool_var(environ, "VARUNA_LIFECYCLE", "WorkerSettings")),
        )


@dataclass(frozen=True, kw_only=True)
class ProcessEnv:
    """Everything a worker process reads from its environment, parsed once (Note [One parser]):
    its identity as far as the launcher gave it -- every field under ``varuna-launch``, torchrun's
    without the ``VARUNA_*`` layout, none for a plain ``python train.py`` (one process) -- plus the
    run plan and the pass-through settings. Unlike :class:`WorkerEnv` (the launcher's complete
    contract) nothing is required: unset values take the defaults below.

    Example::

        >>> env = ProcessEnv.from_env({"RANK": "1", "WORLD_SIZE": "2", "VARUNA_PIPELINE_DEPTH": "2",
        ...                            "VARUNA_SCHEDULE": "1f1b"})
        >>> env.rank, env.pipeline_depth, env.data_parallel, env.plan.schedule
        (1, 2, None, '1f1b')
        >>> ProcessEnv.from_env({"VARUNA_PIPELINE_DEPTH": "0"})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: VARUNA_PIPELINE_DEPTH=0 must be >= 1; ...
    """

    rank: int = 0
    """``RANK`` (0 when unset)."""
    world_size: int = 1
    """``WORLD_SIZE`` (1 when unset)."""
    local_rank: int = 0
    """``LOCAL_RANK`` (0 when unset): the accelerator this process uses."""
    local_world_size: int = 1
    """``LOCAL_WORLD_SIZE`` (1 when unset): the processes sharing this host."""
    pipeline_depth: int | None = None
    """``VARUNA_PIPELINE_DEPTH``, None when unset (torchrun without it, one process)."""
    data_parallel: int | None = None
    """``VARUNA_DATA_PARALLEL``, None when unset."""
    torchrun: bool = False
    """Started by torchrun (``TORCHELASTIC_RUN_ID`` set; varuna-launch never sets it)."""
    master_addr: str | None = None
    """``MASTER_ADDR``: the rendezvous host (None when unset)."""
    master_port: str | None = None
    """``MASTER_PORT`` as given (None when unset; torch checks it)."""
    gloo_ifname: str | None = None
    """``GLOO_SOCKET_IFNAME`` when the user chose gloo's interface (Note [Interface towards a host])."""
    cublas_workspace_config: str | None = None
    """``CUBLAS_WORKSPACE_CONFIG`` as the user set it (None when unset); deterministic mode needs a
    deterministic value (Note [Deterministic CUDA] in varuna/runtime/determinism.py)."""
    plan: RunPlan = field(default_factory=RunPlan)
    """The run plan (Note [Run plan])."""
    settings: WorkerSettings = field(default_factory=WorkerSettings)
    """The launcher's pass-through settings."""

    def __post_init__(self) -> None:
        for name, var in (
            ("pipeline_depth", "VARUNA_PIPELINE_DEPTH"),
            ("data_parallel", "VARUNA_DATA_PARALLEL"),
            ("world_size", "WORLD_SIZE"),
            ("local_world_size", "LOCAL_WORLD_SIZE"),
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{var}={value} must be >= 1; " + _HOW_TO_LAUNCH)
        if self.rank < 0 or self.local_rank < 0:
            raise ValueError(
                f"RANK={self.rank} and LOCAL_RANK={self.local_rank} must be >= 0; " + _HOW_TO_LAUNCH
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ProcessEnv:
        """Read and check this process's environment (default ``os.environ``); one ``ValueError``
        line naming the variable when a value is malformed."""
        environ = os.environ if environ is None else environ

        def get_int(name: str, default: int | None) -> int | None:
            value = _int_var(environ, name, "")  # the variable alone names the problem
            return default if value is None else value

        return cls(
            rank=get_int("RANK", 0),
            world_size=get_int("WORLD_SIZE", 1),
            local_rank=get_int("LOCAL_RANK", 0),
            local_world_size=get_int("LOCAL_WORLD_SIZE", 1),
            pipeline_depth=get_int("VARUNA_PIPELINE_DEPTH", None),
            data_parallel=get_int("VARUNA_DATA_PARALLEL", None),
            torchrun=bool(environ.get(TORCHRUN_VAR)),
            master_addr=environ.get("MASTER_ADDR") or None,
            master_port=environ.get("MASTER_PORT") or None,
            gloo_ifname=environ.get("GLOO_SOCKET_IFNAME") or None,
            cublas_workspace_config=_str_var(environ, "CUBLAS_WORKSPACE_CONFIG"),
            plan=RunPlan.from_env(environ),
            settings=WorkerSettings.from_env(environ),
        )
