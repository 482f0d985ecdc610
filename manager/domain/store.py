"""The manager's durable state: jobs, generations, VMs, events and progress in one SQLite file.

Everything the manager decides from is here, so a manager killed at any point and started again
on the same file resumes supervising: the VMs and workers keep running meanwhile (agents retry
their heartbeats), and the new process reads the job's generation, its VMs and their last
reports back. Only soft state is kept in memory (fail-stutter counters, which restart from zero).

Concurrency: one connection in WAL mode (readers never block the writer), used under one lock
by the gRPC handler threads and the controller thread, so there is exactly one writer at a time.
Every write is its own short transaction, except the deferred ones (below). ``synchronous=NORMAL``
in WAL mode keeps the database consistent on a crash and may lose only the last transactions on a
power cut; heartbeats repeat every second, so nothing of value is lost. The WAL is copied into
the database by :meth:`Store.checkpoint`, which the control loop calls, never inside a commit.

Reads are served from memory (:class:`manager.domain.record_cache.RecordCache`): this process is the
only writer of the file, so the copy is changed by the same calls that change the file and never
goes stale. What a heartbeat only repeats (when a VM was heard from, its free port, a worker's
latest compute times, a throughput point) is *deferred*: kept in memory and written by
:meth:`Store.flush`, which the control loop calls every tick — one transaction for all of them
instead of one per heartbeat (Note [Deferred writes] in manager/domain/record_cache.py says why a crash
between two flushes is harmless). Every other write reaches the file before the call returns.

Times are wall-clock seconds (``time.time()``): they must mean the same after a restart.

    >>> store = Store(":memory:")
    >>> store.add_event("j1", "submitted", "hello")
    1
    >>> [e.kind for e in store.events("j1")]
    ['submitted']
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from manager.common.log_lines import RateLimitedLines
from manager.domain.record_cache import PendingWrites, RecordCache
from manager.domain.records import (
    EventRecord,
    GenerationRecord,
    JobRecord,
    ProgressRecord,
    VMRecord,
    WorkerStatRecord,
)
from manager.domain.state_file import APPLICATION_ID, check_ours, file_identity, restore_copy
from manager.domain.store_schema import SCHEMA, SCHEMA_VERSION, job_row_repair, migrate

__all__ = [
    "SCHEMA_VERSION",  # re-exported from manager.domain.store_schema
    "EventRecord",
    "GenerationRecord",
    "JobRecord",
    "ProgressRecord",
    "Store",
    "VMRecord",
    "WorkerStatRecord",
]

# Note [Non-finite values]: SQLite stores a NaN as NULL, so a diverged loss (a skipped step reports
# loss = nan) once made a NOT NULL column refuse the whole deferred batch; the batch was deferred
# again and failed every tick after, taking status and the heartbeats' writes with it (issue 35).
# Now a progress point's loss and throughput may be NULL (what a non-finite value is stored as:
# WorkerReports stores them as None), and a batch the file refuses for its content is written
# row by row with the refused rows dropped (Store._write_row_by_row): one bad row costs itself.

#: Errors that come from a row's content (a constraint, a value SQLite cannot take), not from the
#: file or the disk: retrying the same row would fail again.
_ROW_ERRORS = (sqlite3.IntegrityError, sqlite3.InterfaceError, sqlite3.DataError, OverflowError)


def _describe(one: PendingWrites) -> str:
    """Which row a one-row batch holds, for the line that says it was dropped."""
    if one.progress:
        p = one.progress[0]
        return f"progress of job {p.job_id} generation {p.generation} step {p.step}"
    if one.stats:
        st = one.stats[0]
        return f"worker stats of job {st.job_id} generation {st.generation} rank {st.rank}"
    columns, rows = next(iter(one.vm_rows.items()))
    return f"VM {rows[0][-1]} ({', '.join(columns)})"


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


def _row_to(cls: type, row: sqlite3.Row) -> Any:
    names = _field_names(cls)
    return cls(**{k: row[k] for k in row.keys() if k in names})


class _ReadOnlyQueries:
    """The reads of :class:`Store` that never write (read-only views such as the dashboard):
    deferred values are merged in from memory instead of flushed."""

    _mem: threading.RLock
    _cache: RecordCache

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        raise NotImplementedError

    def newest_events(self, job_id: str, count: int) -> list[EventRecord]:
        """The job's ``count`` newest events, oldest first."""
        rows = self._query(
            "SELECT * FROM (SELECT * FROM events WHERE job_id=? ORDER BY id DESC LIMIT ?) ORDER BY id",
            (job_id, count),
        )
        return [_row_to(EventRecord, r) for r in rows]

    def peek_progress(self, job_id: str, *, last: int) -> list[ProgressRecord]:
        """The job's newest ``last`` throughput points by time, the deferred ones included,
        without writing anything (for read-only views such as the dashboard)."""
        rows = self._query(
            "SELECT * FROM (SELECT * FROM progress WHERE job_id=? ORDER BY time DESC LIMIT ?) ORDER BY time",
            (job_id, last),
        )
        points = {(r["generation"], r["step"]): _row_to(ProgressRecord, r) for r in rows}
        with self._mem:
            points.update(((p.generation, p.step), p) for p in self._cache.pending_progress(job_id))
        return sorted(points.values(), key=lambda p: p.time)[-last:]

    def peek_worker_stats(self, job_id: str, generation: int) -> list[WorkerStatRecord]:
        """:meth:`worker_stats` without writing the deferred rows first (they are merged in)."""
        rows = self._query(
            "SELECT * FROM worker_stats WHERE job_id=? AND generation=? ORDER BY rank", (job_id, generation)
        )
        stats = {r["rank"]: _row_to(WorkerStatRecord, r) for r in rows}
        with self._mem:
            stats.update((s.rank, s) for s in self._cache.pending_stats(job_id, generation))
        return [stats[rank] for rank in sorted(stats)]


