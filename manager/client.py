"""Client side of the manager's gRPC interface: the CLI, per-VM agents and training workers use it.

:class:`ManagerClient` wraps every RPC with the bearer token and a timeout. :class:`WorkerReporter`
is what a training process uses to send its heartbeats (step, throughput, per-micro-batch
forward/backward compute times); it never blocks or breaks training: heartbeats go out from a
background thread, and when the manager is unreachable (restarting) they are dropped.

A worker started by the manager's agent finds everything in its environment::

    VARUNA_MANAGER=host:port   VARUNA_MANAGER_TOKEN_FILE=/path   [VARUNA_MANAGER_TLS_CA=/path]
    VARUNA_JOB_ID, VARUNA_VM_ID, VARUNA_GENERATION

``python -m manager.worker_shim`` attaches a reporter to every engine of an unmodified script
through the engine plugin :func:`attach_to_engine` (``$VARUNA_ENGINE_PLUGINS``); a script run
without the shim opts in with one line after building its engine::

    reporter = WorkerReporter.from_env(engine)        # None when not run by the manager
    ...
    result = engine.train_step(batch)
    if reporter: reporter.on_step(result)

(Under the shim ``from_env`` returns the reporter already attached, and a step is reported once.)
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from manager import varuna_manager_pb2 as pb
from manager import varuna_manager_pb2_grpc as pb_grpc
from manager.auth import bearer_metadata, client_channel, load_token

__all__ = ["ClientConfig", "ManagerClient", "WorkerReporter", "attach_to_engine", "compute_times"]

#: Default deadline of one RPC: heartbeats are tiny, a manager that needs longer is in trouble.
RPC_TIMEOUT_S = 5.0


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Where the manager is and how to authenticate."""

    address: str
    """``host:port`` of ``varuna-manager serve``."""
    token: str
    """The shared bearer token (read from a file with :func:`manager.auth.load_token`)."""
    tls_ca: str | None = None
    """PEM file to verify the manager's certificate; None: plain TCP (unless ``tls``)."""
    tls: bool = False
    """Use TLS with the system's root certificates."""
    timeout_s: float = RPC_TIMEOUT_S

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ClientConfig | None:
        """From ``VARUNA_MANAGER`` / ``VARUNA_MANAGER_TOKEN_FILE`` / ``VARUNA_MANAGER_TLS_CA``;
        None when ``VARUNA_MANAGER`` is unset. ``ValueError`` if the token cannot be read."""
        env = os.environ if environ is None else environ
        address = env.get("VARUNA_MANAGER")
        if not address:
            return None
        token_file = env.get("VARUNA_MANAGER_TOKEN_FILE")
        if not token_file:
            raise ValueError("VARUNA_MANAGER is set but VARUNA_MANAGER_TOKEN_FILE is not")
        return cls(
            address=address, token=load_token(token_file), tls_ca=env.get("VARUNA_MANAGER_TLS_CA") or None
        )


