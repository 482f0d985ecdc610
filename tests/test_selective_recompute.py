"""Per-segment (selective) recompute (issue #32, Note [Selective recompute] in
varuna/core/selective_recompute.py): recomputing some segments of a stage changes neither losses
nor weights (deterministic mode, bit for bit, against whole-stage recompute and against none),
the memory model moves as the set does, and auto-config recomputes only what memory needs."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch

import varuna
from simulator.autoconfig import autoconfigure
from simulator.config import SimConfig
from simulator.costs import stage_cost_tables, stage_memory
from simulator.engine import simulate
from varuna.core.calibration import Calibration
from varuna.core.selective_recompute import choose_recompute_segments, recompute_blocks

sys.path.insert(0, str(Path(__file__).parent))
from models import build_model  # noqa: E402

M, MICRO = 8, 2


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 * step)
    idx = torch.randint(0, 256, (M, 17), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _train(schedule: str, recompute: bool, segments, steps: int = 2, det: bool = True, lr: float = 1e-2):
    """The tiny GPT (dropout on, tied embedding, clipping) in one process: per-step losses, the
    sha256 of every parameter, and how many blocks a recomputed micro-batch ran as."""
    engine = varuna.Engine(
        build_model("gpt", dropout=0.1),
        varuna.VarunaConfig(global_batch_size=M, micro_batch_size=MICRO, seed=3, schedule=schedule,
                            max_grad_norm=1.0, determinism=varuna.DeterminismConfig(enabled=det),
                            pipeline=varuna.PipelineConfig(recompute=recompute, recompute_segments=segments)),
        example_batch=_batch(0),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr),
    )
    try:
        losses = [engine.train_step(_batch(s)).loss for s in range(1, steps + 1)]
        digests = {n: hashlib.sha256(p.detach().contiguous().numpy().tobytes()).hexdigest()
                   for n, p in engine.named_parameters()}
        blocks = engine._executor.s.blocks(0)
        return losses, digests, engine.profile.num_segments, blocks
    finally:
        engine.close()


@pytest.fixture(scope="module")
def whole_stage():
    return _train("gpipe", True, None)


@pytest.mark.parametrize("segments", [(), (1, 3), (0, 4)])
def test_selective_recompute_trains_the_bits_of_whole_stage_recompute_and_of_none(whole_stage, segments):
    """GPipe at 1×1 recomputes every micro-batch but the last: with a recompute set the stage runs
    them as blocks (kept, recomputed, the source's and the loss's among them), and every loss and
    every parameter equals both whole-stage recompute and no recompute at all."""
    losses, digests, n, blocks = _train("gpipe", True, segments)
    assert n == 5 and blocks is not None, "a recompute set must run the stage as blocks"
    assert [(b.first, b.last, b.recompute) for b in blocks] == recompute_blocks(0, 4, set(segments))
    assert losses == whole_stage[0]
    assert digests == whole_stage[1], ", ".join(k for k in digests if digests[k] != whole_stage[1][k])
    if segments == ():
        none = _train("gpipe", False, None)
        assert (none[0], none[1]) == (losses, digests)


def test_the_comparison_can_fail(whole_stage):
    """Negative control: a change far smaller than a wrong chain of blocks would make (the learning
    rate by one part in 10^6) shows in the digests the tests above compare."""
    losses, digests, _, _ = _train("gpipe", True, (1,), lr=1e-2 * (1 + 1e-6))
    assert losses[0] == whole_stage[0][0]  # the first loss precedes any update
    assert digests != whole_stage[1]


def test_recompute_segments_past_the_model_get_one_line():
    with pytest.raises(ValueError, match="names segment 7 but the model has 5 segments"):
        _train("gpipe", True, (7,), steps=1)
    with pytest.raises(ValueError, match="segment indices >= 0"):
        varuna.VarunaConfig(global_batch_size=M, micro_batch_size=MICRO,
                            pipeline=varuna.PipelineConfig(recompute_segments=(-1,))).validate()
    with pytest.raises(ValueError, match="not supported with schedule zb-h1"):
        varuna.VarunaConfig(global_batch_size=M, micro_batch_size=MICRO, schedule="zb-h1",
                            pipeline=varuna.PipelineConfig(recompute_segments=(1,))).validate()


def test_blocks_partition_the_stage():
    assert recompute_blocks(0, 4, {0, 1, 3}) == [(0, 1, True), (2, 2, False), (3, 3, True), (4, 4, False)]
    assert recompute_blocks(0, 4, set()) == [(0, 4, False)]


# ---------------------------------------------------------------------------------------------
# The memory model and the planner


def _cal(acts=(8, 2, 8, 2, 8, 2, 8, 2)):
    """Eight segments of equal time and parameters whose activations alternate large and small
    (as attention's score tensors against an MLP's), 1 KiB crossing each cut-point per example."""
    return Calibration.synthetic(0.01, num_segments=len(acts), micro_batch_sizes=(1, 2), param_bytes=1 << 20,
                                 act_bytes_per_example=1 << 10,
                                 activation_bytes_per_example=[a << 20 for a in acts])


def test_the_memory_model_moves_with_the_recompute_set():
    """Each segment added to the set frees its activations on every in-flight micro-batch but one
    and adds its block's input; the empty set is no recompute, the whole stage whole-stage recompute
    (independent reference: the formula on the calibration's own numbers)."""
    cal, m, stash = _cal(), 2, 3
    seg_in = [cal.segments[s].stashed_input_bytes[1] for s in range(4)]
    acts = [cal.activation_bytes(s, m) for s in range(4)]
    static = sum(cal.segments[s].param_bytes * 4 for s in range(4))  # weights, grads, Adam's two moments
    work = sum(acts)  # Note [Backward workspace]

    def model(S):
        return stage_memory(cal, [(0, 3)], m, stash, True, recompute_segments=S)

    assert model(()) == stage_memory(cal, [(0, 3)], m, stash, False) == \
        static + stash * (seg_in[0] + sum(acts)) + work
    assert model((0, 1, 2, 3)) == stage_memory(cal, [(0, 3)], m, stash, True) == \
        static + stash * seg_in[0] + sum(acts) + work
    # blocks [0] recomputed, [1] kept, [2, 3] recomputed: three block inputs per micro-batch
    want = static + stash * (seg_in[0] + seg_in[1] + seg_in[2] + acts[1]) + acts[0] + acts[2] + acts[3] + work
    assert model((0, 2, 3)) == want
    sizes = [model(S) for S in [(), (2,), (0, 2), (0, 2, 3), (0, 1, 2, 3)]]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)


