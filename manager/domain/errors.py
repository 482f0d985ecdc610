"""A request the manager refuses: :class:`ManagerError` with a domain :class:`ErrorKind`. The
transport maps each kind to its wire status (``manager.transport.server``); the domain never
sees a gRPC status code.

    >>> err = ManagerError(ErrorKind.NOT_FOUND, "no job 'x'")
    >>> err.kind.name, err.message
    ('NOT_FOUND', "no job 'x'")
"""

from __future__ import annotations

import enum

__all__ = ["ErrorKind", "ManagerError"]


class ErrorKind(enum.Enum):
    """Why a request is refused."""

    INVALID_ARGUMENT = "invalid-argument"
    """The request itself is wrong (a bad job spec): the caller must change it."""
    NOT_FOUND = "not-found"
    """It names a job or VM the manager does not know."""
    FAILED_PRECONDITION = "failed-precondition"
    """Right, but not now or not here (a VM no longer wanted, a pool job without a pool, an extra
    missing on the manager's host)."""


class ManagerError(Exception):
    """A request the manager refuses: ``kind`` says why, ``message`` is the one line for people."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
