"""Mixed VM types in one job (issue #19): uneven replica shares (virtual nodes) and uneven
pipelines (per-stage speeds). Planning pieces against brute force / independent references;
multi-process runs against a 1×1 reference (bit-identical in deterministic mode)."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch
from distributed import check_ok, run_world

from varuna.core.batching import check_shares, microbatch_counts, plan_microbatches, proportional_shares
from varuna.core.env import RunPlan
from varuna.core.partition import balanced_partition, balanced_stages, check_speeds, stage_costs
from varuna.runtime.config import VarunaConfig, adopt_plan
from varuna.runtime.determinism import TreeAccumulator, combine_nodes, tree_levels

WORKER = Path(__file__).parent / "workers" / "det_worker.py"


def compositions(n: int, parts: int):
    """Every way to write n as an ordered sum of ``parts`` counts >= 1."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


# ------------------------------------------------------------------ replica shares (virtual nodes)


def test_shares_regroup_the_same_micro_batches():
    for M, m in [(12, 2), (13, 3), (8, 1), (7, 7), (10, 4)]:
        whole = plan_microbatches(M, m, 1)[0]  # the micro-batches of a 1-replica run
        n = len(whole)
        for D in range(1, min(n, 4) + 1):
            for shares in compositions(n, D):
                plan = plan_microbatches(M, m, D, shares)
                assert [len(p) for p in plan] == list(shares)
                assert [mb for p in plan for mb in p] == whole, (M, m, shares)
                counts, last = microbatch_counts(M, m, D, shares)
                assert counts == shares
                assert last == tuple(p[-1].size for p in plan)


@pytest.mark.parametrize(
    "shares,needle",
    [((3, 2), "sum to 5"), ((4,), "D=2"), ((4, 0), "without micro-batches"), ((2.0, 2), "whole numbers")],
)
def test_bad_shares_are_one_line_naming_the_fix(shares, needle):
    with pytest.raises(ValueError) as e:
        plan_microbatches(8, 2, 2, shares)
    msg = str(e.value)
    assert needle in msg and "summing to 4" in msg and "\n" not in msg


def test_config_and_engine_plan_refuse_bad_shares_and_speeds():
    for bad in [(0, 2), (1.5, 2), ()]:
        with pytest.raises(ValueError, match="replica_shares"):
            VarunaConfig(global_batch_size=8, micro_batch_size=2, replica_shares=bad).validate()
    for bad in [(1.0, 0.0), (1.0, float("nan")), (True, 1.0), ()]:
        with pytest.raises(ValueError, match="stage_speeds"):
            VarunaConfig(global_batch_size=8, micro_batch_size=2, stage_speeds=bad).validate()
    cfg = VarunaConfig(global_batch_size=8, micro_batch_size=2, replica_shares=[3, 1], stage_speeds=[1, 2.5])
    cfg.validate()
    assert (cfg.replica_shares, cfg.stage_speeds) == ((3, 1), (1, 2.5))
    assert "P=3" in check_speeds([1.0, 2.0], 3)
    assert check_speeds([1.0, 2.0], 2) is None


def test_proportional_shares():
    # Equal speeds give the even split (the independent rule of microbatch_counts).
    for n in range(1, 13):
        for D in range(1, n + 1):
            assert proportional_shares([1.0] * D, n) == microbatch_counts(n, 1, D)[0]
    rng = random.Random(1)
    for _ in range(300):
        D = rng.randint(1, 5)
        n = rng.randint(D, 30)
        speeds = [rng.choice([1.0, 1.6, 2.0, 0.5, 3.3]) for _ in range(D)]
        s = proportional_shares(speeds, n)
        assert check_shares(s, n, D) is None
        # Largest remainders: every share is within one of its ideal (after the one each).
        for d in range(D):
            ideal = 1 + (n - D) * speeds[d] / sum(speeds)
            assert abs(s[d] - ideal) < 1, (speeds, n, s)
        # A faster replica never gets fewer micro-batches.
        for a, b in itertools.permutations(range(D), 2):
            if speeds[a] > speeds[b]:
                assert s[a] >= s[b]
    with pytest.raises(ValueError, match="cannot give each of 3 replicas"):
        proportional_shares([1, 1, 1], 2)


def test_run_plan_carries_shares_and_speeds():
    plan = RunPlan(global_batch_size=8, replica_shares=(3, 1), stage_speeds=(1.0, 1.6))
    env = plan.to_env()
    assert env["VARUNA_REPLICA_SHARES"] == "3,1" and env["VARUNA_STAGE_SPEEDS"] == "1.0,1.6"
    assert RunPlan.from_env(env) == plan
    cfg = VarunaConfig(global_batch_size=8, micro_batch_size=2)
    adopt_plan(cfg, RunPlan.from_env(env))
    assert (cfg.pipeline.replica_shares, cfg.pipeline.stage_speeds) == ((3, 1), (1.0, 1.6))
    with pytest.raises(ValueError, match="VARUNA_STAGE_SPEEDS='1;2' is not a comma-separated list"):
        RunPlan.from_env({"VARUNA_STAGE_SPEEDS": "1;2"})


