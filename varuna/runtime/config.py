"""The engine's configuration (:class:`VarunaConfig`), what one step reports (:class:`StepResult`,
:class:`StepTimings`), and the engine side of the run contract (:func:`adopt_plan`, Note [Run plan]
in varuna/core/env.py).

Example::

    >>> from varuna.core.env import RunPlan
    >>> cfg = VarunaConfig(global_batch_size=32)            # m and the schedule left to the plan
    >>> print(adopt_plan(cfg, RunPlan(global_batch_size=32, micro_batch_size=8, schedule="1f1b")))
    varuna: run plan adopted (the script left them unset): micro_batch_size=8, schedule=1f1b
    >>> cfg.micro_batch_size, cfg.schedule
    (8, '1f1b')
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from varuna.core.env import COMM_BACKENDS, PLAN_COSTS, ProcessEnv, RunPlan, WorkerSettings
from varuna.core.flops import check_peak_tflops
from varuna.core.schedule import DEFAULT_SCHEDULE, SCHEDULE_KINDS, schedule_kind
from varuna.core.selective_recompute import check_recompute_segments
from varuna.runtime.config_groups import (
    FLAT_FIELDS,
    GRAD_REDUCES,
    GROUPS,
    CheckpointConfig,
    CuttingConfig,
    DeterminismConfig,
    MetricsConfig,
    NumericsConfig,
    OptimizerStateConfig,
    PipelineConfig,
    TimeoutConfig,
)
from varuna.testing.negative_controls import NegativeControls

__all__ = ["COMM_BACKENDS", "PLAN_COSTS", "PRECISIONS", "PLANNED_FIELDS", "VarunaConfig", "StepResult",
           "StepTimings", "adopt_plan", "adopt_cut_env", "CheckpointConfig", "CuttingConfig",
           "DeterminismConfig", "MetricsConfig", "NumericsConfig", "OptimizerStateConfig", "PipelineConfig",
           "TimeoutConfig"]

#: Autocast dtype per ``VarunaConfig.precision`` (None: plain fp32).
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _accepting_flat_fields(cls: type) -> type:
    """Note [Flat config]: wrap the generated ``__init__`` so the flat spellings of earlier
    releases still construct the grouped config (one DeprecationWarning each, naming the new
    spelling), and add a deprecated property per flat name for reading and setting."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, **kwargs: Any) -> None:
        init(self, **_regroup(kwargs))

    cls.__init__ = __init__
    for flat, (group, name) in FLAT_FIELDS.items():
        setattr(cls, flat, property(_flat_getter(flat, group, name), _flat_setter(flat, group, name)))
    return cls


def _new_spelling(flat: str) -> str:
    group, name = FLAT_FIELDS[flat]
    if group == "_negative_controls":
        return (f"varuna.testing.negative_controls.with_negative_controls(config, {name}=...) "
                "(a test-only switch)")
    return f"VarunaConfig({group}={GROUPS[group].__name__}({name}=...)), read as config.{group}.{name}"


def _warn_flat(flat: str, stacklevel: int) -> None:
    warnings.warn(f"VarunaConfig's flat field {flat!r} is deprecated; use {_new_spelling(flat)}",
                  DeprecationWarning, stacklevel=stacklevel + 1)


