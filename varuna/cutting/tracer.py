"""The tracer: which tensors, parameters and buffers cross segment boundaries in a model's forward.

A pipeline stage runs the user's whole forward, but modules outside the stage return
placeholders (zeros of the right shape) and parameters outside it are zeros (see Note
[Placeholders] in :mod:`varuna.cutting.split`). A value therefore reaches a later stage correctly only if

* it passes through a CutPoint (``x = cut(x)``: the stage receives it), or
* it is *common*: computed by glue code (code that runs on every stage) from the batch,
  buffers and constants only — e.g. an attention mask built from the input ids, or
* it is a parameter (the runtime keeps every parameter a segment reads, and sums the gradients
  of parameters read by several stages: tied embeddings), or a buffer that nobody writes (the
  runtime keeps every buffer on every stage).

Anything else read in another segment is a *hidden dependency*: the receiving stage would compute
with a placeholder. :func:`trace_model` finds them in one dry run in one process, with a
``TorchFunctionMode`` (no patching of PyTorch) that tags every tensor with the segment and the
module call that produced it, and checks every operation's inputs against the segment it runs
in. The result is a :class:`TraceReport`: a table for people (``print(report)``, the
``varuna-trace`` command) and JSON for programs (:meth:`TraceReport.to_json`). The engine refuses a
model whose report has errors before it splits it (:meth:`TraceReport.check_splittable`).

Example::

    >>> import torch, varuna
    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b, self.cut = nn.Linear(4, 4), nn.Linear(4, 4), varuna.CutPoint()
    ...     def forward(self, x):
    ...         h = self.a(x)
    ...         return (self.b(self.cut(h)) + h).sum()       # h skips the CutPoint
    >>> report = trace_model(Net(), torch.randn(2, 4))
    >>> [d.producer for d in report.hidden_dependencies]
    ["output of module 'a'"]
    >>> report.ok
    False

What it cannot see: values that leave torch (``.item()``, ``.tolist()``, Python numbers used in
later control flow), state kept outside tensors, and behaviour that changes with the data (the
dry run follows one path). See docs/annotating.md.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from varuna.cutting.batches import call_with_batch
from varuna.cutting.cutpoint import CutPoint, DryRun, SplitState

__all__ = [
    "TraceReport",
    "SharedParam",
    "BufferUse",
    "HiddenDependency",
    "CommonRead",
    "ExternalTensor",
    "GlobalSync",
    "trace_model",
    "check_splittable",
]

REPORT_VERSION = 1

#: Tensor functions that read only metadata (shape, dtype, ...): placeholders have the same
#: metadata, so these never create a dependency.
_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "is_floating_point", "is_complex",
    "is_contiguous", "element_size", "__len__", "shape", "ndim", "dtype", "device", "is_cuda",
    "is_meta", "is_sparse", "layout", "requires_grad", "grad_fn", "is_leaf", "names", "storage_offset",
    "get_device", "data_ptr", "_version", "is_quantized", "is_mkldnn", "is_nested", "itemsize", "nbytes",
    "requires_grad_", "register_hook", "retain_grad", "_is_view", "is_inference", "__repr__",
    "__format__", "__hash__", "is_signed", "dim_order", "_base", "output_nr",
})


# ---------------------------------------------------------------------------------------------
# Recording (shared with varuna.cutting.autocut)


@dataclass(eq=False)
class _Info:
    """What the recorder knows about one tensor object (see :class:`_Recorder`)."""

    #: clock of the operation that produced the value (an alias keeps its source's)
    created: int
    #: segment in which the value was produced; None: outside the model (batch, buffer, constant)
    segment: int | None
    #: derived only from the batch, buffers, constants and external tensors (no parameter, no
    #: module output): such a value is right on every stage if all of ``chain`` runs there
    pure: bool
    #: indices of the module calls whose own code computed a pure value
    chain: frozenset[int]
    #: "input", "buffer", "external", "op", "output" (of a module), "cut", "param"
    kind: str
    #: human-readable producer, e.g. "output of module 'blocks.0'"
    desc: str
    shape: tuple[int, ...]
    dtype: str
    #: the info of the value this one aliases (itself for a fresh value)
    origin: _Info | None = None
    #: clock of the last operation that read it
    last_use: int = -1
    #: for a module-output alias: the info it aliases (the value the module returned)
    via: _Info | None = None

    def __post_init__(self) -> None:
        if self.origin is None:
            self.origin = self


@dataclass
class _Call:
    """One call of one module during the recorded forward."""

    index: int
    name: str
    module: nn.Module
    start: int
    seg_start: int
    ops_start: int
    end: int = -1
    seg_end: int = -1
    ops_end: int = -1
    parent: int | None = None
    #: "tensor", "sequence" (tuple/list whose first element is a tensor) or "other"
    out_kind: str = "other"
    #: the produced value behind the first output tensor (before the module-output alias)
    first_src: _Info | None = None
    #: the alias tagged "output of module ..." of the first output tensor
    first_alias: _Info | None = None
    first_meta: tuple[tuple[int, ...], torch.dtype, int] | None = None
    flops_end: float = 0.0


@dataclass
class _Read:
    """One operation reading a value produced in another segment (or outside the model)."""

    info: _Info
    segment: int
    consumer: str


def _func_name(func) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":  # property getters: x.shape, x.T, x.data ...
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor object sharing ``t``'s data, so it can carry its own tag."""
    try:
        return t.view_as(t)
    except (RuntimeError, TypeError, NotImplementedError):  # exotic layouts: tag the tensor itself
        return t


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except (RuntimeError, AttributeError):  # tensors without a version counter (e.g. some subclasses)
        return -1


