"""scripts/bench_schedules.py's configurations and results: what runs, and the tables of what ran.

Pure Python (no torch): the run specifications (:class:`RunSpec`, :class:`WorldSpec`), the
analysis of the recorded events (peak activations held, idle time, hand-offs) and the printed
tables, goals and timelines. Also used by the smoke test and by ``--from-json``.

    >>> round(ideal_step_s(4, 16, 0.01), 6)
    0.73
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: Network levels of the brief: name -> VARUNA_NETEM string (None: no emulation).
LEVELS: dict[str, str | None] = {
    "none": None,
    "moderate": "latency=1ms,jitter=2ms,seed=1",
    "heavy": "latency=2ms,jitter=10ms,seed=1",
}
#: Goals (issue 18) for our best schedule: ratio to the best torch schedule with recompute, and
#: fraction of the latency-aware ideal (:func:`latency_aware_ideal_s`).
GOAL_VS_TORCH = {"none": 1.05, "moderate": 1.05, "heavy": 1.15}
GOAL_VS_IDEAL = {"none": 0.97, "moderate": 0.95, "heavy": 0.92}

_TORCH_CLASS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "izb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
#: The schedules compared: ours (``VarunaConfig.schedule``) and torch's (keys of _TORCH_CLASS).
OUR_SCHEDULES = ("varuna", "gpipe", "1f1b", "zb-h1", "varuna-zb", "interleaved", "varuna-interleaved", "2bw")
TORCH_SCHEDULES = tuple(_TORCH_CLASS)
#: Our asynchronous kinds (PipeDream-2BW: one-step-stale gradients, not the same training as the
#: others): timed as one no-flush window, shown for information, never "our best" for the goals.
ASYNC_SCHEDULES = ("2bw",)
#: Mean delay of one message at each level (netem: latency + Exp(mean jitter); 0 without emulation).
MEAN_HOP_S = {"none": 0.0, "moderate": 0.003, "heavy": 0.012}


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One (system, schedule, recompute, network level, model) configuration."""

    system: str
    """``ours`` (varuna.Engine) or ``torch`` (torch.distributed.pipelining)."""
    schedule: str
    """Ours: OUR_SCHEDULES. Torch: TORCH_SCHEDULES."""
    recompute: bool
    """Ours: the engine's recompute flag; torch: torch.utils.checkpoint around each stage module."""
    level: str
    """Key of LEVELS."""
    model: str = "emulated"
    """``emulated`` (EmulatedBlock stages) or ``gpt`` (examples/gpt2)."""
    chunks: int = 1
    """Model chunks per rank (the interleaved kinds: 2)."""

    @property
    def label(self) -> str:
        if self.system == "ours" and self.schedule in ASYNC_SCHEDULES:
            return f"ours {self.schedule} (async)"  # always recomputes (required at P > 1)
        if self.system == "ours":
            name = f"ours {self.schedule}" + (f"(v={self.chunks})" if self.chunks > 1 else "")
            return name + ("+R" if self.recompute and not self.schedule.startswith("varuna") else "")
        name = "torch " + _TORCH_CLASS[self.schedule].removeprefix("Schedule")
        if self.chunks > 1:
            name += f"(v={self.chunks})"
        return name + ("+ckpt" if self.recompute else "")

    @property
    def key(self) -> str:
        return f"{self.model}/{self.level}/{self.label}"


@dataclass(kw_only=True)
class WorldSpec:
    """What one set of worker processes runs (written to JSON for the workers)."""

    model: str
    """``emulated`` or ``gpt``."""
    num_stages: int
    """P (= world size: one rank per stage, D = 1)."""
    num_microbatches: int
    """Nm."""
    micro_batch_size: int
    """m."""
    fwd_s: float
    """F of one stage per micro-batch (emulated model; B = 2F, R = F)."""
    width: int
    """Activation width of the emulated blocks."""
    warmup: int
    """Untimed steps per run."""
    steps: int
    """Timed steps per run."""
    runs: list[dict]
    """RunSpec fields of every run, in execution order."""
    out_dir: str
    """Where each rank writes ``rank{r}.json`` (and its log)."""
    gpt: dict = field(default_factory=dict)
    """GPTConfig fields (gpt model)."""
    gpt_ranges: list | None = None
    """The GPT's segment range per stage for both systems (a planned split); None: equal blocks."""
    comm_timeout_s: float = 120.0
    """Every wait on another process gives up after this long."""