def _regroup(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with every flat field moved into its group (a copy of the given group, if any)."""
    moved: dict[str, dict[str, Any]] = {}
    for flat in [k for k in kwargs if k in FLAT_FIELDS]:
        _warn_flat(flat, stacklevel=3)  # _regroup <- __init__ <- the caller
        group, name = FLAT_FIELDS[flat]
        moved.setdefault(group, {})[name] = kwargs.pop(flat)
    for group, values in moved.items():
        base = kwargs.get(group)
        if base is None:
            base = NegativeControls() if group == "_negative_controls" else GROUPS[group]()
        kwargs[group] = dataclasses.replace(base, **values)
    return kwargs


def _flat_getter(flat: str, group: str, name: str):
    def get(self: Any) -> Any:
        _warn_flat(flat, stacklevel=2)
        return getattr(getattr(self, group), name)

    get.__doc__ = f"Deprecated: {_new_spelling(flat)}."
    return get


def _flat_setter(flat: str, group: str, name: str):
    def set_(self: Any, value: Any) -> None:
        _warn_flat(flat, stacklevel=2)
        setattr(self, group, dataclasses.replace(getattr(self, group), **{name: value}))

    return set_


@_accepting_flat_fields
@dataclass(kw_only=True)
class VarunaConfig:
    """Engine configuration: the common settings at the top, the rest in groups.

    The planned fields (Note [Run plan] in varuna/core/env.py) -- ``global_batch_size``,
    ``micro_batch_size``, ``schedule``, and ``pipeline.chunks``, ``pipeline.stage_ranges``,
    ``pipeline.replica_shares``, ``pipeline.stage_speeds`` -- may be left ``None``: the launcher's
    or manager's plan fills them, else their default (:meth:`with_plan`); a value that differs
    from the plan is refused with one line. P and D default to the launcher's environment (1
    when absent). The flat spellings of earlier releases (``deterministic=True``,
    ``checkpoint_every=100``, ...) still work for one release, with a DeprecationWarning naming the
    grouped one (Note [Flat config] in varuna/runtime/config_groups.py).

    Example::

        >>> cfg = VarunaConfig(global_batch_size=32, micro_batch_size=4, schedule="1f1b",
        ...                    checkpoints=CheckpointConfig(dir="/ckpt", every=100),
        ...                    determinism=DeterminismConfig(enabled=True))
        >>> cfg.checkpoints.every, cfg.determinism.enabled, cfg.optimizer_state.offload
        (100, True, False)
    """

    global_batch_size: int | None = None
    """M_total: examples per optimizer step, whatever P×D; hyper-parameters depend on it only.
    None: the run plan's (``varuna-launch --global-batch-size``); required when nothing plans it."""
    micro_batch_size: int | None = None
    """m: examples per micro-batch. None: the run plan's (auto-config's choice); required when
    nothing plans it."""
    schedule: str | None = None
    """One of varuna, gpipe, 1f1b, interleaved, varuna-interleaved (synchronous), or 2bw:
    PipeDream-2BW, asynchronous -- gradients one step stale, one more copy of the weights; not the
    same training as one device (docs/schedules.md). None: the run plan's (``varuna-launch
    --schedule``), else ``varuna.core.schedule.DEFAULT_SCHEDULE``."""
    pipeline_depth: int | None = None
    """P; defaults to $VARUNA_PIPELINE_DEPTH or 1."""
    data_parallel: int | None = None
    """D; defaults to $VARUNA_DATA_PARALLEL or WORLD_SIZE // P."""
    seed: int = 0
    """Keys dropout masks (with step, micro-batch and segment) and parameter init."""
    precision: str = "fp32"
    """fp32, bf16 (autocast) or fp16 (autocast + dynamic loss scaling: ``numerics``)."""
    max_grad_norm: float | None = None
    """Clip by the global gradient norm over all stages (shared parameters counted once)."""
    device: str | None = None
    """Default: cuda:LOCAL_RANK when CUDA is available (LOCAL_RANK modulo the GPU count: more
    processes than GPUs share them), else cpu."""
    comm_backend: str | None = None
    """Backend of the engine's CUDA traffic (activations, gradients, all-reduces): "nccl", or
    "gloo" (activations and gradients staged through pinned host memory, all-reduces through
    gloo's CUDA support). None: $VARUNA_COMM_BACKEND, else nccl unless some processes share a GPU
    (NCCL refuses two ranks on one device), then gloo for the whole job (docs/gpu.md)."""
    stop_signals: tuple[str, ...] = ("SIGUSR1", "SIGTERM")
    """Signals that ask for a graceful stop: every rank finishes the current mini-batch, runs the
    stop callbacks (e.g. writes a checkpoint) and exits 0. Empty: install no handler."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Chunks, recompute, stash headroom, the stage split and the replicas' shares."""
    cutting: CuttingConfig = field(default_factory=CuttingConfig)
    """Where a model without CutPoints is cut; what the split balances."""
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint store, interval, retention, snapshot mode and resume."""
    determinism: DeterminismConfig = field(default_factory=DeterminismConfig)
    """Bit-identical weights at any P×D (docs/determinism.md)."""
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    """Waits on other processes and the peer watch."""
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    """fp16 loss scaling and the non-finite loss policy."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """TensorBoard events and task timelines."""
    optimizer_state: OptimizerStateConfig = field(default_factory=OptimizerStateConfig)
    """Optimizer state sharded over the replicas and/or offloaded to host memory (docs/memory.md)."""
    _negative_controls: NegativeControls = field(default_factory=NegativeControls, repr=False)
    """Test-only (varuna.testing.negative_controls): not part of the public configuration."""

    def with_plan(
        self, plan: RunPlan | None = None, *, defaults: Mapping[str, Any] | None = None, announce: bool = True
    ) -> VarunaConfig:
        """A copy with the run plan adopted (:func:`adopt_plan`: unset → the plan's value, equal →
        kept, different → ``ValueError``, one line) and the planned fields still unset given
        ``defaults`` (the script's own, e.g. its command line's: ``{"global_batch_size": 32}``),
        then the engine's (``DEFAULT_SCHEDULE``, one chunk). ``plan`` None: this process's
        (``ProcessEnv.from_env().plan``). With ``announce``, rank 0 prints the line saying what
        was adopted. The engine does the same, so a script calls this only when it needs the
        values before building the engine (e.g. the global batch, to load data).

        Example::

            >>> cfg = VarunaConfig().with_plan(RunPlan(global_batch_size=32), announce=False,
            ...                                defaults={"global_batch_size": 8, "micro_batch_size": 4})
            >>> cfg.global_batch_size, cfg.micro_batch_size, cfg.schedule, cfg.pipeline.chunks
            (32, 4, 'varuna', 1)
        """
        env = ProcessEnv.from_env() if plan is None or announce else None
        config = dataclasses.replace(self)
        note = adopt_plan(config, env.plan if plan is None else plan)
        config.fill_planned_defaults(defaults)
        if announce and note and _rank(env) == 0:
            print(note, flush=True)
        return config

    def fill_planned_defaults(self, defaults: Mapping[str, Any] | None = None) -> None:
        """Give the planned fields that are still unset (in place) ``defaults``, then the engine's."""
        for name, value in (defaults or {}).items():
            if name not in PLANNED_FIELDS:
                raise ValueError(
                    f"defaults: {name!r} is not a planned field; choose from {', '.join(PLANNED_FIELDS)}"
                )
            if _planned_value(self, name) is None:
                _set_planned(self, name, value)
        if self.schedule is None:
            self.schedule = DEFAULT_SCHEDULE
        if self.pipeline.chunks is None:
            self.pipeline = dataclasses.replace(self.pipeline, chunks=1)
        if self.optimizer_state.shard is None:
            self.optimizer_state = dataclasses.replace(self.optimizer_state, shard=False)
        if self.pipeline.recompute is None:
            self.pipeline = dataclasses.replace(self.pipeline, recompute=True)

    def validate(self) -> None:
        """Raise ``ValueError`` (one line) for a setting the engine cannot run with; the batch
        sizes must be set (by the script or :meth:`with_plan`, as the engine does), an unset
        schedule or chunk count is checked as its default.

        Example::

            VarunaConfig(global_batch_size=32, micro_batch_size=4, schedule="zigzag").validate()
            # ValueError: unknown schedule 'zigzag'; choose one of varuna, gpipe, 1f1b, 2bw
        """
        self._validate_plan()
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose fp32, bf16 or fp16")
        for name in ("pipeline_depth", "data_parallel"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, or None: the launcher's (got {value!r})")
        if self.pipeline.stash_headroom < 0:
            raise ValueError(f"pipeline.stash_headroom must be >= 0 (got {self.pipeline.stash_headroom})")
        t = self.timeouts
        if not t.comm_s > 0:  # also refuses NaN
            raise ValueError(f"timeouts.comm_s must be > 0 (got {t.comm_s})")
        if not t.peer_s >= 0:
            raise ValueError(f"timeouts.peer_s must be >= 0, 0 to turn the peer watch off (got {t.peer_s})")
        if self.checkpoints.snapshot not in ("auto", "memory", "disk"):
            raise ValueError(
                f"checkpoints.snapshot must be 'auto', 'memory' or 'disk' (got {self.checkpoints.snapshot!r})"
            )
        self._validate_cutting()
        self._validate_tensorboard_dir()
        if self.comm_backend not in (None, *COMM_BACKENDS):
            raise ValueError(
                f"unknown comm_backend {self.comm_backend!r}; choose {' or '.join(COMM_BACKENDS)} "
                "(or None: automatic)"
            )
        peak = check_peak_tflops(self.metrics.peak_tflops, "metrics.peak_tflops")
        self.metrics = dataclasses.replace(self.metrics, peak_tflops=peak)
        if self.numerics.max_nonfinite_steps < 0:
            raise ValueError(
                "numerics.max_nonfinite_steps must be >= 0, 0 to never stop "
                f"(got {self.numerics.max_nonfinite_steps})"
            )
        self._validate_mixed()
        self._validate_optimizer_state()
        self._validate_recompute_segments()

    def _validate_recompute_segments(self) -> None:
        segments = self.pipeline.recompute_segments
        problem = check_recompute_segments(segments)
        if problem is not None:
            raise ValueError(problem)
        schedule = DEFAULT_SCHEDULE if self.schedule is None else self.schedule
        if segments is not None and schedule_kind(schedule).splits_backward:
            raise ValueError(
                f"pipeline.recompute_segments is not supported with schedule {schedule} (its split backward "
                "needs one graph per stage); drop recompute_segments or pick another schedule"
            )

    def _validate_optimizer_state(self) -> None:
        o = self.optimizer_state
        if o.grad_reduce not in GRAD_REDUCES:
            raise ValueError(
                f"unknown optimizer_state.grad_reduce {o.grad_reduce!r}; choose {', '.join(GRAD_REDUCES)}"
            )
        schedule = DEFAULT_SCHEDULE if self.schedule is None else self.schedule
        versions = schedule_kind(schedule).weight_versions
        if (o.shard or o.offload) and versions > 1:
            raise ValueError(
                f"schedule {schedule} keeps {versions} weight versions and steps inside a window; sharded or "
                "offloaded optimizer state is not supported with it: pick a synchronous schedule or turn "
                "optimizer_state.shard/offload off"
            )

    def _validate_plan(self) -> None:
        if self.global_batch_size is None:
            raise ValueError(
                "global_batch_size is not set: pass it to VarunaConfig (a script's --global-batch-size), or "
                "launch with a plan (varuna-launch --global-batch-size M)"
            )
        if self.micro_batch_size is None:
            raise ValueError(
                "micro_batch_size is not set: pass it to VarunaConfig (a script's --micro-batch-size), or "
                "let auto-config choose it (varuna-launch --calibration FILE --global-batch-size M)"
            )
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise ValueError("--global-batch-size and --micro-batch-size must be >= 1")
        # Unset schedule and chunks are checked as their defaults (fill_planned_defaults).
        schedule = DEFAULT_SCHEDULE if self.schedule is None else self.schedule
        chunks = 1 if self.pipeline.chunks is None else self.pipeline.chunks
        if schedule not in SCHEDULE_KINDS:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULE_KINDS)}")
        kind = schedule_kind(schedule)
        kind.check_chunks(chunks)
        if kind.chunked and chunks < 2:
            raise ValueError(
                f"schedule {schedule} needs chunks >= 2 (got {chunks}); "
                "with one chunk use varuna or 1f1b"
            )

    def _validate_cutting(self) -> None:
        c = self.cutting
        if c.plan_cost not in (None, *PLAN_COSTS):
            raise ValueError(f"unknown plan_cost {c.plan_cost!r}; choose {' or '.join(PLAN_COSTS)}")
        n = c.auto_cutpoints
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"auto_cutpoints must be an integer >= 1 (got {n!r})")
        if n is not None and c.cut_after:
            raise ValueError(
                "auto_cutpoints and cut_after both set: cut-points are either automatic or placed by name; "
                "drop one (--auto-cutpoints or --cut-after)"
            )
        if isinstance(c.cut_after, str):
            cuts = tuple(x for x in c.cut_after.split(",") if x.strip())
            self.cutting = dataclasses.replace(c, cut_after=cuts)

    def _validate_mixed(self) -> None:
        """Shares and speeds as tuples of the right kind; their counts are checked against D and P
        once the layout is known (``Engine``)."""
        p = self.pipeline
        shares, speeds = p.replica_shares, p.stage_speeds
        if shares is not None:
            shares = tuple(shares)
            if not shares or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in shares):
                raise ValueError(
                    f"replica_shares {shares} must be whole numbers >= 1 of micro-batches per "
                    "replica, one per replica (or None for an even split)"
                )
        if speeds is not None:
            speeds = tuple(speeds)
            if not speeds or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
                for v in speeds
            ):
                raise ValueError(
                    f"stage_speeds {speeds} must be finite numbers > 0, one per stage "
                    "(or None when every stage's VM is alike)"
                )
        self.pipeline = dataclasses.replace(p, replica_shares=shares, stage_speeds=speeds)

    def _validate_tensorboard_dir(self) -> None:
        d = self.metrics.tensorboard_dir
        if d is None:
            return
        if not isinstance(d, (str, os.PathLike)) or not str(d).strip():
            raise ValueError(
                f"tensorboard_dir must be a directory path, or None for no TensorBoard output (got {d!r})"
            )
        self.metrics = dataclasses.replace(self.metrics, tensorboard_dir=os.fspath(d))
        if os.path.exists(d) and not os.path.isdir(d):
            raise ValueError(
                f"tensorboard_dir {os.fspath(d)!r} is a file, not a directory; "
                "pick a directory for the event files"
            )


