"""Fencing the checkpoint store: a commit from an older generation is refused, however late it comes.

Note [Checkpoint fence]
~~~~~~~~~~~~~~~~~~~~~~~
A host cut off by a partition keeps running until its agent fences it (Note [Silent hosts] in
varuna/launch/protocol.py); a worker there whose checkpoint copy was already under way may still
reach a *shared* checkpoint store (the partition cut the job's network, not the share) and commit
late, after the next generation started from an older checkpoint, or overwrite that generation's
files. Timing alone cannot exclude it (a process stopped in the kernel, a slow share), so the store
itself refuses: every generation of a job carries a :class:`FenceToken`, ordered, and the store's
root holds the newest token that started (``fence.json``):

- **Raise.** Rank 0 of each new generation writes its token there (:func:`raise_fence`, atomic,
  never lowering it) *before it loads a checkpoint* (``Checkpointer.attach``), and the survivors
  of a live morph raise it for their new generation (``Checkpointer.start_generation``). So a
  commit that lands before the raise is visible to the new generation's load; one after it is
  refused.
- **Check.** Every writer checks the fence right before each file of a save is renamed into the
  step directory and before its marker, and rank 0 right before the commit file
  (:func:`fence_held`): a token older than the fence raises :class:`FencedOut` (one line), the
  writer removes the files it put there (only those still its own), and the checkpoint never
  exists. A newer generation's files are never replaced: a stale writer's last rename happened
  before the raise, hence before the newer generation wrote anything.
- **Atomic.** The check and the rename it guards happen under a shared ``flock`` of
  ``.fence.lock`` in the root; a raise takes it exclusively, waiting at most
  :data:`LOCK_TIMEOUT_S` (a holder frozen in its critical section is killed by its agent within
  the detection bound). On NFS, Linux maps ``flock`` to NFS byte-range locks (NFSv4: cluster
  wide); on object-store mounts without locks the check still runs, unlocked.
- **Token.** ``(epoch, generation, live)`` compared in that order: ``epoch`` = the controller's
  start (``varuna-launch``'s start time, the manager job's creation time, in ms:
  ``$VARUNA_FENCE_EPOCH``), so a re-run by an operator outranks every generation of the run before;
  ``generation`` = the launcher's restart count (``$VARUNA_RESTARTS``) or the manager's
  generation (``$VARUNA_GENERATION``); ``live`` = the live-morph generation within one launch.
  The ranks of a generation agree on one token (the minimum of what each was given: a live
  joiner started by a later manager generation must not outrank the generation it joins, and
  the minimum never decreases from one live generation to the next). A run without an epoch
  (a plain ``python train.py``, torchrun) is *unfenced*: it neither raises nor checks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from varuna.core.env import WorkerSettings
from varuna.runtime.checkpoint_files import JSON_MAX_BYTES, CheckpointError, atomic_write, read_regular

__all__ = [
    "FENCE_FILE",
    "LOCK_TIMEOUT_S",
    "FenceToken",
    "FencedOut",
    "fence_held",
    "raise_fence",
    "read_fence",
    "start_generation",
]

log = logging.getLogger("varuna.runtime.checkpoint")

FENCE_FILE = "fence.json"
_LOCK_FILE = ".fence.lock"
#: Longest wait for the fence lock (a writer frozen inside its check-and-rename holds it).
LOCK_TIMEOUT_S = 60.0


@dataclass(frozen=True, order=True)
class FenceToken:
    """The generation a checkpoint write belongs to (Note [Checkpoint fence]); greater is newer.

    >>> FenceToken(5, 1, 0) < FenceToken(5, 1, 2) < FenceToken(5, 2, 0) < FenceToken(6, 0, 0)
    True
    >>> str(FenceToken(1700000000000, 2, 1))
    'epoch 1700000000000 generation 2 live 1'
    """

    epoch: int
    generation: int = 0
    live: int = 0

    def __str__(self) -> str:
        return f"epoch {self.epoch} generation {self.generation} live {self.live}"

    def as_list(self) -> list[int]:
        return [self.epoch, self.generation, self.live]

    @classmethod
    def from_settings(cls, settings: WorkerSettings | None = None) -> FenceToken | None:
        """This process's token as its launcher gave it (live generation 0), or None (unfenced).

        >>> FenceToken.from_settings(WorkerSettings.from_env({"VARUNA_FENCE_EPOCH": "7",
        ...                                                   "VARUNA_RESTARTS": "2"}))
        FenceToken(epoch=7, generation=2, live=0)
        """
        s = WorkerSettings.from_env() if settings is None else settings
        if s.fence_epoch is None:
            return None
        return cls(s.fence_epoch, s.generation or 0)


class FencedOut(CheckpointError):
    """A checkpoint write of a generation older than the store's fence (one line)."""


