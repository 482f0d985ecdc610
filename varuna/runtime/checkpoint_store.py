"""The checkpoint store: step directories under a root, whatever format each one holds.

Everything here works on paths only (no engine, no process group): naming, listing, verifying,
retiring and pruning ``step_*`` directories. What is inside one belongs to its format: a directory
is complete when a registered format finds its commit file there
(:func:`~varuna.runtime.checkpoint_registry.format_of`, Note [Checkpoint formats] in
checkpoint_format.py).

Example::

    >>> list_checkpoints("/nonexistent"), step_dir_name(7)
    ([], 'step_00000007')
"""

from __future__ import annotations

import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from varuna.runtime.checkpoint_registry import format_of, registered_formats

__all__ = ["CheckpointInfo", "list_checkpoints", "prune", "retire", "step_dir_name", "verify_checkpoint"]

_STEP_DIR = re.compile(r"^step_(\d+)$")

log = logging.getLogger("varuna.runtime.checkpoint")


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` steps.

    >>> step_dir_name(300)
    'step_00000300'
    """
    return f"step_{step:08d}"


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """One ``step_*`` directory of a checkpoint store."""

    step: int
    path: Path
    complete: bool
    """A registered format's commit file is there (its files may still turn out corrupt: see
    :func:`verify_checkpoint`)."""
    format: str | None = None
    """The name of that format; None when incomplete."""


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
            fmt = format_of(p)
            name = fmt.name if fmt is not None else None
            out.append(CheckpointInfo(step=int(m.group(1)), path=p, complete=fmt is not None, format=name))
    return sorted(out, key=lambda c: c.step)


def verify_checkpoint(path: str | Path) -> list[str]:
    """Problems with a step directory (no commit file of any registered format; missing,
    truncated or altered files, as its format checks them without unpickling). Empty when it is
    sound.

    >>> verify_checkpoint("/nonexistent")
    ['/nonexistent: no manifest.json (an incomplete checkpoint)']
    """
    path = Path(path)
    fmt = format_of(path)
    if fmt is None:
        files = " or ".join(f.commit_file for f in registered_formats())
        return [f"{path}: no {files} (an incomplete checkpoint)"]
    return fmt.verify(path)


def retire(path: Path) -> None:
    """Make a step directory incomplete for every format (its commit file first, so a reader
    racing with us never finds a complete checkpoint with missing files)."""
    for fmt in registered_formats():
        if fmt.is_complete(path):
            fmt.uncommit(path)


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
        retire(c.path)
        shutil.rmtree(c.path, ignore_errors=True)
