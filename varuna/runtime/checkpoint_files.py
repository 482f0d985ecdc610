"""Crash-safe, link-safe file primitives of the checkpoint store, for every checkpoint format.

Nothing here knows a format or a step directory: reading only regular files in place, with a
bound (:func:`read_regular`, :func:`open_regular`, :func:`open_checked` against a size and
sha256), writing so that readers see all or nothing (:func:`atomic_write`, :func:`copy_file`,
:func:`fsync_dir`), and a ``torch.save`` that hashes on the way (:func:`save_hashed`). The errors
a format raises while reading (:class:`CheckpointError`: refuse, :class:`UnsoundCheckpoint`:
skip to an older checkpoint) live here too, so every layer below the checkpointer can raise them.

Example::

    >>> open_checked(Path("/nonexistent/seg000-00.pt"), {"bytes": 1, "sha256": ""})
    (None, 'seg000-00.pt: missing')
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import secrets
import stat
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from varuna.core.config_error import ConfigError

__all__ = [
    "JSON_MAX_BYTES",
    "CheckpointError",
    "CheckedFile",
    "UnsoundCheckpoint",
    "atomic_write",
    "copy_file",
    "fsync_dir",
    "hash_file",
    "open_checked",
    "open_regular",
    "read_json",
    "read_regular",
    "save_hashed",
]

#: Largest JSON file of a checkpoint read (a manifest's parameter table: ~150 bytes a parameter).
JSON_MAX_BYTES = 256 << 20


class CheckpointError(ConfigError):
    """A checkpoint cannot be used (none found, corrupt, unsafe, or from a different model).

    A ``ValueError`` (a :class:`varuna.core.config_error.ConfigError`): uncaught in a worker, one
    line and exit 78 (Note [One-line refusals]). Raised by a format's
    ``read``, it refuses the load on every rank (something other than varuna changed the store)."""


class UnsoundCheckpoint(Exception):
    """A checkpoint that is incomplete, truncated, altered or unreadable: what a crash or a full
    disk leaves. Raised by a format's ``read``, every rank skips to the next older checkpoint
    with a warning carrying this message (Note [Load] in checkpoint.py)."""


# ---------------------------------------------------------------------------------------------
# Reading


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def open_regular(path: Path) -> tuple[int, int]:
    """Open ``path`` for reading only if it is a regular file in place: (fd, size).

    ``O_NOFOLLOW`` refuses a symbolic link (it could point out of the step directory, e.g. at
    ``/dev/zero``) and ``O_NONBLOCK`` keeps opening a FIFO from blocking until a writer comes;
    the type is checked on the opened descriptor, so nothing can swap the file in between.
    Raises ``FileNotFoundError`` when absent, :class:`CheckpointError` for a link or another
    file type."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fix = "varuna writes only regular files; delete the step directory or put the real file back"
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path}: refusing to read a symbolic link ({fix})") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: refusing to read {_file_kind(st.st_mode)} ({fix})")
    return fd, st.st_size


def _read_fd(fd: int, limit: int, size: int) -> bytes:
    """Up to ``limit`` bytes from ``fd`` (fewer only at end of file), whose size was ``size``.

    Reads ask for the file's size plus one byte (a growing file is noticed) before going on in
    64 MiB pieces: ``os.read`` reserves what it is asked for, and 64 MiB for a small manifest
    would count against an address-space limit (docs/too_big.md)."""
    parts, got = [], 0
    while got < limit:
        want = min(limit - got, size + 1 - got) if got <= size else limit - got
        b = os.read(fd, min(want, 64 << 20))
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def read_regular(path: Path, max_bytes: int | None = None) -> bytes:
    """The bytes of a regular file that is not a link, reading at most ``max_bytes``.

    Raises ``FileNotFoundError`` when absent and :class:`CheckpointError` (naming the file)
    for a link, a FIFO, a device or a file larger than ``max_bytes``: never blocks, never
    reads without bound."""
    fd, size = open_regular(path)
    try:
        if max_bytes is not None and size > max_bytes:
            raise CheckpointError(
                f"{path}: {size} bytes, more than the {max_bytes} a checkpoint file of its kind may have"
            )
        limit = size if max_bytes is None else max_bytes
        data = _read_fd(fd, limit + 1, size)  # one more: a file growing under us is noticed
    finally:
        os.close(fd)
    if len(data) > limit:
        raise CheckpointError(f"{path}: grew while being read (something else is writing it)")
    return data


# ---------------------------------------------------------------------------------------------
# Writing


def fsync_dir(path: Path) -> None:
    """fsync a directory (a rename in it is durable), where the filesystem allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (blob mounts) do not support fsync on directories
    finally:
        os.close(fd)


def _tmp_name(path: Path) -> Path:
    """A temporary name beside ``path`` unique across hosts: a shared store sees writers from
    many machines (and pid namespaces), where the same pid is common."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def atomic_write(path: Path, data: bytes, before_replace: Callable[[], None] | None = None) -> None:
    """Write ``path`` so that readers see either nothing (or the old file) or all of it."""
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        _discard(tmp)
        raise
    fsync_dir(path.parent)


