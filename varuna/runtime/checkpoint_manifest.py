"""The ``varuna`` checkpoint format: per-segment ``torch.save`` shards and a JSON manifest.

The default format (docs/checkpoints.md "Layout on disk" and "Manifest schema")::

    step_00000300/
        seg000-00.pt      params + name-keyed optimizer state of segment 0's own parameters
        seg000-01.pt      segment 0's parameters that other segments also read (tied embedding)
        seg001-00.pt      ...
        manifest.json     the commit file: written last, atomically, with every file's size and sha256

Files are planned per segment (:func:`~varuna.runtime.checkpoint_shards.plan_shards`), each
written by one replica of its stage; a reader opens only the files holding its stage's
parameters, checks each one's size and sha256 against the manifest while streaming it, and
unpickles it from that same open file with ``weights_only=True``.

Example::

    >>> fmt = ManifestFormat()
    >>> fmt.name, fmt.commit_file, fmt.is_complete(Path("/nonexistent"))
    ('varuna', 'manifest.json', False)
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from varuna.runtime.checkpoint_files import (
    JSON_MAX_BYTES,
    CheckedFile,
    CheckpointError,
    UnsoundCheckpoint,
    atomic_write,
    open_checked,
    open_regular,
    read_regular,
    save_hashed,
)
from varuna.runtime.checkpoint_format import (
    CheckpointFormat,
    LoadedShare,
    LoadRequest,
    StateLayout,
    StateShare,
    as_saved,
    check_model_fits,
)
from varuna.runtime.checkpoint_shards import Shard, plan_shards
from varuna.runtime.optimizer_state import merge_optimizer_states

__all__ = ["FORMAT", "MANIFEST", "VERSION", "ManifestFormat", "read_manifest", "read_shard"]

#: The ``format`` key of a manifest and of every shard file.
FORMAT = "varuna-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_SHARD_NAME = re.compile(r"^seg\d{3,}-\d{2,}\.pt$")


class ManifestFormat(CheckpointFormat):
    """Per-segment shard files and a manifest (the module's docstring); ``"varuna"``, the default."""

    name = "varuna"
    commit_file = MANIFEST

    def plan(self, layout: StateLayout) -> list[Shard]:
        return plan_shards(
            param_segments=layout.tensor_segments,
            param_bytes=layout.tensor_bytes,
            stage_ranges=layout.stage_ranges,
            data_parallel=layout.data_parallel,
            pipeline_depth=layout.pipeline_depth,  # interleaved: virtual stage j on process j % P
        )

    def write(self, shard: Shard, share: StateShare, path: Path) -> dict:
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "step": share.step,
            "segment": shard.segment,
            "params": share.tensors,
            "optimizer": share.optimizer,
        }
        if share.extra:
            payload["extra"] = share.extra
        # as_saved: a snapshot is already compact host tensors; live ones are taken as they are
        # when torch.save can write them in place, else copied one file at a time.
        nbytes, sha = save_hashed(as_saved(payload), path)
        return {
            "name": shard.name,
            "segment": shard.segment,
            "stage": shard.stage,
            "replica": shard.replica,
            "rank": share.rank,
            "params": {
                n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                for n, t in share.tensors.items()
            },
            "bytes": nbytes,
            "sha256": sha,
        }

    def commit(
        self,
        target: Path,
        records: list[dict],
        metadata: dict,
        layout: StateLayout,
        *,
        before_replace: Callable[[], None],
    ) -> None:
        parameters = {}
        for f in records:
            for n, meta in f["params"].items():
                segments = list(layout.tensor_segments.get(n, []))
                kind = {"buffer": True} if n in layout.buffers else {}
                parameters[n] = {**meta, "segments": segments, "file": f["name"], **kind}
        missing = set(layout.tensor_segments) - set(parameters)
        if missing:
            raise CheckpointError(f"no file holds parameter(s) {sorted(missing)[:5]}")
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            **metadata,
            "parameters": parameters,
            "files": sorted(records, key=lambda f: f["name"]),
        }
        data = json.dumps(manifest, indent=1).encode()
        atomic_write(target / MANIFEST, data, before_replace=before_replace)

    def read(self, path: Path, request: LoadRequest) -> LoadedShare:
        """The files holding the requested parameters (Note [Load] in checkpoint.py), each checked
        against its size and sha256 in the manifest and unpickled from the same open file."""
        try:
            m = read_manifest(path)
        except ValueError as e:  # CheckpointError included: an unusable manifest skips the checkpoint
            raise UnsoundCheckpoint(str(e)) from None
        try:
            params_meta = m["parameters"]
            shapes = {n: params_meta[n].get("shape", []) for n in request.tensors if n in params_meta}
            check_model_fits(path, shapes, m.get("optimizer"), request)
            entries = {f["name"]: f for f in m["files"]}
            needed = sorted({params_meta[n]["file"] for n in request.tensors if n in params_meta})
        except (KeyError, TypeError, AttributeError) as e:
            raise UnsoundCheckpoint(f"{path / MANIFEST}: malformed ({type(e).__name__}: {e})") from None
        tensors: dict[str, torch.Tensor] = {}
        opts, extra = [], {}
        for name in needed:
            shard = _read_checked(path, name, entries, request.tensors)
            tensors.update((n, t) for n, t in shard["params"].items() if n in request.tensors)
            opts.append(shard["optimizer"])
            extra.update(shard.get("extra", {}))
            del shard  # the file's other tensors (another stage's share of a segment file) go now
        absent = [n for n in request.tensors if n not in tensors and n in params_meta]
        if absent:
            raise UnsoundCheckpoint(f"parameter {absent[0]!r} is not in the file the manifest names")
        metadata = {k: v for k, v in m.items() if k not in ("format", "version", "parameters", "files")}
        return LoadedShare(
            metadata=metadata, tensors=tensors, optimizer=merge_optimizer_states(opts), extra=extra
        )

    def describe(self, path: Path) -> tuple[dict[str, dict], dict]:
        m = read_manifest(path)
        metadata = {k: v for k, v in m.items() if k not in ("format", "version", "parameters", "files")}
        return m["parameters"], metadata

    def verify(self, path: Path) -> list[str]:
        """No/bad manifest, missing, truncated or altered files (size and sha256 of every file;
        nothing is unpickled)."""
        try:
            m = read_manifest(path)
        except ValueError as e:  # CheckpointError included
            return [str(e)]
        problems = []
        for f in m["files"]:
            try:
                opened, problem = open_checked(path / f["name"], f)
            except CheckpointError as e:
                opened, problem = None, str(e)
            if opened is not None:
                opened.close()
            if problem:
                problems.append(problem)
        return problems


