"""The background half of a checkpoint save (Note [Save] in checkpoint.py).

:func:`build_shard_payloads` takes the host snapshot of this rank's shard files (the only part
training waits for); :func:`run_save_job`, on a background thread, writes them to local disk
(sha256 on the way, :func:`write_local`), copies them to the global store, drops this rank's
marker and, on rank 0, waits for every writer's marker and commits the manifest (:func:`commit`).
A :class:`SaveJob` is plain data: the thread never touches the engine.

Note [Snapshot to disk]: the host snapshot is a second copy of the rank's parameters and
optimizer state -- 3× the parameters' bytes with Adam -- held until it is on local disk. A stage
sized to its memory (a model too big for one process, docs/too_big.md) has no room for it. Then
(``Checkpointer.snapshot``: "disk", or "auto" finding too little headroom) the payloads reference
the live tensors and :func:`write_local` serialises them on the training thread before it goes
on (training waits for the local write instead of a memcpy); copying to the global store and
committing stay in the background.

Example::

    files, payloads = build_shard_payloads(mine, stage_params, opt_state, step=300, rank=0)
    ok = run_save_job(SaveJob(root=root, target=root / "step_00000300", ..., files=files,
                              payloads=payloads, ...))
"""

from __future__ import annotations

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
from varuna.runtime.checkpoint_shards import Shard
from varuna.runtime.checkpoint_store import (
    FORMAT,
    JSON_MAX_BYTES,
    MANIFEST,
    MARKERS,
    VERSION,
    CheckpointError,
    atomic_write,
    copy_file,
    fsync_dir,
    prune,
    read_regular,
    save_hashed,
)

