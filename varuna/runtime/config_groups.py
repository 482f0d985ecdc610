"""The groups of :class:`varuna.runtime.config.VarunaConfig`: one small, frozen, keyword-only
dataclass per concern (how the pipeline runs, where the model is cut, checkpoints, determinism,
timeouts, numerics, metrics), each field documented where it is declared.

A group is replaced, never changed in place (``dataclasses.replace(cfg.checkpoints, every=100)``),
so copies of a config never share a group that one of them edits.

Example::

    >>> from varuna.runtime.config import VarunaConfig
    >>> cfg = VarunaConfig(global_batch_size=32, micro_batch_size=4,
    ...                    checkpoints=CheckpointConfig(dir="/ckpt", every=100),
    ...                    determinism=DeterminismConfig(enabled=True))
    >>> cfg.checkpoints.every, cfg.determinism.threads
    (100, 1)

``FLAT_FIELDS`` maps each field of the flat ``VarunaConfig`` of earlier releases to its group and
name there (Note [Flat config]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from varuna.core.policy import DEFAULT_STASH_HEADROOM

__all__ = [
    "CheckpointConfig",
    "CuttingConfig",
    "DeterminismConfig",
    "FLAT_FIELDS",
    "GROUPS",
    "MetricsConfig",
    "NumericsConfig",
    "OptimizerStateConfig",
    "PipelineConfig",
    "TimeoutConfig",
]


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How the pipeline runs beyond its schedule kind: chunks, recompute, the stage split and the
    replicas' shares. ``chunks``, ``stage_ranges``, ``replica_shares`` and ``stage_speeds`` are
    planned fields (Note [Run plan] in varuna/core/env.py): left ``None`` they take the launcher's
    or manager's plan, else their default.

    Example::

        >>> PipelineConfig(chunks=2).stash_headroom
        4
    """

    chunks: int | None = None
    """v: model chunks per process for the interleaved kinds (>= 2; the model then needs P·v - 1
    cut-points and ``stage_ranges``, if given, P·v ranges in virtual-stage order); 1 otherwise.
    None: the run plan's (``varuna-launch --chunks``), else 1."""
    recompute: bool | None = None
    """Activation recompute for gpipe/1f1b (varuna always recomputes except on its last stage).
    None: the run plan's (auto-config's choice: off wherever memory allows, ``$VARUNA_RECOMPUTE``),
    else on."""
    recompute_segments: tuple[int, ...] | None = None
    """Selective recompute: the segments (global indices) whose activations a recomputed
    micro-batch recomputes; the stage's other segments keep theirs from the forward (Note
    [Selective recompute] in varuna/core/selective_recompute.py). ``()``: none (the recomputing
    stages keep every activation). None: every segment of a recomputing stage (whole-stage recompute).
    Applies where the schedule recomputes (``recompute``; varuna's stages but the last); not with
    the zero-bubble kinds, whose split backward needs one graph per stage."""
    stash_headroom: int = DEFAULT_STASH_HEADROOM
    """varuna schedule: how many more boundary inputs than its list's peak a stage may stash by
    running graph-less forwards out of list order -- while it waits for a late gradient, or to
    feed a next stage that ran dry (Notes [Filling the wait] and [Keeping the next stage fed] in
    varuna/core/schedule.py). 0: only within the list's own peak."""
    stage_ranges: list[tuple[int, int]] | None = None
    """Explicit segment ranges per stage. None: the run plan's (auto-config's split), else balanced
    on costs measured in a dry run."""
    replica_shares: tuple[int, ...] | None = None
    """Micro-batches each of the D replicas runs, for replicas on VMs of different speeds (virtual
    nodes): D counts >= 1 summing to ceil(global_batch_size / micro_batch_size). The global batch,
    m and the update are unchanged (bit-identical in deterministic mode); only which replica runs
    which micro-batches moves. None: the run plan's (``$VARUNA_REPLICA_SHARES``), else as even as
    possible. ``varuna.core.batching.proportional_shares`` turns speeds into shares."""
    stage_speeds: tuple[float, ...] | None = None
    """Relative speed of each stage's VM (P values > 0, pipeline order): the stage split balances
    time, a segment costing c taking c / speed on its stage, so a slower VM's stage gets less of the
    model. Ignored with explicit ``stage_ranges``. None: the run plan's (``$VARUNA_STAGE_SPEEDS``),
    else every stage alike."""
    stage_memory: int | tuple[int, ...] | None = None
    """Bytes each stage's process may use (one value for all, or one per stage): where the
    time-balanced split would put more on a stage -- its weights, gradients and optimizer state
    (Adam's two moments assumed; 1/D of them when ``optimizer_state.shard``) and its stashed
    boundary activations, with 80 MiB and 5 % kept for the rest -- the split moves segments off it, the
    least time lost (Note [Memory-aware split] in varuna/core/partition.py). None: the process's
    hard limit (room under ``RLIMIT_AS``, a cgroup's ``memory.max`` share, an accelerator's
    memory), else unbounded. Ignored with explicit ``stage_ranges``."""


