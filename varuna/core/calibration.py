"""The calibration file: measured primitive costs of one model on one kind of host (paper §4.3, Table 2).

The profiler (``varuna-profile``) is its only producer; the simulator and the auto-configurator read
it. It is a versioned JSON document; every time is in seconds and every size in bytes. The schema
is documented field by field in ``docs/calibration.md``. Pure Python: no torch import, so the
simulator runs where no accelerator (or no torch) exists.

Quantities that depend on the micro-batch size ``m`` are stored as lists parallel to the top-level
``micro_batch_sizes``; queries at an ``m`` that was not measured interpolate (or extrapolate)
linearly in ``m`` from the measured points, and fail with a fix-it message when fewer than two
exist.

Example::

    >>> cal = Calibration.synthetic([0.01, 0.02, 0.01], micro_batch_sizes=(1, 2))
    >>> round(cal.fwd_s(1, 4), 6)   # segment 1 at m=4, extrapolated from m=1, 2
    0.08
    >>> cal2 = Calibration.from_dict(cal.to_dict())
    >>> cal2.bwd_s(1, 2) == cal.bwd_s(1, 2)
    True
"""

from __future__ import annotations

import bisect
import datetime
import json
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CALIBRATION_VERSION",
    "ComputeStat",
    "SendStat",
    "SegmentCalibration",
    "CutPointCalibration",
    "LinkPoint",
    "LinkModel",
    "AllReducePoint",
    "AllReduceModel",
    "ModelInfo",
    "HostInfo",
    "RuntimeOverheads",
    "Calibration",
    "fit_link_model",
    "fit_allreduce_model",
]

#: The schema version this code reads and writes. Bump on any incompatible change.
CALIBRATION_VERSION = 1

_FIX = "re-run varuna-profile"
# The runtime overheads are measured by running the engine itself, not by varuna-profile
# (docs/calibration.md, section runtime_overheads).
_RUNTIME_FIX = (
    "measure it again (docs/simulator.md, Validation) or remove the 'runtime_overheads' section "
    "(the simulator then assumes no runtime overheads)"
)
_FREE_BW = 1e18  # bytes/s of the synthetic "free" links


# ---------------------------------------------------------------------------------------------
# Reading helpers: every error names the source file and the dotted field path, on one line.


class _Reader:
    def __init__(self, source: str):
        self.source = source

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.source}: {message}")

    def get(
        self, obj: Any, key: str, path: str, kind: str, *, optional: bool = False, fix: str = _FIX
    ) -> Any:
        full = f"{path}.{key}" if path else key
        if not isinstance(obj, dict):
            raise self.fail(f"field '{path or '<top level>'}' must be an object — {fix}")
        if key not in obj or (obj[key] is None and not optional):
            raise self.fail(f"missing field '{full}' — {fix}")
        return self.check(obj[key], full, kind, optional=optional, fix=fix)

    def check(self, value: Any, path: str, kind: str, *, optional: bool = False, fix: str = _FIX) -> Any:
        if value is None and optional:
            return None
        ok = {
            "num": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
            "int": isinstance(value, int) and not isinstance(value, bool),
            "str": isinstance(value, str),
            "list": isinstance(value, list),
            "dict": isinstance(value, dict),
        }[kind]
        if not ok:
            names = {
                "num": "a finite number",
                "int": "an integer",
                "str": "a string",
                "list": "a list",
                "dict": "an object",
            }
            raise self.fail(
                f"field '{path}' must be {names[kind]}, got {type(value).__name__} {value!r:.40} — {fix}"
            )
        if kind in ("num", "int") and value < 0:
            raise self.fail(f"field '{path}' must be >= 0, got {value} — {fix}")
        return value

    def per_m(self, obj: Any, key: str, path: str, n: int, kind: str, *, optional: bool = False) -> Any:
        """A list with one entry per measured micro-batch size."""
        values = self.get(obj, key, path, "list", optional=optional)
        if values is None:
            return None
        full = f"{path}.{key}"
        if len(values) != n:
            raise self.fail(
                f"field '{full}' has {len(values)} entries but micro_batch_sizes has {n} — {_FIX}"
            )
        return [self.check(v, f"{full}[{j}]", kind) for j, v in enumerate(values)]


# ---------------------------------------------------------------------------------------------
# Schema


@dataclass(kw_only=True, frozen=True)
class ComputeStat:
    """A repeated compute measurement: ``median`` and ``spread`` (interquartile range), seconds."""

    median: float
    spread: float = 0.0

    def to_dict(self) -> dict:
        return {"median": self.median, "spread": self.spread}

    @classmethod
    def _read(cls, r: _Reader, obj: Any, path: str) -> ComputeStat:
        return cls(median=r.get(obj, "median", path, "num"), spread=r.get(obj, "spread", path, "num"))


@dataclass(kw_only=True, frozen=True)
class SendStat:
    """A repeated send-time measurement: ``mean`` and ``jitter`` (standard deviation), seconds."""

    mean: float
    jitter: float = 0.0

    def to_dict(self) -> dict:
        return {"mean": self.mean, "jitter": self.jitter}

    @classmethod
    def _read(cls, r: _Reader, obj: Any, path: str) -> SendStat:
        return cls(mean=r.get(obj, "mean", path, "num"), jitter=r.get(obj, "jitter", path, "num"))


