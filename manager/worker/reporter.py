"""What a training worker sends the manager: one heartbeat per step (step, throughput, loss,
per-micro-batch forward/backward compute times), from :class:`WorkerReporter`. It never blocks or
breaks training: heartbeats go out from a background thread, and when the manager is unreachable
(restarting) they are dropped.

A worker started by the manager's agent finds everything in its environment::

    VARUNA_MANAGER=host:port   VARUNA_MANAGER_TOKEN_FILE=/path   [VARUNA_MANAGER_TLS_CA=/path]
    VARUNA_JOB_ID, VARUNA_VM_ID, VARUNA_GENERATION

``python -m manager.worker.shim`` attaches a reporter to every engine of an unmodified script
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
from typing import Any

import grpc

from manager.transport import varuna_manager_pb2 as pb
from manager.transport.client import ClientConfig, ManagerClient

__all__ = ["WorkerReporter", "attach_to_engine", "compute_times"]


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
    """Engine plugin (``$VARUNA_ENGINE_PLUGINS``, set by ``manager.worker.shim``): make a
    ``varuna.Engine`` a manager-supervised worker through its public hooks.

    - ``$VARUNA_CHECKPOINT_EVERY`` applies when the script left ``checkpoint_every`` at 0, so the
      job spec bounds how many steps a lost VM costs without the script knowing about it;
    - a :class:`WorkerReporter` (when ``$VARUNA_MANAGER`` is set) heartbeats after every step
      (``engine.add_step_callback``); it is ``engine.manager_reporter``.

    Example::

        VARUNA_ENGINE_PLUGINS=manager.worker.reporter:attach_to_engine python train.py
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
