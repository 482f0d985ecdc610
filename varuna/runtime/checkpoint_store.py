"""The checkpoint store on disk: step directories, manifests, shard files (docs/checkpoints.md).

Everything here works on paths only (no engine, no process group): naming, listing, validating
and pruning step directories, reading shard files safely, and the crash-safe file primitives the
background writer uses (atomic write, fsynced copy, hashed ``torch.save``).

Example::

    >>> list_checkpoints("/nonexistent"), step_dir_name(7)
    ([], 'step_00000007')
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT",
    "VERSION",
    "MANIFEST",
    "MARKERS",
    "CheckpointError",
    "CheckpointInfo",
    "CheckedFile",
    "atomic_write",
    "copy_file",
    "fsync_dir",
    "list_checkpoints",
    "open_checked",
    "prune",
    "read_manifest",
    "read_regular",
    "read_shard",
    "save_hashed",
    "step_dir_name",
    "verify_checkpoint",
]

FORMAT = "varuna-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
MARKERS = ".markers"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_SHARD_NAME = re.compile(r"^seg\d{3,}-\d{2,}\.pt$")
#: Largest manifest or marker read (JSON of the parameter table: ~150 bytes a parameter).
JSON_MAX_BYTES = 256 << 20

log = logging.getLogger("varuna.runtime.checkpoint")


class CheckpointError(ValueError):
    """A checkpoint cannot be used (none found, corrupt, unsafe, or from a different model).

    A ``ValueError``: like other bad input, scripts report it as one line."""


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` steps.

    >>> step_dir_name(300)
    'step_00000300'
    """
    return f"step_{step:08d}"


# ---------------------------------------------------------------------------------------------
# Files: shards, markers, manifests


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


def _open_regular(path: Path) -> tuple[int, int]:
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
    fd, size = _open_regular(path)
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


def read_shard(path: Path, source: CheckedFile | None = None) -> dict:
    """Unpickle a shard file safely (``weights_only``: tensors and plain containers only).

    ``source``: the file already opened and verified by :func:`open_checked` (it is read from
    there, record by record: the file is never held whole in memory); else ``path`` is opened
    (a regular file only). Raises :class:`CheckpointError` naming the file when it holds anything
    else (a pickled custom class, code) or does not have the shard layout.
    """
    path = Path(path)
    if source is None:
        fd, _ = _open_regular(path)
        with os.fdopen(fd, "rb") as f:
            return _load_shard(path, f)
    source.file.seek(0)
    obj = _load_shard(path, source.file)
    if source.changed():
        # What was unpickled is not what was hashed: another writer is at work in the store.
        raise ValueError(f"{path.name}: changed while being read (something else is writing it)")
    return obj


def _load_shard(path: Path, f) -> dict:
    try:
        obj = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path}: refusing to load: the file holds pickled objects other than tensors and plain "
            f"containers ({first}); varuna checkpoints never do, so it is not one or it was tampered with"
        ) from None
    if not (
        isinstance(obj, dict)
        and obj.get("format") == FORMAT
        and isinstance(obj.get("params"), dict)
        and isinstance(obj.get("optimizer"), dict)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj["params"].items())
    ):
        raise ValueError(f"{path}: not a varuna checkpoint shard (unexpected layout)")
    return obj


def fsync_dir(path: Path) -> None:
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


def atomic_write(path: Path, data: bytes, before_replace: Callable[[], None] | None = None) -> None:
    """Write ``path`` so that readers see either nothing (or the old file) or all of it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
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


def copy_file(src: Path, dst: Path, chunk_bytes: int, on_chunk: Callable[[int], None]) -> None:
    """Copy ``src`` to ``dst`` via a tmp name, fsynced, then renamed into place; ``on_chunk(n)``
    after each chunk of ``n`` bytes. The data moves inside the kernel (sendfile), so the copy
    costs training processes almost no CPU."""
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
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
        os.replace(tmp, dst)
    except BaseException:
        _discard(tmp)
        raise


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """One ``step_*`` directory of a checkpoint store."""

    step: int
    path: Path
    complete: bool
    """It has a manifest (its files may still turn out corrupt: see :func:`verify_checkpoint`)."""


def list_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Every ``step_*`` directory under ``root``, oldest first (empty when ``root`` is absent).

    >>> list_checkpoints("/nonexistent")
    []
    """
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if not m:
            continue
        if p.is_symlink():
            # Never followed: pruning would delete files outside the root, and loading would
            # read a checkpoint this job never wrote.
            log.warning(
                "varuna: ignoring %s: a symbolic link (checkpoints are only real directories "
                "inside %s; move the checkpoint there or remove the link)",
                p,
                root,
            )
        elif p.is_dir():
            out.append(CheckpointInfo(step=int(m.group(1)), path=p, complete=(p / MANIFEST).is_file()))
    return sorted(out, key=lambda c: c.step)


def read_manifest(path: str | Path) -> dict:
    """Parse and validate ``<step dir>/manifest.json``; ``ValueError`` says what is wrong."""
    path = Path(path)
    try:
        m = json.loads(read_regular(path / MANIFEST, JSON_MAX_BYTES).decode())
    except FileNotFoundError:
        raise ValueError(f"{path}: no {MANIFEST} (an incomplete checkpoint)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / MANIFEST}: unreadable ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path / MANIFEST}: not a varuna checkpoint manifest")
    if m.get("version") != VERSION:
        raise ValueError(
            f"{path / MANIFEST}: format version {m.get('version')!r}, this varuna reads {VERSION}"
        )
    for key in ("step", "files", "parameters", "loss_scale"):
        if key not in m:
            raise ValueError(f"{path / MANIFEST}: missing {key!r}")
    for f in m["files"]:
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not _SHARD_NAME.match(f["name"]):
            raise ValueError(f"{path / MANIFEST}: bad file entry {f!r}")
    return m


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
        fd, size = _open_regular(path)
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


def verify_checkpoint(path: str | Path) -> list[str]:
    """Problems with a checkpoint directory: no/bad manifest, missing, truncated or altered
    files (size and sha256 of every file; nothing is unpickled). Empty when it is sound."""
    path = Path(path)
    try:
        m = read_manifest(path)
    except ValueError as e:  # CheckpointError included
        return [str(e)]
    problems = []
    for f in m["files"]:
        try:
            opened, problem = open_checked(path / f["name"], f)
        except CheckpointError as e:
            opened, problem = None, str(e)
        if opened is not None:
            opened.close()
        if problem:
            problems.append(problem)
    return problems


def prune(root: Path, step: int, keep: int) -> None:
    """After the checkpoint of ``step`` is complete: keep the newest ``keep`` complete ones up to
    it; remove older and incomplete leftovers, and those *after* it (a lineage this run
    abandoned by resuming from an older checkpoint, which a later resume must not pick)."""
    infos = list_checkpoints(root)
    kept = {
        c.step
        for c in sorted((c for c in infos if c.complete and c.step <= step), key=lambda c: -c.step)[:keep]
    }
    kept.add(step)
    for c in infos:
        if c.step in kept:
            continue
        # Manifest first: a reader racing with us sees an incomplete checkpoint, never a
        # complete one with missing files.
        (c.path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(c.path, ignore_errors=True)
