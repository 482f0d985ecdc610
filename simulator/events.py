"""The simulator's event loop: tasks and messages of the simulated ranks as timed events.

Each rank's policy (``StagePolicy``, or the interleaved one) picks its tasks; this module only
times them: a task ends after its cost, a message arrives after the link model of Note [Link
model]. :func:`run_events` returns what each rank did; ``simulator.engine.simulate`` turns that
into a :class:`simulator.config.SimResult`.

Note [Event loop speed]: the loop runs once per task (P=36, Nm=228: 25k tasks in a 50 ms
budget), so everything it needs per task is precomputed per rank (:class:`RankTables`) and
looked up by list index; the dispatcher and the sender are closures over those lists (local
lookups, no attribute access per task); a chunked (interleaved) schedule only adds a chunk
index.

Note [Link model]: as varuna/testing/netem.py emulates it. A directed link serializes messages
(bytes / bandwidth, FIFO, ``max_sends_per_link`` at once); each then arrives after the latency
plus an exponential jitter draw, and never overtakes an earlier message. The calibration's
latency_s is the *mean* delay, so the fixed part is latency_s - jitter_s and the exponential
(mean = std = jitter_s) adds the rest back (a delay cannot go below 0).

Example::

    >>> from simulator.config import SimConfig
    >>> from varuna.core.calibration import Calibration
    >>> Links.of(Calibration.synthetic(0.01, num_segments=2), SimConfig(num_stages=2, micro_batch_size=1,
    ...          num_microbatches=2, extra_latency_s=0.5)).lat_inter
    0.5
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from simulator.config import SimConfig
from simulator.costs import StageCosts
from varuna.core.calibration import Calibration
from varuna.core.schedule import schedule_kind
from varuna.core.timeline import Timeline

__all__ = ["Links", "RankTables", "Tallies", "rank_tables", "run_events"]

# Events closer than this are simultaneous: sums of the same costs in another order differ by
# rounding, and a stage must see every arrival of "now" before it picks its next task.
_EPS_S = 1e-9

# Heap entry codes, and what an arrival of each code is to the receiving policy.
_DONE, _ACT, _GRAD = 0, 1, 2
_ARRIVAL = (None, "F", "B")
_SEND_OP = (None, "SEND_ACT", "SEND_GRAD")
#: What a rank "runs" while it syncs and updates inside a no-flush window (``step_ends``).
_SYNC = object()


@dataclass(frozen=True)
class Links:
    """Point-to-point timing of one simulation (Note [Link model]) and the task jitter."""

    lat_inter: float
    lat_intra: float
    sigma_inter: float
    sigma_intra: float
    task_jitter_s: float

    @classmethod
    def of(cls, cal: Calibration, c: SimConfig) -> Links:
        sigma_inter = cal.inter.jitter_s * c.jitter_scale
        sigma_intra = cal.intra.jitter_s * c.jitter_scale
        return cls(
            lat_inter=max(0.0, cal.inter.latency_s + c.extra_latency_s - sigma_inter),
            lat_intra=max(0.0, cal.intra.latency_s + c.extra_latency_s - sigma_intra),
            sigma_inter=sigma_inter,
            sigma_intra=sigma_intra,
            task_jitter_s=c.task_jitter_s,
        )

    @property
    def random(self) -> bool:
        """Whether any duration is drawn at random (else replicas alike run alike)."""
        return self.sigma_inter > 0 or self.sigma_intra > 0 or self.task_jitter_s > 0


@dataclass(frozen=True)
class RankTables:
    """Flat per-rank tables, rank idx = j·P + k for the j-th simulated replica (Note [Event loop
    speed]). Per rank, per chunk: ``dur_m``/``dur_short`` map an op to its seconds at m and at
    the replica's short last size; ``outbox`` maps "F" / "B" to what that task sends (None:
    nothing) as (receiving rank, wire s at m, wire s short, latency s, jitter s, receiver's
    chunk, arrival code, link index into the per-link state)."""

    stage: list[int]
    replica: list[int]
    short_mb: list[int]
    """The replica's last micro-batch where it is short, else -1."""
    dur_m: list[list[dict[str, float]]]
    dur_short: list[list[dict[str, float]]]
    outbox: list[dict[str, list[tuple | None]]]