@dataclass(frozen=True, kw_only=True)
class CuttingConfig:
    """Where a model without CutPoints of its own is cut, and what the split balances
    (varuna/cutting/autocut.py, varuna/cutting/routing.py).

    Example::

        >>> CuttingConfig(cut_after=("model.layers.*",)).plan_cost is None
        True
    """

    cut_after: tuple[str, ...] | None = None
    """Put a cut-point after each module these names or patterns select (``("model.layers.*",)``:
    after every decoder layer; ``*`` matches one level of a dotted name, see
    ``varuna.apply_cutpoints``), on a model you did not write. None: $VARUNA_CUT_AFTER
    (comma-separated; ``varuna-launch --cut-after``), else the model's own CutPoints."""
    auto_cutpoints: int | None = None
    """Insert up to this many CutPoints automatically into a model that has none (rank 0 picks the
    boundaries from a dry run, every rank applies them; see varuna/cutting/autocut.py). None:
    $VARUNA_AUTO_CUTPOINTS (``varuna-launch --auto-cutpoints``), else the model's. Cannot be
    combined with ``cut_after`` or CutPoints placed by hand."""
    plan_cost: str | None = None
    """What automatic cut-points and the stage split balance: "flop" (counted in the dry run;
    identical runs give identical plans) or "time" (measured forward+backward; follows
    memory-bound work, but a noisy machine can change the plan between runs). None:
    $VARUNA_PLAN_COST, else "flop"."""
    timing_reps: int = 2
    """With ``plan_cost="time"``: timed forward+backward runs per segment in the dry run."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoints (varuna/runtime/checkpoint.py, docs/checkpoints.md).

    Example::

        >>> CheckpointConfig(dir="/ckpt", every=100).keep
        2
    """

    dir: str | None = None
    """Global checkpoint store (shared filesystem or mounted blob); default $VARUNA_CHECKPOINT_DIR.
    When set, a graceful stop (SIGUSR1/SIGTERM) checkpoints before exiting."""
    every: int = 0
    """Save every N steps (0: only on a graceful stop or an explicit ``save_checkpoint``)."""
    keep: int = 2
    """How many complete checkpoints to keep (the newest complete one is never deleted first)."""
    local_dir: str | None = None
    """Fast local disk where files are written before the background copy; default a tmp dir."""
    snapshot: str = "auto"
    """How a save gets the state off the training path: "memory" (a host copy, written in the
    background), "disk" (written to local disk from the live tensors before training goes on: no
    extra copy, for a stage that fills its memory) or "auto" (memory when the copy fits in half of
    the free memory; docs/checkpoints.md)."""
    format: str | None = None
    """The checkpoint format saves write: a registered format's name (docs/checkpoints.md
    "Formats"); None: $VARUNA_CHECKPOINT_FORMAT, else "varuna". Resume reads any registered one."""
    resume: str | bool | None = None
    """"1"/True: load the newest complete checkpoint (error if none); "auto": if there is one;
    "0"/False: never. None: $VARUNA_RESUME (default never)."""
    init_from: str | None = None
    """Start from these weights when the run does not resume: a checkpoint directory of any
    registered format (or a checkpoint root: its newest), a Hugging Face model directory
    (``save_pretrained``: ``model.safetensors`` or sharded with its index) or a DCP checkpoint.
    Each stage reads only its own tensors (a model built on ``meta`` never holds the whole one);
    the optimizer, step and data start fresh (docs/checkpoints.md "Formats")."""


