"""The checkpoint-format seam (issue 28): a format added from one module saves and resumes a run.

``tests/toy_checkpoint_format.py`` is the whole of the throw-away format: it registers itself
when imported. The workers load it through ``$VARUNA_CHECKPOINT_FORMAT_MODULES`` and write it
when ``$VARUNA_CHECKPOINT_FORMAT=toy`` (the unchanged ``tests/workers/ckpt_worker.py``); nothing
else knows it. Reference: the same runs through the default ``varuna`` format, bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import toy_checkpoint_format  # noqa: F401  (registers "toy" in this process too)
from distributed import check_ok, run_world

import varuna
from varuna.runtime.checkpoint_format import LoadRequest, StateLayout, StateShare
from varuna.runtime.checkpoint_manifest import MANIFEST, ManifestFormat
from varuna.runtime.checkpoint_registry import checkpoint_format, format_names, register_format
from varuna.runtime.checkpoint_store import list_checkpoints, prune, step_dir_name, verify_checkpoint

WORKER = Path(__file__).parent / "workers" / "ckpt_worker.py"
sys.path.insert(0, str(WORKER.parent))
from ckpt_worker import GLOBAL_BATCH, MICRO_BATCH  # noqa: E402

TOY = {"VARUNA_CHECKPOINT_FORMAT_MODULES": "toy_checkpoint_format", "VARUNA_CHECKPOINT_FORMAT": "toy"}


def _run(world: int, depth: int, out: Path, ckpt: Path, *extra: str, env: dict | None = None):
    env = {"VARUNA_CHECKPOINT_FORMAT_MODULES": "", "VARUNA_CHECKPOINT_FORMAT": "", **(env or {})}
    args = ["--out", str(out), "--ckpt-dir", str(ckpt), "--pipeline-depth", str(depth), "--deterministic",
            *extra]
    return run_world(WORKER, world, args, env=env)


@pytest.mark.slow
def test_a_format_from_one_module_saves_and_resumes_like_the_default(tmp_path):
    # 3 steps at 2×2 and a checkpoint, once per format; then resume each at 1×1 (another P×D).
    for fmt, env in (("varuna", None), ("toy", TOY)):
        check_ok(_run(4, 2, tmp_path / f"{fmt}-a", tmp_path / fmt, "--steps", "3", "--save-at", "3", env=env))
        [info] = list_checkpoints(tmp_path / fmt)
        assert (info.step, info.complete, info.format) == (3, True, fmt)
        assert verify_checkpoint(info.path) == []
    toy_dir = tmp_path / "toy" / step_dir_name(3)
    assert not (toy_dir / MANIFEST).exists() and {p.name for p in toy_dir.iterdir()} == {
        "toy-index.json", "part-s0-r0.pt", "part-s0-r1.pt", "part-s1-r0.pt", "part-s1-r1.pt"}

    # Negative control: without the module nothing recognises the toy checkpoint, so a required
    # resume refuses in one line (the toy format, not a fallback, is what loads it below).
    unknown = _run(1, 1, tmp_path / "none", tmp_path / "toy", "--steps", "5", "--resume", "1")
    assert unknown[0].returncode != 0 and "no complete, sound checkpoint" in unknown[0].stdout

    # Resume reads any registered format: the toy run resumes with the default format for writing.
    only_module = {"VARUNA_CHECKPOINT_FORMAT_MODULES": "toy_checkpoint_format"}
    for fmt, env in (("varuna", None), ("toy", only_module)):
        check_ok(_run(1, 1, tmp_path / f"{fmt}-b", tmp_path / fmt, "--steps", "5", "--resume", "1", env=env))
    runs = {fmt: json.loads((tmp_path / f"{fmt}-b" / "rank0.json").read_text()) for fmt in ("varuna", "toy")}
    assert runs["toy"]["first_step"] == runs["varuna"]["first_step"] == 4
    assert runs["toy"]["losses"] == runs["varuna"]["losses"]
    got, ref = (torch.load(tmp_path / f"{fmt}-b" / "rank0.pt") for fmt in ("toy", "varuna"))
    assert got.keys() == ref.keys()
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    first = torch.load(tmp_path / "varuna-a" / "step3-rank0.pt")  # stage 0's weights at step 3
    assert any(not torch.equal(first[n], ref[n]) for n in first), "steps 4-5 changed the weights"


def test_an_unknown_format_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError) as e:
        varuna.Engine(
            torch.nn.Linear(4, 4),
            varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, stop_signals=(),
                                checkpoint_dir=str(tmp_path), resume="0", checkpoint_format="safetensor"),
            example_batch=torch.zeros(GLOBAL_BATCH, 4),
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
            loss_fn=lambda out, mb: out.sum(),
        )
    msg = str(e.value)
    assert "\n" not in msg and "unknown checkpoint format 'safetensor'" in msg
    assert "registered: varuna, hf, dcp, toy" in msg and "VARUNA_CHECKPOINT_FORMAT_MODULES" in msg


def test_a_taken_name_or_a_missing_module_is_refused():
    class Impostor(toy_checkpoint_format.ToyFormat):
        pass

    with pytest.raises(ValueError, match="'toy' is taken by toy_checkpoint_format.ToyFormat"):
        register_format(Impostor)
    assert checkpoint_format("toy").name == "toy", "the registered one stays"
    with pytest.raises(ValueError, match="VARUNA_CHECKPOINT_FORMAT_MODULES: cannot import 'no_such_mod'"):
        format_names({"VARUNA_CHECKPOINT_FORMAT_MODULES": "no_such_mod"})
    assert checkpoint_format(None, {"VARUNA_CHECKPOINT_FORMAT": "toy"}).name == "toy"
    assert checkpoint_format(None, {}).name == "varuna"


def test_list_and_prune_recognise_every_registered_format(tmp_path):
    for step, commit in ((1, MANIFEST), (2, "toy-index.json"), (3, MANIFEST), (4, None)):
        d = tmp_path / step_dir_name(step)
        d.mkdir()
        if commit:
            (d / commit).write_text("{}")
    assert [(c.step, c.format) for c in list_checkpoints(tmp_path)] == [
        (1, "varuna"), (2, "toy"), (3, "varuna"), (4, None)]
    assert verify_checkpoint(tmp_path / step_dir_name(4)) == [
        f"{tmp_path / step_dir_name(4)}: no manifest.json or model.safetensors.index.json or .metadata or "
        "toy-index.json (an incomplete checkpoint)"]
    prune(tmp_path, 3, keep=2)
    # The toy checkpoint counts as complete: kept as the second newest (an unrecognised one
    # would have been removed as an incomplete leftover, and step 1 kept instead).
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 3]


def test_the_default_format_round_trips_extra_state(tmp_path):
    """Named extra state (issue 29's LR schedulers...) rides in a stage's files and comes back."""
    fmt = ManifestFormat()
    layout = StateLayout(tensor_segments={"w": (0,)}, tensor_bytes={"w": 16}, stage_ranges=[(0, 0)],
                         pipeline_depth=1, data_parallel=1)
    [shard] = fmt.plan(layout)
    w = torch.arange(4.0)
    optimizer = {"class": "SGD", "state": {}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    extra = {"sched": {"last_epoch": 7, "t": torch.ones(2)}}
    share = StateShare(step=7, rank=0, tensors={"w": w}, optimizer=optimizer, extra=extra)
    (tmp_path / "step").mkdir()
    record = fmt.write(shard, share, tmp_path / "step" / shard.name)
    fmt.commit(tmp_path / "step", [record], {"step": 7, "loss_scale": {"scale": 1.0}}, layout,
               before_replace=lambda: None)
    assert fmt.verify(tmp_path / "step") == []
    loaded = fmt.read(tmp_path / "step", LoadRequest(tensors={"w": torch.zeros(4)}, optimizer_class="SGD"))
    assert torch.equal(loaded.tensors["w"], w) and loaded.metadata["step"] == 7
    assert loaded.extra["sched"]["last_epoch"] == 7 and torch.equal(loaded.extra["sched"]["t"], torch.ones(2))
