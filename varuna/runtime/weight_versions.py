"""PipeDream-2BW's two weight versions on one stage: :class:`WeightVersions` (Note [2BW] in
varuna/core/schedule.py).

The stage keeps the newest weights in its parameters (what the optimizer updates, what
``evaluate`` and checkpoints read) and one stashed copy, the version before. Step t computes its
gradients on that stashed version, W(t-2), and the optimizer applies them to the newest, W(t-1):
W(t) = W(t-1) - lr * grad f_t(W(t-2)). The first step has no older version: W(-1) = W(0).
Memory: one more copy of the stage's trainable weights (2x their bytes; gradients and optimizer
state are not doubled). Buffers and frozen parameters have one version.

Inside :meth:`WeightVersions.stale` the parameters hold W(t-2) (contents swapped in place, so
every view of their storage sees it); on leaving it they hold W(t-1) again and the stash is
W(t-1) too, so the optimizer step
that follows makes W(t) and the next step computes on W(t-1). A step the loss scaler skips leaves
W(t) = W(t-1), as it should. If the pipeline fails inside, the parameters get W(t-1) back and the
stash is left as it was.

Checkpoints hold both versions: the stash rides in the name-keyed optimizer state under
:data:`PREVIOUS_KEY` (:func:`add_previous`, :func:`pop_previous`), so it is sharded, resharded
to another P×D and restored by parameter name like the optimizer's own tensors.

Example::

    versions = WeightVersions(trainable)          # the stage's {name: Parameter}
    with versions.stale():                        # parameters = W(t-2)
        run_pipeline()                            # gradients of step t
    optimizer.step()                              # W(t) = W(t-1) - lr * grad
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

from varuna.core.schedule import schedule_kind
from varuna.runtime.config import VarunaConfig

__all__ = ["PREVIOUS_KEY", "WeightVersions", "add_previous", "pop_previous", "stale_weights",
           "weight_versions_for"]

#: The key of the stashed version in a parameter's name-keyed optimizer state (checkpoints).
PREVIOUS_KEY = "varuna_2bw_previous_weights"


class WeightVersions:
    """The stashed previous version of a stage's trainable parameters (see the module docstring).

    >>> w = nn.Parameter(torch.tensor([1.0]))
    >>> v = WeightVersions({"w": w})
    >>> with torch.no_grad():
    ...     _ = w.add_(1.0)                  # an update: W(1) = 2, the stash still holds W(0) = 1
    >>> with v.stale():
    ...     float(w.detach())
    1.0
    >>> float(w.detach()), float(v.previous["w"])    # after the step's compute both hold W(1)
    (2.0, 2.0)
    """

    def __init__(self, trainable: Mapping[str, nn.Parameter]) -> None:
        self._params = dict(trainable)
        with torch.no_grad():
            self._previous = {n: p.detach().clone() for n, p in self._params.items()}
        self._swapped = False  # whether the parameters hold the stashed version (select)

    @property
    def previous(self) -> dict[str, torch.Tensor]:
        """The stashed version by parameter name (live tensors)."""
        return dict(self._previous)

    def nbytes(self) -> int:
        """Bytes the stashed version takes (the 2BW memory cost)."""
        return sum(t.numel() * t.element_size() for t in self._previous.values())

    def _swap(self) -> None:
        # Contents, not storages: other views of a parameter's storage (deterministic mode's
        # per-segment aliases of a tied weight) must see the version being computed on. One
        # parameter-sized temporary at a time.
        for n, p in self._params.items():
            prev = self._previous[n]
            tmp = p.detach().clone()
            p.detach().copy_(prev)
            prev.copy_(tmp)

    def select(self, stale: bool) -> None:
        """Make the parameters hold the stashed version (``stale``) or the newest one: a no-flush
        window (varuna/runtime/no_flush.py) computes two mini-batches on the two versions and
        switches before each task. In place (contents swapped), so no autograd graph may hold the
        parameters across a switch: the window recomputes, and a graph lives from its R (or F) to
        the B right after it."""
        if stale != self._swapped:
            with torch.no_grad():
                self._swap()
            self._swapped = stale

    def advance(self) -> None:
        """The oldest mini-batch in flight, t, finished its last backward here: the parameters get
        the newest version W(t-1) back and the stash takes a copy of it (what mini-batch t+1
        computes on); the optimizer step that follows makes W(t) for mini-batch t+2."""
        self.select(False)
        with torch.no_grad():
            prev = list(self._previous.values())
            if prev:
                torch._foreach_copy_(prev, [p.detach() for p in self._params.values()])

    @contextmanager
    def stale(self) -> Iterator[None]:
        """Parameters hold the stashed version inside; outside, the newest one, and the stash
        becomes a copy of it (see the module docstring)."""
        with torch.no_grad():
            self._swap()
        try:
            yield
        except BaseException:
            with torch.no_grad():
                self._swap()  # the step did not happen: both versions as they were
            raise
        with torch.no_grad():  # the stash holds W(t-1): the parameters get it back, the stash keeps it
            params = [p.detach() for p in self._params.values()]
            if params:
                torch._foreach_copy_(params, list(self._previous.values()))

    def load(self, previous: Mapping[str, torch.Tensor] | None) -> None:
        """Restore the stash from a checkpoint (``None``: a checkpoint without one, e.g. saved by
        a synchronous schedule: the stash becomes the current weights, like a first step)."""
        with torch.no_grad():
            for n, p in self._params.items():
                src = p.detach() if previous is None or n not in previous else previous[n]
                if tuple(src.shape) != tuple(p.shape):
                    raise ValueError(
                        f"the checkpoint's previous 2bw version of {n!r} has shape {tuple(src.shape)}, "
                        f"the model's is {tuple(p.shape)}: it was saved from another model"
                    )
                self._previous[n].copy_(src)


def weight_versions_for(
    config: VarunaConfig,
    trainable: Mapping[str, nn.Parameter],
    num_stages: int,
    micro_plan: Sequence[Sequence],
) -> WeightVersions | None:
    """The stash of ``config.schedule`` if it keeps two weight versions (the engine's
    ``weight_versions``; None for the synchronous kinds); raises
    ``ValueError`` (one line) where the kind cannot run a replica's micro-batches (``micro_plan``:
    per replica, its micro-batches) on ``num_stages`` stages (2bw: fewer than P).

    >>> cfg = VarunaConfig(global_batch_size=2, micro_batch_size=1, schedule="1f1b")
    >>> weight_versions_for(cfg, {}, 2, [[0, 1]]) is None
    True
    """
    kind = schedule_kind(config.schedule)
    for mbs in micro_plan:
        reason = kind.unsupported(num_stages, len(mbs))
        if reason is not None:
            raise ValueError(reason)
    return WeightVersions(trainable) if kind.weight_versions == 2 else None


def stale_weights(versions: WeightVersions | None) -> AbstractContextManager:
    """``versions.stale()``, or nothing to do for a synchronous kind (``None``)."""
    return versions.stale() if versions is not None else nullcontext()


def add_previous(opt_state: dict, versions: WeightVersions | None) -> dict:
    """``opt_state`` (name-keyed, :func:`~varuna.runtime.optimizer_state.optimizer_state_by_name`)
    with the stashed version added under :data:`PREVIOUS_KEY`; unchanged when ``versions`` is None."""
    if versions is None:
        return opt_state
    state = {n: dict(v) for n, v in opt_state.get("state", {}).items()}
    for n, t in versions._previous.items():
        state.setdefault(n, {})[PREVIOUS_KEY] = t
    return {**opt_state, "state": state}


def pop_previous(opt_state: dict) -> dict[str, torch.Tensor] | None:
    """Remove the stashed versions from a name-keyed optimizer state (in place) and return them by
    name; None when the state has none (a checkpoint of a synchronous schedule)."""
    found: dict[str, torch.Tensor] = {}
    state = opt_state.get("state", {})
    for n in list(state):
        entry = state[n]
        if PREVIOUS_KEY in entry:
            entry = dict(entry)
            found[n] = entry.pop(PREVIOUS_KEY)
            if entry:
                state[n] = entry
            else:
                del state[n]
    return found or None