# ============================================================================================
# Analysis of recorded events (pure Python; also used by the smoke test)


def peak_held(events: Sequence[Sequence], chunks: int = 1) -> tuple[int, float]:
    """(peak inputs held, peak full activation sets held) along one rank's events of one step.

    ``events`` are ``(stage, op, microbatch, start_s, end_s)`` with op in F, R, B, W (others are
    ignored). A micro-batch's input is held from its F's start to its B's end (W's end when the
    backward is split: W needs them); its full activations from the start of its F (when it has
    no R) or of its R, to that same end. With
    several chunks per rank, each (chunk, micro-batch) counts one input and ``1/chunks`` graph.
    """
    compute = [e for e in events if e[1] in ("F", "R", "B", "W") and e[2] is not None]
    recomputed = {(e[0], e[2]) for e in compute if e[1] == "R"}
    split = {(e[0], e[2]) for e in compute if e[1] == "W"}  # a split backward frees at W's end
    deltas: list[tuple[float, int, int, int]] = []  # (time, order, d_inputs, d_graphs)
    for stage, op, mb, start, end in compute:
        if op == "F":
            deltas.append((start, 1, 1, 0 if (stage, mb) in recomputed else 1))
        elif op == "R":
            deltas.append((start, 1, 0, 1))
        elif (op == "W") == ((stage, mb) in split):
            deltas.append((end, 0, -1, -1))  # frees before a task starting at the same instant
    inputs = graphs = peak_inputs = peak_graphs = 0
    for _, _, d_in, d_gr in sorted(deltas):
        inputs += d_in
        graphs += d_gr
        peak_inputs = max(peak_inputs, inputs)
        peak_graphs = max(peak_graphs, graphs)
    return peak_inputs, peak_graphs / chunks


def waiting_hops_s(timeline: dict, system: str) -> list[float]:
    """Delivery delays a waiting stage saw: for each activation or gradient whose receiver was idle
    when it was produced, (start of the task that consumed it) − (end of the task that produced it).

    ``timeline`` maps rank -> that rank's events of one step (``(stage, op, mb, start, end)``).
    Activations: F_i on stage s → F_i on s+1. Gradients: B_i on s+1 → the first task on s that
    needs it: B_i for the engine (its R runs before the gradient), R_i or B_i for torch (the
    checkpoint's recompute runs inside ``backward_one_chunk``, after the gradient arrived).
    The receiver counts as idle when its previous task ended before the producer's end. Without
    network emulation this is the runtime's own hand-off latency (threads, GIL, gloo).
    """
    where: dict[tuple[int, str, int], tuple[float, float]] = {}
    prev_end: dict[tuple[int, str, int], float] = {}
    for evs in timeline.values():
        compute = sorted((e for e in evs if e[1] in ("F", "R", "B") and e[2] is not None), key=lambda e: e[3])
        last = -float("inf")
        for stage, op, mb, start, end in compute:
            where[(stage, op, mb)] = (start, end)
            prev_end[(stage, op, mb)] = last
            last = end
    hops = []
    for (stage, op, mb), (_, end) in where.items():
        if op == "F" and (stage + 1, "F", mb) in where:
            consumer = (stage + 1, "F", mb)
        elif op == "B" and stage > 0:
            grad_ops = ("B",) if system == "ours" else ("R", "B")
            consumer = next(((stage - 1, o, mb) for o in grad_ops if (stage - 1, o, mb) in where), None)
        else:
            continue
        if consumer is not None and prev_end[consumer] < end:
            hops.append(where[consumer][0] - end)
    return hops


def busy_s(events: Sequence[Sequence]) -> float:
    """Time spent in F, R, B and W tasks."""
    return sum(e[4] - e[3] for e in events if e[1] in ("F", "R", "B", "W"))


