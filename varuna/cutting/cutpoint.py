"""``CutPoint``: the marker users put on activations at candidate pipeline boundaries.

Outside the engine a CutPoint is the identity, so an annotated model still trains on one device
unchanged. Inside the engine, the code between two consecutive cut-points is a *segment*; a
stage is a run of segments. The engine attaches a :class:`SplitState` to every CutPoint of the
model; the CutPoint then asks the current :class:`ForwardRun` what to do at its boundary:

* before the stage's input boundary: pass the (placeholder) value through;
* at the stage's input boundary: return the activation received from the previous stage;
* at the stage's output boundary: stop the forward (raise :class:`StopForward` carrying the
  activation to send on) — the rest of the user's forward never runs on this stage.

Example::

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)
            self.cut = varuna.CutPoint()

        def forward(self, x, y):
            h = self.cut(torch.relu(self.a(x)))   # boundary between segment 0 and 1
            return F.mse_loss(self.b(h), y)

Note [Carried values]: a model cut with :func:`~varuna.cutting.routing.apply_cutpoints` cannot be
edited to pass extra values through its cut-points, yet real models read values made early in
later blocks: T5's first block computes the relative position bias from its own parameters and
returns it, every later block reads it; every decoder block reads the encoder's output. Where
the tracer finds such a value crossing only routed cut-points (placed by name or automatically)
and returned by a module that other stages skip, the engine *carries* it (:class:`CarrySpec`,
from the tracer's ``carried_values``): the stage computing it captures the skipped module's real
output, appends it after the activation at its output boundary, and every later stage up to the last reader
receives it after the activation and puts it in place of the module's placeholder output (the
``call``-th call, tensor ``leaf`` of the flattened output), then sends it on. It travels like
the activation: as an autograd leaf on the receiving side whose gradient goes back with the
activation's, so a parameter that made it (``relative_attention_bias``) gets the gradients of
every stage that read it. Recomputing such a value on each stage instead would need the
parameter on every stage and its gradients summed; carrying needs neither. Values computed by
glue code from activations have no module to capture them at and stay errors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["CutPoint", "StopForward", "SplitState", "ForwardRun", "DryRun", "CarrySpec", "CarryPlan", "Carry"]


class CutPoint(nn.Module):
    """Identity module marking a candidate pipeline-stage boundary.

    Call it on the activation(s) that cross the boundary: ``x = self.cut(x)`` or
    ``x, mask = self.cut(x, mask)``. Register it as a submodule (create it in ``__init__``) and
    call each CutPoint at most once per forward.
    """

    def __init__(self) -> None:
        super().__init__()
        # Set by the engine; plain attribute (not a submodule) shared by all CutPoints of a model.
        self._varuna_state: SplitState | None = None
        #: routed: inserted by ``apply_cutpoints`` / ``cut_after`` / automatic cut-points into an
        #: unmodified model: nobody can pass extra values through it by hand, so the engine carries
        #: module outputs that cross it (Note [Carried values]); across a hand-placed CutPoint such
        #: a value stays an error with its fix.
        self.routed = False
        #: placed by the automatic planner (replaced by a new plan; never mixed with manual cuts)
        self.planned = False

    def forward(self, *xs: torch.Tensor):
        if not xs:
            raise TypeError("CutPoint() needs at least one tensor: call it as x = cut(x)")
        state = self._varuna_state
        run = state.run if state is not None else None
        if run is None or state.in_placeholder:
            return xs[0] if len(xs) == 1 else xs
        return run.cross(self, xs)


class StopForward(Exception):
    """Raised at a stage's output boundary; carries the activation(s) to send downstream."""

    def __init__(self, outputs: tuple[torch.Tensor, ...]):
        super().__init__("stage output boundary reached")
        self.outputs = outputs


@dataclass
class SplitState:
    """Per-engine state shared by the model's CutPoints and skipped-module wrappers."""

    #: the forward currently executing (None: CutPoints are identities)
    run: ForwardRun | DryRun | None = None
    #: True while a skipped module is evaluated on meta tensors for its output shape
    in_placeholder: bool = False


def _as_tuple(xs) -> tuple:
    return xs if isinstance(xs, tuple) else (xs,)


@dataclass(frozen=True)
class CarrySpec:
    """A module output carried across cut-points (Note [Carried values])."""

    #: the module returning it (one that stages outside its segment skip)
    module: str
    #: which of that module's calls in one forward (0-based)
    call: int
    #: index of the tensor among the call's flattened outputs (torch pytree order)
    leaf: int
    produced_in: int
    #: the last segment that reads it
    last_read: int

    def crosses(self, cut: int) -> bool:
        """True if the value is live across cut-point ``cut`` (the end of segment ``cut``)."""
        return self.produced_in <= cut < self.last_read


@dataclass
class CarryPlan:
    """What one stage does with carried values: those it receives after its input boundary's
    tensors (``recv``), those it sends after its output boundary's (``send``), and where in the
    forward each is found (``sites``: module -> call -> [(leaf, spec)])."""

    recv: tuple[CarrySpec, ...]
    send: tuple[CarrySpec, ...]
    sites: dict[str, dict[int, list[tuple[int, CarrySpec]]]]

    @classmethod
    def for_stage(cls, specs: Sequence[CarrySpec], first_segment: int, last_segment: int,
                  is_last_stage: bool) -> CarryPlan | None:
        """The plan of the stage running segments [first, last]; None when it carries nothing.
        Both ends of a boundary filter the same ordered ``specs``, so they agree on the order."""
        recv = tuple(s for s in specs if first_segment > 0 and s.crosses(first_segment - 1))
        send = () if is_last_stage else tuple(s for s in specs if s.crosses(last_segment))
        if not recv and not send:
            return None
        sites: dict[str, dict[int, list[tuple[int, CarrySpec]]]] = {}
        for s in dict.fromkeys(recv + send):
            sites.setdefault(s.module, {}).setdefault(s.call, []).append((s.leaf, s))
        return cls(recv, send, sites)


