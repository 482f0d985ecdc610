"""The ``hf`` checkpoint format: Hugging Face safetensors, sharded, with its index (issue 29).

A step directory is a model directory ``transformers``' ``from_pretrained`` loads as it is::

    step_00000300/
        config.json                                the model's config, when it has one (HF models)
        model-00001-of-00004.safetensors           segment 0's tensors (the model's own names)
        optimizer-00001-of-00004.safetensors       their optimizer state (varuna's; HF ignores it)
        ...
        model.safetensors.index.json               the commit file: written last, atomically

Files follow the ``varuna`` format's plan (per segment, split among the stage's replicas:
:func:`~varuna.runtime.checkpoint_shards.plan_shards`), each written by one replica; tensor names
are the model's own (its ``named_parameters`` and persistent buffers), a tied weight once, under
its first name, as ``save_pretrained`` does; the shards carry ``{"format": "pt"}`` metadata. The
index's ``weight_map`` lists the model tensors only; its ``metadata`` holds ``total_size`` and,
under ``varuna``, the training state beyond tensors (step, loss scale, registered state...) and
every file's size and sha256, which a resume checks before reading. Optimizer state is flattened
into its own safetensors files (tensors ``t0``, ``t1``... and a JSON skeleton in the file's
header metadata): no pickle anywhere.

Reading streams: a rank opens only the files holding its stage's tensors and takes each tensor
with ``safe_open(...).get_tensor(name)`` (the file is mapped, not read whole), so a model built on
``meta`` loads its stage without ever holding the whole model. A directory ``save_pretrained``
wrote (no ``varuna`` metadata; or one ``model.safetensors`` without an index) is read for its
weights only (``CheckpointConfig.init_from``).

Example::

    cfg = varuna.VarunaConfig(..., checkpoint_format="hf", checkpoint_dir="/mnt/ckpt")
    # later, anywhere:
    model = transformers.AutoModelForCausalLM.from_pretrained("/mnt/ckpt/step_00000300")
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from varuna.core.extras import require
from varuna.runtime.checkpoint_files import (
    CheckpointError,
    UnsoundCheckpoint,
    atomic_write,
    hash_file,
    open_checked,
    open_regular,
    read_json,
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
from varuna.runtime.state_codec import flatten, unflatten

__all__ = ["INDEX", "SINGLE", "HFFormat", "read_hf_index"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
FORMAT = "varuna-hf"
VERSION = 1


def _safetensors(what: str = "the hf checkpoint format"):
    return require("safetensors.torch", "safetensors", what)


class HFFormat(CheckpointFormat):
    """Hugging Face safetensors shards and their index (the module's docstring); ``"hf"``."""

    name = "hf"
    commit_file = INDEX

    def plan(self, layout: StateLayout) -> list[Shard]:
        base = plan_shards(
            param_segments=layout.tensor_segments,
            param_bytes=layout.tensor_bytes,
            stage_ranges=layout.stage_ranges,
            data_parallel=layout.data_parallel,
            pipeline_depth=layout.pipeline_depth,
        )
        n, out = len(base), []
        for i, s in enumerate(base):
            out.append(dataclasses.replace(s, name=f"model-{i + 1:05d}-of-{n:05d}.safetensors",
                                           holds="tensors"))
            if any(p not in layout.buffers for p in s.params):
                out.append(dataclasses.replace(s, name=f"optimizer-{i + 1:05d}-of-{n:05d}.safetensors",
                                               holds="optimizer"))
        return out

    def write(self, shard: Shard, share: StateShare, path: Path) -> dict:
        st = _safetensors()
        record = {"name": shard.name, "holds": shard.holds, "segment": shard.segment, "stage": shard.stage,
                  "replica": shard.replica, "rank": share.rank}
        if shard.holds == "tensors":
            tensors = as_saved(share.tensors)
            st.save_file(tensors, str(path), metadata={"format": "pt"})
            record["tensors"] = {n: tensor_meta(t) for n, t in tensors.items()}
        else:
            skeleton, tensors = flatten(share.optimizer)
            st.save_file(as_saved(tensors), str(path),
                         metadata={"format": "pt", "varuna": json.dumps(skeleton)})
            record["params"] = sorted(share.optimizer.get("state", {}))
        record["bytes"], record["sha256"] = hash_file(path)
        return record

    def commit(self, target: Path, records: list[dict], metadata: dict, layout: StateLayout, *,
               before_replace: Callable[[], None]) -> None:
        table = tensor_table(records, layout)
        meta = dict(metadata)
        config = meta.pop("model_config", None)
        index = {
            "metadata": {
                "total_size": sum(_nbytes(m) for m in table.values()),
                "varuna": {"format": FORMAT, "version": VERSION, **meta, "tensors": table,
                           "files": sorted(records, key=lambda r: r["name"])},
            },
            "weight_map": {n: m["file"] for n, m in sorted(table.items())},
        }
        if config is not None:  # before the index: a complete checkpoint always has its config
            atomic_write(target / CONFIG, json.dumps(config, indent=2).encode())
        atomic_write(target / INDEX, json.dumps(index, indent=1).encode(), before_replace=before_replace)

    def read(self, path: Path, request: LoadRequest) -> LoadedShare:
        index = read_hf_index(path)
        ours = index.get("metadata", {}).get("varuna")
        if ours is None:
            if not request.weights_only:
                raise CheckpointError(
                    f"{path} is a Hugging Face model directory without varuna's training state (no "
                    "optimizer, no step): start from its weights with CheckpointConfig.init_from instead"
                )
            return _read_weights(path, index, request)
        try:
            table, files = ours["tensors"], {_safe_name(path, f["name"]): f for f in ours["files"]}
            shapes = {n: table[n]["shape"] for n in request.tensors if n in table}
            check_model_fits(path, shapes, ours.get("optimizer"), request)
            wanted = [n for n in request.tensors if n in table]
            by_file: dict[str, list[str]] = {}
            for n in wanted:
                by_file.setdefault(table[n]["file"], []).append(n)
        except (KeyError, TypeError, AttributeError) as e:
            raise UnsoundCheckpoint(f"{path / INDEX}: malformed ({type(e).__name__}: {e})") from None
        tensors: dict[str, torch.Tensor] = {}
        for name, names in by_file.items():
            if name not in files:  # every file a varuna index names is checked: no unlisted one is read
                raise UnsoundCheckpoint(f"{path / INDEX}: names file {name!r} for {names[0]!r} but does not "
                                        "list it")
            tensors.update(_tensors_of(path, name, files[name], names))
        opts = []
        if not request.weights_only:
            mine = set(wanted)
            for f in files.values():
                if f.get("holds") == "optimizer" and mine.intersection(f.get("params", [])):
                    opts.append(_optimizer_of(path, f, mine))
        metadata = {k: v for k, v in ours.items() if k not in ("format", "version", "tensors", "files")}
        return LoadedShare(metadata=metadata, tensors=tensors, optimizer=merge_optimizer_states(opts))

    def verify(self, path: Path) -> list[str]:
        try:
            ours = read_hf_index(path).get("metadata", {}).get("varuna")
        except (UnsoundCheckpoint, CheckpointError) as e:
            return [str(e)]
        if ours is None:
            return [f"{path / INDEX}: no varuna metadata (a model directory, not a varuna checkpoint)"]
        return _verify_files(path, ours.get("files", []))

    def describe(self, path: Path) -> tuple[dict[str, dict], dict]:
        ours = read_hf_index(path).get("metadata", {}).get("varuna")
        if ours is None:
            raise CheckpointError(f"{path}: a model directory without varuna metadata cannot be converted")
        meta = {k: v for k, v in ours.items() if k not in ("format", "version", "tensors", "files")}
        config = _config_of(path)
        return ours["tensors"], {**meta, **({"model_config": config} if config is not None else {})}


def read_hf_index(path: Path) -> dict:
    """The index of a sharded safetensors directory, or one made up for a single
    ``model.safetensors`` (``save_pretrained`` of a small model); :class:`UnsoundCheckpoint` when
    there is neither."""
    path = Path(path)
    if (path / INDEX).exists() or not (path / SINGLE).exists():
        index = read_json(path / INDEX)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise UnsoundCheckpoint(f"{path / INDEX}: not a safetensors index (no weight_map)")
        for f in set(index["weight_map"].values()):
            _safe_name(path, f)
        return index
    names = _open_safetensors(path / SINGLE, lambda f: list(f.keys()))
    return {"metadata": {}, "weight_map": dict.fromkeys(names, SINGLE)}


def _safe_name(path: Path, name: Any) -> str:
    """``name`` if it is a plain file name inside the directory, else :class:`CheckpointError`."""
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise CheckpointError(f"{path}: bad file name {name!r} in the index (files must be in the directory)")
    return name


def _nbytes(meta: dict) -> int:
    n = 1
    for s in meta["shape"]:
        n *= s
    return n * torch.empty((), dtype=getattr(torch, meta["dtype"])).element_size()


def _open_safetensors(path: Path, use: Callable[[Any], Any], checked=None) -> Any:
    """``use(f)`` on ``safe_open`` of ``path``: through the descriptor ``checked`` holds (the file
    whose bytes were verified) or, without one, a regular file opened in place."""
    st = require("safetensors", "safetensors", "reading safetensors checkpoints")
    fd = None
    if checked is None:
        try:
            fd, _ = open_regular(path)
        except FileNotFoundError:
            raise UnsoundCheckpoint(f"{path.name}: missing") from None
    try:
        # /proc/self/fd: safetensors maps the very file that was verified, not what the path
        # names now.
        with st.safe_open(f"/proc/self/fd/{checked.file.fileno() if checked else fd}", framework="pt") as f:
            return use(f)
    except (OSError, ValueError) as e:  # a truncated header, a bad dtype: not safetensors
        raise UnsoundCheckpoint(f"{path.name}: unreadable safetensors ({e})") from None
    finally:
        if fd is not None:
            os.close(fd)


def _checked(path: Path, entry: dict | None):
    if entry is None:
        return None
    opened, problem = open_checked(path / entry["name"], entry)
    if problem:
        raise UnsoundCheckpoint(problem)
    return opened


def _tensors_of(path: Path, name: str, entry: dict | None, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of one file (checked against ``entry``'s size and sha256 first)."""
    opened = _checked(path, entry)
    try:
        got = _open_safetensors(path / name, lambda f: {n: f.get_tensor(n) for n in names}, opened)
        if opened is not None and opened.changed():
            raise UnsoundCheckpoint(f"{name}: changed while being read (something else is writing it)")
    except KeyError as e:
        raise UnsoundCheckpoint(f"{name}: has no tensor {e} that the index names") from None
    finally:
        if opened is not None:
            opened.close()
    return got


def _optimizer_of(path: Path, entry: dict, names: set[str]) -> dict:
    """The optimizer state of ``names`` in one optimizer file (only their tensors are read)."""
    opened = _checked(path, entry)
    try:
        def use(f):
            skeleton = json.loads((f.metadata() or {})["varuna"])
            skeleton["state"] = {n: v for n, v in skeleton.get("state", {}).items() if n in names}
            skeleton["param_groups"] = [
                {**g, "params": [n for n in g.get("params", []) if n in names]}
                for g in skeleton.get("param_groups", []) if any(n in names for n in g.get("params", []))
            ]
            return unflatten(skeleton, f.get_tensor)

        return _open_safetensors(path / entry["name"], use, opened)
    except (KeyError, ValueError) as e:
        raise UnsoundCheckpoint(f"{entry['name']}: malformed optimizer state ({e})") from None
    finally:
        if opened is not None:
            opened.close()


def _read_weights(path: Path, index: dict, request: LoadRequest) -> LoadedShare:
    """Weights only, from a directory ``save_pretrained`` wrote (no checksums to check)."""
    weight_map = index["weight_map"]
    by_file: dict[str, list[str]] = {}
    for n in request.tensors:
        if n in weight_map:
            by_file.setdefault(weight_map[n], []).append(n)
    tensors: dict[str, torch.Tensor] = {}
    for name, names in by_file.items():
        tensors.update(_tensors_of(path, name, None, names))
    check_model_fits(path, {n: list(t.shape) for n, t in tensors.items()}, None, request)
    return LoadedShare(metadata={}, tensors=tensors,
                       optimizer={"class": None, "state": {}, "param_groups": []})


def _config_of(path: Path) -> dict | None:
    try:
        return read_json(path / CONFIG)
    except UnsoundCheckpoint:
        return None


def _verify_files(path: Path, files: list[dict]) -> list[str]:
    problems = []
    for f in files:
        try:
            opened, problem = open_checked(path / f["name"], f)
        except CheckpointError as e:
            opened, problem = None, str(e)
        if opened is not None:
            opened.close()
        if problem:
            problems.append(problem)
    return problems