class ManagerClient:
    """One channel to the manager; every method is one RPC and raises ``grpc.RpcError`` on
    failure (``UNAUTHENTICATED`` for a bad token, ``UNAVAILABLE`` when the manager is down).

    Example::

        with ManagerClient(ClientConfig(address="127.0.0.1:7000", token=tok)) as c:
            job_id = c.submit(spec)
    """

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self._channel = client_channel(config.address, tls_ca=config.tls_ca, tls=config.tls)
        self._stub = pb_grpc.VarunaManagerStub(self._channel)
        self._metadata = bearer_metadata(config.token)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ManagerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self, method: str, request: Any, timeout_s: float | None, *, wait_for_ready: bool = False
    ) -> Any:
        fn = getattr(self._stub, method)
        return fn(
            request,
            timeout=timeout_s or self.config.timeout_s,
            metadata=self._metadata,
            wait_for_ready=wait_for_ready,
        )

    # -- CLI -----------------------------------------------------------------------------------

    def submit(self, spec: pb.JobSpec, *, timeout_s: float | None = None) -> str:
        return self._call("SubmitJob", pb.SubmitJobRequest(spec=spec), timeout_s).job_id

    def status(
        self, job_id: str = "", *, history: int = 20, timeout_s: float | None = None
    ) -> list[pb.JobStatus]:
        return list(
            self._call("GetStatus", pb.GetStatusRequest(job_id=job_id, history=history), timeout_s).jobs
        )

    def events(
        self, job_id: str = "", *, after_id: int = 0, limit: int = 0, timeout_s: float | None = None
    ) -> list[pb.Event]:
        req = pb.ListEventsRequest(job_id=job_id, after_id=after_id, limit=limit)
        return list(self._call("ListEvents", req, timeout_s).events)

    def cancel(self, job_id: str, *, timeout_s: float | None = None) -> str:
        return self._call("CancelJob", pb.CancelJobRequest(job_id=job_id), timeout_s).state

    # -- agents --------------------------------------------------------------------------------

    def register_vm(
        self, request: pb.RegisterVMRequest, *, timeout_s: float | None = None
    ) -> pb.RegisterVMReply:
        return self._call("RegisterVM", request, timeout_s)

    # Heartbeats wait (up to their deadline) for the connection instead of failing at once while
    # the channel is between reconnect attempts: a restarted manager then hears from everyone
    # as soon as it listens. CLI calls fail fast instead (a person is waiting).

    def vm_heartbeat(self, request: pb.VMHeartbeatRequest, *, timeout_s: float | None = None) -> pb.Orders:
        return self._call("VMHeartbeat", request, timeout_s, wait_for_ready=True).orders

    def report_calibration(
        self, request: pb.ReportCalibrationRequest, *, timeout_s: float | None = None
    ) -> pb.ReportCalibrationReply:
        """Hand the result of a PROFILE order back (the calibration file travels in the request)."""
        return self._call("ReportCalibration", request, timeout_s, wait_for_ready=True)

    # -- workers -------------------------------------------------------------------------------

    def worker_heartbeat(self, request: pb.WorkerHeartbeatRequest, *, timeout_s: float | None = None) -> bool:
        return self._call("WorkerHeartbeat", request, timeout_s, wait_for_ready=True).ok


def compute_times(events: Sequence[Any], stage: int, replica: int) -> tuple[float, float, float, int]:
    """Mean forward, backward and recompute seconds per micro-batch in timeline ``events``
    (``varuna.core.timeline.Event``) of one stage replica, and the number of forwards.

    >>> from varuna.core.timeline import Event
    >>> compute_times([Event(0, 0, "F", 0, 0.0, 0.1), Event(0, 0, "B", 0, 0.1, 0.3)], 0, 0)
    (0.1, 0.2, 0.0, 1)
    """
    sums = {"F": 0.0, "B": 0.0, "R": 0.0}
    counts = {"F": 0, "B": 0, "R": 0}
    for e in events:
        if e.stage == stage and e.replica == replica and e.op in sums:
            sums[e.op] += e.end_s - e.start_s
            counts[e.op] += 1

    def mean(op: str) -> float:
        return round(sums[op] / counts[op], 9) if counts[op] else 0.0

    return mean("F"), mean("B"), mean("R"), counts["F"]


