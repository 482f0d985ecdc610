"""Lifecycle lines (Note [Lifecycle lines] in varuna/core/lifecycle.py): the engine's marker lines,
their parser, the launcher's decision (varuna/launch/early_exit.py) and the supervisor acting on it
with pure-Python workers (no torch import). The end-to-end case under varuna-launch, a training
script whose rank 1 exits 0 before its Engine, is in tests/test_weak_answers.py."""

from __future__ import annotations

import io
import os

import pytest

from varuna.core.lifecycle import LIFECYCLE_VAR, PHASES, emit, marker_line, split_marker
from varuna.launch.early_exit import EarlyExits, early_exit_line
from varuna.launch.local import LocalHost
from varuna.launch.spec import LaunchConfig, plan_workers
from varuna.launch.supervisor import Supervisor

# -- the protocol ------------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", PHASES)
def test_every_marker_parses_back_to_its_phase(phase):
    assert split_marker(marker_line(phase)) == ("", phase)
    assert split_marker(marker_line(phase).rstrip("\n")) == ("", phase)  # a last line without newline


def test_a_scripts_unfinished_line_before_a_marker_is_kept():
    assert split_marker("epoch 3: VARUNA_LIFECYCLE built\n") == ("epoch 3: ", "built")


@pytest.mark.parametrize(
    "line",
    ["step 1 loss 0.5\n", "VARUNA_LIFECYCLE\n", "VARUNA_LIFECYCLE started\n", "VARUNA_LIFECYCLE built now\n",
     "VARUNA_LIFECYCLE  built\n", "varuna_lifecycle built\n", ""],
)
def test_other_lines_are_not_markers(line):
    assert split_marker(line) == (line, None)


def test_an_unknown_phase_is_one_line():
    with pytest.raises(ValueError) as err:
        marker_line("ready")
    assert str(err.value) == "unknown lifecycle phase 'ready'; use one of rendezvous, built, closed"


def test_emit_writes_the_marker_on_stdout_only_when_enabled(capfd):
    print("before", end="")
    emit("rendezvous", enabled=False)
    emit("built", enabled=True)
    out, err = capfd.readouterr()
    assert out == "before" + marker_line("built") and err == ""


# -- the decision -------------------------------------------------------------------------------------


def test_an_exit_0_before_built_while_another_rank_waits_is_the_culprit():
    ee = EarlyExits()
    ee.saw(0, "rendezvous")
    ee.exited(1, 0)
    assert ee.culprit(running=[0]) == 1 and ee.waiting([0]) == [0]


def test_the_order_of_the_exit_and_the_waiting_ranks_line_does_not_matter():
    ee = EarlyExits()
    ee.exited(2, 0)
    assert ee.culprit(running=[0, 1, 3]) is None, "nobody waits yet"
    ee.saw(3, "rendezvous")
    assert ee.culprit(running=[0, 1, 3]) == 2


def test_exits_after_building_or_without_any_engine_are_no_culprits():
    ee = EarlyExits()
    for r in (0, 1):
        ee.saw(r, "rendezvous")
        ee.saw(r, "built")
    ee.saw(1, "closed")
    ee.exited(1, 0)
    assert ee.culprit(running=[0]) is None, "a normal end"
    plain = EarlyExits()  # a script that uses no Engine: no lines at all
    plain.exited(1, 0)
    assert plain.culprit(running=[0]) is None


def test_a_built_line_read_after_the_exit_clears_the_rank():
    ee = EarlyExits()
    ee.saw(0, "built")
    ee.exited(1, 0)
    assert ee.culprit(running=[0]) == 1
    ee.saw(1, "built")  # its reader thread was behind the poll loop
    assert ee.culprit(running=[0]) is None


def test_a_nonzero_exit_or_a_rank_no_longer_running_is_not_decided_here():
    ee = EarlyExits()
    ee.saw(0, "rendezvous")
    ee.exited(1, 1)  # the supervisor reports non-zero exits itself, at once
    assert ee.culprit(running=[0]) is None
    ee.exited(2, 0)
    assert ee.culprit(running=[]) is None, "rank 0 left too: nobody waits"
    ee.saw(0, "closed")
    assert ee.culprit(running=[0]) is None, "a closed engine waits for nobody"