def _stat_writes(func, args, kwargs) -> list[torch.Tensor]:
    """Buffers updated inside a kernel without bumping their version counter (running stats)."""
    if func not in (F.batch_norm, F.instance_norm):
        return []
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except TypeError:
        return []
    bound.apply_defaults()
    a = bound.arguments
    flag = a.get("training") if func is F.batch_norm else a.get("use_input_stats")
    if not flag:
        return []
    return [t for t in (a.get("running_mean"), a.get("running_var")) if isinstance(t, torch.Tensor)]


class _Recorder(TorchFunctionMode):
    """Tags every tensor the forward creates and records what each operation reads.

    A monotone ``clock`` ticks at every operation and at every module call's start and end. Each
    tensor gets an :class:`_Info` (kept in a ``WeakIdKeyDictionary``, so tensors are not kept
    alive). Module outputs are replaced by aliases (``x.view_as(x)``) tagged "output of module
    ...": on a stage that skips the module they would be placeholders, so they must be told
    apart from the module's inputs even when a module returns its input unchanged.
    """

    def __init__(self, model: nn.Module, *, flop_counter=None) -> None:
        super().__init__()
        self.model = model
        self.clock = 0
        self.ops = 0
        self.segment = 0
        self.paused = False
        self.flop_counter = flop_counter
        self.infos: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.all_infos: list[_Info] = []
        self.calls: list[_Call] = []
        self.stack: list[_Call] = []
        self.reads: list[_Read] = []
        self._read_keys: set[tuple] = set()
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        self.param_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        self.param_uses: dict[str, set[int]] = {}
        self.buffer_names = {id(b): n for n, b in model.named_buffers()}
        #: buffer name -> [(segment, consumer)]
        self.buffer_reads: dict[str, list[tuple[int, str]]] = {}
        #: buffer name -> [(segment, info of the written value, writer)]
        self.buffer_writes: dict[str, list[tuple[int, _Info, str]]] = {}
        #: buffer name -> clocks of its first and last access (read or write)
        self.buffer_span: dict[str, list[int]] = {}
        self.external_names: dict[int, str] = {}
        for mname, mod in model.named_modules():
            for attr, val in vars(mod).items():
                if isinstance(val, torch.Tensor) and not isinstance(val, nn.Parameter) \
                        and not attr.startswith("_"):
                    self.external_names.setdefault(id(val), f"{mname}.{attr}" if mname else attr)
        self.module_names = {id(m): n for n, m in model.named_modules()}
        self.call_counts: dict[int, int] = {}
        #: registered names of the CutPoints in the order the forward crossed them
        self.cut_order: list[str] = []
        for n, b in model.named_buffers():
            self._new(b, kind="buffer", desc=f"buffer '{n}'", pure=True, segment=None, created=0)

    # -- bookkeeping -----------------------------------------------------------------------

    def _new(self, t: torch.Tensor, *, kind: str, desc: str, pure: bool, segment: int | None, created: int,
             chain: frozenset[int] = frozenset(), origin: _Info | None = None,
             via: _Info | None = None) -> _Info:
        info = _Info(created=created, segment=segment, pure=pure, chain=chain if pure else frozenset(),
                     kind=kind, desc=desc, shape=tuple(t.shape), dtype=str(t.dtype).replace("torch.", ""),
                     origin=origin, via=via)
        self.infos[t] = info
        self.all_infos.append(info)
        return info

    def mark_inputs(self, batch) -> None:
        for i, leaf in enumerate(tree_flatten(batch)[0]):
            if isinstance(leaf, torch.Tensor) and leaf not in self.infos:
                self._new(leaf, kind="input", desc=f"batch tensor #{i}", pure=True, segment=None, created=0)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        old, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = old

    def context(self) -> str:
        """Where the current operation runs, for messages."""
        if not self.stack:
            return "the loss function"
        name = self.stack[-1].name
        return f"module '{name}'" if name else "the model's forward"

    def _lookup(self, t: torch.Tensor, op: str) -> _Info | None:
        """The info of a tensor read by an operation (None for parameters)."""
        if id(t) in self.param_names:
            return None
        info = self.infos.get(t)
        if info is None:
            # Never produced by an operation we saw: created outside the traced code.
            name = self.external_names.get(id(t))
            desc = (f"tensor attribute '{name}'" if name
                    else f"tensor created outside the model (first read by {op})")
            info = self._new(t, kind="external", desc=desc, pure=True, segment=None, created=0)
        return info

    def _note_read(self, info: _Info, consumer: str) -> None:
        if info.segment == self.segment:
            return
        key = (id(info), self.segment, consumer)
        if key not in self._read_keys:
            self._read_keys.add(key)
            self.reads.append(_Read(info, self.segment, consumer))

    def consume(self, leaves, consumer: str) -> None:
        """Record that ``consumer`` reads ``leaves`` now (e.g. the returned loss)."""
        self.clock += 1
        for x in leaves:
            if isinstance(x, torch.Tensor):
                info = self._lookup(x, consumer)
                if info is not None:
                    info.last_use = self.clock
                    self._note_read(info, consumer)

    # -- the mode --------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _func_name(func)
        if self.paused or name in _METADATA:
            return func(*args, **kwargs)
        leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        versions = [_version(x) for x in leaves]
        self.clock += 1
        self.ops += 1
        now, seg = self.clock, self.segment
        where = self.context()
        consumer = f"{name} in {where}"
        pure, chain = True, set()
        for x in leaves:
            pname = self.param_names.get(id(x))
            if pname is not None:
                self.param_uses.setdefault(pname, set()).add(seg)
                pure = False
                continue
            info = self._lookup(x, consumer)
            info.last_use = now
            pure = pure and info.pure
            chain |= info.chain
            self._note_read(info, consumer)
            bname = self.buffer_names.get(id(x))
            if bname is not None:
                self.buffer_reads.setdefault(bname, []).append((seg, consumer))
                self.buffer_span.setdefault(bname, [now, now])[1] = now
        out = func(*args, **kwargs)
        if self.stack:
            chain.add(self.stack[-1].index)
        chain_f = frozenset(chain)
        input_ids = {id(x) for x in leaves}
        written = [x for x, v in zip(leaves, versions) if _version(x) != v]
        written += _stat_writes(func, args, kwargs)
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and id(o) not in input_ids:
                self._new(o, kind="op", desc=f"'{name}' in {where}", pure=pure, segment=seg, created=now,
                          chain=chain_f)
        seen: set[int] = set()
        for w in written:
            for t in (w, w._base):
                if t is None or id(t) in seen or id(t) in self.param_names:
                    continue
                seen.add(id(t))
                info = self._new(t, kind="op", desc=f"'{name}' (in place) in {where}", pure=pure, segment=seg,
                                 created=now, chain=chain_f)
                bname = self.buffer_names.get(id(t))
                if bname is not None:
                    self.buffer_writes.setdefault(bname, []).append((seg, info, consumer))
                    self.buffer_span.setdefault(bname, [now, now])[1] = now
        return out

    # -- module hooks ----------------------------------------------------------------------

    def install(self) -> list:
        handles = []
        for m in self.model.modules():
            if isinstance(m, CutPoint):
                continue
            handles.append(m.register_forward_pre_hook(self._pre))
            handles.append(m.register_forward_hook(self._post))
        return handles

    def _pre(self, mod: nn.Module, args) -> None:
        self.clock += 1
        self.call_counts[id(mod)] = self.call_counts.get(id(mod), 0) + 1
        call = _Call(index=len(self.calls), name=self.module_names.get(id(mod), "?"), module=mod,
                     start=self.clock, seg_start=self.segment, ops_start=self.ops,
                     parent=self.stack[-1].index if self.stack else None)
        self.calls.append(call)
        self.stack.append(call)

    def _post(self, mod: nn.Module, args, out):
        call = self.stack.pop()
        assert call.module is mod, "module calls must nest"
        self.clock += 1
        call.end, call.seg_end, call.ops_end = self.clock, self.segment, self.ops
        if self.flop_counter is not None:
            call.flops_end = float(self.flop_counter.get_total_flops())
        if call.parent is None:
            return None  # the model itself: its output goes to the loss function unchanged
        leaves, spec = tree_flatten(out)
        if isinstance(out, torch.Tensor):
            call.out_kind = "tensor"
        elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            call.out_kind = "sequence"
        new_leaves = []
        with self.pause():
            for leaf in leaves:
                if not isinstance(leaf, torch.Tensor):
                    new_leaves.append(leaf)
                    continue
                pname = self.param_names.get(id(leaf))
                if pname is not None:
                    self.param_uses.setdefault(pname, set()).add(self.segment)
                    src = _Info(created=call.end, segment=self.segment, pure=False, chain=frozenset(),
                                kind="param", desc=f"parameter '{pname}'", shape=tuple(leaf.shape),
                                dtype=str(leaf.dtype).replace("torch.", ""))
                else:
                    src = self.infos.get(leaf)
                    if src is None:  # produced by code we could not see: count it as made here
                        src = self._new(leaf, kind="op", desc=f"untracked value in module '{call.name}'",
                                        pure=False, segment=self.segment, created=call.end - 1)
                alias = _alias(leaf)
                what = f"output of module '{call.name}'"
                if src.kind in ("buffer", "param"):
                    what += f" (its {src.desc})"
                ainfo = self._new(alias, kind="output", desc=what, pure=src.pure, segment=src.segment,
                                  created=src.created, chain=src.chain | {call.index}, origin=src.origin,
                                  via=src)
                if call.first_src is None and call.out_kind != "other":
                    call.first_src, call.first_alias = src, ainfo
                    call.first_meta = (tuple(leaf.shape), leaf.dtype, leaf.numel() * leaf.element_size())
                new_leaves.append(alias)
        return tree_unflatten(new_leaves, spec)


