"""The ``dcp`` checkpoint format: PyTorch Distributed Checkpoint, as torchtitan and most PyTorch
training stacks write it (issue 29).

A step directory is a DCP checkpoint a plain single-process script loads with
``torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id=path)``::

    step_00000300/
        seg000-00.distcp     segment 0's tensors under the model's own names, and their optimizer
        ...                  state under ``optimizer.state.<name>.<key>`` (torch's FQN-keyed layout)
        varuna.json          varuna's training state beyond tensors, every file's size and sha256
        .metadata            the commit file: DCP's index of every item, written last, atomically

Each planned file (the ``varuna`` format's plan: per segment, split among the stage's replicas)
is one DCP data file written by one replica with ``torch.distributed.checkpoint.save(...,
no_dist=True)``; rank 0's commit merges the writers' item tables (from their records: JSON) into
one ``Metadata`` and pickles it as DCP does, so DCP's own reader sees an ordinary checkpoint.

Reading never unpickles ``.metadata``: varuna rebuilds DCP's ``Metadata`` from ``varuna.json``
(JSON) and hands it to a ``FileSystemReader`` whose ``read_metadata`` returns it; DCP reads each
item with ``torch.load(weights_only=True)``, only the items of the requested tensors (a stage's),
each a byte range of its file: streaming, never the whole model. A DCP checkpoint another tool
wrote (no ``varuna.json``) is read for its weights only (``CheckpointConfig.init_from``), its
``.metadata`` through an unpickler that accepts DCP's metadata classes and nothing else.

Example::

    cfg = varuna.VarunaConfig(..., checkpoint_format="dcp", checkpoint_dir="/mnt/ckpt")
    # later, in any script:
    sd = model.state_dict(); dcp.load(sd, checkpoint_id="/mnt/ckpt/step_00000300")
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from varuna.runtime.checkpoint_files import (
    JSON_MAX_BYTES,
    CheckpointError,
    UnsoundCheckpoint,
    atomic_write,
    hash_file,
    open_checked,
    read_json,
    read_regular,
)
from varuna.runtime.checkpoint_format import (
    CheckpointFormat,
    LoadedShare,
    LoadRequest,
    StateLayout,
    StateShare,
    as_saved,
    check_model_fits,
    tensor_meta,
    tensor_table,
)
from varuna.runtime.checkpoint_shards import Shard, plan_shards
from varuna.runtime.optimizer_state import merge_optimizer_states
from varuna.runtime.state_codec import from_json, to_json

__all__ = ["METADATA", "SIDECAR", "DCPFormat", "optimizer_key"]

METADATA = ".metadata"
SIDECAR = "varuna.json"
FORMAT = "varuna-dcp"
VERSION = 1


def optimizer_key(name: str, key: str) -> str:
    """The DCP key of a parameter's optimizer state entry (torch's FQN-keyed optimizer layout).

    >>> optimizer_key("layers.0.w", "exp_avg")
    'optimizer.state.layers.0.w.exp_avg'
    """
    return f"optimizer.state.{name}.{key}"


class DCPFormat(CheckpointFormat):
    """Distributed Checkpoint files and their ``.metadata`` (the module's docstring); ``"dcp"``."""

    name = "dcp"
    commit_file = METADATA

    def plan(self, layout: StateLayout) -> list[Shard]:
        import dataclasses

        shards = plan_shards(
            param_segments=layout.tensor_segments,
            param_bytes=layout.tensor_bytes,
            stage_ranges=layout.stage_ranges,
            data_parallel=layout.data_parallel,
            pipeline_depth=layout.pipeline_depth,
        )
        return [dataclasses.replace(s, name=s.name.removesuffix(".pt") + ".distcp") for s in shards]

    def write(self, shard: Shard, share: StateShare, path: Path) -> dict:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint import save as dcp_save

        items: dict[str, torch.Tensor] = dict(as_saved(share.tensors))
        state = {}
        for n, entries in share.optimizer.get("state", {}).items():
            state[n] = {}
            for k, v in entries.items():
                if isinstance(v, torch.Tensor):
                    items[optimizer_key(n, k)] = as_saved(v)
                    state[n][k] = {"@t": optimizer_key(n, k)}
                else:
                    state[n][k] = to_json(v)
        captured: dict[str, Any] = {}

        class Capture(FileSystemWriter):  # DCP's writer, keeping its item table instead of pickling it
            def finish(self, metadata, results) -> None:
                captured["metadata"], captured["results"] = metadata, results

        tmp = path.with_name(f".{path.name}.dcp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": yes
                warnings.simplefilter("ignore", UserWarning)
                dcp_save(items, storage_writer=Capture(str(tmp), single_file_per_rank=True, sync_files=False),
                         no_dist=True)
            [written] = [p for p in tmp.iterdir() if p.suffix == ".distcp"]
            written.replace(path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        md = captured["metadata"].state_dict_metadata
        located = {r.index.fqn: r.storage_data for rs in captured["results"] for r in rs}
        table = [{"key": k, **tensor_meta(items[k]), "offset": located[k].offset, "length": located[k].length}
                 for k in md]
        nbytes, sha = hash_file(path)
        return {"name": shard.name, "segment": shard.segment, "stage": shard.stage, "replica": shard.replica,
                "rank": share.rank, "bytes": nbytes, "sha256": sha, "items": table,
                "tensors": {n: tensor_meta(t) for n, t in share.tensors.items()},
                "optimizer": {"class": share.optimizer.get("class"), "state": state,
                              "param_groups": to_json(share.optimizer.get("param_groups", []))}}

    def commit(self, target: Path, records: list[dict], metadata: dict, layout: StateLayout, *,
               before_replace: Callable[[], None]) -> None:
        table = tensor_table(records, layout)
        sidecar = {"format": FORMAT, "version": VERSION, **metadata, "tensors": table,
                   "files": sorted(records, key=lambda r: r["name"])}
        atomic_write(target / SIDECAR, json.dumps(sidecar).encode())
        md = _metadata_of(records)
        atomic_write(target / METADATA, pickle.dumps(md), before_replace=before_replace)

    def read(self, path: Path, request: LoadRequest) -> LoadedShare:
        ours = _sidecar(path)
        if ours is None:
            if not request.weights_only:
                raise CheckpointError(
                    f"{path} is a DCP checkpoint without varuna's training state ({SIDECAR}): start from "
                    "its weights with CheckpointConfig.init_from instead"
                )
            return _read_foreign(path, request)
        try:
            table = ours["tensors"]
            files = {_safe_name(path, f["name"]): f for f in ours["files"]}
            shapes = {n: table[n]["shape"] for n in request.tensors if n in table}
            check_model_fits(path, shapes, ours.get("optimizer"), request)
            wanted = [n for n in request.tensors if n in table]
            used = sorted({table[n]["file"] for n in wanted})
            opt_parts = [] if request.weights_only else [
                _optimizer_skeleton(files[f], set(wanted)) for f in used]
        except (KeyError, TypeError, AttributeError) as e:
            raise UnsoundCheckpoint(f"{path / SIDECAR}: malformed ({type(e).__name__}: {e})") from None
        keys = {n: _empty(table[n]) for n in wanted}
        for part in opt_parts:
            keys.update(part.pop("_items"))
        seen = _check_files(path, [files[f] for f in used])
        _load_items(path, keys, _metadata_of(list(files.values())))
        _unchanged(path, seen)
        tensors = {n: keys[n] for n in wanted}
        opts = [_fill(part, keys) for part in opt_parts]
        metadata = {k: v for k, v in ours.items() if k not in ("format", "version", "tensors", "files")}
        return LoadedShare(metadata=metadata, tensors=tensors, optimizer=merge_optimizer_states(opts))

    def verify(self, path: Path) -> list[str]:
        try:
            ours = _sidecar(path)
        except (UnsoundCheckpoint, CheckpointError) as e:
            return [str(e)]
        if ours is None:
            return [f"{path}: no {SIDECAR} (a DCP checkpoint another tool wrote, not a varuna one)"]
        problems = []
        for f in ours.get("files", []):
            try:
                opened, problem = open_checked(path / _safe_name(path, f["name"]), f)
            except CheckpointError as e:
                opened, problem = None, str(e)
            if opened is not None:
                opened.close()
            if problem:
                problems.append(problem)
        return problems

    def describe(self, path: Path) -> tuple[dict[str, dict], dict]:
        ours = _sidecar(path)
        if ours is None:
            raise CheckpointError(f"{path}: a DCP checkpoint without {SIDECAR} cannot be converted")
        return ours["tensors"], {k: v for k, v in ours.items() if k not in ("format", "version", "tensors",
                                                                               "files")}


def _safe_name(path: Path, name: Any) -> str:
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise CheckpointError(f"{path}: bad file name {name!r} in {SIDECAR} (files must be in the directory)")
    return name


def _sidecar(path: Path) -> dict | None:
    """varuna.json, or None for a DCP checkpoint another tool wrote."""
    if not (path / SIDECAR).exists():
        return None
    ours = read_json(path / SIDECAR)
    if not isinstance(ours, dict) or ours.get("format") != FORMAT:
        raise UnsoundCheckpoint(f"{path / SIDECAR}: not a varuna DCP sidecar")
    if ours.get("version") != VERSION:
        raise UnsoundCheckpoint(
            f"{path / SIDECAR}: version {ours.get('version')!r}, this varuna reads {VERSION}"
        )
    return ours


def _empty(meta: Mapping[str, Any]) -> torch.Tensor:
    dt = getattr(torch, str(meta["dtype"]), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"bad dtype {meta['dtype']!r} in {SIDECAR}")
    return torch.empty([int(s) for s in meta["shape"]], dtype=dt)


def _optimizer_skeleton(record: dict, names: set[str]) -> dict:
    """The optimizer state of ``names`` in one file's record, tensors still to load (``_items``)."""
    opt = record["optimizer"]
    items = {i["key"]: i for i in record["items"]}
    state, need = {}, {}
    for n, entries in opt.get("state", {}).items():
        if n not in names:
            continue
        state[n] = {}
        for k, v in entries.items():
            if isinstance(v, dict) and set(v) == {"@t"}:
                need[v["@t"]] = _empty(items[v["@t"]])
                state[n][k] = v
            else:
                state[n][k] = from_json(v)
    groups = [{**g, "params": [n for n in g["params"] if n in names]}
              for g in from_json(opt.get("param_groups", [])) if any(n in names for n in g["params"])]
    return {"class": opt.get("class"), "state": state, "param_groups": groups, "_items": need}


def _fill(part: dict, loaded: Mapping[str, torch.Tensor]) -> dict:
    state = {n: {k: loaded[v["@t"]] if isinstance(v, dict) and set(v) == {"@t"} else v for k, v in e.items()}
             for n, e in part["state"].items()}
    return {**part, "state": state}


def _check_files(path: Path, records: list[dict]) -> dict[str, tuple[int, int, int]]:
    """Each file's size and sha256 against its record; their (inode, size, mtime) as checked."""
    seen = {}
    for r in records:
        opened, problem = open_checked(path / r["name"], r)
        if problem:
            raise UnsoundCheckpoint(problem)
        seen[r["name"]] = opened.signature
        opened.close()
    return seen


def _unchanged(path: Path, seen: Mapping[str, tuple[int, int, int]]) -> None:
    """DCP opens the files by name after the check: refuse what was replaced meanwhile."""
    for name, sig in seen.items():
        st = (path / name).stat()
        if (st.st_ino, st.st_size, st.st_mtime_ns) != sig:
            raise UnsoundCheckpoint(f"{name}: changed while being read (something else is writing it)")


def _metadata_of(records: list[dict]):
    """DCP's ``Metadata`` for the writers' item tables (what ``.metadata`` holds)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm, storage, planner = {}, {}, {}
    for r in records:
        for item in r["items"]:
            key, size = item["key"], torch.Size([int(s) for s in item["shape"]])
            origin = torch.Size([0] * len(size))
            sdm[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_empty({"dtype": item["dtype"], "shape": []}).dtype),
                size=size, chunks=[ChunkStorageMetadata(offsets=origin, sizes=size)])
            storage[MetadataIndex(key, origin, 0)] = _StorageInfo(
                relative_path=r["name"], offset=int(item["offset"]), length=int(item["length"]))
            planner[key] = (key,)
    return Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage)


def _load_items(path: Path, dest: dict[str, torch.Tensor], metadata) -> None:
    """DCP's own reader fills ``dest`` (only those items are read) with ``metadata`` given, never
    unpickled from the directory."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    class Reader(FileSystemReader):
        def read_metadata(self):
            return metadata

    if not dest:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp_load(dest, storage_reader=Reader(str(path)), no_dist=True)
        except (RuntimeError, ValueError, OSError, EOFError) as e:  # a short or corrupt data file
            raise UnsoundCheckpoint(f"{path}: a DCP item cannot be read ({' '.join(str(e).split())[:200]})") \
                from None


# DCP's metadata classes: what a .metadata written by another tool may hold (nothing else is unpickled).
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"{METADATA} refers to {module}.{name}, which is not DCP metadata: refusing to "
                              "unpickle it")


def _read_foreign(path: Path, request: LoadRequest) -> LoadedShare:
    """Weights only from a DCP checkpoint another tool wrote: its ``.metadata`` through the
    restricted unpickler, then the requested tensors (by the model's names) from DCP's reader."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(read_regular(path / METADATA, JSON_MAX_BYTES))).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise UnsoundCheckpoint(f"{path / METADATA}: unreadable ({e})") from None
    sdm = metadata.state_dict_metadata
    shapes = {n: list(sdm[n].size) for n in request.tensors if n in sdm and hasattr(sdm[n], "size")}
    check_model_fits(path, shapes, None, request)
    dest = {n: torch.empty(tuple(shapes[n]), dtype=sdm[n].properties.dtype) for n in shapes}
    _load_items(path, dest, metadata)
    return LoadedShare(metadata={}, tensors=dest, optimizer={"class": None, "state": {}, "param_groups": []})
