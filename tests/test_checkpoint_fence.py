"""Fencing the checkpoint store (issue 30; Note [Checkpoint fence] in varuna/runtime/checkpoint_fence.py):
a checkpoint commit from an older generation is refused however late it arrives, in every format.

The scenario is the one a partition makes: generation 0 (the launcher's first launch) is in the
middle of saving step 4 when its host is cut off; its writer thread stalls after its files are in
the store, before the commit. Generation 1 (the relaunch) resumes from step 2, trains other
batches (so its step-4 weights differ), and commits step 4. Then generation 0's commit arrives.
With the fence it is refused with one line, and the store's step 4 stays generation 1's, sound
and bit for bit. The negative control runs the same scenario unfenced (what the code did before
the fence: no ``$VARUNA_FENCE_EPOCH``): the late commit then lands over generation 1's checkpoint.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch
from distributed import ROOT

import varuna
from varuna.runtime.checkpoint import list_checkpoints, step_dir_name, verify_checkpoint
from varuna.runtime.checkpoint_fence import (
    FENCE_FILE,
    FencedOut,
    FenceToken,
    fence_held,
    raise_fence,
    read_fence,
)

sys.path.insert(0, str(ROOT / "tests" / "workers"))
from state_worker import GLOBAL_BATCH, Indexed, engine_args, step_batch  # noqa: E402

FORMATS = ("varuna", "hf", "dcp")


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _engine(ckpt: Path, fmt: str, **kw) -> varuna.Engine:
    a = type("A", (), {"total_steps": 0, "steps": 8})
    cfg = varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=2, seed=5,
                              checkpoint_dir=str(ckpt), checkpoint_format=fmt, **kw)
    return varuna.Engine(Indexed(), cfg, **engine_args(a))


def _params(eng: varuna.Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in eng.state_dict()["params"].items()}


def _differs(a: dict, b: dict) -> list[str]:
    return [k for k in a if not torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8))]


def _late_commit(tmp_path: Path, monkeypatch, fmt: str, *, fenced: bool) -> tuple[varuna.Engine, dict, Path]:
    """Generation 0's save of step 4 stalls before its commit; generation 1 resumes from step 2,
    trains other batches and commits step 4; then generation 0's commit goes on. Returns
    generation 0's engine (its save finished), generation 1's step-4 parameters and the store."""
    ckpt = tmp_path / "ckpt"
    if fenced:
        monkeypatch.setenv("VARUNA_FENCE_EPOCH", "1764000000000")
    else:
        monkeypatch.delenv("VARUNA_FENCE_EPOCH", raising=False)
    monkeypatch.setenv("VARUNA_RESTARTS", "0")
    old = _engine(ckpt, fmt)
    for s in (1, 2):
        old.train_step(step_batch(s))
    old.save_checkpoint(wait=True)
    for s in (3, 4):
        old.train_step(step_batch(s))
    stalled, release = threading.Event(), threading.Event()

    def cut_off(event: str) -> None:  # the writer thread: its files and marker are in, no commit yet
        if event == "commit-ready":
            stalled.set()
            assert release.wait(120), "the test never released the stale writer"

    old.checkpointer.progress_hook = cut_off
    old.save_checkpoint()
    assert stalled.wait(120), "generation 0's save never reached its commit"
    try:
        monkeypatch.setenv("VARUNA_RESTARTS", "1")  # the launcher's relaunch
        new = _engine(ckpt, fmt, resume="1")
        assert new.step_count == 2
        for s in (3, 4):
            new.train_step(step_batch(s + 10))  # other batches: its step-4 weights differ
        new.save_checkpoint(wait=True)
        assert new.checkpointer.last_ok, new.checkpointer.last_error
        want = _params(new)
        new.close()
    finally:
        release.set()
    assert old.checkpointer.wait(timeout_s=120)
    old.close()
    return old, want, ckpt


def _stored_step4(ckpt: Path, fmt: str) -> dict:
    back = _engine(ckpt, fmt, resume="1")
    try:
        assert back.step_count == 4
        return _params(back)
    finally:
        back.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_stale_generations_late_commit_is_refused(tmp_path, monkeypatch, caplog, fmt):
    old, want, ckpt = _late_commit(tmp_path, monkeypatch, fmt, fenced=True)
    err = old.checkpointer.last_error or ""
    assert old.checkpointer.last_ok is False and "refused" in err and "generation 1" in err, err
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    step4 = ckpt / step_dir_name(4)
    assert verify_checkpoint(step4) == []
    assert not _differs(_stored_step4(ckpt, fmt), want)  # generation 1's checkpoint, bit for bit
    assert read_fence(ckpt) == FenceToken(1764000000000, 1, 0)
    leftovers = [p.name for p in step4.rglob("*") if ".tmp-" in p.name or p.name == ".markers"]
    assert leftovers == []


@pytest.mark.parametrize("fmt", ["varuna", "hf"])
def test_negative_control_unfenced_the_late_commit_lands_over_the_newer_one(tmp_path, monkeypatch, fmt):
    # What the store did before the fence: the stale commit succeeds and step 4 is no longer
    # generation 1's (its commit file replaced: unsound, or holding generation 0's weights).
    old, want, ckpt = _late_commit(tmp_path, monkeypatch, fmt, fenced=False)
    assert old.checkpointer.last_ok is True
    step4 = ckpt / step_dir_name(4)
    problems = verify_checkpoint(step4)
    damaged = bool(problems) or bool(_differs(_stored_step4(ckpt, fmt), want))
    assert damaged, "the unfenced late commit left generation 1's checkpoint intact: the scenario is void"
    assert [c.step for c in list_checkpoints(ckpt) if c.complete] == [2, 4]


def test_the_fence_only_rises_and_refuses_older_tokens(tmp_path):
    a, b = FenceToken(10, 0, 0), FenceToken(10, 0, 1)
    assert read_fence(tmp_path) is None
    assert raise_fence(tmp_path, b) == b
    assert raise_fence(tmp_path, a) == b and read_fence(tmp_path) == b  # never lowered
    with fence_held(tmp_path, b, "x"):
        pass
    with fence_held(tmp_path, None, "unfenced"):
        pass
    with pytest.raises(FencedOut, match=r"^the commit refused: it belongs to epoch 10 generation 0 live 0, "
                                        r"but epoch 10 generation 0 live 1 started since"):
        with fence_held(tmp_path, a, "the commit"):
            raise AssertionError("a refused block must not run")
    assert raise_fence(tmp_path, FenceToken(11)) == FenceToken(11)  # a later launcher outranks all


def test_a_fence_file_not_written_by_varuna_counts_as_absent(tmp_path):
    (tmp_path / FENCE_FILE).write_text("{not json")
    assert read_fence(tmp_path) is None
    assert raise_fence(tmp_path, FenceToken(1)) == FenceToken(1)


def test_a_stale_generation_saving_the_same_step_never_retires_the_newer_checkpoint(tmp_path, monkeypatch):
    # A stale rank 0 starting a save of a step the newer generation already committed would
    # retire (uncommit) that checkpoint first, as for an abandoned lineage: refused too.
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("VARUNA_FENCE_EPOCH", "1764000000000")
    monkeypatch.setenv("VARUNA_RESTARTS", "0")
    old = _engine(ckpt, "varuna")
    monkeypatch.setenv("VARUNA_RESTARTS", "1")
    new = _engine(ckpt, "varuna")
    for s in (1, 2):
        old.train_step(step_batch(s))
        new.train_step(step_batch(s + 10))
    new.save_checkpoint(wait=True)
    want = _params(new)
    new.close()
    old.save_checkpoint(wait=True)
    assert old.checkpointer.last_ok is False and "refused" in (old.checkpointer.last_error or "")
    old.close()
    assert verify_checkpoint(ckpt / step_dir_name(2)) == []
    back = _engine(ckpt, "varuna", resume="1")
    assert back.step_count == 2 and not _differs(_params(back), want)
    back.close()
