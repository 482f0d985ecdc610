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

import warnings
from collections.abc import Callable

from torch import nn

from varuna.cutting.cutpoint import CarrySpec
from varuna.cutting.loss import describe_output, loss_field
from varuna.cutting.recorder import ModuleCall, Recorder, TensorInfo, record_forward
from varuna.cutting.trace_report import (
    BufferUse,
    CarriedValue,
    CommonRead,
    ExternalTensor,
    GlobalSync,
    HiddenDependency,
    SharedParam,
    TraceReport,
    seg_text,
)

__all__ = [
    "TraceReport",
    "SharedParam",
    "BufferUse",
    "HiddenDependency",
    "CommonRead",
    "ExternalTensor",
    "GlobalSync",
    "trace_model",
    "trace_for_engine",
    "check_splittable",
    "carry_specs",
    "CarriedValue",
]

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


def trace_for_engine(
    model: nn.Module, example_batch, loss_fn: Callable | None = None
) -> tuple[TraceReport, list[str]]:
    """:func:`trace_model`, plus what :class:`varuna.Engine` would refuse that the report cannot
    show: a model without CutPoints (one stage only), and, without ``loss_fn``, a forward that does
    not return a scalar loss (e.g. a Hugging Face-style output object). Returns the report and
    those refusals, one line each with the fix (empty: the engine takes the model)."""
    outputs: list = []
    hook = None if loss_fn is not None else model.register_forward_hook(lambda m, a, out: outputs.append(out))
    try:
        report = trace_model(model, example_batch, loss_fn)
    finally:
        if hook is not None:
            hook.remove()
    problems = []
    if not report.cutpoints:
        problems.append(
            "the model has no CutPoint, so the engine cannot split it into pipeline stages (only "
            "--pipeline-depth 1); call varuna.CutPoint() on activations at stage boundaries, or run "
            "varuna-trace --cuts K to insert K automatically"
        )
    out = outputs[-1] if outputs else None
    if loss_fn is None and loss_field(out) is None:
        problems.append(
            f"the model's forward returns {describe_output(out)}, not a scalar loss, so the engine would "
            "refuse it; return the loss (or an output with a scalar 'loss'), or have the factory return "
            "(model, example_batch, loss_fn) with loss_fn(output, batch) -> scalar (as for "
            "Engine(loss_fn=...))"
        )
    return report, problems


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


def _spanning_modules(rec: Recorder) -> set[int]:
    """Modules with a call that contains a boundary: the runtime runs them as glue on every stage."""
    return {id(c.module) for c in rec.calls if c.seg_start != c.seg_end}


def _replicable(call: ModuleCall) -> bool:
    """A module that may run on every stage as glue: no parameters (running it costs no memory
    and reads nothing a stage lacks: every stage keeps every buffer), no boundary inside, and
    outputs derived only from the batch, buffers and constants (so they are right everywhere)."""
    return call.outputs_pure and call.seg_start == call.seg_end \
        and next(call.module.parameters(), None) is None


def _replicated_modules(rec: Recorder, glue: set[int]) -> set[int]:
    """Note [Replicated glue modules]: modules whose pure outputs are read in another segment
    (Llama's ``rotary_emb``: cos/sin computed once, read by every decoder layer).

    Skipped outside their stage, they would hand placeholders to the later segments: a hidden
    dependency, and the split was refused. When every module that computed such a value is
    replicable (:func:`_replicable`), the runtime runs them on every stage instead (not wrapped
    by a placeholder: ``ModelProfile.glue_modules``), which makes the value common. A module
    with parameters never qualifies: the value stays a hidden dependency, with its fix."""
    calls = rec.calls
    ok = {id(c.module) for c in calls if _replicable(c)}
    # A module is replicable only if every one of its calls is (one call with an activation input
    # would make its output a placeholder on other stages, whatever the other calls do).
    ok -= {id(c.module) for c in calls if c.parent is not None and not _replicable(c)}
    out: set[int] = set()
    for r in rec.reads:
        info = r.info
        if not info.pure or info.segment is None or info.kind in ("buffer", "external"):
            continue
        need = {id(calls[c].module) for c in info.chain} - glue
        if need and need <= ok:
            out |= need
    return out


def _free(info: TensorInfo, calls: list[ModuleCall], glue: set[int]) -> bool:
    """True if every stage computes this value itself (pure, and computed only by glue code)."""
    return info.pure and all(id(calls[c].module) in glue for c in info.chain)


