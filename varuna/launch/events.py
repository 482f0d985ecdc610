"""The launcher's event log: one JSON object per line in ``--log-dir``'s ``events.jsonl``, for
operators and for tests that measure how fast a fault was seen (each line carries the launcher's
wall-clock ``time``).

Events (fields besides ``time`` and ``event``):

- ``host-silent``: ``host`` (``h1=10.0.0.5``), ``silent_s`` (how long its agent had said nothing
  when the launcher gave up on it), ``timeout_s``, ``ranks`` (lost with it);
- ``job-failed``: ``cause`` (the launcher's last line without its prefix), ``attempt``;
- ``restart``: ``attempt`` (1, 2, ...), ``of`` (``--max-restarts``), ``hosts``, ``left_out``,
  ``P``, ``D``, ``reason``;
- ``requeue`` (``--slurm``, after Slurm's stop signal): ``job`` (the Slurm job id), ``signal``,
  ``requeued`` (whether ``scontrol requeue`` took it), ``why`` (why not, else "").

Example::

    >>> log = EventLog(None)          # no --log-dir: nothing is written
    >>> log.record("restart", attempt=1)
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

__all__ = ["EVENTS_FILE", "EventLog"]

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends events to ``log_dir/events.jsonl`` (None: a no-op); safe from any thread."""

    def __init__(self, log_dir: str | Path | None) -> None:
        self.path = Path(log_dir) / EVENTS_FILE if log_dir is not None else None
        self._lock = threading.Lock()

    def record(self, event: str, **fields: object) -> None:
        """Append one event, stamped with ``time.time()``; never raises (a log is no reason to fail)."""
        if self.path is None:
            return
        line = json.dumps({"time": time.time(), "event": event, **fields}, default=str)
        with self._lock:
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(line + "\n")
            except OSError:
                pass

    def __call__(self, event: str, **fields: object) -> None:
        self.record(event, **fields)
