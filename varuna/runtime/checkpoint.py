"""Per-segment checkpoints that any P×D (and any micro-batch size) can load — paper §4.5.

Every file is keyed by the original model's parameter names, never by stage-local indices, so a
job that was preempted at 2×2 resumes at 4×1, 1×1 or anything else. Layout on disk (see
docs/checkpoints.md for the manifest schema and the guarantees)::

    <checkpoint_dir>/step_00000300/
        seg000-00.pt      params + name-keyed optimizer state of segment 0's own parameters
        seg000-01.pt      segment 0's parameters that other segments also read (tied embedding)
        seg001-00.pt      ...
        manifest.json     written LAST, atomically: a checkpoint without it does not exist

How a save goes (Note [Save]): at a mini-batch boundary every rank agrees on a save id (one tiny
all-reduce) and takes a host snapshot of the shard files assigned to it (:func:`plan_shards`: the
D replicas of a stage split the stage's files) — the only part training waits for. A background
thread serialises the snapshot to fast local disk (sha256 computed on the way), copies the files
to the global store, fsyncs them and drops a small *marker* file. Rank 0's thread waits
(bounded) for the markers of every writer, then writes the manifest (tmp + fsync +
``os.replace``) and prunes old checkpoints. At most one save per rank is in flight.

How a load goes (Note [Load]): rank 0 lists the checkpoints that have a manifest, newest first,
and broadcasts the list; each rank reads only the files holding its stage's parameters, checking
size and sha256 and unpickling with ``torch.load(weights_only=True)``; one all-reduce agrees on
the verdict, so every rank loads the same step or all skip it (with a warning naming the file).

Example::

    engine = varuna.Engine(model, varuna.VarunaConfig(global_batch_size=32, micro_batch_size=4,
                           checkpoint_dir="/mnt/blob/run1", checkpoint_every=100, resume="auto"),
                           example_batch=batch, optimizer=make_optimizer)
    for step in range(engine.step_count + 1, total_steps + 1):   # continues after the checkpoint
        engine.train_step(get_batch(step))
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import re
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from varuna.runtime.engine import Engine

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "Checkpointer",
    "Shard",
    "plan_shards",
    "optimizer_state_by_name",
    "load_optimizer_state_by_name",
    "merge_optimizer_states",
    "list_checkpoints",
    "verify_checkpoint",
    "read_shard",
    "resolve_resume",
    "step_dir_name",
]

log = logging.getLogger("varuna.runtime.checkpoint")

FORMAT = "varuna-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_MARKERS = ".markers"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_SHARD_NAME = re.compile(r"^seg\d{3,}-\d{2,}\.pt$")

# Verdicts of one rank on one checkpoint, combined with MAX over ranks (Note [Load]).
_OK, _SKIP, _FATAL = 0, 1, 2

_RESUME_MODES = {
    "": "never", "0": "never", "false": "never", "no": "never", "never": "never",
    "1": "always", "true": "always", "yes": "always", "always": "always",
    "auto": "auto",
}


class CheckpointError(ValueError):
    """A checkpoint cannot be used (none found, corrupt, unsafe, or from a different model).

    A ``ValueError``: like other bad input, scripts report it as one line."""


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` steps.

    >>> step_dir_name(300)
    'step_00000300'
    """
    return f"step_{step:08d}"


def resolve_resume(value: str | bool | None) -> str:
    """Normalise a resume setting to ``"never"``, ``"always"`` or ``"auto"``.

    ``None`` reads ``$VARUNA_RESUME`` (the launcher passes it through), default never.

    >>> resolve_resume(True), resolve_resume("auto"), resolve_resume("0")
    ('always', 'auto', 'never')
    """
    if value is None:
        value = os.environ.get("VARUNA_RESUME", "")
    if isinstance(value, bool):
        return "always" if value else "never"
    mode = _RESUME_MODES.get(str(value).strip().lower())
    if mode is None:
        raise ValueError(f"bad resume setting {value!r} (VARUNA_RESUME / --resume); use 1, 0 or auto")
    return mode


# ---------------------------------------------------------------------------------------------
# Which rank writes which file


@dataclass(frozen=True, kw_only=True)
class Shard:
    """One checkpoint file: some parameters of one segment, written by one replica of its stage."""

    name: str
    """File name inside the step directory, e.g. ``seg003-00.pt``."""
    segment: int
    stage: int
    replica: int
    """Which of the stage's D replicas writes it (all replicas hold identical state)."""
    params: tuple[str, ...]
    """Canonical parameter names it holds (with their optimizer state)."""
    nbytes: int
    """Parameter bytes (the optimizer state is usually proportional)."""