class _DeferredWrites:
    """:meth:`Store.flush`: the deferred values in one transaction (Note [Deferred writes] in
    manager/domain/record_cache.py), row by row when the file refuses one (Note [Non-finite
    values])."""

    path: str
    row_log: RateLimitedLines
    _lock: threading.RLock
    _mem: threading.RLock
    _cache: RecordCache

    def transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def flush(self) -> int:
        """Write every deferred value in one transaction; how many rows it wrote. Kept for the
        next call if the write fails for a reason that may pass (a full disk, a lock); a batch the
        file refuses for what is in it (a constraint) is written row by row instead, and the rows
        it refuses are dropped with one line each kind (Note [Non-finite values])."""
        # The connection first and to the end: no write of the same columns can come between
        # taking the batch and committing it (a newer value overwritten by an older one).
        with self._lock:
            with self._mem:
                batch = self._cache.take_pending()
            if not len(batch):
                return 0
            try:
                with self.transaction() as conn:
                    self._write_batch(conn, batch)
            except _ROW_ERRORS:
                return self._write_row_by_row(batch)
            except BaseException:
                with self._mem:
                    self._cache.restore_pending(batch)
                raise
            return len(batch)

    def _write_batch(self, conn: sqlite3.Connection, batch: PendingWrites) -> None:
        for columns, rows in batch.vm_rows.items():
            sets = ", ".join(f"{c}=?" for c in columns)
            conn.executemany(f"UPDATE vms SET {sets} WHERE vm_id=?", rows)
        if batch.stats:
            self._insert_many(conn, "INSERT OR REPLACE INTO worker_stats", batch.stats)
        if batch.progress:
            self._insert_many(conn, "INSERT OR REPLACE INTO progress", batch.progress)

    def _write_row_by_row(self, batch: PendingWrites) -> int:
        """A batch that failed on a row's content: every row on its own (one transaction, a
        savepoint each), the refused ones dropped, never deferred again (they would fail every
        tick). Other errors go up as from :meth:`flush`."""
        singles: list[PendingWrites] = [
            PendingWrites(vm_rows={columns: [row]}) for columns, rows in batch.vm_rows.items() for row in rows
        ]
        singles += [PendingWrites(stats=[rec]) for rec in batch.stats]
        singles += [PendingWrites(progress=[rec]) for rec in batch.progress]
        written, refused = 0, []
        with self.transaction() as conn:
            for one in singles:
                conn.execute("SAVEPOINT one_row")
                try:
                    self._write_batch(conn, one)
                except _ROW_ERRORS as exc:
                    conn.execute("ROLLBACK TO one_row")
                    refused.append(f"{_describe(one)}: {exc}")
                else:
                    written += 1
                conn.execute("RELEASE one_row")
        if refused:
            self.row_log.line(
                "refused-rows",
                f"varuna-manager: state file {self.path}: dropped {len(refused)} row(s) it refused;"
                f" first: {refused[0]}",
            )
        return written

    @staticmethod
    def _insert_many(conn: sqlite3.Connection, verb: str, recs: Sequence[Any]) -> None:
        names = [f.name for f in fields(recs[0])]
        conn.executemany(
            f"{verb} ({', '.join(names)}) VALUES ({', '.join('?' for _ in names)})",
            [tuple(getattr(r, n) for n in names) for r in recs],
        )



