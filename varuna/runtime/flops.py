"""FLOPs of one training step and what the devices make of them: TFLOP/s per device and MFU.

The dry run counts each segment's forward FLOPs for its micro-batch (``FlopCounterMode`` on rank
0, ``ModelProfile.fwd_flops``); :func:`share_segment_flops` broadcasts them per example, and
:func:`step_flops` turns them into the whole job's FLOPs per step -- model FLOPs (3 × forward)
and hardware FLOPs (+ the forwards the schedule recomputes), Note [Model FLOPs] in
``varuna/core/flops.py`` -- with the peak of one device (:func:`resolve_peak`:
``VarunaConfig.metrics.peak_tflops``, else ``$VARUNA_PEAK_TFLOPS``, else the table of known GPUs; unknown on
a CPU). :meth:`StepFlops.metrics` gives a step's ``tflops`` (model TFLOP/s per device, the whole
job's FLOPs over its P×D devices), ``hardware_tflops`` and ``mfu``.

The count assumes every mini-batch is shaped like the dry run's micro-batch (same sequence
length); FLOPs are linear in the number of examples, so a short last micro-batch is counted
exactly.

Example (the numbers of ``tests/test_flops.py``'s hand count)::

    >>> from varuna.core.batching import plan_microbatches
    >>> from varuna.runtime.config import MetricsConfig, VarunaConfig
    >>> from varuna.runtime.layout import Layout
    >>> cfg = VarunaConfig(global_batch_size=8, micro_batch_size=4, metrics=MetricsConfig(peak_tflops=1.0))
    >>> f = step_flops([100.0], config=cfg, layout=Layout(world=1, rank=0, P=1, D=1),
    ...                micro_plan=plan_microbatches(8, 4, 1), stage_ranges=[(0, 0)], device_name="cpu")
    >>> f.model_flops, f.metrics(step_s=1e-9)["mfu"]
    (2400.0, 2.4)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from varuna.core.batching import MicroBatch
from varuna.core.env import WorkerSettings
from varuna.core.flops import (
    check_peak_tflops,
    device_peak,
    model_flops_utilization,
    training_flops,
)
from varuna.core.schedule import schedule_kind
from varuna.cutting.split import ModelProfile
from varuna.runtime.config import VarunaConfig
from varuna.runtime.layout import Layout

__all__ = ["PEAK_ENV", "StepFlops", "device_name", "engine_flops", "resolve_peak", "share_segment_flops",
           "step_flops", "step_metrics"]

#: Overrides the table's peak TFLOP/s of one device (``VarunaConfig.peak_tflops`` wins over it).
PEAK_ENV = "VARUNA_PEAK_TFLOPS"


@dataclass(frozen=True)
class StepFlops:
    """The whole job's FLOPs per training step and the peak of one of its devices."""

    model_flops: float
    """3 × the forward FLOPs of one mini-batch (Note [Model FLOPs] in varuna/core/flops.py)."""
    hardware_flops: float
    """``model_flops`` + the recomputed forwards (the schedule's and ``recompute``'s)."""
    devices: int
    """P×D: the processes (accelerators) sharing the work."""
    peak_tflops: float | None
    """Dense peak of one device at the run's precision; None: unknown (MFU is None)."""
    peak_source: str
    """Where the peak came from: ``config``, ``$VARUNA_PEAK_TFLOPS``, the table entry, or ``unknown``."""

    def metrics(self, step_s: float) -> dict[str, float | None]:
        """``model_flops``, ``tflops`` and ``hardware_tflops`` (per device) and ``mfu`` of a step
        that took ``step_s`` seconds."""
        if not step_s > 0:
            return {"model_flops": self.model_flops, "tflops": None, "hardware_tflops": None, "mfu": None}
        per_device = 1e12 * step_s * self.devices
        tflops = self.model_flops / per_device
        return {
            "model_flops": self.model_flops,
            "tflops": tflops,
            "hardware_tflops": self.hardware_flops / per_device,
            "mfu": model_flops_utilization(tflops=tflops, peak=self.peak_tflops),
        }


def step_metrics(flops: StepFlops | None, step_s: float) -> dict[str, float | None]:
    """:meth:`StepFlops.metrics`, or every field None when nothing was counted."""
    if flops is None:
        return {"model_flops": None, "tflops": None, "hardware_tflops": None, "mfu": None}
    return flops.metrics(step_s)