def plan_shards(
    *,
    param_segments: Mapping[str, Sequence[int]],
    param_bytes: Mapping[str, int],
    stage_ranges: Sequence[tuple[int, int]],
    data_parallel: int,
) -> list[Shard]:
    """Split a checkpoint into files and assign each to one replica of one stage.

    A parameter belongs to the first segment that reads it (a tied embedding is saved once, by
    segment 0). Each segment's parameters make one file, plus one for those other segments also
    read (so the last stage loads the tied embedding without segment 0's blocks). While a stage
    has fewer files than replicas, its largest multi-parameter file is cut in two (by bytes);
    then files go to replicas largest first, each to the least loaded one — so every replica
    writes a disjoint, non-empty part whenever the stage has at least D files. Pure function:
    every rank computes the same plan.

    >>> plan = plan_shards(param_segments={"a": (0,), "b": (0,), "c": (1,)},
    ...                    param_bytes={"a": 8, "b": 8, "c": 4}, stage_ranges=[(0, 1)], data_parallel=2)
    >>> [(s.name, s.replica, s.params) for s in plan]
    [('seg000-00.pt', 0, ('a', 'b')), ('seg001-00.pt', 1, ('c',))]
    """
    D = data_parallel
    order = [n for n in param_bytes if n in param_segments]
    order += [n for n in param_segments if n not in param_bytes]
    private: dict[int, list[str]] = {}
    shared: dict[int, list[str]] = {}
    for n in order:
        segs = param_segments[n]
        (shared if len(segs) > 1 else private).setdefault(segs[0], []).append(n)

    def size(names: Sequence[str]) -> int:
        return sum(param_bytes.get(n, 0) for n in names)

    shards: list[Shard] = []
    for stage, (first, last) in enumerate(stage_ranges):
        groups: list[tuple[int, list[str]]] = []
        for s in range(first, last + 1):
            for names in (private.get(s), shared.get(s)):
                if names:
                    groups.append((s, names))
        while len(groups) < D:
            splittable = [i for i, (_, names) in enumerate(groups) if len(names) > 1]
            if not splittable:
                break  # fewer parameters than replicas: some replicas write nothing
            i = max(splittable, key=lambda i: (size(groups[i][1]), -i))
            s, names = groups[i]
            cut = _balanced_cut([param_bytes.get(n, 0) for n in names])
            groups[i: i + 1] = [(s, names[:cut]), (s, names[cut:])]
        loads = [(0, 0)] * D
        owner: dict[int, int] = {}
        for i in sorted(range(len(groups)), key=lambda i: (-size(groups[i][1]), i)):
            d = min(range(D), key=lambda d: (loads[d], d))
            owner[i] = d
            loads[d] = (loads[d][0] + size(groups[i][1]), loads[d][1] + 1)
        parts: dict[int, int] = {}
        for i, (s, names) in enumerate(groups):
            j = parts.get(s, 0)
            parts[s] = j + 1
            shards.append(Shard(name=f"seg{s:03d}-{j:02d}.pt", segment=s, stage=stage, replica=owner[i],
                                params=tuple(names), nbytes=size(names)))
    return shards


def _balanced_cut(sizes: list[int]) -> int:
    """Index 1..len-1 that splits ``sizes`` into two runs of most nearly equal sums."""
    total, run, best, best_gap = sum(sizes), 0, 1, None
    for k in range(1, len(sizes)):
        run += sizes[k - 1]
        gap = abs(total - 2 * run)
        if best_gap is None or gap < best_gap:
            best, best_gap = k, gap
    return best


# ---------------------------------------------------------------------------------------------
# Optimizer state keyed by parameter name


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer,
    named_params: Mapping[str, torch.Tensor],
    only: Iterable[str] | None = None,
) -> dict:
    """The optimizer's state with parameter names instead of torch's positional indices.

    Returns ``{"class": "AdamW", "state": {name: {key: value}}, "param_groups": [{hyper...,
    "params": [names]}]}``; with ``only``, just those parameters (groups without any of them are
    dropped). Values are references to the live tensors, like ``Optimizer.state_dict()``.

    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    >>> w.grad = torch.ones(2); opt.step()
    >>> sd = optimizer_state_by_name(opt, {"w": w})
    >>> sorted(sd["state"]["w"]), sd["param_groups"][0]["params"], sd["param_groups"][0]["lr"]
    (['momentum_buffer'], ['w'], 0.1)
    """
    name_of = {id(p): n for n, p in named_params.items()}
    keep = None if only is None else set(only)
    sd = optimizer.state_dict()
    # state_dict() numbers parameters in the order of optimizer.param_groups: zip the two.
    index_to_name: dict[int, str] = {}
    for saved, live in zip(sd["param_groups"], optimizer.param_groups):
        for idx, p in zip(saved["params"], live["params"]):
            name = name_of.get(id(p))
            if name is None:
                raise ValueError(
                    "the optimizer holds a parameter that is not among the engine's parameters; build it "
                    "from the parameters the engine passes to the optimizer factory"
                )
            index_to_name[idx] = name
    groups = []
    for g in sd["param_groups"]:
        names = [index_to_name[i] for i in g["params"] if keep is None or index_to_name[i] in keep]
        if names:
            hyper = {k: v for k, v in g.items() if k not in ("params", "param_names")}
            groups.append({**hyper, "params": names})
    state = {index_to_name[i]: dict(v) for i, v in sd["state"].items()
             if i in index_to_name and (keep is None or index_to_name[i] in keep)}
    return {"class": type(optimizer).__name__, "state": state, "param_groups": groups}