def test_the_simulator_charges_only_the_recomputed_segments():
    cal = _cal()
    full = stage_cost_tables(cal, [(0, 3), (4, 7)], {2}, task_overhead_s=0.0, placeholder_s=0.0)[2]
    some = stage_cost_tables(cal, [(0, 3), (4, 7)], {2}, task_overhead_s=0.0, placeholder_s=0.0,
                             recompute_segments=(0, 2))[2]
    assert some.rec[0] == pytest.approx(full.rec[0] / 2) and some.rec[1] == 0.0
    assert some.fwd == full.fwd and some.bwd == full.bwd
    base = dict(num_stages=2, micro_batch_size=2, num_microbatches=8, schedule="1f1b", jitter_scale=0.0,
                stage_segments=((0, 3), (4, 7)))
    t_none, t_some, t_full = (simulate(cal, SimConfig(**base, recompute=r, recompute_segments=s)).minibatch_s
                              for r, s in [(False, None), (True, (0, 2)), (True, None)])
    assert t_none < t_some < t_full


@pytest.mark.parametrize("schedule", ["1f1b", "varuna"])
def test_the_planner_recomputes_part_of_a_stage_when_memory_lies_between_the_extremes(schedule):
    """At P = 2 (pipeline_depth fixed, no sharding): with room for every activation nothing is
    recomputed (varuna's R tasks then do nothing); with room only for whole-stage recompute the
    whole stage is; in between the plan recomputes some segments -- the large ones first (most
    bytes per second) -- fits, and spends less time than whole-stage recompute."""
    cal = _cal((8, 2, 8, 2, 1, 1, 1, 1))  # large early: the first stage, stashing the most, binds
    kw = dict(gpus=2, global_batch_size=16, micro_batch_size=2, pipeline_depth=2, schedule=schedule,
              recompute=None if schedule == "1f1b" else True, shard_optimizer=False)
    free = autoconfigure(cal, gpu_memory_bytes=1 << 40, **kw).best
    assert free.num_stages == 2 and not free.config.recompute or free.config.recompute_segments == ()
    whole_plan = autoconfigure(cal, **{**kw, "recompute": True}).best  # no memory given: whole stages
    assert whole_plan.config.recompute and whole_plan.config.recompute_segments is None
    tight, roomy = whole_plan.memory_bytes, free.memory_bytes
    assert tight < roomy
    middle = autoconfigure(cal, gpu_memory_bytes=(tight + roomy) // 2, **kw).best
    S = middle.config.recompute_segments
    a, b = middle.stage_segments[0]
    assert middle.config.recompute and S is not None and 0 < len(S) < b - a + 1, S
    large = {s for s in range(a, b + 1) if cal.activation_bytes(s, 2) == 16 << 20}
    assert set(S) <= large or large <= set(S), "the large activations go first"
    assert middle.memory_bytes <= (tight + roomy) // 2
    whole = simulate(cal, dataclasses_replace(middle.config, recompute_segments=None))
    assert middle.result.minibatch_s <= whole.minibatch_s
    assert middle.result.stage_busy_s[0] < whole.stage_busy_s[0], "fewer seconds of recompute"
    squeezed = autoconfigure(cal, gpu_memory_bytes=tight, **kw).best
    a, b = squeezed.stage_segments[0]
    S = squeezed.config.recompute_segments
    assert squeezed.config.recompute and (S is None or set(range(a, b + 1)) <= set(S))


def test_the_greedy_takes_most_bytes_per_second_first():
    acts, secs = [1.0, 8.0, 4.0, 8.0], [1.0, 1.0, 1.0, 4.0]
    order = []
    choose_recompute_segments(0, 3, lambda s: order.append(sorted(s)) or len(s) == 4, acts, secs)
    assert order == [[], [1], [1, 2], [1, 2, 3], [0, 1, 2, 3]]


def dataclasses_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


# ---------------------------------------------------------------------------------------------
# Across processes


def _world(tmp_path: Path, P: int, D: int, *flags: str):
    import json

    from distributed import check_ok, run_world

    worker = Path(__file__).parent / "workers" / "det_worker.py"
    out = tmp_path / f"{P}x{D}{''.join(flags)}"
    check_ok(run_world(worker, P * D, ["--out", str(out), "--steps", "4", *flags],
                       env={"VARUNA_PIPELINE_DEPTH": str(P), "VARUNA_DATA_PARALLEL": str(D)}))
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    digests = {}
    for r in reports:
        digests.update(r["digests"])
    return reports[0]["losses"], digests, reports[0]["stage_ranges"]


@pytest.mark.slow
def test_selective_recompute_across_stages_and_replicas_is_bit_identical_to_one_process(tmp_path):
    """The tiny GPT (tied embedding across stages, dropout, clipping), varuna schedule at 2×2 and
    1f1b with recompute at 4×1, each recomputing only some segments of its stages (so boundaries,
    carried gradients and R tasks that do nothing all occur), equals the one-process run bit for bit."""
    ref_losses, ref_digests, _ = _world(tmp_path, 1, 1)
    for P, D, flags in [(2, 2, ("--recompute-segments", "1")), (2, 1, ("--recompute-segments", "none")),
                        (4, 1, ("--schedule", "1f1b", "--recompute-segments", "0,2"))]:
        losses, digests, ranges = _world(tmp_path, P, D, *flags)
        assert losses == ref_losses, f"{P}x{D} {flags}: losses differ"
        assert digests == ref_digests, f"{P}x{D} {flags}: parameters differ"
