"""How far a calibration has got: the workers append one line per finished step to
``RUN_DIR/progress<rank>``; the parent turns them into a progress bar (on a terminal only).

Steps, in the order the workers run them (:mod:`profiler.worker`): every rank's start-up (torch
imported, model built), each segment measured, each link pair, each all-reduce configuration.

Example (the parent, polling while it waits for the workers)::

    with PhaseProgress(run_dir, plan, world, enabled=None) as bar:
        while not done():
            bar.poll()
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

from varuna.core.progress import Progress

__all__ = ["PhaseProgress", "note"]


def note(run_dir: Path | None, rank: int, step: str) -> None:
    """Worker side: record that this rank finished ``step`` (no-op without a run directory)."""
    if run_dir is not None:
        with open(run_dir / f"progress{rank}", "a") as f:
            f.write(step + "\n")  # one small write: the parent sees whole lines or none


class PhaseProgress:
    """Parent side: a bar over the plan's steps, fed by the workers' progress files."""

    def __init__(
        self, run_dir: Path, plan: dict, world: int, *, enabled: bool | None, file: IO[str] | None = None
    ) -> None:
        self.run_dir, self.world = run_dir, world
        assign = (plan.get("compute") or {}).get("assign", {})
        configs = (plan.get("allreduce") or {}).get("configs", [])
        # (phase name, steps) in run order; a step is the line a worker writes for it.
        self.phases = [
            ("start-up", {f"ready {r}" for r in range(world)}),
            ("compute", {f"segment {s}" for segs in assign.values() for s in segs}),
            ("links", {f"link {name}" for name in (plan.get("links") or {}).get("pairs", {})}),
            ("all-reduce", {f"allreduce {j}" for j in range(len(configs))}),
            ("overheads", {"overheads"} if plan.get("overheads") else set()),
        ]
        self.steps = set().union(*(steps for _, steps in self.phases))
        self.bar = Progress(
            "calibrating: start-up", total=len(self.steps), unit="step", enabled=enabled, file=file
        )
        self.done: set[str] = set()

    def poll(self) -> None:
        """Read the progress files and move the bar."""
        if not self.bar.active:
            return
        seen: set[str] = set()
        for r in range(self.world):
            try:
                text = (self.run_dir / f"progress{r}").read_text()
            except FileNotFoundError:
                continue
            # A line being written has no newline yet: count it next time.
            seen.update(text.split("\n")[:-1])
        new = (seen & self.steps) - self.done
        if not new:
            return
        self.done |= new
        current = next((name for name, steps in self.phases if not steps <= self.done), "done")
        self.bar.set_description(f"calibrating: {current}")
        self.bar.update(len(new))

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> PhaseProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