def merge_optimizer_states(parts: Iterable[dict]) -> dict:
    """Union of name-keyed optimizer states (e.g. read from several shard files)."""
    out: dict = {"class": None, "state": {}, "param_groups": []}
    for part in parts:
        if out["class"] is None:
            out["class"] = part.get("class")
        out["state"].update(part.get("state", {}))
        out["param_groups"].extend(part.get("param_groups", []))
    return out


def load_optimizer_state_by_name(
    optimizer: torch.optim.Optimizer,
    named_params: Mapping[str, torch.Tensor],
    state: dict,
    *,
    copy: bool = True,
) -> None:
    """Load a name-keyed optimizer state (:func:`optimizer_state_by_name`) into ``optimizer``.

    The optimizer may hold its parameters in any order and grouping (another stage split): each
    parameter gets its own saved state, and each group the hyper-parameters saved with its
    parameters (they must agree within a group). Parameters without saved state start fresh,
    as they would after a first step. ``copy``: clone the state tensors (torch's own
    ``load_state_dict`` would alias them when dtype and device already match, so two optimizers
    loaded from one in-memory state would update the same buffers); False for freshly read files.

    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = torch.optim.SGD([w], lr=0.5)
    >>> load_optimizer_state_by_name(opt, {"w": w}, {"class": "SGD", "state": {},
    ...     "param_groups": [{"lr": 0.1, "momentum": 0.0, "dampening": 0, "weight_decay": 0,
    ...                       "nesterov": False, "maximize": False, "foreach": None,
    ...                       "differentiable": False, "fused": None, "params": ["w"]}]})
    >>> opt.param_groups[0]["lr"]
    0.1
    """
    cls = state.get("class")
    if cls is not None and cls != type(optimizer).__name__:
        raise CheckpointError(
            f"the checkpoint's optimizer state is for {cls} but the engine's optimizer is "
            f"{type(optimizer).__name__}; build the same optimizer as the run that saved it"
        )
    name_of = {id(p): n for n, p in named_params.items()}
    hyper_of: dict[str, dict] = {}
    for g in state.get("param_groups", []):
        hyper = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        for n in g["params"]:
            hyper_of[n] = hyper
    saved_state = state.get("state", {})
    groups, by_index, idx = [], {}, 0
    for g in optimizer.param_groups:
        names = []
        for p in g["params"]:
            if id(p) not in name_of:
                raise ValueError("the optimizer holds a parameter that is not among the engine's parameters")
            names.append(name_of[id(p)])
        hypers = [hyper_of[n] for n in names if n in hyper_of]
        for h in hypers[1:]:
            if _plain_value(h) != _plain_value(hypers[0]):
                raise CheckpointError(
                    f"parameters {names[0]} and others of one optimizer group were saved with different "
                    "hyper-parameters; group parameters the way the saving run did"
                )
        current = {k: v for k, v in g.items() if k not in ("params", "param_names")}
        saved = hypers[0] if hypers else {}
        groups.append({**current, **saved, "params": list(range(idx, idx + len(names)))})
        for i, n in enumerate(names):
            if n in saved_state:
                v = saved_state[n]
                by_index[idx + i] = {k: (x.clone() if copy and isinstance(x, torch.Tensor) else x)
                                     for k, x in v.items()}
        idx += len(names)
    optimizer.load_state_dict({"state": by_index, "param_groups": groups})


