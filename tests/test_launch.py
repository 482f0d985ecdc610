"""Tests of the environment contract (varuna.core.env) and the single-machine launcher
(varuna.launch: spec, local, supervisor, job, launcher).

Worker scripts are tiny pure-Python files written to tmp_path, so the multi-process tests cost
interpreter start-ups, not torch imports (except the one gloo test). "No processes left behind"
is checked by pid (each worker writes its pid to a file) with bounded polling, never by timing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from varuna.core.env import WorkerEnv, rank_of, stage_and_replica
from varuna.launch.job import launch
from varuna.launch.launcher import main
from varuna.launch.local import LocalHost
from varuna.launch.spec import LaunchConfig, plan_workers, resolve_data_parallel

PREFIX_RE = re.compile(r"^\[rank (\d+) stage (\d+) replica (\d+)\] (.*)$")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """True if ``pid`` is a live process (a zombie counts as gone: it runs no code)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def _wait_gone(pids: list[int], timeout_s: float = 5.0) -> list[int]:
    """Poll until no pid in ``pids`` is alive or ``timeout_s`` passes; return the survivors."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _wait_files(paths: list[Path], timeout_s: float = 45.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() >= deadline:
            missing = [p.name for p in paths if not p.exists()]
            raise AssertionError(f"files never appeared: {missing}")
        time.sleep(0.02)


def _read_pids(out: Path, names: list[str]) -> list[int]:
    return [int((out / name).read_text()) for name in names]


def _kill_leftovers(pids: list[int]) -> None:
    """Test hygiene: if an assertion failed, do not leave the processes of that test running."""
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# A worker used by the supervision tests. argv: OUT_DIR MODE. It writes OUT_DIR/pid{rank}
# atomically once its signal handlers are installed, then does what MODE says.
BLOCKING_WORKER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, threading, time
    from pathlib import Path
    from varuna.core.env import WorkerEnv

    env = WorkerEnv.from_env()
    out, mode = Path(sys.argv[1]), sys.argv[2]

    def put(name, text=""):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)

    def record_and_exit(signum, frame):
        put(f"{signal.Signals(signum).name}{env.rank}")
        sys.exit(0)

    def record_only(signum, frame):
        put(f"{signal.Signals(signum).name}{env.rank}")

    if mode == "fail":
        if env.rank == env.world_size - 1:
            # Survives SIGTERM (forces the SIGKILL escalation) and leaves a grandchild that
            # only a kill of its whole process group reaches.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            put("grandchild", str(child.pid))
    elif mode == "graceful":
        signal.signal(signal.SIGTERM, record_and_exit)
        signal.signal(signal.SIGUSR1, record_and_exit)
    elif mode == "ignore_int":
        signal.signal(signal.SIGINT, record_only)
    elif mode == "slow_stop":
        # A "checkpoint" that never ends: only a second signal to the launcher can stop it.
        signal.signal(signal.SIGUSR1, record_only)
    elif mode == "leave_child":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        put("grandchild", str(child.pid))
        put(f"pid{env.rank}", str(os.getpid()))
        sys.exit(0)  # a successful worker that forgot its child

    put(f"pid{env.rank}", str(os.getpid()))
    print(f"ready {env.rank}", flush=True)

    if mode == "fail" and env.rank == 1:
        deadline = time.monotonic() + 60  # the others start slowly on a loaded host
        others = [out / f"pid{r}" for r in range(env.world_size) if r != 1]
        while not all(p.exists() for p in others) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("rank 1 giving up", file=sys.stderr, flush=True)
        sys.exit(3)
    threading.Event().wait()  # block forever: only the launcher can end this worker
    """
)


@pytest.fixture
def blocking_worker(tmp_path: Path) -> tuple[Path, Path]:
    script = tmp_path / "blocking_worker.py"
    script.write_text(BLOCKING_WORKER)
    out = tmp_path / "out"
    out.mkdir()
    return script, out


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "varuna.launch", *args]


def _start_cli(tmp_path: Path, args: list[str]) -> subprocess.Popen[bytes]:
    # Output to files, not pipes: nobody would drain a pipe while the test waits.
    with open(tmp_path / "launcher.out", "wb") as out, open(tmp_path / "launcher.err", "wb") as err:
        return subprocess.Popen(_cli(*args), stdout=out, stderr=err, stdin=subprocess.DEVNULL)


# ----------------------------------------------------------------------------------------------
# varuna.core.env: fast, single-process
# ----------------------------------------------------------------------------------------------


