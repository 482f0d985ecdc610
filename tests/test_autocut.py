"""Tests of automatic cut-points (varuna/cutting/autocut.py) and of splitting auto-cut models in the engine.

Fast tests run in one process: the choice of boundaries (validity, balance on known costs, one
timing-based check on emulated-device blocks), insertion without renaming parameters, and the
engine at P=1. ``slow`` tests train real 2- and 4-stage pipelines (gloo, one process per stage)
and compare every gradient with a single-process reference on the same auto-cut model.
"""

from __future__ import annotations

import copy
import io
import itertools
import json
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "workers"))

from autocut_worker import GLOBAL_BATCH, MICRO_BATCH, SEED, build  # noqa: E402
from distributed import check_ok, run_world  # noqa: E402
from models import reference_step  # noqa: E402

import varuna  # noqa: E402
from varuna.cutting.autocut import (  # noqa: E402
    CUT_ATTR,
    _auto_cut_modules,
    apply_cutpoints,
    auto_cutpoints,
    choose_cuts,
    remove_cutpoints,
)
from varuna.cutting.split import profile_model  # noqa: E402
from varuna.cutting.tracer import trace_model  # noqa: E402
from varuna.testing.emulated import EmulatedBlock, EmulatedModel  # noqa: E402

WORKER = ROOT / "tests" / "workers" / "autocut_worker.py"


def _micro(batch, n: int = MICRO_BATCH):
    return tuple(t[:n] for t in batch)


# ----------------------------------------------------------------------------------------------
# choosing: balance on known costs


def _best_split(positions, total, K):
    """Brute force: the smallest achievable largest segment with K cuts among ``positions``."""
    best = None
    for combo in itertools.combinations(range(len(positions)), K):
        marks = [0.0, *[positions[i] for i in combo], total]
        m = max(marks[i + 1] - marks[i] for i in range(len(marks) - 1))
        best = m if best is None else min(best, m)
    return best


def _segments(positions, total, picked):
    marks = [0.0, *[positions[i] for i in picked], total]
    return [marks[i + 1] - marks[i] for i in range(len(marks) - 1)]


def test_choose_cuts_is_optimal_on_random_costs() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        costs = [rng.choice([1, 1, 2, 4, 0.5, 3]) for _ in range(n + 1)]
        positions = list(itertools.accumulate(costs[:-1]))
        total = sum(costs)
        acts = [rng.choice([1, 2, 4]) for _ in range(n)]
        K = rng.randint(1, n)
        best = _best_split(positions, total, K)
        exact = choose_cuts(positions, total, acts, K, balance_slack=0.0)
        assert len(exact) == K and exact == sorted(set(exact))
        assert max(_segments(positions, total, exact)) == pytest.approx(best)
        slack = choose_cuts(positions, total, acts, K)
        assert max(_segments(positions, total, slack)) <= best * 1.05 + 1e-9
        # within the slack, the smallest summed activation wins
        ok = [c for c in itertools.combinations(range(n), K)
              if max(_segments(positions, total, c)) <= best * 1.05 + 1e-9]
        assert sum(acts[i] for i in slack) == min(sum(acts[i] for i in c) for c in ok)


def test_choose_cuts_prefers_small_activations_within_the_slack() -> None:
    # Cutting at 1.0 or 1.04 is about as balanced; the second carries a 4x smaller activation.
    assert choose_cuts([1.0, 1.04], 2.0, [400, 100], 1) == [1]
    assert choose_cuts([1.0, 1.04], 2.0, [400, 100], 1, balance_slack=0.0) == [0]
    assert choose_cuts([1.0, 1.5], 2.0, [400, 100], 1) == [0]  # 1.5 would be far off balance


def _emulated(costs_s, width: int = 4) -> EmulatedModel:
    torch.manual_seed(0)
    blocks = [EmulatedBlock(c, width) for c in costs_s]
    return EmulatedModel(blocks, [nn.Identity() for _ in range(len(blocks) - 1)])  # no CutPoints


def _known_segments(plan, costs) -> list[float]:
    cut_after = [int(m.split(".")[1]) for m in plan.module_names]
    marks = [0, *[i + 1 for i in cut_after], len(costs)]
    return [sum(costs[marks[i]:marks[i + 1]]) for i in range(len(marks) - 1)]


