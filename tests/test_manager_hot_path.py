"""The manager's heartbeat path at scale: what an RPC costs in SQLite, and what survives a crash.

A heartbeat that only repeats what the manager knows commits nothing: its time and port are
deferred and written once per control-loop tick (Note [Deferred writes] in
manager/domain/record_cache.py). A state change is on the file before the RPC returns. A manager killed
between two flushes loses only heartbeat times, and its successor declares no healthy VM gone
for it.
"""

from __future__ import annotations

import sqlite3

import pytest
from test_manager_controller import FakeProvider, World

from manager.domain.records import GenerationRecord, ProgressRecord, VMRecord, WorkerStatRecord
from manager.domain.store import Store


@pytest.fixture
def commits(monkeypatch) -> dict[str, int]:
    """Counts the COMMITs of every sqlite3 connection opened from now on."""
    count = {"n": 0}
    real_connect = sqlite3.connect

    def trace(sql: str) -> None:
        if sql.lstrip().upper().startswith(("COMMIT", "END")):
            count["n"] += 1

    def connect(*args, **kwargs):
        conn = real_connect(*args, **kwargs)
        conn.set_trace_callback(trace)
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect)
    return count


def _on_file(tmp_path, sql: str, *args):
    """What the state file holds (a connection of its own: not the manager's memory)."""
    conn = sqlite3.connect(str(tmp_path / "state.sqlite"))
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def _running(tmp_path) -> tuple[World, str]:
    w = World(tmp_path, provider=FakeProvider(capacity=3))
    job = w.submit(max_vms=3)
    w.tick()
    w.tick(0.1)
    w.steps(job, 1, 2)
    assert w.gen(job).state == "running" and len(w.running(job)) == 3
    return w, job


def test_steady_heartbeats_commit_nothing_until_the_tick_flushes(tmp_path, commits):
    w, job = _running(tmp_path)
    w.mgr.tick()  # everything so far on the file
    vm_id = w.running(job)[0].vm_id
    before = commits["n"]
    w.clock.advance(1.0)
    for vm in w.running(job):
        vm.beat()
        vm.beat()
    assert commits["n"] == before, "an agent heartbeat with nothing new committed a transaction"
    # The manager knows the new time at once; the file gets it at the next tick.
    assert w.store.vm(vm_id).last_heartbeat == w.clock()
    (on_file,) = _on_file(tmp_path, "SELECT last_heartbeat FROM vms WHERE vm_id=?", vm_id)[0]
    assert on_file < w.clock()
    # A new step from every worker: the job's and the generation's step, not one write per worker.
    w.steps(job, 3, 3)
    assert commits["n"] - before == 2
    w.mgr.tick()
    (on_file,) = _on_file(tmp_path, "SELECT last_heartbeat FROM vms WHERE vm_id=?", vm_id)[0]
    assert on_file == w.clock()
    stats = _on_file(tmp_path, "SELECT rank, step FROM worker_stats WHERE job_id=? ORDER BY rank", job)
    assert stats == [(0, 3), (1, 3), (2, 3)]
    assert [p.step for p in w.store.progress(job)] == [1, 2, 3]


def test_a_state_change_is_on_the_file_before_the_heartbeat_returns(tmp_path, commits):
    w, job = _running(tmp_path)
    vm = w.running(job)[1]
    before = commits["n"]
    vm.finish(code=1)  # its worker crashed
    vm.beat()
    assert commits["n"] > before
    (workers,) = _on_file(tmp_path, "SELECT workers_json FROM vms WHERE vm_id=?", vm.vm_id)[0]
    assert '"exit_code": 1' in workers and '"running": false' in workers


def test_heartbeat_times_lost_in_a_crash_do_not_make_vms_gone(tmp_path):
    w, job = _running(tmp_path)
    w.mgr.tick()
    # Heartbeats for 10 s (T = 3 s) and no control-loop tick: their times are only in memory.
    for _ in range(10):
        w.clock.advance(1.0)
        for vm in w.vms.values():
            vm.beat()
    ages = _on_file(tmp_path, "SELECT ? - last_heartbeat FROM vms WHERE job_id=?", w.clock(), job)
    assert all(age >= 10.0 > w.mgr.config.heartbeat_timeout_s for (age,) in ages)
    # kill -9: no flush, no close. A new manager opens the same file at once.
    w2 = World(tmp_path, store=Store(str(tmp_path / "state.sqlite")), clock=w.clock, provider=w.provider)
    for vm_id, vm in w.vms.items():  # the same agents, still running their workers
        vm.mgr = w2.mgr
        w2.vms[vm_id] = vm
    w2.mgr.tick()  # before any agent heartbeats again
    w2.tick(0.5)
    assert not w2.event(job, "vm-gone")
    assert w2.gen(job).generation == w.gen(job).generation and w2.gen(job).state == "running"
    # Liveness still works: a VM that really goes silent is declared gone after T.
    silent = w2.running(job)[0]
    silent.alive = False
    w2.until(lambda: w2.event(job, "vm-gone"), dt=1.0, max_ticks=10)
    assert [e.vm_id for e in w2.event(job, "vm-gone")] == [silent.vm_id]


# -- the store's memory ------------------------------------------------------------------------------


def _store_with_a_vm(tmp_path) -> Store:
    store = Store(str(tmp_path / "state.sqlite"))
    store.add_job("j", {"script": "x"})
    store.add_vm(VMRecord(vm_id="v1", job_id="j", provider="local", seq=1, state="up", slots=1, created=1.0))
    return store


