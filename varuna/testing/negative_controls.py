"""Switches that break one of the engine's guarantees on purpose, so that a test can show its
check fails without the mechanism it tests (a negative control). Never for training: they are
not part of the public ``VarunaConfig``; a test sets them on a copy of its config with
:func:`with_negative_controls`.

Example::

    >>> from varuna.runtime.config import VarunaConfig
    >>> cfg = with_negative_controls(VarunaConfig(global_batch_size=8, micro_batch_size=2), rng_keyed=False)
    >>> negative_controls(cfg).rng_keyed, negative_controls(cfg).canonical_reduction
    (False, True)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["NegativeControls", "negative_controls", "with_negative_controls"]


@dataclass(frozen=True, kw_only=True)
class NegativeControls:
    """Each field True is the engine's normal behaviour; False turns the mechanism off."""

    rng_keyed: bool = True
    """Key dropout by (seed, step, micro-batch, segment). Off: draws depend on each process's
    history, so a recompute or another layout draws other masks."""
    canonical_reduction: bool = True
    """With deterministic mode: canonical-order sums of gradients (Note [Canonical reduction]).
    Off: the plain all-reduce, whose summation order depends on P×D."""


def negative_controls(config: Any) -> NegativeControls:
    """The controls of ``config`` (a ``VarunaConfig``): all on unless a test turned one off."""
    return config._negative_controls


def with_negative_controls(config: Any, **switches: bool) -> Any:
    """A copy of ``config`` (a ``VarunaConfig``) with the named controls set (``rng_keyed=False``,
    ``canonical_reduction=False``); ``TypeError`` for an unknown name."""
    controls = dataclasses.replace(config._negative_controls, **switches)
    return dataclasses.replace(config, _negative_controls=controls)
