"""What auto-config is asked to plan (:class:`PlanRequest`): one value object that the launcher
(``varuna-launch --calibration``), the simulator's command line (``varuna-simulate``) and the
manager's planner build and hand to the simulator's auto-config
(``simulator.autoconfig.autoconfigure_request``), instead of each passing its own keywords.

A request is validated when it is made (one ``ValueError`` line naming the option and the fix):
the global batch, the micro-batch size, the forced pipeline depth P and the chunks are positive,
the schedule is a known kind and the slots are counts. Nothing downstream checks them again.

Example::

    >>> req = PlanRequest.for_hosts([4, 4], calibration="cal.json", global_batch_size=32, schedule="1f1b")
    >>> req.gpus, req.host_slots, req.gpu_memory_bytes is None
    (8, (4, 4), True)
    >>> PlanRequest(calibration="cal.json", global_batch_size=32, pipeline_depth=0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: --pipeline-depth must be an integer >= 1, got 0
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from varuna.core.calibration import Calibration
from varuna.core.schedule import DEFAULT_SCHEDULE, schedule_kind
from varuna.core.selective_recompute import check_recompute_segments

__all__ = ["PlanRequest", "check_count"]


def check_count(option: str, value: Any) -> None:
    """``ValueError`` (one line naming ``option``) unless ``value`` is an integer >= 1: the one check
    of P, D, chunks, batch sizes where a plan is made (launcher, simulator, manager).

    Example::

        >>> check_count("--data-parallel", 2)
        >>> check_count("--data-parallel", 0)
        Traceback (most recent call last):
        ValueError: --data-parallel must be an integer >= 1, got 0
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{option} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """A job to plan: the workload (global batch, schedule, chunks, a fixed m), the machines
    (slots per host, a memory cap) and the costs (the calibration). Field names follow the
    command-line options of :func:`varuna.core.cli.add_planning_args`.

    Example::

        >>> PlanRequest(calibration=None, global_batch_size=24, gpus=3).host_slots
        1
    """

    calibration: str | os.PathLike | Calibration | None
    """The calibration file (path, loaded by :meth:`load_calibration`) or a loaded one; None:
    nothing to simulate (the manager's fallback rule plans without costs)."""
    global_batch_size: int
    """Examples per optimizer step (``--global-batch-size``)."""
    gpus: int = 1
    """G: the accelerators (worker slots) to plan for."""
    host_slots: int | tuple[int, ...] = 1
    """Slots per host (consecutive ranks fill a host), or each host's own in host order; the
    simulator places ranks with it."""
    schedule: str | None = DEFAULT_SCHEDULE
    """The schedule kind the job runs (``--schedule``); None: auto-config picks it among
    ``varuna.core.schedule.PLANNED_KINDS`` with the rest of the plan (Note [Joint plan] in
    simulator/autoconfig.py)."""
    chunks: int = 1
    """Model chunks per process for the interleaved kinds (``--chunks``)."""
    micro_batch_size: int | None = None
    """A fixed m (``--micro-batch-size``); None: auto-config chooses it."""
    pipeline_depth: int | None = None
    """A fixed P; None: auto-config chooses it."""
    gpu_memory_bytes: int | None = None
    """Memory per accelerator (``--gpu-memory``); None: unchecked."""
    recompute: bool | None = True
    """Activation recompute for gpipe/1f1b/interleaved (varuna always recomputes); None:
    auto-config chooses it (off wherever memory allows; what :meth:`from_args`, i.e.
    ``varuna-launch`` without a recompute flag, asks for)."""
    shard_optimizer: bool | None = False
    """Optimizer state sharded over each stage's replicas; None: auto-config chooses it (on only
    where memory needs it; :meth:`from_args`'s default)."""
    recompute_segments: tuple[int, ...] | None = None
    """The segments a recomputed micro-batch recomputes (``--recompute-segments``, Note
    [Selective recompute]); None: auto-config chooses them where memory binds, else whole stages."""

    def __post_init__(self) -> None:
        check_count("--global-batch-size", self.global_batch_size)
        check_count("--chunks", self.chunks)
        if self.micro_batch_size is not None:
            check_count("--micro-batch-size", self.micro_batch_size)
        if self.pipeline_depth is not None:
            check_count("--pipeline-depth", self.pipeline_depth)
        if self.schedule is not None:
            schedule_kind(self.schedule)  # "unknown schedule kind ..." naming the choices
        check_count("--gpus", self.gpus)
        slots = self.host_slots
        if isinstance(slots, int):
            check_count("--procs-per-host", slots)
        else:
            object.__setattr__(self, "host_slots", tuple(slots))
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.host_slots):
                raise ValueError(f"host slots {self.host_slots} must be counts >= 0, one per host")
        segments = self.recompute_segments
        if segments is not None:
            problem = check_recompute_segments(segments)
            if problem is not None:
                raise ValueError(problem.replace("pipeline.recompute_segments", "--recompute-segments"))
            object.__setattr__(self, "recompute_segments", tuple(sorted(set(segments))))
            if self.schedule is not None and schedule_kind(self.schedule).splits_backward:
                raise ValueError(f"--recompute-segments is not supported with --schedule {self.schedule} "
                                 "(its split backward needs one graph per stage); drop one of them")
        memory = self.gpu_memory_bytes
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory < 1):
            raise ValueError(f"--gpu-memory must be a size > 0, e.g. 16GiB, got {memory!r}")

    def load_calibration(self) -> Calibration | None:
        """The calibration, loaded from its path if need be (``ValueError``, one line, when the
        file cannot be read or is not a calibration)."""
        if self.calibration is None or isinstance(self.calibration, Calibration):
            return self.calibration
        return Calibration.load(self.calibration)

    @classmethod
    def for_hosts(cls, slots: Sequence[int], **fields: Any) -> PlanRequest:
        """A request for hosts with ``slots`` each (G their sum; ranks placed host by host).

        Example::

            >>> PlanRequest.for_hosts([2, 1], calibration=None, global_batch_size=8).gpus
            3
        """
        return cls(gpus=sum(slots), host_slots=tuple(slots), **fields)

    @classmethod
    def from_args(cls, args: Any, **fields: Any) -> PlanRequest:
        """A request from the options of :func:`varuna.core.cli.add_planning_args` (``args`` the
        parsed namespace); ``fields`` give the rest (``gpus=``, ``host_slots=``, ``recompute=``,
        ``chunks=`` for another default). ``ValueError`` (one line) when there is no
        ``--global-batch-size`` to plan for.

        Example::

            req = PlanRequest.from_args(parser.parse_args(argv), gpus=8, host_slots=(4, 4))
        """
        if args.global_batch_size is None:
            raise ValueError("--calibration needs --global-batch-size M (the mini-batch size to plan for)")
        given = {
            "calibration": args.calibration,
            "global_batch_size": args.global_batch_size,
            "schedule": args.schedule,  # None: planned with the rest (Note [Joint plan])
            "micro_batch_size": args.micro_batch_size,
            "gpu_memory_bytes": args.gpu_memory,
            "recompute_segments": getattr(args, "recompute_segments", None),
        }
        default_chunks = fields.pop("chunks", 1)  # the caller's default when --chunks is not given
        given["chunks"] = default_chunks if args.chunks is None else args.chunks
        # Left to auto-config unless the caller says (Note [Joint plan] in simulator/autoconfig.py).
        given.update(recompute=None, shard_optimizer=None)
        return cls(**{**given, **fields})
