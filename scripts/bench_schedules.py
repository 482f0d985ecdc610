#!/usr/bin/env python
"""Pipeline schedules under network jitter: this project's engine against torch.distributed.pipelining.

Same model, same conditions for both systems (see docs/benchmarks.md for the method and results):

- **emulated devices**: P stages of ``varuna.testing.EmulatedBlock`` (forward sleeps F = 10 ms,
  backward B = 20 ms, recompute R = F), one process per stage, D = 1, Nm = 16 micro-batches of
  m = 4 examples (M = 64); torch's interleaved schedule gets 2 chunks per rank of F/2 each, so
  every rank does the same work;
- **network** (``varuna.testing.netem``; ``$VARUNA_NETEM`` for the engine, ``emulate_network`` around torch's
  schedule): none; moderate = latency 1 ms + Exp(mean 2 ms); heavy = 2 ms + Exp(mean 10 ms) per
  message;
- **schedules**: ours ``varuna`` / ``gpipe`` / ``1f1b`` (``varuna.Engine``), torch's ``ScheduleGPipe``,
  ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, each with activation checkpointing on its stages
  (``torch.utils.checkpoint`` around the stage module, non-reentrant; rows ``+ckpt``) and without.
  Ours: ``gpipe``/``1f1b`` with recompute (``+R``) and without; ``varuna`` always recomputes (not
  on its last stage).
- **real compute**: the GPT of examples/gpt2 at P = 2 on both systems (same split, same init).

Every timed step runs between two barriers, so its time is the whole mini-batch on every stage
(the optimizer step included); throughput is M / median step time. Peak stashed activations are
counted from the order in which each stage really ran its tasks (the engine's timeline for ours;
for torch, ``PipelineStage.forward_one_chunk``/``backward_one_chunk`` and the checkpoint's recompute
timed per micro-batch on each rank). Two numbers per stage: *inputs* (micro-batches whose stage
input is held: forward started, backward not finished) and *graphs* (micro-batches whose full
activations are held: a forward without recompute, or a recompute, started and its backward not
finished), in units of one stage's activations (an interleaved chunk counts 1/2 of a graph).

Usage::

    python scripts/bench_schedules.py                         # P=4 (3 levels) + GPT P=2, 5-8 min
    python scripts/bench_schedules.py --p8                    # also P=8
    python scripts/bench_schedules.py --json runs/bench.json --plot docs/img/bench_schedules_p4.png \\
        --timelines runs/timelines
    python scripts/bench_schedules.py --from-json runs/bench.json   # reprint the tables

``--timelines DIR`` writes, per run, the Chrome trace (open in https://ui.perfetto.dev) and a Gantt
PNG of the median timed step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Network levels of the brief: name -> VARUNA_NETEM string (None: no emulation).
LEVELS: dict[str, str | None] = {
    "none": None,
    "moderate": "latency=1ms,jitter=2ms,seed=1",
    "heavy": "latency=2ms,jitter=10ms,seed=1",
}
#: Goals for the ``varuna`` schedule (issue 10): ratio to the best torch schedule with
#: recompute, and fraction of the ideal with-recompute time.
GOAL_VS_TORCH = {"none": 1.05, "moderate": 1.05, "heavy": 1.15}
GOAL_VS_IDEAL = {"none": 0.93, "moderate": 0.88, "heavy": 0.80}

_TORCH_CLASS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One (system, schedule, recompute, network level, model) configuration."""

    system: str
    """``ours`` (varuna.Engine) or ``torch`` (torch.distributed.pipelining)."""
    schedule: str
    """Ours: varuna, gpipe, 1f1b. Torch: gpipe, 1f1b, interleaved."""
    recompute: bool
    """Ours: the engine's recompute flag; torch: torch.utils.checkpoint around each stage module."""
    level: str
    """Key of LEVELS."""
    model: str = "emulated"
    """``emulated`` (EmulatedBlock stages) or ``gpt`` (examples/gpt2)."""
    chunks: int = 1
    """Model chunks per rank (torch interleaved: 2)."""

    @property
    def label(self) -> str:
        if self.system == "ours":
            name = f"ours {self.schedule}"
            return name + ("+R" if self.recompute and self.schedule != "varuna" else "")
        name = "torch " + _TORCH_CLASS[self.schedule].removeprefix("Schedule")
        if self.chunks > 1:
            name += f"(v={self.chunks})"
        return name + ("+ckpt" if self.recompute else "")

    @property
    def key(self) -> str:
        return f"{self.model}/{self.level}/{self.label}"


