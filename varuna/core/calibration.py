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
import os
import platform
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

# The sections are part of this module's API: callers import them from here.
from varuna.core.calibration_sections import (
    REMEASURE_FIX,
    REPROFILE_FIX,
    AllReduceModel,
    AllReducePoint,
    ComputeStat,
    CutPointCalibration,
    FieldReader,
    HostInfo,
    LinkModel,
    LinkPoint,
    ModelInfo,
    RuntimeOverheads,
    SegmentCalibration,
    SendStat,
    SharedParams,
)
from varuna.core.calibration_types import SegmentCompute, VmType, for_type, with_types
from varuna.core.memory import activation_memory_bytes

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
    "SharedParams",
    "HostInfo",
    "RuntimeOverheads",
    "Calibration",
    "plan_model_mismatch",
    "SegmentCompute",
    "VmType",
]

#: The schema version this code writes. Bump on any incompatible change. Version 2 added the
#: optional ``types`` section (VM types, ``varuna/core/calibration_types.py``): a version-1 reader
#: would ignore it and plan a mixed cluster as if every VM were the profiled one.
CALIBRATION_VERSION = 2
#: Versions this code reads: a version-1 file is a version-2 file without ``types``.
READABLE_VERSIONS = (1, 2)

_FREE_BW = 1e18  # bytes/s of the synthetic "free" links


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
    types: dict[str, VmType] = field(default_factory=dict)
    """VM types (file key ``types``, version 2): each type's compute, own or the base's over its
    speed (:meth:`for_type`); empty: one type, the profiled host's."""
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
        if self.types:
            out["version"] = max(self.version, 2)  # a version-1 reader must not drop the types
            out["types"] = {name: t.to_dict() for name, t in self.types.items()}
        return out

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "calibration") -> Calibration:
        """Validate and build; raises ``ValueError`` with one line naming the field and the fix."""
        r = FieldReader(source)
        if not isinstance(data, dict):
            raise r.fail(
                f"expected a JSON object at the top level, got {type(data).__name__} — {REPROFILE_FIX}"
            )
        version = r.get(data, "version", "", "int")
        if version not in READABLE_VERSIONS:
            raise r.fail(
                f"unsupported calibration version {version} (this varuna reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}) — re-run varuna-profile with this varuna "
                "to regenerate it"
            )
        model = ModelInfo._read(r, r.get(data, "model", "", "dict"), "model")
        ms = [
            r.check(m, f"micro_batch_sizes[{j}]", "int")
            for j, m in enumerate(r.get(data, "micro_batch_sizes", "", "list"))
        ]
        if not ms or any(m < 1 for m in ms) or any(a >= b for a, b in zip(ms, ms[1:])):
            raise r.fail(
                f"field 'micro_batch_sizes' must be a non-empty, strictly increasing list of "
                f"positive integers, got {ms} — {REPROFILE_FIX}"
            )
        n = len(ms)
        segs = r.get(data, "segments", "", "list")
        if len(segs) != model.num_segments:
            raise r.fail(
                f"field 'segments' has {len(segs)} entries but model.num_segments is "
                f"{model.num_segments} — {REPROFILE_FIX}"
            )
        cuts = r.get(data, "cutpoints", "", "list")
        if len(cuts) != model.num_segments - 1 or len(model.cutpoint_names) != model.num_segments - 1:
            raise r.fail(
                f"field 'cutpoints' has {len(cuts)} entries and model.cutpoint_names "
                f"{len(model.cutpoint_names)}, but {model.num_segments} segments need "
                f"{model.num_segments - 1} — {REPROFILE_FIX}"
            )
        links = r.get(data, "links", "", "dict")
        opt = r.get(data, "optimizer", "", "dict")
        # Optional sections (absent or null: none). Unknown top-level keys are ignored.
        runtime = r.check(
            data.get("runtime_overheads"), "runtime_overheads", "dict", optional=True, fix=REMEASURE_FIX
        )
        prof = r.check(data.get("profiler"), "profiler", "dict", optional=True)
        types = r.check(data.get("types"), "types", "dict", optional=True)
        if types is not None and version < 2:
            raise r.fail(
                "field 'types' needs calibration version 2 (this file says 1) — set \"version\": 2"
            )
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
            types={
                name: VmType._read(r, name, t, model.num_segments, n) for name, t in (types or {}).items()
            },
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
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{name}: not a calibration file (not UTF-8 text: byte {e.object[e.start]:#04x} at offset "
                f"{e.start}) — check the path or {REPROFILE_FIX}"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON (line {e.lineno}: {e.msg}) — {REPROFILE_FIX}") from None
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

    def check_model(self, cutpoint_names: Sequence[str], *, source: str = "the calibration") -> None:
        """Raise ``ValueError`` (one line, with the fix) unless this calibration was made for a
        model with these cut-points, in this order: a calibration of another model gives stage
        ranges and costs that do not fit, and would otherwise surface only as a stage-range error.

        >>> cal = Calibration.synthetic(0.01, num_segments=3)
        >>> cal.check_model(["cut0", "cut1"])
        >>> cal.check_model(["h.0"], source="cal.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: cal.json is a calibration of model 'synthetic' with 2 cut-points (cut0, cut1), but ...
        """
        names = list(cutpoint_names)
        if names == list(self.model.cutpoint_names):
            return
        have = ", ".join(self.model.cutpoint_names) or "none"
        raise ValueError(
            f"{source} is a calibration of model {self.model.name!r} with {len(self.model.cutpoint_names)} "
            f"cut-points ({have}), but this model has {len(names)} ({', '.join(names) or 'none'}); "
            f"run varuna-profile on this model and use that file"
        )

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

    def activation_bytes(self, segment: int, m: float) -> float:
        """Bytes autograd saves in ``segment`` for one micro-batch of size m (what recomputing it frees)."""
        return self._at(self.segments[segment].activation_bytes, m)

    def act_bytes(self, cutpoint: int, m: float) -> int:
        """Bytes crossing ``cutpoint`` (between segment ``cutpoint`` and ``cutpoint + 1``) at m."""
        return int(round(self._at(self.cutpoints[cutpoint].act_bytes, m)))

    def param_bytes(self, segments: Sequence[int]) -> int:
        return sum(self.segments[s].param_bytes for s in segments)

    def grad_bytes(self, segments: Sequence[int]) -> int:
        return sum(self.segments[s].grad_bytes for s in segments)

    def stage_memory_bytes(
        self, segments: Sequence[int], m: float, stashed: int, *, recompute: bool = True,
        optimizer_shards: int = 1, recompute_segments: Collection[int] | None = None,
    ) -> int:
        """Peak memory of a stage made of ``segments`` holding ``stashed`` in-flight micro-batches.

        Static part: parameters + gradients + optimizer state (``optimizer_shards``: the state
        split over that many replicas, each holding its share: ``VarunaConfig.optimizer_state``).
        With recompute the stage keeps only each in-flight micro-batch's input plus one
        micro-batch's full activations (the one being recomputed/back-propagated); without it
        every in-flight micro-batch keeps its activations. Either way one micro-batch's forward and
        backward hold transients about that large again (Note [Backward workspace] in
        varuna/core/memory.py). ``recompute_segments`` (with recompute):
        only those segments recompute, the others keep their activations (Note [Selective
        recompute] in varuna/core/selective_recompute.py; None: all of them).

        >>> cal = Calibration.synthetic([0.01, 0.01], param_bytes=100, act_bytes_per_example=10,
        ...                             activation_bytes_per_example=50, micro_batch_sizes=(1, 2))
        >>> cal.stage_memory_bytes([0, 1], 1, stashed=3)  # 2*(100+100+200) static + 3*10 + 2*50 + 2*50
        1030
        """
        segs = list(segments)
        if not segs:
            raise ValueError("a stage needs at least one segment")
        static = sum(
            self.segments[i].param_bytes + self.segments[i].grad_bytes
            + self.segments[i].optimizer_bytes / optimizer_shards
            for i in segs
        )
        # The one activation formula (varuna/core/memory.py), shared with the runtime's split.
        dynamic = activation_memory_bytes(
            segs[0], segs[-1], stashed=stashed, recompute=recompute,
            input_bytes=lambda s: self._at(self.segments[s].stashed_input_bytes, m),
            activation_bytes=lambda s: self._at(self.segments[s].activation_bytes, m),
            recompute_segments=recompute_segments,
        )
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

    # -- VM types (version 2) ------------------------------------------------------------------

    def for_type(self, name: str) -> Calibration:
        """This calibration as measured on VM type ``name`` (``calibration_types.for_type``)."""
        return for_type(self, name)

    def with_types(self, per_type: dict[str, Calibration], *, memory_bytes: dict[str, int] | None = None
                   ) -> Calibration:
        """A copy holding each of ``per_type`` as a VM type (``calibration_types.with_types``)."""
        return with_types(self, per_type, memory_bytes=memory_bytes)

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
        fwd = _forward_times(fwd_s, num_segments)
        n = len(fwd)
        ms = sorted(int(m) for m in micro_batch_sizes)
        pbytes = _per_segment(param_bytes, n)
        cut = _per_segment(act_bytes_per_example, n - 1)
        # A segment's stashed input is the activation of the cut-point before it; the input of
        # segment 0 is the data batch, taken to be as large as the first cut-point's activation.
        seg_in = [cut[0] if cut else 1 << 20] + cut
        if activation_bytes_per_example is None:
            acts = [4 * x for x in seg_in]
        else:
            acts = _per_segment(activation_bytes_per_example, n)
        if len(pbytes) != n or len(cut) != n - 1 or len(acts) != n:
            raise ValueError("per-segment lists need num_segments entries (num_segments - 1 for cut-points)")
        segments = [
            _synthetic_segment(
                [overhead_s + fwd[i] * m for m in ms], bwd_factor, recompute_factor, int(pbytes[i]),
                optimizer_factor, [int(seg_in[i] * m) for m in ms], [int(acts[i] * m) for m in ms],
            )
            for i in range(n)
        ]
        # "Free" links and all-reduce: 1e18 B/s keeps sends below a nanosecond and stays valid JSON.
        intra = intra or LinkModel(latency_s=0.0, bandwidth_bytes_per_s=_FREE_BW, jitter_s=0.0)
        inter = inter or LinkModel(latency_s=0.0, bandwidth_bytes_per_s=_FREE_BW, jitter_s=0.0)
        cutpoints = [_synthetic_cutpoint(f"cut{i}", [cut[i] * m for m in ms], intra, inter)
                     for i in range(n - 1)]
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


def _forward_times(fwd_s: Sequence[float] | float, num_segments: int | None) -> list[float]:
    """Per-segment forward times per example of :meth:`Calibration.synthetic`."""
    if isinstance(fwd_s, (int, float)):
        return [float(fwd_s)] * (num_segments or 1)
    fwd = [float(x) for x in fwd_s]
    if num_segments is not None and num_segments != len(fwd):
        raise ValueError(f"num_segments={num_segments} disagrees with len(fwd_s)={len(fwd)}")
    return fwd


def _per_segment(x: Sequence[float] | float, count: int) -> list:
    """A per-segment (or per-cut-point) list from one value for all or the list itself."""
    return [x] * count if isinstance(x, (int, float)) else list(x)


def _synthetic_segment(fwd: list[float], bwd_factor: float, recompute_factor: float, param_bytes: int,
                       optimizer_factor: float, stashed: list[int], activations: list[int]
                       ) -> SegmentCalibration:
    """One segment of :meth:`Calibration.synthetic` from its per-m forward times (no spread)."""
    return SegmentCalibration(
        fwd_s=[ComputeStat(median=f, spread=0.0) for f in fwd],
        bwd_s=[ComputeStat(median=bwd_factor * f, spread=0.0) for f in fwd],
        recompute_s=[ComputeStat(median=recompute_factor * f, spread=0.0) for f in fwd],
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_bytes=int(optimizer_factor * param_bytes),
        stashed_input_bytes=stashed,
        activation_bytes=activations,
    )


def _synthetic_cutpoint(name: str, act_bytes: list[float], intra: LinkModel, inter: LinkModel
                        ) -> CutPointCalibration:
    """One cut-point of :meth:`Calibration.synthetic` from its per-m activation sizes: activations
    and gradients (the same size) cost what the links' models say."""
    def sends(link: LinkModel) -> list[SendStat]:
        return [SendStat(mean=link.time_s(b), jitter=link.jitter_s) for b in act_bytes]

    return CutPointCalibration(
        name=name,
        act_bytes=[int(b) for b in act_bytes],
        act_send_intra_s=sends(intra),
        act_send_inter_s=sends(inter),
        grad_send_intra_s=sends(intra),
        grad_send_inter_s=sends(inter),
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


def plan_model_mismatch(stage_ranges: Sequence[tuple[int, int]], num_segments: int) -> str | None:
    """For the engine, which sees only the planned stage ranges: the one-line message when they
    are a well-formed plan (contiguous from segment 0) for another number of segments than the
    model has — auto-config ran on a calibration of another model — else None.

    >>> plan_model_mismatch([(0, 1), (2, 4)], 5) is None
    True
    >>> plan_model_mismatch([(0, 1), (2, 4)], 3)  # doctest: +ELLIPSIS
    'the planned stage ranges [(0, 1), (2, 4)] cover 5 segments (4 cut-points) but this model has 3 (2 ...'
    """
    ranges = [tuple(r) for r in stage_ranges]
    flat = [s for a, b in ranges for s in range(a, b + 1)]
    if not ranges or flat != list(range(len(flat))) or len(flat) == num_segments:
        return None
    return (
        f"the planned stage ranges {ranges} cover {len(flat)} segments ({len(flat) - 1} cut-points) but "
        f"this model has {num_segments} ({num_segments - 1} CutPoints): the calibration auto-config "
        "planned from is of another model — run varuna-profile on this model and pass that file to "
        "--calibration (or the job spec); if you set stage_ranges yourself, cover all the segments"
    )