def task_medians_s(per_rank_steps: Sequence[Sequence[Sequence]], chunks: int = 1) -> dict[str, float]:
    """Median duration of F, R and B (per stage: a chunk's time × ``chunks``) over all events."""
    by_op: dict[str, list[float]] = {}
    for steps in per_rank_steps:
        for events in steps:
            for e in events:
                if e[1] in ("F", "R", "B", "W"):
                    by_op.setdefault(e[1], []).append((e[4] - e[3]) * chunks)
    return {op: statistics.median(v) for op, v in by_op.items()}


def ideal_step_s(num_stages: int, num_microbatches: int, fwd_s: float) -> float:
    """The ideal with-recompute time Nm·(F+R+B) + (P−1)·(F+B), with R = F and B = 2F."""
    f, r, b = fwd_s, fwd_s, 2 * fwd_s
    return num_microbatches * (f + r + b) + (num_stages - 1) * (f + b)


def latency_aware_ideal_s(num_stages: int, num_microbatches: int, fwd_s: float, level: str) -> float:
    """:func:`ideal_step_s` plus 2(P−1) mean hop delays of ``level`` (docs/benchmarks.md): the
    first activation crosses P−1 links down and the last gradient P−1 links up, and no schedule
    can hide those two chains.

    >>> round(latency_aware_ideal_s(4, 16, 0.01, "heavy"), 6)
    0.802
    """
    return ideal_step_s(num_stages, num_microbatches, fwd_s) + 2 * (num_stages - 1) * MEAN_HOP_S[level]