@pytest.mark.parametrize("costs, K", [
    ([1, 1, 4, 1, 1, 1, 1, 4, 2], 3),     # 16 = 4 + 4 + 4 + 4
    ([2, 2, 4, 1, 1, 2, 2, 2], 3),        # 1x,1x,4x... style, perfect split exists
    ([1, 1, 4, 1, 1, 1, 1], 1),
    ([3, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2),
    ([1, 1, 10, 1, 1], 2),                # no balanced split exists: must still be the best one
    ([5, 1, 1, 1, 1, 1], 3),
])
def test_known_costs_give_balanced_segments(costs, K) -> None:
    model = _emulated([0.0] * len(costs))
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    plan = auto_cutpoints(model, (x, y), K, module_costs={f"blocks.{i}": c for i, c in enumerate(costs)},
                          verbose=False)
    segs = _known_segments(plan, costs)
    assert len(segs) == K + 1 and plan.segment_costs == pytest.approx(segs)
    mean = sum(segs) / len(segs)
    positions = list(itertools.accumulate(costs))  # a cut after any block is a valid boundary
    best = _best_split(positions, sum(costs), K)
    assert max(segs) <= best * 1.05 + 1e-9  # equal activations here: in fact exactly the best
    if best / mean <= 1.15:
        assert max(segs) / mean <= 1.15
    assert plan.imbalance == pytest.approx(max(segs) / mean)


def test_measured_time_balances_emulated_blocks_of_known_cost() -> None:
    """Timing-based: blocks sleep 5-20 ms (1x,1x,2x,4x... of 5 ms); judged on the known costs."""
    unit = 0.005
    costs = [2, 2, 4, 1, 1, 2, 2, 2]  # a perfect 4-way split exists: [2,2] [4] [1,1,2] [2,2]
    model = _emulated([c * unit for c in costs])
    plan = auto_cutpoints(model, (torch.randn(2, 4), torch.randn(2, 4)), 3, verbose=False)
    assert plan.cost_unit == "s"
    segs = _known_segments(plan, costs)
    assert max(segs) / (sum(segs) / len(segs)) <= 1.15, (plan.module_names, segs)


# ----------------------------------------------------------------------------------------------
# where cuts may go, and how they are inserted


def test_gpt_without_cutpoints_gets_valid_cuts_and_keeps_names() -> None:
    model, batch = build("gpt")
    mb = _micro(batch)
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    torch.manual_seed(5)
    before = float(model(*mb).detach())
    plan = auto_cutpoints(model, mb, 3, cost="flop", verbose=False)
    assert plan.module_names == ["blocks.0", "blocks.1", "blocks.2"]  # FLOPs: equal blocks, heavy head
    valid = [c[0] for c in plan.candidates]
    assert valid == ["wte", "drop", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f"]
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    torch.manual_seed(5)
    assert float(model(*mb).detach()) == before  # outside the engine a CutPoint is the identity
    # The engine's dry run sees the CutPoints, in call order, and each chosen block inside one segment.
    prof = profile_model(model, mb, lambda out, b: out, measure=False)
    assert prof.cutpoint_names == [f"blocks.{i}.{CUT_ATTR}" for i in range(3)]
    assert not {"blocks.0", "blocks.1", "blocks.2"} & prof.spanning_modules
    assert prof.shared_params() == {"wte.weight": (0, 3)}
    report = trace_model(model, mb)
    assert report.ok and [(p.name, p.segments) for p in report.shared_params] == [("wte.weight", [0, 3])]


def test_residual_inside_a_block_is_not_a_boundary() -> None:
    from varuna.cutting.autocut import _evaluate, _group
    from varuna.cutting.recorder import record_forward

    model, batch = build("gpt")
    rec = record_forward(model, _micro(batch), None)
    cands = {c.call.name: c for c in _evaluate(rec, MICRO_BATCH, explain=True)}
    assert not cands["blocks.0.attn"].valid and "live across it" in cands["blocks.0.attn"].reason
    assert not cands["blocks.0.mlp"].valid
    assert cands["blocks.0"].valid
    assert [c.name for c in _group(list(cands.values()))][:3] == ["wte", "drop", "blocks.0"]


def test_tuple_blocks_route_their_first_element() -> None:
    model, batch = build("tuple")
    mb = _micro(batch)
    torch.manual_seed(3)
    before = float(model(*mb).detach())
    plan = auto_cutpoints(model, mb, 3, cost="flop", verbose=False)
    assert plan.module_names == ["blocks.0", "blocks.1", "blocks.2"]
    h, attn = model.blocks[0](torch.randn(3, 16), torch.ones(3, 1))  # still a (hidden, attn) tuple
    assert h.shape == attn.shape == (3, 16)
    torch.manual_seed(3)
    assert float(model(*mb).detach()) == before
    assert trace_model(model, mb).ok


def test_tuple_blocks_whose_other_outputs_are_read_later_are_not_boundaries() -> None:
    model, batch = build("tuple-read-attn")
    plan = auto_cutpoints(model, _micro(batch), 3, cost="flop", verbose=False)
    assert plan.module_names == ["inp"]  # every block's attn is read by the loss: no block boundary


def test_resnet_cuts_at_block_ends() -> None:
    model, batch = build("resnet")
    mb = _micro(batch)
    keys = list(model.state_dict())
    plan = auto_cutpoints(model, mb, 3, cost="flop", verbose=False)
    assert all(m.startswith("stages.") or m.startswith("stem.") for m in plan.module_names), plan.module_names
    assert {c[0] for c in plan.candidates} >= {f"stages.{i}.{j}" for i in range(3) for j in range(2)}
    assert not any(".conv" in c[0] or ".bn" in c[0] for c in plan.candidates)  # inside a residual block
    assert list(model.state_dict()) == keys
    report = trace_model(model, mb)
    assert report.ok and report.shared_params == [] and report.buffers == []
    assert report.num_segments == 4


def test_plan_is_printed_with_time_and_activation_size(capsys: pytest.CaptureFixture[str]) -> None:
    model, batch = build("tuple")
    plan = auto_cutpoints(model, _micro(batch), 2)
    out = capsys.readouterr().out
    assert "varuna.auto_cutpoints: 2 cut-point(s)" in out and "ms" in out
    for c in plan.choices:
        assert c.module in out and str(c.act_bytes) in out
        assert c.act_shape[0] == 3 and c.act_bytes == 4 * c.act_shape[0] * c.act_shape[1]
    data = json.loads(plan.to_json())
    assert [c["module"] for c in data["choices"]] == plan.module_names


def test_apply_remove_and_deepcopy() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    cls = type(model[1])
    cps = apply_cutpoints(model, ["1"])
    assert type(model[1]) is not cls and isinstance(model[1], cls) and type(model[1]).__name__ == "ReLU"
    assert model[1].varuna_cut is cps[0]
    twin = copy.deepcopy(model)
    assert _auto_cut_modules(twin) == ["1"]
    x = torch.randn(2, 4)
    assert torch.equal(twin(x), model(x))
    buf = io.BytesIO()
    torch.save(model, buf)  # whole-model pickles work too
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert _auto_cut_modules(loaded) == ["1"] and torch.equal(loaded(x), model(x))
    assert isinstance(loaded[1].varuna_cut, varuna.CutPoint)
    assert remove_cutpoints(model) == ["1"]
    assert type(model[1]) is cls and not any(isinstance(m, varuna.CutPoint) for m in model.modules())
    with pytest.raises(ValueError, match="'9' matches no module"):
        apply_cutpoints(model, ["9"])
    with pytest.raises(ValueError, match="Sequential"):
        apply_cutpoints(nn.Sequential(nn.Sequential(nn.Linear(2, 2))), ["0"])


def test_replanning_replaces_earlier_auto_cuts() -> None:
    model, batch = build("tuple")
    auto_cutpoints(model, _micro(batch), 3, cost="flop", verbose=False)
    plan = auto_cutpoints(model, _micro(batch), 1, cost="flop", verbose=False)
    assert _auto_cut_modules(model) == plan.module_names and len(plan.module_names) == 1


def test_meta_model_is_planned_on_flops() -> None:
    from models import build_model, make_batch

    model = build_model("gpt", meta=True)
    model.cuts = nn.ModuleList(nn.Identity() for _ in model.cuts)
    plan = auto_cutpoints(model, make_batch("gpt", 3), 1, verbose=False)
    assert plan.cost_unit == "flop" and plan.module_names == ["blocks.1"]


# ----------------------------------------------------------------------------------------------
# clear errors


def test_one_big_module_has_no_valid_boundary() -> None:
    class OneBig(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 1))

        def forward(self, x, y):
            return F.mse_loss((x @ self.w).squeeze(-1), y)

    with pytest.raises(ValueError, match="no valid cut boundary") as e:
        auto_cutpoints(OneBig(), (torch.randn(2, 8), torch.randn(2)), 1)
    assert "calls no submodule" in str(e.value)


def test_dense_connections_leave_no_boundary_and_say_why() -> None:
    class Dense(nn.Module):
        """Every layer reads the input and all earlier outputs (DenseNet style)."""

        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))
            self.layers = nn.ModuleList(nn.Linear(8 * (i + 1), 8) for i in range(3))

        def forward(self, x):
            feats = [x * self.scale]
            for layer in self.layers:
                feats.append(torch.tanh(layer(torch.cat(feats, dim=-1))))
            return torch.cat(feats, dim=-1).pow(2).mean()

    with pytest.raises(ValueError) as e:
        auto_cutpoints(Dense(), torch.randn(2, 8), 1)
    msg = str(e.value)
    assert "no valid cut boundary" in msg and "live across it" in msg and "'layers.0'" in msg


