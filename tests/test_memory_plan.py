"""Memory-aware planning (issue #32): the memory model with sharded optimizer state, the
per-stage memory bounds of the split, the runtime's memory-aware split, and auto-config's joint
choice of the schedule kind, recompute and sharding (Note [Joint plan])."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from simulator.autoconfig import autoconfigure, plan_variants
from simulator.config import SimConfig
from varuna.core.calibration import Calibration
from varuna.core.memory import ENGINE_OVERHEAD_BYTES as MEMORY_OVERHEAD_BYTES
from varuna.core.memory import MEMORY_MARGIN
from varuna.core.partition import balanced_stages, stage_costs
from varuna.core.schedule import schedule_kind
from varuna.cutting.split import ModelProfile
from varuna.runtime.stages import StageMemory

MB = 1 << 20


def test_the_memory_model_divides_the_optimizer_state_over_its_shards():
    cal = Calibration.synthetic(0.01, num_segments=2, param_bytes=100, act_bytes_per_example=10,
                                activation_bytes_per_example=50, micro_batch_sizes=(1, 2))
    whole = cal.stage_memory_bytes([0, 1], 1, stashed=3)
    # weights 2·100, gradients 2·100, Adam's moments 2·200 -> a quarter of those at D = 4
    assert whole - cal.stage_memory_bytes([0, 1], 1, stashed=3, optimizer_shards=4) == 400 - 100


def _brute_force(full, last, P, weights, caps):
    n, best = len(full), None
    for cuts in itertools.combinations(range(1, n), P - 1):
        bounds = [0, *cuts, n]
        ranges = [(bounds[i], bounds[i + 1] - 1) for i in range(P)]
        if any(sum(weights[a : b + 1]) > c for (a, b), c in zip(ranges, caps)):
            continue
        worst = max(stage_costs(full, last, ranges))
        best = worst if best is None else min(best, worst)
    return best


def test_per_stage_memory_bounds_give_the_fastest_split_that_fits():
    rng = random.Random(1)
    for _ in range(300):
        n, P = rng.randint(2, 8), rng.randint(2, 4)
        if P > n:
            continue
        full = [rng.randint(1, 9) for _ in range(n)]
        last = [x - rng.randint(0, x - 1) for x in full]
        weights = [rng.randint(1, 5) for _ in range(n)]
        caps = [rng.randint(3, 14) for _ in range(P)]
        want = _brute_force(full, last, P, weights, caps)
        if want is None:
            with pytest.raises(ValueError, match="keeps every stage within"):
                balanced_stages(full, last, P, weights=weights, capacity=caps)
            continue
        got = balanced_stages(full, last, P, weights=weights, capacity=caps)
        assert all(sum(weights[a : b + 1]) <= c for (a, b), c in zip(got, caps))
        assert max(stage_costs(full, last, got)) == want


def _profile(nseg: int, params_per_seg: list[int], act: int) -> ModelProfile:
    """A dry run's facts for a chain of segments of fp32 parameters; ``act`` elements cross each cut."""
    return ModelProfile(
        cutpoint_names=[f"cut{i}" for i in range(nseg - 1)],
        param_segments={f"seg{i}.w": (i,) for i in range(nseg)},
        act_meta=[[((act,), torch.float32)] for _ in range(nseg - 1)],
        fwd_cost=[1.0] * nseg, bwd_cost=[2.0] * nseg, cost_unit="flop",
        param_bytes={f"seg{i}.w": 4 * n for i, n in enumerate(params_per_seg)},
    )


def test_the_runtime_split_moves_segments_off_a_stage_only_when_it_overflows():
    """The last of 4 stages takes more blocks (it does not recompute): with room to spare the
    time-balanced split stands; with a cap below its last stage's state the split changes,
    every stage's state fits and the largest stage holds at most 10 % more than the mean."""
    prof = _profile(25, [1_000_000] * 24 + [10_000], act=4096)
    full, last = [4.0] * 25, [3.0] * 25  # F+R+B on a recomputing stage, F+B on the last
    timed = balanced_stages(full, last, 4)
    roomy = StageMemory((10_000 * MB,), num_microbatches=4).fit(timed, prof, "varuna", full, last, None)
    assert roomy == timed
    sizes = [sum(1 for s in range(a, b + 1) if s < 24) for a, b in timed]
    assert max(sizes) > 1.1 * 24 / 4, f"the control: the time-balanced split is uneven ({sizes})"
    # 6.5 blocks of 16 bytes a parameter, once the engine's overhead is set aside
    cap = int((16 * 6.5 * 1_000_000 + MEMORY_OVERHEAD_BYTES + 4096 * 4 * 12) / (1 - MEMORY_MARGIN))
    memory = StageMemory((cap,), num_microbatches=4)
    fitted = memory.fit(timed, prof, "varuna", full, last, None)
    static = memory.static_bytes(prof)
    assert fitted != timed
    for k, (a, b) in enumerate(fitted):
        stash = memory.activation_bytes(prof, "varuna", 4, k, a, b)
        assert sum(static[a : b + 1]) + stash + MEMORY_OVERHEAD_BYTES <= cap * (1 - MEMORY_MARGIN)
    params = [sum(1 for s in range(a, b + 1) if s < 24) for a, b in fitted]
    assert max(params) <= 1.1 * sum(params) / 4, params
    # Sharding the optimizer state over 2 replicas makes room: the time-balanced split fits again.
    sharded = StageMemory((cap,), optimizer_shards=2, num_microbatches=4)
    assert sharded.fit(timed, prof, "varuna", full, last, None) == timed


