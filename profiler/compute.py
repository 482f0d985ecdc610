"""Per-segment compute costs: F_i(m), R_i(m), B_i(m) and memory, measured the way a stage runs.

Each segment is profiled in isolation, exactly as the engine would execute a one-segment stage:
a fresh copy of the model is turned into that stage's model with :func:`varuna.cutting.split.
materialize_stage` (modules of other segments return placeholders, parameters of other segments
become stride-0 zeros), the activation recorded at the segment's input cut-point is swapped in by
the input CutPoint, and the forward stops at the output CutPoint (:class:`varuna.cutting.cutpoint.
ForwardRun`). Timestamps are taken at the input swap and at the stop, so the placeholders of the
segments *before* it (work a multi-segment stage would not repeat per segment) are not counted.

Per repetition (after ``warmup`` unrecorded ones), mirroring the engine's tasks (Note [Tasks]):

- **F**: forward under ``torch.no_grad()`` — the engine's forward of a micro-batch that will be
  recomputed (every stage but the last in Varuna's schedule) keeps no graph;
- **R**: forward with autograd recording (the recompute; also what a forward that keeps its graph
  costs);
- **B**: ``torch.autograd.backward`` of the segment's outputs with a gradient of their shape (the
  last segment: ``loss.backward()``), gradients accumulating into ``.grad`` as within a mini-batch;
- the optimizer step of the segment's parameters (timed; used for ``optimizer_s_per_param_byte``).

Memory (one extra untimed R+B per m): parameter, gradient and optimizer-state bytes are summed
from the stage's actual tensors (optimizer state after a real step: Adam holds two moments);
stashed input = bytes of the segment's input (segment 0: the micro-batch's tensors); activations =
on CPU, the bytes of the distinct storages autograd saves during R (a
``torch.autograd.graph.saved_tensors_hooks`` pack hook sees every one) plus the outputs, minus the
parameters and the input; on CUDA, the allocator's peak during R+B above what was allocated before.

Example::

    >>> from profiler.spec import load_target
    >>> prof = SegmentProfiler(load_target("profiler.targets:emulated", {"num_blocks": 2, "fwd_s": 0.0}),
    ...                        warmup=0, reps=1)
    >>> [r.segment for r in prof.measure(1, [1, 2])]
    [1, 1]
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from profiler.spec import ModelTarget
from varuna.cutting.batches import call_with_batch
from varuna.cutting.cutpoint import CutPoint, DryRun, ForwardRun, SplitState, StopForward
from varuna.cutting.split import ModelProfile, materialize_stage, profile_model, storage_key
from varuna.runtime.executor import leaf

__all__ = ["SegmentMeasurement", "SegmentProfiler", "median_iqr", "DryRunInfo", "dry_run"]

# Note [Tasks]: the three timed tasks are those of varuna.runtime.executor.ScheduleExecutor: F (no
# graph when the micro-batch will be recomputed), R (forward with graph from the stashed input),
# B (backward from the received gradient). A stage whose forward keeps its graph (last stage, or no
# recompute) pays about R for its forward: the simulator reads recompute_s for that.


@dataclass(kw_only=True)
class SegmentMeasurement:
    """Raw measurements of one segment at one micro-batch size (times in seconds, sizes in bytes)."""

    segment: int
    micro_batch_size: int
    fwd_s: list[float]
    recompute_s: list[float]
    bwd_s: list[float]
    optimizer_step_s: list[float]
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    stashed_input_bytes: int
    activation_bytes: int
    memory_source: str
    """``saved_tensors`` (CPU accounting) or ``cuda_allocator``."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SegmentMeasurement:
        return cls(**d)


def median_iqr(values: Sequence[float]) -> tuple[float, float]:
    """Median and interquartile range (0 for fewer than two values).

    >>> median_iqr([1.0, 2.0, 3.0, 4.0, 100.0])
    (3.0, 2.0)
    """
    vals = sorted(values)
    if not vals:
        raise ValueError("no measurements")
    if len(vals) < 2:
        return vals[0], 0.0
    q = statistics.quantiles(vals, n=4, method="inclusive")
    return statistics.median(vals), q[2] - q[0]




def _tensor_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


@dataclass
class _TimedRun(ForwardRun):
    """A :class:`ForwardRun` that timestamps the input swap and the output stop."""

    sync: Callable[[], None] = lambda: None
    t_in: float | None = None
    t_out: float | None = None

    def cross(self, cp: CutPoint, xs: tuple[torch.Tensor, ...]):
        idx = self.crossings
        if idx == self.last_segment:
            self.sync()  # the segment's kernels must be done before the clock is read
            self.t_out = time.perf_counter()
        out = super().cross(cp, xs)
        if idx == self.first_segment - 1:
            self.sync()  # placeholders of earlier segments finish outside the measured span
            self.t_in = time.perf_counter()
        return out