@dataclass(kw_only=True)
class SegmentCalibration:
    """Costs of one segment (the code between two consecutive cut-points).

    Lists have one entry per top-level ``micro_batch_sizes`` entry.
    """

    fwd_s: list[ComputeStat]
    """Forward time F_i(m)."""
    bwd_s: list[ComputeStat]
    """Backward time B_i(m), excluding any recompute."""
    recompute_s: list[ComputeStat]
    """Recompute time R_i(m): the forward re-run with autograd recording (about F_i(m))."""
    param_bytes: int
    """Bytes of this segment's parameters."""
    grad_bytes: int
    """Bytes of this segment's gradients (what the data-parallel all-reduce moves)."""
    optimizer_bytes: int
    """Bytes of this segment's optimizer state (e.g. Adam's two moments)."""
    stashed_input_bytes: list[int]
    """Bytes kept per in-flight micro-batch when this segment starts a stage (its input)."""
    activation_bytes: list[int]
    """Bytes of activations alive for one micro-batch during its recompute/backward."""

    def to_dict(self) -> dict:
        return {
            "fwd_s": [s.to_dict() for s in self.fwd_s],
            "bwd_s": [s.to_dict() for s in self.bwd_s],
            "recompute_s": [s.to_dict() for s in self.recompute_s],
            "param_bytes": self.param_bytes,
            "grad_bytes": self.grad_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "stashed_input_bytes": list(self.stashed_input_bytes),
            "activation_bytes": list(self.activation_bytes),
        }

    @classmethod
    def _read(cls, r: _Reader, obj: Any, path: str, n: int) -> SegmentCalibration:
        stats = {}
        for k in ("fwd_s", "bwd_s", "recompute_s"):
            raw = r.per_m(obj, k, path, n, "dict")
            stats[k] = [ComputeStat._read(r, v, f"{path}.{k}[{j}]") for j, v in enumerate(raw)]
        return cls(
            **stats,
            param_bytes=r.get(obj, "param_bytes", path, "int"),
            grad_bytes=r.get(obj, "grad_bytes", path, "int"),
            optimizer_bytes=r.get(obj, "optimizer_bytes", path, "int"),
            stashed_input_bytes=r.per_m(obj, "stashed_input_bytes", path, n, "int"),
            activation_bytes=r.per_m(obj, "activation_bytes", path, n, "int"),
        )


@dataclass(kw_only=True)
class CutPointCalibration:
    """One cut-point (between segment i and i+1): what crosses it and how long sending takes.

    The gradient crossing backwards has the same size as the activation. Send measurements are
    ``None`` where that kind of link was not available to the profiler (e.g. a single host).
    """

    name: str
    act_bytes: list[int]
    """Bytes of the activation crossing this cut-point for one micro-batch of size m."""
    act_send_intra_s: list[SendStat] | None = None
    act_send_inter_s: list[SendStat] | None = None
    grad_send_intra_s: list[SendStat] | None = None
    grad_send_inter_s: list[SendStat] | None = None

    _SENDS = ("act_send_intra_s", "act_send_inter_s", "grad_send_intra_s", "grad_send_inter_s")

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"name": self.name, "act_bytes": list(self.act_bytes)}
        for k in self._SENDS:
            v = getattr(self, k)
            out[k] = None if v is None else [s.to_dict() for s in v]
        return out

    @classmethod
    def _read(cls, r: _Reader, obj: Any, path: str, n: int) -> CutPointCalibration:
        sends = {}
        for k in cls._SENDS:
            raw = r.per_m(obj, k, path, n, "dict", optional=True)
            if raw is not None:
                raw = [SendStat._read(r, v, f"{path}.{k}[{j}]") for j, v in enumerate(raw)]
            sends[k] = raw
        return cls(
            name=r.get(obj, "name", path, "str"), act_bytes=r.per_m(obj, "act_bytes", path, n, "int"), **sends
        )


@dataclass(kw_only=True, frozen=True)
class LinkPoint:
    """One point-to-point measurement: ``bytes`` sent, mean time and jitter (std) in seconds."""

    bytes: int
    mean_s: float
    jitter_s: float = 0.0

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "mean_s": self.mean_s, "jitter_s": self.jitter_s}

    @classmethod
    def _read(cls, r: _Reader, obj: Any, path: str) -> LinkPoint:
        return cls(
            bytes=r.get(obj, "bytes", path, "int"),
            mean_s=r.get(obj, "mean_s", path, "num"),
            jitter_s=r.get(obj, "jitter_s", path, "num"),
        )