def _plain_value(x: Any) -> Any:
    """Comparable plain-Python form of a hyper-parameter value (tensors become lists)."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {k: _plain_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain_value(v) for v in x]
    return x


def _snapshot(x: Any) -> Any:
    """A host copy of ``x``'s tensors, compact and contiguous (torch.save writes a view's whole
    storage), so training can go on updating the originals while the copy is being written."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", memory_format=torch.contiguous_format, copy=True)
    if isinstance(x, dict):
        return {k: _snapshot(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_snapshot(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_snapshot(v) for v in x)
    return x


# ---------------------------------------------------------------------------------------------
# Files: shards, markers, manifests


def read_shard(path: Path, data: bytes | None = None) -> dict:
    """Unpickle a shard file safely (``weights_only``: tensors and plain containers only).

    Raises :class:`CheckpointError` naming the file when it holds anything else (a pickled
    custom class, code) or does not have the shard layout.
    """
    path = Path(path)
    raw = data if data is not None else path.read_bytes()
    try:
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path}: refusing to load: the file holds pickled objects other than tensors and plain "
            f"containers ({first}); varuna checkpoints never do, so it is not one or it was tampered with"
        ) from None
    if not (isinstance(obj, dict) and obj.get("format") == FORMAT and isinstance(obj.get("params"), dict)
            and isinstance(obj.get("optimizer"), dict)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj["params"].items())):
        raise ValueError(f"{path}: not a varuna checkpoint shard (unexpected layout)")
    return obj


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (blob mounts) do not support fsync on directories
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes, before_replace: Callable[[], None] | None = None) -> None:
    """Write ``path`` so that readers see either nothing (or the old file) or all of it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if before_replace is not None:
        before_replace()
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class _HashingWriter:
    """File-like sink for ``torch.save`` that computes the sha256 of what it writes (one pass)."""

    def __init__(self, f) -> None:
        self.f, self.sha, self.nbytes = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.nbytes += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def _save_hashed(obj: Any, path: Path) -> tuple[int, str]:
    """``torch.save(obj, path)``; returns (bytes, sha256 hex) of the file."""
    with open(path, "wb") as f:
        w = _HashingWriter(f)
        torch.save(obj, w)
    return w.nbytes, w.sha.hexdigest()


def _copy_file(src: Path, dst: Path, chunk_bytes: int, on_chunk: Callable[[], None]) -> None:
    """Copy ``src`` to ``dst`` via a tmp name, fsynced, then renamed into place. The data moves
    inside the kernel (sendfile), so the copy costs training processes almost no CPU."""
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    with open(src, "rb") as fi, open(tmp, "wb") as fo:
        size, off = os.fstat(fi.fileno()).st_size, 0
        while off < size:
            try:
                n = os.sendfile(fo.fileno(), fi.fileno(), off, min(chunk_bytes, size - off))
            except OSError:  # a filesystem without sendfile support: plain reads and writes
                fi.seek(off)
                n = fo.write(fi.read(min(chunk_bytes, size - off)))
                fo.flush()
            if n == 0:
                raise OSError(f"{src}: file shrank while being copied")
            off += n
            on_chunk()
        os.fsync(fo.fileno())
    os.replace(tmp, dst)


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """One ``step_*`` directory of a checkpoint store."""

    step: int
    path: Path
    complete: bool
    """It has a manifest (its files may still turn out corrupt: see :func:`verify_checkpoint`)."""


def list_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Every ``step_*`` directory under ``root``, oldest first (empty when ``root`` is absent).

    >>> list_checkpoints("/nonexistent")
    []
    """
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            out.append(CheckpointInfo(step=int(m.group(1)), path=p, complete=(p / MANIFEST).is_file()))
    return sorted(out, key=lambda c: c.step)


def read_manifest(path: str | Path) -> dict:
    """Parse and validate ``<step dir>/manifest.json``; ``ValueError`` says what is wrong."""
    path = Path(path)
    try:
        m = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no {MANIFEST} (an incomplete checkpoint)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / MANIFEST}: unreadable ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path / MANIFEST}: not a varuna checkpoint manifest")
    if m.get("version") != VERSION:
        raise ValueError(f"{path / MANIFEST}: format version {m.get('version')!r}, "
                         f"this varuna reads {VERSION}")
    for key in ("step", "files", "parameters", "loss_scale"):
        if key not in m:
            raise ValueError(f"{path / MANIFEST}: missing {key!r}")
    for f in m["files"]:
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not _SHARD_NAME.match(f["name"]):
            raise ValueError(f"{path / MANIFEST}: bad file entry {f!r}")
    return m


