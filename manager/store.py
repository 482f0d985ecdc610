"""The manager's durable state: jobs, generations, VMs, events and progress in one SQLite file.

Everything the manager decides from is here, so a manager killed at any point and started again
on the same file resumes supervising: the VMs and workers keep running meanwhile (agents retry
their heartbeats), and the new process reads the job's generation, its VMs and their last
reports back. Only soft state is kept in memory (fail-stutter counters, which restart from zero).

Concurrency: one connection in WAL mode (readers never block the writer), used under one lock
by the gRPC handler threads and the controller thread, so there is exactly one writer at a time.
Every write is its own short transaction. ``synchronous=NORMAL`` in WAL mode keeps the database
consistent on a crash and may lose only the last transactions on a power cut; heartbeats repeat
every second, so nothing of value is lost.

Times are wall-clock seconds (``time.time()``): they must mean the same after a restart.

    >>> store = Store(":memory:")
    >>> store.add_event("j1", "submitted", "hello")
    1
    >>> [e.kind for e in store.events("j1")]
    ['submitted']
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "SCHEMA_VERSION",
    "EventRecord",
    "GenerationRecord",
    "JobRecord",
    "ProgressRecord",
    "Store",
    "VMRecord",
    "WorkerStatRecord",
]

SCHEMA_VERSION = 2

# Columns added after version 1 (a version-1 file gets them with ALTER TABLE on open).
_ADDED_COLUMNS = {
    2: [
        ("jobs", "calibration_state", "TEXT NOT NULL DEFAULT ''"),
        ("jobs", "calibration_source", "TEXT NOT NULL DEFAULT ''"),
        ("jobs", "calibration_attempt", "INTEGER NOT NULL DEFAULT 0"),
        ("jobs", "calibration_vm", "TEXT NOT NULL DEFAULT ''"),
        ("jobs", "calibration_started", "REAL"),
    ],
}

_SCHEMA = """
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
    calibration_started REAL
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
    samples_per_s REAL NOT NULL,
    loss REAL NOT NULL,
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
"""


def _row_to(cls: type, row: sqlite3.Row) -> Any:
    names = {f.name for f in fields(cls)}
    return cls(**{k: row[k] for k in row.keys() if k in names})


@dataclass(kw_only=True)
class JobRecord:
    """A row of ``jobs``. ``state``: pending | running | stopping | finished | cancelled | failed."""

    job_id: str
    spec_json: str
    calibration_json: str = ""
    state: str
    message: str = ""
    created: float
    updated: float
    generation: int = 0
    """Newest generation launched (0: none yet)."""
    step: int = 0
    """Highest step any worker reported."""
    detection_time: float | None = None
    """When the manager noticed what the pending morph reacts to (cleared when training resumes)."""
    detection_reason: str = ""
    failed_launches: int = 0
    """Consecutive generations that ended without completing a step."""
    cancel_requested: int = 0
    vm_seq: int = 0
    """Counter for VM names."""
    calibration_state: str = ""
    """given | none | pending | profiling | done | failed (Note [Calibration at job start] in
    :mod:`manager.controller`); '' in rows written before it existed."""
    calibration_source: str = ""
    """Where the calibration came from, for people (``status``)."""
    calibration_attempt: int = 0
    """The current (or last) profiling attempt; agents key their run by it."""
    calibration_vm: str = ""
    """The VM running (or that ran) the profiling attempt."""
    calibration_started: float | None = None
    """When the current attempt was ordered."""

    @property
    def spec(self) -> dict[str, Any]:
        return json.loads(self.spec_json)

    @property
    def terminal(self) -> bool:
        return self.state in ("finished", "cancelled", "failed")


@dataclass(kw_only=True)
class GenerationRecord:
    """One launch of a job at one P×D on one set of VMs.

    ``state``: running | stopping (graceful stop asked) | killing | ended."""

    job_id: str
    generation: int
    state: str
    pipeline_depth: int
    data_parallel: int
    micro_batch_size: int
    vms_json: str
    master_addr: str
    master_port: int
    launched: float
    stop_reason: str = ""
    stop_time: float | None = None
    ended: float | None = None
    first_step_time: float | None = None
    resumed_from: int | None = None
    last_step: int = 0
    graceful: int = 0
    """1 when every worker exited 0 (a clean stop or completion)."""
    predicted_samples_per_s: float = 0.0

    @property
    def vm_ids(self) -> list[str]:
        return list(json.loads(self.vms_json))


@dataclass(kw_only=True)
class VMRecord:
    """A VM of a job. ``state``: requested | up | gone | deleted."""

    vm_id: str
    job_id: str
    provider: str
    seq: int
    state: str
    slots: int
    address: str = ""
    hostname: str = ""
    agent_instance: str = ""
    agent_pid: int = 0
    created: float
    registered: float | None = None
    last_heartbeat: float | None = None
    free_port: int = 0
    reported_generation: int = 0
    workers_json: str = "[]"
    slow: int = 0
    slow_reason: str = ""
    notice_json: str = ""
    gone_reason: str = ""
    provider_ref: str = "{}"

    @property
    def workers(self) -> list[dict[str, Any]]:
        """The agent's last report: ``[{"rank", "pid", "running", "exit_code"}]``."""
        return list(json.loads(self.workers_json))

    @property
    def notice(self) -> dict[str, Any] | None:
        return json.loads(self.notice_json) if self.notice_json else None

    @property
    def ref(self) -> dict[str, Any]:
        return dict(json.loads(self.provider_ref or "{}"))