class _FileGuard:
    """The connection to the state file, and the file itself (Note [Our state file] and Note
    [State file vanishing] in manager/domain/state_file.py)."""

    path: str
    _lock: threading.RLock
    _conn: sqlite3.Connection
    _identity: tuple[int, int] | None
    _ours: str

    def _connect(self, path: str, *, check: bool) -> sqlite3.Connection:
        """A connection to ``path`` with the pragmas every one of ours has; ``check``: first
        make sure the file is ours (Note [Our state file] in manager/domain/state_file.py), before
        anything, WAL mode included, changes it."""
        # check_same_thread=False: the connection is shared by threads, serialised by _lock.
        # isolation_level=None: we issue BEGIN/COMMIT ourselves (one transaction per write).
        conn = sqlite3.connect(path, timeout=10.0, check_same_thread=False, isolation_level=None)
        try:
            conn.row_factory = sqlite3.Row
            if check:
                self._ours = check_ours(conn, path)
            if path != ":memory:":
                mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise ValueError(f"{path}: SQLite refused WAL mode (got {mode}); use a local disk")
            conn.execute("PRAGMA synchronous=NORMAL")
            # No automatic checkpoint: SQLite runs it (with an fsync) inside whichever commit
            # takes the WAL past 1,000 pages, often one an RPC is waiting for under the
            # manager's state lock. The control loop calls checkpoint() instead.
            conn.execute("PRAGMA wal_autocheckpoint=0")
            conn.execute("PRAGMA foreign_keys=ON")
        except BaseException:
            conn.close()
            raise
        return conn

    def file_state(self) -> str:
        """``"ok"``, ``"missing"`` (nothing at :attr:`path` any more) or ``"replaced"`` (another
        file there now)."""
        if self._identity is None:
            return "ok"
        now = file_identity(self.path)
        if now is None:
            return "missing"
        return "ok" if now == self._identity else "replaced"

    def restore(self) -> None:
        """Put the open database back at :attr:`path` after it vanished (the caller checked
        :meth:`file_state`). ``OSError`` when that cannot be done; when another file appeared at
        the path meanwhile, the store goes on with the copy (its name is in the error)."""
        with self._lock:
            copy = restore_copy(self._conn, self.path)
            self._conn.close()
            for stale in (f"{self.path}-wal", f"{self.path}-shm"):
                # The vanished file's, if they survived it: never to be replayed into the copy.
                if not os.path.exists(self.path):
                    Path(stale).unlink(missing_ok=True)
            try:
                os.link(copy, self.path)  # not over a file that appeared meanwhile
            except OSError as exc:
                self._conn = self._connect(copy, check=False)
                self._identity = None  # the manager stops (it is told so); the copy gets the rest
                raise OSError(
                    f"cannot put the state file back at {self.path} ({exc.strerror or exc});"
                    f" the manager's state is in {copy}"
                ) from None
            Path(copy).unlink()
            self._conn = self._connect(self.path, check=False)
            self._identity = file_identity(self.path)


