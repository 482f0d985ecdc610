"""Recording a model's forward for the tracer and the auto-cutter: who made each tensor, who read it.

One dry run of the forward under a :class:`Recorder` (a ``TorchFunctionMode``: no patching of
PyTorch) tags every tensor with the segment and the module call that produced it
(:class:`TensorInfo`), records every module call (:class:`ModuleCall`) and every read of a tensor
from another segment (:class:`TensorRead`), and which segments read each parameter and buffer.
:mod:`varuna.cutting.tracer` turns a recording into a report; :mod:`varuna.cutting.autocut` uses
it to find where cut-points can go.

Example::

    >>> import torch
    >>> from torch import nn
    >>> rec = record_forward(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(2, 4), None)
    >>> [c.name for c in rec.calls][:2]
    ['', '0']
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from varuna.cutting.batches import call_with_batch, to_meta
from varuna.cutting.cutpoint import CutPoint, DryRun, SplitState
from varuna.cutting.loss import loss_field

__all__ = ["ModuleCall", "Recorder", "TensorInfo", "TensorRead", "TraceRun", "preserved_state",
           "record_forward"]

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
class TensorInfo:
    """What the recorder knows about one tensor object (see :class:`Recorder`)."""

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
    origin: TensorInfo | None = None
    #: clock of the last operation that read it
    last_use: int = -1
    #: for a module-output alias: the info it aliases (the value the module returned)
    via: TensorInfo | None = None
    #: for a module-output alias: (index of the call, index of the tensor among its flattened outputs)
    out_of: tuple[int, int] | None = None
    #: for a pure value passed through a CutPoint: the segment it entered there (the stage running
    #: that segment receives it, even if the modules that computed it run elsewhere)
    arrived: int | None = None
    #: for a module-output alias: (clock, index of the innermost module call or -1) of each read, so
    #: the auto-cutter can tell state that later blocks take as input (carried across a cut) from a
    #: value that code inside an enclosing call still reads (a residual: not carried)
    reads: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.origin is None:
            self.origin = self


@dataclass
class ModuleCall:
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
    first_src: TensorInfo | None = None
    #: the alias tagged "output of module ..." of the first output tensor
    first_alias: TensorInfo | None = None
    first_meta: tuple[tuple[int, ...], torch.dtype, int] | None = None
    flops_end: float = 0.0
    #: it returned tensors, all derived only from the batch, buffers and constants (no parameter,
    #: no activation): with no parameters of its own it can run on every stage as glue
    outputs_pure: bool = False
    #: which call of its module this is in the forward (0-based)
    ordinal: int = 0


@dataclass
class TensorRead:
    """One operation reading a value produced in another segment (or outside the model)."""

    info: TensorInfo
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


class Recorder(TorchFunctionMode):
    """Tags every tensor the forward creates and records what each operation reads.

    A monotone ``clock`` ticks at every operation and at every module call's start and end. Each
    tensor gets an :class:`TensorInfo` (kept in a ``WeakIdKeyDictionary``, so tensors are not kept
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
        self.all_infos: list[TensorInfo] = []
        self.calls: list[ModuleCall] = []
        self.stack: list[ModuleCall] = []
        self.reads: list[TensorRead] = []
        self._read_keys: set[tuple] = set()
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        self.param_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        self.param_uses: dict[str, set[int]] = {}
        self.buffer_names = {id(b): n for n, b in model.named_buffers()}
        #: buffer name -> [(segment, consumer)]
        self.buffer_reads: dict[str, list[tuple[int, str]]] = {}
        #: buffer name -> [(segment, info of the written value, writer)]
        self.buffer_writes: dict[str, list[tuple[int, TensorInfo, str]]] = {}
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
        #: per crossed CutPoint: inserted by apply_cutpoints (Note [Carried values] in cutpoint.py)
        self.cut_routed: list[bool] = []
        for n, b in model.named_buffers():
            self._new(b, kind="buffer", desc=f"buffer '{n}'", pure=True, segment=None, created=0)

    # -- bookkeeping -----------------------------------------------------------------------

    def _new(self, t: torch.Tensor, *, kind: str, desc: str, pure: bool, segment: int | None, created: int,
             chain: frozenset[int] = frozenset(), origin: TensorInfo | None = None,
             via: TensorInfo | None = None, out_of: tuple[int, int] | None = None) -> TensorInfo:
        info = TensorInfo(created=created, segment=segment, pure=pure, chain=chain if pure else frozenset(),
                     kind=kind, desc=desc, shape=tuple(t.shape), dtype=str(t.dtype).replace("torch.", ""),
                     origin=origin, via=via, out_of=out_of)
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

    def _lookup(self, t: torch.Tensor, op: str) -> TensorInfo | None:
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

    def _note_read(self, info: TensorInfo, consumer: str) -> None:
        if info.segment == self.segment:
            return
        key = (id(info), self.segment, consumer)
        if key not in self._read_keys:
            self._read_keys.add(key)
            self.reads.append(TensorRead(info, self.segment, consumer))

    def consume(self, leaves, consumer: str) -> None:
        """Record that ``consumer`` reads ``leaves`` now (e.g. the returned loss)."""
        self.clock += 1
        for x in leaves:
            if isinstance(x, torch.Tensor):
                info = self._lookup(x, consumer)
                if info is not None:
                    info.last_use = self.clock
                    if info.out_of is not None:
                        info.reads.append((self.clock, -1))  # outside every module (the loss)
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
            if info.out_of is not None:
                info.reads.append((now, self.stack[-1].index if self.stack else -1))
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
            # First among the post hooks, as in the engine's dry run (split._boundary_hooks): a
            # CutPoint a user's forward hook calls is outside the module's call.
            handles.append(m.register_forward_hook(self._post, prepend=True))
        return handles

    def _pre(self, mod: nn.Module, args) -> None:
        self.clock += 1
        ordinal = self.call_counts.get(id(mod), 0)
        self.call_counts[id(mod)] = ordinal + 1
        call = ModuleCall(index=len(self.calls), name=self.module_names.get(id(mod), "?"), module=mod,
                     start=self.clock, seg_start=self.segment, ops_start=self.ops,
                     parent=self.stack[-1].index if self.stack else None, ordinal=ordinal)
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
        pure_outputs: list[bool] = []
        with self.pause():
            for pos, leaf in enumerate(leaves):
                if not isinstance(leaf, torch.Tensor):
                    new_leaves.append(leaf)
                    continue
                pname = self.param_names.get(id(leaf))
                if pname is not None:
                    self.param_uses.setdefault(pname, set()).add(self.segment)
                    src = TensorInfo(created=call.end, segment=self.segment, pure=False, chain=frozenset(),
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
                pure_outputs.append(src.pure)
                ainfo = self._new(alias, kind="output", desc=what, pure=src.pure, segment=src.segment,
                                  created=src.created, chain=src.chain | {call.index}, origin=src.origin,
                                  via=src, out_of=(call.index, pos))
                if src.arrived is not None and call.seg_start == call.seg_end == src.arrived:
                    # A glue value that crossed a cut, returned again by a module of the segment it
                    # arrived in (T5's blocks return the cross-attention bias they were given): the
                    # stage running that segment has it, as it has the value itself.
                    ainfo.arrived = src.arrived
                if call.first_src is None and call.out_kind != "other":
                    call.first_src, call.first_alias = src, ainfo
                    call.first_meta = (tuple(leaf.shape), leaf.dtype, leaf.numel() * leaf.element_size())
                new_leaves.append(alias)
        call.outputs_pure = bool(pure_outputs) and all(pure_outputs)
        return tree_unflatten(new_leaves, spec)


class TraceRun(DryRun):
    """The tracer's view of CutPoint crossings: new segment, and fresh tags for what crosses."""

    def __init__(self, recorder: Recorder, cutpoint_names: dict[int, str]) -> None:
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
                             created=src.created, chain=src.chain, origin=src.origin).arrived = self.segment
                else:
                    rec._new(alias, kind="cut", desc=f"activation received at CutPoint '{name}'", pure=False,
                             segment=self.segment, created=rec.clock)
                out.append(alias)
        return out[0] if len(out) == 1 else tuple(out)




@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
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


def record_forward(model: nn.Module, batch, loss_fn: Callable | None, *, flop_counter=None) -> Recorder:
    """Run one forward (and ``loss_fn``) of ``model`` on ``batch`` under a :class:`Recorder`.

    CutPoints split the run into segments as in the engine. Nothing is left changed: RNG state,
    buffers and the CutPoints' engine state are restored.
    """
    if any(p.is_meta for p in model.parameters()):
        batch = to_meta(batch)
    rec = Recorder(model, flop_counter=flop_counter)
    cps = [m for m in model.modules() if isinstance(m, CutPoint)]
    old_states = [cp._varuna_state for cp in cps]
    state = SplitState()
    run = TraceRun(rec, {id(m): n for n, m in model.named_modules() if isinstance(m, CutPoint)})
    state.run = run
    for cp in cps:
        cp._varuna_state = state
    handles = rec.install()
    rec.mark_inputs(batch)
    try:
        with preserved_state(model), torch.no_grad():
            with flop_counter if flop_counter is not None else contextlib.nullcontext(), rec:
                out = call_with_batch(model, batch)
                if loss_fn is not None:
                    loss = loss_fn(out, batch)
                    rec.consume(tree_flatten(loss)[0], "the loss (backward)")
                else:  # the engine's default_loss: the output itself, or its 'loss' field (HF)
                    lf = loss_field(out)
                    rec.consume(tree_flatten(out if lf is None else lf)[0], "the returned loss (backward)")
    finally:
        for h in handles:
            h.remove()
        for cp, s in zip(cps, old_states):
            cp._varuna_state = s
    rec.cut_order = [run.cutpoint_names.get(id(cp), "?") for cp in run.order]
    rec.cut_routed = [bool(getattr(cp, "routed", False)) for cp in run.order]

    return rec
