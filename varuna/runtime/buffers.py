"""Module buffers in the training state: which ones a stage holds, and how its replicas keep them
equal and the same as one process would (issue 29).

Note [Buffers across replicas]: a stage holds the *persistent* buffers (what ``state_dict``
holds besides parameters; ``persistent=False`` ones are rebuilt by the constructor and stay out)
that its segments read or write in the dry run (``ModelProfile.buffer_segments``). They are saved
in every checkpoint by the replica the format's plan names, sent peer to peer in a live morph,
and loaded at any P×D, so the D replicas of a stage must hold the same values, and those values
should be the ones one process (1×1) would have. Two rules make that so:

- **Running statistics of BatchNorm** (every ``torch.nn.modules.batchnorm._BatchNorm`` that tracks
  them) are updated per micro-batch, in order: under 1×1, micro-batch 0 then 1 ... then N-1 of
  the mini-batch, each one's mean and unbiased variance mixed in with the momentum. At P×D a
  replica sees only its share of the micro-batches (the micro-batches themselves never change:
  ``varuna/core/batching.py``), and a recomputing stage runs each forward twice; left to the
  module, each replica's statistics would be its own (DDP's problem: it broadcasts rank 0's) and
  a recompute would count a micro-batch twice. So in training mode the module's own update is
  turned off around each forward (its output uses the batch's statistics either way, bit for bit
  the same), :class:`RunningStats` records each micro-batch's mean and unbiased variance keyed by
  its global index (a recompute writes the same values again), the stage's replicas exchange
  them at the end of the step (one all-gather over the stage's data-parallel group), and every
  replica applies all N updates in micro-batch order, as one process would. Each micro-batch's
  statistics are computed from that micro-batch's input, which deterministic mode makes bitwise
  the same at any P×D, and the updates are the same operations in the same order, so the
  buffers are **bit-identical to 1×1's at any P×D, across checkpoints and morphs** (averaging the
  replicas' statistics at checkpoints would give neither: a mean of two exponential averages is
  not the average of the sequence). The values differ from eager torch's own update by rounding
  only (torch's kernel mixes in the same numbers; varuna does it with ``mul_``/``add_``). A step
  that is skipped (overflow, non-finite loss) leaves the statistics as they were, like the
  weights. Cost: one extra reduction over each BatchNorm input (what the module computes anyway)
  and, per step, one all-gather of 2·C floats per BatchNorm per micro-batch.
- **Any other persistent buffer** a model changes while training (a counter, an EMA in a custom
  module) cannot be merged without knowing what it means: replica 0's value wins, as under DDP's
  ``broadcast_buffers``. At the end of a step every replica checks whether the buffer changed
  (its tensor's in-place version counter, or the module assigned a new tensor), one tiny all-reduce
  agrees, and replica 0's changed buffers are broadcast to the others; buffers that training never
  changes (masks, position ids) cost nothing. Such buffers are equal across replicas but, unlike
  BatchNorm's, in general not equal to 1×1's.

Both rules exchange *before* the step commits and write the buffers only once the optimizer
step has run (``commit``), so a step that fails half way (a lost peer in a live morph) and is
redone never counts a micro-batch twice.

Example (the engine does this; ``keeper.current`` is set by the executor per micro-batch)::

    keeper = BufferKeeper(model, stage_names, groups=groups, replica=0, micro_plan=plan)
    ...                                         # the step's forwards record statistics
    pending = keeper.exchange(step)             # before the optimizer step (collectives)
    keeper.commit(pending, skipped=False)       # after it: the buffers change here
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from varuna.core.batching import MicroBatch
from varuna.cutting.split import ModelProfile

__all__ = ["BufferKeeper", "PendingBuffers", "RunningStats", "stage_buffer_names"]

#: The buffers a BatchNorm's running statistics consist of (the rule of :class:`RunningStats`).
_STATS = ("running_mean", "running_var", "num_batches_tracked")


def stage_buffer_names(profile: ModelProfile, segments: Sequence[int]) -> list[str]:
    """The persistent buffers a stage of ``segments`` holds (Note [Buffers across replicas]).

    >>> from varuna.cutting.split import ModelProfile
    >>> prof = ModelProfile([], {}, [], [], [], "s", buffer_segments={"bn.running_mean": (1,)})
    >>> stage_buffer_names(prof, [0]), stage_buffer_names(prof, [1, 2])
    ([], ['bn.running_mean'])
    """
    segs = set(segments)
    return [n for n, s in profile.buffer_segments.items() if segs.intersection(s)]


@dataclass
class PendingBuffers:
    """What :meth:`BufferKeeper.exchange` agreed on, for :meth:`BufferKeeper.commit`."""

    stats: list[torch.Tensor] = field(default_factory=list)
    """Every micro-batch's statistics rows, in the order one process would apply them."""
    replica0: dict[str, torch.Tensor] = field(default_factory=dict)
    """Other buffers that changed this step: replica 0's values."""


