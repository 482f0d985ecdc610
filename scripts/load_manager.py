"""The manager under load: one ``varuna-manager serve`` on loopback, driven by simulated VM agents
and their workers (gRPC clients only, no processes), then a preemption wave.

Every simulated VM registers, heartbeats every ``--heartbeat-interval`` (the manager's default,
2 s) and follows its orders (RUN, STOP, KILL, IDLE, SHUTDOWN) as ``manager.agent.vm_agent`` would; each
of its running workers sends a worker heartbeat per simulated step (``--step-s``, 1 s). After
``--steady`` seconds of steady state, ``--wave-pct`` % of the VMs of the running generation stop
all RPCs at once (a preemption wave without notice). The run ends by itself when the manager
decided the morph (the next generation's launch) and it started training, or after ``--max-s``.

It prints heartbeat RPC latency p50/p99 (steady state, and after the wave), the manager's CPU
(its process's CPU time / wall), SQLite writes per second (statements that change the state
file, counted inside the manager process by a sqlite3 trace callback), the time from the wave to
the manager declaring the VMs gone and to its morph decision, and false losses (healthy VMs
declared gone). Goal (issue #17): p99 <= 50 ms at 1,000 VMs, no false loss, the morph decided
within 2 heartbeat timeouts. Exit 1 when a goal is missed or the run could not complete.

    python scripts/load_manager.py                       # 1,000 VMs (about 2 minutes)
    python scripts/load_manager.py --vms 100 --steady 10 --heartbeat-timeout 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from manager.common.procs import find_free_port  # noqa: E402
from manager.domain.jobspec import load_jobspec  # noqa: E402
from manager.transport import varuna_manager_pb2 as pb  # noqa: E402
from manager.transport import varuna_manager_pb2_grpc as pb_grpc  # noqa: E402
from manager.transport.convert import spec_to_pb  # noqa: E402

SERVE_WITH_COUNTS = "_serve-with-counts"
WRITE_VERBS = ("INSERT", "UPDATE", "DELETE", "REPLACE")


# -- inside the manager process: count its SQLite writes --------------------------------------


def serve_with_counts(counts_file: str, argv: list[str]) -> int:
    """Run ``varuna-manager serve ARGV`` with every sqlite3 connection traced: statements that
    write, and commits, are counted and written to ``counts_file`` (JSON) every 0.5 s."""
    import sqlite3

    counts = {"writes": 0, "commits": 0}
    real_connect = sqlite3.connect

    def trace(sql: str) -> None:
        head = sql.lstrip()[:8].upper()
        if head.startswith(WRITE_VERBS):
            counts["writes"] += 1
        elif head.startswith(("COMMIT", "END")):
            counts["commits"] += 1

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = real_connect(*args, **kwargs)
        conn.set_trace_callback(trace)
        return conn

    sqlite3.connect = connect
    done = threading.Event()

    def dump() -> None:
        while not done.wait(0.5):
            tmp = counts_file + ".tmp"
            Path(tmp).write_text(json.dumps(counts))
            os.replace(tmp, counts_file)

    dumper = threading.Thread(target=dump, name="load-counts", daemon=True)
    dumper.start()
    if os.environ.get("VARUNA_LOAD_SAMPLE_STACKS"):
        counts["stacks"] = {}
        threading.Thread(target=sample_stacks, args=(counts["stacks"], done), daemon=True).start()
    from manager import cli

    try:
        return cli.main(argv)
    finally:
        done.set()
        dumper.join(2.0)


def sample_stacks(into: dict[str, int], done: threading.Event) -> None:
    """A poor man's sampling profiler (no profiler is installed here): every 10 ms, for each
    busy thread, count its innermost frame in manager/ code (file:function:line) — a line that
    takes the state lock shows up when threads queue for it."""
    me = threading.get_ident()
    while not done.wait(0.01):
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            f, leaf = frame, f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"
            while f is not None and "/manager/" not in f.f_code.co_filename:
                f = f.f_back
            if f is None or leaf in ("threading.py:wait", "selectors.py:select", "_server.py:_serve"):
                continue  # idle threads
            key = f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}:{f.f_lineno} [{leaf}]"
            into[key] = into.get(key, 0) + 1


# -- the simulated fleet ----------------------------------------------------------------------


@dataclass
class Stats:
    """What the fleet measured."""

    latencies: dict[str, list[tuple[float, float]]] = field(
        default_factory=lambda: {"VMHeartbeat": [], "WorkerHeartbeat": []}
    )
    """RPC name → (time sent, latency s)."""
    loop_lag: list[tuple[float, float]] = field(default_factory=list)
    """(time, how late a 50 ms timer fired): the load generator's own delay, part of every latency."""
    errors: dict[str, int] = field(default_factory=dict)


