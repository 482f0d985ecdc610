"""The simulator's event loop: one mini-batch of pipeline + data-parallel training.

Given a calibration and a config (P stages × D replicas, micro-batch size m, micro-batches per
replica, segment→stage map, schedule kind, host placement), replay the mini-batch as discrete
events and report its time, throughput, per-stage busy/idle time and peak stashed activations.

What decides the order of work: each stage's tasks come from ``varuna.core.schedule.get_schedule``
and are picked one at a time by the same :class:`varuna.core.schedule.StagePolicy` the runtime runs
(``arrived`` when an activation or gradient lands, ``next_task`` when the stage is idle,
``complete`` when a task ends). The simulator never orders tasks itself: the schedule kind
(``varuna.core.schedule.schedule_kind``) builds the policies, including those of the
simulation-only interleaved 1F1B schedule (``varuna/core/interleaved.py``).

The pieces: ``simulator/config.py`` (what is asked and answered), ``simulator/costs.py`` (what
each task, message, all-reduce and byte costs), ``simulator/events.py`` (the event loop); this
module puts them together.

What is modelled (see docs/simulator.md for formulas):

- compute: a task's time is the sum over the stage's segments of the calibrated F, R or B at m
  (the replica's final micro-batch may be smaller: costs and sizes at its size), plus the
  runtime's per-task overhead ``task_overhead_s`` and, for F and R, its placeholder glue
  ``placeholder_s`` per segment before the stage (these and ``step_overhead_s``: the
  ``SimConfig`` field where set, else the calibration's ``runtime_overheads``, else 0;
  :func:`runtime_overheads`);
- point-to-point sends: the fitted link model, intra- or inter-host from the rank placement
  (rank = replica·P + stage; consecutive ranks fill a host's slots), applied as varuna/testing/netem.py
  emulates a link: FIFO serialization (bytes/bandwidth, ``max_sends_per_link`` at once), then the
  latency with a seeded exponential jitter per message, no overtaking (Note [Link model] in
  ``simulator/events.py``); sends
  never block compute;
- mixed VM types (``SimConfig.device_types``): each device's F, R and B at its VM type's costs,
  and replicas with uneven micro-batch counts (``num_microbatches`` per replica, e.g. the shares of
  ``varuna.core.batching.microbatch_counts(..., shares=...)``);
- the per-stage gradient all-reduce over D replicas, starting when the last (slowest) replica
  finishes the stage's last backward, with k = the number of rings sharing a host's NIC;
- the optimizer step after the all-reduce;
- a fixed per-mini-batch runtime overhead ``step_overhead_s`` (step set-up and the end-of-step
  agreement all-reduce), added to the mini-batch time.

Example::

    >>> from varuna.core.calibration import Calibration
    >>> cal = Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1, 2))
    >>> r = simulate(cal, SimConfig(num_stages=2, micro_batch_size=1, num_microbatches=4, schedule="gpipe",
    ...                             recompute=False))
    >>> round(r.minibatch_s, 6)   # (Nm + P - 1)·(F + B) = 5 · (0.02 + 0.04)
    0.3
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from simulator.config import SimConfig, SimResult, host_of_ranks, validate_config
from simulator.costs import runtime_overheads, stage_cost_tables, stage_memory, sync_costs
from simulator.events import Links, Tallies, rank_tables, run_events
from varuna.core.calibration import Calibration
from varuna.core.schedule import schedule_kind
from varuna.core.timeline import Timeline

__all__ = ["simulate", "SimConfig", "SimResult"]


def simulate(cal: Calibration, config: SimConfig, *, record: bool = False) -> SimResult:
    """Simulate one mini-batch of ``config`` with ``cal``'s costs.

    ``record=True`` also returns a :class:`varuna.core.timeline.Timeline` of every task, send,
    all-reduce and optimizer step (slower: one object per event). An asynchronous kind (2bw,
    no flush between mini-batches) is priced in steady state: :func:`_steady_state`.
    """
    if schedule_kind(config.schedule).weight_versions > 1:
        return _steady_state(cal, config, record=record)
    return _simulate(cal, config, record=record)


def _steady_state(cal: Calibration, c: SimConfig, *, record: bool) -> SimResult:
    """Note [2BW] in varuna/core/schedule.py: mini-batches run back to back, so one costs what a
    window of two costs beyond a window of one: T(2) - T(1), each window ending with the last
    mini-batch's all-reduce and optimizer step; an earlier mini-batch's are run by each stage
    right after its own last backward of it, before its next task (the engine's no-flush window,
    Note [No-flush window] in varuna/runtime/no_flush.py; their use of the links is not
    modelled). Busy times likewise; the executed orders are the second mini-batch's tasks
    (micro-batch Nm + i is its i-th) in the order they ran; peaks and the timeline are the
    two-step window's."""
    kind = schedule_kind(c.schedule)
    for d in range(c.num_replicas):
        reason = kind.unsupported(c.num_stages, c.microbatches_of(d))
        if reason is not None:
            raise ValueError(reason)
    one = _simulate(cal, c, record=False)
    two = _simulate(cal, c, record=record, steps=2)
    t = two.minibatch_s - one.minibatch_s
    busy = tuple(b2 - b1 for b1, b2 in zip(one.stage_busy_s, two.stage_busy_s))
    second = tuple(
        tuple(tuple(task for task in order if task.microbatch >= c.microbatches_of(d)) for order in per_stage)
        for d, per_stage in zip(two.simulated_replicas, two.executed)
    )
    return dataclasses.replace(
        two,
        executed=second,
        minibatch_s=t,
        examples_per_s=one.examples / t if t > 0 else math.inf,
        pipeline_s=two.pipeline_s - one.pipeline_s,
        examples=one.examples,
        stage_busy_s=busy,
        stage_idle_s=tuple(
            max(0.0, t - b - a - o) for b, a, o in zip(busy, one.stage_allreduce_s, one.stage_optimizer_s)
        ),
    )


