"""The pipeline runtime against an independent single-process reference (gloo, real processes).

Equality: per parameter tensor ‖a−b‖/‖b‖ ≤ 1e-5 in fp32. The reference is plain autograd over the
whole model (tests/models.py:reference_step), with dropout masks keyed by the documented rule.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import check_ok, run_world
from models import build_model, make_batch, reference_step

WORKER = Path(__file__).parent / "workers" / "grad_worker.py"
TOL = 1e-5
M, m = 10, 3  # 4 micro-batches of 3, 3, 3, 1: does not divide evenly, and D=2 splits it 2/2


def launch(tmp_path: Path, P: int, D: int, *args: str, env: dict | None = None):
    results = run_world(
        WORKER, P * D, ["--out", str(tmp_path), *args], env={"VARUNA_PIPELINE_DEPTH": str(P), **(env or {})}
    )
    return results


def load(out: Path, kind: str):
    """Every rank's gradients, parameters and report for one schedule kind."""
    ranks = []
    for f in sorted(out.joinpath(kind).glob("rank*.pt")):
        ranks.append((torch.load(f, weights_only=True), json.loads(f.with_suffix(".json").read_text())))
    assert ranks, f"no results for {kind}"
    return ranks


def assert_close(got: dict, ref: dict, what: str) -> None:
    assert got.keys() == ref.keys(), f"{what}: parameter sets differ: {sorted(got.keys() ^ ref.keys())}"
    for name, r in ref.items():
        err = ((got[name] - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert err <= TOL, f"{what}: {name} differs (relative error {err:.2e})"


def merged_grads(ranks) -> dict:
    """Gradients by name; every copy (replicas, stages sharing a tied weight) must agree."""
    out: dict = {}
    for data, _ in ranks:
        for n, g in data["grads"].items():
            if n in out:
                assert torch.allclose(out[n], g, rtol=1e-6, atol=1e-9), f"copies of {n} disagree"
            out[n] = g
    return out


def reference(kind: str = "gpt", *, clip: float | None = None, meta: bool = False):
    model = build_model(kind, meta=meta)
    if meta:
        from varuna.cutting.cutpoint import SplitState
        from varuna.cutting.split import materialize_stage, profile_model

        # The single-process run of the same init rule: materialise every segment.
        prof = profile_model(model, make_batch(kind, m), lambda out, b: out, measure=False)
        materialize_stage(
            model, prof, 0, prof.num_segments - 1, SplitState(), device=torch.device("cpu"), seed=7
        )
    loss = reference_step(model, make_batch(kind, M), M, m)
    norm = None
    if clip is not None:
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}, norm


@pytest.mark.slow
@pytest.mark.parametrize("P,D", [(1, 1), (2, 1), (4, 1), (2, 2), (3, 1)])
def test_every_layout_and_schedule_equals_single_process(tmp_path, P, D):
    check_ok(launch(tmp_path, P, D))
    ref_loss, ref_grads, _ = reference()
    for kind in ("varuna", "gpipe", "1f1b"):
        ranks = load(tmp_path, kind)
        assert len(ranks) == P * D
        for _, rep in ranks:
            assert rep["loss"] == pytest.approx(ref_loss, rel=1e-6), f"{kind}: loss on stage {rep['stage']}"
        assert_close(merged_grads(ranks), ref_grads, f"{kind} {P}x{D}")


@pytest.mark.slow
def test_glue_code_tuples_raw_parameters_and_masks(tmp_path):
    """GlueNet: masks built from the input in glue code, a raw nn.Parameter, blocks returning tuples."""
    check_ok(launch(tmp_path, 4, 1, "--model", "glue", "--schedules", "varuna"))
    ref_loss, ref_grads, _ = reference("glue")
    ranks = load(tmp_path, "varuna")
    assert ranks[-1][1]["loss"] == pytest.approx(ref_loss, rel=1e-6)
    assert_close(merged_grads(ranks), ref_grads, "glue 4x1")


@pytest.mark.slow
def test_recompute_gives_the_same_gradients_as_no_recompute(tmp_path):
    check_ok(launch(tmp_path / "norec", 2, 1, "--schedules", "gpipe,1f1b", "--no-recompute"))
    check_ok(launch(tmp_path / "rec", 2, 1, "--schedules", "gpipe,1f1b"))
    _, ref_grads, _ = reference()
    for kind in ("gpipe", "1f1b"):
        norec = merged_grads(load(tmp_path / "norec", kind))
        rec = merged_grads(load(tmp_path / "rec", kind))
        assert not any("R" in t for _, rep in load(tmp_path / "norec", kind) for t in rep["executed"][0])
        assert any("R" in t for _, rep in load(tmp_path / "rec", kind) for t in rep["executed"][0])
        assert_close(rec, norec, f"{kind} recompute vs none")
        assert_close(norec, ref_grads, f"{kind} no recompute vs reference")


@pytest.mark.slow
def test_jitter_reorders_tasks_and_gradients_stay_equal(tmp_path):
    # Heavy-tailed delivery delays (mean 40 ms) against ~1 ms tasks: the opportunistic policy must
    # run ready tasks out of the static order on some stage -- including a forward run while a
    # recomputed micro-batch waits for its late gradient (Note [Filling the wait]) -- and the
    # gradients must not change.
    deviated = filled = False
    _, ref_grads, _ = reference()
    for seed in range(4):
        out = tmp_path / f"s{seed}"
        check_ok(
            launch(out, 3, 1, "--schedules", "varuna", "--netem", f"latency=1ms,jitter=40ms,seed={seed}")
        )
        ranks = load(out, "varuna")
        assert_close(merged_grads(ranks), ref_grads, f"jitter seed {seed}")
        deviated |= any(rep["executed"][0] != rep["static"] for _, rep in ranks)
        filled |= any(
            a.startswith("R") and b.startswith("F")
            for _, rep in ranks
            for a, b in zip(rep["executed"][0], rep["executed"][0][1:])
        )
        if deviated and filled:
            break
    assert filled, "no stage ever ran a forward while waiting for a late gradient"
    assert deviated, "no stage ever deviated from its static list under heavy jitter"


@pytest.mark.slow
def test_global_norm_clipping_equals_clip_grad_norm(tmp_path):
    check_ok(launch(tmp_path, 2, 2, "--schedules", "varuna", "--max-grad-norm", "0.05"))
    _, ref_grads, ref_norm = reference(clip=0.05)
    ranks = load(tmp_path, "varuna")
    for _, rep in ranks:
        assert rep["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert ref_norm > 0.05, "the test must actually clip"
    assert_close(merged_grads(ranks), ref_grads, "clipped 2x2")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_planted_inf_on_one_stage_skips_the_step_everywhere(tmp_path, precision):
    check_ok(
        launch(
            tmp_path,
            2,
            2,
            "--schedules",
            "varuna",
            "--plant-inf-stage",
            "1",
            "--lr",
            "0.1",
            "--precision",
            precision,
        )
    )
    ranks = load(tmp_path, "varuna")
    for data, rep in ranks:
        assert rep["skipped"], f"rank on stage {rep['stage']} replica {rep['replica']} stepped"
        for n, p in data["params"].items():
            assert torch.equal(p, data["before"][n]), f"{n} changed although the step was skipped"
        if precision == "fp16":
            assert rep["loss_scale"] == 2.0**15  # halved once, identically on every rank
    # Negative control: without the planted inf the same run does update the parameters.
    check_ok(launch(tmp_path / "ctl", 2, 2, "--schedules", "varuna", "--lr", "0.1"))
    for data, rep in load(tmp_path / "ctl", "varuna"):
        assert not rep["skipped"]
        assert any(not torch.equal(p, data["before"][n]) for n, p in data["params"].items())


@pytest.mark.slow
def test_meta_model_materialises_only_its_stage_and_trains_like_one_process(tmp_path):
    check_ok(launch(tmp_path, 4, 1, "--meta", "--schedules", "varuna"))
    ref_loss, ref_grads, _ = reference(meta=True)
    ranks = load(tmp_path, "varuna")
    assert_close(merged_grads(ranks), ref_grads, "meta 4x1")
    assert ranks[-1][1]["loss"] == pytest.approx(ref_loss, rel=1e-6)
    total = sum(g.numel() * 4 for g in ref_grads.values())
    for data, rep in ranks:
        stage_bytes = sum(p.numel() * p.element_size() for p in data["params"].values())
        # Resident bytes = the stage's own parameters (+ a few bytes per stride-0 placeholder).
        assert stage_bytes <= data["resident_bytes"] <= stage_bytes + 4096, rep["stage"]
        assert data["resident_bytes"] < 0.6 * total


@pytest.mark.slow
@pytest.mark.parametrize(
    "P,D,args,message",
    [
        (3, 1, ["--model", "onecut"], "pipeline depth 3 exceeds the 2 segments"),
        (2, 1, ["--model", "nocut"], "has no CutPoint"),
        (
            1,
            2,
            ["--model", "onecut", "--global-batch-size", "1", "--micro-batch-size", "1"],
            "global batch size 1 is smaller than data-parallel degree D=2",
        ),
        (2, 1, ["--model", "twice"], "called twice in one forward"),
    ],
)
def test_bad_configurations_fail_with_one_clear_line(tmp_path, P, D, args, message):
    results = run_world(
        WORKER,
        P * D,
        ["--out", str(tmp_path), "--schedules", "varuna", *args],
        env={"VARUNA_PIPELINE_DEPTH": str(P), "VARUNA_DATA_PARALLEL": str(D)},
        timeout_s=120,
    )
    for r in results:
        assert r.returncode == 2, r.stdout
        errors = [line for line in r.stdout.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], r.stdout
        assert "Traceback" not in r.stdout


def test_world_size_must_equal_p_times_d():
    import varuna

    model = build_model("onecut")
    with pytest.raises(ValueError, match=r"world size 1 != pipeline depth 2 x data parallel 1"):
        varuna.Engine(
            model,
            varuna.VarunaConfig(global_batch_size=4, micro_batch_size=2, pipeline_depth=2, data_parallel=1),
            example_batch=make_batch("onecut", 4),
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        )


def test_single_process_engine_equals_reference():
    """Fast in-process check (P = D = 1) of the same property the slow tests check everywhere."""
    import varuna

    model = build_model("gpt")
    batch = make_batch("gpt", M)
    eng = varuna.Engine(
        model,
        varuna.VarunaConfig(global_batch_size=M, micro_batch_size=m, seed=7),
        example_batch=batch,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0),
    )
    r = eng.train_step(batch)
    ref_loss, ref_grads, _ = reference()
    assert r.loss == pytest.approx(ref_loss, rel=1e-6)
    assert_close({n: p.grad for n, p in eng.named_parameters()}, ref_grads, "1x1 in-process")
    eng.close()


def test_wrong_batch_size_is_a_clear_error():
    import varuna

    model = build_model("onecut")
    eng = varuna.Engine(
        model,
        varuna.VarunaConfig(global_batch_size=4, micro_batch_size=2),
        example_batch=make_batch("onecut", 4),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
    )
    with pytest.raises(ValueError, match="got a batch of 6 examples but global_batch_size is 4"):
        eng.train_step(make_batch("onecut", 6))
    eng.close()