@dataclass(frozen=True, kw_only=True)
class DeterminismConfig:
    """Bit-identical training at any P×D and across morphs (docs/determinism.md).

    Example::

        >>> DeterminismConfig(enabled=True).threads
        1
    """

    enabled: bool = False
    """Bit-for-bit identical weights at any P×D and across morphs: canonical summation order for
    gradients, norms and losses; deterministic kernels; pinned threads."""
    threads: int = 1
    """Intra-op threads in deterministic mode (kernels may sum in a thread-count-dependent order)."""


GRAD_REDUCES = ("auto", "all_reduce", "reduce_scatter")


@dataclass(frozen=True, kw_only=True)
class OptimizerStateConfig:
    """Where the optimizer state lives (varuna/runtime/sharded_optimizer.py, docs/memory.md):
    sharded over each stage's D replicas (ZeRO-1), offloaded to host memory, or (default) whole
    beside the weights on every replica.

    Example::

        >>> OptimizerStateConfig(shard=True).grad_reduce
        'auto'
    """

    shard: bool | None = None
    """Each of a stage's D replicas keeps and steps the optimizer state of 1/D of the stage's
    parameters (flat, aligned shards), then the updated weights are all-gathered: the optimizer
    state per replica shrinks by D (Adam: 8 of ~16 bytes per parameter). Bit-identical in
    deterministic mode; checkpoints stay by parameter name, so any layout resumes them. Needs an
    elementwise optimizer (Adam, AdamW, SGD, ...: ``ELEMENTWISE_OPTIMIZERS``). None: the run
    plan's (auto-config's choice, ``$VARUNA_SHARD_OPTIMIZER``), else off."""
    offload: bool = False
    """Keep this replica's optimizer state (and a copy of the parameters it steps) in host memory,
    pinned when the model is on an accelerator, and step it there; only the updated weights go
    back. Combines with ``shard``."""
    grad_reduce: str = "auto"
    """How sharded gradients are summed over the replicas: "reduce_scatter" (each replica gets its
    shard's sum: half an all-reduce's traffic), "all_reduce" (every replica gets every sum, then
    reads its shard), or "auto": reduce-scatter on NCCL, all-reduce on gloo (whose reduce-scatter
    measured slower than its all-reduce here: docs/memory.md). Deterministic mode always sums
    canonically (all-reduce form)."""


@dataclass(frozen=True, kw_only=True)
class TimeoutConfig:
    """How long the engine waits on other processes (every wait has one).

    Example::

        >>> TimeoutConfig(peer_s=0).comm_s
        300.0
    """

    comm_s: float = 300.0
    """Every wait on another process gives up after this long."""
    peer_s: float = 10.0
    """While this rank waits inside a step, a peer whose liveness beat has not moved for this long
    (frozen, killed), or that closed its engine early, is reported by rank and host and the run
    fails at once instead of after ``comm_s`` (Note [Peer watch] in varuna/runtime/peer_watch.py).
    0: off."""


