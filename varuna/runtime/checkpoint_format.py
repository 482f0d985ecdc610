"""The checkpoint-format seam: what one on-disk layout must do, and the state it is handed.

Note [Checkpoint formats]: a save and a load are split between two owners.

- The **checkpointer** (:class:`~varuna.runtime.checkpoint.Checkpointer`) owns *when* and *with
  whom*: scheduling (every N steps, on a graceful stop), agreement across ranks (one save id, one
  verdict per checkpoint on load), the host snapshot or not (Note [Snapshot to disk] in
  checkpoint_writer.py), local staging, the background copy to the global store, the writers'
  markers, and pruning. It names the step directory (``<root>/step_NNNNNNNN``).
- The **format** (a :class:`CheckpointFormat`) owns *what is inside* a step directory: which
  files exist and who writes each (:meth:`~CheckpointFormat.plan`, the same on every rank), how
  tensors are named and serialised (:meth:`~CheckpointFormat.write`, one file at a time, to local
  staging), the commit file whose atomic appearance makes the checkpoint exist
  (:meth:`~CheckpointFormat.commit`, rank 0, once every file is in the store), how a directory is
  recognised as its own and complete (:attr:`~CheckpointFormat.commit_file`), verified without
  unpickling (:meth:`~CheckpointFormat.verify`), and read back for one stage
  (:meth:`~CheckpointFormat.read`).

The format never sees the engine: it is handed a :class:`StateLayout` (where every tensor lives,
identical on every rank), one :class:`StateShare` per file it planned for this rank (name-keyed
tensors and their name-keyed optimizer state, host copies or the live tensors), the run's small
JSON-able ``metadata`` (step, loss scale, the saving run's P×D...), and on load a
:class:`LoadRequest` (the names and shapes this rank needs); it returns a :class:`LoadedShare`.
So every guarantee of docs/checkpoints.md holds for any format that keeps four rules: ``write``
writes only the path it is given, ``commit`` writes its commit file last and atomically
(:func:`~varuna.runtime.checkpoint_files.atomic_write`), ``read`` never unpickles anything but
tensors and plain containers, and ``read`` raises :class:`UnsoundCheckpoint` for what a crash
leaves (skip to an older one) and :class:`CheckpointError` for what only tampering or another
model makes (refuse).

Whole state (issue 29, Note [Whole state] in whole_state.py) fits the same shapes: persistent
buffers are more name-keyed tensors of a stage (:attr:`StateLayout.tensor_segments` lists them,
:attr:`StateLayout.buffers` says which, each written by one replica, and a reader may lack them:
:attr:`LoadRequest.optional`); the small rest (the data position, the LR scheduler, registered
objects, optimizer state outside ``state[param]`` per stage) rides in ``metadata`` as JSON.

Resume considers every registered format (:func:`~varuna.runtime.checkpoint_registry.format_of`),
newest step first, whatever format the run writes: a run that switched formats resumes from its
newest state, never silently from an older one.

Example (a format is one module; see docs/checkpoints.md "Formats")::

    @register_format
    class MyFormat(CheckpointFormat):
        name = "mine"
        commit_file = "index.json"
        ...
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from varuna.runtime.checkpoint_files import CheckpointError, UnsoundCheckpoint
from varuna.runtime.checkpoint_shards import Shard

__all__ = [
    "CheckpointError",
    "CheckpointFormat",
    "LoadRequest",
    "LoadedShare",
    "Shard",
    "StateLayout",
    "StateShare",
    "UnsoundCheckpoint",
    "as_saved",
    "check_model_fits",
    "snapshot",
    "tensor_meta",
    "tensor_table",
]


@dataclass(frozen=True, kw_only=True)
class StateLayout:
    """Where the training state lives across the ranks (identical on every rank): what a format
    plans its files from.

    >>> lay = StateLayout(tensor_segments={"w": (0,), "v": (1, 2)}, tensor_bytes={"w": 4, "v": 8},
    ...                   stage_ranges=[(0, 0), (1, 2)], pipeline_depth=2, data_parallel=1)
    >>> lay.holder("v"), sorted(lay.held_by(0))
    (1, ['w'])
    """

    tensor_segments: Mapping[str, tuple[int, ...]]
    """Every saved tensor by canonical name: the segments that read it, sorted (the first one
    holds it: a tied embedding is held by the earliest stage that reads it)."""
    tensor_bytes: Mapping[str, int]
    stage_ranges: Sequence[tuple[int, int]]
    """Segment ranges of the (virtual) stages; with interleaving, virtual stage j runs on
    process ``j % pipeline_depth``."""
    pipeline_depth: int
    data_parallel: int
    buffers: frozenset[str] = frozenset()
    """The names in :attr:`tensor_segments` that are persistent buffers, not parameters (they have
    no optimizer state; Note [Buffers across replicas] in varuna/runtime/buffers.py)."""

    def holder(self, name: str) -> int:
        """The pipeline stage (process) whose replicas hold ``name`` and write it."""
        first = self.tensor_segments[name][0]
        for j, (a, b) in enumerate(self.stage_ranges):
            if a <= first <= b:
                return j % self.pipeline_depth
        raise ValueError(f"segment {first} of {name!r} is in no stage range {list(self.stage_ranges)}")

    def held_by(self, stage: int) -> list[str]:
        """The names stage ``stage`` writes, in the layout's order."""
        return [n for n in self.tensor_segments if self.holder(n) == stage]