@dataclass(kw_only=True)
class WorldSpec:
    """What one set of worker processes runs (written to JSON for the workers)."""

    model: str
    """``emulated`` or ``gpt``."""
    num_stages: int
    """P (= world size: one rank per stage, D = 1)."""
    num_microbatches: int
    """Nm."""
    micro_batch_size: int
    """m."""
    fwd_s: float
    """F of one stage per micro-batch (emulated model; B = 2F, R = F)."""
    width: int
    """Activation width of the emulated blocks."""
    warmup: int
    """Untimed steps per run."""
    steps: int
    """Timed steps per run."""
    runs: list[dict]
    """RunSpec fields of every run, in execution order."""
    out_dir: str
    """Where each rank writes ``rank{r}.json`` (and its log)."""
    gpt: dict = field(default_factory=dict)
    """GPTConfig fields (gpt model)."""
    comm_timeout_s: float = 120.0
    """Every wait on another process gives up after this long."""


# ============================================================================================
# Analysis of recorded events (pure Python; also used by the smoke test)


def peak_held(events: Sequence[Sequence], chunks: int = 1) -> tuple[int, float]:
    """(peak inputs held, peak full activation sets held) along one rank's events of one step.

    ``events`` are ``(stage, op, microbatch, start_s, end_s)`` with op in F, R, B (others are
    ignored). A micro-batch's input is held from its F's start to its B's end; its full
    activations from the start of its F (when it has no R) or of its R, to its B's end. With
    several chunks per rank, each (chunk, micro-batch) counts one input and ``1/chunks`` graph.
    """
    compute = [e for e in events if e[1] in ("F", "R", "B") and e[2] is not None]
    recomputed = {(e[0], e[2]) for e in compute if e[1] == "R"}
    deltas: list[tuple[float, int, int, int]] = []  # (time, order, d_inputs, d_graphs)
    for stage, op, mb, start, end in compute:
        if op == "F":
            deltas.append((start, 1, 1, 0 if (stage, mb) in recomputed else 1))
        elif op == "R":
            deltas.append((start, 1, 0, 1))
        else:
            deltas.append((end, 0, -1, -1))  # frees before a task starting at the same instant
    inputs = graphs = peak_inputs = peak_graphs = 0
    for _, _, d_in, d_gr in sorted(deltas):
        inputs += d_in
        graphs += d_gr
        peak_inputs = max(peak_inputs, inputs)
        peak_graphs = max(peak_graphs, graphs)
    return peak_inputs, peak_graphs / chunks


def waiting_hops_s(timeline: dict, system: str) -> list[float]:
    """Delivery delays a waiting stage saw: for each activation or gradient whose receiver was idle
    when it was produced, (start of the task that consumed it) − (end of the task that produced it).

    ``timeline`` maps rank -> that rank's events of one step (``(stage, op, mb, start, end)``).
    Activations: F_i on stage s → F_i on s+1. Gradients: B_i on s+1 → the first task on s that
    needs it: B_i for the engine (its R runs before the gradient), R_i or B_i for torch (the
    checkpoint's recompute runs inside ``backward_one_chunk``, after the gradient arrived).
    The receiver counts as idle when its previous task ended before the producer's end. Without
    network emulation this is the runtime's own hand-off latency (threads, GIL, gloo).
    """
    where: dict[tuple[int, str, int], tuple[float, float]] = {}
    prev_end: dict[tuple[int, str, int], float] = {}
    for evs in timeline.values():
        compute = sorted((e for e in evs if e[1] in ("F", "R", "B") and e[2] is not None), key=lambda e: e[3])
        last = -float("inf")
        for stage, op, mb, start, end in compute:
            where[(stage, op, mb)] = (start, end)
            prev_end[(stage, op, mb)] = last
            last = end
    hops = []
    for (stage, op, mb), (_, end) in where.items():
        if op == "F" and (stage + 1, "F", mb) in where:
            consumer = (stage + 1, "F", mb)
        elif op == "B" and stage > 0:
            grad_ops = ("B",) if system == "ours" else ("R", "B")
            consumer = next(((stage - 1, o, mb) for o in grad_ops if (stage - 1, o, mb) in where), None)
        else:
            continue
        if consumer is not None and prev_end[consumer] < end:
            hops.append(where[consumer][0] - end)
    return hops


def busy_s(events: Sequence[Sequence]) -> float:
    """Time spent in F, R and B tasks."""
    return sum(e[4] - e[3] for e in events if e[1] in ("F", "R", "B"))


def task_medians_s(per_rank_steps: Sequence[Sequence[Sequence]], chunks: int = 1) -> dict[str, float]:
    """Median duration of F, R and B (per stage: a chunk's time × ``chunks``) over all events."""
    by_op: dict[str, list[float]] = {}
    for steps in per_rank_steps:
        for events in steps:
            for e in events:
                if e[1] in ("F", "R", "B"):
                    by_op.setdefault(e[1], []).append((e[4] - e[3]) * chunks)
    return {op: statistics.median(v) for op, v in by_op.items()}


def ideal_step_s(num_stages: int, num_microbatches: int, fwd_s: float) -> float:
    """The ideal with-recompute time Nm·(F+R+B) + (P−1)·(F+B), with R = F and B = 2F."""
    f, r, b = fwd_s, fwd_s, 2 * fwd_s
    return num_microbatches * (f + r + b) + (num_stages - 1) * (f + b)


