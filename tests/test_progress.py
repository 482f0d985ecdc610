"""Progress bars (varuna.core.progress): when they are drawn, that they are a silent no-op without
tqdm, and that a real CLI shows one on a terminal (a pseudo-terminal) and never when piped or
with --quiet."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from profiler.phase_progress import PhaseProgress, note
from varuna.core.calibration import Calibration
from varuna.core.progress import QUIET_VAR, Progress, progress_wanted
from varuna.launch.job import launch
from varuna.launch.spec import LaunchConfig
from varuna.runtime.checkpoint_files import copy_file

ROOT = Path(__file__).resolve().parents[1]


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


# -- when a bar is drawn --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tty, quiet, env, wanted",
    [
        (True, False, {}, True),
        (False, False, {}, False),
        (True, True, {}, False),
        (True, False, {QUIET_VAR: "1"}, False),
        (True, False, {QUIET_VAR: "yes"}, False),
        (True, False, {QUIET_VAR: "0"}, True),
        (True, False, {QUIET_VAR: ""}, True),
    ],
)
def test_progress_wanted(tty, quiet, env, wanted):
    assert progress_wanted(quiet, _Stream(tty), env) is wanted


def test_a_real_terminal_then_closed():
    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "w") as f:
            assert progress_wanted(stream=f, environ={}) is True
        assert progress_wanted(stream=f, environ={}) is False  # closed: no error, no bar
    finally:
        os.close(master)


def test_enabled_none_follows_the_stream(monkeypatch):
    monkeypatch.delenv(QUIET_VAR, raising=False)
    for tty in (True, False):
        out = _Stream(tty)
        with Progress("phase", total=4, unit="seg", file=out) as bar:
            bar.update(4)
        assert bar.n == 4
        assert ("phase: 100%" in out.getvalue() and "4/4" in out.getvalue()) is tty, out.getvalue()


def test_disabled_bar_counts_and_prints_nothing():
    out = _Stream(True)
    with Progress("phase", total=3, enabled=False, file=out) as bar:
        bar.update(2)
        bar.set_postfix("x")
        bar.set_description("y")
        bar.set_total(5)
        assert not bar.active
    assert bar.n == 2 and out.getvalue() == ""


def test_description_postfix_and_total_reach_the_bar():
    out = io.StringIO()
    with Progress("phase", total=10, unit="seg", enabled=True, file=out) as bar:
        bar.set_total(3)
        bar.set_description("compute")
        bar.set_postfix("P=2 D=4")
        bar.update(3)
    last = out.getvalue().split("\r")[-1]
    assert re.search(r"compute: 100%\|.*\| 3/3 .*P=2 D=4", last), last


def test_without_tqdm_a_bar_is_a_silent_no_op(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("tqdm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if not installed
    with pytest.raises(ImportError):
        import tqdm  # noqa: F401  (the blocker works)
    out = _Stream(True)
    with Progress("phase", total=2, enabled=True, file=out) as bar:
        bar.update(2)
        bar.set_postfix("x")
    assert not bar.active and bar.n == 2 and out.getvalue() == ""


def test_updates_from_many_threads_all_count():
    out = io.StringIO()
    with Progress("copy", total=8 * 500, enabled=True, file=out) as bar:
        threads = [threading.Thread(target=lambda: [bar.update() for _ in range(500)]) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert bar._bar.n == 8 * 500
    assert bar.n == 8 * 500 and "4000/4000" in out.getvalue()


# -- the pieces that feed bars --------------------------------------------------------------------


def test_calibration_phases_from_the_workers_progress_files(tmp_path):
    plan = {
        "compute": {"assign": {"0": [0, 2], "1": [1]}},
        "links": {"pairs": {"intra": [0, 1], "inter": [0, 2]}},
        "allreduce": {"configs": [{}, {}]},
    }
    out = io.StringIO()
    with PhaseProgress(tmp_path, plan, 3, enabled=True, file=out) as bar:
        for r in range(3):
            note(tmp_path, r, f"ready {r}")
        note(tmp_path, 0, "segment 0")
        with open(tmp_path / "progress1", "a") as f:
            f.write("segment 1")  # being written: no newline yet
        bar.poll()
        assert bar.bar.n == 4 and "calibrating: compute" in out.getvalue().split("\r")[-1]
        with open(tmp_path / "progress1", "a") as f:
            f.write("\nsomething else\n")  # completes the line; unknown lines are not steps
        note(tmp_path, 0, "segment 2")
        note(tmp_path, 0, "link intra")
        note(tmp_path, 2, "link intra")  # the same step from another rank counts once
        bar.poll()
        assert bar.bar.n == 7 and "calibrating: links" in out.getvalue().split("\r")[-1]
        for step in ("link inter", "allreduce 0", "allreduce 1"):
            note(tmp_path, 0, step)
        bar.poll()
        assert bar.bar.n == 10
    assert "10/10" in out.getvalue().split("\r")[-1]


def test_copy_file_reports_every_byte(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(2500))
    chunks: list[int] = []
    copy_file(src, tmp_path / "dst.bin", 1000, chunks.append)
    assert sum(chunks) == 2500 and max(chunks) <= 1000
    assert (tmp_path / "dst.bin").read_bytes() == src.read_bytes()


def test_launcher_bar_while_workers_start(tmp_path):
    script = tmp_path / "w.py"
    script.write_text("print('up')\n")
    cfg = LaunchConfig(script=str(script), pipeline_depth=1, data_parallel=2)
    for progress in (True, False):
        err = io.StringIO()
        assert launch(cfg, stdout=io.StringIO(), stderr=err, progress=progress) == 0
        assert ("starting workers: 100%" in err.getvalue() and "2/2" in err.getvalue()) is progress


# -- a real CLI on a (pseudo-)terminal ----------------------------------------------------------


def _run_on_a_terminal(argv: list[str], env: dict[str, str], timeout_s: float = 120) -> tuple[int, str]:
    """Run ``argv`` with stdin/stdout/stderr on a new 120x30 pseudo-terminal; everything it wrote."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    try:
        proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT)
    finally:
        os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], deadline - time.monotonic())
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal (the command ended)
                break
            if not data:
                break
            chunks.append(data)
        else:
            proc.kill()
            raise AssertionError(f"{argv} still writing after {timeout_s} s")
    finally:
        os.close(master)
        code = proc.wait(30)
    return code, b"".join(chunks).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def simulate_argv(tmp_path_factory):
    cal_path = tmp_path_factory.mktemp("cal") / "cal.json"
    Calibration.synthetic(0.01, num_segments=8, micro_batch_sizes=(1, 2, 4), overhead_s=0.002).save(cal_path)
    return [sys.executable, "-m", "simulator.cli", "--calibration", str(cal_path), "--gpus", "8",
            "--global-batch-size", "64", "--sweep-gpus", "4,8"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != QUIET_VAR}
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), **extra}


def test_simulate_shows_bars_on_a_terminal_only(simulate_argv):
    code, screen = _run_on_a_terminal(simulate_argv, _env())
    assert code == 0, screen
    # The bar's total is the candidates the search decides on: all of them here (no memory limit).
    candidates = int(re.search(r"simulated of (\d+) candidates", screen).group(1))
    assert re.search(rf"auto-config G=8: 100%\|[^|\r\n]*\| {candidates}/{candidates} \[", screen), screen
    assert re.search(r"sweep over G: 100%\|[^|\r\n]*\| 2/2 \[", screen), screen

    for argv, env in ((simulate_argv + ["--quiet"], _env()), (simulate_argv, _env(**{QUIET_VAR: "1"}))):
        code, screen = _run_on_a_terminal(argv, env)
        assert code == 0 and "best: P=" in screen, screen
        assert "auto-config" not in screen and "%|" not in screen, screen

    piped = subprocess.run(simulate_argv, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    assert piped.returncode == 0 and "best: P=" in piped.stdout, piped.stderr
    assert piped.stderr == "", piped.stderr
