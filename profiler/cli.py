"""``varuna-profile``: calibrate a model annotated with CutPoints into a calibration file.

    varuna-profile --model examples/gpt2/profile_target.py:build --micro-batch-sizes 1,2,4 --out calib.json
    varuna-profile --model examples/gpt2/profile_target.py:build --micro-batch-sizes 8 --update calib.json
    varuna-profile --model profiler.targets:emulated --model-arg fwd_s=0.02 --micro-batch-sizes 1,2 \\
        --inter-netem latency=5ms,bandwidth=1Gbit/s --hosts 3 --out emulated.json

Exit codes: 0 done; 1 a measurement failed (a worker's error is printed); 2 bad input (one line).
See docs/profiling.md.
"""

from __future__ import annotations

import argparse
import sys
import time

from profiler.hosts import HostEmulationError, RemoteHost
from profiler.runner import ProfileOptions, calibrate
from profiler.spec import parse_micro_batch_sizes, parse_model_args
from varuna.core.cli import OneLineParser

__all__ = ["main", "build_parser"]




def build_parser() -> argparse.ArgumentParser:
    d = ProfileOptions()
    p = OneLineParser(
        prog="varuna-profile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="SPEC",
        help="module_or_file:factory; the factory returns (model, make_batch[, loss_fn])",
    )
    p.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the factory (VALUE parsed as JSON when possible); repeatable",
    )
    p.add_argument(
        "--micro-batch-sizes", required=True, metavar="M1,M2,...", help="micro-batch sizes to measure"
    )
    dest = p.add_mutually_exclusive_group(required=True)
    dest.add_argument("--out", metavar="FILE", help="write a new calibration file")
    dest.add_argument(
        "--update",
        metavar="FILE",
        help="add the m values / ring sizes FILE lacks, keeping everything else in it",
    )
    p.add_argument(
        "--procs", type=int, default=d.procs, help="processes measuring segments in parallel (default 2)"
    )
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per process (default 1)")
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--hosts", type=int, default=d.hosts, help="emulated hosts: ring sizes 2..HOSTS (default 2)"
    )
    p.add_argument(
        "--procs-per-host",
        type=int,
        default=d.procs_per_host,
        help="processes per emulated host: intra link and concurrent all-reduces (default 2)",
    )
    p.add_argument(
        "--host-emulation",
        default=d.host_emulation,
        choices=["auto", "netns", "loopback"],
        help="auto: network namespaces when root, else loopback",
    )
    _add_host_list(p)
    p.add_argument(
        "--inter-netem",
        default=d.inter_netem,
        metavar="STRING",
        help=f"network between hosts, varuna.testing.netem syntax (default {d.inter_netem}); 'none': real",
    )
    p.add_argument(
        "--intra-netem", default=None, metavar="STRING", help="network inside a host (default: real)"
    )
    p.add_argument(
        "--reps", type=int, default=d.reps, help="measured repetitions per segment and m (at least)"
    )
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--link-reps", type=int, default=d.link_reps)
    p.add_argument("--allreduce-reps", type=int, default=d.allreduce_reps)
    p.add_argument("--optimizer", default=d.optimizer, choices=["adam", "sgd", "none"])
    p.add_argument(
        "--runtime-overheads", action=argparse.BooleanOptionalAction, default=None,
        help="measure the engine's own per-task / per-step costs in the workers (runtime_overheads;"
        " default: on with --host-list, off on emulated hosts)",
    )
    p.add_argument("--overhead-steps", type=int, default=d.overhead_steps,
                   help="timed steps per calibration run of --runtime-overheads "
                   f"(default {d.overhead_steps})")
    p.add_argument(
        "--timeout", type=float, default=d.timeout_s, help="seconds before a stuck worker is stopped"
    )
    p.add_argument("--quiet", action="store_true")
    return p


def _add_host_list(p: argparse.ArgumentParser) -> None:
    """``--host-list`` and its ssh options (Note [Calibrating real links] in profiler/hosts.py)."""
    p.add_argument(
        "--host-list",
        default=None,
        metavar="HOSTS",
        help="the job's hosts, [user@]host[:port] comma-separated, rank 0's first: measure their real"
        " links over ssh (--procs-per-host workers on each, --hosts and --inter-netem do not apply; the"
        " run directory, under TMPDIR, must be shared by the hosts at the same path)",
    )
    p.add_argument("--ssh-key", default=None, metavar="FILE", help="private key for --host-list (ssh -i)")
    p.add_argument(
        "--ssh-known-hosts", default=None, metavar="FILE",
        help="known_hosts file for --host-list (new host keys are recorded there)",
    )


def _process_start() -> float:
    """``time.perf_counter()`` at this process's start (Linux), so the reported wall time includes the
    interpreter start and the torch import; now where /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        import os

        return time.perf_counter() - max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    t0 = _process_start()
    args = build_parser().parse_args(argv)
    netem = None if str(args.inter_netem).lower() in ("", "none") else args.inter_netem
    try:
        ms = parse_micro_batch_sizes(args.micro_batch_sizes)
        remote = [
            RemoteHost.parse(h, key_file=args.ssh_key, known_hosts_file=args.ssh_known_hosts)
            for h in (args.host_list.split(",") if args.host_list else [])
        ]
        opts = ProfileOptions(
            procs=args.procs,
            threads=args.threads,
            device=args.device,
            hosts=args.hosts,
            procs_per_host=args.procs_per_host,
            host_emulation=args.host_emulation,
            inter_netem=netem,
            intra_netem=args.intra_netem or None,
            reps=args.reps,
            warmup=args.warmup,
            link_reps=args.link_reps,
            allreduce_reps=args.allreduce_reps,
            optimizer=args.optimizer,
            timeout_s=args.timeout,
            verbose=not args.quiet,
            clock_start=t0,
            remote_hosts=remote,
            runtime_overheads=args.runtime_overheads,
            overhead_steps=args.overhead_steps,
        )
        calibrate(
            args.model,
            ms,
            out=args.out,
            update=args.update,
            model_kwargs=parse_model_args(args.model_arg),
            options=opts,
        )
    except ValueError as e:
        print(f"varuna-profile: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    except (RuntimeError, HostEmulationError) as e:
        print(f"varuna-profile: failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
