"""Lifecycle lines: how far a worker got, told to ``varuna-launch`` on the worker's stdout.

Note [Lifecycle lines]: a worker that exits 0 before it builds its Engine (an early ``return`` or
``sys.exit(0)`` on some ranks, a script that never calls varuna on them) leaves the other ranks
waiting for it in the rendezvous, silent until their timeouts (~305 s), and the launcher saw
nothing wrong: exit 0 is a success. So the launcher sets ``VARUNA_LIFECYCLE=1``
(``plan_workers(..., lifecycle_lines=True)``) and the engine prints one marker line per phase:

- ``VARUNA_LIFECYCLE rendezvous``: the Engine is about to join the process group; from here on
  this rank waits for every other rank;
- ``VARUNA_LIFECYCLE built``: the Engine is constructed;
- ``VARUNA_LIFECYCLE closed``: the Engine was closed (also at exit, Note [Teardown at exit]).

The launcher's supervisor swallows these lines (they reach ``--log-dir``'s logs only) and
``varuna.launch.early_exit`` decides: a rank that exits 0 without ``built`` while another rank
waits (its last phase ``rendezvous`` or ``built``) is the job's failure, in one line, at once.
Only the Engine prints them -- not ``init_distributed`` alone, which a script may use without an
Engine -- and only when asked: torchrun, a plain ``python train.py`` and the manager's workers
print nothing (the manager's path still waits out the timeouts, docs/launch.md).

The line is written to file descriptor 1 after flushing ``sys.stdout``, so it never sits in a
buffer behind the script's output; a script's unfinished line (``print(..., end="")``) may still
precede it on the same line, which :func:`split_marker` handles. This module is pure Python (no
torch): the launcher parses what the engine prints.

Example::

    >>> marker_line("built")
    'VARUNA_LIFECYCLE built\\n'
    >>> split_marker("VARUNA_LIFECYCLE rendezvous\\n")
    ('', 'rendezvous')
    >>> split_marker("loss 0.25 VARUNA_LIFECYCLE closed\\n")
    ('loss 0.25 ', 'closed')
    >>> split_marker("VARUNA_LIFECYCLE is on\\n")
    ('VARUNA_LIFECYCLE is on\\n', None)
"""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = [
    "BUILT",
    "CLOSED",
    "LIFECYCLE_VAR",
    "MARKER",
    "PHASES",
    "RENDEZVOUS",
    "emit",
    "marker_line",
    "split_marker",
]

#: The environment variable that asks the engine for lifecycle lines ("1"); read through
#: ``varuna.core.env.WorkerSettings.lifecycle`` (Note [One parser]).
LIFECYCLE_VAR = "VARUNA_LIFECYCLE"
#: What starts every lifecycle line; the phase follows after one space.
MARKER = "VARUNA_LIFECYCLE"
RENDEZVOUS = "rendezvous"
BUILT = "built"
CLOSED = "closed"
#: The phases, in the order one Engine goes through them.
PHASES = (RENDEZVOUS, BUILT, CLOSED)


def marker_line(phase: str) -> str:
    """The line that announces ``phase`` (one of :data:`PHASES`), newline included.

    Example::

        >>> marker_line("closed")
        'VARUNA_LIFECYCLE closed\\n'
    """
    if phase not in PHASES:
        raise ValueError(f"unknown lifecycle phase {phase!r}; use one of {', '.join(PHASES)}")
    return f"{MARKER} {phase}\n"


def split_marker(line: str) -> tuple[str, str | None]:
    """``(text, phase)``: a line that ends with a marker gives what came before it (the script's
    unfinished line, usually "") and the phase; any other line is ``(line, None)``.

    Example::

        >>> split_marker("step 1\\n")
        ('step 1\\n', None)
    """
    body = line.rstrip("\r\n")
    head, sep, phase = body.rpartition(f"{MARKER} ")
    if not sep or phase not in PHASES:
        return line, None
    return head, phase


def emit(phase: str, *, enabled: bool) -> None:
    """Print the marker of ``phase`` on this process's stdout when ``enabled`` (the worker's
    ``WorkerSettings.lifecycle``); never raises (a closed stdout loses the line, not the run).

    Example::

        >>> emit("built", enabled=False)  # nothing printed: not under varuna-launch
    """
    if not enabled:
        return
    line = marker_line(phase).encode()
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stdout.flush()  # the script's own output first, in order
    with contextlib.suppress(OSError):
        os.write(1, line)  # fd 1, past any buffer a script put on sys.stdout
