"""``varuna-launch --live-morph`` (Note [Live morph supervision] in varuna/launch/supervisor.py):
a worker killed with SIGKILL does not stop the job, the survivors regroup in their processes and
end where an undisturbed run ends; a stage that loses every replica takes the restart path
(relaunch, resume from the newest checkpoint) and still ends there. Deterministic mode: losses and
final parameters are compared bit for bit with an undisturbed run of the same command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from varuna.launch.supervisor import PEER_LOST_EXIT_CODE

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "live_launch_worker.py"
STEPS = 6
TIMEOUT_S = 300  # the whole launcher run, on a busy 2-core machine


def test_the_launcher_knows_the_runtime_fallback_code() -> None:
    from varuna.runtime.peer_watch import PEER_LOST_EXIT_CODE as runtime_code

    assert PEER_LOST_EXIT_CODE == runtime_code


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--procs", "4", "--live-morph"], "--live-morph needs --checkpoint-dir DIR"),
        (["--hosts", "localhost,localhost", "--procs-per-host", "2", "--live-morph"],
         "--live-morph needs --checkpoint-dir DIR"),
        (["--procs", "4", "--max-restarts", "2"], "--max-restarts 2 needs --checkpoint-dir DIR"),
    ],
)
def test_live_morph_usage_errors(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--live-morph and --max-restarts resume from a checkpoint, on one machine or several hosts."""
    from varuna.launch.launcher import main

    assert main([*argv, "--pipeline-depth", "2", str(WORKER)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def launch_live(tmp: Path, *worker_args: str) -> tuple[subprocess.CompletedProcess[str], dict, Path]:
    """``varuna-launch --procs 4 --pipeline-depth 2 --live-morph`` on the worker; returns the run,
    launch.json and the workers' output directory."""
    out, logs = tmp / "out", tmp / "logs"
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "varuna.launch", "--procs", "4", "--pipeline-depth", "2", "--live-morph",
           "--checkpoint-dir", str(tmp / "ckpt"), "--log-dir", str(logs), "--stop-timeout", "30", "--quiet",
           str(WORKER), "--out", str(out), "--steps", str(STEPS), *worker_args]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp)
    return run, json.loads((logs / "launch.json").read_text()), out


def final_state(out: Path, members: list[int]) -> tuple[dict[int, dict], dict[str, torch.Tensor]]:
    reports = {m: json.loads((out / f"member{m}.json").read_text()) for m in members}
    params: dict[str, torch.Tensor] = {}
    for m in members:
        params.update(torch.load(out / f"member{m}.pt"))
    return reports, params


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, dict[str, torch.Tensor]]:
    run, _, out = launch_live(tmp_path_factory.mktemp("ref"))
    assert run.returncode == 0, run.stderr[-3000:]
    reports, params = final_state(out, [0, 1, 2, 3])
    return reports[0]["losses"], params


def same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


@pytest.mark.slow
def test_kill_9_one_of_2x2_the_job_goes_on_live(tmp_path: Path, undisturbed) -> None:
    ref_losses, ref_params = undisturbed
    run, launched, out = launch_live(tmp_path, "--die-members", "3", "--die-after", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "live morph: the 3 other worker(s) regroup without a restart" in run.stderr
    assert "restarting" not in run.stderr
    pids = {w["rank"]: w["pid"] for w in launched["workers"]}
    reports, params = final_state(out, [0, 1, 2])
    assert not (out / "member3.json").exists()
    for m, r in reports.items():
        assert r["pid"] == pids[m] and r["restarts"] == 0, "the survivor is the process launched first"
        assert (r["P"], r["D"]) == (1, 3) and [x["resumed_after"] for x in r["morphs"]] == [2]
        assert r["losses"][2:] == ref_losses[2:], "steps 3.. equal the undisturbed run's"
    assert same_params(params, ref_params) == []


@pytest.mark.slow
def test_a_stage_lost_whole_takes_the_restart_path(tmp_path: Path, undisturbed) -> None:
    ref_losses, ref_params = undisturbed
    run, launched, out = launch_live(tmp_path, "--die-members", "1,3", "--die-after", "3")
    assert run.returncode == 0, run.stderr[-3000:]
    [line] = [x for x in run.stderr.splitlines() if "fallback: restarting" in x]
    assert "stage 1 has no live replica" in line, line
    reports, params = final_state(out, [0, 1, 2, 3])
    pids = {w["rank"]: w["pid"] for w in launched["workers"]}  # launch.json of the relaunch
    for m, r in reports.items():
        assert r["restarts"] == 1 and r["pid"] == pids[m] and r["morphs"] == []
        assert r["resumed_at"] <= 3, "resumed from a checkpoint at most at the failed step"
        assert r["losses"] == ref_losses[r["resumed_at"]:]
    assert same_params(params, ref_params) == []


def test_a_worker_declared_frozen_is_killed_and_the_job_ends(tmp_path: Path) -> None:
    """Rank 1 stops itself (SIGSTOP: sockets open, no exit); the others' verdict (``frozen``, the
    store's ``dead_why`` key in a live run) makes the supervisor SIGKILL it, so the job ends
    (exit 0: the worker still standing finished) instead of waiting for it for ever."""
    import io
    import threading

    from varuna.launch.local import LocalHost
    from varuna.launch.spec import LaunchConfig, plan_workers
    from varuna.launch.supervisor import Supervisor

    code = "import os, signal\nif os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
    cfg = LaunchConfig(script="-c", script_args=(code,), pipeline_depth=1, data_parallel=2)
    hosts = [LocalHost(slots=2)]
    lost: list[int] = []
    err = io.StringIO()
    sup = Supervisor(plan_workers(cfg, hosts, master_port=29500), hosts, stderr=err, stdout=io.StringIO(),
                     on_lost=lost.append, frozen=lambda r: "no heartbeat for 31s" if r == 1 else None)
    result: list[int] = []
    try:
        sup.start()
        waiter = threading.Thread(target=lambda: result.append(sup.wait()), daemon=True)
        waiter.start()
        waiter.join(120)
        assert not waiter.is_alive(), "the supervisor kept waiting for a frozen worker"
    finally:
        sup.close()  # kills whatever still runs
    assert result == [0] and lost == [1], err.getvalue()
    assert "was declared dead by the others (no heartbeat for 31s); killing it" in err.getvalue()
