"""The line protocol between ``varuna-launch`` and its per-host agents
(:mod:`varuna.launch.agent`): one ASCII JSON object per line, over the agent's stdin/stdout
(the ssh channel for a remote host, srun's for a Slurm job step).

Note [Agent protocol] (version :data:`PROTOCOL_VERSION`). Agent → launcher:

- ``{"type": "ready", "protocol": 2, "pid": P, "hostname": H, "free_port": N}`` once, first
  (``free_port``: a port free on this host, used as MASTER_PORT when this is host 0);
- ``{"type": "spawned", "started": [{"rank": r, "pid": p}, ...], "failed": null | {"rank": r,
  "error": "..."}}`` answers a spawn request (after a failure the rest are not started);
- ``{"type": "out", "rank": r, "stream": "stdout"|"stderr", "line": "...\\n"}`` per output line;
- ``{"type": "exit", "rank": r, "code": c}`` after the worker's last output line (``c < 0``:
  killed by signal ``-c``; its leftover processes are already killed);
- ``{"type": "message", "text": "..."}`` agent diagnostics; ``{"type": "bye"}`` last;
- ``{"type": "beat"}`` every :data:`BEAT_INTERVAL_S` (Note [Silent hosts]);
- ``{"type": "signaled", "signal": "SIGUSR1"|"SIGTERM"|"SIGINT"}``: the agent (started with
  ``--report-signals``, a Slurm job step) received this signal from the scheduler and leaves the
  stop to the launcher (an older launcher ignores the line, as any unknown type).

Launcher → agent:

- ``{"type": "spawn", "workers": [{"rank": r, "argv": [...], "env": {...}, "cwd": "..."}]}``;
  ``env`` is added to the agent's environment (ssh forwards none of the launcher's);
- ``{"type": "signal", "rank": r, "signal": "SIGTERM"}`` (``rank`` null: every worker);
- ``{"type": "ping"}`` every :data:`BEAT_INTERVAL_S`, ``{"type": "shutdown"}``.

The launcher refuses an agent whose "ready" line names another protocol version (the message
names both: install the same varuna on every host).

Note [Silent hosts]: a host whose packets vanish (a partition, an evicted VM) resets nothing, so
neither side of the channel sees it end; each side watches the other's lines instead. Both
send one every :data:`BEAT_INTERVAL_S` at the least (a beat, a ping, or real traffic), from a
loop that never blocks on the channel, and both give up after the same silence (the launcher's
``--host-timeout``, :data:`SILENCE_TIMEOUT_S` by default, which it passes to every agent as
``--heartbeat-timeout``): the launcher declares the host silent and its ranks lost, naming them
(its detection: at most the timeout plus one check, 0.25 s, after the host's last word); the
agent, cut off from the launcher, kills its workers at the same time, so a silent host's workers
are gone before a relaunch (seconds of process start after the detection) can start the next
generation. ssh's own keepalive (``ServerAliveInterval`` 2 s × ``ServerAliveCountMax`` 3,
:mod:`varuna.launch.ssh`) ends the ssh client 6-8 s into a silence, a backstop behind both.

Example::

    >>> decode_message(encode_message({"type": "signal", "rank": 3, "signal": "SIGTERM"}))["rank"]
    3
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["BEAT_INTERVAL_S", "PROTOCOL_VERSION", "SILENCE_TIMEOUT_S", "decode_message", "encode_message"]

#: Version 2: agents beat (Note [Silent hosts]); a version-1 agent would look silent when idle.
PROTOCOL_VERSION = 2
#: Each side of an agent's channel sends at least one line this often (Note [Silent hosts]).
BEAT_INTERVAL_S = 1.0
#: How long a side's silence means the other is gone, by default (``varuna-launch
#: --host-timeout``): four missed beats, within the 5 s a silent host must be named in.
SILENCE_TIMEOUT_S = 4.0


def encode_message(message: Mapping[str, Any]) -> bytes:
    """One protocol line (ASCII JSON, so no byte of it can be a newline inside a string).

    Example::

        >>> encode_message({"type": "ping"})
        b'{"type":"ping"}\\n'
    """
    return json.dumps(message, separators=(",", ":"), ensure_ascii=True).encode("ascii") + b"\n"


def decode_message(raw: bytes) -> dict[str, Any]:
    """Parse one protocol line; ``ValueError`` if it is not a JSON object with a ``type``.

    Example::

        >>> decode_message(b'{"type":"ping"}\\n')
        {'type': 'ping'}
    """
    try:
        msg = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a protocol line: {raw[:80]!r}") from exc
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ValueError(f"not a protocol message: {raw[:80]!r}")
    return msg
