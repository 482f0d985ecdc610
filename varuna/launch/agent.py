"""``python -m varuna.launch.agent``: the per-host agent that runs one host's workers for the launcher.

The launcher starts one agent per host, over ssh (``ssh HOST exec env PYTHONPATH=... python -m
varuna.launch.agent ...``) or, for a pretend ``localhost`` host, as a local process. The agent talks to
the launcher over its own stdin/stdout (the ssh channel), one JSON object per line (Note [Agent
protocol] in :mod:`varuna.launch.protocol`); its stderr carries its own diagnostics, which the
launcher relays.

The agent starts workers exactly as the single-machine launcher does (``LocalHost.spawn``: own
session, parent-death signal, group kill on exit; Note [No orphans] in :mod:`varuna.launch.procs`), so
killing the agent by any means takes its workers with it.

Launcher gone: EOF on stdin, a broken stdout, or no line for ``--heartbeat-timeout`` seconds (a
network partition keeps a TCP connection open for hours; Note [Silent hosts] in
:mod:`varuna.launch.protocol`) all mean the launcher is gone; the agent then SIGKILLs every worker
group, reaps them and exits. The agent beats every second, and its main loop never waits on the
channel: lines go out through a writer thread, so a channel stalled by a partition cannot keep
the agent from noticing the silence. SIGTERM/SIGINT/SIGHUP to the agent do the same; SIGUSR1 to
the agent is forwarded to every worker (a local "checkpoint and stop").

With ``--report-signals`` (an agent started as a Slurm job step, Note [Agents as job steps] in
:mod:`varuna.launch.srun`) SIGUSR1, SIGTERM and SIGINT are Slurm's stop of the whole job, which
reaches every step: the agent reports each to the launcher (a ``signaled`` line) and does nothing
itself; the launcher makes one graceful stop of them. Its workers keep running until the launcher
says otherwise (or is gone).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO, Any

from varuna.core.env import WorkerEnv
from varuna.launch.local import LocalHost, LocalWorker
from varuna.launch.procs import find_free_port
from varuna.launch.protocol import (
    BEAT_INTERVAL_S,
    PROTOCOL_VERSION,
    SILENCE_TIMEOUT_S,
    decode_message,
    encode_message,
)
from varuna.launch.spec import WorkerSpec

__all__ = ["HEARTBEAT_TIMEOUT_S", "Agent", "main"]

#: Default for ``--heartbeat-timeout`` (the launcher passes its ``--host-timeout``): the launcher
#: pings every second; this much silence means it is gone or cut off (Note [Silent hosts]).
HEARTBEAT_TIMEOUT_S = SILENCE_TIMEOUT_S
#: Lines queued for the launcher beyond which worker output waits (the agent's own never does).
MAX_QUEUED_LINES = 10_000
#: Longest request line accepted; a spawn request of a few workers is a few KiB.
MAX_LINE_BYTES = 16 << 20
#: How long the exit report of a worker waits for its last output lines (its pipes are closed
#: once its group is killed, unless a process escaped the group with setsid).
OUTPUT_DRAIN_TIMEOUT_S = 5.0

#: What ``--report-signals`` reports instead of acting on (Slurm's stop of the job).
_REPORTED_SIGNALS = frozenset({signal.SIGUSR1, signal.SIGTERM, signal.SIGINT})
_ALLOWED_SIGNALS = frozenset({"SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGKILL", "SIGCONT"})


class Agent:
    """The agent's state and main loop; see the module docstring. Run :meth:`run` in the main
    thread: workers get a parent-death signal tied to the thread that forks them."""

    def __init__(
        self,
        *,
        job_id: str,
        host_id: int,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        stdin_fd: int = 0,
        stdout: IO[bytes] | None = None,
        report_signals: bool = False,
    ) -> None:
        self.job_id = job_id
        self._report_signals = report_signals
        self.host_id = host_id
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._stdin_fd = stdin_fd
        self._out = stdout if stdout is not None else sys.stdout.buffer
        self._out_queue: list[bytes] = []
        self._out_cond = threading.Condition()
        self._writer_done = False
        self._writer = threading.Thread(target=self._write_loop, name="agent-writer", daemon=True)
        self._workers: dict[int, LocalWorker] = {}
        self._readers: dict[int, list[threading.Thread]] = {}
        self._exited: dict[int, tuple[int, float]] = {}  # rank -> (code, report deadline)
        self._reported: set[int] = set()
        self._stopping: str | None = None  # why every worker is being killed
        self._launcher_gone = False
        self._pending_signals: list[int] = []
        self._stdin_open = True
        self._buffer = b""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # -- output to the launcher ----------------------------------------------------------------

    def emit(self, message: Mapping[str, Any], *, wait: bool = False) -> None:
        """Queue one line for the launcher (the writer thread sends it); ``wait``: first wait
        while too many lines are queued (worker output: back-pressure on a chatty worker, never
        on the agent's own loop). A broken channel means the launcher is gone."""
        data = encode_message(message)
        with self._out_cond:
            while wait and len(self._out_queue) >= MAX_QUEUED_LINES and not self._launcher_gone:
                self._out_cond.wait(1.0)
            if self._launcher_gone:
                return
            self._out_queue.append(data)
            self._out_cond.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._out_cond:
                while not self._out_queue and not self._writer_done:
                    self._out_cond.wait()
                if not self._out_queue:
                    return
                batch = b"".join(self._out_queue)
                self._out_queue.clear()
                self._out_cond.notify_all()
            try:
                self._out.write(batch)
                self._out.flush()
            except (OSError, ValueError):
                with self._out_cond:
                    self._launcher_gone = True
                    self._out_queue.clear()
                    self._out_cond.notify_all()
                self._wake()
                return

    def _flush_and_stop_writer(self, timeout_s: float) -> None:
        """Let the writer send what is queued ("bye" last), bounded: a stalled channel (the
        launcher cut off) must not keep the agent from exiting."""
        with self._out_cond:
            self._writer_done = True
            self._out_cond.notify_all()
        self._writer.join(timeout_s)

    def _say(self, text: str) -> None:
        print(f"varuna-agent[{self.host_id}]: {text}", file=sys.stderr, flush=True)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def notify_signal(self, signum: int) -> None:
        """Signal handler body: queue and wake the loop (no locks in a handler)."""
        self._pending_signals.append(signum)
        self._wake()

    # -- requests ------------------------------------------------------------------------------

    def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "spawn":
            self._spawn(msg.get("workers", []))
        elif kind == "signal":
            name = str(msg.get("signal"))
            if name not in _ALLOWED_SIGNALS:
                self.emit({"type": "message", "text": f"ignoring request for signal {name!r}"})
                return
            rank = msg.get("rank")
            targets = (
                self._running() if rank is None else [w for w in self._running() if w.spec.env.rank == rank]
            )
            for worker in targets:
                worker.send_signal(getattr(signal, name))
        elif kind == "shutdown":
            self._begin_stop("the launcher asked to shut down")
        # "ping" (and unknown types from a newer launcher) only count as a sign of life.

    def _spawn(self, requests: list[dict[str, Any]]) -> None:
        started: list[dict[str, int]] = []
        failed: dict[str, Any] | None = None
        new: list[LocalWorker] = []
        if self._stopping is not None:
            failed = {
                "rank": requests[0]["rank"] if requests else -1,
                "error": f"agent is stopping ({self._stopping})",
            }
        for request in requests if failed is None else ():
            rank = int(request["rank"])
            try:
                env_vars = {str(k): str(v) for k, v in dict(request["env"]).items()}
                # Line-buffered output, so lines arrive as printed (the local launcher's default).
                env_vars.setdefault("PYTHONUNBUFFERED", "1")
                spec = WorkerSpec(
                    env=WorkerEnv.from_env(env_vars),
                    argv=tuple(str(a) for a in request["argv"]),
                    set_vars=env_vars,
                    cwd=request.get("cwd"),
                )
                worker = LocalHost(slots=1).spawn(spec)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                failed = {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
                break
            self._workers[rank] = worker
            new.append(worker)
            started.append({"rank": rank, "pid": worker.pid})
        self.emit({"type": "spawned", "started": started, "failed": failed})
        # Output threads only after the whole batch is forked: a fork while another thread of
        # ours holds a lock could deadlock the child before exec (Note [No orphans]).
        for worker in new:
            rank = worker.spec.env.rank
            self._readers[rank] = [
                threading.Thread(
                    target=self._relay,
                    args=(rank, stream, name),
                    name=f"agent-relay-{rank}-{name}",
                    daemon=True,
                )
                for stream, name in zip(worker.output_streams, ("stdout", "stderr"))
            ]
            for thread in self._readers[rank]:
                thread.start()

    def _relay(self, rank: int, stream: IO[bytes], name: str) -> None:
        try:
            for raw in iter(stream.readline, b""):
                text = raw.decode("utf-8", errors="replace")
                if not text.endswith("\n"):
                    text += "\n"
                self.emit({"type": "out", "rank": rank, "stream": name, "line": text}, wait=True)
        except (OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError):
                stream.close()

    # -- supervision ---------------------------------------------------------------------------

    def _running(self) -> list[LocalWorker]:
        return [w for r, w in self._workers.items() if r not in self._exited]

    def _begin_stop(self, why: str) -> None:
        if self._stopping is None:
            self._stopping = why
            running = self._running()
            if running:
                self._say(f"{why}; killing {len(running)} worker(s)")
        for worker in self._running():
            worker.send_signal(signal.SIGKILL)

    def _poll_workers(self) -> None:
        now = time.monotonic()
        for rank, worker in list(self._workers.items()):
            if rank not in self._exited:
                code = worker.poll()  # on exit: leftovers of its group are killed, then it is reaped
                if code is not None:
                    self._exited[rank] = (code, now + OUTPUT_DRAIN_TIMEOUT_S)
        for rank, (code, deadline) in self._exited.items():
            if rank in self._reported:
                continue
            if any(t.is_alive() for t in self._readers.get(rank, ())) and now < deadline:
                continue  # its last lines are still on their way; report the exit after them
            self._reported.add(rank)
            self.emit({"type": "exit", "rank": rank, "code": code})

    def _on_signal(self, signum: int) -> None:
        if self._report_signals and signum in _REPORTED_SIGNALS:
            self._say(f"received {signal.Signals(signum).name}; reporting it to the launcher")
            self.emit({"type": "signaled", "signal": signal.Signals(signum).name})
            return
        if signum == signal.SIGUSR1:
            for worker in self._running():
                worker.send_signal(signum)
        else:
            self._begin_stop(f"received {signal.Signals(signum).name}")

    def _read_requests(self) -> bool:
        """Wait up to 50 ms for requests and handle them; whether the launcher said anything."""
        fds = [self._wake_r] + ([self._stdin_fd] if self._stdin_open else [])
        try:
            readable, _, _ = select.select(fds, [], [], 0.05)
        except InterruptedError:
            return False
        if self._wake_r in readable:
            with contextlib.suppress(BlockingIOError, OSError):
                os.read(self._wake_r, 4096)
        if not (self._stdin_open and self._stdin_fd in readable):
            return False
        chunk = os.read(self._stdin_fd, 65536)
        if not chunk:
            self._stdin_open = False
            self._begin_stop("the launcher is gone (EOF on stdin)")
            return False
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            try:
                self._handle(decode_message(line))
            except (ValueError, KeyError, TypeError) as exc:
                self.emit({"type": "message", "text": f"bad request ignored: {exc}"})
        if len(self._buffer) > MAX_LINE_BYTES:
            self._buffer = b""
            self.emit({"type": "message", "text": "oversized request dropped"})
        return True

    def run(self) -> int:
        """Serve until shut down or the launcher is gone; 0 after a shutdown request, else 1."""
        self._writer.start()
        self.emit(
            {
                "type": "ready",
                "protocol": PROTOCOL_VERSION,
                "pid": os.getpid(),
                "hostname": socket.gethostname(),
                "free_port": find_free_port(),
                "job_id": self.job_id,
            }
        )
        last_heard = last_beat = time.monotonic()
        stop_deadline: float | None = None
        while True:
            if time.monotonic() - last_beat >= BEAT_INTERVAL_S:
                last_beat = time.monotonic()
                self.emit({"type": "beat"})  # Note [Silent hosts]
            while self._pending_signals:
                self._on_signal(self._pending_signals.pop(0))
            if self._launcher_gone:
                self._begin_stop("the launcher is gone (its channel broke)")
            if self._read_requests():
                last_heard = time.monotonic()
            if (
                self._heartbeat_timeout_s > 0
                and self._stopping is None
                and time.monotonic() - last_heard > self._heartbeat_timeout_s
            ):
                self._begin_stop(
                    f"no word from the launcher for {self._heartbeat_timeout_s:g} s (cut off: fencing"
                    " this host)"
                )
            self._poll_workers()
            if self._stopping is not None:
                if stop_deadline is None:
                    stop_deadline = time.monotonic() + 2 * OUTPUT_DRAIN_TIMEOUT_S
                self._begin_stop(self._stopping)  # also workers started since (none, normally)
                if len(self._reported) == len(self._workers) or time.monotonic() > stop_deadline:
                    break
        unreaped = [r for r in self._workers if r not in self._exited]
        if unreaped:
            self._say(f"rank(s) {unreaped} could not be reaped (stuck in the kernel?)")
        self.emit({"type": "bye"})
        self._flush_and_stop_writer(OUTPUT_DRAIN_TIMEOUT_S)
        return 0 if self._stopping == "the launcher asked to shut down" else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m varuna.launch.agent`` (started by ``varuna-launch``, not by hand)."""
    parser = argparse.ArgumentParser(
        prog="varuna-agent", description="Per-host agent of varuna-launch; speaks JSON lines on stdin/stdout."
    )
    parser.add_argument("--job-id", required=True, help="the launcher's job id (for process listings)")
    parser.add_argument("--host-id", type=int, required=True, help="index of this host in the job")
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=HEARTBEAT_TIMEOUT_S,
        metavar="S",
        help=f"stop the workers after S seconds without a line from the launcher (default"
        f" {HEARTBEAT_TIMEOUT_S:g}; 0 disables)",
    )
    parser.add_argument(
        "--report-signals",
        action="store_true",
        help="report SIGUSR1/SIGTERM/SIGINT to the launcher instead of acting on them (srun agents)",
    )
    args = parser.parse_args(argv)
    agent = Agent(job_id=args.job_id, host_id=args.host_id, heartbeat_timeout_s=args.heartbeat_timeout,
                  report_signals=args.report_signals)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, lambda s, _frame: agent.notify_signal(s))
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
