"""Which file of a checkpoint holds which parameters, and which rank writes it: the plan of the
``varuna`` format (checkpoint_manifest.py), and :class:`Shard`, the file plan of every format
(Note [Checkpoint formats] in checkpoint_format.py). Pure Python: every rank computes the same plan.

Example::

    >>> plan = plan_shards(param_segments={"w": (0,)}, param_bytes={"w": 4}, stage_ranges=[(0, 0)],
    ...                    data_parallel=1)
    >>> plan[0].name, plan[0].params
    ('seg000-00.pt', ('w',))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Shard", "plan_shards"]


@dataclass(frozen=True, kw_only=True)
class Shard:
    """One file of a checkpoint's plan (any format's): some tensors of one stage, written by one
    replica of it."""

    name: str
    """File name inside the step directory, e.g. ``seg003-00.pt``."""
    stage: int
    """The pipeline stage (process) holding the segment; with interleaving, not the virtual stage."""
    replica: int
    """Which of the stage's D replicas writes it (all replicas hold identical state)."""
    params: tuple[str, ...]
    """Canonical names of the parameters (and buffers) it holds (with their optimizer state)."""
    nbytes: int
    """Parameter bytes (the optimizer state is usually proportional)."""
    segment: int | None = None
    """The model segment whose parameters it holds, for a format that splits by segment
    (:func:`plan_shards`, the ``varuna`` format's plan); None for others."""
    holds: str = "all"
    """What of :attr:`params` the file holds: ``"all"`` (the tensors and their optimizer state),
    ``"tensors"`` or ``"optimizer"`` (a format that keeps them in separate files: ``hf``); the
    checkpointer snapshots only that."""


def plan_shards(
    *,
    param_segments: Mapping[str, Sequence[int]],
    param_bytes: Mapping[str, int],
    stage_ranges: Sequence[tuple[int, int]],
    data_parallel: int,
    pipeline_depth: int | None = None,
) -> list[Shard]:
    """Split a checkpoint into files and assign each to one replica of one stage.

    A parameter belongs to the first segment that reads it (a tied embedding is saved once, by
    segment 0). Each segment's parameters make one file, plus one for those other segments also
    read (so the last stage loads the tied embedding without segment 0's blocks). While a stage
    has fewer files than replicas, its largest multi-parameter file is cut in two (by bytes);
    then files go to replicas largest first, each to the least loaded one — so every replica
    writes a disjoint, non-empty part whenever the stage has at least D files. Pure function:
    every rank computes the same plan.

    Interleaved runs (``pipeline_depth`` P < ``len(stage_ranges)``): the ranges are virtual
    stages and virtual stage j runs on process j % P, so a process's files are those of all its
    (non-contiguous) segments and :attr:`Shard.stage` is the process, not the virtual stage.

    >>> plan = plan_shards(param_segments={"a": (0,), "b": (1,), "c": (2,), "d": (3,)}, param_bytes={},
    ...                    stage_ranges=[(0, 0), (1, 1), (2, 2), (3, 3)], data_parallel=1, pipeline_depth=2)
    >>> [(s.name, s.stage) for s in plan]
    [('seg000-00.pt', 0), ('seg002-00.pt', 0), ('seg001-00.pt', 1), ('seg003-00.pt', 1)]

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

    P = len(stage_ranges) if pipeline_depth is None else pipeline_depth
    if P < 1 or len(stage_ranges) % P:
        raise ValueError(f"{len(stage_ranges)} stage ranges are not chunks of pipeline depth {P}")
    shards: list[Shard] = []
    for stage in range(P):
        groups: list[tuple[int, list[str]]] = []
        for s in (s for first, last in stage_ranges[stage::P] for s in range(first, last + 1)):
            for names in (private.get(s), shared.get(s)):
                if names:
                    groups.append((s, names))
        _split_for_replicas(groups, D, param_bytes)
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
            shards.append(
                Shard(
                    name=f"seg{s:03d}-{j:02d}.pt",
                    segment=s,
                    stage=stage,
                    replica=owner[i],
                    params=tuple(names),
                    nbytes=size(names),
                )
            )
    return shards


def _split_for_replicas(groups: list[tuple[int, list[str]]], D: int, param_bytes: Mapping[str, int]) -> None:
    """While a stage has fewer files than replicas, cut its largest multi-parameter file in two
    (by bytes), in place."""
    while len(groups) < D:
        splittable = [i for i, (_, names) in enumerate(groups) if len(names) > 1]
        if not splittable:
            break  # fewer parameters than replicas: some replicas write nothing
        i = max(splittable, key=lambda i: (sum(param_bytes.get(n, 0) for n in groups[i][1]), -i))
        s, names = groups[i]
        cut = _balanced_cut([param_bytes.get(n, 0) for n in names])
        groups[i : i + 1] = [(s, names[:cut]), (s, names[cut:])]


def _balanced_cut(sizes: list[int]) -> int:
    """Index 1..len-1 that splits ``sizes`` into two runs of most nearly equal sums."""
    total, run, best, best_gap = sum(sizes), 0, 1, None
    for k in range(1, len(sizes)):
        run += sizes[k - 1]
        gap = abs(total - 2 * run)
        if best_gap is None or gap < best_gap:
            best, best_gap = k, gap
    return best
