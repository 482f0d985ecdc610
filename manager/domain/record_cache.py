"""The store's memory: the rows the manager reads on every RPC, and the writes it defers.

The manager is the only writer of its state file (a flock keeps one manager per file,
manager/common/daemon_lock.py), so a copy of the rows in memory, changed by the same calls that
change the file, never goes stale. :class:`manager.domain.store.Store` keeps one; this module is the
bookkeeping, with no SQL:

- every job row, and the generation rows read so far (read-through);
- the VM rows of every job read so far (all of a job's VMs at once, so that listing them needs
  no query);
- **deferred writes** (Note [Deferred writes]): heartbeat times and ports, worker stats and
  progress points, applied here at once and written to the file in one batch by the next
  :meth:`manager.domain.store.Store.flush`.

Note [Deferred writes]: at 1,000 VMs the manager takes about 1,500 heartbeats a second, and
with one SQLite transaction each it spent its time committing (docs/reliability.md, the
``load_manager.py`` section). Most of what a heartbeat carries only repeats what the manager
already knows, or is a value that the next heartbeat brings again: when it was heard from
(``last_heartbeat``), a free port (``free_port``), a worker's latest compute times
(``worker_stats``), a throughput point (``progress``). Those are deferred: kept here and written
by the control loop every tick, one transaction for all. Everything a decision or a restart
depends on — a VM's state, its workers' report, a notice, an agent restart, a generation's
state or last step, the job's step, events — is written at once, as before.

A manager killed between two flushes loses at most one tick of deferred values: heartbeat times
that are too old. That is safe because a restarted manager judges liveness from
``max(last_heartbeat, its own start)`` (``ManagerContext.age``), so no VM is declared gone for
heartbeats the old process heard but did not write; the next heartbeat brings the port and
the worker stats back, and a lost progress point only leaves a gap in the throughput history.

    >>> from manager.domain.records import VMRecord
    >>> cache = RecordCache()
    >>> cache.load_job_vms("j", [VMRecord(vm_id="v", job_id="j", provider="local", seq=1,
    ...                                   state="up", slots=1, created=0.0)])
    >>> cache.change_vm("v", {"last_heartbeat": 5.0}, deferred=True)
    True
    >>> cache.vm("v").last_heartbeat, cache.take_pending().vm_rows
    (5.0, {('last_heartbeat',): [(5.0, 'v')]})
    >>> len(cache.take_pending())
    0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from manager.domain.records import GenerationRecord, JobRecord, ProgressRecord, VMRecord, WorkerStatRecord

__all__ = ["PendingWrites", "RecordCache"]


@dataclass
class PendingWrites:
    """The deferred writes, ready for one transaction."""

    vm_rows: dict[tuple[str, ...], list[tuple[Any, ...]]] = field(default_factory=dict)
    """Columns → ``(value, ..., vm_id)`` for ``UPDATE vms SET column=?, ... WHERE vm_id=?``."""
    stats: list[WorkerStatRecord] = field(default_factory=list)
    progress: list[ProgressRecord] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(len(rows) for rows in self.vm_rows.values()) + len(self.stats) + len(self.progress)


class RecordCache:
    """Rows in memory and deferred writes (module docstring). Not thread-safe by itself: the
    store calls it under its memory lock.

    Example::

        cache.change_vm(vm_id, {"state": "gone"}, deferred=False)  # after the UPDATE committed
        batch = cache.take_pending()    # write it in one transaction;
        cache.restore_pending(batch)    # only if that failed
    """

    def __init__(self) -> None:
        #: Every job row, by id (None until the store first reads them).
        self.jobs: dict[str, JobRecord] | None = None
        #: Generation rows read so far; a write drops the entry (read again on next use).
        self.generations: dict[tuple[str, int], GenerationRecord] = {}
        self._vms: dict[str, VMRecord] = {}
        self._by_job: dict[str, dict[str, VMRecord]] = {}
        self._deferred_columns: dict[str, set[str]] = {}
        self._stats: dict[tuple[str, int, int], WorkerStatRecord] = {}
        self._progress: dict[tuple[str, int, int], ProgressRecord] = {}

    # -- VM rows -------------------------------------------------------------------------------

    def has_job_vms(self, job_id: str) -> bool:
        """Whether every VM row of ``job_id`` is here."""
        return job_id in self._by_job

    def load_job_vms(self, job_id: str, vms: Iterable[VMRecord]) -> None:
        """Every VM row of ``job_id``, as just read from the file."""
        by_id = self._by_job[job_id] = {}
        for vm in vms:
            by_id[vm.vm_id] = self._vms[vm.vm_id] = vm

    def vm(self, vm_id: str) -> VMRecord | None:
        """The VM's row (None: not loaded, or no such VM)."""
        return self._vms.get(vm_id)

    def job_vms(self, job_id: str) -> list[VMRecord]:
        """The loaded VM rows of ``job_id``, in ``seq`` order."""
        return sorted(self._by_job.get(job_id, {}).values(), key=lambda vm: vm.seq)

    def add_vm(self, vm: VMRecord) -> None:
        """A row just inserted (kept only when its job's rows are here: they stay complete)."""
        if vm.job_id in self._by_job:
            self._by_job[vm.job_id][vm.vm_id] = self._vms[vm.vm_id] = vm

    def change_vm(self, vm_id: str, values: dict[str, Any], *, deferred: bool) -> bool:
        """Apply ``values`` to the VM's row; False when it is not loaded. ``deferred``: the file
        does not have them yet (the next :meth:`take_pending` lists them); otherwise they were just
        written, so columns deferred earlier need not be written again."""
        vm = self._vms.get(vm_id)
        if vm is None:
            return False
        new = dataclasses.replace(vm, **values)  # a new snapshot: readers keep theirs
        self._vms[vm_id] = self._by_job[vm.job_id][vm_id] = new
        if deferred:
            self._deferred_columns.setdefault(vm_id, set()).update(values)
        elif vm_id in self._deferred_columns:
            self._deferred_columns[vm_id].difference_update(values)
        return True

    # -- other deferred rows -------------------------------------------------------------------

    def defer_stat(self, rec: WorkerStatRecord) -> None:
        """A worker's latest heartbeat (one row per worker: the newest replaces the older)."""
        self._stats[(rec.job_id, rec.generation, rec.rank)] = rec

    def defer_progress(self, rec: ProgressRecord) -> None:
        """A throughput point (one row per step)."""
        self._progress[(rec.job_id, rec.generation, rec.step)] = rec

    def pending_progress(self, job_id: str) -> list[ProgressRecord]:
        """The job's deferred throughput points (still the cache's: not taken)."""
        return [p for (job, _, _), p in self._progress.items() if job == job_id]

    def pending_stats(self, job_id: str, generation: int) -> list[WorkerStatRecord]:
        """The deferred worker rows of one generation (still the cache's: not taken)."""
        return [s for (job, gen, _), s in self._stats.items() if (job, gen) == (job_id, generation)]

    # -- the batch -----------------------------------------------------------------------------

    def take_pending(self) -> PendingWrites:
        """Every deferred write, grouped for ``executemany``; from now on the caller's to write
        (or to give back with :meth:`restore_pending`)."""
        out = PendingWrites(stats=list(self._stats.values()), progress=list(self._progress.values()))
        for vm_id, columns in self._deferred_columns.items():
            vm = self._vms.get(vm_id)
            if vm is None or not columns:
                continue
            names = tuple(sorted(columns))
            out.vm_rows.setdefault(names, []).append((*(getattr(vm, c) for c in names), vm_id))
        self._deferred_columns.clear()
        self._stats.clear()
        self._progress.clear()
        return out

    def restore_pending(self, batch: PendingWrites) -> None:
        """A batch of :meth:`take_pending` that could not be written: deferred again (values
        deferred since are newer and win)."""
        for columns, rows in batch.vm_rows.items():
            for row in rows:
                self._deferred_columns.setdefault(row[-1], set()).update(columns)
        for rec in batch.stats:
            self._stats.setdefault((rec.job_id, rec.generation, rec.rank), rec)
        for p in batch.progress:
            self._progress.setdefault((p.job_id, p.generation, p.step), p)