def _discard(tmp: Path) -> None:
    """Remove a temporary file of a failed write (a full disk must not keep its half copies)."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass  # a read-only or vanished directory: nothing was written there either


class _HashingWriter:
    """File-like sink for ``torch.save`` that computes the sha256 of what it writes (one pass)."""

    def __init__(self, f) -> None:
        self.f, self.sha, self.nbytes = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.nbytes += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def save_hashed(obj: Any, path: Path) -> tuple[int, str]:
    """``torch.save(obj, path)``; returns (bytes, sha256 hex) of the file."""
    with open(path, "wb") as f:
        w = _HashingWriter(f)
        torch.save(obj, w)
    return w.nbytes, w.sha.hexdigest()


def hash_file(path: Path, chunk_bytes: int = 8 << 20) -> tuple[int, str]:
    """(bytes, sha256 hex) of a file another library wrote (safetensors, DCP), streamed."""
    sha, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while b := f.read(chunk_bytes):
            sha.update(b)
            n += len(b)
    return n, sha.hexdigest()


def read_json(path: Path, max_bytes: int | None = None) -> Any:
    """A JSON file read with :func:`read_regular` (a regular file in place, bounded); raises
    :class:`UnsoundCheckpoint` when it is missing or unreadable (a crash's leftover or an
    incomplete directory)."""
    try:
        return json.loads(read_regular(path, JSON_MAX_BYTES if max_bytes is None else max_bytes).decode())
    except FileNotFoundError:
        raise UnsoundCheckpoint(f"{path}: missing") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UnsoundCheckpoint(f"{path}: unreadable ({e})") from None


def copy_file(
    src: Path,
    dst: Path,
    chunk_bytes: int,
    on_chunk: Callable[[int], None],
    guard: Callable[[], AbstractContextManager] = nullcontext,
) -> None:
    """Copy ``src`` to ``dst`` via a tmp name, fsynced, then renamed into place; ``on_chunk(n)``
    after each chunk of ``n`` bytes. The data moves inside the kernel (sendfile), so the copy
    costs training processes almost no CPU. The rename happens inside ``guard()`` (the checkpoint
    fence's check: Note [Checkpoint fence] in checkpoint_fence.py), which may refuse it by raising."""
    tmp = _tmp_name(dst)
    try:
        with open(src, "rb") as fi, open(tmp, "wb") as fo:
            size, off = os.fstat(fi.fileno()).st_size, 0
            while off < size:
                try:
                    n = os.sendfile(fo.fileno(), fi.fileno(), off, min(chunk_bytes, size - off))
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):
                        raise  # a real write failure, not a missing sendfile
                    # a filesystem without sendfile support: plain reads and writes
                    fi.seek(off)
                    n = fo.write(fi.read(min(chunk_bytes, size - off)))
                    fo.flush()
                if n == 0:
                    raise OSError(f"{src}: file shrank while being copied")
                off += n
                on_chunk(n)
            os.fsync(fo.fileno())
        with guard():
            os.replace(tmp, dst)
    except BaseException:
        _discard(tmp)
        raise


@dataclass
class CheckedFile:
    """A shard file opened by :func:`open_checked`, whose bytes matched its manifest entry.

    ``changed()`` tells whether the file was modified since (checked after unpickling it: the
    bytes hashed and the bytes loaded are read in two passes). Close it (or use ``with``).

    Example::

        opened, problem = open_checked(step_dir / "seg000-00.pt", manifest_entry)
        if opened is not None:
            with opened:
                shard = read_shard(step_dir / "seg000-00.pt", opened)
    """

    file: io.BufferedReader
    signature: tuple[int, int, int]

    def changed(self) -> bool:
        return _signature(os.fstat(self.file.fileno())) != self.signature

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> CheckedFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _signature(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


def open_checked(
    path: Path, entry: dict, chunk_bytes: int = 8 << 20
) -> tuple[CheckedFile | None, str | None]:
    """Open a file and compare it with its manifest entry: (opened file, None) or (None, problem).

    The sha256 is computed over the file streamed in ``chunk_bytes`` pieces, so memory stays
    bounded whatever the shard's size (a shard holds a segment's weights and optimizer state: a
    buffer of its bytes beside the unpickled tensors would double that while loading, on a stage
    sized to its memory). Reads only a regular file that is not a
    link, and never more than the manifest's size (plus one byte); raises
    :class:`CheckpointError` for a link, a FIFO or a device.

    >>> open_checked(Path("/nonexistent/seg000-00.pt"), {"bytes": 1, "sha256": ""})
    (None, 'seg000-00.pt: missing')
    """
    expected = entry.get("bytes")
    try:
        fd, size = open_regular(path)
    except FileNotFoundError:
        return None, f"{path.name}: missing"
    except OSError as e:
        return None, f"{path.name}: unreadable ({e})"
    f = os.fdopen(fd, "rb")
    try:
        got, sha = 0, hashlib.sha256()
        if isinstance(expected, int) and size == expected:
            while got <= expected:  # one byte more than expected: a growing file is noticed
                b = f.read(min(chunk_bytes, expected + 1 - got))
                if not b:
                    break
                sha.update(b)
                got += len(b)
        signature = _signature(os.fstat(fd))
    except OSError as e:
        f.close()
        return None, f"{path.name}: unreadable ({e})"
    problem = None
    if size != expected or got != expected:
        problem = (
            f"{path.name}: {size if size != expected else got} bytes, the manifest says {expected} "
            "(truncated or altered)"
        )
    elif sha.hexdigest() != entry.get("sha256"):
        problem = f"{path.name}: sha256 mismatch (corrupt or altered)"
    if problem:
        f.close()
        return None, problem
    return CheckedFile(file=f, signature=signature), None