def _analyse(rec: Recorder) -> TraceReport:
    nseg = len(rec.cut_order) + 1
    glue = _spanning_modules(rec)
    replicated = _replicated_modules(rec, glue)
    glue |= replicated
    report = TraceReport(cutpoints=list(rec.cut_order), num_segments=nseg)
    report.replicated_modules = sorted(rec.module_names[m] for m in replicated)

    # (a) tied weights
    for name, segs in sorted(rec.param_uses.items()):
        if len(segs) > 1:
            report.shared_params.append(SharedParam(name, sorted(segs), rec.param_bytes.get(name, 0)))
    _add_buffer_uses(rec, report, glue)
    _add_value_reads(rec, report, glue)
    report.global_state = _global_state(report)
    return report


def _add_buffer_uses(rec: Recorder, report: TraceReport, glue: set[int]) -> None:
    """(b) buffers: written in one segment and read in another (error), or read-only and read
    outside their owner's segments (info); buffers written and read in one segment are listed as
    local mutable buffers."""
    nseg, calls = report.num_segments, rec.calls
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
                f"buffer '{bname}' (owned by '{owner}', segment(s) {seg_text(osegs)}) is read in segment(s) "
                f"{seg_text(rsegs)}; it is read-only, and the runtime keeps every buffer on every stage",
            ))



def _carrier(info: TensorInfo, calls: list[ModuleCall], glue: set[int]) -> tuple[ModuleCall, int] | None:
    """The call of a module that other stages skip, and the index among its flattened outputs, that
    returned ``info`` (following module-output aliases inward past glue modules: T5's encoder output
    is the output of the spanning 'encoder', returned from its 'encoder.dropout'); None when no such
    module returned it (computed by glue code from activations)."""
    x: TensorInfo | None = info
    while x is not None:
        if x.out_of is not None:
            call = calls[x.out_of[0]]
            if id(call.module) not in glue:
                # Stages wrap the outermost modules without a boundary inside (split._wrap_candidates):
                # every enclosing call must span a boundary for this one to be that module.
                p = call.parent
                while p is not None:
                    if calls[p].seg_start == calls[p].seg_end:
                        return None
                    p = calls[p].parent
                return call, x.out_of[1]
        x = x.via
    return None


def _carry(rec: Recorder, info: TensorInfo, segment: int, glue: set[int],
           carried: dict[tuple[int, int], CarriedValue]) -> bool:
    """Note [Carried values] (varuna/cutting/cutpoint.py): record ``info``, read in ``segment``, as
    carried if it is a skipped module's output and crosses only routed cut-points (placed by name
    or automatically) on the way."""
    made = info.segment
    if made is None or segment <= made or not all(rec.cut_routed[k] for k in range(made, segment)):
        return False
    site = _carrier(info, rec.calls, glue)
    if site is None:
        return False
    call, leaf = site
    c = carried.get((call.index, leaf))
    if c is None:
        c = carried[(call.index, leaf)] = CarriedValue(
            f"output #{leaf} of module '{call.name}'" + (f" (call #{call.ordinal})" if call.ordinal else ""),
            call.name, call.ordinal, leaf, made, [], list(info.shape), info.dtype)
    if segment not in c.read_in:
        c.read_in.append(segment)
        c.read_in.sort()
    return True


def carry_specs(report: TraceReport) -> list[CarrySpec]:
    """What the engine carries across cut-points, from the report (Note [Carried values])."""
    return [CarrySpec(c.module, c.call, c.leaf, c.produced_in, max(c.read_in)) for c in report.carried_values]


def _add_value_reads(rec: Recorder, report: TraceReport, glue: set[int]) -> None:
    """(c) values read in another segment than the one that produced them: hidden dependencies,
    common reads (glue-computed values every stage makes itself) and external tensors."""
    calls = rec.calls
    hidden: dict[tuple, HiddenDependency] = {}
    carried: dict[tuple[int, int], CarriedValue] = {}
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
        if key in hidden or info.arrived == r.segment or _carry(rec, info, r.segment, glue, carried):
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
    report.carried_values = sorted(carried.values(), key=lambda c: (c.produced_in, c.module, c.call, c.leaf))
    report.common_reads = [c for c in common.values() if any(s != c.produced_in for s in c.read_in)]
    report.external_tensors = list(externals.values())


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