class RunningStats:
    """BatchNorm running statistics, updated per micro-batch in micro-batch order on every replica
    (Note [Buffers across replicas]). ``modules``: the stage's BatchNorm modules by name."""

    def __init__(self, modules: Mapping[str, _BatchNorm]) -> None:
        self.modules = dict(sorted(modules.items()))
        self.current: tuple[int, int] | None = None
        """(step, global micro-batch index) of the forward running now (set by the executor)."""
        self.rows: dict[tuple[int, int], torch.Tensor] = {}
        self._parts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._widths = [2 * m.num_features + 1 for m in self.modules.values()]
        self._handles = []
        for name, m in self.modules.items():
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._make_post(name), always_call=True))

    @property
    def width(self) -> int:
        """Floats per micro-batch row: per module a presence flag, C means, C variances."""
        return sum(self._widths)

    def close(self) -> None:
        """Remove the hooks (the module updates its statistics itself again)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, module: _BatchNorm, args) -> None:
        if module.training and module.track_running_stats:
            module.track_running_stats = False  # the forward uses the batch's statistics only
            module._varuna_held = True

    def _make_post(self, name: str):
        def post(module: _BatchNorm, args, out) -> None:
            if not getattr(module, "_varuna_held", False):
                return
            module.track_running_stats = True
            module._varuna_held = False
            if self.current is None or not args or not isinstance(args[0], torch.Tensor):
                return
            x = args[0].detach()
            ref = module.running_mean
            with torch.no_grad():
                dims = [0, *range(2, x.dim())]
                var, mean = torch.var_mean(x.to(ref.dtype), dim=dims, correction=1)
            # A recompute of the micro-batch writes the same values again (keyed by its index).
            self._parts.setdefault(self.current, {})[name] = torch.cat([mean, var])

        return post

    def take_rows(self, keys: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
        """The recorded statistics of ``keys`` as one [len(keys), width] tensor (the presence flag 0
        where a module did not run for a micro-batch), and forget them."""
        out = torch.zeros(len(keys), self.width, dtype=torch.float64, device=device)
        for i, key in enumerate(keys):
            parts = self._parts.pop(key, {})
            col = 0
            for (name, _m), w in zip(self.modules.items(), self._widths):
                if name in parts:
                    out[i, col] = 1.0
                    out[i, col + 1 : col + w] = parts[name].to(torch.float64)
                col += w
        return out

    def forget(self, step: int) -> None:
        """Drop what was recorded for ``step`` (a step being redone records it again)."""
        for key in [k for k in self._parts if k[0] == step]:
            del self._parts[key]

    @torch.no_grad()
    def apply(self, rows: torch.Tensor) -> None:
        """Mix each row's statistics in, in row order, as the module's own update would."""
        for row in rows:
            col = 0
            for m, w in zip(self.modules.values(), self._widths):
                if row[col] > 0:
                    c = m.num_features
                    mean = row[col + 1 : col + 1 + c].to(m.running_mean.dtype)
                    var = row[col + 1 + c : col + w].to(m.running_var.dtype)
                    if m.num_batches_tracked is not None:
                        m.num_batches_tracked.add_(1)
                    f = m.momentum if m.momentum is not None else 1.0 / float(m.num_batches_tracked)
                    m.running_mean.mul_(1.0 - f).add_(mean, alpha=f)
                    m.running_var.mul_(1.0 - f).add_(var, alpha=f)
                col += w


class BufferKeeper:
    """A stage's persistent buffers and the rules that keep its replicas' copies equal (Note
    [Buffers across replicas]). ``names``: the stage's buffers (:func:`stage_buffer_names`);
    ``groups``: the engine's process groups (its ``dp_group`` is read when needed); ``micro_plan``:
    every replica's micro-batches."""

    def __init__(
        self,
        model: nn.Module,
        names: Sequence[str],
        *,
        groups,
        layout,
        micro_plan: Sequence[Sequence[MicroBatch]],
    ) -> None:
        self.names = list(names)
        self._where: dict[str, tuple[nn.Module, str]] = {}
        mods = dict(model.named_modules())
        for n in self.names:
            mname, _, attr = n.rpartition(".")
            self._where[n] = (mods[mname], attr)
        bn = {}
        for n in self.names:
            mod, attr = self._where[n]
            if isinstance(mod, _BatchNorm) and attr in _STATS and mod.track_running_stats \
                    and mod.running_mean is not None:
                bn[n.rpartition(".")[0]] = mod
        self.stats = RunningStats(bn)
        managed = {f"{m}.{a}" if m else a for m in bn for a in _STATS}
        self.watched = [n for n in self.names if n not in managed]
        self.groups, self.layout, self.micro_plan = groups, layout, micro_plan
        self._versions: dict[str, tuple[int, int]] = {}
        self.mark_clean()

    def tensor(self, name: str) -> torch.Tensor:
        """The current tensor of buffer ``name`` (a module may assign a new one)."""
        mod, attr = self._where[name]
        return mod._buffers[attr]

    def named(self) -> dict[str, torch.Tensor]:
        """The stage's buffers by canonical name (the live tensors, detached)."""
        return {n: self.tensor(n).detach() for n in self.names}

    def close(self) -> None:
        self.stats.close()

    def mark_clean(self) -> None:
        """Remember the watched buffers' identities and versions (after a commit or a load)."""
        self._versions = {n: (id(t := self.tensor(n)), t._version) for n in self.watched}

    # ---- the end of a step

    def exchange(self, step: int) -> PendingBuffers:
        """Before the step commits (collectives over the stage's replicas): every micro-batch's
        statistics of ``step`` from every replica, and replica 0's values of the other buffers that
        changed. Writes nothing."""
        pending = PendingBuffers()
        dp = self.groups.dp_group if self.layout.D > 1 else None
        if self.stats.modules:
            pending.stats = self._exchange_stats(step, dp)
        if self.watched and dp is not None:
            pending.replica0 = self._exchange_changed(dp)
        return pending

    def commit(self, pending: PendingBuffers, *, skipped: bool) -> None:
        """After the optimizer step (or the skip) of the step ``pending`` belongs to: write."""
        if not skipped:
            for rows in pending.stats:
                self.stats.apply(rows)
        for n, t in pending.replica0.items():
            with torch.no_grad():
                self.tensor(n).copy_(t)
        self.mark_clean()

    def _exchange_stats(self, step: int, dp) -> list[torch.Tensor]:
        device = next(iter(self.stats.modules.values())).running_mean.device
        mine = [mb.index for mb in self.micro_plan[self.layout.replica]]
        local = self.stats.take_rows([(step, i) for i in mine], device)
        self.stats.forget(step)
        if dp is None:
            return [local]
        # Shares may be uneven (replica_shares): pad to the largest, then place rows by index.
        rows_max = max(len(p) for p in self.micro_plan)
        padded = torch.zeros(rows_max, self.stats.width, dtype=local.dtype, device=device)
        padded[: len(mine)] = local
        parts = [torch.empty_like(padded) for _ in self.micro_plan]
        dist.all_gather(parts, padded, group=dp)
        by_index = {}
        for plan, part in zip(self.micro_plan, parts):
            for j, mb in enumerate(plan):
                by_index[mb.index] = part[j]
        return [torch.stack([by_index[i] for i in sorted(by_index)])]

    def _exchange_changed(self, dp) -> dict[str, torch.Tensor]:
        flags = torch.tensor(
            [float(self._versions.get(n) != (id(t := self.tensor(n)), t._version)) for n in self.watched]
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=dp)
        src = self.layout.rank_of(self.layout.stage, 0)
        out = {}
        for n, changed in zip(self.watched, flags.tolist()):
            if not changed:
                continue
            t = self.tensor(n).detach().clone()
            wire = t.view(torch.uint8) if t.dtype == torch.bool else t
            dist.broadcast(wire, src=src, group=dp)
            out[n] = t
        return out

    # ---- checkpoints and morphs

    def load(self, saved: Mapping[str, torch.Tensor]) -> list[str]:
        """Copy ``saved`` buffers into the stage's (shapes checked); returns the stage's buffers
        ``saved`` lacks (a checkpoint written before buffers were saved: they keep their values)."""
        missing = [n for n in self.names if n not in saved]
        with torch.no_grad():
            for n in self.names:
                if n in missing:
                    continue
                t, v = self.tensor(n), saved[n]
                if tuple(v.shape) != tuple(t.shape):
                    raise ValueError(f"buffer {n!r}: shape {tuple(v.shape)} != the model's {tuple(t.shape)}")
                if t.data_ptr() != v.data_ptr():
                    t.copy_(v)
        self.mark_clean()
        return missing

