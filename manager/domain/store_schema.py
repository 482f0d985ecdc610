"""The state file's schema: its tables, its version, and how an older file is brought up to date;
and what a readable job row looks like (Note [Corrupt rows]). :class:`manager.domain.store.Store`
runs it; nothing here holds a connection.

    >>> SCHEMA_VERSION >= 6, "CREATE TABLE IF NOT EXISTS progress" in SCHEMA
    (True, True)
"""

from __future__ import annotations

import math
import re
import sqlite3
from typing import Any

from manager.domain.pool_store import POOL_SCHEMA

__all__ = ["JOB_STATES", "SCHEMA", "SCHEMA_VERSION", "job_row_repair", "migrate"]

SCHEMA_VERSION = 6

# Columns added after version 1 (a version-1 file gets them with ALTER TABLE on open).
_ADDED_COLUMNS = {
    2: [
        ("jobs", "calibration_state", "TEXT NOT NULL DEFAULT ''"),
        ("jobs", "calibration_source", "TEXT NOT NULL DEFAULT ''"),
        ("jobs", "calibration_attempt", "INTEGER NOT NULL DEFAULT 0"),
        ("jobs", "calibration_vm", "TEXT NOT NULL DEFAULT ''"),
        ("jobs", "calibration_started", "REAL"),
    ],
    # 3: the shared pool's tables (manager/domain/pool_store.py), created by _SCHEMA on open.
    4: [  # mixed VM types (issue #19): calibration per type, each generation's mixed plan
        ("jobs", "type_calibrations_json", "TEXT NOT NULL DEFAULT ''"),
        ("jobs", "calibration_type", "TEXT NOT NULL DEFAULT ''"),
        ("generations", "mixed_json", "TEXT NOT NULL DEFAULT ''"),
    ],
    5: [("generations", "live_json", "TEXT NOT NULL DEFAULT ''")],  # live morph: members, joiners, leavers
}

# Tables whose column constraints changed (SQLite cannot alter a column: the table is rebuilt):
# 6: a progress point's loss and throughput may be NULL (a non-finite value: Note [Non-finite values]).
_REBUILT_TABLES = {6: ["progress"]}

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    spec_json TEXT NOT NULL,
    calibration_json TEXT NOT NULL DEFAULT '',
    state TEXT NOT NULL,
    message TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL,
    generation INTEGER NOT NULL DEFAULT 0,
    step INTEGER NOT NULL DEFAULT 0,
    detection_time REAL,
    detection_reason TEXT NOT NULL DEFAULT '',
    failed_launches INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    vm_seq INTEGER NOT NULL DEFAULT 0,
    calibration_state TEXT NOT NULL DEFAULT '',
    calibration_source TEXT NOT NULL DEFAULT '',
    calibration_attempt INTEGER NOT NULL DEFAULT 0,
    calibration_vm TEXT NOT NULL DEFAULT '',
    calibration_started REAL,
    type_calibrations_json TEXT NOT NULL DEFAULT '',
    calibration_type TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS generations (
    job_id TEXT NOT NULL,
    generation INTEGER NOT NULL,
    state TEXT NOT NULL,
    pipeline_depth INTEGER NOT NULL,
    data_parallel INTEGER NOT NULL,
    micro_batch_size INTEGER NOT NULL,
    vms_json TEXT NOT NULL,
    master_addr TEXT NOT NULL,
    master_port INTEGER NOT NULL,
    launched REAL NOT NULL,
    stop_reason TEXT NOT NULL DEFAULT '',
    stop_time REAL,
    ended REAL,
    first_step_time REAL,
    resumed_from INTEGER,
    last_step INTEGER NOT NULL DEFAULT 0,
    graceful INTEGER NOT NULL DEFAULT 0,
    predicted_samples_per_s REAL NOT NULL DEFAULT 0,
    mixed_json TEXT NOT NULL DEFAULT '',
    live_json TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (job_id, generation)
);
CREATE TABLE IF NOT EXISTS vms (
    vm_id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    provider TEXT NOT NULL,
    seq INTEGER NOT NULL,
    state TEXT NOT NULL,
    slots INTEGER NOT NULL,
    address TEXT NOT NULL DEFAULT '',
    hostname TEXT NOT NULL DEFAULT '',
    agent_instance TEXT NOT NULL DEFAULT '',
    agent_pid INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    registered REAL,
    last_heartbeat REAL,
    free_port INTEGER NOT NULL DEFAULT 0,
    reported_generation INTEGER NOT NULL DEFAULT 0,
    workers_json TEXT NOT NULL DEFAULT '[]',
    slow INTEGER NOT NULL DEFAULT 0,
    slow_reason TEXT NOT NULL DEFAULT '',
    notice_json TEXT NOT NULL DEFAULT '',
    gone_reason TEXT NOT NULL DEFAULT '',
    provider_ref TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS vms_by_job ON vms (job_id, seq);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    vm_id TEXT NOT NULL DEFAULT '',
    generation INTEGER NOT NULL DEFAULT 0,
    message TEXT NOT NULL DEFAULT '',
    data_json TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, id);