def test_the_line_names_the_rank_the_waiting_ranks_and_the_fix():
    line = early_exit_line("h1=node2 rank 1 stage 1 replica 0", 0, waiting=[3, 0])
    assert line.startswith("h1=node2 rank 1 stage 1 replica 0 exited with code 0 before building its Engine")
    assert "while ranks 0, 3 wait for it" in line and "every rank must construct varuna.Engine" in line
    assert "\n" not in line


def test_plan_workers_asks_for_lifecycle_lines_only_when_told():
    cfg = LaunchConfig(script="t.py", pipeline_depth=2, data_parallel=1)
    hosts = [LocalHost(slots=2)]
    on = plan_workers(cfg, hosts, master_port=1, launcher_environ={}, lifecycle_lines=True)
    off = plan_workers(cfg, hosts, master_port=1, launcher_environ={})  # the manager's launches
    assert all(s.set_vars[LIFECYCLE_VAR] == "1" for s in on)
    assert all(LIFECYCLE_VAR not in s.set_vars for s in off)


# -- the supervisor, with pure-Python workers ------------------------------------------------------------

#: Rank 0 announces its phases (argv[1], comma-separated) through the real emitter, then blocks
#: ("pause": until the launcher stops it) or exits 0; rank 1 announces argv[2]'s and exits 0.
WORKER = """
import os, signal, sys
from varuna.core.env import WorkerSettings
from varuna.core.lifecycle import emit
enabled = WorkerSettings.from_env().lifecycle
rank = int(os.environ["RANK"])
phases, then = sys.argv[1 + rank].split(":")
for phase in filter(None, phases.split(",")):
    if phase == "built":
        print("loss 1.0 ", end="", flush=True)  # an unfinished line before the marker
    emit(phase, enabled=enabled)
if then == "pause":
    signal.pause()
"""


def _supervise(rank0: str, rank1: str, log_dir: str | None = None) -> tuple[int, str, str, Supervisor]:
    cfg = LaunchConfig(script="-c", script_args=(WORKER, rank0, rank1), pipeline_depth=2, data_parallel=1)
    hosts = [LocalHost(slots=2)]
    out, err = io.StringIO(), io.StringIO()
    specs = plan_workers(cfg, hosts, master_port=1, lifecycle_lines=True)
    sup = Supervisor(specs, hosts, stop_timeout_s=30.0, stdout=out, stderr=err, log_dir=log_dir)
    try:
        sup.start()
        code = sup.wait()
    finally:
        sup.close()
    return code, out.getvalue(), err.getvalue(), sup


@pytest.mark.timeout(60)
def test_the_supervisor_ends_the_job_in_one_line_when_a_rank_leaves_before_its_engine():
    assert os.environ.get(LIFECYCLE_VAR) is None, "the test's own environment must not ask for the lines"
    code, out, err, sup = _supervise("rendezvous:pause", ":exit")
    assert code == 1 and sup.early_exit, err
    assert err.splitlines() == [
        "varuna-launch: job failed: rank 1 stage 1 replica 0 exited with code 0 before building its Engine, "
        "while rank 0 waits for it: every rank must construct varuna.Engine (or the live trainer); check the "
        "script for an early return or sys.exit on some ranks"]
    assert "VARUNA_LIFECYCLE" not in out, "the markers are the launcher's, never relayed"


@pytest.mark.timeout(60)
def test_the_supervisor_lets_a_normal_run_end_and_relays_no_marker(tmp_path):
    """The negative control: both ranks build and close their Engines, then exit 0; the log keeps
    every line as the worker wrote it."""
    code, out, err, sup = _supervise("rendezvous,built,closed:exit", "rendezvous,built,closed:exit",
                                     log_dir=str(tmp_path))
    assert (tmp_path / "rank1.log").read_text().splitlines() == [
        "VARUNA_LIFECYCLE rendezvous", "loss 1.0 VARUNA_LIFECYCLE built", "VARUNA_LIFECYCLE closed"]
    assert (code, err, sup.early_exit) == (0, "", False)
    assert sorted(out.splitlines()) == ["[rank 0 stage 0 replica 0] loss 1.0 ",
                                        "[rank 1 stage 1 replica 0] loss 1.0 "]


