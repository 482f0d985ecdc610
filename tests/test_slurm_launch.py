"""``varuna-launch --slurm`` without Slurm (fast): the host-list grammar against the examples of
Slurm's documentation (``scontrol show hostnames``, checked against the real command in
tests/test_slurm.py), per-node counts, slots from tasks or GPUs (Note [Slurm slots]), the bad
inputs (not in an allocation, a node list that does not expand, fewer slots than P: one line
each), the srun remote-start argv, and the signal path (agents report, the supervisor makes one
graceful stop of many copies)."""

from __future__ import annotations

import io
import json
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from slurm_cluster import wait_for  # noqa: E402 - a polling helper; no Slurm needed

from varuna.launch.agent import Agent
from varuna.launch.agent_host import AgentHost
from varuna.launch.hosts import HostEntry
from varuna.launch.job import HostsAttempt
from varuna.launch.launcher import main
from varuna.launch.local import LocalHost
from varuna.launch.protocol import encode_message
from varuna.launch.slurm import MAX_NODES, allocation_from_env, expand_counts, expand_hostlist
from varuna.launch.spec import LaunchConfig, plan_workers
from varuna.launch.srun import SrunOptions
from varuna.launch.supervisor import Supervisor


@pytest.mark.parametrize(
    "text,names",
    [
        # The forms of Slurm's hostlist documentation (scontrol(1) "show hostnames", sbatch(1)).
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("linux[00-02]", ["linux00", "linux01", "linux02"]),
        ("lx[10-12,20]", ["lx10", "lx11", "lx12", "lx20"]),
        ("tux[0-1],login", ["tux0", "tux1", "login"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("gpu-[098-100]", ["gpu-098", "gpu-099", "gpu-100"]),
        ("a[5],b", ["a5", "b"]),
    ],
)
def test_hostlist_expands_as_documented(text: str, names: list[str]) -> None:
    assert expand_hostlist(text) == names


@pytest.mark.parametrize(
    "text,why",
    [
        ("n[1-", "'[' without ']'"),
        ("n1-2]", "']' without '['"),
        ("n[3-1]", "runs backwards"),
        ("n[a-b]", "not a number or a range"),
        ("n[]", "empty '[]'"),
        ("n[[1]]", "nested"),
        ("", "empty"),
        ("a,,b", "empty name"),
        ("n[1 -2]", "blanks"),
        (f"n[1-{MAX_NODES + 1}]", f"more than {MAX_NODES} names"),
    ],
)
def test_bad_hostlists_are_one_line_naming_the_problem(text: str, why: str) -> None:
    with pytest.raises(ValueError) as info:
        expand_hostlist(text)
    message = str(info.value)
    assert "\n" not in message and why in message and "is not a Slurm host list" in message, message


def test_per_node_counts() -> None:
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("8") == [8]
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE='2x3' is not a list of counts"):
        expand_counts("2x3")


def _alloc(**env: str):
    return allocation_from_env({"SLURM_JOB_ID": "42", **env}, scontrol=None)


def test_slots_from_tasks_gpus_and_their_conflict() -> None:
    a = _alloc(SLURM_JOB_NODELIST="n[1-3]", SLURM_TASKS_PER_NODE="2(x2),1", SLURM_NTASKS_PER_NODE="2",
               SLURM_JOB_CPUS_PER_NODE="8(x3)", SLURM_RESTART_COUNT="2")  # fmt: skip
    assert [(e.host, e.slots) for e in a.entries()] == [("n1", 2), ("n2", 2), ("n3", 1)]
    assert a.cpus == (8, 8, 8) and a.restart_count == 2 and a.job_id == "42"
    # No task count asked, GPUs given: one worker per GPU.
    gpus = _alloc(SLURM_JOB_NODELIST="g[1-2]", SLURM_TASKS_PER_NODE="1(x2)", SLURM_GPUS_PER_NODE="a100:4")
    assert gpus.slots == (4, 4) and gpus.slots_from == "GPUs per node"
    # Tasks asked, as many GPUs: the tasks.
    same = _alloc(SLURM_JOB_NODELIST="g1", SLURM_TASKS_PER_NODE="4", SLURM_NTASKS_PER_NODE="4",
                  SLURM_GPUS_ON_NODE="4")  # fmt: skip
    assert same.slots == (4,)
    with pytest.raises(ValueError, match="8 tasks on a node but 4 GPU"):
        _alloc(SLURM_JOB_NODELIST="g1", SLURM_TASKS_PER_NODE="8", SLURM_NTASKS="8", SLURM_GPUS_PER_NODE="4")
    with pytest.raises(ValueError, match="counts 1 node.* names 2"):
        _alloc(SLURM_JOB_NODELIST="n[1-2]", SLURM_TASKS_PER_NODE="2")
    with pytest.raises(ValueError, match="names a node twice"):
        _alloc(SLURM_JOB_NODELIST="n1,n1", SLURM_TASKS_PER_NODE="1(x2)")


def test_launcher_under_a_many_task_srun_is_one_line() -> None:
    with pytest.raises(ValueError, match="task 1 of 4 of job step 0: .* not under srun"):
        _alloc(SLURM_JOB_NODELIST="n1", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="4", SLURM_PROCID="1")
    # The batch script itself (no step), or a one-task step, is fine.
    assert _alloc(SLURM_JOB_NODELIST="n1", SLURM_NTASKS="4", SLURM_TASKS_PER_NODE="4").slots == (4,)
    assert _alloc(SLURM_JOB_NODELIST="n1", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="1").slots == (1,)


def test_node_names_varuna_cannot_use_are_one_line() -> None:
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST node 1.*a Slurm node name varuna cannot use"):
        _alloc(SLURM_JOB_NODELIST="bad_name", SLURM_TASKS_PER_NODE="1").entries()


def test_srun_agent_argv_takes_the_whole_node_and_never_a_shell() -> None:
    argv = SrunOptions(cpus={"n1": 16}).agent_argv(
        HostEntry(host="n1", slots=4), python="/opt/py", pythonpath=["/src"], agent_args=["--job-id", "j"]
    )
    assert argv[0] == "srun" and "--overlap" in argv and "--nodelist=n1" in argv
    assert "--cpus-per-task=16" in argv and "--mem=0" in argv and "--ntasks=1" in argv
    assert argv[-5:] == ["/opt/py", "-m", "varuna.launch.agent", "--job-id", "j"]
    environ = {"PATH": "/bin", "VARUNA_SSH_KEY": "k", "PYTHONPATH": "/x", "SLURM_JOB_ID": "5",
               "SLURM_GPUS_PER_TASK": "1", "SLURM_NTASKS_PER_NODE": "4",
               "SLURM_CPUS_PER_TASK": "2"}  # fmt: skip
    env = SrunOptions().agent_env(environ, ["/src"])
    assert env == {"PATH": "/bin", "PYTHONPATH": "/src:/x", "SLURM_JOB_ID": "5"}


def test_srun_agents_report_signals_and_the_host_hands_them_on() -> None:
    host = AgentHost(HostEntry(host="n1", slots=1), 0, job_id="j", remote=SrunOptions(),
                     on_signal=seen.append if (seen := []) is not None else None)  # fmt: skip
    assert host.agent_argv()[-1] == "--report-signals"
    host._dispatch(encode_message({"type": "signaled", "signal": "SIGTERM"}))
    host._dispatch(encode_message({"type": "signaled", "signal": "SIGKILL"}))  # not a stop: ignored
    assert seen == [signal.SIGTERM]
    # A pretend localhost of --hosts still starts directly, without ssh and without reports.
    local = AgentHost(HostEntry(host="localhost", slots=1), 0, job_id="j")
    argv = local.agent_argv()
    assert argv[1:3] == ["-m", "varuna.launch.agent"] and "--report-signals" not in argv


def test_reporting_agent_leaves_its_workers_running() -> None:
    out = io.BytesIO()
    agent = Agent(job_id="j", host_id=0, stdout=out, report_signals=True)
    agent._writer.start()  # lines go out through the agent's writer thread (its run() starts it)
    agent._on_signal(signal.SIGTERM)
    agent._flush_and_stop_writer(timeout_s=30)
    assert json.loads(out.getvalue().decode().splitlines()[0]) == {"type": "signaled", "signal": "SIGTERM"}
    assert agent._stopping is None
    acting = Agent(job_id="j", host_id=0, stdout=io.BytesIO())
    acting._on_signal(signal.SIGTERM)
    assert acting._stopping == "received SIGTERM"  # negative control: the --hosts agent stops


# -- the command line ----------------------------------------------------------------------------


@pytest.fixture
def no_slurm_commands(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An environment without SLURM_* and without Slurm's commands on PATH (the pure grammar)."""
    import os

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('must not run')\n")
    return script


def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith("varuna-launch: error: "), captured.err
    return lines[0]


def test_slurm_outside_an_allocation_is_one_line(no_slurm_commands: Path, capsys) -> None:
    line = _one_error_line(capsys, ["--slurm", "--pipeline-depth", "2", str(no_slurm_commands)])
    assert "--slurm needs a Slurm allocation" in line and "sbatch" in line


def test_slurm_node_list_that_does_not_expand_is_one_line(
    no_slurm_commands: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-")
    line = _one_error_line(capsys, ["--slurm", "--pipeline-depth", "2", str(no_slurm_commands)])
    assert "SLURM_JOB_NODELIST: 'n[1-' is not a Slurm host list" in line


def test_slurm_fewer_slots_than_p_is_one_line(no_slurm_commands: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1(x2)")
    line = _one_error_line(capsys, ["--slurm", "--pipeline-depth", "4", str(no_slurm_commands)])
    assert "Slurm job 5: 2 node(s) × 1 slot(s)" in line and "fewer slots than the 4 stages" in line
    line = _one_error_line(capsys, ["--slurm", "--procs-per-host", "1", "--pipeline-depth", "4",
                                    str(no_slurm_commands)])  # fmt: skip
    assert "--procs-per-host 1" in line


def test_slurm_with_procs_or_hosts_is_one_line(no_slurm_commands: Path, capsys) -> None:
    p2 = ["--pipeline-depth", "2", str(no_slurm_commands)]
    assert "not both --procs and --slurm" in _one_error_line(capsys, ["--procs", "2", "--slurm", *p2])
    assert "--no-requeue needs --slurm" in _one_error_line(capsys, ["--procs", "2", "--no-requeue", *p2])
    # --live-morph and --max-restarts run under --slurm as under --hosts (the same supervision
    # and restart path); they need a checkpoint directory there too.
    for option in (["--live-morph"], ["--max-restarts", "2"]):
        line = _one_error_line(capsys, ["--slurm", *option, *p2])
        assert f"{' '.join(option)} needs --checkpoint-dir DIR" in line, line


# -- one graceful stop of the scheduler's many copies (multi-process) ----------------------------

WAITER = """
import os, signal, sys
got = []
def on(s, f):
    got.append(signal.Signals(s).name)
for s in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(s, on)
open(sys.argv[1] + os.environ["RANK"], "w").close()
while not got:
    signal.pause()
print("stopped by", got[0], flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("scheduler_stop", [True, False])
def test_scheduler_stop_sigterm_is_graceful_and_copies_are_ignored(
    scheduler_stop: bool, tmp_path: Path
) -> None:
    """Slurm's SIGTERM arrives at the launcher and through every agent: with ``scheduler_stop``
    the first is forwarded without a deadline, the copies are ignored and the workers' exit 0 is
    the job's; without it (negative control) the second SIGTERM kills them at once (143)."""
    ready = tmp_path / "ready"
    cfg = LaunchConfig(script="-c", script_args=(WAITER, str(ready)), pipeline_depth=2, data_parallel=1,
                       stop_timeout_s=60)  # fmt: skip
    hosts = [LocalHost(slots=2)]
    out, err = io.StringIO(), io.StringIO()
    sup = Supervisor(plan_workers(cfg, hosts, master_port=29500), hosts, stdout=out, stderr=err,
                     stop_timeout_s=60, scheduler_stop=scheduler_stop)  # fmt: skip
    try:
        sup.start()
        wait_for(lambda: all((tmp_path / f"ready{r}").exists() for r in range(2)), 60, "both workers ready")
        for signum in (signal.SIGTERM, signal.SIGTERM, signal.SIGUSR1):
            sup.notify_signal(signum)
        code = sup.wait()
    finally:
        sup.close()
    if scheduler_stop:
        assert code == 0 and sup.graceful_signal == signal.SIGTERM, err.getvalue()
        assert out.getvalue().count("stopped by SIGTERM") == 2, out.getvalue()
        assert "killing" not in err.getvalue()
    else:
        assert code == 128 + signal.SIGTERM and "killing 2 worker(s) now" in err.getvalue(), err.getvalue()



# -- P×D for what the allocation holds, and the requeue decision (nothing started) ----------------


@pytest.fixture
def hosts_launched(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """What ``varuna-launch --slurm`` hands to each launch of ``run_with_restarts``
    (``attempt_on_hosts``; nothing is started)."""
    import varuna.launch.recovery

    calls: list[dict] = []

    def fake(config, entries, signals, **kwargs) -> HostsAttempt:
        calls.append({"config": config, "entries": list(entries), **kwargs})
        return HostsAttempt(0)

    monkeypatch.setattr(varuna.launch.recovery, "attempt_on_hosts", fake)
    return calls


def _slurm_env(monkeypatch: pytest.MonkeyPatch, nodes: str, tasks: str) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_JOB_NODELIST", nodes)
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", tasks)
    monkeypatch.setenv("SLURM_JOB_CPUS_PER_NODE", tasks)


def test_auto_config_plans_for_the_nodes_the_allocation_has(
    no_slurm_commands: Path, monkeypatch: pytest.MonkeyPatch, hosts_launched: list[dict]
) -> None:
    from varuna.core.calibration import Calibration

    cal = no_slurm_commands.parent / "cal.json"
    Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1, 2, 4)).save(cal)
    plan = ["--slurm", "--calibration", str(cal), "--global-batch-size", "16", str(no_slurm_commands)]
    for nodes, tasks, slots in (("n[1-2]", "2(x2)", 4), ("n1", "2", 2)):
        _slurm_env(monkeypatch, nodes, tasks)
        assert main(plan) == 0
        call = hosts_launched[-1]
        config, entries, remote = call["config"], call["entries"], call["remote"]
        assert 1 <= config.pipeline_depth * config.data_parallel <= slots
        assert sum(e.slots for e in entries) >= config.world_size and entries[0].host == "n1"
        assert isinstance(remote, SrunOptions) and remote.cpus["n1"] == 2
        assert "VARUNA_STAGE_RANGES" in config.worker_env  # auto-config's plan reaches the workers


def test_requeue_after_slurms_stop_signal_only(
    no_slurm_commands: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """After a SIGUSR1/SIGTERM the launcher asks Slurm to requeue (scontrol is absent here, so the
    answer is the one line saying why not, and the ``requeue`` event says so); after SIGINT, with
    --no-requeue, or without a signal, it does not."""
    import varuna.launch.recovery

    stops: tuple[int, ...] = ()

    def fake(config, entries, signals, **kwargs) -> HostsAttempt:
        # The job got these signals (as an srun agent's report reaches them), then ended with 0.
        for signum in stops:
            signals.notify(signum)
        signals.pending.clear()  # no supervisor here to take them
        return HostsAttempt(0)

    monkeypatch.setattr(varuna.launch.recovery, "attempt_on_hosts", fake)
    _slurm_env(monkeypatch, "n[1-2]", "1(x2)")
    logs = tmp_path / "logs"
    argv = ["--slurm", "--pipeline-depth", "2", "--log-dir", str(logs), str(no_slurm_commands)]
    usr1, term = signal.SIGUSR1, signal.SIGTERM
    cases = [((usr1, usr1), [], True), ((term,), [], True), ((signal.SIGINT,), [], False),
             ((usr1,), ["--no-requeue"], False), ((), [], False)]  # fmt: skip
    for stops, extra, requeued in cases:
        assert main([*extra, *argv]) == 0
        err = capsys.readouterr().err
        said = [line for line in err.splitlines() if "requeue" in line]
        if requeued:
            name = signal.Signals(stops[0]).name
            assert said == [
                f"varuna-launch: stopped by {name} from Slurm; requeueing job 5 (the next run resumes from"
                " the newest checkpoint)",
                "varuna-launch: job 5 not requeued: cannot run scontrol: No such file or directory; submit"
                " the script again to resume",
            ], err
        else:
            assert said == [], err
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["job"], e["signal"], e["requeued"]) for e in events] == [
        ("requeue", "5", "SIGUSR1", False), ("requeue", "5", "SIGTERM", False)]
    assert all(e["why"].startswith("cannot run scontrol") for e in events), events


def test_max_restarts_under_slurm_relaunches_on_the_nodes_left(
    no_slurm_commands: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``--slurm --max-restarts`` takes ``--hosts``' restart path (Note [Restarts on hosts]): a
    node lost in the first launch is left out, P×D is planned again for the node left, the
    relaunch's workers get VARUNA_RESTARTS=1 and srun agents, and events.jsonl records it."""
    import varuna.launch.recovery

    calls: list[dict] = []

    def fake(config, entries, signals, **kwargs) -> HostsAttempt:
        calls.append({"config": config, "entries": list(entries), **kwargs})
        if len(calls) == 1:
            return HostsAttempt(1, [entries[1]], "host h1=n2 went silent")
        return HostsAttempt(0)

    monkeypatch.setattr(varuna.launch.recovery, "attempt_on_hosts", fake)
    _slurm_env(monkeypatch, "n[1-2]", "2(x2)")
    logs = tmp_path / "logs"
    argv = ["--slurm", "--pipeline-depth", "2", "--max-restarts", "1", "--checkpoint-dir",
            str(tmp_path / "c"), "--log-dir", str(logs), "--host-timeout", "7", str(no_slurm_commands)]
    assert main(argv) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert [len(c["entries"]) for c in calls] == [2, 1] and calls[1]["entries"][0].host == "n1"
    assert [(c["config"].pipeline_depth, c["config"].data_parallel) for c in calls] == [(2, 2), (2, 1)]
    assert [c["config"].worker_env["VARUNA_RESTARTS"] for c in calls] == ["0", "1"]
    assert all(isinstance(c["remote"], SrunOptions) and c["host_timeout_s"] == 7 for c in calls)
    relaunch = "relaunching on the 1 host(s) left from the newest checkpoint (restart 1 of 1); left out: n2"
    assert relaunch in err, err
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["restart"] and events[0]["left_out"] == ["n2"]
