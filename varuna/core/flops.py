"""Training FLOPs, TFLOP/s per device and MFU: the arithmetic and the peak of known accelerators.

Pure Python (no torch): the runtime (``varuna/runtime/flops.py``, per-step metrics) and the
simulator (``varuna-simulate``'s predicted TFLOP/s and time-to-train) both use it.

Note [Model FLOPs]: MFU follows PaLM's definition (Chowdhery et al. 2022, appendix B): the FLOPs
the *model* needs per step -- forward plus backward, counted as three forwards -- divided by
what the devices could do in the step's time at their peak. The forward count is the dry run's
``FlopCounterMode`` count (every matmul, batched matmul and attention kernel, 2·m·n·k each;
elementwise work and embedding lookups are not counted, as in PaLM's 6N + attention formula). A
recomputed forward (activation checkpointing) is work the hardware does but the model does not
need: it is in the *hardware* FLOPs (HFU), never in the model FLOPs (MFU), so recompute cannot make
MFU look better.

Example::

    >>> step = training_flops(fwd_flops=2e12)          # one step's forward FLOPs, whole job
    >>> step.model, step.hardware
    (6000000000000.0, 6000000000000.0)
    >>> peak_tflops("NVIDIA H100 80GB HBM3", "bf16")
    989.4
    >>> round(model_flops_utilization(tflops=494.7, peak=989.4), 3)
    0.5
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = [
    "DEVICE_PEAKS",
    "PRECISION_NAMES",
    "DevicePeak",
    "StepFlopCount",
    "check_peak_tflops",
    "device_peak",
    "model_flops_utilization",
    "peak_tflops",
    "training_flops",
]


@dataclass(frozen=True)
class DevicePeak:
    """Dense (no sparsity) peak TFLOP/s of one accelerator per math mode; None: no such mode (a T4
    has no bf16 tensor cores) or no published figure."""

    name: str
    pattern: str
    """Regular expression matched (case-insensitive) against ``torch.cuda.get_device_name()``."""
    fp32: float | None
    tf32: float | None
    bf16: float | None
    fp16: float | None
    source: str

    def tflops(self, precision: str, *, tf32: bool = False) -> float | None:
        """The peak for ``precision`` (fp32, bf16, fp16); fp32 means TF32 when ``tf32`` (matmuls
        allowed to use TF32: ``torch.backends.cuda.matmul.allow_tf32``)."""
        if precision == "fp32":
            return self.tf32 if tf32 else self.fp32
        if precision in ("bf16", "fp16"):
            return getattr(self, precision)
        raise ValueError(f"unknown precision {precision!r}; choose fp32, bf16 or fp16")


#: The precisions a peak is known for (``VarunaConfig.precision``'s values).
PRECISION_NAMES = ("fp32", "bf16", "fp16")

_NV = "https://www.nvidia.com"
#: Known accelerators, most specific pattern first (an "H100 NVL" is not an SXM H100). Datasheet
#: figures halved where NVIDIA quotes them "with sparsity"; docs/metrics.md lists the sources.
DEVICE_PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak(name="H200 NVL", pattern=r"\bh200\b.*\bnvl\b", fp32=60.0, tf32=417.5, bf16=835.5, fp16=835.5,
               source=f"{_NV}/en-us/data-center/h200/"),
    DevicePeak(name="H200 SXM", pattern=r"\bh200\b", fp32=67.0, tf32=494.7, bf16=989.4, fp16=989.4,
               source=f"{_NV}/en-us/data-center/h200/"),
    DevicePeak(name="H100 NVL", pattern=r"\bh100\b.*\bnvl\b", fp32=60.0, tf32=417.5, bf16=835.5, fp16=835.5,
               source=f"{_NV}/en-us/data-center/h100/"),
    DevicePeak(name="H100 PCIe", pattern=r"\bh100\b.*\bpcie\b", fp32=51.0, tf32=378.0, bf16=756.5, fp16=756.5,
               source=f"{_NV}/en-us/data-center/h100/"),
    DevicePeak(name="H100 SXM", pattern=r"\bh100\b", fp32=67.0, tf32=494.7, bf16=989.4, fp16=989.4,
               source=f"{_NV}/en-us/data-center/h100/"),
    DevicePeak(name="A100", pattern=r"\ba100\b", fp32=19.5, tf32=156.0, bf16=312.0, fp16=312.0,
               source=f"{_NV}/en-us/data-center/a100/"),
    # AWS's A10G: NVIDIA publishes no tensor-core figure for this variant; give peak_tflops.
    DevicePeak(name="A10G", pattern=r"\ba10g\b", fp32=31.2, tf32=None, bf16=None, fp16=None,
               source="https://aws.amazon.com/ec2/instance-types/g5/ (no tensor figure published)"),
    DevicePeak(name="A10", pattern=r"\ba10\b", fp32=31.2, tf32=62.5, bf16=125.0, fp16=125.0,
               source=f"{_NV}/en-us/data-center/products/a10-gpu/"),
    DevicePeak(name="L40S", pattern=r"\bl40s\b", fp32=91.6, tf32=183.0, bf16=362.05, fp16=362.05,
               source=f"{_NV}/en-us/data-center/l40s/"),
    DevicePeak(name="L4", pattern=r"\bl4\b", fp32=30.3, tf32=60.0, bf16=121.0, fp16=121.0,
               source=f"{_NV}/en-us/data-center/l4/"),
    DevicePeak(name="T4", pattern=r"\bt4\b", fp32=8.1, tf32=None, bf16=None, fp16=65.0,
               source=f"{_NV}/en-us/data-center/tesla-t4/"),
    DevicePeak(name="V100 PCIe", pattern=r"\bv100\b.*\bpcie\b", fp32=14.0, tf32=None, bf16=None, fp16=112.0,
               source=f"{_NV}/en-us/data-center/v100/"),
    DevicePeak(name="V100 SXM2", pattern=r"\bv100\b", fp32=15.7, tf32=None, bf16=None, fp16=125.0,
               source=f"{_NV}/en-us/data-center/v100/"),
    # GeForce: FP16/BF16 tensor throughput with FP32 accumulate (what PyTorch's matmuls use).
    DevicePeak(name="RTX 4090", pattern=r"\b4090\b", fp32=82.6, tf32=82.6, bf16=165.2, fp16=165.2,
               source="NVIDIA Ada Lovelace architecture whitepaper, appendix A"),
    DevicePeak(name="RTX 3090", pattern=r"\b3090\b", fp32=35.6, tf32=35.6, bf16=71.0, fp16=71.0,
               source="NVIDIA Ampere GA102 GPU architecture whitepaper, appendix A"),
)


def device_peak(device_name: str) -> DevicePeak | None:
    """The table's entry for a device name (``torch.cuda.get_device_name()``), or None.

    >>> device_peak("NVIDIA H100 PCIe").name, device_peak("NVIDIA L40S").name, device_peak("cpu")
    ('H100 PCIe', 'L40S', None)
    """
    for entry in DEVICE_PEAKS:
        if re.search(entry.pattern, device_name, flags=re.IGNORECASE):
            return entry
    return None


def peak_tflops(device_name: str, precision: str, *, tf32: bool = False) -> float | None:
    """Dense peak TFLOP/s of one device for a run at ``precision``; None when the device or
    the mode is not in :data:`DEVICE_PEAKS` (a CPU, an unknown card): MFU is then unknown."""
    entry = device_peak(device_name)
    return None if entry is None else entry.tflops(precision, tf32=tf32)


def check_peak_tflops(value: object, what: str) -> float | None:
    """``value`` as a peak TFLOP/s (a finite number > 0), None for None/empty; ``ValueError``
    (one line naming ``what``) otherwise.

    >>> check_peak_tflops("989.4", "VARUNA_PEAK_TFLOPS")
    989.4
    """
    if value is None or value == "":
        return None
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        v = math.nan
    if isinstance(value, bool) or not (0 < v < math.inf):
        raise ValueError(
            f"{what}={value!r} is not a peak TFLOP/s; give the device's dense peak at the run's precision "
            "as a number > 0 (e.g. 989.4 for an H100 SXM in bf16), or leave it unset"
        )
    return v


@dataclass(frozen=True)
class StepFlopCount:
    """FLOPs of one training step of the whole job (Note [Model FLOPs])."""

    model: float
    """Forward + backward = 3 × the forward FLOPs: what MFU counts."""
    hardware: float
    """``model`` plus every recomputed forward: what the devices executed (HFU)."""


def training_flops(fwd_flops: float, *, recompute_flops: float = 0.0) -> StepFlopCount:
    """One step's :class:`StepFlopCount` from its forward FLOPs (all micro-batches, all stages,
    all replicas) and the FLOPs of the forwards recomputed in it."""
    if fwd_flops < 0 or recompute_flops < 0:
        raise ValueError(f"FLOP counts must be >= 0 (got {fwd_flops}, {recompute_flops})")
    return StepFlopCount(model=3.0 * fwd_flops, hardware=3.0 * fwd_flops + recompute_flops)


def model_flops_utilization(*, tflops: float | None, peak: float | None) -> float | None:
    """``tflops`` achieved per device over the device's ``peak`` (both TFLOP/s); None when either
    is unknown."""
    if tflops is None or peak is None or peak <= 0:
        return None
    return tflops / peak
