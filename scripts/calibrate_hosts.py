"""Calibration over real links, checked against a known cap: ``varuna-profile --host-list`` on hosts
in network namespaces (varuna/testing/netns.py) whose links ``tbf`` caps at R bytes/s each way.

Per rate R one row: the inter-host bandwidth ``varuna-profile`` fitted (the links' latency +
bytes/bandwidth line, ``links.inter``) and the all-reduce bandwidth, each against R; a link
calibrates right when the fitted bandwidth is within 10 % of R (issue #30). The profiler runs in
the set's control namespace and reaches the hosts with OpenSSH as ``varuna-launch --hosts`` does
(Note [Calibrating real links] in profiler/hosts.py): nothing is emulated, the kernel's ``tbf`` is
the only cap.

``--step``: on the same hosts, each P×D layout of ``--layouts`` (default 1x2, 2x1, 2x2: one
process per host when P×D is the number of hosts, else P×D / hosts; consecutive ranks fill a host,
so 2x2's pipelines stay inside a host and its all-reduces cross) trains the GPT example (``--gpt``
sets its size, the same for the profiler and the run; m = 2, global batch ``--global-batch-size``)
with ``varuna-launch --hosts``; its measured step time (the median ``step_s`` after two warm-up
steps; the last step's task timeline is kept as ``trace-PxD.json`` beside the metrics) is printed
against ``simulator.engine.simulate`` on the calibration just measured (nothing fitted to the run):
the same schedule, micro-batches, stages, host slots, recompute and optimizer, the calibration's
``runtime_overheads`` (measured on the hosts by the profiler's runtime-overheads phase) and its
tied embedding (``model.shared_params``). A layout off by more than ``--step-tolerance`` (5 %)
makes the exit status 1. Every process in the hosts runs at SCHED_RR priority (``--priority``,
:class:`Prioritizer`), the profiler's as the trained runs'.

Usage (root; every namespace, sshd and process is removed on exit)::

    python scripts/calibrate_hosts.py                      # 100 and 400 Mbit/s, 2 hosts
    python scripts/calibrate_hosts.py --rates-mbit 50 --hosts 3
    python scripts/calibrate_hosts.py --step --keep runs/cal   # + simulated vs measured steps;
                                                               # files kept under runs/cal
    python scripts/calibrate_hosts.py --step --rates-mbit 400 --steps 12 \
        --gpt n_layer=4,n_embd=128,n_head=4,block_size=64     # the larger model of the docs' table

Results and the machine's load when they were taken: docs/profiling.md, "Calibrating real links".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulator.config import SimConfig  # noqa: E402
from simulator.engine import simulate  # noqa: E402
from varuna.core.calibration import Calibration  # noqa: E402
from varuna.core.partition import balanced_stages  # noqa: E402
from varuna.core.schedule import DEFAULT_SCHEDULE, schedule_kind  # noqa: E402
from varuna.testing.netns import NetHosts, netns_unavailable  # noqa: E402
from varuna.testing.sshd import sshd_unavailable  # noqa: E402

MODEL = f"{ROOT / 'examples' / 'gpt2' / 'profile_target.py'}:build"
GPT = "n_layer=2,n_embd=64,n_head=2,block_size=32"  # --gpt's default
TRAIN = ROOT / "examples" / "gpt2" / "train.py"
MICRO_BATCH = 2
WARMUP_STEPS = 2
TOLERANCE = 0.10


class Prioritizer:
    """While open, give every thread of every process in ``net``'s hosts SCHED_RR priority 1
    (``--priority rr``), re-applied every ``period_s`` as processes and threads appear.

    Why: the GPT example's tasks take 0.1-1 ms of CPU each; on this shared 2-core machine other
    sessions' load makes a task wait several ms for a core, varying from one second to the next
    (steps after warm-up spread −40 %..+50 % around their median, single ones 3× it), which no
    model of the runtime can predict. scripts/validate_simulator.py gives its workers the same
    priority for the same reason. Applied alike to the profiler's workers (its runtime-overheads
    phase measures the engine's costs) and to the trained runs, so both see the same host.
    """

    def __init__(self, net: NetHosts, enabled: bool, period_s: float = 0.2) -> None:
        self.net, self.enabled, self.period_s = net, enabled, period_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="prioritizer", daemon=True)

    def __enter__(self) -> Prioritizer:
        if self.enabled:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)

    def _loop(self) -> None:
        while not self.stop.is_set():
            for h in range(self.net.num_hosts):
                for pid in self.net.pids(h):
                    try:
                        tids = os.listdir(f"/proc/{pid}/task")
                    except OSError:
                        continue  # gone
                    for tid in tids:
                        with contextlib.suppress(OSError):
                            if os.sched_getscheduler(int(tid)) != os.SCHED_RR:
                                os.sched_setscheduler(int(tid), os.SCHED_RR, os.sched_param(1))
            self.stop.wait(self.period_s)


def gpt_model(text: str) -> dict[str, int]:
    """``--gpt``: the GPT example's size, the same words for the profiler and examples/gpt2/train.py.

    >>> gpt_model("n_layer=4, n_embd=128")
    {'n_layer': 4, 'n_embd': 128}
    """
    out = {}
    for word in (w.strip() for w in text.split(",") if w.strip()):
        key, _, value = word.partition("=")
        if key not in ("n_layer", "n_embd", "n_head", "block_size") or not value.isdigit():
            raise ValueError(f"--gpt: {word!r} is not n_layer|n_embd|n_head|block_size=INT")
        out[key] = int(value)
    return out


def train_args(model: dict[str, int]) -> list[str]:
    """examples/gpt2/train.py's options for ``model`` (m as calibrated, no evaluation)."""
    return [*[a for k, v in model.items() for a in (f"--{k.replace('_', '-')}", str(v))],
            "--micro-batch-size", str(MICRO_BATCH), "--eval-every", "0"]


