"""The profiler's runtime-overheads phase: the engine's own costs measured by the profiler's workers.

Note [Overheads on the hosts]: a segment profile times each segment alone, outside the engine's
task loop, so it cannot see what the engine itself costs per task (dispatch, RNG re-seeding,
slicing, the send), per segment before a stage (placeholders) and per step (set-up, the agreement
all-reduce, the optimizer call) -- on a small model those are most of a step. This phase runs
:func:`profiler.overhead_runs.micro_benchmarks` (the calibration runs of Note [Task costs] in
:mod:`profiler.overheads`: W×1 pipelines of the engine itself over emulated blocks) in the
workers, after the other phases, so on ``--host-list`` they run on the job's own hosts over its own
links and their CPUs; :func:`runtime_constants` fits the costs and the file's ``runtime_overheads``
section gets them (``source`` says where and at which world size W). W is one worker per host,
the first of each, in a gloo world of their own: the profiler's k workers per host would measure
k processes sharing a host's cores, and the constants grow with W (the step overhead by its
agreement all-reduce; on a 2-core machine every term, by contention: task overhead 0.21 ms at
W = 2 and 0.35 ms at W = 4 on one host, the engine's real tasks on the GPT example 0.0-0.2 ms).
On by default with ``--host-list`` (``--runtime-overheads`` / ``--no-runtime-overheads``);
off for emulated hosts, whose constants would describe this machine only.

The worker half is :func:`run_phase`; this module's other functions are pure (no torch).

Example::

    plan["overheads"] = overheads_plan(probe_messages=40, calibration_steps=3, num_hosts=2,
                                       procs_per_host=2)
    ...                                              # ranks 0 and 2 run it (run_phase)
    section, constants = reduce_overheads([results[0], results[2]], "2 hosts over ssh")
    cal.runtime_overheads = section
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from profiler.overheads import RuntimeConstants, runtime_constants
from varuna.core.calibration import RuntimeOverheads

__all__ = ["overheads_plan", "reduce_overheads", "run_phase", "wants_overheads"]

#: The plan key of the phase and the step name a worker notes when it is done.
PHASE = "overheads"


def wants_overheads(choice: bool | None, remote: bool) -> bool:
    """Whether to run the phase: ``choice`` when given, else on exactly for real hosts.

    >>> wants_overheads(None, remote=True), wants_overheads(None, remote=False), wants_overheads(False, True)
    (True, False, False)
    """
    return remote if choice is None else choice


def overheads_plan(*, probe_messages: int, calibration_steps: int, num_hosts: int, procs_per_host: int
                   ) -> dict[str, Any]:
    """The phase's entry of the workers' plan: the first worker of each host runs it (the counts
    are checked by ``ProfileOptions.validate``).

    >>> overheads_plan(probe_messages=40, calibration_steps=3, num_hosts=2, procs_per_host=2)
    {'probe_messages': 40, 'calibration_steps': 3, 'ranks': [0, 2]}
    """
    return {"probe_messages": probe_messages, "calibration_steps": calibration_steps,
            "ranks": [h * procs_per_host for h in range(num_hosts)]}


def reduce_overheads(results: Sequence[dict], where: str) -> tuple[RuntimeOverheads, RuntimeConstants]:
    """The file's ``runtime_overheads`` (and every fitted constant, for the diagnostics) from the
    workers' results, each holding ``bench``: its rounds of micro-benchmarks. ``where``: the hosts
    (goes into ``source`` with the world size)."""
    if any("bench" not in r for r in results):
        raise RuntimeError("a profiler worker returned no runtime-overhead measurements; see its log")
    rc = runtime_constants([{"bench": r["bench"]} for r in results])
    source = f"varuna-profile runtime-overheads phase, W={len(results)} on {where}"
    return rc.to_runtime_overheads(source=source), rc


def run_phase(spec: dict[str, Any], rank: int, ranks: list[int], store: Any, timeout_s: float) -> list[dict]:
    """Worker side, on each rank of ``spec["ranks"]`` (one per host) at once: leave the profiler's
    world for one of those ranks alone (a gloo world on a prefix of the same store), run one round
    of micro-benchmarks in it, and end it."""
    from datetime import timedelta

    import torch.distributed as dist

    from profiler.overhead_runs import micro_benchmarks

    dist.destroy_process_group()  # local: the phase's world replaces it (Note [Overheads on the hosts])
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{PHASE}/", store), rank=ranks.index(rank),
                            world_size=len(ranks), timeout=timedelta(seconds=timeout_s))
    try:
        return [micro_benchmarks(ranks.index(rank), len(ranks), int(spec["probe_messages"]),
                                 int(spec["calibration_steps"]), timeout_s)]
    finally:
        dist.destroy_process_group()
