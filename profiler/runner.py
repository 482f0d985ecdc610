"""The calibration run behind ``profiler.calibrate(...)`` and ``varuna-profile``: measure, fit, write.

What happens (see ``docs/profiling.md``):

1. In this process: build the model from its spec (bad input fails here, with one line), emulate
   ``hosts`` hosts with ``procs_per_host`` processes each (:mod:`profiler.hosts`) and start
   ``max(procs, hosts·procs_per_host)`` worker processes (:mod:`profiler.worker`; rank r lives on
   host ``r // procs_per_host``). While they import torch, dry-run the model at every new
   micro-batch size (:func:`profiler.compute.dry_run`: cut-points, activation shapes, a rough
   time per segment), then hand them the plan. Phases, one at a time:
   - compute: ``procs`` ranks measure disjoint sets of segments in parallel (balanced by the dry
     run's times); they also report each segment's gradient bytes;
   - links: ranks (0, 1) (same host) and (0, procs_per_host) (two hosts) send every cut-point's
     activation and gradient at every m, plus a sweep of sizes for the latency/bandwidth fit;
   - all-reduce: for every ring size D in 2..hosts and k in {1, procs_per_host}, k rings of D
     ranks (one per host) all-reduce each segment's gradient bytes (and a sweep) concurrently.
3. Here again: statistics, least-squares fits (links: latency + bytes/bandwidth; all-reduce:
   Note [All-reduce model] of :mod:`varuna.core.calibration`; F/B/R: a + b·m per segment), their
   errors on the measured points, and the file.

``update=FILE`` measures only what FILE lacks (new m values: compute and sends; new ring sizes /
concurrencies: all-reduce) and merges; the rest of FILE is kept as it was.

Example::

    cal = calibrate("examples/gpt2/profile_target.py:build", [1, 2, 4], out="calib.json")
    cal.fwd_s(0, 4), cal.p2p_s(cal.act_bytes(0, 4), intra=False), cal.allreduce_s(1 << 20, 4, 2)
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profiler.assembly import CalibrationState, add_compute, assemble, state_from_file
from profiler.compute import SegmentMeasurement, dry_run
from profiler.hosts import HostSet, RemoteHost, open_hosts
from profiler.network import MessageSpec, allreduce_times, link_stats, mean_std, payload_bytes
from profiler.overhead_phase import PHASE, overheads_plan, reduce_overheads, wants_overheads
from profiler.overheads import RuntimeConstants
from profiler.phase_progress import PhaseProgress
from profiler.spec import load_target, parse_micro_batch_sizes
from varuna.core.calibration import (
    AllReducePoint,
    Calibration,
    HostInfo,
    LinkPoint,
    RuntimeOverheads,
    SendStat,
    SharedParams,
)
from varuna.core.process import PARENT_PID_VAR
from varuna.cutting.cutpoint import CutPoint

__all__ = ["ProfileOptions", "calibrate", "measure_allreduce", "EXTRA_KEY"]

#: Top-level key of the calibration file holding the profiler's diagnostics (fit errors, peak
#: memory, settings, history): ``Calibration.profiler``, an opaque object the schema keeps through
#: load and save; the profiler reads it back on --update.
EXTRA_KEY = "profiler"

_DEFAULT_INTER = "latency=1ms,bandwidth=1Gbit/s"


@dataclass(kw_only=True)
class ProfileOptions:
    """Settings of one calibration run (the CLI flags, one to one)."""

    procs: int = 2
    """Processes measuring segments in parallel (each takes a subset; use one per core/accelerator)."""
    threads: int = 1
    """torch intra-op threads per process."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    hosts: int = 2
    """Emulated hosts; all-reduce ring sizes 2..hosts are measured."""
    procs_per_host: int = 2
    """Processes per emulated host: the intra-host link and k concurrent all-reduces per host."""
    host_emulation: str = "auto"
    """auto, netns or loopback (see profiler.hosts)."""
    inter_netem: str | None = _DEFAULT_INTER
    """The emulated network between hosts (varuna.testing.netem string); None: none (real links only)."""
    intra_netem: str | None = None
    """Emulated network inside a host; None: the real loopback."""
    warmup: int = 2
    """Unrecorded repetitions per (segment, m) before the measured ones."""
    reps: int = 7
    """Measured repetitions per (segment, m) at least ..."""
    min_time_s: float = 0.05
    """... and more, up to 50, until they take this long (cheap segments get more samples)."""
    link_reps: int = 8
    """Measured rounds per message size and direction (after 2 warm-up rounds); a round sends each
    message twice and times the second (Note [Steady-state sends] in profiler/network.py)."""
    link_pings: int = 5
    """Ping-pongs that relate the two clocks of a link."""
    link_sweep_bytes: tuple[int, ...] = (1 << 10, 64 << 10, 1 << 20, 4 << 20)
    """Extra message sizes for the latency/bandwidth fit (a single float32 tensor each)."""
    allreduce_reps: int = 5
    """Measured rounds per (size, ring size, concurrency), after one warm-up round."""
    allreduce_sweep_bytes: tuple[int, ...] = (256 << 10, 1 << 20, 4 << 20)
    """Buffer sizes all-reduced besides the segments' gradients (spread for the fit)."""
    optimizer: str = "adam"
    """adam (two moments per parameter, as the paper), sgd (momentum) or none."""
    timeout_s: float = 300.0
    """Every wait on another process gives up after this long."""
    verbose: bool = True
    """Print progress, the results and the wall time."""
    clock_start: float | None = None
    """``time.perf_counter()`` where the reported wall time starts (default: the call of calibrate)."""
    remote_hosts: list[RemoteHost] = field(default_factory=list)
    """The job's hosts (``--host-list``): measure their real links over ssh instead of emulating
    ``hosts`` (Note [Calibrating real links] in profiler/hosts.py)."""
    runtime_overheads: bool | None = None
    """Measure the engine's own per-task / per-step costs in the workers (the file's
    ``runtime_overheads``; Note [Overheads on the hosts] in profiler/overhead_phase.py). None: on
    exactly with ``remote_hosts``."""
    overhead_steps: int = 3
    """Timed steps per calibration run of that phase (after one warm-up step)."""
    overhead_probe_messages: int = 40
    """Hand-off probe messages per direction in that phase."""

    def validate(self) -> None:
        if self.procs < 1 or self.threads < 1:
            raise ValueError("--procs and --threads must be >= 1")
        if self.remote_hosts:
            self.hosts = len(self.remote_hosts)
            self.inter_netem = None  # real links: nothing emulated between the hosts
        if self.hosts < 2:
            raise ValueError("--hosts must be >= 2 to measure links between hosts and all-reduces")
        if self.procs_per_host < 2:
            raise ValueError("--procs-per-host must be >= 2 to measure the intra-host link")
        if self.overhead_steps < 1 or self.overhead_probe_messages < 4:
            raise ValueError("--overhead-steps must be >= 1 (and the hand-off probe messages >= 4)")
        if self.reps < 1 or self.warmup < 0 or self.link_reps < 1 or self.allreduce_reps < 1:
            raise ValueError("repetition counts must be >= 1 (warm-up >= 0)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"unknown --device {self.device!r}; choose auto, cpu or cuda")
        from varuna.testing.netem import NetworkConfig

        for flag, text in (("--inter-netem", self.inter_netem), ("--intra-netem", self.intra_netem)):
            if text:
                try:
                    NetworkConfig.parse(text)
                except ValueError as e:
                    raise ValueError(f"{flag}: {e}") from None


def _say(opts: ProfileOptions, text: str) -> None:
    if opts.verbose:
        print(text, flush=True)


# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# Plan


def _assign_segments(flops: Sequence[float], procs: int) -> dict[int, list[int]]:
    """Longest-processing-time-first: each segment to the least loaded process."""
    load = [0.0] * procs
    out: dict[int, list[int]] = {r: [] for r in range(procs)}
    for seg in sorted(range(len(flops)), key=lambda s: -flops[s]):
        r = min(range(procs), key=lambda i: load[i])
        out[r].append(seg)
        load[r] += max(flops[seg], 1.0)
    return {r: sorted(s) for r, s in out.items() if s}


def _msg_key(msg: MessageSpec) -> str:
    return json.dumps([[list(s), d] for s, d in msg])


def _grad_msg(msg: MessageSpec) -> MessageSpec:
    # The engine sends back gradients of the floating-point inputs only
    # (varuna.runtime.executor.ScheduleExecutor).
    return [(s, d) for s, d in msg if d.startswith(("float", "bfloat"))]


def _sweep_msg(nbytes: int) -> MessageSpec:
    return [((max(nbytes // 4, 1),), "float32")]


def _strip_bandwidth(text: str | None) -> str | None:
    """The netem string without its bandwidth (applied by the kernel's tbf in the netns mode)."""
    if not text:
        return None
    from varuna.testing.netem import NetworkConfig

    cfg = NetworkConfig.parse(text)
    return NetworkConfig(latency_s=cfg.latency_s, jitter_mean_s=cfg.jitter_mean_s, seed=cfg.seed).to_string()


def _ar_configs(ring_sizes: Sequence[int], concurrencies: Sequence[int], k: int) -> list[dict]:
    configs = []
    for d in ring_sizes:
        for c in concurrencies:
            # Ring j holds slot j of hosts 0..d-1: one rank per host, c rings sharing each host.
            configs.append(
                {"ring_size": d, "concurrent": c, "rings": [[h * k + j for h in range(d)] for j in range(c)]}
            )
    return configs


# ---------------------------------------------------------------------------------------------
# Running the workers


class _Workers:
    """The worker processes of one run, started before the plan exists (Note [Early start]).

    Note [Early start]: on a 2-core machine, starting 4 Python processes that import torch takes
    longer than all the measuring of a small model; the workers therefore start first and import
    while this process builds and dry-runs the model, then wait for ``plan.json``.
    """

    def __init__(self, hosts: HostSet, world: int, k: int, opts: ProfileOptions, boot: dict) -> None:
        self.hosts, self.world, self.opts = hosts, world, opts
        self.run_dir = Path(tempfile.mkdtemp(prefix="varuna-profile-"))
        (self.run_dir / "boot.json").write_text(json.dumps({**boot, "timeout_s": opts.timeout_s}))
        port = hosts.free_port()
        pythonpath = os.pathsep.join(dict.fromkeys([os.getcwd(), *[p for p in sys.path if p]]))
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        self.keep_logs = False  # a worker failed: its log is the evidence, the message points at it
        try:
            for rank in range(world):
                host = rank // k if rank < hosts.num_hosts * k else 0
                env = {
                    **os.environ,
                    **hosts.env(host),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "MASTER_ADDR": hosts.address(0),
                    "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": str(opts.threads),
                    "PYTHONPATH": pythonpath,
                }
                env.pop("VARUNA_NETEM", None)  # the plan says which links are emulated
                # The worker asks for the parent-death signal itself (varuna.core.process): no
                # preexec_fn, which can crash a child forked from a process with gRPC threads.
                env[PARENT_PID_VAR] = str(os.getpid())
                log = open(self.run_dir / f"rank{rank}.log", "w")
                self.logs.append(log)
                worker = [sys.executable, "-m", "profiler.worker", str(self.run_dir)]
                # ssh forwards no environment: the remote process gets what the worker reads.
                remote_env = {k: env[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                  "OMP_NUM_THREADS", "PYTHONPATH")}
                argv = hosts.wrap(host, worker, remote_env)
                self.procs.append(
                    subprocess.Popen(
                        argv,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=os.getcwd(),
                    )
                )
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, plan: dict) -> list[dict]:
        """Hand the plan to the workers and wait for all of them; their raw results by rank."""
        tmp = self.run_dir / "plan.json.tmp"
        tmp.write_text(json.dumps(plan))
        os.replace(tmp, self.run_dir / "plan.json")  # atomic: a worker never reads half a plan
        deadline = time.monotonic() + self.opts.timeout_s + 60
        enabled = None if self.opts.verbose else False  # a bar on a terminal, unless --quiet
        with PhaseProgress(self.run_dir, plan, self.world, enabled=enabled) as bar:
            self._wait(deadline, bar)
            bar.poll()  # the last steps, written just before the results
        return [json.loads((self.run_dir / f"rank{r}.json").read_text()) for r in range(self.world)]

    def _wait(self, deadline: float, bar: PhaseProgress) -> None:
        while True:
            bar.poll()
            codes = [p.poll() for p in self.procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                self.keep_logs = True
                r, c = bad[0]
                tail = (self.run_dir / f"rank{r}.log").read_text().strip().splitlines()[-15:]
                raise RuntimeError(
                    f"profiler worker rank {r} failed (exit {c}); its log "
                    f"({self.run_dir}/rank{r}.log) ends with:\n" + "\n".join(tail)
                )
            # Results are written before a worker tears down torch.distributed and the interpreter
            # (seconds on a busy machine): the data is complete once every file exists.
            written = all((self.run_dir / f"rank{r}.json").exists() for r in range(self.world))
            if written or all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                self.keep_logs = True
                raise RuntimeError(
                    f"profiler workers did not finish within {self.opts.timeout_s + 60:.0f}s; "
                    f"logs in {self.run_dir}"
                )
            time.sleep(0.02)

    def close(self) -> None:
        deadline = time.monotonic() + 0.3  # finished workers get a moment to exit on their own
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()) if not self.keep_logs else 0.0)
                except subprocess.TimeoutExpired:
                    pass
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for log in self.logs:
            log.close()
        self.logs = []
        if not self.keep_logs:
            shutil.rmtree(self.run_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Public API


def _host_info(device: str, threads: int) -> HostInfo:
    import torch

    if device.startswith("cuda"):
        desc = f"cuda: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    else:
        cpu = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        desc = f"cpu: {cpu}, {threads} thread(s) per process"
    return HostInfo(
        device=desc, hostname=platform.node(), torch_version=torch.__version__, cpu_count=os.cpu_count() or 1
    )


def _now() -> str:
    return (
        datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    )


def _save(path: str | os.PathLike, cal: Calibration, extra: dict) -> None:
    """Write ``cal`` with ``extra`` as its profiler diagnostics (``Calibration.profiler``)."""
    cal.profiler = extra
    cal.save(path)


def _missing_allreduce_configs(ring_sizes: list[int], concurrencies: list[int], old: Calibration | None
                               ) -> list[tuple[int, int]]:
    """(ring size, concurrency) pairs to measure: those ``old`` (the file being updated) lacks."""
    have_ar = {(p.ring_size, p.concurrent) for p in old.allreduce.points} if old else set()
    return [(d, c) for d in ring_sizes for c in concurrencies if (d, c) not in have_ar]


def _check_same_model(old: Calibration | None, info: Any, update: Any, spec: str) -> None:
    """``--update`` only adds to a file profiled for the same cut-points."""
    if old is not None and (
        old.model.cutpoint_names != info.cutpoint_names or old.model.num_segments != info.num_segments
    ):
        raise ValueError(
            f"{update} was profiled for a model with cut-points {old.model.cutpoint_names}, "
            f"but {spec} has {info.cutpoint_names}; profile it into a new file with --out"
        )


def _apply_overrides(opts: ProfileOptions, overrides: Mapping[str, Any]) -> None:
    """Set ``calibrate(**overrides)`` on ``opts`` (unknown names: TypeError) and validate."""
    for k, v in overrides.items():
        if not hasattr(opts, k):
            raise TypeError(f"calibrate() got an unknown option {k!r}")
        setattr(opts, k, v)
    opts.validate()


def _resolve_device(device: str) -> str:
    """``auto``: cuda when available, else cpu."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _bandwidth(netem: str | None) -> float | None:
    """The bandwidth limit of a ``$VARUNA_NETEM`` spec (None: none, or no spec)."""
    if not netem:
        return None
    from varuna.testing.netem import NetworkConfig

    return NetworkConfig.parse(netem).bandwidth_bytes_per_s


def _boot(opts: ProfileOptions, target: Any, device: str, new_ms: list[int]) -> dict:
    """What every worker needs before the plan (it starts importing torch while we dry-run)."""
    return {
        "spec": target.spec,
        "model_kwargs": target.kwargs,
        "threads": opts.threads,
        "device": device,
        "compute_ranks": opts.procs if new_ms else 0,
        "compute_settings": {
            "warmup": opts.warmup,
            "reps": opts.reps,
            "optimizer": opts.optimizer,
            "min_time_s": opts.min_time_s,
            "dry_run_m": min(new_ms) if new_ms else 1,  # some models need m > 1 (BatchNorm)
        },
    }


def _build_plan(opts: ProfileOptions, info: Any, new_ms: list[int], old: Calibration | None,
                ar_cfgs: list[tuple[int, int]], inter_netem: str | None
                ) -> tuple[dict[str, Any], dict[str, MessageSpec], dict[str, MessageSpec]]:
    """The workers' plan (compute, links, all-reduce phases: only those with something to measure)
    and the activation and gradient messages the links phase sends, by key."""
    k = opts.procs_per_host
    ring_sizes = list(range(2, opts.hosts + 1))
    concurrencies = sorted({1, k})
    plan: dict[str, Any] = {}
    if new_ms:
        plan["compute"] = {
            "assign": _assign_segments(info.segment_cost_s, opts.procs),
            "micro_batch_sizes": new_ms,
        }
    # Messages: every distinct activation (and its gradient) at the new m's, plus the size
    # sweep when the file has no link points yet.
    act_msgs: dict[str, MessageSpec] = {}
    grad_msgs: dict[str, MessageSpec] = {}
    for m in new_ms:
        for cut in info.act_meta[m]:
            msg = [(tuple(s), d) for s, d in cut]
            act_msgs.setdefault(_msg_key(msg), msg)
            grad_msgs.setdefault(_msg_key(_grad_msg(msg)), _grad_msg(msg))
    if old is None:
        for nbytes in opts.link_sweep_bytes:
            act_msgs.setdefault(_msg_key(_sweep_msg(nbytes)), _sweep_msg(nbytes))
            grad_msgs.setdefault(_msg_key(_sweep_msg(nbytes)), _sweep_msg(nbytes))
    if act_msgs:
        plan["links"] = {
            "pairs": {"intra": [0, 1], "inter": [0, k]},
            "netem": {"intra": opts.intra_netem, "inter": inter_netem},
            "act_msgs": list(act_msgs.values()),
            "grad_msgs": list(grad_msgs.values()),
            "pings": opts.link_pings,
            "warmup": 2,
            "reps": opts.link_reps,
        }
    if ar_cfgs:
        configs = [
            c
            for c in _ar_configs(ring_sizes, concurrencies, k)
            if (c["ring_size"], c["concurrent"]) in ar_cfgs
        ]
        plan["allreduce"] = {
            "configs": configs,
            "sweep": list(opts.allreduce_sweep_bytes),
            "warmup": 1,
            "reps": opts.allreduce_reps,
            "num_segments": info.num_segments,
            # None: the compute phase measures them (a fresh file)
            "segment_grad_bytes": [s.grad_bytes for s in old.segments] if old else None,
        }
    return plan, act_msgs, grad_msgs


def _reduce_links(st: CalibrationState, plan: dict, results: Sequence[dict], act_msgs: dict[str, MessageSpec],
                  grad_msgs: dict[str, MessageSpec], info: Any, new_ms: list[int], *,
                  same_clock: bool = True) -> None:
    """The links phase's timings into ``st``: link points for the fits and per-cut-point sends."""
    keys_act, keys_grad = list(act_msgs), list(grad_msgs)
    for kind, (a, b) in plan["links"]["pairs"].items():
        act_t, grad_t = link_stats(results[a]["links"][kind], results[b]["links"][kind], warmup=2,
                                   same_clock=same_clock)
        stat = {key: mean_std(t) for key, t in [*zip(keys_act, act_t), *zip(keys_grad, grad_t)]}
        act_stat = {key: SendStat(mean=stat[key][0], jitter=stat[key][1]) for key in keys_act}
        grad_stat = {key: SendStat(mean=stat[key][0], jitter=stat[key][1]) for key in keys_grad}
        # The fit's points take the median of the rounds (Note [Robust fits] in
        # varuna/core/calibration_fit.py): one descheduled round must not move a size's time.
        for msgs, stats, times in ((act_msgs, act_stat, act_t), (grad_msgs, grad_stat, grad_t)):
            for (key, msg), t in zip(msgs.items(), times):
                st.link_points[kind].append(
                    LinkPoint(bytes=payload_bytes(msg), mean_s=statistics.median(t),
                              jitter_s=stats[key].jitter)
                )
        for m in new_ms:
            for c, cut in enumerate(info.act_meta[m]):
                msg = [(tuple(s), d) for s, d in cut]
                st.sends[(f"act_send_{kind}_s", c, m)] = act_stat[_msg_key(msg)]
                st.sends[(f"grad_send_{kind}_s", c, m)] = grad_stat[_msg_key(_grad_msg(msg))]


def _reduce_compute(st: CalibrationState, results: Sequence[dict], info: Any, new_ms: list[int]) -> None:
    """The compute phase's measurements and the dry run's activation sizes into ``st``."""
    add_compute(st, [SegmentMeasurement.from_dict(d) for r in results for d in r.get("compute", [])])
    flops = next((r["fwd_flops_per_example"] for r in results if r.get("fwd_flops_per_example")), None)
    if flops is not None:  # every compute rank counts the same model: any one will do
        st.fwd_flops_per_example = list(flops)
    shared = next((r["shared_params"] for r in results if "shared_params" in r), None)
    if shared is not None:  # the same model on every compute rank, as the FLOPs
        st.shared_params = [SharedParams(segments=tuple(d["segments"]), grad_bytes=d["grad_bytes"])
                            for d in shared]
    for m in new_ms:
        for c, cut in enumerate(info.act_meta[m]):
            st.act_bytes[(c, m)] = payload_bytes([(tuple(s), d) for s, d in cut])


def _reduce_allreduce(st: CalibrationState, plan: dict, results: Sequence[dict], sweep: Sequence[int]
                      ) -> None:
    """The all-reduce phase's timings into ``st``: one point per (configuration, segment) and per
    sweep size, averaged over the configuration's concurrent rings."""
    ar_sizes, seg_bytes = results[0]["allreduce_sizes"], results[0]["segment_grad_bytes"]
    for j, cfg in enumerate(plan["allreduce"]["configs"]):
        per_ring = [
            allreduce_times([results[r]["allreduce"][str(j)] for r in ring], warmup=1)
            for ring in cfg["rings"]
        ]
        by_size = {size: sum(t[i] for t in per_ring) / len(per_ring) for i, size in enumerate(ar_sizes)}
        for seg, gb in enumerate(seg_bytes):
            if gb > 0:
                st.ar_points.append(
                    AllReducePoint(
                        segment=seg,
                        ring_size=cfg["ring_size"],
                        concurrent=cfg["concurrent"],
                        bytes=gb,
                        time_s=by_size[gb],
                    )
                )
        for size in sweep:
            st.ar_points.append(
                AllReducePoint(
                    segment=None,
                    ring_size=cfg["ring_size"],
                    concurrent=cfg["concurrent"],
                    bytes=size,
                    time_s=by_size[size],
                )
            )


def _history_entry(opts: ProfileOptions, target: Any, new_ms: list[int], ar_cfgs: list[tuple[int, int]],
                   hosts: HostSet, inter_netem: str | None, device: str) -> dict:
    """What this run measured and how (one entry of the file's ``profiler.history``; the wall time
    is filled in at the end)."""
    return {
        "at": _now(),
        "wall_time_s": 0.0,
        "micro_batch_sizes": new_ms,
        "allreduce_configs": ar_cfgs,
        "hosts": hosts.describe(),
        "inter_netem": opts.inter_netem,
        "inter_netem_applied_to_p2p": inter_netem,
        "procs": opts.procs,
        "procs_per_host": opts.procs_per_host,
        "device": device,
        "threads": opts.threads,
        "reps": opts.reps,
        "warmup": opts.warmup,
        "optimizer": opts.optimizer,
        "model_kwargs": target.kwargs,
    }


def _allreduce_note(hosts: HostSet) -> str:
    """How the all-reduces were emulated (``profiler.allreduce_note`` in the file)."""
    if hosts.mode == "loopback":
        return "all-reduce over loopback: the inter-host emulation (netem) does not delay collectives"
    if hosts.bandwidth_shaped:
        return "all-reduce across network namespaces; bandwidth shaped by tbf"
    return "all-reduce across network namespaces"


def calibrate(
    model: str | Callable,
    micro_batch_sizes: Sequence[int] | str,
    *,
    out: str | os.PathLike | None = None,
    update: str | os.PathLike | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    options: ProfileOptions | None = None,
    **overrides: Any,
) -> Calibration:
    """Profile ``model`` (a ``module_or_file:factory`` spec, see :mod:`profiler.spec`) and return
    the calibration; written to ``out`` (or back to ``update``) when given.

    ``options`` / keyword ``overrides``: :class:`ProfileOptions` fields (``procs=4``, ...).
    Raises ``ValueError`` (one line) on bad input, ``RuntimeError`` when a worker fails.
    """
    opts = options or ProfileOptions()
    t_start = opts.clock_start if opts.clock_start is not None else time.perf_counter()
    _apply_overrides(opts, overrides)
    ms = parse_micro_batch_sizes(micro_batch_sizes)
    target = load_target(model, model_kwargs)

    old: Calibration | None = None
    old_extra: dict = {}
    if update is not None:
        old = Calibration.load(update)  # ValueError with a one-line message if unreadable
        old_extra = old.profiler or {}
    new_ms = [m for m in ms if old is None or m not in old.micro_batch_sizes]
    if not any(isinstance(mod, CutPoint) for mod in target.model.modules()):
        raise ValueError(
            f"model {target.spec} has no CutPoint; call varuna.CutPoint() on the activations at "
            "candidate stage boundaries (see varuna/cutting/cutpoint.py)"
        )
    device = _resolve_device(opts.device)
    k = opts.procs_per_host
    ring_sizes = list(range(2, opts.hosts + 1))
    ar_cfgs = _missing_allreduce_configs(ring_sizes, sorted({1, k}), old)
    if not new_ms and not ar_cfgs:
        _say(
            opts,
            f"varuna-profile: {update} already has m={ms} and ring sizes {ring_sizes}: nothing to measure",
        )
        return old  # type: ignore[return-value]
    world = max(opts.procs if new_ms else 0, opts.hosts * k)
    inter_bw = _bandwidth(opts.inter_netem)
    boot = _boot(opts, target, device, new_ms)

    with (
        open_hosts(opts.host_emulation, num_hosts=opts.hosts, bandwidth_bytes_per_s=inter_bw,
                   remote=opts.remote_hosts) as hosts,
        _Workers(hosts, world, k, opts, boot) as workers,
    ):  # Note [Early start]
        info = dry_run(target, new_ms or ms[:1])  # shapes at the m's the file already has are in it
        _check_same_model(old, info, update, target.spec)
        st = state_from_file(old, old_extra) if old else CalibrationState(
            cutpoint_names=info.cutpoint_names, num_segments=info.num_segments)
        inter_netem = _strip_bandwidth(opts.inter_netem) if hosts.bandwidth_shaped else opts.inter_netem
        plan, act_msgs, grad_msgs = _build_plan(opts, info, new_ms, old, ar_cfgs, inter_netem)
        if wants_overheads(opts.runtime_overheads, bool(opts.remote_hosts)):
            plan[PHASE] = overheads_plan(probe_messages=opts.overhead_probe_messages,
                                         calibration_steps=opts.overhead_steps, num_hosts=opts.hosts,
                                         procs_per_host=k)
        _say(
            opts,
            f"varuna-profile: {target.spec}: {info.num_segments} segments, m={new_ms or '-'}, "
            f"{world} processes on {hosts.describe()}, inter-host network: {opts.inter_netem or 'real'}",
        )
        t_plan = time.perf_counter()
        results = workers.run(plan)
        t_workers = time.perf_counter() - t_plan
    _say(opts, _timeline(results, t_start, t_plan, t_plan + t_workers))

    # -- reduce the raw results --------------------------------------------------------------
    _reduce_compute(st, results, info, new_ms)
    if "links" in plan:
        _reduce_links(st, plan, results, act_msgs, grad_msgs, info, new_ms, same_clock=hosts.same_clock)
    if "allreduce" in plan:
        _reduce_allreduce(st, plan, results, opts.allreduce_sweep_bytes)

    history = _history_entry(opts, target, new_ms, ar_cfgs, hosts, inter_netem, device)
    measured = reduce_overheads([results[r] for r in plan[PHASE]["ranks"]], hosts.describe()) \
        if PHASE in plan else None
    return _finish(st, old, target, opts, history, _allreduce_note(hosts), t_start,
                   out if out is not None else update, measured)


def _finish(st: CalibrationState, old: Calibration | None, target: Any, opts: ProfileOptions, history: dict,
            allreduce_note: str, t_start: float, dest: str | os.PathLike | None,
            measured: tuple[RuntimeOverheads, RuntimeConstants] | None = None) -> Calibration:
    """Assemble the calibration, add the run's diagnostics, write it to ``dest`` (and check that
    it reads back), report. ``measured``: this run's runtime overheads (else the old file's)."""
    old_extra = (old.profiler or {}) if old else {}
    host = old.host if old else _host_info(history["device"], opts.threads)
    cal, extra = assemble(
        st,
        created=old.created if old else _now(),
        host=host,
        model_name=old.model.name if old else target.spec,
    )
    # Measured by the overheads phase (Note [Overheads on the hosts]) or kept from the old file.
    cal.runtime_overheads = measured[0] if measured else (old.runtime_overheads if old else None)
    history["wall_time_s"] = round(time.perf_counter() - t_start, 3)
    extra.update(
        {
            "tool": "varuna-profile",
            "spec": target.spec,
            "history": list(old_extra.get("history", [])) + [history],
            # The schema's convention, restated in the file for readers without the docs.
            "units": {"time": "seconds", "size": "bytes", "bandwidth": "bytes per second"},
            "allreduce_note": allreduce_note,
        }
    )
    if measured:  # every fitted constant, also those the schema's section has no field for
        extra["runtime_constants"] = measured[1].to_dict()
    if dest is not None:
        _save(dest, cal, extra)
        Calibration.load(dest)  # the file must read back through the schema
    wall = time.perf_counter() - t_start
    _report(opts, cal, extra, wall, dest)
    return cal


def _timeline(results: Sequence[dict], t_start: float, t_plan: float, t_end: float) -> str:
    """Where the wall time went (worker clocks are this machine's CLOCK_MONOTONIC, like ours)."""
    st = [r.get("stamps", {}) for r in results]
    if not all(st):
        return ""
    ready = max(max(s["preloaded"], s["plan"] if s["plan"] > t_plan else 0.0) for s in st)
    phases = results[0].get("phase_s", {})
    return (
        f"timeline: plan ready at {t_plan - t_start:.1f} s; slowest worker started "
        f"{max(s['main'] for s in st) - t_start:.1f} s, imported "
        f"{max(s['imported'] for s in st) - t_start:.1f} s, ready {ready - t_start:.1f} s, "
        f"measured {max(s['measured'] for s in st) - t_start:.1f} s; "
        f"done {t_end - t_start:.1f} s (rank 0: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
        + ")"
    )


def _report(opts: ProfileOptions, cal: Calibration, extra: dict, wall: float, dest) -> None:
    if not opts.verbose:
        return
    ms = cal.micro_batch_sizes
    print(f"segments (median ms: F / R / B; activation MB) at m = {ms}:")
    for i, seg in enumerate(cal.segments):
        cells = [
            f"{seg.fwd_s[j].median * 1e3:.2f}/{seg.recompute_s[j].median * 1e3:.2f}/"
            f"{seg.bwd_s[j].median * 1e3:.2f}; {seg.activation_bytes[j] / 1e6:.2f}"
            for j in range(len(ms))
        ]
        print(f"  seg {i}: params {seg.param_bytes / 1e6:.2f} MB | " + " | ".join(cells))
    worst = max(
        ((f[k]["max_rel_error"], i, k) for i, f in enumerate(extra["compute_fit"]) for k in f), default=None
    )
    if worst and len(ms) > 1:
        print(
            f"F/B/R linear in m: largest error on the measured points {worst[0] * 100:.1f}% "
            f"(segment {worst[1]}, {worst[2]})"
        )
    for kind, link in (("intra", cal.intra), ("inter", cal.inter)):
        fe = extra["link_fit"][kind]
        print(
            f"link {kind}: latency {link.latency_s * 1e3:.3f} ms, "
            f"bandwidth {link.bandwidth_bytes_per_s / 1e6:.1f} "
            f"MB/s, jitter {link.jitter_s * 1e3:.3f} ms; fit error rms {fe['rms_rel_error'] * 100:.1f}% "
            f"max {fe['max_rel_error'] * 100:.1f}% over {len(link.points)} points"
        )
    ar = cal.allreduce
    print(
        f"all-reduce: bandwidth {ar.bandwidth_bytes_per_s / 1e6:.1f} MB/s, "
        f"latency {ar.latency_s * 1e3:.3f} ms, "
        f"contention {ar.contention:.2f}; fit error rms {ar.fit_rms_rel_error * 100:.1f}% "
        f"max {ar.fit_max_rel_error * 100:.1f}% over {len(ar.points)} points "
        f"(ring sizes/concurrency {extra['allreduce_configs']})"
    )
    print(f"optimizer: {cal.optimizer_s_per_param_byte * 1e9:.3f} s per GB of parameters")
    ro = cal.runtime_overheads
    if ro is not None:
        print(f"runtime overheads: task {ro.task_overhead_s * 1e3:.3f} ms, placeholder "
              f"{ro.placeholder_s * 1e3:.3f} ms per segment, step {ro.step_overhead_s * 1e3:.2f} ms "
              f"({ro.source})")
    if dest is not None:
        print(f"wrote {dest}")
    print(f"calibration wall time: {wall:.1f} s")


def measure_allreduce(
    sizes: Sequence[int],
    *,
    hosts: int,
    procs_per_host: int = 1,
    reps: int = 5,
    host_emulation: str = "auto",
    inter_netem: str | None = _DEFAULT_INTER,
    timeout_s: float = 300.0,
) -> tuple[list[AllReducePoint], str]:
    """All-reduce ``sizes`` bytes over every ring size 2..hosts (and k in {1, procs_per_host}).

    Returns the points and the host emulation used (``netns`` or ``loopback``). For checking the
    all-reduce model (tests, what-if studies) without a model to profile.
    """
    opts = ProfileOptions(
        hosts=hosts,
        procs_per_host=procs_per_host,
        inter_netem=inter_netem,
        host_emulation=host_emulation,
        timeout_s=timeout_s,
        verbose=False,
    )
    k = procs_per_host
    bw = None
    if inter_netem:
        from varuna.testing.netem import NetworkConfig

        bw = NetworkConfig.parse(inter_netem).bandwidth_bytes_per_s
    with open_hosts(host_emulation, num_hosts=hosts, bandwidth_bytes_per_s=bw) as hs:
        configs = _ar_configs(range(2, hosts + 1), sorted({1, k}), k)
        plan = {
            "allreduce": {
                "configs": configs,
                "sweep": list(sizes),
                "warmup": 1,
                "reps": reps,
                "num_segments": 0,
                "segment_grad_bytes": [],
            }
        }
        with _Workers(hs, hosts * k, k, opts, {}) as workers:
            results = workers.run(plan)
        mode = hs.mode
    points = []
    for j, cfg in enumerate(configs):
        per_ring = [
            allreduce_times([results[r]["allreduce"][str(j)] for r in ring], warmup=1)
            for ring in cfg["rings"]
        ]
        for i, size in enumerate(results[0]["allreduce_sizes"]):
            points.append(
                AllReducePoint(
                    segment=None,
                    ring_size=cfg["ring_size"],
                    concurrent=cfg["concurrent"],
                    bytes=size,
                    time_s=sum(t[i] for t in per_ring) / len(per_ring),
                )
            )
    return points, mode