# ============================================================================================
# Worker side (one process per rank; torch imported only here)


class _TorchRecorder:
    """Times torch pipelining's per-micro-batch work on one rank: F, R (checkpoint recompute) and B.

    ``forward_one_chunk``/``backward_one_chunk`` of each ``PipelineStage`` are wrapped on the
    instance; the recompute is the stage module's forward called while a backward is running.
    B is recorded from the end of its recompute (if any) to the end of ``backward_one_chunk``, so
    the F/R/B boxes never overlap, as in the engine's timeline.
    """

    def __init__(self) -> None:
        self.events: list[tuple[int, str, int, float, float]] = []
        self._in_backward: tuple[int, int] | None = None
        self._recompute_end: float | None = None

    def wrap_stage(self, stage: Any) -> None:
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
        index = stage.stage_index

        def forward_one_chunk(chunk_id, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fwd(chunk_id, *args, **kwargs)
            finally:
                self.events.append((index, "F", chunk_id, t0, time.perf_counter()))

        def backward_one_chunk(chunk_id, *args, **kwargs):
            t0 = time.perf_counter()
            self._in_backward, self._recompute_end = (index, chunk_id), None
            try:
                return bwd(chunk_id, *args, **kwargs)
            finally:
                start = self._recompute_end if self._recompute_end is not None else t0
                self.events.append((index, "B", chunk_id, start, time.perf_counter()))
                self._in_backward = None

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk

    def recompute_hooks(self, module: Any) -> None:
        """Record the forward of ``module`` run inside a backward (the checkpoint's recompute) as R."""
        state: dict[str, float] = {}

        def pre(_module, _args):
            if self._in_backward is not None:
                state["t0"] = time.perf_counter()

        def post(_module, _args, _out):
            if self._in_backward is not None and "t0" in state:
                end = time.perf_counter()
                stage, mb = self._in_backward
                self.events.append((stage, "R", mb, state.pop("t0"), end))
                self._recompute_end = end

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def _worker_main(spec_path: str) -> int:
    """One rank: run every configuration of the spec, write ``rank{r}.json``."""
    import torch
    import torch.distributed as dist

    spec = WorldSpec(**json.loads(Path(spec_path).read_text()))
    torch.set_num_threads(1)
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.comm_timeout_s))
    rank = dist.get_rank()
    if spec.model == "gpt" and spec.num_stages > 1:
        _TIED_GROUP[0] = dist.new_group([0, spec.num_stages - 1])  # every rank creates every group
    results = []
    try:
        for run in spec.runs:
            run_spec = RunSpec(**run)
            fn = _run_ours if run_spec.system == "ours" else _run_torch
            t0 = time.perf_counter()
            step_s, events = fn(spec, run_spec, rank)
            results.append({"run": run, "step_s": step_s, "events": events,
                            "wall_s": time.perf_counter() - t0})
            if rank == 0:
                med = statistics.median(step_s)
                print(f"[bench] P={spec.num_stages} {run_spec.key:<48} median step {med * 1e3:7.1f} ms "
                      f"({len(step_s)} steps, {time.perf_counter() - t0:.1f} s)", flush=True)
        Path(spec.out_dir, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "results": results}))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _batch(spec: WorldSpec) -> tuple:
    """The mini-batch every step uses: (x, target) of M examples."""
    import torch

    M = spec.num_microbatches * spec.micro_batch_size
    if spec.model == "gpt":
        sys.path.insert(0, str(ROOT / "examples" / "gpt2"))
        from data import ByteBatches

        return ByteBatches(spec.gpt["block_size"]).get("train", 0, M)
    g = torch.Generator().manual_seed(1)
    return torch.randn(M, spec.width, generator=g), torch.randn(M, spec.width, generator=g)


def _timed_steps(spec: WorldSpec, step: Callable[[], None], events: Callable[[], list]) -> tuple[list, list]:
    """Warm-up + timed steps, each between barriers; returns step times and each step's events."""
    import torch.distributed as dist

    times, per_step = [], []
    for s in range(spec.warmup + spec.steps):
        n0 = len(events())
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        t1 = time.perf_counter()
        if s >= spec.warmup:
            times.append(t1 - t0)
            per_step.append([list(e) for e in events()[n0:]])
    return times, per_step


def _gpt_config(spec: WorldSpec) -> Any:
    """examples/gpt2's GPTConfig from the spec (the example directory joins sys.path)."""
    sys.path.insert(0, str(ROOT / "examples" / "gpt2"))
    from model import GPTConfig

    return GPTConfig(**spec.gpt)


