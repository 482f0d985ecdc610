"""What both ends of a connection to the manager agree on, without gRPC: the bearer token's file
(:func:`load_token`) and how long a client waits between reconnect attempts
(:data:`MAX_RECONNECT_BACKOFF_S`: the transport sets its channels by it, the daemon's restart
grace counts on it). The token lives in a file, never on a command line or in an environment
variable, where ``ps`` and ``/proc/*/environ`` show it.

    >>> MAX_RECONNECT_BACKOFF_S <= 2.0
    True
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["MAX_RECONNECT_BACKOFF_S", "MIN_TOKEN_CHARS", "load_token"]

#: A token shorter than this is too easy to guess; ``secrets.token_urlsafe(32)`` gives 43 chars.
MIN_TOKEN_CHARS = 16

#: The longest a client waits between two connection attempts to a manager that is down; gRPC adds
#: up to 20 % jitter. A restarted manager allows this much before it counts silence (Note
#: [Restart grace] in manager/domain/context.py).
MAX_RECONNECT_BACKOFF_S = 1.0


def load_token(path: str | os.PathLike) -> str:
    """The token in ``path`` (surrounding whitespace stripped). ``ValueError`` with one line when
    the file is missing, empty, too short, or readable by other users."""
    p = Path(path)
    try:
        st = p.stat()
        text = p.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"cannot read token file {p}: {exc.strerror or exc}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"token file {p} is accessible by other users; run: chmod 600 {p}")
    if not text:
        raise ValueError(
            f"token file {p} is empty; write a random token, e.g. "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    if len(text) < MIN_TOKEN_CHARS or any(c.isspace() for c in text):
        raise ValueError(f"token in {p} must be at least {MIN_TOKEN_CHARS} characters without whitespace")
    return text
