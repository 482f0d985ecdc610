"""Automatic cut-points: find where a model can be split, and insert CutPoints without editing it.

:func:`auto_cutpoints` dry-runs the model once under the tracer's recorder (:mod:`varuna.cutting.tracer`)
and looks at every module call as a candidate boundary. The end of a call to module ``M`` is a
*valid* boundary when

* ``M`` is called once per forward and returns a batch-major tensor it computed (or a tuple/list
  whose first element is one: ``hidden, attn = block(hidden, mask)``; the inserted cut-point passes
  every tensor of the output on, but the choice counts only the first as crossing), and
* nothing else that was computed before the end of the call is read after it, except values
  every stage computes itself (glue code on the batch: masks, position ids) — so the output of
  ``M`` is the only live activation flowing onward. A residual input still needed later, a
  second tuple element read later, or a mask built by a module all make the boundary invalid —
  unless the plan without them is unbalanced and the value is a module's output that later blocks
  read, which the engine carries across the cut (Note [Carrying in plans], below).

It then measures the cost before each valid boundary (forward time by default; FLOPs for a
``meta`` model or with ``cost="flop"``; or costs you give per module) and picks up to
``max_cuts`` boundaries that split the forward into near-equal segments (the largest segment is
within ``balance_slack`` of the best achievable), preferring small activations among those.

The model's source is not touched and parameter names stay the same (checkpoints keep their
keys): the chosen modules' outputs are routed through new CutPoints as for cut-points placed by
name (:mod:`varuna.cutting.routing`); :func:`remove_cutpoints` undoes it.

Example::

    >>> import torch, varuna
    >>> from torch import nn
    >>> model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    >>> plan = varuna.auto_cutpoints(model, torch.randn(2, 8), max_cuts=1, verbose=False,
    ...                              module_costs={str(i): 1.0 for i in range(4)})
    >>> plan.module_names
    ['1.1']
    >>> [n for n, m in model.named_modules() if isinstance(m, varuna.CutPoint)]
    ['1.1.varuna_cut']
"""

from __future__ import annotations

import bisect
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from varuna.core.partition import balanced_partition
from varuna.cutting.batches import call_with_batch, to_meta
from varuna.cutting.recorder import ModuleCall, Recorder, TensorInfo, preserved_state, record_forward
from varuna.cutting.routing import (
    _CONTAINERS,
    CUT_ATTR,
    apply_cutpoints,
    check_no_cutpoints,
    insert_cutpoints,
    match_modules,
    remove_cutpoints,
    routed_modules,
)
from varuna.cutting.tracer import _replicable, trace_model

#: the by-name helpers live in varuna/cutting/routing.py; re-exported here for existing imports
_auto_cut_modules = routed_modules

__all__ = ["auto_cutpoints", "apply_cutpoints", "match_modules", "remove_cutpoints", "check_no_cutpoints",
           "choose_cuts", "AutoCutPlan", "CutChoice", "engine_auto_cutpoints", "CUT_ATTR"]

# ---------------------------------------------------------------------------------------------
# Choosing cut-points