class _TraceRun(DryRun):
    """The tracer's view of CutPoint crossings: new segment, and fresh tags for what crosses."""

    def __init__(self, recorder: _Recorder, cutpoint_names: dict[int, str]) -> None:
        super().__init__(cutpoint_names=cutpoint_names)
        self.recorder = recorder

    def cross(self, cp: CutPoint, xs: tuple[torch.Tensor, ...]):
        super().cross(cp, xs)
        rec = self.recorder
        rec.segment = self.segment
        name = self.cutpoint_names.get(id(cp), "?")
        out = []
        with rec.pause():
            for x in xs:
                src = rec.infos.get(x) or rec._lookup(x, f"CutPoint '{name}'")
                alias = _alias(x)
                if src is not None:
                    src.last_use = rec.clock
                if src is not None and src.pure:
                    # Glue values stay glue values: every stage computes them, whichever side it is on.
                    rec._new(alias, kind="cut", desc=src.desc, pure=True, segment=src.segment,
                             created=src.created, chain=src.chain, origin=src.origin)
                else:
                    rec._new(alias, kind="cut", desc=f"activation received at CutPoint '{name}'", pure=False,
                             segment=self.segment, created=rec.clock)
                out.append(alias)
        return out[0] if len(out) == 1 else tuple(out)




