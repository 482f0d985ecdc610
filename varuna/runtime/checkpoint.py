"""Per-segment checkpoints that any P×D (and any micro-batch size) can load — paper §4.5.

Every tensor is keyed by the original model's parameter names, never by stage-local indices, so a
job that was preempted at 2×2 resumes at 4×1, 1×1 or anything else. What a step directory holds is
its format's (Note [Checkpoint formats] in checkpoint_format.py; the default, ``"varuna"``, is
per-segment ``torch.save`` shards and a ``manifest.json``: checkpoint_manifest.py, and
docs/checkpoints.md for the schema and the guarantees); the :class:`Checkpointer` here owns when
and with whom: scheduling, agreement across ranks, the host snapshot, the background copy,
pruning::

    <checkpoint_dir>/step_00000300/
        ...               the format's files, each written by one replica of its stage
        <commit file>     written LAST, atomically: a checkpoint without it does not exist

How a save goes (Note [Save]): at a mini-batch boundary every rank agrees on a save id (one tiny
all-reduce) and takes a host snapshot of the files the format's plan assigns to it (the D
replicas of a stage split the stage's files) — the only part training waits for. A background
thread has the format serialise the snapshot to fast local disk, copies the files to the global
store, fsyncs them and drops a small *marker* file. Rank 0's thread waits (bounded) for the
markers of every writer, then has the format write its commit file (tmp + fsync + ``os.replace``)
and prunes old checkpoints. At most one save per rank is in flight.

How a load goes (Note [Load]): rank 0 lists the complete checkpoints of every registered format,
newest first, and broadcasts the list; each rank has the checkpoint's format read only what its
stage holds, checked (for ``"varuna"``: size and sha256 of each file, unpickled with
``torch.load(weights_only=True)``); one all-reduce agrees on the verdict, so every rank loads the
same step or all skip it (with a warning naming the file).

Example::

    checkpoints = varuna.CheckpointConfig(dir="/mnt/blob/run1", every=100, resume="auto")
    engine = varuna.Engine(model, varuna.VarunaConfig(global_batch_size=32, micro_batch_size=4,
                                                      checkpoints=checkpoints),
                           example_batch=batch, optimizer=make_optimizer)
    for step in range(engine.step_count + 1, total_steps + 1):   # continues after the checkpoint
        engine.train_step(get_batch(step))
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from varuna.core.env import WorkerSettings
from varuna.cutting.split import ModelProfile
from varuna.runtime.checkpoint_convert import check_resumable, resolve_step_dir, weights_format
from varuna.runtime.checkpoint_fence import FencedOut, FenceToken, fence_held, start_generation
from varuna.runtime.checkpoint_files import CheckpointError, UnsoundCheckpoint
from varuna.runtime.checkpoint_format import CheckpointFormat, LoadedShare, LoadRequest, StateLayout
from varuna.runtime.checkpoint_manifest import MANIFEST, read_manifest, read_shard
from varuna.runtime.checkpoint_registry import checkpoint_format, format_of, register_format
from varuna.runtime.checkpoint_shards import Shard, plan_shards
from varuna.runtime.checkpoint_staging import create_staging
from varuna.runtime.checkpoint_store import (
    CheckpointInfo,
    list_checkpoints,
    retire,
    step_dir_name,
    verify_checkpoint,
)
from varuna.runtime.checkpoint_writer import (
    SaveJob,
    run_save_job,
    shard_state_bytes,
    take_shares,
    takes_host_snapshot,
    write_local,
)
from varuna.runtime.config import VarunaConfig
from varuna.runtime.layout import Layout
from varuna.runtime.optimizer_state import (
    load_optimizer_state_by_name,
    merge_optimizer_states,
    optimizer_state_by_name,
)
from varuna.runtime.state_codec import from_json, json_bytes, to_json
from varuna.runtime.weight_versions import pop_previous

# The checkpoint API in one place: what scripts and tests import from varuna.runtime.checkpoint.
__all__ = [
    "MANIFEST",
    "CheckpointError",
    "CheckpointFormat",
    "CheckpointInfo",
    "CheckpointState",
    "Checkpointer",
    "FenceToken",
    "FencedOut",
    "Resumed",
    "Shard",
    "checkpoint_format",
    "plan_shards",
    "optimizer_state_by_name",
    "load_optimizer_state_by_name",
    "merge_optimizer_states",
    "list_checkpoints",
    "read_manifest",
    "register_format",
    "verify_checkpoint",
    "read_shard",
    "resolve_resume",
    "state_layout",
    "step_dir_name",
]

if TYPE_CHECKING:
    from varuna.runtime.whole_state import StageExtras

log = logging.getLogger("varuna.runtime.checkpoint")

# Verdicts of one rank on one checkpoint, combined with MAX over ranks (Note [Load]).
_OK, _SKIP, _FATAL = 0, 1, 2

_RESUME_MODES = {
    "": "never",
    "0": "never",
    "false": "never",
    "no": "never",
    "never": "never",
    "1": "always",
    "true": "always",
    "yes": "always",
    "always": "always",
    "auto": "auto",
}


def resolve_resume(value: str | bool | None) -> str:
    """Normalise a resume setting to ``"never"``, ``"always"`` or ``"auto"``.

    ``None`` reads ``$VARUNA_RESUME`` (the launcher passes it through), default never.

    >>> resolve_resume(True), resolve_resume("auto"), resolve_resume("0")
    ('always', 'auto', 'never')
    """
    if value is None:
        value = WorkerSettings.from_env().resume or ""
    if isinstance(value, bool):
        return "always" if value else "never"
    mode = _RESUME_MODES.get(str(value).strip().lower())
    if mode is None:
        raise ValueError(f"bad resume setting {value!r} (VARUNA_RESUME / --resume); use 1, 0 or auto")
    return mode


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed from: its step directory, its step, the layout that wrote
    it (None for a checkpoint without one) and its format. A different P×D than the run's own is
    a morph."""

    path: Path
    step: int
    P: int | None
    D: int | None
    format: str | None = None