__all__ = [
    "SaveJob",
    "as_saved",
    "build_shard_payloads",
    "commit",
    "memory_headroom",
    "run_save_job",
    "shard_state_bytes",
    "takes_host_snapshot",
    "write_local",
]

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
    files: list[dict]
    """This rank's files: name, segment, stage, replica, rank, params {name: {shape, dtype}}."""
    payloads: list[dict]
    """What to ``torch.save`` in each of ``files`` (host snapshots; dropped once written)."""
    writers: list[int]
    """Ranks whose markers rank 0 waits for (those with files)."""
    expected_files: list[str]
    manifest_base: dict | None
    """Rank 0 only: everything of the manifest but ``files`` and ``parameters``."""
    param_segments: dict[str, list[int]]
    keep: int
    timeout_s: float
    chunk_bytes: int
    hook: Callable[[str], None] | None
    lost_writers: Callable[[], set[int]] | None = None
    """Ranks known gone (a live run): rank 0's commit stops waiting for their markers at once."""
    error: str | None = None
    """Set when the save failed: the step directory and the error (e.g. the OS error)."""
    committed: bool = False
    """Rank 0: the manifest is written (the checkpoint exists; its files must stay)."""
    local_failure: BaseException | None = None
    """The training thread's local write failed (Note [Snapshot to disk]); the thread reports it."""


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], x: Any) -> Any:
    """``x`` with ``fn`` applied to every tensor inside its dicts, lists and tuples."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return {k: _map_tensors(fn, v) for k, v in x.items()}
    if isinstance(x, list):
        return [_map_tensors(fn, v) for v in x]
    if isinstance(x, tuple):
        return tuple(_map_tensors(fn, v) for v in x)
    return x


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", memory_format=torch.contiguous_format, copy=True)


def _saveable(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if t.device.type == "cpu" and t.is_contiguous() and whole else _host_copy(t)


def snapshot(x: Any) -> Any:
    """A host copy of ``x``'s tensors, compact and contiguous (torch.save writes a view's whole
    storage), so training can go on updating the originals while the copy is being written.

    >>> w = torch.ones(2)
    >>> snapshot({"w": w})["w"].data_ptr() != w.data_ptr()
    True
    """
    return _map_tensors(_host_copy, x)


def as_saved(x: Any) -> Any:
    """``x``'s tensors as ``torch.save`` can write them without a copy: the live tensor when it
    is a compact host tensor (its whole storage), else a compact host copy (torch.save would
    write a view's whole storage; a device tensor must come to the host). :func:`write_local`
    applies it to one file's payload at a time, so a save without a snapshot copies at most one
    file's worth (and nothing for compact host tensors).

    >>> w = torch.zeros(4, 4)
    >>> as_saved(w).data_ptr() == w.data_ptr(), as_saved(w[1]).untyped_storage().nbytes()
    (True, 16)
    """
    return _map_tensors(_saveable, x)


def shard_state_bytes(
    shards: Sequence[Shard], stage_params: Mapping[str, torch.Tensor], opt: dict | None
) -> int:
    """Bytes of tensor data a snapshot of ``shards`` would copy (parameters and optimizer state).

    Example::

        nbytes = shard_state_bytes(my_shards, engine.stage_params, optimizer_state_by_name(opt, params))
    """
    names = {n for s in shards for n in s.params}
    total = sum(stage_params[n].numel() * stage_params[n].element_size() for n in names)
    for n, v in (opt or {}).get("state", {}).items():
        if n in names:
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


def build_shard_payloads(
    shards: Sequence[Shard],
    stage_params: Mapping[str, torch.Tensor],
    opt: dict | None,
    *,
    step: int,
    rank: int,
    copy: bool = True,
) -> tuple[list[dict], list[dict]]:
    """Host snapshots of ``shards`` (this rank's files): their manifest entries and what to save.

    ``opt``: the stage's name-keyed optimizer state (``optimizer_state_by_name``). ``copy=False``:
    the payloads reference the live tensors; they must be written (:func:`write_local`) before
    training changes them (Note [Snapshot to disk])."""
    take = snapshot if copy else (lambda x: _map_tensors(torch.Tensor.detach, x))
    files, payloads = [], []
    for shard in shards:
        keep = set(shard.params)
        # The synchronous part of a save (Note [Save]): a host snapshot of this rank's part.
        # Serialising it (to local disk) and copying it (to the global store) happen in the
        # background thread; the snapshot is freed once it is on local disk.
        params = {n: take(stage_params[n]) for n in shard.params}
        opt_part = {
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
        payloads.append(
            {
                "format": FORMAT,
                "version": VERSION,
                "step": step,
                "segment": shard.segment,
                "params": params,
                "optimizer": opt_part,
            }
        )
        files.append(
            {
                "name": shard.name,
                "segment": shard.segment,
                "stage": shard.stage,
                "replica": shard.replica,
                "rank": rank,
                "params": {
                    n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                    for n, t in params.items()
                },
            }
        )
    return files, payloads


def write_local(job: SaveJob) -> None:
    """Serialise the payloads not yet written to the job's local staging directory (sha256 on
    the way), dropping each once it is on disk. The training thread calls it for a save without
    a host snapshot (Note [Snapshot to disk]); :func:`run_save_job` for the rest.

    Example::

        write_local(job)             # job.files now carry "bytes" and "sha256"; payloads are None
    """
    hook = job.hook or (lambda event: None)
    job.local.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(job.files):
        if job.payloads[i] is None:
            continue
        hook("local-write")
        # as_saved: a snapshot is already compact host tensors; live ones are taken as they are
        # when torch.save can write them in place, else copied one file at a time.
        f["bytes"], f["sha256"] = save_hashed(as_saved(job.payloads[i]), job.local / f["name"])
        job.payloads[i] = None  # free the snapshot: the file on local disk is the copy now


def run_save_job(job: SaveJob) -> bool:
    """The background part of a save (Note [Save]): serialise to local disk, copy to the store,
    drop a marker, and on rank 0 commit; True when this rank's part (and rank 0's commit)
    succeeded. Never raises: a failed save must not stop training."""
    hook = job.hook or (lambda event: None)
    copied: list[Path] = []
    try:
        if job.local_failure is not None:
            raise job.local_failure
        write_local(job)
        job.target.mkdir(parents=True, exist_ok=True)
        # Rank 0 only, on a terminal, for copies slow enough to wait for (the delay): the bar
        # shares the screen with the training loop's output.
        with Progress(
            f"checkpoint step {job.step}",
            total=sum(f["bytes"] for f in job.files),
            unit="B",
            unit_scale=True,
            leave=False,
            delay=1.0,
            enabled=None if job.rank == 0 else False,
        ) as bar:

            def on_chunk(n: int) -> None:
                bar.update(n)
                hook("copy-chunk")

            for f in job.files:
                copy_file(job.local / f["name"], job.target / f["name"], job.chunk_bytes, on_chunk)
                copied.append(job.target / f["name"])
                hook("copied")
        fsync_dir(job.target)
        if job.files:
            markers = job.target / MARKERS
            markers.mkdir(exist_ok=True)
            marker = {"nonce": job.nonce, "rank": job.rank, "files": job.files}
            atomic_write(markers / f"rank{job.rank}.json", json.dumps(marker).encode())
            hook("marker")
        shutil.rmtree(job.local, ignore_errors=True)
        if job.rank == 0:
            commit(job, hook)
        return True
    except Exception as e:  # a failed save must not stop training: the checkpoint just never exists
        job.error = str(e) if str(job.target) in str(e) else f"{job.target}: {e}"
        log.warning(
            "varuna: the checkpoint of step %d failed on rank %d and will not exist: %s",
            job.step,
            job.rank,
            job.error,
        )
        # This rank's files of a checkpoint that will never exist (they would fill a full disk).
        for p in [] if job.committed else copied:
            try:
                p.unlink(missing_ok=True)
            except OSError:
                pass
        return False
    finally:
        shutil.rmtree(job.local, ignore_errors=True)  # local copies are only a staging area


def commit(job: SaveJob, hook: Callable[[str], None]) -> None:
    """Rank 0: wait for every writer's marker, write the manifest (the commit), prune."""
    markers = job.target / MARKERS
    deadline = time.monotonic() + job.timeout_s
    files: list[dict] = []
    pending = set(job.writers)
    while pending:
        for r in sorted(pending):
            try:
                m = json.loads(read_regular(markers / f"rank{r}.json", JSON_MAX_BYTES))
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            if m.get("nonce") == job.nonce:  # markers of an abandoned earlier attempt differ
                files.extend(m["files"])
                pending.discard(r)
        if pending:
            lost = pending & job.lost_writers() if job.lost_writers is not None else set()
            if lost:  # their part will never come: abandon now (no manifest: the previous stays)
                raise CheckpointError(f"abandoned: writer rank(s) {sorted(lost)} are gone (a peer was lost)")
            if time.monotonic() > deadline:
                raise CheckpointError(f"no marker from rank(s) {sorted(pending)} after {job.timeout_s:.0f}s")
            time.sleep(0.05)
    got = sorted(f["name"] for f in files)
    if got != sorted(job.expected_files):
        raise CheckpointError(f"writers produced files {got}, expected {sorted(job.expected_files)}")
    parameters = {}
    for f in files:
        for n, meta in f["params"].items():
            parameters[n] = {**meta, "segments": job.param_segments.get(n, []), "file": f["name"]}
    missing = set(job.param_segments) - set(parameters)
    if missing:
        raise CheckpointError(f"no file holds parameter(s) {sorted(missing)[:5]}")
    manifest = {
        **job.manifest_base,
        "parameters": parameters,
        "files": sorted(files, key=lambda f: f["name"]),
    }
    atomic_write(
        job.target / MANIFEST,
        json.dumps(manifest, indent=1).encode(),
        before_replace=lambda: hook("manifest-tmp"),
    )
    job.committed = True
    hook("manifest")
    shutil.rmtree(markers, ignore_errors=True)
    prune(job.root, job.step, job.keep)


# ---- load