@dataclass(kw_only=True)
class StateShare:
    """What one file of a checkpoint holds: the format's :meth:`~CheckpointFormat.write` serialises it.

    The tensors are host snapshots, or the live tensors when the save takes no snapshot (then the
    write happens before training changes them: Note [Snapshot to disk]); either way, read them
    only. A view or a device tensor: :func:`as_saved` gives what can be written without a copy."""

    step: int
    rank: int
    """The rank writing it."""
    tensors: dict[str, torch.Tensor]
    """This file's tensors by canonical name (the stage's parameters and buffers the plan put in it)."""
    optimizer: dict
    """Their name-keyed optimizer state (:func:`~varuna.runtime.optimizer_state.optimizer_state_by_name`):
    ``{"class", "state": {name: {key: value}}, "param_groups": [{hyper..., "params": [names]}]}``;
    2bw's stashed weight version rides in ``state`` (Note [2BW])."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Named state dicts (plain containers and tensors) a format stores in the file; a reader gets
    them back in :attr:`LoadedShare.extra`. The checkpointer puts none here: the state beyond
    tensors (registered objects, the LR scheduler, per-stage optimizer state) is small and goes in
    the ``metadata`` every rank reads (Note [Registered state] in extra_state.py: a stage at a new
    P×D needs the state of the *old* stage that held its first segment, whose files it may not
    read)."""


@dataclass(frozen=True, kw_only=True)
class LoadRequest:
    """What one rank asks a format to read: its stage's tensors (names, shapes, dtypes; never
    written to) and the optimizer class it will load the state into."""

    tensors: Mapping[str, torch.Tensor]
    optimizer_class: str | None
    """None: no optimizer state is wanted (weights only: ``CheckpointConfig.init_from``, an export)."""
    optional: frozenset[str] = frozenset()
    """Names of :attr:`tensors` a checkpoint may lack (buffers: checkpoints written before they
    were saved); a format leaves them out of :attr:`LoadedShare.tensors` instead of refusing."""

    @property
    def weights_only(self) -> bool:
        return self.optimizer_class is None


@dataclass(kw_only=True)
class LoadedShare:
    """What a format read for one rank: every requested tensor, their optimizer state, and the
    metadata saved with the checkpoint (``step``, ``loss_scale``, ``config``...)."""

    metadata: dict
    tensors: dict[str, torch.Tensor]
    optimizer: dict
    """Name-keyed, merged over the files read (``{"class", "state", "param_groups"}``)."""
    extra: dict[str, Any] = field(default_factory=dict)


class CheckpointFormat(ABC):
    """One on-disk layout of a checkpoint (Note [Checkpoint formats]).

    A subclass sets :attr:`name` (what ``VarunaConfig.checkpoint_format`` names) and
    :attr:`commit_file`, implements the five abstract methods and registers itself with
    :func:`~varuna.runtime.checkpoint_registry.register_format`. Instances hold no state: the
    registry makes one per use.
    """

    name: ClassVar[str]
    """The registry's key, e.g. ``"varuna"``."""
    commit_file: ClassVar[str]
    """The file written last and atomically by :meth:`commit`: a step directory holding it is a
    complete checkpoint of this format; without it, there is none."""

    @abstractmethod
    def plan(self, layout: StateLayout) -> list[Shard]:
        """Every file of a checkpoint, with the (stage, replica) that writes it and the tensor names
        it holds. A pure function: every rank computes the same plan. Each name is in exactly one
        file, written by a replica of the stage that holds it (:meth:`StateLayout.holder`)."""

    @abstractmethod
    def write(self, shard: Shard, share: StateShare, path: Path) -> dict:
        """Serialise one planned file to ``path`` (local staging; the checkpointer copies it into
        the step directory under ``shard.name``). Returns its record, JSON-able, with at least
        ``name`` and ``bytes``; :meth:`commit` gets every writer's records."""

    @abstractmethod
    def commit(
        self,
        target: Path,
        records: list[dict],
        metadata: dict,
        layout: StateLayout,
        *,
        before_replace: Callable[[], None],
    ) -> None:
        """Rank 0, once every planned file is fsynced in ``target``: write :attr:`commit_file`
        atomically (call ``before_replace`` between its temporary file and the rename: a test
        hook). Raise :class:`CheckpointError` when the records do not make a checkpoint."""

    @abstractmethod
    def read(self, path: Path, request: LoadRequest) -> LoadedShare:
        """Read what ``request`` needs from a complete checkpoint of this format, checked.

        Raise :class:`UnsoundCheckpoint` for a missing, truncated, altered or unreadable file (the
        checkpoint is skipped), :class:`CheckpointError` for a file that is not one this format
        writes (a link, pickled code) or a checkpoint of another model (the load is refused):
        :func:`check_model_fits` does the second for a table of saved shapes."""

    @abstractmethod
    def verify(self, path: Path) -> list[str]:
        """Problems with a step directory of this format, without unpickling; empty when sound."""

    def describe(self, path: Path) -> tuple[dict[str, dict], dict]:
        """Every saved tensor (name -> ``{"shape", "dtype", "segments"}``, ``"buffer": True`` for
        buffers) and the checkpoint's metadata: what ``varuna-checkpoint export`` needs to plan a
        conversion. Optional: the default refuses."""
        raise CheckpointError(f"checkpoint format {self.name!r} cannot describe its tensors (no export)")

    def is_complete(self, path: Path) -> bool:
        """Whether ``path`` holds a committed checkpoint of this format."""
        return (path / self.commit_file).is_file()

    def uncommit(self, path: Path) -> None:
        """Make ``path`` incomplete (before deleting it or overwriting its files): readers racing
        with us then skip it rather than find missing files."""
        (path / self.commit_file).unlink(missing_ok=True)