class WorkerReporter:
    """Sends one heartbeat per training step of an engine to the manager, off the training
    thread (see the module docstring).

    Each micro-batch's forward/backward time comes from the step result's ``timings`` (a
    ``varuna.Engine`` measures them). For an engine without them (no ``add_step_callback``), it
    turns on the engine's task timeline (``config.metrics.record_timeline``) and, when it did so, empties
    the timeline after each step so memory stays flat.
    """

    #: Heartbeats waiting to be sent; when the manager is slow, older ones are dropped first.
    QUEUE_SIZE = 64

    def __init__(
        self, engine: Any, client: ManagerClient, *, job_id: str, vm_id: str, generation: int
    ) -> None:
        self._client = client
        self._job_id, self._vm_id, self._generation = job_id, vm_id, generation
        layout = engine.layout
        self._rank, self._stage, self._replica = int(layout.rank), int(layout.stage), int(layout.replica)
        self._P, self._D = int(layout.P), int(layout.D)
        self._resumed_from = int(engine.step_count)
        info = engine.describe()
        ranges = info.get("stage_ranges") or []
        first, end = ranges[self._stage] if self._stage < len(ranges) else (0, -1)  # empty: unknown
        self._segments = (int(first), int(end))
        self._m = int(info.get("m") or 0)
        self._last_step = self._resumed_from
        self._uses_timeline = not hasattr(engine, "add_step_callback")
        # Only an engine without step callbacks is read later (its timeline). A varuna Engine held
        # here would stay alive through atexit until the process ends: every engine a live morph
        # replaces (its model and optimizer state) would leak.
        self._engine = engine if self._uses_timeline else None
        self._owns_timeline = self._uses_timeline and not engine.config.metrics.record_timeline
        self._seen = 0
        if self._uses_timeline:
            engine.config.metrics = dataclasses.replace(engine.config.metrics, record_timeline=True)
            self._seen = len(engine.timeline.events)
        self._queue: queue.Queue[pb.WorkerHeartbeatRequest | None] = queue.Queue(self.QUEUE_SIZE)
        self._errors = 0
        self._closed = False
        self._thread = threading.Thread(target=self._send_loop, name="varuna-manager-heartbeat", daemon=True)
        self._thread.start()
        # The last steps' heartbeats are still queued when the script returns: send them
        # (bounded) so the manager learns the final step.
        atexit.register(self.close)
        # A first heartbeat before any step (step == resumed_from): the manager learns that this
        # worker is up and which checkpoint it resumed from, even if it has no step left to run.
        self._send(step=self._resumed_from, wall_time=time.time())

    @classmethod
    def from_env(cls, engine: Any, environ: dict[str, str] | None = None) -> WorkerReporter | None:
        """A reporter when the process was started by the manager (``VARUNA_MANAGER`` set),
        else None. Never raises for a missing manager: a script runs the same without one. An
        engine that already has one (:func:`attach_to_engine`) gets that one back."""
        existing = getattr(engine, "manager_reporter", None)
        if existing is not None:
            return existing
        env = os.environ if environ is None else environ
        try:
            config = ClientConfig.from_env(env)
        except ValueError as exc:
            print(f"varuna-manager client: not reporting: {exc}", file=sys.stderr, flush=True)
            return None
        if config is None:
            return None
        return cls(
            engine,
            ManagerClient(config),
            job_id=env.get("VARUNA_JOB_ID", ""),
            vm_id=env.get("VARUNA_VM_ID", ""),
            generation=int(env.get("VARUNA_GENERATION", "0") or 0),
        )

    def on_step(self, result: Any) -> None:
        """Queue the heartbeat of the step ``result`` (a ``varuna.StepResult``) just finished; a step
        already reported (by the step callback and the script both) is not sent again."""
        if int(result.step) <= self._last_step:
            return
        self._last_step = int(result.step)
        timings = getattr(result, "timings", None)
        if timings is not None:
            fwd, bwd, rec = (round(t, 9) for t in (timings.fwd_s, timings.bwd_s, timings.recompute_s))
            n = int(timings.num_forwards)
        else:
            fwd, bwd, rec, n = self._timeline_times()
        self._send(
            step=int(result.step),
            loss=float(result.loss),
            samples_per_s=float(result.samples_per_s),
            wall_time=float(result.wall_time),
            fwd_s=fwd,
            bwd_s=bwd,
            recompute_s=rec,
            num_microbatches=n,
        )

    def _timeline_times(self) -> tuple[float, float, float, int]:
        events = self._engine.timeline.events
        times = compute_times(events[self._seen :], self._stage, self._replica)
        if self._owns_timeline:
            events.clear()  # nobody else reads it: keep memory flat
            self._seen = 0
        else:
            self._seen = len(events)
        return times

    def _send(self, **fields: Any) -> None:
        request = pb.WorkerHeartbeatRequest(
            job_id=self._job_id,
            vm_id=self._vm_id,
            generation=self._generation,
            rank=self._rank,
            stage=self._stage,
            replica=self._replica,
            pipeline_depth=self._P,
            data_parallel=self._D,
            resumed_from=self._resumed_from,
            micro_batch_size=self._m,
            first_segment=self._segments[0],
            end_segment=self._segments[1],
            **fields,
        )
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            # Keep the newest: drop the oldest queued heartbeat.
            try:
                self._queue.get_nowait()
                self._queue.put_nowait(request)
            except (queue.Empty, queue.Full):
                pass

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (bounded by ``timeout_s``) and stop the sender thread."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        # A heartbeat still in flight (a manager that is down: wait_for_ready holds it until its
        # deadline) ends when the channel closes; the thread then sees _closed and returns.
        self._client.close()
        self._thread.join(timeout_s)

    def _send_loop(self) -> None:
        while True:
            try:
                request = self._queue.get(timeout=1.0)
            except queue.Empty:
                if self._closed:
                    return
                continue
            if request is None:
                return
            try:
                self._client.worker_heartbeat(request, timeout_s=2.0)
            except ValueError:  # grpc: "Cannot invoke RPC on closed channel" (close() gave up on it)
                return
            except grpc.RpcError as exc:
                if self._closed:  # cancelled by close(): what is left is dropped
                    return
                self._errors += 1
                # One line for the first failure and then every 100th: a restarting manager must
                # not flood the worker's log.
                if self._errors == 1 or self._errors % 100 == 0:
                    code = exc.code() if hasattr(exc, "code") else "?"
                    print(
                        f"varuna-manager client: heartbeat not delivered ({code}); {self._errors} so far",
                        file=sys.stderr,
                        flush=True,
                    )
                time.sleep(0.05)


