"""The schedule executor: runs one stage's tasks for one mini-batch (Note [Step] in engine.py).

A loop asks the stage's :class:`~varuna.core.schedule.StagePolicy` for the next task, runs it, and
drains the inbox fed by the link receiver threads. F runs without a graph (stashing its input)
when the schedule recomputes that micro-batch, else it keeps its graph; R rebuilds the graph from
the stash; B back-propagates the received gradient (the loss on the last stage) and sends the
input gradients upstream.

Note [Deterministic forward]: some kernels pick their algorithm by autograd state. PyTorch's CPU
``scaled_dot_product_attention`` takes its flash kernel unless a float ``attn_mask`` requires
grad, and then its math kernel; a mask built from a parameter (T5's position bias) requires grad
only while autograd is on. A forward run without a graph and its recompute with one then round
differently (~1e-7): the next stage consumes an activation that is not the one whose backward is
taken, and a 2×1 run drifts from 1×1 (issue #16). So in deterministic mode every training forward
runs with autograd on, the way a 1×1 run and every recompute do; a forward that the schedule
recomputes detaches what it sends and drops its graph at once. Cost: the graph of one micro-batch
lives for the length of that forward (as a recompute's does), and the forward records it (the
speed of a forward that keeps its graph). And on the first training step each recompute of a
non-last stage is compared bitwise with what its forward sent (``_verify``): a kernel whose result
still depends on something else (call count, unkeyed randomness) raises
:class:`~varuna.runtime.determinism.DeterminismError` naming the boundary, instead of letting every
layout train different weights.

Note [One loss sync per step]: on a GPU, reading a tensor's value on the host (``float(loss)``)
waits until the device has run everything queued before it, and the host queues nothing new in
the meantime: the device then idles while the host prepares the next task. The sink stage keeps
each micro-batch's loss as a device tensor and reads them all with one copy when its tasks are done
(or when a no-flush window's update needs them), so a step has one such sync where it had one per
micro-batch. The sum is taken in the same order as before, so the reported loss is unchanged.

Note [Devices of a step's data]: the user's batch usually lives in host memory; each micro-batch
is copied to the stage's device as its forward starts (``to_device``, asynchronous), and an
activation or gradient that a link delivered in host memory (the gloo transport of CUDA
tensors, varuna/runtime/comm.py) is copied to the device when it is taken from the inbox.

Example::

    executor = ScheduleExecutor(stage=stage_setup, config=cfg, links=links, inbox=inbox,
                                timeline=timeline, det=None)
    run = executor.run(batch, micro_plan[replica], step=1, scale=1.0, train=True)
    run.loss_sum, run.timings.fwd_s
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from varuna.core.batching import MicroBatch
from varuna.core.interleaved import forward_only_policy
from varuna.core.schedule import BACKWARD, FORWARD, RECOMPUTE, StagePolicy, Task, schedule_kind
from varuna.core.selective_recompute import recompute_blocks
from varuna.core.tasks import WEIGHT
from varuna.core.timeline import Timeline
from varuna.cutting.batches import call_with_batch, slice_batch, to_device
from varuna.cutting.cutpoint import CarryPlan, CarrySpec, CutPoint, ForwardRun, SplitState, StopForward
from varuna.cutting.split import keyed_seed
from varuna.runtime.comm import Arrival
from varuna.runtime.config import PRECISIONS, StepTimings, VarunaConfig
from varuna.runtime.determinism import DeterminismError, first_difference
from varuna.runtime.groups import StageLinks
from varuna.runtime.recompute_chain import backward_chain, forward_chain, leaf, recompute_chain
from varuna.runtime.split_backward import WeightWork, backward_input, backward_weight

__all__ = ["Feed", "StageModel", "ScheduleExecutor", "StageRun", "leaf"]


@dataclass(kw_only=True)
class StageModel:
    """The materialised model of one stage and what its forward needs to run."""

    model: nn.Module
    loss_fn: Callable
    split: SplitState
    cutpoints: list[CutPoint]
    """The model's CutPoints in segment order."""
    first_segment: int
    last_segment: int
    num_segments: int
    stage: int
    replica: int
    num_stages: int
    device: torch.device
    cutpoint_names: list[str] = field(default_factory=list)
    """The CutPoints' module names in segment order (for messages; may be empty)."""
    #: module outputs this stage receives and sends with its activations (Note [Carried values])
    carry_plan: CarryPlan | None = None
    #: interleaved kinds: (first, last) segment of each model chunk this process holds (chunk c is
    #: virtual stage c·P + stage), and each chunk's carry plan; empty: one chunk, the fields above
    chunk_ranges: list[tuple[int, int]] = field(default_factory=list)
    chunk_carry: list[CarryPlan | None] = field(default_factory=list)
    #: selective recompute: the segments a recomputed micro-batch recomputes (None: all of them;
    #: Note [Selective recompute] in varuna/core/selective_recompute.py)
    recompute_segments: frozenset[int] | None = None
    #: every carried value of the model (Note [Carried values]): block boundaries carry them too
    carried: tuple[CarrySpec, ...] = ()

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def num_chunks(self) -> int:
        return max(1, len(self.chunk_ranges))

    def is_sink(self, chunk: int) -> bool:
        """Whether ``chunk`` is the pipeline's last virtual stage (it computes the loss)."""
        return chunk * self.num_stages + self.stage == self.num_stages * self.num_chunks - 1

    def is_source(self, chunk: int) -> bool:
        """Whether ``chunk`` is the pipeline's first virtual stage (it reads the data)."""
        return chunk == 0 and self.stage == 0

    def set_chunks(self, ranges: list[tuple[int, int]], carried) -> None:
        """Hold the model chunks of segment ``ranges`` (interleaved; one range: nothing to do),
        with their carry plans."""
        self.carried = tuple(carried or ())
        if len(ranges) < 2:
            return
        self.chunk_ranges = list(ranges)
        self.chunk_carry = [
            CarryPlan.for_stage(carried, a, b, self.is_sink(c)) for c, (a, b) in enumerate(ranges)
        ]

    def blocks(self, chunk: int) -> list[Block] | None:
        """The blocks a recomputed micro-batch of ``chunk`` runs as (Note [Selective recompute]);
        None when it recomputes the chunk whole (no set, or the set covers the chunk)."""
        cache = self.__dict__.setdefault("_blocks", {})
        if chunk not in cache:
            first, last, _ = self.segments_of(chunk)
            parts = recompute_blocks(first, last, self.recompute_segments)
            sink = self.is_sink(chunk)
            cache[chunk] = None if parts == [(first, last, True)] else [
                Block(a, b, CarryPlan.for_stage(self.carried, a, b, sink and b == last), rec,
                      sink and b == last)
                for a, b, rec in parts
            ]
        return cache[chunk]

    def segments_of(self, chunk: int) -> tuple[int, int, CarryPlan | None]:
        """(first segment, last segment, carry plan) of ``chunk``."""
        if not self.chunk_ranges:
            return self.first_segment, self.last_segment, self.carry_plan
        first, last = self.chunk_ranges[chunk]
        return first, last, self.chunk_carry[chunk]


