"""The calibration runs of the runtime overheads: the engine itself, run on emulated devices.

Worker-side half of :mod:`profiler.overheads` (which fits what these record; pure Python). Each
of W processes (``torch.distributed`` already initialised, gloo) calls :func:`micro_benchmarks`
for one round: hand-off probes through the runtime's ``LinkSender``/``LinkReceiver`` (plain and
under a latency-only network emulation), a 2-rank gradient all-reduce, and the calibration runs
of Note [Task costs] (W×1 1F1B pipelines of 1- and 3-block stages over
``varuna.testing.EmulatedBlock``\\ s, every task recorded in the timeline). The rounds' results,
one list per rank, go to :func:`profiler.overheads.runtime_constants`.

Every engine's process groups are destroyed after its run (:func:`owned_groups`), so a worker
can build dozens of engines without slowing down.

Example (in each worker process)::

    dist.init_process_group("gloo")
    bench = micro_benchmarks(dist.get_rank(), dist.get_world_size(), probe_messages=40,
                             calibration_steps=3, timeout_s=120.0)
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

import varuna
from profiler.overheads import (
    CALIBRATION_BLOCKS,
    CALIBRATION_MICROBATCHES,
    CALIBRATION_STAGE_FWD_S,
    EMULATED_WIDTH,
    MICRO_BATCH_SIZE,
    PROBE_LATENCY_S,
)
from varuna.core.schedule import FORWARD, schedule_kind
from varuna.runtime.comm import LinkReceiver, LinkSender
from varuna.testing.emulated import emulated_model
from varuna.testing.netem import NETEM_ENV_VAR, emulate_network

__all__ = [
    "destroy_groups",
    "emulated_engine",
    "micro_benchmarks",
    "owned_groups",
    "probe_allreduce",
    "probe_handoff",
    "timed_steps",
]

#: Stage-0 gradient buffer of a stage of this many blocks, all-reduced by :func:`probe_allreduce`.
_ALLREDUCE_BLOCKS = 2


def _batch(num_examples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(num_examples, EMULATED_WIDTH, generator=g),
            torch.randn(num_examples, EMULATED_WIDTH, generator=g))


@contextlib.contextmanager
def owned_groups() -> Iterator[list]:
    """Record every process group created inside the block; destroy them (and free their threads)
    when the caller's ``finally`` calls :func:`destroy_groups`.

    Why: every gloo process group costs each member 3 threads that wake periodically (100 groups
    cost an idle process ~0.1 core, measured), and neither ``Engine.close()`` nor dropping the
    engine frees them. A worker that builds dozens of engines (scripts/validate_simulator.py) would
    slow down as it goes: the hand-off, the all-reduces and the step overhead grew round after
    round (2× after ~300 groups at W = 8).
    """
    created: list = []
    original = dist.new_group

    def new_group(*args, **kwargs):
        g = original(*args, **kwargs)
        created.append(g)
        return g

    dist.new_group = new_group
    try:
        yield created
    finally:
        dist.new_group = original


def destroy_groups(groups: list) -> None:
    """Destroy the groups this rank is a member of (others got a non-member sentinel)."""
    for g in groups:
        if isinstance(g, dist.ProcessGroup):
            try:
                dist.destroy_process_group(g)
            except (ValueError, RuntimeError):
                pass  # Engine.close() already destroyed the groups it created
    groups.clear()
    gc.collect()  # the last references (engine, comm threads) go; the groups' threads end


@contextlib.contextmanager
def emulated_engine(num_stages: int, num_replicas: int, schedule: str, num_microbatches: int,
                    recompute: bool, netem: str | None, timeout_s: float, *, blocks_per_stage: int,
                    block_fwd_s: float, stage_blocks: Sequence[int] | None = None,
                    replica_shares: Sequence[int] | None = None, speed: float = 1.0,
                    chunks: int = 1, weight_frac: float = 0.5,
                    ) -> Iterator[tuple[Any, Any]]:
    """An engine over ``varuna.testing.emulated_model`` with ``blocks_per_stage · num_stages``
    blocks, one stage per ``blocks_per_stage`` blocks, under the network emulation ``netem``
    (a ``$VARUNA_NETEM`` value; None: none): yields it and its (whole) mini-batch; closes it and
    destroys its process groups after.

    Mixed VM types (issue #19): ``stage_blocks`` (blocks per stage, uneven) replaces
    ``blocks_per_stage``; ``replica_shares`` gives each replica its micro-batch count (the global
    batch is then m·Σshares, ``num_microbatches`` unused); ``speed`` is this rank's emulated
    device speed (``emulated_model(speed=...)``).

    Issue 18: ``chunks`` = v model chunks per process (the interleaved kinds): P·v virtual
    stages of ``blocks_per_stage`` blocks each (``stage_blocks``, if given, lists all P·v);
    ``weight_frac``: the blocks' share of the backward spent on weight gradients (a zero-bubble
    W; ``EmulatedBlock.weight_frac``).

    Example (every rank)::

        with emulated_engine(2, 1, "1f1b", 6, True, None, 120.0, blocks_per_stage=2,
                             block_fwd_s=0.01) as (engine, batch):
            steps = timed_steps(engine, batch, warmup=1, steps=3)
    """
    if replica_shares is not None:
        M = MICRO_BATCH_SIZE * sum(replica_shares)
    else:
        M = MICRO_BATCH_SIZE * num_microbatches * num_replicas
    batch = _batch(M)
    torch.manual_seed(0)
    V = num_stages * chunks
    per_stage = list(stage_blocks) if stage_blocks is not None else [blocks_per_stage] * V
    model = emulated_model(sum(per_stage), block_fwd_s, EMULATED_WIDTH, speed=speed, weight_frac=weight_frac)
    starts = [sum(per_stage[:k]) for k in range(V)]
    ranges = [(a, a + n - 1) for a, n in zip(starts, per_stage)]
    if netem:
        os.environ[NETEM_ENV_VAR] = netem  # the engine reads it at construction
    else:
        os.environ.pop(NETEM_ENV_VAR, None)
    groups: list = []
    try:
        with owned_groups() as groups:
            engine = varuna.Engine(
                model,
                varuna.VarunaConfig(
                    global_batch_size=M, micro_batch_size=MICRO_BATCH_SIZE, pipeline_depth=num_stages,
                    data_parallel=num_replicas, schedule=schedule, stop_signals=(),
                    pipeline=varuna.PipelineConfig(
                        recompute=recompute, stage_ranges=ranges, chunks=chunks,
                        replica_shares=None if replica_shares is None else tuple(replica_shares),
                    ),
                    metrics=varuna.MetricsConfig(record_timeline=True),
                    timeouts=varuna.TimeoutConfig(comm_s=timeout_s),
                ),
                example_batch=batch, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3),
            )
    finally:
        os.environ.pop(NETEM_ENV_VAR, None)
    try:
        yield engine, batch
    finally:
        engine.close()
        del engine
        dist.barrier()
        destroy_groups(groups)


def timed_steps(engine, batch, warmup: int, steps: int, warmup_out: list | None = None) -> list[dict]:
    """Warm-up, then timed steps, each started after a barrier: per timed step (t0, t1, this
    rank's events). ``warmup_out`` collects the same for the warm-up steps. 2bw: one no-flush
    window of them all (:func:`timed_window`)."""
    if schedule_kind(engine.config.schedule).weight_versions > 1:
        return timed_window(engine, batch, warmup, steps, warmup_out)
    out = []
    for s in range(warmup + steps):
        n0 = len(engine.timeline.events)
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_step(batch)
        t1 = time.perf_counter()
        events = [[e.stage, e.replica, e.op, e.microbatch, e.start_s, e.end_s]
                  for e in engine.timeline.events[n0:]]
        if s >= warmup:
            out.append({"t0": t0, "t1": t1, "events": events})
        elif warmup_out is not None:
            warmup_out.append({"t0": t0, "t1": t1, "events": events})
    # Ranks that finish the last step early must not start tearing their engine down (gc,
    # group destruction: CPU-heavy) while another is still in it: on a loaded 2-core host that
    # stretched the last timed step by up to 0.3 s (scripts/validate_mixed.py, docs/mixed_types.md).
    dist.barrier()
    return out


def timed_window(engine, batch, warmup: int, steps: int, warmup_out: list | None = None) -> list[dict]:
    """:func:`timed_steps` of 2bw without a flush: ``warmup + steps`` mini-batches in one
    ``Engine.train_steps`` window after a barrier. A step's t1 is its end on this rank (its
    update, after the stage's last backward of it), its t0 the previous step's end (the first:
    the window's start), so on a stage-0 rank t1 - t0 is the steady-state period; its events are
    the tasks of its micro-batches (the window tags them step·micro-batches + index) and the
    update."""
    n0 = len(engine.timeline.events)
    dist.barrier()
    t_start = time.perf_counter()
    results = engine.train_steps([batch] * (warmup + steps))
    total = sum(len(p) for p in engine.micro_plan)
    ends, t = [], t_start
    for r in results:
        t += r.step_s
        ends.append(t)
    per_step: list[list] = [[] for _ in results]
    for e in engine.timeline.events[n0:]:
        if e.microbatch is not None:
            s = e.microbatch // total
        else:  # the update: the step that ends at or after it
            s = next((i for i, end in enumerate(ends) if e.end_s <= end + 1e-6), len(ends) - 1)
        per_step[s].append([e.stage, e.replica, e.op, e.microbatch, e.start_s, e.end_s])
    out = []
    for s, events in enumerate(per_step):
        rec = {"t0": ends[s - 1] if s else t_start, "t1": ends[s], "events": events}
        if s >= warmup:
            out.append(rec)
        elif warmup_out is not None:
            warmup_out.append(rec)
    dist.barrier()  # as timed_steps: no rank tears down while another still runs
    return out


def probe_handoff(rank: int, world: int, messages: int, netem: str | None, timeout_s: float) -> dict:
    """Send spaced messages along each pair (2j → 2j+1, then back), one pair at a time, through
    the runtime's LinkSender/LinkReceiver threads; record send-call and inbox-arrival times.

    ``messages`` in all per direction, split over the pairs. The receiver waits on its inbox as
    the engine's idle stage does; the sender sleeps between messages as a stage computes between
    sends. One pair at a time: in a pipeline, messages are spread over time, not sent in bursts
    by every rank at once. perf_counter is system-wide (CLOCK_MONOTONIC), so times of different
    processes compare.
    """
    pairs = [(2 * j, 2 * j + 1) for j in range(world // 2)]
    groups = {}
    with owned_groups() as owned:
        for a, b in pairs:  # every rank creates every group, in the same order
            groups[(a, b)] = dist.new_group([a, b])
            groups[(b, a)] = dist.new_group([a, b])
    per_pair = max(4, messages // len(pairs))
    sent, received = [], []
    cpu = torch.device("cpu")
    payload = torch.zeros(MICRO_BATCH_SIZE, EMULATED_WIDTH)
    gap_s = 0.012
    with emulate_network(netem):
        for direction in (0, 1):
            for a, b in pairs:
                src, dst = (a, b) if direction == 0 else (b, a)
                inbox: queue.Queue = queue.Queue()
                if rank == src:
                    sender = LinkSender("probe-send", dst, groups[(src, dst)], cpu, inbox, timeout_s)
                    for i in range(per_pair):
                        time.sleep(gap_s)
                        sent.append([src, dst, i, time.perf_counter()])
                        sender.send(i, (payload,))
                    sender.close()
                elif rank == dst:
                    receiver = LinkReceiver("probe-recv", FORWARD, src, groups[(src, dst)], cpu, inbox,
                                            timeout_s)
                    receiver.expect(per_pair)
                    for _ in range(per_pair):
                        item = inbox.get(timeout=timeout_s)
                        t = time.perf_counter()
                        if isinstance(item, Exception):
                            raise item
                        received.append([src, dst, item.microbatch, t])
                    receiver.close()
                dist.barrier()
    groups.clear()
    destroy_groups(owned)
    return {"sent": sent, "received": received}


def probe_allreduce(rank: int, world: int, reps: int) -> list[float]:
    """Times of one stage's gradient buffer all-reduced over concurrent 2-rank rings (D = 2)."""
    pairs = [(2 * j, 2 * j + 1) for j in range(world // 2)]
    mine = None
    with owned_groups() as owned:
        for a, b in pairs:
            g = dist.new_group([a, b])
            if rank in (a, b):
                mine = g
    out = []
    if mine is not None:
        flat = torch.zeros(_ALLREDUCE_BLOCKS * 2 * EMULATED_WIDTH)
        for i in range(reps + 1):
            dist.barrier(group=mine)
            t0 = time.perf_counter()
            dist.all_reduce(flat, group=mine)
            if i > 0:
                out.append(time.perf_counter() - t0)
            time.sleep(0.005)
    mine = g = None
    dist.barrier()
    destroy_groups(owned)
    return out


def micro_benchmarks(rank: int, world: int, probe_messages: int, calibration_steps: int,
                     timeout_s: float) -> dict:
    """One round of micro-benchmarks: hand-off probes (plain and emulated network), the 2-rank
    all-reduce, and the calibration runs of Note [Task costs] (``calibration_steps`` timed steps
    each, after one warm-up step). Reduced by :func:`profiler.overheads.runtime_constants`.

    Example (every rank of an initialised gloo world)::

        rounds = [micro_benchmarks(rank, world, 40, 3, 120.0)]
    """
    t = time.perf_counter()
    out: dict[str, Any] = {"probes": {}, "calibration": {}}
    out["probes"]["none"] = probe_handoff(rank, world, probe_messages, None, timeout_s)
    out["probes"]["netem"] = probe_handoff(rank, world, probe_messages,
                                           f"latency={PROBE_LATENCY_S * 1e3:g}ms", timeout_s)
    out["allreduce"] = probe_allreduce(rank, world, 20)
    for blocks in CALIBRATION_BLOCKS:
        run = emulated_engine(world, 1, "1f1b", CALIBRATION_MICROBATCHES, True, None, timeout_s,
                              blocks_per_stage=blocks, block_fwd_s=CALIBRATION_STAGE_FWD_S / blocks)
        with run as (engine, batch):
            out["calibration"][str(blocks)] = timed_steps(engine, batch, 1, calibration_steps)
    if rank == 0:
        print(f"[validate] world {world}: micro-benchmarks {time.perf_counter() - t:.1f} s", flush=True)
    return out


