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

import atexit
import dataclasses
import gc
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import nn

from varuna.core import lifecycle
from varuna.core.batching import plan_microbatches
from varuna.core.config_error import ConfigError, install_excepthook
from varuna.core.env import ProcessEnv
from varuna.core.partition import check_speeds
from varuna.core.schedule import Task, schedule_kind
from varuna.core.selective_recompute import recompute_set
from varuna.core.timeline import Timeline
from varuna.cutting.batches import batch_size_of, slice_batch
from varuna.cutting.cutpoint import CarryPlan, CutPoint, SplitState
from varuna.cutting.loss import default_loss
from varuna.cutting.split import ModelProfile, materialize_stage
from varuna.runtime import whole_state
from varuna.runtime.buffers import stage_buffer_names
from varuna.runtime.checkpoint import Checkpointer, checkpoint_format
from varuna.runtime.config import StepResult, VarunaConfig, adopt_plan, adopt_settings
from varuna.runtime.determinism import cuda_deterministic_env, deterministic_kernels
from varuna.runtime.executor import ScheduleExecutor, StageModel
from varuna.runtime.flops import StepFlops, engine_flops, step_metrics
from varuna.runtime.grad_sync import GradientSync, allreduce_scalars
from varuna.runtime.groups import ProcessGroups, StageLinks, build_groups
from varuna.runtime.layout import Layout, choose_transport, init_distributed, pick_device
from varuna.runtime.loss_scale import DynamicLossScale, NonFiniteLosses, NonFiniteLossStop
from varuna.runtime.no_flush import MAX_WINDOW_STEPS, WindowFeed, no_flush_unsupported
from varuna.runtime.peer_watch import PeerWatch, watching
from varuna.runtime.plugins import run_plugins
from varuna.runtime.sharded_optimizer import (
    FlatParameters,
    ShardedOptimizer,
    stage_optimizer_state,
)
from varuna.runtime.stages import (
    assign_stages,
    chunks_per_process,
    measures_activations,
    planning_profile,
    stage_memory_for,
)
from varuna.runtime.tensorboard import TensorBoardLog, adopt_tensorboard_settings, require_tensorboard
from varuna.runtime.timeline_gather import gather_timeline
from varuna.runtime.weight_versions import stale_weights, weight_versions_for
from varuna.runtime.whole_state import StageExtras, preserved_buffers

__all__ = ["VarunaConfig", "Engine", "StepResult", "NonFiniteLossStop"]


def _adopt_environment(config: VarunaConfig) -> tuple[ProcessEnv, str | None]:
    """Read this process's environment once (Note [One parser]), adopt the run plan and the
    launcher's settings into ``config`` and check them: settings only, no user code, so any
    ``ValueError`` is a :class:`ConfigError` (one line, Note [One-line refusals])."""
    try:
        env = ProcessEnv.from_env()
        plan_note = adopt_plan(config, env.plan)  # Note [Run plan] in varuna/core/env.py
        config.fill_planned_defaults()
        adopt_settings(config, env.settings)
        adopt_tensorboard_settings(config, env.settings)
        config.validate()
        checkpoint_format(config.checkpoints.format)  # an unknown format: one line, before any group
        for what, where in (("checkpoints.dir", config.checkpoints.dir or env.settings.checkpoint_dir),
                            ("checkpoints.local_dir", config.checkpoints.local_dir)):
            if where and os.path.exists(where) and not os.path.isdir(where):  # else every save fails
                raise ConfigError(f"{what} {where} is a file, not a directory; pick a directory "
                                  "(varuna-launch --checkpoint-dir DIR; it is created when missing)")
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return env, plan_note