def _run_ours(spec: WorldSpec, run: RunSpec, rank: int) -> tuple[list, list]:
    """One configuration on varuna.Engine (one block, or the GPT's fixed split, per stage)."""
    import torch

    import varuna
    from varuna.testing.netem import NETEM_ENV_VAR

    P = spec.num_stages
    batch = _batch(spec)
    torch.manual_seed(0)
    if spec.model == "gpt":
        from model import GPT

        cfg = _gpt_config(spec)
        model = GPT(cfg)
        per = cfg.n_layer // P  # segments: 0 = embedding + block 0, i = block i, n_layer = head
        ranges = [(k * per, (k + 1) * per - 1) for k in range(P)]
        ranges[-1] = (ranges[-1][0], cfg.n_layer)
        optimizer = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    else:
        from varuna.testing.emulated import emulated_model

        model = emulated_model(P, spec.fwd_s, spec.width)
        ranges = [(k, k) for k in range(P)]
        optimizer = lambda ps: torch.optim.SGD(ps, lr=1e-3)  # noqa: E731
    netem = LEVELS[run.level]
    if netem:
        os.environ[NETEM_ENV_VAR] = netem  # the engine reads it at construction
    else:
        os.environ.pop(NETEM_ENV_VAR, None)
    try:
        engine = varuna.Engine(
            model,
            varuna.VarunaConfig(
                global_batch_size=spec.num_microbatches * spec.micro_batch_size,
                micro_batch_size=spec.micro_batch_size, pipeline_depth=P, data_parallel=1,
                schedule=run.schedule, recompute=run.recompute, stage_ranges=ranges,
                record_timeline=True, comm_timeout_s=spec.comm_timeout_s, stop_signals=(),
            ),
            example_batch=batch, optimizer=optimizer,
        )
    finally:
        os.environ.pop(NETEM_ENV_VAR, None)
    try:
        def events() -> list:
            return [(e.stage, e.op, e.microbatch, e.start_s, e.end_s) for e in engine.timeline.events]

        return _timed_steps(spec, lambda: engine.train_step(batch), events)
    finally:
        engine.close()


def _checkpointed(inner: Any) -> Any:
    """``inner`` under non-reentrant activation checkpointing (torch.utils.checkpoint).

    Early stop is off, so the recompute runs the whole forward of ``inner`` (as the engine's R
    does) and its end can be timed by a forward hook.
    """
    import torch
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            with set_checkpoint_early_stop(False):
                return checkpoint(self.inner, *args, use_reentrant=False)

    return Checkpointed(inner)


