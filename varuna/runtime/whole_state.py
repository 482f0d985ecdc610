"""The whole training state of one stage, in and out of an engine (issue 29).

Note [Whole state]: what must equal the uninterrupted run after a resume or a morph, and where
each part lives in ``Engine.state_dict()``:

| part | key | kept equal across a stage's replicas by |
|---|---|---|
| parameters | ``params`` | the gradient all-reduce (same update everywhere) |
| optimizer state per parameter, hyper-parameters per group | ``optimizer`` (name-keyed) | the same update |
| optimizer state outside ``state[param]`` | ``optimizer["stage_state"]`` | the same update |
| persistent buffers | ``buffers`` | Note [Buffers across replicas] (varuna/runtime/buffers.py) |
| loss scale | ``loss_scale`` | the agreed overflow |
| step (= data position: one whole mini-batch per step) | ``step`` | every rank counts steps |
| LR scheduler, registered objects | ``extra`` (``{"global", "rank"}``) | Note [Registered state] |

Dropout needs no saved RNG state: it is keyed by (seed, step, micro-batch, segment).

:class:`StageExtras` is the engine's holder of the parts beyond parameters and optimizer (buffers,
scheduler, registered objects) and its two hooks at the end of a step: :meth:`StageExtras.before_commit`
(the buffers' exchange, a collective over the stage's replicas, before the optimizer step) and
:meth:`StageExtras.after_commit` (write the buffers, step the scheduler). :func:`state_dict` and
:func:`load_state_dict` are ``Engine.state_dict``/``load_state_dict``.

Example::

    extras = StageExtras(model, buffer_names, groups=groups, layout=layout, micro_plan=plan,
                         optimizer=opt, lr_scheduler=None)
    pending = extras.before_commit(step)
    outcome = sync.finish(...)
    extras.after_commit(pending, skipped=outcome.skipped, loss=outcome.loss)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from varuna.core.batching import MicroBatch
from varuna.runtime.buffers import BufferKeeper, PendingBuffers
from varuna.runtime.extra_state import SCHEDULER, ExtraState, SchedulerState
from varuna.runtime.sharded_optimizer import load_stage_optimizer_state
from varuna.runtime.weight_versions import add_previous, pop_previous

__all__ = ["StageExtras", "load_state_dict", "preserved_buffers", "state_dict"]

log = logging.getLogger("varuna.runtime.whole_state")


class StageExtras:
    """Buffers, LR scheduler and registered objects of one engine (Note [Whole state])."""

    def __init__(
        self,
        model: nn.Module,
        buffer_names: Sequence[str],
        *,
        groups,
        layout,
        micro_plan: Sequence[Sequence[MicroBatch]],
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None,
    ) -> None:
        self.buffers = BufferKeeper(model, buffer_names, groups=groups, layout=layout, micro_plan=micro_plan)
        self.registered = ExtraState(layout.rank)
        self.scheduler = SchedulerState(lr_scheduler(optimizer)) if lr_scheduler is not None else None
        if self.scheduler is not None:
            self.registered.register(SCHEDULER, self.scheduler, "global")

    def before_commit(self, step: int) -> PendingBuffers:
        """Before the optimizer step of ``step``: the buffers' exchange (collectives, no writes)."""
        return self.buffers.exchange(step)

    def after_commit(self, pending: PendingBuffers, *, skipped: bool, loss: float | None) -> None:
        """After it: the buffers written, the scheduler stepped (once per mini-batch, skipped ones
        too: its epoch is the engine's step count)."""
        self.buffers.commit(pending, skipped=skipped)
        if self.scheduler is not None:
            self.scheduler.step(loss)

    def close(self) -> None:
        self.buffers.close()


def state_dict(engine, *, optimizer_for=None) -> dict:
    """``Engine.state_dict()`` (Note [Whole state]); tensors are references to the live ones.
    ``optimizer_for``: the parameters whose optimizer state is wanted (sharded state is gathered
    for those only; None: all)."""
    return {
        "step": engine.step_count,
        "params": {n: p.detach() for n, p in engine.stage_params.items()},
        "optimizer": add_previous(engine.optimizer_state(optimizer_for), engine.weight_versions),
        "loss_scale": engine.scaler.state_dict(),
        "buffers": engine.extras.buffers.named(),
        # committed_step: inside a failed step (a live morph's hand-over) a loader already gave out
        # the step's batch; its state after the last committed step is what must travel
        "extra": engine.extras.registered.state_dicts(engine.committed_step),
    }


def load_state_dict(engine, state: dict, *, copy: bool = True) -> None:
    """``Engine.load_state_dict`` (its docstring). ``state`` may lack ``buffers`` and ``extra``
    (a checkpoint written before they were saved): the buffers keep their values, with a warning."""
    params = state["params"]
    missing = [n for n in engine.stage_params if n not in params]
    if missing:
        raise ValueError(f"state has no parameter {missing[0]!r} (and {len(missing) - 1} more) of this stage")
    with torch.no_grad():
        for n, p in engine.stage_params.items():
            if tuple(params[n].shape) != tuple(p.shape):
                raise ValueError(
                    f"parameter {n!r}: shape {tuple(params[n].shape)} != the model's {tuple(p.shape)}"
                )
            p.copy_(params[n] if copy else params.pop(n))
    trainable = dict(engine.named_parameters())
    opt = dict(state["optimizer"])
    opt["state"] = {n: v for n, v in opt.get("state", {}).items() if n in trainable}
    previous = pop_previous(opt)
    if engine.weight_versions is not None:  # 2bw (Note [2BW]): the stashed version; others drop it
        engine.weight_versions.load(previous)
    load_stage_optimizer_state(engine.optimizer, engine._shards, trainable, opt, copy=copy)  # sharded: pieces
    engine.scaler.load_state_dict(state["loss_scale"])
    engine.step_count = int(state["step"])
    lacking = engine.extras.buffers.load(state.get("buffers", {}))
    if lacking and engine.layout.rank == engine.layout.stage:  # replica 0 of each stage says it once
        log.warning("varuna: the loaded state has no buffer %r (and %d more) of stage %d (a checkpoint "
                    "written before buffers were saved): they keep their current values",
                    lacking[0], len(lacking) - 1, engine.stage)
    extra = state.get("extra")  # None: leave the registered objects as they are (init_from)
    if extra is not None:
        engine.extras.registered.load(extra, rank_state="rank" in extra)


class preserved_buffers:
    """Restore ``model``'s buffers on exit: the dry runs before materialisation run the forward in
    training mode, which would move BatchNorm's running statistics (and differently on rank 0,
    which may time extra runs)."""

    def __init__(self, model: nn.Module) -> None:
        self.saved = {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}
        self.model = model

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        current = dict(self.model.named_buffers())
        with torch.no_grad():
            for n, b in self.saved.items():
                t = current.get(n)
                if t is not None and t.shape == b.shape and not t.is_meta:
                    t.copy_(b)
