"""Deterministic mode: bit-identical weights and losses at any P×D, with negative controls."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from distributed import check_ok, run_world

from varuna.runtime.determinism import TreeAccumulator, combine_nodes

WORKER = Path(__file__).parent / "workers" / "det_worker.py"


def run(tmp_path: Path, P: int, D: int, *flags: str) -> tuple[list[float], dict[str, str]]:
    out = tmp_path / f"{P}x{D}{''.join(flags)}"
    check_ok(
        run_world(
            WORKER,
            P * D,
            ["--out", str(out), *flags],
            env={"VARUNA_PIPELINE_DEPTH": str(P), "VARUNA_DATA_PARALLEL": str(D)},
        )
    )
    losses, digests = None, {}
    for f in sorted(out.glob("rank*.json")):
        r = json.loads(f.read_text())
        losses = losses or r["losses"]
        assert r["losses"] == losses, "ranks disagree on the loss"
        for n, d in r["digests"].items():
            assert digests.setdefault(n, d) == d, f"copies of {n} differ between ranks"
    return losses, digests


def test_tree_sum_does_not_depend_on_replicas_or_arrival_order():
    rng = random.Random(0)
    for n in (1, 2, 5, 7, 12, 16):
        vals = [torch.randn(64) * 10 ** rng.randint(-4, 4) for _ in range(n)]
        whole = TreeAccumulator(n, 0, n)
        for i in range(n):
            whole.add(i, vals[i])
        ref = whole.result()
        for d in range(1, n + 1):
            cuts = [n * k // d for k in range(d + 1)]
            nodes = {}
            for k in range(d):
                acc = TreeAccumulator(n, cuts[k], cuts[k + 1])
                order = list(range(cuts[k], cuts[k + 1]))
                rng.shuffle(order)
                for i in order:
                    acc.add(i, vals[i])
                nodes.update(acc.partial_nodes())
            assert torch.equal(combine_nodes(nodes, n), ref), (n, d)
    # Negative control: the canonical tree is not the naive sequential sum (else the test is vacuous).
    vals = [torch.randn(256) * 10 ** rng.randint(-4, 4) for _ in range(7)]
    acc = TreeAccumulator(7, 0, 7)
    for i, v in enumerate(vals):
        acc.add(i, v)
    assert not torch.equal(acc.result(), sum(vals[1:], vals[0]))


@pytest.mark.slow
def test_weights_and_losses_are_bit_identical_at_every_layout(tmp_path):
    ref_losses, ref_digests = run(tmp_path, 1, 1)
    for P, D in [(2, 1), (4, 1), (2, 2), (1, 2), (3, 1)]:
        losses, digests = run(tmp_path, P, D)
        assert losses == ref_losses, f"{P}x{D}: per-step losses differ"
        assert digests == ref_digests, f"{P}x{D}: parameters differ: " + ", ".join(
            n for n in ref_digests if digests.get(n) != ref_digests[n]
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag,P,D", [("--no-canonical", 2, 2), ("--unkeyed-rng", 2, 1), ("--unkeyed-data", 1, 2)]
)
def test_disabling_each_mechanism_breaks_equality(tmp_path, flag, P, D):
    ref_losses, ref_digests = run(tmp_path, 1, 1, flag)
    losses, digests = run(tmp_path, P, D, flag)
    assert digests != ref_digests, f"{flag}: still bit-identical, so the test could not detect its loss"


CKPT_WORKER = Path(__file__).parent / "workers" / "ckpt_worker.py"


def ckpt_run(tmp: Path, name: str, P: int, D: int, *args: str):
    out = tmp / name
    check_ok(
        run_world(
            CKPT_WORKER,
            P * D,
            ["--out", str(out), "--pipeline-depth", str(P), "--deterministic", "--eps", "1e-8", *args],
            env={"VARUNA_PIPELINE_DEPTH": str(P)},
            timeout_s=180,
        )
    )
    reports, params = [], {}
    for f in sorted(out.glob("rank*.json")):
        reports.append(json.loads(f.read_text()))
        for n, t in torch.load(f.with_suffix(".pt"), weights_only=True).items():
            assert torch.equal(params.setdefault(n, t), t), f"copies of {n} disagree"
    return reports[0], params


@pytest.mark.slow
def test_morphing_through_checkpoints_equals_the_uninterrupted_run_bitwise(tmp_path):
    """2×2 for steps 1–2 → checkpoint → 4×1 for steps 3–4 → checkpoint → 1×1 for steps 5–6."""
    ckpt = str(tmp_path / "ckpt")
    ref, ref_params = ckpt_run(tmp_path, "ref", 1, 1, "--ckpt-dir", str(tmp_path / "unused"), "--steps", "6")
    a, _ = ckpt_run(tmp_path, "a", 2, 2, "--ckpt-dir", ckpt, "--steps", "2", "--save-at", "2")
    b, _ = ckpt_run(
        tmp_path, "b", 4, 1, "--ckpt-dir", ckpt, "--steps", "4", "--resume", "1", "--save-at", "4"
    )
    c, params = ckpt_run(tmp_path, "c", 1, 1, "--ckpt-dir", ckpt, "--steps", "6", "--resume", "1")
    assert (b["first_step"], c["first_step"]) == (3, 5)
    assert a["losses"] + b["losses"] + c["losses"] == ref["losses"], "per-step losses differ"
    assert params.keys() == ref_params.keys()
    assert [n for n in ref_params if not torch.equal(params[n], ref_params[n])] == []
