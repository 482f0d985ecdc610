"""Merging every rank's recorded task events on rank 0 (``Engine.gather_timeline``).

The events travel as one float64 tensor per rank (all-gather, no pickle): rows of (stage,
replica, op code, micro-batch or -1, start, end).

Example::

    tl = gather_timeline(engine.timeline, engine.layout, metadata={"source": "runtime"})
    if tl is not None:                      # rank 0
        tl.to_chrome_trace("trace.json")
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from varuna.core.timeline import OPS, Timeline
from varuna.runtime.layout import Layout

__all__ = ["gather_timeline"]

def gather_timeline(timeline: Timeline, layout: Layout, metadata: dict) -> Timeline | None:
    """Every rank's events merged on rank 0 (a collective; other ranks get None), origin shifted
    to the earliest event."""
    rows = [
        [
            e.stage,
            e.replica,
            OPS.index(e.op),
            -1 if e.microbatch is None else e.microbatch,
            e.start_s,
            e.end_s,
        ]
        for e in timeline.events
    ]
    local = torch.tensor(rows, dtype=torch.float64).reshape(-1, 6)
    if layout.world > 1:
        n = torch.tensor([local.shape[0]], dtype=torch.int64)
        counts = [torch.zeros_like(n) for _ in range(layout.world)]
        dist.all_gather(counts, n)
        width = max(int(c) for c in counts)
        padded = torch.zeros(width, 6, dtype=torch.float64)
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(layout.world)]
        dist.all_gather(parts, padded)
        local = torch.cat([p[: int(c)] for p, c in zip(parts, counts)])
    if layout.rank != 0:
        return None
    t0 = float(local[:, 4].min()) if local.numel() else 0.0
    tl = Timeline(metadata=metadata)
    for st, rep, op, mb, a, b in local.tolist():
        tl.add(int(st), int(rep), OPS[int(op)], None if mb < 0 else int(mb), a - t0, b - t0)
    return tl
