"""The tracer's report: what crosses segment boundaries, for people (a table) and programs (JSON).

Built by :func:`varuna.cutting.tracer.trace_model`; see its module docstring for what each
finding means. Example::

    >>> r = TraceReport(cutpoints=["cut0"], num_segments=2)
    >>> r.ok, TraceReport.from_json(r.to_json()).num_segments
    (True, 2)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = [
    "REPORT_VERSION",
    "seg_text",
    "TraceReport",
    "SharedParam",
    "BufferUse",
    "HiddenDependency",
    "CarriedValue",
    "CommonRead",
    "ExternalTensor",
    "GlobalSync",
]

REPORT_VERSION = 1


# ---------------------------------------------------------------------------------------------
# The report


@dataclass
class SharedParam:
    """A parameter read by several segments (tied weights)."""

    name: str
    segments: list[int]
    bytes: int
    note: str = "registered as shared by the runtime: every stage holding it keeps a copy and the copies' " \
                "gradients are summed before the optimizer step"


@dataclass
class BufferUse:
    """A buffer read outside the segments that call its owning module, or written and read apart."""

    name: str
    owner: str
    owner_segments: list[int]
    read_segments: list[int]
    written_segments: list[int]
    readers: list[str]
    #: "replicated" (read-only: every stage has a copy) or "mutable-cross-segment" (an error)
    status: str
    severity: str
    message: str


@dataclass
class HiddenDependency:
    """A value produced in one segment and read in another without passing through a CutPoint."""

    producer: str
    produced_in: int
    consumed_in: int
    consumer: str
    shape: list[int]
    dtype: str
    #: "error" (the engine refuses the model) or "warning" (0-dim values: the stage reads 0)
    severity: str
    message: str


@dataclass
class CarriedValue:
    """A module output read in later segments across routed (by-name or automatic) cut-points only:
    the engine sends it along with the activation (Note [Carried values] in varuna/cutting/cutpoint.py)."""

    producer: str
    #: the module returning it, which call of it in the forward, which tensor of its output
    module: str
    call: int
    leaf: int
    produced_in: int
    read_in: list[int]
    shape: list[int]
    dtype: str


@dataclass
class CommonRead:
    """A value every stage computes or holds (batch tensors, glue values derived from them)."""

    tensor: str
    kind: str
    produced_in: int | None
    read_in: list[int]
    consumers: list[str]


@dataclass
class ExternalTensor:
    """A tensor that is neither a parameter, a buffer nor computed by the forward."""

    name: str
    shape: list[int]
    dtype: str
    read_in: list[int]
    message: str


@dataclass
class GlobalSync:
    """State the engine agrees on across stages or replicas every step."""

    what: str
    how: str


@dataclass
class TraceReport:
    """What :func:`trace_model` found. ``print(report)`` gives the table; ``to_json`` the data."""

    cutpoints: list[str]
    num_segments: int
    shared_params: list[SharedParam] = field(default_factory=list)
    buffers: list[BufferUse] = field(default_factory=list)
    hidden_dependencies: list[HiddenDependency] = field(default_factory=list)
    common_reads: list[CommonRead] = field(default_factory=list)
    external_tensors: list[ExternalTensor] = field(default_factory=list)
    #: buffers written and read inside one segment only (e.g. BatchNorm running statistics)
    local_mutable_buffers: list[str] = field(default_factory=list)
    global_state: list[GlobalSync] = field(default_factory=list)
    #: parameter-free modules computing only from the batch and buffers whose outputs other segments
    #: read (e.g. a rotary embedding): the runtime runs them on every stage, as glue
    replicated_modules: list[str] = field(default_factory=list)
    #: module outputs crossing automatic cut-points that the engine carries with the activation
    carried_values: list[CarriedValue] = field(default_factory=list)
    version: int = REPORT_VERSION

    # -- verdict ---------------------------------------------------------------------------

    def errors(self) -> list[str]:
        """Messages of the problems that make a pipeline split wrong (empty: splittable)."""
        out = [d.message for d in self.hidden_dependencies if d.severity == "error"]
        out += [b.message for b in self.buffers if b.severity == "error"]
        return out

    def warnings(self) -> list[str]:
        out = [d.message for d in self.hidden_dependencies if d.severity == "warning"]
        out += [e.message for e in self.external_tensors]
        return out

    @property
    def ok(self) -> bool:
        return not self.errors()

    def check_splittable(self) -> None:
        """Raise ``ValueError`` naming every hidden dependency if the model cannot be split."""
        errs = self.errors()
        if errs:
            lines = "\n  - ".join(errs)
            raise ValueError(
                f"varuna: this model cannot be split into pipeline stages as annotated; {len(errs)} value(s) "
                f"cross a segment boundary without passing through a CutPoint, so the receiving stage would "
                f"compute with a placeholder:\n  - {lines}\n(run `varuna-trace` on the model for the full "
                "report; see docs/annotating.md)"
            )

    # -- machine-readable form -------------------------------------------------------------

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        """JSON with a ``version`` field; :meth:`from_json` reads it back.

        >>> TraceReport(cutpoints=[], num_segments=1).to_json(indent=None)[:40]
        '{"cutpoints": [], "num_segments": 1, "sh'
        """
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> TraceReport:
        d = json.loads(text)
        if d.get("version") != REPORT_VERSION:
            raise ValueError(f"trace report version {d.get('version')!r} is not {REPORT_VERSION}")
        kinds = {"shared_params": SharedParam, "buffers": BufferUse, "hidden_dependencies": HiddenDependency,
                 "common_reads": CommonRead, "external_tensors": ExternalTensor, "global_state": GlobalSync,
                 "carried_values": CarriedValue}
        for k, typ in kinds.items():
            d[k] = [typ(**x) for x in d.get(k, [])]
        return cls(**d)

    # -- table -----------------------------------------------------------------------------

    def __str__(self) -> str:
        return self.table()

    def _carried_rows(self, max_rows: int) -> list[str]:
        if not self.carried_values:
            return []
        rows = [[c.producer, str(c.produced_in), seg_text(c.read_in), "x".join(map(str, c.shape)) or "scalar"]
                for c in self.carried_values]
        return ["  module outputs carried across routed cut-points (sent with the activation, gradients "
                "sent back):", *_rows(["value", "made in", "read in", "shape"], rows, max_rows)]

    def table(self, max_rows: int = 20) -> str:
        """The human-readable report."""
        L: list[str] = []
        K = len(self.cutpoints)
        L.append(f"varuna-trace: {self.num_segments} segment(s), {K} CutPoint(s)"
                 + (f" in call order: {', '.join(self.cutpoints)}" if K else ""))
        L.append("")
        L.append("(a) Parameters read by more than one segment (tied weights)")
        if self.shared_params:
            L += _rows(["parameter", "segments", "bytes"],
                       [[p.name, seg_text(p.segments), str(p.bytes)] for p in self.shared_params], max_rows)
            L.append("    -> registered as shared by the runtime: each stage holding one keeps a copy and "
                     "the copies' gradients are summed.")
        else:
            L.append("    none")
        L.append("")
        L.append("(b) Values read across segments")
        if self.buffers:
            L.append("  buffers read outside their owner's segments:")
            L += _rows(["buffer", "owner (segments)", "read in", "written in", "status"],
                       [[b.name, f"{b.owner or '<model>'} ({seg_text(b.owner_segments)})",
                         seg_text(b.read_segments), seg_text(b.written_segments) or "-", b.status]
                        for b in self.buffers], max_rows)
        if self.hidden_dependencies:
            L.append("  hidden dependencies (no CutPoint on the way):")
            L += _rows(["severity", "value", "made in", "read in", "by", "shape"],
                       [[d.severity, d.producer, str(d.produced_in), str(d.consumed_in), d.consumer,
                         "x".join(map(str, d.shape)) or "scalar"] for d in self.hidden_dependencies],
                       max_rows)
            L.append("    fix: pass the value through the CutPoint (x, mask = cut(x, mask)), or compute it "
                     "from the batch in the model's forward (glue code runs on every stage).")
        L += self._carried_rows(max_rows)
        if not self.buffers and not self.hidden_dependencies and not self.carried_values:
            L.append("    none: every activation that crosses a boundary passes through its CutPoint")
        if self.common_reads:
            n = sum(len(c.consumers) for c in self.common_reads)
            L.append(f"  common values (batch tensors and glue computed from them, valid on every stage): "
                     f"{len(self.common_reads)} value(s), {n} reader(s)")
            for c in self.common_reads[:max_rows]:
                L.append(f"    {c.tensor} -> segments {seg_text(c.read_in)}")
            if len(self.common_reads) > max_rows:
                L.append(f"    ... {len(self.common_reads) - max_rows} more")
        L += [f"  modules run on every stage as glue (parameter-free, computing from the batch and buffers "
              f"only, read by other segments): {', '.join(self.replicated_modules[:max_rows])}"
              ] if self.replicated_modules else []
        if self.external_tensors:
            L.append("  tensors that are neither parameters, buffers nor computed by the forward:")
            for e in self.external_tensors[:max_rows]:
                L.append(f"    {e.name} {list(e.shape)} read in segments {seg_text(e.read_in)}: {e.message}")
        if self.local_mutable_buffers:
            names = ", ".join(self.local_mutable_buffers[:6])
            if len(self.local_mutable_buffers) > 6:
                names += " ..."
            L.append(f"  {len(self.local_mutable_buffers)} buffer(s) updated and read within one segment "
                     f"(e.g. BatchNorm statistics): fine; each stage updates its own ({names})")
        L.append("")
        L.append("(c) State the engine synchronizes every step")
        for g in self.global_state:
            L.append(f"  - {g.what}: {g.how}")
        L.append("")
        errs = self.errors()
        if errs:
            L.append(f"VERDICT: cannot be split as annotated ({len(errs)} error(s)):")
            L += [f"  - {e}" for e in errs]
        else:
            warns = self.warnings()
            L.append("VERDICT: OK, the model can be split at its CutPoints"
                     + (f" ({len(warns)} warning(s) above)" if warns else ""))
        return "\n".join(L)


def seg_text(segs) -> str:
    return ",".join(str(s) for s in segs)


def _rows(header: list[str], rows: list[list[str]], max_rows: int) -> list[str]:
    shown = rows[:max_rows]
    widths = [max(len(h), *(len(r[i]) for r in shown)) if shown else len(h) for i, h in enumerate(header)]
    fmt = "    " + "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header).rstrip(), "    " + "  ".join("-" * w for w in widths)]
    out += [fmt.format(*r).rstrip() for r in shown]
    if len(rows) > max_rows:
        out.append(f"    ... {len(rows) - max_rows} more")
    return out