def test_bad_arguments_are_value_errors() -> None:
    model, batch = build("tuple")
    with pytest.raises(ValueError, match="max_cuts"):
        auto_cutpoints(model, _micro(batch), 0)
    with pytest.raises(ValueError, match="not modules"):
        auto_cutpoints(model, _micro(batch), 1, module_costs={"nope": 1.0})
    with pytest.raises(ValueError, match="already has 3 CutPoint"):
        auto_cutpoints(build("chain")[0], _micro(batch), 1)


# ----------------------------------------------------------------------------------------------
# the engine


def _grads_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    assert got, "no gradients"
    for n, g in got.items():
        r = ref[n]
        err = float((g - r).norm() / r.norm().clamp_min(1e-30))
        assert err <= tol, f"{n}: relative error {err:.2e}"


def _reference(name: str, cut_modules: list[str]) -> dict[str, torch.Tensor]:
    model, batch = build(name)
    if cut_modules:
        apply_cutpoints(model, cut_modules)
    reference_step(model, batch, GLOBAL_BATCH, MICRO_BATCH, seed=SEED, step=1)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_engine_single_stage_with_auto_cutpoints_matches_reference() -> None:
    model, batch = build("gpt")
    engine = varuna.Engine(
        model,
        varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=SEED,
                            auto_cutpoints=2, stop_signals=()),
        example_batch=batch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0),
    )
    try:
        cut = _auto_cut_modules(model)
        assert len(cut) == 2 and engine.profile.num_cutpoints == 2
        engine.train_step(batch)
        got = {n: p.grad for n, p in engine.named_parameters()}
    finally:
        engine.close()
    _grads_close(got, _reference("gpt", cut))