class Engine:
    """Pipeline- and data-parallel training of an unmodified model annotated with CutPoints.

    ``model``: the user's ``nn.Module`` (on CPU, or on ``meta`` for models too big for a host).
    ``example_batch``: one batch in the format ``train_step`` takes (only the first micro-batch is
    used, for the dry run). ``optimizer``: builds the stage's optimizer from its parameters.
    ``loss_fn(output, microbatch)``: the scalar *mean* loss of a micro-batch; default: the model returns
    it. ``param_init(module_name, module)``: how a ``meta`` model's modules are initialised (default:
    ``reset_parameters``). ``lr_scheduler(optimizer)``: builds the stage's learning-rate scheduler
    (e.g. ``lambda opt: CosineAnnealingLR(opt, 1000)``), stepped after every mini-batch and saved
    with the whole state (docs/checkpoints.md "Whole state"); :meth:`register_state` adds your own
    stateful objects.

    Hooks: :meth:`add_step_callback` (after every step, with its :class:`StepResult`),
    :meth:`add_stop_callback` (before a graceful stop exits), and the plugins named in
    ``$VARUNA_ENGINE_PLUGINS`` (varuna/runtime/plugins.py), called with the engine once it is built.
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
        lr_scheduler: Callable[[torch.optim.Optimizer], object] | None = None,
    ) -> None:
        install_excepthook()  # a ConfigError is one line and exit 78 (Note [One-line refusals])
        config = dataclasses.replace(config)  # the caller's object stays as it was (groups are frozen)
        env, plan_note = _adopt_environment(config)
        if config.determinism.enabled:
            cuda_deterministic_env(env)  # before this process's first cuBLAS call (Note [Deterministic CUDA])
        require_tensorboard(config)  # before any group: a missing package stops every rank at once
        self._tb: TensorBoardLog | None = None
        self.config = config
        self.env = env
        self.loss_fn = loss_fn or default_loss
        self.layout: Layout
        _before_rendezvous(model, config, env)
        self.layout, self._owns_pg = init_distributed(
            config.pipeline_depth, config.data_parallel, device=config.device,
            timeout_s=config.timeouts.comm_s, env=env,
        )
        if plan_note and self.layout.rank == 0:
            print(plan_note, flush=True)
        self._step_callbacks: list[Callable[[StepResult], None]] = []
        self._stop_callbacks: list[Callable[[Engine], None]] = []
        self.model = model
        #: what a live morph needs to build this engine again on a fresh model (live_morph.py)
        self.rebuild_args = {"example_batch": example_batch, "optimizer": optimizer, "loss_fn": loss_fn,
                             "param_init": param_init, "lr_scheduler": lr_scheduler}
        self._build_stage(model, example_batch, param_init)
        self._build_training(optimizer)
        self._build_comm(lr_scheduler)
        self.step_count = 0
        self._uncommitted = False  # inside a step whose optimizer step has not run yet
        self.executed_orders: list[list[Task]] = []
        #: set by a stop signal on this rank; agreed by all ranks at the end of the next step
        self.stop_requested = False
        #: live morph (live_trainer.py): asks to regroup at a step boundary; agreed -> agreed_stop
        self.boundary_hook: Callable[[], bool] | None = None
        self.agreed_stop = False
        _on_stop_signals(config.stop_signals, self._signal_stop)
        self.checkpointer = Checkpointer(self)  # save on stop, periodic saves, resume
        self.checkpointer.attach()  # a collective when resuming: every rank loads the same step
        self._nonfinite = NonFiniteLosses(limit=config.numerics.max_nonfinite_steps, rank=self.layout.rank)
        self._watch = PeerWatch.for_world(self.layout.rank, self.layout.world, config.timeouts.peer_s,
                                          stop_signals=config.stop_signals)
        self._close_at_exit()
        self._tb = TensorBoardLog.attach(self)  # after a resume: it notes the resume and any morph
        run_plugins(self, env.settings.engine_plugins)
        lifecycle.emit(lifecycle.BUILT, enabled=env.settings.lifecycle)

    # ------------------------------------------------------------------ setup

    def _build_stage(self, model: nn.Module, example_batch, param_init) -> None:
        """Dry run, stage assignment and materialisation of this process's stage."""
        config, P = self.config, self.layout.P
        with preserved_buffers(model):  # the dry runs must not move BatchNorm's statistics
            self._dry_runs(model, example_batch)
        v = self.chunks
        self.stage_ranges = assign_stages(
            self.layout,
            self.profile,
            schedule=config.schedule,
            recompute=config.pipeline.recompute,
            explicit=config.pipeline.stage_ranges,
            speeds=config.pipeline.stage_speeds,
            chunks=v,
            memory=stage_memory_for(
                config, self.layout, self.device, self.micro_plan, self.profile.num_segments),
        )
        self.flops: StepFlops | None = engine_flops(self)  # a collective: rank 0's count reaches every rank
        mine = self.stage_ranges[self.stage :: P]  # interleaved: virtual stages stage, stage + P, ...
        self.first_segment, self.last_segment = mine[0][0], mine[-1][1]
        for cp in model.modules():
            if isinstance(cp, CutPoint):
                cp._varuna_state = self._split
        by_name = dict(model.named_modules())
        self._order: list[CutPoint] = [by_name[n] for n in self.profile.cutpoint_names]
        self.stage_params = materialize_stage(
            model,
            self.profile,
            self.first_segment,
            self.last_segment,
            self._split,
            device=self.device,
            seed=config.seed,
            param_init=param_init,
            segments=[s for a, b in mine for s in range(a, b + 1)],
        )
        self._trainable = {n: p for n, p in self.stage_params.items() if p.requires_grad}

    def _dry_runs(self, model: nn.Module, example_batch) -> None:
        """Cut-points, the micro-batch plan, the dry run's profile, the hidden-dependency check."""
        config, P = self.config, self.layout.P
        _place_cutpoints(model, example_batch, config, self.loss_fn, self.layout)  # before the dry run
        self.micro_plan = _plan_step(config, self.layout)
        self.device = pick_device(config.device, local_rank=self.env.local_rank)
        self._split = SplitState()
        first = slice_batch(example_batch, 0, min(config.micro_batch_size, batch_size_of(example_batch)))
        self.profile: ModelProfile = planning_profile(
            model, first, self.loss_fn, config, self.layout,
            activations=measures_activations(config, self.layout, self.device))
        self.chunks = chunks_per_process(config, P, self.profile.num_cutpoints, self.micro_plan)
        if P > 1:  # refuse hidden dependencies (values crossing a boundary outside a CutPoint)
            from varuna.cutting.tracer import carry_specs, check_splittable

            report = check_splittable(model, first, self.loss_fn, warn=self.layout.rank == 0)
            if report is not None:  # e.g. a rotary embedding every layer reads runs on every stage
                self.profile.glue_modules = set(report.replicated_modules)
                self.profile.carried = carry_specs(report)  # e.g. T5's encoder output, read by the decoder

    def _build_training(self, optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        config = self.config
        # Sharded/offloaded optimizer state: before anything else holds the parameters' storage.
        self._flat = FlatParameters.for_stage(self._trainable, config.optimizer_state, self.layout.D)
        self._det = None
        if config.determinism.enabled:
            from varuna.runtime.determinism import DeterministicGrads

            deterministic_kernels(config.determinism.threads)
            if config._negative_controls.canonical_reduction:
                self._det = DeterministicGrads(
                    model=self.model,
                    profile=self.profile,
                    trainable=self._trainable,
                    first_segment=self.first_segment,
                    last_segment=self.last_segment,
                    layout=self.layout,
                    stage_ranges=self.stage_ranges,
                )
        self.optimizer = optimizer(list(self._trainable.values()))
        self.weight_versions = weight_versions_for(config, self._trainable, self.layout.P, self.micro_plan)
        num = config.numerics
        self.scaler = DynamicLossScale(scale=num.loss_scale if config.precision == "fp16" else 1.0,
                                       growth_interval=num.loss_scale_growth_interval)

    def _build_comm(self, lr_scheduler=None) -> None:
        """Process groups (a collective), network emulation, links, buffers, executor, gradient sync."""
        # A collective: every rank agrees on what carries its traffic (docs/gpu.md).
        self.transport = choose_transport(self.layout, self.device, self.config.comm_backend, self.env)
        self._groups = build_groups(self.layout, self.stage_ranges, self.profile.shared_params(),
                                    backend=self.transport.backend)
        segments = [s for a, b in self.stage_ranges[self.stage :: self.layout.P] for s in range(a, b + 1)]
        self.extras = StageExtras(self.model, stage_buffer_names(self.profile, segments), groups=self._groups,
                                  layout=self.layout, micro_plan=self.micro_plan, optimizer=self.optimizer,
                                  lr_scheduler=lr_scheduler)
        if self._det is not None:
            self._det.groups = self._groups
        self._shards = ShardedOptimizer.for_stage(self._flat, self.optimizer, self.layout, self._groups,
                                                  self.config.optimizer_state, self.device, bool(self._det),
                                                  backend=self.transport.backend)
        self._netem = None
        if self.layout.world > 1:
            from varuna.testing.netem import NetworkConfig, emulate_network

            netcfg = NetworkConfig.from_setting(self.env.settings.netem)
            if netcfg is not None:  # $VARUNA_NETEM: emulate a slow network for this process
                self._netem = emulate_network(netcfg)
                self._netem.__enter__()
        inbox: queue.Queue = queue.Queue()
        self._links = StageLinks.start(
            self.layout, self._groups, self.transport.link_device, inbox, self.config.timeouts.comm_s,
            chunks=self.chunks, compute_device=self.device,
        )
        self.timeline = Timeline()
        self._executor = ScheduleExecutor(
            stage=self._stage_model(),
            config=self.config,
            links=self._links,
            inbox=inbox,
            timeline=self.timeline,
            det=self._det,
            stats=self.extras.buffers.stats,
        )
        self._sync = GradientSync(
            layout=self.layout,
            groups=self._groups,
            trainable=self._trainable,
            optimizer=self.optimizer,
            scaler=self.scaler,
            config=self.config,
            timeline=self.timeline,
            det=self._det,
            shards=self._shards,
        )

    def _stage_model(self) -> StageModel:
        """What the executor runs: the engine's materialised stage (its model chunks, interleaved)."""
        stage = StageModel(
            model=self.model,
            loss_fn=self.loss_fn,
            split=self._split,
            cutpoints=self._order,
            cutpoint_names=self.profile.cutpoint_names,
            first_segment=self.first_segment,
            last_segment=self.last_segment,
            num_segments=self.profile.num_segments,
            stage=self.stage,
            replica=self.replica,
            num_stages=self.layout.P,
            device=self.device,
            carry_plan=CarryPlan.for_stage(self.profile.carried, self.first_segment, self.last_segment,
                                           self.is_last_stage),
            recompute_segments=recompute_set(self.config.pipeline.recompute_segments,
                                             self.profile.num_segments),
        )
        stage.set_chunks(self.stage_ranges[self.stage :: self.layout.P], self.profile.carried)
        return stage

    def _close_at_exit(self) -> None:
        """Note [Teardown at exit]: a process group's gloo worker threads live as long as its C++
        object, which lives as long as any Python handle to it -- ``destroy_process_group`` only
        unregisters it. A group still alive at interpreter finalisation is torn down there: a worker
        thread that then needs the GIL (to free a tensor of its last work) is ended by
        ``pthread_exit`` inside C++ code and libstdc++ aborts ("terminate called without an active
        exception", exit -6; ~1 run in 14 of 1×2 worlds beside two CPU burners when the script did not
        destroy its group; once in CI on a graceful stop whose engine still held its subgroups).
        So ``Engine.close`` destroys the groups, drops every handle (``ProcessGroups.release``,
        ``StageLinks.close``) and collects, and a script that returns (or raises) without closing gets
        the same at exit: atexit runs while the interpreter is whole, closing the engine (peer watch,
        link threads, subgroups), then the default group -- atexit is last-in first-out."""
        atexit.unregister(_destroy_default_group)  # once per process, registered before any engine
        atexit.register(_destroy_default_group)
        atexit.register(self.close)  # Engine.close unregisters it

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
    def committed_step(self) -> int:
        """The last step whose optimizer step ran here: a live morph's commit point (docs/live_morph.md)."""
        return self.step_count - int(self._uncommitted)

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.layout.P - 1

    # ------------------------------------------------------------------ hooks

    def add_step_callback(self, fn: Callable[[StepResult], None]) -> None:
        """Call ``fn(result)`` on this rank after every ``train_step`` (also the one that agreed to
        stop), with the step's :class:`StepResult` (step, loss, grad_norm, samples/s, wall time,
        and ``timings``: this rank's mean F/B/R seconds per micro-batch and end-of-step time).
        Example: ``engine.add_step_callback(lambda r: print(r.step, r.loss, r.timings.fwd_s))``."""
        self._step_callbacks.append(fn)

    def add_stop_callback(self, fn: Callable[[Engine], None]) -> None:
        """Call ``fn(engine)`` on every rank after the step all ranks agreed to stop at (a stop
        signal arrived), before the engine closes and exits 0; e.g. to write a checkpoint.
        Example: ``engine.add_stop_callback(lambda eng: print("stopping after", eng.step_count))``."""
        self._stop_callbacks.append(fn)

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
            **{k: v for k, v in asdict(self.config).items() if not k.startswith("_")},
            "P": self.layout.P,
            "D": self.layout.D,
            "m": self.config.micro_batch_size,
            "Nm": [len(p) for p in self.micro_plan],
            "stage_ranges": self.stage_ranges,
            "cutpoints": self.profile.cutpoint_names,
            "shared_params": {k: list(v) for k, v in self.profile.shared_params().items()},
            "device": str(self.device),
            "transport": self.transport.description,
        }

    def train_step(self, batch) -> StepResult:
        """Run one mini-batch (M_total examples) through the pipeline and step the optimizer."""
        t_start = time.perf_counter()
        _check_batch(batch, self.config.global_batch_size)
        self.step_count += 1
        self._uncommitted = True
        with watching(self._watch, self.step_count):  # Note [Peer watch]
            return self._train_step(batch, t_start)

    def _train_step(self, batch, t_start: float) -> StepResult:
        self._sync.zero_grad()
        mbs = self.micro_plan[self.replica]
        if self._det is not None:
            self._det.begin_step(mbs, sum(len(p) for p in self.micro_plan))
        with stale_weights(self.weight_versions):  # 2bw: on the version before (Note [2BW])
            run = self._executor.run(batch, mbs, step=self.step_count, scale=self.scaler.scale, train=True)
        self.executed_orders.append(run.executed)
        t_sync = time.perf_counter()
        hook = self.boundary_hook
        pending = self.extras.before_commit(self.step_count)  # Note [Buffers across replicas]
        outcome = self._sync.finish(
            run.loss_sum, stop_requested=self.stop_requested or (hook is not None and hook()),
            micro_plan=self.micro_plan,
        )
        self.extras.after_commit(pending, skipped=outcome.skipped, loss=outcome.loss)
        sync_s = time.perf_counter() - t_sync
        self._uncommitted = False
        self.checkpointer.after_step()  # periodic checkpoint at this mini-batch boundary, if configured
        result = self._step_result(outcome, run.timings, t_start, sync_s)
        self._report(result)
        self._after_stop(outcome.stop, hook)
        return result

    def _step_result(self, outcome, timings, t_start: float, sync_s: float) -> StepResult:
        wall = time.perf_counter() - t_start
        return StepResult(
            step=self.step_count,
            loss=outcome.loss,
            grad_norm=outcome.grad_norm,
            skipped=outcome.skipped,
            loss_scale=self.scaler.scale,
            samples_per_s=self.config.global_batch_size / wall,
            wall_time=time.time(),
            timings=dataclasses.replace(timings, sync_s=sync_s),
            step_s=wall,
            **step_metrics(self.flops, wall),
        )

    def _report(self, result: StepResult) -> None:
        """Step callbacks, then the NaN/Inf loss policy."""
        for fn in self._step_callbacks:
            fn(result)
        line = self._nonfinite.observe(result.step, result.loss)
        if line is not None:  # every rank saw the same agreed loss: every rank stops here
            self.close()
            raise NonFiniteLossStop(line)

    def _after_stop(self, stop: bool, hook) -> None:
        if stop and hook is not None:
            self.agreed_stop = True  # the live trainer decides: regroup, or stop (Engine._stop)
        elif stop:
            self._stop()

    def train_steps(self, batches: Iterable) -> list[StepResult]:
        """Train one step per mini-batch of ``batches`` (each M_total examples); their results.
        With ``schedule="2bw"`` they run back to back without a pipeline flush, each stage
        updating right after its own last backward of each (Note [No-flush window] in
        varuna/runtime/no_flush.py), drained every ``MAX_WINDOW_STEPS`` (8) and at every periodic
        checkpoint step:
        the weights ``train_step`` would make, sooner. Other kinds: ``train_step`` on each.
        Example: ``results = engine.train_steps(batch_of(t) for t in range(1, 9))``."""
        batches = list(batches)
        for b in batches:
            _check_batch(b, self.config.global_batch_size)
        if self.weight_versions is None:
            return [self.train_step(b) for b in batches]
        reason = no_flush_unsupported(self.config, self.layout.P)
        if reason is not None:
            raise ValueError(reason)
        ckpt = self.checkpointer
        every = ckpt.every if ckpt.directory is not None else 0
        out: list[StepResult] = []
        while batches:  # windows of at most MAX_WINDOW_STEPS, ending at the periodic checkpoint steps
            n = min(len(batches), MAX_WINDOW_STEPS)
            if every:
                n = min(n, every - self.step_count % every)
            out += self._train_window(batches[:n])
            batches = batches[n:]
        return out

    def _train_window(self, batches: list) -> list[StepResult]:
        """One no-flush window (Note [No-flush window]), drained at its end."""
        t_start = time.perf_counter()
        first = self.step_count + 1
        self._uncommitted = True
        self._sync.zero_grad()
        mbs = self.micro_plan[self.replica]
        if self._det is not None:
            self._det.begin_step(mbs, sum(len(p) for p in self.micro_plan))
        feed = WindowFeed(self, batches, first)
        assert self.weight_versions is not None
        try:
            with watching(self._watch, first):
                run = self._executor.run_window(feed, len(mbs), len(batches), scale=self.scaler.scale)
        finally:
            self.weight_versions.select(stale=False)  # the newest version in the parameters
        self.executed_orders.append(run.executed)
        results, stop = feed.results(run, t_start)
        self._uncommitted = False
        self.checkpointer.after_step()  # periodic checkpoint: windows end at its steps
        for result in results:
            self._report(result)
        self._after_stop(stop, self.boundary_hook)
        return results

    def _signal_stop(self, signum, frame) -> None:
        # Only a flag: the step in flight finishes, then all ranks agree (Note [Step]).
        self.stop_requested = True

    def _stop(self) -> None:
        """Graceful stop agreed by every rank: callbacks (checkpoint), clean shutdown, exit 0; exit
        non-zero with one line when a callback failed (e.g. the checkpoint could not be written)."""
        failure = None
        try:
            for cb in self._stop_callbacks:
                cb(self)
        except Exception as e:  # the groups are still torn down (below) before exiting
            failure = f"varuna: graceful stop failed: {e}"
        self.close()
        raise SystemExit(failure or 0)

    @torch.no_grad()
    def evaluate(self, batch) -> float:
        """Mean loss of ``batch`` (M_total examples) in eval mode, without touching parameters."""
        _check_batch(batch, self.config.global_batch_size)
        was_training = self.model.training
        self.model.eval()
        try:
            mbs = self.micro_plan[self.replica]
            run = self._executor.run(batch, mbs, step=self.step_count, scale=self.scaler.scale, train=False)
            self.executed_orders.append(run.executed)
            v = torch.tensor([0.0, 0.0, run.loss_sum, 0.0], dtype=torch.float64)
            loss = allreduce_scalars(v, self.layout.world)[2]
            if self._tb is not None:
                self._tb.on_eval(self.step_count, loss)
            return loss
        finally:
            self.model.train(was_training)

    def gather_timeline(self) -> Timeline | None:
        """Every rank's recorded task events (``metrics.record_timeline=True``), merged on rank 0.

        A collective: call it on every rank; rank 0 gets the :class:`Timeline`, others None.
        Times are ``time.perf_counter()`` seconds, comparable across processes of one host (a
        system-wide monotonic clock on Linux); the origin is shifted to the earliest event.
        """
        L, c = self.layout, self.config
        metadata = {"source": "runtime", "P": L.P, "D": L.D, "m": c.micro_batch_size, "schedule": c.schedule}
        return gather_timeline(self.timeline, self.layout, metadata)

    def close(self, *, collect: bool = True) -> None:
        """Stop the engine's threads and destroy its groups (the default one if it made it); at exit too.
        ``collect=False``: skip the garbage collection that frees handles caught in reference cycles
        (the caller runs it soon, e.g. a live morph while it waits for its peers)."""
        atexit.unregister(self.close)
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self._links.close()
        if self._netem is not None:
            self._netem.__exit__(None, None, None)
            self._netem = None
        _destroy_groups(self._groups, owns_default=self._owns_pg, collect=collect)
        self._owns_pg = False
        self.extras.close()
        lifecycle.emit(lifecycle.CLOSED, enabled=self.env.settings.lifecycle)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- checkpoints (see varuna/runtime/checkpoint.py)

    def save_checkpoint(self, directory: str | os.PathLike | None = None, *, wait: bool = False):
        """Checkpoint the state after ``step_count`` steps; every rank calls it at the same step.

        Files go to local disk now and to ``directory`` (default ``config.checkpoints.dir``) in the
        background, in ``config.checkpoints.format``; the checkpoint exists once rank 0 wrote its
        commit file (``wait=True`` blocks until this rank's part is copied, rank 0 until the commit
        file is written: ``manifest.json`` for the default format). Returns the
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

    def register_state(self, name: str, obj, *, scope: str = "global") -> None:
        """Save and restore ``obj`` (with ``state_dict()``/``load_state_dict()``) with the model:
        in checkpoints, live morphs and resumes (Note [Registered state] in extra_state.py). ``scope``
        "global": one state for the job, the same on every rank, restored at any P×D (a loader of
        whole mini-batches: ``StatefulBatches``); "rank": this process's own, restored only at the
        P×D that saved it. A state resumed before the call is loaded into ``obj`` now.

        Example::

            data = StatefulBatches(StatefulDataLoader(ds, batch_size=32, shuffle=True, drop_last=True))
            engine.register_state("data", data)            # resumed: continues after the saved step
        """
        self.extras.registered.register(name, obj, scope)

    def state_dict(self, *, optimizer_for: Iterable[str] | None = None) -> dict:
        """This stage's whole state by canonical name (Note [Whole state] in whole_state.py):
        ``step``, ``params``, ``optimizer`` (name-keyed, see
        :func:`varuna.runtime.checkpoint.optimizer_state_by_name`; 2bw's stashed weight version
        rides in it, Note [2BW]), ``loss_scale``, ``buffers`` (persistent ones), ``extra`` (the LR
        scheduler and registered objects: ``{"global": {...}, "rank": {...}}``). Tensors are
        references to the live ones, like ``nn.Module.state_dict``. With sharded optimizer state
        (``optimizer_state.shard``) the optimizer part is gathered whole from the stage's
        replicas: a collective, every replica of the stage calls it; ``optimizer_for`` names the
        parameters whose optimizer state this rank needs (a checkpoint's writer: the files it
        writes), so no replica holds the whole stage's state at once; None: all.

        Example::

            sd = engine.state_dict()
            engine.load_state_dict(sd)
        """
        return whole_state.state_dict(self, optimizer_for=optimizer_for)

    def optimizer_state(self, only: Iterable[str] | None = None) -> dict:
        """The optimizer state by canonical parameter name, whole tensors shaped as the
        parameters (:func:`varuna.runtime.optimizer_state.optimizer_state_by_name`), whatever
        ``optimizer_state`` says: sharded state is gathered (a collective over the stage's
        replicas then; ``only``: the parameters this rank needs), offloaded state comes from host
        memory. Example: ``engine.optimizer_state()["state"]["wte.weight"]["exp_avg"]``."""
        return stage_optimizer_state(self.optimizer, self._shards, dict(self.named_parameters()), only)

    def gather_optimizer_state(self) -> None:
        """With the optimizer state split over the stage's replicas (``optimizer_state.shard``,
        D > 1): gather it whole, by name, on every replica (a collective), so that
        :meth:`optimizer_state` still answers after the groups are gone (a live morph gathers at
        its step boundary, then tears them down). Nothing to do otherwise."""
        if self._shards is not None:
            self._shards.gather_for_transfer()

    def load_state_dict(self, state: dict, *, copy: bool = True) -> None:
        """Inverse of :meth:`state_dict`; ``state["params"]`` may hold more names (e.g. the whole
        model's), but must hold every parameter of this stage. ``copy=False`` hands the state
        over: the optimizer adopts its tensors (nobody else may update them, e.g. a live morph's
        received ones or a checkpoint's freshly read ones) and each parameter's entry leaves
        ``state["params"]`` once copied in (no second set of weights stays alive). ``buffers``
        and ``extra`` may be absent (older checkpoints): buffers keep their values, with a
        warning."""
        whole_state.load_state_dict(self, state, copy=copy)

def _on_stop_signals(names: tuple[str, ...], handler) -> None:
    """Install ``handler`` for the signals ``names`` (only possible from the main thread)."""
    if not names or threading.current_thread() is not threading.main_thread():
        return
    for name in names:
        signal.signal(getattr(signal, name), handler)


def _plan_step(config: VarunaConfig, layout: Layout) -> list[list]:
    """Each replica's micro-batches (``replica_shares`` when set), after checking that the shares
    fit D and the schedule kind, and the stage speeds fit P (one line each, on every rank)."""
    plan = plan_microbatches(
        config.global_batch_size, config.micro_batch_size, layout.D, config.pipeline.replica_shares
    )
    kind = schedule_kind(config.schedule)
    for d, mbs in enumerate(plan):
        reason = kind.unsupported(layout.P, len(mbs))
        if reason is not None:
            raise ValueError(f"replica {d}'s {len(mbs)} micro-batch(es) cannot run at P={layout.P}: {reason}")
    if config.pipeline.stage_speeds is not None:
        problem = check_speeds(config.pipeline.stage_speeds, layout.P)
        if problem is not None:
            raise ValueError(problem)
    return plan


def _check_batch(batch, global_batch_size: int) -> None:
    n = batch_size_of(batch)
    if n != global_batch_size:
        raise ValueError(
            f"train_step got a batch of {n} examples but global_batch_size is "
            f"{global_batch_size}; pass the whole mini-batch on every rank"
        )


def _destroy_groups(groups: ProcessGroups, *, owns_default: bool, collect: bool = True) -> None:
    """The engine's groups, and the default one when the engine made it. Note [Teardown at exit]:
    no handle may outlive this (the groups' worker threads are joined now, not at finalisation)."""
    if owns_default and dist.is_initialized():
        dist.destroy_process_group()  # every group with it
    elif dist.is_initialized():
        # The caller owns the default group and may build more engines in this process.
        groups.destroy()
    groups.release()
    if collect:
        gc.collect()


def _before_rendezvous(model: nn.Module, config: VarunaConfig, env: ProcessEnv) -> None:
    """What this rank says alone, before it waits for the others in the rendezvous: a
    ``cut_after`` pattern that matches nothing (one line), then the ``rendezvous`` lifecycle line
    (Note [Lifecycle lines] in varuna/core/lifecycle.py)."""
    if config.cutting.cut_after:
        from varuna.cutting.routing import match_modules

        match_modules(model, config.cutting.cut_after)
    lifecycle.emit(lifecycle.RENDEZVOUS, enabled=env.settings.lifecycle)


def _place_cutpoints(
    model: nn.Module, example_batch, config: VarunaConfig, loss_fn: Callable, layout: Layout
) -> None:
    """``config.cutting.cut_after`` (by name) or ``cutting.auto_cutpoints`` (a plan from rank 0)."""
    cuts = config.cutting
    if cuts.cut_after:
        from varuna.cutting.routing import CUT_ATTR, insert_cutpoints, match_modules

        # Modules cut already (an earlier Engine on this model, or apply_cutpoints with the same
        # names) keep their cut: asking again is the same request, not an error.
        mods = dict(model.named_modules())
        names = [n for n in match_modules(model, cuts.cut_after) if CUT_ATTR not in mods[n]._modules]
        insert_cutpoints(model, names, auto=False)
    if cuts.auto_cutpoints is not None:
        from varuna.cutting.autocut import engine_auto_cutpoints
        from varuna.cutting.routing import check_no_cutpoints

        check_no_cutpoints(model)  # on every rank, before the plan's collective
        engine_auto_cutpoints(
            model,
            example_batch,
            cuts.auto_cutpoints,
            loss_fn=loss_fn,
            micro_batch_size=config.micro_batch_size,
            rank=layout.rank,
            world=layout.world,
            cost=cuts.plan_cost,
        )


def _destroy_default_group() -> None:
    """At exit (Note [Teardown at exit]): the default process group, if the script left it."""
    if dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # groups only reachable through cycles are freed (threads joined) now