@dataclass(frozen=True, kw_only=True)
class NumericsConfig:
    """Loss scaling (``precision="fp16"``) and what a non-finite loss does.

    Example::

        >>> NumericsConfig().max_nonfinite_steps
        5
    """

    loss_scale: float = 2.0**16
    """Initial dynamic loss scale with fp16."""
    loss_scale_growth_interval: int = 2000
    """Steps without overflow before the fp16 loss scale doubles."""
    max_nonfinite_steps: int = 5
    """A step whose agreed loss is NaN/Inf is skipped with a one-line warning; this many in a row
    stop the run (non-zero exit, one line naming the steps). 0: never stop."""


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """What the engine records besides its ``StepResult`` (docs/metrics.md).

    Example::

        >>> MetricsConfig(record_timeline=True).tensorboard_dir is None
        True
    """

    tensorboard_dir: str | None = None
    """Also write the per-step metrics as TensorBoard events here (rank 0; loss, grad norm,
    samples/s, step time, TFLOP/s and MFU, P, D; text events for resumes and morphs): see
    varuna/runtime/tensorboard.py. None: $VARUNA_TENSORBOARD_DIR (``varuna-launch
    --tensorboard-dir``), else off. Needs ``pip install 'varuna[tensorboard]'``."""
    record_timeline: bool = False
    """Record (stage, op, micro-batch, start, end) of every task, for traces."""
    peak_tflops: float | None = None
    """Dense peak TFLOP/s of one device at the run's precision, for MFU (``StepResult.mfu``).
    None: $VARUNA_PEAK_TFLOPS, else the table of known GPUs (varuna/core/flops.py); on a CPU or
    an unknown device MFU is then None (TFLOP/s are still reported, docs/metrics.md)."""


#: Each group's field name on ``VarunaConfig`` and its class.
GROUPS: Mapping[str, type] = MappingProxyType(
    {
        "pipeline": PipelineConfig,
        "cutting": CuttingConfig,
        "checkpoints": CheckpointConfig,
        "determinism": DeterminismConfig,
        "timeouts": TimeoutConfig,
        "numerics": NumericsConfig,
        "metrics": MetricsConfig,
        "optimizer_state": OptimizerStateConfig,
    }
)

#: Note [Flat config]: the flat ``VarunaConfig`` fields of earlier releases → (group, name). For
#: one release ``VarunaConfig(checkpoint_every=5)`` and ``cfg.checkpoint_every`` still work, with
#: a DeprecationWarning naming the grouped spelling; the group ``_negative_controls`` holds the
#: test-only switches (varuna.testing.negative_controls), which left the public config.
FLAT_FIELDS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "chunks": ("pipeline", "chunks"),
        "recompute": ("pipeline", "recompute"),
        "stash_headroom": ("pipeline", "stash_headroom"),
        "stage_ranges": ("pipeline", "stage_ranges"),
        "replica_shares": ("pipeline", "replica_shares"),
        "stage_speeds": ("pipeline", "stage_speeds"),
        "cut_after": ("cutting", "cut_after"),
        "auto_cutpoints": ("cutting", "auto_cutpoints"),
        "plan_cost": ("cutting", "plan_cost"),
        "dry_run_reps": ("cutting", "timing_reps"),
        "checkpoint_dir": ("checkpoints", "dir"),
        "checkpoint_every": ("checkpoints", "every"),
        "keep_checkpoints": ("checkpoints", "keep"),
        "local_checkpoint_dir": ("checkpoints", "local_dir"),
        "checkpoint_snapshot": ("checkpoints", "snapshot"),
        "checkpoint_format": ("checkpoints", "format"),
        "resume": ("checkpoints", "resume"),
        "init_from": ("checkpoints", "init_from"),
        "deterministic": ("determinism", "enabled"),
        "deterministic_threads": ("determinism", "threads"),
        "comm_timeout_s": ("timeouts", "comm_s"),
        "peer_timeout_s": ("timeouts", "peer_s"),
        "loss_scale": ("numerics", "loss_scale"),
        "loss_scale_growth_interval": ("numerics", "loss_scale_growth_interval"),
        "max_nonfinite_steps": ("numerics", "max_nonfinite_steps"),
        "tensorboard_dir": ("metrics", "tensorboard_dir"),
        "record_timeline": ("metrics", "record_timeline"),
        "rng_keyed": ("_negative_controls", "rng_keyed"),
        "canonical_reduction": ("_negative_controls", "canonical_reduction"),
    }
)
