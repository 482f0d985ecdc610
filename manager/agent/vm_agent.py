"""``python -m manager.agent.vm_agent``: the manager's agent on one VM.

It registers the VM with the manager, then heartbeats every ``heartbeat_interval_s`` (liveness,
the state of its workers, a free port, any eviction notice) and obeys the orders that come back
in each reply (Note [Orders]). It needs no listening port, and a manager restart only pauses it:
it keeps its workers running and retries until ``--orphan-timeout`` passes without an answer,
then kills its workers and exits (so nothing runs forever unsupervised).

Note [Fencing under the manager]: a manager that is *down* refuses connections (its host
answers); a VM that is *cut off* hears nothing at all (a partition, an eviction: its RPCs time
out). The rule (:class:`manager.agent.fencing.FenceRule`) is the manager's Note [Silence probes]
(manager/domain/silence.py) the other way round: after ``--silence-probe-after`` S (the
manager's, passed by the provider: ``ProviderContext.silence_probe_after_s``) plus 0.5 s without
an answer, the agent probes the manager's ``host:port`` (one TCP connect in the background,
Note [Reachability probe] in manager/common/reachability.py). Nothing answers within
``--probe-timeout`` P: the VM is cut off, it kills its workers at once. The host answers (a
manager merely slow or hung): the old bound holds, ``--fence-timeout`` (T + 2 s: ``ProviderContext.
fence_timeout_s``; the 2 s keep a reply merely slowed by a loaded manager from killing workers the
manager still counts) with neither an answer nor a refusal.

The bound, with the defaults (interval 2 s, S = 3 s, P = 1 s): the heartbeat after the last
answer is sent one interval later and fails after its timeout (2 s), the probe starts then and
says *silent* P later: the workers are killed 5-5.5 s after the last answer (5.2 s after the
link went down, measured on namespaces). The manager names the VM S + P + two ticks (about
4.4 s) after its last heartbeat, then has the survivors killed (their next heartbeat) and
relaunches: the next generation's workers start a process and import torch, and commit nothing
before their first step, seconds later. So the cut-off workers are gone before the next
generation can write, even where the provider's delete does not reach the VM. The store's
fencing token is what refuses a late commit for certain (tests/test_checkpoint_fence.py); this
bounds how long a stale writer lives. A refusal means the manager restarts: the workers keep
running, as before, until ``--orphan-timeout``. The agent keeps trying; an answer afterwards
brings it back (the manager's orders: IDLE, a new RUN).

Workers (:class:`manager.agent.workers.WorkerPool`) run as ``python -m manager.worker.shim
SCRIPT ARGS`` (heartbeats, checkpoint interval),
each in its own session (SIGUSR1/SIGKILL go to its whole process group) and with a parent-death
signal (set by the shim, ``$VARUNA_AGENT_PID``), so whatever kills the agent — including
``kill -9`` of the agent's process group, which is how tests preempt a pretend VM — kills the
workers too, exactly like a VM that disappears.

Eviction notices: with ``--notice-source MODULE:CLASS`` (the provider's, from its registry entry:
Azure Scheduled Events, :mod:`manager.agent.scheduled_events`) a thread polls that source
(:mod:`manager.agent.notices`). On a notice for this VM the agent at once
sends SIGUSR1 to its workers (every rank then finishes the mini-batch, writes a checkpoint and
exits 0: the engine agrees on the stop across ranks), without waiting for a manager round trip,
then reports the notice (a live-morph job's workers instead wait for the manager's ``leave``
order: they hand their state over to the workers that stay; docs/manager.md, Live morph); with
``--approve-notices`` it approves the event once its workers are
done, so the platform need not wait until ``NotBefore``.

Note [Orders]: each heartbeat reply is the full desired state (``action``, ``generation``, and
for RUN this VM's workers), so a lost or repeated reply is harmless:

- RUN g: if g is newer than anything run here, kill older workers and start g's (once);
- RUN g with ``kill`` (a live-morph job): SIGKILL (and reap) those of g's workers: their peers
  declared them frozen and went on without them (SIGKILL ends a stopped process too);
- RUN g with ``leave`` (a live-morph job, a notice here): the notice signal
  (``$VARUNA_LIVE_NOTICE_SIGNAL``, SIGUSR2) to g's workers once: they finish the step, hand their
  state over and exit 0; SIGKILL after ``stop_timeout_s``;
- STOP g: SIGCONT + SIGUSR1 to g's workers once, SIGKILL after ``stop_timeout_s``;
- KILL g: SIGKILL g's (and older) workers; IDLE: no worker should run, kill strays;
- PROFILE n: calibrate the job here (once per attempt n, :class:`manager.agent.calibrate.ProfileRun`):
  ``varuna-profile`` with the order's arguments and timeout; the file (or why there is none) goes
  back with ``ReportCalibration``, retried until the manager answers. Any other order stops a
  run still going (the manager no longer wants it);
- SHUTDOWN: kill everything and exit (the VM is being deleted or the job is over).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from manager.agent.calibrate import ProfileRun
from manager.agent.fencing import FenceRule
from manager.agent.notices import Notice, NoticeSource, load_notice_source
from manager.agent.workers import WorkerPool
from manager.common.procs import find_free_port
from manager.common.reachability import Prober
from manager.common.wire import load_token
from manager.transport import varuna_manager_pb2 as pb
from manager.transport.client import ClientConfig, ManagerClient

__all__ = ["AgentConfig", "VMAgent", "main"]

PROG = "varuna-vm-agent"
#: How often the agent's loop looks at its workers; a worker exit is reported this fast.
POLL_S = 0.05
#: A notice on a live-morph job's VM waits this long for the manager's word (``leave``, or STOP
#: when no hand-over is possible) before the agent stops its workers itself (SIGUSR1): the
#: platform's notice is about 30 s.
NOTICE_WAIT_S = 10.0


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """What an agent needs to know; every field has a command-line flag."""

    manager: str
    """``host:port`` of the manager."""
    token_file: str
    """Bearer token file (also handed to the workers by path, never by value)."""
    tls_ca: str | None = None
    vm_id: str
    job_id: str = ""
    slots: int = 1
    address: str = ""
    """How other VMs reach this one; default: the local address that routes to the manager."""
    notice_source: str | None = None
    """``module:Class`` of the eviction-notice source to poll (manager/agent/notices.py); None:
    no polling."""
    notice_url: str | None = None
    """The source's endpoint (None: its default; tests serve a recorded document locally)."""
    vm_name: str = ""
    """This VM's name for the notice source (default: ``vm_id``)."""
    approve_notices: bool = False
    notice_poll_s: float = 1.0
    heartbeat_interval_s: float = 2.0
    """Until the manager says otherwise."""
    orphan_timeout_s: float = 300.0
    fence_timeout_s: float = 0.0
    """Note [Fencing under the manager]: kill the workers after this long with neither an answer
    nor a refusal from the manager (0: never; the manager's ``--heartbeat-timeout``)."""
    silence_probe_after_s: float = 0.0
    """Note [Fencing under the manager]: probe the manager's host after this long without an
    answer, and fence at once when it does not answer (0: never; the manager's S)."""
    probe_timeout_s: float = 1.0
    """How long that probe waits for the manager's host to answer."""
    log_dir: str = ""
    """Worker logs (``gen{g}-rank{r}.log``); default: the current directory."""
    standby: int = 0
    """Standby workers kept ready (torch imported) for the next generation (Note [Standby])."""
    standby_priority: str = "idle"
    """``idle``: standbys import at idle priority (never slowing the training; slow to get ready
    when the training keeps the CPU busy); ``normal``: ready sooner, at the training's expense."""
    standby_delay_s: float = 1.0
    """Start standbys this long after the manager reports the generation training (its first
    step done), so they do not slow the workers' own start-up."""
    python: str = field(default_factory=lambda: sys.executable or "python3")


