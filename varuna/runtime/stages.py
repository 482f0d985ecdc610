"""Which segments each pipeline stage runs (paper §3.3).

Explicit ranges (the config's or the launcher's plan) are checked; otherwise the segments are
split by :func:`varuna.core.partition.balanced_stages` on the dry run's segment costs (FLOPs, or
measured time with ``plan_cost="time"``), the schedule kind saying what a segment costs on a
non-last and on the last stage (varuna's last stage never recomputes), each stage's cost divided
by its VM's relative speed when ``stage_speeds`` says the VMs differ. Rank 0's split is broadcast.

Example::

    ranges = assign_stages(layout, profile, schedule="varuna", recompute=True, explicit=None)
    # [(0, 2), (3, 4)]
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from varuna.core.calibration import plan_model_mismatch
from varuna.core.config_error import ConfigError
from varuna.core.env import ProcessEnv
from varuna.core.memory import (
    ENGINE_OVERHEAD_BYTES,
    GRAD_BUCKET_BYTES,
    MEMORY_MARGIN,
    activation_memory_bytes,
    comm_buffer_bytes,
)
from varuna.core.partition import balanced_stages
from varuna.core.schedule import schedule_kind
from varuna.core.selective_recompute import recompute_set
from varuna.cutting.split import ModelProfile, profile_model
from varuna.runtime.config import VarunaConfig
from varuna.runtime.layout import Layout

__all__ = [
    "StageMemory",
    "assign_stages",
    "check_chunks_fit",
    "check_pipeline_depth",
    "chunks_per_process",
    "measures_activations",
    "planning_profile",
    "stage_memory_budget",
    "stage_memory_for",
]


def chunks_per_process(config: VarunaConfig, P: int, num_cutpoints: int, micro_plan: Sequence) -> int:
    """Model chunks each process holds under ``config`` (1 unless the kind is interleaved; chunk
    c is virtual stage c·P + stage), after checking (one line each) that the model's cut-points
    make P stages (:func:`check_pipeline_depth`) and P·v virtual ones, and that every replica's
    micro-batch count suits the kind.

    Example::

        cfg = VarunaConfig(global_batch_size=8, micro_batch_size=1, schedule="interleaved",
                           pipeline=PipelineConfig(chunks=2))
        chunks_per_process(cfg.with_plan(RunPlan(), announce=False), 4, 7, plan)  # 2
    """
    check_pipeline_depth(P, num_cutpoints)
    kind = schedule_kind(config.schedule)
    v = kind.chunks_per_device(config.pipeline.chunks)
    if v > 1:
        check_chunks_fit(P, v, num_cutpoints)
        for plan in micro_plan:  # Nm must suit the kind (interleaved: a multiple of P)
            kind.pipeline(P, len(plan), recompute=config.pipeline.recompute, chunks=v)
    return v


def check_chunks_fit(P: int, chunks: int, num_cutpoints: int) -> None:
    """Raise :class:`ConfigError` (a ``ValueError``, one line) when P processes of ``chunks`` model
    chunks each (P·chunks virtual stages) need more cut-points than the model has.

    Example::

        check_chunks_fit(4, 2, 5)   # ValueError: ... needs 8 virtual stages, i.e. >= 7 cut-points ...
    """
    V = P * chunks
    if chunks > 1 and V > num_cutpoints + 1:
        raise ConfigError(
            f"the interleaved schedule with P={P} and chunks={chunks} needs {V} virtual stages, i.e. >= "
            f"{V - 1} cut-points, but the model has {num_cutpoints}; lower chunks or the pipeline depth, or "
            f"place more cut-points (--auto-cutpoints {V - 1}, or --cut-after selecting >= {V - 1} modules)"
        )


def check_pipeline_depth(P: int, num_cutpoints: int) -> None:
    """Raise :class:`ConfigError` (a ``ValueError``, one line) when the model's CutPoints cannot
    make ``P`` stages.

    Example::

        check_pipeline_depth(4, 2)   # ValueError: pipeline depth 4 exceeds the 3 segments ...
    """
    K = num_cutpoints
    if P > 1 and K == 0:
        raise ConfigError(
            f"the model has no CutPoint, so it cannot be split into {P} pipeline stages; place cut-points "
            f"by module name (cut_after=('model.layers.*',) or varuna-launch --cut-after 'model.layers.*'), "
            f"let the engine choose them (auto_cutpoints={P - 1} or --auto-cutpoints {P - 1}), call "
            "varuna.CutPoint() in the model, or use --pipeline-depth 1"
        )
    if P > K + 1:
        raise ConfigError(
            f"pipeline depth {P} exceeds the {K + 1} segments defined by the model's {K} cut-points; use "
            f"--pipeline-depth <= {K + 1}, or place more cut-points (by name: --cut-after with a pattern "
            f"selecting >= {P - 1} modules; automatically: --auto-cutpoints {P - 1})"
        )


def planning_profile(model: nn.Module, micro_batch, loss_fn: Callable, config: VarunaConfig,
                     layout: Layout, *, activations: bool = False) -> ModelProfile:
    """The engine's dry run (:func:`varuna.cutting.split.profile_model`) with the segment costs
    the stage split needs and the FLOPs the step metrics need: counted only on rank 0 (it
    broadcasts the split and the FLOPs, varuna/runtime/flops.py); the split balances FLOPs unless
    ``config.cutting.plan_cost == "time"`` (measured, and only when it splits), because a plan must
    not change between identical runs (docs/annotating.md, "Stable plans").

    Example::

        prof = planning_profile(model, first_micro_batch, loss_fn, config, layout)
        prof.cost_unit   # "flop" on rank 0 by default
    """
    splits = layout.rank == 0 and config.pipeline.stage_ranges is None and layout.P > 1
    prof = profile_model(
        model,
        micro_batch,
        loss_fn,
        timing_reps=config.cutting.timing_reps,
        measure=splits and config.cutting.plan_cost == "time",
        costs=layout.rank == 0,
        activations=activations,  # the memory-aware split's per-segment activation bytes
    )
    if splits and prof.cost_unit == "flop" and not any(prof.fwd_cost) and not any(
        p.is_meta for p in model.parameters()
    ):
        # Nothing the counter sees (elementwise ops only, emulated devices): FLOPs cannot rank the
        # segments, so measure after all (and say so: this plan may vary between runs).
        print("varuna: the model's segments count no FLOPs; balancing stages on measured time", flush=True)
        prof = profile_model(
            model, micro_batch, loss_fn, timing_reps=config.cutting.timing_reps, measure=True, costs=True,
            activations=activations,
        )
    return prof


#: Adam's two moments per weight: what the split assumes the optimizer keeps (the optimizer is
#: built after the split, from the stage's parameters).
OPTIMIZER_STATES_PER_WEIGHT = 2
@dataclass(frozen=True)
class StageMemory:
    """What each stage may hold (bytes, one per stage) and how its state is counted: the
    optimizer state divided over ``optimizer_shards`` replicas, ``num_microbatches`` per replica
    (the stash), whether the kind's stages recompute and which segments (``recompute_segments``,
    Note [Selective recompute]; None: whole stages), for the memory-aware split (Note
    [Memory-aware split]). Activations are the dry run's measured bytes per segment
    (``profile_model(activations=True)``; none counted when it did not measure them), through the
    one formula the planner uses (``varuna.core.memory.activation_memory_bytes``).

    Example::

        mem = StageMemory((2 << 30,), num_microbatches=4)
        mem.stage_bytes(profile, "varuna", 2, 0, 0, 3)   # stage 0 of 2 holding segments 0-3
    """

    caps: tuple[int, ...]
    optimizer_shards: int = 1
    num_microbatches: int = 1
    replicas: int = 1
    recompute: bool = True
    recompute_segments: frozenset[int] | None = None

    def static_bytes(self, profile: ModelProfile) -> list[float]:
        """Per segment: weights + gradients + optimizer state of the parameters it reads (a
        parameter read by several segments, a tied embedding, counts on each: each stage holding
        it holds all of it)."""
        per = 2 + OPTIMIZER_STATES_PER_WEIGHT / self.optimizer_shards
        out = [0.0] * profile.num_segments
        for name, segs in profile.param_segments.items():
            for s in segs:
                out[s] += per * profile.param_bytes.get(name, 0)
        return out

    def activation_bytes(
        self, profile: ModelProfile, schedule: str, P: int, k: int, first: int, last: int
    ) -> float:
        """Stage ``k`` of ``P`` holding segments [first, last]: its activation memory at the dry
        run's micro-batch (``activation_memory_bytes`` with the kind's ``stash_peak`` and whether
        the stage recomputes)."""
        return self._activations(profile, schedule, P)(k, first, last)

    def _activations(self, profile: ModelProfile, schedule: str, P: int) -> Callable[[int, int, int], float]:
        """(k, first, last) -> :meth:`activation_bytes`, the profile's lists read once (the split
        asks for O(P·K²) ranges)."""
        kind = schedule_kind(schedule)
        ins = profile.segment_input_bytes()
        acts = profile.activation_bytes or [0] * profile.num_segments
        stash = [kind.stash_peak(P, k, self.num_microbatches) for k in range(P)]
        recomputes = [kind.recomputes(P, k, recompute=self.recompute) for k in range(P)]

        def count(k: int, first: int, last: int) -> float:
            return activation_memory_bytes(
                first, last, stashed=stash[k], recompute=recomputes[k], input_bytes=ins.__getitem__,
                activation_bytes=acts.__getitem__, recompute_segments=self.recompute_segments)

        return count

    def stage_bytes(
        self, profile: ModelProfile, schedule: str, P: int, k: int, first: int, last: int
    ) -> float:
        """Stage ``k`` of ``P`` holding segments [first, last]: static bytes + activations (what
        the split compares with the stage's room)."""
        return sum(self.static_bytes(profile)[first : last + 1]) + self.activation_bytes(
            profile, schedule, P, k, first, last)

    def fit(self, ranges, profile: ModelProfile, schedule: str, full, last, speeds) -> list[tuple[int, int]]:
        """``ranges`` if every stage fits, else the fastest split that does; ``ranges`` with one
        line on stderr when none does (the run then fails where memory runs out, as before)."""
        P = len(ranges)
        static = self.static_bytes(profile)
        prefix = [0.0]
        for b in static:
            prefix.append(prefix[-1] + b)
        caps = list(self.caps) if len(self.caps) > 1 else [self.caps[0]] * P
        # What the model does not count (varuna/core/memory.py): the engine's own memory, one
        # gradient bucket with replicas (the largest a stage may need), a share for the rest.
        extra = ENGINE_OVERHEAD_BYTES + comm_buffer_bytes(self.replicas, GRAD_BUCKET_BYTES)
        room = [c * (1 - MEMORY_MARGIN) - extra for c in caps]

        activations = self._activations(profile, schedule, P)

        def need(k: int, a: int, b: int) -> float:
            return prefix[b + 1] - prefix[a] + activations(k, a, b)

        def fits(k: int, a: int, b: int) -> bool:
            return need(k, a, b) <= room[k]

        if all(fits(k, a, b) for k, (a, b) in enumerate(ranges)):
            return ranges
        try:
            fitted = balanced_stages(full, last, P, speeds=speeds, fits=fits)
        except ValueError:
            most = max(need(k, a, b) for k, (a, b) in enumerate(ranges)) + extra
            print(f"varuna: no stage split keeps every stage within its memory ({min(caps) / 2**20:.0f} "
                  f"MiB, {MEMORY_MARGIN:.0%} kept free; the time-balanced one needs about {most / 2**20:.0f} "
                  "MiB on its largest stage): keeping it", flush=True)
            return ranges
        print(f"varuna: stage split {fitted} instead of {ranges}: the time-balanced one overflows a stage's "
              f"memory ({min(caps) / 2**20:.0f} MiB; Note [Memory-aware split])", flush=True)
        return fitted


def stage_memory_for(
    config: VarunaConfig, layout: Layout, device: torch.device, micro_plan: Sequence, num_segments: int
) -> StageMemory | None:
    """What each stage may hold for the memory-aware split (``pipeline.stage_memory``, else the
    process's hard limit, on rank 0: it splits), or None (unbounded, or not rank 0). The model's
    ``num_segments`` checks the recompute set (``pipeline.recompute_segments``), which the
    memory counts (Note [Selective recompute])."""
    caps = config.pipeline.stage_memory
    if caps is None and layout.rank == 0 and layout.P > 1:
        caps = stage_memory_budget(device)
    if caps is None:
        return None
    caps = (caps,) if isinstance(caps, int) else tuple(caps)
    bad = any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in caps)
    if len(caps) not in (1, layout.P) or bad:
        raise ValueError(f"pipeline.stage_memory {caps} must be bytes > 0: one value, or one per stage "
                         f"(P={layout.P})")
    shards = layout.D if config.optimizer_state.shard else 1
    nm = max(len(p) for p in micro_plan)
    return StageMemory(caps, optimizer_shards=shards, num_microbatches=nm, replicas=layout.D,
                       recompute=config.pipeline.recompute is not False,  # None: the default, on
                       recompute_segments=recompute_set(config.pipeline.recompute_segments, num_segments))


