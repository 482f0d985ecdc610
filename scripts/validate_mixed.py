#!/usr/bin/env python
"""Validate the simulator on an emulated MIXED cluster (issue #19): devices of different speeds,
uneven replica shares and uneven stage ranges, real engine vs ``simulator.engine.simulate``.

The machinery is ``scripts/validate_simulator.py``'s (same workers, micro-benchmarked runtime
constants, disturbed-step handling, table): each configuration here adds, per rank, an emulated
device speed (``varuna.testing.emulated_model(speed=...)``: its blocks sleep F / speed), per
replica a micro-batch share (``VarunaConfig.replica_shares``) and per stage a number of blocks
(``stage_ranges``). The simulator sees each speed as a VM type of the calibration (schema v2
``types``, with the runtime's measured per-task overheads unscaled) and simulates with
``SimConfig.device_types`` and per-replica micro-batch counts.

Usage::

    python scripts/validate_mixed.py                 # the table (10 configurations, ~6 min)
    python scripts/validate_mixed.py --only "2x2,shares=10/6"
    python scripts/validate_mixed.py --json runs/mixed.json

Goal (the issue): every configuration within 5%, median <= 3%. Results: docs/mixed_types.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import validate_simulator as vs  # noqa: E402  (after the sys.path set-up)

FAST, MID, SLOW = 1.6, 1.3, 1.0


def _c(P: int, D: int, kind: str, level: str, speeds, shares=None, nm: int = 16, blocks=None) -> vs.ValConfig:
    return vs.ValConfig(num_stages=P, num_replicas=D, schedule=kind, num_microbatches=nm, level=level,
                        speeds=tuple(tuple(r) for r in speeds), shares=shares, stage_blocks=blocks)


def mixed_configs() -> list[vs.ValConfig]:
    """Two device speeds (1.6x and 1x) at P = 2, three (1.6x, 1.3x, 1x) at P = 4: uneven shares
    with replicas grouped by speed, even shares (the plan that ignores speeds), the fast devices
    only, pipelines mixing speeds with uneven stage ranges, and every schedule kind."""
    f, m, s = FAST, MID, SLOW
    return [
        _c(2, 2, "varuna", "none", [(f, f), (s, s)], (10, 6)),
        _c(2, 2, "varuna", "none", [(f, f), (s, s)], (8, 8)),
        _c(2, 1, "varuna", "none", [(f, f)], nm=16),
        _c(2, 2, "varuna", "moderate", [(f, s), (f, s)], (8, 8), blocks=(5, 3)),
        _c(2, 2, "1f1b", "moderate", [(f, f), (s, s)], (10, 6)),
        _c(2, 2, "gpipe", "heavy", [(f, s), (f, f)], (7, 9), blocks=(3, 2)),
        _c(1, 4, "varuna", "none", [(f,), (f,), (s,), (s,)], (5, 5, 3, 3)),
        _c(4, 1, "varuna", "none", [(f, m, m, s)], nm=8, blocks=(3, 2, 2, 1)),
        _c(4, 2, "varuna", "moderate", [(f, f, m, m), (m, s, s, s)], (10, 6), blocks=(3, 2, 2, 1)),
        _c(4, 2, "1f1b", "none", [(f, f, f, f), (m, m, s, s)], (9, 7)),
    ]


def run(configs: Sequence[vs.ValConfig], a: argparse.Namespace) -> list[vs.Row]:
    """Run ``configs`` (real and simulated) with validate_simulator's settings in ``a``."""
    with tempfile.TemporaryDirectory(prefix="varuna-validate-mixed-") as tmp:
        best, constants, _ = vs._run_all(a, list(configs), "", str(a.work_dir) if a.work_dir else tmp)
    order = {c.label: i for i, c in enumerate(configs)}
    rows = sorted(best.values(), key=lambda r: order[r.config.label])
    vs.print_table(rows, constants)
    if a.json:
        vs._write_json(a.json, rows, constants, {})
    return rows


def load() -> str:
    """The machine's load, for the record (the runs share the host)."""
    one, five, fifteen = os.getloadavg()
    return f"{os.cpu_count()} cores, load average {one:.1f} {five:.1f} {fifteen:.1f}"


def parser() -> argparse.ArgumentParser:
    p = vs._parser()
    p.description = __doc__
    return p


def run_selected(configs: list, a, what: str) -> int:
    """Run the configurations ``--only`` keeps (all labels' parts must match) and print the
    table with the machine's load before and after; 2 when none matches."""
    if a.only:
        parts = [x.strip() for x in a.only.split(",") if x.strip()]
        configs = [c for c in configs if all(x in c.label for x in parts)]
    if not configs:
        print("no configuration matches --only", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(f"{len(configs)} {what}, {a.warmup} warm-up + {a.steps} timed steps each; {load()}", flush=True)
    run(configs, a)
    print(f"wall time {time.perf_counter() - t0:.0f} s; {load()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_selected(mixed_configs(), parser().parse_args(argv), "mixed configurations")


if __name__ == "__main__":
    sys.exit(main())
