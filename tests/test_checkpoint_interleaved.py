"""Checkpoints of interleaved runs (chunks = v model chunks per process, docs/interleaved.md).

A process of an interleaved run holds v non-contiguous segments (virtual stages d, d+P, ...);
its checkpoint files are still keyed by parameter name, so a run saved at chunks = 2 resumes at
the same layout or at any other P×D and kind, and the reverse. References: the uninterrupted run
(same layout) and the single-process run, both in deterministic mode, where every layout trains
bit for bit alike (docs/determinism.md) — so every comparison below is bit-exact, stronger than
the 1e-5 tolerance test_checkpoint.py allows without deterministic mode. The model is the tiny GPT
of tests/models.py (4 cut-points, LM head tied to the embedding: the tied weight lives on process
0's first chunk and on process P-1's last one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import check_ok, run_world

from varuna.runtime.checkpoint import plan_shards

WORKER = Path(__file__).parent / "workers" / "ckpt_worker.py"
DET = ["--deterministic", "--eps", "1e-8", "--steps", "5"]
IL = ["--schedule", "varuna-interleaved", "--chunks", "2"]


# ---------------------------------------------------------------------------------------------
# The shard plan (fast)


def _process_of_segment(stage_ranges, P):
    """Independent of plan_shards: the process holding each segment (virtual stage j on j % P)."""
    return {s: j % P for j, (a, b) in enumerate(stage_ranges) for s in range(a, b + 1)}


@pytest.mark.parametrize("P,v,D", [(2, 2, 1), (2, 2, 2), (3, 2, 2), (2, 3, 1)])
def test_plan_gives_each_process_the_files_of_all_its_chunks(P, v, D):
    nseg = P * v + 1
    ranges = [(j, j) for j in range(P * v - 1)] + [(P * v - 1, nseg - 1)]
    segs = {f"blk{s}.w": (s,) for s in range(nseg)}
    segs.update({f"blk{s}.b": (s,) for s in range(nseg)})
    segs["wte"] = (0, nseg - 1)  # tied: first and last segment (different processes)
    sizes = {n: 4 * (i + 1) for i, n in enumerate(segs)}
    plan = plan_shards(param_segments=segs, param_bytes=sizes, stage_ranges=ranges, data_parallel=D,
                       pipeline_depth=P)
    owner = _process_of_segment(ranges, P)
    held = [n for s in plan for n in s.params]
    assert sorted(held) == sorted(segs), "every parameter in exactly one file"
    for s in plan:
        assert 0 <= s.stage < P and 0 <= s.replica < D
        assert s.stage == owner[s.segment], f"{s.name} written by process {s.stage}, not {owner[s.segment]}"
        assert all(segs[n][0] == s.segment for n in s.params), "a parameter lives with its first segment"
    assert [s.params for s in plan if "wte" in s.params] == [("wte",)], "the tied weight: a file alone"
    for k in range(P):
        mine = [s for s in plan if s.stage == k]
        if D <= len(mine):
            assert {s.replica for s in mine} == set(range(D)), "every replica of a process writes"


def test_plan_refuses_ranges_that_are_not_chunks_of_the_pipeline():
    with pytest.raises(ValueError, match="3 stage ranges are not chunks of pipeline depth 2"):
        plan_shards(param_segments={"w": (0,)}, param_bytes={}, stage_ranges=[(0, 0), (1, 1), (2, 2)],
                    data_parallel=1, pipeline_depth=2)


# ---------------------------------------------------------------------------------------------
# Save and resume (real processes, gloo)


def world(tmp: Path, name: str, P: int, D: int, *args: str) -> Path:
    out = tmp / name
    check_ok(run_world(WORKER, P * D, ["--out", str(out), "--pipeline-depth", str(P), *args],
                       env={"VARUNA_PIPELINE_DEPTH": str(P)}, timeout_s=180))
    return out


def gather(out: Path) -> tuple[list[dict], dict]:
    """Every rank's report and the union of their final parameters (copies must agree bit for bit:
    replicas, and the tied weight's two processes)."""
    reports, params = [], {}
    for f in sorted(out.glob("rank*.json")):
        reports.append(json.loads(f.read_text()))
        for n, t in torch.load(f.with_suffix(".pt"), weights_only=True).items():
            assert n not in params or torch.equal(params[n], t), f"copies of {n} disagree"
            params[n] = t
    return reports, params


def assert_same_run(out: Path, ref: Path, *, first_step: int) -> None:
    reports, params = gather(out)
    ref_reports, ref_params = gather(ref)
    assert all(r["first_step"] == first_step for r in reports)
    assert reports[0]["losses"] == ref_reports[0]["losses"][first_step - 1:]
    assert params.keys() == ref_params.keys()
    assert [n for n in ref_params if not torch.equal(params[n], ref_params[n])] == []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Uninterrupted deterministic runs, each saving after step 3: 1×1 (one chunk) and 2×2
    varuna-interleaved with 2 chunks per process."""
    tmp = tmp_path_factory.mktemp("ckpt_il")
    one = world(tmp, "one", 1, 1, "--ckpt-dir", str(tmp / "ckpt_one"), "--save-at", "3", *DET)
    il = world(tmp, "il", 2, 2, "--ckpt-dir", str(tmp / "ckpt_il"), "--save-at", "3", *DET, *IL)
    return tmp, one, il


@pytest.mark.slow
def test_interleaved_checkpoint_is_written_by_the_process_of_each_chunk(runs):
    tmp, one, il = runs
    reports, _ = gather(il)
    assert {r["chunks"] for r in reports} == {2} and all(r["last_ok"] for r in reports)
    m = json.loads((tmp / "ckpt_il" / "step_00000003" / "manifest.json").read_text())
    assert m["config"]["chunks"] == 2 and len(m["config"]["stage_ranges"]) == 4
    owner = _process_of_segment(m["config"]["stage_ranges"], 2)
    for f in m["files"]:  # chunk 1's segments too (the old plan lost them), by their process
        assert f["stage"] == owner[f["segment"]] and f["rank"] == f["replica"] * 2 + f["stage"], f["name"]
    assert {f["segment"] for f in m["files"]} == set(owner)
    assert {f["rank"] for f in m["files"]} == {0, 1, 2, 3}, "both replicas of both processes write"
    # The uninterrupted interleaved run equals one process bit for bit: the references agree.
    assert_same_run(il, one, first_step=1)


@pytest.mark.slow
def test_resume_interleaved_at_the_same_layout_is_bit_identical(runs):
    tmp, _, il = runs
    out = world(tmp, "resume_il", 2, 2, "--ckpt-dir", str(tmp / "ckpt_il"), "--resume", "1", *DET, *IL)
    assert_same_run(out, il, first_step=4)


@pytest.mark.slow
def test_resume_interleaved_checkpoint_in_one_process_without_chunks(runs):
    tmp, one, _ = runs
    out = world(tmp, "resume_one", 1, 1, "--ckpt-dir", str(tmp / "ckpt_il"), "--resume", "1", *DET)
    assert_same_run(out, one, first_step=4)


@pytest.mark.slow
def test_resume_one_chunk_checkpoint_interleaved(runs):
    """The reverse: a 1×1 checkpoint resumed by the strict interleaved kind at 2×1, chunks = 2."""
    tmp, one, _ = runs
    out = world(tmp, "resume_strict", 2, 1, "--ckpt-dir", str(tmp / "ckpt_one"), "--resume", "1", *DET,
                "--schedule", "interleaved", "--chunks", "2")
    assert_same_run(out, one, first_step=4)