def measures_activations(config: VarunaConfig, layout: Layout, device: torch.device) -> bool:
    """Whether this rank's dry run should count activation bytes per segment: it splits (rank 0,
    P > 1, no given ranges) and the memory is bounded (:func:`stage_memory_for` would answer).

    Example::

        prof = planning_profile(model, mb, loss_fn, config, layout,
                                activations=measures_activations(config, layout, device))
    """
    if layout.rank != 0 or layout.P == 1 or config.pipeline.stage_ranges is not None:
        return False
    return config.pipeline.stage_memory is not None or stage_memory_budget(device) is not None


def stage_memory_budget(device: torch.device) -> int | None:
    """The hard limit on this process's memory, in bytes: an accelerator's total memory, else
    the room under ``RLIMIT_AS`` and a cgroup's ``memory.max`` (shared by the host's ranks); None
    when there is none (not ``MemAvailable``: it moves between runs, and a plan must not).

    Example::

        stage_memory_budget(torch.device("cpu"))   # None on an unlimited host
    """
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    room: list[int] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        with open("/proc/self/status") as f:
            vm = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")), 0)
        room.append(max(soft - vm, 0))
    try:
        cg = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if cg != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            room.append(max(int(cg) - used, 0) // ProcessEnv.from_env().local_world_size)
    except (OSError, ValueError):
        pass
    return min(room) if room else None


def assign_stages(
    layout: Layout,
    profile: ModelProfile,
    *,
    schedule: str,
    recompute: bool,
    explicit: Sequence[tuple[int, int]] | None,
    speeds: Sequence[float] | None = None,
    chunks: int = 1,
    memory: StageMemory | None = None,
) -> list[tuple[int, int]]:
    """Inclusive segment range of every stage (a collective when it balances on several ranks);
    with ``chunks`` > 1, of every virtual stage (P·chunks of them, virtual stage j on process j % P).
    ``speeds``: relative speed of each process's VM; a segment's cost on a stage of process i is
    divided by ``speeds[i]`` (``VarunaConfig.stage_speeds``). ``memory``: what each stage may hold
    (Note [Memory-aware split]); the time-balanced split stands where it fits."""
    P, nseg = layout.P * chunks, profile.num_segments
    if explicit is not None:
        ranges = [tuple(r) for r in explicit]
        # A plan made from another model's calibration: say so, not just "bad ranges".
        mismatch = plan_model_mismatch(ranges, nseg)
        if mismatch is not None:
            raise ValueError(mismatch)
        flat = [s for a, b in ranges for s in range(a, b + 1)]
        if len(ranges) != P or flat != list(range(nseg)):
            what = f"{P} (P·chunks)" if chunks > 1 else f"{P}"
            raise ValueError(
                f"stage_ranges {ranges} must be {what} contiguous ranges covering segments 0..{nseg - 1}"
            )
        return ranges
    fwd, bwd = profile.fwd_cost, profile.bwd_cost
    # A recompute is a forward again: the dry run's forward cost stands for it.
    full, last = schedule_kind(schedule).balancing_costs(fwd, fwd, bwd, recompute=recompute)
    if speeds is not None and chunks > 1:
        speeds = [speeds[j % layout.P] for j in range(P)]
    ranges = balanced_stages(full, last, P, speeds=speeds) if P > 1 else [(0, nseg - 1)]
    if memory is not None and P > 1 and chunks == 1 and layout.rank == 0:
        ranges = memory.fit(ranges, profile, schedule, full, last, speeds)
    if layout.world > 1:
        # Timings differ between processes: rank 0's split is the one everybody uses.
        t = torch.tensor([x for r in ranges for x in r], dtype=torch.int64)
        dist.broadcast(t, src=0)
        v = t.tolist()
        ranges = [(v[2 * i], v[2 * i + 1]) for i in range(P)]
    return ranges