def calibrate(net: NetHosts, out: Path, timeout_s: float, model: dict[str, int]) -> tuple[Calibration, float]:
    """``varuna-profile --host-list`` over every host of ``net``; the calibration and its wall time."""
    hosts = ",".join(net.address(h) for h in range(net.num_hosts))
    cmd = [sys.executable, "-m", "profiler.cli", "--model", MODEL,
           *[a for k, v in model.items() for a in ("--model-arg", f"{k}={v}")], "--micro-batch-sizes",
           str(MICRO_BATCH), "--out", str(out), "--host-list", hosts, "--procs-per-host", "2", "--procs", "2",
           "--quiet", *net.ssh_options()]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(out.parent)}
    started = time.monotonic()
    run = subprocess.run(net.control(cmd), capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                         env=env)
    if run.returncode != 0:
        raise RuntimeError(f"varuna-profile failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    return Calibration.load(out), time.monotonic() - started


def parse_layouts(text: str, num_hosts: int) -> list[tuple[int, int]]:
    """``"1x2,2x1"`` -> [(1, 2), (2, 1)] (P×D); each must fill the hosts evenly.

    >>> parse_layouts("1x2, 2x2", 2)
    [(1, 2), (2, 2)]
    """
    out = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        try:
            p, d = (int(x) for x in word.lower().split("x"))
        except ValueError:
            raise ValueError(f"--layouts: {word!r} is not PxD (e.g. 2x1)") from None
        if p < 1 or d < 1 or (p * d) % num_hosts:
            raise ValueError(f"--layouts: {word} needs P*D a multiple of --hosts ({num_hosts}); "
                             f"choose another layout or host count")
        out.append((p, d))
    return out


def measure_step(net: NetHosts, p: int, d: int, steps: int, global_batch: int, workdir: Path,
                 timeout_s: float, model: dict[str, int]) -> float:
    """The GPT example trained as P×D over every host of ``net`` with ``varuna-launch --hosts``:
    the median step time (s) after the warm-up steps."""
    metrics = workdir / f"steps-{p}x{d}.jsonl"
    metrics.unlink(missing_ok=True)
    hosts = ",".join(net.address(h) for h in range(net.num_hosts))
    cmd = [sys.executable, "-m", "varuna.launch", "--hosts", hosts, "--procs-per-host",
           str(p * d // net.num_hosts), "--pipeline-depth", str(p), "--quiet", *net.ssh_options(), str(TRAIN),
           *train_args(model), "--global-batch-size", str(global_batch), "--steps", str(steps),
           "--metrics-out", str(metrics),
           "--trace", str(workdir / f"trace-{p}x{d}.json")]  # the last step's tasks, to look into
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(workdir)}
    run = subprocess.run(net.control(cmd), capture_output=True, text=True, timeout=timeout_s, cwd=workdir,
                         env=env)
    if run.returncode != 0:
        raise RuntimeError(f"varuna-launch {p}x{d} failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = [r["step_s"] for r in rows if r["step"] > WARMUP_STEPS]
    if not times:
        raise RuntimeError(f"{p}x{d}: no step after the {WARMUP_STEPS} warm-up steps in {metrics}")
    return statistics.median(times)


def engine_split(cal: Calibration, p: int) -> tuple[tuple[int, int], ...]:
    """The stages the engine makes of the model without a plan (varuna/runtime/stages.py): the
    dry run's FLOPs balanced for the default schedule, recompute on -- not the simulator's own
    split by calibrated time, which calibration noise can move (one 100 Mbit/s calibration split
    the 5 segments 1 + 4 where the runs used 2 + 3)."""
    flops = cal.model.fwd_flops_per_example
    if flops is None or p == 1:
        return ((0, cal.num_segments - 1),) if p == 1 else ()
    full, last = schedule_kind(DEFAULT_SCHEDULE).balancing_costs(flops, flops, [2.0 * f for f in flops],
                                                                  recompute=True)
    return tuple(tuple(r) for r in balanced_stages(full, last, p))


def simulate_step(cal: Calibration, p: int, d: int, host_slots: int, global_batch: int) -> float:
    """``simulator.engine.simulate``'s step time (s) of the same P×D layout, batch and stages."""
    config = SimConfig.for_global_batch(global_batch_size=global_batch, num_replicas=d,
                                        micro_batch_size=MICRO_BATCH, num_stages=p, host_slots=host_slots,
                                        stage_segments=engine_split(cal, p) or None)
    return simulate(cal, config).minibatch_s


def step_rows(net: NetHosts, cal: Calibration, layouts: list[tuple[int, int]], a: argparse.Namespace,
              workdir: Path) -> tuple[list[str], int]:
    """One printed line per layout: simulated vs measured step time on ``net``'s hosts; and how
    many layouts are off by more than ``--step-tolerance``."""
    lines, bad = [], 0
    for p, d in layouts:
        measured = measure_step(net, p, d, a.steps, a.global_batch_size, workdir, a.timeout, a.gpt)
        simulated = simulate_step(cal, p, d, p * d // net.num_hosts, a.global_batch_size)
        err = simulated / measured - 1
        ok = abs(err) <= a.step_tolerance
        bad += not ok
        lines.append(f"{'':>10} {f'{p}x{d}':>9} step: simulated {simulated * 1e3:8.1f} ms, measured "
                     f"{measured * 1e3:8.1f} ms, error {err:+7.1%}  {'yes' if ok else 'NO'}")
    return lines, bad


def overheads_line(cal: Calibration) -> str:
    """The calibration's runtime overheads (what the simulator adds for the engine's own work)."""
    ro = cal.runtime_overheads
    if ro is None:
        return f"{'':>10} runtime overheads: none in the file (the simulator adds nothing for them)"
    return (f"{'':>10} runtime overheads: task {ro.task_overhead_s * 1e3:.3f} ms, placeholder "
            f"{ro.placeholder_s * 1e3:.3f} ms/segment, step {ro.step_overhead_s * 1e3:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates-mbit", default="100,400", help="tbf caps to check, Mbit/s (default 100,400)")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--step", action="store_true",
                   help="also train the GPT example per --layouts and print simulated vs measured step time")
    p.add_argument("--layouts", default="1x2,2x1,2x2", help="PxD layouts for --step (default 1x2,2x1,2x2)")
    p.add_argument("--steps", type=int, default=8, help=f"steps per --step run ({WARMUP_STEPS} are warm-up)")
    p.add_argument("--global-batch-size", type=int, default=16, help="global batch of the --step runs")
    p.add_argument("--gpt", default=GPT, help=f"the GPT example's size (default {GPT})")
    p.add_argument("--step-tolerance", type=float, default=0.05, metavar="FRACTION",
                   help="--step: largest |simulated / measured - 1| per layout (default 0.05); "
                   "beyond: exit 1")
    p.add_argument("--priority", choices=["rr", "normal"], default="rr",
                   help="CPU priority of the hosts' processes: SCHED_RR (default; see Prioritizer) "
                   "or unchanged")
    p.add_argument("--keep", type=Path, metavar="DIR",
                   help="keep each rate's calibration (and --step metrics) under DIR/<rate>mbit/")
    a = p.parse_args(argv)
    try:
        layouts = parse_layouts(a.layouts, a.hosts) if a.step else []
        a.gpt = gpt_model(a.gpt)
    except ValueError as e:
        print(f"calibrate_hosts: {e}", file=sys.stderr)
        return 2
    if a.step and a.steps <= WARMUP_STEPS:
        print(f"calibrate_hosts: --steps must be > {WARMUP_STEPS} (the warm-up steps)", file=sys.stderr)
        return 2
    why = netns_unavailable() or sshd_unavailable()
    if why is not None:
        print(f"calibrate_hosts: cannot run: {why}", file=sys.stderr)
        return 2
    rates = [float(r) for r in a.rates_mbit.split(",") if r]
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs, "
          f"priority {a.priority}")
    print(f"{'cap Mbit/s':>10} {'cap MB/s':>9} {'inter MB/s':>10} {'err':>7} {'latency ms':>10}"
          f" {'allreduce MB/s':>14} {'err':>7} {'wall s':>7}  ok")
    bad = 0
    for mbit in rates:
        rate = mbit * 1e6 / 8
        with tempfile.TemporaryDirectory(prefix="varuna-cal-hosts-") as tmp, \
                NetHosts.create(a.hosts, workdir=Path(tmp), rate_bytes_per_s=rate) as net:
            keep = a.keep / f"{mbit:g}mbit" if a.keep else Path(tmp)
            keep.mkdir(parents=True, exist_ok=True)
            with Prioritizer(net, a.priority == "rr"):
                cal, wall = calibrate(net, keep / "calibration.json", a.timeout, a.gpt)
                steps, step_bad = step_rows(net, cal, layouts, a, keep) if layouts else ([], 0)
        bad += step_bad
        inter = cal.inter.bandwidth_bytes_per_s
        ar = cal.allreduce.bandwidth_bytes_per_s
        err, ar_err = inter / rate - 1, ar / rate - 1
        ok = abs(err) <= TOLERANCE
        bad += not ok
        latency_ms = cal.inter.latency_s * 1e3
        print(f"{mbit:>10g} {rate / 1e6:>9.2f} {inter / 1e6:>10.2f} {err:>+7.1%} {latency_ms:>10.3f}"
              f" {ar / 1e6:>14.2f} {ar_err:>+7.1%} {wall:>7.1f}  {'yes' if ok else 'NO'}")
        if layouts:
            print(overheads_line(cal))
        for line in steps:
            print(line)
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