@dataclass(kw_only=True)
class DryRunInfo:
    """What the profiler needs to know before measuring (one no-grad forward per micro-batch size)."""

    cutpoint_names: list[str]
    """Qualified names of the cut-points, in the order the forward crosses them."""
    num_segments: int
    segment_cost_s: list[float]
    """Seconds each segment took in the dry forward at the largest m (balances segments across
    processes; not a measurement)."""
    act_meta: dict[int, list[list[tuple[tuple[int, ...], str]]]] = field(default_factory=dict)
    """m -> per cut-point, the (shape, dtype name) of each tensor crossing it."""
    batch_bytes: dict[int, int] = field(default_factory=dict)
    """m -> bytes of the micro-batch's tensors."""


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def dry_run(target: ModelTarget, ms: Sequence[int]) -> DryRunInfo:
    """Cut-points and activation shapes at every m, from one no-grad forward per m.

    Deliberately lighter than :func:`varuna.cutting.split.profile_model` (no FLOP counting: its first use
    imports torch._dynamo, seconds of CPU on a small machine); the workers run that one, they need
    its parameter-to-segment map. Raises ``ValueError`` (one line) for a model without CutPoints,
    one whose forward fails, or one whose cut-points depend on the data.
    """
    model = copy.deepcopy(target.model)
    names = {id(mod): n for n, mod in model.named_modules() if isinstance(mod, CutPoint)}
    if not names:
        raise ValueError(
            f"model {target.spec} has no CutPoint; call varuna.CutPoint() on the activations at "
            "candidate stage boundaries (see varuna/cutting/cutpoint.py)"
        )
    info: DryRunInfo | None = None
    for m in sorted(ms, reverse=True):  # the largest m first: its timings balance the segments
        batch = target.make_batch(m)
        try:
            _, dry, t0, t1 = _capture(model, batch, target.loss_fn, names)
        except (ValueError, TypeError) as e:
            raise ValueError(f"model {target.spec}: dry run at m={m} failed: {e}") from e
        except Exception as e:
            raise ValueError(f"model {target.spec}: dry run at m={m} failed: {type(e).__name__}: {e}") from e
        order = [names[id(cp)] for cp in dry.order]
        if not order:
            raise ValueError(
                f"model {target.spec}: its forward calls none of its CutPoints; call them on the "
                "activations at candidate stage boundaries (x = self.cut(x))"
            )
        if info is None:
            marks = [t0, *dry.cross_times, t1]
            info = DryRunInfo(
                cutpoint_names=order,
                num_segments=len(order) + 1,
                segment_cost_s=[marks[i + 1] - marks[i] for i in range(len(marks) - 1)],
            )
        elif order != info.cutpoint_names:
            raise ValueError(
                f"model {target.spec}: the CutPoints its forward passes differ between micro-batch "
                f"sizes ({order} vs {info.cutpoint_names}); they must not depend on the data"
            )
        info.act_meta[m] = [[(tuple(s), _dtype_name(d)) for s, d in cut] for cut in dry.act_meta]
        info.batch_bytes[m] = _tensor_bytes(batch)
    assert info is not None
    return info


def _capture(
    model: torch.nn.Module, batch: Any, loss_fn: Callable, names: dict[int, str] | None = None
) -> tuple[list[tuple], DryRun, float, float]:
    """Run the whole model once (no grad): the tensors crossing each cut-point, the DryRun record
    and the start/end times of the forward."""
    cps = [m for m in model.modules() if isinstance(m, CutPoint)]
    state = cps[0]._varuna_state if cps and cps[0]._varuna_state is not None else SplitState()
    for cp in cps:
        cp._varuna_state = state
    dry = DryRun(cutpoint_names=names or {})
    state.run = dry
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            loss_fn(call_with_batch(model, batch), batch)
            t1 = time.perf_counter()
    finally:
        state.run = None
    crossing = [tuple(x.detach().clone() for x in xs) for xs in dry.crossing_tensors]
    return crossing, dry, t0, t1