def _read_checked(
    path: Path, name: str, entries: Mapping[str, dict], mine: Mapping[str, torch.Tensor]
) -> dict:
    """One shard file, checked against its manifest entry, unpickled safely, its tensors' shapes
    compared with the model's."""
    if name not in entries:
        raise UnsoundCheckpoint(f"the manifest names file {name!r} for a parameter but does not list it")
    try:
        opened, problem = open_checked(path / name, entries[name])
        if problem:
            raise UnsoundCheckpoint(problem)
        with opened:  # unpickled from the verified file: never held whole in memory
            shard = read_shard(path / name, opened)
    except (CheckpointError, UnsoundCheckpoint):  # a link, a FIFO, a device, or pickled code: refused
        raise
    except Exception as e:  # checksum matched but torch cannot parse it: treat as corrupt
        raise UnsoundCheckpoint(f"{name}: unreadable ({e})") from None
    problem = _wrong_shape(path / name, shard["params"], mine)
    if problem:
        raise CheckpointError(problem)
    return shard


def _wrong_shape(
    path: Path, saved: Mapping[str, torch.Tensor], mine: Mapping[str, torch.Tensor]
) -> str | None:
    """A tensor of the file whose shape is not its parameter's, or None.

    ``copy_`` broadcasts (a ``[16]`` tensor would fill every row of a ``[16, 16]`` weight), so a
    file whose tensors disagree with the manifest it matches must be refused, not loaded."""
    for n, t in saved.items():
        p = mine.get(n)
        if p is not None and tuple(t.shape) != tuple(p.shape):
            return (
                f"{path}: parameter {n!r} has shape {tuple(t.shape)} in the file but {tuple(p.shape)} "
                f"in the model and the manifest: the file was altered or written by another tool; "
                f"delete {path.parent} to resume from an older checkpoint"
            )
    return None


def read_manifest(path: str | Path) -> dict:
    """Parse and validate ``<step dir>/manifest.json``; ``ValueError`` says what is wrong.

    >>> read_manifest("/nonexistent")
    Traceback (most recent call last):
    ValueError: /nonexistent: no manifest.json (an incomplete checkpoint)
    """
    path = Path(path)
    try:
        m = json.loads(read_regular(path / MANIFEST, JSON_MAX_BYTES).decode())
    except FileNotFoundError:
        raise ValueError(f"{path}: no {MANIFEST} (an incomplete checkpoint)") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / MANIFEST}: unreadable ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path / MANIFEST}: not a varuna checkpoint manifest")
    if m.get("version") != VERSION:
        raise ValueError(
            f"{path / MANIFEST}: format version {m.get('version')!r}, this varuna reads {VERSION}"
        )
    for key in ("step", "files", "parameters", "loss_scale"):
        if key not in m:
            raise ValueError(f"{path / MANIFEST}: missing {key!r}")
    for f in m["files"]:
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not _SHARD_NAME.match(f["name"]):
            raise ValueError(f"{path / MANIFEST}: bad file entry {f!r}")
    return m


def read_shard(path: Path, source: CheckedFile | None = None) -> dict:
    """Unpickle a shard file safely (``weights_only``: tensors and plain containers only).

    ``source``: the file already opened and verified by
    :func:`~varuna.runtime.checkpoint_files.open_checked` (it is read from there, record by
    record: the file is never held whole in memory); else ``path`` is opened (a regular file
    only). Raises :class:`CheckpointError` naming the file when it holds anything else (a pickled
    custom class, code), ``ValueError`` when it does not have the shard layout.

    Example::

        shard = read_shard(step_dir / "seg000-00.pt")
        shard["params"]["wte.weight"], shard["optimizer"]["state"]["wte.weight"]["exp_avg"]
    """
    path = Path(path)
    if source is None:
        fd, _ = open_regular(path)
        with os.fdopen(fd, "rb") as f:
            return _load_shard(path, f)
    source.file.seek(0)
    obj = _load_shard(path, source.file)
    if source.changed():
        # What was unpickled is not what was hashed: another writer is at work in the store.
        raise ValueError(f"{path.name}: changed while being read (something else is writing it)")
    return obj


def _load_shard(path: Path, f) -> dict:
    try:
        obj = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path}: refusing to load: the file holds pickled objects other than tensors and plain "
            f"containers ({first}); varuna checkpoints never do, so it is not one or it was tampered with"
        ) from None
    if not (
        isinstance(obj, dict)
        and obj.get("format") == FORMAT
        and isinstance(obj.get("params"), dict)
        and isinstance(obj.get("optimizer"), dict)
        and isinstance(obj.get("extra", {}), dict)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj["params"].items())
    ):
        raise ValueError(f"{path}: not a varuna checkpoint shard (unexpected layout)")
    return obj
