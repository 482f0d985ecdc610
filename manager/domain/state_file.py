"""The state file as a file: is it ours, is it still where we opened it, and putting it back.

:class:`manager.domain.store.Store` keeps the rows; this module answers three questions about the
SQLite file that holds them, with no knowledge of the rows themselves.

Note [Our state file]: ``--db`` names any path, and a typo can name another program's SQLite
database. Opening it would switch it to WAL mode and add our tables to it. So before anything is
written, the file must be empty, or carry our ``application_id`` (SQLite's header field for the
purpose, ``PRAGMA application_id``), or be one of ours written before the id existed (a ``meta``
table with our ``schema_version`` and a ``jobs`` table: it gets the id). Anything else is refused
with one line naming what is there.

Note [State file vanishing]: deleting the state file (or its directory: a temporary-file cleaner,
an ``rm -r`` of the wrong run) under a running manager goes unnoticed by SQLite, which keeps
writing to the open, unlinked file; everything would be lost at the next stop, and a successor
would find no record of the VMs that still run (and cost money) on the provider. A daemon that
supervises paid resources must not lose their record, and it still has the whole database open,
so it puts it back: the control loop compares the path's inode with the one it opened about once
a second, and when the path is gone it copies the open database (SQLite's online backup, which
includes what is still in the WAL) to a file beside it and links that under the old name (never
over a file that appeared there meanwhile: that one belongs to someone else, and the manager then
stops with one line naming where its copy is). Stopping instead would orphan the VMs; recreating
an empty file would forget them.

    >>> import sqlite3
    >>> conn = sqlite3.connect(":memory:")
    >>> check_ours(conn, ":memory:")
    'new'
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

__all__ = ["APPLICATION_ID", "check_ours", "file_identity", "restore_copy"]

#: ``PRAGMA application_id`` of a varuna-manager state file: "VRNM" in ASCII.
APPLICATION_ID = 0x56524E4D


def check_ours(conn: sqlite3.Connection, path: str) -> str:
    """``"ours"``, ``"new"`` (empty: ours from now on) or ``"older"`` (ours, before the id): the
    caller sets the id for the last two. ``ValueError`` (one line) for another application's file
    (Note [Our state file]); ``sqlite3.DatabaseError`` for a file that is not SQLite at all."""
    app = int(conn.execute("PRAGMA application_id").fetchone()[0])
    if app == APPLICATION_ID:
        return "ours"
    if app != 0:
        raise ValueError(
            f"{path} is another application's SQLite file (application_id {app:#x}, varuna-manager's is"
            f" {APPLICATION_ID:#x}); give varuna-manager a state file of its own with --db"
        )
    tables = sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'"))
    if not tables:
        return "new"
    if "meta" in tables and "jobs" in tables:
        try:
            row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.DatabaseError:
            row = None
        if row is not None and str(row[0]).isdigit():
            return "older"
    shown = ", ".join(tables[:6]) + (f" and {len(tables) - 6} more" if len(tables) > 6 else "")
    raise ValueError(
        f"{path} is another application's SQLite file (tables {shown}); give varuna-manager a"
        " state file of its own with --db (it would add its tables to this one)"
    )


def file_identity(path: str) -> tuple[int, int] | None:
    """``(device, inode)`` of ``path``, or None when nothing is there."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def restore_copy(conn: sqlite3.Connection, path: str) -> str:
    """Copy the database open on ``conn`` to a new file beside ``path`` (Note [State file
    vanishing]) and return that file's name; the caller links it under ``path``."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    copy = f"{path}.restored-{os.getpid()}"
    for leftover in (copy, f"{copy}-wal", f"{copy}-shm"):
        Path(leftover).unlink(missing_ok=True)
    dest = sqlite3.connect(copy)
    try:
        conn.backup(dest)  # the pages as this connection sees them: the WAL's included
    finally:
        dest.close()
    return copy
