"""File descriptors of the daemon: raise the soft limit at start, and say how many the dashboard
may hold so that gRPC, SQLite and the providers keep their own (Note [Dashboard limits] in
manager/dashboard/web.py).

A soft limit of 1,024 is common (it is systemd's and most shells' default) while the hard limit
is usually far higher: the soft one exists for programs that still use ``select()``, which the
manager does not (gRPC uses epoll, asyncio its selector's epoll). So ``serve`` raises its soft
limit to the hard one, as servers such as nginx (``worker_rlimit_nofile``) and the JVM do.

    >>> dashboard_connections(soft_limit=1024, wanted=256)
    256
    >>> dashboard_connections(soft_limit=600, wanted=256)
    88
"""

from __future__ import annotations

import resource

__all__ = ["RESERVED_DESCRIPTORS", "dashboard_connections", "raise_soft_limit", "soft_limit"]

#: Descriptors kept for everything but the dashboard's connections: gRPC's listening socket and
#: its clients (agents, workers, the CLI), the state file with its WAL, the providers' sockets
#: and subprocesses, the Python runtime's own.
RESERVED_DESCRIPTORS = 512

#: The soft limit is raised at most this far (an unlimited hard limit is not a number the
#: kernel takes: ``fs.nr_open`` caps it).
_MAX_SOFT = 1 << 20


def raise_soft_limit() -> int:
    """Raise ``RLIMIT_NOFILE``'s soft limit to the hard one (at most 2^20); the soft limit in
    force afterwards. A refusal leaves the limit as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _MAX_SOFT if hard == resource.RLIM_INFINITY else min(hard, _MAX_SOFT)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    return soft_limit()


def soft_limit() -> int:
    """The soft ``RLIMIT_NOFILE`` now (2^20 when unlimited)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _MAX_SOFT if soft == resource.RLIM_INFINITY else int(soft)


def dashboard_connections(*, soft_limit: int, wanted: int) -> int:
    """How many connections the dashboard may hold: ``wanted``, but never into the
    :data:`RESERVED_DESCRIPTORS` (and at least 8: a dashboard that serves nobody is no use)."""
    return max(8, min(wanted, soft_limit - RESERVED_DESCRIPTORS))