def _cal() -> Calibration:
    # 8 segments of 64 MiB of weights; activations large enough that keeping every graph costs.
    return Calibration.synthetic(0.01, num_segments=8, micro_batch_sizes=(1, 2, 4), param_bytes=64 * MB,
                                 act_bytes_per_example=8 * MB, activation_bytes_per_example=64 * MB)


def test_plan_variants_follow_the_kind():
    assert plan_variants("1f1b", None, None) == [(False, False), (False, True), (True, False), (True, True)]
    assert plan_variants("varuna", None, None) == [(True, False), (True, True)]
    assert plan_variants("2bw", None, None) == [(False, False), (True, False)]
    assert plan_variants("gpipe", True, False) == [(True, False)]


def _recomputes(cfg: SimConfig) -> bool:
    kind = schedule_kind(cfg.schedule)
    return any(kind.recomputes(cfg.num_stages, k, recompute=cfg.recompute) for k in range(cfg.num_stages))


def test_where_memory_allows_the_joint_plan_pays_no_recompute():
    """Note [Joint plan]: with memory for every graph no stage of the plan recomputes, and the plan
    is at least as fast as the paper's kind (which always does). The cap keeps one process from
    holding the model (P >= 2), where recomputing would be the default's cost."""
    cal = _cal()
    free = autoconfigure(cal, gpus=4, global_batch_size=16, schedule=None, recompute=None,
                         shard_optimizer=None)
    assert not _recomputes(free.best.config)
    from simulator.autoconfig import _Planner

    one = _Planner(cal, "1f1b", False, 1, 1, None).fit(1, 1, 16)[1]
    two = _Planner(cal, "1f1b", False, 1, 1, None).fit(2, 1, 8, D=2)[1]
    assert two < one
    kw = dict(gpus=4, global_batch_size=16, micro_batch_size=1, gpu_memory_bytes=two)
    best = autoconfigure(cal, schedule=None, recompute=None, shard_optimizer=None, **kw).best
    assert best.num_stages >= 2 and not _recomputes(best.config), best.summary()
    varuna = autoconfigure(cal, schedule="varuna", **kw).best
    assert _recomputes(varuna.config) and best.minibatch_s <= varuna.minibatch_s


def test_the_joint_plan_is_the_fastest_of_the_plans_restricted_to_each_choice():
    """Note [Joint plan] at caps from roomy to tight (the memory of P = 2, D = 2 without recompute,
    with it, with it and sharded state): the joint plan fits, is as fast as the fastest plan
    restricted to one (recompute, sharding) choice, and recomputes or shards only when no plan
    without it fits."""
    from simulator.autoconfig import _Planner

    cal = _cal()
    need = {v: _Planner(cal, "1f1b", v[0], 1, 1, None, shard=v[1]).fit(2, 2, 4, D=2)[1]
            for v in [(False, False), (True, False), (True, True)]}
    assert need[(False, False)] > need[(True, False)] > need[(True, True)]
    kw = dict(gpus=4, global_batch_size=16, micro_batch_size=2, schedule="1f1b")
    for cap in [None, *need.values()]:
        restricted = {}
        for r, sh in itertools.product([False, True], [False, True]):
            try:
                restricted[(r, sh)] = autoconfigure(cal, recompute=r, shard_optimizer=sh,
                                                    gpu_memory_bytes=cap, **kw).best
            except ValueError:
                pass
        joint = autoconfigure(cal, recompute=None, shard_optimizer=None, gpu_memory_bytes=cap, **kw).best
        assert cap is None or joint.memory_bytes <= cap
        fastest = min(b.minibatch_s for b in restricted.values())
        assert joint.minibatch_s <= fastest + 1e-12
        # what it recomputes or shards buys time: no plan without it is as fast
        if joint.config.recompute and joint.num_stages > 1:
            assert all(b.minibatch_s > joint.minibatch_s for (r, _), b in restricted.items() if not r), cap
        if joint.config.shard_optimizer:
            assert all(b.minibatch_s > joint.minibatch_s for (_, sh), b in restricted.items() if not sh), cap
    assert joint.config.shard_optimizer or joint.num_stages > 2, "the tightest cap needs sharding or depth"
