"""Runtime overheads: what the engine's own task loop costs beyond the model's compute.

The simulator needs three constants a segment profile cannot see (``runtime_overheads`` in the
calibration file, docs/calibration.md): a per-task cost (dispatch, RNG re-seeding, slicing, the
send), a per-placeholder-segment cost (every stage runs the user's forward from the start, Note
[Placeholders] in varuna/cutting/split.py) and a per-step cost (set-up, the end-of-step agreement
all-reduce, the optimizer). They are measured by running the engine itself over W processes on
emulated devices (:mod:`profiler.overhead_runs`, the *calibration runs*: W×1 pipelines of 1- and
3-block stages, 1F1B, Nm = 6) and fitted here (:func:`runtime_constants`, Note [Task costs]).

This module is pure Python (no torch): it reduces the workers' recorded timelines. Events are
``(stage, replica, op, microbatch, start_s, end_s)``.

Example::

    >>> rc = RuntimeConstants(handoff_s=1e-4, handoff_netem_s=1e-4, probe_handoff_s=1e-4,
    ...                       task_overhead_s=5e-4, segment_overhead_s=1e-4, placeholder_s=4e-5,
    ...                       step_overhead_s=2e-3, allreduce_s=1e-3)
    >>> rc.to_runtime_overheads(source="W=2").placeholder_s
    4e-05
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from varuna.core.calibration import RuntimeOverheads

__all__ = [
    "CALIBRATION_BLOCKS",
    "CALIBRATION_MICROBATCHES",
    "CALIBRATION_STAGE_FWD_S",
    "DISTURBED_TASK_S",
    "EMULATED_WIDTH",
    "MICRO_BATCH_SIZE",
    "PROBE_LATENCY_S",
    "RuntimeConstants",
    "disturbed",
    "fit_task_costs",
    "handoff_delays",
    "known_task_s",
    "runtime_constants",
    "task_overheads",
    "trimmed_mean",
    "waiting_hops",
]

#: Width of the emulated blocks' activations (tiny: messages are latency-bound).
EMULATED_WIDTH = 16
#: Examples per micro-batch (emulated blocks take the same time at any size).
MICRO_BATCH_SIZE = 1
#: Delay of the latency-only emulation used to measure the emulator's own hand-off overhead.
PROBE_LATENCY_S = 0.001

#: The calibration runs (per world of W processes, Note [Task costs]): W×1 pipelines,
#: 1F1B with recompute, whose stages hold this many blocks (each stage's forward sleeping
#: CALIBRATION_STAGE_FWD_S in all), over CALIBRATION_MICROBATCHES micro-batches -- model cuts and
#: configurations that are not among the validation runs of scripts/validate_simulator.py.
CALIBRATION_BLOCKS: tuple[int, ...] = (1, 3)
CALIBRATION_STAGE_FWD_S = 0.020
CALIBRATION_MICROBATCHES = 6


def known_task_s(op: str, stage_fwd_s: float = CALIBRATION_STAGE_FWD_S) -> float:
    """Emulated compute of one task of a stage whose forward sleeps ``stage_fwd_s`` (B = 2F, R = F)."""
    return stage_fwd_s * (2.0 if op == "B" else 1.0)


def task_overheads(events: Sequence[Sequence],
                   stage_fwd_s: float = CALIBRATION_STAGE_FWD_S) -> dict[str, list[float]]:
    """Per op (F, R, B): each task's measured time minus its known emulated compute.

    ``events`` are ``(stage, replica, op, microbatch, start_s, end_s)``.
    """
    out: dict[str, list[float]] = {"F": [], "R": [], "B": []}
    for _, _, op, _, start, end in events:
        if op in out:
            out[op].append(end - start - known_task_s(op, stage_fwd_s))
    return out


def waiting_hops(events: Sequence[Sequence]) -> list[float]:
    """Hand-off delays seen by idle receivers in one step of a pipeline run.

    For each activation (F_i on stage s → F_i on s+1) and gradient (B_i on s+1 → B_i on s) of one
    replica whose receiver was idle when it was produced: consumer start − producer end. This is
    the runtime's message latency as the simulator's link model sees it (plus the emulated delay).
    """
    where: dict[tuple[int, int, str, int], tuple[float, float]] = {}
    prev_end: dict[tuple[int, int, str, int], float] = {}
    by_rank: dict[tuple[int, int], list] = {}
    for e in events:
        if e[2] in ("F", "R", "B"):
            by_rank.setdefault((e[0], e[1]), []).append(e)
    for evs in by_rank.values():
        last = -float("inf")
        for stage, rep, op, mb, start, end in sorted(evs, key=lambda e: e[4]):
            where[(stage, rep, op, mb)] = (start, end)
            prev_end[(stage, rep, op, mb)] = last
            last = end
    hops = []
    for (stage, rep, op, mb), (_, end) in where.items():
        if op == "F":
            consumer = (stage + 1, rep, "F", mb)
        elif op == "B" and stage > 0:
            consumer = (stage - 1, rep, "B", mb)
        else:
            continue
        if consumer in where and prev_end[consumer] < end:
            hops.append(where[consumer][0] - end)
    return hops


def handoff_delays(benches: Sequence[dict], key: str) -> list[float]:
    """One-way delays (receive − send, seconds) of the hand-off probe ``key`` over all pairs.

    ``benches``: one micro-benchmark result per rank (of one round).
    """
    sends: dict[tuple[int, int, int], float] = {}
    recvs: dict[tuple[int, int, int], float] = {}
    for b in benches:
        probe = b["probes"][key]
        for src, dst, i, t in probe["sent"]:
            sends[(src, dst, i)] = t
        for src, dst, i, t in probe["received"]:
            recvs[(src, dst, i)] = t
    return [recvs[k] - sends[k] for k in sorted(sends) if k in recvs]


def trimmed_mean(xs: Sequence[float], trim: float = 0.1) -> float:
    """Mean without the ``trim`` fraction at each end (robust to a rare scheduler stall).

    >>> trimmed_mean([1, 2, 3, 4, 100], trim=0.2)
    3.0
    """
    s = sorted(xs)
    k = int(len(s) * trim)
    s = s[k:len(s) - k] or s
    return sum(s) / len(s)


@dataclass(kw_only=True)
class RuntimeConstants:
    """Runtime constants measured by the micro-benchmarks of one world (seconds)."""

    handoff_s: float
    """Mean hand-off of an activation or gradient to an idle receiver in the calibration runs
    (producer's task end → consumer's task start), no network emulation (Note [Hand-off])."""
    handoff_netem_s: float
    """The same under the network emulator, without the emulated delay (Note [Hand-off])."""
    handoff_jitter_s: float = 0.0
    """Spread of that hand-off: its trimmed mean minus its 10th percentile, simulated as
    exponential jitter of this mean on top of the rest (Note [Hand-off])."""
    probe_handoff_s: float
    """One-way time through the comm threads in the isolated probe (diagnostic)."""
    task_overhead_s: float
    """Engine time per F, R or B task beyond its segments: the least of the three ops' (Note
    [Task costs]); → ``SimConfig.task_overhead_s``."""
    op_overhead_s: dict[str, float] = field(default_factory=dict)
    """What each op's task costs beyond ``task_overhead_s`` (F and B send a message, R does
    not); the simulator gets it inside the segments' costs."""
    segment_overhead_s: float
    """Time per segment executed by a task beyond its block's nominal sleep (Note [Task costs])."""
    placeholder_s: float
    """F and R time per segment before the stage (Note [Task costs])."""
    task_jitter_s: float = 0.0
    """Spread of a single task's duration around its (run, stage, op) mean: the residuals'
    trimmed mean minus their 10th percentile (→ ``SimConfig.task_jitter_s``, Note [Hand-off])."""
    step_overhead_s: float
    """Per mini-batch: step set-up before the first task, and from the end of the gradient
    all-reduce to the return of ``train_step`` (norms, agreement all-reduce, optimizer)."""
    allreduce_s: float
    """A stage's gradients all-reduced over a 2-rank ring (concurrent rings, as in a P×2 run)."""
    fit_rms_s: float = 0.0
    """Root-mean-square residual of the task-cost fit on the calibration runs' per-stage means."""
    samples: dict[str, int] = field(default_factory=dict)

    def task_s(self, op: str, segments: int, first_segment: int) -> float:
        """Overhead of one task of a stage of ``segments`` segments starting at ``first_segment``."""
        glue = self.placeholder_s * first_segment if op in ("F", "R") else 0.0
        return (self.task_overhead_s + self.op_overhead_s.get(op, 0.0) + self.segment_overhead_s * segments
                + glue)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_runtime_overheads(self, source: str = "") -> RuntimeOverheads:
        """The calibration file's ``runtime_overheads`` section from these constants.

        The simulator adds ``task_overhead_s`` to every task, ``placeholder_s`` per segment before
        a stage (F and R) and ``step_overhead_s`` per mini-batch; the per-op and per-segment terms
        belong inside the segment costs (a profiler timing a segment sees them).
        """
        return RuntimeOverheads(task_overhead_s=self.task_overhead_s, placeholder_s=self.placeholder_s,
                                step_overhead_s=self.step_overhead_s, source=source)


