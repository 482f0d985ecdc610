"""P×D for the slots a job may use: as given on the command line, or chosen by the simulator's
auto-config from a calibration (:func:`resolve_layout`), and the run plan exported to every
worker (:meth:`Layout.run_plan`, a :class:`varuna.core.env.RunPlan`).

Auto-config (``--calibration FILE --global-batch-size M``, P not given: a
:class:`varuna.core.planning.PlanRequest`) plans for a schedule kind (``--schedule``, default
``varuna``) and also picks the micro-batch size m (unless ``--micro-batch-size`` fixes it) and the
segment→stage map. Every worker's engine applies the plan rule (Note [Run plan] in
:mod:`varuna.core.env`): a field the script leaves unset takes the plan's value, a different one is
refused in one line.

Example::

    >>> layout = resolve_layout(slots=[2, 2], pipeline_depth=2)
    >>> (layout.pipeline_depth, layout.data_parallel)
    (2, 2)
    >>> layout.run_plan(global_batch_size=32).to_env()
    {'VARUNA_GLOBAL_BATCH_SIZE': '32'}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from varuna.core.env import RunPlan
from varuna.core.planning import PlanRequest
from varuna.core.schedule import schedule_kind

__all__ = ["LAYOUT_REQUIRED", "Layout", "auto_configure", "resolve_layout"]


LAYOUT_REQUIRED = (
    "argument required: --pipeline-depth P (or --calibration FILE --global-batch-size M for auto-config)"
)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """P×D (and, from auto-config, m) chosen for the slots that are available.

    Example::

        >>> resolve_layout(slots=[2, 2, 1], pipeline_depth=2)  # doctest: +NORMALIZE_WHITESPACE
        Layout(pipeline_depth=2, data_parallel=2, micro_batch_size=None, stage_ranges=None,
               schedule=None, replica_shares=None, stage_speeds=None, recompute=None,
               recompute_segments=None, shard_optimizer=None, note='')
    """

    pipeline_depth: int
    data_parallel: int
    micro_batch_size: int | None = None
    """m picked by auto-config (exported to workers as ``VARUNA_MICRO_BATCH_SIZE``), else None."""
    stage_ranges: tuple[tuple[int, int], ...] | None = None
    """Segment→stage map auto-config simulated (exported as ``VARUNA_STAGE_RANGES``), else None."""
    schedule: str | None = None
    """Schedule kind auto-config planned for (exported as ``VARUNA_SCHEDULE``), else None."""
    replica_shares: tuple[int, ...] | None = None
    """Micro-batches per replica on hosts of mixed VM types (``VARUNA_REPLICA_SHARES``), else None."""
    stage_speeds: tuple[float, ...] | None = None
    """Relative speed of each stage's VM type (``VARUNA_STAGE_SPEEDS``), else None."""
    recompute: bool | None = None
    """Recompute as auto-config chose it with the schedule (``VARUNA_RECOMPUTE``), else None."""
    recompute_segments: tuple[int, ...] | None = None
    """The segments recomputed micro-batches recompute, as auto-config chose them for the memory
    (``VARUNA_RECOMPUTE_SEGMENTS``), else None (whole stages)."""
    shard_optimizer: bool | None = None
    """Sharded optimizer state as auto-config chose it (``VARUNA_SHARD_OPTIMIZER``), else None."""
    note: str = ""
    """How auto-config chose it, for the launcher's log."""

    def run_plan(
        self,
        *,
        global_batch_size: int | None = None,
        schedule: str | None = None,
        chunks: int | None = None,
        micro_batch_size: int | None = None,
        recompute_segments: tuple[int, ...] | None = None,
    ) -> RunPlan:
        """The plan every worker gets: ``global_batch_size``, ``schedule``, ``chunks`` (model
        chunks per process, interleaved kinds), ``micro_batch_size`` and ``recompute_segments`` as
        the user gave them (the schedule, m and set auto-config planned for when none is given),
        the stage ranges when auto-config chose them; ``None`` fields are not exported.

        Example::

            >>> layout = Layout(pipeline_depth=2, data_parallel=1, micro_batch_size=4, schedule="1f1b")
            >>> layout.run_plan().to_env()
            {'VARUNA_MICRO_BATCH_SIZE': '4', 'VARUNA_SCHEDULE': '1f1b'}
        """
        return RunPlan(
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size if micro_batch_size is not None else self.micro_batch_size,
            schedule=schedule if schedule is not None else self.schedule,
            chunks=chunks,
            stage_ranges=self.stage_ranges,
            replica_shares=self.replica_shares,
            stage_speeds=self.stage_speeds,
            recompute=self.recompute,
            recompute_segments=self.recompute_segments if recompute_segments is None else recompute_segments,
            shard_optimizer=self.shard_optimizer,
        )


