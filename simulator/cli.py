"""``varuna-simulate``: rank P×D configurations for G GPUs, or estimate one, from a calibration file.

Examples::

    varuna-simulate --calibration cal.json --gpus 64 --global-batch-size 8192
    varuna-simulate --calibration cal.json --gpus 64 --global-batch-size 8192 --json
    varuna-simulate --calibration cal.json --gpus 64 --global-batch-size 8192 --config 8x8 \\
        --trace best.json --plot best.png
    varuna-simulate --calibration cal.json --gpus 64 --global-batch-size 8192 --sweep-gpus 16,32,64,128
    varuna-simulate --calibration cal.json --cluster fast=2,slow=2 --global-batch-size 64  # cal's types
    varuna-simulate --type-calibration fast=fast.json --type-calibration slow=slow.json \
        --cluster fast=2,slow=2 --global-batch-size 64                  # one file per VM type

With ``--cluster`` (mixed VM types, docs/mixed_types.md) it plans with
``simulator.mixed_plan.plan_mixed`` and prints the chosen stage→type map, stage ranges, micro-batch
shares and why: predicted samples/s against the best plan treating every VM as the slowest type
and the best plan on the fastest type only.

On a terminal, progress bars on stderr show the search and the sweep (``--quiet`` or
``VARUNA_QUIET=1`` turns them off; they never appear when stderr is not a terminal).

Bad input exits with status 2 and one line ``varuna-simulate: error: <what> — <how to fix>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Sequence

from simulator.autoconfig import (
    AutoConfigResult,
    Candidate,
    autoconfigure_request,
    choose_micro_batch_size,
    sweep_gpus,
)
from simulator.config import SIM_SCHEDULE_KINDS, SimConfig, SimResult
from simulator.engine import simulate
from simulator.mixed_plan import plan_mixed
from simulator.training import (
    TrainingEstimate,
    add_training_args,
    device_peak_of,
    estimate_training,
    flops_per_example,
)
from varuna.core.calibration import Calibration
from varuna.core.cli import OneLineParser, add_deprecated_alias, add_planning_args, positive_int
from varuna.core.extras import MissingExtra, require_extra
from varuna.core.planning import PlanRequest
from varuna.core.schedule import DEFAULT_SCHEDULE, chunks_problem, schedule_kind

PROG = "varuna-simulate"

class _UsageError(Exception):
    """Bad command-line input: reported as one line, exit status 2."""


def _config(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", text)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise argparse.ArgumentTypeError(
            f"invalid config {text!r}; write PxD, e.g. 8x4 (8 stages, 4 replicas)"
        )
    return int(match.group(1)), int(match.group(2))


def _gpu_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"invalid GPU list {text!r}; write e.g. 16,32,64")
    return values


def _cluster(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in text.split(","):
        name, _, count = part.partition("=")
        if not name.strip() or not count.strip().isdigit() or name.strip() in out:
            raise argparse.ArgumentTypeError(
                f"invalid cluster {text!r}; write TYPE=COUNT,... with each type once, e.g. fast=2,slow=2"
            )
        out[name.strip()] = int(count)
    return out


def _type_file(text: str) -> tuple[str, str]:
    name, _, path = text.partition("=")
    if not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(
            f"invalid --type-calibration {text!r}; write TYPE=FILE, e.g. slow=slow.json"
        )
    return name.strip(), path.strip()


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG,
        description="Simulate pipeline+data-parallel training from a calibration file and "
        "pick the fastest configuration.",
    )
    p.add_argument("--gpus", type=positive_int, metavar="G", help="GPUs available (not with --cluster)")
    p.add_argument(
        "--cluster",
        type=_cluster,
        metavar="TYPE=N,...",
        help="a cluster of mixed VM types, e.g. fast=2,slow=2 (one accelerator per VM): plan it",
    )
    p.add_argument(
        "--type-calibration",
        type=_type_file,
        action="append",
        default=[],
        metavar="TYPE=FILE",
        help="calibration of one VM type (repeat per type); else the types of --calibration",
    )
    p.add_argument(
        "--pipeline-depths", type=_gpu_list, metavar="P1,P2,...", help="with --cluster: only these P"
    )
    # The auto-config options, shared with varuna-launch (one spelling, one unit: --gpu-memory SIZE).
    add_planning_args(p, title="what to plan (shared with varuna-launch)", require_global_batch=True)
    p.add_argument("--no-recompute", action="store_true", help="gpipe/1f1b/interleaved without recompute")
    p.add_argument(
        "--config", type=_config, metavar="PxD", help="estimate this configuration instead of searching"
    )
    p.add_argument(
        "--procs-per-host",
        type=positive_int,
        default=1,
        metavar="K",
        help="GPUs (worker slots) per host; consecutive ranks fill a host (default 1)",
    )
    add_deprecated_alias(p, "--hosts-slots", "--procs-per-host", dest="procs_per_host", metavar="K",
                         convert=positive_int)
    p.add_argument(
        "--jitter-scale",
        type=float,
        default=0.0,
        metavar="S",
        help="scale of the calibration's network jitter in --config/--trace/--plot runs (default 0)",
    )
    p.add_argument("--seed", type=int, default=0, help="jitter seed")
    p.add_argument(
        "--top", type=positive_int, default=15, metavar="N", help="rows of the ranked table (default 15)"
    )
    p.add_argument(
        "--sweep-gpus",
        type=_gpu_list,
        metavar="G1,G2,...",
        help="also report the best throughput and throughput per GPU at each of these G",
    )
    p.add_argument("--json", action="store_true", help="print JSON: the best config and every candidate")
    p.add_argument(
        "--trace", metavar="OUT.json", help="write the chosen config's timeline as Chrome trace JSON"
    )
    p.add_argument("--plot", metavar="OUT.png", help="write the chosen config's timeline as a Gantt chart")
    p.add_argument("--quiet", action="store_true", help="no progress bars (also: VARUNA_QUIET=1)")
    return add_training_args(p)


def _table(plan: AutoConfigResult, top: int) -> str:
    head = (
        f"{'#':>3} {'P':>4} {'D':>5} {'m':>3} {'Nm':>9} {'GPUs':>5} {'s/minibatch':>12} {'examples/s':>11} "
        f"{'ex/s/GPU':>9} {'mem GiB':>8}  status"
    )
    lines = [head, "-" * len(head)]
    for n, c in enumerate(plan.candidates[:top], 1):
        nm = (
            f"{min(c.num_microbatches)}"
            if min(c.num_microbatches) == max(c.num_microbatches)
            else f"{min(c.num_microbatches)}-{max(c.num_microbatches)}"
        )
        if c.result is not None:
            t, eps, per = (
                f"{c.result.minibatch_s:12.4f}",
                f"{c.result.examples_per_s:11.2f}",
                f"{c.result.examples_per_s / c.num_gpus:9.3f}",
            )
        elif c.status == "pruned":
            t, eps, per = f"{'>=' + format(c.lower_bound_s, '.4f'):>12}", f"{'':>11}", f"{'':>9}"
        else:
            t, eps, per = f"{'-':>12}", f"{'':>11}", f"{'':>9}"
        lines.append(
            f"{n:>3} {c.num_stages:>4} {c.num_replicas:>5} {c.micro_batch_size:>3} {nm:>9} "
            f"{c.num_gpus:>5} {t} {eps} {per} {c.memory_bytes / 2**30:8.2f}  {c.status}"
        )
    if len(plan.candidates) > top:
        lines.append(f"... {len(plan.candidates) - top} more (--top N, or --json for all)")
    return "\n".join(lines)


def _outputs(args, cal: Calibration, cfg: SimConfig) -> SimResult | None:
    if not (args.trace or args.plot):
        return None
    res = simulate(cal, cfg, record=True)
    assert res.timeline is not None
    if args.trace:
        res.timeline.to_chrome_trace(args.trace)
    if args.plot:
        res.timeline.plot_gantt(args.plot, title=f"{cfg.label()}: {res.minibatch_s:.3f} s per mini-batch")
    return res


#: ``--chunks`` when not given: model chunks per device of the interleaved kinds.
SIM_DEFAULT_CHUNKS = 2


def _run(args) -> int:
    args.schedule = args.schedule or DEFAULT_SCHEDULE
    if args.schedule not in SIM_SCHEDULE_KINDS:
        raise _UsageError(
            f"unknown schedule kind {args.schedule!r}; choose one of {', '.join(SIM_SCHEDULE_KINDS)}"
        )
    if args.chunks is not None:  # as varuna-launch refuses it: never silently ignored
        problem = chunks_problem(args.schedule, args.chunks)
        if problem is not None:
            raise _UsageError(problem)
    if args.plot:  # before minutes of search, not after
        require_extra("plot", "--plot")
    if not 0 <= args.jitter_scale <= 1e6:  # also refuses nan and inf
        raise _UsageError(f"--jitter-scale must be a number >= 0 (at most 1e6), got {args.jitter_scale}")
    # One request, checked once (PlanRequest), whatever the mode below does with it.
    gpus = sum(args.cluster.values()) if args.cluster is not None else args.gpus
    request = PlanRequest.from_args(args, gpus=gpus or 1, host_slots=args.procs_per_host,
                                    recompute=not args.no_recompute, chunks=SIM_DEFAULT_CHUNKS)
    if args.cluster is not None:
        return _mixed(args, request)
    missing = [name for name, v in (("--calibration", args.calibration), ("--gpus", args.gpus)) if v is None]
    if missing:
        raise _UsageError(
            f"the following arguments are required: {', '.join(missing)} "
            "(or --cluster TYPE=N,... for mixed VM types)"
        )
    request = dataclasses.replace(request, calibration=Calibration.load(args.calibration))
    out = _estimate(args, request) if args.config is not None else _search(args, request)
    if args.sweep_gpus:
        sweep = _sweep(args, request)
        if args.json:
            out["sweep"] = sweep
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


def _estimate(args, request: PlanRequest) -> dict:
    """``--config PxD``: simulate that configuration; prints it unless ``--json``."""
    P, D = args.config
    if P * D > args.gpus:
        raise _UsageError(
            f"--config {P}x{D} needs {P * D} GPUs but --gpus is {args.gpus}; "
            f"use a smaller config or more GPUs"
        )
    cal = request.load_calibration()
    cfg = SimConfig.for_global_batch(
        global_batch_size=request.global_batch_size,
        num_replicas=D,
        micro_batch_size=request.micro_batch_size or choose_micro_batch_size(cal),
        num_stages=P,
        schedule=request.schedule,
        recompute=request.recompute,
        chunks=schedule_kind(request.schedule).chunks_per_device(request.chunks),
        host_slots=request.host_slots,
        jitter_scale=args.jitter_scale,
        seed=args.seed,
    )
    res = simulate(cal, cfg)
    _outputs(args, cal, cfg)
    if request.gpu_memory_bytes is not None and max(res.stage_memory_bytes) > request.gpu_memory_bytes:
        print(
            f"{PROG}: warning: config {P}x{D} needs {max(res.stage_memory_bytes) / 2**30:.2f} GiB on its "
            f"largest stage, more than --gpu-memory",
            file=sys.stderr,
        )
    train = _training(args, request, cal, res.examples_per_s, P * D)
    if args.json:
        return {"best": res.summary(), "candidates": [res.summary()], "training": train.to_dict()}
    nm = cfg.num_microbatches
    print(f"config {cfg.label()}  Nm per replica {min(nm)}-{max(nm)}")
    print(
        f"  time per mini-batch {res.minibatch_s:.4f} s  ({res.examples_per_s:.2f} examples/s, "
        f"{res.examples_per_s / (P * D):.3f} per GPU)"
    )
    print(f"  {'stage':>5} {'busy s':>9} {'idle s':>9} {'allreduce s':>11} {'stash':>6} {'mem GiB':>8}")
    for k in range(P):
        print(
            f"  {k:>5} {res.stage_busy_s[k]:9.4f} {res.stage_idle_s[k]:9.4f} "
            f"{res.stage_allreduce_s[k]:11.4f} {res.peak_stashed[k]:>6} "
            f"{res.stage_memory_bytes[k] / 2**30:8.2f}"
        )
    print(f"  {train.describe()}")
    return {}


def _search(args, request: PlanRequest) -> dict:
    """Auto-configuration: rank the candidates; prints the ranking unless ``--json``."""
    plan = autoconfigure_request(request, progress=False if args.quiet else None)
    best: Candidate = plan.best
    cfg = best.config
    if args.jitter_scale > 0:
        cfg = dataclasses.replace(cfg, jitter_scale=args.jitter_scale, seed=args.seed)
    cal = request.load_calibration()
    _outputs(args, cal, cfg)
    train = _training(args, request, cal, best.result.examples_per_s, best.num_gpus)
    if args.json:
        return {**plan.to_dict(), "training": train.to_dict()}
    b = best.result
    print(
        f"best: P={best.num_stages} D={best.num_replicas} m={best.micro_batch_size} "
        f"({best.num_gpus} of {args.gpus} GPUs): {b.minibatch_s:.4f} s per mini-batch, "
        f"{b.examples_per_s:.2f} examples/s  [{plan.simulations} simulated of {len(plan.candidates)} "
        f"candidates in {plan.elapsed_s:.2f} s]"
    )
    print(train.describe())
    print(_table(plan, args.top))
    return {}


def _mixed(args, request: PlanRequest) -> int:
    """``--cluster``: plan a cluster of several VM types; prints the plan and why (or JSON)."""
    if args.gpus is not None or args.config is not None or args.sweep_gpus:
        raise _UsageError("--cluster plans the given VMs; leave out --gpus, --config and --sweep-gpus")
    if request.recompute_segments is not None:  # the mixed planner keeps whole stages
        raise _UsageError("--cluster does not plan a given --recompute-segments yet; drop it (the plan "
                          "recomputes whole stages)")
    if args.type_calibration:
        costs = {name: Calibration.load(path) for name, path in args.type_calibration}
    elif args.calibration is not None:
        costs = Calibration.load(args.calibration)
    else:
        raise _UsageError(
            "--cluster needs --calibration FILE (with a 'types' section) or --type-calibration TYPE=FILE"
        )
    memory = request.gpu_memory_bytes
    plan = plan_mixed(
        args.cluster,
        costs,
        global_batch_size=request.global_batch_size,
        micro_batch_size=request.micro_batch_size,
        memory_by_type=None if memory is None else {t: memory for t in args.cluster},
        schedule=request.schedule,
        recompute=request.recompute,
        host_slots=request.host_slots,
        pipeline_depths=args.pipeline_depths,
    )
    train = _training(args, request, None, plan.examples_per_s, sum(plan.vms_used.values()),
                      price_per_hour=_cluster_price(args, costs, plan.vms_used))
    if args.json:
        print(json.dumps({**plan.to_dict(), "training": train.to_dict()}, indent=1))
        return 0
    print(plan.explain())
    print(train.describe())
    env = plan.run_plan().to_env()
    print("run plan: " + " ".join(f"{k}={v}" for k, v in env.items()))
    print(f"[{plan.layouts_considered} layouts estimated, {plan.simulations} simulated]")
    return 0


def _training(args, request: PlanRequest, cal: Calibration | None, examples_per_s: float, devices: int,
              *, price_per_hour: float | None = None) -> TrainingEstimate:
    """``--train-steps/--train-tokens/--price-per-device-hour/--peak-tflops`` applied to a predicted
    rate (``cal`` None: a mixed cluster, no single device peak)."""
    if args.tokens_per_example is not None and args.tokens_per_example < 1:
        raise _UsageError(f"--tokens-per-example must be >= 1, got {args.tokens_per_example}")
    device_price = args.price_per_device_hour
    if isinstance(device_price, dict):
        if cal is not None:
            raise _UsageError("--price-per-device-hour TYPE=PRICE,... is for --cluster; give one number")
        device_price = None
    return estimate_training(
        examples_per_s=examples_per_s, devices=devices, global_batch_size=request.global_batch_size,
        flops_per_example=flops_per_example(cal) if cal is not None else None,
        peak=device_peak_of(cal, args.peak_tflops, args.precision) if cal is not None else None,
        train_steps=args.train_steps, train_tokens=args.train_tokens,
        tokens_per_example=args.tokens_per_example,
        device_price_per_hour=device_price, price_per_hour=price_per_hour,
    )


def _cluster_price(args, costs, vms_used: dict[str, int]) -> float | None:
    """Price per hour of the VMs a mixed plan uses: ``--price-per-device-hour`` (one price, or one per
    type), else the calibration types' ``price_per_hour``; None when a type has no price."""
    given = args.price_per_device_hour
    if isinstance(given, float):
        return given * sum(vms_used.values())
    prices = dict(given or {})
    if not prices and isinstance(costs, Calibration):
        prices = {n: t.price_per_hour for n, t in costs.types.items() if t.price_per_hour is not None}
    missing = sorted(t for t in vms_used if t not in prices)
    if given and missing:
        raise _UsageError(f"--price-per-device-hour has no price for VM type(s) {', '.join(missing)}")
    return None if missing else sum(n * prices[t] for t, n in vms_used.items())