def _to_meta(tree):
    leaves, spec = tree_flatten(tree)
    return tree_unflatten(
        [torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x
         for x in leaves],
        spec,
    )


@contextlib.contextmanager
def _preserved_state(model: nn.Module) -> Iterator[None]:
    """Dry runs must not leave traces: global RNG and buffers (BatchNorm statistics) restored."""
    saved = [(b, b.detach().clone()) for b in model.buffers() if not b.is_meta]
    devices = sorted({b.device.index or 0 for b in model.buffers() if b.device.type == "cuda"} |
                     {p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for b, v in saved:
                    b.copy_(v)


def record_forward(model: nn.Module, batch, loss_fn: Callable | None, *, flop_counter=None) -> _Recorder:
    """Run one forward (and ``loss_fn``) of ``model`` on ``batch`` under a :class:`_Recorder`.

    CutPoints split the run into segments as in the engine. Nothing is left changed: RNG state,
    buffers and the CutPoints' engine state are restored.
    """
    if any(p.is_meta for p in model.parameters()):
        batch = _to_meta(batch)
    rec = _Recorder(model, flop_counter=flop_counter)
    cps = [m for m in model.modules() if isinstance(m, CutPoint)]
    old_states = [cp._varuna_state for cp in cps]
    state = SplitState()
    run = _TraceRun(rec, {id(m): n for n, m in model.named_modules() if isinstance(m, CutPoint)})
    state.run = run
    for cp in cps:
        cp._varuna_state = state
    handles = rec.install()
    rec.mark_inputs(batch)
    try:
        with _preserved_state(model), torch.no_grad():
            with flop_counter if flop_counter is not None else contextlib.nullcontext(), rec:
                out = call_with_batch(model, batch)
                if loss_fn is not None:
                    loss = loss_fn(out, batch)
                    rec.consume(tree_flatten(loss)[0], "the loss (backward)")
                else:
                    rec.consume(tree_flatten(out)[0], "the returned loss (backward)")
    finally:
        for h in handles:
            h.remove()
        for cp, s in zip(cps, old_states):
            cp._varuna_state = s
    rec.cut_order = [run.cutpoint_names.get(id(cp), "?") for cp in run.order]

    return rec


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
                 "common_reads": CommonRead, "external_tensors": ExternalTensor, "global_state": GlobalSync}
        for k, typ in kinds.items():
            d[k] = [typ(**x) for x in d.get(k, [])]
        return cls(**d)

    # -- table -----------------------------------------------------------------------------

    def __str__(self) -> str:
        return self.table()

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
                       [[p.name, _segs(p.segments), str(p.bytes)] for p in self.shared_params], max_rows)
            L.append("    -> registered as shared by the runtime: each stage holding one keeps a copy and "
                     "the copies' gradients are summed.")
        else:
            L.append("    none")
        L.append("")
        L.append("(b) Values read across segments")
        if self.buffers:
            L.append("  buffers read outside their owner's segments:")
            L += _rows(["buffer", "owner (segments)", "read in", "written in", "status"],
                       [[b.name, f"{b.owner or '<model>'} ({_segs(b.owner_segments)})",
                         _segs(b.read_segments), _segs(b.written_segments) or "-", b.status]
                        for b in self.buffers], max_rows)
        if self.hidden_dependencies:
            L.append("  hidden dependencies (no CutPoint on the way):")
            L += _rows(["severity", "value", "made in", "read in", "by", "shape"],
                       [[d.severity, d.producer, str(d.produced_in), str(d.consumed_in), d.consumer,
                         "x".join(map(str, d.shape)) or "scalar"] for d in self.hidden_dependencies],
                       max_rows)
            L.append("    fix: pass the value through the CutPoint (x, mask = cut(x, mask)), or compute it "
                     "from the batch in the model's forward (glue code runs on every stage).")
        if not self.buffers and not self.hidden_dependencies:
            L.append("    none: every activation that crosses a boundary passes through its CutPoint")
        if self.common_reads:
            n = sum(len(c.consumers) for c in self.common_reads)
            L.append(f"  common values (batch tensors and glue computed from them, valid on every stage): "
                     f"{len(self.common_reads)} value(s), {n} reader(s)")
            for c in self.common_reads[:max_rows]:
                L.append(f"    {c.tensor} -> segments {_segs(c.read_in)}")
            if len(self.common_reads) > max_rows:
                L.append(f"    ... {len(self.common_reads) - max_rows} more")
        if self.external_tensors:
            L.append("  tensors that are neither parameters, buffers nor computed by the forward:")
            for e in self.external_tensors[:max_rows]:
                L.append(f"    {e.name} {list(e.shape)} read in segments {_segs(e.read_in)}: {e.message}")
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


