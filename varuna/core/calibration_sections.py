"""The sections of a calibration file: one dataclass per JSON object, and their reader.

Part of :mod:`varuna.core.calibration` (which re-exports every section class; import them from
there). Each section has ``to_dict`` and a ``_read`` that validates its JSON object with a
:class:`FieldReader`, so every error names the source file and the dotted field path, on one line,
with the fix. Pure Python: no torch.

Example::

    >>> LinkModel(latency_s=1e-4, bandwidth_bytes_per_s=1e9).time_s(1e6)
    0.0011
    >>> FieldReader("cal.json").get({"a": -1}, "a", "links", "num")
    Traceback (most recent call last):
    ValueError: cal.json: field 'links.a' must be >= 0, got -1 — re-run varuna-profile
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "REPROFILE_FIX",
    "REMEASURE_FIX",
    "FieldReader",
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
]

#: The fix-it hint of most reading errors: the profiler wrote the file.
REPROFILE_FIX = "re-run varuna-profile"
# The runtime overheads are measured by running the engine itself, not by varuna-profile
# (docs/calibration.md, section runtime_overheads).
#: The hint for the runtime_overheads section, which varuna-profile does not write.
REMEASURE_FIX = (
    "measure it again (docs/simulator.md, Validation) or remove the 'runtime_overheads' section "
    "(the simulator then assumes no runtime overheads)"
)


#: Largest time a field in seconds may hold (11.6 days for one task or message): beyond it a
#: value is corrupt, and sums of such values overflow the simulator's arithmetic.
MAX_SECONDS = 1e6
#: Largest value of any other number (bytes, counts, bandwidths): 1e18 bytes is an exabyte.
MAX_VALUE = 1e18
_SECONDS_KEYS = ("median", "spread", "mean", "jitter")


def _limit_of(path: str) -> float:
    """The upper bound of field ``path`` (e.g. ``segments[0].fwd_s[1].median``: seconds)."""
    last = path.rsplit(".", 1)[-1].split("[", 1)[0]
    seconds = (last.endswith("_s") and not last.endswith("_per_s")) or last in _SECONDS_KEYS
    return MAX_SECONDS if seconds else MAX_VALUE


# ---------------------------------------------------------------------------------------------
# Reading helpers: every error names the source file and the dotted field path, on one line.


class FieldReader:
    """Reads and checks the fields of one calibration file (``source`` names it in errors)."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.source}: {message}")

    def get(
        self, obj: Any, key: str, path: str, kind: str, *, optional: bool = False, fix: str = REPROFILE_FIX
    ) -> Any:
        full = f"{path}.{key}" if path else key
        if not isinstance(obj, dict):
            raise self.fail(f"field '{path or '<top level>'}' must be an object — {fix}")
        if key not in obj or (obj[key] is None and not optional):
            raise self.fail(f"missing field '{full}' — {fix}")
        return self.check(obj[key], full, kind, optional=optional, fix=fix)

    def check(
        self, value: Any, path: str, kind: str, *, optional: bool = False, fix: str = REPROFILE_FIX
    ) -> Any:
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
        if kind in ("num", "int") and value > _limit_of(path):
            raise self.fail(
                f"field '{path}' is {float(value):.3g}, beyond any real measurement (at most "
                f"{_limit_of(path):.0e}) — {fix}"
            )
        return value

    def per_m(self, obj: Any, key: str, path: str, n: int, kind: str, *, optional: bool = False) -> Any:
        """A list with one entry per measured micro-batch size."""
        values = self.get(obj, key, path, "list", optional=optional)
        if values is None:
            return None
        full = f"{path}.{key}"
        if len(values) != n:
            raise self.fail(
                f"field '{full}' has {len(values)} entries but micro_batch_sizes has {n} — {REPROFILE_FIX}"
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
    def _read(cls, r: FieldReader, obj: Any, path: str) -> ComputeStat:
        return cls(median=r.get(obj, "median", path, "num"), spread=r.get(obj, "spread", path, "num"))


@dataclass(kw_only=True, frozen=True)
class SendStat:
    """A repeated send-time measurement: ``mean`` and ``jitter`` (standard deviation), seconds."""

    mean: float
    jitter: float = 0.0

    def to_dict(self) -> dict:
        return {"mean": self.mean, "jitter": self.jitter}

    @classmethod
    def _read(cls, r: FieldReader, obj: Any, path: str) -> SendStat:
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
    def _read(cls, r: FieldReader, obj: Any, path: str, n: int) -> SegmentCalibration:
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
    def _read(cls, r: FieldReader, obj: Any, path: str, n: int) -> CutPointCalibration:
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
    def _read(cls, r: FieldReader, obj: Any, path: str) -> LinkPoint:
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
    def _read(cls, r: FieldReader, obj: Any, path: str) -> LinkModel:
        bw = r.get(obj, "bandwidth_bytes_per_s", path, "num")
        if bw < 1:  # bytes per second: below it, message times overflow
            raise r.fail(f"field '{path}.bandwidth_bytes_per_s' must be >= 1, got {bw} — {REPROFILE_FIX}")
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
    def _read(cls, r: FieldReader, obj: Any, path: str) -> AllReducePoint:
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
    def _read(cls, r: FieldReader, obj: Any, path: str) -> AllReduceModel:
        bw = r.get(obj, "bandwidth_bytes_per_s", path, "num")
        if bw < 1:  # bytes per second: below it, message times overflow
            raise r.fail(f"field '{path}.bandwidth_bytes_per_s' must be >= 1, got {bw} — {REPROFILE_FIX}")
        pts = r.get(obj, "points", path, "list")
        return cls(
            bandwidth_bytes_per_s=bw,
            latency_s=r.get(obj, "latency_s", path, "num"),
            contention=r.get(obj, "contention", path, "num"),
            fit_rms_rel_error=r.get(obj, "fit_rms_rel_error", path, "num"),
            fit_max_rel_error=r.get(obj, "fit_max_rel_error", path, "num"),
            points=[AllReducePoint._read(r, p, f"{path}.points[{j}]") for j, p in enumerate(pts)],
        )


@dataclass(frozen=True, kw_only=True)
class SharedParams:
    """Parameters that several segments read (tied input/output embeddings): which segments, and
    their gradient bytes (counted once here, but in each of those segments' ``grad_bytes``).

    The runtime sums such a parameter's gradient over every rank of the stages holding a copy, in a
    group of its own, instead of with the stage's replicas (varuna/runtime/groups.py); the
    simulator prices that sum (``simulator.costs.sync_costs``).

    >>> SharedParams(segments=(0, 2), grad_bytes=65536).to_dict()
    {'segments': [0, 2], 'grad_bytes': 65536}
    """

    segments: tuple[int, ...]
    grad_bytes: int

    def to_dict(self) -> dict:
        return {"segments": list(self.segments), "grad_bytes": self.grad_bytes}


@dataclass(kw_only=True)
class ModelInfo:
    """What was profiled: the model's name, its cut-point names (K) and its segments (K+1)."""

    name: str
    cutpoint_names: list[str]
    num_segments: int
    fwd_flops_per_example: list[float] | None = None
    """Optional: each segment's forward FLOPs per example (the dry run's ``FlopCounterMode``
    count); what TFLOP/s and MFU predictions (``varuna-simulate``) and the dashboard need. None:
    not counted (a file written before the field existed)."""
    shared_params: list[SharedParams] = field(default_factory=list)
    """Optional: parameters several segments read, grouped by their segments (empty: none, or a
    file written before the field existed)."""

    def to_dict(self) -> dict:
        out: dict[str, Any] = {
            "name": self.name,
            "cutpoint_names": list(self.cutpoint_names),
            "num_segments": self.num_segments,
        }
        if self.fwd_flops_per_example is not None:
            out["fwd_flops_per_example"] = list(self.fwd_flops_per_example)
        if self.shared_params:
            out["shared_params"] = [sp.to_dict() for sp in self.shared_params]
        return out

    @classmethod
    def _read(cls, r: FieldReader, obj: Any, path: str) -> ModelInfo:
        names = r.get(obj, "cutpoint_names", path, "list")
        names = [r.check(n, f"{path}.cutpoint_names[{j}]", "str") for j, n in enumerate(names)]
        num_segments = r.get(obj, "num_segments", path, "int")
        flops = r.get(obj, "fwd_flops_per_example", path, "list", optional=True) \
            if "fwd_flops_per_example" in obj else None
        if flops is not None:
            flops = [r.check(f, f"{path}.fwd_flops_per_example[{j}]", "num") for j, f in enumerate(flops)]
            if len(flops) != num_segments or min(flops, default=0) < 0:
                raise r.fail(
                    f"field '{path}.fwd_flops_per_example' must hold {num_segments} numbers >= 0 (one per "
                    f"segment), got {len(flops)} — {REPROFILE_FIX}"
                )
        return cls(
            name=r.get(obj, "name", path, "str"),
            cutpoint_names=names,
            num_segments=num_segments,
            fwd_flops_per_example=flops,
            shared_params=cls._read_shared(r, obj, path, num_segments),
        )

    @staticmethod
    def _read_shared(r: FieldReader, obj: Any, path: str, num_segments: int) -> list[SharedParams]:
        if "shared_params" not in obj:
            return []
        out = []
        for j, sp in enumerate(r.get(obj, "shared_params", path, "list")):
            where = f"{path}.shared_params[{j}]"
            r.check(sp, where, "dict")
            segs = [r.check(x, f"{where}.segments[{i}]", "int")
                    for i, x in enumerate(r.get(sp, "segments", where, "list"))]
            grad_bytes = r.get(sp, "grad_bytes", where, "int")
            if len(set(segs)) < 2 or not all(0 <= x < num_segments for x in segs) or grad_bytes < 0:
                raise r.fail(f"field '{where}' must name >= 2 distinct segments in 0..{num_segments - 1} "
                             f"and grad_bytes >= 0, got {sp!r} — {REPROFILE_FIX}")
            out.append(SharedParams(segments=tuple(sorted(set(segs))), grad_bytes=grad_bytes))
        return out


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
    def _read(cls, r: FieldReader, obj: Any, path: str) -> HostInfo:
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
    sets the same-named field (``docs/simulator.md``). ``varuna-profile --host-list`` measures
    them on the hosts by running the engine itself (its runtime-overheads phase,
    ``docs/calibration.md``).

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
    def _read(cls, r: FieldReader, obj: Any, path: str) -> RuntimeOverheads:
        times = {k: r.get(obj, k, path, "num", fix=REMEASURE_FIX) for k in cls._TIMES}
        source = obj.get("source")
        if source is not None:
            r.check(source, f"{path}.source", "str", fix=REMEASURE_FIX)
        return cls(**times, source=source or "")


# Note [All-reduce model]: a ring all-reduce of B bytes over D ranks moves 2(D-1)/D·B bytes through
# every rank's link in 2(D-1) steps, hence 2(D-1)/D·B/bandwidth + (D-1)·latency (latency counted
# once per step pair, as NCCL/gloo pipeline the reduce-scatter and all-gather halves). Varuna
# places each stage's ring on different hosts, so the k stages that share a host run k rings
# through one NIC. We model that as the bandwidth term scaled by (1 + contention·(k-1)), with
# ``contention`` fitted on the measured points: 1 means the NIC is shared fairly (each ring gets
# 1/k of it), 0 means the NIC is not the bottleneck. When no point has k > 1 the file cannot tell,
# and the fit keeps the conservative value 1.
