"""Note [Staging leftovers] (varuna/runtime/checkpoint_staging.py): a rank's checkpoint staging
directory is swept by the next one once its process is gone, however it died (SIGKILL runs no
finalizer), and never while its process lives, while it is young, or when it has no owner file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from varuna.runtime.checkpoint_staging import OWNER_FILE, create_staging, sweep_stale

MODULE = Path(__file__).resolve().parents[1] / "varuna" / "runtime" / "checkpoint_staging.py"
# A child that makes a staging directory, says where, and waits for its stdin to close. The module is
# loaded from its file: no torch import, the child is up in a fraction of a second.
CHILD = (
    "import importlib.util, sys\n"
    f"spec = importlib.util.spec_from_file_location('staging', {str(MODULE)!r})\n"
    "m = importlib.util.module_from_spec(spec); sys.modules['staging'] = m; spec.loader.exec_module(m)\n"
    "s = m.create_staging(int(sys.argv[2]), parent=sys.argv[1])\n"
    "print(s.path, flush=True)\n"
    "sys.stdin.read()\n"
)


def _owner(parent: Path, rank: int) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(parent), str(rank)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line, "the child made no staging directory"
    return proc, Path(line)


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    for p in (path, path / OWNER_FILE):
        os.utime(p, (then, then))


def test_a_killed_ranks_directory_is_swept_and_a_live_ones_is_kept(tmp_path: Path) -> None:
    dead, dead_dir = _owner(tmp_path, 0)
    live, live_dir = _owner(tmp_path, 1)
    try:
        (dead_dir / "step_00000004-x").mkdir()
        (dead_dir / "step_00000004-x" / "seg000-00.pt").write_bytes(b"x" * 1024)
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=30)
        for d in (dead_dir, live_dir):
            _age(d, 3600)
        assert sweep_stale(tmp_path) == [dead_dir]
        assert not dead_dir.exists()
        assert live_dir.exists() and (live_dir / OWNER_FILE).exists()  # negative control: alive, kept
    finally:
        for p in (dead, live):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def test_young_and_ownerless_directories_are_kept_and_a_new_staging_sweeps(tmp_path: Path) -> None:
    dead, dead_dir = _owner(tmp_path, 0)
    dead.kill()
    dead.wait(timeout=30)
    assert sweep_stale(tmp_path) == [] and dead_dir.exists()  # young: its owner may not have locked it yet
    ownerless = tmp_path / "varuna-ckpt-rank3-old"
    ownerless.mkdir()
    _age(dead_dir, 3600)
    os.utime(ownerless, (time.time() - 3600,) * 2)
    other = tmp_path / "unrelated"
    other.mkdir()
    staging = create_staging(2, parent=tmp_path)  # sweeps first
    try:
        assert not dead_dir.exists()
        assert ownerless.exists() and other.exists()  # an older version's, and not ours: left alone
        assert staging.path.exists() and staging.path.name.startswith("varuna-ckpt-rank2-")
        _age(staging.path, 3600)
        assert sweep_stale(tmp_path) == [] and staging.path.exists()  # this process holds its lock
    finally:
        staging.close()
    assert not staging.path.exists()
