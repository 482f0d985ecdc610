"""PipeDream-2BW without a pipeline flush: several mini-batches as one task list on each stage
(``Engine.train_steps``; Note [2BW] in varuna/core/schedule.py).

Note [No-flush window]: the stage runs ``schedule_kind("2bw").window(P, Nm, n)``, 1F1B over the
n mini-batches' micro-batches back to back (window index s·Nm + i is micro-batch i of the s-th),
so mini-batch t+1's forwards start on a stage while mini-batch t's backwards drain. Right after
its own last backward of t, the stage (and only it: no barrier across stages) sums t's gradients
over its replicas (and over the copies of a tied weight, which makes the stages holding one wait
for each other), steps its optimizer and goes on. With Nm >= P a stage never holds more than two
mini-batches, t on W(t-2) and t+1 on W(t-1): :meth:`WeightVersions.select` swaps the two versions'
contents before each task as needed, and :meth:`WeightVersions.advance` then the optimizer write
W(t) into the buffer of W(t-2). The swap is in place, so no autograd graph may span one: the
window recomputes (an R, or the last stage's F, is directly followed by its B).

What needs every stage to agree before an update cannot be had without a barrier per step, so:
the end-of-step agreement (loss, global gradient norm, overflow, stop request) is an all-reduce
that is started per step and only waited for at the end of the window; a non-finite gradient
skips the update of the stages that see one (every replica of a stage sees the same sums) and of
the stages holding a copy of a tied weight with them (or its copies would part), not of every
stage; clipping by the global norm (``max_grad_norm``) and fp16 loss scaling are
refused. The window ends drained: after ``train_steps`` returns, the state is a step boundary
like after ``train_step`` (both versions as ``train_step`` leaves them), so checkpoints,
``evaluate`` and ``close`` see a clean boundary; ``train_steps`` also ends a window at every
periodic checkpoint step and after at most :data:`MAX_WINDOW_STEPS` mini-batches, so a stop
request (SIGTERM, a preemption notice), which is acted on when a window ends, waits at most that
many steps, and step callbacks (a learning-rate schedule, say) run in bursts of at most that many.

Example (every rank)::

    results = engine.train_steps([batch_of(t) for t in range(1, 9)])   # 8 steps, no flush between
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from varuna.core.schedule import BACKWARD, Task
from varuna.runtime.config import StepResult, VarunaConfig
from varuna.runtime.executor import Feed, StageRun
from varuna.runtime.flops import step_metrics

__all__ = ["MAX_WINDOW_STEPS", "StepEnd", "WindowFeed", "no_flush_unsupported"]

#: The longest no-flush window: one drain per this many mini-batches (1/8 of the fill-and-drain
#: of a flush per step) bounds how long a stop request or a step callback waits.
MAX_WINDOW_STEPS = 8


def no_flush_unsupported(config: VarunaConfig, num_stages: int) -> str | None:
    """Why ``config`` cannot train 2bw mini-batches without a flush (one line), or None.

    >>> no_flush_unsupported(VarunaConfig(global_batch_size=4, micro_batch_size=1, schedule="2bw",
    ...                                   max_grad_norm=1.0), 2)  # doctest: +ELLIPSIS
    'train_steps without a flush cannot clip by the global gradient norm ...'
    """
    if config.max_grad_norm is not None:
        return ("train_steps without a flush cannot clip by the global gradient norm (max_grad_norm): each "
                "stage updates before the others finish the step; unset max_grad_norm or use train_step")
    if config.precision == "fp16":
        return ("train_steps without a flush cannot use fp16 loss scaling: skipping a step needs every "
                "stage's agreement before any updates; use precision='bf16' or 'fp32', or train_step")
    if num_stages > 1 and config.pipeline.recompute is False:  # None: the default, on
        return ("train_steps without a flush needs pipeline.recompute=True at P > 1: the weight versions are "
                "swapped in place between tasks, so no graph may live from a forward to a later backward")
    return None


@dataclass
class StepEnd:
    """What one mini-batch's end did on this stage; the agreement is read at the window's end."""

    step: int
    slots: torch.Tensor
    handle: object | None
    end_s: float
    sync_s: float


class WindowFeed(Feed):
    """The no-flush window's feed (Note [No-flush window]): maps window indices to mini-batches,
    selects each task's weight version and updates the stage after its last backward of each
    mini-batch. ``engine``: the :class:`~varuna.runtime.engine.Engine` (its sync, optimizer,
    weight versions)."""

    def __init__(self, engine, batches: list, first_step: int) -> None:
        self.e = engine
        self.batches, self.first_step = batches, first_step
        self.mbs = engine.micro_plan[engine.replica]
        self.nm = len(self.mbs)
        self.total = sum(len(p) for p in engine.micro_plan)
        self.oldest = 0  # the window's oldest mini-batch not yet updated on this stage
        self.done = [0] * len(batches)
        self.ends: list[StepEnd] = []

    def locate(self, i: int):
        s, j = divmod(i, self.nm)
        mb = self.mbs[j]
        return self.batches[s], mb, self.first_step + s, s * self.total + mb.index

    def before(self, task: Task) -> None:
        s = task.microbatch // self.nm
        if s > self.oldest + 1:  # the kind refuses Nm < P, which is what would get here
            raise RuntimeError(f"2bw window: mini-batch {s} started before {self.oldest} was updated")
        self.e.weight_versions.select(stale=s == self.oldest)

    def after_backward(self, task: Task, work) -> None:
        assert task.op == BACKWARD
        s = task.microbatch // self.nm
        self.done[s] += 1
        if self.done[s] == self.nm:
            self._update(s, work)

    def _update(self, s: int, work) -> None:
        """The end of mini-batch s on this stage: gradient sums, the agreement started, the update."""
        e, t0 = self.e, time.perf_counter()
        loss, work.loss_sum = work.loss_sum, 0.0  # the last stage ran no forward of s+1 yet
        e.weight_versions.advance()
        e._sync.reduce()
        sumsq, nonfinite = e._sync.local_norms()
        nonfinite = e._sync.shared_nonfinite(nonfinite)  # a tied weight's copies skip together
        slots = e._sync.agreement_slots(sumsq, nonfinite, loss, e.stop_requested)
        handle = dist.all_reduce(slots, async_op=True) if e.layout.world > 1 else None
        t_opt = time.perf_counter()
        pending = e.extras.before_commit(self.first_step + s)  # Note [Buffers across replicas]
        if nonfinite == 0:
            e.optimizer.step()
        e.optimizer.zero_grad(set_to_none=True)
        e.extras.after_commit(pending, skipped=nonfinite != 0, loss=None)  # not agreed yet
        end = time.perf_counter()
        if e.config.metrics.record_timeline:
            e.timeline.add(e.stage, e.replica, "OPT", None, t_opt, end)
        e.step_count += 1
        self.oldest = s + 1
        if e._det is not None and s + 1 < len(self.batches):
            e._det.begin_step(self.mbs, self.total)
        self.ends.append(StepEnd(self.first_step + s, slots, handle, end, end - t0))

    def agreed(self) -> list[tuple[float, bool, float, bool]]:
        """Per mini-batch, (sum of squared gradients, overflow, loss, stop) agreed by every rank."""
        out = []
        timeout = timedelta(seconds=self.e.config.timeouts.comm_s)
        for end in self.ends:
            if end.handle is not None:
                end.handle.wait(timeout)
            out.append(self.e._sync.read_agreement(end.slots.tolist(), self.e.micro_plan))
        return out

    def results(self, run: StageRun, t_start: float) -> tuple[list[StepResult], bool]:
        """The window's :class:`StepResult`\\ s (every rank the same agreed values; ``step_s``:
        from the previous mini-batch's end on this stage) and whether a stop was requested."""
        out, stop, prev = [], False, t_start
        M = self.e.config.global_batch_size
        for end, (total_sq, overflow, loss, stop_s) in zip(self.ends, self.agreed()):
            stop = stop or stop_s
            skipped = overflow or not math.isfinite(loss)  # overflow: some stage skipped its update
            wall = end.end_s - prev
            prev = end.end_s
            timings = dataclasses.replace(run.timings, sync_s=end.sync_s)
            out.append(StepResult(
                step=end.step, loss=loss, grad_norm=math.inf if skipped else math.sqrt(total_sq),
                skipped=skipped, loss_scale=1.0, samples_per_s=M / wall if wall > 0 else math.inf,
                wall_time=time.time() - (time.perf_counter() - end.end_s), timings=timings, step_s=wall,
                **step_metrics(getattr(self.e, "flops", None), wall),
            ))
        return out, stop
