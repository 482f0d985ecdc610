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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["CutPoint", "StopForward", "SplitState", "ForwardRun", "DryRun"]


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
            raise StopForward(xs)
        out = xs
        if idx == self.first_segment - 1:
            if self.inputs is None or len(self.inputs) != len(xs):
                raise RuntimeError(f"stage input boundary {idx} expected {len(xs)} tensor(s)")
            out = self.inputs
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