def choose_cuts(positions: Sequence[float], total: float, act_bytes: Sequence[float], max_cuts: int,
                balance_slack: float = 0.05) -> list[int]:
    """Indices of the candidate boundaries to cut at.

    ``positions``: nondecreasing cost before each candidate; ``total``: cost of the whole forward.
    Picks ``min(max_cuts, len(positions))`` candidates so that the largest segment is at most
    ``(1 + balance_slack)`` times the smallest achievable largest segment, and among those the
    smallest summed activation size (then the smallest largest segment).

    >>> choose_cuts([1, 2, 3], 4, [8, 8, 8], 1)
    [1]
    >>> choose_cuts([1.0, 1.04], 2.0, [400, 100], 1)    # as balanced, 4x smaller activation
    [1]
    >>> choose_cuts([1.0, 1.04], 2.0, [400, 100], 1, balance_slack=0.0)
    [0]
    """
    n = len(positions)
    K = min(max_cuts, n)
    if K <= 0:
        return []
    if K == n:
        return list(range(n))
    gaps = [positions[0]] + [positions[i] - positions[i - 1] for i in range(1, n)] + [total - positions[-1]]
    gaps = [max(g, 0.0) for g in gaps]
    parts = balanced_partition(gaps, K + 1)
    best_max = max(sum(gaps[a:b + 1]) for a, b in parts)
    thr = best_max * (1.0 + balance_slack) + 1e-12 * max(total, 1e-30)
    INF = (math.inf, math.inf)
    # f[i]: (activation sum, largest segment) of the best placement of k cuts ending at candidate i.
    f = [(float(act_bytes[i]), positions[i]) if positions[i] <= thr else INF for i in range(n)]
    back: list[list[int]] = [[-1] * n]
    for _k in range(2, K + 1):
        g = [INF] * n
        bk = [-1] * n
        for i in range(n):
            j = i - 1
            while j >= 0 and positions[i] - positions[j] <= thr:
                if f[j] != INF:
                    cand = (f[j][0] + act_bytes[i], max(f[j][1], positions[i] - positions[j]))
                    if cand < g[i]:
                        g[i], bk[i] = cand, j
                j -= 1
        f = g
        back.append(bk)
    best, last = INF, -1
    for i in range(n):
        if f[i] != INF and total - positions[i] <= thr:
            cand = (f[i][0], max(f[i][1], total - positions[i]))
            if cand < best:
                best, last = cand, i
    assert last >= 0, "the balanced partition is always a feasible placement"
    chosen = [last]
    for k in range(K - 1, 0, -1):
        chosen.append(back[k][chosen[-1]])
    return chosen[::-1]


@dataclass
class CutChoice:
    """One inserted cut-point."""

    #: module whose output is routed through the CutPoint
    module: str
    #: registered name of the CutPoint (``<module>.varuna_cut``)
    cutpoint: str
    #: cost of everything before the cut, and of the segment that ends here (``cost_unit``)
    cost_before: float
    segment_cost: float
    act_shape: list[int]
    act_dtype: str
    act_bytes: int
    #: module outputs carried across this cut besides the activation (Note [Carried values])
    carried_bytes: int = 0


