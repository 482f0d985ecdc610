"""The background half of a checkpoint save (Note [Save] in checkpoint.py), for any format.

:func:`take_shares` takes this rank's part of the state, one :class:`StateShare` per file the
format planned for it: a host snapshot, or the live tensors (the only part training waits for);
:func:`run_save_job`, on a background thread, has the format write each file to local disk
(:func:`write_local`), copies them to the global store, drops this rank's marker and, on rank 0,
waits for every writer's marker and has the format commit (:func:`commit`). A :class:`SaveJob`
is plain data: the thread never touches the engine.

Note [Snapshot to disk]: the host snapshot is a second copy of the rank's parameters and
optimizer state -- 3× the parameters' bytes with Adam -- held until it is on local disk. A stage
sized to its memory (a model too big for one process, docs/too_big.md) has no room for it. Then
(``Checkpointer.snapshot``: "disk", or "auto" finding too little headroom) the shares reference
the live tensors and :func:`write_local` has them written on the training thread before it goes
on (training waits for the local write instead of a memcpy); copying to the global store and
committing stay in the background.

Example::

    shares = take_shares(mine, engine.state_dict(), step=300, rank=0)
    ok = run_save_job(SaveJob(root=root, target=root / "step_00000300", ..., format=fmt, shards=mine,
                              shares=shares, ...))
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from varuna.core.env import ProcessEnv
from varuna.core.progress import Progress
from varuna.runtime.checkpoint_fence import FencedOut, FenceToken, fence_held
from varuna.runtime.checkpoint_files import (
    JSON_MAX_BYTES,
    CheckpointError,
    atomic_write,
    copy_file,
    fsync_dir,
    read_regular,
)
from varuna.runtime.checkpoint_format import CheckpointFormat, StateLayout, StateShare, detached, snapshot
from varuna.runtime.checkpoint_shards import Shard
from varuna.runtime.checkpoint_store import prune

__all__ = [
    "MARKERS",
    "SaveJob",
    "commit",
    "memory_headroom",
    "run_save_job",
    "shard_state_bytes",
    "take_shares",
    "takes_host_snapshot",
    "write_local",
]

#: Where writers drop their markers inside the step directory (the commit protocol's, not a format's).
MARKERS = ".markers"

log = logging.getLogger("varuna.runtime.checkpoint")


@dataclass(kw_only=True)
class SaveJob:
    """Everything the background thread needs (plain data: it never touches the engine)."""

    root: Path
    target: Path
    local: Path
    step: int
    nonce: int
    rank: int
    format: CheckpointFormat
    shards: list[Shard]
    """This rank's files (its part of the format's plan)."""
    shares: list[StateShare | None]
    """What to write in each of ``shards`` (host snapshots or live tensors; dropped once written)."""
    records: list[dict | None]
    """Each file's record once written (the format's ``write`` returns it); they go in the marker."""
    writers: list[int]
    """Ranks whose markers rank 0 waits for (those with files)."""
    expected_files: list[str]
    metadata: dict | None
    """Rank 0 only: the run's JSON-able metadata the format's commit stores (step, loss scale...)."""
    layout: StateLayout
    keep: int
    timeout_s: float
    chunk_bytes: int
    hook: Callable[[str], None] | None
    lost_writers: Callable[[], set[int]] | None = None
    """Ranks known gone (a live run): rank 0's commit stops waiting for their markers at once."""
    fence: FenceToken | None = None
    """The generation this save belongs to (agreed by the ranks); every rename into the store is
    refused once a newer one started (Note [Checkpoint fence]). None: unfenced."""
    error: str | None = None
    """Set when the save failed: the step directory and the error (e.g. the OS error)."""
    committed: bool = False
    """Rank 0: the commit file is written (the checkpoint exists; its files must stay)."""
    local_failure: BaseException | None = None
    """The training thread's local write failed (Note [Snapshot to disk]); the thread reports it."""


def shard_state_bytes(
    shards: Sequence[Shard], stage_tensors: Mapping[str, torch.Tensor], opt: dict | None
) -> int:
    """Bytes of tensor data a snapshot of ``shards`` would copy (tensors and optimizer state).

    Example::

        nbytes = shard_state_bytes(my_shards, engine.stage_params, optimizer_state_by_name(opt, params))
    """
    tensors = {n for s in shards if s.holds != "optimizer" for n in s.params}
    states = {n for s in shards if s.holds != "tensors" for n in s.params}
    total = sum(stage_tensors[n].numel() * stage_tensors[n].element_size() for n in tensors)
    for n, v in (opt or {}).get("state", {}).items():
        if n in states:
            total += sum(t.numel() * t.element_size() for t in v.values() if isinstance(t, torch.Tensor))
    return total