def test_the_engine_announces_its_phases_when_asked(capfd, monkeypatch):
    import torch
    from models import build_model, make_batch

    import varuna

    def build_and_close() -> str:
        cfg = varuna.VarunaConfig(global_batch_size=4, micro_batch_size=2)
        engine = varuna.Engine(build_model("onecut"), cfg, example_batch=make_batch("onecut", 4),
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        engine.close()
        return capfd.readouterr().out

    assert "VARUNA_LIFECYCLE" not in build_and_close(), "not under varuna-launch: nothing printed"
    monkeypatch.setenv(LIFECYCLE_VAR, "1")
    lines = [x for x in build_and_close().splitlines() if x.startswith("VARUNA_LIFECYCLE")]
    assert lines == [marker_line(p).strip() for p in PHASES]


#: Note [Echoes of an exit] (varuna/launch/supervisor.py): rank 0 prints what c10d prints when a
#: peer's socket closes, then tells rank 1 (a file) it has; rank 1 then refuses its configuration
#: (argv[1] == "refuse") or exits 0 after printing nothing. Rank 0's line thus always reaches the
#: launcher first, the order a loaded machine produced.
ECHO_WORKER = """
import os, pathlib, sys, time
from varuna.core.config_error import CONFIG_EXIT_CODE, ERROR_PREFIX
said = pathlib.Path(sys.argv[2])
if os.environ["RANK"] == "0":
    print("[E1129 19:14:30.574705783 ProcessGroupGloo.cpp:67] Gloo connectFullMesh failed with "
          "Connection closed by peer [127.0.0.1]:9114", file=sys.stderr, flush=True)
    said.touch()
    sys.exit(0)
deadline = time.monotonic() + 30
while not said.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
if sys.argv[1] == "refuse":
    print(f"{ERROR_PREFIX}pipeline depth 3 exceeds the 2 segments", file=sys.stderr, flush=True)
    sys.exit(CONFIG_EXIT_CODE)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank1", ["refuse", "exit"])
def test_a_peers_echo_of_a_refused_configuration_is_only_logged(tmp_path, rank1):
    """A refused configuration is the job's one line even when another rank's c10d error line
    (the echo of the refusing rank's exit) reached the launcher first; without a refusal (the
    negative control) that line is shown as it is."""
    cfg = LaunchConfig(script="-c", script_args=(ECHO_WORKER, rank1, str(tmp_path / "said")),
                       pipeline_depth=2, data_parallel=1)
    hosts = [LocalHost(slots=2)]
    out, err = io.StringIO(), io.StringIO()
    sup = Supervisor(plan_workers(cfg, hosts, master_port=1), hosts, stop_timeout_s=30.0, stdout=out,
                     stderr=err, log_dir=str(tmp_path / "logs"))
    try:
        sup.start()
        code = sup.wait()
    finally:
        sup.close()
    echo = "Gloo connectFullMesh failed with Connection closed by peer"
    if rank1 == "refuse":
        assert code == 2 and err.getvalue().splitlines() == [
            "varuna-launch: job failed: rank 1 stage 1 replica 0: pipeline depth 3 exceeds the 2 segments"
        ], err.getvalue()
        assert echo in (tmp_path / "logs" / "rank0.log").read_text(), "the echo is kept in the log"
    else:
        assert code == 0, err.getvalue()
        shown = "[rank 0 stage 0 replica 0] [E1129 19:14:30.574705783 ProcessGroupGloo.cpp:67] "
        assert [line for line in err.getvalue().splitlines() if echo in line] == [
            f"{shown}{echo} [127.0.0.1]:9114"]
