"""End of step: gradient sync, the agreement of every rank, and the optimizer step (Note [Step]).

Gradients are summed over each stage's replicas in flat buckets (and, for parameters several
stages hold such as tied embeddings, over every rank holding them); then one small all-reduce over
the world agrees on the global gradient norm (each gradient counted once), on overflow (any
non-finite gradient makes every rank skip), on the loss and on a pending stop request; finally
unscale + clip with one ``_foreach_mul_`` and the optimizer step. Deterministic mode replaces the
sums with canonical-order ones (varuna/runtime/determinism.py).

Example::

    sync = GradientSync(layout=layout, groups=groups, trainable=trainable, optimizer=opt,
                        scaler=scaler, config=cfg, timeline=timeline, det=None)
    outcome = sync.finish(local_loss, stop_requested=False, micro_plan=plan)
    outcome.grad_norm, outcome.skipped, outcome.loss
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from varuna.core.batching import MicroBatch
from varuna.core.memory import GRAD_BUCKET_BYTES
from varuna.core.timeline import Timeline
from varuna.runtime.config import VarunaConfig
from varuna.runtime.groups import ProcessGroups
from varuna.runtime.layout import Layout
from varuna.runtime.loss_scale import DynamicLossScale
from varuna.runtime.sharded_optimizer import ShardedOptimizer

__all__ = ["GradientSync", "StepOutcome", "allreduce_bucketed", "allreduce_scalars"]


def allreduce_bucketed(tensors: list[torch.Tensor], group, bucket_bytes: int = GRAD_BUCKET_BYTES) -> None:
    """Sum ``tensors`` across ``group`` in flat buckets (few large messages beat many small).

    Example::

        allreduce_bucketed([p.grad for p in params], dp_group)
    """
    bucket: list[torch.Tensor] = []
    size = 0

    def flush():
        if not bucket:
            return
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for t, r in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(r)
        bucket.clear()

    for t in tensors:
        bucket.append(t)
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            flush()
            size = 0
    flush()


def allreduce_scalars(v: torch.Tensor, world: int) -> list[float]:
    """Sum the small tensor ``v`` over all ranks (nothing to do in one process); as a list.

    Example::

        >>> allreduce_scalars(torch.tensor([1.0, 2.0]), 1)
        [1.0, 2.0]
    """
    if world > 1:
        dist.all_reduce(v)
    return v.tolist()


@dataclass(frozen=True)
class StepOutcome:
    """What every rank agreed on at the end of a step."""

    grad_norm: float
    """Global gradient norm (unscaled); inf when the step was skipped."""
    skipped: bool
    stop: bool
    """Some rank asked for a graceful stop."""
    loss: float
    """Mean loss over the whole mini-batch."""


class GradientSync:
    """The end of step of one engine (see the module docstring)."""

    def __init__(
        self,
        *,
        layout: Layout,
        groups: ProcessGroups,
        trainable: dict[str, nn.Parameter],
        optimizer: torch.optim.Optimizer,
        scaler: DynamicLossScale,
        config: VarunaConfig,
        timeline: Timeline,
        det=None,
        shards: ShardedOptimizer | None = None,
    ) -> None:
        self.layout, self.groups, self.trainable = layout, groups, trainable
        self.optimizer, self.scaler, self.config = optimizer, scaler, config
        self.timeline, self.det = timeline, det
        #: the optimizer's shard of this replica (``optimizer_state``: shard/offload), else None
        self.shards = shards

    def zero_grad(self) -> None:
        """Drop every gradient: the parameters' and, sharded, the optimizer's pieces'."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.shards is not None:
            for p in self.trainable.values():
                p.grad = None
            self.shards.zero_grad()

    def _scattered(self) -> bool:
        return self.shards is not None and self.shards.reduce_scatter

    def _reduce_grads(self) -> None:
        params = self.trainable
        shared = self.groups.shared_names()
        for p in params.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        plain = [p for n, p in params.items() if n not in shared]
        if self._scattered():
            self.shards.reduce_scatter_grads()  # this replica's shard of the sums only
        elif self.groups.dp_group is not None:
            allreduce_bucketed([p.grad for p in plain], self.groups.dp_group)
        for group, names in self.groups.shared:
            allreduce_bucketed([params[n].grad for n in names if n in params], group)

    def _local_norms(self) -> tuple[torch.Tensor, float]:
        """This rank's counted sum of squared gradients, and 1.0 if any gradient is not finite."""
        if self._scattered():  # each replica holds (and counts) its shard's sums only
            self.shards.bind_grads()
            return self.shards.local_norms(self.groups.norm_elsewhere)
        params = self.trainable
        grads = [p.grad for p in params.values()]
        # Each gradient counts once in the global norm: replica 0 only, and a parameter held by
        # several stages only on the first of them.
        elsewhere = self.groups.norm_elsewhere
        counted = [i for i, n in enumerate(params) if self.layout.replica == 0 and n not in elsewhere]
        sumsq = torch.zeros((), dtype=torch.float64)
        nonfinite = 0.0
        if grads:
            squares = [x.double() ** 2 for x in torch._foreach_norm(grads)]
            sums = [torch.stack(squares).sum()]
            if counted:
                sums.append(torch.stack([squares[i] for i in counted]).sum())
            # One read for both (on a GPU each read waits for the device: Note [One loss sync per
            # step] in executor.py).
            values = torch.stack(sums).tolist()
            nonfinite = 0.0 if math.isfinite(values[0]) else 1.0
            if counted:
                sumsq = torch.tensor(values[1], dtype=torch.float64)
        return sumsq, nonfinite

    def _agree(
        self,
        sumsq: torch.Tensor,
        nonfinite: float,
        local_loss: float,
        stop_requested: bool,
        micro_plan: list[list[MicroBatch]],
    ) -> tuple[float, bool, float, bool]:
        """One all-reduce over the world: (sum of squared gradients, overflow, loss, stop)."""
        v = self.agreement_slots(sumsq, nonfinite, local_loss, stop_requested)
        return self.read_agreement(allreduce_scalars(v, self.layout.world), micro_plan)

    def agreement_slots(
        self, sumsq: torch.Tensor, nonfinite: float, local_loss: float, stop_requested: bool
    ) -> torch.Tensor:
        """This rank's part of the end-of-step agreement, to SUM over the world (a no-flush
        window all-reduces it without waiting: varuna/runtime/no_flush.py)."""
        if self.det is not None:
            return self.det.scalar_slots(nonfinite > 0, stop_requested, self.groups.norm_elsewhere)
        return torch.tensor(
            [float(sumsq) if nonfinite == 0 else 0.0, nonfinite, local_loss, float(stop_requested)],
            dtype=torch.float64,
        )

    def read_agreement(
        self, summed: list[float], micro_plan: list[list[MicroBatch]]
    ) -> tuple[float, bool, float, bool]:
        """(sum of squared gradients, overflow, loss, stop) from the summed slots."""
        if self.det is not None:
            sizes = [mb.size for plan in micro_plan for mb in plan]
            return self.det.read_slots(summed, sizes, self.config.global_batch_size)
        total_sq, overflow, loss, stop = summed
        return total_sq, overflow > 0, loss, stop > 0

    def reduce(self) -> None:
        """Sum the gradients over each stage's replicas and over the copies of shared parameters
        (canonical order in deterministic mode)."""
        t0 = time.perf_counter()
        if self.det is not None:
            self.det.reduce()
        else:
            self._reduce_grads()
        if self.config.metrics.record_timeline:
            self.timeline.add(self.layout.stage, self.layout.replica, "AR", None, t0, time.perf_counter())

    def local_norms(self) -> tuple[torch.Tensor, float]:
        """This rank's counted sum of squared gradients, and 1.0 if any gradient is not finite."""
        return self._local_norms()

    def shared_nonfinite(self, nonfinite: float) -> float:
        """1.0 if this rank or a stage holding a copy of one of its shared parameters (a tied
        weight) saw a non-finite gradient, else ``nonfinite``: a no-flush window skips updates per
        stage (varuna/runtime/no_flush.py), and a tied weight's copies must skip together or they
        part for good. One tiny all-reduce per shared group, where those stages already meet to
        sum the tied gradients. (Groups are taken once, in order: a stage reached only through a
        second tied weight of another stage is not told; no model here ties that way.)"""
        if not self.groups.shared:
            return nonfinite
        device = next((p.device for p in self.trainable.values()), torch.device("cpu"))
        for group, _names in self.groups.shared:
            flag = torch.tensor([nonfinite], dtype=torch.float32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            nonfinite = float(flag.item())
        return nonfinite

    def finish(
        self, local_loss: float, *, stop_requested: bool, micro_plan: list[list[MicroBatch]]
    ) -> StepOutcome:
        """Sync gradients, agree with every rank, then step the optimizer or skip (overflow)."""
        cfg = self.config
        self.reduce()
        sumsq, nonfinite = self._local_norms()
        t_ar = time.perf_counter()
        total_sq, skipped, loss, stop = self._agree(sumsq, nonfinite, local_loss, stop_requested, micro_plan)
        # A NaN/Inf loss skips the step even if every gradient happens to be finite; the loss is
        # agreed, so every rank skips (the engine warns and counts: Engine._check_nonfinite).
        skipped = skipped or not math.isfinite(loss)
        scale = self.scaler.scale
        if cfg.precision == "fp16":
            self.scaler.update(found_inf=skipped)
        if skipped:
            self.zero_grad()
            return StepOutcome(grad_norm=math.inf, skipped=True, stop=stop, loss=loss)
        norm = math.sqrt(total_sq) / scale
        coef = 1.0 / scale
        if cfg.max_grad_norm is not None:
            # Same rule as torch.nn.utils.clip_grad_norm_ (coefficient clamped to 1).
            coef *= min(1.0, cfg.max_grad_norm / (norm + 1e-6))
        if self.shards is not None:
            grads = self.shards.bind_grads()  # this replica's pieces (views, or host copies)
        else:
            grads = [p.grad for p in self.trainable.values()]
        if coef != 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        if self.shards is not None:
            self.shards.step()  # step the pieces, all-gather the updated weights
        else:
            self.optimizer.step()
        if cfg.metrics.record_timeline:
            self.timeline.add(self.layout.stage, self.layout.replica, "OPT", None, t_ar, time.perf_counter())
        return StepOutcome(grad_norm=norm, skipped=False, stop=stop, loss=loss)