def check_model_fits(
    path: Path,
    saved_shapes: Mapping[str, Sequence[int]],
    saved_optimizer: str | None,
    request: LoadRequest,
) -> None:
    """Refuse (:class:`CheckpointError`, one line) a checkpoint of another model: one without a
    requested name, with another shape, or with another optimizer class's state.

    >>> req = LoadRequest(tensors={"w": torch.zeros(2)}, optimizer_class="SGD")
    >>> check_model_fits(Path("ck"), {"w": [2]}, "SGD", req)
    >>> check_model_fits(Path("ck"), {"w": [3]}, "SGD", req)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    varuna...CheckpointError: checkpoint ck: parameter 'w' has shape (3,), the model's is (2,): ...
    """
    missing = [n for n in request.tensors if n not in saved_shapes and n not in request.optional]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} has no parameter {missing[0]!r} (and {len(missing) - 1} "
            "more) of this model: it was saved from a different model"
        )
    for n, p in request.tensors.items():
        if n not in saved_shapes:
            continue
        shape = list(saved_shapes[n])
        if shape != list(p.shape):
            raise CheckpointError(
                f"checkpoint {path}: parameter {n!r} has shape {tuple(shape)}, the model's "
                f"is {tuple(p.shape)}: it was saved from another model configuration"
            )
    if saved_optimizer and request.optimizer_class and saved_optimizer != request.optimizer_class:
        raise CheckpointError(
            f"checkpoint {path} holds {saved_optimizer} state but the engine's optimizer is "
            f"{request.optimizer_class}; build the optimizer the saving run used"
        )


def tensor_table(records: Sequence[dict], layout: StateLayout) -> dict[str, dict]:
    """name -> ``{"shape", "dtype", "segments", "file"}`` (and ``"buffer": True``) of every tensor
    the writers' ``records`` hold (each record's ``tensors``: name -> shape and dtype), checked to
    cover the layout: what a commit file lists so that a reader finds a tensor's file.

    >>> lay = StateLayout(tensor_segments={"w": (0,)}, tensor_bytes={}, stage_ranges=[(0, 0)],
    ...                   pipeline_depth=1, data_parallel=1)
    >>> tensor_table([{"name": "f", "tensors": {"w": {"shape": [2], "dtype": "float32"}}}], lay)
    {'w': {'shape': [2], 'dtype': 'float32', 'segments': [0], 'file': 'f'}}
    """
    table: dict[str, dict] = {}
    for r in records:
        for n, meta in r.get("tensors", {}).items():
            kind = {"buffer": True} if n in layout.buffers else {}
            segments = list(layout.tensor_segments.get(n, []))
            table[n] = {**meta, "segments": segments, "file": r["name"], **kind}
    missing = set(layout.tensor_segments) - set(table)
    if missing:
        raise CheckpointError(f"no file holds tensor(s) {sorted(missing)[:5]}")
    return table


def tensor_meta(t: torch.Tensor) -> dict:
    """``{"shape", "dtype"}`` of a tensor, JSON-able (what :func:`tensor_table` records)."""
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


# ---------------------------------------------------------------------------------------------
# Tensors as a writer takes them


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


def detached(x: Any) -> Any:
    """``x`` with every tensor detached (the live storage: no copy)."""
    return _map_tensors(torch.Tensor.detach, x)


def as_saved(x: Any) -> Any:
    """``x``'s tensors as ``torch.save`` (or any serialiser) can write them without a copy: the
    live tensor when it is a compact host tensor (its whole storage), else a compact host copy
    (torch.save would write a view's whole storage; a device tensor must come to the host). A
    format applies it to one file's share at a time, so a save without a snapshot copies at most
    one file's worth (and nothing for compact host tensors).

    >>> w = torch.zeros(4, 4)
    >>> as_saved(w).data_ptr() == w.data_ptr(), as_saved(w[1]).untyped_storage().nbytes()
    (True, 16)
    """
    return _map_tensors(_saveable, x)