def test_a_deferred_value_never_overwrites_a_newer_written_one(tmp_path):
    store = _store_with_a_vm(tmp_path)
    store.note_vm("v1", last_heartbeat=5.0, free_port=1234)
    store.update_vm("v1", last_heartbeat=7.0, state="gone")  # e.g. a registration, written at once
    assert store.flush() == 1  # the port only
    assert _on_file(tmp_path, "SELECT last_heartbeat, free_port, state FROM vms") == [(7.0, 1234, "gone")]
    assert store.flush() == 0
    store.note_vm("v1", last_heartbeat=9.0)
    store.close()  # a clean stop writes what is deferred
    assert Store(str(tmp_path / "state.sqlite")).vm("v1").last_heartbeat == 9.0


def test_cached_records_follow_every_write_and_readers_keep_their_snapshot(tmp_path):
    store = _store_with_a_vm(tmp_path)
    assert store.next_vm_seq("j") == 1 and store.job("j").vm_seq == 1
    store.release_vm_seqs("j", reserved_up_to=1, used_up_to=0)
    assert store.job("j").vm_seq == 0
    job = store.job("j")
    job.step = 99  # the caller's own copy
    assert store.job("j").step == 0
    store.add_generation(
        GenerationRecord(
            job_id="j", generation=1, state="running", pipeline_depth=1, data_parallel=1,
            micro_batch_size=2, vms_json='["v1"]', master_addr="h", master_port=1, launched=2.0,
        )
    )  # fmt: skip
    assert store.job("j").generation == 1 and store.job("j").state == "running"
    gen = store.generation("j", 1)
    vm = store.vm("v1")
    store.update_generation("j", 1, state="ended")
    store.note_vm("v1", last_heartbeat=3.0)
    assert gen.state == "running" and vm.last_heartbeat is None  # snapshots do not change
    assert store.generation("j", 1).state == "ended" and store.vm("v1").last_heartbeat == 3.0
    assert [v.vm_id for v in store.vms("j", states=["up"])] == ["v1"]
    # Deferred rows are seen by the store's own reads before they reach the file.
    store.put_worker_stat(
        WorkerStatRecord(
            job_id="j", generation=1, rank=0, vm_id="v1", stage=0, replica=0, step=4,
            resumed_from=0, time=1.0, fwd_s=0.1, bwd_s=0.2,
        )
    )  # fmt: skip
    store.add_progress(
        ProgressRecord(
            job_id="j", generation=1, step=4, time=1.0, samples_per_s=1.0, loss=1.0,
            pipeline_depth=1, data_parallel=1,
        )
    )  # fmt: skip
    assert [s.step for s in store.worker_stats("j", 1)] == [4]
    assert [p.step for p in store.progress("j")] == [4]
    assert Store(str(tmp_path / "state.sqlite")).vm("v1").last_heartbeat == 3.0


def test_a_failed_flush_keeps_the_deferred_values_for_the_next(tmp_path):
    """A write that fails for a reason that may pass (here SQLite refusing every write, as for a
    file whose permissions changed) keeps the batch for the next flush."""
    store = _store_with_a_vm(tmp_path)
    store.note_vm("v1", last_heartbeat=5.0)
    store._conn.execute("PRAGMA query_only=ON")
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        store.flush()
    store.note_vm("v1", free_port=99)  # deferred meanwhile: goes with the next batch
    store._conn.execute("PRAGMA query_only=OFF")
    assert store.flush() == 1
    assert _on_file(tmp_path, "SELECT last_heartbeat, free_port FROM vms") == [(5.0, 99)]


def test_a_row_the_file_refuses_is_dropped_with_one_line_and_the_rest_written(tmp_path, capsys):
    """Note [Non-finite values]: a batch that fails on a row's content (a constraint) is written
    row by row; the refused row is dropped with one line and never deferred again (it once made
    every later tick and status call fail), the others reach the file."""
    store = _store_with_a_vm(tmp_path)
    store.add_vm(VMRecord(vm_id="v2", job_id="j", provider="local", seq=2, state="up", slots=1, created=1.0))
    conn = sqlite3.connect(str(tmp_path / "state.sqlite"))
    conn.execute(
        "CREATE TRIGGER refuse BEFORE UPDATE OF last_heartbeat ON vms WHEN NEW.vm_id = 'v1'"
        " BEGIN SELECT RAISE(ABORT, 'refused by a constraint'); END"
    )
    conn.commit()
    conn.close()
    store.note_vm("v1", last_heartbeat=5.0)
    store.note_vm("v2", last_heartbeat=6.0)
    store.add_progress(ProgressRecord(job_id="j", generation=1, step=3, time=1.0, samples_per_s=None,
                                      loss=None, pipeline_depth=1, data_parallel=1))  # fmt: skip
    assert store.flush() == 2  # v2's time and the progress point; v1's is dropped
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "dropped 1 row(s)" in err[0] and "VM v1" in err[0] and "Traceback" not in err[0]
    assert store.flush() == 0, "the refused row is not deferred again"
    on_file = _on_file(tmp_path, "SELECT vm_id, last_heartbeat FROM vms ORDER BY vm_id")
    assert on_file == [("v1", None), ("v2", 6.0)]
    assert _on_file(tmp_path, "SELECT step, loss, samples_per_s FROM progress") == [(3, None, None)]