class VMAgent:
    """The agent's state and loop (module docstring). Run :meth:`run` in the main thread: the
    workers' parent-death signal is tied to the thread that starts them."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.instance = secrets.token_hex(8)
        self._client = ManagerClient(
            ClientConfig(address=config.manager, token=load_token(config.token_file), tls_ca=config.tls_ca)
        )
        self._interval = config.heartbeat_interval_s
        self._generation = 0
        self._shutdown = threading.Event()
        self._notice: Notice | None = None
        self._notice_lock = threading.Lock()
        self._notice_acted = False
        self._notice_approved = False
        self._notice_seen: float | None = None  # when a live job's notice began waiting for orders
        self._events: NoticeSource | None = None
        if config.notice_source:  # ValueError (one line) when it names no class
            self._events = load_notice_source(
                config.notice_source, url=config.notice_url, vm_name=config.vm_name or config.vm_id
            )
        self._address = config.address or _route_address(config.manager)
        self._log_dir = Path(config.log_dir or ".")
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._pool = WorkerPool(
            worker_env=self._worker_env,
            log_dir=self._log_dir,
            python=config.python,
            say=self._say,
            standby=config.standby,
            standby_priority=config.standby_priority,
            standby_delay_s=config.standby_delay_s,
        )
        self._profile: ProfileRun | None = None  # the PROFILE order's run (kept once reported)
        self._profile_reported = False
        self._report_retrying = False
        self._next_report = 0.0
        #: Probes of the manager's host (Note [Fencing under the manager]); None: no probing.
        self._prober = (Prober(timeout_s=config.probe_timeout_s, clock=time.monotonic, max_workers=1)
                        if config.silence_probe_after_s > 0 else None)

    # -- life cycle ----------------------------------------------------------------------------

    def request_shutdown(self) -> None:
        """Stop the loop (signal handlers call it); workers are killed on the way out."""
        self._shutdown.set()

    def run(self) -> int:
        """Register, then heartbeat and obey until shut down. Returns the exit code."""
        poller = None
        if self._events is not None:
            poller = threading.Thread(target=self._poll_events, name="notice-source", daemon=True)
            poller.start()
        try:
            if not self._register():
                return 3
            return self._loop()
        finally:
            self._pool.kill_all()
            self._pool.kill_standbys()
            self._stop_profile()
            self._client.close()
            if self._prober is not None:
                self._prober.close()

    def _say(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S") + f".{int(time.time() * 1000) % 1000:03d}"
        print(f"{stamp} {PROG}[{self.config.vm_id}]: {text}", file=sys.stderr, flush=True)

    def _register(self) -> bool:
        deadline = time.monotonic() + self.config.orphan_timeout_s
        request = pb.RegisterVMRequest(
            vm_id=self.config.vm_id,
            job_id=self.config.job_id,
            agent_instance=self.instance,
            hostname=socket.gethostname(),
            address=self._address,
            slots=self.config.slots,
            pid=os.getpid(),
        )
        while not self._shutdown.is_set():
            try:
                reply = self._client.register_vm(request)
                if reply.heartbeat_interval_s > 0:
                    self._interval = reply.heartbeat_interval_s
                self._say(f"registered with {self.config.manager} ({reply.message or 'ok'})")
                return True
            except grpc.RpcError as exc:
                if exc.code() in (
                    grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.INVALID_ARGUMENT,
                ):
                    self._say(f"the manager refused this VM: {exc.details()}")
                    return False
                if time.monotonic() > deadline:
                    self._say(
                        f"no manager at {self.config.manager} for {self.config.orphan_timeout_s:g} s; exiting"
                    )
                    return False
            self._shutdown.wait(min(1.0, self._interval))
        return False

    def _loop(self) -> int:
        fence = FenceRule(
            manager=self.config.manager,
            fence_timeout_s=self.config.fence_timeout_s,
            probe_after_s=self.config.silence_probe_after_s,
            prober=self._prober,
            now=time.monotonic(),
        )
        fenced = failing = False
        next_beat = 0.0
        reported: tuple = ()
        while not self._shutdown.is_set():
            self._pool.poll()
            self._act_on_notice()
            self._pool.enforce_stop_deadline()
            self._pool.maintain_standbys()
            self._report_profile()
            state = self._state_key()
            now = time.monotonic()
            cut_off = fence.reason(now) if failing else None  # Note [Fencing under the manager]
            if cut_off is not None and not fenced:
                fenced = True
                self._say(f"{cut_off}: this VM is cut off; fencing: killing its workers")
                self._pool.kill_all()
                self._pool.kill_standbys()
            # Beat on schedule, and at once when something changed (a worker exited, a notice):
            # the manager reacts to those within a round trip instead of an interval.
            if now >= next_beat or state != reported:
                timeout_s = max(2.0, self._interval)
                if failing:  # no call may overrun the fence, nor hide a probe's verdict long
                    timeout_s = fence.rpc_timeout(now, timeout_s)
                try:
                    orders = self._client.vm_heartbeat(self._heartbeat(), timeout_s=timeout_s)
                except grpc.RpcError as exc:
                    if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                        self._say(f"the manager no longer knows this VM ({exc.details()}); exiting")
                        return 0
                    if time.monotonic() - fence.last_ok > self.config.orphan_timeout_s:
                        self._say(
                            f"no manager for {self.config.orphan_timeout_s:g} s; killing workers and exiting"
                        )
                        return 3
                    failing = True
                    if _refused(exc):
                        fence.refused(time.monotonic())
                    next_beat = time.monotonic() + min(1.0, self._interval)
                else:
                    fence.answered(time.monotonic())
                    fenced = failing = False
                    reported = state
                    next_beat = fence.last_ok + self._interval
                    if self._apply(orders):
                        return 0
            self._shutdown.wait(POLL_S)
        return 0

    # -- orders --------------------------------------------------------------------------------

    def _apply(self, orders: pb.Orders) -> bool:
        """Obey one reply (Note [Orders]); True when told to shut down."""
        if orders.heartbeat_interval_s > 0:
            self._interval = orders.heartbeat_interval_s
        action = orders.action
        if action == pb.Orders.SHUTDOWN:
            self._say("shutdown ordered")
            return True
        if action == pb.Orders.PROFILE:
            if self._pool.any_running:
                self._say("profile ordered: killing leftover workers")
                self._pool.kill_all()
            self._start_profile(orders.profile)
            return False
        if self._profile is not None:
            self._stop_profile()
        if action == pb.Orders.RUN:
            self._run_order(orders)
        elif action == pb.Orders.STOP:
            self._stop_order(orders)
        elif action == pb.Orders.KILL:
            if orders.generation >= self._generation:
                self._pool.kill_all()
                self._generation = orders.generation
        elif action == pb.Orders.IDLE and self._pool.any_running:
            self._say("idle ordered: killing leftover workers")
            self._pool.kill_all()
        return False

    def _run_order(self, orders: pb.Orders) -> None:
        """RUN g: start g's workers once, when g is newer than anything run here."""
        pool, g = self._pool, orders.generation
        if orders.training and pool.training_since is None:
            pool.training_since = time.monotonic()
        if g > self._generation:
            pool.kill_all()
            self._generation = g
            pool.training_since = time.monotonic() if orders.training else None
            pool.spawn(list(orders.workers), g)
            # A VM under notice should not get work; if it does, stop it again right away.
            if self._notice_acted:
                pool.signal(signal.SIGUSR1)
        killed = pool.kill_ranks(set(orders.kill)) if orders.kill and g == self._generation else []
        if killed:
            self._say(f"rank(s) {killed} of generation {g} killed (SIGKILL): their peers declared them "
                      "frozen and went on without them")
        notice_sig = pool.notice_signal
        if orders.leave and g == self._generation and notice_sig is not None and not self._notice_acted:
            # Live morph: the manager wrote the survivors' layout; now hand over and leave.
            self._notice_acted = True
            self._say(f"leave ordered (eviction notice, live morph): {signal.Signals(notice_sig).name} to "
                      "the workers (finish the step, hand the state over, exit 0)")
            pool.signal(notice_sig)
            pool.stop_deadline = time.monotonic() + (orders.stop_timeout_s or 60.0)

    def _stop_order(self, orders: pb.Orders) -> None:
        """STOP g: SIGUSR1 to g's workers once; SIGKILL after the order's stop timeout."""
        g = orders.generation
        if g > self._generation:
            self._pool.kill_all()
            self._generation = g  # never started: nothing to stop, and never start it later
        elif g == self._generation and self._pool.stop_deadline is None:
            self._say(f"stopping generation {g} (SIGUSR1: checkpoint and exit)")
            self._pool.signal(signal.SIGUSR1)
            self._pool.stop_deadline = time.monotonic() + (orders.stop_timeout_s or 60.0)

    def _worker_env(self, launch_env: dict[str, str]) -> dict[str, str]:
        base = dict(os.environ)
        extra = {
            "VARUNA_MANAGER": self.config.manager,
            "VARUNA_MANAGER_TOKEN_FILE": str(Path(self.config.token_file).resolve()),
            "VARUNA_VM_ID": self.config.vm_id,
            # The shim asks for a parent-death signal tied to us (manager.common.procs.die_with_parent).
            "VARUNA_AGENT_PID": str(os.getpid()),
            # The workers import manager.worker.shim: make this package importable for them
            # wherever their working directory is.
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(Path(__file__).resolve().parent.parent), base.get("PYTHONPATH", "")) if p
            ),
        }
        if self.config.tls_ca:
            extra["VARUNA_MANAGER_TLS_CA"] = str(Path(self.config.tls_ca).resolve())
        return {**base, **launch_env, **extra}

    # -- calibration (PROFILE orders) ----------------------------------------------------------

    def _start_profile(self, order: pb.ProfileOrder) -> None:
        """Start the ordered run unless this attempt already runs (or ran) here."""
        if self._profile is not None and self._profile.attempt == order.attempt:
            return
        self._stop_profile()
        self._profile = ProfileRun(
            attempt=order.attempt,
            argv=list(order.argv),
            env=self._worker_env(dict(order.env)),
            cwd=order.cwd,
            timeout_s=order.timeout_s or 600.0,
            log_dir=self._log_dir,
            python=self.config.python,
        )
        self._profile_reported = False
        self._report_retrying = False
        self._next_report = 0.0
        self._say(
            f"calibration attempt {order.attempt}: varuna-profile {' '.join(order.argv)} "
            f"(timeout {order.timeout_s:g} s; log {self._profile.log_path})"
        )

    def _stop_profile(self) -> None:
        if self._profile is None:
            return
        if self._profile.running:
            self._say(f"calibration attempt {self._profile.attempt} no longer ordered: stopping it")
        self._profile.kill()
        self._profile = None

    def _report_profile(self) -> None:
        """Send a finished run's result until the manager has answered once."""
        run = self._profile
        if run is None or self._profile_reported or time.monotonic() < self._next_report:
            return
        result = run.poll()
        if result is None:
            return
        request = pb.ReportCalibrationRequest(
            vm_id=self.config.vm_id,
            agent_instance=self.instance,
            attempt=run.attempt,
            ok=result.ok,
            calibration_json=result.calibration_json,
            error=result.error,
            wall_s=result.wall_s,
        )
        try:
            reply = self._client.report_calibration(request, timeout_s=max(5.0, 2 * self._interval))
        except grpc.RpcError as exc:
            self._next_report = time.monotonic() + min(1.0, self._interval)
            if not self._report_retrying:  # once per run: the manager may be down for a while
                self._report_retrying = True
                self._say(f"reporting calibration attempt {run.attempt} failed ({exc.code().name}); retrying")
            return
        self._profile_reported = True
        outcome = f"done in {result.wall_s:.1f} s" if result.ok else f"failed: {result.error}"
        self._say(f"calibration attempt {run.attempt} {outcome}; manager: {reply.message}")

    # -- eviction notices ----------------------------------------------------------------------

    def _poll_events(self) -> None:
        assert self._events is not None
        while not self._shutdown.is_set():
            notices = self._events.poll()
            if notices:
                with self._notice_lock:
                    if self._notice is None:
                        self._notice = notices[0]
            self._shutdown.wait(self.config.notice_poll_s)

    def _act_on_notice(self) -> None:
        with self._notice_lock:
            notice = self._notice
        if notice is None:
            return
        if not self._notice_acted and self._waits_for_leave(notice):
            return
        if not self._notice_acted:
            self._notice_acted = True
            self._say(
                f"eviction notice {notice.event_type} {notice.event_id} (not before {notice.not_before!r}):"
                " SIGUSR1 to the workers (checkpoint and exit)"
            )
            self._pool.signal(signal.SIGUSR1)
            if self._pool.any_running:
                self._pool.stop_deadline = time.monotonic() + 60.0
        if (
            self.config.approve_notices
            and not self._notice_approved
            and self._events is not None
            and not self._pool.any_running
        ):
            self._notice_approved = True
            ok = self._events.approve(notice.event_id)
            self._say(
                f"approved event {notice.event_id}" if ok else f"could not approve event {notice.event_id}"
            )

    def _waits_for_leave(self, notice: Notice) -> bool:
        """A live-morph job's workers leave one by one, on the manager's word (``leave``, once it
        wrote the layout of those that stay; Note [Orders]); without it for ``NOTICE_WAIT_S``
        (no manager), they stop the old way. True while waiting."""
        if self._pool.notice_signal is None or not self._pool.any_running:
            return False
        if any(w.stop_sent is not None for w in self._pool.workers):  # a STOP order came first
            self._notice_acted = True
            return True
        now = time.monotonic()
        if self._notice_seen is None:
            self._notice_seen = now
            self._say(f"eviction notice {notice.event_type} {notice.event_id}: live morph, waiting for the "
                      "manager's word to hand over and leave")
        if now - self._notice_seen < NOTICE_WAIT_S:
            return True
        self._say(f"no word from the manager in {NOTICE_WAIT_S:g} s after the notice")
        return False

    # -- reports -------------------------------------------------------------------------------

    def _state_key(self) -> tuple:
        return (
            self._generation,
            tuple((w.rank, w.exit_code) for w in self._pool.workers),
            self._notice is not None,
        )

    def _heartbeat(self) -> pb.VMHeartbeatRequest:
        req = pb.VMHeartbeatRequest(
            vm_id=self.config.vm_id,
            agent_instance=self.instance,
            generation=self._generation,
            free_port=find_free_port(),
        )
        for w in self._pool.workers:
            req.workers.add(
                rank=w.rank,
                pid=w.popen.pid,
                running=w.exit_code is None,
                exit_code=w.exit_code if w.exit_code is not None else 0,
            )
        with self._notice_lock:
            notice = self._notice
        if notice is not None:
            req.has_notice = True
            req.notice.CopyFrom(
                pb.PreemptNotice(
                    event_id=notice.event_id,
                    event_type=notice.event_type,
                    not_before=notice.not_before,
                    description=notice.description,
                )
            )
        return req


