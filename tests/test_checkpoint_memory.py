"""Checkpoints of stages sized to their memory (docs/too_big.md): a save without a host snapshot,
the snapshot decision, and loading without holding a shard file whole in memory. Single process, seconds."""

from __future__ import annotations

import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest
import torch
from models import build_model

import varuna
from varuna.runtime import checkpoint_manifest
from varuna.runtime.checkpoint import list_checkpoints, read_shard, step_dir_name
from varuna.runtime.checkpoint_files import open_checked, read_regular, save_hashed
from varuna.runtime.checkpoint_format import as_saved
from varuna.runtime.checkpoint_writer import memory_headroom


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 256, (8, 17), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _engine(ckpt: Path, *, meta: bool = False, resume: str = "0", snapshot: str = "auto") -> varuna.Engine:
    return varuna.Engine(
        build_model("gpt", dropout=0.1, meta=meta),
        varuna.VarunaConfig(
            global_batch_size=8,
            micro_batch_size=2,
            seed=7,
            stop_signals=(),
            checkpoint_dir=str(ckpt),
            resume=resume,
            checkpoint_snapshot=snapshot,
        ),
        example_batch=_batch(1),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    )


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.named_parameters()}


@pytest.mark.parametrize("mode", ["disk", "memory"])
def test_a_save_holds_the_state_of_its_step_while_training_goes_on(tmp_path, mode):
    """Without a host snapshot the files must be written before the next step changes the live
    tensors: the checkpoint holds step 1's weights even though step 2 runs right after the call."""
    eng = _engine(tmp_path / "ckpt", meta=True)
    eng.checkpointer.snapshot = mode
    step2_done = threading.Event()

    def hold_background_writes(event: str) -> None:
        # A write left to the background thread happens only after step 2 changed the weights.
        if event == "local-write" and threading.current_thread() is not threading.main_thread():
            assert step2_done.wait(30)

    eng.checkpointer.progress_hook = hold_background_writes
    eng.train_step(_batch(1))
    at_save = _params(eng)
    eng.save_checkpoint()  # no wait: training goes on at once
    eng.train_step(_batch(2))
    step2_done.set()
    assert eng.checkpointer.wait(60) and eng.checkpointer.last_ok
    assert eng.checkpointer.last_snapshot_in_memory is (mode == "memory")
    after = _params(eng)
    eng.close()
    assert any(not torch.equal(after[n], at_save[n]) for n in at_save), "step 2 must change the weights"
    back = _engine(tmp_path / "ckpt", meta=True, resume="1")
    assert back.step_count == 1
    for n, p in back.named_parameters():
        assert torch.equal(p.detach(), at_save[n]), n
    back.close()


def test_auto_snapshot_copies_only_what_fits_in_half_the_headroom(tmp_path, monkeypatch):
    eng = _engine(tmp_path / "ckpt")
    eng.train_step(_batch(1))
    # What a snapshot copies: the weights and every optimizer state tensor (moments, step).
    state = sum(p.numel() * p.element_size() for p in eng.stage_params.values())
    state += sum(t.numel() * t.element_size() for v in eng.optimizer.state.values() for t in v.values())
    monkeypatch.setattr("varuna.runtime.checkpoint_writer.memory_headroom", lambda: 2 * state - 1)
    eng.save_checkpoint(wait=True)
    assert eng.checkpointer.last_snapshot_in_memory is False
    eng.train_step(_batch(2))
    monkeypatch.setattr("varuna.runtime.checkpoint_writer.memory_headroom", lambda: 2 * state)
    eng.save_checkpoint(wait=True)
    assert eng.checkpointer.last_snapshot_in_memory is True
    eng.train_step(_batch(3))
    monkeypatch.setattr("varuna.runtime.checkpoint_writer.memory_headroom", lambda: None)  # nothing readable
    eng.save_checkpoint(wait=True)
    assert eng.checkpointer.last_snapshot_in_memory is True
    assert [c.step for c in list_checkpoints(tmp_path / "ckpt")] == [2, 3]  # keep_checkpoints=2
    eng.checkpointer.snapshot = "sometimes"
    eng.train_step(_batch(4))
    with pytest.raises(ValueError, match="'auto', 'memory' or 'disk'"):
        eng.save_checkpoint()
    eng.close()