@dataclass(frozen=True)
class Block:
    """Segments [first, last] of a stage run as one sub-forward (Note [Selective recompute])."""

    first: int
    last: int
    carry: CarryPlan | None
    recompute: bool
    sink: bool
    """Whether the block ends the pipeline's last virtual stage (its output is the loss)."""


@dataclass
class StageRun:
    """What running one mini-batch through the stage produced."""

    loss_sum: float
    """Sum over this replica's micro-batches of loss × size / M_total (last stage; else 0)."""
    executed: list
    """The tasks in the order they ran (``ChunkTask`` for the interleaved kinds)."""
    timings: StepTimings


@dataclass
class _Work:
    """Per-step state of the loop: what arrived, what waits for its backward, the loss so far.
    Keyed by (micro-batch, chunk); the chunk is 0 unless the kind is interleaved."""

    acts: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)
    grads: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)
    stash: dict[tuple[int, int], tuple[torch.Tensor, ...] | None] = field(default_factory=dict)
    graphs: dict[tuple[int, int], tuple] = field(default_factory=dict)
    #: what the forward sent, per micro-batch, while its recompute is still to be verified
    sent: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)
    #: backwards run per micro-batch (deterministic mode captures after the last chunk's)
    bwd_done: dict[int, int] = field(default_factory=dict)
    #: zero-bubble kinds: what each micro-batch's W needs, from its B (varuna/runtime/split_backward.py)
    weight: dict[tuple[int, int], WeightWork] = field(default_factory=dict)
    #: the sink's losses still on the device, in execution order: (global micro-batch, its
    #: examples, 0-dim tensor); read all at once (Note [One loss sync per step])
    pending_losses: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    #: M_total: a loss counts size / M_total of the mini-batch's
    global_batch: int = 1
    #: deterministic mode (``DeterministicGrads``): its per-micro-batch ``losses`` are filled on
    #: read (its dict, not a copy of the reference: a no-flush window starts a new one per update)
    det: Any = None
    _loss_sum: float = 0.0
    #: selective recompute (varuna/runtime/recompute_chain.py): per micro-batch its blocks'
    #: [inputs, out] (None until a recomputed block's R), recomputed blocks' stashed inputs and,
    #: while to be verified, their forward's outputs, keyed (micro-batch key, block)
    chains: dict[tuple[int, int], list] = field(default_factory=dict)
    chain_stash: dict = field(default_factory=dict)
    chain_sent: dict = field(default_factory=dict)
    busy_s: dict[str, float] = field(
        default_factory=lambda: {FORWARD: 0.0, RECOMPUTE: 0.0, BACKWARD: 0.0, WEIGHT: 0.0}
    )
    count: dict[str, int] = field(default_factory=lambda: {FORWARD: 0, RECOMPUTE: 0, BACKWARD: 0, WEIGHT: 0})

    @property
    def loss_sum(self) -> float:
        """Sum over the micro-batches run so far of loss × size / M_total (the sink; else 0)."""
        self.read_losses()
        return self._loss_sum

    @loss_sum.setter
    def loss_sum(self, value: float) -> None:
        self.read_losses()
        self._loss_sum = value

    def read_losses(self) -> None:
        """Bring the pending losses to the host with one copy (a sync point on GPU) and add them
        up in execution order (the order the float sum always had)."""
        if not self.pending_losses:
            return
        values = torch.stack([t.float().reshape(()) for _, _, t in self.pending_losses]).tolist()
        for (index, size, _), v in zip(self.pending_losses, values):
            self._loss_sum += v * size / self.global_batch  # the expression of one read per loss
            if self.det is not None:
                self.det.losses[index] = v
        self.pending_losses.clear()

    def timings(self) -> StepTimings:
        def mean(op: str) -> float:
            return self.busy_s[op] / self.count[op] if self.count[op] else 0.0

        return StepTimings(
            fwd_s=mean(FORWARD),
            # A split backward's B and W together are the backward (what calibration measures).
            bwd_s=mean(BACKWARD) + (self.busy_s[WEIGHT] / max(1, self.count[BACKWARD])),
            recompute_s=mean(RECOMPUTE),
            num_forwards=self.count[FORWARD],
        )


