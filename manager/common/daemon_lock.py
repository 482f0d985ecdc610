"""One manager daemon per state file: an exclusive ``flock`` on ``<db>.lock``, held for the
daemon's life.

Two ``varuna-manager serve`` on one database would both run the control loop and supervise the
same jobs (double launches, VMs deleted under the other's feet). The second one must refuse
before it touches the database. A lock the kernel holds for an open file descriptor is released
when the process dies, however it dies, so a ``kill -9``'d manager never blocks its successor
(a PID file alone would go stale). The file keeps the holder's PID for the error message only.

    >>> import tempfile, os
    >>> db = os.path.join(tempfile.mkdtemp(), "state.sqlite")
    >>> lock = DaemonLock.acquire(db)
    >>> DaemonLock.acquire(db)
    Traceback (most recent call last):
    ...
    manager.common.daemon_lock.DaemonLockHeld: another varuna-manager (PID ...) is serving ...
    >>> lock.release()
    >>> DaemonLock.acquire(db).release()
"""

from __future__ import annotations

import fcntl
import os

__all__ = ["DaemonLock", "DaemonLockHeld", "lock_path"]


class DaemonLockHeld(OSError):
    """Another live process holds the state file's lock."""


def lock_path(db: str) -> str:
    """The lock file of state file ``db`` (beside it, so every manager of that file finds it)."""
    return f"{db}.lock"


class DaemonLock:
    """The held lock of one state file; :meth:`release` (idempotent) or process exit frees it."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, db: str) -> DaemonLock:
        """Lock ``db``'s lock file without waiting. Raises :class:`DaemonLockHeld` (naming the
        holder's PID) when another process holds it, ``OSError`` when the file cannot be made."""
        path = lock_path(db)
        # O_CLOEXEC: agents and other children must not inherit the lock and keep it after we die.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"PID {holder}" if holder else "PID unknown"
            raise DaemonLockHeld(
                f"another varuna-manager ({who}) is serving {db} (lock {path}); stop it first, or "
                "use another --db"
            ) from None
        except OSError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Free the lock (the file stays: removing it would race with a successor locking it)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.close(fd)  # closing the only descriptor drops the flock


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