@dataclass
class AutoCutPlan:
    """What :func:`auto_cutpoints` chose; ``print(plan)`` shows it as a table."""

    choices: list[CutChoice]
    #: cost of each of the ``len(choices) + 1`` segments
    segment_costs: list[float]
    total_cost: float
    #: "s" (measured forward time), "flop", or "given" (``module_costs``)
    cost_unit: str
    requested: int
    #: valid boundaries found, in forward order: [module, cost before, activation bytes]
    candidates: list[tuple[str, float, int]] = field(default_factory=list)
    #: module ends that cannot be a boundary, at the depth of the valid ones: [module, why]
    rejected: list[tuple[str, str]] = field(default_factory=list)

    @property
    def module_names(self) -> list[str]:
        return [c.module for c in self.choices]

    @property
    def imbalance(self) -> float:
        """Largest segment cost over the mean (1.0 is perfect)."""
        mean = sum(self.segment_costs) / len(self.segment_costs)
        return max(self.segment_costs) / mean if mean > 0 else 1.0

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(asdict(self), indent=indent)

    def _fmt(self, v: float) -> str:
        if self.cost_unit == "s":
            return f"{v * 1e3:.3f} ms"
        if self.cost_unit == "flop":
            return f"{v / 1e6:.2f} MFLOP"
        return f"{v:g}"

    def __str__(self) -> str:
        what = {"s": "measured forward time", "flop": "forward FLOPs",
                "given": "given module costs"}[self.cost_unit]
        L = [f"varuna.auto_cutpoints: {len(self.choices)} cut-point(s) of {self.requested} requested, from "
             f"{len(self.candidates)} valid boundaries (cost: {what})"]
        rows = [["#", "after module", "cost before", "segment cost", "activation", "bytes"]]
        for i, c in enumerate(self.choices):
            carried = f" + {c.carried_bytes} carried" if c.carried_bytes else ""
            rows.append([str(i), c.module, self._fmt(c.cost_before), self._fmt(c.segment_cost),
                         f"{tuple(c.act_shape)} {c.act_dtype}", f"{c.act_bytes}{carried}"])
        rows.append(["", "(end of forward)", self._fmt(self.total_cost), self._fmt(self.segment_costs[-1]),
                     "", ""])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            L.append("  " + "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip())
        L.append(f"  segment costs: {' / '.join(self._fmt(c) for c in self.segment_costs)} "
                 f"(max/mean {self.imbalance:.3f})")
        if self.rejected:
            L.append(f"  rejected boundaries ({len(self.rejected)}):")
            L.extend(f"    - after {name}: {why}" for name, why in self.rejected)
        return "\n".join(L)


@dataclass
class _Candidate:
    call: ModuleCall
    valid: bool = True
    reason: str = ""
    #: bytes of the module outputs the engine would carry across this boundary (per micro-batch)
    carried_bytes: int = 0


def _is_family(info: TensorInfo, alias: TensorInfo) -> bool:
    """True if ``info`` is ``alias`` or an alias of it made by enclosing modules returning it."""
    while info is not None:
        if info is alias:
            return True
        info = info.via
    return False


def _batch_size(batch) -> int | None:

    sizes = {x.shape[0] for x in tree_flatten(batch)[0] if isinstance(x, torch.Tensor) and x.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def _window(info: TensorInfo, calls: list[ModuleCall], glue: frozenset[int]) -> tuple[int, float]:
    """Boundaries strictly inside every call of ``info.chain`` (except modules that run on every
    stage anyway): there the value is computed by every stage."""
    lo, hi = -1, math.inf
    for c in info.chain:
        if id(calls[c].module) not in glue:
            lo, hi = max(lo, calls[c].start), min(hi, calls[c].end)
    return lo, hi


def _blocking(info: TensorInfo, calls: list[ModuleCall], glue: frozenset[int] = frozenset()
              ) -> list[tuple[int, float]]:
    """Clock ranges [a, z) of boundaries that this value crosses without being valid on every stage.

    ``glue``: ids of modules that would run on every stage (Note [Replicated glue modules] in
    varuna/cutting/tracer.py): a pure value computed only by them is valid everywhere."""
    a, z = info.created, info.last_use
    if z <= a:
        return []
    if not info.pure:
        return [(a, z)]
    lo, hi = _window(info, calls, glue)
    out = []
    if a <= lo:
        out.append((a, min(z, lo + 1)))
    if hi < z:
        out.append((max(a, hi), z))
    return out


def _unroutable(rec: Recorder, c: ModuleCall, batch_size: int | None) -> str:
    """Why the output of call ``c`` cannot be routed through a CutPoint ("" when it can)."""
    n = rec.call_counts.get(id(c.module), 1)
    src, meta = c.first_src, c.first_meta
    if n > 1:
        return f"called {n} times per forward"
    if src is None or meta is None:
        return "returns no tensor (nor a tuple/list starting with one)"
    if len(meta[0]) == 0 or (batch_size is not None and meta[0][0] != batch_size):
        return f"output shape {list(meta[0])} is not batch-major (batch {batch_size})"
    if src.kind in ("input", "buffer", "external", "param") or src.created <= c.start:
        return "returns a value it did not compute (its input, a parameter or buffer)"
    return ""


def _glue_modules(rec: Recorder) -> frozenset[int]:
    """Modules every stage may run as glue (parameter-free, pure outputs, e.g. a rotary embedding):
    the engine replicates those whose outputs a later segment reads, so they never block a cut."""
    calls = rec.calls
    ok = {id(c.module) for c in calls if _replicable(c)}
    return frozenset(ok - {id(c.module) for c in calls if c.parent is not None and not _replicable(c)})


#: tensors one boundary may send (the runtime's message header: varuna/runtime/comm.py)
MAX_BOUNDARY_TENSORS = 6


def _carryable(info: TensorInfo, calls: list[ModuleCall], glue: frozenset[int]) -> bool:
    """A value returned by a module (not a glue one; or an enclosing module's alias of one): the
    engine carries such a value across routed cut-points (Note [Carried values] in
    varuna/cutting/cutpoint.py), so it need not block a boundary (see :func:`_counted_ranges`)."""
    x: TensorInfo | None = info
    while x is not None:
        if x.out_of is not None and id(calls[x.out_of[0]].module) not in glue:
            return True
        x = x.via
    return False


def _nbytes(info: TensorInfo) -> int:
    return math.prod(info.shape) * torch.empty((), dtype=getattr(torch, info.dtype)).element_size()


def _counted_ranges(info: TensorInfo, calls: list[ModuleCall], glue: frozenset[int], carry: bool,
                    ranges: list[tuple[int, float]] | None = None) -> list[tuple[int, float]]:
    """The boundary ranges over which ``info`` blocks a cut. A carried module output blocks only
    where code of a call enclosing the cut still reads it (a block's residual add): it is carried
    to modules called after the cut, else a cut inside every block would be "valid" by carrying the
    block's residual input and doubling the traffic."""
    ranges = _blocking(info, calls, glue) if ranges is None else ranges
    if not (carry and ranges and _carryable(info, calls, glue)):
        return ranges
    lo, hi = min(a for a, _ in ranges), max(z for _, z in ranges)
    out = []
    for t, k in info.reads:
        a, z = max(calls[k].start if k >= 0 else 0, info.created, lo), min(t, hi)
        if a < z:
            out.append((a, z))
    return out


def _crossings(rec: Recorder, pos: list[int], glue: frozenset[int], carry: bool
               ) -> tuple[list[int], list[int], list[int], dict[int, tuple[float, float, int]]]:
    """Per boundary position (as difference arrays over ``pos``): how many blocking values cross
    it, how many carried module outputs and their bytes; and, per carried origin, the range it is
    carried over and its bytes."""
    calls = rec.calls
    n = len(pos) + 1
    count, carried_n, carried_b = [0] * n, [0] * n, [0] * n

    def add(a: float, z: float, sign: int, diff: list[int]) -> None:
        i0, i1 = bisect.bisect_left(pos, a), bisect.bisect_left(pos, z)
        if i0 < i1:
            diff[i0] += sign
            diff[i1] -= sign

    carried_span: dict[int, tuple[float, float, int]] = {}
    for info in rec.all_infos:
        ranges = _blocking(info, calls, glue)
        if carry and ranges and _carryable(info, calls, glue):
            lo, hi, nb = carried_span.get(id(info.origin), (math.inf, -math.inf, _nbytes(info)))
            lo, hi = min(lo, *(a for a, _ in ranges)), max(hi, *(z for _, z in ranges))
            carried_span[id(info.origin)] = (lo, hi, nb)
        for a, z in _counted_ranges(info, calls, glue, carry, ranges):
            add(a, z, 1, count)
    for a, z, nb in carried_span.values():
        add(a, z, 1, carried_n)
        add(a, z, nb, carried_b)
    # Buffers written by one module's code must be read and written on one side of every cut.
    for bname, writes in rec.buffer_writes.items():
        if any(not w.pure or any(calls[i].parent is not None for i in w.chain) for _, w, _ in writes):
            first, last = rec.buffer_span[bname]
            add(first, last, 1, count)
    return count, carried_n, carried_b, carried_span


def _evaluate(rec: Recorder, batch_size: int | None, *, explain: bool = False, carry: bool = True
              ) -> list[_Candidate]:
    """Every non-root module call with its validity as a boundary (see the module docstring).

    ``explain``: name the value that blocks each invalid boundary (a scan per boundary: for
    error messages, not for large models' planning). ``carry``: module outputs read across a
    boundary do not block it (the engine carries them; their bytes count as the boundary's)."""
    calls = rec.calls
    glue = _glue_modules(rec)
    cands: list[_Candidate] = []
    for c in calls:
        if c.parent is None:
            continue
        cand = _Candidate(c)
        cands.append(cand)
        reason = _unroutable(rec, c, batch_size)
        if reason:
            cand.valid, cand.reason = False, reason
    live = [c for c in cands if c.valid]
    if not live:
        return cands
    pos = [c.call.end for c in live]
    order = sorted(range(len(live)), key=lambda i: pos[i])
    live = [live[i] for i in order]
    pos = [pos[i] for i in order]
    count, carried_n, carried_b, carried_span = _crossings(rec, pos, glue, carry)
    by_origin: dict[int, list[TensorInfo]] = {}
    for info in rec.all_infos:
        by_origin.setdefault(id(info.origin), []).append(info)
    run = n_run = b_run = 0
    for i, cand in enumerate(live):
        run, n_run, b_run = run + count[i], n_run + carried_n[i], b_run + carried_b[i]
        b = pos[i]
        origin = id(cand.call.first_src.origin)
        # The routed output itself (and its aliases by enclosing modules) may cross: it goes through the cut.
        own = sum(1 for info in by_origin.get(origin, [])
                  if _is_family(info, cand.call.first_alias)
                  for a, z in _counted_ranges(info, calls, glue, carry) if a <= b < z)
        span = carried_span.get(origin)
        own_carried = span is not None and span[0] <= b < span[1]
        extra_n, extra_b = n_run - own_carried, b_run - (span[2] if own_carried else 0)
        if run - own > 0:
            cand.valid = False
            cand.reason = (_blocker(rec, cand.call, b, glue, carry) if explain
                           else "another value is live across it")
        elif extra_n + 1 > MAX_BOUNDARY_TENSORS:
            cand.valid = False
            cand.reason = (f"{extra_n} module outputs would be carried across it besides the activation; "
                           f"a boundary sends at most {MAX_BOUNDARY_TENSORS} tensors")
        else:
            cand.carried_bytes = extra_b
    return cands


def _blocker(rec: Recorder, call: ModuleCall, b: int, glue: frozenset[int], carry: bool = True) -> str:
    for info in rec.all_infos:
        if info.origin is call.first_src.origin and _is_family(info, call.first_alias):
            continue
        if any(a <= b < z for a, z in _counted_ranges(info, rec.calls, glue, carry)):
            return f"another value is live across it: {info.desc} {list(info.shape)}"
    return "a buffer written by module code is read on both sides"


def _group(cands: list[_Candidate]) -> list[ModuleCall]:
    """One call per distinct boundary: of nested calls ending together on the same output, the
    outermost valid one that can host a CutPoint (not a Sequential/ModuleList/ModuleDict)."""
    groups: dict[tuple[int, int], list[ModuleCall]] = {}
    for cand in cands:
        if cand.valid and not isinstance(cand.call.module, _CONTAINERS):
            c = cand.call
            groups.setdefault((c.ops_end, id(c.first_src.origin)), []).append(c)
    chosen = [min(g, key=lambda c: c.start) for g in groups.values()]
    return sorted(chosen, key=lambda c: c.end)


def _timed_positions(model: nn.Module, batch, loss_fn: Callable | None, names: list[str],
                     reps: int) -> tuple[list[float], float]:
    """Time from the start of the forward to the end of each named module's call (in call order).

    Each gap between consecutive stamps is the fastest of ``reps`` runs: on a shared machine noise
    only ever adds time, so the minimum is the steadiest estimate of a gap's own cost.
    """
    mods = dict(model.named_modules())
    sync = torch.cuda.synchronize if any(p.is_cuda for p in model.parameters()) else (lambda: None)
    gaps: list[list[float]] = []
    totals: list[float] = []
    warm, runs = 0, 0
    while runs < max(reps, 1):
        stamps: dict[str, float] = {}
        handles = []
        for n in names:
            def hook(mod, args, out, n=n, stamps=stamps):
                sync()
                stamps[n] = time.perf_counter()
            handles.append(mods[n].register_forward_hook(hook))
        try:
            with preserved_state(model), torch.no_grad():
                sync()
                t0 = time.perf_counter()
                out = call_with_batch(model, batch)
                if loss_fn is not None:
                    loss_fn(out, batch)
                sync()
                t1 = time.perf_counter()
        finally:
            for h in handles:
                h.remove()
        totals.append(t1 - t0)
        # Warm up (allocators, caches, thread pools) until two runs in a row agree within 25%.
        if warm < 10 and (len(totals) < 2 or max(totals[-2:]) > 1.25 * min(totals[-2:])):
            warm += 1
            continue
        runs += 1
        marks = [t0, *[stamps[n] for n in names], t1]
        gaps.append([max(marks[i + 1] - marks[i], 0.0) for i in range(len(marks) - 1)])
    best = [min(g[i] for g in gaps) for i in range(len(names) + 1)]
    pos, acc = [], 0.0
    for g in best[:-1]:
        acc += g
        pos.append(acc)
    return pos, acc + best[-1]


def _positions(model: nn.Module, rec: Recorder, chosen_calls: list[ModuleCall], batch,
               loss_fn: Callable | None, module_costs: Mapping[str, float] | None, counter, timing_reps: int
               ) -> tuple[list[float], float, str]:
    """Cumulative cost at each candidate boundary, the total and its unit: from ``module_costs``,
    the FLOP counter of the recording, or timed runs of the forward (``batch``: on ``meta`` when
    the model is)."""
    names = [c.name for c in chosen_calls]
    if module_costs is not None:
        known = dict(model.named_modules())
        bad = [n for n in module_costs if n not in known]
        if bad:
            raise ValueError(f"module_costs names {bad[:3]} are not modules of the model")
        # A cost counts before a cut if all of its module's operations ran before the cut.
        ends = [(c.ops_end, float(module_costs[c.name])) for c in rec.calls if c.name in module_costs]
        positions = [sum(v for e, v in ends if e <= c.ops_end) for c in chosen_calls]
        total, unit = sum(v for _, v in ends), "given"
    elif counter is not None:
        positions = [c.flops_end for c in chosen_calls]
        total, unit = float(counter.get_total_flops()), "flop"
    else:
        positions, total = _timed_positions(model, batch, loss_fn, names, timing_reps)
        unit = "s"
    return positions, total, unit


def _check_request(model: nn.Module, max_cuts: int, cost: str) -> None:
    """Validate :func:`auto_cutpoints`' arguments; remove cut-points an earlier call inserted and
    refuse a model with CutPoints of its own."""
    if not isinstance(max_cuts, int) or max_cuts < 1:
        raise ValueError(f"max_cuts must be an integer >= 1, got {max_cuts!r}")
    if cost not in ("time", "flop"):
        raise ValueError(f"cost must be 'time' or 'flop', got {cost!r}")
    remove_cutpoints(model, only_auto=True)
    check_no_cutpoints(model)


def auto_cutpoints(
    model: nn.Module,
    example_batch,
    max_cuts: int,
    loss_fn: Callable | None = None,
    *,
    cost: str = "time",
    module_costs: Mapping[str, float] | None = None,
    balance_slack: float = 0.05,
    timing_reps: int = 5,
    verbose: bool = True,
) -> AutoCutPlan:
    """Insert up to ``max_cuts`` CutPoints into ``model`` at the best valid boundaries.

    ``example_batch``: one micro-batch, as the model's forward takes it (tensor, tuple or dict).
    ``loss_fn(output, batch)``: as for :class:`varuna.Engine` (default: the forward returns the
    loss). ``cost``: "time" (forward time, the fastest of ``timing_reps`` runs per gap between
    boundaries; FLOPs for a ``meta`` model) or "flop". ``module_costs``: known cost per module
    name instead (attributed at the end of each call of that module; give costs for modules that
    do not nest). ``balance_slack``: how
    much larger than the best achievable the largest segment may be in exchange for smaller
    activations. Prints the plan unless ``verbose=False``; returns it.

    Raises ``ValueError`` if the model already has CutPoints of its own, or has no valid boundary.
    Cut-points inserted by an earlier call are replaced.

    Example::

        >>> import torch, varuna
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        >>> varuna.auto_cutpoints(m, torch.randn(2, 4), 2, cost="flop", verbose=False).module_names
        ['0', '1']
    """
    _check_request(model, max_cuts, cost)
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and cost == "time":
        cost = "flop"  # nothing to time on `meta`
    counter = None
    if cost == "flop" and module_costs is None:
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
    rec = record_forward(model, example_batch, loss_fn, flop_counter=counter)
    batch = to_meta(example_batch) if on_meta else example_batch
    # Note [Carrying in plans]: first as if nothing could be carried (only the routed output
    # crosses each cut: the least traffic). Only when that plan is unbalanced (T5: the position
    # bias and the encoder output, read by every later block, leave no valid block end) plan again
    # letting module outputs be carried across cuts (Note [Carried values] in cutpoint.py), and
    # keep that plan if it is better balanced and the tracer accepts it.
    args = (model, rec, batch, example_batch, loss_fn, max_cuts, module_costs, counter, timing_reps,
            balance_slack)
    try:
        plans = [_plan(*args, carry=False)]
    except ValueError:
        plans = []
    if not plans or plans[0].imbalance > 1.0 + CARRY_WHEN_IMBALANCED * balance_slack:
        try:
            carried = _plan(*args, carry=True)
        except ValueError:
            if not plans:
                raise
        else:
            if not plans or carried.imbalance < plans[0].imbalance:
                plans.insert(0, carried)
    errs: list[str] = []
    for plan in plans:
        insert_cutpoints(model, plan.module_names, auto=True)
        errs = trace_model(model, example_batch, loss_fn).errors()
        if not errs:
            break
        remove_cutpoints(model, only_auto=True)
    if errs:  # the analysis above should make this impossible: do not leave a broken model behind
        raise RuntimeError("varuna internal error: automatic cut-points failed the tracer's check:\n" +
                           "\n".join(errs))
    if verbose:
        print(plan, flush=True)
    return plan


#: Note [Carrying in plans]: a plan without carried values is kept while its largest segment is
#: within this many ``balance_slack``\ s of the mean (1.15 at the default slack)
CARRY_WHEN_IMBALANCED = 3


def _plan(model: nn.Module, rec: Recorder, batch, example_batch, loss_fn: Callable | None, max_cuts: int,
          module_costs: Mapping[str, float] | None, counter, timing_reps: int, balance_slack: float,
          *, carry: bool) -> AutoCutPlan:
    """Choose the cuts from the recording (see :func:`auto_cutpoints`)."""
    cands = _evaluate(rec, _batch_size(example_batch), carry=carry)
    chosen_calls = _group(cands)
    if not chosen_calls:
        raise ValueError(_no_boundary_message(_evaluate(rec, _batch_size(example_batch), explain=True,
                                                        carry=carry)))
    positions, total, unit = _positions(model, rec, chosen_calls, batch, loss_fn, module_costs, counter,
                                        timing_reps)
    carried = {c.call.index: c.carried_bytes for c in cands}
    acts = [c.first_meta[2] + carried.get(c.index, 0) for c in chosen_calls]
    picked = choose_cuts(positions, total, acts, max_cuts, balance_slack)
    marks = [0.0, *[positions[i] for i in picked], total]
    seg = [max(marks[i + 1] - marks[i], 0.0) for i in range(len(marks) - 1)]
    choices = []
    for k, i in enumerate(picked):
        c = chosen_calls[i]
        shape, dtype, nbytes = c.first_meta
        choices.append(CutChoice(c.name, f"{c.name}.{CUT_ATTR}", positions[i], seg[k], list(shape),
                                 str(dtype).replace("torch.", ""), nbytes, carried.get(c.index, 0)))
    return AutoCutPlan(choices, seg, total, unit, max_cuts,
                       [(c.name, positions[i], acts[i]) for i, c in enumerate(chosen_calls)],
                       _rejections(rec, cands, [chosen_calls[i] for i in picked], carry))


#: at most this many rejected boundaries are explained in a plan (each is a scan of the recording)
MAX_REJECTIONS_SHOWN = 12


def _rejections(rec: Recorder, cands: list[_Candidate], valid: list[ModuleCall], carry: bool = True
                ) -> list[tuple[str, str]]:
    """Why module ends as deep as the chosen boundaries (e.g. the other decoder layers) were refused:
    the question a user asks when a plan is unbalanced. Containers and modules whose end coincides
    with a valid boundary are left out: they are not a different place to cut."""
    glue = _glue_modules(rec)
    depth = max(c.name.count(".") for c in valid)
    valid_at = {(c.ops_end, id(c.first_src.origin)) for c in valid if c.first_src is not None}
    out = []
    for cand in cands:
        c = cand.call
        if cand.valid or isinstance(c.module, _CONTAINERS) or c.name.count(".") > depth:
            continue
        if c.first_src is not None and (c.ops_end, id(c.first_src.origin)) in valid_at:
            continue
        why = cand.reason
        if why == "another value is live across it" and len(out) < MAX_REJECTIONS_SHOWN:
            why = _blocker(rec, c, c.end, glue, carry)
        out.append((c.name, why))
    if len(out) > MAX_REJECTIONS_SHOWN:
        out = [*out[:MAX_REJECTIONS_SHOWN], (f"... {len(out) - MAX_REJECTIONS_SHOWN} more", "")]
    return out


def _no_boundary_message(cands: list[_Candidate]) -> str:
    if cands:
        depth = min(c.call.name.count(".") for c in cands)
        shown = [c for c in cands if c.call.name.count(".") == depth][:8]
        why = "".join(f"\n  - '{c.call.name}': "
                      f"{c.reason or 'a container: its last module ends at the same place'}" for c in shown)
    else:
        why = "\n  - the model calls no submodule: its whole forward is one module"
    return ("varuna.auto_cutpoints: no valid cut boundary in this model: a boundary must be the end of a "
            "submodule called once per forward whose (first) output is a batch-major tensor and the only "
            f"activation still needed afterwards. Checked {len(cands)} module call(s); e.g.:{why}\n"
            "Split the model into submodules called in sequence, or place varuna.CutPoint()s by hand "
            "(docs/annotating.md)")


# ---------------------------------------------------------------------------------------------
# Engine integration


def engine_auto_cutpoints(model: nn.Module, example_batch, max_cuts: int, *, micro_batch_size: int,
                          loss_fn: Callable | None, rank: int = 0, world: int = 1,
                          cost: str = "flop") -> list[str]:
    """What :class:`varuna.Engine` does for ``VarunaConfig.auto_cutpoints``: rank 0 plans on the
    first micro-batch (timings differ between processes), every rank applies the same plan.

    Returns the modules that got a cut-point. A ``ValueError`` on rank 0 is raised on every rank.
    """
    from varuna.cutting.batches import batch_size_of, slice_batch

    first = slice_batch(example_batch, 0, min(micro_batch_size, batch_size_of(example_batch)))
    if world == 1:
        return auto_cutpoints(model, first, max_cuts, loss_fn, cost=cost).module_names
    import torch.distributed as dist

    msg: dict = {}
    failure: Exception | None = None
    if rank == 0:
        try:
            msg = {"modules": auto_cutpoints(model, first, max_cuts, loss_fn, cost=cost).module_names}
        except Exception as e:  # every rank must leave the broadcast below, then fail alike
            failure, msg = e, {"error": str(e)}
    box = [json.dumps(msg)]
    dist.broadcast_object_list(box, src=0)  # a JSON string: no objects are unpickled from peers
    msg = json.loads(box[0])
    if failure is not None:
        raise failure
    if "error" in msg:
        raise ValueError(f"automatic cut-points failed on rank 0: {msg['error']}")
    if rank != 0:
        remove_cutpoints(model, only_auto=True)
        insert_cutpoints(model, msg["modules"], auto=True)
    return msg["modules"]
