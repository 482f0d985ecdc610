#!/usr/bin/env python
"""Plots from ``bench_schedules.py --json`` output: samples/s against network jitter, and Gantt charts.

    python scripts/plot_bench.py runs/bench.json docs/img/bench_schedules_p4.png [--stages 4] [--title T]
    python scripts/plot_bench.py runs/bench.json docs/img/gantt.png --gantt "ours varuna" --level heavy

Throughput: one panel per pipeline depth P; x is the network level (mean extra delay per message:
none 0 ms, moderate 1 + 2 ms, heavy 2 + 10 ms), one line per schedule; solid lines with recompute
/ checkpointing, dashed without, dash-dot (black) for the asynchronous ``ours 2bw (async)``; the
ideal with-recompute throughput as a dotted grey line.
Gantt: the median timed step of one row (F red, R orange, B green; rows = stages).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

_LEVEL_X = {"none": 0.0, "moderate": 3.0, "heavy": 12.0}
_STYLE = {  # (colour, marker) per schedule family
    "ours varuna": ("#d62728", "o"),
    "ours gpipe": ("#ff9896", "s"),
    "ours 1f1b": ("#e377c2", "^"),
    "ours zb-h1": ("#8c564b", "v"),
    "ours varuna-zb": ("#ff7f0e", "*"),
    "ours interleaved(v=2)": ("#bcbd22", "P"),
    "ours varuna-interleaved(v=2)": ("#9467bd", "X"),
    "ours 2bw (async)": ("#000000", "o"),
    "torch GPipe": ("#1f77b4", "s"),
    "torch 1F1B": ("#17becf", "^"),
    "torch Interleaved1F1B(v=2)": ("#2ca02c", "D"),
    "torch InterleavedZeroBubble(v=2)": ("#98df8a", "d"),
    "torch ZBVZeroBubble(v=2)": ("#aec7e8", "h"),
    "torch DualPipeV(v=2)": ("#393b79", "p"),
}


def _family(label: str) -> str:
    return label.removesuffix("+ckpt").removesuffix("+R")


def plot_throughput(rows: Sequence[dict], path: str | Path, *, stages: Sequence[int] | None = None,
                    title: str | None = None) -> None:
    """Write the PNG (emulated-device rows only); ``stages`` restricts the panels to those P."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in rows if r["model"] == "emulated" and (stages is None or r["P"] in stages)]
    depths = sorted({r["P"] for r in rows})
    if not depths:
        raise ValueError("no emulated-device rows to plot")
    fig = Figure(figsize=(8.6 * len(depths), 4.6), dpi=90)
    FigureCanvasAgg(fig)
    for i, P in enumerate(depths):
        ax = fig.add_subplot(1, len(depths), i + 1)
        mine = [r for r in rows if r["P"] == P]
        by_label: dict[str, list[dict]] = {}
        for r in mine:
            by_label.setdefault(r["label"], []).append(r)
        for label, rs in by_label.items():
            rs = sorted(rs, key=lambda r: _LEVEL_X[r["level"]])
            colour, marker = _STYLE.get(_family(label), ("#7f7f7f", "x"))
            rc = rs[0]["recompute"] or rs[0]["schedule"].startswith("varuna")
            # The asynchronous kind (2bw) trains differently: its own dash-dot style, marked in the label.
            style = "-." if rs[0].get("asynchronous") else "-" if rc else "--"
            ax.plot([_LEVEL_X[r["level"]] for r in rs], [r["samples_per_s"] for r in rs], marker=marker,
                    color=colour, linestyle=style,
                    linewidth=2.2 if label == "ours varuna" else 1.2, label=label)
        ideal = [r for r in mine if r.get("ideal_step_s")]
        if ideal:
            ax.axhline(ideal[0]["M"] / ideal[0]["ideal_step_s"], color="#7f7f7f", linestyle=":",
                       label="ideal with recompute")
        ax.set_xticks(sorted(_LEVEL_X.values()), ["none", "moderate\n1+Exp(2) ms", "heavy\n2+Exp(10) ms"])
        ax.set_xlabel("network (latency + jitter per message)")
        ax.set_ylabel("samples/s")
        ax.set_title(f"P={P}, Nm={mine[0]['Nm']}, m={mine[0]['m']}, F=10 ms B=20 ms (emulated devices)",
                     fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path))


def plot_gantt(row: dict, path: str | Path, *, dpi: int = 80) -> None:
    """Gantt PNG of the median timed step of one result row (its ``timeline``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from varuna.core.timeline import Timeline

    tl = Timeline()
    for evs in row["timeline"].values():
        for stage, op, mb, start, end in evs:
            tl.add(stage, 0, op, mb, start, end)
    tl.plot_gantt(path, title=f"{row['label']}, P={row['P']}, network {row['level']}: "
                  f"step {row['median_step_s'] * 1e3:.0f} ms", dpi=dpi)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", type=Path, help="output of bench_schedules.py --json")
    ap.add_argument("png", type=Path)
    ap.add_argument("--stages", type=int, nargs="*", help="only these pipeline depths")
    ap.add_argument("--title", help="figure title")
    ap.add_argument("--gantt", metavar="LABEL", help="draw this row's timeline instead (e.g. 'ours varuna')")
    ap.add_argument("--level", default="none", help="network level of the --gantt row")
    ap.add_argument("--model", default="emulated", help="model of the --gantt row")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from varuna.core.extras import MissingExtra, require_extra

    try:
        require_extra("plot", "plot_bench.py")
    except MissingExtra as e:
        print(f"plot_bench: {e}", file=sys.stderr)
        return 2
    try:
        rows = json.loads(a.json.read_text())["rows"]
    except (OSError, ValueError, KeyError) as e:
        print(f"plot_bench: cannot read rows from {a.json}: {e}", file=sys.stderr)
        return 2
    if a.gantt:
        match = [r for r in rows if r["label"] == a.gantt and r["level"] == a.level and r["model"] == a.model
                 and (not a.stages or r["P"] in a.stages)]
        if not match:
            print(f"plot_bench: no row {a.gantt!r} at level {a.level!r} in {a.json}", file=sys.stderr)
            return 2
        plot_gantt(match[0], a.png)
        return 0
    plot_throughput(rows, a.png, stages=a.stages or None, title=a.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