def _segs(segs) -> str:
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


# ---------------------------------------------------------------------------------------------
# Analysis


def trace_model(model: nn.Module, example_batch, loss_fn: Callable | None = None) -> TraceReport:
    """Dry-run ``model`` on ``example_batch`` (one micro-batch) and report what crosses segments.

    ``loss_fn(output, batch)`` as for :class:`varuna.Engine` (default: the forward returns the
    loss). The model is left as it was (RNG, buffers). Works on a ``meta`` model too.

    Example::

        >>> import torch, sys; sys.path.insert(0, "examples/gpt2")
        >>> from model import GPT, GPTConfig                       # doctest: +SKIP
        >>> idx = torch.randint(0, 256, (2, 17))                    # doctest: +SKIP
        >>> r = trace_model(GPT(GPTConfig()), (idx[:, :-1], idx[:, 1:]))  # doctest: +SKIP
        >>> [(p.name, p.segments) for p in r.shared_params]          # doctest: +SKIP
        [('wte.weight', [0, 4])]
    """
    rec = record_forward(model, example_batch, loss_fn)
    return _analyse(rec)


def check_splittable(model: nn.Module, example_batch, loss_fn: Callable | None = None, *,
                     warn: bool = True) -> TraceReport | None:
    """What the engine runs before splitting a model over several stages.

    Raises ``ValueError`` (see :meth:`TraceReport.check_splittable`) if a value would reach a stage
    as a placeholder; with ``warn``, issues a ``UserWarning`` for 0-dim values read across segments.
    Should the tracer itself fail on some exotic model, it warns and returns None: the check is a
    safety net and must not stop a model the runtime can run.
    """
    try:
        report = trace_model(model, example_batch, loss_fn)
    except Exception as e:  # the forward itself already ran fine in the engine's dry run
        warnings.warn(f"varuna: the hidden-dependency check could not run ({type(e).__name__}: {e}); the "
                      "model is split without it", stacklevel=2)
        return None
    report.check_splittable()
    scalars = [d for d in report.hidden_dependencies if d.severity == "warning"]
    if warn and scalars:
        warnings.warn(f"varuna: {len(scalars)} 0-dim value(s) cross a segment boundary outside a CutPoint "
                      f"(e.g. {scalars[0].producer}, read in segment {scalars[0].consumed_in}); other stages "
                      "read 0 there. Fine for statistics, wrong for an auxiliary loss: run varuna-trace",
                      stacklevel=2)
    return report


