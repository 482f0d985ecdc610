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
- **schedules**: ours ``varuna`` / ``gpipe`` / ``1f1b`` / ``zb-h1`` / ``varuna-zb`` and the interleaved
  ``interleaved`` / ``varuna-interleaved`` (v = 2 chunks per rank of F/2 each, like torch's)
  (``varuna.Engine``), our asynchronous ``2bw`` (PipeDream-2BW, recompute, row ``ours 2bw (async)``:
  one-step-stale gradients, so shown for information and never counted as our best kind),
  torch's ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
  ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (the last
  three with 2 chunks per rank, V-shaped placement for ZBV/DualPipeV; the emulated blocks split
  their backward B = 2F into input and weight halves of F each), each with activation checkpointing
  on its stages (``torch.utils.checkpoint`` around the stage module, non-reentrant; rows ``+ckpt``)
  and without. Ours: ``gpipe``/``1f1b`` with recompute (``+R``) and without; ``varuna`` always recomputes (not
  on its last stage).
- **real compute**: the GPT of examples/gpt2 at P = 2 on both systems (same split, same init).

Every timed step runs between two barriers, so its time is the whole mini-batch on every stage (the
optimizer step included); throughput is M / median step time. ``2bw`` runs without a flush: its
warm-up + timed mini-batches are one ``Engine.train_steps`` window and a step's time is the span
between two consecutive updates of stage 0 (the steady-state period); its peaks are counted over the
whole window, and the bytes of its stashed weight version are reported per stage. Peak stashed
activations are counted from the order in which each stage really ran its tasks (the engine's
timeline for ours; for torch, ``PipelineStage.forward_one_chunk``/``backward_one_chunk`` and the
checkpoint's recompute timed per micro-batch on each rank). Two numbers per stage: *inputs*
(micro-batches whose stage input is held: forward started, backward not finished) and *graphs*
(micro-batches whose full activations are held: a forward without recompute, or a recompute, started
and its backward not finished), in units of one stage's activations (an interleaved chunk counts 1/2
of a graph).

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
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "scripts"):  # the package, and this script's results module
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_schedules_results import (  # noqa: E402  (after the sys.path set-up)
    ASYNC_SCHEDULES,
    LEVELS,
    OUR_SCHEDULES,
    TORCH_SCHEDULES,
    RunSpec,
    WorldSpec,
    goal_rows,
    peak_held,
    print_goals,
    print_tables,
    reprint,
    summarize,
    write_timelines,
)

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
        wfn = getattr(stage, "backward_weight_one_chunk", None)
        if wfn is not None:  # zero-bubble schedules: the weight gradients, split from the backward
            def backward_weight_one_chunk(chunk_id, *args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return wfn(chunk_id, *args, **kwargs)
                finally:
                    self.events.append((index, "W", chunk_id, t0, time.perf_counter()))

            stage.backward_weight_one_chunk = backward_weight_one_chunk

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
            step_s, events, extra = fn(spec, run_spec, rank)
            results.append({"run": run, "step_s": step_s, "events": events,
                            "wall_s": time.perf_counter() - t0, **extra})
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


def _run_ours(spec: WorldSpec, run: RunSpec, rank: int) -> tuple[list, list, dict]:
    """One configuration on varuna.Engine (one block, or the GPT's fixed split, per stage); the
    asynchronous kinds (2bw) as one no-flush window (:func:`_timed_window`)."""
    import torch

    import varuna
    from varuna.testing.netem import NETEM_ENV_VAR

    P, v = spec.num_stages, run.chunks
    V = P * v  # virtual stages (the interleaved kinds: v chunks per rank, virtual stage j on rank j % P)
    batch = _batch(spec)
    torch.manual_seed(0)
    if spec.model == "gpt":
        from model import GPT

        cfg = _gpt_config(spec)
        model = GPT(cfg)
        ranges = _gpt_ranges(spec, V)
        optimizer = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    else:
        from varuna.testing.emulated import emulated_model

        model = emulated_model(V, spec.fwd_s / v, spec.width)  # a rank's work is the same at any v
        ranges = [(k, k) for k in range(V)]
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
                schedule=run.schedule, stop_signals=(),
                pipeline=varuna.PipelineConfig(recompute=run.recompute, stage_ranges=ranges, chunks=v),
                metrics=varuna.MetricsConfig(record_timeline=True),
                timeouts=varuna.TimeoutConfig(comm_s=spec.comm_timeout_s),
            ),
            example_batch=batch, optimizer=optimizer,
        )
    finally:
        os.environ.pop(NETEM_ENV_VAR, None)
    try:
        def events() -> list:
            return [(e.stage, e.op, e.microbatch, e.start_s, e.end_s) for e in engine.timeline.events]

        if run.schedule in ASYNC_SCHEDULES:
            return _timed_window(spec, engine, batch)
        return (*_timed_steps(spec, lambda: engine.train_step(batch), events), {})
    finally:
        engine.close()