def summarize(spec: WorldSpec, ranks: list[dict]) -> list[dict]:
    """One row per configuration: median step, samples/s, ratios, peaks, idle per stage."""
    M = spec.num_microbatches * spec.micro_batch_size
    by_key: dict[str, dict] = {}
    for rank_result in ranks:
        r = rank_result["rank"]
        for res in rank_result["results"]:
            run = RunSpec(**res["run"])
            row = by_key.setdefault(run.key, {"run": run, "step_s": [], "ranks": {}})
            if r == 0:
                row["step_s"] += res["step_s"]
            per = row["ranks"].setdefault(r, {"peaks": [], "busy": [], "events": [], "step_s": [],
                                              "stash": 0})
            per["stash"] = max(per["stash"], res.get("weight_stash_bytes", 0))
            for evs, st in zip(res["events"], res["step_s"]):
                # A no-flush window's steps overlap: its peaks are the whole window's (the worker's).
                window = res.get("window_peak")
                per["peaks"].append(tuple(window) if window else peak_held(evs, run.chunks))
                per["busy"].append(busy_s(evs))
                per["events"].append(evs)
                per["step_s"].append(st)
    ideal = None
    if spec.model == "emulated":
        ideal = ideal_step_s(spec.num_stages, spec.num_microbatches, spec.fwd_s)
    rows = []
    for key, row in by_key.items():
        run: RunSpec = row["run"]
        med = statistics.median(row["step_s"])
        stages = sorted(row["ranks"])
        # The median timed step of rank 0 is the one whose timeline is kept.
        r0 = row["ranks"][0]
        order = sorted(range(len(r0["step_s"])), key=lambda i: r0["step_s"][i])
        mid = order[len(order) // 2]
        tasks = task_medians_s([row["ranks"][k]["events"] for k in stages], run.chunks)
        rows.append({
            "key": key, "label": run.label, "system": run.system, "schedule": run.schedule,
            "recompute": run.recompute, "chunks": run.chunks, "level": run.level, "model": run.model,
            "netem": LEVELS[run.level], "P": spec.num_stages, "Nm": spec.num_microbatches,
            "m": spec.micro_batch_size, "M": M,
            "step_s": row["step_s"], "median_step_s": med, "samples_per_s": M / med,
            "ideal_step_s": ideal, "of_ideal": (ideal / med) if ideal else None,
            "of_la_ideal": (
                latency_aware_ideal_s(spec.num_stages, spec.num_microbatches, spec.fwd_s, run.level) / med
            ) if ideal else None,
            "task_ms": {op: t * 1e3 for op, t in tasks.items()},
            "efficiency": _efficiency(spec, tasks, med),
            "peak_inputs": [max(p[0] for p in row["ranks"][k]["peaks"]) for k in stages],
            "peak_graphs": [max(p[1] for p in row["ranks"][k]["peaks"]) for k in stages],
            "weight_stash_bytes": [row["ranks"][k]["stash"] for k in stages],
            "asynchronous": run.system == "ours" and run.schedule in ASYNC_SCHEDULES,
            "idle_frac": [
                statistics.median(1 - b / t for b, t in zip(rk["busy"], rk["step_s"]))
                for rk in (row["ranks"][k] for k in stages)
            ],
            "hop_ms": _hop_stats([
                waiting_hops_s({k: row["ranks"][k]["events"][i] for k in stages}, run.system)
                for i in range(len(r0["step_s"]))
            ]),
            "timeline": {k: row["ranks"][k]["events"][mid] for k in stages},
        })
    return rows


def _efficiency(spec: WorldSpec, tasks: dict[str, float], step_s: float) -> float | None:
    """The row's own ideal at its measured task times, Nm·(F+R+B) + (P−1)·(F+B), over its step time.

    It factors out how long the tasks themselves took (sleep overshoot under load, per-task
    overheads), leaving how well the schedule and the communication keep the stages busy.
    """
    if spec.model != "emulated" or "F" not in tasks or "B" not in tasks:
        return None  # real models: stages differ in cost, the formula does not apply
    f, r, b = tasks["F"], tasks.get("R", 0.0), tasks["B"] + tasks.get("W", 0.0)  # a split backward: B + W
    return (spec.num_microbatches * (f + r + b) + (spec.num_stages - 1) * (f + b)) / step_s


def _hop_stats(per_step: list[list[float]]) -> dict:
    """Median and 90th percentile (ms) of the waiting hops over all timed steps."""
    hops = sorted(h for step in per_step for h in step)
    if not hops:
        return {"count": 0, "p50": None, "p90": None}
    p90 = hops[int(0.9 * (len(hops) - 1))]
    return {"count": len(hops), "p50": statistics.median(hops) * 1e3, "p90": p90 * 1e3}


def _fmt_list(xs: Sequence[float]) -> str:
    return " ".join(f"{x:g}" if isinstance(x, int) or float(x).is_integer() else f"{x:.1f}" for x in xs)


def _fmt_opt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _fmt_hops(h: dict) -> str:
    return "-" if h["p50"] is None else f"{h['p50']:.1f}/{h['p90']:.1f}"


def _fmt_bytes(xs: Sequence[int]) -> str:
    """Per-stage byte counts, "-" when every stage has none."""
    if not any(xs):
        return "-"
    for unit, div in (("MB", 1 << 20), ("KB", 1 << 10)):
        if max(xs) >= div:
            return " ".join(f"{x / div:.1f}" for x in xs) + f" {unit}"
    return " ".join(str(x) for x in xs) + " B"


_COLUMNS = ("schedule", "step ms", "samples/s", "of ideal", "of LA ideal", "varuna/x", "eff", "max idle",
            "hop p50/p90 ms", "F/R/B/W ms", "inputs held/stage", "graphs held/stage", "weights stashed/stage")


def print_tables(rows: list[dict], spec: WorldSpec) -> None:
    """One Markdown table per (model, P, level): samples/s, ratios, efficiency, hops, peaks."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["P"], r["level"]), []).append(r)
    for (model, P, level), rs in groups.items():
        ours = next((r for r in rs if r["system"] == "ours" and r["schedule"] == "varuna"), None)
        head = f"\n{model} P={P} Nm={rs[0]['Nm']} m={rs[0]['m']}"
        if model == "emulated":
            head += f" F={spec.fwd_s * 1e3:g}ms B={2 * spec.fwd_s * 1e3:g}ms R=F"
        print(head + f", network {level} ({LEVELS[level] or 'no emulation'})")
        if rs[0]["ideal_step_s"]:
            ideal = rs[0]["ideal_step_s"]
            la = latency_aware_ideal_s(P, rs[0]["Nm"], spec.fwd_s, level)
            print(f"ideal with recompute Nm(F+R+B)+(P-1)(F+B) = {ideal * 1e3:.0f} ms = "
                  f"{rs[0]['M'] / ideal:.1f} samples/s; latency-aware (+2(P-1) mean hops of "
                  f"{MEAN_HOP_S[level] * 1e3:g} ms) = {la * 1e3:.0f} ms\n")
        print("| " + " | ".join(_COLUMNS) + " |")
        print("|" + "|".join("---" if c == "schedule" else "---:" for c in _COLUMNS) + "|")
        for r in rs:
            t = r["task_ms"]
            cells = [
                r["label"],
                f"{r['median_step_s'] * 1e3:.0f}",
                f"{r['samples_per_s']:.1f}",
                _fmt_opt(r["of_ideal"], 3),
                _fmt_opt(r.get("of_la_ideal"), 3),
                _fmt_opt(ours["samples_per_s"] / r["samples_per_s"] if ours else None, 3),
                _fmt_opt(r["efficiency"]),
                f"{max(r['idle_frac']) * 100:.0f}%",
                _fmt_hops(r["hop_ms"]),
                "/".join(f"{t[op]:.1f}" if op in t else "-" for op in ("F", "R", "B", "W")),
                _fmt_list(r["peak_inputs"]),
                _fmt_list(r["peak_graphs"]),
                _fmt_bytes(r.get("weight_stash_bytes", ())),
            ]
            print("| " + " | ".join(cells) + " |")
        if any(r.get("asynchronous") for r in rs):
            print("\n(async) = PipeDream-2BW, one-step-stale gradients: not the same training as the other "
                  "rows, not comparable bit for bit; timed as one no-flush window (step = steady-state "
                  "period on stage 0), its memory one extra copy of each stage's weights (last column)")


def goal_rows(rows: list[dict]) -> list[dict]:
    """Per (P, level) of the emulated runs: our fastest schedule with recompute vs the best torch
    schedule with recompute (activation checkpointing), and vs the latency-aware ideal."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["model"] == "emulated":
            groups.setdefault((r["P"], r["level"]), []).append(r)
    for (P, level), rs in groups.items():
        # Like for like: our synchronous kinds with recompute (the varuna family always recomputes);
        # the asynchronous ones train differently, so they are reported beside, never picked.
        ours = [r for r in rs if r["system"] == "ours" and not _is_async(r)
                and (r["recompute"] or r["schedule"].startswith("varuna"))]
        asynchronous = [r for r in rs if r["system"] == "ours" and _is_async(r)]
        torch_rc = [r for r in rs if r["system"] == "torch" and r["recompute"]]
        if not ours or not torch_rc:
            continue
        mine = max(ours, key=lambda r: r["samples_per_s"])
        best = max(torch_rc, key=lambda r: r["samples_per_s"])
        la = mine.get("of_la_ideal")
        out.append({
            "P": P, "level": level, "ours": mine["label"], "ours_samples_per_s": mine["samples_per_s"],
            "best_torch": best["label"],
            "best_torch_samples_per_s": best["samples_per_s"],
            "vs_torch": mine["samples_per_s"] / best["samples_per_s"],
            "goal_vs_torch": GOAL_VS_TORCH.get(level),
            "of_la_ideal": la if la is not None else mine["of_ideal"],
            "goal_of_ideal": GOAL_VS_IDEAL.get(level),
            "async": [{
                "label": a["label"], "samples_per_s": a["samples_per_s"],
                "vs_torch": a["samples_per_s"] / best["samples_per_s"],
                "of_la_ideal": a["of_la_ideal"] if a.get("of_la_ideal") is not None else a["of_ideal"],
                "weight_stash_bytes": a.get("weight_stash_bytes", []),
            } for a in asynchronous],
        })
    return out


def _is_async(row: dict) -> bool:
    """Whether ``row`` is one of our asynchronous kinds (older JSON files lack the flag)."""
    return row.get("asynchronous", row["system"] == "ours" and row["schedule"] in ASYNC_SCHEDULES)


def print_goals(goals: list[dict]) -> None:
    """The goals of issue 18 for our fastest schedule, as a Markdown table."""
    if not goals:
        return
    print("\ngoals for our fastest schedule (emulated devices)\n")
    print("| P | network | ours | samples/s | best torch with recompute | its samples/s | ratio | goal | met "
          "| of LA ideal | goal | met |")
    print("|---:|---|---|---:|---|---:|---:|---:|---|---:|---:|---|")
    for g in goals:
        met_torch = "yes" if g["vs_torch"] >= g["goal_vs_torch"] else "**no**"
        met_ideal = "yes" if g["of_la_ideal"] >= g["goal_of_ideal"] else "**no**"
        print(f"| {g['P']} | {g['level']} | {g.get('ours', 'varuna')} "
              f"| {g.get('ours_samples_per_s', g.get('varuna_samples_per_s', 0.0)):.1f} | {g['best_torch']} "
              f"| {g['best_torch_samples_per_s']:.1f} | {g['vs_torch']:.3f} | {g['goal_vs_torch']:.2f} "
              f"| {met_torch} | {g.get('of_la_ideal', g.get('of_ideal', 0.0)):.3f} "
              f"| {g['goal_of_ideal']:.2f} | {met_ideal} |")
    rows = [(g, a) for g in goals for a in g.get("async", [])]
    if rows:
        print("\nasynchronous kinds, for information only (one-step-stale gradients: not the same training, "
              "not counted as ours above)\n")
        print("| P | network | schedule | samples/s | best torch with recompute | ratio | of LA ideal "
              "| weights stashed/stage |")
        print("|---:|---|---|---:|---|---:|---:|---|")
        for g, a in rows:
            print(f"| {g['P']} | {g['level']} | {a['label']} | {a['samples_per_s']:.1f} | {g['best_torch']} "
                  f"| {a['vs_torch']:.3f} | {a['of_la_ideal']:.3f} | {_fmt_bytes(a['weight_stash_bytes'])} |")


def write_timelines(rows: list[dict], directory: Path) -> None:
    """Chrome trace + Gantt PNG of each run's median timed step."""
    from varuna.core.timeline import Timeline

    directory.mkdir(parents=True, exist_ok=True)
    for r in rows:
        tl = Timeline(metadata={k: r[k] for k in ("label", "level", "P", "Nm", "m", "median_step_s")})
        for evs in r["timeline"].values():
            for stage, op, mb, start, end in evs:
                tl.add(stage, 0, op, mb, start, end)
        name = f"{r['model']}_p{r['P']}_{r['level']}_{r['label'].replace(' ', '_').replace('+', '-')}"
        name = name.replace("(", "").replace(")", "").replace("=", "")
        tl.to_chrome_trace(directory / f"{name}.json")
        try:
            tl.plot_gantt(directory / f"{name}.png", title=f"{r['label']} P={r['P']} network {r['level']} "
                          f"(step {r['median_step_s'] * 1e3:.0f} ms)", dpi=80)
        except ImportError:  # matplotlib is optional
            pass


def reprint(path: Path) -> int:
    """Print the tables of a saved run (fields added since it was written are derived if missing)."""
    try:
        data = json.loads(path.read_text())
        rows, args = data["rows"], data.get("args", {})
    except (OSError, ValueError, KeyError) as e:
        print(f"bench_schedules: cannot read results from {path}: {e}", file=sys.stderr)
        return 2
    for models in (("emulated",), ("gpt",)):
        rs = [r for r in rows if r["model"] in models]
        for P in sorted({r["P"] for r in rs}):
            sel = [r for r in rs if r["P"] == P]
            spec = WorldSpec(model=models[0], num_stages=P, num_microbatches=sel[0]["Nm"],
                             micro_batch_size=sel[0]["m"], fwd_s=args.get("fwd_ms", 10.0) / 1e3, width=0,
                             warmup=0, steps=0, runs=[], out_dir="")
            for r in sel:
                if r["model"] != "emulated":
                    r["efficiency"] = None
                if "task_ms" not in r:  # older files: from the kept (median) step's timeline only
                    tasks = task_medians_s([[evs] for evs in r["timeline"].values()], r["chunks"])
                    r["task_ms"] = {op: t * 1e3 for op, t in tasks.items()}
                    r["efficiency"] = _efficiency(spec, tasks, r["median_step_s"])
            print_tables(sel, spec)
    print_goals(data.get("goals") or goal_rows(rows))
    if "load_average" in data:
        print(f"\nload average {data['load_average'][0]:.1f} before, {data['load_average'][1]:.1f} after")
    return 0
