"""The training engine: one process = one stage of one replica pipeline.

Example (the same script runs at any P×D under ``varuna-launch``)::

    engine = varuna.Engine(
        model,
        varuna.VarunaConfig(global_batch_size=32, micro_batch_size=4),
        example_batch=first_batch,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4),
    )
    for batch in batches:               # each batch holds the whole mini-batch (M_total examples)
        result = engine.train_step(batch)
        print(result.step, result.loss)
    engine.close()

What happens in ``train_step`` (Note [Step]): the mini-batch is cut into micro-batches (see
:mod:`varuna.core.batching`); the stage runs its schedule's tasks through the shared
:class:`~varuna.core.schedule.StagePolicy` while sender/receiver threads move activations and
gradients; then gradients are summed over each stage's replicas (and, for parameters that live
on several stages such as tied embeddings, over every copy); one small all-reduce over all
ranks agrees on the global gradient norm, on whether any gradient overflowed and on the loss;
finally every rank steps its optimizer — or every rank skips the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import queue
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from varuna.core.batching import MicroBatch, plan_microbatches
from varuna.core.partition import balanced_stages, stage_of_segment
from varuna.core.schedule import (
    BACKWARD,
    DEFAULT_STASH_HEADROOM,
    FORWARD,
    RECOMPUTE,
    SCHEDULE_KINDS,
    Task,
    get_schedule,
)
from varuna.core.timeline import Timeline
from varuna.cutting.batches import batch_size_of, call_with_batch, slice_batch
from varuna.cutting.cutpoint import CutPoint, ForwardRun, SplitState, StopForward
from varuna.cutting.split import ModelProfile, keyed_seed, materialize_stage, profile_model
from varuna.runtime.comm import Arrival, LinkReceiver, LinkSender
from varuna.runtime.loss_scale import DynamicLossScale

__all__ = ["VarunaConfig", "Engine", "StepResult"]

_PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


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
    """One of varuna, gpipe, 1f1b."""
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
    comm_timeout_s: float = 300.0
    """Every wait on another process gives up after this long."""
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
    resume: str | bool | None = None
    """"1"/True: load the newest complete checkpoint (error if none); "auto": if there is one;
    "0"/False: never. None: $VARUNA_RESUME (default never)."""
    auto_cutpoints: int | None = None
    """Insert up to this many CutPoints automatically into a model that has none (rank 0 picks the
    boundaries from a dry run, every rank applies them; see varuna/cutting/autocut.py). None: use the
    model's."""

    def apply_launcher_env(self, environ=None) -> None:
        """Adopt what ``varuna-launch``'s auto-config chose (``VARUNA_MICRO_BATCH_SIZE``,
        ``VARUNA_STAGE_RANGES="0-3,4-7"``): the simulator picked them for this cluster."""
        env = os.environ if environ is None else environ
        if env.get("VARUNA_MICRO_BATCH_SIZE"):
            self.micro_batch_size = int(env["VARUNA_MICRO_BATCH_SIZE"])
        if env.get("VARUNA_STAGE_RANGES"):
            try:
                self.stage_ranges = [
                    tuple(int(x) for x in part.split("-")) for part in env["VARUNA_STAGE_RANGES"].split(",")
                ]
            except ValueError:
                raise ValueError(
                    f"VARUNA_STAGE_RANGES={env['VARUNA_STAGE_RANGES']!r} is not like '0-3,4-7'"
                ) from None

    def validate(self) -> None:
        if self.schedule not in SCHEDULE_KINDS:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULE_KINDS)}")
        if self.stash_headroom < 0:
            raise ValueError(f"stash_headroom must be >= 0 (got {self.stash_headroom})")
        if self.precision not in _PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose fp32, bf16 or fp16")
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            raise ValueError("--global-batch-size and --micro-batch-size must be >= 1")


