"""``varuna-manager``: run the manager daemon, submit jobs, watch and cancel them.

::

    varuna-manager serve  --db STATE.sqlite --listen 127.0.0.1:7878 --token-file TOKEN
                          [--tls-cert CERT --tls-key KEY] [--dashboard 127.0.0.1:8787]
    varuna-manager submit JOBSPEC.toml|json      # prints the job id
    varuna-manager status [JOB] [--json]         # P×D, calibration, VMs and their health, throughput
    varuna-manager events [JOB] [--json]         # the job's history, with morph latencies
    varuna-manager cancel JOB
    varuna-manager wait JOB [--until running|done] [--wait-timeout S] [--quiet]

Client commands find the manager with ``--manager`` (default ``$VARUNA_MANAGER``, else
``127.0.0.1:7878``) and the token with ``--token-file`` (default ``$VARUNA_MANAGER_TOKEN_FILE``).
Exit codes: 0 ok; 1 the manager is unreachable, refused the token, or failed; 2 bad input (one
line on stderr: an unreadable job spec, an unknown job, a bad option). ``wait`` exits 1 when the
job failed or was cancelled, or did not get there within ``--wait-timeout``; on a terminal it shows
the job's steps as a progress bar (``--quiet`` or ``VARUNA_QUIET=1``: none).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from manager.common.wire import load_token
from manager.domain.jobspec import JobSpec, load_jobspec
from manager.transport.client import ClientConfig, ManagerClient
from manager.transport.convert import spec_to_pb
from varuna.core.cli import OneLineParser
from varuna.core.progress import Progress

__all__ = ["main"]

PROG = "varuna-manager"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_ADDRESS = "127.0.0.1:7878"


class _UsageError(Exception):
    """Bad input: exit 2 with this one line."""


class _Failure(Exception):
    """The manager could not be reached or failed: exit 1 with this one line."""


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value

    return parse


def _build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=PROG,
        description="The varuna job manager: morphs P×D jobs across spot VMs.",
        epilog="Exit codes: 0 ok, 1 manager unreachable/refused/failed, 2 bad input.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    _add_serve_parser(sub)
    _add_client_parsers(sub)
    return parser


def _add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the manager daemon")
    serve.add_argument(
        "--db", required=True, metavar="STATE.sqlite", help="state file (created when missing)"
    )
    serve.add_argument("--listen", default=DEFAULT_ADDRESS, metavar="HOST:PORT", help="address to bind")
    serve.add_argument(
        "--token-file", required=True, help="file holding the bearer token every RPC must carry"
    )
    serve.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS")
    serve.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    serve.add_argument("--tls-ca", default=None, help="CA agents verify us with (default: --tls-cert)")
    serve.add_argument("--advertise", default=None, metavar="HOST:PORT", help="address agents/workers dial")
    serve.add_argument("--state-dir", default=None, help="pretend-VM directories (default: DB.d)")
    _add_dashboard_options(serve)
    serve.add_argument("--pool", metavar="POOL.toml", help="VM types shared by --pool jobs (docs/pool.md)")
    _add_tuning_options(serve)


def _add_dashboard_options(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--dashboard",
        default=None,
        metavar="HOST:PORT",
        help="also serve the read-only web dashboard here (needs varuna[dashboard]; the same token)",
    )
    serve.add_argument(
        "--dashboard-timeout",
        type=_positive(float),
        default=10.0,
        metavar="S",
        help="close a dashboard connection whose request takes longer, or idle that long (default 10)",
    )
    serve.add_argument(
        "--dashboard-max-connections",
        type=_positive(int),
        default=256,
        metavar="N",
        help="dashboard connections held at once (default 256; fewer under a low descriptor limit)",
    )


def _add_tuning_options(serve: argparse.ArgumentParser) -> None:
    tune = serve.add_argument_group("supervision")
    tune.add_argument("--heartbeat-interval", type=_positive(float), default=2.0, metavar="S")
    tune.add_argument(
        "--heartbeat-timeout",
        type=_positive(float),
        default=15.0,
        metavar="T",
        help="a VM silent this long is gone (default 15)",
    )
    tune.add_argument(
        "--silence-probe-after",
        type=float,
        default=None,
        metavar="S",
        help="probe a VM quiet this long; gone at once when its host does not answer"
        " (default 1.5 heartbeat intervals; 0: never, only T)",
    )
    tune.add_argument(
        "--probe-timeout",
        type=_positive(float),
        default=1.0,
        metavar="P",
        help="how long a probe waits for a VM's host to answer (default 1)",
    )
    tune.add_argument(
        "--stop-timeout",
        type=_positive(float),
        default=60.0,
        metavar="S",
        help="graceful stop (checkpoint) before SIGKILL (default 60)",
    )
    tune.add_argument("--kill-timeout", type=_positive(float), default=15.0, metavar="S")
    tune.add_argument(
        "--gather-timeout",
        type=_positive(float),
        default=120.0,
        metavar="S",
        help="first launch waits this long for max_vms (default 120)",
    )
    tune.add_argument("--register-timeout", type=_positive(float), default=600.0, metavar="S")
    tune.add_argument("--create-retry", type=_positive(float), default=30.0, metavar="S")
    tune.add_argument(
        "--orphan-timeout",
        type=_positive(float),
        default=300.0,
        metavar="S",
        help="agents give up on a silent manager after this long (default 300)",
    )
    tune.add_argument("--max-failed-launches", type=_positive(int), default=5, metavar="N")
    tune.add_argument(
        "--slow-threshold-pct",
        type=_positive(float),
        default=50.0,
        metavar="X",
        help="fail-stutter: compute time X %% above the reference ... (default 50)",
    )
    tune.add_argument(
        "--slow-heartbeats",
        type=_positive(int),
        default=5,
        metavar="N",
        help="... for N heartbeats in a row (default 5)",
    )
    tune.add_argument(
        "--grow-min-gain-pct",
        type=_positive(float),
        default=10.0,
        metavar="PCT",
        help="morph onto new VMs when the simulator predicts at least this gain (default 10)",
    )
    tune.add_argument("--grow-cooldown", type=_positive(float), default=60.0, metavar="S")


def _client_options(p: argparse.ArgumentParser) -> None:
    """Where the manager is and how to authenticate (every command but ``serve``)."""
    p.add_argument(
        "--manager",
        default=os.environ.get("VARUNA_MANAGER") or DEFAULT_ADDRESS,
        metavar="HOST:PORT",
        help="manager address (default $VARUNA_MANAGER or 127.0.0.1:7878)",
    )
    p.add_argument(
        "--token-file",
        default=os.environ.get("VARUNA_MANAGER_TOKEN_FILE"),
        help="bearer token file (default $VARUNA_MANAGER_TOKEN_FILE)",
    )
    p.add_argument(
        "--tls-ca",
        default=os.environ.get("VARUNA_MANAGER_TLS_CA"),
        help="verify the manager's TLS certificate with this CA (implies TLS)",
    )
    p.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    p.add_argument("--timeout", type=_positive(float), default=10.0, metavar="S", help="RPC deadline")


def _add_client_parsers(sub: Any) -> None:
    submit = sub.add_parser("submit", help="submit a job spec (JSON or TOML); prints the job id")
    submit.add_argument("jobspec", metavar="JOBSPEC")
    submit.add_argument(
        "--pool", action="store_true", help="run on the manager's shared pool (as 'pool = true' in the spec)"
    )
    submit.add_argument("--weight", type=_positive(float), default=None, help="priority in the pool")
    _client_options(submit)

    status = sub.add_parser("status", help="job state, P×D, VMs with health, throughput history")
    status.add_argument("job", nargs="?", default="", metavar="JOB")
    status.add_argument("--history", type=_positive(int), default=10, metavar="N", help="throughput points")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    _client_options(status)

    events = sub.add_parser("events", help="a job's events, with morph latencies")
    events.add_argument("job", nargs="?", default="", metavar="JOB")
    events.add_argument("--after", type=int, default=0, metavar="ID", help="only events after this id")
    events.add_argument("--kind", action="append", default=None, help="only events of this kind (repeatable)")
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    _client_options(events)

    cancel = sub.add_parser("cancel", help="checkpoint, stop and delete a job's VMs")
    cancel.add_argument("job", metavar="JOB")
    _client_options(cancel)

    wait = sub.add_parser("wait", help="wait until a job runs or ends, with a progress bar of its steps")
    wait.add_argument("job", metavar="JOB")
    wait.add_argument(
        "--until", choices=("running", "done"), default="done", help="running, or done (finished; default)"
    )
    wait.add_argument(
        "--wait-timeout", type=_positive(float), default=3600.0, metavar="S", help="give up after S s"
    )
    wait.add_argument("--poll", type=_positive(float), default=1.0, metavar="S", help="status poll interval")
    wait.add_argument("--quiet", action="store_true", help="no progress bar (also: VARUNA_QUIET=1)")
    _client_options(wait)


# ----------------------------------------------------------------------------------------------
# serve


def _serve(args: argparse.Namespace) -> int:
    from manager.common.descriptors import raise_soft_limit
    from manager.transport.server import ManagerServer, ServeConfig

    # A daemon that serves many clients: the soft descriptor limit (often 1,024) up to the hard
    # one, before anything opens a descriptor (Note [Dashboard limits] in manager/dashboard/web.py).
    raise_soft_limit()
    if args.heartbeat_timeout <= args.heartbeat_interval:
        raise _UsageError("--heartbeat-timeout must exceed --heartbeat-interval (a few intervals)")
    if args.silence_probe_after is not None and not 0 <= args.silence_probe_after < args.heartbeat_timeout:
        raise _UsageError("--silence-probe-after must be 0 (off) or between 0 and --heartbeat-timeout"
                          f" ({args.heartbeat_timeout:g}); got {args.silence_probe_after:g}")
    pool = None
    if args.pool:
        from manager.domain.pool_config import load_pool_config

        try:
            pool = load_pool_config(args.pool)
        except ValueError as exc:
            raise _UsageError(str(exc).splitlines()[0]) from None
    try:
        server = ManagerServer(
            ServeConfig(
                db=args.db,
                listen=args.listen,
                token_file=args.token_file,
                tls_cert=args.tls_cert,
                tls_key=args.tls_key,
                tls_ca=args.tls_ca,
                advertise=args.advertise,
                state_dir=args.state_dir,
                dashboard=args.dashboard,
                dashboard_timeout_s=args.dashboard_timeout,
                dashboard_max_connections=args.dashboard_max_connections,
                manager=_tuning(args),
                pool=pool,
            )
        )
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    except OSError as exc:  # another manager holds the state file, or it cannot be written
        raise _Failure(str(exc)) from None
    return _run_server(server, args)


def _tuning(args: argparse.Namespace) -> dict[str, Any]:
    """``ManagerConfig`` overrides from the supervision options."""
    from manager.domain.policy import StutterConfig

    return {
        "heartbeat_interval_s": args.heartbeat_interval,
        "heartbeat_timeout_s": args.heartbeat_timeout,
        # Note [Silence probes] in manager/domain/silence.py: one beat late (default).
        "silence_probe_after_s": (1.5 * args.heartbeat_interval if args.silence_probe_after is None
                                  else args.silence_probe_after),
        "probe_timeout_s": args.probe_timeout,
        "stop_timeout_s": args.stop_timeout,
        "kill_timeout_s": args.kill_timeout,
        "gather_timeout_s": args.gather_timeout,
        "register_timeout_s": args.register_timeout,
        "create_retry_s": args.create_retry,
        "orphan_timeout_s": args.orphan_timeout,
        "max_failed_launches": args.max_failed_launches,
        "grow_min_gain_pct": args.grow_min_gain_pct,
        "grow_cooldown_s": args.grow_cooldown,
        "stutter": StutterConfig(threshold_pct=args.slow_threshold_pct, heartbeats=args.slow_heartbeats),
    }


def _run_server(server: Any, args: argparse.Namespace) -> int:
    """Start ``server`` (a ManagerServer), say where it listens, serve until SIGTERM/SIGINT or
    until the manager stops by itself (its state file replaced: exit 1 with that line)."""
    from manager.transport.server import insecure_listen_warning

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except OSError as exc:
        raise _Failure(str(exc)) from None
    except ValueError as exc:  # e.g. the pool config stored in the state file no longer validates
        raise _UsageError(str(exc).splitlines()[0]) from None
    assert server.manager is not None
    warning = insecure_listen_warning(args.listen.rpartition(":")[0], tls=bool(args.tls_cert))
    if warning is not None:
        print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    print(
        f"{PROG}: listening on {server.address} (agents dial {server.manager.config.advertise_address}); "
        f"state in {args.db}",
        flush=True,
    )
    if server.dashboard is not None:
        warning = insecure_listen_warning(server.dashboard.host, tls=bool(args.tls_cert))
        if warning is not None:
            print(f"{PROG}: warning: dashboard {warning}", file=sys.stderr, flush=True)
        url = server.dashboard.url
        print(f"{PROG}: dashboard on {url} (open {url}?token=TOKEN once)", flush=True)
    try:
        while not stop.wait(1.0) and server.failure is None:
            pass
    finally:
        print(
            f"{PROG}: stopping (VMs and workers keep running; restart with the same --db to resume)",
            flush=True,
        )
        server.stop()
    if server.failure is not None:
        raise _Failure(server.failure)
    return EXIT_OK


# ----------------------------------------------------------------------------------------------
# client commands


def _client(args: argparse.Namespace) -> ManagerClient:
    if not args.token_file:
        raise _UsageError("no token: pass --token-file or set VARUNA_MANAGER_TOKEN_FILE")
    try:
        token = load_token(args.token_file)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    try:
        return ManagerClient(
            ClientConfig(
                address=args.manager, token=token, tls_ca=args.tls_ca, tls=args.tls, timeout_s=args.timeout
            )
        )
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def _rpc_error(exc: grpc.RpcError, address: str) -> Exception:
    code, details = exc.code(), (exc.details() or "").splitlines()[0] if exc.details() else ""
    if code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
    ):
        return _UsageError(details or code.name)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return _Failure(f"the manager at {address} refused the token: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return _Failure(f"cannot reach the manager at {address} ({code.name.lower()}): {details}")
    return _Failure(f"the manager failed ({code.name}): {details}")


def _submit(args: argparse.Namespace) -> int:
    try:
        spec = load_jobspec(args.jobspec)
        if args.pool or args.weight is not None:
            weight = args.weight if args.weight is not None else spec.weight
            spec = dataclasses.replace(spec, pool=spec.pool or args.pool, weight=weight)
        calibration_json = ""
        if spec.calibration:
            from varuna.core.calibration import Calibration

            try:
                calibration_json = Path(spec.calibration).read_text(encoding="utf-8")
            except OSError as exc:
                raise ValueError(f"cannot read calibration {spec.calibration}: {exc.strerror}") from None
            try:
                Calibration.from_dict(json.loads(calibration_json), source=spec.calibration)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{spec.calibration}: not valid JSON: {exc.msg}") from None
        if spec.provider == "local" and not spec.module and not Path(spec.script).is_file():
            raise ValueError(f"script {spec.script} does not exist")
        if spec.profile:
            _check_profile(spec)
    except ValueError as exc:
        raise _UsageError(str(exc).splitlines()[0]) from None
    with _client(args) as client:
        try:
            job_id = client.submit(spec_to_pb(spec, calibration_json))
        except grpc.RpcError as exc:
            raise _rpc_error(exc, args.manager) from None
    print(job_id)
    return EXIT_OK


def _check_profile(spec: JobSpec) -> None:
    """Refuse a ``[profile]`` that ``varuna-profile`` would refuse (its flags), before the job waits
    for a VM to find out. Needs the profiler here (it imports torch); skipped where it is missing."""
    profile = spec.profile_spec
    assert profile is not None
    where = profile.model.rpartition(":")[0]
    if spec.provider == "local" and where.endswith(".py") and not Path(where).is_file():
        raise ValueError(f"profile.model: file {where} does not exist")
    try:
        from profiler.cli import build_parser
    except ImportError:
        return
    argv = [*profile.profiler_args(job_micro_batch_size=spec.micro_batch_size), "--out", "calibration.json"]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(argv)
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        detail = lines[-1].removeprefix("varuna-profile: error: ") if lines else "rejected"
        raise ValueError(f"profile: varuna-profile refuses these arguments: {detail}") from None


def _status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            jobs = client.status(args.job, history=args.history)
        except grpc.RpcError as exc:
            raise _rpc_error(exc, args.manager) from None
    if args.json:
        print(json.dumps([MessageToDict(j, preserving_proto_field_name=True) for j in jobs], indent=1))
        return EXIT_OK
    if not jobs:
        print("no jobs")
    for job in jobs:
        print(_format_status(job))
    return EXIT_OK


def _format_pool_share(p: Any) -> str:
    """A pool job's share (docs/pool.md): placement, allocation, predicted and measured rates."""
    where = f"{p.vm_count} × {p.vm_type}" if p.vm_type else "no VMs this round"
    measured = f"{p.measured_samples_per_s:.1f}" if p.measured_samples_per_s else "not yet"
    return (
        f"  pool        {where} (round {p.round}, {p.policy}, weight {p.weight:g}); allocation "
        f"{p.allocation or 'none'}; examples/s predicted {p.predicted_samples_per_s:.1f}, measured {measured}"
    )


