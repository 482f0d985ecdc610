"""The engine's configuration (:class:`VarunaConfig`), what one step reports (:class:`StepResult`,
:class:`StepTimings`), and the engine side of the run contract (:func:`adopt_plan`).

Example::

    >>> from varuna.core.env import RunPlan
    >>> cfg = VarunaConfig(global_batch_size=32, micro_batch_size=4)
    >>> print(adopt_plan(cfg, RunPlan(global_batch_size=32, micro_batch_size=8)))  # doctest: +ELLIPSIS
    varuna: using the launcher's planned micro-batch size 8 (VARUNA_MICRO_BATCH_SIZE) instead of ...
    >>> cfg.micro_batch_size
    8
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from varuna.core.env import RunPlan
from varuna.core.schedule import DEFAULT_STASH_HEADROOM, SCHEDULE_KINDS, schedule_kind

__all__ = ["PLAN_COSTS", "PRECISIONS", "VarunaConfig", "StepResult", "StepTimings", "adopt_plan",
           "adopt_cut_env"]

#: Autocast dtype per ``VarunaConfig.precision`` (None: plain fp32).
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
#: What a plan (automatic cut-points, stage split) balances: counted FLOPs or measured time.
PLAN_COSTS = ("flop", "time")


@dataclass(kw_only=True)
class VarunaConfig:
    """Engine configuration. P and D default to the launcher's environment (1 when absent)."""

    global_batch_size: int
    """M_total: examples per optimizer step, whatever P×D; hyper-parameters depend on it only."""
    micro_batch_size: int
    """m: examples per micro-batch."""
    pipeline_depth: int | None = None
    """P; defaults to $VARUNA_PIPELINE_DEPTH or 1."""
    data_parallel: int | None = None
    """D; defaults to $VARUNA_DATA_PARALLEL or WORLD_SIZE // P."""
    schedule: str = "varuna"
    """One of varuna, gpipe, 1f1b, interleaved, varuna-interleaved (synchronous), or 2bw:
    PipeDream-2BW, asynchronous -- gradients one step stale, one more copy of the weights; not the
    same training as one device (docs/schedules.md)."""
    chunks: int = 1
    """v: model chunks per process for the interleaved kinds (>= 2; the model then needs P·v - 1
    cut-points and ``stage_ranges``, if given, P·v ranges in virtual-stage order); 1 otherwise."""
    recompute: bool = True
    """Activation recompute for gpipe/1f1b (varuna always recomputes except on its last stage)."""
    stash_headroom: int = DEFAULT_STASH_HEADROOM
    """varuna schedule: how many more boundary inputs than its list's peak a stage may stash by
    running graph-less forwards out of list order -- while it waits for a late gradient, or to
    feed a next stage that ran dry (Notes [Filling the wait] and [Keeping the next stage fed] in
    varuna/core/schedule.py). 0: only within the list's own peak."""
    seed: int = 0
    """Keys dropout masks (with step, micro-batch and segment) and parameter init."""
    precision: str = "fp32"
    """fp32, bf16 (autocast) or fp16 (autocast + dynamic loss scaling)."""
    max_grad_norm: float | None = None
    """Clip by the global gradient norm over all stages (shared parameters counted once)."""
    stage_ranges: list[tuple[int, int]] | None = None
    """Explicit segment ranges per stage; default: balanced on costs measured in a dry run."""
    replica_shares: tuple[int, ...] | None = None
    """Micro-batches each of the D replicas runs, for replicas on VMs of different speeds (virtual
    nodes): D counts >= 1 summing to ceil(global_batch_size / micro_batch_size). The global batch,
    m and the update are unchanged (bit-identical in deterministic mode); only which replica runs
    which micro-batches moves. None: as even as possible. ``$VARUNA_REPLICA_SHARES`` ("3,1", the
    run plan) overrides it. ``varuna.core.batching.proportional_shares`` turns speeds into shares."""
    stage_speeds: tuple[float, ...] | None = None
    """Relative speed of each stage's VM (P values > 0, pipeline order): the stage split balances
    time, a segment costing c taking c / speed on its stage, so a slower VM's stage gets less of the
    model. Ignored with explicit ``stage_ranges``. ``$VARUNA_STAGE_SPEEDS`` ("1,1.6") overrides it."""
    comm_timeout_s: float = 300.0
    """Every wait on another process gives up after this long."""
    peer_timeout_s: float = 10.0
    """While this rank waits inside a step, a peer whose liveness beat has not moved for this long
    (frozen, killed), or that closed its engine early, is reported by rank and host and the run
    fails at once instead of after ``comm_timeout_s`` (Note [Peer watch] in
    varuna/runtime/peer_watch.py). 0: off."""
    max_nonfinite_steps: int = 5
    """A step whose agreed loss is NaN/Inf is skipped with a one-line warning; this many in a row
    stop the run (non-zero exit, one line naming the steps). 0: never stop."""
    dry_run_reps: int = 2
    record_timeline: bool = False
    """Record (stage, op, micro-batch, start, end) of every task, for traces."""
    deterministic: bool = False
    """Bit-for-bit identical weights at any P×D and across morphs (docs/determinism.md): canonical
    summation order for gradients, norms and losses; deterministic kernels; pinned threads."""
    deterministic_threads: int = 1
    """Intra-op threads in deterministic mode (kernels may sum in a thread-count-dependent order)."""
    rng_keyed: bool = True
    """Key dropout by (seed, step, micro-batch, segment). Off only as a test's negative control."""
    canonical_reduction: bool = True
    """With ``deterministic``: canonical-order sums. Off only as a test's negative control."""
    device: str | None = None
    """Default: cuda:LOCAL_RANK when CUDA is available, else cpu."""
    loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    stop_signals: tuple[str, ...] = ("SIGUSR1", "SIGTERM")
    """Signals that ask for a graceful stop: every rank finishes the current mini-batch, runs the
    stop callbacks (e.g. writes a checkpoint) and exits 0. Empty: install no handler."""
    # ---- checkpoints (see varuna/runtime/checkpoint.py and docs/checkpoints.md)
    checkpoint_dir: str | None = None
    """Global checkpoint store (shared filesystem or mounted blob); default $VARUNA_CHECKPOINT_DIR.
    When set, a graceful stop (SIGUSR1/SIGTERM) checkpoints before exiting."""
    checkpoint_every: int = 0
    """Save every N steps (0: only on a graceful stop or an explicit ``save_checkpoint``)."""
    keep_checkpoints: int = 2
    """How many complete checkpoints to keep (the newest complete one is never deleted first)."""
    local_checkpoint_dir: str | None = None
    """Fast local disk where files are written before the background copy; default a tmp dir."""
    checkpoint_snapshot: str = "auto"
    """How a save gets the state off the training path: "memory" (a host copy, written in the
    background), "disk" (written to local disk from the live tensors before training goes on: no
    extra copy, for a stage that fills its memory) or "auto" (memory when the copy fits in half of
    the free memory; docs/checkpoints.md)."""
    checkpoint_format: str | None = None
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
    tensorboard_dir: str | None = None
    """Also write the per-step metrics as TensorBoard events here (rank 0; loss, grad norm,
    samples/s, step time, P, D; text events for resumes and morphs): see
    varuna/runtime/tensorboard.py. None: $VARUNA_TENSORBOARD_DIR (``varuna-launch
    --tensorboard-dir``), else off. Needs ``pip install 'varuna[tensorboard]'``."""

    def validate(self) -> None:
        """Raise ``ValueError`` (one line) for a setting the engine cannot run with.

        Example::

            VarunaConfig(global_batch_size=32, micro_batch_size=4, schedule="zigzag").validate()
            # ValueError: unknown schedule 'zigzag'; choose one of varuna, gpipe, 1f1b, 2bw
        """
        if self.schedule not in SCHEDULE_KINDS:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULE_KINDS)}")
        if self.stash_headroom < 0:
            raise ValueError(f"stash_headroom must be >= 0 (got {self.stash_headroom})")
        kind = schedule_kind(self.schedule)
        kind.check_chunks(self.chunks)
        if kind.chunked and self.chunks < 2:
            raise ValueError(
                f"schedule {self.schedule} needs chunks >= 2 (got {self.chunks}); "
                "with one chunk use varuna or 1f1b"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose fp32, bf16 or fp16")
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise ValueError("--global-batch-size and --micro-batch-size must be >= 1")
        if not self.comm_timeout_s > 0:  # also refuses NaN
            raise ValueError(f"comm_timeout_s must be > 0 (got {self.comm_timeout_s})")
        if not self.peer_timeout_s >= 0:
            raise ValueError(
                f"peer_timeout_s must be >= 0, 0 to turn the peer watch off (got {self.peer_timeout_s})"
            )
        if self.checkpoint_snapshot not in ("auto", "memory", "disk"):
            raise ValueError(
                f"checkpoint_snapshot must be 'auto', 'memory' or 'disk' (got {self.checkpoint_snapshot!r})"
            )
        if self.plan_cost not in (None, *PLAN_COSTS):
            raise ValueError(f"unknown plan_cost {self.plan_cost!r}; choose {' or '.join(PLAN_COSTS)}")
        n = self.auto_cutpoints
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"auto_cutpoints must be an integer >= 1 (got {self.auto_cutpoints!r})")
        if self.auto_cutpoints is not None and self.cut_after:
            raise ValueError(
                "auto_cutpoints and cut_after both set: cut-points are either automatic or placed by name; "
                "drop one (--auto-cutpoints or --cut-after)"
            )
        if isinstance(self.cut_after, str):
            self.cut_after = tuple(x for x in self.cut_after.split(",") if x.strip())
        self._validate_tensorboard_dir()
        if self.max_nonfinite_steps < 0:
            raise ValueError(
                f"max_nonfinite_steps must be >= 0, 0 to never stop (got {self.max_nonfinite_steps})"
            )
        self._validate_mixed()

    def _validate_mixed(self) -> None:
        """Shares and speeds as tuples of the right kind; their counts are checked against D and P
        once the layout is known (``Engine``)."""
        if self.replica_shares is not None:
            self.replica_shares = tuple(self.replica_shares)
            if not self.replica_shares or any(
                isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in self.replica_shares
            ):
                raise ValueError(
                    f"replica_shares {self.replica_shares} must be whole numbers >= 1 of micro-batches per "
                    "replica, one per replica (or None for an even split)"
                )
        if self.stage_speeds is not None:
            self.stage_speeds = tuple(self.stage_speeds)
            if not self.stage_speeds or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")
                for v in self.stage_speeds
            ):
                raise ValueError(
                    f"stage_speeds {self.stage_speeds} must be finite numbers > 0, one per stage "
                    "(or None when every stage's VM is alike)"
                )


    def _validate_tensorboard_dir(self) -> None:
        d = self.tensorboard_dir
        if d is None:
            return
        if not isinstance(d, (str, os.PathLike)) or not str(d).strip():
            raise ValueError(
                f"tensorboard_dir must be a directory path, or None for no TensorBoard output (got {d!r})"
            )
        self.tensorboard_dir = os.fspath(d)
        if os.path.exists(d) and not os.path.isdir(d):
            raise ValueError(
                f"tensorboard_dir {self.tensorboard_dir!r} is a file, not a directory; "
                "pick a directory for the event files"
            )