def _run(models: str, world: int, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    results = run_world(WORKER, world, ["--out", str(out), "--models", models],
                        env={"VARUNA_PIPELINE_DEPTH": str(world)}, timeout_s=120)
    check_ok(results)
    return out


def _check_trained(out: Path, name: str, world: int) -> list[dict]:
    infos = [json.loads((out / name / f"rank{r}.json").read_text()) for r in range(world)]
    assert all("refused" not in i for i in infos), infos
    cut = infos[0]["auto_cut_modules"]
    assert all(i["auto_cut_modules"] == cut for i in infos)  # every rank applied rank 0's plan
    assert all(i["param_names_after"] == i["param_names"] for i in infos)  # checkpoint keys unchanged
    assert [i["stage"] for i in infos] == list(range(world))
    ref = _reference(name, cut)
    for r in range(world):
        _grads_close(torch.load(out / name / f"rank{r}.pt"), ref)
    covered = set().union(*(torch.load(out / name / f"rank{r}.pt").keys() for r in range(world)))
    assert covered == set(ref)  # every parameter was trained by some stage
    return infos


@pytest.mark.slow
def test_two_stages_auto_cut_models_match_reference_and_hidden_deps_refused(tmp_path: Path) -> None:
    out = _run("gpt:1,tuple:1,resnet:1,planted,skip,counter", 2, tmp_path)
    gpt = _check_trained(out, "gpt", 2)
    assert len(gpt[0]["auto_cut_modules"]) == 1
    assert all("wte.weight" in torch.load(out / "gpt" / f"rank{r}.pt") for r in range(2))  # tied: both ends
    tup = _check_trained(out, "tuple", 2)
    assert tup[0]["auto_cut_modules"][0].startswith(("blocks.", "inp", "out"))
    _check_trained(out, "resnet", 2)
    planted = _check_trained(out, "planted", 2)  # late block reads segment 0's buffer: still correct
    assert planted[0]["cutpoints"] == ["cuts.0", "cuts.1", "cuts.2"]
    for r in range(2):
        msg = json.loads((out / "skip" / f"rank{r}.json").read_text())["refused"]
        assert "output of module 'blocks.0'" in msg and "cut(x, extra)" in msg
        msg = json.loads((out / "counter" / f"rank{r}.json").read_text())["refused"]
        assert "buffer 'counter' is written in segment 0" in msg


@pytest.mark.slow
def test_four_stages_auto_cut_gpt_matches_reference(tmp_path: Path) -> None:
    out = _run("gpt:3", 4, tmp_path)
    infos = _check_trained(out, "gpt", 4)
    assert len(infos[0]["auto_cut_modules"]) == 3
    assert [tuple(r) for r in infos[0]["stage_ranges"]] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert not set(infos[0]["auto_cut_modules"]) & set(infos[0]["spanning"])
