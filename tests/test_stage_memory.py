"""One activation-memory formula (issue #32, docs/memory.md): ``activation_memory_bytes`` against
a count by hand, the planner (``Calibration.stage_memory_bytes``) and the runtime's split
(``StageMemory``) agreeing on the same numbers, the dry run's per-segment activation bytes against
an analytic count, and ``balanced_stages(fits=)`` against brute force."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

import varuna
from varuna.core.calibration import Calibration
from varuna.core.memory import ENGINE_OVERHEAD_BYTES, MEMORY_MARGIN, WORKSPACE_FACTOR, activation_memory_bytes
from varuna.core.partition import balanced_stages, stage_costs
from varuna.core.schedule import schedule_kind
from varuna.cutting.split import ModelProfile, profile_model
from varuna.runtime.config import PipelineConfig, VarunaConfig
from varuna.runtime.layout import Layout
from varuna.runtime.stages import StageMemory, stage_memory_for

MB = 1 << 20


# ---------------------------------------------------------------------------------------------
# The formula against a count by hand


def _by_hand(first, last, stashed, recompute, ins, acts, segments):
    """Each in-flight micro-batch and the one being recomputed, listed tensor by tensor."""
    total = 0.0
    stage = range(first, last + 1)
    kept = [s for s in stage if not recompute or (segments is not None and s not in segments)]
    recomputed = [s for s in stage if s not in kept]
    # Block inputs: the stage's input, and every segment whose kind (kept/recomputed) differs from
    # the one before it (a block boundary inside the stage).
    starts = [s for s in stage if s == first or ((s in kept) != (s - 1 in kept))]
    if not recompute:
        starts = [first]
    for _ in range(stashed):
        total += sum(ins[s] for s in starts) + sum(acts[s] for s in kept)
    total += sum(acts[s] for s in recomputed)  # the one micro-batch being recomputed
    return total + WORKSPACE_FACTOR * sum(acts[s] for s in stage)


@pytest.mark.parametrize("recompute,segments", [(False, None), (True, None), (True, set()), (True, {1, 2}),
                                                (True, {0, 3}), (True, {2})])
def test_activation_memory_matches_a_count_by_hand(recompute, segments):
    ins, acts = [3.0, 5.0, 7.0, 11.0], [100.0, 200.0, 400.0, 800.0]
    got = activation_memory_bytes(0, 3, stashed=4, recompute=recompute, input_bytes=ins.__getitem__,
                                  activation_bytes=acts.__getitem__, recompute_segments=segments)
    assert got == _by_hand(0, 3, 4, recompute, ins, acts, segments)


def test_recomputing_more_segments_never_costs_more_memory():
    ins, acts = [1.0] * 4, [100.0, 200.0, 400.0, 800.0]
    kw = {"stashed": 4, "recompute": True, "input_bytes": ins.__getitem__,
          "activation_bytes": acts.__getitem__}
    none, some, whole = (activation_memory_bytes(0, 3, recompute_segments=s, **kw)
                         for s in (set(), {3}, None))
    assert whole < some < none
    keep_all = activation_memory_bytes(0, 3, stashed=4, recompute=False, input_bytes=ins.__getitem__,
                                       activation_bytes=acts.__getitem__)
    assert none == keep_all  # recomputing no segment keeps what no recompute keeps


# ---------------------------------------------------------------------------------------------
# Planner and runtime: the same numbers give the same bytes


def _twin(num_segments: int = 6, m: int = 2) -> tuple[Calibration, ModelProfile]:
    """A calibration and a dry-run profile holding the same per-segment facts at micro-batch m."""
    params = [(i + 1) * MB for i in range(num_segments)]
    cal = Calibration.synthetic(0.01, num_segments=num_segments, micro_batch_sizes=(1, 2, 4),
                                param_bytes=params, optimizer_factor=2.0, act_bytes_per_example=[
                                    (i + 2) * 1000.0 for i in range(num_segments - 1)],
                                activation_bytes_per_example=[(i + 3) * 50_000.0
                                                              for i in range(num_segments)])
    seg = cal.segments
    assert all(s.grad_bytes == s.param_bytes and s.optimizer_bytes == 2 * s.param_bytes for s in seg)
    prof = ModelProfile(
        cutpoint_names=[f"c{i}" for i in range(num_segments - 1)],
        param_segments={f"w{i}": (i,) for i in range(num_segments)},
        act_meta=[[] for _ in range(num_segments - 1)],
        fwd_cost=[1.0] * num_segments, bwd_cost=[2.0] * num_segments, cost_unit="flop",
        param_bytes={f"w{i}": seg[i].param_bytes for i in range(num_segments)},
        activation_bytes=[round(cal.activation_bytes(i, m)) for i in range(num_segments)],
        input_bytes=[round(cal._at(seg[i].stashed_input_bytes, m)) for i in range(num_segments)],
    )
    return cal, prof


@pytest.mark.parametrize("schedule", ["varuna", "1f1b", "gpipe"])
@pytest.mark.parametrize("recompute,segments", [(True, None), (False, None), (True, frozenset({1, 4})),
                                                (True, frozenset())])
@pytest.mark.parametrize("shards", [1, 2])
def test_planner_and_runtime_count_a_stage_alike(schedule, recompute, segments, shards):
    m, P, nm = 2, 3, 6
    cal, prof = _twin(m=m)
    kind = schedule_kind(schedule)
    memory = StageMemory((1 << 40,), optimizer_shards=shards, num_microbatches=nm, recompute=recompute,
                         recompute_segments=segments)
    for k, (a, b) in enumerate([(0, 1), (2, 3), (4, 5)]):
        planner = cal.stage_memory_bytes(
            range(a, b + 1), m, kind.stash_peak(P, k, nm),
            recompute=kind.recomputes(P, k, recompute=recompute),
            optimizer_shards=shards, recompute_segments=segments)
        runtime = memory.stage_bytes(prof, schedule, P, k, a, b)
        assert abs(runtime - planner) <= 1, (k, runtime, planner)


def test_the_runtime_split_counts_kept_activations():
    """The memory the split allows for depends on the recompute set: keeping every activation
    (an empty set) overflows the cap under which whole-stage recompute keeps the time-balanced
    split, so the split moves a boundary (1F1B with recompute: stage 0 holds 2 micro-batches)."""
    _, prof = _twin(num_segments=8)
    prof.param_bytes = {f"w{i}": MB for i in range(8)}
    prof.activation_bytes = [8 * MB] * 8
    full = last = [4.0] * 8
    timed = balanced_stages(full, last, 2)
    assert timed == [(0, 3), (4, 7)]
    kept = StageMemory((1 << 40,), num_microbatches=4, recompute_segments=frozenset())
    room = max(kept.stage_bytes(prof, "1f1b", 2, k, a, b) for k, (a, b) in enumerate([(0, 2), (3, 7)]))
    cap = int((room + ENGINE_OVERHEAD_BYTES) / (1 - MEMORY_MARGIN)) + 1
    assert StageMemory((cap,), num_microbatches=4).fit(timed, prof, "1f1b", full, last, None) == timed
    moved = StageMemory((cap,), num_microbatches=4, recompute_segments=frozenset())
    assert moved.stage_bytes(prof, "1f1b", 2, 0, 0, 3) > room  # the control: timed overflows
    fitted = moved.fit(timed, prof, "1f1b", full, last, None)
    assert fitted == [(0, 2), (3, 7)]
    assert all(moved.stage_bytes(prof, "1f1b", 2, k, a, b) <= room for k, (a, b) in enumerate(fitted))


def test_stage_memory_for_carries_the_recompute_set():
    cfg = VarunaConfig(global_batch_size=8, micro_batch_size=2,
                       pipeline=PipelineConfig(stage_memory=1 << 30, recompute_segments=(3, 1)))
    layout = Layout(rank=0, world=2, P=2, D=1)
    mem = stage_memory_for(cfg, layout, torch.device("cpu"), [[0, 1, 2, 3]], num_segments=5)
    assert mem.recompute_segments == frozenset({1, 3}) and mem.recompute is True
    with pytest.raises(ValueError, match="names segment 3 but the model has 3 segments"):
        stage_memory_for(cfg, layout, torch.device("cpu"), [[0, 1, 2, 3]], num_segments=3)


# ---------------------------------------------------------------------------------------------
# The dry run's per-segment activation bytes against an analytic count


class _Stack(nn.Module):
    """Segments of Linear(D, H) → Tanh → Linear(H, D), a CutPoint between them: autograd saves each
    segment's input (its first Linear's), the Tanh output h (Tanh's and the second Linear's) and
    nothing else but the weights; the segment's output crosses the cut."""

    def __init__(self, segments: int, d: int, h: int, dropout: float = 0.0):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Dropout(dropout), nn.Linear(h, d))
            for _ in range(segments))
        self.cuts = nn.ModuleList(varuna.CutPoint() for _ in range(segments - 1))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return x