class SegmentProfiler:
    """Measures segments of one model, one segment at a time, at several micro-batch sizes.

    ``device``: where the stage runs (``cpu`` or ``cuda[:i]``). ``optimizer``: ``adam`` (two
    moments per parameter, as the paper assumes), ``sgd`` or ``none``. Each (segment, m) gets
    ``reps`` measured repetitions after ``warmup``, more (up to ``max_reps``) when that takes less
    than ``min_time_s``: short segments are cheap to repeat and noisy, so they get more samples.
    ``dry_run_m``: micro-batch size of the dry run that maps parameters to segments (some models,
    e.g. with BatchNorm, cannot run at m = 1).
    """

    def __init__(
        self,
        target: ModelTarget,
        *,
        device: str | torch.device = "cpu",
        warmup: int = 2,
        reps: int = 7,
        optimizer: str = "adam",
        min_time_s: float = 0.0,
        max_reps: int = 50,
        dry_run_m: int = 1,
    ) -> None:
        if reps < 1 or warmup < 0:
            raise ValueError(f"need reps >= 1 and warmup >= 0, got reps={reps} warmup={warmup}")
        if optimizer not in ("adam", "sgd", "none"):
            raise ValueError(f"unknown optimizer {optimizer!r}; choose adam, sgd or none")
        self.target = target
        self.device = torch.device(device)
        self.warmup, self.reps, self.optimizer = warmup, reps, optimizer
        self.min_time_s, self.max_reps = min_time_s, max(max_reps, reps)
        self.pristine = target.model
        # The dry run attaches a SplitState to the pristine model's CutPoints; each segment's
        # copy gets its own state below.
        self.profile: ModelProfile = profile_model(
            self.pristine, target.make_batch(dry_run_m), target.loss_fn, measure=False
        )
        self.num_cutpoints = self.profile.num_cutpoints
        self._crossings: dict[int, tuple[Any, list[tuple]]] = {}

    def fwd_flops_per_example(self) -> list[float] | None:
        """Each segment's forward FLOPs per example, from the dry run's ``FlopCounterMode`` count
        (calibration ``model.fwd_flops_per_example``: the simulator's TFLOP/s and MFU)."""
        p = self.profile
        if p.fwd_flops is None or p.flops_examples <= 0:
            return None
        return [f / p.flops_examples for f in p.fwd_flops]

    def shared_params(self) -> list[dict]:
        """Parameters several segments read (tied embeddings), grouped by those segments, with
        their bytes (calibration ``model.shared_params``; the runtime sums their gradients in a
        group of their own: ``varuna.core.calibration.SharedParams``)."""
        by_segments: dict[tuple[int, ...], int] = {}
        for name, segs in sorted(self.profile.shared_params().items()):
            by_segments[segs] = by_segments.get(segs, 0) + self.profile.param_bytes.get(name, 0)
        return [{"segments": list(s), "grad_bytes": b} for s, b in sorted(by_segments.items())]

    # -- helpers -------------------------------------------------------------------------------

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _to_device(self, tree: Any) -> Any:
        return tree_map(lambda x: x.to(self.device) if isinstance(x, torch.Tensor) else x, tree)

    def _crossing(self, m: int) -> tuple[Any, list[tuple]]:
        """The micro-batch of size m and the real activations crossing each cut-point for it."""
        if m not in self._crossings:
            batch = self.target.make_batch(m)
            crossing = _capture(self.pristine, batch, self.target.loss_fn)[0]
            self._crossings[m] = (self._to_device(batch), [self._to_device(xs) for xs in crossing])
        return self._crossings[m]

    def _stage(self, segment: int):
        model = copy.deepcopy(self.pristine)
        state = SplitState()
        for cp in model.modules():
            if isinstance(cp, CutPoint):
                cp._varuna_state = state
        params = materialize_stage(model, self.profile, segment, segment, state, device=self.device)
        by_name = dict(model.named_modules())
        order = [by_name[n] for n in self.profile.cutpoint_names]
        return model, state, order, params

    def _forward(self, model, state, order, segment: int, inputs, batch, grad: bool):
        """One forward of the one-segment stage; returns (outputs or loss, start, end)."""
        K = self.num_cutpoints
        run = _TimedRun(
            cutpoints=order,
            first_segment=segment,
            last_segment=segment if segment < K else K,
            num_segments=K + 1,
            inputs=inputs,
            sync=self._sync,
        )
        state.run = run
        try:
            with torch.set_grad_enabled(grad):
                self._sync()
                t0 = time.perf_counter()
                try:
                    out = call_with_batch(model, batch)
                except StopForward as stop:
                    return stop.outputs, (run.t_in if segment > 0 else t0), run.t_out
                loss = self.target.loss_fn(out, batch)
                self._sync()
                return loss, (run.t_in if segment > 0 else t0), time.perf_counter()
        finally:
            state.run = None

    def _backward(self, segment: int, out, grads) -> float:
        self._sync()
        t0 = time.perf_counter()
        if segment == self.num_cutpoints:
            out.backward()
        else:
            pairs = [(o, g) for o, g in zip(out, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self._sync()
        return time.perf_counter() - t0

    # -- the measurement -----------------------------------------------------------------------

    def measure(self, segment: int, ms: Sequence[int]) -> list[SegmentMeasurement]:
        """Time F/R/B and the optimizer step of ``segment`` at each m; account its memory."""
        K = self.num_cutpoints
        if not 0 <= segment <= K:
            raise ValueError(f"segment {segment} out of range: the model has {K + 1} segments")
        model, state, order, params = self._stage(segment)
        trainable = [p for p in params.values() if p.requires_grad]
        opt = None
        if trainable and self.optimizer == "adam":
            # lr tiny: the parameters barely move, so every repetition times the same model.
            opt = torch.optim.Adam(trainable, lr=1e-9)
        elif trainable and self.optimizer == "sgd":
            opt = torch.optim.SGD(trainable, lr=1e-9, momentum=0.9)
        results = []
        for m in ms:
            batch, crossing = self._crossing(m)
            stash = crossing[segment - 1] if segment > 0 else None
            fwd, rec, bwd, opt_s = [], [], [], []
            grads = None
            rounds, rep, t_start = self.warmup + self.reps, 0, time.perf_counter()
            while rep < rounds:
                if rep == self.warmup and rep > 0 and self.min_time_s > 0:
                    per_rep = (time.perf_counter() - t_start) / rep
                    want = math.ceil(self.min_time_s / max(per_rep, 1e-6))
                    rounds = self.warmup + min(max(self.reps, want), self.max_reps)
                inputs = None if stash is None else tuple(leaf(x) for x in stash)
                _, a, b = self._forward(model, state, order, segment, inputs, batch, grad=False)
                f = b - a
                out, a, b = self._forward(model, state, order, segment, inputs, batch, grad=True)
                r = b - a
                if grads is None and segment < K:
                    grads = [torch.full_like(o, 1e-3) if o.is_floating_point() else None for o in out]
                bt = self._backward(segment, out, grads)
                del out, inputs
                ot = 0.0
                if opt is not None:
                    self._sync()
                    t0 = time.perf_counter()
                    opt.step()
                    self._sync()
                    ot = time.perf_counter() - t0
                if rep >= self.warmup:
                    fwd.append(f)
                    rec.append(r)
                    bwd.append(bt)
                    opt_s.append(ot)
                rep += 1
            act_bytes, source = self._activation_bytes(
                model, state, order, segment, stash, batch, grads, params
            )
            param_bytes = sum(p.numel() * p.element_size() for p in params.values())
            grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
            opt_bytes = 0
            if opt is not None:
                opt_bytes = sum(_tensor_bytes(st) for st in opt.state.values())
            stash_bytes = _tensor_bytes(stash) if stash is not None else _tensor_bytes(batch)
            results.append(
                SegmentMeasurement(
                    segment=segment,
                    micro_batch_size=m,
                    fwd_s=fwd,
                    recompute_s=rec,
                    bwd_s=bwd,
                    optimizer_step_s=opt_s,
                    param_bytes=param_bytes,
                    grad_bytes=grad_bytes,
                    optimizer_bytes=opt_bytes,
                    stashed_input_bytes=stash_bytes,
                    activation_bytes=act_bytes,
                    memory_source=source,
                )
            )
        return results

    def _activation_bytes(self, model, state, order, segment, stash, batch, grads, params) -> tuple[int, str]:
        """Bytes alive for one micro-batch during its recompute/backward (see the module docstring)."""
        inputs = None if stash is None else tuple(leaf(x) for x in stash)
        excluded = {storage_key(p)[0] for p in params.values()}
        excluded |= {storage_key(x)[0] for x in (stash or ())}
        excluded |= {storage_key(x)[0] for x in (inputs or ())}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.is_meta:  # shape inference of placeholders: no memory
                return t
            key, nbytes = storage_key(t)
            if key not in excluded and nbytes > 0:
                saved[key] = nbytes
            return t  # no copy: the hook only looks

        if self.device.type == "cuda":
            self._sync()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            out, _, _ = self._forward(model, state, order, segment, inputs, batch, grad=True)
            self._backward(segment, out, grads)
            del out
            self._sync()
            return max(0, torch.cuda.max_memory_allocated(self.device) - base), "cuda_allocator"
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _, _ = self._forward(model, state, order, segment, inputs, batch, grad=True)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key, nbytes = storage_key(t)
                if key not in excluded:
                    saved[key] = nbytes
        total = sum(saved.values())
        self._backward(segment, out, grads)
        return total, "saved_tensors"
