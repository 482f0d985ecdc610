#!/usr/bin/env python
"""Validate the simulator on the schedule kinds of issue 18: interleaved stages (``interleaved``,
``varuna-interleaved``, v = 2 model chunks per process) and zero-bubble (``zb-h1``,
``varuna-zb``: the backward split into B and a deferrable W) and PipeDream-2BW (``2bw``, no
flush between mini-batches), real engine vs ``simulator.engine.simulate``.

The machinery is ``scripts/validate_simulator.py``'s (same workers, micro-benchmarked runtime
constants, disturbed-step handling, table). The interleaved configurations build P·v virtual
stages of ``BLOCKS_PER_STAGE`` emulated blocks each (2·P·v blocks; ``VarunaConfig.chunks`` and
``SimConfig.chunks`` = v); the zero-bubble ones split each block's backward with the same
``WEIGHT_FRAC`` in the emulated blocks (``weight_frac``) and in the simulator
(``weight_grad_fraction``). ``2bw`` runs its warm-up and timed steps as one ``Engine.train_steps``
window (``profiler.overhead_runs.timed_window``: a step's time is from the previous step's end to
its own) against the simulator's steady state (``simulator.engine.simulate``: a window of two
mini-batches beyond a window of one).

Usage::

    python scripts/validate_kinds.py                    # the table (11 configurations, ~5 min)
    python scripts/validate_kinds.py --only "zb-h1" --json runs/kinds.json

Goal (the issue): every configuration within 5%. Results: docs/simulator.md, Validation, "New
schedule kinds".
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import validate_mixed as vm  # noqa: E402  (after the sys.path set-up)
import validate_simulator as vs  # noqa: E402

#: The kinds validated here.
NEW_KINDS: tuple[str, ...] = ("interleaved", "varuna-interleaved", "zb-h1", "varuna-zb", "2bw")
#: v of the interleaved kinds: model chunks per process.
CHUNKS = 2


def new_kind_configs() -> list[vs.ValConfig]:
    """Each of NEW_KINDS at P = 2 and P = 4, D = 1 and 2, with no and moderate network jitter: 11
    configurations, every kind on both depths, both D and both levels (2bw: a third, 2x2 heavy);
    all with recompute, Nm a multiple of P (as the interleaved kinds need).

    >>> [c.label for c in new_kind_configs()][:2]
    ['2x1 interleaved(v=2) Nm=4 none', '4x2 interleaved(v=2) Nm=8 moderate']
    """
    rows = [
        ("interleaved", 2, 1, 4, "none"), ("interleaved", 4, 2, 8, "moderate"),
        ("varuna-interleaved", 2, 2, 4, "moderate"), ("varuna-interleaved", 4, 1, 8, "none"),
        ("zb-h1", 2, 2, 8, "none"), ("zb-h1", 4, 1, 8, "moderate"),
        ("varuna-zb", 2, 1, 8, "moderate"), ("varuna-zb", 4, 2, 8, "none"),
        ("2bw", 2, 1, 4, "moderate"), ("2bw", 4, 2, 8, "none"), ("2bw", 2, 2, 8, "heavy"),
    ]
    return [vs.ValConfig(num_stages=P, num_replicas=D, schedule=kind, num_microbatches=nm, level=level,
                         chunks=CHUNKS if "interleaved" in kind else 1)
            for kind, P, D, nm, level in rows]


def main(argv: Sequence[str] | None = None) -> int:
    p = vm.parser()
    p.description = __doc__
    return vm.run_selected(new_kind_configs(), p.parse_args(argv), "configurations of the issue-18 kinds")


if __name__ == "__main__":
    sys.exit(main())