def _refused(exc: grpc.RpcError) -> bool:
    """Whether a failed RPC was refused by the manager's host (the manager is down, the network
    is not: Note [Fencing under the manager]), as opposed to unanswered."""
    details = (exc.details() or "") if hasattr(exc, "details") else ""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and "refused" in details.lower()


def _route_address(manager: str) -> str:
    """The local IP address that routes to the manager (what other VMs can reach us at)."""
    host = manager.rsplit(":", 1)[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP connect sends nothing; it only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="The varuna manager's agent on one VM.")
    parser.add_argument("--manager", required=True, metavar="HOST:PORT")
    parser.add_argument("--token-file", required=True)
    parser.add_argument("--tls-ca", default=None)
    parser.add_argument("--vm-id", required=True)
    parser.add_argument("--job-id", default="")
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--address", default="")
    parser.add_argument("--notice-source", default=None, metavar="MODULE:CLASS",
                        help="eviction-notice source to poll (the provider's; none: no polling)")
    parser.add_argument("--notice-url", default=None, help="the notice source's endpoint (default: its own)")
    parser.add_argument("--vm-name", default="", help="this VM's name there (default: --vm-id)")
    parser.add_argument("--approve-notices", action="store_true")
    parser.add_argument("--notice-poll", type=float, default=1.0, metavar="S")
    parser.add_argument("--heartbeat-interval", type=float, default=2.0, metavar="S")
    parser.add_argument("--orphan-timeout", type=float, default=300.0, metavar="S")
    parser.add_argument("--fence-timeout", type=float, default=0.0, metavar="S",
                        help="kill the workers after S s without an answer or a refusal from the manager"
                             " (0: never; Note [Fencing under the manager])")
    parser.add_argument("--silence-probe-after", type=float, default=0.0, metavar="S",
                        help="after S s without an answer probe the manager's host; no answer: fence at"
                             " once (0: never; Note [Fencing under the manager])")
    parser.add_argument("--probe-timeout", type=float, default=1.0, metavar="P",
                        help="how long that probe waits for the manager's host (default 1)")
    parser.add_argument("--log-dir", default="")
    parser.add_argument(
        "--standby",
        type=int,
        default=0,
        metavar="N",
        help="keep N pre-imported workers ready for the next generation (default 0)",
    )
    parser.add_argument(
        "--standby-delay",
        type=float,
        default=1.0,
        metavar="S",
        help="start standbys this long after the generation's first step (default 1)",
    )
    parser.add_argument(
        "--standby-priority",
        choices=["idle", "normal"],
        default="idle",
        help="CPU priority of standbys while they import (default idle: never slows the training)",
    )
    args = parser.parse_args(argv)
    try:
        agent = VMAgent(
            AgentConfig(
                manager=args.manager,
                token_file=args.token_file,
                tls_ca=args.tls_ca,
                vm_id=args.vm_id,
                job_id=args.job_id,
                slots=args.slots,
                address=args.address,
                notice_source=args.notice_source,
                notice_url=args.notice_url,
                vm_name=args.vm_name,
                approve_notices=args.approve_notices,
                notice_poll_s=args.notice_poll,
                heartbeat_interval_s=args.heartbeat_interval,
                orphan_timeout_s=args.orphan_timeout,
                fence_timeout_s=args.fence_timeout,
                silence_probe_after_s=args.silence_probe_after,
                probe_timeout_s=args.probe_timeout,
                log_dir=args.log_dir,
                standby=args.standby,
                standby_delay_s=args.standby_delay,
                standby_priority=args.standby_priority,
            )
        )
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: agent.request_shutdown())
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