def memory_headroom() -> int | None:
    """Bytes this process can still allocate, as far as it can tell: the least of its share of
    the host's ``MemAvailable`` and of the room under a cgroup v2 ``memory.max`` (divided by
    ``$LOCAL_WORLD_SIZE``: the ranks of a host save at the same step), and the room under its own
    ``RLIMIT_AS``. None when none of them is readable.

    Example::

        room = memory_headroom()     # e.g. 5_400_000_000 on a host with 21 GB free and 4 ranks
    """
    sharers = ProcessEnv.from_env().local_world_size
    room: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            room += [int(line.split()[1]) * 1024 // sharers for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/status") as f:
                vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
            room.append(max(soft - vm, 0))
        except (OSError, StopIteration):
            pass
    try:
        cg = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if cg != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            room.append(max(int(cg) - used, 0) // sharers)
    except (OSError, ValueError):
        pass
    return min(room) if room else None


def takes_host_snapshot(mode: str, nbytes: int) -> bool:
    """Whether a save of ``nbytes`` of state takes a host snapshot (Note [Snapshot to disk]):
    always with ``"memory"``, never with ``"disk"``, and with ``"auto"`` when the copy fits in
    half of :func:`memory_headroom` (or the headroom is unknown).

    >>> takes_host_snapshot("disk", 1), takes_host_snapshot("memory", 1 << 60)
    (False, True)
    """
    if mode not in ("auto", "memory", "disk"):
        raise ValueError(f"Checkpointer.snapshot must be 'auto', 'memory' or 'disk' (got {mode!r})")
    if mode != "auto":
        return mode == "memory"
    room = memory_headroom()
    # Half: the copy must leave room for the next step's activations and allocator slack.
    return room is None or 2 * nbytes <= room


def take_shares(
    shards: Sequence[Shard], state: Mapping[str, Any], *, step: int, rank: int, copy: bool = True
) -> list[StateShare]:
    """This rank's part of the state, one :class:`StateShare` per file of ``shards``.

    ``state``: the stage's state in ``Engine.state_dict`` form (``params``, ``buffers``, name-keyed
    ``optimizer``). ``copy``: host snapshots (training goes on updating the originals);
    False: the shares reference the live tensors and must be written (:func:`write_local`)
    before training changes them (Note [Snapshot to disk])."""
    take = snapshot if copy else detached
    tensors_of = {**state.get("buffers", {}), **state["params"]}
    opt = state["optimizer"]
    shares = []
    for shard in shards:
        keep = set(shard.params) if shard.holds != "tensors" else set()
        # The synchronous part of a save (Note [Save]): a host snapshot of this rank's part.
        # Serialising it (to local disk) and copying it (to the global store) happen in the
        # background thread; the snapshot is freed once it is on local disk.
        optimizer = {
            "class": opt["class"],
            "state": {n: take(v) for n, v in opt["state"].items() if n in keep},
            "param_groups": [
                {
                    **snapshot({k: v for k, v in g.items() if k != "params"}),
                    "params": [n for n in g["params"] if n in keep],
                }
                for g in opt["param_groups"]
                if any(n in keep for n in g["params"])
            ],
        }
        names = shard.params if shard.holds != "optimizer" else ()
        tensors = {n: take(tensors_of[n]) for n in names}
        shares.append(StateShare(step=step, rank=rank, tensors=tensors, optimizer=optimizer))
    return shares


def write_local(job: SaveJob) -> None:
    """Have the format write the shares not yet written to the job's local staging directory,
    dropping each once it is on disk. The training thread calls it for a save without a host
    snapshot (Note [Snapshot to disk]); :func:`run_save_job` for the rest.

    Example::

        write_local(job)             # job.records now hold each file's record; shares are None
    """
    hook = job.hook or (lambda event: None)
    job.local.mkdir(parents=True, exist_ok=True)
    for i, shard in enumerate(job.shards):
        share = job.shares[i]
        if share is None:
            continue
        hook("local-write")
        job.records[i] = job.format.write(shard, share, job.local / shard.name)
        job.shares[i] = None  # free the snapshot: the file on local disk is the copy now


def run_save_job(job: SaveJob) -> bool:
    """The background part of a save (Note [Save]): write to local disk, copy to the store,
    drop a marker, and on rank 0 commit; True when this rank's part (and rank 0's commit)
    succeeded. Never raises: a failed save must not stop training.

    ``job.hook`` gets the named points of a save (a test hook): ``local-write`` (before each
    file's local write), ``copy-chunk``, ``copied``, ``marker``, then on rank 0 ``commit-ready``
    (every marker is in), ``commit-tmp`` (between the commit file's temporary file and its
    rename) and ``commit``."""
    hook = job.hook or (lambda event: None)
    copied: dict[Path, tuple[int, int]] = {}  # what this rank put in the store: path -> (dev, inode)
    what = f"the checkpoint of step {job.step} (rank {job.rank}'s part)"

    def guard() -> contextlib.AbstractContextManager:
        return fence_held(job.root, job.fence, what)

    try:
        if job.local_failure is not None:
            raise job.local_failure
        write_local(job)
        records = [r for r in job.records if r is not None]
        with guard():  # a stale writer stops before copying anything (Note [Checkpoint fence])
            job.target.mkdir(parents=True, exist_ok=True)
        # Rank 0 only, on a terminal, for copies slow enough to wait for (the delay): the bar
        # shares the screen with the training loop's output.
        with Progress(
            f"checkpoint step {job.step}",
            total=sum(f["bytes"] for f in records),
            unit="B",
            unit_scale=True,
            leave=False,
            delay=1.0,
            enabled=None if job.rank == 0 else False,
        ) as bar:

            def on_chunk(n: int) -> None:
                bar.update(n)
                hook("copy-chunk")

            for shard in job.shards:
                dst = job.target / shard.name
                copy_file(job.local / shard.name, dst, job.chunk_bytes, on_chunk, guard)
                copied[dst] = _identity(dst)
                hook("copied")
        fsync_dir(job.target)
        if records:
            markers = job.target / MARKERS
            markers.mkdir(exist_ok=True)
            marker = {"nonce": job.nonce, "rank": job.rank, "files": records}
            with guard():
                atomic_write(markers / f"rank{job.rank}.json", json.dumps(marker).encode())
            if job.rank != 0:
                # Once the marker is out the files are the checkpoint's, not this rank's: rank 0
                # may commit and remove .markers/ at once, so nothing here may touch them again
                # (a failure from here on must not delete shards of a committed checkpoint).
                # Rank 0 is the committer: until its commit is in, its files are still its own.
                copied.clear()
            hook("marker")
        shutil.rmtree(job.local, ignore_errors=True)
        if job.rank == 0:
            commit(job, hook)
        return True
    except Exception as e:  # a failed save must not stop training: the checkpoint just never exists
        job.error = str(e) if str(job.target) in str(e) or isinstance(e, FencedOut) else f"{job.target}: {e}"
        log.warning(
            "varuna: the checkpoint of step %d failed on rank %d and will not exist: %s",
            job.step,
            job.rank,
            job.error,
        )
        # This rank's files of a checkpoint that will never exist (they would fill a full disk),
        # only those still its own: a newer generation may have written the same names since.
        if copied and not job.committed:
            _remove_own(job, copied)
        return False
    finally:
        shutil.rmtree(job.local, ignore_errors=True)  # local copies are only a staging area


def _remove_own(job: SaveJob, copied: dict[Path, tuple[int, int]]) -> None:
    """Unlink the files this rank copied into the store, each only if it is still the one it
    wrote. Inside the fence: once a newer generation started, the names (and, on a reused inode,
    even the identities) may be its files, so a fenced-out writer removes nothing."""
    try:
        with fence_held(job.root, job.fence, f"removing rank {job.rank}'s part of step {job.step}"):
            for p, ident in copied.items():
                try:
                    if _identity(p) == ident:
                        p.unlink()
                except OSError:
                    pass
    except FencedOut:
        pass  # the save's own failure line already says the newer generation refused it
    except OSError as e:
        log.warning("varuna: left rank %d's files of step %d in place: %s", job.rank, job.step, e)


def _identity(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino


def commit(job: SaveJob, hook: Callable[[str], None]) -> None:
    """Rank 0: wait for every writer's marker, have the format write its commit file, prune."""
    markers = job.target / MARKERS
    deadline = time.monotonic() + job.timeout_s
    records: list[dict] = []
    pending = set(job.writers)
    while pending:
        for r in sorted(pending):
            try:
                m = json.loads(read_regular(markers / f"rank{r}.json", JSON_MAX_BYTES))
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            if m.get("nonce") == job.nonce:  # markers of an abandoned earlier attempt differ
                records.extend(m["files"])
                pending.discard(r)
        if pending:
            lost = pending & job.lost_writers() if job.lost_writers is not None else set()
            if lost:  # their part will never come: abandon now (no commit: the previous stays)
                raise CheckpointError(f"abandoned: writer rank(s) {sorted(lost)} are gone (a peer was lost)")
            if time.monotonic() > deadline:
                raise CheckpointError(f"no marker from rank(s) {sorted(pending)} after {job.timeout_s:.0f}s")
            time.sleep(0.05)  # polling the shared store: the writers are other processes, other hosts
    got = sorted(f["name"] for f in records)
    if got != sorted(job.expected_files):
        raise CheckpointError(f"writers produced files {got}, expected {sorted(job.expected_files)}")
    if job.metadata is None:
        raise CheckpointError("rank 0's save job has no metadata to commit")
    metadata = job.metadata if job.fence is None else {**job.metadata, "fence": job.fence.as_list()}
    hook("commit-ready")
    # The commit file's rename and the fence check are one step (Note [Checkpoint fence]): a
    # generation that started since refuses it, however late this commit comes.
    with fence_held(job.root, job.fence, f"the commit of the checkpoint of step {job.step}"):
        job.format.commit(
            job.target, records, metadata, job.layout, before_replace=lambda: hook("commit-tmp")
        )
    job.committed = True
    hook("commit")
    shutil.rmtree(markers, ignore_errors=True)
    try:  # a generation that started since owns the store now: its steps are not ours to prune
        with fence_held(job.root, job.fence, f"pruning after the checkpoint of step {job.step}"):
            prune(job.root, job.step, job.keep)
    except FencedOut as e:
        log.warning("varuna: %s", e)
