"""Splitting an unmodified model into pipeline stages without rewriting its forward.

Two steps:

1. :func:`profile_model` — a *dry run* of the whole forward (and backward, for timing) in one
   process. It records the order of the CutPoints, which segment uses each parameter (a
   ``TorchFunctionMode`` sees every parameter passed to a torch function, so raw
   ``nn.Parameter``\\ s used in glue code and tied weights are found too), which modules contain
   boundaries, the activation shapes at each boundary, and a per-segment cost (measured time,
   or FLOPs for a model on the ``meta`` device).

2. :func:`materialize_stage` — turns the model into one stage's executable model in place. See
   Note [Placeholders].

Note [Placeholders]: every stage runs the user's forward unchanged. Modules whose calls happen
in segments outside the stage do not compute; they return zero tensors of the right shape,
found by running the module on meta tensors (cached per call signature, bounded: Note
[Placeholder cache] in :mod:`varuna.cutting.placeholders`). Glue code between modules
therefore keeps running on real tensors (masks, position ids, residual adds), and no user code
ever sees ``None``. Parameters used only outside the stage are replaced by stride-0 expanded
zeros: glue code can still read them (``x + self.pos_emb``), they cost a few bytes, and they
never mix meta with real tensors. The stage's input CutPoint swaps in the received activation,
so the placeholder values never influence results.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from varuna.cutting.batches import batch_size_of, call_with_batch, to_device, to_meta
from varuna.cutting.cutpoint import CarrySpec, CutPoint, DryRun, SplitState
from varuna.cutting.placeholders import Skipper

__all__ = [
    "ModelProfile",
    "keyed_seed",
    "materialize_stage",
    "persistent_buffers",
    "profile_model",
    "resident_param_bytes",
    "storage_key",
]


def keyed_seed(*parts: object) -> int:
    """A 63-bit seed derived from ``parts`` (stable across processes and Python runs).

    >>> keyed_seed(0, "wte") == keyed_seed(0, "wte")
    True
    """
    h = 1469598103934665603  # FNV-1a, so the value does not depend on PYTHONHASHSEED
    for p in parts:
        for b in repr(p).encode():
            h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ 0x1F) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


@dataclass
class ModelProfile:
    """What the dry run learned about a model (identical on every rank for the same model)."""

    cutpoint_names: list[str]
    #: canonical parameter name -> sorted segments whose computation reads it
    param_segments: dict[str, tuple[int, ...]]
    #: per cut-point: [(shape, dtype)] of each tensor crossing it, at the dry run's batch
    act_meta: list[list[tuple[tuple[int, ...], torch.dtype]]]
    #: per segment: forward and backward cost (seconds, or FLOPs when cost_unit == "flop")
    fwd_cost: list[float]
    bwd_cost: list[float]
    cost_unit: str
    #: modules whose forward contains a boundary (they always run: they are glue)
    spanning_modules: set[str] = field(default_factory=set)
    #: modules whose forward ran in the dry run (containers such as ModuleList never run)
    called_modules: set[str] = field(default_factory=set)
    param_bytes: dict[str, int] = field(default_factory=dict)
    #: parameter-free modules that run on every stage as glue although no boundary is inside them:
    #: their outputs, computed from the batch and buffers only, are read by other segments (Note
    #: [Replicated glue modules] in varuna/cutting/tracer.py; the engine fills it from the trace)
    glue_modules: set[str] = field(default_factory=set)
    #: module outputs carried across routed (by-name or automatic) cut-points (Note [Carried values] in
    #: varuna/cutting/cutpoint.py; the engine fills it from the trace)
    carried: list[CarrySpec] = field(default_factory=list)
    #: per segment: forward FLOPs counted in the dry run (``FlopCounterMode``), whatever
    #: ``cost_unit`` says (timed costs replace ``fwd_cost``, not these); None: not counted
    fwd_flops: list[float] | None = None
    #: examples in the dry run's batch (what ``fwd_flops`` were counted for)
    flops_examples: int = 0
    #: canonical name of every persistent buffer (``persistent=False`` ones are not model state) ->
    #: sorted segments that read or write it in the dry run; one the dry run never touches takes its
    #: module's segments, else segment 0 (Note [Buffers across replicas] in varuna/runtime/buffers.py)
    buffer_segments: dict[str, tuple[int, ...]] = field(default_factory=dict)
    buffer_bytes: dict[str, int] = field(default_factory=dict)
    #: per segment: bytes of the distinct storages autograd saves in it for the dry run's
    #: micro-batch, plus its outputs, less the parameters, buffers and its input (what the profiler
    #: counts, profiler/compute.py); None: not measured (``profile_model(activations=False)``)
    activation_bytes: list[int] | None = None
    #: per segment: bytes entering it for the dry run's micro-batch (segment 0: the batch's
    #: tensors); None: not measured
    input_bytes: list[int] | None = None

    @property
    def num_cutpoints(self) -> int:
        return len(self.cutpoint_names)

    @property
    def num_segments(self) -> int:
        return len(self.cutpoint_names) + 1

    def shared_params(self) -> dict[str, tuple[int, ...]]:
        """Parameters read by more than one segment (e.g. tied input/output embeddings)."""
        return {n: s for n, s in self.param_segments.items() if len(s) > 1}

    def segment_input_bytes(self) -> list[int]:
        """Per segment, the bytes entering it for the dry run's micro-batch: measured when the
        dry run counted activations, else from the boundaries' shapes (segment 0: 0, the batch
        unknown)."""
        if self.input_bytes is not None:
            return list(self.input_bytes)
        return [0] + [sum(math.prod(shape) * dtype.itemsize for shape, dtype in meta)
                      for meta in self.act_meta]

    def segment_param_bytes(self) -> list[int]:
        out = [0] * self.num_segments
        for name, segs in self.param_segments.items():
            out[segs[0]] += self.param_bytes.get(name, 0)
        return out


class _NoCount(contextlib.nullcontext):
    def get_total_flops(self) -> float:
        return 0.0


class _ParamUse(TorchFunctionMode):
    """Records, for every torch function call, which parameters it reads and in which segment."""

    def __init__(self, param_ids: dict[int, str], state: SplitState, uses: dict[str, set[int]]):
        super().__init__()
        self.param_ids, self.state, self.uses = param_ids, state, uses

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        run = self.state.run
        if run is not None:
            for leaf in tree_flatten((args, kwargs))[0]:
                name = self.param_ids.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
                if name is not None:
                    self.uses.setdefault(name, set()).add(run.segment)
        return func(*args, **kwargs)


def _named_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters())  # remove_duplicate=True: tied tensors get one name


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by canonical name (a buffer shared by two modules gets its
    first name), in ``named_buffers`` order: what ``state_dict`` holds besides the parameters.
    ``persistent=False`` buffers (caches, masks recomputed by the constructor) are left out.

    >>> bn = nn.BatchNorm1d(2)
    >>> sorted(persistent_buffers(bn))
    ['num_batches_tracked', 'running_mean', 'running_var']
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for mname, mod in model.named_modules():
        for bname, b in mod._buffers.items():
            if b is None or bname in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out[f"{mname}.{bname}" if mname else bname] = b
    return out


def _buffer_segments(model: nn.Module, uses: dict[str, set[int]], buffers: dict[str, torch.Tensor],
                     param_uses: dict[str, set[int]]) -> dict[str, tuple[int, ...]]:
    """Segments of each persistent buffer: those that read or wrote it (``uses``), else its
    module's (its parameters' or other buffers'), else segment 0."""
    canon = {id(p): n for n, p in _named_params(model).items()}
    out: dict[str, tuple[int, ...]] = {}
    for mname, mod in model.named_modules():
        prefix = f"{mname}." if mname else ""
        mine = [n for n in (prefix + b for b in mod._buffers) if n in buffers]
        if not mine:
            continue
        module_segs: set[int] = set()
        for p in mod.parameters(recurse=False):
            module_segs |= param_uses.get(canon.get(id(p), ""), set())
        for n in mine:
            module_segs |= uses.get(n, set())
        for n in mine:
            segs = uses.get(n) or module_segs or {0}
            out[n] = tuple(sorted(segs))
    return out