def adopt_plan(config: VarunaConfig, plan: RunPlan) -> str | None:
    """Apply the launcher's run plan to ``config`` in place (Note [Run plan] in varuna/core/env.py).

    The plan's global batch and schedule must be the script's (else ``ValueError``, one line
    naming both values and the fix); its micro-batch size and stage ranges are adopted (the
    simulator chose them for this cluster), and its model chunks per process (``--chunks``) unless
    the script set other chunks than 1 itself (``ValueError``). Returns the line to print (on
    rank 0) when the planned micro-batch size overrides the script's, else None.

    Example::

        >>> cfg = VarunaConfig(global_batch_size=32, micro_batch_size=4)
        >>> adopt_plan(cfg, RunPlan(stage_ranges=((0, 1), (2, 3)))), cfg.stage_ranges
        (None, [(0, 1), (2, 3)])
    """
    if plan.global_batch_size is not None and plan.global_batch_size != config.global_batch_size:
        raise ValueError(
            f"the launcher planned global batch {plan.global_batch_size} (VARUNA_GLOBAL_BATCH_SIZE) but the "
            f"script asks for {config.global_batch_size}: pass the same --global-batch-size to "
            "varuna-launch and the script"
        )
    if plan.schedule is not None and plan.schedule != config.schedule:
        raise ValueError(
            f"the launcher planned schedule {plan.schedule} (VARUNA_SCHEDULE) but the script asks for "
            f"{config.schedule}: pass the same --schedule to varuna-launch and the script"
        )
    note = None
    if plan.chunks is not None:
        if config.chunks not in (1, plan.chunks):
            raise ValueError(
                f"the launcher planned chunks={plan.chunks} (VARUNA_CHUNKS, --chunks) but the script asks "
                f"for chunks={config.chunks}: pass the same --chunks to varuna-launch, or leave chunks "
                "out of the script"
            )
        config.chunks = plan.chunks
    if plan.micro_batch_size is not None:
        if plan.micro_batch_size != config.micro_batch_size:
            note = (
                f"varuna: using the launcher's planned micro-batch size {plan.micro_batch_size} "
                f"(VARUNA_MICRO_BATCH_SIZE) instead of the script's {config.micro_batch_size}"
            )
        config.micro_batch_size = plan.micro_batch_size
    if plan.stage_ranges is not None:
        config.stage_ranges = [tuple(r) for r in plan.stage_ranges]
    # The planner knows the cluster's VM types: its shares and speeds stand (as its m does).
    if plan.replica_shares is not None:
        config.replica_shares = plan.replica_shares
    if plan.stage_speeds is not None:
        config.stage_speeds = plan.stage_speeds
    return note


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