def auto_configure(request: PlanRequest, *, progress: bool | None = False) -> Layout:
    """The simulator's fastest P×D (and m, and the stage ranges) for ``request`` (a
    :class:`varuna.core.planning.PlanRequest`: G accelerators on hosts with their slots, running
    its schedule; with ``chunks`` model chunks per process for the interleaved kinds, whose stage
    ranges are then P·chunks virtual stages); ``progress``: its progress bar
    (``varuna.core.progress``).

    The simulator is imported here, not at module load: the launcher must work on hosts where
    only the runtime is installed, as long as P is given explicitly. ``ValueError`` carries
    auto-config's reason when nothing fits (e.g. the smallest P that fits in memory exceeds G).
    """
    try:
        from simulator.autoconfig import autoconfigure_request
    except ImportError as exc:
        raise ValueError(
            f"--calibration needs the simulator (simulator/autoconfig.py), which cannot be imported here"
            f" ({exc}); give --pipeline-depth P instead"
        ) from None
    result = autoconfigure_request(request, progress=progress)
    best = result.best
    cfg = best.config
    speed = f", simulated {best.examples_per_s:.3g} examples/s" if best.examples_per_s else ""
    kind = schedule_kind(cfg.schedule)
    chosen = kind.label(recompute=cfg.recompute, chunks=cfg.chunks) + (
        " + sharded optimizer state" if cfg.shard_optimizer else "") + (
        "" if cfg.recompute_segments is None
        else f" recomputing segments {','.join(map(str, cfg.recompute_segments)) or 'none'}")
    return Layout(
        pipeline_depth=best.num_stages,
        data_parallel=best.num_replicas,
        micro_batch_size=best.micro_batch_size,
        stage_ranges=tuple(tuple(r) for r in best.stage_segments),
        schedule=cfg.schedule,
        # Planned only where auto-config chose them (Note [Joint plan]); a given value stays the
        # script's or the engine's default.
        recompute=cfg.recompute if request.recompute is None and kind.recompute_optional else None,
        shard_optimizer=cfg.shard_optimizer if request.shard_optimizer is None else None,
        recompute_segments=cfg.recompute_segments,
        note=f"auto-config for G={request.gpus}: P={best.num_stages} D={best.num_replicas}"
        f" m={best.micro_batch_size}, {chosen}{speed}",
    )


def resolve_layout(
    *,
    slots: Sequence[int],
    pipeline_depth: int | None = None,
    data_parallel: int | None = None,
    request: PlanRequest | None = None,
    progress: bool | None = False,
) -> Layout:
    """P×D for the available ``slots`` (one count per host): P and D as given; P given, D the
    most replicas that fit; or neither, from auto-config on ``request`` (a
    :class:`~varuna.core.planning.PlanRequest` with a calibration, planned for these hosts;
    ``progress``: its bar, see :func:`auto_configure`). P and D were checked where they were
    given (the command line, ``PlanRequest``); ``ValueError`` says why nothing fits.

    Example::

        >>> resolve_layout(slots=[1, 1], pipeline_depth=4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: the hosts hold 2 slot(s), fewer than the 4 stages of --pipeline-depth 4; ...
    """
    capacity = sum(slots)
    if pipeline_depth is not None:
        if capacity < pipeline_depth:
            raise ValueError(
                f"the hosts hold {capacity} slot(s), fewer than the {pipeline_depth} stages of"
                f" --pipeline-depth {pipeline_depth}; add hosts or use a smaller --pipeline-depth"
            )
        if data_parallel is None:
            return Layout(pipeline_depth=pipeline_depth, data_parallel=capacity // pipeline_depth)
        if pipeline_depth * data_parallel > capacity:
            raise ValueError(
                f"P={pipeline_depth} × D={data_parallel} needs {pipeline_depth * data_parallel} slots but the"
                f" hosts hold {capacity}; use --data-parallel {capacity // pipeline_depth} or add hosts"
            )
        return Layout(pipeline_depth=pipeline_depth, data_parallel=data_parallel)
    if data_parallel is not None:
        raise ValueError("--data-parallel needs --pipeline-depth")
    if request is None or request.calibration is None:
        raise ValueError(LAYOUT_REQUIRED)
    return auto_configure(dataclasses.replace(request, gpus=capacity, host_slots=tuple(slots)),
                          progress=progress)
