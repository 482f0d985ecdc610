"""A stateful data loader's mini-batches, resumed exactly once across checkpoints, resizes and live
morphs (issue 29).

Note [Data position]: every rank passes the *whole* mini-batch to ``Engine.train_step`` (the engine
cuts it into micro-batches globally: varuna/core/batching.py), so the data position is global: one
position per mini-batch, the same on every rank, whatever P×D. A loader that yields whole
mini-batches (``batch_size = global_batch_size``, ``drop_last=True``) and is built the same way on
every rank (same dataset, same seed) is therefore in the same state on every rank after step s,
and that state is a *global* registered state (Note [Registered state] in extra_state.py): saved
once, loaded by every rank at any new P×D, which then reads mini-batch s + 1 next. No sample is
read twice or skipped, at any new D, because D never enters what a mini-batch is.

:class:`StatefulBatches` wraps such a loader (torchdata's ``StatefulDataLoader``, or anything with
``state_dict``/``load_state_dict`` that iterates over mini-batches) and counts positions:
``batch_for(step)`` returns mini-batch ``step`` (1-based) and chains epochs; it remembers the loader's
state after each position it handed out, so that a checkpoint of step s saves the state *after s*
even when the script already took later batches (``train_steps`` windows), and a step that is
redone (a live morph after a lost peer) gets the same mini-batch again (``batch_for(s)`` with s at
or before the position rewinds).

The contract (docs/checkpoints.md "Data"): the loader yields whole mini-batches; every rank builds
it identically; the script feeds ``batch_for(step)`` (or iterates the object) in step order and
registers it (``engine.register_state("data", batches)``) right after the engine is built, which
rewinds it to the resumed step. Per-rank sharding of the data (a ``DistributedSampler``) breaks the
first rule: varuna's replicas split each mini-batch themselves.

Example::

    from torchdata.stateful_dataloader import StatefulDataLoader
    loader = StatefulDataLoader(dataset, batch_size=32, shuffle=True, drop_last=True,
                                generator=torch.Generator().manual_seed(0))
    data = StatefulBatches(loader)
    engine.register_state("data", data)                     # resumed: continues after engine.step_count
    for step in range(engine.step_count + 1, total + 1):
        engine.train_step(data.batch_for(step))
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from varuna.core.extras import MissingExtra

__all__ = ["StatefulBatches"]


class StatefulBatches:
    """The mini-batches of a stateful loader by step (Note [Data position]).

    ``history``: how many positions' loader states are kept (a checkpoint can be taken at any step
    up to that many behind the newest batch handed out).

    >>> class Counter:                   # a stand-in for a StatefulDataLoader over 3 mini-batches
    ...     def __init__(self): self.i = 0
    ...     def __iter__(self):
    ...         while self.i < 3:
    ...             self.i += 1
    ...             yield self.i
    ...         self.i = 0
    ...     def state_dict(self): return {"i": self.i}
    ...     def load_state_dict(self, s): self.i = s["i"]
    >>> data = StatefulBatches(Counter())
    >>> [data.batch_for(s) for s in range(1, 6)], data.epoch
    ([1, 2, 3, 1, 2], 1)
    >>> data.state_dict_at(4)["position"], data.batch_for(5)     # step 5 redone: the same batch
    (4, 2)
    """

    def __init__(self, loader: Any, *, history: int = 1024) -> None:
        if not all(callable(getattr(loader, m, None)) for m in ("state_dict", "load_state_dict", "__iter__")):
            raise MissingExtra(f"StatefulBatches over a {type(loader).__name__} (it has no state_dict/"
                               "load_state_dict; use torchdata's StatefulDataLoader)", "data", ["torchdata"])
        if history < 1:
            raise ValueError(f"StatefulBatches: history must be >= 1 (got {history})")
        self.loader = loader
        self.position = 0
        """Mini-batches handed out so far (the next ``batch_for`` is ``position + 1``)."""
        self.epoch = 0
        """Passes over the loader completed before the current one."""
        self._it: Iterator | None = None
        self._history: OrderedDict[int, dict] = OrderedDict()
        self._keep = history
        self._generators = _generators(loader)
        self._remember()

    def _remember(self) -> None:
        self._history[self.position] = {"position": self.position, "epoch": self.epoch,
                                        "loader": self.loader.state_dict(),
                                        "generators": [g.get_state() for g in self._generators]}
        while len(self._history) > self._keep:
            self._history.popitem(last=False)

    def _next(self) -> Any:
        for _ in range(2):  # the current epoch's next batch, else the next epoch's first
            if self._it is None:
                self._it = iter(self.loader)
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                self.epoch += 1
                continue
            self.position += 1
            self._remember()
            return batch
        raise ValueError("StatefulBatches: the loader yields no mini-batch in a whole epoch (a dataset "
                         "smaller than one global batch with drop_last=True?)")

    def batch_for(self, step: int) -> Any:
        """Mini-batch ``step`` (1-based): the next one, or, for a step at or before the position
        (a step being redone), the same one again."""
        if step <= self.position:
            self.load_state_dict(self.state_dict_at(step - 1))
        elif step > self.position + 1:
            raise ValueError(f"StatefulBatches: asked for step {step}, but the loader is at mini-batch "
                             f"{self.position}; feed the steps in order (engine.step_count + 1 first)")
        return self._next()

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self._next()

    def state_dict_at(self, step: int) -> dict:
        """The state after ``step`` mini-batches (what a checkpoint of ``step`` saves)."""
        state = self._history.get(step)
        if state is None:
            raise ValueError(f"StatefulBatches: no state for step {step} (kept: steps "
                             f"{min(self._history)}..{max(self._history)}); a checkpoint may be at most "
                             f"`history` ({self._keep}) mini-batches behind the newest one taken")
        return state

    def state_dict(self) -> dict:
        """The state at the current position."""
        return self._history[self.position]

    def load_state_dict(self, state: dict) -> None:
        """Continue after ``state``'s position (the next batch is ``position + 1``)."""
        self.loader.load_state_dict(state["loader"])
        self.position, self.epoch = int(state["position"]), int(state["epoch"])
        # A StatefulDataLoader rebuilds the epoch's order when its iterator is made, drawing from
        # its generator on the way (torchdata 0.11 draws once more than the saving run did, and the
        # next epoch came out in another order): make the iterator now, then put the generators
        # where the saving run had them, so the next epoch draws what it drew.
        self._it = iter(self.loader)
        for g, saved in zip(self._generators, state.get("generators", [])):
            g.set_state(saved)
        for p in [p for p in self._history if p > self.position]:
            del self._history[p]
        self._history[self.position] = state


def _generators(loader: Any) -> list:
    """The torch generators a loader shuffles with (its own, its sampler's, its batch sampler's
    sampler's), each once."""
    import torch

    found, seen = [], set()
    for obj in (loader, getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None),
                                                               "sampler", None)):
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator) and id(g) not in seen:
            seen.add(id(g))
            found.append(g)
    return found
