"""What a schedule kind is: :class:`ScheduleKind`, the owner of every fact of one kind.

A kind (``varuna``, ``gpipe``, ``1f1b``, the simulation-only ``interleaved``) answers everything
that differs between schedules -- which stages recompute, how many micro-batches a stage stashes,
what each segment costs when stages are balanced, how to build the pipeline's policies -- so
the runtime, the partitioner, the simulator and the auto-configurator ask it instead of
branching on the kind's name. The concrete kinds and their registry
(:func:`varuna.core.schedule.schedule_kind`) live in ``varuna/core/schedule.py`` and
``varuna/core/interleaved.py``; this module holds only the base class, so both can subclass it
without importing each other. Pure Python, no torch.

Example::

    >>> from varuna.core.schedule import schedule_kind
    >>> kind = schedule_kind("1f1b")
    >>> kind.recomputes(3, 2, recompute=True)   # the last 1f1b stage runs each B right after its F
    False
    >>> kind.balancing_costs([1.0], [1.0], [2.0], recompute=True)
    ([4.0], [3.0])
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

__all__ = ["Pipeline", "ScheduleKind"]


class Pipeline(Protocol):
    """One pipeline's schedule as the simulator drives it: a fresh policy per stage (device) and
    whether that stage's list recomputes (``varuna.core.schedule.Schedule`` is one)."""

    def policy(self, stage: int, *, stash_headroom: int = ...) -> Any: ...

    def recomputes(self, stage: int) -> bool: ...


class ScheduleKind(ABC):
    """Every fact of one schedule kind (stateless; one instance per kind in the registry).

    Subclasses set :attr:`name` and implement :meth:`_recomputes`, :meth:`stash_peak` and
    :meth:`pipeline`; the rest derives from those.
    """

    #: The name users pass (``--schedule``, ``VarunaConfig.schedule``, ``SimConfig.schedule``).
    name: ClassVar[str]
    #: Whether varuna's runtime executes it (else: simulation only).
    runtime: ClassVar[bool] = True
    #: Whether the executor may run a ready task ahead of a blocked one (``StagePolicy``).
    opportunistic: ClassVar[bool] = False
    #: Whether ``recompute=False`` is honoured (varuna always recomputes, except on its last stage).
    recompute_optional: ClassVar[bool] = True
    #: Whether a device holds several model chunks (its tasks carry a ``chunk``).
    chunked: ClassVar[bool] = False
    #: Whether the backward is split into B (input gradient) and a later W (weight gradients).
    splits_backward: ClassVar[bool] = False
    #: Whether auto-config weighs this kind when the job names none (Note [Joint plan] in
    #: simulator/autoconfig.py): the paper's kind with recompute, and PipeDream-Flush without
    #: it for models that fit.
    planned_by_default: ClassVar[bool] = False
    #: Versions of its weights a stage keeps: 1 for the synchronous kinds (a flush after every
    #: mini-batch); 2 for PipeDream-2BW (``TwoBWKind`` in ``varuna/core/schedule.py``), whose
    #: gradients are one step stale and whose mini-batches run back to back.
    weight_versions: ClassVar[int] = 1

    def __repr__(self) -> str:
        return f"schedule_kind({self.name!r})"

    @abstractmethod
    def _recomputes(self, *, last: bool, recompute: bool) -> bool:
        """Whether a (virtual) stage recomputes: the last one if ``last``, else any other."""

    @abstractmethod
    def stash_peak(self, num_stages: int, stage: int, num_microbatches: int, *, chunks: int = 1) -> int:
        """Most micro-batches (chunk activations when chunked) stage ``stage`` holds at once:
        forward done, backward not, when it runs its list with inputs on time."""

    @abstractmethod
    def pipeline(
        self, num_stages: int, num_microbatches: int, *, recompute: bool = True, chunks: int = 1
    ) -> Pipeline:
        """The per-stage policies of one pipeline of this kind (what the simulator drives)."""

    def window(
        self, num_stages: int, num_microbatches: int, steps: int, *, recompute: bool = True, chunks: int = 1
    ) -> Pipeline:
        """The lists of ``steps`` consecutive mini-batches run back to back (micro-batch
        ``s·Nm + i`` is micro-batch i of the s-th): only a kind without a flush between
        mini-batches has one longer than a single mini-batch."""
        if steps != 1:
            raise ValueError(
                f"the {self.name} schedule flushes the pipeline after every mini-batch: its window is one "
                "mini-batch (steps=1); only an asynchronous kind (2bw) runs mini-batches back to back"
            )
        return self.pipeline(num_stages, num_microbatches, recompute=recompute, chunks=chunks)

    def effective_recompute(self, recompute: bool) -> bool:
        """The recompute flag this kind runs with when asked for ``recompute``."""
        return recompute if self.recompute_optional else True

    def recomputes(self, num_stages: int, stage: int, *, recompute: bool) -> bool:
        """Whether ``stage`` (of ``num_stages``) runs forwards without a graph and recomputes them.

        With two or more micro-batches this is whether its list has R tasks; with one, gpipe and
        1f1b keep the graph everywhere (F0 directly precedes B0). For a chunked kind, ``stage``
        is a virtual stage of ``num_stages`` = P·chunks (interleaved: the last one recomputes
        only when Nm == P).

        >>> from varuna.core.schedule import schedule_kind
        >>> [schedule_kind("varuna").recomputes(3, k, recompute=False) for k in range(3)]
        [True, True, False]
        """
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")
        return self._recomputes(last=stage == num_stages - 1, recompute=recompute)

    def balancing_costs(
        self,
        fwd_s: Sequence[float],
        recompute_s: Sequence[float],
        bwd_s: Sequence[float],
        *,
        recompute: bool,
    ) -> tuple[list[float], list[float]]:
        """Per segment, its cost on a non-last stage and on the last stage, for
        ``varuna.core.partition.balanced_stages``: F+R+B where that stage recomputes, else F+B.

        >>> from varuna.core.schedule import schedule_kind
        >>> schedule_kind("gpipe").balancing_costs([1.0, 2.0], [1.0, 2.0], [2.0, 4.0], recompute=False)
        ([3.0, 6.0], [3.0, 6.0])
        """
        if not len(fwd_s) == len(recompute_s) == len(bwd_s):
            raise ValueError("forward, recompute and backward cost lists differ in length")
        fb = [f + b for f, b in zip(fwd_s, bwd_s)]
        full = [x + r for x, r in zip(fb, recompute_s)]
        inner = full if self._recomputes(last=False, recompute=recompute) else fb
        last = full if self._recomputes(last=True, recompute=recompute) else fb
        return inner, last

    def chunks_per_device(self, chunks: int) -> int:
        """Model chunks (virtual stages) per device when ``chunks`` is asked for: 1 unless chunked."""
        return chunks if self.chunked else 1

    def check_chunks(self, chunks: int) -> None:
        """Raise ValueError if this kind cannot run ``chunks`` model chunks per device."""
        if not self.chunked and chunks != 1:
            raise ValueError(
                f"chunks={chunks} applies to the interleaved schedule only; use chunks=1 for {self.name}"
            )

    def unsupported(self, num_stages: int, num_microbatches: int) -> str | None:
        """Why ``num_microbatches`` per replica cannot run on ``num_stages`` stages, or None."""
        return None

    def label(self, *, recompute: bool, chunks: int) -> str:
        """Short name for tables, e.g. ``gpipe+recompute`` or ``interleaved(v=2)``."""
        text = self.name + (f"(v={chunks})" if self.chunked else "")
        return text + ("+recompute" if self.recompute_optional and recompute else "")
