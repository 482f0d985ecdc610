"""State that rides with the model: the engine's learning-rate scheduler and the user's own stateful
objects (a data loader's position, an RNG, a counter), registered by name (issue 29).

Note [Registered state]: an object registered with :meth:`ExtraState.register` (through
``Engine.register_state(name, obj, scope=...)``) has ``state_dict()`` and ``load_state_dict(sd)``;
its state is saved in every checkpoint, handed to the new engine in a live morph, and loaded back
on resume. The scope says whose state it is, and the user must choose it:

- ``"global"``: one value for the whole job, the same on every rank (a data loader that yields
  whole mini-batches, as every rank passes the whole mini-batch to ``train_step``; a step counter;
  an RNG every rank draws from alike). Saved once (rank 0's), loaded by every rank at **any**
  P×D. Every save checks that the ranks agree (one digest in the save's all-reduce) and warns
  naming the step when they do not (then the checkpoint holds rank 0's).
- ``"rank"``: this process's own (an RNG for per-rank augmentation). Saved per rank; restored
  only when the run resumes at the P×D that saved it (rank r gets rank r's); at another P×D, or
  in a live morph, a rank keeps the object as it is and rank 0 says so once.

State is plain data (tensors, numbers, strings, lists, tuples, dicts: varuna/runtime/state_codec.py;
never pickled objects) and small: it travels as JSON in the checkpoint's commit file and in a live
morph's store records (:data:`MAX_STATE_BYTES` in all). An object may also provide
``state_dict_at(step)``: the state after ``step`` mini-batches, for an object that ran ahead of the
engine (a loader whose next batches were already taken: ``StatefulBatches``).

Objects are usually registered after ``Engine(...)`` returned, i.e. after a resume: the state the
checkpoint holds for a name nobody has registered yet waits and is loaded when the name is
registered (so ``engine.register_state("data", loader)`` right after the engine is built resumes
the loader). The engine's own scheduler (``Engine(lr_scheduler=...)``) is the global state
``"lr_scheduler"``; its per-group values (``base_lrs``, ``_last_lr``) are taken from this stage's
optimizer groups, whose hyper-parameters the checkpoint restores by parameter name, because the
saved ones are rank 0's stage's groups.

Example::

    engine = varuna.Engine(model, cfg, example_batch=b, optimizer=make_opt,
                           lr_scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, 1000))
    engine.register_state("rng", my_numpy_rng_wrapper, scope="rank")
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy
import torch

from varuna.runtime.state_codec import json_bytes

__all__ = ["MAX_STATE_BYTES", "SCHEDULER", "SCOPES", "ExtraState", "RNGState", "SchedulerState"]

SCOPES = ("global", "rank")
#: The engine's learning-rate scheduler's name among the registered states.
SCHEDULER = "lr_scheduler"
#: Bound on one rank's registered state as JSON (it rides in the commit file and store records).
MAX_STATE_BYTES = 64 << 20

log = logging.getLogger("varuna.runtime.extra_state")


class SchedulerState:
    """An LR scheduler as registered state (Note [Registered state]): saved once for the job, its
    per-group lists rebuilt from this stage's optimizer on load. ``step(loss)`` steps it once per
    mini-batch (``ReduceLROnPlateau`` gets the agreed loss).

    >>> w = torch.nn.Parameter(torch.zeros(1))
    >>> opt = torch.optim.SGD([w], lr=1.0)
    >>> s = SchedulerState(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    >>> s.step(0.0); s.state_dict()["last_epoch"], opt.param_groups[0]["lr"]
    (1, 0.5)
    """

    def __init__(self, scheduler: Any) -> None:
        if not (hasattr(scheduler, "state_dict") and hasattr(scheduler, "step")):
            raise ValueError(
                f"lr_scheduler must return a learning-rate scheduler, not {type(scheduler).__name__}"
            )
        self.scheduler = scheduler

    def step(self, loss: float | None) -> None:
        """One step; ``loss``: the mini-batch's agreed loss (None inside a 2bw window, where the
        stages update before the loss is agreed)."""
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            if loss is None:
                raise ValueError("ReduceLROnPlateau needs each step's agreed loss, which train_steps' "
                                 "no-flush windows do not have when a stage updates; use train_step")
            self.scheduler.step(loss)
        else:
            self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        groups = self.scheduler.optimizer.param_groups
        self.scheduler.load_state_dict(_with_group_values(state, groups))


def _with_group_values(state: Any, groups: list[dict]) -> Any:
    """``state`` with ``base_lrs`` and ``_last_lr`` (here and in nested schedulers' states) taken
    from ``groups``' ``initial_lr`` and ``lr``."""
    if isinstance(state, list):
        return [_with_group_values(v, groups) for v in state]
    if not isinstance(state, dict):
        return state
    out = {k: _with_group_values(v, groups) for k, v in state.items()}
    for key, group_key in (("base_lrs", "initial_lr"), ("_last_lr", "lr")):
        if isinstance(out.get(key), list) and all(group_key in g for g in groups):
            out[key] = [g[group_key] for g in groups]
    return out


class RNGState:
    """This process's global random generators (Python's ``random``, NumPy's legacy global one,
    torch's default CPU generator) as registered state, for a script that draws from them outside
    the engine (augmentation, sampling). Register it with scope ``"global"`` when every rank draws
    the same numbers (every rank builds the whole mini-batch, so usually), else ``"rank"``. Dropout
    does not need it: the engine keys its draws by work and restores torch's stream after.

    >>> rng = RNGState()
    >>> saved = rng.state_dict(); a = random.random()
    >>> rng.load_state_dict(saved); a == random.random()
    True
    """

    def state_dict(self) -> dict:
        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        return {"python": random.getstate(), "torch": torch.get_rng_state(),
                "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                          "gauss": float(gauss)}}

    def load_state_dict(self, state: dict) -> None:
        random.setstate(_tuples(state["python"]))
        torch.set_rng_state(state["torch"])
        n = state["numpy"]
        numpy.random.set_state((n["kind"], numpy.array(n["keys"], dtype=numpy.uint32), n["pos"],
                                n["has_gauss"], n["gauss"]))


def _tuples(x: Any) -> Any:
    """Lists back to tuples (``random.setstate`` wants tuples; a JSON round trip keeps them as the
    codec's tuples, an in-memory copy as they were)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


class ExtraState:
    """The registered objects of one engine (Note [Registered state]) and the loaded states still
    waiting for their object. ``rank``: this process's rank (rank 0 speaks)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.entries: dict[str, tuple[Any, str]] = {}
        self._waiting: dict[str, dict[str, Any]] = {"global": {}, "rank": {}}

    def register(self, name: str, obj: Any, scope: str = "global") -> None:
        """Add ``obj`` under ``name``; a state loaded for it before is loaded into it now."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"register_state needs a non-empty name (got {name!r})")
        if scope not in SCOPES:
            raise ValueError(f"register_state({name!r}): scope must be 'global' or 'rank' (got {scope!r}); "
                             "see docs/checkpoints.md 'Whole state'")
        if not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")):
            raise ValueError(f"register_state({name!r}): a {type(obj).__name__} has no state_dict() and "
                             "load_state_dict(); register an object that has both")
        if name in self.entries and self.entries[name][0] is not obj:
            raise ValueError(f"register_state: {name!r} is registered already; use another name")
        self.entries[name] = (obj, scope)
        waiting = self._waiting[scope].pop(name, None)
        if waiting is not None:
            obj.load_state_dict(waiting)

    def state_dicts(self, step: int) -> dict[str, dict[str, Any]]:
        """``{"global": {name: state}, "rank": {name: state}}`` after ``step`` mini-batches
        (``state_dict_at(step)`` where an object has it), checked to fit :data:`MAX_STATE_BYTES`."""
        out: dict[str, dict[str, Any]] = {"global": {}, "rank": {}}
        for name, (obj, scope) in self.entries.items():
            at = getattr(obj, "state_dict_at", None)
            out[scope][name] = at(step) if callable(at) else obj.state_dict()
        size = len(json_bytes(out))
        if size > MAX_STATE_BYTES:
            raise ValueError(
                f"the registered states ({', '.join(self.entries)}) take {size >> 20} MiB as JSON, over "
                f"{MAX_STATE_BYTES >> 20} MiB; save large state yourself (e.g. as a tensor file) and "
                "register only its position"
            )
        return out

    def load(self, states: Mapping[str, Mapping[str, Any]], *, rank_state: bool) -> None:
        """Load saved states into the registered objects; keep the others for their registration.
        ``rank_state``: whether ``states["rank"]`` is this rank's own (same P×D as the save)."""
        for scope in SCOPES:
            saved = dict(states.get(scope, {}))
            if scope == "rank" and not rank_state:
                if self.rank == 0 and (saved or any(s == "rank" for _, s in self.entries.values())):
                    log.warning("varuna: per-rank registered state is not restored at another P×D or after "
                                "a live morph: each rank keeps its objects as they are")
                continue
            self._waiting[scope] = {}
            for name, state in saved.items():
                entry = self.entries.get(name)
                if entry is None:
                    self._waiting[scope][name] = state
                elif entry[1] == scope:
                    entry[0].load_state_dict(state)