class Feed:
    """Where task index i's data lives: one mini-batch here (``i`` is its micro-batch); a no-flush
    window's feed (varuna/runtime/no_flush.py) maps the window's indices to several mini-batches
    and steps, and hooks every task (weight version) and every backward (the per-step update)."""

    def __init__(self, batch, mbs: list[MicroBatch], step: int) -> None:
        self.batch, self.mbs, self.step = batch, mbs, step

    def locate(self, i: int) -> tuple[object, MicroBatch, int, int]:
        """(mini-batch, micro-batch, step, timeline tag) of task index ``i``."""
        mb = self.mbs[i]
        return self.batch, mb, self.step, mb.index

    def before(self, task: Task) -> None:
        """Called before ``task`` runs."""

    def after_backward(self, task: Task, work: _Work) -> None:
        """Called after a backward ran (and sent its gradient)."""


class ScheduleExecutor:
    """Runs the schedule of one stage (one per engine; see the module docstring)."""

    def __init__(
        self,
        *,
        stage: StageModel,
        config: VarunaConfig,
        links: StageLinks,
        inbox: queue.Queue,
        timeline: Timeline,
        det=None,
        stats=None,
    ) -> None:
        self.s = stage
        #: BatchNorm running statistics recorded per micro-batch (Note [Buffers across replicas])
        self.stats = stats
        self.config = config
        self.links = links
        self.inbox = inbox
        self.timeline = timeline
        self.det = det
        self._step = 0
        self._scale = 1.0
        # Note [Deterministic forward]: the first training step checks sends against recomputes.
        # Not with unkeyed dropout (a negative control), whose recompute redraws other masks.
        self._verify = config.determinism.enabled and config._negative_controls.rng_keyed
        #: zero-bubble kinds: B computes the input gradient only, W the weight gradients later
        self._split = schedule_kind(config.schedule).splits_backward

    def run(self, batch, mbs: list[MicroBatch], *, step: int, scale: float, train: bool) -> StageRun:
        """Run this replica's micro-batches ``mbs`` of ``batch`` (forward only unless ``train``)."""
        P, k, n, v = self.s.num_stages, self.s.stage, len(mbs), self.s.num_chunks
        self._step, self._scale = step, scale
        if train:
            kind = schedule_kind(self.config.schedule)
            pipe = kind.pipeline(P, n, recompute=self.config.pipeline.recompute, chunks=v)
            policy = pipe.policy(k, stash_headroom=self.config.pipeline.stash_headroom)
            rec = pipe.recomputed(k)
            recomputed = frozenset(rec) if v > 1 else frozenset((i, 0) for i in rec)
        elif v > 1:
            policy = forward_only_policy(P, n, v, k)
            recomputed = frozenset((i, c) for i in range(n) for c in range(v))
        else:
            policy = StagePolicy([Task(FORWARD, i) for i in range(n)], k, P, opportunistic=False)
            recomputed = frozenset((i, 0) for i in range(n))  # forward-only: never keep a graph
        self.links.begin_step(n, train=train)
        work = self._forked(Feed(batch, mbs, step), policy, recomputed, train)
        if train:
            self._verify = False  # one step's recomputes checked
        return StageRun(loss_sum=work.loss_sum, executed=list(policy.executed), timings=work.timings())

    def run_window(self, feed: Feed, num_microbatches: int, steps: int, *, scale: float) -> StageRun:
        """Train ``steps`` mini-batches of ``num_microbatches`` each back to back as one task list
        (``schedule_kind(...).window``: 2bw without a flush, Note [2BW] in varuna/core/schedule.py);
        ``feed`` maps the window's task indices to mini-batches and updates the weights."""
        P, k = self.s.num_stages, self.s.stage
        self._scale = scale
        pipe = schedule_kind(self.config.schedule).window(
            P, num_microbatches, steps, recompute=self.config.pipeline.recompute
        )
        policy = pipe.policy(k, stash_headroom=self.config.pipeline.stash_headroom)
        recomputed = frozenset((i, 0) for i in pipe.recomputed(k))
        self.links.begin_step(num_microbatches * steps, train=True)
        work = self._forked(feed, policy, recomputed, True)
        self._verify = False
        return StageRun(loss_sum=work.loss_sum, executed=list(policy.executed), timings=work.timings())

    def _forked(self, feed: Feed, policy, recomputed: frozenset[tuple[int, int]], train: bool) -> _Work:
        # Dropout draws are keyed by work (Note [Step]); the user's RNG stream is restored after.
        devices = [self.s.device] if self.s.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            return self._execute(feed, policy, recomputed, train)

    def _execute(self, feed: Feed, policy, recomputed: frozenset[tuple[int, int]], train: bool) -> _Work:
        work = _Work(det=self.det, global_batch=self.config.global_batch_size)
        timeout = self.config.timeouts.comm_s
        record = self.config.metrics.record_timeline
        v = self.s.num_chunks
        while not policy.finished:
            self._drain(policy, work, block=False, timeout=timeout)
            task = policy.next_task()
            if task is None:
                self._drain(policy, work, block=True, timeout=timeout)
                continue
            feed.before(task)
            t0 = time.perf_counter()
            i, c = task.microbatch, getattr(task, "chunk", 0)
            batch, mb, self._step, tag = feed.locate(i)
            key = (i, c)
            if task.op == FORWARD:
                keep = train and key not in recomputed
                self._run_forward(work, batch, mb, key, keep_graph=keep, train=train)
            elif task.op == RECOMPUTE:
                self._run_recompute(work, batch, mb, key)
            elif task.op == BACKWARD:
                self._run_backward(work, mb, key, train=train)
            else:
                backward_weight(work.weight.pop(key))
                if self.det is not None:
                    self.det.capture(mb.index)
            policy.complete(task)
            t1 = time.perf_counter()
            work.busy_s[task.op] += t1 - t0
            work.count[task.op] += 1
            if record:  # interleaved: the event's micro-batch is tagged index·v + chunk
                self.timeline.add(self.s.stage, self.s.replica, task.op, tag * v + c, t0, t1)
            if task.op == BACKWARD:
                feed.after_backward(task, work)
        work.read_losses()
        return work

    def _run_recompute(self, work: _Work, batch, mb: MicroBatch, key: tuple[int, int]) -> None:
        if key in work.chains:  # Note [Selective recompute]
            recompute_chain(self, work, batch, mb, key)
            return
        inputs = work.stash.pop(key)
        if inputs is not None:
            inputs = tuple(leaf(x) for x in inputs)
        out = self._forward(batch, mb, inputs, with_grad=True, chunk=key[1])
        sent = work.sent.pop(key, None)
        if sent is not None:
            self._check_recompute(mb, sent, out, key[1])
        work.graphs[key] = (inputs, out)

    def _run_forward(
        self, work: _Work, batch, mb: MicroBatch, key: tuple[int, int], *, keep_graph: bool, train: bool
    ) -> None:
        i, c = key
        received = work.acts.pop(key, None)
        # Note [Selective recompute]: a recomputed micro-batch of a stage with a recompute set.
        blocks = self.s.blocks(c) if train and not keep_graph else None
        if blocks is not None:
            out = forward_chain(self, work, batch, mb, key, received, blocks)
        else:
            # Note [Deterministic forward]: with the autograd state of the recompute and of a 1×1 run.
            with_grad = keep_graph or (train and self.config.determinism.enabled)
            inputs = received
            if inputs is not None and with_grad:
                inputs = tuple(leaf(x) for x in inputs)
            out = self._forward(batch, mb, inputs, with_grad=with_grad, chunk=c)
        if self.s.is_sink(c):
            # Note [One loss sync per step]: float(loss) here would stop the host until the device
            # caught up, once per micro-batch; the losses are read together at the end instead.
            work.pending_losses.append((mb.index, mb.size, out.detach()))
        else:
            sent = tuple(x.detach() for x in out)
            # The receiving chunk: the same one on the next process, the next one past the last.
            to = c if self.s.stage < self.s.num_stages - 1 else c + 1
            self.links.act_out.send(i * self.s.num_chunks + to, sent)
            if train and not keep_graph and self._verify and blocks is None:
                work.sent[key] = sent
        if blocks is not None:
            return
        if keep_graph:
            work.graphs[key] = (inputs, out)
        elif train:
            work.stash[key] = received  # not the leaves: no reference to the graph being dropped

    def _run_backward(self, work: _Work, mb: MicroBatch, key: tuple[int, int], *, train: bool) -> None:
        i, c = key
        if key in work.chains:  # Note [Selective recompute]
            scale = mb.size / self.config.global_batch_size * self._scale
            self._after_backward(work, mb, key, backward_chain(self, work, mb, key, scale), train=train)
            return
        inputs, out = work.graphs.pop(key)
        if self.s.is_sink(c):
            pairs = [(out * (mb.size / self.config.global_batch_size * self._scale), None)]
        else:
            g = work.grads.pop(key)
            # Gradients come back for the floating-point tensors only (an integer mask may cross too).
            floats = [o for o in out if o.is_floating_point()]
            pairs = [(o, gi) for o, gi in zip(floats, g) if o.requires_grad]
        if self._split and train:
            self._split_backward(work, key, inputs, pairs)
            return
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [gi for _, gi in pairs])
        upstream = None if self.s.is_source(c) else tuple(
            (x.grad if x.grad is not None else torch.zeros_like(x)) for x in inputs if x.is_floating_point()
        )
        self._after_backward(work, mb, key, upstream, train=train)

    def _after_backward(
        self, work: _Work, mb: MicroBatch, key: tuple[int, int], upstream, *, train: bool
    ) -> None:
        """Capture the micro-batch's gradients (deterministic mode) and send ``upstream``, the
        gradients of the stage's input, to the previous stage."""
        i, c = key
        v = self.s.num_chunks
        if self.det is not None and train:
            # Each chunk's backward fills its own parameters' gradients (a shared one: per-segment
            # aliases), so the micro-batch's row is the sum of disjoint parts (exact).
            work.bwd_done[i] = work.bwd_done.get(i, 0) + 1
            self.det.capture(mb.index, last=work.bwd_done[i] == v)
        if not self.s.is_source(c):
            to = c if self.s.stage > 0 else c - 1
            self.links.grad_out.send(i * v + to, upstream)

    def _split_backward(self, work: _Work, key: tuple[int, int], inputs, pairs: list) -> None:
        """B of a zero-bubble kind: send the input gradient now, keep what W needs (W runs later)."""
        i, c = key
        leaves = [x for x in (inputs or ()) if x.is_floating_point()]
        wanted = [x for x in leaves if x.requires_grad]
        got, work.weight[key] = backward_input([o for o, _ in pairs], [g for _, g in pairs], wanted)
        by_leaf = dict(zip(map(id, wanted), got))
        if not self.s.is_source(c):
            to = c if self.s.stage > 0 else c - 1
            self.links.grad_out.send(
                i * self.s.num_chunks + to,
                tuple(g if (g := by_leaf.get(id(x))) is not None else torch.zeros_like(x) for x in leaves),
            )

    def _check_recompute(
        self, mb: MicroBatch, sent: tuple[torch.Tensor, ...], out, chunk: int = 0,
        segments: tuple[int, int] | None = None,
    ) -> None:
        """Note [Deterministic forward]: the recompute must reproduce what the forward sent (or
        what a recomputed block, ``segments``, handed to the next one)."""
        diff = first_difference(sent, tuple(x.detach() for x in out))
        if diff is None:
            return
        s = self.s
        first, last = segments if segments is not None else s.segments_of(chunk)[:2]
        names = s.cutpoint_names
        where = f"CutPoint '{names[last]}'" if last < len(names) else f"CutPoint #{last}"
        raise DeterminismError(
            f"varuna: deterministic mode: stage {s.stage} (segments {first}-{last}) "
            f"sent micro-batch {mb.index}'s activation at {where} (boundary to stage {s.stage + 1}, {diff}) "
            "that its recompute does not reproduce bitwise: something in these segments gives another "
            "result when the same micro-batch runs again (state kept between calls, randomness outside "
            "torch's default generator, a kernel choosing its algorithm by run-time state), so weights "
            "would differ between layouts (docs/determinism.md)"
        )

    def _drain(self, policy, work: _Work, *, block: bool, timeout: float) -> None:
        while True:
            try:
                item = self.inbox.get(timeout=timeout) if block else self.inbox.get_nowait()
            except queue.Empty:
                if block:
                    raise TimeoutError(
                        f"stage {self.s.stage} replica {self.s.replica} waited {timeout:.0f}s for an "
                        "activation or "
                        "gradient; a peer process is stuck or gone (raise VarunaConfig.comm_timeout_s if "
                        "steps are legitimately this slow)"
                    ) from None
                return
            if isinstance(item, Exception):
                raise RuntimeError(f"communication thread failed: {item}") from item
            assert isinstance(item, Arrival)
            v = self.s.num_chunks
            i, c = divmod(item.microbatch, v)  # the sender tags micro-batch·v + receiving chunk
            tensors = item.tensors
            if any(t.device != self.s.device for t in tensors):  # Note [Devices of a step's data]
                tensors = tuple(t.to(self.s.device, non_blocking=True) for t in tensors)
            elif self.s.device.type == "cuda":
                for t in tensors:  # Note [Receiver streams] in comm.py
                    t.record_stream(torch.cuda.current_stream(t.device))
            (work.acts if item.kind == FORWARD else work.grads)[(i, c)] = tensors
            if v > 1:
                policy.arrived(item.kind, i, c)
            else:
                policy.arrived(item.kind, i)
            block = False

    # ------------------------------------------------------------------ the forward of one micro-batch

    def _reseed(self, microbatch: int) -> Callable[[int], None]:
        seed, step = self.config.seed, self._step
        # Seed only the generators this process draws from: torch.manual_seed would also queue
        # lazy seeding of every accelerator backend (with a captured stack), per segment.
        gens = [torch.default_generator]
        if self.s.device.type == "cuda":
            gens.append(torch.cuda.default_generators[self.s.device.index or 0])

        if not self.config._negative_controls.rng_keyed:  # negative control: draws depend on history
            return lambda segment: None

        def reseed(segment: int) -> None:
            s = keyed_seed(seed, step, microbatch, segment)
            for g in gens:
                g.manual_seed(s)

        return reseed

    def _autocast(self):
        dt = PRECISIONS[self.config.precision]
        if dt is None:
            return contextlib.nullcontext()
        return torch.autocast(self.s.device.type, dtype=dt)

    def _forward(
        self, batch, mb: MicroBatch, inputs, with_grad: bool, chunk: int = 0, block: Block | None = None
    ):
        """Run the user's forward for this stage (its model chunk ``chunk``; only its segments of
        ``block``); returns the loss (last virtual stage) or outputs."""
        s = self.s
        if block is None:
            first, last, carry = s.segments_of(chunk)
            sink = s.is_sink(chunk)
        else:
            first, last, carry, sink = block.first, block.last, block.carry, block.sink
        data = to_device(slice_batch(batch, mb.start, mb.end), s.device)  # Note [Devices of a step's data]
        reseed = self._reseed(mb.index)
        on_segment = reseed
        if self.det is not None and self.det.aliases:
            det = self.det

            def on_segment(segment: int) -> None:
                reseed(segment)
                det.on_segment(segment)

        run = ForwardRun(
            cutpoints=s.cutpoints,
            first_segment=first,
            last_segment=last if not sink else len(s.cutpoints),
            num_segments=s.num_segments,
            inputs=inputs,
            on_segment=on_segment,
            carry_plan=carry,
        )
        s.split.run = run
        if self.stats is not None:
            self.stats.current = (self._step, mb.index)
        try:
            with torch.set_grad_enabled(with_grad), self._autocast():
                on_segment(0)
                try:
                    out = call_with_batch(s.model, data)
                except StopForward as stop:
                    return stop.outputs
                if not sink:
                    raise RuntimeError(
                        f"stage {s.stage}'s forward returned without reaching CutPoint "
                        f"#{last}; "
                        "the forward must pass every CutPoint on every call"
                    )
                return s.loss_fn(out, data)
        finally:
            s.split.run = None
            if self.stats is not None:
                self.stats.current = None
            if self.det is not None:
                self.det.restore()
