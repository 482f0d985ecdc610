"""A rank's local staging directory for checkpoint writes, and the sweep of those whose process died.

Note [Staging leftovers]: without ``checkpoints.local_dir`` each rank stages its files in a fresh
temporary directory (``varuna-ckpt-rank<r>-*``: the last save's shards, as big as the rank's part of
the model) that a finalizer removes when the process ends. A process killed with SIGKILL (a
preempted or fenced worker, a relaunch after a silent host) never runs it, so on a machine whose
workers are restarted again and again (``varuna-launch --max-restarts``, a manager relaunching on the
VMs left, a test suite) those directories pile up until the disk is full (this machine's ``/tmp``
held 353 of them after a day of test runs). So a staging directory holds an exclusive ``flock`` on
its ``.owner`` file for the life of its process: the kernel drops the lock when the process dies,
however it dies, and for every process sharing the file system whatever its pid namespace. Each
new staging directory first sweeps the others: one whose lock can be taken is removed, unless it is
younger than :data:`MIN_AGE_S` (so a directory being created right now, before its owner locked it,
is never taken for dead). A directory without an ``.owner`` file (an older version's) is left alone.

    >>> import tempfile
    >>> parent = tempfile.mkdtemp()
    >>> staging = create_staging(0, parent=parent)
    >>> staging.path.name.startswith("varuna-ckpt-rank0-"), sweep_stale(parent, min_age_s=0.0)
    (True, [])
    >>> staging.close(); staging.path.exists()
    False
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MIN_AGE_S", "OWNER_FILE", "STAGING_PREFIX", "Staging", "create_staging", "sweep_stale"]

log = logging.getLogger(__name__)

#: Name prefix of the staging directories (``varuna-ckpt-rank<r>-<random>``).
STAGING_PREFIX = "varuna-ckpt-rank"
#: The file whose lock says the directory's process is alive.
OWNER_FILE = ".owner"
#: A directory younger than this is never swept (its owner may not have locked it yet).
MIN_AGE_S = 60.0


@dataclass
class Staging:
    """A staging directory and the open, locked ``.owner`` file that keeps it from being swept."""

    path: Path
    fd: int

    def close(self) -> None:
        """Release the lock and remove the directory (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        shutil.rmtree(self.path, ignore_errors=True)


def create_staging(rank: int, parent: str | os.PathLike | None = None) -> Staging:
    """Sweep the dead ranks' leftovers under ``parent`` (default: the temp directory), then make
    this rank's staging directory there and lock it for this process's life (Note [Staging
    leftovers])."""
    base = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    sweep_stale(base)
    path = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{rank}-", dir=base))
    fd = os.open(path / OWNER_FILE, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by exec'd children
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a file nobody else has opened yet: never busy
    return Staging(path=path, fd=fd)


def sweep_stale(parent: str | os.PathLike, *, min_age_s: float = MIN_AGE_S) -> list[Path]:
    """Remove the staging directories under ``parent`` whose process is gone; the removed ones.

    Best effort: a directory that cannot be read, locked or removed is left as it is."""
    removed: list[Path] = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(STAGING_PREFIX) or entry.is_symlink() or not entry.is_dir():
            continue
        owner = entry / OWNER_FILE
        try:
            if now - max(entry.stat().st_mtime, owner.stat().st_mtime) < min_age_s:
                continue
            fd = os.open(owner, os.O_RDWR)
        except OSError:  # no owner file (an older version's), gone meanwhile, or not ours
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its process is alive
            os.close(fd)
            continue
        try:
            shutil.rmtree(entry, ignore_errors=True)
        finally:
            os.close(fd)
        if not entry.exists():
            removed.append(entry)
            log.info("varuna: removed %s, the checkpoint staging directory of a process that is gone", entry)
    return removed
