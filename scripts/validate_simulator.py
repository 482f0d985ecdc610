#!/usr/bin/env python
"""Validate the simulator against the real engine on an emulated cluster (paper §4.4, §7.2: ±5%).

For each configuration (P×D layout, schedule, micro-batches per replica Nm, network level) this
script runs the REAL engine — P×D processes over gloo on 127.0.0.1, a model of 2·P
``varuna.testing.EmulatedBlock``\\ s (forward sleeps F = 10 ms per block, backward 2F, recompute F;
two blocks per stage, so a stage's F ≈ 20 ms), ``$VARUNA_NETEM`` for the network — measures the
mean mini-batch time over a few steps after warm-up, simulates the same configuration with
``simulator.engine.simulate`` and prints real vs simulated time and the error.

The simulator's calibration is built from KNOWN costs (the blocks' sleeps, the emulated network's
latency and jitter) plus runtime constants MEASURED by micro-benchmarks in the same worker
processes, in rounds before, between and after the validation runs (never fitted to them); the
micro-benchmarks are ``profiler.overhead_runs`` and their fit ``profiler.overheads`` (the notes
cited below live there):

- *task costs* (Note [Task costs]): the engine's F, R and B times minus the known sleeps, in
  calibration runs of the runtime (W×1 pipelines of 1- and 3-block stages, 1F1B, Nm = 6: model
  cuts and configurations outside the validation set), fitted as a per-task term, a per-segment
  term (goes into the calibration's segment costs) and a per-placeholder-segment term →
  ``SimConfig.task_overhead_s``, ``SimConfig.placeholder_s``;
- *hand-off* (Note [Hand-off]): producer end → consumer start of messages to idle receivers in
  those runs, plus the network emulator's own extra cost from a probe through the runtime's
  ``LinkSender``/``LinkReceiver`` threads → the link model's latency;
- *step overhead*: step set-up, and the end-of-step agreement all-reduce and optimizer step, in
  the same runs → ``SimConfig.step_overhead_s``;
- *gradient all-reduce*: a stage's gradient buffer all-reduced by concurrent 2-rank rings →
  the calibration's all-reduce latency.

Workers run at SCHED_RR priority after start-up (``--priority``, ``_prioritize``): on a shared
2-core host that makes the emulated devices behave like dedicated ones.

Usage::

    python scripts/validate_simulator.py --gantt-dir docs/img   # the full table, ~6 min
    python scripts/validate_simulator.py --quick                # 2 configurations (smoke test)
    python scripts/validate_simulator.py --json runs/validation.json --work-dir runs/validation
    python scripts/validate_simulator.py --only "4x1,heavy"     # configurations whose label has all
    VALIDATE_NETEM_SEED=3 VALIDATE_GANTT="4x2 varuna Nm=4 moderate" \
        python scripts/validate_simulator.py --only "4x2,varuna,Nm=4,moderate" --gantt-dir /tmp/g
        # another emulator seed, and the Gantt charts of another configuration

Prints the measured constants, the table (config, real, simulated, error) with the median and
max absolute error, and diagnostics from the real timelines (per-task overhead seen vs
predicted, hand-off seen). ``--gantt-dir`` writes real and simulated Gantt charts of one
configuration (``sim_vs_real_real.png``, ``sim_vs_real_sim.png``). Results and findings:
docs/simulator.md, section "Validation".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from profiler.overheads import (  # noqa: E402  (after the sys.path set-up)
    EMULATED_WIDTH,
    MICRO_BATCH_SIZE,
    RuntimeConstants,
    disturbed,
    runtime_constants,
    task_overheads,
    trimmed_mean,
    waiting_hops,
)

#: Emulated compute of one block (paper-like units: F, B = 2F, R = F), seconds.
BLOCK_FWD_S = 0.010
#: Blocks (= segments) per pipeline stage: stage F = 2 · BLOCK_FWD_S.
BLOCKS_PER_STAGE = 2
#: Zero-bubble W's share of each block's backward, in ``EmulatedBlock`` and ``SimConfig`` alike.
WEIGHT_FRAC = 0.5
# The blocks' width and the micro-batch size are the calibration runs' (profiler.overheads).

#: Network levels: name -> (latency s, mean exponential jitter s); None = no emulation.
LEVELS: dict[str, tuple[float, float] | None] = {
    "none": None,
    "moderate": (0.001, 0.002),
    "heavy": (0.002, 0.010),
}
#: Seed of the emulator's jitter draws (the simulator uses its own seeds, see ``simulate_config``).
NETEM_SEED = int(os.environ.get("VALIDATE_NETEM_SEED", "1"))

LAYOUTS: tuple[tuple[int, int], ...] = ((2, 1), (4, 1), (2, 2), (4, 2), (8, 1))
SCHEDULES: tuple[str, ...] = ("varuna", "gpipe", "1f1b")
NUM_MICROBATCHES: tuple[int, ...] = (4, 8, 16)
LEVEL_NAMES: tuple[str, ...] = tuple(LEVELS)

#: Configuration whose real and simulated timelines are drawn (``--gantt-dir``).
GANTT_LABEL = os.environ.get("VALIDATE_GANTT", "4x1 varuna Nm=8 moderate")


def netem_string(level: str) -> str | None:
    """``$VARUNA_NETEM`` value of a network level (None: no emulation).

    >>> netem_string("moderate")
    'latency=1ms,jitter=2ms,seed=1'
    """
    spec = LEVELS[level]
    if spec is None:
        return None
    lat, jit = spec
    return f"latency={lat * 1e3:g}ms,jitter={jit * 1e3:g}ms,seed={NETEM_SEED}"


@dataclass(frozen=True, kw_only=True)
class ValConfig:
    """One validation configuration."""

    num_stages: int
    """P."""
    num_replicas: int
    """D."""
    schedule: str
    """varuna, gpipe or 1f1b."""
    num_microbatches: int
    """Nm: micro-batches per replica (M_total = m · Nm · D)."""
    level: str
    """Network level, a key of LEVELS."""
    recompute: bool = True
    """Activation recompute for gpipe / 1f1b (varuna always recomputes, except its last stage)."""
    # Mixed VM types (issue #19; scripts/validate_mixed.py): None = the homogeneous case.
    speeds: tuple[tuple[float, ...], ...] | None = None
    """Per replica, per stage: the emulated device's speed (its blocks sleep F / speed)."""
    shares: tuple[int, ...] | None = None
    """Micro-batches per replica (``VarunaConfig.replica_shares``; then Nm is unused)."""
    stage_blocks: tuple[int, ...] | None = None
    """Blocks (segments) per stage, uneven; None: BLOCKS_PER_STAGE each."""
    chunks: int = 1
    """v: model chunks per process (the interleaved kinds; then P·v virtual stages)."""

    def __post_init__(self) -> None:  # JSON gives lists back: keep labels and equality stable
        if self.speeds is not None:
            object.__setattr__(self, "speeds", tuple(tuple(float(v) for v in r) for r in self.speeds))
        for name in ("shares", "stage_blocks"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def world(self) -> int:
        return self.num_stages * self.num_replicas

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.stage_blocks or (BLOCKS_PER_STAGE,) * (self.num_stages * self.chunks)

    def speed_of(self, rank: int) -> float:
        return 1.0 if self.speeds is None else self.speeds[rank // self.num_stages][rank % self.num_stages]

    @property
    def label(self) -> str:
        """E.g. ``4x2 varuna Nm=8 heavy``, ``2x2 varuna shares=5/3 speeds=1.6-1.6/1-1 none``."""
        kind = self.schedule + ("" if self.recompute or self.schedule == "varuna" else "-noR")
        kind += f"(v={self.chunks})" if self.chunks > 1 else ""
        nm = f"Nm={self.num_microbatches}"
        if self.shares is not None:
            nm = "shares=" + "/".join(map(str, self.shares))
        mixed = ""
        if self.speeds is not None:
            mixed = " speeds=" + "/".join("-".join(f"{v:g}" for v in r) for r in self.speeds)
        if self.stage_blocks is not None:
            mixed += " blocks=" + "/".join(map(str, self.stage_blocks))
        return f"{self.num_stages}x{self.num_replicas} {kind} {nm}{mixed} {self.level}"

    def ideal_s(self) -> float:
        """Rough mini-batch time (compute only), for budgeting runs."""
        f = max(self.blocks) * BLOCK_FWD_S / min(min(r) for r in (self.speeds or ((1.0,),)))
        return (max(self.shares or (self.num_microbatches,)) * 4 * self.chunks + 3 * self.num_stages - 3) * f


def default_configs() -> list[ValConfig]:
    """The trimmed cross-product: 25 of the 135 (layout, schedule, Nm, level) combinations.

    Every (layout, schedule) pair once, with Nm and level rotated Latin-square style so that
    every (layout, level), (layout, Nm), (schedule, level), (schedule, Nm) and (level, Nm) pair
    appears (15); then 10 more that stress what the simulator must get right: the varuna schedule
    (opportunistic, jitter-sensitive) on the deepest and the data-parallel layouts, the longest
    pipelines (Nm = 16) under heavy jitter, and gpipe / 1f1b without recompute (F keeps its graph).
    All with recompute unless the label says ``-noR``.
    """
    out: list[ValConfig] = []
    for i, (P, D) in enumerate(LAYOUTS):
        for j, kind in enumerate(SCHEDULES):
            out.append(ValConfig(num_stages=P, num_replicas=D, schedule=kind,
                                 num_microbatches=NUM_MICROBATCHES[(i + 2 * j) % 3],
                                 level=LEVEL_NAMES[(i + j) % 3]))
    extra = [
        (8, 1, "varuna", 8, "none", True), (8, 1, "varuna", 16, "heavy", True),
        (4, 2, "varuna", 8, "heavy", True), (4, 2, "varuna", 4, "moderate", True),
        (2, 1, "varuna", 16, "heavy", True), (2, 2, "gpipe", 16, "heavy", True),
        (4, 1, "1f1b", 16, "heavy", True), (8, 1, "1f1b", 8, "moderate", True),
        (4, 1, "gpipe", 8, "moderate", False), (4, 2, "1f1b", 8, "none", False),
    ]
    seen = {c.label for c in out}
    for P, D, kind, nm, level, recompute in extra:
        c = ValConfig(num_stages=P, num_replicas=D, schedule=kind, num_microbatches=nm, level=level,
                      recompute=recompute)
        if c.label not in seen:
            out.append(c)
            seen.add(c.label)
    return out


def quick_configs() -> list[ValConfig]:
    """Two small configurations in one 2-process world (the smoke test).

    The varuna one has Nm = 3 = 3·(P−1): every forward fits before the first recompute, so no
    forward can fill a gradient wait. With Nm = 4, F3 sits after the recompute pairs, and whether
    it fills the wait after R1 turns on a gradient landing a fraction of a millisecond before or
    after R1 ends (docs/simulator.md, Validation, Finding 7): the real step is 0.34 s or 0.38 s and
    the simulator, given constants measured a little differently in each run, may take the other
    branch -- a property of that configuration, not something a smoke test should hinge on.
    """
    return [
        ValConfig(num_stages=2, num_replicas=1, schedule="varuna", num_microbatches=3, level="none"),
        ValConfig(num_stages=2, num_replicas=1, schedule="gpipe", num_microbatches=4, level="moderate"),
    ]


@dataclass(kw_only=True)
class WorldSpec:
    """What one set of W worker processes runs (JSON for the workers)."""

    world: int
    """W = P·D of every configuration it runs."""
    configs: list[dict]
    """The ValConfigs, as dicts, in run order."""
    out_dir: str
    """Where each rank writes ``rank{r}.json`` (and its log)."""
    warmup: int
    """Untimed steps per configuration (the first step builds buffers, starts threads)."""
    steps: int
    """Timed steps per configuration."""
    probe_messages: int
    """Hand-off probe: messages per direction and round, split over the rank pairs."""
    gantt_label: str | None = None
    """The configuration whose timeline is gathered with ``Engine.gather_timeline``."""
    calibration_steps: int = 3
    """Timed steps of each calibration run."""
    calibrate_every: int = 4
    """A micro-benchmark round before every this many configurations (and one after the last)."""
    comm_timeout_s: float = 120.0
    priority: str = "normal"
    """CPU priority of the workers (``_prioritize``)."""


# ============================================================================================
# Analysis of measurements (pure Python; no torch)


def step_times(ranks: Sequence[dict], key: str, num_stages: int) -> list[float]:
    """Per timed step of run ``key``: from the first stage-0 rank's start (after the barrier) to
    the last rank's return from ``train_step``.

    The pipeline starts when stage 0 starts (the simulator's time 0); the other ranks' barrier
    exits do not matter to it. Ranks are ``replica·P + stage``.
    """
    per_rank = [r["runs"][key]["steps"] for r in ranks]
    n = min(len(s) for s in per_rank)
    firsts = [s for r, s in enumerate(per_rank) if r % num_stages == 0]
    return [max(s[i]["t1"] for s in per_rank) - min(s[i]["t0"] for s in firsts) for i in range(n)]


# ============================================================================================
# The simulator side


def build_calibration(num_stages: int, level: str, rc: RuntimeConstants, *, num_segments: int | None = None,
                      speeds: Sequence[float] = ()):
    """The calibration of the emulated model at ``level``: known block costs and network delays,
    plus the measured hand-off (link latency) and all-reduce constants.

    Every rank is its own "host" (``host_slots=1``), so every link is an inter-host link; the
    intra model is set equal to it. ``speeds``: emulated device speeds, each a VM type named
    :func:`speed_type` whose blocks sleep F / speed (the runtime's overheads do not scale).
    """
    from varuna.core.calibration import AllReduceModel, Calibration, ComputeStat, LinkModel, VmType
    from varuna.core.calibration_types import SegmentCompute

    spec = LEVELS[level]
    # The link model's latency_s is the MEAN delay: the emulator's fixed latency, its mean
    # exponential jitter, and the runtime's own hand-off; the simulator draws the jitter as
    # Exp(jitter_s) on top of latency_s − jitter_s: the emulator's distribution, plus the
    # hand-off's own spread (Note [Hand-off]; a sum of two exponentials drawn as one).
    if spec is None:
        latency, jitter = rc.handoff_s, rc.handoff_jitter_s
    else:
        lat, jit = spec
        latency, jitter = lat + jit + rc.handoff_netem_s, jit + rc.handoff_jitter_s
    link = LinkModel(latency_s=latency, bandwidth_bytes_per_s=1e12, jitter_s=jitter)
    param_bytes = 2 * EMULATED_WIDTH * 4  # scale and bias, float32
    cal = Calibration.synthetic(
        BLOCK_FWD_S / MICRO_BATCH_SIZE,
        num_segments=num_segments or BLOCKS_PER_STAGE * num_stages,
        micro_batch_sizes=(MICRO_BATCH_SIZE,),
        param_bytes=param_bytes,
        act_bytes_per_example=EMULATED_WIDTH * 4,
        intra=link,
        inter=link,
        # (D−1)·latency for a D-ring: the measured 2-rank all-reduce is its latency.
        allreduce=AllReduceModel(bandwidth_bytes_per_s=1e12, latency_s=rc.allreduce_s, contention=0.0),
        optimizer_s_per_param_byte=0.0,  # the optimizer step is inside the measured step overhead
        model_name="emulated-blocks",
    )
    # Segment costs as a profiler timing one block through the runtime would see them: the
    # nominal sleep plus the measured per-segment overhead (Note [Task costs]), plus each op's
    # share of what its task costs beyond the cheapest op's (every validated stage has
    # BLOCKS_PER_STAGE segments).
    seg = rc.segment_overhead_s
    extra = {op: rc.op_overhead_s.get(op, 0.0) / BLOCKS_PER_STAGE for op in ("F", "R", "B")}
    def costs(v: float) -> dict:
        return {"fwd_s": (ComputeStat(median=BLOCK_FWD_S / v + seg + extra["F"]),),
                "recompute_s": (ComputeStat(median=BLOCK_FWD_S / v + seg + extra["R"]),),
                "bwd_s": (ComputeStat(median=2 * BLOCK_FWD_S / v + seg + extra["B"]),)}

    for s in cal.segments:
        s.fwd_s, s.recompute_s, s.bwd_s = (list(x) for x in costs(1.0).values())
    for v in sorted(set(speeds)):
        own = tuple(SegmentCompute(**costs(v)) for _ in cal.segments)
        cal.types[speed_type(v)] = VmType(name=speed_type(v), speed=v, segments=own)
    return cal


def speed_type(speed: float) -> str:
    """The VM type name of an emulated device speed (``x1.6``)."""
    return f"x{speed:g}"


def sim_config(c: ValConfig, rc: RuntimeConstants, seed: int = 0):
    """The simulator's view of ``c`` (same stage map, schedule and micro-batches as the run)."""
    from simulator.engine import SimConfig

    P = c.num_stages
    starts = [sum(c.blocks[:k]) for k in range(len(c.blocks))]
    return SimConfig(
        num_stages=P,
        num_replicas=c.num_replicas,
        micro_batch_size=MICRO_BATCH_SIZE,
        num_microbatches=c.num_microbatches if c.shares is None else c.shares,
        stage_segments=tuple((a, a + n - 1) for a, n in zip(starts, c.blocks)),
        chunks=c.chunks, weight_grad_fraction=WEIGHT_FRAC,
        device_types=None if c.speeds is None else tuple(tuple(speed_type(v) for v in r) for r in c.speeds),
        schedule=c.schedule,
        recompute=c.recompute,
        host_slots=1,
        seed=seed,
        task_overhead_s=rc.task_overhead_s,
        placeholder_s=rc.placeholder_s,
        step_overhead_s=rc.step_overhead_s,
        task_jitter_s=rc.task_jitter_s,
    )


def simulate_config(c: ValConfig, rc: RuntimeConstants, seeds: int = 25, *, stat=statistics.mean) -> float:
    """Simulated mini-batch time: the mean over ``seeds`` jitter draws (the real time is a mean
    over steps, each with its own draws; Note [Means, not medians]); without any jitter (no
    emulation and a constant hand-off), one deterministic run. ``stat=statistics.median`` gives
    the median instead."""
    from simulator.engine import simulate

    cal = calibration_of(c, rc)
    n = seeds if LEVELS[c.level] is not None or rc.handoff_jitter_s > 0 or rc.task_jitter_s > 0 else 1
    return stat([simulate(cal, sim_config(c, rc, seed=s)).minibatch_s for s in range(n)])


def calibration_of(c: ValConfig, rc: RuntimeConstants):
    """:func:`build_calibration` for ``c``'s segments and device speeds."""
    speeds = [v for r in c.speeds for v in r] if c.speeds is not None else []
    return build_calibration(c.num_stages, c.level, rc, num_segments=sum(c.blocks), speeds=speeds)


# Note [Means, not medians]: throughput over a run is M / (mean step time), and that is what the
# simulator's examples/s stands for. A policy fork can make a configuration's step time bimodal
# (docs/simulator.md, Validation, Finding 7: 4x2 varuna Nm=4 moderate takes 0.48 or 0.53 s per
# step); a median over a handful of steps then jumps between the modes with the jitter draws
# (real medians 0.482-0.533 s over netem seeds 1-5 of that one configuration) while the mean
# converges. Disturbed steps are dropped before either statistic (Note [Disturbed steps]).


def known_costs_only() -> RuntimeConstants:
    """All runtime constants zero: the simulator told only the blocks' sleeps and the emulated
    network (for the table's comparison column)."""
    return RuntimeConstants(handoff_s=0.0, handoff_netem_s=0.0, probe_handoff_s=0.0, task_overhead_s=0.0,
                            segment_overhead_s=0.0, placeholder_s=0.0, step_overhead_s=0.0, allreduce_s=0.0)


# ============================================================================================
# Worker side (one process per rank; torch imported only here, through profiler.overhead_runs)


def _prioritize(mode: str) -> str:
    """Give this worker's threads CPU priority (after the CPU-heavy start-up); returns what applied.

    The workers mostly sleep (emulated devices) and use ~0.05 core each, but each task needs ~1 ms
    of CPU the moment its sleep ends; on a shared 2-core host under load, ordinary scheduling makes
    that take several ms, and how many depends on other users' load from one second to the next.
    ``rr``: SCHED_RR priority 1 for every thread of the process (threads started later inherit
    it), like a dedicated host; ``nice``: niceness -10; ``normal``: unchanged. Without
    CAP_SYS_NICE, ``rr`` falls back to ``nice`` and that to ``normal`` (timings are then noisier).
    """
    if mode == "rr":
        try:
            for tid in os.listdir("/proc/self/task"):
                os.sched_setscheduler(int(tid), os.SCHED_RR, os.sched_param(1))
            return "rr"
        except (PermissionError, AttributeError, OSError):
            mode = "nice"
    if mode == "nice":
        try:
            os.nice(-10)
            return "nice"
        except PermissionError:
            pass
    return "normal"


def _run_config(spec: WorldSpec, cdict: dict, rank: int, bench_rounds: list[int]) -> dict:
    """One validation configuration on this rank: build its engine, warm up, time the steps
    (and gather one more step's timeline when it is the Gantt configuration)."""
    from profiler.overhead_runs import emulated_engine, timed_steps

    c = ValConfig(**cdict)
    t = time.perf_counter()
    with emulated_engine(c.num_stages, c.num_replicas, c.schedule, c.num_microbatches, c.recompute,
                         netem_string(c.level), spec.comm_timeout_s, blocks_per_stage=BLOCKS_PER_STAGE,
                         block_fwd_s=BLOCK_FWD_S, stage_blocks=c.stage_blocks, replica_shares=c.shares,
                         speed=c.speed_of(rank), chunks=c.chunks, weight_frac=WEIGHT_FRAC) as (engine, batch):
        build_s = time.perf_counter() - t
        warm: list[dict] = []
        steps = timed_steps(engine, batch, spec.warmup, spec.steps, warm)
        trace = None
        if c.label == spec.gantt_label:
            engine.timeline.events.clear()  # one more step, gathered on rank 0
            timed_steps(engine, batch, 0, 1)
            tl = engine.gather_timeline()
            if tl is not None:
                tl.metadata["config"] = c.label
                trace = tl.to_chrome_dict()
    if rank == 0:
        per = [s["t1"] - s["t0"] for s in steps]
        print(f"[validate] {c.label:<28} rank-0 median step {statistics.median(per):.3f} s "
              f"(build {build_s:.1f} s, total {time.perf_counter() - t:.1f} s)", flush=True)
    return {"config": cdict, "steps": steps, "warmup": warm, "build_s": build_s, "trace": trace,
            "bench_rounds": bench_rounds}


def _worker_main(spec_path: str) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from profiler.overhead_runs import micro_benchmarks

    spec = WorldSpec(**json.loads(Path(spec_path).read_text()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.comm_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    priority = _prioritize(spec.priority)
    if rank == 0 and priority != spec.priority:
        print(f"[validate] could not apply --priority {spec.priority} (needs CAP_SYS_NICE); using "
              f"{priority}: timings will be noisier on a loaded host", flush=True)
    result: dict[str, Any] = {"rank": rank, "runs": {}, "bench": [], "priority": priority}

    def bench() -> dict:
        return micro_benchmarks(rank, world, spec.probe_messages, spec.calibration_steps, spec.comm_timeout_s)

    try:
        for index, cdict in enumerate(spec.configs):
            # Micro-benchmark rounds before the first configuration and every calibrate_every
            # configurations (and after the last): each configuration is simulated with the
            # rounds just before and after it, so slow drift of the host's load cancels.
            if index % spec.calibrate_every == 0:
                result["bench"].append(bench())
            rounds = [len(result["bench"]) - 1, len(result["bench"])]
            result["runs"][ValConfig(**cdict).label] = _run_config(spec, cdict, rank, rounds)
        result["bench"].append(bench())
        Path(spec.out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


# ============================================================================================
# Launcher side


def run_world(spec: WorldSpec, timeout_s: float) -> list[dict]:
    """Start ``spec.world`` worker processes, wait (bounded), return each rank's results."""
    from varuna.testing.emulated import run_local_world

    Path(spec.out_dir).mkdir(parents=True, exist_ok=True)
    spec_path = Path(spec.out_dir, "spec.json")
    spec_path.write_text(json.dumps(asdict(spec)))
    return run_local_world(__file__, ["--_worker", str(spec_path)], spec.world, spec.out_dir, timeout_s,
                           what="validation")


@dataclass(kw_only=True)
class Row:
    """One line of the table."""

    config: ValConfig
    real_s: float
    sim_s: float
    known_sim_s: float
    """Simulated with the known costs only (all runtime constants zero), for comparison."""
    real_steps_s: list[float]
    constants: RuntimeConstants
    """What the simulation used: the micro-benchmark rounds just before and after the run."""
    real_median_s: float = 0.0
    """Median of the same steps (Note [Means, not medians]: reported, not the headline)."""
    sim_median_s: float = 0.0
    """Median over the same jitter seeds."""
    task_overhead_ms: float
    """Mean per-task overhead seen in this run (diagnostic; the simulator does not use it)."""
    model_task_overhead_ms: float
    """The same, predicted by Note [Task costs] from the micro-benchmarks."""
    hop_ms: float
    """Mean hand-off seen by idle receivers in this run (diagnostic)."""
    first_step_s: float | None = None
    """The untimed first step after building the engine (None without warm-up, or disturbed)."""
    all_steps_s: list[float] = field(default_factory=list)
    """Every timed step of the attempt used, disturbed ones included (Note [Disturbed steps])."""
    attempt: int = 0
    """Which run of this configuration the row comes from (0: the first)."""
    clean_steps: int = 0
    """Undisturbed timed steps (when none, ``real_steps_s`` holds every step)."""

    @property
    def disturbed(self) -> int:
        """Timed steps found disturbed."""
        return len(self.all_steps_s) - self.clean_steps

    @property
    def error(self) -> float:
        """(simulated − real) / real."""
        return self.sim_s / self.real_s - 1.0


# Disturbed steps (Note [Disturbed steps] in profiler/overheads.py): real time = mean of the
# undisturbed timed steps; a configuration with fewer than MIN_CLEAN_STEPS of them is run again in
# a later world (--retries). The table shows how many steps were left out, and the summary also
# gives the errors with every step kept.
MIN_CLEAN_STEPS = 3


def _nominal(c: ValConfig, events: Sequence[Sequence]) -> list:
    """Events with each F/R/B's known sleep swapped for a BLOCKS_PER_STAGE stage at speed 1, so
    the homogeneous checks (``disturbed``, ``task_overheads``) apply to uneven stages, mixed
    device speeds and split backwards; identity for homogeneous unsplit configurations."""
    from varuna.core.schedule import schedule_kind

    nominal = BLOCKS_PER_STAGE * BLOCK_FWD_S
    out = []
    for e in events:
        stage, replica, op, _, _, end = e[:6]
        if op in ("F", "R", "B") and (c.speeds is not None or c.stage_blocks is not None):
            own = c.blocks[stage] * BLOCK_FWD_S / c.speed_of(replica * c.num_stages + stage)
            end = end - (own - nominal) * (2.0 if op == "B" else 1.0)
        if op == "B" and schedule_kind(c.schedule).splits_backward:  # input gradient only: count it whole
            end = end + 2 * nominal * (1.0 if stage == 0 else WEIGHT_FRAC)
        out.append([*e[:5], end, *e[6:]])
    return out


def analyze_run(c: ValConfig, ranks: Sequence[dict], attempt: int = 0, *, spread: bool = False) -> Row:
    """Real (median over the undisturbed timed steps) and simulated time of ``c`` in one world.

    ``spread``: simulate the measured spreads of the hand-off and of task durations as
    independent exponential noise (Note [Hand-off]); otherwise they are only reported."""
    run = ranks[0]["runs"][c.label]
    rc = runtime_constants(ranks, run["bench_rounds"])
    if not spread:
        rc = replace(rc, handoff_jitter_s=0.0, task_jitter_s=0.0)
    every = step_times(ranks, c.label, c.num_stages)
    events = [[e for r in ranks for e in r["runs"][c.label]["steps"][i]["events"]] for i in range(len(every))]
    clean = [i for i, evs in enumerate(events) if not disturbed(_nominal(c, evs))]
    use = clean if clean else list(range(len(every)))
    real = [every[i] for i in use]
    over = [x for i in use for xs in task_overheads(_nominal(c, events[i])).values() for x in xs]
    model = [rc.task_s(e[2], BLOCKS_PER_STAGE, BLOCKS_PER_STAGE * e[0])
             for i in use for e in events[i] if e[2] in ("F", "R", "B")]
    hops = [h for i in use for h in waiting_hops(events[i])]
    warm = [r["runs"][c.label].get("warmup") or [] for r in ranks]
    first = None
    if all(warm) and not disturbed(_nominal(c, [e for w in warm for e in w[0].get("events", [])])):
        firsts = [w for i, w in enumerate(warm) if i % c.num_stages == 0]
        first = max(w[0]["t1"] for w in warm) - min(w[0]["t0"] for w in firsts)
    return Row(config=c, real_s=statistics.mean(real), sim_s=simulate_config(c, rc),
               real_median_s=statistics.median(real),
               sim_median_s=simulate_config(c, rc, stat=statistics.median),
               known_sim_s=simulate_config(c, known_costs_only()), real_steps_s=real, constants=rc,
               task_overhead_ms=trimmed_mean(over) * 1e3 if over else 0.0,
               model_task_overhead_ms=statistics.mean(model) * 1e3 if model else 0.0,
               hop_ms=trimmed_mean(hops) * 1e3 if hops else 0.0, first_step_s=first,
               all_steps_s=every, attempt=attempt, clean_steps=len(clean))


def print_table(rows: Sequence[Row], constants: dict[int, RuntimeConstants]) -> None:
    """The table, the error summary and the measured constants (all rounds of each world)."""
    print()
    print("runtime constants per world, all micro-benchmark rounds (ms; Note [Task costs]: t, s, p):")
    print(f"  {'W':>2} {'hand-off':>9} {'spread':>7} {'+netem':>7} {'probe':>6} {'task t':>7} {'spread':>7} "
          f"{'seg s':>6} {'ph p':>6} {'fit rms':>8} {'step':>6} {'AR(2)':>6}")
    for w, rc in sorted(constants.items()):
        print(f"  {w:>2} {rc.handoff_s * 1e3:>9.2f} {rc.handoff_jitter_s * 1e3:>7.2f} "
              f"{rc.handoff_netem_s * 1e3:>7.2f} {rc.probe_handoff_s * 1e3:>6.2f} "
              f"{rc.task_overhead_s * 1e3:>7.2f} {rc.task_jitter_s * 1e3:>7.2f} "
              f"{rc.segment_overhead_s * 1e3:>6.2f} {rc.placeholder_s * 1e3:>6.3f} "
              f"{rc.fit_rms_s * 1e3:>8.2f} {rc.step_overhead_s * 1e3:>6.2f} {rc.allreduce_s * 1e3:>6.2f}")
    print()
    w = max([28] + [len(r.config.label) + 1 for r in rows])
    print(f"{'config':<{w}}{'real (s)':>10}{'sim (s)':>10}{'error':>9}  {'known-only':>11}  {'steps':>6}   "
          f"{'task+ real/model ms':>20}{'hop ms':>8}")
    for r in rows:
        tm = f"{r.task_overhead_ms:.2f}/{r.model_task_overhead_ms:.2f}"
        known = r.known_sim_s / r.real_s - 1
        used = f"{r.clean_steps}/{len(r.all_steps_s)}" + ("*" if r.attempt else " ")
        print(f"{r.config.label:<{w}}{r.real_s:>10.3f}{r.sim_s:>10.3f}{r.error * 100:>+8.1f}%  "
              f"{known * 100:>+10.1f}%  {used:>6}   {tm:>20}{r.hop_ms:>8.2f}")
    print("steps: undisturbed / timed steps of the run used (Note [Disturbed steps]); *: a re-run")
    errs = [abs(r.error) for r in rows]
    med, worst = statistics.median(errs), max(errs)
    print(f"\n{len(rows)} configurations: median |error| {med * 100:.1f}%, max |error| {worst * 100:.1f}% "
          f"({max(rows, key=lambda r: abs(r.error)).config.label})")
    known = [abs(r.known_sim_s / r.real_s - 1) for r in rows]
    print(f"known costs only (no runtime constants): median |error| {statistics.median(known) * 100:.1f}%, "
          f"max {max(known) * 100:.1f}%")
    with_medians = [r for r in rows if r.real_median_s]
    if with_medians:
        def median_error(r: Row) -> float:
            return abs(r.sim_median_s / r.real_median_s - 1)

        worst_m = max(with_medians, key=median_error)
        print(f"medians instead of means (Note [Means, not medians]): median |error| "
              f"{statistics.median(map(median_error, with_medians)) * 100:.1f}%, "
              f"max {median_error(worst_m) * 100:.1f}% ({worst_m.config.label})")
    kept = [abs(r.sim_s / statistics.mean(r.all_steps_s) - 1) for r in rows]
    print(f"every timed step kept (disturbed ones too): median |error| {statistics.median(kept) * 100:.1f}%, "
          f"max {max(kept) * 100:.1f}%; {sum(r.disturbed for r in rows)} of "
          f"{sum(len(r.all_steps_s) for r in rows)} steps disturbed, "
          f"{sum(r.attempt > 0 for r in rows)} configuration(s) re-run")
    slow = [r.first_step_s / r.real_s - 1 for r in rows if r.first_step_s]
    if slow:
        print(f"first step after building the engine (untimed warm-up, undisturbed): median "
              f"{statistics.median(slow) * 100:+.1f}%, max {max(slow) * 100:+.1f}% vs steady-state mean")
    ok = worst <= 0.05 and med <= 0.03
    print(f"goal: every config within 5%, median <= 3% -> {'met' if ok else 'MISSED'}")


def write_gantt(c: ValConfig, trace: dict, rc: RuntimeConstants, out_dir: Path) -> list[Path]:
    """Real (from ``Engine.gather_timeline``) and simulated Gantt charts and traces of ``c``."""
    from simulator.engine import simulate
    from varuna.core.timeline import Timeline

    out_dir.mkdir(parents=True, exist_ok=True)
    real = Timeline.from_chrome_dict(trace)
    sim = simulate(calibration_of(c, rc), sim_config(c, rc), record=True).timeline
    assert sim is not None
    paths = []
    for name, tl in (("real", real), ("sim", sim)):
        png = out_dir / f"sim_vs_real_{name}.png"
        kind = "real engine" if name == "real" else "simulator"
        tl.plot_gantt(png, title=f"{c.label}: {kind}, {tl.span_s():.3f} s", dpi=80)
        paths.append(png)
    return paths


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two small configurations (the smoke test)")
    p.add_argument("--only", default="", help="comma-separated substrings; keep configs whose label has all")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration")
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    p.add_argument("--probe-messages", type=int, default=40,
                   help="hand-off probe: messages per direction and round, split over the rank pairs")
    p.add_argument("--json", type=Path, help="write constants, rows and steps here")
    p.add_argument("--gantt-dir", type=Path, help="write sim_vs_real_{real,sim}.png (and traces) here")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per world before giving up")
    p.add_argument("--retries", type=int, default=2,
                   help="re-runs of configurations with too many disturbed steps (Note [Disturbed steps])")
    p.add_argument("--priority", choices=("rr", "nice", "normal"), default="rr",
                   help="CPU priority of the workers: SCHED_RR (default), niceness -10, or unchanged")
    p.add_argument("--spread", action="store_true",
                   help="simulate the measured hand-off and task-time spreads as noise (Note [Hand-off])")
    p.add_argument("--work-dir", type=Path,
                   help="keep the workers' raw measurements here (default: a temporary directory)")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    return p


def _run_all(a: argparse.Namespace, configs: list[ValConfig], gantt: str, tmp: str
             ) -> tuple[dict[str, Row], dict[int, RuntimeConstants], dict[str, dict]]:
    """Run every configuration, one world per world size, re-running those with too many
    disturbed steps (``--retries``): the best row per label, the constants per world size (all
    rounds of its first world) and the gathered traces."""
    pending: dict[int, list[ValConfig]] = {}
    for c in configs:
        pending.setdefault(c.world, []).append(c)
    best: dict[str, Row] = {}
    constants: dict[int, RuntimeConstants] = {}
    traces: dict[str, dict] = {}
    for attempt in range(a.retries + 1):
        for w, cs in sorted(pending.items()):
            if attempt:
                print(f"[validate] re-running {len(cs)} configuration(s) with disturbed steps at W={w}: "
                      + ", ".join(c.label for c in cs), flush=True)
            spec = WorldSpec(world=w, configs=[asdict(c) for c in cs],
                             out_dir=str(Path(tmp, f"w{w}" + (f"-retry{attempt}" if attempt else ""))),
                             warmup=a.warmup, steps=a.steps, probe_messages=a.probe_messages,
                             priority=a.priority,
                             gantt_label=gantt if any(c.label == gantt for c in cs) else None)
            ranks = run_world(spec, a.timeout)
            constants.setdefault(w, runtime_constants(ranks))
            for c in cs:
                row = analyze_run(c, ranks, attempt, spread=a.spread)
                prev = best.get(c.label)
                if prev is None or row.clean_steps >= prev.clean_steps:
                    best[c.label] = row
                    tr = ranks[0]["runs"][c.label].get("trace")
                    if tr:
                        traces[c.label] = tr
        pending = {w: [c for c in cs if best[c.label].clean_steps < min(MIN_CLEAN_STEPS, a.steps)]
                   for w, cs in pending.items()}
        pending = {w: cs for w, cs in pending.items() if cs}
        if not pending:
            break
    return best, constants, traces


def _write_json(path: Path, rows: Sequence[Row], constants: dict[int, RuntimeConstants],
                traces: dict[str, dict]) -> None:
    """``--json``: constants, rows (with their steps) and traces."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "constants": {str(w): rc.to_dict() for w, rc in constants.items()},
        "rows": [{"config": asdict(r.config), "label": r.config.label, "real_s": r.real_s,
                  "sim_s": r.sim_s, "known_sim_s": r.known_sim_s, "error": r.error,
                  "real_median_s": r.real_median_s, "sim_median_s": r.sim_median_s,
                  "real_steps_s": r.real_steps_s,
                  "task_overhead_ms": r.task_overhead_ms, "first_step_s": r.first_step_s,
                  "all_steps_s": r.all_steps_s, "clean_steps": r.clean_steps, "attempt": r.attempt,
                  "hop_ms": r.hop_ms, "model_task_overhead_ms": r.model_task_overhead_ms,
                  "constants": r.constants.to_dict()} for r in rows],
        "traces": traces,
    }, indent=1))
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a._worker:
        return _worker_main(a._worker)
    configs = quick_configs() if a.quick else default_configs()
    if a.only:
        parts = [s.strip() for s in a.only.split(",") if s.strip()]
        configs = [c for c in configs if all(s in c.label for s in parts)]
    if not configs:
        p.error("no configuration matches --only")
    if a.quick:
        a.steps, a.probe_messages = min(a.steps, 3), min(a.probe_messages, 16)
    gantt = GANTT_LABEL if not a.quick else configs[-1].label
    budget = sum(c.ideal_s() * 1.15 * (a.warmup + a.steps) + 3.0 for c in configs)
    print(f"{len(configs)} configurations, {a.warmup} warm-up + {a.steps} timed steps each; "
          f"estimated {budget / 60:.1f} min + world start-up", flush=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="varuna-validate-") as tmp_dir:
        best, constants, traces = _run_all(a, configs, gantt, str(a.work_dir) if a.work_dir else tmp_dir)
    rows = list(best.values())
    order = {c.label: i for i, c in enumerate(configs)}
    rows.sort(key=lambda r: order[r.config.label])
    print_table(rows, constants)
    print(f"wall time {time.perf_counter() - t_start:.0f} s")
    if a.gantt_dir and gantt in traces:
        c = next(c for c in configs if c.label == gantt)
        row = next(r for r in rows if r.config.label == gantt)
        for path in write_gantt(c, traces[gantt], row.constants, a.gantt_dir):
            print(f"wrote {path}")
    if a.json:
        _write_json(a.json, rows, constants, traces)
    return 0


if __name__ == "__main__":
    sys.exit(main())