def _boundary_hooks(model: nn.Module, state: SplitState, called: set[str], spanning: set[str]) -> list:
    """Module hooks of the dry run: fill ``called`` with every module that runs and ``spanning``
    with those whose call contains a boundary. Returns the handles (remove them after)."""
    entry: dict[int, list[int]] = {}
    mod_names = {id(m): n for n, m in model.named_modules()}

    def pre(mod, args):
        called.add(mod_names[id(mod)])
        entry.setdefault(id(mod), []).append(state.run.segment if state.run else 0)

    def post(mod, args, out):
        start = entry[id(mod)].pop()
        if state.run is not None and state.run.segment != start:
            spanning.add(mod_names[id(mod)])

    handles = []
    for m in model.modules():
        if not isinstance(m, CutPoint):
            handles.append(m.register_forward_pre_hook(pre))
            # First among the post hooks: a CutPoint called by a user's forward hook on this module
            # (hook-attached cut) comes after the module's end, not inside it.
            handles.append(m.register_forward_hook(post, prepend=True))
    return handles


def profile_model(
    model: nn.Module,
    batch,
    loss_fn: Callable,
    *,
    timing_reps: int = 2,
    measure: bool = True,
    costs: bool = True,
    activations: bool = False,
) -> ModelProfile:
    """Dry-run ``model`` on ``batch`` (one micro-batch) and return its :class:`ModelProfile`.

    ``loss_fn(output, batch)`` maps the model output to a scalar loss. With ``measure`` and a
    model on a real device, segment costs are the median of ``timing_reps`` timed
    forward+backward runs; otherwise (or for a ``meta`` model) they are FLOP counts. With
    ``costs=False`` (the caller does not use them) costs are zeros and nothing is counted or timed:
    FLOP counting imports ``torch._dynamo``, seconds of start-up on a busy host. With
    ``activations`` (and a model off the ``meta`` device) one more forward with autograd counts
    each segment's activation and input bytes (:func:`_measure_activations`), for the
    memory-aware split.

    Example::

        prof = profile_model(model, micro_batch, lambda out, b: out.sum(), activations=True)
        prof.activation_bytes   # e.g. [65536, 65540]: bytes per segment for this micro-batch
    """
    cut_names = {id(m): n for n, m in model.named_modules() if isinstance(m, CutPoint)}
    cps = [m for m in model.modules() if isinstance(m, CutPoint)]
    state = SplitState()
    for cp in cps:
        cp._varuna_state = state
    params = _named_params(model)
    buffers = persistent_buffers(model)
    on_meta = any(p.is_meta for p in params.values())
    if on_meta:
        batch = to_meta(batch)
    elif params:  # a model already on an accelerator runs on its device's copy of the batch
        batch = to_device(batch, next(iter(params.values())).device)
    param_ids = {id(p): n for n, p in params.items()}
    buffer_ids = {id(b): n for n, b in buffers.items() if id(b) not in param_ids}
    uses: dict[str, set[int]] = {}
    called: set[str] = set()
    spanning: set[str] = set()
    handles = _boundary_hooks(model, state, called, spanning)
    flops_at: list[float] = []
    if costs:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
    else:
        counter = _NoCount()
    dry = DryRun(cutpoint_names=cut_names, on_segment=lambda s: flops_at.append(counter.get_total_flops()))
    state.run = dry
    try:
        with torch.no_grad(), counter, _ParamUse({**param_ids, **buffer_ids}, state, uses):
            loss_fn(call_with_batch(model, batch), batch)
        total_flops = counter.get_total_flops()
    finally:
        state.run = None
        for h in handles:
            h.remove()
    order = dry.order
    for i, cp in enumerate(order):
        if cp._varuna_state is not state:
            raise ValueError(f"CutPoint #{i} is not a submodule of the model; create it in __init__")
    names = [cut_names[id(cp)] for cp in order]
    marks = [0.0, *flops_at, total_flops]
    fwd_flops = [max(marks[i + 1] - marks[i], 0.0) for i in range(len(marks) - 1)]
    profile = ModelProfile(
        cutpoint_names=names,
        param_segments={n: tuple(sorted(s)) for n, s in uses.items() if n in params},
        act_meta=dry.act_meta,
        fwd_cost=fwd_flops,
        bwd_cost=[2.0 * f for f in fwd_flops],
        cost_unit="flop",
        spanning_modules=spanning,
        called_modules=called,
        param_bytes={n: p.numel() * p.element_size() for n, p in params.items()},
        fwd_flops=list(fwd_flops) if costs else None,
        flops_examples=_examples(batch) if costs else 0,
        buffer_segments=_buffer_segments(model, uses, {n: buffers[n] for n in buffer_ids.values()}, uses),
        buffer_bytes={n: b.numel() * b.element_size() for n, b in buffers.items()},
    )
    # Cut-points not reached by the forward are dropped from the model's order; CutPoints that
    # are registered but never called stay identities.
    if costs and measure and not on_meta and timing_reps > 0:
        fwd, bwd = _time_segments(model, batch, loss_fn, state, cut_names, timing_reps)
        if fwd is not None:
            profile.fwd_cost, profile.bwd_cost, profile.cost_unit = fwd, bwd, "s"
    if activations and not on_meta:
        profile.activation_bytes, profile.input_bytes = _measure_activations(
            model, batch, loss_fn, state, cut_names)
    return profile


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of the storage behind ``t``: views of one storage count once when
    activations are summed (the dry run here, the profiler's stage measurement).

    Example::

        >>> x = torch.zeros(4); storage_key(x[:2])[0] == storage_key(x)[0]
        True
    """
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return id(t), t.numel() * t.element_size()


def _measure_activations(model, batch, loss_fn, state, cut_names) -> tuple[list[int], list[int]]:
    """Per segment, (activation bytes, input bytes) of one forward with autograd (see
    :class:`ModelProfile`). Each distinct storage counts once, on the segment that first saves or
    outputs it: a boundary's tensors are their segment's outputs, not the next one's activations
    (as the profiler counts them: a stage's stash holds its input, its graph the rest). The RNG is
    restored after, so the dry run draws nothing a training step would (dropout stays aligned)."""
    params = list(model.parameters())
    excluded = {storage_key(t)[0] for t in (*params, *model.buffers())}
    batch_tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    excluded |= {storage_key(t)[0] for t in batch_tensors}
    owner: dict[int, tuple[int, int]] = {}  # storage -> (segment, bytes)
    dry = DryRun(cutpoint_names=cut_names)

    def note(t: torch.Tensor, segment: int) -> None:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            key, nbytes = storage_key(t)
            if key not in excluded and key not in owner and nbytes > 0:
                owner[key] = (segment, nbytes)

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t, dry.segment)
        return t  # no copy: the hook only looks

    # The tensors crossing boundary i are segment i's outputs (noted before segment i + 1 saves them).
    dry.on_segment = lambda seg: [note(x, seg - 1) for x in dry.crossing_tensors[-1]]
    devices = [d for d in {t.device for t in params} if d.type == "cuda"]
    state.run = dry
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(call_with_batch(model, batch), batch)
            for t in tree_flatten(loss)[0]:
                note(t, dry.segment)
    finally:
        state.run = None
    del loss  # frees the graph
    n = len(dry.order) + 1
    acts = [0] * n
    for seg, nbytes in owner.values():
        acts[min(seg, n - 1)] += nbytes
    # A stash holds the tensors themselves: their bytes, not their storages' (a micro-batch is
    # often a slice of the whole batch).
    inputs = [sum(t.numel() * t.element_size() for t in ts) for ts in (batch_tensors, *dry.crossing_tensors)]
    return acts, inputs


def _examples(batch) -> int:
    """Examples in a dry run's batch (0 when it has no common batch dimension)."""
    try:
        return batch_size_of(batch)
    except ValueError:
        return 0


def _time_segments(model, batch, loss_fn, state, cut_names, reps):
    fwd_runs, bwd_runs = [], []
    for _ in range(reps + 1):  # the first run warms up allocators and kernels
        dry = DryRun(cutpoint_names=cut_names)
        grad_times: dict[int, float] = {}
        state.run = dry
        try:
            t0 = time.perf_counter()
            loss = loss_fn(call_with_batch(model, batch), batch)
            t1 = time.perf_counter()
        finally:
            state.run = None
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return None, None
        for i, xs in enumerate(dry.crossing_tensors):
            t = next((x for x in xs if x.requires_grad), None)
            if t is not None:
                t.register_hook(lambda g, i=i, times=grad_times: times.__setitem__(i, time.perf_counter()))
        tb0 = time.perf_counter()
        loss.backward()
        tb1 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        marks = [t0, *dry.cross_times, t1]
        fwd_runs.append([marks[i + 1] - marks[i] for i in range(len(marks) - 1)])
        k = len(dry.cross_times)
        if len(grad_times) == k:
            bmarks = [tb1, *[grad_times[i] for i in range(k)], tb0]
            bwd_runs.append([max(bmarks[i] - bmarks[i + 1], 0.0) for i in range(k + 1)])
        else:
            bwd_runs.append([2 * f for f in fwd_runs[-1]])
    fwd = [statistics.median(r[i] for r in fwd_runs[1:]) for i in range(len(fwd_runs[0]))]
    bwd = [statistics.median(r[i] for r in bwd_runs[1:]) for i in range(len(bwd_runs[0]))]
    return fwd, bwd


# ---------------------------------------------------------------------------------------------
# Stage materialization


def default_param_init(module_name: str, module: nn.Module) -> None:
    """Initialise the parameters a module owns directly: its ``reset_parameters`` if it has one,
    else N(0, 0.02) for matrices and zeros for vectors. Called under a generator seeded by the
    module's qualified name, so every layout (and a single process) gets identical weights."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
        return
    with torch.no_grad():
        for p in module.parameters(recurse=False):
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.zero_()


def _wrap_candidates(model: nn.Module, spanning: set[str], called: set[str],
                     glue: frozenset[str] | set[str] = frozenset()) -> list[tuple[str, nn.Module]]:
    """Outermost *called* modules whose calls never contain a boundary (Note [Placeholders]).

    A module the dry run never called (a ``ModuleList``, a plain container) is looked into: its
    children are called directly by the glue code, and wrapping the container would leave them
    computing on every stage. A module in ``glue`` (and everything inside it) is never wrapped:
    it runs on every stage.
    """
    out = []

    def visit(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            q = f"{prefix}.{name}" if prefix else name
            if isinstance(child, CutPoint) or q in glue:
                continue
            if q in spanning or q not in called:
                visit(q, child)
            else:
                out.append((q, child))

    visit("", model)
    return out


def _replace_params(model: nn.Module, canon_of: dict[int, str], keep: set[str], device: torch.device
                    ) -> dict[str, tuple[str, nn.Module]]:
    """Put the stage's parameters (``keep``, by canonical name) on ``device`` and stride-0 zeros
    in place of the others (tied parameters stay tied). Returns, for each kept parameter that was
    on ``meta`` (now uninitialised), its first owning module (name, module)."""
    new: dict[int, nn.Parameter] = {}
    owners: dict[str, tuple[str, nn.Module]] = {}
    for mname, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            canon = canon_of.get(id(p))
            if id(p) not in new:
                if canon in keep:
                    if p.is_meta:
                        t = torch.empty(p.shape, dtype=p.dtype, device=device)
                        owners.setdefault(canon, (mname, mod))
                    else:
                        t = p.detach().to(device)
                    new[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
                else:
                    z = torch.zeros((), dtype=p.dtype, device=device).expand(p.shape)
                    new[id(p)] = nn.Parameter(z, requires_grad=False)
            mod._parameters[pname] = new[id(p)]
    return owners


def _move_buffers(model: nn.Module, device: torch.device) -> dict[str, nn.Module]:
    """Every buffer to ``device`` (zeros for ``meta`` ones): every stage keeps every buffer.
    Returns the modules without parameters of their own whose buffers were on ``meta`` (a rotary
    embedding's frequencies): ``param_init`` initialises them (nobody else would)."""
    uninitialised = {}
    for mname, mod in model.named_modules():
        for bname, b in list(mod._buffers.items()):
            if b is not None:
                if b.is_meta:
                    mod._buffers[bname] = torch.zeros(b.shape, dtype=b.dtype, device=device)
                    if not mod._parameters:
                        uninitialised[mname] = mod
                else:
                    mod._buffers[bname] = b.to(device)
    return uninitialised


def materialize_stage(
    model: nn.Module,
    profile: ModelProfile,
    first_segment: int,
    last_segment: int,
    state: SplitState,
    *,
    device: torch.device,
    seed: int = 0,
    param_init: Callable[[str, nn.Module], None] | None = None,
    segments: Collection[int] | None = None,
) -> dict[str, nn.Parameter]:
    """Turn ``model`` (in place) into the executable model of segments [first, last].

    Returns the stage's parameters by canonical name. Parameters the stage does not read are
    replaced by stride-0 zeros; modules outside the stage return placeholders (Note
    [Placeholders]). A ``meta`` model gets its stage's parameters created on ``device`` and
    initialised by ``param_init(module_name, module)`` under a per-module-name seed; so do its
    modules that hold buffers but no parameters (for a Hugging Face model, pass
    ``param_init=lambda name, m: model._init_weights(m)``: it recomputes rotary frequencies).
    """
    # ``segments``: an interleaved process's model chunks (several ranges) instead of one range.
    segs = range(first_segment, last_segment + 1) if segments is None else frozenset(segments)
    params = _named_params(model)
    keep = {n for n, s in profile.param_segments.items() if any(x in segs for x in s)}
    # Wrap first: the meta shape dictionaries need the original parameter shapes.
    for qname, mod in _wrap_candidates(model, profile.spanning_modules, profile.called_modules,
                                         profile.glue_modules):
        mod.forward = Skipper(mod, state, device, qname)
    owners = _replace_params(model, {id(p): n for n, p in params.items()}, keep, device)
    for mname, mod in _move_buffers(model, device).items():
        owners.setdefault(f"{mname} (buffers)", (mname, mod))
    if owners:
        init = param_init or default_param_init
        # Initialise each owning module once, seeded by its name, so any stage split gives the
        # same values as a single process that materialises everything.
        done: set[str] = set()
        for _canon, (mname, mod) in sorted(owners.items()):
            if mname in done:
                continue
            done.add(mname)
            with _seeded(device, keyed_seed(seed, "init", mname)):
                init(mname, mod)
    stage = {n: p for n, p in _named_params(model).items() if n in keep}
    return stage


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int):
    """The CPU generator and ``device``'s (a GPU initialises its parameters with its own) seeded
    with ``seed``, both restored after: the script's random streams are left as they were."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


def resident_param_bytes(model: nn.Module) -> int:
    """Bytes of parameter storage actually held (stride-0 placeholders count a few bytes)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.is_meta:
            continue
        s = p.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total
