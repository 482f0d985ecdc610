"""One profiler process: ``python -m profiler.worker RUN_DIR`` (started by :mod:`profiler.runner`).

Environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and ``GLOO_SOCKET_IFNAME``
in the netns mode). ``RUN_DIR/boot.json`` (written before the start) names the model; the worker
imports everything, then waits for ``RUN_DIR/plan.json`` (written once the parent's dry run is done),
which says what each rank does. Phases run one after the other so they never compete for the 2
cores of a small machine:

1. **compute** — ranks listed in ``compute.assign`` measure their segments
   (:class:`profiler.compute.SegmentProfiler`) in parallel; the others wait.
2. **links** — for each named pair (``intra``, ``inter``), its two ranks run
   :func:`profiler.network.link_session` (the inter pair inside :func:`varuna.testing.netem.emulate_network`
   when the plan gives a netem string); one pair at a time.
3. **allreduce** — for each configuration (ring size, concurrent rings), its ranks run
   :func:`profiler.network.allreduce_session`; one configuration at a time.
4. **overheads** (when the plan has it) — the first rank of each host runs the engine's
   micro-benchmarks in a world of its own (:mod:`profiler.overhead_phase`, Note [Overheads on the
   hosts]); the others wait on the store.

Idle ranks wait on the rendezvous store (a blocking socket read), not in a gloo barrier, which
spins and would steal a core from the ranks being timed. Each rank writes
``RUN_DIR/rank<r>.json`` with its raw measurements; the parent does all the statistics. Finished
steps (start-up, each segment, link pair and all-reduce configuration) are appended to
``RUN_DIR/progress<r>`` for the parent's progress bar (:mod:`profiler.phase_progress`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from profiler.overhead_phase import PHASE, run_phase
from profiler.phase_progress import note
from varuna.core.process import PARENT_PID_VAR, die_with_parent

__all__ = ["main"]


def _phase(store, name: str, rank: int, participants: list[int], timeout_s: float) -> None:
    """Mark this rank done with phase ``name`` (if it took part) and wait for all participants."""
    if rank in participants:
        store.set(f"{name}/{rank}", "1")
    if participants:
        store.wait([f"{name}/{r}" for r in participants], timedelta(seconds=timeout_s))


def _write_result(run_dir: Path, rank: int, result: dict) -> None:
    out = run_dir / f"rank{rank}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)  # atomic: the parent never reads half a file


def _new_groups(links: dict, ar: dict) -> tuple[dict, list]:
    """The process groups of the links and all-reduce phases. Every rank creates every group, in
    plan order (new_group is collective over the world)."""
    import torch.distributed as dist

    pair_groups = {}
    for name, pair in links.get("pairs", {}).items():
        pair_groups[name] = (dist.new_group(sorted(pair)), dist.new_group(sorted(pair)))
    ar_groups = []
    for cfg in ar.get("configs", []):
        rings = [dist.new_group(ring) for ring in cfg["rings"]]
        union = dist.new_group(sorted({r for ring in cfg["rings"] for r in ring}))
        ar_groups.append((rings, union))
    return pair_groups, ar_groups


def _run_allreduce_phase(
    ar: dict, ar_groups: list, store, rank: int, result: dict, timeout_s: float, run_dir: Path | None
) -> None:
    """This rank's all-reduce measurements of every configuration (its rings' members together)."""
    from profiler.network import allreduce_session

    seg_bytes = ar.get("segment_grad_bytes")
    if seg_bytes is None:  # measured in the compute phase (the parent does not build stages)
        seg_bytes = [int(store.get(f"grad_bytes/{i}")) for i in range(ar["num_segments"])]
    sizes = sorted({b for b in seg_bytes if b > 0} | set(ar["sweep"]))
    result["segment_grad_bytes"], result["allreduce_sizes"] = seg_bytes, sizes
    for j, (cfg, (rings, union)) in enumerate(zip(ar.get("configs", []), ar_groups)):
        members = sorted({r for ring in cfg["rings"] for r in ring})
        for ring, group in zip(cfg["rings"], rings):
            if rank in ring:
                times = allreduce_session(group, union, sizes, rounds=ar["warmup"] + ar["reps"])
                result.setdefault("allreduce", {})[str(j)] = times
        _phase(store, f"allreduce-{j}", rank, members, timeout_s)
        if rank == members[0]:
            note(run_dir, rank, f"allreduce {j}")


def run(
    plan: dict,
    rank: int,
    world: int,
    profiler=None,
    run_dir: Path | None = None,
    stamps: dict | None = None,
) -> dict:
    """Run this rank's part of ``plan``; with ``run_dir``, write the result there before tearing
    down torch.distributed (the parent stops waiting once every rank's result exists)."""
    import torch
    import torch.distributed as dist

    t_import = time.perf_counter()
    torch.set_num_threads(int(plan.get("threads", 1)))
    timeout_s = float(plan.get("timeout_s", 300))
    from varuna.runtime.layout import choose_gloo_interface

    choose_gloo_interface(os.environ["MASTER_ADDR"])  # unless set (Note [Calibrating real links])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        rank == 0,
        timeout=timedelta(seconds=timeout_s),
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    result: dict = {"rank": rank, "phase_s": {}}
    marks = [("start", t_import)]

    def mark(name: str) -> None:
        marks.append((name, time.perf_counter()))
        result["phase_s"][name] = marks[-1][1] - marks[-2][1]

    try:
        links = plan.get("links") or {}
        ar = plan.get("allreduce") or {}
        pair_groups, ar_groups = _new_groups(links, ar)
        mark("setup")

        compute = plan.get("compute") or {}
        assign = {int(k): v for k, v in compute.get("assign", {}).items()}
        if rank in assign and assign[rank]:
            prof = profiler or _make_profiler(plan, rank)
            result["compute"] = _run_compute(prof, assign[rank], compute["micro_batch_sizes"], run_dir, rank)
            result["fwd_flops_per_example"] = prof.fwd_flops_per_example()
            result["shared_params"] = prof.shared_params()
            for r in result["compute"]:  # the all-reduce phase moves each segment's gradient bytes
                store.set(f"grad_bytes/{r['segment']}", str(r["grad_bytes"]))
        _phase(store, "compute", rank, sorted(assign), timeout_s)
        mark("compute")

        for name, pair in links.get("pairs", {}).items():
            a, b = pair
            if rank in (a, b):
                result.setdefault("links", {})[name] = _run_link(
                    links, name, rank, a, b, pair_groups[name], timeout_s
                )
            _phase(store, f"link-{name}", rank, [a, b], timeout_s)
            if rank == a:
                note(run_dir, rank, f"link {name}")
        mark("links")

        if ar:
            _run_allreduce_phase(ar, ar_groups, store, rank, result, timeout_s, run_dir)
        mark("allreduce")
        if plan.get(PHASE):  # last: the engine's own costs on these hosts (Note [Overheads on the hosts])
            ranks = plan[PHASE]["ranks"]
            if rank in ranks:
                result["bench"] = run_phase(plan[PHASE], rank, ranks, store, timeout_s)
            _phase(store, PHASE, rank, ranks, timeout_s)
            if rank == 0:
                note(run_dir, rank, PHASE)
            mark(PHASE)
        # Rank 0 hosts the store: everyone leaves together, so no rank loses it while waiting.
        # (On an error a rank just exits; the parent then stops the others.)
        _phase(store, "exit", rank, list(range(world)), timeout_s)
        if stamps is not None:
            result["stamps"] = {**stamps, "measured": time.perf_counter()}
        if run_dir is not None:
            _write_result(run_dir, rank, result)
    finally:
        if dist.is_initialized():  # the overheads phase ends its own world
            dist.destroy_process_group()
    return result


def _make_profiler(boot: dict, rank: int):
    """This rank's :class:`SegmentProfiler` (builds the model and dry-runs it)."""
    import torch

    from profiler.compute import SegmentProfiler
    from profiler.spec import load_target

    device = boot.get("device", "cpu")
    if device == "cuda":  # one accelerator per compute process, as the engine's LOCAL_RANK does
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    compute = boot["compute_settings"]
    target = load_target(boot["spec"], boot.get("model_kwargs") or {})
    return SegmentProfiler(
        target,
        device=device,
        warmup=compute["warmup"],
        reps=compute["reps"],
        optimizer=compute["optimizer"],
        min_time_s=compute.get("min_time_s", 0.0),
        dry_run_m=compute.get("dry_run_m", 1),
    )


def _run_compute(prof, segments: list[int], ms: list[int], run_dir: Path | None, rank: int) -> list[dict]:
    out = []
    for seg in segments:
        out.extend(r.to_dict() for r in prof.measure(seg, ms))
        note(run_dir, rank, f"segment {seg}")
    return out


def _run_link(links: dict, name: str, rank: int, a: int, b: int, groups, timeout_s: float) -> dict:
    from profiler.network import link_session
    from varuna.testing.netem import emulate_network

    netem = (links.get("netem") or {}).get(name)
    act_msgs = [[(tuple(s), d) for s, d in msg] for msg in links["act_msgs"]]
    grad_msgs = [[(tuple(s), d) for s, d in msg] for msg in links["grad_msgs"]]
    with emulate_network(netem, timeout_s=timeout_s):
        return link_session(
            "a" if rank == a else "b",
            b if rank == a else a,
            groups[0],
            groups[1],
            act_msgs,
            grad_msgs,
            pings=links["pings"],
            rounds=links["warmup"] + links["reps"],
            timeout_s=timeout_s,
        )


def _wait_for_plan(run_dir: Path, timeout_s: float) -> dict:
    """The parent writes plan.json (atomically) once its dry run is done; until then we wait."""
    path = run_dir / "plan.json"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no plan in {run_dir} after {timeout_s:.0f}s")
        time.sleep(0.02)
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m profiler.worker RUN_DIR", file=sys.stderr)
        return 2
    stamps = {"main": time.perf_counter()}  # CLOCK_MONOTONIC: comparable with the parent's clock
    if os.environ.get(PARENT_PID_VAR, "").isdigit():  # never outlive a killed runner
        die_with_parent(int(os.environ[PARENT_PID_VAR]))
    run_dir = Path(args[0])
    boot = json.loads((run_dir / "boot.json").read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        # Import (and build the model) while the parent is still dry-running: worker start-up
        # is most of a small calibration's wall time on a 2-core machine.
        import profiler.network  # noqa: F401
        import varuna.runtime.engine  # noqa: F401
        import varuna.testing.netem  # noqa: F401

        stamps["imported"] = time.perf_counter()
        prof = _make_profiler(boot, rank) if rank < int(boot.get("compute_ranks", 0)) else None
        stamps["preloaded"] = time.perf_counter()
        note(run_dir, rank, f"ready {rank}")
        plan = {**boot, **_wait_for_plan(run_dir, float(boot.get("timeout_s", 300)))}
        stamps["plan"] = time.perf_counter()
        run(plan, rank, world, prof, run_dir, stamps)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