def _rank(env: ProcessEnv | None) -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return env.rank if env is not None else 0


#: The planned fields (Note [Run plan]): name in the run plan → where the config holds it.
PLANNED_FIELDS: Mapping[str, tuple[str, ...]] = {
    "global_batch_size": ("global_batch_size",),
    "micro_batch_size": ("micro_batch_size",),
    "schedule": ("schedule",),
    "chunks": ("pipeline", "chunks"),
    "stage_ranges": ("pipeline", "stage_ranges"),
    "replica_shares": ("pipeline", "replica_shares"),
    "stage_speeds": ("pipeline", "stage_speeds"),
    "recompute": ("pipeline", "recompute"),
    "recompute_segments": ("pipeline", "recompute_segments"),
    "shard_optimizer": ("optimizer_state", "shard"),
}

# Per planned field: its variable and how to make script and plan agree (the refusal's fix).
_HOW_TO_AGREE = {
    "global_batch_size": ("VARUNA_GLOBAL_BATCH_SIZE", "or pass the same --global-batch-size to varuna-launch "
                          "(global_batch_size in a varuna-manager job spec)"),
    "micro_batch_size": ("VARUNA_MICRO_BATCH_SIZE", "to run the one auto-config chose, or fix it in the plan "
                         "(micro_batch_size in a varuna-manager job spec)"),
    "schedule": ("VARUNA_SCHEDULE", "or pass the same --schedule to varuna-launch (schedule in a "
                 "varuna-manager job spec)"),
    "chunks": ("VARUNA_CHUNKS", "or pass the same --chunks to varuna-launch (chunks in a varuna-manager "
               "job spec)"),
    "stage_ranges": ("VARUNA_STAGE_RANGES", "to run the split auto-config simulated, or launch with "
                     "--pipeline-depth instead of auto-config"),
    "replica_shares": ("VARUNA_REPLICA_SHARES", "to run the shares planned for the cluster's VM types"),
    "stage_speeds": ("VARUNA_STAGE_SPEEDS", "to run the speeds planned for the cluster's VM types"),
    "recompute": ("VARUNA_RECOMPUTE", "to run what auto-config chose for the memory it planned with"),
    "recompute_segments": ("VARUNA_RECOMPUTE_SEGMENTS", "to run what auto-config chose for the memory it "
                           "planned with"),
    "shard_optimizer": ("VARUNA_SHARD_OPTIMIZER", "to run what auto-config chose for the memory it "
                        "planned with"),
}