@dataclass
class StepResult:
    """What one ``train_step`` did. ``loss`` is the mean over the whole mini-batch (all replicas)."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool
    loss_scale: float
    samples_per_s: float
    wall_time: float


@dataclass
class _Layout:
    world: int
    rank: int
    P: int
    D: int

    @property
    def stage(self) -> int:
        return self.rank % self.P

    @property
    def replica(self) -> int:
        return self.rank // self.P

    def rank_of(self, stage: int, replica: int) -> int:
        return replica * self.P + stage


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


class Engine:
    """Pipeline- and data-parallel training of an unmodified model annotated with CutPoints.

    ``model``: the user's ``nn.Module`` (on CPU, or on ``meta`` for models too big for a host).
    ``example_batch``: one batch in the format ``train_step`` takes (only the first micro-batch
    is used, for the dry run). ``optimizer``: builds the stage's optimizer from its parameters.
    ``loss_fn(output, microbatch)``: the scalar *mean* loss of a micro-batch; default: the model
    returns it. ``param_init(module_name, module)``: how a ``meta`` model's modules are
    initialised (default: ``reset_parameters``).
    """

    def __init__(
        self,
        model: nn.Module,
        config: VarunaConfig,
        *,
        example_batch,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        loss_fn: Callable | None = None,
        param_init: Callable[[str, nn.Module], None] | None = None,
    ) -> None:
        config = dataclasses.replace(config)  # the caller's object stays as it was
        config.apply_launcher_env()
        config.validate()
        self.config = config
        self.loss_fn = loss_fn or _model_returns_loss
        self._owns_pg = False
        self.layout = self._init_distributed(config)
        if config.auto_cutpoints is not None:  # before the dry run, which must see the CutPoints
            from varuna.cutting.autocut import engine_auto_cutpoints

            engine_auto_cutpoints(
                model,
                example_batch,
                config.auto_cutpoints,
                loss_fn=self.loss_fn,
                micro_batch_size=config.micro_batch_size,
                rank=self.layout.rank,
                world=self.layout.world,
            )
        P, D = self.layout.P, self.layout.D
        self.micro_plan = plan_microbatches(config.global_batch_size, config.micro_batch_size, D)
        self.device = self._pick_device(config)
        self.model = model
        self._split = SplitState()

        first = slice_batch(example_batch, 0, min(config.micro_batch_size, batch_size_of(example_batch)))
        # Only rank 0's segment costs are used (it broadcasts the split), and only when it splits.
        measure = self.layout.rank == 0 and config.stage_ranges is None and P > 1
        self.profile: ModelProfile = profile_model(
            model, first, self.loss_fn, timing_reps=config.dry_run_reps, measure=measure, costs=measure
        )
        K = self.profile.num_cutpoints
        if P > 1 and K == 0:
            raise ValueError(
                f"the model has no CutPoint, so it cannot be split into {P} pipeline stages; call "
                "varuna.CutPoint() on activations at stage boundaries, or use --pipeline-depth 1"
            )
        if P > K + 1:
            raise ValueError(
                f"pipeline depth {P} exceeds the {K + 1} segments defined by the model's {K} CutPoints; "
                f"use --pipeline-depth <= {K + 1} or add CutPoints"
            )
        if P > 1:  # refuse hidden dependencies (values crossing a boundary outside a CutPoint)
            from varuna.cutting.tracer import check_splittable

            check_splittable(model, first, self.loss_fn, warn=self.layout.rank == 0)
        self.stage_ranges = self._assign_stages(config)
        self.first_segment, self.last_segment = self.stage_ranges[self.stage]
        self._cutpoints = [m for m in model.modules() if isinstance(m, CutPoint)]
        for cp in self._cutpoints:
            cp._varuna_state = self._split
        self._order = self._cut_order(model)
        self.stage_params = materialize_stage(
            model,
            self.profile,
            self.first_segment,
            self.last_segment,
            self._split,
            device=self.device,
            seed=config.seed,
            param_init=param_init,
        )
        self._trainable = {n: p for n, p in self.stage_params.items() if p.requires_grad}
        self._det = None
        if config.deterministic:
            from varuna.runtime.determinism import DeterministicGrads

            torch.use_deterministic_algorithms(True)
            torch.set_num_threads(config.deterministic_threads)
            if config.canonical_reduction:
                self._det = DeterministicGrads(self)
        self.optimizer = optimizer(list(self._trainable.values()))
        self.scaler = DynamicLossScale(
            scale=config.loss_scale if config.precision == "fp16" else 1.0,
            growth_interval=config.loss_scale_growth_interval,
        )
        self._build_groups()
        self._netem = None
        if self.layout.world > 1:
            from varuna.testing.netem import NetworkConfig, emulate_network

            netcfg = NetworkConfig.from_env()
            if netcfg is not None:  # $VARUNA_NETEM: emulate a slow network for this process
                self._netem = emulate_network(netcfg)
                self._netem.__enter__()
        self._inbox: queue.Queue = queue.Queue()
        self._start_comm()
        self.step_count = 0
        self.executed_orders: list[list[Task]] = []
        self.timeline = Timeline()
        #: set by a stop signal on this rank; agreed by all ranks at the end of the next step
        self.stop_requested = False
        #: called (with the engine) on every rank after the step that agreed to stop
        self.stop_callbacks: list[Callable[[Engine], None]] = []
        self._install_stop_handlers(config.stop_signals)
        # ---- checkpoints (see varuna/runtime/checkpoint.py): save on stop, periodic saves, resume
        from varuna.runtime.checkpoint import Checkpointer

        self.checkpointer = Checkpointer(self)
        self.checkpointer.attach()  # a collective when resuming: every rank loads the same step

    # ------------------------------------------------------------------ setup

    @property
    def stage(self) -> int:
        return self.layout.stage

    @property
    def replica(self) -> int:
        return self.layout.replica

    @property
    def num_stages(self) -> int:
        return self.layout.P

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.layout.P - 1

    def _init_distributed(self, cfg: VarunaConfig) -> _Layout:
        world = dist.get_world_size() if dist.is_initialized() else (_env_int("WORLD_SIZE") or 1)
        P = cfg.pipeline_depth or _env_int("VARUNA_PIPELINE_DEPTH") or 1
        D = cfg.data_parallel or _env_int("VARUNA_DATA_PARALLEL") or max(world // P, 1)
        if P < 1 or D < 1:
            raise ValueError(f"pipeline depth and data parallelism must be >= 1 (got P={P}, D={D})")
        if world != P * D:
            raise ValueError(
                f"world size {world} != pipeline depth {P} x data parallel {D}; launch P×D processes "
                f"(varuna-launch --procs {P * D} --pipeline-depth {P}) or change P/D"
            )
        if world > 1 and not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() and cfg.device != "cpu" else "gloo"
            dist.init_process_group(backend, timeout=timedelta(seconds=cfg.comm_timeout_s))
            self._owns_pg = True
        rank = dist.get_rank() if dist.is_initialized() else 0
        return _Layout(world=world, rank=rank, P=P, D=D)

    def _pick_device(self, cfg: VarunaConfig) -> torch.device:
        if cfg.device:
            return torch.device(cfg.device)
        if torch.cuda.is_available():
            dev = torch.device("cuda", _env_int("LOCAL_RANK") or 0)
            torch.cuda.set_device(dev)
            return dev
        return torch.device("cpu")

    def _assign_stages(self, cfg: VarunaConfig) -> list[tuple[int, int]]:
        P, nseg = self.layout.P, self.profile.num_segments
        if cfg.stage_ranges is not None:
            ranges = [tuple(r) for r in cfg.stage_ranges]
            flat = [s for a, b in ranges for s in range(a, b + 1)]
            if len(ranges) != P or flat != list(range(nseg)):
                raise ValueError(
                    f"stage_ranges {ranges} must be {P} contiguous ranges covering segments 0..{nseg - 1}"
                )
            return ranges
        fwd, bwd = self.profile.fwd_cost, self.profile.bwd_cost
        recompute = cfg.schedule == "varuna" or cfg.recompute
        full = [f + (f if recompute else 0.0) + b for f, b in zip(fwd, bwd)]
        # Varuna's last stage never recomputes, so it can take more segments.
        last = [f + b for f, b in zip(fwd, bwd)] if cfg.schedule == "varuna" else full
        ranges = balanced_stages(full, last, P) if P > 1 else [(0, nseg - 1)]
        if self.layout.world > 1:
            # Timings differ between processes: rank 0's split is the one everybody uses.
            t = torch.tensor([x for r in ranges for x in r], dtype=torch.int64)
            dist.broadcast(t, src=0)
            v = t.tolist()
            ranges = [(v[2 * i], v[2 * i + 1]) for i in range(P)]
        return ranges

    def _cut_order(self, model: nn.Module) -> list[CutPoint]:
        by_name = dict(model.named_modules())
        return [by_name[n] for n in self.profile.cutpoint_names]

    def _build_groups(self) -> None:
        """Create every process group in the same order on every rank (a collective)."""
        L = self.layout
        P, D = L.P, L.D
        self._dp_group = None
        self._act_groups: dict[tuple[int, int], object] = {}
        self._grad_groups: dict[tuple[int, int], object] = {}
        self._shared_groups: list[tuple[object, list[str]]] = []
        self._norm_elsewhere: set[str] = set()
        self._created_groups: list = []  # destroyed by close(): each gloo group keeps threads alive
        if L.world == 1:
            return
        for k in range(P):
            ranks = [L.rank_of(k, d) for d in range(D)]
            g = dist.new_group(ranks) if D > 1 else None
            self._created_groups.append(g)
            if k == L.stage:
                self._dp_group = g
        for d in range(D):
            for k in range(P - 1):
                pair = [L.rank_of(k, d), L.rank_of(k + 1, d)]
                ga = dist.new_group(pair)
                gg = dist.new_group(pair)
                self._created_groups += [ga, gg]
                if L.rank in pair:
                    self._act_groups[(k, d)] = ga
                    self._grad_groups[(k, d)] = gg
        seg_stage = stage_of_segment(self.stage_ranges)
        by_stages: dict[tuple[int, ...], list[str]] = {}
        for name, segs in sorted(self.profile.shared_params().items()):
            stages = tuple(sorted({seg_stage[s] for s in segs}))
            if len(stages) > 1:
                by_stages.setdefault(stages, []).append(name)
        for stages, names in sorted(by_stages.items()):
            ranks = sorted(L.rank_of(k, d) for k in stages for d in range(D))
            g = dist.new_group(ranks)
            self._created_groups.append(g)
            if L.stage in stages:
                self._shared_groups.append((g, names))
                if stages[0] != L.stage:
                    self._norm_elsewhere.update(names)

    def _shared_names(self) -> set[str]:
        return {n for _, names in self._shared_groups for n in names}

    def _start_comm(self) -> None:
        L, t = self.layout, self.config.comm_timeout_s
        k, d = L.stage, L.replica
        self._act_out = self._grad_out = self._act_in = self._grad_in = None
        if k < L.P - 1:
            nxt = L.rank_of(k + 1, d)
            self._act_out = LinkSender(
                f"act-send-{k}", nxt, self._act_groups[(k, d)], self.device, self._inbox, t
            )
            self._grad_in = LinkReceiver(
                f"grad-recv-{k}", BACKWARD, nxt, self._grad_groups[(k, d)], self.device, self._inbox, t
            )
        if k > 0:
            prv = L.rank_of(k - 1, d)
            self._act_in = LinkReceiver(
                f"act-recv-{k}", FORWARD, prv, self._act_groups[(k - 1, d)], self.device, self._inbox, t
            )
            self._grad_out = LinkSender(
                f"grad-send-{k}", prv, self._grad_groups[(k - 1, d)], self.device, self._inbox, t
            )

    def _install_stop_handlers(self, names: tuple[str, ...]) -> None:
        import signal
        import threading

        if not names or threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            # Only a flag: the step in flight finishes, then all ranks agree (Note [Step]).
            self.stop_requested = True

        for name in names:
            signal.signal(getattr(signal, name), handler)

    # ------------------------------------------------------------------ public API

    def parameters(self) -> Iterable[nn.Parameter]:
        """This stage's trainable parameters (what its optimizer updates)."""
        return self._trainable.values()

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        """This stage's trainable parameters keyed by the original model's names."""
        return self._trainable.items()

    def describe(self) -> dict:
        """The resolved configuration (P, D, m, Nm, stage ranges...), JSON-serialisable."""
        return {
            **asdict(self.config),
            "P": self.layout.P,
            "D": self.layout.D,
            "m": self.config.micro_batch_size,
            "Nm": [len(p) for p in self.micro_plan],
            "stage_ranges": self.stage_ranges,
            "cutpoints": self.profile.cutpoint_names,
            "shared_params": {k: list(v) for k, v in self.profile.shared_params().items()},
        }

    def train_step(self, batch) -> StepResult:
        """Run one mini-batch (M_total examples) through the pipeline and step the optimizer."""
        t_start = time.perf_counter()
        self._check_batch(batch)
        self.step_count += 1
        self.optimizer.zero_grad(set_to_none=True)
        mbs = self.micro_plan[self.replica]
        if self._det is not None:
            self._det.begin_step(mbs, sum(len(p) for p in self.micro_plan))
        local_loss = self._run_pipeline(batch, mbs, train=True)
        grad_norm, skipped, stop = self._finish_step(local_loss)
        self.checkpointer.after_step()  # periodic checkpoint at this mini-batch boundary, if configured
        loss = self._last_loss
        wall = time.perf_counter() - t_start
        result = StepResult(
            step=self.step_count,
            loss=loss,
            grad_norm=grad_norm,
            skipped=skipped,
            loss_scale=self.scaler.scale,
            samples_per_s=self.config.global_batch_size / wall,
            wall_time=time.time(),
        )
        if stop:
            self._stop()
        return result

    def _stop(self) -> None:
        """Graceful stop agreed by every rank: callbacks (checkpoint), clean shutdown, exit 0."""
        for cb in self.stop_callbacks:
            cb(self)
        self.close()
        raise SystemExit(0)

    @torch.no_grad()
    def evaluate(self, batch) -> float:
        """Mean loss of ``batch`` (M_total examples) in eval mode, without touching parameters."""
        self._check_batch(batch)
        was_training = self.model.training
        self.model.eval()
        try:
            local = self._run_pipeline(batch, self.micro_plan[self.replica], train=False)
            return self._allreduce_scalars(torch.tensor([0.0, 0.0, local, 0.0], dtype=torch.float64))[2]
        finally:
            self.model.train(was_training)

    def gather_timeline(self) -> Timeline | None:
        """Every rank's recorded task events (``record_timeline=True``), merged on rank 0.

        A collective: call it on every rank; rank 0 gets the :class:`Timeline`, others None.
        Times are ``time.perf_counter()`` seconds, comparable across processes of one host (a
        system-wide monotonic clock on Linux); the origin is shifted to the earliest event.
        """
        ops = ["F", "R", "B", "AR", "OPT"]
        rows = [
            [
                e.stage,
                e.replica,
                ops.index(e.op),
                -1 if e.microbatch is None else e.microbatch,
                e.start_s,
                e.end_s,
            ]
            for e in self.timeline.events
        ]
        local = torch.tensor(rows, dtype=torch.float64).reshape(-1, 6)
        if self.layout.world > 1:
            n = torch.tensor([local.shape[0]], dtype=torch.int64)
            counts = [torch.zeros_like(n) for _ in range(self.layout.world)]
            dist.all_gather(counts, n)
            width = max(int(c) for c in counts)
            padded = torch.zeros(width, 6, dtype=torch.float64)
            padded[: local.shape[0]] = local
            parts = [torch.empty_like(padded) for _ in range(self.layout.world)]
            dist.all_gather(parts, padded)
            local = torch.cat([p[: int(c)] for p, c in zip(parts, counts)])
        if self.layout.rank != 0:
            return None
        t0 = float(local[:, 4].min()) if local.numel() else 0.0
        tl = Timeline(
            metadata={
                "source": "runtime",
                "P": self.layout.P,
                "D": self.layout.D,
                "m": self.config.micro_batch_size,
                "schedule": self.config.schedule,
            }
        )
        for st, rep, op, mb, a, b in local.tolist():
            tl.add(int(st), int(rep), ops[int(op)], None if mb < 0 else int(mb), a - t0, b - t0)
        return tl

    def close(self) -> None:
        """Stop communication threads and, if the engine created it, the process group."""
        for w in (self._act_out, self._grad_out, self._act_in, self._grad_in):
            if w is not None:
                w.close()
        if self._netem is not None:
            self._netem.__exit__(None, None, None)
            self._netem = None
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()  # every group with it
            self._owns_pg = False
        elif dist.is_initialized():
            # The caller owns the default group and may build more engines in this process.
            for g in getattr(self, "_created_groups", []):
                if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(g)
        self._created_groups = []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the pipeline

    def _check_batch(self, batch) -> None:
        n = batch_size_of(batch)
        if n != self.config.global_batch_size:
            raise ValueError(
                f"train_step got a batch of {n} examples but global_batch_size is "
                f"{self.config.global_batch_size}; pass the whole mini-batch on every rank"
            )

    def _reseed(self, microbatch: int) -> Callable[[int], None]:
        seed, step = self.config.seed, self.step_count
        # Seed only the generators this process draws from: torch.manual_seed would also queue
        # lazy seeding of every accelerator backend (with a captured stack), per segment.
        gens = [torch.default_generator]
        if self.device.type == "cuda":
            gens.append(torch.cuda.default_generators[self.device.index or 0])

        if not self.config.rng_keyed:  # negative control: draws depend on the process's history
            return lambda segment: None

        def reseed(segment: int) -> None:
            s = keyed_seed(seed, step, microbatch, segment)
            for g in gens:
                g.manual_seed(s)

        return reseed

    def _autocast(self):
        dt = _PRECISIONS[self.config.precision]
        if dt is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dt)

    def _forward(self, batch, mb: MicroBatch, inputs, with_grad: bool):
        """Run the user's forward for this stage; returns the loss (last stage) or outputs."""
        data = slice_batch(batch, mb.start, mb.end)
        reseed = self._reseed(mb.index)
        on_segment = reseed
        if self._det is not None and self._det.aliases:
            det = self._det

            def on_segment(segment: int) -> None:
                reseed(segment)
                det.on_segment(segment)

        run = ForwardRun(
            cutpoints=self._order,
            first_segment=self.first_segment,
            last_segment=self.last_segment if not self.is_last_stage else len(self._order),
            num_segments=self.profile.num_segments,
            inputs=inputs,
            on_segment=on_segment,
        )
        self._split.run = run
        try:
            with torch.set_grad_enabled(with_grad), self._autocast():
                on_segment(0)
                try:
                    out = call_with_batch(self.model, data)
                except StopForward as stop:
                    return stop.outputs
                if not self.is_last_stage:
                    raise RuntimeError(
                        f"stage {self.stage}'s forward returned without reaching CutPoint "
                        f"#{self.last_segment}; "
                        "the forward must pass every CutPoint on every call"
                    )
                return self.loss_fn(out, data)
        finally:
            self._split.run = None
            if self._det is not None:
                self._det.restore()

    def _run_pipeline(self, batch, mbs: list[MicroBatch], *, train: bool) -> float:
        P, k = self.layout.P, self.stage
        n = len(mbs)
        if train:
            sched = get_schedule(self.config.schedule, P, n, self.config.recompute)
            policy = sched.policy(k, stash_headroom=self.config.stash_headroom)
            recomputed = sched.recomputed(k)
        else:
            from varuna.core.schedule import StagePolicy

            policy = StagePolicy([Task(FORWARD, i) for i in range(n)], k, P, opportunistic=False)
            recomputed = frozenset(range(n))  # forward-only: never keep a graph
        for sender in (self._act_out, self._grad_out):
            if sender is not None:
                sender.flush()  # last step's sends (all received by now: the step ended everywhere)
        if self._act_in is not None:
            self._act_in.expect(n)
        if self._grad_in is not None and train:
            self._grad_in.expect(n)
        # Dropout draws are keyed by work (Note [Step]); the user's RNG stream is restored after.
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            loss_sum = self._execute(batch, mbs, policy, recomputed, train)
        self.executed_orders.append(list(policy.executed))
        return loss_sum

    def _execute(
        self, batch, mbs: list[MicroBatch], policy, recomputed: frozenset[int], train: bool
    ) -> float:
        k = self.stage
        acts: dict[int, tuple[torch.Tensor, ...]] = {}
        grads: dict[int, tuple[torch.Tensor, ...]] = {}
        stash: dict[int, tuple[torch.Tensor, ...] | None] = {}
        graphs: dict[int, tuple] = {}
        M = self.config.global_batch_size
        scale = self.scaler.scale
        loss_sum = 0.0
        timeout = self.config.comm_timeout_s
        record = self.config.record_timeline
        while not policy.finished:
            self._drain(policy, acts, grads, block=False, timeout=timeout)
            task = policy.next_task()
            if task is None:
                self._drain(policy, acts, grads, block=True, timeout=timeout)
                continue
            t0 = time.perf_counter()
            i, mb = task.microbatch, mbs[task.microbatch]
            if task.op == FORWARD:
                inputs = acts.pop(i, None)
                keep_graph = train and i not in recomputed
                if inputs is not None and keep_graph:
                    inputs = tuple(_leaf(x) for x in inputs)
                out = self._forward(batch, mb, inputs, with_grad=keep_graph)
                if self.is_last_stage:
                    loss_value = float(out.detach())  # a sync point on GPU; one per micro-batch
                    loss_sum += loss_value * mb.size / M
                    if self._det is not None:
                        self._det.losses[mb.index] = loss_value
                    if keep_graph:
                        graphs[i] = (inputs, out)
                    elif train:
                        stash[i] = inputs
                else:
                    self._act_out.send(i, tuple(x.detach() for x in out))
                    if keep_graph:
                        graphs[i] = (inputs, out)
                    elif train:
                        stash[i] = inputs
            elif task.op == RECOMPUTE:
                inputs = stash.pop(i)
                if inputs is not None:
                    inputs = tuple(_leaf(x) for x in inputs)
                out = self._forward(batch, mb, inputs, with_grad=True)
                graphs[i] = (inputs, out)
            else:
                inputs, out = graphs.pop(i)
                if self.is_last_stage:
                    (out * (mb.size / M * scale)).backward()
                else:
                    g = grads.pop(i)
                    pairs = [(o, gi) for o, gi in zip(out, g) if o.requires_grad]
                    if pairs:
                        torch.autograd.backward([o for o, _ in pairs], [gi for _, gi in pairs])
                if self._det is not None and train:
                    self._det.capture(mb.index)
                if self._grad_out is not None:
                    self._grad_out.send(
                        i,
                        tuple(
                            (x.grad if x.grad is not None else torch.zeros_like(x))
                            for x in inputs
                            if x.is_floating_point()
                        ),
                    )
                del inputs, out
            policy.complete(task)
            if record:
                self.timeline.add(k, self.replica, task.op, mb.index, t0, time.perf_counter())
        return loss_sum

    def _drain(self, policy, acts, grads, *, block: bool, timeout: float) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block:
                    raise TimeoutError(
                        f"stage {self.stage} replica {self.replica} waited {timeout:.0f}s for an "
                        "activation or "
                        "gradient; a peer process is stuck or gone (raise VarunaConfig.comm_timeout_s if "
                        "steps are legitimately this slow)"
                    ) from None
                return
            if isinstance(item, Exception):
                raise RuntimeError(f"communication thread failed: {item}") from item
            assert isinstance(item, Arrival)
            (acts if item.kind == FORWARD else grads)[item.microbatch] = item.tensors
            policy.arrived(item.kind, item.microbatch)
            block = False

    # ------------------------------------------------------------------ gradient sync & step

    def _allreduce_scalars(self, v: torch.Tensor) -> list[float]:
        if self.layout.world > 1:
            dist.all_reduce(v)
        return v.tolist()

    def _reduce_grads(self) -> None:
        params = self._trainable
        shared = self._shared_names()
        for p in params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        plain = [p for n, p in params.items() if n not in shared]
        if self._dp_group is not None:
            _allreduce_bucketed([p.grad for p in plain], self._dp_group)
        for group, names in self._shared_groups:
            _allreduce_bucketed([params[n].grad for n in names if n in params], group)

    def _finish_step(self, local_loss: float) -> tuple[float, bool, bool]:
        t0 = time.perf_counter()
        if self._det is not None:
            self._det.reduce()
        else:
            self._reduce_grads()
        if self.config.record_timeline:
            self.timeline.add(self.stage, self.replica, "AR", None, t0, time.perf_counter())
        params = self._trainable
        grads = [p.grad for p in params.values()]
        # Each gradient counts once in the global norm: replica 0 only, and a parameter held by
        # several stages only on the first of them.
        counted = [p.grad for n, p in params.items() if self.replica == 0 and n not in self._norm_elsewhere]
        sumsq = torch.zeros((), dtype=torch.float64)
        nonfinite = 0.0
        if grads:
            norms = torch._foreach_norm(grads)
            all_sq = torch.stack([x.double() ** 2 for x in norms]).sum()
            nonfinite = 0.0 if bool(torch.isfinite(all_sq)) else 1.0
            if counted:
                sumsq = torch.stack([x.double() ** 2 for x in torch._foreach_norm(counted)]).sum()
        t_ar = time.perf_counter()
        if self._det is not None:
            v = self._det.scalar_slots(nonfinite > 0, self.stop_requested, self._norm_elsewhere)
            sizes = [mb.size for plan in self.micro_plan for mb in plan]
            total_sq, overflow, loss, stop = self._det.read_slots(
                self._allreduce_scalars(v), sizes, self.config.global_batch_size
            )
        else:
            v = torch.tensor(
                [float(sumsq) if nonfinite == 0 else 0.0, nonfinite, local_loss, float(self.stop_requested)],
                dtype=torch.float64,
            )
            total_sq, overflow, loss, stop = self._allreduce_scalars(v)
            stop = stop > 0
        self._last_loss = loss
        scale = self.scaler.scale
        skipped = overflow > 0
        if self.config.precision == "fp16":
            self.scaler.update(found_inf=skipped)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            return math.inf, True, stop
        norm = math.sqrt(total_sq) / scale
        coef = 1.0 / scale
        if self.config.max_grad_norm is not None:
            # Same rule as torch.nn.utils.clip_grad_norm_ (coefficient clamped to 1).
            coef *= min(1.0, self.config.max_grad_norm / (norm + 1e-6))
        if coef != 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        self.optimizer.step()
        if self.config.record_timeline:
            self.timeline.add(self.stage, self.replica, "OPT", None, t_ar, time.perf_counter())
        return norm, False, stop

    # ---- checkpoints (see varuna/runtime/checkpoint.py)

    def save_checkpoint(self, directory: str | os.PathLike | None = None, *, wait: bool = False):
        """Checkpoint the state after ``step_count`` steps; every rank calls it at the same step.

        Files go to local disk now and to ``directory`` (default ``config.checkpoint_dir``) in the
        background; the checkpoint exists once rank 0 wrote its manifest (``wait=True`` blocks
        until this rank's part is copied, rank 0 until the manifest is written). Returns the
        step directory, or None when skipped because the previous save is still being copied.

        Example::

            engine.train_step(batch)
            engine.save_checkpoint("/mnt/ckpt", wait=True)   # /mnt/ckpt/step_00000001
        """
        return self.checkpointer.save(directory, wait=wait)

    def load_checkpoint(self, directory: str | os.PathLike | None = None, *, step: int | None = None) -> int:
        """Load the newest complete checkpoint (or ``step``) saved at any P×D; every rank calls it.

        Each rank reads only the files holding its stage's parameters; corrupt or incomplete
        checkpoints are skipped with a warning. Returns the step loaded: the next
        ``train_step`` is that step + 1.

        Example::

            step = engine.load_checkpoint("/mnt/ckpt")
            for s in range(step + 1, total + 1):
                engine.train_step(batches(s))
        """
        return self.checkpointer.load(directory, step=step)

    def state_dict(self) -> dict:
        """This stage's state by canonical parameter name: ``step``, ``params``, ``optimizer``
        (name-keyed, see :func:`varuna.runtime.checkpoint.optimizer_state_by_name`), ``loss_scale``.

        Example::

            sd = engine.state_dict()
            engine.load_state_dict(sd)
        """
        from varuna.runtime.checkpoint import engine_state_dict

        return engine_state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Inverse of :meth:`state_dict`; ``state["params"]`` may hold the whole model's names."""
        from varuna.runtime.checkpoint import load_engine_state_dict

        load_engine_state_dict(self, state)


def _allreduce_bucketed(tensors: list[torch.Tensor], group, bucket_bytes: int = 32 << 20) -> None:
    """Sum ``tensors`` across ``group`` in flat buckets (few large messages beat many small)."""
    bucket: list[torch.Tensor] = []
    size = 0

    def flush():
        if not bucket:
            return
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for t, r in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(r)
        bucket.clear()

    for t in tensors:
        bucket.append(t)
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            flush()
            size = 0
    flush()


def _leaf(x: torch.Tensor) -> torch.Tensor:
    t = x.detach()
    if t.is_floating_point():
        t.requires_grad_(True)
    return t




def _model_returns_loss(output, batch):
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    raise TypeError(
        "the model's forward must return a scalar loss, or pass loss_fn=lambda output, batch: ... to Engine"
    )