@dataclass(kw_only=True)
class LinkModel:
    """Fitted point-to-point model of one kind of link: ``time = latency_s + bytes / bandwidth``.

    ``jitter_s`` is the standard deviation of a message's time around that mean.
    """

    latency_s: float
    bandwidth_bytes_per_s: float
    jitter_s: float = 0.0
    points: list[LinkPoint] = field(default_factory=list)
    """The measurements the model was fitted to (may be empty for a synthetic file)."""

    def time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def to_dict(self) -> dict:
        return {
            "latency_s": self.latency_s,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "jitter_s": self.jitter_s,
            "points": [p.to_dict() for p in self.points],
        }

    @classmethod
    def _read(cls, r: _Reader, obj: Any, path: str) -> LinkModel:
        bw = r.get(obj, "bandwidth_bytes_per_s", path, "num")
        if bw <= 0:
            raise r.fail(f"field '{path}.bandwidth_bytes_per_s' must be > 0, got {bw} — {_FIX}")
        pts = r.get(obj, "points", path, "list")
        return cls(
            latency_s=r.get(obj, "latency_s", path, "num"),
            bandwidth_bytes_per_s=bw,
            jitter_s=r.get(obj, "jitter_s", path, "num"),
            points=[LinkPoint._read(r, p, f"{path}.points[{j}]") for j, p in enumerate(pts)],
        )


@dataclass(kw_only=True, frozen=True)
class AllReducePoint:
    """One all-reduce measurement: the gradients of ``segment`` (or None: a synthetic buffer) over a
    ring of ``ring_size`` ranks, with ``concurrent`` all-reduces sharing each host's NIC."""

    segment: int | None
    ring_size: int
    concurrent: int
    bytes: int
    time_s: float

    def to_dict(self) -> dict:
        return {
            "segment": self.segment,
            "ring_size": self.ring_size,
            "concurrent": self.concurrent,
            "bytes": self.bytes,
            "time_s": self.time_s,
        }

    @classmethod
    def _read(cls, r: _Reader, obj: Any, path: str) -> AllReducePoint:
        return cls(
            segment=r.get(obj, "segment", path, "int", optional=True),
            ring_size=r.get(obj, "ring_size", path, "int"),
            concurrent=r.get(obj, "concurrent", path, "int"),
            bytes=r.get(obj, "bytes", path, "int"),
            time_s=r.get(obj, "time_s", path, "num"),
        )


@dataclass(kw_only=True)
class AllReduceModel:
    """Fitted ring all-reduce model (see Note [All-reduce model]).

    ``time = 2(D-1)/D * bytes / bandwidth * (1 + contention * (k-1)) + (D-1) * latency``
    for a ring of D ranks with k all-reduces concurrently sharing each host's NIC.
    """

    bandwidth_bytes_per_s: float
    latency_s: float
    contention: float = 1.0
    """0: concurrent rings do not slow each other; 1: they share the NIC bandwidth fairly."""
    fit_rms_rel_error: float = 0.0
    """Root-mean-square relative error of the model on ``points``."""
    fit_max_rel_error: float = 0.0
    """Largest relative error of the model on ``points``."""
    points: list[AllReducePoint] = field(default_factory=list)

    def time_s(self, nbytes: float, ring_size: int, concurrent: int = 1) -> float:
        d = ring_size
        if d <= 1:
            return 0.0
        share = 1.0 + self.contention * (max(concurrent, 1) - 1)
        return 2.0 * (d - 1) / d * nbytes / self.bandwidth_bytes_per_s * share + (d - 1) * self.latency_s

    def to_dict(self) -> dict:
        return {
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "latency_s": self.latency_s,
            "contention": self.contention,
            "fit_rms_rel_error": self.fit_rms_rel_error,
            "fit_max_rel_error": self.fit_max_rel_error,
            "points": [p.to_dict() for p in self.points],
        }

    @classmethod
    def _read(cls, r: _Reader, obj: Any, path: str) -> AllReduceModel:
        bw = r.get(obj, "bandwidth_bytes_per_s", path, "num")
        if bw <= 0:
            raise r.fail(f"field '{path}.bandwidth_bytes_per_s' must be > 0, got {bw} — {_FIX}")
        pts = r.get(obj, "points", path, "list")
        return cls(
            bandwidth_bytes_per_s=bw,
            latency_s=r.get(obj, "latency_s", path, "num"),
            contention=r.get(obj, "contention", path, "num"),
            fit_rms_rel_error=r.get(obj, "fit_rms_rel_error", path, "num"),
            fit_max_rel_error=r.get(obj, "fit_max_rel_error", path, "num"),
            points=[AllReducePoint._read(r, p, f"{path}.points[{j}]") for j, p in enumerate(pts)],
        )


@dataclass(kw_only=True)
class ModelInfo:
    """What was profiled: the model's name, its cut-point names (K) and its segments (K+1)."""

    name: str
    cutpoint_names: list[str]
    num_segments: int

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "cutpoint_names": list(self.cutpoint_names),
            "num_segments": self.num_segments,
        }

    @classmethod
    def _read(cls, r: _Reader, obj: Any, path: str) -> ModelInfo:
        names = r.get(obj, "cutpoint_names", path, "list")
        names = [r.check(n, f"{path}.cutpoint_names[{j}]", "str") for j, n in enumerate(names)]
        return cls(
            name=r.get(obj, "name", path, "str"),
            cutpoint_names=names,
            num_segments=r.get(obj, "num_segments", path, "int"),
        )