@dataclass(kw_only=True)
class EventRecord:
    id: int
    job_id: str
    time: float
    kind: str
    vm_id: str = ""
    generation: int = 0
    message: str = ""
    data_json: str = "{}"

    @property
    def data(self) -> dict[str, Any]:
        return dict(json.loads(self.data_json or "{}"))


@dataclass(kw_only=True)
class ProgressRecord:
    job_id: str
    generation: int
    step: int
    time: float
    samples_per_s: float
    loss: float
    pipeline_depth: int
    data_parallel: int


@dataclass(kw_only=True)
class WorkerStatRecord:
    """The latest heartbeat of one worker of one generation."""

    job_id: str
    generation: int
    rank: int
    vm_id: str
    stage: int
    replica: int
    step: int
    resumed_from: int
    time: float
    fwd_s: float
    bwd_s: float
    recompute_s: float = 0.0
    micro_batch_size: int = 0
    first_segment: int = 0
    end_segment: int = 0


@dataclass
class Store:
    """The SQLite state file (see the module docstring). Thread-safe."""

    path: str
    _conn: sqlite3.Connection = field(init=False, repr=False)
    _lock: threading.RLock = field(init=False, repr=False, default_factory=threading.RLock)

    def __post_init__(self) -> None:
        # check_same_thread=False: the connection is shared by threads, serialised by _lock.
        # isolation_level=None: we issue BEGIN/COMMIT ourselves (one transaction per write).
        self._conn = sqlite3.connect(self.path, timeout=10.0, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        with self._lock:
            if self.path != ":memory:":
                mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise ValueError(f"{self.path}: SQLite refused WAL mode (got {mode}); use a local disk")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._conn.executescript(_SCHEMA)
            row = self._conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self._conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) < SCHEMA_VERSION:
                self._migrate(int(row[0]))
            elif int(row[0]) != SCHEMA_VERSION:
                raise ValueError(
                    f"{self.path}: state file has schema version {row[0]}, "
                    f"this manager reads {SCHEMA_VERSION};"
                    " use the matching varuna-manager or a new --db"
                )

    def _migrate(self, version: int) -> None:
        """Bring a file of an older schema ``version`` up to date (columns only ever get added)."""
        with self.transaction() as conn:
            for v in range(version + 1, SCHEMA_VERSION + 1):
                for table, column, decl in _ADDED_COLUMNS.get(v, []):
                    have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
                    if column not in have:
                        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
            conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """Run several statements atomically (BEGIN IMMEDIATE: the write lock up front)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def _update(self, table: str, where: dict[str, Any], values: dict[str, Any]) -> None:
        if not values:
            return
        sets = ", ".join(f"{k}=?" for k in values)
        cond = " AND ".join(f"{k}=?" for k in where)
        with self.transaction() as conn:
            conn.execute(f"UPDATE {table} SET {sets} WHERE {cond}", (*values.values(), *where.values()))

    # -- meta ----------------------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        rows = self._query("SELECT value FROM meta WHERE key=?", (key,))
        return rows[0][0] if rows else None

    def set_meta(self, key: str, value: str) -> None:
        with self.transaction() as conn:
            conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    # -- jobs ----------------------------------------------------------------------------------

    def add_job(
        self, job_id: str, spec: dict[str, Any], calibration_json: str = "", **values: Any
    ) -> JobRecord:
        """Insert a pending job; ``values`` set further columns (e.g. ``calibration_state``)."""
        now = time.time()
        row = {
            "job_id": job_id,
            "spec_json": json.dumps(spec, sort_keys=True),
            "calibration_json": calibration_json,
            "state": "pending",
            "created": now,
            "updated": now,
            **values,
        }
        with self.transaction() as conn:
            conn.execute(
                f"INSERT INTO jobs ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})",
                tuple(row.values()),
            )
        job = self.job(job_id)
        assert job is not None
        return job

    def job(self, job_id: str) -> JobRecord | None:
        rows = self._query("SELECT * FROM jobs WHERE job_id=?", (job_id,))
        return _row_to(JobRecord, rows[0]) if rows else None

    def jobs(self, *, active_only: bool = False) -> list[JobRecord]:
        sql = "SELECT * FROM jobs"
        if active_only:
            sql += " WHERE state NOT IN ('finished', 'cancelled', 'failed')"
        return [_row_to(JobRecord, r) for r in self._query(sql + " ORDER BY created")]

    def update_job(self, job_id: str, **values: Any) -> None:
        values["updated"] = time.time()
        self._update("jobs", {"job_id": job_id}, values)

    def next_vm_seq(self, job_id: str) -> int:
        with self.transaction() as conn:
            conn.execute("UPDATE jobs SET vm_seq = vm_seq + 1 WHERE job_id=?", (job_id,))
            return int(conn.execute("SELECT vm_seq FROM jobs WHERE job_id=?", (job_id,)).fetchone()[0])

    def release_vm_seqs(self, job_id: str, *, reserved_up_to: int, used_up_to: int) -> None:
        """Give back VM numbers reserved with :meth:`next_vm_seq` but not used (the provider had
        less capacity), unless a later reservation came meanwhile: names stay dense."""
        with self.transaction() as conn:
            conn.execute(
                "UPDATE jobs SET vm_seq=? WHERE job_id=? AND vm_seq=?", (used_up_to, job_id, reserved_up_to)
            )

    # -- generations ---------------------------------------------------------------------------

    def add_generation(self, gen: GenerationRecord) -> None:
        values = {f.name: getattr(gen, f.name) for f in fields(gen)}
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        with self.transaction() as conn:
            conn.execute(f"INSERT INTO generations ({cols}) VALUES ({marks})", tuple(values.values()))
            conn.execute(
                "UPDATE jobs SET generation=?, state='running', updated=? WHERE job_id=?",
                (gen.generation, time.time(), gen.job_id),
            )

    def generation(self, job_id: str, generation: int) -> GenerationRecord | None:
        rows = self._query("SELECT * FROM generations WHERE job_id=? AND generation=?", (job_id, generation))
        return _row_to(GenerationRecord, rows[0]) if rows else None

    def generations(self, job_id: str) -> list[GenerationRecord]:
        rows = self._query("SELECT * FROM generations WHERE job_id=? ORDER BY generation", (job_id,))
        return [_row_to(GenerationRecord, r) for r in rows]

    def update_generation(self, job_id: str, generation: int, **values: Any) -> None:
        self._update("generations", {"job_id": job_id, "generation": generation}, values)

    # -- VMs -----------------------------------------------------------------------------------

    def add_vm(self, vm: VMRecord) -> None:
        values = {f.name: getattr(vm, f.name) for f in fields(vm)}
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        with self.transaction() as conn:
            conn.execute(f"INSERT INTO vms ({cols}) VALUES ({marks})", tuple(values.values()))

    def vm(self, vm_id: str) -> VMRecord | None:
        rows = self._query("SELECT * FROM vms WHERE vm_id=?", (vm_id,))
        return _row_to(VMRecord, rows[0]) if rows else None

    def vms(self, job_id: str, *, states: Sequence[str] | None = None) -> list[VMRecord]:
        sql, args = "SELECT * FROM vms WHERE job_id=?", [job_id]
        if states is not None:
            sql += f" AND state IN ({', '.join('?' for _ in states)})"
            args.extend(states)
        return [_row_to(VMRecord, r) for r in self._query(sql + " ORDER BY seq", args)]

    def update_vm(self, vm_id: str, **values: Any) -> None:
        self._update("vms", {"vm_id": vm_id}, values)

    # -- events --------------------------------------------------------------------------------

    def add_event(
        self,
        job_id: str,
        kind: str,
        message: str = "",
        *,
        vm_id: str = "",
        generation: int = 0,
        data: dict[str, Any] | None = None,
        when: float | None = None,
    ) -> int:
        with self.transaction() as conn:
            cur = conn.execute(
                "INSERT INTO events (job_id, time, kind, vm_id, generation, message, data_json)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    job_id,
                    time.time() if when is None else when,
                    kind,
                    vm_id,
                    generation,
                    message,
                    json.dumps(data or {}, sort_keys=True),
                ),
            )
            return int(cur.lastrowid or 0)

    def events(
        self, job_id: str = "", *, after_id: int = 0, limit: int = 0, kinds: Sequence[str] | None = None
    ) -> list[EventRecord]:
        sql, args = "SELECT * FROM events WHERE id > ?", [after_id]
        if job_id:
            sql += " AND job_id=?"
            args.append(job_id)
        if kinds:
            sql += f" AND kind IN ({', '.join('?' for _ in kinds)})"
            args.extend(kinds)
        sql += " ORDER BY id"
        if limit > 0:
            sql += " LIMIT ?"
            args.append(limit)
        return [_row_to(EventRecord, r) for r in self._query(sql, args)]

    # -- progress and worker stats -------------------------------------------------------------

    def add_progress(self, rec: ProgressRecord) -> None:
        with self.transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO progress VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    rec.job_id,
                    rec.generation,
                    rec.step,
                    rec.time,
                    rec.samples_per_s,
                    rec.loss,
                    rec.pipeline_depth,
                    rec.data_parallel,
                ),
            )

    def progress(self, job_id: str, *, last: int = 0) -> list[ProgressRecord]:
        if last > 0:
            rows = self._query(
                "SELECT * FROM (SELECT * FROM progress WHERE job_id=? ORDER BY time DESC LIMIT ?)"
                " ORDER BY time",
                (job_id, last),
            )
        else:
            rows = self._query("SELECT * FROM progress WHERE job_id=? ORDER BY time", (job_id,))
        return [_row_to(ProgressRecord, r) for r in rows]

    def put_worker_stat(self, rec: WorkerStatRecord) -> None:
        values = {f.name: getattr(rec, f.name) for f in fields(rec)}
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        with self.transaction() as conn:
            conn.execute(
                f"INSERT OR REPLACE INTO worker_stats ({cols}) VALUES ({marks})", tuple(values.values())
            )

    def worker_stats(self, job_id: str, generation: int) -> list[WorkerStatRecord]:
        rows = self._query(
            "SELECT * FROM worker_stats WHERE job_id=? AND generation=? ORDER BY rank", (job_id, generation)
        )
        return [_row_to(WorkerStatRecord, r) for r in rows]