def rank_tables(
    c: SimConfig,
    chunks: int,
    host: Sequence[int],
    sim_replicas: Sequence[int],
    costs: dict[int, StageCosts],
    links: Links,
    rank_costs: Sequence[dict[int, StageCosts]] | None = None,
) -> RankTables:
    """The :class:`RankTables` of the simulated replicas (``chunks`` model chunks per device).
    ``rank_costs`` (mixed VM types): per rank idx, its device type's compute tables (else
    ``costs``); messages always cost what ``costs`` says (the model and network are one)."""
    P, m, v = c.num_stages, c.micro_batch_size, chunks
    n = len(sim_replicas) * P
    stage = [idx % P for idx in range(n)]
    replica = [sim_replicas[idx // P] for idx in range(n)]
    short_mb = [c.microbatches_of(d) - 1 if c.last_size_of(d) != m else -1 for d in replica]
    short_costs = [costs[c.last_size_of(d)] for d in replica]
    compute = rank_costs if rank_costs is not None else [costs] * n

    split = schedule_kind(c.schedule).splits_backward
    w = c.weight_grad_fraction if split else 0.0

    def durations(tab: StageCosts, k: int) -> list[dict[str, float]]:
        per_chunk = [ch * P + k for ch in range(v)]
        # A split backward: B (input gradient) and W (weight gradients) share the calibrated B.
        # The first virtual stage's input is data: no input gradient, so a split B computes
        # nothing there and its W the whole backward (varuna/runtime/split_backward.py: outputs
        # that reach no input are W's roots; measured: B 0.1 ms, W 41 ms of a 40 ms backward).
        return [
            {"F": tab.fwd[vs], "R": tab.rec[vs], "B": 0.0 if split and vs == 0 else tab.bwd[vs] * (1 - w),
             "W": tab.bwd[vs] if split and vs == 0 else tab.bwd[vs] * w}
            for vs in per_chunk
        ]

    def sends(idx: int, forward: bool) -> list[tuple | None]:
        k, base = stage[idx], replica[idx] * P
        peer = (k + 1) % P if forward else (k - 1) % P
        intra = host[base + k] == host[base + peer]
        out: list[tuple | None] = []
        for ch in range(v):
            vs = ch * P + k
            cut = vs if forward else vs - 1  # a gradient crosses the cut-point before vs
            if not 0 <= cut < P * v - 1:
                out.append(None)  # the last virtual stage's F and the first one's B send nothing
                continue
            out.append(
                (
                    idx - k + peer,
                    costs[m].wire[cut][intra],
                    short_costs[idx].wire[cut][intra],
                    links.lat_intra if intra else links.lat_inter,
                    links.sigma_intra if intra else links.sigma_inter,
                    (vs + 1) // P if forward else (vs - 1) // P,
                    _ACT if forward else _GRAD,
                    2 * idx + (0 if forward else 1),
                )
            )
        return out

    return RankTables(
        stage=stage,
        replica=replica,
        short_mb=short_mb,
        dur_m=[durations(compute[idx][m], stage[idx]) for idx in range(n)],
        dur_short=[durations(compute[idx][c.last_size_of(replica[idx])], stage[idx]) for idx in range(n)],
        outbox=[{"F": sends(idx, True), "B": sends(idx, False)} for idx in range(n)],
    )


@dataclass
class Tallies:
    """Per rank, what the event loop measured."""

    n: int
    busy: list[float] = field(init=False)
    """Seconds of compute."""
    live: list[int] = field(init=False)
    peak: list[int] = field(init=False)
    """Most micro-batches with F started and B not done."""
    last_b_end: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.busy = [0.0] * self.n
        self.live = [0] * self.n
        self.peak = [0] * self.n
        self.last_b_end = [0.0] * self.n


@dataclass
class _Loop:
    """What the dispatcher and the sender share (built once per :func:`run_events`)."""

    ranks: RankTables
    policies: Sequence
    tallies: Tallies
    chunked: bool
    chunks: int
    heap: list = field(default_factory=list)
    running: list = field(init=False)
    run_end: list[float] = field(init=False)
    uniform: Callable[[], float] = random.random
    add: Callable | None = None

    def __post_init__(self) -> None:
        self.running = [None] * len(self.policies)
        self.run_end = [0.0] * len(self.policies)


def run_events(
    ranks: RankTables,
    policies: Sequence,
    *,
    chunked: bool,
    chunks: int,
    max_sends_per_link: int,
    links: Links,
    seed: int,
    timeline: Timeline | None,
    split_backward: bool = False,
    step_ends: Sequence[dict[int, float]] | None = None,
) -> Tallies:
    """Run every rank's policy to the end of the mini-batch; raises RuntimeError on a deadlock.

    Heap entries are (time, code, rank, x) with x the micro-batch (chunked: mb·chunks + chunk).
    No sequence number: events within ``_EPS_S`` of each other are applied together before any
    stage picks its next task, so their order inside a batch does not matter.
    ``split_backward``: the lists have W tasks (a micro-batch is live until its W, and the last
    W ends the stage's backward work). ``step_ends`` (a no-flush window of several mini-batches):
    per rank, {micro-batch of a mini-batch's last B: seconds the stage then spends on that
    mini-batch's gradient sync and update before its next task}, as the engine does (Note
    [No-flush window] in varuna/runtime/no_flush.py).
    """
    tallies = Tallies(len(policies))
    loop = _Loop(ranks, policies, tallies, chunked, chunks, uniform=random.Random(seed).random)
    loop.add = timeline.add if timeline is not None else None
    dispatch = _dispatcher(loop, links.task_jitter_s)
    send = _sender(loop, max_sends_per_link)
    heap, running, pop, v = loop.heap, loop.running, heapq.heappop, chunks
    arrived = [p.arrived for p in policies]
    complete = [p.complete for p in policies]
    live, last_b_end = tallies.live, tallies.last_b_end
    dirty, now = list(range(len(policies))), 0.0
    frees = "W" if split_backward else "B"
    while True:
        dispatch(dirty, now)  # every stage that became idle or received an input asks for work
        if not heap:
            break
        dirty = []
        limit = heap[0][0] + _EPS_S
        while heap and heap[0][0] <= limit:
            now, code, idx, x = pop(heap)
            dirty.append(idx)
            if code != _DONE:
                if chunked:
                    arrived[idx](_ARRIVAL[code], x // v, x % v)
                else:
                    arrived[idx](_ARRIVAL[code], x)
                continue
            task = running[idx]
            running[idx] = None
            if task is _SYNC:
                continue
            complete[idx](task)
            op = task.op
            if op == "B" or op == "W":
                if op == frees:
                    live[idx] -= 1
                if now > last_b_end[idx]:  # the stage's last B (or W) wins
                    last_b_end[idx] = now
                if op == "W":
                    continue
            elif op != "F":
                continue
            send(idx, task, now, limit, dirty)
            if step_ends is not None and op == "B":
                _hold(loop, idx, step_ends[idx].get(task.microbatch, 0.0), now)
    _check_finished(policies, ranks)
    return tallies


def _hold(loop: _Loop, idx: int, seconds: float, now: float) -> None:
    """Keep rank ``idx`` busy for ``seconds`` (a mid-window gradient sync and update)."""
    if seconds <= 0.0:
        return
    loop.running[idx] = _SYNC
    heapq.heappush(loop.heap, (now + seconds, _DONE, idx, 0))
    if loop.add is not None:
        r = loop.ranks
        loop.add(r.stage[idx], r.replica[idx], "SYNC", None, now, now + seconds)


def _dispatcher(loop: _Loop, task_jitter: float) -> Callable[[list[int], float], None]:
    """``dispatch(dirty, now)``: start the next task of every idle rank in ``dirty``."""
    r, t = loop.ranks, loop.tallies
    next_task = [p.next_task for p in loop.policies]
    running, run_end, heap, push, add = loop.running, loop.run_end, loop.heap, heapq.heappush, loop.add
    short_mb, dur_m, dur_short, stage, replica = r.short_mb, r.dur_m, r.dur_short, r.stage, r.replica
    busy, live, peak, uniform, log, chunked = t.busy, t.live, t.peak, loop.uniform, math.log, loop.chunked

    def dispatch(dirty: list[int], now: float) -> None:
        for idx in dirty:
            if running[idx] is not None:
                continue
            task = next_task[idx]()
            if task is None:
                continue
            op = task.op
            i = task.microbatch
            dur = (dur_short if i == short_mb[idx] else dur_m)[idx][task.chunk if chunked else 0][op]
            if task_jitter > 0.0:
                j = task_jitter if task_jitter < dur else dur
                dur -= j + j * log(1.0 - uniform())  # cost - j + Exponential(mean j)
            if op == "F":
                lv = live[idx] + 1
                live[idx] = lv
                if lv > peak[idx]:
                    peak[idx] = lv
            running[idx] = task
            busy[idx] += dur
            end = now + dur
            run_end[idx] = end
            push(heap, (end, _DONE, idx, 0))
            if add is not None:
                add(stage[idx], replica[idx], op, i, now, end)

    return dispatch


def _sender(loop: _Loop, slots: int) -> Callable[[int, object, float, float, list[int]], None]:
    """``send(idx, task, now, limit, dirty)``: the message a finished F or B sends (Note [Link
    model]); delivered at once when it lands by ``limit`` or while its receiver is busy."""
    r, v, chunked = loop.ranks, loop.chunks, loop.chunked
    outbox, short_mb, stage, replica = r.outbox, r.short_mb, r.stage, r.replica
    running, run_end, heap, push, add = loop.running, loop.run_end, loop.heap, heapq.heappush, loop.add
    arrived = [p.arrived for p in loop.policies]
    nlinks = 2 * len(loop.policies)
    free: list = [0.0] * nlinks if slots == 1 else [[0.0] * slots for _ in range(nlinks)]
    delivered = [0.0] * nlinks  # last delivery time on each link (FIFO: no overtaking)
    uniform, log, replace = loop.uniform, math.log, heapq.heapreplace

    def send(idx: int, task, te: float, limit: float, dirty: list[int]) -> None:
        out = outbox[idx][task.op][task.chunk if chunked else 0]
        if out is None:
            return
        dst, wire, wire_short, delay, sigma, dch, code, link = out
        i = task.microbatch
        if i == short_mb[idx]:
            wire = wire_short
        # The sender's messages on a link are issued in time order, so each takes the earliest
        # free serialization slot.
        if slots == 1:
            f = free[link]
            start = f if f > te else te
            done_s = start + wire
            free[link] = done_s
        else:
            q = free[link]
            start = q[0] if q[0] > te else te
            done_s = start + wire
            replace(q, done_s)
        ta = done_s + delay
        if sigma > 0.0:
            ta -= sigma * log(1.0 - uniform())  # Exponential(mean sigma)
        if ta < delivered[link]:
            ta = delivered[link]
        delivered[link] = ta
        if add is not None:
            add(stage[idx], replica[idx], _SEND_OP[code], i, start, ta)
        if ta <= limit or (running[dst] is not None and run_end[dst] >= ta):
            # Deliver now, without an event: either it arrives "now" (a free link), or the
            # receiver is busy until after it lands, so it cannot look before then anyway
            # (policies have no clock; they only answer next_task, asked when idle).
            if chunked:
                arrived[dst](_ARRIVAL[code], i, dch)
            else:
                arrived[dst](_ARRIVAL[code], i)
            if ta <= limit:
                dirty.append(dst)
        else:
            push(heap, (ta, code, dst, i * v + dch if chunked else i))

    return send


def _check_finished(policies: Sequence, ranks: RankTables) -> None:
    for idx, pol in enumerate(policies):
        if not pol.finished:
            # A schedule/policy bug, not user input: the pipeline deadlocked.
            raise RuntimeError(
                f"simulation deadlocked: stage {ranks.stage[idx]} of replica {ranks.replica[idx]} "
                f"stopped after {len(pol.executed)} of {len(pol.tasks)} tasks"
            )