@dataclass(kw_only=True)
class HostInfo:
    """Where it was profiled."""

    device: str
    hostname: str
    torch_version: str
    cpu_count: int

    def to_dict(self) -> dict:
        return {
            "device": self.device,
            "hostname": self.hostname,
            "torch_version": self.torch_version,
            "cpu_count": self.cpu_count,
        }

    @classmethod
    def _read(cls, r: _Reader, obj: Any, path: str) -> HostInfo:
        return cls(
            device=r.get(obj, "device", path, "str"),
            hostname=r.get(obj, "hostname", path, "str"),
            torch_version=r.get(obj, "torch_version", path, "str"),
            cpu_count=r.get(obj, "cpu_count", path, "int"),
        )


@dataclass(kw_only=True, frozen=True)
class RuntimeOverheads:
    """The runtime's own costs beyond the calibrated compute, sends, all-reduce and optimizer step.

    All in seconds. The simulator adds them to every simulated mini-batch unless its ``SimConfig``
    sets the same-named field (``docs/simulator.md``). ``varuna-profile`` does not measure them:
    they need the engine itself running a pipeline (see ``docs/calibration.md``).

    >>> RuntimeOverheads(task_overhead_s=5e-4, step_overhead_s=2e-3).to_dict()["placeholder_s"]
    0.0
    >>> RuntimeOverheads(task_overhead_s=-1.0)
    Traceback (most recent call last):
    ValueError: runtime_overheads.task_overhead_s must be a finite number >= 0 (seconds), got -1.0
    """

    task_overhead_s: float = 0.0
    """Added to every F, R and B task: the executor's per-task work (dispatch, RNG re-seeding,
    slicing, queueing the send)."""
    placeholder_s: float = 0.0
    """Added to a stage's F and R per segment *before* the stage: each earlier segment's modules
    return placeholders (Note [Placeholders] in varuna/cutting/split.py)."""
    step_overhead_s: float = 0.0
    """Added once per mini-batch: step set-up and the end-of-step agreement all-reduce over every
    rank. It grows with the world size; ``source`` should say at which size it was measured."""
    source: str = ""
    """How the values were obtained (free text: the tool, the world size, the date)."""

    _TIMES = ("task_overhead_s", "placeholder_s", "step_overhead_s")

    def __post_init__(self) -> None:
        for name in self._TIMES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(
                    f"runtime_overheads.{name} must be a finite number >= 0 (seconds), got {v!r}"
                )
        if not isinstance(self.source, str):
            raise ValueError(f"runtime_overheads.source must be a string, got {self.source!r}")

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self._TIMES}, "source": self.source}

    @classmethod
    def _read(cls, r: _Reader, obj: Any, path: str) -> RuntimeOverheads:
        times = {k: r.get(obj, k, path, "num", fix=_RUNTIME_FIX) for k in cls._TIMES}
        source = obj.get("source")
        if source is not None:
            r.check(source, f"{path}.source", "str", fix=_RUNTIME_FIX)
        return cls(**times, source=source or "")


# Note [All-reduce model]: a ring all-reduce of B bytes over D ranks moves 2(D-1)/D·B bytes through
# every rank's link in 2(D-1) steps, hence 2(D-1)/D·B/bandwidth + (D-1)·latency (latency counted
# once per step pair, as NCCL/gloo pipeline the reduce-scatter and all-gather halves). Varuna
# places each stage's ring on different hosts, so the k stages that share a host run k rings
# through one NIC. We model that as the bandwidth term scaled by (1 + contention·(k-1)), with
# ``contention`` fitted on the measured points: 1 means the NIC is shared fairly (each ring gets
# 1/k of it), 0 means the NIC is not the bottleneck. When no point has k > 1 the file cannot tell,
# and the fit keeps the conservative value 1.


