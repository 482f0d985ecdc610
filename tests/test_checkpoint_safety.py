"""Checkpoints lose nothing to bad input (issue #17): symlinked step directories, shards of the
wrong shape, links / FIFOs / devices in place of files, failed saves at a graceful stop, and the
true bound on the steps redone after a loss.

Single-process engines (world size 1, no signal handlers), like tests/test_checkpoint.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch
from models import build_model

import varuna
from varuna.runtime.checkpoint import (
    MANIFEST,
    CheckpointError,
    list_checkpoints,
    read_shard,
    step_dir_name,
    verify_checkpoint,
)
from varuna.runtime.checkpoint_store import prune

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from ckpt_worker import GLOBAL_BATCH, MICRO_BATCH, batch_for  # noqa: E402

GUARD_S = 120  # a failure guard only: each wait below ends as soon as the awaited thing happens


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_engine(ckpt: Path, **cfg) -> varuna.Engine:
    cfg.setdefault("resume", "0")
    return varuna.Engine(
        build_model("gpt", dropout=0.1),
        varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=7,
                            stop_signals=(), checkpoint_dir=str(ckpt), **cfg),
        example_batch=batch_for(1),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    )


@pytest.fixture
def saved(tmp_path) -> Path:
    """A store with the complete checkpoints of steps 1 and 2 of one run."""
    ckpt = tmp_path / "ckpt"
    eng = make_engine(ckpt)
    for step in (1, 2):
        eng.train_step(batch_for(step))
        eng.save_checkpoint(wait=True)
    assert eng.checkpointer.last_ok
    eng.close()
    return ckpt


def reseal(step_dir: Path, name: str) -> None:
    """Make the manifest agree with the file's current bytes (a checksum that matches)."""
    m = json.loads((step_dir / MANIFEST).read_text())
    data = (step_dir / name).read_bytes()
    for f in m["files"]:
        if f["name"] == name:
            f["bytes"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (step_dir / MANIFEST).write_text(json.dumps(m))


# ---------------------------------------------------------------------------------------------
# 1. Symlinked step directories are never followed


def test_prune_never_follows_a_symlinked_step_dir_out_of_the_root(tmp_path, caplog):
    root, outside = tmp_path / "ckpt", tmp_path / "precious"
    (root / step_dir_name(1)).mkdir(parents=True)
    (root / step_dir_name(1) / MANIFEST).write_text("{}")
    outside.mkdir()
    (outside / MANIFEST).write_text("{}")
    (outside / "seg000-00.pt").write_bytes(b"data")
    (root / step_dir_name(5)).symlink_to(outside, target_is_directory=True)
    with caplog.at_level(logging.WARNING, logger="varuna.runtime.checkpoint"):
        assert [c.step for c in list_checkpoints(root)] == [1]
        prune(root, 1, keep=1)  # step 5 > 1 would be pruned as an abandoned lineage
    assert (outside / MANIFEST).is_file() and (outside / "seg000-00.pt").is_file()
    assert (root / step_dir_name(5)).is_symlink(), "the link is the user's: left alone"
    warned = [r.getMessage() for r in caplog.records if "symbolic link" in r.getMessage()]
    assert warned and step_dir_name(5) in warned[0], warned


# ---------------------------------------------------------------------------------------------
# 2. A shard whose tensor has the wrong shape (checksum matching) is refused


def test_shard_of_the_wrong_shape_with_a_matching_checksum_is_refused(saved):
    step_dir = saved / step_dir_name(2)
    for f in sorted(step_dir.glob("seg*.pt")):
        shard = read_shard(f)
        name = next((n for n, t in shard["params"].items() if t.dim() == 2), None)
        if name is not None:
            break
    good = shard["params"][name]
    shard["params"][name] = good[0].clone()  # [n] would broadcast into every row of [k, n]
    torch.save(shard, f)
    reseal(step_dir, f.name)
    assert not verify_checkpoint(step_dir), "sizes and checksums agree: only the shape is wrong"
    with pytest.raises(CheckpointError) as e:
        make_engine(saved, resume="1")
    msg = str(e.value)
    assert "\n" not in msg and name in msg and f.name in msg, msg
    assert str(tuple(good[0].shape)) in msg and str(tuple(good.shape)) in msg, msg
    assert "delete" in msg, msg


# ---------------------------------------------------------------------------------------------
# 4. Only regular files, never more than the manifest says


def test_fifo_in_place_of_a_shard_is_refused_without_blocking(saved):
    step_dir = saved / step_dir_name(2)
    victim = step_dir / "seg001-00.pt"
    victim.unlink()
    os.mkfifo(victim)
    result: list = []
    t = threading.Thread(target=lambda: result.append(verify_checkpoint(step_dir)), daemon=True)
    t.start()
    t.join(GUARD_S)
    if t.is_alive():  # it blocked opening the FIFO: give it a writer so the thread ends
        os.close(os.open(victim, os.O_WRONLY | os.O_NONBLOCK))
        t.join(GUARD_S)
        pytest.fail("verify_checkpoint blocked on a FIFO")
    assert any("seg001-00.pt" in p and "FIFO" in p for p in result[0]), result
    with pytest.raises(CheckpointError, match=r"seg001-00.pt: refusing to read a FIFO"):
        make_engine(saved, resume="1")


def test_symlinked_shard_is_refused(saved, tmp_path):
    step_dir = saved / step_dir_name(2)
    victim = step_dir / "seg001-00.pt"
    elsewhere = tmp_path / "elsewhere.pt"
    shutil.move(victim, elsewhere)  # same bytes: only the link stands out
    victim.symlink_to(elsewhere)
    problems = verify_checkpoint(step_dir)
    assert any("seg001-00.pt" in p and "symbolic link" in p for p in problems), problems
    with pytest.raises(CheckpointError, match=r"seg001-00.pt: refusing to read a symbolic link"):
        make_engine(saved, resume="1")


def test_link_to_a_device_is_refused_unread(saved):
    from varuna.runtime.checkpoint_files import read_regular

    step_dir = saved / step_dir_name(2)
    victim = step_dir / "seg001-00.pt"
    victim.unlink()
    victim.symlink_to("/dev/null")
    problems = verify_checkpoint(step_dir)
    assert any("symbolic link" in p for p in problems), problems
    with pytest.raises(CheckpointError, match="a character device"):
        read_regular(Path("/dev/zero"))  # would never end if read
    with pytest.raises(CheckpointError, match="bytes, more than"):
        read_regular(step_dir / "seg000-00.pt", max_bytes=10)


# ---------------------------------------------------------------------------------------------
# 3. A failed save leaves nothing behind and fails the graceful stop


def _raise_at(event: str):
    def hook(e: str) -> None:
        if e == event:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return hook


@pytest.mark.parametrize("event", ["copy-chunk", "commit-tmp"])
def test_failed_save_leaves_no_temporary_or_partial_files(tmp_path, event):
    ckpt = tmp_path / "ckpt"
    eng = make_engine(ckpt)
    try:
        eng.train_step(batch_for(1))
        eng.checkpointer.progress_hook = _raise_at(event)
        target = eng.save_checkpoint(wait=True)
        assert eng.checkpointer.last_ok is False
        err = eng.checkpointer.last_error
        assert err and str(target) in err and os.strerror(errno.ENOSPC) in err, err
        left = [p for p in ckpt.rglob("*") if ".tmp-" in p.name]
        assert not left, f"temporaries left behind: {left}"
        assert not list(target.glob("seg*.pt")), "a failed save keeps none of its shards"
        assert not (target / MANIFEST).exists()
    finally:
        eng.close()


def test_graceful_stop_whose_checkpoint_failed_does_not_exit_0(tmp_path):
    ckpt = tmp_path / "ckpt"
    eng = make_engine(ckpt)
    try:
        eng.train_step(batch_for(1))
        shutil.rmtree(ckpt, ignore_errors=True)
        ckpt.write_text("not a directory")  # a real OS error for the save: ENOTDIR
        eng.stop_requested = True
        with pytest.raises((SystemExit, CheckpointError)) as e:
            eng.train_step(batch_for(2))
        if isinstance(e.value, SystemExit):
            assert e.value.code not in (0, None), "a stop that lost its checkpoint must not exit 0"
            msg = str(e.value.code)
        else:
            msg = str(e.value)
        assert "\n" not in msg, msg
        assert str(ckpt) in msg and "Not a directory" in msg and "step 2" in msg, msg
    finally:
        eng.close()


# ---------------------------------------------------------------------------------------------
# 5. The steps-redone bound as it truly is


def test_steps_finished_before_a_save_commits_are_bounded(tmp_path):
    """A save is committed in the background, so steps finish while it commits; the next
    periodic save waits for it. A loss at any moment redoes at most 2·every − 1 steps
    (every + 1 is reachable: the old "≤ checkpoint_every" claim is wrong)."""
    every = 2
    ckpt = tmp_path / "ckpt"
    trace: list[tuple[str, int]] = []
    step3_done = threading.Event()
    eng = make_engine(ckpt, checkpoint_every=every)

    def hook(event: str) -> None:
        step = int(threading.current_thread().name.rsplit("-", 1)[1])
        if event == "commit-tmp" and step == every:
            # Hold the first commit until the next step has finished (a slow store).
            assert step3_done.wait(GUARD_S), "step 3 never finished"
        if event == "commit":
            trace.append(("commit", step))

    def on_step(result) -> None:
        trace.append(("step", result.step))
        if result.step == every + 1:
            step3_done.set()

    eng.checkpointer.progress_hook = hook
    eng.add_step_callback(on_step)
    try:
        for step in range(1, 3 * every + 1):
            eng.train_step(batch_for(step))
        assert eng.checkpointer.wait() and eng.checkpointer.last_ok
    finally:
        eng.close()
    reported = committed = 0
    worst = 0
    for kind, step in trace:
        if kind == "step":
            reported = step
        else:
            committed = step
        worst = max(worst, reported - committed)  # steps redone if the job were lost now
    assert ("step", every + 1) in trace and trace.index(("step", every + 1)) < trace.index(("commit", every))
    assert worst == every + 1, trace
    assert worst <= 2 * every - 1, trace
    for s in range(every, 3 * every, every):  # the save of s commits before step s + every is reported
        assert trace.index(("commit", s)) < trace.index(("step", s + every)), trace


# ---------------------------------------------------------------------------------------------
# 6. A save in flight when a writer is lost (live morph, docs/live_morph.md)


def test_a_save_waiting_for_a_lost_writer_is_abandoned_at_once_and_the_previous_stays(tmp_path):
    """Rank 0 commits only once every writer's marker is there; a writer lost mid-save (a live
    run learns it from the store) never writes one. The wait ends when the loss is known, not
    after comm_timeout_s: no manifest (the checkpoint never exists), the previous one stays newest."""
    from varuna.runtime.checkpoint_writer import run_save_job

    ckpt = tmp_path / "ckpt"
    eng = make_engine(ckpt, comm_timeout_s=3600.0)
    lost: set[int] = set()
    marker_written = threading.Event()
    try:
        eng.train_step(batch_for(1))
        assert eng.save_checkpoint(wait=True) is not None and eng.checkpointer.last_ok
        eng.train_step(batch_for(2))
        eng.checkpointer.lost_writers = lambda: set(lost)
        job = eng.checkpointer._save_job(ckpt, ckpt / step_dir_name(2), 2, nonce=7)
        job.writers = [0, 1]  # rank 1 (another process in a real run) will never write its marker
        job.hook = lambda event: marker_written.set() if event == "marker" else None
        result: list[bool] = []
        writer = threading.Thread(target=lambda: result.append(run_save_job(job)), name="writer-2")
        writer.start()
        assert marker_written.wait(GUARD_S), "rank 0's own part never got written"
        lost.add(1)  # the live world learns that rank 1 is gone
        writer.join(GUARD_S)
        assert not writer.is_alive(), "the commit kept waiting for a writer known to be gone"
        assert result == [False] and "writer rank(s) [1] are gone" in (job.error or ""), job.error
        assert not (ckpt / step_dir_name(2) / MANIFEST).exists()
        complete = [c.step for c in list_checkpoints(ckpt) if c.complete]
        assert complete == [1], "the previous one stays the newest"
    finally:
        eng.close()


# ---------------------------------------------------------------------------------------------
# 7. A writer whose marker rank 0 already consumed keeps its files (chaos: "committed checkpoint
#    missing a file")


def test_a_writer_whose_marker_was_consumed_at_once_keeps_its_files(tmp_path, monkeypatch):
    """Rank 0 commits as soon as the last marker lands and removes ``.markers/``; a writer that
    looked at its own marker after writing it found nothing, counted its save failed and deleted
    its shards from the checkpoint rank 0 had just committed. Once a marker is out, the files are
    the checkpoint's: the writer's part succeeded and every file stays."""
    from varuna.runtime import checkpoint_writer
    from varuna.runtime.checkpoint_writer import MARKERS, run_save_job

    real = checkpoint_writer.atomic_write

    def write_then_commit(path: Path, data: bytes, *a, **kw) -> None:
        real(path, data, *a, **kw)
        if path.parent.name == MARKERS:  # rank 0 (another process) commits and cleans up at once
            shutil.rmtree(path.parent)

    ckpt = tmp_path / "ckpt"
    eng = make_engine(ckpt)
    try:
        eng.train_step(batch_for(1))
        target = ckpt / step_dir_name(1)
        job = eng.checkpointer._save_job(ckpt, target, 1, nonce=3)
        job.rank = 1  # a non-committing writer: its files go in, its marker is consumed by rank 0
        monkeypatch.setattr(checkpoint_writer, "atomic_write", write_then_commit)
        assert run_save_job(job), job.error
        names = [s.name for s in job.shards]
        assert names and all((target / n).is_file() for n in names), "the writer deleted its shards"
    finally:
        eng.close()


def test_temporary_names_differ_between_writers_with_the_same_pid(tmp_path):
    """Writers on different hosts (or pid namespaces) share a store and often a pid: their
    temporary files must not collide."""
    from varuna.runtime.checkpoint_files import _tmp_name

    names = {_tmp_name(tmp_path / "seg000-00.pt") for _ in range(64)}
    assert len(names) == 64


def test_a_fenced_out_writer_removes_nothing_from_the_store(tmp_path):
    """A writer whose save fails after a newer generation started leaves the store alone: the
    names it wrote may be the newer generation's files by now (same names, recycled inodes), so
    its clean-up runs inside the fence like its renames (Note [Checkpoint fence])."""
    from varuna.runtime.checkpoint_fence import FenceToken, raise_fence
    from varuna.runtime.checkpoint_writer import run_save_job

    ckpt = tmp_path / "ckpt"
    eng = make_engine(ckpt)
    try:
        eng.train_step(batch_for(1))
        target = ckpt / step_dir_name(1)
        job = eng.checkpointer._save_job(ckpt, target, 1, nonce=5)
        ckpt.mkdir(parents=True, exist_ok=True)
        job.fence = raise_fence(ckpt, FenceToken(1))

        def newer_generation_then_fail(event: str) -> None:
            if event == "copied":
                raise_fence(ckpt, FenceToken(2))  # the next generation starts on this store
                raise OSError(errno.EIO, os.strerror(errno.EIO))

        job.hook = newer_generation_then_fail
        assert not run_save_job(job)
        assert (target / job.shards[0].name).is_file(), "a fenced-out writer deleted a file in the store"
    finally:
        eng.close()