@dataclass
class SimVM:
    """One pretend VM: its agent's state and its workers."""

    vm_id: str
    generation: int = 0
    workers: list[dict] = field(default_factory=list)
    dead: bool = False
    shutdown: bool = False


class Fleet:
    """Simulated VM agents and workers over one gRPC channel per 100 VMs (asyncio)."""

    def __init__(self, address: str, token: str, job: str, n: int, opts: argparse.Namespace) -> None:
        self.address, self.job, self.opts = address, job, opts
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.vms = [SimVM(f"sim-{i:04d}") for i in range(n)]
        self.stats = Stats()
        self.channels: list[grpc.aio.Channel] = []
        self.stubs: list[pb_grpc.VarunaManagerStub] = []
        self.steps: dict[int, tuple[float, int]] = {}  # generation → (start time, resumed_from)
        self.rng = random.Random(opts.seed)

    async def open(self) -> None:
        """One channel per 100 VMs (HTTP/2 multiplexes; a few connections spread the server's I/O)."""
        for _ in range(max(1, len(self.vms) // 100)):
            ch = grpc.aio.insecure_channel(self.address)
            self.channels.append(ch)
            self.stubs.append(pb_grpc.VarunaManagerStub(ch))

    async def close(self) -> None:
        """Close every channel."""
        for ch in self.channels:
            await ch.close(grace=None)

    async def call(self, index: int, name: str, request: Any) -> Any:
        """One RPC with a 10 s deadline; latency recorded; None on an error (counted)."""
        stub = self.stubs[index % len(self.stubs)]
        sent = time.monotonic()
        try:
            reply = await getattr(stub, name)(request, timeout=10.0, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            key = f"{name}: {e.code().name}"
            self.stats.errors[key] = self.stats.errors.get(key, 0) + 1
            return None
        if name in self.stats.latencies:
            self.stats.latencies[name].append((sent, time.monotonic() - sent))
        return reply

    async def agent(self, index: int, stop: asyncio.Event) -> None:
        """Register, then heartbeat every interval and follow the orders, until dead or stopped."""
        vm = self.vms[index]
        instance = secrets.token_hex(8)
        reg = pb.RegisterVMRequest(
            vm_id=vm.vm_id, job_id=self.job, agent_instance=instance, hostname=vm.vm_id,
            address="127.0.0.1", slots=1, pid=100000 + index,
        )  # fmt: skip
        while not stop.is_set() and await self.call(index, "RegisterVM", reg) is None:
            await asyncio.sleep(1.0)
        # Agents start at random moments, not in lockstep.
        await asyncio.sleep(self.rng.uniform(0, self.opts.heartbeat_interval))
        while not (stop.is_set() or vm.dead or vm.shutdown):
            beat = pb.VMHeartbeatRequest(
                vm_id=vm.vm_id, agent_instance=instance, generation=vm.generation, free_port=29500 + index
            )
            for w in vm.workers:
                beat.workers.add(rank=w["rank"], pid=w["pid"], running=w["running"], exit_code=w["exit_code"])
            reply = await self.call(index, "VMHeartbeat", beat)
            if reply is not None:
                self.follow(index, reply.orders)
            await asyncio.sleep(self.opts.heartbeat_interval)

    def follow(self, index: int, orders: pb.Orders) -> None:
        """What manager.agent.vm_agent does with its orders, without processes."""
        vm = self.vms[index]
        if orders.action == pb.Orders.SHUTDOWN:
            vm.shutdown = True
            vm.workers = []
        elif orders.action == pb.Orders.RUN and orders.generation > vm.generation:
            vm.generation = orders.generation
            vm.workers = [
                {"rank": w.rank, "pid": 200000 + index, "running": True, "exit_code": 0, "env": dict(w.env)}
                for w in orders.workers
            ]
            # Every worker of a generation resumes from the last checkpoint (every 10 steps) of
            # the newest step any earlier generation reached; its "engine start" takes 2 s.
            last = max((self.step_of(g) for g in self.steps), default=0)
            self.steps.setdefault(vm.generation, (time.monotonic() + 2.0, last // 10 * 10))
        elif orders.action in (pb.Orders.STOP, pb.Orders.KILL) and orders.generation >= vm.generation:
            vm.generation = orders.generation
            for w in vm.workers:
                if w["running"]:
                    w["running"], w["exit_code"] = False, (0 if orders.action == pb.Orders.STOP else -9)
        elif orders.action == pb.Orders.IDLE:
            vm.workers = [w for w in vm.workers if not w["running"]]

    async def worker(self, index: int, stop: asyncio.Event) -> None:
        """The VM's running workers: one heartbeat per simulated step."""
        vm = self.vms[index]
        period = self.opts.step_s
        await asyncio.sleep(self.rng.uniform(0, period))
        while not (stop.is_set() or vm.dead or vm.shutdown):
            await asyncio.sleep(period)
            for w in [w for w in vm.workers if w["running"]]:
                await self.call(index, "WorkerHeartbeat", self.worker_beat(vm, w))

    def step_of(self, generation: int) -> int:
        """The step the workers of ``generation`` are at now (all of them in step)."""
        start, resumed_from = self.steps.get(generation, (time.monotonic(), 0))
        return resumed_from + max(0, int((time.monotonic() - start) / self.opts.step_s))

    def worker_beat(self, vm: SimVM, w: dict) -> pb.WorkerHeartbeatRequest:
        """The heartbeat a worker of generation ``vm.generation`` sends now."""
        env = w["env"]
        resumed_from = self.steps.get(vm.generation, (0.0, 0))[1]
        step = self.step_of(vm.generation)
        return pb.WorkerHeartbeatRequest(
            job_id=self.job, vm_id=vm.vm_id, generation=vm.generation, rank=w["rank"],
            stage=int(env.get("VARUNA_STAGE", 0)), replica=int(env.get("VARUNA_REPLICA", 0)),
            pipeline_depth=int(env.get("VARUNA_PIPELINE_DEPTH", 1)),
            data_parallel=int(env.get("VARUNA_DATA_PARALLEL", 1)), step=step,
            resumed_from=resumed_from, loss=3.0, samples_per_s=100.0, wall_time=time.time(),
            fwd_s=0.01, bwd_s=0.02, num_microbatches=4, micro_batch_size=2,
        )  # fmt: skip

    async def lag_probe(self, stop: asyncio.Event) -> None:
        """Measure this event loop's own lateness (a busy client inflates every RPC latency)."""
        while not stop.is_set():
            t = time.monotonic()
            await asyncio.sleep(0.05)
            self.stats.loop_lag.append((t, time.monotonic() - t - 0.05))

    def wave(self, pct: float) -> list[str]:
        """Stop ``pct`` % of the VMs running a generation, at once; their ids."""
        running = [v for v in self.vms if any(w["running"] for w in v.workers)]
        victims = self.rng.sample(running, max(1, round(len(running) * pct / 100)))
        for v in victims:
            v.dead = True
        return [v.vm_id for v in victims]


# -- the run ----------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_counts(path: Path) -> dict:
    """The manager's latest SQLite counts ({} before the first dump)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@dataclass
class Probe:
    """Manager CPU time and SQLite writes at one moment."""

    t: float
    cpu_s: float
    writes: int
    commits: int

    @classmethod
    def take(cls, pid: int, counts: Path) -> Probe:
        c = read_counts(counts)
        return cls(time.monotonic(), cpu_seconds(pid), int(c.get("writes", 0)), int(c.get("commits", 0)))


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by nearest rank (nan when empty)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def start_manager(work: Path, opts: argparse.Namespace) -> tuple[subprocess.Popen, str, str]:
    """The manager with SQLite counting, on a free loopback port; (process, address, token)."""
    token = secrets.token_urlsafe(32)
    (work / "token").write_text(token)
    (work / "token").chmod(0o600)
    address = f"127.0.0.1:{find_free_port('127.0.0.1')}"
    argv = [
        "serve", "--db", str(work / "state.sqlite"), "--listen", address,
        "--token-file", str(work / "token"),
        "--heartbeat-interval", str(opts.heartbeat_interval),
        "--heartbeat-timeout", str(opts.heartbeat_timeout),
        "--gather-timeout", "60", "--stop-timeout", "30", "--kill-timeout", "10",
        "--slow-threshold-pct", "100000",
    ]  # fmt: skip
    with open(work / "manager.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, __file__, SERVE_WITH_COUNTS, str(work / "counts.json"), *argv],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    return proc, address, token


def job_file(work: Path, opts: argparse.Namespace) -> Path:
    """A job for ``opts.vms`` VMs that the local provider never creates (``max_created`` 0):
    the simulated agents register into it."""
    spec = {
        "name": "load",
        "script": str(ROOT / "examples" / "gpt2" / "train.py"),
        "global_batch_size": 4096,
        "micro_batch_size": 2,
        "checkpoint_dir": str(work / "ckpt"),
        "checkpoint_every": 10,
        "min_vms": 1,
        "max_vms": opts.vms,
        "target_steps": 1_000_000,
        "num_segments": opts.segments,
        "provider_options": {"max_created": 0},
    }
    path = work / "job.json"
    path.write_text(json.dumps(spec))
    return path


class Watcher:
    """Follows the job's events: when each kind first happened after a moment, and VMs gone."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.after = 0
        self.events: list[tuple[float, Any]] = []  # (local monotonic time seen, event)

    async def poll(self) -> None:
        """Fetch new events (their time is the manager's wall clock: kept in the event)."""
        reply = await self.fleet.call(
            0, "ListEvents", pb.ListEventsRequest(job_id=self.fleet.job, after_id=self.after)
        )
        if reply is None:
            return
        for e in reply.events:
            self.after = max(self.after, e.id)
            self.events.append((time.monotonic(), e))

    def of(self, kind: str, since_wall: float = 0.0) -> list[Any]:
        return [e for _, e in self.events if e.kind == kind and e.time >= since_wall]


async def wait_until(cond: Any, watcher: Watcher, timeout_s: float, poll_s: float = 0.5) -> bool:
    """Poll the events until ``cond()``; False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await watcher.poll()
        if cond():
            return True
        await asyncio.sleep(poll_s)
    return False


@dataclass
class Report:
    """The figures of one run."""

    rows: list[tuple[str, str, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def add(self, what: str, value: str, goal: str = "", ok: bool = True) -> None:
        self.rows.append((what, value, goal if ok else f"{goal}  MISSED"))
        if not ok:
            self.failures.append(what)

    def print(self) -> None:
        width = max(len(r[0]) for r in self.rows)
        for what, value, goal in self.rows:
            print(f"{what:<{width}}  {value:<22} {goal}")


async def drive(
    opts: argparse.Namespace, proc: subprocess.Popen, address: str, token: str, work: Path
) -> Report:
    """Submit, bring up the fleet, steady state, the wave, until the morph is decided."""
    report = Report()
    counts = work / "counts.json"
    fleet = Fleet(address, token, "", opts.vms, opts)
    await fleet.open()
    stop = asyncio.Event()
    tasks: list[asyncio.Task] = []
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.VarunaManagerStub(ch)
            spec = spec_to_pb(load_jobspec(job_file(work, opts)))
            fleet.job = stub.SubmitJob(
                # wait_for_ready: the manager may still be starting (bounded by the deadline).
                pb.SubmitJobRequest(spec=spec),
                timeout=60,
                metadata=fleet.metadata,
                wait_for_ready=True,
            ).job_id
        watcher = Watcher(fleet)
        for i in range(opts.vms):
            tasks += [asyncio.create_task(fleet.agent(i, stop)), asyncio.create_task(fleet.worker(i, stop))]
        tasks.append(asyncio.create_task(fleet.lag_probe(stop)))
        t0 = time.monotonic()
        if not await wait_until(lambda: watcher.of("training-started"), watcher, opts.max_s / 2):
            report.add("training started", "never", f"within {opts.max_s / 2:g} s", ok=False)
            return report
        report.add("all VMs registered, first step", f"{time.monotonic() - t0:.1f} s")
        await asyncio.sleep(2.0)  # let the first-step burst pass before measuring steady state
        steady = Probe.take(proc.pid, counts)
        await asyncio.sleep(opts.steady)
        wave_probe = Probe.take(proc.pid, counts)
        wave_wall = time.time()
        victims = set(fleet.wave(opts.wave_pct))
        budget = 2 * opts.heartbeat_timeout
        decided = await wait_until(lambda: watcher.of("launched", wave_wall), watcher, opts.max_s / 2, 0.2)
        end = Probe.take(proc.pid, counts)
        await watcher.poll()
        summarize(report, fleet, watcher, steady, wave_probe, end, victims, wave_wall, budget, decided)
        return report
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await fleet.close()


def summarize(
    report: Report, fleet: Fleet, watcher: Watcher, steady: Probe, wave: Probe, end: Probe,
    victims: set[str], wave_wall: float, budget: float, decided: bool,
) -> None:  # fmt: skip
    """The table's rows."""
    opts = fleet.opts
    for name, lat in fleet.stats.latencies.items():
        before = [x for t, x in lat if steady.t <= t < wave.t]
        after = [x for t, x in lat if t >= wave.t]
        p99 = percentile(before, 0.99) * 1e3
        report.add(f"{name} p50 / p99, steady", f"{percentile(before, 0.5) * 1e3:.1f} / {p99:.1f} ms",
                   "p99 <= 50 ms", ok=p99 <= 50)  # fmt: skip
        report.add(f"{name} p50 / p99, after wave", f"{percentile(after, 0.5) * 1e3:.1f} / "
                   f"{percentile(after, 0.99) * 1e3:.1f} ms")  # fmt: skip
        report.add(f"{name} RPCs/s, steady", f"{len(before) / max(1e-9, wave.t - steady.t):.0f}")
    lag = [x for t, x in fleet.stats.loop_lag if steady.t <= t < wave.t]
    report.add("load generator's loop lag p50 / p99", f"{percentile(lag, 0.5) * 1e3:.1f} / "
               f"{percentile(lag, 0.99) * 1e3:.1f} ms", "(included in the latencies)")  # fmt: skip
    span = wave.t - steady.t
    report.add("manager CPU, steady", f"{(wave.cpu_s - steady.cpu_s) / span * 100:.0f} % of a core")
    report.add(
        "manager CPU, wave", f"{(end.cpu_s - wave.cpu_s) / max(1e-9, end.t - wave.t) * 100:.0f} % of a core"
    )
    report.add("SQLite writes/s, steady", f"{(wave.writes - steady.writes) / span:.0f} "
               f"({(wave.commits - steady.commits) / span:.0f} commits/s)")  # fmt: skip
    gone = watcher.of("vm-gone")
    false = sorted({e.vm_id for e in gone} - victims)
    report.add("false losses (healthy VMs gone)", str(len(false)), "0", ok=not false)
    wave_gone = [e.time - wave_wall for e in gone if e.vm_id in victims]
    detected = len({e.vm_id for e in gone if e.vm_id in victims})
    report.add("wave", f"{len(victims)} of {opts.vms} VMs")
    report.add("wave detected (first / last VM gone)",
               f"{min(wave_gone, default=float('nan')):.1f} / {max(wave_gone, default=float('nan')):.1f} s",
               f"{detected}/{len(victims)} VMs", ok=detected == len(victims))  # fmt: skip
    launched = watcher.of("launched", wave_wall)
    t = launched[0].time - wave_wall if launched else float("nan")
    report.add("morph decided (next launch)", f"{t:.1f} s" if decided else "never",
               f"<= {budget:g} s (2 heartbeat timeouts)", ok=decided and t <= budget)  # fmt: skip
    if launched:
        report.add("new generation", launched[0].message[:60])
    if fleet.stats.errors:
        report.add("RPC errors", json.dumps(fleet.stats.errors)[:200])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vms", type=int, default=1000)
    p.add_argument("--heartbeat-interval", type=float, default=2.0, help="the manager's default: 2 s")
    p.add_argument("--heartbeat-timeout", type=float, default=15.0, help="the manager's default: 15 s")
    p.add_argument("--step-s", type=float, default=1.0, help="simulated step time: one worker heartbeat each")
    p.add_argument("--steady", type=float, default=30.0, help="seconds of steady state before the wave")
    p.add_argument("--wave-pct", type=float, default=10.0)
    p.add_argument("--segments", type=int, default=4, help="num_segments of the job (the fallback rule's P)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-s", type=float, default=600.0, help="the whole run's bound")
    p.add_argument("--keep", type=Path, default=None, help="keep the manager's log and state here")
    a = p.parse_args(argv)
    if a.vms < 10 or a.heartbeat_interval <= 0 or a.heartbeat_timeout <= 0 or a.step_s <= 0 or a.steady <= 0:
        p.error("need --vms >= 10 and positive intervals")
    return a


def main(argv: list[str] | None = None) -> int:
    """Run the load; 0 when every goal was met."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == SERVE_WITH_COUNTS:
        return serve_with_counts(argv[1], argv[2:])
    opts = parse_args(argv)
    if opts.keep is not None:
        opts.keep.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="varuna-load-", dir=opts.keep))
    proc, address, token = start_manager(work, opts)
    report: Report | None = None
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        report = asyncio.run(asyncio.wait_for(drive(opts, proc, address, token, work), opts.max_s))
    except TimeoutError:
        print(
            f"load_manager: the run did not finish in {opts.max_s:g} s (see {work}/manager.log)",
            file=sys.stderr,
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if opts.keep is None:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    if report is None:
        return 1
    print(f"load_manager: {opts.vms} simulated VMs, heartbeat every {opts.heartbeat_interval:g} s, worker "
          f"heartbeat every {opts.step_s:g} s, timeout {opts.heartbeat_timeout:g} s")  # fmt: skip
    report.print()
    if report.failures:
        print(f"load_manager: missed: {', '.join(report.failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