def test_canonical_tree_does_not_depend_on_uneven_shares():
    """The deterministic reduction with any contiguous shares gives the bits of one replica's tree,
    and no replica ever holds more partial nodes than canonical_allreduce's exchange has rows."""
    rng = random.Random(0)
    for n in range(1, 10):
        vals = [torch.randn(32) * 10 ** rng.randint(-4, 4) for _ in range(n)]
        whole = TreeAccumulator(n, 0, n)
        for i in range(n):
            whole.add(i, vals[i])
        ref = whole.result()
        for D in range(1, min(n, 4) + 1):
            for shares in compositions(n, D):
                nodes, lo = {}, 0
                for cnt in shares:
                    acc = TreeAccumulator(n, lo, lo + cnt)
                    order = list(range(lo, lo + cnt))
                    rng.shuffle(order)
                    for i in order:
                        acc.add(i, vals[i])
                    assert len(acc.partial_nodes()) <= 2 * (tree_levels(n) + 1)
                    nodes.update(acc.partial_nodes())
                    lo += cnt
                assert torch.equal(combine_nodes(nodes, n), ref), (n, shares)


# ------------------------------------------------------------------ uneven pipelines (stage speeds)


def brute_force(full, last, speeds, weights=None, capacity=float("inf")):
    """Least max stage time over every contiguous split into len(speeds) non-empty stages."""
    n, P = len(full), len(speeds)
    best = float("inf")
    for sizes in compositions(n, P):
        bounds = list(itertools.accumulate(sizes, initial=0))
        ranges = [(bounds[i], bounds[i + 1] - 1) for i in range(P)]
        if weights is not None and any(sum(weights[a : b + 1]) > capacity for a, b in ranges):
            continue
        best = min(best, max(stage_costs(full, last, ranges, speeds)))
    return best


def test_speed_split_is_optimal_against_brute_force():
    rng = random.Random(7)
    cases = 0
    for _ in range(400):
        n = rng.randint(1, 8)
        P = rng.randint(1, min(n, 4))
        full = [rng.choice([0.0, 1.0, 2.0, 3.5, 7.0, 10.0]) for _ in range(n)]
        last = [f * rng.choice([0.5, 0.75, 1.0]) for f in full]
        speeds = [rng.choice([0.5, 1.0, 1.6, 3.0]) for _ in range(P)]
        weights, capacity = None, float("inf")
        if rng.random() < 0.3:
            weights = [rng.randint(1, 3) for _ in range(n)]
            capacity = rng.randint(3, 8)
        ref = brute_force(full, last, speeds, weights, capacity)
        if ref == float("inf"):
            with pytest.raises(ValueError, match="keeps every stage within"):
                balanced_stages(full, last, P, speeds=speeds, weights=weights, capacity=capacity)
            continue
        ranges = balanced_stages(full, last, P, speeds=speeds, weights=weights, capacity=capacity)
        flat = [s for a, b in ranges for s in range(a, b + 1)]
        assert len(ranges) == P and flat == list(range(n)) and all(a <= b for a, b in ranges)
        if weights is not None:
            assert all(sum(weights[a : b + 1]) <= capacity for a, b in ranges)
        got = max(stage_costs(full, last, ranges, speeds))
        assert got == pytest.approx(ref, rel=1e-12, abs=1e-12), (full, last, speeds, ranges)
        cases += 1
    assert cases > 250


def test_slower_stage_gets_less_of_the_model():
    costs = [1.0] * 12
    assert balanced_partition(costs, 2) == [(0, 5), (6, 11)]
    assert balanced_partition(costs, 2, speeds=[2.0, 1.0]) == [(0, 7), (8, 11)]
    assert balanced_partition(costs, 2, speeds=[1.0, 2.0]) == [(0, 3), (4, 11)]
    assert balanced_partition(costs, 3, speeds=[1.0, 1.0, 1.0]) == balanced_partition(costs, 3)
    with pytest.raises(ValueError, match="P=2 stages; give one per stage"):
        balanced_partition(costs, 2, speeds=[1.0])


# ------------------------------------------------------------------ multi-process: same training


def run(tmp_path: Path, name: str, P: int, D: int, *flags: str, env: dict | None = None) -> dict:
    out = tmp_path / name
    check_ok(
        run_world(
            WORKER,
            P * D,
            ["--out", str(out), "--steps", "4", *flags],
            env={"VARUNA_PIPELINE_DEPTH": str(P), "VARUNA_DATA_PARALLEL": str(D), **(env or {})},
        )
    )
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    digests: dict[str, str] = {}
    for r in reports:
        assert r["losses"] == reports[0]["losses"], "ranks disagree on the loss"
        for n, d in r["digests"].items():
            assert digests.setdefault(n, d) == d, f"copies of {n} differ between ranks"
    return {"losses": reports[0]["losses"], "digests": digests, "Nm": reports[0]["Nm"],
            "stage_ranges": reports[0]["stage_ranges"]}


def same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and a["digests"] == b["digests"]