class Carry:
    """Carried values during one forward of one stage: received ones put in place of their
    module's placeholder output, produced ones captured, the outgoing ones gathered at the end."""

    def __init__(self, plan: CarryPlan, received: Sequence[torch.Tensor]) -> None:
        self.plan = plan
        self.values: dict[CarrySpec, torch.Tensor] = dict(zip(plan.recv, received))
        self.calls: dict[str, int] = {}

    def module_output(self, name: str, out, computed: bool):
        """``out`` of a call of module ``name`` (``computed``: real, else a placeholder), with
        received values in place of their placeholders."""
        sites = self.plan.sites.get(name)
        if sites is None:
            return out
        n = self.calls.get(name, 0)
        self.calls[name] = n + 1
        here = sites.get(n)
        if not here:
            return out
        leaves, spec = tree_flatten(out)
        changed = False
        for i, s in here:
            x = leaves[i] if i < len(leaves) else None
            if not isinstance(x, torch.Tensor):
                raise RuntimeError(f"module '{name}' call #{n} returned no tensor at output #{i}, where "
                                   "the dry run saw the value carried across a cut-point; its outputs must "
                                   "not depend on the data")
            if computed:
                self.values[s] = x
            elif s in self.values:
                got = self.values[s]
                if got.shape != x.shape:
                    raise RuntimeError(f"carried output #{i} of module '{name}' arrived with shape "
                                       f"{tuple(got.shape)}, its placeholder has {tuple(x.shape)}")
                leaves[i], changed = got, True
        return tree_unflatten(leaves, spec) if changed else out

    def outgoing(self) -> tuple[torch.Tensor, ...]:
        missing = [s for s in self.plan.send if s not in self.values]
        if missing:
            s = missing[0]
            raise RuntimeError(f"output #{s.leaf} of module '{s.module}' (call #{s.call}) must be carried on "
                               "but was neither computed nor received on this stage")
        return tuple(self.values[s] for s in self.plan.send)


@dataclass
class ForwardRun:
    """How one forward of one micro-batch behaves on one stage (see module docstring)."""

    cutpoints: Sequence[CutPoint]
    first_segment: int
    last_segment: int
    num_segments: int
    #: activation received from the previous stage (None on stage 0)
    inputs: tuple[torch.Tensor, ...] | None
    #: called with the new segment index at every boundary (re-seeds the RNG)
    on_segment: Callable[[int], None] | None = None
    segment: int = 0
    crossings: int = 0
    #: module outputs carried across this stage's boundaries (Note [Carried values])
    carry_plan: CarryPlan | None = None
    carry: Carry | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.carry_plan is not None:
            # Received values come after the activation: known before the forward reaches the
            # modules whose placeholders they replace.
            n = len(self.carry_plan.recv)
            have = self.inputs or ()
            if len(have) < n:
                raise RuntimeError(f"stage input has {len(have)} tensor(s); {n} carried value(s) expected")
            self.carry = Carry(self.carry_plan, have[len(have) - n:] if n else ())

    def in_stage(self) -> bool:
        return self.first_segment <= self.segment <= self.last_segment

    def cross(self, cp: CutPoint, xs: tuple[torch.Tensor, ...]):
        idx = self.crossings
        if idx >= len(self.cutpoints) or self.cutpoints[idx] is not cp:
            raise RuntimeError(
                f"CutPoint #{idx} differs from the one seen at this position in the dry run; the "
                "sequence of CutPoints a forward passes must not depend on the data"
            )
        self.crossings += 1
        if idx == self.last_segment:
            raise StopForward(xs + self.carry.outgoing() if self.carry is not None else xs)
        out = xs
        if idx == self.first_segment - 1:
            extra = len(self.carry_plan.recv) if self.carry_plan is not None else 0
            if self.inputs is None or len(self.inputs) != len(xs) + extra:
                raise RuntimeError(f"stage input boundary {idx} expected {len(xs) + extra} tensor(s)")
            out = self.inputs[: len(xs)]
        self.segment = idx + 1
        if self.on_segment is not None:
            self.on_segment(self.segment)
        return out[0] if len(out) == 1 else out


@dataclass
class DryRun:
    """Records the boundaries a full forward crosses: order, timing and activation shapes."""

    cutpoint_names: dict[int, str]
    segment: int = 0
    order: list[CutPoint] = field(default_factory=list)
    cross_times: list[float] = field(default_factory=list)
    act_meta: list[list[tuple[tuple[int, ...], torch.dtype]]] = field(default_factory=list)
    crossing_tensors: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    on_segment: Callable[[int], None] | None = None

    def in_stage(self) -> bool:
        return True

    def cross(self, cp: CutPoint, xs: tuple[torch.Tensor, ...]):
        if any(c is cp for c in self.order):
            name = self.cutpoint_names.get(id(cp), "?")
            raise ValueError(
                f"CutPoint '{name}' was called twice in one forward; each CutPoint marks one "
                "boundary: create one CutPoint per boundary"
            )
        for x in xs:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"CutPoint got a {type(x).__name__}; pass tensors only")
        self.order.append(cp)
        self.cross_times.append(time.perf_counter())
        self.act_meta.append([(tuple(x.shape), x.dtype) for x in xs])
        self.crossing_tensors.append(xs)
        self.segment += 1
        if self.on_segment is not None:
            self.on_segment(self.segment)
        return xs[0] if len(xs) == 1 else xs