def _spanning_modules(rec: _Recorder) -> set[int]:
    """Modules with a call that contains a boundary: the runtime runs them as glue on every stage."""
    return {id(c.module) for c in rec.calls if c.seg_start != c.seg_end}


def _free(info: _Info, calls: list[_Call], glue: set[int]) -> bool:
    """True if every stage computes this value itself (pure, and computed only by glue code)."""
    return info.pure and all(id(calls[c].module) in glue for c in info.chain)


def _analyse(rec: _Recorder) -> TraceReport:
    nseg = len(rec.cut_order) + 1
    glue = _spanning_modules(rec)
    calls = rec.calls
    report = TraceReport(cutpoints=list(rec.cut_order), num_segments=nseg)

    # (a) tied weights
    for name, segs in sorted(rec.param_uses.items()):
        if len(segs) > 1:
            report.shared_params.append(SharedParam(name, sorted(segs), rec.param_bytes.get(name, 0)))

    # (b) buffers
    owner_segments: dict[str, set[int]] = {}
    for c in calls:
        owner_segments.setdefault(c.name, set()).update(range(c.seg_start, c.seg_end + 1))
    for bname in sorted(set(rec.buffer_reads) | set(rec.buffer_writes)):
        reads = rec.buffer_reads.get(bname, [])
        writes = rec.buffer_writes.get(bname, [])
        owner = bname.rpartition(".")[0]
        osegs = sorted(owner_segments.get(owner, set())) if owner else list(range(nseg))
        rsegs = sorted({s for s, _ in reads})
        local_writes = [(s, w) for s, info, w in writes if not _free(info, calls, glue)]
        wsegs = sorted({s for s, _, _ in writes})
        readers = sorted({r for _, r in reads})[:8]
        if local_writes:
            segs = set(rsegs) | {s for s, _ in local_writes}
            if len(segs) > 1:
                ws, writer = local_writes[0]
                rs, reader = next(((s, r) for s, r in reads if s != ws), (ws, "?"))
                report.buffers.append(BufferUse(
                    bname, owner, osegs, rsegs, wsegs, readers, "mutable-cross-segment", "error",
                    f"buffer '{bname}' is written in segment {ws} ({writer}) and read in segment {rs} "
                    f"({reader}); each stage updates only its own copy, so the reader sees a stale value. "
                    "Keep its writes and reads in one segment, or pass the value through the CutPoint",
                ))
            else:
                report.local_mutable_buffers.append(bname)
        elif owner and osegs and not set(rsegs) <= set(osegs):
            report.buffers.append(BufferUse(
                bname, owner, osegs, rsegs, wsegs, readers, "replicated", "info",
                f"buffer '{bname}' (owned by '{owner}', segment(s) {_segs(osegs)}) is read in segment(s) "
                f"{_segs(rsegs)}; it is read-only, and the runtime keeps every buffer on every stage",
            ))

    # (b) values read in another segment than the one that produced them
    hidden: dict[tuple, HiddenDependency] = {}
    common: dict[int, CommonRead] = {}
    externals: dict[int, ExternalTensor] = {}
    for r in rec.reads:
        info = r.info
        if info.kind == "buffer":
            continue  # buffers: above
        if info.kind == "external":
            e = externals.get(id(info))
            if e is None:
                e = externals[id(info)] = ExternalTensor(
                    info.desc, list(info.shape), info.dtype, [],
                    "not moved to the stage's device or materialized from `meta`: register it as a buffer "
                    "(self.register_buffer(name, t, persistent=False))")
            if r.segment not in e.read_in:
                e.read_in.append(r.segment)
            continue
        if info.segment is None or _free(info, calls, glue):
            c = common.get(id(info.origin))
            if c is None:
                c = common[id(info.origin)] = CommonRead(info.desc, info.kind, info.segment, [], [])
            if r.segment not in c.read_in:
                c.read_in.append(r.segment)
            if len(c.consumers) < 8 and r.consumer not in c.consumers:
                c.consumers.append(r.consumer)
            continue
        key = (id(info.origin), r.segment)
        if key in hidden:
            continue
        scalar = len(info.shape) == 0
        sev = "warning" if scalar else "error"
        what = "0-dim value" if scalar else f"tensor of shape {list(info.shape)}"
        msg = (f"{info.desc} (a {what} made in segment {info.segment}) is read in segment {r.segment} "
               f"by {r.consumer} without passing through a CutPoint; the stage running segment "
               f"{r.segment} would see a placeholder. Fix: pass it through the CutPoint that ends segment "
               f"{info.segment} (x, extra = cut(x, extra)) and through every later one up to segment "
               f"{r.segment}, or compute it from the batch in the model's forward")
        if scalar:
            msg += (" (reported as a warning: the stage reads 0 there; fine for logging statistics, "
                    "wrong for an auxiliary loss)")
        hidden[key] = HiddenDependency(info.desc, info.segment, r.segment, r.consumer, list(info.shape),
                                       info.dtype, sev, msg)
    report.hidden_dependencies = sorted(hidden.values(), key=lambda d: (d.severity != "error", d.produced_in,
                                                                         d.consumed_in))
    report.common_reads = [c for c in common.values() if any(s != c.produced_in for s in c.read_in)]
    report.external_tensors = list(externals.values())
    report.global_state = _global_state(report)
    return report


