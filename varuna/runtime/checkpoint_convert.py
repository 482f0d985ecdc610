"""Checkpoints in and out of varuna without an engine: converting a step directory from one format
to another (``varuna-checkpoint export``), and finding the format that reads a directory's weights
(``CheckpointConfig.init_from``: a varuna checkpoint of any format, or a Hugging Face model directory,
or a DCP checkpoint another tool wrote).

A conversion plans the destination's files with the source's layout (its stage split, one writer)
and fills them one file at a time: each file's tensors are read from the source through its
format (only the files holding them), written, and dropped, so converting needs about one
segment's state in memory, never the whole model. The destination's commit file comes last, as in
a save.

Example::

    export_checkpoint("/mnt/ckpt", "/mnt/hf-model", to="hf")        # the newest complete checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained("/mnt/hf-model")
"""

from __future__ import annotations

from pathlib import Path

import torch

from varuna.runtime.checkpoint_dcp import DCPFormat
from varuna.runtime.checkpoint_files import CheckpointError
from varuna.runtime.checkpoint_format import CheckpointFormat, LoadRequest, StateLayout, StateShare
from varuna.runtime.checkpoint_hf import INDEX, SINGLE, HFFormat
from varuna.runtime.checkpoint_registry import checkpoint_format, format_of
from varuna.runtime.checkpoint_store import list_checkpoints

__all__ = ["export_checkpoint", "resolve_step_dir", "weights_format"]


def resolve_step_dir(path: str | Path) -> Path:
    """``path`` itself when it is a complete checkpoint, else the newest complete checkpoint under
    it (a checkpoint root); ``ValueError`` (one line) when there is none."""
    path = Path(path)
    if format_of(path) is not None:
        return path
    done = [c for c in list_checkpoints(path) if c.complete]
    if not done:
        raise ValueError(f"{path}: no complete checkpoint here (neither a step directory with a commit file "
                         "nor a checkpoint root with one)")
    return done[-1].path


def weights_format(path: str | Path) -> CheckpointFormat:
    """The format that reads the weights in ``path``: its registered format when it is a complete
    checkpoint; ``hf`` for a Hugging Face model directory (``model.safetensors`` or its sharded
    index); ``dcp`` for a DCP checkpoint (``.metadata``). ``ValueError`` (one line) otherwise."""
    path = Path(path)
    fmt = format_of(path)
    if fmt is not None:
        return fmt
    if (path / INDEX).is_file() or (path / SINGLE).is_file():
        return HFFormat()
    if (path / DCPFormat.commit_file).is_file():
        return DCPFormat()
    raise ValueError(f"init_from {path}: no checkpoint of a registered format, no Hugging Face model "
                     f"({SINGLE} or {INDEX}) and no DCP checkpoint (.metadata) there")


def _layout(table: dict[str, dict], metadata: dict) -> StateLayout:
    cfg = metadata.get("config", {})
    ranges = [tuple(r) for r in cfg.get("stage_ranges") or []]
    segments = sorted({s for m in table.values() for s in m["segments"]})
    if not ranges:
        ranges = [(0, max(segments, default=0))]
    P = int(cfg.get("P") or len(ranges))
    return StateLayout(
        tensor_segments={n: tuple(m["segments"]) for n, m in table.items()},
        tensor_bytes={n: _nbytes(m) for n, m in table.items()},
        stage_ranges=ranges, pipeline_depth=P, data_parallel=1,
        buffers=frozenset(n for n, m in table.items() if m.get("buffer")),
    )


def _nbytes(meta: dict) -> int:
    n = 1
    for s in meta["shape"]:
        n *= int(s)
    return n * torch.empty((), dtype=getattr(torch, meta["dtype"])).element_size()


def _meta_tensor(meta: dict) -> torch.Tensor:
    return torch.empty([int(s) for s in meta["shape"]], dtype=getattr(torch, meta["dtype"]), device="meta")


def export_checkpoint(src: str | Path, dst: str | Path, *, to: str, weights_only: bool = False) -> Path:
    """Convert checkpoint ``src`` (a step directory, or a root: its newest complete one) into
    format ``to`` in the new directory ``dst``; returns the step directory converted. With
    ``weights_only`` the optimizer state is left out (and the result cannot be resumed from,
    only started from: ``CheckpointConfig.init_from``)."""
    source = resolve_step_dir(src)
    fmt_in, fmt_out = format_of(source), checkpoint_format(to)
    assert fmt_in is not None
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst} exists and is not an empty directory; name a new one")
    table, metadata = fmt_in.describe(source)
    layout = _layout(table, metadata)
    plan = [s for s in fmt_out.plan(layout) if not (weights_only and s.holds == "optimizer")]
    optimizer = None if weights_only else metadata.get("optimizer") or None
    dst.mkdir(parents=True, exist_ok=True)
    records = []
    for shard in plan:
        wants_state = shard.holds != "tensors" and optimizer is not None
        request = LoadRequest(tensors={n: _meta_tensor(table[n]) for n in shard.params},
                              optimizer_class=optimizer if wants_state else None)
        loaded = fmt_in.read(source, request)
        tensors = loaded.tensors if shard.holds != "optimizer" else {}
        opt = loaded.optimizer if wants_state else {"class": optimizer, "state": {}, "param_groups": []}
        share = StateShare(step=int(metadata.get("step", 0)), rank=0, tensors=tensors, optimizer=opt)
        records.append(fmt_out.write(shard, share, dst / shard.name))
        del loaded, share  # one file's state at a time
    meta = {**metadata, **({"weights_only": True} if weights_only else {})}
    fmt_out.commit(dst, records, meta, layout, before_replace=lambda: None)
    return source


def check_resumable(path: Path, metadata: dict) -> None:
    """Refuse to resume from a weights-only export (its optimizer state is not there)."""
    if metadata.get("weights_only"):
        raise CheckpointError(f"{path} was exported with --weights-only (no optimizer state): start from "
                              "its weights with CheckpointConfig.init_from, or move it out of the checkpoint "
                              "directory")