def attach_to_engine(engine: Any) -> None:
    """Engine plugin (``$VARUNA_ENGINE_PLUGINS``, set by ``manager.worker_shim``): make a
    ``varuna.Engine`` a manager-supervised worker through its public hooks.

    - ``$VARUNA_CHECKPOINT_EVERY`` applies when the script left ``checkpoint_every`` at 0, so the
      job spec bounds how many steps a lost VM costs without the script knowing about it;
    - a :class:`WorkerReporter` (when ``$VARUNA_MANAGER`` is set) heartbeats after every step
      (``engine.add_step_callback``); it is ``engine.manager_reporter``.

    Example::

        VARUNA_ENGINE_PLUGINS=manager.client:attach_to_engine python train.py
    """
    every = os.environ.get("VARUNA_CHECKPOINT_EVERY", "")
    if every and not engine.checkpointer.every:
        engine.checkpointer.set_every(int(every))
    if getattr(engine, "manager_reporter", None) is not None:
        return
    slowdown = float(os.environ.get("VARUNA_VM_SLOWDOWN", "1") or 1)
    if slowdown > 1.0:  # before the reporter: the step it reports is the slowed one
        engine.add_step_callback(_SlowVM(slowdown))
    reporter = WorkerReporter.from_env(engine)
    engine.manager_reporter = reporter
    if reporter is not None:
        engine.add_step_callback(reporter.on_step)


class _SlowVM:
    """A pretend VM of a slower pool type (``$VARUNA_VM_SLOWDOWN`` f, set by the local provider):
    after each step, wait (f − 1) × the step's time, so the worker trains f times slower, as on a
    slower accelerator. The first step only starts the clock."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self._last: float | None = None

    def __call__(self, result: Any) -> None:
        now = time.monotonic()
        if self._last is not None:
            time.sleep((self.factor - 1.0) * (now - self._last))
        self._last = time.monotonic()