def _format_status(job: Any) -> str:
    lines = [f"job {job.job_id}  {job.name}  [{job.state}]  step {job.step}/{job.target_steps}"]
    if job.generation:
        lines.append(
            f"  config      P={job.pipeline_depth} × D={job.data_parallel}"
            f"{f'  m={job.micro_batch_size}' if job.micro_batch_size else ''}"
            f"  generation {job.generation} ({job.generation_state})"
        )
    if job.message:
        lines.append(f"  message     {job.message}")
    if job.calibration:
        lines.append(f"  calibration {job.calibration}")
    if job.HasField("pool"):
        lines.append(_format_pool_share(job.pool))
    lines.append(f"  provider    {job.provider}; checkpoints in {job.checkpoint_dir}")
    active = [vm for vm in job.vms if vm.state != "deleted"]
    lines.append(
        f"  VMs         {len(active)} ({sum(vm.in_generation for vm in active)} in the generation"
        f"{f', {len(job.vms) - len(active)} deleted' if len(job.vms) > len(active) else ''})"
    )
    if active:
        width = max(len(vm.vm_id) for vm in active)
        lines.append(f"    {'VM':<{width}}  state      health      heartbeat  used  workers / detail")
        for vm in active:
            age = f"{vm.heartbeat_age_s:.1f}s ago" if vm.heartbeat_age_s >= 0 else "never"
            workers = "  ".join(
                f"r{w.rank}(s{w.stage}) step {w.step} F {w.fwd_s * 1e3:.1f}ms B {w.bwd_s * 1e3:.1f}ms"
                + ("" if w.running else f" exit {w.exit_code}")
                for w in vm.workers
            )
            detail = "; ".join(x for x in (workers, vm.detail) if x)
            lines.append(
                f"    {vm.vm_id:<{width}}  {vm.state:<9}  {vm.health:<10}  {age:>9}  "
                f"{'yes' if vm.in_generation else '-':<4}  {detail}"
            )
    if job.throughput:
        lines.append(f"  throughput  (last {len(job.throughput)} steps)")
        lines.append("    step   gen   P×D    samples/s      loss")
        for p in job.throughput:
            lines.append(
                f"    {p.step:>4}  {p.generation:>4}   {p.pipeline_depth}×{p.data_parallel:<3}  "
                f"{p.samples_per_s:>9.1f}  {p.loss:>8.4f}"
            )
    return "\n".join(lines)