def _planned_value(config: VarunaConfig, name: str) -> Any:
    obj = config
    for part in PLANNED_FIELDS[name]:
        obj = getattr(obj, part)
    return obj


def _set_planned(config: VarunaConfig, name: str, value: Any) -> None:
    path = PLANNED_FIELDS[name]
    if len(path) == 1:
        setattr(config, path[0], value)
    else:
        group = getattr(config, path[0])
        setattr(config, path[0], dataclasses.replace(group, **{path[1]: value}))


def _comparable(name: str, value: Any) -> Any:
    """Script and plan values in one form (ranges as tuples of int pairs, speeds as floats)."""
    if name == "stage_ranges":
        return tuple((int(a), int(b)) for a, b in value)
    if name == "stage_speeds":
        return tuple(float(v) for v in value)
    if name == "recompute_segments":  # a set: the same segments in any order agree
        return tuple(sorted(set(value)))
    if name == "replica_shares":
        return tuple(value)
    return value


def _shown(name: str, value: Any) -> str:
    """A value as its variable writes it (``0-1,2-3`` for ranges, ``3,1`` for shares)."""
    if name == "stage_ranges":
        return ",".join(f"{a}-{b}" for a, b in value)
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value) or ("none" if name == "recompute_segments" else "")
    return str(value)