def _gpt_pieces(spec: WorldSpec, num_pieces: int) -> list[Any]:
    """The GPT cut into ``num_pieces`` sequential modules (embedding in the first, head in the last);
    the last holds its own copy of the tied embedding (gradients summed after each step)."""
    import torch
    import torch.nn.functional as F
    from model import GPT
    from torch import nn

    cfg = _gpt_config(spec)
    if cfg.n_layer % num_pieces:
        raise ValueError(f"--gpt-layers {cfg.n_layer} must be a multiple of the {num_pieces} pipeline pieces")
    torch.manual_seed(0)
    gpt = GPT(cfg)
    per = cfg.n_layer // num_pieces

    class Piece(nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.first, self.last = index == 0, index == num_pieces - 1
            if self.first:
                self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
            self.blocks = nn.ModuleList(gpt.blocks[index * per:(index + 1) * per])
            if self.last:
                self.ln_f = gpt.ln_f
                self.head = gpt.wte.weight if self.first else nn.Parameter(gpt.wte.weight.detach().clone())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.first:
                x = self.drop(self.wte(x) + self.wpe[:, : x.shape[1]])
            for block in self.blocks:
                x = block(x)
            if self.last:
                x = F.linear(self.ln_f(x), self.head)
            return x

    return [Piece(i) for i in range(num_pieces)]


def _run_torch(spec: WorldSpec, run: RunSpec, rank: int) -> tuple[list, list]:
    """One configuration on torch.distributed.pipelining, timed per micro-batch by _TorchRecorder."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining

    from varuna.testing.netem import emulate_network

    P, v = spec.num_stages, run.chunks
    S = P * v  # virtual stages; rank r holds stages r, r + P, ...
    x, y = _batch(spec)
    mine = [rank + c * P for c in range(v)]
    if spec.model == "gpt":
        pieces = _gpt_pieces(spec, S)
        modules = [pieces[s] for s in mine]
        vocab = spec.gpt["vocab_size"]

        def loss_fn(logits, target):
            return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

        make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    else:
        from varuna.testing.emulated import emulated_model

        torch.manual_seed(0)
        blocks = emulated_model(S, spec.fwd_s / v, spec.width).blocks
        modules = [blocks[s] for s in mine]
        loss_fn = F.mse_loss
        make_opt = lambda ps: torch.optim.SGD(ps, lr=1e-3)  # noqa: E731
    recorder = _TorchRecorder()
    for m in modules:
        recorder.recompute_hooks(m)
    wrapped = [_checkpointed(m) if run.recompute else m for m in modules]
    params = [p for m in wrapped for p in m.parameters()]
    optimizer = make_opt(params)
    # GPT: the tied embedding lives on the first virtual stage (rank 0) and the last (rank P-1);
    # its two gradients are summed after each step, as the engine does for shared parameters.
    tied = [] if spec.model != "gpt" else (
        [m.wte.weight for m in modules if m.first] + [m.head for m in modules if m.last and not m.first])
    with emulate_network(LEVELS[run.level]):
        stages = [pipelining.PipelineStage(m, s, S, torch.device("cpu")) for m, s in zip(wrapped, mine)]
        for st in stages:
            recorder.wrap_stage(st)
        n = spec.num_microbatches
        if run.schedule == "interleaved":
            schedule = pipelining.ScheduleInterleaved1F1B(stages, n, loss_fn=loss_fn)
        else:
            cls = pipelining.ScheduleGPipe if run.schedule == "gpipe" else pipelining.Schedule1F1B
            schedule = cls(stages[0], n, loss_fn=loss_fn)
        has_first, has_last = 0 in mine, S - 1 in mine

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            kwargs: dict[str, Any] = {"return_outputs": False}
            if has_last:
                kwargs["target"] = y
            schedule.step(*((x,) if has_first else ()), **kwargs)
            for t in tied:
                if t.grad is None:
                    t.grad = torch.zeros_like(t)
            if len(tied) == 2:
                total = tied[0].grad + tied[1].grad
                for t in tied:
                    t.grad.copy_(total)
            elif tied:
                dist.all_reduce(tied[0].grad, group=_TIED_GROUP[0])
            optimizer.step()

        return _timed_steps(spec, step, lambda: recorder.events)


#: The process group of ranks 0 and P-1 (holders of the GPT's tied embedding), made at start-up.
_TIED_GROUP: list[Any] = [None]


# ============================================================================================
# Launcher side


def run_world(spec: WorldSpec, timeout_s: float) -> list[dict]:
    """Start ``spec.num_stages`` worker processes, wait (bounded), return each rank's results."""
    from varuna.testing.emulated import run_local_world

    Path(spec.out_dir).mkdir(parents=True, exist_ok=True)
    spec_path = Path(spec.out_dir, "spec.json")
    spec_path.write_text(json.dumps(asdict(spec)))
    return run_local_world(__file__, ["--_worker", str(spec_path)], spec.num_stages, spec.out_dir, timeout_s,
                           what="benchmark")


def _order_runs(specs: list[RunSpec], rounds: int, only: Sequence[str] = ()) -> list[dict]:
    """Each round runs every configuration once; odd rounds in reverse order (drift hits all alike).

    ``only``: keep the configurations whose label contains one of these substrings (all if empty).
    """
    specs = [s for s in specs if not only or any(o in s.label for o in only)]
    out = []
    for r in range(rounds):
        seq = specs if r % 2 == 0 else list(reversed(specs))
        out += [{**asdict(s)} for s in seq]
    return out


def comparison_runs(levels: Sequence[str], *, with_no_recompute: bool = True) -> list[RunSpec]:
    """Every configuration of the comparison at ``levels`` (emulated model; GPT runs override it)."""
    def ours(schedules: Sequence[str], recompute: bool, level: str) -> list[RunSpec]:
        return [RunSpec(system="ours", schedule=s, recompute=recompute, level=level) for s in schedules]

    def torch_(recompute: bool, level: str) -> list[RunSpec]:
        return [RunSpec(system="torch", schedule=s, recompute=recompute, level=level,
                        chunks=2 if s == "interleaved" else 1) for s in ("gpipe", "1f1b", "interleaved")]

    specs = []
    for level in levels:
        specs += ours(("varuna", "gpipe", "1f1b"), True, level) + torch_(True, level)
        if with_no_recompute:
            specs += ours(("gpipe", "1f1b"), False, level) + torch_(False, level)
    return specs


def summarize(spec: WorldSpec, ranks: list[dict]) -> list[dict]:
    """One row per configuration: median step, samples/s, ratios, peaks, idle per stage."""
    M = spec.num_microbatches * spec.micro_batch_size
    by_key: dict[str, dict] = {}
    for rank_result in ranks:
        r = rank_result["rank"]
        for res in rank_result["results"]:
            run = RunSpec(**res["run"])
            row = by_key.setdefault(run.key, {"run": run, "step_s": [], "ranks": {}})
            if r == 0:
                row["step_s"] += res["step_s"]
            per = row["ranks"].setdefault(r, {"peaks": [], "busy": [], "events": [], "step_s": []})
            for evs, st in zip(res["events"], res["step_s"]):
                per["peaks"].append(peak_held(evs, run.chunks))
                per["busy"].append(busy_s(evs))
                per["events"].append(evs)
                per["step_s"].append(st)
    ideal = None
    if spec.model == "emulated":
        ideal = ideal_step_s(spec.num_stages, spec.num_microbatches, spec.fwd_s)
    rows = []
    for key, row in by_key.items():
        run: RunSpec = row["run"]
        med = statistics.median(row["step_s"])
        stages = sorted(row["ranks"])
        # The median timed step of rank 0 is the one whose timeline is kept.
        r0 = row["ranks"][0]
        order = sorted(range(len(r0["step_s"])), key=lambda i: r0["step_s"][i])
        mid = order[len(order) // 2]
        tasks = task_medians_s([row["ranks"][k]["events"] for k in stages], run.chunks)
        rows.append({
            "key": key, "label": run.label, "system": run.system, "schedule": run.schedule,
            "recompute": run.recompute, "chunks": run.chunks, "level": run.level, "model": run.model,
            "netem": LEVELS[run.level], "P": spec.num_stages, "Nm": spec.num_microbatches,
            "m": spec.micro_batch_size, "M": M,
            "step_s": row["step_s"], "median_step_s": med, "samples_per_s": M / med,
            "ideal_step_s": ideal, "of_ideal": (ideal / med) if ideal else None,
            "task_ms": {op: t * 1e3 for op, t in tasks.items()},
            "efficiency": _efficiency(spec, tasks, med),
            "peak_inputs": [max(p[0] for p in row["ranks"][k]["peaks"]) for k in stages],
            "peak_graphs": [max(p[1] for p in row["ranks"][k]["peaks"]) for k in stages],
            "idle_frac": [
                statistics.median(1 - b / t for b, t in zip(rk["busy"], rk["step_s"]))
                for rk in (row["ranks"][k] for k in stages)
            ],
            "hop_ms": _hop_stats([
                waiting_hops_s({k: row["ranks"][k]["events"][i] for k in stages}, run.system)
                for i in range(len(r0["step_s"]))
            ]),
            "timeline": {k: row["ranks"][k]["events"][mid] for k in stages},
        })
    return rows


def _efficiency(spec: WorldSpec, tasks: dict[str, float], step_s: float) -> float | None:
    """The row's own ideal at its measured task times, Nm·(F+R+B) + (P−1)·(F+B), over its step time.

    It factors out how long the tasks themselves took (sleep overshoot under load, per-task
    overheads), leaving how well the schedule and the communication keep the stages busy.
    """
    if spec.model != "emulated" or "F" not in tasks or "B" not in tasks:
        return None  # real models: stages differ in cost, the formula does not apply
    f, r, b = tasks["F"], tasks.get("R", 0.0), tasks["B"]
    return (spec.num_microbatches * (f + r + b) + (spec.num_stages - 1) * (f + b)) / step_s


def _hop_stats(per_step: list[list[float]]) -> dict:
    """Median and 90th percentile (ms) of the waiting hops over all timed steps."""
    hops = sorted(h for step in per_step for h in step)
    if not hops:
        return {"count": 0, "p50": None, "p90": None}
    p90 = hops[int(0.9 * (len(hops) - 1))]
    return {"count": len(hops), "p50": statistics.median(hops) * 1e3, "p90": p90 * 1e3}


def _fmt_list(xs: Sequence[float]) -> str:
    return " ".join(f"{x:g}" if isinstance(x, int) or float(x).is_integer() else f"{x:.1f}" for x in xs)


def _fmt_opt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _fmt_hops(h: dict) -> str:
    return "-" if h["p50"] is None else f"{h['p50']:.1f}/{h['p90']:.1f}"


_COLUMNS = ("schedule", "step ms", "samples/s", "of ideal", "varuna/x", "eff", "max idle", "hop p50/p90 ms",
            "F/R/B ms", "inputs held/stage", "graphs held/stage")


def print_tables(rows: list[dict], spec: WorldSpec) -> None:
    """One Markdown table per (model, P, level): samples/s, ratios, efficiency, hops, peaks."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["P"], r["level"]), []).append(r)
    for (model, P, level), rs in groups.items():
        ours = next((r for r in rs if r["system"] == "ours" and r["schedule"] == "varuna"), None)
        head = f"\n{model} P={P} Nm={rs[0]['Nm']} m={rs[0]['m']}"
        if model == "emulated":
            head += f" F={spec.fwd_s * 1e3:g}ms B={2 * spec.fwd_s * 1e3:g}ms R=F"
        print(head + f", network {level} ({LEVELS[level] or 'no emulation'})")
        if rs[0]["ideal_step_s"]:
            ideal = rs[0]["ideal_step_s"]
            print(f"ideal with recompute Nm(F+R+B)+(P-1)(F+B) = {ideal * 1e3:.0f} ms = "
                  f"{rs[0]['M'] / ideal:.1f} samples/s\n")
        print("| " + " | ".join(_COLUMNS) + " |")
        print("|" + "|".join("---" if c == "schedule" else "---:" for c in _COLUMNS) + "|")
        for r in rs:
            t = r["task_ms"]
            cells = [
                r["label"],
                f"{r['median_step_s'] * 1e3:.0f}",
                f"{r['samples_per_s']:.1f}",
                _fmt_opt(r["of_ideal"], 3),
                _fmt_opt(ours["samples_per_s"] / r["samples_per_s"] if ours else None, 3),
                _fmt_opt(r["efficiency"]),
                f"{max(r['idle_frac']) * 100:.0f}%",
                _fmt_hops(r["hop_ms"]),
                "/".join(f"{t[op]:.1f}" if op in t else "-" for op in ("F", "R", "B")),
                _fmt_list(r["peak_inputs"]),
                _fmt_list(r["peak_graphs"]),
            ]
            print("| " + " | ".join(cells) + " |")


def goal_rows(rows: list[dict]) -> list[dict]:
    """Per (P, level) of the emulated runs: varuna vs the best torch schedule with recompute, and vs ideal."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["model"] == "emulated":
            groups.setdefault((r["P"], r["level"]), []).append(r)
    for (P, level), rs in groups.items():
        ours = next((r for r in rs if r["system"] == "ours" and r["schedule"] == "varuna"), None)
        torch_rc = [r for r in rs if r["system"] == "torch" and r["recompute"]]
        if ours is None or not torch_rc:
            continue
        best = max(torch_rc, key=lambda r: r["samples_per_s"])
        vs_torch = ours["samples_per_s"] / best["samples_per_s"]
        out.append({
            "P": P, "level": level, "varuna_samples_per_s": ours["samples_per_s"],
            "best_torch": best["label"],
            "best_torch_samples_per_s": best["samples_per_s"], "vs_torch": vs_torch,
            "goal_vs_torch": GOAL_VS_TORCH.get(level), "of_ideal": ours["of_ideal"],
            "goal_of_ideal": GOAL_VS_IDEAL.get(level),
        })
    return out


def print_goals(goals: list[dict]) -> None:
    """The goals of issue 10 for the varuna schedule, as a Markdown table."""
    if not goals:
        return
    print("\ngoals for the varuna schedule (emulated devices)\n")
    print("| P | network | varuna samples/s | best torch with recompute | its samples/s | ratio | goal | met "
          "| of ideal | goal | met |")
    print("|---:|---|---:|---|---:|---:|---:|---|---:|---:|---|")
    for g in goals:
        met_torch = "yes" if g["vs_torch"] >= g["goal_vs_torch"] else "**no**"
        met_ideal = "yes" if g["of_ideal"] >= g["goal_of_ideal"] else "**no**"
        print(f"| {g['P']} | {g['level']} | {g['varuna_samples_per_s']:.1f} | {g['best_torch']} "
              f"| {g['best_torch_samples_per_s']:.1f} | {g['vs_torch']:.3f} | {g['goal_vs_torch']:.2f} "
              f"| {met_torch} | {g['of_ideal']:.3f} | {g['goal_of_ideal']:.2f} | {met_ideal} |")


def write_timelines(rows: list[dict], directory: Path) -> None:
    """Chrome trace + Gantt PNG of each run's median timed step."""
    from varuna.core.timeline import Timeline

    directory.mkdir(parents=True, exist_ok=True)
    for r in rows:
        tl = Timeline(metadata={k: r[k] for k in ("label", "level", "P", "Nm", "m", "median_step_s")})
        for evs in r["timeline"].values():
            for stage, op, mb, start, end in evs:
                tl.add(stage, 0, op, mb, start, end)
        name = f"{r['model']}_p{r['P']}_{r['level']}_{r['label'].replace(' ', '_').replace('+', '-')}"
        name = name.replace("(", "").replace(")", "").replace("=", "")
        tl.to_chrome_trace(directory / f"{name}.json")
        try:
            tl.plot_gantt(directory / f"{name}.png", title=f"{r['label']} P={r['P']} network {r['level']} "
                          f"(step {r['median_step_s'] * 1e3:.0f} ms)", dpi=80)
        except ImportError:  # matplotlib is optional
            pass


def _reprint(path: Path) -> int:
    """Print the tables of a saved run (fields added since it was written are derived if missing)."""
    try:
        data = json.loads(path.read_text())
        rows, args = data["rows"], data.get("args", {})
    except (OSError, ValueError, KeyError) as e:
        print(f"bench_schedules: cannot read results from {path}: {e}", file=sys.stderr)
        return 2
    for models in (("emulated",), ("gpt",)):
        rs = [r for r in rows if r["model"] in models]
        for P in sorted({r["P"] for r in rs}):
            sel = [r for r in rs if r["P"] == P]
            spec = WorldSpec(model=models[0], num_stages=P, num_microbatches=sel[0]["Nm"],
                             micro_batch_size=sel[0]["m"], fwd_s=args.get("fwd_ms", 10.0) / 1e3, width=0,
                             warmup=0, steps=0, runs=[], out_dir="")
            for r in sel:
                if r["model"] != "emulated":
                    r["efficiency"] = None
                if "task_ms" not in r:  # older files: from the kept (median) step's timeline only
                    tasks = task_medians_s([[evs] for evs in r["timeline"].values()], r["chunks"])
                    r["task_ms"] = {op: t * 1e3 for op, t in tasks.items()}
                    r["efficiency"] = _efficiency(spec, tasks, r["median_step_s"])
            print_tables(sel, spec)
    print_goals(data.get("goals") or goal_rows(rows))
    if "load_average" in data:
        print(f"\nload average {data['load_average'][0]:.1f} before, {data['load_average'][1]:.1f} after")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, nargs="+", default=[4], help="pipeline depths P (emulated devices)")
    ap.add_argument("--p8", action="store_true", help="also P=8 (8 processes: they mostly sleep)")
    ap.add_argument("--levels", default="none,moderate,heavy",
                    help=f"network levels, comma-separated, of {', '.join(LEVELS)}")
    ap.add_argument("--microbatches", type=int, default=16, help="Nm")
    ap.add_argument("--micro-batch-size", type=int, default=4, help="m")
    ap.add_argument("--fwd-ms", type=float, default=10.0, help="F per stage per micro-batch (B = 2F, R = F)")
    ap.add_argument("--width", type=int, default=16, help="activation width of the emulated blocks")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per run")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run and round")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds over all configurations (odd rounds in reverse order)")
    ap.add_argument("--no-no-recompute", action="store_true", help="skip the rows without recompute")
    ap.add_argument("--only", default="", help="comma-separated substrings: keep rows whose label has one "
                    "(e.g. 'ours varuna,torch GPipe+ckpt')")
    ap.add_argument("--no-gpt", action="store_true", help="skip the real-compute GPT comparison")
    ap.add_argument("--no-emulated", action="store_true", help="skip the emulated-device comparison")
    ap.add_argument("--gpt-levels", default="none", help="network levels for the GPT comparison")
    ap.add_argument("--gpt-layers", type=int, default=4)
    ap.add_argument("--gpt-embd", type=int, default=128)
    ap.add_argument("--gpt-block-size", type=int, default=64)
    ap.add_argument("--gpt-microbatches", type=int, default=8)
    ap.add_argument("--gpt-steps", type=int, default=3, help="timed GPT steps per run and round")
    ap.add_argument("--json", type=Path, help="write machine-readable results here")
    ap.add_argument("--plot", type=Path, help="PNG of samples/s vs network level per schedule")
    ap.add_argument("--timelines", type=Path, help="directory for each run's Chrome trace + Gantt PNG")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per set of worker processes")
    ap.add_argument("--from-json", type=Path, metavar="JSON", help="print the tables of a saved --json run")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._worker:
        return _worker_main(a._worker)
    if a.from_json:
        return _reprint(a.from_json)
    levels = [s.strip() for s in a.levels.split(",") if s.strip()]
    gpt_levels = [s.strip() for s in a.gpt_levels.split(",") if s.strip()]
    for lv in levels + gpt_levels:
        if lv not in LEVELS:
            ap.error(f"unknown network level {lv!r}; choose from {', '.join(LEVELS)}")
    stages = sorted(set(a.stages + ([8] if a.p8 else [])))
    only = [o.strip() for o in a.only.split(",") if o.strip()]
    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    all_rows: list[dict] = []
    goals: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_schedules_") as tmp:
        worlds: list[WorldSpec] = []
        if not a.no_emulated:
            specs = comparison_runs(levels, with_no_recompute=not a.no_no_recompute)
            runs = _order_runs(specs, a.rounds, only)
            for P in stages:
                worlds.append(WorldSpec(
                    model="emulated", num_stages=P, num_microbatches=a.microbatches,
                    micro_batch_size=a.micro_batch_size, fwd_s=a.fwd_ms / 1e3, width=a.width,
                    warmup=a.warmup, steps=a.steps, runs=runs, out_dir=f"{tmp}/emu_p{P}",
                ))
        if not a.no_gpt:
            gpt = {"vocab_size": 256, "block_size": a.gpt_block_size, "n_layer": a.gpt_layers, "n_head": 4,
                   "n_embd": a.gpt_embd, "dropout": 0.1}
            specs = comparison_runs(gpt_levels, with_no_recompute=not a.no_no_recompute)
            runs = [{**r, "model": "gpt"} for r in _order_runs(specs, a.rounds, only)]
            worlds.append(WorldSpec(model="gpt", num_stages=2, num_microbatches=a.gpt_microbatches,
                                    micro_batch_size=a.micro_batch_size, fwd_s=0.0, width=0, warmup=a.warmup,
                                    steps=a.gpt_steps, runs=runs, out_dir=f"{tmp}/gpt", gpt=gpt))
        for spec in worlds:
            rows = summarize(spec, run_world(spec, a.timeout))
            print_tables(rows, spec)
            all_rows += rows
        goals = goal_rows(all_rows)
        print_goals(goals)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs; median of {a.rounds}x{a.steps} timed steps per row "
          f"({a.rounds}x{a.gpt_steps} for GPT) after {a.warmup} warm-up step(s) per round; "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    if a.timelines:
        write_timelines(all_rows, a.timelines)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "_worker"},
            "goals": goals,
            "load_average": [load_before, os.getloadavg()[0]],
            "rows": all_rows,
        }, indent=1))
    if a.plot:
        sys.path.insert(0, str(ROOT / "scripts"))
        from plot_bench import plot_throughput

        plot_throughput(all_rows, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
