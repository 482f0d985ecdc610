"""A throw-away checkpoint format, registered from this one module (tests/test_seams_checkpoint_format.py).

It lays a checkpoint out unlike the ``varuna`` format, to show that a format is a module of its
own: one file per (stage, replica) instead of per segment, tensors and optimizer state in one
``torch.save`` dict per file, and ``toy-index.json`` (name -> file, shapes, sizes, the run's
metadata) as its commit file. Import it (or name it in ``$VARUNA_CHECKPOINT_FORMAT_MODULES``) and
set ``VarunaConfig.checkpoint_format="toy"`` / ``$VARUNA_CHECKPOINT_FORMAT=toy``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from varuna.runtime.checkpoint_files import JSON_MAX_BYTES, atomic_write, read_regular, save_hashed
from varuna.runtime.checkpoint_format import (
    CheckpointFormat,
    LoadedShare,
    LoadRequest,
    Shard,
    StateLayout,
    StateShare,
    UnsoundCheckpoint,
    as_saved,
    check_model_fits,
)
from varuna.runtime.checkpoint_registry import register_format
from varuna.runtime.optimizer_state import merge_optimizer_states

INDEX = "toy-index.json"


@register_format
class ToyFormat(CheckpointFormat):
    name = "toy"
    commit_file = INDEX

    def plan(self, layout: StateLayout) -> list[Shard]:
        shards = []
        for stage in range(layout.pipeline_depth):
            names = sorted(layout.held_by(stage))
            for replica in range(layout.data_parallel):  # round robin: each replica a disjoint part
                mine = tuple(names[replica :: layout.data_parallel])
                if mine:
                    nbytes = sum(layout.tensor_bytes.get(n, 0) for n in mine)
                    shards.append(Shard(name=f"part-s{stage}-r{replica}.pt", stage=stage, replica=replica,
                                        params=mine, nbytes=nbytes))
        return shards

    def write(self, shard: Shard, share: StateShare, path: Path) -> dict:
        nbytes, sha = save_hashed(as_saved({"tensors": share.tensors, "optimizer": share.optimizer}), path)
        shapes = {n: list(t.shape) for n, t in share.tensors.items()}
        return {"name": shard.name, "bytes": nbytes, "sha256": sha, "shapes": shapes}

    def commit(self, target: Path, records: list[dict], metadata: dict, layout: StateLayout, *,
               before_replace: Callable[[], None]) -> None:
        index = {
            "format": "toy",
            "metadata": metadata,
            "weight_map": {n: r["name"] for r in records for n in r["shapes"]},
            "shapes": {n: s for r in records for n, s in r["shapes"].items()},
            "files": {r["name"]: {"bytes": r["bytes"], "sha256": r["sha256"]} for r in records},
        }
        atomic_write(target / INDEX, json.dumps(index).encode(), before_replace=before_replace)

    def _index(self, path: Path) -> dict:
        try:
            index = json.loads(read_regular(path / INDEX, JSON_MAX_BYTES))
        except (OSError, ValueError) as e:
            raise UnsoundCheckpoint(f"{path / INDEX}: unreadable ({e})") from None
        if index.get("format") != "toy":
            raise UnsoundCheckpoint(f"{path / INDEX}: not a toy index")
        return index

    def read(self, path: Path, request: LoadRequest) -> LoadedShare:
        index = self._index(path)
        check_model_fits(path, index["shapes"], index["metadata"].get("optimizer"), request)
        tensors: dict[str, torch.Tensor] = {}
        opts = []
        for name in sorted({index["weight_map"][n] for n in request.tensors}):
            problems = self._check(path, name, index["files"][name])
            if problems:
                raise UnsoundCheckpoint(problems)
            part = torch.load(path / name, map_location="cpu", weights_only=True)
            tensors.update({n: t for n, t in part["tensors"].items() if n in request.tensors})
            opts.append(part["optimizer"])
        optimizer = merge_optimizer_states(opts)
        return LoadedShare(metadata=index["metadata"], tensors=tensors, optimizer=optimizer)

    def verify(self, path: Path) -> list[str]:
        try:
            index = self._index(path)
        except UnsoundCheckpoint as e:
            return [str(e)]
        return [p for name, entry in index["files"].items() if (p := self._check(path, name, entry))]

    @staticmethod
    def _check(path: Path, name: str, entry: dict) -> str:
        f = path / name
        if not f.is_file():
            return f"{name}: missing"
        size = f.stat().st_size
        return "" if size == entry["bytes"] else f"{name}: {size} bytes, the index says {entry['bytes']}"