def _check_file(path: Path, entry: dict) -> tuple[bytes | None, str | None]:
    """Read a file and compare it with its manifest entry; (data, None) or (None, problem)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, f"{path.name}: missing"
    except OSError as e:
        return None, f"{path.name}: unreadable ({e})"
    if len(data) != entry.get("bytes"):
        return None, (f"{path.name}: {len(data)} bytes, the manifest says {entry.get('bytes')} "
                      "(truncated or altered)")
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        return None, f"{path.name}: sha256 mismatch (corrupt or altered)"
    return data, None


def verify_checkpoint(path: str | Path) -> list[str]:
    """Problems with a checkpoint directory: no/bad manifest, missing, truncated or altered
    files (size and sha256 of every file; nothing is unpickled). Empty when it is sound."""
    path = Path(path)
    try:
        m = read_manifest(path)
    except ValueError as e:
        return [str(e)]
    problems = []
    for f in m["files"]:
        _, problem = _check_file(path / f["name"], f)
        if problem:
            problems.append(problem)
    return problems


# ---------------------------------------------------------------------------------------------
# The engine's checkpointer


@dataclass(kw_only=True)
class _SaveJob:
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


class Checkpointer:
    """Saves and loads an :class:`~varuna.runtime.engine.Engine`'s checkpoints (one per engine).

    Settings come from the engine's config, then the environment: ``checkpoint_dir`` or
    ``$VARUNA_CHECKPOINT_DIR``; ``resume`` or ``$VARUNA_RESUME`` (1 / auto / 0). The engine calls
    :meth:`attach` at the end of its ``__init__`` and :meth:`after_step` after each step.

    Test hooks: ``progress_hook(event)`` is called, from the background thread, at named points
    of a save (``local-write``, ``copy-chunk``, ``copied``, ``marker``, ``manifest-tmp``,
    ``manifest``); ``copy_chunk_bytes`` sets the copy granularity.

    Example::

        engine.save_checkpoint(wait=True)          # same as engine.checkpointer.save(wait=True)
        step = engine.load_checkpoint()            # newest complete one; any P×D
    """

    def __init__(self, engine: Engine) -> None:
        cfg = engine.config
        self.engine = engine
        d = getattr(cfg, "checkpoint_dir", None) or os.environ.get("VARUNA_CHECKPOINT_DIR") or None
        self.directory: Path | None = Path(d) if d else None
        self.every: int = int(getattr(cfg, "checkpoint_every", 0) or 0)
        self.keep: int = int(getattr(cfg, "keep_checkpoints", 2))
        self.resume_mode: str = resolve_resume(getattr(cfg, "resume", None))
        local = getattr(cfg, "local_checkpoint_dir", None)
        self._local_base: Path | None = Path(local) if local else None
        self.timeout_s: float = float(cfg.comm_timeout_s)
        if self.every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 (got {self.every}); 0 saves only on stop")
        if self.keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 (got {self.keep})")
        if self.directory is None and (self.every > 0 or self.resume_mode == "always"):
            what = "checkpoint_every" if self.every > 0 else "resume"
            raise ValueError(f"{what} needs a checkpoint directory: set --checkpoint-dir, "
                             "VarunaConfig.checkpoint_dir or $VARUNA_CHECKPOINT_DIR")
        self.progress_hook: Callable[[str], None] | None = None
        self.copy_chunk_bytes = 8 << 20
        self._local_root: Path | None = None
        self._thread: threading.Thread | None = None
        self._last_saved: tuple[Path, int] | None = None
        #: outcome of the latest background job: None while running / never run, else True/False
        self.last_ok: bool | None = None
        #: seconds training stood still in the latest save (waiting for the previous one, agreeing,
        #: snapshotting), and the part of it spent waiting for the previous save
        self.last_stall_s = self.last_wait_s = 0.0

    # ---- wiring

    def attach(self) -> None:
        """Register the save-on-stop callback and resume when asked (a collective then)."""
        if self.directory is not None:
            self.engine.stop_callbacks.append(lambda eng: self.save(wait=True))
        if self.resume_mode != "never":
            if self.directory is None:
                raise ValueError("resume needs a checkpoint directory: set --checkpoint-dir or "
                                 "$VARUNA_CHECKPOINT_DIR")
            self.load(required=self.resume_mode == "always")

    def after_step(self) -> None:
        """Periodic save at the mini-batch boundary that just completed."""
        if self.every and self.directory is not None and self.engine.step_count % self.every == 0:
            self.save()

    @property
    def rank(self) -> int:
        return self.engine.layout.rank

    def _hook(self, event: str) -> None:
        if self.progress_hook is not None:
            self.progress_hook(event)

    def _local(self) -> Path:
        if self._local_root is None:
            if self._local_base is not None:
                # Ranks on one host share the local directory: one subdirectory each.
                self._local_root = self._local_base / f"rank{self.rank}"
                self._local_root.mkdir(parents=True, exist_ok=True)
            else:
                self._local_root = Path(tempfile.mkdtemp(prefix=f"varuna-ckpt-rank{self.rank}-"))
                # At interpreter exit (after non-daemon copy threads were joined) or on GC.
                weakref.finalize(self, shutil.rmtree, str(self._local_root), True)
        return self._local_root

    # ---- save

    def save(self, directory: str | Path | None = None, *, wait: bool = False) -> Path | None:
        """Checkpoint the state after ``engine.step_count`` steps (a collective: every rank calls
        it at the same mini-batch boundary). Returns the step directory, or None when skipped
        because the previous save is still being copied. ``wait``: block until this rank's files
        are in the global store (rank 0: until the manifest is written)."""
        eng = self.engine
        root = Path(directory) if directory is not None else self.directory
        if root is None:
            raise ValueError("no checkpoint directory: pass one, or set --checkpoint-dir, "
                             "VarunaConfig.checkpoint_dir or $VARUNA_CHECKPOINT_DIR")
        step = eng.step_count
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
        if self.rank == 0 and not busy and (target / MANIFEST).exists():
            # A complete checkpoint of this step from an abandoned lineage (we resumed from an
            # older one): retire its manifest before anyone overwrites its files. Other ranks
            # start writing only after the all-reduce below.
            (target / MANIFEST).unlink(missing_ok=True)
        nonce, any_busy = self._agree_save(step, busy)
        if any_busy:
            log.warning("varuna: skipping the checkpoint of step %d: the previous one is still being copied "
                        "to %s (raise checkpoint_every, or use a faster global store)", step, root)
            return None
        plan = plan_shards(param_segments=eng.profile.param_segments, param_bytes=eng.profile.param_bytes,
                           stage_ranges=eng.stage_ranges, data_parallel=eng.layout.D)
        mine = [s for s in plan if (s.stage, s.replica) == (eng.stage, eng.replica)]
        local = self._local() / f"{step_dir_name(step)}-{nonce:016x}"
        opt = optimizer_state_by_name(eng.optimizer, eng._trainable) if mine else None
        files, payloads = [], []
        for shard in mine:
            keep = set(shard.params)
            # The synchronous part of a save (Note [Save]): a host snapshot of this rank's part.
            # Serialising it (to local disk) and copying it (to the global store) happen in the
            # background thread; the snapshot is freed once it is on local disk.
            params = {n: _snapshot(eng.stage_params[n]) for n in shard.params}
            opt_part = {
                "class": opt["class"],
                "state": {n: _snapshot(v) for n, v in opt["state"].items() if n in keep},
                "param_groups": [{**_snapshot({k: v for k, v in g.items() if k != "params"}),
                                  "params": [n for n in g["params"] if n in keep]}
                                 for g in opt["param_groups"] if any(n in keep for n in g["params"])],
            }
            payloads.append({"format": FORMAT, "version": VERSION, "step": step, "segment": shard.segment,
                             "params": params, "optimizer": opt_part})
            files.append({"name": shard.name, "segment": shard.segment, "stage": shard.stage,
                          "replica": shard.replica, "rank": self.rank,
                          "params": {n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                                     for n, t in params.items()}})
        manifest_base = None
        if self.rank == 0:
            info = eng.describe()
            manifest_base = {
                "format": FORMAT, "version": VERSION, "step": step,
                "data_position": step,
                "created_unix_s": time.time(),
                "config": {"P": eng.layout.P, "D": eng.layout.D, "m": eng.config.micro_batch_size,
                           "global_batch_size": eng.config.global_batch_size, "Nm": info["Nm"],
                           "schedule": eng.config.schedule,
                           "stage_ranges": [list(r) for r in eng.stage_ranges],
                           "precision": eng.config.precision, "seed": eng.config.seed},
                "cutpoints": list(eng.profile.cutpoint_names),
                "optimizer": type(eng.optimizer).__name__,
                "loss_scale": eng.scaler.state_dict(),
            }
        L = eng.layout
        job = _SaveJob(
            root=root, target=target, local=local, step=step, nonce=nonce, rank=self.rank, files=files,
            payloads=payloads,
            writers=sorted({L.rank_of(s.stage, s.replica) for s in plan}),
            expected_files=[s.name for s in plan], manifest_base=manifest_base,
            param_segments={n: list(v) for n, v in eng.profile.param_segments.items()},
            keep=self.keep, timeout_s=self.timeout_s, chunk_bytes=self.copy_chunk_bytes,
            hook=self.progress_hook,
        )
        self.last_ok = None
        # Not a daemon: a started save finishes (or times out) even if the training script
        # returns right away; the interpreter joins the thread at exit.
        self._thread = threading.Thread(target=self._run_job, args=(job,), name=f"varuna-ckpt-{step}")
        self._thread.start()
        self._last_saved = (root, step)
        self.last_stall_s, self.last_wait_s = time.perf_counter() - t0, t_waited
        log.debug("varuna: save of step %d on rank %d: %.1f ms (%.1f ms waiting for the previous one)",
                  step, self.rank, 1e3 * self.last_stall_s, 1e3 * t_waited)
        if wait:
            self.wait()
        return target

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the save in flight (rank 0: until its manifest is written). True when none
        is left running; see :attr:`last_ok` for whether it succeeded."""
        t = self._thread
        if t is None:
            return True
        t.join(timeout=timeout_s if timeout_s is not None else 2 * self.timeout_s + 60)
        return not t.is_alive()

    def _agree_save(self, step: int, busy: bool) -> tuple[int, bool]:
        """One all-reduce: rank 0's save id, whether any rank is still busy, and a check that
        every rank saves the same step."""
        nonce = secrets.randbits(62) if self.rank == 0 else 0
        if self.engine.layout.world == 1:
            return nonce, busy
        v = torch.tensor([nonce, int(busy), step, -step], dtype=torch.int64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        nonce, any_busy, hi, neg_lo = v.tolist()
        if hi != -neg_lo:
            raise RuntimeError(f"ranks called save_checkpoint at different steps ({-neg_lo}..{hi}); "
                               "every rank must save at the same mini-batch boundary")
        return nonce, bool(any_busy)

    def _run_job(self, job: _SaveJob) -> None:
        hook = job.hook or (lambda event: None)
        try:
            job.local.mkdir(parents=True, exist_ok=True)
            for i, f in enumerate(job.files):
                hook("local-write")
                f["bytes"], f["sha256"] = _save_hashed(job.payloads[i], job.local / f["name"])
                job.payloads[i] = None  # free the snapshot: the file on local disk is the copy now
            job.target.mkdir(parents=True, exist_ok=True)
            for f in job.files:
                _copy_file(job.local / f["name"], job.target / f["name"], job.chunk_bytes,
                           lambda: hook("copy-chunk"))
                hook("copied")
            _fsync_dir(job.target)
            if job.files:
                markers = job.target / _MARKERS
                markers.mkdir(exist_ok=True)
                marker = {"nonce": job.nonce, "rank": job.rank, "files": job.files}
                _atomic_write(markers / f"rank{job.rank}.json", json.dumps(marker).encode())
                hook("marker")
            shutil.rmtree(job.local, ignore_errors=True)
            if job.rank == 0:
                self._commit(job, hook)
            self.last_ok = True
        except Exception as e:  # a failed save must not stop training: the checkpoint just never exists
            self.last_ok = False
            log.warning("varuna: the checkpoint of step %d failed on rank %d and will not exist: %s",
                        job.step, job.rank, e)
        finally:
            shutil.rmtree(job.local, ignore_errors=True)  # local copies are only a staging area

    def _commit(self, job: _SaveJob, hook: Callable[[str], None]) -> None:
        """Rank 0: wait for every writer's marker, write the manifest (the commit), prune."""
        markers = job.target / _MARKERS
        deadline = time.monotonic() + job.timeout_s
        files: list[dict] = []
        pending = set(job.writers)
        while pending:
            for r in sorted(pending):
                try:
                    m = json.loads((markers / f"rank{r}.json").read_text())
                except (FileNotFoundError, json.JSONDecodeError):
                    continue
                if m.get("nonce") == job.nonce:  # markers of an abandoned earlier attempt differ
                    files.extend(m["files"])
                    pending.discard(r)
            if pending:
                if time.monotonic() > deadline:
                    raise CheckpointError(f"no marker from rank(s) {sorted(pending)} "
                                          f"after {job.timeout_s:.0f}s")
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
        manifest = {**job.manifest_base, "parameters": parameters,
                    "files": sorted(files, key=lambda f: f["name"])}
        _atomic_write(job.target / MANIFEST, json.dumps(manifest, indent=1).encode(),
                      before_replace=lambda: hook("manifest-tmp"))
        hook("manifest")
        shutil.rmtree(markers, ignore_errors=True)
        prune(job.root, job.step, job.keep)

    # ---- load

    def load(self, directory: str | Path | None = None, *, step: int | None = None,
             required: bool = True) -> int | None:
        """Load the newest complete, sound checkpoint (or ``step``) into the engine: a collective.

        Incomplete or corrupt checkpoints are skipped with a warning naming the problem; a file
        that holds anything but tensors, or a checkpoint of a different model, is an error.
        Returns the step loaded (the next ``train_step`` is step + 1), or None when nothing was
        found and ``required`` is false.
        """
        root = Path(directory) if directory is not None else self.directory
        if root is None:
            raise ValueError("no checkpoint directory: pass one, or set --checkpoint-dir or "
                             "$VARUNA_CHECKPOINT_DIR")
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
                    log.info("varuna: resumed from %s (next step %d)", path, s + 1)
                return s
            if agreed == _FATAL:
                raise CheckpointError(problem or f"another rank refused checkpoint {path} (see its output)")
            skipped.append(str(path))
            if problem:
                log.warning("varuna: skipping checkpoint %s: %s", path, problem)
            elif self.rank == 0:
                log.warning("varuna: skipping checkpoint %s: another rank found it corrupt "
                            "(see its output)", path)
        what = f"step {step}" if step is not None else "checkpoint"
        msg = f"no complete, sound {what} in {root}" + (f" (skipped {', '.join(skipped)})" if skipped else "")
        if required:
            raise CheckpointError(msg + "; start without --resume / VARUNA_RESUME=1, "
                                  "or use VARUNA_RESUME=auto")
        if self.rank == 0:
            log.warning("varuna: %s: starting from scratch", msg)
        return None

    def _read_for_stage(self, path: Path) -> tuple[int, str | None, dict | None]:
        """This rank's verdict on a checkpoint, and what it read (its stage's parameters)."""
        try:
            m = read_manifest(path)
            return self._read_files(path, m)
        except ValueError as e:
            return _SKIP, str(e), None
        except (KeyError, TypeError, AttributeError) as e:
            return _SKIP, f"{path / MANIFEST}: malformed ({type(e).__name__}: {e})", None

    def _read_files(self, path: Path, m: dict) -> tuple[int, str | None, dict | None]:
        eng = self.engine
        mine = eng.stage_params
        params_meta = m["parameters"]
        missing = [n for n in mine if n not in params_meta]
        if missing:
            return _FATAL, (f"checkpoint {path} has no parameter {missing[0]!r} (and {len(missing) - 1} "
                            "more) of this model: it was saved from a different model"), None
        for n, p in mine.items():
            shape = list(params_meta[n].get("shape", []))
            if shape != list(p.shape):
                return _FATAL, (f"checkpoint {path}: parameter {n!r} has shape {tuple(shape)}, the model's "
                                f"is {tuple(p.shape)}: it was saved from another model configuration"), None
        saved_opt = m.get("optimizer")
        if saved_opt and saved_opt != type(eng.optimizer).__name__:
            return _FATAL, (f"checkpoint {path} holds {saved_opt} state but the engine's optimizer is "
                            f"{type(eng.optimizer).__name__}; build the optimizer the saving run used"), None
        entries = {f["name"]: f for f in m["files"]}
        needed = sorted({params_meta[n]["file"] for n in mine})
        params: dict[str, torch.Tensor] = {}
        opts = []
        for name in needed:
            if name not in entries:
                return _SKIP, f"the manifest names file {name!r} for a parameter but does not list it", None
            data, problem = _check_file(path / name, entries[name])
            if problem:
                return _SKIP, problem, None
            try:
                shard = read_shard(path / name, data)
            except CheckpointError as e:
                return _FATAL, str(e), None
            except Exception as e:  # checksum matched but torch cannot parse it: treat as corrupt
                return _SKIP, f"{name}: unreadable ({e})", None
            params.update(shard["params"])
            opts.append(shard["optimizer"])
        absent = [n for n in mine if n not in params]
        if absent:
            return _SKIP, f"parameter {absent[0]!r} is not in the file the manifest names", None
        return _OK, None, {"manifest": m, "params": params, "optimizer": merge_optimizer_states(opts)}

    def _apply(self, payload: dict, root: Path, step: int) -> None:
        eng = self.engine
        m = payload["manifest"]
        with torch.no_grad():
            for n, p in eng.stage_params.items():
                p.copy_(payload["params"][n])
        opt = payload["optimizer"]
        opt["state"] = {n: v for n, v in opt["state"].items() if n in eng._trainable}
        load_optimizer_state_by_name(eng.optimizer, eng._trainable, opt, copy=False)  # fresh from disk
        eng.scaler.load_state_dict(m["loss_scale"])
        eng.step_count = int(m["step"])
        self._last_saved = (root, step)  # never rewrite the checkpoint we resumed from
        saved_M = m.get("config", {}).get("global_batch_size")
        if saved_M is not None and saved_M != eng.config.global_batch_size and self.rank == 0:
            log.warning("varuna: the checkpoint was trained with global batch size %s, this run uses %s: "
                        "hyper-parameters may no longer fit", saved_M, eng.config.global_batch_size)

    def _broadcast_ints(self, values: list[int]) -> list[int]:
        if self.engine.layout.world == 1:
            return values
        n = torch.tensor([len(values)], dtype=torch.int64)
        dist.broadcast(n, src=0)
        t = torch.tensor(values if self.rank == 0 else [0] * int(n), dtype=torch.int64)
        if int(n):
            dist.broadcast(t, src=0)
        return t.tolist()

    def _agree_verdict(self, verdict: int) -> int:
        if self.engine.layout.world == 1:
            return verdict
        v = torch.tensor([verdict], dtype=torch.int64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return int(v)


def prune(root: Path, step: int, keep: int) -> None:
    """After the checkpoint of ``step`` is complete: keep the newest ``keep`` complete ones up to
    it; remove older and incomplete leftovers, and those *after* it (a lineage this run
    abandoned by resuming from an older checkpoint, which a later resume must not pick)."""
    infos = list_checkpoints(root)
    kept = {c.step for c in sorted((c for c in infos if c.complete and c.step <= step),
                                   key=lambda c: -c.step)[:keep]}
    kept.add(step)
    for c in infos:
        if c.step in kept:
            continue
        # Manifest first: a reader racing with us sees an incomplete checkpoint, never a
        # complete one with missing files.
        (c.path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(c.path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# In-memory state (Engine.state_dict / load_state_dict)


def engine_state_dict(engine: Engine) -> dict:
    """This stage's state keyed by canonical names: ``step``, ``params``, ``optimizer`` (name-keyed),
    ``loss_scale``. Tensors are references to the live ones, like ``nn.Module.state_dict``."""
    return {
        "step": engine.step_count,
        "params": {n: p.detach() for n, p in engine.stage_params.items()},
        "optimizer": optimizer_state_by_name(engine.optimizer, engine._trainable),
        "loss_scale": engine.scaler.state_dict(),
    }


def load_engine_state_dict(engine: Engine, state: Mapping[str, Any]) -> None:
    """Inverse of :func:`engine_state_dict`; ``state["params"]`` may hold more names (e.g. the
    whole model's), but must hold every parameter of this stage."""
    params = state["params"]
    missing = [n for n in engine.stage_params if n not in params]
    if missing:
        raise ValueError(f"state has no parameter {missing[0]!r} (and {len(missing) - 1} more) of this stage")
    with torch.no_grad():
        for n, p in engine.stage_params.items():
            if tuple(params[n].shape) != tuple(p.shape):
                raise ValueError(f"parameter {n!r}: shape {tuple(params[n].shape)} != "
                                 f"the model's {tuple(p.shape)}")
            p.copy_(params[n])
    opt = dict(state["optimizer"])
    opt["state"] = {n: v for n, v in opt.get("state", {}).items() if n in engine._trainable}
    load_optimizer_state_by_name(engine.optimizer, engine._trainable, opt)
    engine.scaler.load_state_dict(state["loss_scale"])
    engine.step_count = int(state["step"])

