"""What the simulator charges: task and message costs per (virtual) stage, runtime overheads,
the gradient all-reduce and optimizer step, and per-stage memory (docs/simulator.md, formulas).

Example::

    >>> from varuna.core.calibration import Calibration
    >>> cal = Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1,))
    >>> t = stage_cost_tables(cal, [(0, 1), (2, 3)], {1}, task_overhead_s=0.0, placeholder_s=0.0)
    >>> [round(x, 3) for x in t[1].fwd]   # two segments of 0.01 s per stage
    [0.02, 0.02]
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from simulator.config import SimConfig, host_of_ranks
from varuna.core.calibration import Calibration, RuntimeOverheads
from varuna.core.memory import comm_buffer_bytes
from varuna.core.selective_recompute import recompute_blocks

__all__ = [
    "StageCosts",
    "stage_cost_tables",
    "runtime_overheads",
    "sync_costs",
    "allreduce_concurrency",
    "stage_memory",
]


@dataclass(frozen=True)
class StageCosts:
    """Per (virtual) stage at one micro-batch size: seconds of F, R and B (segments' calibrated
    compute plus the runtime's overheads), and per cut-point after the stage the serialization
    seconds of its activation (or gradient) on an (inter, intra) link."""

    fwd: list[float]
    rec: list[float]
    bwd: list[float]
    wire: list[tuple[float, float]]


def stage_cost_tables(
    cal: Calibration,
    ranges: Sequence[tuple[int, int]],
    sizes: Iterable[int],
    *,
    task_overhead_s: float,
    placeholder_s: float,
    recompute_segments: Collection[int] | None = None,
) -> dict[int, StageCosts]:
    """:class:`StageCosts` at each micro-batch size in ``sizes``. F and R also pay
    ``placeholder_s`` per segment before the stage (its placeholders); every task pays
    ``task_overhead_s``. With ``recompute_segments`` (Note [Selective recompute]) R re-runs only
    the stage's recomputed blocks, and F of a micro-batch that will be recomputed runs block by
    block, each block paying the placeholders before it: F and R are then upper bounds for the
    stage's micro-batches that are not recomputed (they run whole)."""
    glue = [task_overhead_s + placeholder_s * a for a, _ in ranges]  # F and R also pass segments 0..a-1
    blocks = [recompute_blocks(a, b, recompute_segments) for a, b in ranges]
    extra_glue = [placeholder_s * sum(x for x, _, _ in bl[1:]) for bl in blocks]
    out = {}
    for size in sorted(set(sizes)):
        fwd = [g + e + sum(cal.fwd_s(s, size) for s in range(a, b + 1))
               for g, e, (a, b) in zip(glue, extra_glue, ranges)]
        rec = [task_overhead_s + sum(_block_s(cal, size, x, y, placeholder_s) for x, y, r in bl if r)
               for bl in blocks]
        bwd = [task_overhead_s + sum(cal.bwd_s(s, size) for s in range(a, b + 1)) for a, b in ranges]
        # Bytes leaving virtual stage c forwards (and its gradient backwards): the cut-point
        # after its last segment. The last virtual stage sends nothing.
        nbytes = [cal.act_bytes(b, size) if b < cal.num_segments - 1 else 0 for _, b in ranges]
        # Serialization time on an (inter, intra) link; latency is added per link kind.
        wire = [(x / cal.inter.bandwidth_bytes_per_s, x / cal.intra.bandwidth_bytes_per_s) for x in nbytes]
        out[size] = StageCosts(fwd, rec, bwd, wire)
    return out


def _block_s(cal: Calibration, size: int, a: int, b: int, placeholder_s: float) -> float:
    """R of one recomputed block [a, b]: its placeholders before it and its segments' recomputes."""
    return placeholder_s * a + sum(cal.recompute_s(s, size) for s in range(a, b + 1))


def runtime_overheads(cal: Calibration, config: SimConfig) -> tuple[float, float, float]:
    """(task_overhead_s, placeholder_s, step_overhead_s) that ``simulate`` applies: each
    ``config`` field that is set, else the calibration's ``runtime_overheads`` value, else 0.

    >>> from varuna.core.calibration import RuntimeOverheads
    >>> cal = Calibration.synthetic(0.01, num_segments=2, runtime_overheads=RuntimeOverheads(
    ...     task_overhead_s=1e-3, placeholder_s=1e-4, step_overhead_s=2e-3))
    >>> from simulator.config import SimConfig
    >>> runtime_overheads(cal, SimConfig(num_stages=2, micro_batch_size=1, num_microbatches=4,
    ...                                  step_overhead_s=0.0))
    (0.001, 0.0001, 0.0)
    """
    ro = cal.runtime_overheads or RuntimeOverheads()  # none in the file: all 0
    c = config
    return (
        float(ro.task_overhead_s if c.task_overhead_s is None else c.task_overhead_s),
        float(ro.placeholder_s if c.placeholder_s is None else c.placeholder_s),
        float(ro.step_overhead_s if c.step_overhead_s is None else c.step_overhead_s),
    )


def sync_costs(
    cal: Calibration, config: SimConfig, device_segments: Sequence[Sequence[int]]
) -> list[tuple[float, float]]:
    """Per device: (gradient all-reduce seconds, optimizer step seconds) after its last backward.

    A ring that never leaves one host uses the intra link (latency, bandwidth) in the ring
    formula; otherwise the calibration's fitted model with k = :func:`allreduce_concurrency`.
    Parameters several stages hold (``cal.model.shared_params``: tied embeddings) leave the
    replicas' ring and are summed after it over every rank of those stages, as the runtime does
    (Note [Shared gradients]).
    """
    c = config
    P, D = c.num_stages, c.num_replicas
    host = host_of_ranks(c)
    concurrency = allreduce_concurrency(host, P, D)
    out = []
    for k in range(P):
        ar = 0.0
        nbytes, shared = _stage_grad_bytes(cal, device_segments, k)
        if c.allreduce and D > 1:
            if concurrency[k] == 0:
                ar = (
                    2.0 * (D - 1) / D * nbytes / cal.intra.bandwidth_bytes_per_s
                    + (D - 1) * cal.intra.latency_s
                )
            else:
                ar = cal.allreduce_s(nbytes, D, concurrency[k])
        if c.allreduce:
            for stages, shared_bytes in shared:
                ranks = [d * P + j for j in stages for d in range(D)]
                ar += _ring_s(cal, shared_bytes, [host[r] for r in ranks])
        opt = cal.optimizer_s(cal.param_bytes(device_segments[k])) if c.optimizer else 0.0
        if c.shard_optimizer and D > 1:
            # Each replica steps 1/D of the state, then the updated weights are all-gathered: half
            # a ring all-reduce's traffic ((D-1)/D of the bytes once), modelled as half its time.
            ar *= 1.5
            opt /= D
        out.append((ar, opt))
    return out


# Note [Shared gradients]: a parameter several segments read (tied input/output embeddings) is
# counted in each of those segments' grad_bytes (the profiler times segments alone). The runtime
# holds it once per stage: within one stage it is one parameter, summed with the stage's other
# gradients over the replicas; held by several stages, it leaves the replicas' ring and is summed,
# after it, over every rank of those stages in a group of its own (varuna/runtime/grad_sync.py,
# groups.py) -- across the pipeline, so over the inter-host link when the stages are on different
# hosts, and also when D = 1.


def _stage_grad_bytes(cal: Calibration, device_segments: Sequence[Sequence[int]], k: int
                      ) -> tuple[int, list[tuple[list[int], int]]]:
    """Device ``k``'s gradient bytes summed over its replicas, and the shared parameters it sums
    with other devices: (those devices, bytes) each (Note [Shared gradients]).

    >>> from varuna.core.calibration import Calibration, SharedParams
    >>> cal = Calibration.synthetic(0.01, num_segments=3)
    >>> cal.model.shared_params = [SharedParams(segments=(0, 2), grad_bytes=100)]
    >>> whole = cal.grad_bytes([0, 1, 2])
    >>> _stage_grad_bytes(cal, [[0, 1, 2]], 0) == (whole - 100, [])
    True
    >>> _stage_grad_bytes(cal, [[0], [1, 2]], 1) == (cal.grad_bytes([1, 2]) - 100, [([0, 1], 100)])
    True
    """
    mine = set(device_segments[k])
    nbytes = cal.grad_bytes(device_segments[k])
    shared = []
    for sp in cal.model.shared_params:
        held = [s for s in sp.segments if s in mine]
        if not held:
            continue
        holders = [j for j, segs in enumerate(device_segments) if set(sp.segments) & set(segs)]
        if len(holders) == 1:
            nbytes -= sp.grad_bytes * (len(held) - 1)  # one parameter, counted once per segment
        else:
            nbytes -= sp.grad_bytes * len(held)  # summed in its own group
            shared.append((holders, sp.grad_bytes))
    return max(nbytes, 0), shared


def _ring_s(cal: Calibration, nbytes: int, hosts: Sequence[int]) -> float:
    """One ring all-reduce of ``nbytes`` over ranks on ``hosts`` (the intra link when they share
    one host, else the calibration's all-reduce model, one ring per NIC)."""
    n = len(hosts)
    if n < 2 or nbytes <= 0:
        return 0.0
    if len(set(hosts)) == 1:
        return 2.0 * (n - 1) / n * nbytes / cal.intra.bandwidth_bytes_per_s + (n - 1) * cal.intra.latency_s
    return cal.allreduce_s(nbytes, n, 1)


def allreduce_concurrency(host: Sequence[int], P: int, D: int) -> list[int]:
    """Per stage, k: how many all-reduce rings share the busiest host NIC on its ring (0: the
    ring never leaves one host). A static upper bound: we count every ring that crosses the host,
    whether or not their all-reduces overlap in time.

    >>> allreduce_concurrency([0, 0, 1, 1], P=2, D=2)   # 2 hosts × 2 slots: both rings cross both hosts
    [2, 2]
    """
    if D <= 1:
        return [0] * P
    ring_hosts = [{host[d * P + k] for d in range(D)} for k in range(P)]
    crosses = [len(h) > 1 for h in ring_hosts]
    rings_on: dict[int, int] = {}
    for k in range(P):
        if crosses[k]:
            for h in ring_hosts[k]:
                rings_on[h] = rings_on.get(h, 0) + 1
    return [max(rings_on[h] for h in ring_hosts[k]) if crosses[k] else 0 for k in range(P)]


def stage_memory(
    cal: Calibration,
    ranges: Sequence[tuple[int, int]],
    m: int,
    stashed: int,
    recompute: bool,
    *,
    weight_versions: int = 1,
    optimizer_shards: int = 1,
    replicas: int = 1,
    recompute_segments: Collection[int] | None = None,
) -> int:
    """Peak memory of one device holding the segment ``ranges`` (one per model chunk) with
    ``stashed`` micro-batches in flight (``Calibration.stage_memory_bytes``), plus the parameters
    once more per extra weight version (2bw keeps two); ``optimizer_shards``: the optimizer state
    split over that many replicas (sharded optimizer state, docs/memory.md); with ``replicas`` > 1
    one gradient bucket of the sync (``varuna.core.memory.comm_buffer_bytes``);
    ``recompute_segments``: what a recomputing stage recomputes (Note [Selective recompute])."""
    if replicas > 1:
        grads = sum(cal.segments[i].grad_bytes for a, b in ranges for i in range(a, b + 1))
        bucket = comm_buffer_bytes(replicas, grads)
        return bucket + stage_memory(cal, ranges, m, stashed, recompute, weight_versions=weight_versions,
                                     optimizer_shards=optimizer_shards, recompute_segments=recompute_segments)
    shards = {"optimizer_shards": optimizer_shards, "recompute_segments": recompute_segments}
    if weight_versions > 1:
        params = sum(cal.segments[i].param_bytes for a, b in ranges for i in range(a, b + 1))
        extra = (weight_versions - 1) * params
        return extra + stage_memory(cal, ranges, m, stashed, recompute, **shards)  # type: ignore[arg-type]
    if len(ranges) == 1:
        a, b = ranges[0]
        return cal.stage_memory_bytes(range(a, b + 1), m, stashed, recompute=recompute, **shards)
    # Interleaved: the static memory of every chunk; in-flight activations are counted per chunk
    # and sized by the largest chunk (an upper bound).
    static = sum(
        cal.stage_memory_bytes(range(a, b + 1), m, 0, recompute=False, optimizer_shards=optimizer_shards)
        for a, b in ranges
    )
    dynamic = max(
        cal.stage_memory_bytes(range(a, b + 1), m, stashed, recompute=recompute,
                               recompute_segments=recompute_segments)
        - cal.stage_memory_bytes(range(a, b + 1), m, 0, recompute=False)
        for a, b in ranges
    )
    return int(static + dynamic)