def share_segment_flops(profile: ModelProfile, layout: Layout) -> list[float] | None:
    """Rank 0's per-segment forward FLOPs per example, on every rank (a collective when the world
    has several processes); None when rank 0 counted none (every rank gets None)."""
    mine: list[float] | None = None
    if profile.fwd_flops is not None and profile.flops_examples > 0:
        mine = [f / profile.flops_examples for f in profile.fwd_flops]
    if layout.world == 1:
        return mine
    n = profile.num_segments
    t = torch.zeros(n + 1, dtype=torch.float64)
    if layout.rank == 0 and mine is not None:
        t[0] = 1.0
        t[1:] = torch.tensor(mine, dtype=torch.float64)
    dist.broadcast(t, src=0)
    return t[1:].tolist() if t[0] > 0 else None


def device_name(device: torch.device) -> str:
    """What the peak table is matched against: the CUDA device's name, else the device type."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def resolve_peak(
    name: str, precision: str, configured: float | None, environ: Mapping[str, str] | None = None, *,
    settings: WorkerSettings | None = None,
) -> tuple[float | None, str]:
    """(peak TFLOP/s of one device, where it came from): ``configured`` (the config), else
    ``$VARUNA_PEAK_TFLOPS`` (``settings.peak_tflops``; default parsed from ``environ``, default
    ``os.environ``), else the table entry for ``name`` at ``precision`` (TF32 counts for fp32 when
    PyTorch lets matmuls use it), else (None, "unknown").

    >>> resolve_peak("NVIDIA A100-SXM4-80GB", "bf16", None, {})
    (312.0, 'A100')
    >>> resolve_peak("cpu", "fp32", None, {"VARUNA_PEAK_TFLOPS": "2.5"})
    (2.5, '$VARUNA_PEAK_TFLOPS')
    """
    if configured is not None:
        return check_peak_tflops(configured, "metrics.peak_tflops"), "config"
    settings = WorkerSettings.from_env(environ) if settings is None else settings
    if settings.peak_tflops is not None:
        return settings.peak_tflops, f"${PEAK_ENV}"
    entry = device_peak(name)
    if entry is None:
        return None, "unknown"
    tf32 = precision == "fp32" and torch.backends.cuda.matmul.allow_tf32
    value = entry.tflops(precision, tf32=tf32)
    return value, entry.name if value is not None else "unknown"


def _recomputed_flops(
    per_example: Sequence[float],
    config: VarunaConfig,
    layout: Layout,
    micro_plan: Sequence[Sequence[MicroBatch]],
    stage_ranges: Sequence[tuple[int, int]],
) -> float:
    """FLOPs of the forwards every stage of every replica recomputes in one step."""
    kind = schedule_kind(config.schedule)
    P = layout.P
    chunks = len(stage_ranges) // P
    seg_cost = [sum(per_example[a : b + 1]) for a, b in stage_ranges]  # per example, per virtual stage
    total = 0.0
    for mbs in micro_plan:
        pipe = kind.pipeline(P, len(mbs), recompute=config.pipeline.recompute, chunks=chunks)
        for k in range(P):
            for item in pipe.recomputed(k):
                i, c = item if chunks > 1 else (item, 0)
                total += mbs[i].size * seg_cost[c * P + k]
    return total


def engine_flops(engine) -> StepFlops | None:
    """The :class:`StepFlops` of an engine whose stages are assigned (its ``profile``, ``layout``,
    ``config``, ``micro_plan``, ``stage_ranges`` and ``device``): a collective over its world."""
    return step_flops(share_segment_flops(engine.profile, engine.layout), config=engine.config,
                      layout=engine.layout, micro_plan=engine.micro_plan, stage_ranges=engine.stage_ranges,
                      device_name=device_name(engine.device), settings=engine.env.settings)


def step_flops(
    per_example: Sequence[float] | None,
    *,
    config: VarunaConfig,
    layout: Layout,
    micro_plan: Sequence[Sequence[MicroBatch]],
    stage_ranges: Sequence[tuple[int, int]],
    device_name: str,
    settings: WorkerSettings | None = None,
) -> StepFlops | None:
    """The job's :class:`StepFlops` from each segment's forward FLOPs per example (None: not
    counted, then None). Every rank computes the same value (no communication). ``settings``:
    where ``$VARUNA_PEAK_TFLOPS`` comes from (:func:`resolve_peak`). Planned fields the config
    left unset count as their defaults (``VarunaConfig.fill_planned_defaults``)."""
    if per_example is None:
        return None
    if config.schedule is None or config.pipeline.recompute is None:
        config = dataclasses.replace(config)
        config.fill_planned_defaults()
    fwd = sum(per_example) * config.global_batch_size
    count = training_flops(fwd, recompute_flops=_recomputed_flops(
        per_example, config, layout, micro_plan, stage_ranges))
    peak, source = resolve_peak(device_name, config.precision, config.metrics.peak_tflops, settings=settings)
    return StepFlops(model_flops=count.model, hardware_flops=count.hardware, devices=layout.world,
                     peak_tflops=peak, peak_source=source)