def adopt_plan(config: VarunaConfig, plan: RunPlan) -> str | None:
    """Apply the run plan to ``config`` in place, one rule for every planned field (Note [Run plan]
    in varuna/core/env.py): unset (None) in the script → the plan's value; the same value →
    accepted; another value → ``ValueError``, one line naming both and the fix. Returns the line
    to print on rank 0 naming what was adopted, or None when nothing was.

    Example::

        >>> cfg = VarunaConfig(global_batch_size=32, micro_batch_size=4)
        >>> print(adopt_plan(cfg, RunPlan(global_batch_size=32, stage_ranges=((0, 1), (2, 3)))))
        varuna: run plan adopted (the script left them unset): stage_ranges=0-1,2-3
        >>> adopt_plan(cfg, RunPlan(global_batch_size=16))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: the run plan has global_batch_size=16 (VARUNA_GLOBAL_BATCH_SIZE) but the script ...
    """
    adopted = []
    for name, planned in plan.planned().items():
        mine = _planned_value(config, name)
        if mine is None:
            _set_planned(config, name, [tuple(r) for r in planned] if name == "stage_ranges" else planned)
            adopted.append(f"{name}={_shown(name, planned)}")
        elif _comparable(name, mine) != _comparable(name, planned):
            var, fix = _HOW_TO_AGREE[name]
            raise ValueError(
                f"the run plan has {name}={_shown(name, planned)} ({var}) but the script sets "
                f"{_shown(name, mine)}: leave {name} unset in the script {fix}"
            )
    if not adopted:
        return None
    return "varuna: run plan adopted (the script left them unset): " + ", ".join(adopted)