def _timed_window(spec: WorldSpec, engine: Any, batch: tuple) -> tuple[list, list, dict]:
    """2bw without a flush: warm-up + timed mini-batches as one ``Engine.train_steps`` window
    (profiler.overhead_runs.timed_window). A step's time is the span between this rank's
    consecutive updates (on rank 0, whose time is reported: the steady-state period), so it
    compares with a synchronous row's step. Also: the window's peaks (its steps overlap, so
    they are counted over all of its events) and the bytes of the stashed weight version."""
    from profiler.overhead_runs import timed_window

    warm: list[dict] = []
    timed = timed_window(engine, batch, spec.warmup, spec.steps, warm)

    def five(events: list) -> list:  # [stage, replica, op, mb, start, end] -> the bench's form
        return [[st, op, mb, t0, t1] for st, _replica, op, mb, t0, t1 in events]

    window = [e for rec in warm + timed for e in five(rec["events"])]
    return ([rec["t1"] - rec["t0"] for rec in timed], [five(rec["events"]) for rec in timed],
            {"window_peak": list(peak_held(window)), "weight_stash_bytes": engine.weight_versions.nbytes()})


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


def _gpt_ranges(spec: WorldSpec, num_pieces: int) -> list[tuple[int, int]]:
    """The engine's segment range of each piece: ``spec.gpt_ranges`` (a planned split), else
    equal blocks (segments: 0 = embedding + block 0, i = block i, n_layer = the head)."""
    if spec.gpt_ranges:
        return [tuple(r) for r in spec.gpt_ranges]
    n_layer = spec.gpt["n_layer"]
    if n_layer % num_pieces:
        raise ValueError(f"--gpt-layers {n_layer} must be a multiple of the {num_pieces} pipeline pieces")
    per = n_layer // num_pieces
    ranges = [(k * per, (k + 1) * per - 1) for k in range(num_pieces)]
    ranges[-1] = (ranges[-1][0], n_layer)
    return ranges


def _gpt_pieces(spec: WorldSpec, num_pieces: int) -> list[Any]:
    """The GPT cut into ``num_pieces`` sequential modules as the engine cuts it (:func:`_gpt_ranges`:
    embedding in the first, head in the last); the last holds its own copy of the tied embedding
    (gradients summed after each step)."""
    import torch
    import torch.nn.functional as F
    from model import GPT
    from torch import nn

    cfg = _gpt_config(spec)
    ranges = _gpt_ranges(spec, num_pieces)
    torch.manual_seed(0)
    gpt = GPT(cfg)

    class Piece(nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.first, self.last = index == 0, index == num_pieces - 1
            if self.first:
                self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
            a, b = ranges[index]
            self.blocks = nn.ModuleList(gpt.blocks[a : min(b, cfg.n_layer - 1) + 1])
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


def _run_torch(spec: WorldSpec, run: RunSpec, rank: int) -> tuple[list, list, dict]:
    """One configuration on torch.distributed.pipelining, timed per micro-batch by _TorchRecorder."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining

    from varuna.testing.netem import emulate_network

    P, v = spec.num_stages, run.chunks
    S = P * v  # virtual stages; rank r holds stages r, r + P, ...
    x, y = _batch(spec)
    # V-shaped kinds (ZBV, DualPipeV): rank r holds virtual stages r and 2P-1-r; else r, r+P, ...
    mine = [rank, 2 * P - 1 - rank] if run.schedule in _V_SHAPED else [rank + c * P for c in range(v)]
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
        if run.schedule in _MULTI_STAGE:
            schedule = getattr(pipelining, _MULTI_STAGE[run.schedule])(stages, n, loss_fn=loss_fn)
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

        return (*_timed_steps(spec, step, lambda: recorder.events), {})


#: torch schedules that take every stage of the rank (class names), and the V-shaped ones.
_MULTI_STAGE = {
    "interleaved": "ScheduleInterleaved1F1B",
    "izb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
_V_SHAPED = ("zbv", "dualpipev")

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
        return [RunSpec(system="ours", schedule=s, recompute=recompute, level=level,
                        chunks=2 if "interleaved" in s else 1) for s in schedules]

    def torch_(recompute: bool, level: str) -> list[RunSpec]:
        return [RunSpec(system="torch", schedule=s, recompute=recompute, level=level,
                        chunks=1 if s in ("gpipe", "1f1b") else 2) for s in TORCH_SCHEDULES]

    specs = []
    for level in levels:
        specs += ours(OUR_SCHEDULES, True, level) + torch_(True, level)
        if with_no_recompute:
            specs += ours(("gpipe", "1f1b", "zb-h1", "interleaved"), False, level) + torch_(False, level)
    return specs


def _parser() -> argparse.ArgumentParser:
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
    return ap


def _worlds(a: argparse.Namespace, levels: list[str], gpt_levels: list[str], tmp: str) -> list[WorldSpec]:
    """The sets of worker processes to run: one per emulated depth P, and the GPT one."""
    stages = sorted(set(a.stages + ([8] if a.p8 else [])))
    only = [o.strip() for o in a.only.split(",") if o.strip()]
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
    return worlds


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    if a._worker:
        return _worker_main(a._worker)
    if a.from_json:
        return reprint(a.from_json)
    levels = [s.strip() for s in a.levels.split(",") if s.strip()]
    gpt_levels = [s.strip() for s in a.gpt_levels.split(",") if s.strip()]
    for lv in levels + gpt_levels:
        if lv not in LEVELS:
            ap.error(f"unknown network level {lv!r}; choose from {', '.join(LEVELS)}")
    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    all_rows: list[dict] = []
    goals: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_schedules_") as tmp:
        for spec in _worlds(a, levels, gpt_levels, tmp):
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