def _sweep(args, request: PlanRequest) -> list[dict]:
    """``--sweep-gpus``: the best configuration at each G; prints a table unless ``--json``."""
    cal = request.load_calibration()
    points = sweep_gpus(
        cal,
        args.sweep_gpus,
        global_batch_size=request.global_batch_size,
        gpu_memory_bytes=request.gpu_memory_bytes,
        schedule=request.schedule,
        recompute=request.recompute,
        chunks=request.chunks,
        micro_batch_size=request.micro_batch_size,
        host_slots=request.host_slots,
        progress=False if args.quiet else None,
    )
    trains = {p.gpus: _training(args, request, cal, p.examples_per_s, p.best.num_gpus)
              for p in points if p.best}
    if not args.json:
        print(f"\n{'G':>6} {'P':>4} {'D':>5} {'examples/s':>11} {'ex/s/GPU':>9} {'TFLOP/s/GPU':>11} "
              f"{'hours':>9} {'cost':>10}")
        for p in points:
            if p.best is None:
                print(f"{p.gpus:>6}    -     - {'':>11} {'':>9}  {p.error}")
            else:
                t = trains[p.gpus]
                print(
                    f"{p.gpus:>6} {p.best.num_stages:>4} {p.best.num_replicas:>5} "
                    f"{p.examples_per_s:11.2f} {p.examples_per_s_per_gpu:9.3f} "
                    + " ".join(f"{'-' if v is None else format(v, f):>{w}}" for v, f, w in (
                        (t.tflops_per_device, ".3g", 11), (t.hours, ",.2f", 9), (t.cost, ",.2f", 10)))
                )
    return [
        {
            "gpus": p.gpus,
            "examples_per_s": p.examples_per_s,
            "examples_per_s_per_gpu": p.examples_per_s_per_gpu,
            "best": p.best.summary() if p.best else None,
            "training": trains[p.gpus].to_dict() if p.best else None,
            "error": p.error,
        }
        for p in points
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``varuna-simulate`` console script; returns the exit status.

    Example (``main(["--gpus", "4"])`` prints one line to stderr and returns 2)::

        varuna-simulate: error: the following arguments are required: --calibration, ...
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return _run(args)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except BrokenPipeError:
        # The reader went away (``| head``): not an input error. Point stdout at /dev/null so the
        # interpreter's final flush does not complain again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (_UsageError, ValueError, OSError, MissingExtra) as e:
        # Library errors are written to be shown as they are: one line with the fix.
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