@dataclass
class Store(_ReadOnlyQueries, _DeferredWrites, _FileGuard):
    """The SQLite state file (see the module docstring). Thread-safe."""

    path: str
    _conn: sqlite3.Connection = field(init=False, repr=False)
    _lock: threading.RLock = field(init=False, repr=False, default_factory=threading.RLock)
    """The connection's: one statement or transaction at a time. Taken before ``_mem``."""
    _mem: threading.RLock = field(init=False, repr=False, default_factory=threading.RLock)
    """The memory's (``_cache``): never held while waiting for ``_lock`` or for SQLite, so a
    read or a deferred write does not wait for a transaction (a flush, a WAL checkpoint)."""
    _cache: RecordCache = field(init=False, repr=False, default_factory=RecordCache)
    problems: list[str] = field(init=False, repr=False, default_factory=list)
    """One line per job row quarantined when the file was opened (the manager reports them)."""
    row_log: RateLimitedLines = field(init=False, repr=False, default_factory=RateLimitedLines)
    """Where :meth:`flush` says which rows the file refused (Note [Rate-limited lines])."""
    _identity: tuple[int, int] | None = field(init=False, repr=False, default=None)
    _ours: str = field(init=False, repr=False, default="")

    def __post_init__(self) -> None:
        self._conn = self._connect(self.path, check=True)
        try:
            self._open()
        except BaseException:
            self._conn.close()
            raise
        self._identity = file_identity(self.path) if self.path != ":memory:" else None

    def _open(self) -> None:
        with self._lock:
            self._conn.executescript(SCHEMA)
            if self._ours != "ours":
                self._conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
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
            # Every job row up front (one per job submitted): job reads never need the connection.
            rows = self._query("SELECT * FROM jobs ORDER BY created")
            self._cache.jobs = {}
            for r in rows:
                self._load_job_row(r)

    def _load_job_row(self, row: sqlite3.Row) -> None:
        """One job row into memory; a row this manager cannot read (a value of the wrong type)
        is quarantined instead: the job failed, with one line in :attr:`problems` (Note [Corrupt
        rows])."""
        job_id = row["job_id"]
        if not isinstance(job_id, str):
            self.problems.append(f"state file {self.path}: job row with an unusable id ({job_id!r}) ignored")
            return
        found = job_row_repair(row)
        if found is None:
            self._all_jobs()[job_id] = _row_to(JobRecord, row)
            return
        problem, repair = found
        message = f"quarantined: its row in the state file is corrupt ({problem})"
        values = {**repair, "state": "failed", "message": message[:500], "updated": time.time()}
        self._update("jobs", {"job_id": job_id}, values)
        self.problems.append(f"job {job_id}: {message}; it is marked failed, the other jobs go on")
        self._reload_job(job_id)

    def _migrate(self, version: int) -> None:
        """Bring a file of an older schema ``version`` up to date (columns get added; a table
        whose constraints changed is rebuilt with its rows)."""
        with self.transaction() as conn:
            migrate(conn, version)

    def close(self) -> None:
        """Write what is deferred, then close the file."""
        with self._lock:
            try:
                self.flush()
            finally:
                self._conn.close()

    def checkpoint(self) -> None:
        """Copy the WAL into the database file (PASSIVE: it never waits for other readers of
        the file). The control loop calls it every second or so, outside the state lock."""
        with self._lock:
            self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

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
        with self._lock:
            with self.transaction() as conn:
                conn.execute(
                    f"INSERT INTO jobs ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})",
                    tuple(row.values()),
                )
            self._reload_job(job_id)
        job = self.job(job_id)
        assert job is not None
        return job

    def _all_jobs(self) -> dict[str, JobRecord]:
        assert self._cache.jobs is not None  # loaded when the file is opened
        return self._cache.jobs

    def _reload_job(self, job_id: str) -> None:
        """After any write to the job's row (``_lock`` held): the copy in memory follows."""
        rows = self._query("SELECT * FROM jobs WHERE job_id=?", (job_id,))
        if rows:
            with self._mem:
                self._all_jobs()[job_id] = _row_to(JobRecord, rows[0])

    def job(self, job_id: str) -> JobRecord | None:
        """The job's row (the caller's own copy: it may change it)."""
        with self._mem:
            job = self._all_jobs().get(job_id)
            return copy.copy(job) if job is not None else None

    def jobs(self, *, active_only: bool = False) -> list[JobRecord]:
        """Every job (or every one not ended), oldest first; the caller's own copies."""
        with self._mem:
            jobs = [copy.copy(j) for j in self._all_jobs().values() if not (active_only and j.terminal)]
        return sorted(jobs, key=lambda j: j.created)

    def update_job(self, job_id: str, **values: Any) -> None:
        values["updated"] = time.time()
        with self._lock:
            self._update("jobs", {"job_id": job_id}, values)
            self._reload_job(job_id)

    def next_vm_seq(self, job_id: str) -> int:
        with self._lock:
            with self.transaction() as conn:
                conn.execute("UPDATE jobs SET vm_seq = vm_seq + 1 WHERE job_id=?", (job_id,))
                seq = int(conn.execute("SELECT vm_seq FROM jobs WHERE job_id=?", (job_id,)).fetchone()[0])
            self._reload_job(job_id)
            return seq

    def release_vm_seqs(self, job_id: str, *, reserved_up_to: int, used_up_to: int) -> None:
        """Give back VM numbers reserved with :meth:`next_vm_seq` but not used (the provider had
        less capacity), unless a later reservation came meanwhile: names stay dense."""
        with self._lock:
            with self.transaction() as conn:
                conn.execute(
                    "UPDATE jobs SET vm_seq=? WHERE job_id=? AND vm_seq=?",
                    (used_up_to, job_id, reserved_up_to),
                )
            self._reload_job(job_id)

    # -- generations ---------------------------------------------------------------------------

    def add_generation(self, gen: GenerationRecord) -> None:
        values = {f.name: getattr(gen, f.name) for f in fields(gen)}
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        with self._lock:
            with self.transaction() as conn:
                conn.execute(f"INSERT INTO generations ({cols}) VALUES ({marks})", tuple(values.values()))
                conn.execute(
                    "UPDATE jobs SET generation=?, state='running', updated=? WHERE job_id=?",
                    (gen.generation, time.time(), gen.job_id),
                )
            with self._mem:
                self._cache.generations.pop((gen.job_id, gen.generation), None)
            self._reload_job(gen.job_id)

    def generation(self, job_id: str, generation: int) -> GenerationRecord | None:
        """The generation's row (a frozen snapshot, shared by every reader)."""
        key = (job_id, generation)
        with self._mem:
            gen = self._cache.generations.get(key)
        if gen is not None:
            return gen
        with self._lock:  # not read yet: from the file (no write can come in between)
            rows = self._query("SELECT * FROM generations WHERE job_id=? AND generation=?", key)
            if not rows:
                return None
            with self._mem:
                return self._cache.generations.setdefault(key, _row_to(GenerationRecord, rows[0]))

    def generations(self, job_id: str) -> list[GenerationRecord]:
        rows = self._query("SELECT * FROM generations WHERE job_id=? ORDER BY generation", (job_id,))
        return [_row_to(GenerationRecord, r) for r in rows]

    def update_generation(self, job_id: str, generation: int, **values: Any) -> None:
        key = (job_id, generation)
        with self._lock:
            self._update("generations", {"job_id": job_id, "generation": generation}, values)
            # Read back at once: a reader must not find it missing (and wait for the connection).
            rows = self._query("SELECT * FROM generations WHERE job_id=? AND generation=?", key)
            with self._mem:
                self._cache.generations.pop(key, None)
                if rows:
                    self._cache.generations[key] = _row_to(GenerationRecord, rows[0])

    # -- VMs -----------------------------------------------------------------------------------

    def add_vm(self, vm: VMRecord) -> None:
        values = {f.name: getattr(vm, f.name) for f in fields(vm)}
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        with self._lock:
            with self.transaction() as conn:
                conn.execute(f"INSERT INTO vms ({cols}) VALUES ({marks})", tuple(values.values()))
            with self._mem:
                self._cache.add_vm(vm)

    def _load_vms(self, job_id: str) -> None:
        """Every VM row of the job into memory, unless there already (``_lock`` held: no write
        can come between the query and the copy)."""
        with self._mem:
            if self._cache.has_job_vms(job_id):
                return
        rows = self._query("SELECT * FROM vms WHERE job_id=? ORDER BY seq", (job_id,))
        with self._mem:
            self._cache.load_job_vms(job_id, [_row_to(VMRecord, r) for r in rows])

    def vm(self, vm_id: str) -> VMRecord | None:
        """The VM's row (a frozen snapshot, shared by every reader)."""
        with self._mem:
            vm = self._cache.vm(vm_id)
        if vm is not None:
            return vm
        with self._lock:
            rows = self._query("SELECT job_id FROM vms WHERE vm_id=?", (vm_id,))
            if not rows:
                return None
            self._load_vms(rows[0][0])  # all of its job's VMs: they are read together
        with self._mem:
            return self._cache.vm(vm_id)

    def vms(self, job_id: str, *, states: Sequence[str] | None = None) -> list[VMRecord]:
        """The job's VMs (those in ``states``), by ``seq``."""
        with self._mem:
            loaded = self._cache.has_job_vms(job_id)
        if not loaded:
            with self._lock:
                self._load_vms(job_id)
        with self._mem:
            vms = self._cache.job_vms(job_id)
        return vms if states is None else [vm for vm in vms if vm.state in states]

    def update_vm(self, vm_id: str, **values: Any) -> None:
        """Change the VM's row now (state changes: on the file before this returns)."""
        with self._lock:
            self._update("vms", {"vm_id": vm_id}, values)
            with self._mem:
                self._cache.change_vm(vm_id, values, deferred=False)

    def note_vm(self, vm_id: str, **values: Any) -> None:
        """Change values of the VM's row that its agent repeats every heartbeat
        (``last_heartbeat``, ``free_port``): in memory now, on the file at the next
        :meth:`flush` (Note [Deferred writes] in manager/domain/record_cache.py). Callers serialise
        their changes of one VM (the manager's state lock): a newer :meth:`update_vm` of the same
        column must not race with this."""
        if self.vm(vm_id) is None:
            raise KeyError(f"no VM {vm_id!r}")
        with self._mem:
            self._cache.change_vm(vm_id, values, deferred=True)

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
        """A throughput point (deferred: written by the next :meth:`flush`)."""
        with self._mem:
            self._cache.defer_progress(rec)

    def progress(self, job_id: str, *, last: int = 0) -> list[ProgressRecord]:
        self.flush()  # the deferred points too
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
        """A worker's latest heartbeat (deferred: written by the next :meth:`flush`)."""
        with self._mem:
            self._cache.defer_stat(rec)

    def worker_stats(self, job_id: str, generation: int) -> list[WorkerStatRecord]:
        self.flush()  # the deferred rows too
        rows = self._query(
            "SELECT * FROM worker_stats WHERE job_id=? AND generation=? ORDER BY rank", (job_id, generation)
        )
        return [_row_to(WorkerStatRecord, r) for r in rows]