def adopt_cut_env(config: VarunaConfig, environ: Mapping[str, str] | None = None) -> None:
    """Fill ``cut_after``, ``auto_cutpoints`` and ``plan_cost`` from the environment where the
    script left them unset (``varuna-launch --cut-after/--auto-cutpoints/--plan-cost`` export
    ``VARUNA_CUT_AFTER``, ``VARUNA_AUTO_CUTPOINTS``, ``VARUNA_PLAN_COST``). A bad value raises
    ``ValueError`` naming the variable.

    Example::

        >>> cfg = VarunaConfig(global_batch_size=8, micro_batch_size=2)
        >>> adopt_cut_env(cfg, {"VARUNA_CUT_AFTER": "model.layers.*,lm_head"})
        >>> cfg.cut_after, cfg.plan_cost
        (('model.layers.*', 'lm_head'), 'flop')
    """
    environ = os.environ if environ is None else environ
    script_cuts = config.cut_after is not None or config.auto_cutpoints is not None
    raw = environ.get("VARUNA_CUT_AFTER", "").strip()
    if raw and not script_cuts:
        config.cut_after = tuple(x.strip() for x in raw.split(",") if x.strip())
    raw = environ.get("VARUNA_AUTO_CUTPOINTS", "").strip()
    if raw and not script_cuts:
        try:
            config.auto_cutpoints = int(raw)
        except ValueError:
            raise ValueError(
                f"VARUNA_AUTO_CUTPOINTS={raw!r} is not an integer; give the number of cut-points"
            ) from None
    if config.plan_cost is None:
        raw = environ.get("VARUNA_PLAN_COST", "").strip()
        if raw and raw not in PLAN_COSTS:
            raise ValueError(f"VARUNA_PLAN_COST={raw!r}: choose {' or '.join(PLAN_COSTS)}")
        config.plan_cost = raw or "flop"