class CheckpointState(Protocol):
    """What the checkpointer needs from the training state it saves and restores (the engine
    provides it): the run's config and layout, the stage's parameters and optimizer (what a load
    must fit), the step counter, the stage's state by name (``state_dict``, read on save, loaded
    with ``load_state_dict`` on resume), and a way to run a save on a graceful stop."""

    config: VarunaConfig
    layout: Layout
    model: torch.nn.Module
    profile: ModelProfile
    """Canonical parameter names, which segments read them, their sizes, the CutPoint names."""
    stage_ranges: list[tuple[int, int]]
    stage_params: Mapping[str, torch.Tensor]
    """Every parameter this stage holds, by canonical name (the trainable ones are optimised)."""
    optimizer: torch.optim.Optimizer
    step_count: int
    extras: StageExtras
    """Buffers, LR scheduler, registered objects (Note [Whole state] in whole_state.py)."""

    def state_dict(self, *, optimizer_for: Iterable[str] | None = None) -> dict: ...

    def load_state_dict(self, state: dict, *, copy: bool = True) -> None: ...

    def describe(self) -> dict: ...

    def add_stop_callback(self, fn: Callable[[Any], None]) -> None: ...


#: The largest step a checkpoint may say it was taken at (no run takes 2**40 optimizer steps; a
#: bigger number is a damaged or forged manifest that would end the run at once as "finished").
MAX_STEP = 1 << 40


def check_loaded_values(path: Path, loaded: LoadedShare) -> None:
    """Refuse (:class:`CheckpointError`, one line) a checkpoint whose step is not the one its
    directory names or is out of range, or whose floating-point weights hold NaN or Inf: its
    checksums only say the bytes are the ones written, not that training can go on from them.

    Example::

        check_loaded_values(Path("ckpt/step_00000300"), loaded)  # CheckpointError: ... NaN or Inf ...
    """
    fix = "move this checkpoint out of the directory to resume from an older one"
    step = loaded.metadata.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise CheckpointError(f"{path}: step {step!r} is out of range (0..{MAX_STEP}); the manifest is "
                              f"damaged: {fix}")
    if path.name.startswith("step_") and path.name != step_dir_name(step):
        raise CheckpointError(f"{path}: its manifest says step {step}, its directory another; the "
                              f"manifest is damaged: {fix}")
    for name, t in loaded.tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{path}: {name} holds NaN or Inf values; refusing to train from them "
                                  f"({fix})")