CREATE TABLE IF NOT EXISTS progress (
    job_id TEXT NOT NULL,
    generation INTEGER NOT NULL,
    step INTEGER NOT NULL,
    time REAL NOT NULL,
    samples_per_s REAL,
    loss REAL,
    pipeline_depth INTEGER NOT NULL,
    data_parallel INTEGER NOT NULL,
    PRIMARY KEY (job_id, generation, step)
);
CREATE TABLE IF NOT EXISTS worker_stats (
    job_id TEXT NOT NULL,
    generation INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    vm_id TEXT NOT NULL,
    stage INTEGER NOT NULL,
    replica INTEGER NOT NULL,
    step INTEGER NOT NULL,
    resumed_from INTEGER NOT NULL,
    time REAL NOT NULL,
    fwd_s REAL NOT NULL,
    bwd_s REAL NOT NULL,
    recompute_s REAL NOT NULL,
    micro_batch_size INTEGER NOT NULL,
    first_segment INTEGER NOT NULL,
    end_segment INTEGER NOT NULL,
    PRIMARY KEY (job_id, generation, rank)
);
""" + POOL_SCHEMA


def _rebuild(conn: sqlite3.Connection, table: str) -> None:
    """Re-create ``table`` with its declaration in ``SCHEMA``, keeping its rows (SQLite cannot
    change a column's constraints in place)."""
    match = re.search(rf"CREATE TABLE IF NOT EXISTS {table} \((.*?)\n\);", SCHEMA, re.S)
    assert match is not None, table
    conn.execute(f"CREATE TABLE {table}_rebuilt ({match.group(1)}\n)")
    columns = ", ".join(r[1] for r in conn.execute(f"PRAGMA table_info({table})"))
    conn.execute(f"INSERT INTO {table}_rebuilt ({columns}) SELECT {columns} FROM {table}")
    conn.execute(f"DROP TABLE {table}")
    conn.execute(f"ALTER TABLE {table}_rebuilt RENAME TO {table}")


def migrate(conn: sqlite3.Connection, version: int) -> None:
    """Bring a file of an older schema ``version`` up to date, inside the caller's transaction:
    columns get added; a table whose constraints changed is rebuilt with its rows."""
    for v in range(version + 1, SCHEMA_VERSION + 1):
        for table, column, decl in _ADDED_COLUMNS.get(v, []):
            have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
        for table in _REBUILT_TABLES.get(v, []):
            _rebuild(conn, table)
    conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))


# Note [Corrupt rows]: the job rows are read once, when the file is opened. A row whose values are
# not of their column's type (SQLite keeps whatever is written: a hand edit, another program, a
# disk error) would otherwise break every later sort, comparison or parse, and with it every tick
# and every status call. Such a job is quarantined: marked failed with a message saying why, one
# line on stderr; the others go on. A row whose spec cannot be parsed is caught the same way by
# the control loop (Manager._quarantine) when it first reads it.
_JOB_COLUMN_TYPES: dict[str, tuple[type, ...]] = {
    "spec_json": (str,), "calibration_json": (str,), "state": (str,), "message": (str,),
    "created": (int, float), "updated": (int, float), "generation": (int,), "step": (int,),
    "detection_time": (int, float, type(None)), "detection_reason": (str,), "failed_launches": (int,),
    "cancel_requested": (int,), "vm_seq": (int,), "calibration_state": (str,),
    "calibration_source": (str,), "calibration_attempt": (int,), "calibration_vm": (str,),
    "calibration_started": (int, float, type(None)), "type_calibrations_json": (str,),
    "calibration_type": (str,),
}
JOB_STATES = ("pending", "running", "stopping", "finished", "cancelled", "failed")


def job_row_repair(row: sqlite3.Row) -> tuple[str, dict[str, Any]] | None:
    """None for a readable job row; else what is wrong with it and the values that make it a
    readable, failed job (Note [Corrupt rows]): every column of the wrong type gets its default,
    so the next start reads it without a word."""
    names = set(row.keys())
    problems: list[str] = []
    repair: dict[str, Any] = {}
    for column, types in _JOB_COLUMN_TYPES.items():
        if column not in names:
            continue
        value = row[column]
        finite = not isinstance(value, float) or math.isfinite(value)
        if isinstance(value, types) and not isinstance(value, bool) and finite:
            continue
        problems.append(f"{column} is {str(value)[:40]!r}")
        default = None if types[-1] is type(None) else types[-1]()  # '', 0, 0.0 or NULL
        repair[column] = _JOB_COLUMN_DEFAULTS.get(column, default)
    if "state" not in repair and row["state"] not in JOB_STATES:
        problems.append(f"state is {str(row['state'])[:40]!r}")
    if not problems:
        return None
    return "; ".join(problems), repair


_JOB_COLUMN_DEFAULTS: dict[str, Any] = {"spec_json": "{}", "created": 0.0, "updated": 0.0}