def test_dry_run_counts_each_segments_activations_exactly():
    B, D, H, S = 5, 8, 24, 4
    prof = profile_model(_Stack(S, D, H), torch.randn(B, D), lambda out, b: out.sum(), costs=False,
                         activations=True)
    h, y = B * H * 4, B * D * 4
    # Every segment: its h and its output y (the next one's input, counted once, here); the last
    # one's output is only summed (nothing saved), so it holds h and the scalar loss.
    assert prof.activation_bytes == [h + y] * (S - 1) + [h + 4]
    assert prof.input_bytes == [B * D * 4] * S
    assert profile_model(_Stack(S, D, H), torch.randn(B, D), lambda out, b: out.sum(),
                         costs=False).activation_bytes is None  # not asked: not measured


def test_dry_run_activations_draw_no_random_numbers():
    """The extra forward restores the RNG: a run that measures draws what one that does not."""
    model, x = _Stack(3, 8, 16, dropout=0.5), torch.randn(4, 8)
    torch.manual_seed(7)
    profile_model(model, x, lambda out, b: out.sum(), costs=False)
    plain = torch.get_rng_state()
    torch.manual_seed(7)
    prof = profile_model(model, x, lambda out, b: out.sum(), costs=False, activations=True)
    assert torch.equal(torch.get_rng_state(), plain)
    assert prof.activation_bytes[0] > 0