def _env_vars(**overrides: str) -> dict[str, str]:
    base = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "4",
        "VARUNA_PIPELINE_DEPTH": "2",
        "VARUNA_DATA_PARALLEL": "2",
        "VARUNA_STAGE": "1",
        "VARUNA_REPLICA": "1",
        "VARUNA_HOST_ID": "0",
    }
    base.update(overrides)
    return base


def test_rank_layout_p2_d2() -> None:
    got = [stage_and_replica(rank, 2) for rank in range(4)]
    assert got == [(0, 0), (1, 0), (0, 1), (1, 1)]  # consecutive ranks = consecutive stages
    assert all(rank_of(stage=s, replica=d, pipeline_depth=2) == r for r, (s, d) in enumerate(got))


def test_worker_env_round_trip() -> None:
    for rank in range(4):
        env = WorkerEnv(
            master_addr="10.0.0.1",
            master_port=1234,
            rank=rank,
            world_size=4,
            local_rank=rank % 2,
            local_world_size=2,
            pipeline_depth=2,
            data_parallel=2,
            host_id=rank // 2,
            extra={"VARUNA_NETEM": "latency=5ms", "VARUNA_RESUME": "1"},
        )
        vars_ = env.to_env()
        assert vars_["VARUNA_STAGE"] == str(rank % 2) and vars_["VARUNA_REPLICA"] == str(rank // 2)
        back = WorkerEnv.from_env({**vars_, "PATH": "/bin"})
        assert back == env
        assert back.netem == "latency=5ms" and back.resume == "1" and back.checkpoint_dir is None


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"WORLD_SIZE": "5"}, "WORLD_SIZE=5 is not VARUNA_PIPELINE_DEPTH=2"),
        ({"RANK": "4"}, "RANK=4 is outside"),
        ({"RANK": "-1"}, "RANK=-1 is outside"),
        ({"VARUNA_STAGE": "0"}, "VARUNA_STAGE=0 is inconsistent with RANK=3"),
        ({"VARUNA_REPLICA": "0"}, "VARUNA_REPLICA=0 is inconsistent with RANK=3"),
        ({"RANK": "three"}, "RANK='three' is not an integer"),
        ({"LOCAL_RANK": "4"}, "LOCAL_RANK=4 is outside"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
        ({"VARUNA_PIPELINE_DEPTH": "0"}, "pipeline_depth must be >= 1"),
    ],
)
def test_worker_env_from_env_rejects_inconsistency(overrides: dict[str, str], needle: str) -> None:
    with pytest.raises(ValueError) as info:
        WorkerEnv.from_env(_env_vars(**overrides))
    message = str(info.value)
    assert needle in message and "\n" not in message


@pytest.mark.parametrize("missing", ["MASTER_ADDR", "MASTER_PORT", "RANK", "VARUNA_PIPELINE_DEPTH"])
def test_worker_env_from_env_missing_variable(missing: str) -> None:
    environ = _env_vars()
    del environ[missing]
    with pytest.raises(ValueError, match=f"{missing} is not set; start workers with varuna-launch"):
        WorkerEnv.from_env(environ)


def test_worker_env_optional_variables_default() -> None:
    environ = _env_vars()
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "VARUNA_STAGE", "VARUNA_REPLICA", "VARUNA_HOST_ID"):
        del environ[name]
    env = WorkerEnv.from_env(environ)
    assert (env.local_rank, env.local_world_size, env.stage, env.replica, env.host_id) == (3, 4, 1, 1, 0)


# ----------------------------------------------------------------------------------------------
# varuna.launch.launcher: planning and argument checking, fast
# ----------------------------------------------------------------------------------------------


def test_plan_workers_contiguous_per_host_and_passthrough() -> None:
    cfg = LaunchConfig(
        script="t.py",
        script_args=["--x", "1"],
        pipeline_depth=2,
        data_parallel=3,
        worker_env={"OMP_NUM_THREADS": "1", "VARUNA_CHECKPOINT_DIR": "/ckpt"},
    )
    hosts = [LocalHost(slots=4), LocalHost(slots=4)]
    specs = plan_workers(cfg, hosts, master_port=4321, launcher_environ={"VARUNA_NETEM": "x", "HOME": "/h"})
    assert [(s.env.rank, s.env.host_id, s.env.local_rank, s.env.local_world_size) for s in specs] == [
        (0, 0, 0, 4),
        (1, 0, 1, 4),
        (2, 0, 2, 4),
        (3, 0, 3, 4),
        (4, 1, 0, 2),
        (5, 1, 1, 2),
    ]
    spec = specs[5]
    assert spec.label == "rank 5 stage 1 replica 2"
    assert spec.argv[1:] == ("t.py", "--x", "1")
    assert spec.set_vars["VARUNA_NETEM"] == "x" and spec.set_vars["VARUNA_CHECKPOINT_DIR"] == "/ckpt"
    assert spec.set_vars["OMP_NUM_THREADS"] == "1" and "HOME" not in spec.set_vars
    assert spec.set_vars["PYTHONUNBUFFERED"] == "1"
    assert WorkerEnv.from_env(spec.set_vars) == spec.env