def test_memory_headroom_sees_an_address_space_limit(monkeypatch):
    room = memory_headroom()
    assert room is None or room > 0
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    # The ranks of a host save at the same step: each gets its share of the host's memory.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000")
    assert memory_headroom() <= available // 1000 + (64 << 20)
    # In a child: lowering RLIMIT_AS in the test process could starve the rest of the run.
    code = (
        "import resource; from varuna.runtime.checkpoint_writer import memory_headroom\n"
        "vm = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmSize:'))\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (300 << 20), resource.RLIM_INFINITY))\n"
        "print(memory_headroom())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert 0 < int(out.stdout) <= 300 << 20


def test_as_saved_keeps_compact_host_tensors_and_copies_views():
    w = torch.randn(4, 4)
    assert as_saved(w).data_ptr() == w.data_ptr()
    row = w[1]
    saved = as_saved(row)
    assert saved.data_ptr() != w.data_ptr() and saved.untyped_storage().nbytes() == 16
    assert torch.equal(saved, row)
    assert as_saved({"a": [w, 3]})["a"][1] == 3


def test_a_shard_is_verified_and_loaded_without_holding_the_file_in_memory(tmp_path):
    """The sha256 is streamed and the tensors are unpickled from the open file: Python-level
    allocations stay far below the file's size (a whole-file buffer was as large as the file)."""
    big = {
        "format": "varuna-checkpoint",
        "version": 1,
        "step": 1,
        "segment": 0,
        "params": {"w": torch.randn(8 << 20)},
        "optimizer": {"class": "AdamW", "state": {}, "param_groups": []},
    }
    path = tmp_path / "seg000-00.pt"
    nbytes, sha = save_hashed(big, path)
    assert nbytes > 32 << 20
    tracemalloc.start()
    try:
        opened, problem = open_checked(path, {"bytes": nbytes, "sha256": sha}, chunk_bytes=1 << 20)
        assert problem is None
        with opened:
            shard = read_shard(path, opened)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.equal(shard["params"]["w"], big["params"]["w"])
    assert peak < 8 << 20, f"{peak} bytes of Python allocations for a {nbytes}-byte shard"


def test_a_shard_changed_after_its_check_is_not_loaded(tmp_path):
    payload = {
        "format": "varuna-checkpoint",
        "version": 1,
        "step": 1,
        "segment": 0,
        "params": {"w": torch.ones(16)},
        "optimizer": {"class": "AdamW", "state": {}, "param_groups": []},
    }
    path = tmp_path / "seg000-00.pt"
    nbytes, sha = save_hashed(payload, path)
    opened, problem = open_checked(path, {"bytes": nbytes, "sha256": sha})
    assert problem is None
    with open(path, "ab") as f:  # another writer appends after the verification
        f.write(b"x")
    with opened, pytest.raises(ValueError, match="changed while being read"):
        read_shard(path, opened)
    _, problem = open_checked(path, {"bytes": nbytes, "sha256": sha})
    assert "bytes, the manifest says" in problem


def test_reading_a_small_manifest_reserves_only_its_size(tmp_path):
    """``os.read`` allocates what it is asked for: a 1 KiB file read with a 256 MiB bound must not
    ask for 64 MiB (it counts against an address-space cap)."""
    path = tmp_path / "manifest.json"
    path.write_bytes(b"{}" * 512)
    tracemalloc.start()
    try:
        data = read_regular(path, 256 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert data == b"{}" * 512
    assert peak < 1 << 20, peak


def test_the_background_thread_reports_a_failed_local_write(tmp_path, monkeypatch):
    """A save written on the training thread that fails (disk full) fails like any other save:
    a warning, ``last_ok`` False, training goes on, no checkpoint."""
    eng = _engine(tmp_path / "ckpt")
    eng.checkpointer.snapshot = "disk"
    eng.train_step(_batch(1))

    def full(obj, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_manifest, "save_hashed", full)
    eng.save_checkpoint(wait=True)
    assert eng.checkpointer.last_ok is False and "No space left" in eng.checkpointer.last_error
    assert not (tmp_path / "ckpt" / step_dir_name(1) / "manifest.json").exists()
    eng.train_step(_batch(2))
    eng.close()


def test_the_snapshot_mode_is_a_config_field(tmp_path):
    """``VarunaConfig.checkpoint_snapshot`` reaches the checkpointer; a bad value is one line."""
    eng = _engine(tmp_path / "ckpt", snapshot="disk")
    try:
        assert eng.checkpointer.snapshot == "disk"
        eng.train_step(_batch(1))
        eng.save_checkpoint(wait=True)
        assert eng.checkpointer.last_snapshot_in_memory is False
    finally:
        eng.close()
    with pytest.raises(ValueError, match="checkpoints.snapshot must be 'auto', 'memory' or 'disk'"):
        varuna.VarunaConfig(global_batch_size=4, micro_batch_size=2, checkpoint_snapshot="ram").validate()
