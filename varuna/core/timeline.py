"""Timelines: what each stage of each replica did, and when, during a mini-batch.

One format for simulated and real runs: the simulator and the runtime both produce a
:class:`Timeline`; it is saved as Chrome trace JSON (open it at https://ui.perfetto.dev) and drawn
as a Gantt chart in the style of the Varuna paper's Figure 7 (rows = stages; F red, B green,
R orange, all-reduce purple, optimizer grey; micro-batch numbers on boxes that fit them).

Pure Python; matplotlib (the ``plot`` extra) is imported only inside :meth:`Timeline.plot_gantt`.

Example::

    >>> tl = Timeline()
    >>> tl.add(stage=0, replica=0, op="F", microbatch=0, start_s=0.0, end_s=0.01)
    >>> tl.add(stage=1, replica=0, op="F", microbatch=0, start_s=0.01, end_s=0.02)
    >>> tl.span_s()
    0.02
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from varuna.core.extras import require

__all__ = ["Event", "Timeline", "OPS", "COLORS"]

#: Operations a timeline records. Compute: F, R, B (and W: the weight gradients of a split
#: backward). Gradient all-reduce: AR. Optimizer step: OPT.
#: Transfers: SEND_ACT (activation to the next stage), SEND_GRAD (gradient to the previous stage).
OPS = ("F", "R", "B", "W", "AR", "OPT", "SEND_ACT", "SEND_GRAD")

#: Gantt colours, as in the paper's Figure 7.
COLORS = {
    "F": "#d62728",
    "B": "#2ca02c",
    "W": "#17becf",
    "R": "#ff7f0e",
    "AR": "#9467bd",
    "OPT": "#7f7f7f",
    "SEND_ACT": "#1f77b4",
    "SEND_GRAD": "#17becf",
}

# Chrome trace rows: compute (and AR/OPT) on tid = stage; sends on their own rows so slices on
# one row never overlap (Perfetto mis-nests overlapping complete events).
_SEND_TID_OFFSET = {"SEND_ACT": 10_000, "SEND_GRAD": 20_000}
_NAME_RE = re.compile(r"^([A-Z_]+?)(\d+)?$")


@dataclass(frozen=True, slots=True)
class Event:
    """One interval of work. ``microbatch`` is None for per-mini-batch work (AR, OPT)."""

    stage: int
    replica: int
    op: str
    microbatch: int | None
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class Timeline:
    """An ordered bag of :class:`Event` plus free-form ``metadata`` (the config, the source).

    >>> tl = Timeline(metadata={"P": 2})
    >>> tl.add(stage=0, replica=0, op="B", microbatch=3, start_s=1.0, end_s=1.5)
    >>> tl.events[0].duration_s
    0.5
    """

    events: list[Event] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    def add(
        self, stage: int, replica: int, op: str, microbatch: int | None, start_s: float, end_s: float
    ) -> None:
        """Record one interval (seconds, any common origin)."""
        self.events.append(Event(stage, replica, op, microbatch, start_s, end_s))

    def span_s(self) -> float:
        """Time from the first start to the last end (0 when empty)."""
        if not self.events:
            return 0.0
        return max(e.end_s for e in self.events) - min(e.start_s for e in self.events)

    def for_stage(self, stage: int, replica: int = 0, ops: tuple[str, ...] = ("F", "R", "B")) -> list[Event]:
        """The stage's events of kinds ``ops``, in start order."""
        return sorted(
            (e for e in self.events if e.stage == stage and e.replica == replica and e.op in ops),
            key=lambda e: (e.start_s, e.end_s),
        )

    # -- Chrome trace -------------------------------------------------------------------------

    def to_chrome_dict(self) -> dict:
        """The Chrome trace object (``traceEvents``, times in microseconds)."""
        out: list[dict] = []
        rows: set[tuple[int, int]] = set()
        for e in self.events:
            tid = e.stage + _SEND_TID_OFFSET.get(e.op, 0)
            rows.add((e.replica, tid))
            out.append(
                {
                    "name": e.op if e.microbatch is None else f"{e.op}{e.microbatch}",
                    "cat": e.op,
                    "ph": "X",
                    "pid": e.replica,
                    "tid": tid,
                    "ts": e.start_s * 1e6,
                    "dur": (e.end_s - e.start_s) * 1e6,
                    "args": {"stage": e.stage, "replica": e.replica, "op": e.op, "microbatch": e.microbatch},
                }
            )
        meta: list[dict] = []
        for replica in sorted({r for r, _ in rows}):
            meta.append(
                {"name": "process_name", "ph": "M", "pid": replica, "args": {"name": f"replica {replica}"}}
            )
        for replica, tid in sorted(rows):
            stage = tid % 10_000
            suffix = {1: " act sends", 2: " grad sends"}.get(tid // 10_000, "")
            meta.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": replica,
                    "tid": tid,
                    "args": {"name": f"stage {stage}{suffix}"},
                }
            )
            meta.append(
                {
                    "name": "thread_sort_index",
                    "ph": "M",
                    "pid": replica,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        return {"traceEvents": meta + out, "displayTimeUnit": "ms", "otherData": dict(self.metadata)}

    def to_chrome_trace(self, path: str | os.PathLike) -> None:
        """Write Chrome trace JSON (opens in Perfetto / chrome://tracing)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome_dict(), f)

    @classmethod
    def from_chrome_dict(cls, data: dict) -> Timeline:
        """Inverse of :meth:`to_chrome_dict`; also reads traces from other writers that use
        ``pid`` = replica, ``tid`` = stage and names like ``F3``."""
        if isinstance(data, list):  # the bare-array form of the format
            data = {"traceEvents": data}
        if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
            raise ValueError("not a Chrome trace: expected an object with a 'traceEvents' list")
        tl = cls(metadata=dict(data.get("otherData") or {}))
        for ev in data["traceEvents"]:
            if ev.get("ph") != "X":
                continue
            args = ev.get("args") or {}
            op, mb = args.get("op"), args.get("microbatch")
            if op is None:
                match = _NAME_RE.match(str(ev.get("name", "")))
                if not match:
                    continue
                op, mb = match.group(1), (int(match.group(2)) if match.group(2) else None)
            stage = args.get("stage", int(ev.get("tid", 0)) % 10_000)
            replica = args.get("replica", int(ev.get("pid", 0)))
            start = float(ev["ts"]) / 1e6
            tl.add(int(stage), int(replica), str(op), mb, start, start + float(ev.get("dur", 0.0)) / 1e6)
        return tl

    @classmethod
    def from_chrome_trace(cls, path: str | os.PathLike) -> Timeline:
        """Read a trace written by :meth:`to_chrome_trace` (or a compatible writer)."""
        with open(path, encoding="utf-8") as f:
            return cls.from_chrome_dict(json.load(f))

    # -- Gantt chart --------------------------------------------------------------------------

    def plot_gantt(
        self,
        path: str | os.PathLike,
        *,
        title: str | None = None,
        replica: int | None = 0,
        show_sends: bool = False,
        dpi: int = 120,
    ) -> None:
        """Draw a Gantt chart PNG (or any format matplotlib infers from ``path``'s suffix).

        Rows are stages (stage 0 on top) of ``replica`` (``None``: every replica, grouped).
        Micro-batch numbers are drawn on boxes wide enough to hold them.

        >>> tl = Timeline()
        >>> tl.add(stage=0, replica=0, op="F", microbatch=0, start_s=0.0, end_s=1.0)
        >>> tl.plot_gantt("/tmp/_timeline_doctest.png", title="one box")
        """
        # Imported here: matplotlib is optional (the plot extra) and slow to import; Figure + Agg
        # canvas avoid pyplot's global state (safe in servers and threads).
        require("matplotlib", "plot", "Timeline.plot_gantt")
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        ops = set(COLORS) if show_sends else {"F", "R", "B", "AR", "OPT"}
        events = [e for e in self.events if e.op in ops and (replica is None or e.replica == replica)]
        row_keys = sorted({(e.replica, e.stage) for e in events})
        row_of = {k: i for i, k in enumerate(row_keys)}
        t0 = min((e.start_s for e in events), default=0.0)
        t1 = max((e.end_s for e in events), default=1.0)
        span = max(t1 - t0, 1e-12)
        # Wide enough that a pipeline's boxes stay legible; matplotlib caps sizes near 2^16 px.
        per_row = max((sum(1 for e in events if (e.replica, e.stage) == k) for k in row_keys), default=1)
        width_in = min(max(8.0, 0.18 * per_row), 60.0)
        bottom_in, top_in = 0.55, 0.7  # x-axis label below; legend and title above
        height_in = bottom_in + top_in + 0.38 * max(len(row_keys), 1)
        fig = Figure(figsize=(width_in, height_in), dpi=dpi)
        FigureCanvasAgg(fig)
        ax = fig.add_axes((0.07, bottom_in / height_in, 0.91, 1 - (bottom_in + top_in) / height_in))
        px_per_s = 0.91 * width_in * dpi / span
        _draw_boxes(ax, events, row_of, t0, px_per_s, dpi)
        ax.set_ylim(len(row_keys) - 0.5, -0.5)
        ax.set_xlim(0, span)
        ax.set_yticks(range(len(row_keys)))
        multi = replica is None and len({r for r, _ in row_keys}) > 1
        ax.set_yticklabels([f"r{r} s{s}" if multi else f"stage {s}" for r, s in row_keys], fontsize=8)
        ax.set_xlabel("time (s)")
        _draw_legend(ax, events)
        if title:
            fig.suptitle(title, fontsize=10, y=1 - 0.06 / height_in, va="top")
        fig.savefig(os.fspath(path))


# Legend names of the timeline's ops.
_OP_NAMES = {
    "F": "forward",
    "R": "recompute",
    "B": "backward",
    "AR": "all-reduce",
    "OPT": "optimizer",
    "SEND_ACT": "send activation",
    "SEND_GRAD": "send gradient",
}


def _draw_boxes(ax: Any, events: list[Event], row_of: dict[tuple[int, int], int], t0: float,
                px_per_s: float, dpi: int) -> None:
    """One box per event on its (replica, stage) row, labelled with its micro-batch where it fits."""
    fontsize = 7
    for e in events:
        y = row_of[(e.replica, e.stage)]
        w = e.end_s - e.start_s
        ax.broken_barh(
            [(e.start_s - t0, w)],
            (y - 0.4, 0.8),
            facecolors=COLORS.get(e.op, "#bcbd22"),
            edgecolors="black",
            linewidth=0.3,
        )
        label = str(e.microbatch) if e.microbatch is not None else ("AR" if e.op == "AR" else "")
        # Text fits when the box is wider than ~0.62 em per character plus a small margin.
        if label and w * px_per_s > (0.62 * fontsize * dpi / 72) * len(label) + 2:
            ax.text(
                e.start_s - t0 + w / 2,
                y,
                label,
                ha="center",
                va="center",
                fontsize=fontsize,
                color="white" if e.op in ("F", "B", "AR") else "black",
            )


def _draw_legend(ax: Any, events: list[Event]) -> None:
    """A one-row legend above the axes, of the ops present."""
    from matplotlib.patches import Patch

    present = [op for op in COLORS if any(e.op == op for e in events)]
    ax.legend(
        handles=[Patch(facecolor=COLORS[op], edgecolor="black", label=_OP_NAMES[op]) for op in present],
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=len(present) or 1,
        fontsize=8,
        frameon=False,
    )