@dataclass(kw_only=True)
class Calibration:
    """A calibration file in memory. See the module docstring and ``docs/calibration.md``."""

    version: int = CALIBRATION_VERSION
    created: str
    """ISO 8601 UTC timestamp of the profiling run."""
    model: ModelInfo
    host: HostInfo
    micro_batch_sizes: list[int]
    """The measured micro-batch sizes, strictly increasing; per-m lists are parallel to this."""
    segments: list[SegmentCalibration]
    cutpoints: list[CutPointCalibration]
    intra: LinkModel
    """Point-to-point link between two accelerators of one host."""
    inter: LinkModel
    """Point-to-point link between accelerators of two hosts."""
    allreduce: AllReduceModel
    optimizer_s_per_param_byte: float
    """Optimizer step time per byte of parameters updated."""
    runtime_overheads: RuntimeOverheads | None = None
    """The runtime's own per-task / per-step costs (file key ``runtime_overheads``); None: not
    measured, the simulator assumes none."""
    profiler: dict[str, Any] | None = None
    """The profiler's diagnostics (file key ``profiler``: fit errors, peak memory, settings, run
    history; ``docs/profiling.md``). Opaque to this module: any JSON object, kept as it is through
    load and save."""
    source: str = field(default="calibration", compare=False)
    """Where it was loaded from (used in error messages; not stored)."""

    # -- serialization ------------------------------------------------------------------------

    def to_dict(self) -> dict:
        out = {
            "version": self.version,
            "created": self.created,
            "model": self.model.to_dict(),
            "host": self.host.to_dict(),
            "micro_batch_sizes": list(self.micro_batch_sizes),
            "segments": [s.to_dict() for s in self.segments],
            "cutpoints": [c.to_dict() for c in self.cutpoints],
            "links": {"intra": self.intra.to_dict(), "inter": self.inter.to_dict()},
            "allreduce": self.allreduce.to_dict(),
            "optimizer": {"step_s_per_param_byte": self.optimizer_s_per_param_byte},
        }
        # Optional sections are written only when present, so a file without them re-saves as it was.
        if self.runtime_overheads is not None:
            out["runtime_overheads"] = self.runtime_overheads.to_dict()
        if self.profiler is not None:
            out["profiler"] = _json_copy(self.profiler, "profiler")
        return out

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "calibration") -> Calibration:
        """Validate and build; raises ``ValueError`` with one line naming the field and the fix."""
        r = _Reader(source)
        if not isinstance(data, dict):
            raise r.fail(f"expected a JSON object at the top level, got {type(data).__name__} — {_FIX}")
        version = r.get(data, "version", "", "int")
        if version != CALIBRATION_VERSION:
            raise r.fail(
                f"unsupported calibration version {version} (this varuna reads version "
                f"{CALIBRATION_VERSION}) — re-run varuna-profile with this varuna to regenerate it"
            )
        model = ModelInfo._read(r, r.get(data, "model", "", "dict"), "model")
        ms = [
            r.check(m, f"micro_batch_sizes[{j}]", "int")
            for j, m in enumerate(r.get(data, "micro_batch_sizes", "", "list"))
        ]
        if not ms or any(m < 1 for m in ms) or any(a >= b for a, b in zip(ms, ms[1:])):
            raise r.fail(
                f"field 'micro_batch_sizes' must be a non-empty, strictly increasing list of "
                f"positive integers, got {ms} — {_FIX}"
            )
        n = len(ms)
        segs = r.get(data, "segments", "", "list")
        if len(segs) != model.num_segments:
            raise r.fail(
                f"field 'segments' has {len(segs)} entries but model.num_segments is "
                f"{model.num_segments} — {_FIX}"
            )
        cuts = r.get(data, "cutpoints", "", "list")
        if len(cuts) != model.num_segments - 1 or len(model.cutpoint_names) != model.num_segments - 1:
            raise r.fail(
                f"field 'cutpoints' has {len(cuts)} entries and model.cutpoint_names "
                f"{len(model.cutpoint_names)}, but {model.num_segments} segments need "
                f"{model.num_segments - 1} — {_FIX}"
            )
        links = r.get(data, "links", "", "dict")
        opt = r.get(data, "optimizer", "", "dict")
        # Optional sections (absent or null: none). Unknown top-level keys are ignored.
        runtime = r.check(
            data.get("runtime_overheads"), "runtime_overheads", "dict", optional=True, fix=_RUNTIME_FIX
        )
        prof = r.check(data.get("profiler"), "profiler", "dict", optional=True)
        return cls(
            version=version,
            created=r.get(data, "created", "", "str"),
            model=model,
            host=HostInfo._read(r, r.get(data, "host", "", "dict"), "host"),
            micro_batch_sizes=ms,
            segments=[SegmentCalibration._read(r, s, f"segments[{i}]", n) for i, s in enumerate(segs)],
            cutpoints=[CutPointCalibration._read(r, c, f"cutpoints[{i}]", n) for i, c in enumerate(cuts)],
            intra=LinkModel._read(r, r.get(links, "intra", "links", "dict"), "links.intra"),
            inter=LinkModel._read(r, r.get(links, "inter", "links", "dict"), "links.inter"),
            allreduce=AllReduceModel._read(r, r.get(data, "allreduce", "", "dict"), "allreduce"),
            optimizer_s_per_param_byte=r.get(opt, "step_s_per_param_byte", "optimizer", "num"),
            runtime_overheads=None
            if runtime is None
            else RuntimeOverheads._read(r, runtime, "runtime_overheads"),
            profiler=None if prof is None else _json_copy(prof, "profiler"),
            source=source,
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        """Read and validate a calibration file.

        >>> Calibration.load("/nonexistent.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: /nonexistent.json: cannot read calibration file (No such file or directory) — check ...
        """
        name = os.fspath(path)
        try:
            with open(name, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(
                f"{name}: cannot read calibration file ({e.strerror}) — check the path or "
                f"run varuna-profile to create it"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON (line {e.lineno}: {e.msg}) — {_FIX}") from None
        return cls.from_dict(data, source=name)

    def save(self, path: str | os.PathLike) -> None:
        """Write as indented JSON (atomically: a crash never leaves half a file)."""
        name = os.fspath(path)
        tmp = f"{name}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")
        os.replace(tmp, name)

    # -- queries used by the simulator -------------------------------------------------------

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def num_cutpoints(self) -> int:
        return len(self.cutpoints)

    def _at(self, values: Sequence[float], m: float) -> float:
        """Value at micro-batch size m: exact, else linear in m through the two nearest points."""
        ms = self.micro_batch_sizes
        if m <= 0:
            raise ValueError(f"micro-batch size must be >= 1, got {m}")
        j = bisect.bisect_left(ms, m)
        if j < len(ms) and ms[j] == m:
            return float(values[j])
        if len(ms) < 2:
            have = ", ".join(str(x) for x in ms)
            raise ValueError(
                f"calibration lacks micro-batch size m={m} (has {have}); re-run "
                f"varuna-profile --update --micro-batch-sizes {m}"
            )
        # Inside the range: the bracketing pair; outside: the two nearest measured points.
        a = min(max(j - 1, 0), len(ms) - 2)
        m0, m1, v0, v1 = ms[a], ms[a + 1], float(values[a]), float(values[a + 1])
        # Extrapolating down can cross zero; a cost is never negative.
        return max(0.0, v0 + (v1 - v0) * (m - m0) / (m1 - m0))

    def has_micro_batch_size(self, m: int) -> bool:
        """True when m was measured or can be interpolated/extrapolated (>= 2 measured sizes)."""
        return m in self.micro_batch_sizes or len(self.micro_batch_sizes) >= 2

    def fwd_s(self, segment: int, m: float) -> float:
        """Median forward time of ``segment`` at micro-batch size m."""
        return self._at([s.median for s in self.segments[segment].fwd_s], m)

    def bwd_s(self, segment: int, m: float) -> float:
        """Median backward time (without recompute) of ``segment`` at m."""
        return self._at([s.median for s in self.segments[segment].bwd_s], m)

    def recompute_s(self, segment: int, m: float) -> float:
        """Median recompute time of ``segment`` at m."""
        return self._at([s.median for s in self.segments[segment].recompute_s], m)

    def act_bytes(self, cutpoint: int, m: float) -> int:
        """Bytes crossing ``cutpoint`` (between segment ``cutpoint`` and ``cutpoint + 1``) at m."""
        return int(round(self._at(self.cutpoints[cutpoint].act_bytes, m)))

    def param_bytes(self, segments: Sequence[int]) -> int:
        return sum(self.segments[s].param_bytes for s in segments)

    def grad_bytes(self, segments: Sequence[int]) -> int:
        return sum(self.segments[s].grad_bytes for s in segments)

    def stage_memory_bytes(
        self, segments: Sequence[int], m: float, stashed: int, *, recompute: bool = True
    ) -> int:
        """Peak memory of a stage made of ``segments`` holding ``stashed`` in-flight micro-batches.

        Static part: parameters + gradients + optimizer state. With recompute the stage keeps only
        each in-flight micro-batch's input plus one micro-batch's full activations (the one being
        recomputed/back-propagated); without it every in-flight micro-batch keeps its activations.

        >>> cal = Calibration.synthetic([0.01, 0.01], param_bytes=100, act_bytes_per_example=10,
        ...                             activation_bytes_per_example=50, micro_batch_sizes=(1, 2))
        >>> cal.stage_memory_bytes([0, 1], 1, stashed=3)  # 2*(100+100+200) static + 3*10 + 2*50
        930
        """
        segs = list(segments)
        if not segs:
            raise ValueError("a stage needs at least one segment")
        static = sum(
            self.segments[i].param_bytes + self.segments[i].grad_bytes + self.segments[i].optimizer_bytes
            for i in segs
        )
        stash_in = self._at(self.segments[segs[0]].stashed_input_bytes, m)
        acts = sum(self._at(self.segments[i].activation_bytes, m) for i in segs)
        if recompute:
            dynamic = stashed * stash_in + acts
        else:
            dynamic = stashed * (stash_in + acts)
        return int(round(static + dynamic))

    def p2p_s(self, nbytes: float, intra: bool) -> float:
        """Mean time of one point-to-point send of ``nbytes`` (fitted link model)."""
        return (self.intra if intra else self.inter).time_s(nbytes)

    def p2p_jitter_s(self, intra: bool) -> float:
        return (self.intra if intra else self.inter).jitter_s

    def allreduce_s(self, nbytes: float, ring_size: int, concurrent: int = 1) -> float:
        """Time of a ring all-reduce of ``nbytes`` over ``ring_size`` hosts with ``concurrent``
        rings per host (Note [All-reduce model])."""
        return self.allreduce.time_s(nbytes, ring_size, concurrent)

    def optimizer_s(self, param_bytes: float) -> float:
        """Optimizer step time for ``param_bytes`` bytes of parameters."""
        return param_bytes * self.optimizer_s_per_param_byte

    # -- synthetic files (tests, benchmarks, what-if studies) ---------------------------------

    @classmethod
    def synthetic(
        cls,
        fwd_s: Sequence[float] | float = 0.01,
        *,
        num_segments: int | None = None,
        micro_batch_sizes: Sequence[int] = (1, 2, 4, 8),
        bwd_factor: float = 2.0,
        recompute_factor: float = 1.0,
        overhead_s: float = 0.0,
        param_bytes: Sequence[int] | int = 1 << 26,
        optimizer_factor: float = 2.0,
        act_bytes_per_example: Sequence[float] | float = 1 << 20,
        activation_bytes_per_example: Sequence[float] | float | None = None,
        intra: LinkModel | None = None,
        inter: LinkModel | None = None,
        allreduce: AllReduceModel | None = None,
        optimizer_s_per_param_byte: float = 0.0,
        runtime_overheads: RuntimeOverheads | None = None,
        model_name: str = "synthetic",
    ) -> Calibration:
        """A calibration built from given per-segment costs instead of measurements.

        ``fwd_s[i]`` is segment i's forward time per example: F_i(m) = overhead_s + fwd_s[i]·m,
        B_i = bwd_factor·F_i, R_i = recompute_factor·F_i. ``overhead_s`` (a fixed per-call cost)
        makes small micro-batches less efficient, as on a real accelerator. Sizes scale with m:
        cut-point i carries ``act_bytes_per_example[i]·m`` bytes; ``activation_bytes_per_example``
        (default 4× the input) is what a segment holds during its recompute/backward. Links
        default to zero-cost, all-reduce to free, so tests can switch costs on one at a time.
        ``runtime_overheads`` (default none) is stored as given.

        >>> cal = Calibration.synthetic(0.01, num_segments=4, overhead_s=0.002)
        >>> cal.num_segments, round(cal.fwd_s(0, 2), 6), round(cal.bwd_s(0, 2), 6)
        (4, 0.022, 0.044)
        """
        if isinstance(fwd_s, (int, float)):
            fwd = [float(fwd_s)] * (num_segments or 1)
        else:
            fwd = [float(x) for x in fwd_s]
            if num_segments is not None and num_segments != len(fwd):
                raise ValueError(f"num_segments={num_segments} disagrees with len(fwd_s)={len(fwd)}")
        n = len(fwd)
        ms = sorted(int(m) for m in micro_batch_sizes)

        def per(x, count):
            return [x] * count if isinstance(x, (int, float)) else list(x)

        pbytes = per(param_bytes, n)
        cut = per(act_bytes_per_example, n - 1)
        # A segment's stashed input is the activation of the cut-point before it; the input of
        # segment 0 is the data batch, taken to be as large as the first cut-point's activation.
        seg_in = [cut[0] if cut else 1 << 20] + cut
        if activation_bytes_per_example is None:
            acts = [4 * x for x in seg_in]
        else:
            acts = per(activation_bytes_per_example, n)
        if len(pbytes) != n or len(cut) != n - 1 or len(acts) != n:
            raise ValueError("per-segment lists need num_segments entries (num_segments - 1 for cut-points)")

        def stat(x: float) -> ComputeStat:
            return ComputeStat(median=x, spread=0.0)

        segments = [
            SegmentCalibration(
                fwd_s=[stat(overhead_s + fwd[i] * m) for m in ms],
                bwd_s=[stat(bwd_factor * (overhead_s + fwd[i] * m)) for m in ms],
                recompute_s=[stat(recompute_factor * (overhead_s + fwd[i] * m)) for m in ms],
                param_bytes=int(pbytes[i]),
                grad_bytes=int(pbytes[i]),
                optimizer_bytes=int(optimizer_factor * pbytes[i]),
                stashed_input_bytes=[int(seg_in[i] * m) for m in ms],
                activation_bytes=[int(acts[i] * m) for m in ms],
            )
            for i in range(n)
        ]
        # "Free" links and all-reduce: 1e18 B/s keeps sends below a nanosecond and stays valid JSON.
        intra = intra or LinkModel(latency_s=0.0, bandwidth_bytes_per_s=_FREE_BW, jitter_s=0.0)
        inter = inter or LinkModel(latency_s=0.0, bandwidth_bytes_per_s=_FREE_BW, jitter_s=0.0)

        def sends(link: LinkModel, i: int) -> list[SendStat]:
            return [SendStat(mean=link.time_s(cut[i] * m), jitter=link.jitter_s) for m in ms]

        cutpoints = [
            CutPointCalibration(
                name=f"cut{i}",
                act_bytes=[int(cut[i] * m) for m in ms],
                act_send_intra_s=sends(intra, i),
                act_send_inter_s=sends(inter, i),
                grad_send_intra_s=sends(intra, i),
                grad_send_inter_s=sends(inter, i),
            )
            for i in range(n - 1)
        ]
        return cls(
            created=_now(),
            model=ModelInfo(name=model_name, cutpoint_names=[c.name for c in cutpoints], num_segments=n),
            host=HostInfo(
                device="synthetic",
                hostname=platform.node(),
                torch_version="none",
                cpu_count=os.cpu_count() or 1,
            ),
            micro_batch_sizes=ms,
            segments=segments,
            cutpoints=cutpoints,
            intra=intra,
            inter=inter,
            allreduce=allreduce or AllReduceModel(bandwidth_bytes_per_s=_FREE_BW, latency_s=0.0),
            optimizer_s_per_param_byte=optimizer_s_per_param_byte,
            runtime_overheads=runtime_overheads,
        )


def _json_copy(value: Any, what: str) -> Any:
    """A deep copy through JSON: tuples become lists, and the caller's object is not shared."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise ValueError(f"calibration field '{what}' must hold JSON values only ({e})") from None


def _now() -> str:
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return now.isoformat().replace("+00:00", "Z")


# ---------------------------------------------------------------------------------------------
# Fitting (used by the profiler; pure least squares, no numpy so the simulator side stays light)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    return [m[i][n] / m[i][i] for i in range(n)]


def _least_squares(rows: list[list[float]], y: list[float], weights: list[float]) -> list[float] | None:
    k = len(rows[0])
    ata = [[sum(w * r[i] * r[j] for r, w in zip(rows, weights)) for j in range(k)] for i in range(k)]
    aty = [sum(w * r[i] * t for r, t, w in zip(rows, y, weights)) for i in range(k)]
    return _solve(ata, aty)


def fit_link_model(points: Sequence[LinkPoint]) -> LinkModel:
    """Fit ``mean_s = latency_s + bytes / bandwidth`` (relative least squares) to measurements.

    ``jitter_s`` of the model is the root-mean-square of the points' jitters.

    >>> pts = [LinkPoint(bytes=b, mean_s=1e-4 + b / 1e9, jitter_s=1e-5) for b in (1000, 10**6, 10**7)]
    >>> lm = fit_link_model(pts)
    >>> round(lm.latency_s * 1e6), round(lm.bandwidth_bytes_per_s / 1e9, 3)
    (100, 1.0)
    """
    pts = list(points)
    if len({p.bytes for p in pts}) < 2:
        raise ValueError("fitting a link model needs measurements at two or more message sizes")
    # Relative weighting (1/t²) so small messages (latency) and large ones (bandwidth) both count.
    w = [1.0 / max(p.mean_s, 1e-12) ** 2 for p in pts]
    sol = _least_squares([[1.0, float(p.bytes)] for p in pts], [p.mean_s for p in pts], w)
    if sol is None or sol[1] <= 0:
        raise ValueError("link measurements do not grow with message size; cannot fit a bandwidth")
    lat, inv_bw = sol
    if lat < 0:  # refit through the origin: latency cannot be negative
        lat = 0.0
        num = sum(wi * p.bytes * p.mean_s for p, wi in zip(pts, w))
        inv_bw = num / sum(wi * p.bytes**2 for p, wi in zip(pts, w))
    jitter = math.sqrt(sum(p.jitter_s**2 for p in pts) / len(pts))
    return LinkModel(latency_s=lat, bandwidth_bytes_per_s=1.0 / inv_bw, jitter_s=jitter, points=pts)


def fit_allreduce_model(points: Sequence[AllReducePoint]) -> AllReduceModel:
    """Fit the all-reduce model of Note [All-reduce model] and report its error on the points.

    >>> true = AllReduceModel(bandwidth_bytes_per_s=1e9, latency_s=1e-4, contention=0.5)
    >>> pts = [AllReducePoint(segment=None, ring_size=d, concurrent=k, bytes=b, time_s=true.time_s(b, d, k))
    ...        for d in (2, 4) for k in (1, 2) for b in (10**6, 10**8)]
    >>> fit = fit_allreduce_model(pts)
    >>> round(fit.bandwidth_bytes_per_s / 1e9, 3), round(fit.latency_s * 1e4, 3), round(fit.contention, 3)
    (1.0, 1.0, 0.5)
    """
    pts = [p for p in points if p.ring_size > 1]
    if len(pts) < 2:
        raise ValueError("fitting the all-reduce model needs two or more measurements with ring_size > 1")
    y = [p.time_s for p in pts]
    w = [1.0 / max(t, 1e-12) ** 2 for t in y]
    x1 = [2.0 * (p.ring_size - 1) / p.ring_size * p.bytes for p in pts]
    xk = [x * (p.concurrent - 1) for x, p in zip(x1, pts)]
    xl = [float(p.ring_size - 1) for p in pts]
    has_k = any(v != 0 for v in xk)
    # Try the full model, then drop terms the data cannot support (singular) or that come out negative.
    for use_k, use_l in ((has_k, True), (has_k, False), (False, True), (False, False)):
        cols = [x1] + ([xk] if use_k else []) + ([xl] if use_l else [])
        sol = _least_squares([list(r) for r in zip(*cols)], y, w)
        if sol is None or sol[0] <= 0 or any(v < 0 for v in sol[1:]):
            continue
        inv_bw = sol[0]
        c = sol[1] / inv_bw if use_k else 1.0
        lat = sol[-1] if use_l else 0.0
        model = AllReduceModel(bandwidth_bytes_per_s=1.0 / inv_bw, latency_s=lat, contention=c, points=pts)
        errs = [
            abs(model.time_s(p.bytes, p.ring_size, p.concurrent) - p.time_s) / max(p.time_s, 1e-12)
            for p in pts
        ]
        model.fit_rms_rel_error = math.sqrt(sum(e * e for e in errs) / len(errs))
        model.fit_max_rel_error = max(errs)
        return model
    raise ValueError("all-reduce measurements do not grow with message size; cannot fit a bandwidth")