# Note [Task costs]: what an engine task costs beyond its blocks' nominal sleeps, measured on
# calibration runs (W×1 pipelines of 1- and 3-block stages, CALIBRATION_BLOCKS) and fitted per
# (run, stage, op) cell mean by least squares:
#
#     task − nominal = t_op + s·b + p·first_segment·[op ∈ {F, R}]
#
# t_op: the executor's work per task of that op (dispatch, RNG re-seeding, slicing, the
# timeline; F and B also pack and send a message, R does not, ~0.3-0.5 ms apart on this host:
# with one t for all three the simulator had recomputes ending late and gradients arriving
# early, which decides the sub-millisecond forks of Finding 7 in docs/simulator.md); s: per
# segment executed (the block's sleep overshoot — the time an emulated device needs to wake a
# sleeping process on a loaded host —, its autograd node, the CutPoint); p: per
# segment BEFORE the stage, which F and R pass through as placeholders (every stage runs the
# user's forward from the start, Note [Placeholders] in varuna/cutting/split.py). The simulator gets s
# inside the calibration's segment costs (a profiler timing a segment would include it), the
# least t_op as SimConfig.task_overhead_s, each op's excess over it inside that op's segment
# costs, and p as SimConfig.placeholder_s.


# Note [Hand-off]: the simulator's link latency for the emulated cluster is the runtime's own
# hand-off plus the emulated delay. The hand-off is measured where it happens and as the
# simulator sees it: in the calibration runs, consumer start − producer end for every activation
# and gradient whose receiver was idle (``waiting_hops``). A probe that sends spaced messages
# through the same LinkSender/LinkReceiver with the sender otherwise idle measures a different
# interval (from the send call, without the next task's work competing on the sender); it came
# out 0.5 ms below the in-pipeline hand-off while sends were issued from the sender thread, and
# 0.1-0.2 ms above it once the compute thread issued them. It is kept for the network emulator's
# own extra cost: handoff_netem = handoff + (probe under a 1 ms latency-only emulation − 1 ms −
# probe without emulation).
#
# The hand-off and the tasks also vary (a thread wake-up, a sleep's overshoot on a loaded host):
# both spreads are measured (trimmed mean − 10th percentile: hand-off 0.1-0.3 ms, a task
# 0.25-0.3 ms around its (run, stage, op) mean) and printed. They matter only where the policy
# forks on sub-millisecond timing (docs/simulator.md, Finding 7: a gradient landing just before
# or just after a recompute ends). ``--spread`` simulates them as independent exponential noise
# (link jitter and SimConfig.task_jitter_s) over 25 seeds; measured in one run, that turns the
# forks into mixtures but with too many slow steps (4x2 varuna Nm=4 none: 16 of 25 simulated
# draws slow, 0 of 8 real steps; +5.9% against −0.4% without the noise), since real variations
# are not independent (a loaded core slows a process's tasks and its sends alike). So by
# default the simulator gets the means only; what had put its forks on the wrong branch was a
# bias, not missing noise: one task overhead for all ops (Note [Task costs]).


def lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares via the normal equations (a handful of unknowns; pure Python)."""
    k = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] + [sum(r[i] * v for r, v in zip(rows, y))]
         for i in range(k)]
    for c in range(k):
        piv = max(range(c, k), key=lambda r: abs(a[r][c]))
        a[c], a[piv] = a[piv], a[c]
        if abs(a[c][c]) < 1e-18:
            raise ValueError("calibration runs cannot separate the task-cost terms")
        for r in range(k):
            if r != c:
                f = a[r][c] / a[c][c]
                a[r] = [x - f * z for x, z in zip(a[r], a[c])]
    return [a[i][k] / a[i][i] for i in range(k)]


_OPS = ("F", "R", "B")


def fit_task_costs(
    cells: dict[tuple[int, int, str], list[float]],
) -> tuple[dict[str, float], float, float, float]:
    """({op: t_op}, s, p, rms residual) of Note [Task costs] from overhead samples keyed by
    (blocks per stage, stage, op). Terms that come out negative are dropped (set to 0) and the
    rest refitted.

    >>> cells = {(b, k, op): [0.5e-3 + 0.4e-3 * b + (0.1e-3 * b * k if op != "B" else 0.0)
    ...                       + (0.2e-3 if op == "F" else 0.0)]
    ...          for b in (1, 3) for k in range(4) for op in "FRB"}
    >>> t, s, p, rms = fit_task_costs(cells)
    >>> {op: round(v * 1e3, 3) for op, v in t.items()}, round(s * 1e3, 3), round(p * 1e3, 3)
    ({'F': 0.7, 'R': 0.5, 'B': 0.5}, 0.4, 0.1)
    """
    keys = sorted(cells)
    y = [trimmed_mean(cells[key]) for key in keys]
    full = [[float(op == o) for o in _OPS] + [float(b), float(b * k) if op in ("F", "R") else 0.0]
            for b, k, op in keys]
    n = len(full[0])
    use = [True] * n
    while True:
        cols = [i for i in range(n) if use[i]]
        sol = lstsq([[r[i] for i in cols] for r in full], y)
        coef = [0.0] * n
        for i, v in zip(cols, sol):
            coef[i] = v
        neg = [i for i in cols if coef[i] < 0]
        if not neg or len(cols) == 1:
            break
        use[min(neg, key=lambda i: coef[i])] = False
    coef = [max(0.0, v) for v in coef]
    res = [v - sum(c * x for c, x in zip(coef, r)) for r, v in zip(full, y)]
    return dict(zip(_OPS, coef[:3])), coef[3], coef[4], (sum(x * x for x in res) / len(res)) ** 0.5


def runtime_constants(ranks: Sequence[dict], rounds: Sequence[int] | None = None) -> RuntimeConstants:
    """Reduce one world's micro-benchmark measurements (``rounds``: which rounds, default all)
    to :class:`RuntimeConstants`.

    Task costs: Note [Task costs]. Hand-offs: Note [Hand-off] (10%-trimmed means). Step
    overhead: per step of the calibration runs, stage 0's set-up time (step start → first F)
    plus the time from the end of the last gradient all-reduce to the last return from
    ``train_step``; the median.
    """
    rounds = list(range(len(ranks[0]["bench"]))) if rounds is None else list(rounds)
    plain: list[float] = []
    probed: list[float] = []
    hops: list[float] = []
    cells: dict[tuple[int, int, str], list[float]] = {}
    step_extra: list[float] = []
    ar_times: list[float] = []
    for k in rounds:
        benches = [r["bench"][k] for r in ranks]
        plain += handoff_delays(benches, "none")
        probed += [d - PROBE_LATENCY_S for d in handoff_delays(benches, "netem")]
        ar_times += [t for b in benches for t in b["allreduce"]]
        for blocks in CALIBRATION_BLOCKS:
            runs = [b["calibration"][str(blocks)] for b in benches]
            for i in range(min(len(r) for r in runs)):
                steps = [r[i] for r in runs]
                if disturbed([e for s in steps for e in s["events"]], CALIBRATION_STAGE_FWD_S):
                    continue
                start = min(e[4] for e in steps[0]["events"] if e[2] in "FRB") - steps[0]["t0"]  # stage 0
                ar_end = max(max(e[5] for e in s["events"] if e[2] == "AR") for s in steps)
                step_extra.append(start + max(s["t1"] for s in steps) - ar_end)
                hops += waiting_hops([e for s in steps for e in s["events"]])
                for stage, s in enumerate(steps):
                    for op, xs in task_overheads(s["events"], CALIBRATION_STAGE_FWD_S).items():
                        if xs:
                            cells.setdefault((blocks, stage, op), []).extend(xs)
    t_op, seg, ph, rms = fit_task_costs(cells)
    t = min(t_op.values())
    residuals = sorted(x - statistics.fmean(xs) for xs in cells.values() for x in xs)
    task_jitter = trimmed_mean(residuals) - residuals[len(residuals) // 10] if residuals else 0.0
    handoff = trimmed_mean(hops)
    p10 = sorted(hops)[len(hops) // 10] if hops else handoff
    return RuntimeConstants(
        handoff_s=handoff,
        handoff_jitter_s=max(0.0, handoff - p10),
        handoff_netem_s=handoff + max(0.0, trimmed_mean(probed) - trimmed_mean(plain)),
        probe_handoff_s=trimmed_mean(plain),
        task_overhead_s=t,
        op_overhead_s={op: v - t for op, v in t_op.items()},
        segment_overhead_s=seg,
        placeholder_s=ph,
        task_jitter_s=max(0.0, task_jitter),
        step_overhead_s=statistics.median(step_extra),
        allreduce_s=statistics.median(ar_times) if ar_times else 0.0,
        fit_rms_s=rms,
        samples={"handoff": len(hops), "probe": len(plain), "probe_netem": len(probed),
                 "tasks": sum(len(v) for v in cells.values()), "steps": len(step_extra),
                 "allreduce": len(ar_times), "rounds": len(rounds)},
    )

# Note [Disturbed steps]: the emulated devices promise that a block's forward takes 10 ms. On the
# shared host that promise sometimes breaks: now and then every process of ours freezes for
# 70-300 ms at the same instant — every rank's running task, sleeps included, stretched by the
# same amount, even at SCHED_RR priority (the cause lies outside our processes: presumably the
# host's other tenants) — and a configuration that catches a few freezes comes out 10-50% slower.
# No model of the runtime can predict that, so such steps are not valid measurements of it. A step is
# *disturbed* when any of its F, R or B tasks ran more than DISTURBED_TASK_S past its nominal
# compute; in undisturbed runs the runtime's own per-task overhead never exceeded 11 ms (typically
# 1.5-4 ms). The test looks at compute tasks only (never at messages, the schedule or the
# simulated time). Disturbed steps of the calibration runs are left out of the runtime constants;
# scripts/validate_simulator.py also leaves them out of its real times (and re-runs a
# configuration with too few undisturbed steps).
DISTURBED_TASK_S = 0.025


def disturbed(events: Sequence[Sequence], stage_fwd_s: float = CALIBRATION_STAGE_FWD_S) -> bool:
    """Whether a step's events show a host freeze (Note [Disturbed steps]).

    >>> disturbed([(0, 0, "F", 0, 0.0, 0.021), (0, 0, "B", 0, 0.021, 0.101)])   # B took 80 ms, not 40
    True
    """
    return any(end - start - known_task_s(op, stage_fwd_s) > DISTURBED_TASK_S
               for _, _, op, _, start, end in events if op in ("F", "R", "B"))