# ---------------------------------------------------------------------------------------------
# balanced_stages(fits=) against brute force


def _all_splits(n: int, P: int):
    for cuts in itertools.combinations(range(1, n), P - 1):
        bounds = [0, *cuts, n]
        yield [(bounds[i], bounds[i + 1] - 1) for i in range(P)]


def _brute(full, last, P, fits):
    best = None
    for ranges in _all_splits(len(full), P):
        if all(fits(k, a, b) for k, (a, b) in enumerate(ranges)):
            t = max(stage_costs(full, last, ranges))
            best = t if best is None else min(best, t)
    return best


def test_fits_shifts_a_boundary_when_the_time_optimal_split_does_not_fit():
    full, last = [1.0] * 6, [1.0] * 6
    timed = balanced_stages(full, last, 2)
    assert timed == [(0, 2), (3, 5)]
    # Stage 0 pays its input once per in-flight micro-batch: starting later costs it more, so
    # the predicate is not a sum of per-segment weights.
    def fits(k, a, b):
        return k == 1 or (b - a + 1) * 10 <= 25
    got = balanced_stages(full, last, 2, fits=fits)
    assert got == [(0, 1), (2, 5)]
    assert max(stage_costs(full, last, got)) == _brute(full, last, 2, fits)


def test_fits_finds_the_fastest_split_that_fits_on_random_cases():
    rng = random.Random(32)
    infeasible = constrained = 0
    for _ in range(150):
        n, P = rng.randint(2, 8), rng.randint(1, 4)
        if P > n:
            continue
        full = [float(rng.randint(1, 9)) for _ in range(n)]
        last = [f - rng.randint(0, 1) * 0.5 for f in full]
        cost = [rng.randint(1, 6) for _ in range(n)]
        budget = [rng.randint(8, 30) for _ in range(P)]

        # per-stage room; the stash grows with the stage's place and its first segment
        def fits(k, a, b, cost=cost, budget=budget, P=P):
            return sum(cost[a : b + 1]) + (P - k) * cost[a] <= budget[k]

        want = _brute(full, last, P, fits)
        if want is None:
            with pytest.raises(ValueError, match="keeps every stage within its memory"):
                balanced_stages(full, last, P, fits=fits)
            infeasible += 1
            continue
        got = balanced_stages(full, last, P, fits=fits)
        assert all(fits(k, a, b) for k, (a, b) in enumerate(got))
        assert max(stage_costs(full, last, got)) == want
        constrained += want > max(stage_costs(full, last, balanced_stages(full, last, P)))
    assert infeasible > 5 and constrained > 5, (infeasible, constrained)  # both cases were exercised


def test_dry_run_counts_what_the_profiler_counts_on_the_gpt_example():
    """One pass over the whole model gives, per segment, the bytes varuna-profile measures one
    segment at a time (profiler/compute.py; the planner's numbers): within 1 % and the same inputs."""
    from profiler.compute import SegmentProfiler
    from profiler.spec import load_target

    target = load_target("examples/gpt2/profile_target.py:build",
                         {"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16, "dropout": 0.0})
    profiler, m = SegmentProfiler(target, warmup=0, reps=1, optimizer="none"), 2
    mine = profile_model(target.model, target.make_batch(m), target.loss_fn, costs=False, activations=True)
    theirs = [profiler.measure(s, [m])[0] for s in range(profiler.num_cutpoints + 1)]
    assert mine.input_bytes == [r.stashed_input_bytes for r in theirs]
    for s, r in enumerate(theirs):
        assert abs(mine.activation_bytes[s] - r.activation_bytes) <= 0.01 * r.activation_bytes, (s, mine, r)