def read_fence(root: Path) -> FenceToken | None:
    """The newest token that started on the store ``root`` (None: none yet, or unreadable)."""
    try:
        data = json.loads(read_regular(Path(root) / FENCE_FILE, JSON_MAX_BYTES))
        return FenceToken(*(int(x) for x in data["token"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        # Unreadable: another writer's torn state is impossible (atomic_write), so something
        # outside varuna wrote it; the next raise replaces it, and a check treats it as absent.
        return None


@contextlib.contextmanager
def _locked(root: Path, exclusive: bool, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """``flock`` of the root's lock file, polled (never an unbounded wait); unlocked where the
    filesystem has no locks."""
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(root) / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise CheckpointError(f"{root}: cannot open the checkpoint fence lock: {e}") from None
    try:
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, mode)
                break
            except OSError as e:
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    break  # no locks on this filesystem: the check still runs
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"{root}/{_LOCK_FILE}: still locked after {timeout_s:.0f} s by another writer of"
                        " this checkpoint store (a frozen process of an older generation?); kill it or"
                        " check the store's filesystem"
                    ) from None
                time.sleep(0.02)  # another process's critical section: a rename, milliseconds
        yield
    finally:
        os.close(fd)  # releases the lock


def raise_fence(root: Path, token: FenceToken) -> FenceToken:
    """Record ``token`` as the newest generation on ``root`` unless a newer one is there; returns
    the fence now in force. Atomic against :func:`fence_held` (Note [Checkpoint fence]).

    Example::

        raise_fence(Path("/ckpt"), FenceToken(1764320000000, 1))   # before loading a checkpoint
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root, exclusive=True):
        current = read_fence(root)
        if current is not None and current >= token:
            return current
        atomic_write(root / FENCE_FILE, json.dumps({"token": token.as_list(), "pid": os.getpid(),
                                                   "time": time.time()}).encode())
        return token


@contextlib.contextmanager
def fence_held(root: Path, token: FenceToken | None, what: str) -> Iterator[None]:
    """Run the block (a rename into the store) only if ``token`` is not older than the fence,
    holding the fence lock so no newer generation starts in between. ``None``: unfenced.
    Raises :class:`FencedOut` naming ``what`` and both generations.

    Example::

        with fence_held(root, job.fence, f"the checkpoint of step {step}"):
            os.replace(tmp, dst)
    """
    if token is None:
        yield
        return
    with _locked(Path(root), exclusive=False):
        fence = read_fence(root)
        if fence is not None and fence > token:
            raise FencedOut(
                f"{what} refused: it belongs to {token}, but {fence} started since"
                f" ({Path(root) / FENCE_FILE}); a stale writer of an older generation (a host cut off"
                " from its launcher or manager) never commits"
            )
        yield


def start_generation(root: Path, given: FenceToken, live: int, *, rank: int, world: int) -> FenceToken:
    """The token of a generation starting on ``root`` (a collective over the default group when
    ``world`` > 1): the minimum over the ranks of what each was ``given`` (a live joiner started
    by a later manager generation must not outrank the generation it joins, and the minimum never
    decreases as members change), at live generation ``live``; rank 0 raises the fence to it.

    Example::

        token = start_generation(Path("/ckpt"), FenceToken.from_settings(), 0, rank=0, world=1)
    """
    epoch, generation = given.epoch, given.generation
    if world > 1:
        v = torch.tensor([epoch, generation], dtype=torch.int64)
        dist.all_reduce(v, op=dist.ReduceOp.MIN)
        epoch, generation = (int(x) for x in v.tolist())
    token = FenceToken(epoch, generation, live)
    if rank == 0:
        now = raise_fence(root, token)
        if now > token:
            log.warning("varuna: this run (%s) is older than the generation that last started on %s (%s):"
                        " its checkpoints will be refused; it is a stale copy of the job, stop it",
                        token, root, now)
    return token