def test_plan_workers_not_enough_slots() -> None:
    cfg = LaunchConfig(script="t.py", pipeline_depth=4, data_parallel=2)
    with pytest.raises(ValueError, match="need 8 slots but the hosts have 6"):
        plan_workers(cfg, [LocalHost(slots=3), LocalHost(slots=3)], master_port=1)


def test_module_argv_and_config_validation() -> None:
    cfg = LaunchConfig(script="pkg.train", module=True, script_args=("a",), pipeline_depth=1, data_parallel=1)
    assert cfg.worker_argv()[1:] == ("-m", "pkg.train", "a")
    with pytest.raises(ValueError, match="cannot set contract variables"):
        LaunchConfig(script="t.py", pipeline_depth=1, data_parallel=1, worker_env={"RANK": "0"})
    with pytest.raises(ValueError, match="--stop-timeout must be >= 0"):
        LaunchConfig(script="t.py", pipeline_depth=1, data_parallel=1, stop_timeout_s=-1)


def test_resolve_data_parallel() -> None:
    assert resolve_data_parallel(8, 4, None) == 2
    assert resolve_data_parallel(8, 4, 2) == 2
    with pytest.raises(
        ValueError, match=r"^--procs 6 is not --pipeline-depth 4 × --data-parallel D .*--procs 8"
    ):
        resolve_data_parallel(6, 4, None)
    with pytest.raises(ValueError, match="use --procs 9 or --data-parallel 2"):
        resolve_data_parallel(6, 3, 3)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--procs", "6", "--pipeline-depth", "4", "SCRIPT"], "--procs 6 is not --pipeline-depth 4 ×"),
        (["--procs", "4", "--pipeline-depth", "2", "--data-parallel", "3", "SCRIPT"], "use --procs 6"),
        (["--procs", "2", "--pipeline-depth", "2", "no_such_script.py"], "'no_such_script.py' not found"),
        (["--procs", "2", "--pipeline-depth", "2"], "no SCRIPT given"),
        (["--procs", "2", "SCRIPT"], "required: --pipeline-depth"),
        (["--procs", "two", "--pipeline-depth", "2", "SCRIPT"], "invalid int value: 'two'"),
        (["--procs", "2", "--pipeline-depth", "2", "--stop-timeout", "-1", "SCRIPT"], "--stop-timeout"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "ok.py"
    script.write_text("raise SystemExit('must not run')\n")
    argv = [str(script) if a == "SCRIPT" else a for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("varuna-launch: error: ") and needle in lines[0]


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "--pipeline-depth" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# varuna.launch.launcher: real processes
# ----------------------------------------------------------------------------------------------

ENV_WORKER = textwrap.dedent(
    """
    import json, os, sys
    from varuna.core.env import WorkerEnv

    env = WorkerEnv.from_env()
    print(json.dumps({"rank": env.rank, "stage": env.stage, "replica": env.replica,
                      "world_size": env.world_size, "local_rank": env.local_rank,
                      "local_world_size": env.local_world_size, "P": env.pipeline_depth,
                      "D": env.data_parallel, "host_id": env.host_id, "netem": env.netem,
                      "master": [env.master_addr, env.master_port], "argv": sys.argv[1:],
                      "raw_stage": os.environ["VARUNA_STAGE"]}))
    for i in range(50):
        print(f"seq {i}")
    print(f"to stderr {env.rank}", file=sys.stderr)
    sys.stdout.write("no trailing newline")
    """
)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_launch_p2_d2_env_prefixes_and_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "env_worker.py"
    script.write_text(ENV_WORKER)
    monkeypatch.setenv("VARUNA_NETEM", "latency=1ms")
    cfg = LaunchConfig(
        script=str(script),
        script_args=("a", "--b"),
        pipeline_depth=2,
        data_parallel=2,
        log_dir=str(tmp_path / "logs"),
    )
    assert launch(cfg) == 0
    captured = capsys.readouterr()

    infos: dict[int, dict] = {}
    seq: dict[int, list[int]] = {r: [] for r in range(4)}
    for line in captured.out.splitlines():
        match = PREFIX_RE.match(line)
        assert match, f"unprefixed line: {line!r}"
        rank, stage, replica = (int(g) for g in match.groups()[:3])
        assert (stage, replica) == stage_and_replica(rank, 2)
        body = match.group(4)
        if body.startswith("{"):
            infos[rank] = json.loads(body)
        elif body.startswith("seq "):
            seq[rank].append(int(body.split()[1]))
        else:
            assert body == "no trailing newline"
    assert sorted(infos) == [0, 1, 2, 3]
    ports = {tuple(info["master"]) for info in infos.values()}
    assert len(ports) == 1 and next(iter(ports))[0] == "127.0.0.1"
    for rank, info in infos.items():
        assert (info["stage"], info["replica"]) == (rank % 2, rank // 2)
        assert info["raw_stage"] == str(rank % 2)
        assert (info["world_size"], info["P"], info["D"]) == (4, 2, 2)
        assert (info["local_rank"], info["local_world_size"], info["host_id"]) == (rank, 4, 0)
        assert info["netem"] == "latency=1ms" and info["argv"] == ["a", "--b"]
        assert seq[rank] == list(range(50)), "per-worker line order must be kept"
    for rank in range(4):
        assert (
            f"[rank {rank} stage {rank % 2} replica {rank // 2}] to stderr {rank}"
            in captured.err.splitlines()
        )

    logs = tmp_path / "logs"
    assert "to stderr 2" in (logs / "rank2.log").read_text()
    record = json.loads((logs / "launch.json").read_text())
    assert record["world_size"] == 4 and [w["stage"] for w in record["workers"]] == [0, 1, 0, 1]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_launch_module(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mymod.py").write_text("import os\nprint('module rank', os.environ['RANK'])\n")
    monkeypatch.chdir(tmp_path)  # `python -m` finds modules in the working directory
    assert main(["--procs", "2", "--pipeline-depth", "1", "-m", "mymod"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == [
        "[rank 0 stage 0 replica 0] module rank 0",
        "[rank 1 stage 0 replica 1] module rank 1",
    ]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_failed_worker_stops_all_and_leaves_no_process(
    blocking_worker: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    script, out = blocking_worker
    cfg = LaunchConfig(
        script=str(script),
        script_args=(str(out), "fail"),
        pipeline_depth=2,
        data_parallel=2,
        stop_timeout_s=1.0,
    )
    code = launch(cfg)
    names = ["pid0", "pid1", "pid2", "pid3", "grandchild"]
    pids = _read_pids(out, names)
    try:
        assert code == 1
        err = capsys.readouterr().err
        assert "[rank 1 stage 1 replica 0] rank 1 giving up" in err
        last = err.splitlines()[-1]
        assert last == "varuna-launch: job failed: rank 1 stage 1 replica 0 exited with code 3"
        assert "rank(s) 3 did not exit within 1 s; sending SIGKILL" in err  # rank 3 ignored SIGTERM
        # The workers were reaped by launch(); the grandchild died with its worker's group.
        assert _wait_gone(pids) == []
    finally:
        _kill_leftovers(pids)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_child_left_by_successful_worker_is_killed(
    blocking_worker: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    script, out = blocking_worker
    cfg = LaunchConfig(
        script=str(script), script_args=(str(out), "leave_child"), pipeline_depth=1, data_parallel=1
    )
    assert launch(cfg) == 0
    pids = _read_pids(out, ["pid0", "grandchild"])
    try:
        assert _wait_gone(pids) == []
    finally:
        _kill_leftovers(pids)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sigterm_to_launcher_is_forwarded_and_leaves_no_process(
    tmp_path: Path, blocking_worker: tuple[Path, Path]
) -> None:
    script, out = blocking_worker
    launcher = _start_cli(
        tmp_path,
        ["--procs", "4", "--pipeline-depth", "2", "--stop-timeout", "30", str(script), str(out), "graceful"],
    )
    pids: list[int] = []
    try:
        _wait_files([out / f"pid{r}" for r in range(4)])
        pids = _read_pids(out, [f"pid{r}" for r in range(4)])
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=20) == 128 + signal.SIGTERM
        assert all((out / f"SIGTERM{r}").exists() for r in range(4)), "each worker saw the forwarded SIGTERM"
        assert _wait_gone(pids) == []
        assert "received SIGTERM; forwarding it to 4 worker(s)" in (tmp_path / "launcher.err").read_text()
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
        _kill_leftovers(pids)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_second_sigint_kills_at_once(tmp_path: Path, blocking_worker: tuple[Path, Path]) -> None:
    script, out = blocking_worker
    # A 60 s grace period: the job can only end within the wait below through the second SIGINT.
    launcher = _start_cli(
        tmp_path,
        [
            "--procs",
            "2",
            "--pipeline-depth",
            "2",
            "--stop-timeout",
            "60",
            str(script),
            str(out),
            "ignore_int",
        ],
    )
    pids: list[int] = []
    try:
        _wait_files([out / "pid0", out / "pid1"])
        pids = _read_pids(out, ["pid0", "pid1"])
        launcher.send_signal(signal.SIGINT)
        _wait_files([out / "SIGINT0", out / "SIGINT1"])  # forwarded, and ignored by the workers
        assert launcher.poll() is None
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=20) == 128 + signal.SIGINT
        assert _wait_gone(pids) == []
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
        _kill_leftovers(pids)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sigusr1_is_forwarded(tmp_path: Path, blocking_worker: tuple[Path, Path]) -> None:
    script, out = blocking_worker
    launcher = _start_cli(
        tmp_path, ["--procs", "2", "--pipeline-depth", "1", str(script), str(out), "graceful"]
    )
    pids: list[int] = []
    try:
        _wait_files([out / "pid0", out / "pid1"])
        pids = _read_pids(out, ["pid0", "pid1"])
        launcher.send_signal(signal.SIGUSR1)
        # The workers "checkpoint and exit" with code 0, so the job succeeds.
        assert launcher.wait(timeout=20) == 0
        assert (out / "SIGUSR10").exists() and (out / "SIGUSR11").exists()
        assert _wait_gone(pids) == []
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
        _kill_leftovers(pids)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_second_signal_after_sigusr1_kills_at_once(
    tmp_path: Path, blocking_worker: tuple[Path, Path]
) -> None:
    script, out = blocking_worker
    launcher = _start_cli(
        tmp_path, ["--procs", "2", "--pipeline-depth", "2", str(script), str(out), "slow_stop"]
    )
    pids: list[int] = []
    try:
        _wait_files([out / "pid0", out / "pid1"])
        pids = _read_pids(out, ["pid0", "pid1"])
        launcher.send_signal(signal.SIGUSR1)
        _wait_files([out / "SIGUSR10", out / "SIGUSR11"])  # forwarded; the workers keep "saving"
        assert launcher.poll() is None, "no deadline after SIGUSR1: a checkpoint takes what it takes"
        launcher.send_signal(signal.SIGUSR1)
        assert launcher.wait(timeout=20) == 128 + signal.SIGUSR1
        assert _wait_gone(pids) == []
        assert (
            "received SIGUSR1 after SIGUSR1; killing 2 worker(s) now"
            in (tmp_path / "launcher.err").read_text()
        )
    finally:
        launcher.kill()
        launcher.wait(timeout=10)
        _kill_leftovers(pids)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sigkill_of_launcher_kills_workers(tmp_path: Path, blocking_worker: tuple[Path, Path]) -> None:
    script, out = blocking_worker
    launcher = _start_cli(tmp_path, ["--procs", "4", "--pipeline-depth", "4", str(script), str(out), "block"])
    pids: list[int] = []
    try:
        _wait_files([out / f"pid{r}" for r in range(4)])
        pids = _read_pids(out, [f"pid{r}" for r in range(4)])
        launcher.kill()  # SIGKILL: no launcher code runs; only PR_SET_PDEATHSIG can end the workers
        launcher.wait(timeout=10)
        assert _wait_gone(pids, timeout_s=5.0) == []
    finally:
        _kill_leftovers(pids)


def test_console_script_bad_arguments(tmp_path: Path) -> None:
    result = subprocess.run(
        _cli("--procs", "6", "--pipeline-depth", "4", "x.py"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "varuna-launch: error: --procs 6 is not --pipeline-depth 4 × --data-parallel D for any D;"
        " use --procs 4 or --procs 8"
    ]


GLOO_WORKER = textwrap.dedent(
    """
    import datetime
    import torch
    import torch.distributed as dist
    from varuna.core.env import WorkerEnv

    env = WorkerEnv.from_env()
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    assert (dist.get_rank(), dist.get_world_size()) == (env.rank, env.world_size)
    value = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(value)
    print(f"all_reduce={value.item():g}")
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_torch_gloo_all_reduce(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "gloo_worker.py"
    script.write_text(GLOO_WORKER)
    cfg = LaunchConfig(
        script=str(script), pipeline_depth=2, data_parallel=1, worker_env={"OMP_NUM_THREADS": "1"}
    )
    code = launch(cfg)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert sorted(line for line in captured.out.splitlines() if "all_reduce=" in line) == [
        "[rank 0 stage 0 replica 0] all_reduce=3",
        "[rank 1 stage 1 replica 0] all_reduce=3",
    ]