@pytest.mark.slow
def test_uneven_shares_and_speeds_train_bit_identically(tmp_path):
    """Deterministic mode: 1×2 with shares (5, 1) (config), 2×2 with (4, 2) (run-plan env) and a
    2-stage pipeline split for speeds (1, 3) and (3, 1) all give the 1×1 run's losses and weights."""
    ref = run(tmp_path, "ref", 1, 1)
    a = run(tmp_path, "a", 1, 2, "--replica-shares", "5,1")
    assert a["Nm"] == [5, 1] and same(a, ref)
    b = run(tmp_path, "b", 2, 2, env={"VARUNA_REPLICA_SHARES": "4,2", "VARUNA_STAGE_SPEEDS": "1,3"})
    assert b["Nm"] == [4, 2] and same(b, ref)
    c = run(tmp_path, "c", 2, 1, env={"VARUNA_STAGE_SPEEDS": "3,1"})
    assert same(c, ref)
    # The speeds moved the split: the faster first stage holds more segments.
    (a0, b0), _ = b["stage_ranges"]
    (c0, d0), _ = c["stage_ranges"]
    assert d0 - c0 > b0 - a0, (b["stage_ranges"], c["stage_ranges"])


@pytest.mark.slow
def test_uneven_shares_without_canonical_order(tmp_path):
    """Negative control: without the canonical reduction, shares (5, 1) and (3, 3) sum gradients in
    other orders, so the bits differ (the test above could fail); without deterministic mode the
    training is still the same up to rounding (losses within 1e-5 relative after 4 AdamW steps)."""
    even = run(tmp_path, "even", 1, 2, "--no-canonical")
    skew = run(tmp_path, "skew", 1, 2, "--no-canonical", "--replica-shares", "5,1")
    assert even["digests"] != skew["digests"]
    ref = run(tmp_path, "ref", 1, 1, "--no-deterministic")
    loose = run(tmp_path, "loose", 1, 2, "--no-deterministic", "--replica-shares", "5,1")
    assert loose["losses"] == pytest.approx(ref["losses"], rel=1e-5)


def test_launcher_forwards_shares_and_speeds_to_every_worker():
    """``VARUNA_REPLICA_SHARES=5,3 varuna-launch ...``: every worker's environment carries the plan."""
    from varuna.launch.local import LocalHost
    from varuna.launch.spec import LaunchConfig, plan_workers

    cfg = LaunchConfig(script="t.py", pipeline_depth=2, data_parallel=2)
    environ = {"VARUNA_REPLICA_SHARES": "5,3", "VARUNA_STAGE_SPEEDS": "1,1.6", "HOME": "/x"}
    hosts = [LocalHost(slots=2), LocalHost(slots=2)]
    specs = plan_workers(cfg, hosts, master_port=1, launcher_environ=environ)
    plans = {RunPlan.from_env(s.set_vars) for s in specs}
    assert plans == {RunPlan(replica_shares=(5, 3), stage_speeds=(1.0, 1.6))}


CKPT_WORKER = Path(__file__).parent / "workers" / "ckpt_worker.py"


def ckpt_run(tmp: Path, name: str, P: int, D: int, *args: str, env: dict | None = None):
    out = tmp / name
    check_ok(
        run_world(
            CKPT_WORKER,
            P * D,
            ["--out", str(out), "--pipeline-depth", str(P), "--deterministic", "--eps", "1e-8", *args],
            env={"VARUNA_PIPELINE_DEPTH": str(P), **(env or {})},
            timeout_s=180,
        )
    )
    report = json.loads((out / "rank0.json").read_text())
    params: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("rank*.pt")):
        for n, t in torch.load(f, weights_only=True).items():
            assert torch.equal(params.setdefault(n, t), t), f"copies of {n} disagree"
    return report, params


@pytest.mark.slow
def test_morph_from_a_mixed_to_a_homogeneous_cluster_is_bitwise(tmp_path):
    """2×2 with shares (3, 1) and speeds (1, 3) for steps 1–2 → checkpoint → 1×1 for steps 3–4
    equals 4 uninterrupted 1×1 steps bitwise (deterministic mode; 4 micro-batches of 2)."""
    ckpt = str(tmp_path / "ckpt")
    ref, ref_params = ckpt_run(tmp_path, "ref", 1, 1, "--ckpt-dir", str(tmp_path / "unused"), "--steps", "4")
    mixed = {"VARUNA_REPLICA_SHARES": "3,1", "VARUNA_STAGE_SPEEDS": "1,3"}
    a, _ = ckpt_run(tmp_path, "a", 2, 2, "--ckpt-dir", ckpt, "--steps", "2", "--save-at", "2", env=mixed)
    b, params = ckpt_run(tmp_path, "b", 1, 1, "--ckpt-dir", ckpt, "--steps", "4", "--resume", "1")
    assert b["first_step"] == 3
    assert a["losses"] + b["losses"] == ref["losses"], "per-step losses differ"
    assert params.keys() == ref_params.keys()
    assert [n for n in ref_params if not torch.equal(params[n], ref_params[n])] == []