def _global_state(report: TraceReport) -> list[GlobalSync]:
    out = [
        GlobalSync("data-parallel gradients",
                   "each stage's gradients are summed over its D replicas (bucketed all-reduce)"),
    ]
    if report.shared_params:
        names = ", ".join(p.name for p in report.shared_params)
        out.append(GlobalSync("shared parameters",
                              f"{names}: gradients summed over every stage and replica holding a copy, so "
                              "the copies stay identical after each optimizer step"))
    out += [
        GlobalSync("global gradient norm (max_grad_norm clipping)",
                   "sum of squares all-reduced over all ranks, replica 0 only, each shared parameter counted "
                   "once (on the first stage holding it); every rank clips with the same coefficient"),
        GlobalSync("loss-scale overflow (fp16)",
                   "one non-finite flag all-reduced over all ranks: every rank skips the step and updates "
                   "its loss scale identically"),
        GlobalSync("loss", "all-reduced: the mean over the whole mini-batch, reported on every rank"),
        GlobalSync("randomness (dropout)",
                   "reseeded at the start of every segment from (seed, step, micro-batch, segment): the same "
                   "masks at any P×D and in recompute"),
    ]
    if report.local_mutable_buffers:
        out.append(GlobalSync("buffers updated in the forward (e.g. BatchNorm statistics)",
                              "NOT synchronized: each stage updates its own, and data-parallel replicas may "
                              "drift apart"))
    return out