def _events(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            events = client.events(args.job, after_id=args.after)
        except grpc.RpcError as exc:
            raise _rpc_error(exc, args.manager) from None
    if args.kind:
        events = [e for e in events if e.kind in args.kind]
    if args.json:
        for e in events:
            row = MessageToDict(e, preserving_proto_field_name=True)
            row["data"] = json.loads(row.pop("data_json", "{}") or "{}")
            print(json.dumps(row, sort_keys=True))
        return EXIT_OK
    for e in events:
        stamp = time.strftime("%H:%M:%S", time.localtime(e.time)) + f".{int(e.time * 1000) % 1000:03d}"
        gen = f"g{e.generation}" if e.generation else "-"
        who = f" {e.vm_id}" if e.vm_id else ""
        job = f"{e.job_id} " if not args.job else ""
        print(f"{stamp} {job}{gen:>4} {e.kind:<17}{who} {e.message}")
    latencies = [
        json.loads(e.data_json or "{}").get("morph_latency_s") for e in events if e.kind == "resumed"
    ]
    latencies = [x for x in latencies if x is not None]
    if latencies:
        listed = ", ".join(f"{x:.1f}" for x in latencies)
        print(
            f"morph latency (detection → training resumed): {len(latencies)} morph(s): {listed} s; "
            f"mean {sum(latencies) / len(latencies):.1f} s, max {max(latencies):.1f} s"
        )
    return EXIT_OK


def _cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            state = client.cancel(args.job)
        except grpc.RpcError as exc:
            raise _rpc_error(exc, args.manager) from None
    print(f"{args.job}: {state}")
    return EXIT_OK


#: States in which ``wait --until X`` is satisfied; a job in an END state never gets further.
_REACHED = {"running": ("running", "finished"), "done": ("finished",)}
_END = ("finished", "cancelled", "failed")


def _wait(args: argparse.Namespace) -> int:
    """Poll the job's status until it reaches ``--until`` (exit 0), ends without reaching it, or
    ``--wait-timeout`` passes (exit 1, one line)."""
    deadline = time.monotonic() + args.wait_timeout
    bar = Progress(args.job, unit="step", enabled=False if args.quiet else None)
    with _client(args) as client, bar:
        while True:
            try:
                job = client.status(args.job, history=0)[0]
            except grpc.RpcError as exc:
                raise _rpc_error(exc, args.manager) from None
            bar.set_total(job.target_steps or None)
            bar.update(job.step - bar.n)
            bar.set_description(f"{job.job_id} [{job.state}]")
            if job.generation:
                bar.set_postfix(f"P={job.pipeline_depth}×D={job.data_parallel} generation {job.generation}")
            if job.state in _REACHED[args.until]:
                return EXIT_OK
            if job.state in _END:
                raise _Failure(f"job {job.job_id} ended {job.state}: {job.message or 'no message'}")
            if time.monotonic() >= deadline:
                raise _Failure(
                    f"job {job.job_id} is still {job.state} after {args.wait_timeout:g} s; "
                    f"raise --wait-timeout to wait longer"
                )
            time.sleep(min(args.poll, max(0.0, deadline - time.monotonic())))


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit code."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        print(
            f"{PROG}: error: a command is required: serve, submit, status, events, cancel or wait "
            f"(see {PROG} --help)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    handlers = {"serve": _serve, "submit": _submit, "status": _status, "events": _events, "cancel": _cancel}
    handlers["wait"] = _wait
    try:
        return handlers[args.command](args)
    except BrokenPipeError:  # `varuna-manager events | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except _UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except _Failure as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