def _simulate(cal: Calibration, config: SimConfig, *, record: bool, steps: int = 1) -> SimResult:
    """One window of ``steps`` mini-batches of ``config`` (more than one: back to back, 2bw)."""
    c = config
    ranges = validate_config(cal, c)
    kind = schedule_kind(c.schedule)
    if steps > 1:  # the window's micro-batches; a short last micro-batch only at its very end
        counts = tuple(steps * c.microbatches_of(d) for d in range(c.num_replicas))
        c = dataclasses.replace(c, num_microbatches=counts)
    v = kind.chunks_per_device(c.chunks)
    host = host_of_ranks(c)
    over, placeholder_s, step_overhead_s = runtime_overheads(cal, c)
    sizes = {c.micro_batch_size} | {c.last_size_of(d) for d in range(c.num_replicas)}
    sel = c.recompute_segments
    costs = stage_cost_tables(cal, ranges, sizes, task_overhead_s=over, placeholder_s=placeholder_s,
                              recompute_segments=sel)
    links = Links.of(cal, c)
    sim_replicas = _replicas_to_simulate(c, host, links.random)
    rank_costs = None
    if c.device_types is not None:
        # Mixed VM types: each device computes at its type's costs (Calibration.for_type).
        by_type = {
            t: stage_cost_tables(
                cal.for_type(t), ranges, sizes, task_overhead_s=over, placeholder_s=placeholder_s,
                recompute_segments=sel,
            )
            for t in sorted({t for row in c.device_types for t in row})
        }
        rank_costs = [by_type[c.device_types[d][k]] for d in sim_replicas for k in range(c.num_stages)]
    policies, pipelines = [], {}
    for d in sim_replicas:
        nm = c.microbatches_of(d)
        pipe = kind.window(c.num_stages, nm // steps, steps, recompute=c.recompute, chunks=c.chunks)
        policies.extend(pipe.policy(k, stash_headroom=c.stash_headroom) for k in range(c.num_stages))
        pipelines[nm] = pipe
    tl = Timeline(metadata={"config": c.label(), "source": "simulator"}) if record else None
    holds = _step_ends(cal, c, ranges, sim_replicas, steps) if steps > 1 else None
    tallies = run_events(
        rank_tables(c, v, host, sim_replicas, costs, links, rank_costs),
        policies,
        chunked=kind.chunked,
        chunks=v,
        max_sends_per_link=c.max_sends_per_link,
        links=links,
        seed=c.seed,
        timeline=tl,
        split_backward=kind.splits_backward,
        step_ends=holds,
    )
    # What the stage's list recomputes decides its memory (replica 0's micro-batch count).
    pipe = pipelines[c.microbatches_of(sim_replicas[0])]
    recomputes = [pipe.recomputes(k) for k in range(c.num_stages)]
    res = _result(cal, c, ranges, sim_replicas, tallies, recomputes, policies, step_overhead_s, tl)
    return dataclasses.replace(res, config=config) if steps > 1 else res


def _step_ends(
    cal: Calibration, c: SimConfig, ranges: Sequence[tuple[int, int]], sim_replicas: Sequence[int], steps: int
) -> list[dict[int, float]]:
    """Per simulated rank, the window's mini-batch ends but the last (window micro-batch of the
    mini-batch's last B) -> the gradient all-reduce and optimizer step the stage then runs before
    its next task, as the engine does (Note [No-flush window] in varuna/runtime/no_flush.py); the
    last mini-batch's are priced after the window (:func:`_result`)."""
    P = c.num_stages
    per_stage = [[s for s in range(a, b + 1)] for a, b in ranges]
    hold = [ar + opt for ar, opt in sync_costs(cal, c, per_stage)]
    out = []
    for d in sim_replicas:
        nm = c.microbatches_of(d) // steps
        out.extend({s * nm + nm - 1: hold[k] for s in range(steps - 1)} for k in range(P))
    return out


def _replicas_to_simulate(c: SimConfig, host: Sequence[int], random: bool) -> list[int]:
    """Replicas interact only through the all-reduce, which starts after the slowest one. Without
    random durations, replicas with the same micro-batches and the same intra/inter link pattern
    run identically: simulate one of each kind."""
    P = c.num_stages
    if random:
        return list(range(c.num_replicas))

    def pattern(d: int):
        base = d * P
        links = tuple(host[base + k] == host[base + (k + 1) % P] for k in range(P))
        types = c.device_types[d] if c.device_types is not None else None
        return c.microbatches_of(d), c.last_size_of(d), links, types

    seen: dict = {}
    for d in range(c.num_replicas):
        seen.setdefault(pattern(d), d)
    return sorted(seen.values())


def _result(
    cal: Calibration,
    c: SimConfig,
    ranges: tuple[tuple[int, int], ...],
    sim_replicas: Sequence[int],
    t: Tallies,
    recomputes: Sequence[bool],
    policies: Sequence,
    step_overhead_s: float,
    tl: Timeline | None,
) -> SimResult:
    """The gradient all-reduce and optimizer step per device after its last backward, and the
    :class:`SimResult`."""
    P, D, m, nsim = c.num_stages, c.num_replicas, c.micro_batch_size, len(sim_replicas)
    device_ranges: list[list[tuple[int, int]]] = [[] for _ in range(P)]
    for vs, r in enumerate(ranges):
        device_ranges[vs % P].append(r)
    device_segments = [[s for a, b in rs for s in range(a, b + 1)] for rs in device_ranges]
    ar_s, opt_s, end_s = [], [], []
    for k, (ar, opt) in enumerate(sync_costs(cal, c, device_segments)):
        stage_end = max(t.last_b_end[j * P + k] for j in range(nsim))
        ar_s.append(ar)
        opt_s.append(opt)
        end_s.append(stage_end + ar + opt)
        if tl is not None:
            for d in sim_replicas:
                if ar > 0:
                    tl.add(k, d, "AR", None, stage_end, stage_end + ar)
                if opt > 0:
                    tl.add(k, d, "OPT", None, stage_end + ar, stage_end + ar + opt)
    minibatch_s = max(end_s) + step_overhead_s
    busy = [max(t.busy[j * P + k] for j in range(nsim)) for k in range(P)]
    peak = [max(t.peak[j * P + k] for j in range(nsim)) for k in range(P)]
    examples = sum((c.microbatches_of(d) - 1) * m + c.last_size_of(d) for d in range(D))
    if tl is not None:
        tl.metadata.update({"minibatch_s": minibatch_s, "P": P, "D": D, "m": m})
    return SimResult(
        config=c,
        minibatch_s=minibatch_s,
        examples_per_s=examples / minibatch_s if minibatch_s > 0 else math.inf,
        pipeline_s=max(t.last_b_end),
        examples=examples,
        stage_busy_s=tuple(busy),
        stage_idle_s=tuple(minibatch_s - busy[k] - ar_s[k] - opt_s[k] for k in range(P)),
        stage_allreduce_s=tuple(ar_s),
        stage_optimizer_s=tuple(opt_s),
        peak_stashed=tuple(peak),
        stage_memory_bytes=tuple(
            stage_memory(cal, device_ranges[k], m, peak[k], recomputes[k],
                         weight_versions=schedule_kind(c.schedule).weight_versions,
                         recompute_segments=c.recompute_segments)
            for k in range(P)
        ),
        stage_segments=ranges,
        executed=tuple(tuple(tuple(policies[j * P + k].executed) for k in range(P)) for j in range(nsim)),
        simulated_replicas=tuple(sim_replicas),
        timeline=tl,
    )
