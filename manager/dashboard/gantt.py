"""The dashboard's Gantt chart: one mini-batch of a generation, replayed from what it measured.

The manager does not receive the workers' task timelines (a heartbeat carries the mean forward,
backward and recompute time per micro-batch of the worker's stage, nothing per task). What it
can show truthfully is the generation's schedule with those measured durations: the simulator
(:func:`simulator.engine.simulate`, the runtime's own next-task policy) replays one mini-batch
at the generation's P×D, m and schedule from a calibration built out of the measured per-stage
times. Communication is left out (links and all-reduce cost nothing): the chart shows where the
pipeline's bubbles are, not the network. The result is a :class:`varuna.core.timeline.Timeline`,
the format both the runtime and the simulator produce.

    >>> from manager.domain.records import WorkerStatRecord
    >>> stat = lambda rank, stage, first, end: WorkerStatRecord(job_id="j", generation=1,
    ...     rank=rank, vm_id="v", stage=stage, replica=0, step=3, resumed_from=0, time=0.0,
    ...     fwd_s=0.01, bwd_s=0.02, recompute_s=0.01, micro_batch_size=2,
    ...     first_segment=first, end_segment=end)
    >>> tl = measured_timeline([stat(0, 0, 0, 1), stat(1, 1, 2, 3)], pipeline_depth=2,
    ...     data_parallel=1, global_batch_size=8, schedule="gpipe")
    >>> sorted({e.op for e in tl.events} & {"F", "B"}), tl.metadata["Nm"]
    (['B', 'F'], 4)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from statistics import median

from manager.domain.records import WorkerStatRecord
from simulator.config import SimConfig
from simulator.engine import simulate
from varuna.core.calibration import Calibration
from varuna.core.calibration_sections import ComputeStat
from varuna.core.timeline import COLORS, Timeline

__all__ = ["measured_timeline", "timeline_json"]

#: Operations drawn (sends take no time here: links are free).
_DRAWN = ("F", "R", "B", "AR", "OPT")


def measured_timeline(
    stats: Sequence[WorkerStatRecord],
    *,
    pipeline_depth: int,
    data_parallel: int,
    global_batch_size: int,
    schedule: str,
) -> Timeline | None:
    """One mini-batch at the generation's P×D replayed with its workers' measured per-stage
    times (module docstring); None until every stage has reported a step with its segments."""
    by_stage: dict[int, list[WorkerStatRecord]] = {}
    for s in stats:
        if s.step > s.resumed_from and s.micro_batch_size > 0 and s.fwd_s > 0:
            by_stage.setdefault(s.stage, []).append(s)
    if sorted(by_stage) != list(range(pipeline_depth)):
        return None
    ranges = tuple((by_stage[k][0].first_segment, by_stage[k][0].end_segment) for k in range(pipeline_depth))
    if ranges[0][0] != 0 or any(b[0] != a[1] + 1 for a, b in zip(ranges, ranges[1:])):
        return None  # not a tiling of the segments: an older heartbeat format
    m = by_stage[0][0].micro_batch_size
    per_segment: list[tuple[float, float, float]] = []
    for k, (first, end) in enumerate(ranges):
        n = end - first + 1
        f, b, r = (median(getattr(s, x) for s in by_stage[k]) / n for x in ("fwd_s", "bwd_s", "recompute_s"))
        per_segment.extend([(f, b, r)] * n)
    cal = Calibration.synthetic(
        [f / m for f, _, _ in per_segment], micro_batch_sizes=(m,), model_name="measured"
    )
    cal.segments = [
        dataclasses.replace(
            seg, bwd_s=[ComputeStat(median=b, spread=0.0)], recompute_s=[ComputeStat(median=r, spread=0.0)]
        )
        for seg, (_, b, r) in zip(cal.segments, per_segment)
    ]
    config = SimConfig.for_global_batch(
        global_batch_size=global_batch_size,
        num_replicas=data_parallel,
        micro_batch_size=m,
        num_stages=pipeline_depth,
        stage_segments=ranges,
        schedule=schedule,
        recompute=any(r > 0 for _, _, r in per_segment),
        jitter_scale=0.0,
    )
    result = simulate(cal, config, record=True)
    tl = result.timeline
    assert tl is not None
    nm = config.microbatches_of(0)
    tl.metadata.update({"P": pipeline_depth, "D": data_parallel, "m": m, "Nm": nm, "schedule": schedule})
    return tl


def timeline_json(tl: Timeline) -> dict:
    """The chart's data: one bar per task (replica 0's pipeline: replicas run alike here).

    >>> tl = Timeline(metadata={"P": 1})
    >>> tl.add(stage=0, replica=0, op="F", microbatch=0, start_s=0.0, end_s=0.5)
    >>> timeline_json(tl)["bars"]
    [{'stage': 0, 'op': 'F', 'microbatch': 0, 'start_s': 0.0, 'end_s': 0.5}]
    """
    bars = [
        {"stage": e.stage, "op": e.op, "microbatch": e.microbatch, "start_s": e.start_s, "end_s": e.end_s}
        for e in sorted(tl.events, key=lambda e: (e.stage, e.start_s))
        if e.replica == 0 and e.op in _DRAWN and e.end_s > e.start_s
    ]
    colors = {op: COLORS[op] for op in _DRAWN}
    return {"bars": bars, "span_s": tl.span_s(), "metadata": tl.metadata, "colors": colors}
