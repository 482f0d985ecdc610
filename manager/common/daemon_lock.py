"""One manager daemon per state file: an exclusive ``flock`` on ``<db>.lock``, held for the
daemon's life. ``<db>`` is the state file's real path (symbolic links resolved), so two names of
one file (a link, ``./state.sqlite`` and an absolute path) find the same lock.

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
    """The lock file of state file ``db``: beside the file ``db`` names once every symbolic link
    is resolved, so every name of that file finds it (a link to the state file once got past the
    lock: issue 35)."""
    return f"{os.path.realpath(db)}.lock"


class DaemonLock:
    """The held lock of one state file; :meth:`release` (idempotent) or process exit frees it."""

    def __init__(self, path: str, fd: int, db: str = "") -> None:
        self.path = path
        self.db = db
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, db: str) -> DaemonLock:
        """Lock ``db``'s lock file without waiting. Raises :class:`DaemonLockHeld` (naming the
        holder's PID) when another process holds it, ``OSError`` when the file cannot be made."""
        path = lock_path(db)
        return cls(path, _lock(path, db), db)

    def ensure(self) -> None:
        """Hold the lock of the file now at :attr:`path` (after the directory was emptied under
        the daemon, the old lock file is gone and a successor could lock a new one: Note [State
        file vanishing] in manager/domain/state_file.py). :class:`DaemonLockHeld` when another
        process holds the new one; a no-op while the held file is still the one at the path."""
        if self._fd is None:
            raise OSError(f"the lock {self.path} was released")
        held = os.fstat(self._fd)
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            there = None
        if there is not None and (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino):
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd = _lock(self.path, self.db)
        os.close(self._fd)
        self._fd = fd

    def release(self) -> None:
        """Free the lock (the file stays: removing it would race with a successor locking it)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.close(fd)  # closing the only descriptor drops the flock


def _lock(path: str, db: str) -> int:
    """The descriptor of ``path``, flocked (``DaemonLockHeld`` when another process holds it),
    with our PID written in it."""
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
    return fd


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