class Checkpointer:
    """Saves and loads the checkpoints of one training state (an :class:`~varuna.runtime.engine.Engine`,
    or anything providing :class:`CheckpointState`).

    Settings come from the state's config (``checkpoints``), then the environment: ``dir`` or
    ``$VARUNA_CHECKPOINT_DIR``; ``resume`` or ``$VARUNA_RESUME`` (1 / auto / 0);
    ``format`` or ``$VARUNA_CHECKPOINT_FORMAT`` (the format written, default
    ``"varuna"``; resume reads any registered one: Note [Checkpoint formats]). The engine calls
    :meth:`attach` at the end of its ``__init__`` and :meth:`after_step` after each step.

    ``snapshot`` (Note [Snapshot to disk] in checkpoint_writer.py): ``"memory"`` takes a host copy
    of the rank's state and training goes on at once; ``"disk"`` takes none: the files are written
    to local disk from the live tensors before training goes on (no memory beyond the training
    state: for stages sized to their memory); ``"auto"`` (default) takes the copy only when it
    fits in half of :func:`~varuna.runtime.checkpoint_writer.memory_headroom`
    (:func:`~varuna.runtime.checkpoint_writer.takes_host_snapshot`).

    Example::

        engine.save_checkpoint(wait=True)          # same as engine.checkpointer.save(wait=True)
        step = engine.load_checkpoint()            # newest complete one; any P×D
        engine.checkpointer.snapshot = "disk"      # never copy the state (VarunaConfig.checkpoints.snapshot)
        engine.checkpointer.format.name            # "varuna" (VarunaConfig.checkpoints.format)
    """

    def __init__(self, state: CheckpointState) -> None:
        cfg = state.config
        self.state = state
        ck = cfg.checkpoints
        d = ck.dir or WorkerSettings.from_env().checkpoint_dir
        self.directory: Path | None = Path(d) if d else None
        self.every: int = 0
        self.keep: int = int(ck.keep)
        self.resume_mode: str = resolve_resume(ck.resume)
        local = ck.local_dir
        self._local_base: Path | None = Path(local) if local else None
        self.timeout_s: float = float(cfg.timeouts.comm_s)
        #: the format saves write (an unknown name is one line naming the registered ones)
        self.format: CheckpointFormat = checkpoint_format(ck.format)
        self.set_every(int(ck.every or 0))
        if self.keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 (got {self.keep})")
        if self.directory is None and self.resume_mode == "always":
            raise ValueError(
                "resume needs a checkpoint directory: set --checkpoint-dir, "
                "VarunaConfig.checkpoints.dir or $VARUNA_CHECKPOINT_DIR"
            )
        # Test hooks: called from the writer thread at each named point of a save; copy granularity.
        self.progress_hook: Callable[[str], None] | None = None
        self.copy_chunk_bytes = 8 << 20
        self.snapshot = ck.snapshot
        #: whether the latest save took a host snapshot (else it was written before training went on)
        self.last_snapshot_in_memory: bool | None = None
        self._local_root: Path | None = None
        self._thread: threading.Thread | None = None
        self._last_saved: tuple[Path, int] | None = None
        #: the checkpoint this run resumed from, once :meth:`load` loaded one
        self.resumed: Resumed | None = None
        #: outcome of the latest background job: None while running / never run, else True/False
        self.last_ok: bool | None = None
        #: why the latest background job failed (its step directory and the error), else None
        self.last_error: str | None = None
        #: seconds training stood still in the latest save (waiting for the previous one, agreeing,
        #: snapshotting), and the part of it spent waiting for the previous save
        self.last_stall_s = self.last_wait_s = 0.0
        #: ranks known gone (set by a live run): a save in flight waiting for them is abandoned at once
        self.lost_writers: Callable[[], set[int]] | None = None
        #: the generation this run's saves belong to, agreed by the ranks (Note [Checkpoint fence]
        #: in checkpoint_fence.py); None: unfenced (no $VARUNA_FENCE_EPOCH: not started by
        #: varuna-launch or the manager)
        self.fence: FenceToken | None = None
        self._given_fence = FenceToken.from_settings()

    def set_every(self, every: int) -> None:
        """Save every ``every`` steps from now on (0: only on a graceful stop or when asked).

        Example::

            engine.checkpointer.set_every(100)
        """
        if every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 (got {every}); 0 saves only on stop")
        if every > 0 and self.directory is None:
            raise ValueError(
                "checkpoint_every needs a checkpoint directory: set --checkpoint-dir, "
                "VarunaConfig.checkpoints.dir or $VARUNA_CHECKPOINT_DIR"
            )
        self.every = every

    # ---- wiring

    def attach(self) -> None:
        """Register the save-on-stop callback and resume when asked (a collective then); else start
        from ``config.checkpoints.init_from``'s weights when set."""
        if self.directory is not None:
            self.state.add_stop_callback(lambda _state: self.save_on_stop())
            # Before loading: a late commit of an older generation is then either visible to
            # the load below or refused (Note [Checkpoint fence]).
            self.start_generation(0)
        resumed = None
        if self.resume_mode != "never":
            if self.directory is None:
                raise ValueError(
                    "resume needs a checkpoint directory: set --checkpoint-dir or $VARUNA_CHECKPOINT_DIR"
                )
            resumed = self.load(required=self.resume_mode == "always")
        init_from = self.state.config.checkpoints.init_from
        if resumed is None and init_from:
            self.load_weights(init_from)

    def start_generation(self, live: int) -> FenceToken | None:
        """Agree on this generation's fence token (a collective when fenced; ``live``: the
        live-morph generation, 0 at launch) and raise the store's fence to it: no save of an
        older generation commits from now on (Note [Checkpoint fence]). None: unfenced.

        Example::

            engine.checkpointer.start_generation(live.generation)   # after a live morph
        """
        if self._given_fence is not None and self.directory is not None:
            self.fence = start_generation(self.directory, self._given_fence, live, rank=self.rank,
                                          world=self.state.layout.world)
        return self.fence

    def load_weights(self, path: str | Path) -> None:
        """Load only the weights (parameters and buffers) of ``path`` into this stage (a
        collective): a checkpoint of any registered format, a checkpoint root, a Hugging Face model
        directory or a DCP checkpoint (:func:`~varuna.runtime.checkpoint_convert.weights_format`).
        Each rank reads only its stage's tensors. The optimizer, step and registered state stay as
        they are; any rank's failure is every rank's ``CheckpointError``.

        Example::

            engine.checkpointer.load_weights("/models/llama-hf")      # = CheckpointConfig.init_from
        """
        st = self.state
        buffers = st.extras.buffers.named()
        request = LoadRequest(tensors={**buffers, **st.stage_params}, optimizer_class=None,
                              optional=frozenset(buffers))
        loaded, problem = None, None
        try:
            root = Path(path)
            source = resolve_step_dir(root) if format_of(root) is None and list_checkpoints(root) else root
            loaded = weights_format(source).read(source, request)
        except (CheckpointError, UnsoundCheckpoint, ValueError, OSError) as e:
            problem = f"init_from {path}: {' '.join(str(e).split())}"
        if self._agree_verdict(_FATAL if problem else _OK) != _OK:
            raise CheckpointError(problem or f"init_from {path}: another rank could not read it")
        assert loaded is not None
        sd = st.state_dict()
        pop_previous(sd["optimizer"])  # 2bw: the stash becomes the loaded weights, like a first step
        tensors = loaded.tensors
        st.load_state_dict({**sd, "params": {n: t for n, t in tensors.items() if n not in buffers},
                            "buffers": {n: t for n, t in tensors.items() if n in buffers}, "extra": None},
                           copy=False)
        if self.rank == 0:
            log.info("varuna: started from the weights of %s", path)

    def after_step(self) -> None:
        """Periodic save at the mini-batch boundary that just completed."""
        if self.every and self.directory is not None and self.state.step_count % self.every == 0:
            self.save()

    @property
    def rank(self) -> int:
        return self.state.layout.rank

    def _local(self) -> Path:
        if self._local_root is None:
            if self._local_base is not None:
                # Ranks on one host share the local directory: one subdirectory each.
                self._local_root = self._local_base / f"rank{self.rank}"
                self._local_root.mkdir(parents=True, exist_ok=True)
            else:
                # Locked for this process's life; the leftovers of killed ones are swept first
                # (Note [Staging leftovers] in checkpoint_staging.py).
                staging = create_staging(self.rank)
                self._local_root = staging.path
                # At interpreter exit (after non-daemon copy threads were joined) or on GC.
                weakref.finalize(self, staging.close)
        return self._local_root

    # ---- save

    def save(self, directory: str | Path | None = None, *, wait: bool = False) -> Path | None:
        """Checkpoint the state after ``step_count`` steps (a collective: every rank calls it at
        the same mini-batch boundary). Returns the step directory, or None when skipped because
        the previous save is still being copied. ``wait``: block until this rank's files are in
        the global store (rank 0: until the commit file is written)."""
        root = Path(directory) if directory is not None else self.directory
        if root is None:
            raise ValueError(
                "no checkpoint directory: pass one, or set --checkpoint-dir, "
                "VarunaConfig.checkpoints.dir or $VARUNA_CHECKPOINT_DIR"
            )
        step = self.state.step_count
        target = root / step_dir_name(step)
        if self._last_saved == (root, step):
            # Already saved (periodic save then stop at the same step) or just loaded from it.
            if wait:
                self.wait()
            return target
        t0 = time.perf_counter()
        # Backpressure: at most one save in flight per rank, so local disk does not fill up.
        busy = not self.wait(timeout_s=self.timeout_s)
        t_waited = time.perf_counter() - t0
        if self.rank == 0 and not busy:
            # A complete checkpoint of this step from an abandoned lineage (we resumed from an
            # older one), in any format: retire its commit file before anyone overwrites its
            # files. Other ranks start writing only after the all-reduce below. Never for a
            # stale generation: that complete checkpoint may be a newer generation's.
            try:
                with fence_held(root, self.fence, f"retiring {target}"):
                    retire(target)
            except FencedOut as e:
                log.warning("varuna: %s", e)  # this save will be refused too
        # References to the live tensors (2bw: the stashed version rides along); sharded optimizer
        # state is gathered for the parameters of this rank's files only (a collective then).
        sd = self.state.state_dict(optimizer_for=[n for s in self._my_shares() for n in s.params])
        nonce, any_busy, others = self._agree_save(step, busy, sd)
        if any_busy:
            log.warning(
                "varuna: skipping the checkpoint of step %d: the previous one is still being copied "
                "to %s (raise checkpoint_every, or use a faster global store)",
                step,
                root,
            )
            return None
        job = self._save_job(root, target, step, nonce, sd, others)
        if not self.last_snapshot_in_memory:
            try:  # Note [Snapshot to disk]: before training changes the tensors the payloads hold
                write_local(job)
            except Exception as e:  # reported by the thread like any failed save; training goes on
                job.local_failure = e
        self.last_ok, self.last_error = None, None
        # Not a daemon: a started save finishes (or times out) even if the training script
        # returns right away; the interpreter joins the thread at exit.
        self._thread = threading.Thread(target=self._run_job, args=(job,), name=f"varuna-ckpt-{step}")
        self._thread.start()
        self._last_saved = (root, step)
        self.last_stall_s, self.last_wait_s = time.perf_counter() - t0, t_waited
        log.debug(
            "varuna: save of step %d on rank %d: %.1f ms (%.1f ms waiting for the previous one)",
            step,
            self.rank,
            1e3 * self.last_stall_s,
            1e3 * t_waited,
        )
        if wait:
            self.wait()
        return target

    def _my_shares(self) -> list:
        """The files of the configured format this rank writes (its stage and replica's)."""
        L = self.state.layout
        plan = self.format.plan(state_layout(self.state))
        return [s for s in plan if (s.stage, s.replica) == (L.stage, L.replica)]

    def _save_job(self, root: Path, target: Path, step: int, nonce: int, sd: dict | None = None,
                  extra: dict | None = None) -> SaveJob:
        """The snapshot of this rank's part and everything the background thread needs. ``sd``:
        the state (default: taken now); ``extra`` (rank 0): the state beyond tensors every rank
        contributed (:meth:`_agree_save`; default: this rank's global state only)."""
        st, L = self.state, self.state.layout
        layout = state_layout(st)
        plan = self.format.plan(layout)
        mine = [s for s in plan if (s.stage, s.replica) == (L.stage, L.replica)]
        sd = st.state_dict(optimizer_for=[n for s in mine for n in s.params]) if sd is None else sd
        extra = self._collected(sd["extra"], []) if extra is None else extra
        nbytes = shard_state_bytes(mine, {**sd["buffers"], **sd["params"]}, sd["optimizer"])
        in_memory = takes_host_snapshot(self.snapshot, nbytes)
        self.last_snapshot_in_memory = in_memory
        shares = take_shares(mine, sd, step=step, rank=self.rank, copy=in_memory)
        return SaveJob(
            root=root,
            target=target,
            local=self._local() / f"{step_dir_name(step)}-{nonce:016x}",
            step=step,
            nonce=nonce,
            rank=self.rank,
            format=self.format,
            shards=mine,
            shares=list(shares),
            records=[None] * len(mine),
            writers=sorted({L.rank_of(s.stage, s.replica) for s in plan}),
            expected_files=[s.name for s in plan],
            metadata=self._metadata(step, sd, extra) if self.rank == 0 else None,
            layout=layout,
            keep=self.keep,
            timeout_s=self.timeout_s,
            chunk_bytes=self.copy_chunk_bytes,
            hook=self.progress_hook,
            lost_writers=self.lost_writers,
            fence=self.fence,
        )

    def _metadata(self, step: int, sd: dict, extra: dict) -> dict:
        """The run's JSON-able metadata the format stores with the checkpoint (rank 0): the
        config, the loss scale and the state beyond tensors (Note [Whole state])."""
        st = self.state
        cfg, info = st.config, st.describe()
        return {
            **extra,
            "step": step,
            "data_position": step,
            "created_unix_s": time.time(),
            "config": {
                "P": st.layout.P,
                "D": st.layout.D,
                "m": cfg.micro_batch_size,
                "global_batch_size": cfg.global_batch_size,
                "Nm": info["Nm"],
                "schedule": cfg.schedule,
                "stage_ranges": [list(r) for r in st.stage_ranges],
                "chunks": len(st.stage_ranges) // st.layout.P,
                "precision": cfg.precision,
                "seed": cfg.seed,
            },
            "cutpoints": list(st.profile.cutpoint_names),
            "optimizer": type(st.optimizer).__name__,
            "loss_scale": sd["loss_scale"],
            **model_config(st.model),
        }

    def _run_job(self, job: SaveJob) -> None:
        ok = run_save_job(job)
        self.last_error = job.error
        self.last_ok = ok

    def save_on_stop(self) -> None:
        """The graceful stop's save (a collective): checkpoint, wait until it is in the global
        store, and raise :class:`CheckpointError` on every rank when it failed on any of them.

        A stop that exits 0 tells the launcher and the manager that nothing is lost; when the
        checkpoint failed (a full or read-only store), the steps since the last complete one
        are, so the stop must fail, with one line naming the directory and the error."""
        step, root = self.state.step_count, self.directory
        try:
            target = self.save(wait=True)
        except OSError as e:  # e.g. the staging directory: still agree below, so no rank hangs
            target, self.last_ok, self.last_error = root, False, str(e)
        if target is None:
            problem = f"the previous checkpoint was still being copied to {root} after {self.timeout_s:.0f}s"
        elif self.last_ok is False:
            problem = self.last_error or f"{target}: failed (see the warning above)"
        elif self._thread is not None and self._thread.is_alive():
            problem = f"{target}: still being written after {2 * self.timeout_s + 60:.0f}s"
        else:
            problem = None  # saved, or nothing to save (just resumed from this very step)
        failed = self._agree_verdict(_FATAL if problem else _OK) != _OK
        if failed:
            where = f"on rank {self.rank}: {problem}" if problem else "on another rank (see its output)"
            raise CheckpointError(
                f"the checkpoint of step {step} at the graceful stop failed {where}; the steps since the "
                f"last complete checkpoint in {root} are lost: make it writable or free space on it, "
                "then resume"
            )

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the save in flight (rank 0: until its commit file is written). True when none
        is left running; see :attr:`last_ok` for whether it succeeded."""
        t = self._thread
        if t is None:
            return True
        t.join(timeout=timeout_s if timeout_s is not None else 2 * self.timeout_s + 60)
        return not t.is_alive()

    def _agree_save(self, step: int, busy: bool, sd: dict) -> tuple[int, bool, dict]:
        """One all-reduce: rank 0's save id, whether any rank is still busy, a check that every
        rank saves the same step, and the digests of the global registered state (equal on every
        rank, or a warning). Then, when any rank has per-stage or per-rank state, one gather of it
        to rank 0. Returns rank 0's metadata part for that state (Note [Registered state])."""
        nonce = secrets.randbits(62) if self.rank == 0 else 0
        extra = sd["extra"]
        mine = self._own_state(sd)
        blob = json.dumps(mine, separators=(",", ":")).encode() if mine else b""
        digest = _digest(extra.get("global", {}))
        if self.state.layout.world == 1:
            return nonce, busy, self._collected(extra, [blob] if blob else [])
        v = torch.tensor([nonce, int(busy), step, -step, len(blob), digest, -digest], dtype=torch.int64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        nonce, any_busy, hi, neg_lo, most, d_hi, d_lo = v.tolist()
        if hi != -neg_lo:
            raise RuntimeError(
                f"ranks called save_checkpoint at different steps ({-neg_lo}..{hi}); "
                "every rank must save at the same mini-batch boundary"
            )
        if d_hi != -d_lo and self.rank == 0:
            log.warning("varuna: the registered global state differs between ranks at step %d (the "
                        "checkpoint keeps rank 0's); register what is per process with scope='rank'", step)
        blobs = _gather_bytes(blob, most, self.state.layout.world) if most else []
        return nonce, bool(any_busy), self._collected(extra, blobs) if self.rank == 0 else {}

    def _own_state(self, sd: dict) -> dict | None:
        """This rank's part of the state gathered at a save: its stage's optimizer state outside
        ``state[param]`` (replica 0 of each stage) and its per-rank registered state."""
        L, out, extra = self.state.layout, {}, sd["extra"]
        stage = sd["optimizer"].get("stage_state")
        if stage and L.replica == 0:
            out["stage_state"] = {"segments": self._segments(), "state": to_json(stage)}
        if extra.get("rank"):
            out["rank_state"] = {"rank": L.rank, "state": to_json(extra["rank"])}
        return out or None

    def _segments(self) -> list[int]:
        st, L = self.state, self.state.layout
        return [s for a, b in st.stage_ranges[L.stage :: L.P] for s in range(a, b + 1)]

    def _collected(self, extra: dict, blobs: list[bytes]) -> dict:
        """Rank 0's metadata for the state beyond tensors: the global registered state, and what
        the ranks contributed (:meth:`_own_state`)."""
        out: dict = {"state": to_json(extra.get("global", {}))}
        parts = [json.loads(b) for b in blobs if b]
        stages = [p["stage_state"] for p in parts if "stage_state" in p]
        ranks = {str(p["rank_state"]["rank"]): p["rank_state"]["state"] for p in parts if "rank_state" in p}
        if stages:
            out["stage_state"] = stages
        if ranks:
            out["rank_state"] = ranks
        return out

    # ---- load

    def load(
        self, directory: str | Path | None = None, *, step: int | None = None, required: bool = True
    ) -> int | None:
        """Load the newest complete, sound checkpoint (or ``step``) into the engine: a collective.

        Checkpoints of every registered format are candidates (Note [Checkpoint formats]).
        Incomplete or corrupt checkpoints are skipped with a warning naming the problem; a file
        that holds anything but tensors, or a checkpoint of a different model, is an error.
        Returns the step loaded (the next ``train_step`` is step + 1), or None when nothing was
        found and ``required`` is false.
        """
        root = Path(directory) if directory is not None else self.directory
        if root is None:
            raise ValueError(
                "no checkpoint directory: pass one, or set --checkpoint-dir or $VARUNA_CHECKPOINT_DIR"
            )
        candidates = []
        if self.rank == 0:
            candidates = [c.step for c in reversed(list_checkpoints(root)) if c.complete]
            if step is not None:
                candidates = [s for s in candidates if s == step]
        candidates = self._broadcast_ints(candidates)
        skipped = []
        for s in candidates:
            path = root / step_dir_name(s)
            verdict, problem, payload = self._read_for_stage(path)
            agreed = self._agree_verdict(verdict)
            if agreed == _OK:
                self._apply(payload, root, s)
                if self.rank == 0:
                    fmt = self.resumed.format if self.resumed else None
                    log.info("varuna: resumed from %s (format %s, next step %d)", path, fmt, s + 1)
                return s
            if agreed == _FATAL:
                raise CheckpointError(problem or f"another rank refused checkpoint {path} (see its output)")
            skipped.append(str(path))
            if problem:
                log.warning("varuna: skipping checkpoint %s: %s", path, problem)
            elif self.rank == 0:
                log.warning(
                    "varuna: skipping checkpoint %s: another rank found it corrupt (see its output)", path
                )
        what = f"step {step}" if step is not None else "checkpoint"
        msg = f"no complete, sound {what} in {root}" + (f" (skipped {', '.join(skipped)})" if skipped else "")
        if required:
            raise CheckpointError(
                msg + "; start without --resume / VARUNA_RESUME=1, or use VARUNA_RESUME=auto"
            )
        if self.rank == 0:
            log.warning("varuna: %s: starting from scratch", msg)
        return None

    def _read_for_stage(self, path: Path) -> tuple[int, str | None, LoadedShare | None]:
        """This rank's verdict on a checkpoint, and what its format read (its stage's state)."""
        st = self.state
        buffers = st.extras.buffers.named()
        request = LoadRequest(tensors={**buffers, **st.stage_params},
                              optimizer_class=type(st.optimizer).__name__, optional=frozenset(buffers))
        fmt = format_of(path)
        if fmt is None:  # the commit file went away since rank 0 listed it
            return _SKIP, f"{path}: no longer complete (no commit file of any registered format)", None
        try:
            loaded = fmt.read(path, request)
            check_resumable(path, loaded.metadata)
            check_loaded_values(path, loaded)
            return _OK, None, loaded
        except CheckpointError as e:  # not one the format writes, or another model's: refuse
            return _FATAL, str(e), None
        except UnsoundCheckpoint as e:  # what a crash or a full disk leaves: an older one may do
            return _SKIP, str(e), None
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            return _SKIP, f"{path}: malformed for format {fmt.name} ({type(e).__name__}: {e})", None

    def _apply(self, loaded: LoadedShare, root: Path, step: int) -> None:
        eng, m = self.state, loaded.metadata
        saved = m.get("config", {})
        buffer_names = set(eng.extras.buffers.names)
        optimizer = dict(loaded.optimizer)
        stage_state = _stage_state_for(m.get("stage_state", []), min(self._segments()))
        if stage_state is not None:
            optimizer["stage_state"] = stage_state
        extra = {"global": from_json(m.get("state", {}))}
        same_layout = (saved.get("P"), saved.get("D")) == (eng.layout.P, eng.layout.D)
        if same_layout and str(self.rank) in m.get("rank_state", {}):
            extra["rank"] = from_json(m["rank_state"][str(self.rank)])
        tensors = loaded.tensors
        state = {"step": m["step"], "params": {n: t for n, t in tensors.items() if n not in buffer_names},
                 "buffers": {n: t for n, t in tensors.items() if n in buffer_names},
                 "optimizer": optimizer, "loss_scale": m["loss_scale"], "extra": extra}
        # copy=False: the loaded tensors are handed over, each freed once copied in (no second
        # set of weights); the optimizer adopts its freshly read state.
        eng.load_state_dict(state, copy=False)
        self._last_saved = (root, step)  # never rewrite the checkpoint we resumed from
        fmt = format_of(root / step_dir_name(step))
        self.resumed = Resumed(
            root / step_dir_name(step), step, saved.get("P"), saved.get("D"), fmt.name if fmt else None
        )
        saved_M = saved.get("global_batch_size")
        if saved_M is not None and saved_M != eng.config.global_batch_size and self.rank == 0:
            log.warning(
                "varuna: the checkpoint was trained with global batch size %s, this run uses %s: "
                "hyper-parameters may no longer fit",
                saved_M,
                eng.config.global_batch_size,
            )

    def _broadcast_ints(self, values: list[int]) -> list[int]:
        if self.state.layout.world == 1:
            return values
        n = torch.tensor([len(values)], dtype=torch.int64)
        dist.broadcast(n, src=0)
        t = torch.tensor(values if self.rank == 0 else [0] * int(n), dtype=torch.int64)
        if int(n):
            dist.broadcast(t, src=0)
        return t.tolist()

    def _agree_verdict(self, verdict: int) -> int:
        if self.state.layout.world == 1:
            return verdict
        v = torch.tensor([verdict], dtype=torch.int64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return int(v)



def state_layout(state: CheckpointState) -> StateLayout:
    """Where every saved tensor of ``state``'s run lives: parameters and persistent buffers, by the
    segments that read them (identical on every rank)."""
    prof, L = state.profile, state.layout
    return StateLayout(
        tensor_segments={**prof.buffer_segments, **prof.param_segments},
        tensor_bytes={**prof.buffer_bytes, **prof.param_bytes},
        stage_ranges=state.stage_ranges,
        pipeline_depth=L.P,
        data_parallel=L.D,
        buffers=frozenset(prof.buffer_segments),
    )


def model_config(model) -> dict:
    """``{"model_config": ...}``: a Hugging Face model's configuration as JSON (what ``config.json``
    holds, for the ``hf`` format and exports), or nothing."""
    cfg = getattr(model, "config", None)
    to_json_string = getattr(cfg, "to_json_string", None)
    if not callable(to_json_string):
        return {}
    try:
        return {"model_config": json.loads(to_json_string(use_diff=False))}
    except (TypeError, ValueError):  # a config that does not serialise: the export has no config.json
        return {}


def _digest(tree: dict) -> int:
    """A 62-bit digest of a registered state (0 for none)."""
    if not tree:
        return 0
    return int.from_bytes(hashlib.sha256(json_bytes(tree)).digest()[:8], "big") >> 2


def _gather_bytes(blob: bytes, most: int, world: int) -> list[bytes]:
    """Every rank's ``blob`` on rank 0 (elsewhere: empty), each at most ``most`` bytes: one gather."""
    buf = torch.zeros(most + 8, dtype=torch.uint8)
    buf[:8] = torch.tensor(list(len(blob).to_bytes(8, "big")), dtype=torch.uint8)
    if blob:
        buf[8 : 8 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    rank = dist.get_rank()
    parts = [torch.empty_like(buf) for _ in range(world)] if rank == 0 else None
    dist.gather(buf, parts, dst=0)
    if parts is None:
        return []
    out = []
    for p in parts:
        n = int.from_bytes(bytes(p[:8].tolist()), "big")
        out.append(bytes(p[8 : 8 + n].tolist()))
    return out


def _stage_state_for(entries: list[dict], first_segment: int) -> dict | None:
    """The saved per-stage optimizer state of the stage that held ``first_segment`` (a stage at a
    new P×D continues that one's), or None."""
    for e in entries:
        if first_segment in e.get("segments", []):
            return from_json(e["state"])
    return None