@dataclass(frozen=True)
class StepTimings:
    """Where one step's time went on this rank: mean seconds per micro-batch of each task kind
    (0.0 when the stage ran none), how many forwards ran, and the end of step (gradient sync and
    optimizer) in seconds."""

    fwd_s: float = 0.0
    bwd_s: float = 0.0
    recompute_s: float = 0.0
    num_forwards: int = 0
    sync_s: float = 0.0


@dataclass
class StepResult:
    """What one ``train_step`` did; step callbacks (``Engine.add_step_callback``) get it too.
    ``loss`` is the mean over the whole mini-batch (all replicas)."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool
    loss_scale: float
    samples_per_s: float
    wall_time: float
    timings: StepTimings = field(default_factory=StepTimings)
    """This rank's per-task compute times during the step."""
    step_s: float = 0.0
    """Wall seconds of the whole step on this rank (``samples_per_s`` is global_batch_size / step_s)."""
    model_flops: float | None = None
    """The whole job's model FLOPs of the step: 3 × the forward's (Note [Model FLOPs] in
    varuna/core/flops.py); None when the dry run counted none."""
    tflops: float | None = None
    """Model TFLOP/s per device: ``model_flops`` / ``step_s`` / (P×D) / 1e12."""
    hardware_tflops: float | None = None
    """As ``tflops``, counting the recomputed forwards too (what the devices executed)."""
    mfu: float | None = None
    """Model FLOPs utilisation: ``tflops`` over one device's peak (``metrics.peak_tflops``,
    $VARUNA_PEAK_TFLOPS, or the table of known GPUs); None when the peak is unknown (CPU)."""


def adopt_cut_env(config: VarunaConfig, environ: Mapping[str, str] | None = None) -> None:
    """Fill ``cutting.cut_after``, ``cutting.auto_cutpoints`` and ``cutting.plan_cost`` from the
    launcher's settings where the script left them unset (``varuna-launch --cut-after/--auto-cutpoints
    /--plan-cost`` export ``VARUNA_CUT_AFTER``, ``VARUNA_AUTO_CUTPOINTS``, ``VARUNA_PLAN_COST``; read
    through ``varuna.core.env.WorkerSettings``). A bad value raises ``ValueError`` naming the variable.

    Example::

        >>> cfg = VarunaConfig(global_batch_size=8, micro_batch_size=2)
        >>> adopt_cut_env(cfg, {"VARUNA_CUT_AFTER": "model.layers.*,lm_head"})
        >>> cfg.cutting.cut_after, cfg.cutting.plan_cost
        (('model.layers.*', 'lm_head'), 'flop')
    """
    adopt_settings(config, WorkerSettings.from_env(environ))


def adopt_settings(config: VarunaConfig, settings: WorkerSettings) -> None:
    """:func:`adopt_cut_env` from parsed settings: cut-points only when the script placed none by
    name or number, the plan cost when the script left it unset (else "flop")."""
    c = config.cutting
    if c.cut_after is None and c.auto_cutpoints is None:
        c = dataclasses.replace(c, cut_after=settings.cut_after, auto_cutpoints=settings.auto_cutpoints)
    if c.plan_cost is None:
        c = dataclasses.replace(c, plan_cost=settings.plan_cost or "flop")
    config.cutting = c
