"""``varuna-launch --slurm`` on a real one-host Slurm cluster (slow): munge, slurmctld and two
slurmd (nodes n1, n2) from Debian's slurm-wlm, started by tests/slurm_cluster.py; skipped in one
line where they cannot run (not root, not installed: ``scripts/setup.sh --tests``).

The main test submits the GPT example with ``sbatch examples/slurm/gpt2.sbatch`` (deterministic
mode): it runs at P=2 × D=2 on both nodes through srun agents; with n2 drained (the node going
away), ``scancel --signal=USR1`` stops it with a checkpoint and the launcher requeues it; the
requeued run gets one node, resumes at P=2 × D=1 and finishes with final weights bit-identical
to an undisturbed single-process run (scripts/chaos.py's byte comparison of every tensor) and the
same loss at every step; no process of the job is left. Every wait is on an observable state (job
state, output lines), with a timeout.

The others run ``varuna-launch --slurm`` under ``salloc -N2`` through main's restart, silence and
live-morph paths: ``--max-restarts`` relaunching after a failed worker (negative control: without
it the job fails), an srun agent SIGSTOPped (named silent, relaunch on the node left), and
``--live-morph`` (a member killed, the survivors regroup without a restart).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from slurm_cluster import SlurmCluster, wait_for, why_not_available  # noqa: E402

from varuna.launch.slurm import allocation_from_env, expand_hostlist  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "gpt2" / "train.py"
SBATCH = ROOT / "examples" / "slurm" / "gpt2.sbatch"
STEPS = 16
MODEL_ARGS = [
    "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--global-batch-size", "8",
    "--micro-batch-size", "2", "--eval-every", "0", "--seed", "0", "--deterministic",
]  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    why = why_not_available()
    if why is not None:
        pytest.skip(why)
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def _chaos():
    spec = importlib.util.spec_from_file_location("varuna_chaos_script", ROOT / "scripts" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _clean_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("VARUNA_CHECKPOINT_DIR", "VARUNA_RESUME", "VARUNA_MANAGER", "VARUNA_LIVE_STORE"):
        env.pop(key, None)
    return env


def _processes_with(marker: str) -> list[int]:
    """Processes whose environment mentions ``marker`` (this test's checkpoint directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.timeout(420)
def test_gpt_sbatch_2x2_stopped_by_usr1_requeued_on_one_node_bit_identical(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    chaos = _chaos()
    train_args = ["--steps", str(STEPS), *MODEL_ARGS, "--checkpoint-every", str(STEPS)]
    # The undisturbed reference: one process, same arguments, beside the Slurm job.
    ref_ckpt, ref_metrics = tmp_path / "ref-ckpt", tmp_path / "ref-metrics.jsonl"
    reference = subprocess.Popen(
        [sys.executable, str(TRAIN), *train_args, "--checkpoint-dir", str(ref_ckpt),
         "--metrics-out", str(ref_metrics)],
        env=_clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    ckpt, metrics, out = tmp_path / "ckpt", tmp_path / "metrics.jsonl", tmp_path / "job.out"
    gate = tmp_path / "gate"
    env = {
        **_clean_env(),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
        # Holds the first run after step 2 until the stop arrived (tests/slurm_gate.py).
        "VARUNA_ENGINE_PLUGINS": "slurm_gate:attach",
        "VARUNA_TEST_GATE": str(gate),
        "VARUNA_CKPT": str(ckpt),
        "VARUNA_LAUNCH": f"{sys.executable} -m varuna.launch",
    }
    job = ""
    try:
        job = cluster.run(
            "sbatch", "--parsable", f"--output={out}", str(SBATCH), *train_args,
            "--metrics-out", str(metrics), env=env, cwd=ROOT,
        ).stdout.strip().split(";")[0]

        def text() -> str:
            return out.read_text(errors="replace") if out.exists() else ""

        wait_for(lambda: gate.exists() or cluster.job_state(job) not in ("PENDING", "RUNNING"), 180,
                 f"job {job} at step 2 ({text()[-2000:]})")
        first = text()
        assert "P=2 × D=2 on 2 host(s): n1 (2 workers), n2 (2 workers)" in first, first
        # n2 goes away (drained: the running job keeps it, a new run cannot have it), then the stop.
        cluster.run("scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=varuna-test")
        cluster.run("scancel", "--signal=USR1", job)
        wait_for(lambda: cluster.job_state(job) == "PENDING", 120, f"job {job} requeued ({text()[-2000:]})")
        # Slurm requeues a job with the task count of its first allocation (4 tasks: 2 nodes); the
        # scheduler giving it the one node left is this update (docs/slurm.md, Requeue). It starts
        # once the node has let go of the first run's credential (tests/slurm_cluster.py).
        cluster.run("scontrol", "update", f"JobId={job}", "NumNodes=1", "NumTasks=2")
        wait_for(lambda: cluster.job_state(job) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 240,
                 f"job {job} to finish ({text()[-2000:]})")
        log = text()
        assert cluster.job_state(job) == "COMPLETED", log[-4000:]
        assert cluster.job_field(job, "Restarts") == "1", log[-4000:]
    finally:
        if job:
            cluster.run("scancel", job, check=False)
        cluster.run("scontrol", "update", "NodeName=n2", "State=RESUME", check=False)
        reference_err = reference.communicate(timeout=300)[1]
    assert reference.returncode == 0, reference_err.decode(errors="replace")[-2000:]

    first_run, _, second_run = log.partition("run 1 on ")
    assert "stopped by SIGUSR1 from Slurm; requeueing job" in first_run, first_run[-3000:]
    stopped = sorted(ckpt.glob("step_*/manifest.json"))
    stop_step = int(re.search(r"resumed from the checkpoint of step (\d+)", second_run).group(1))
    assert stop_step == 3, "the step after the held one (tests/slurm_gate.py)"
    assert "P=2 × D=1 on 1 host(s): n1 (2 workers)" in second_run, second_run[-3000:]
    assert stopped, "checkpoints written"

    # Bit-identical final weights and the same loss, bit for bit, at every step both runs report
    # (the step in flight at the stop is finished and saved, not reported).
    diff = chaos.bit_identical(
        chaos.final_state(ckpt / chaos.step_dir_name(STEPS)),
        chaos.final_state(ref_ckpt / chaos.step_dir_name(STEPS)),
    )
    assert diff == "", f"final weights differ from the undisturbed run: {diff}"
    ours = {row["step"]: row["loss"] for row in map(json.loads, metrics.read_text().splitlines())}
    ref = {row["step"]: row["loss"] for row in map(json.loads, ref_metrics.read_text().splitlines())}
    assert set(ours) | {stop_step} == set(ref) == set(range(1, STEPS + 1)), sorted(ours)
    assert all(ours[s] == ref[s] for s in ours), {s: (ours[s], ref[s]) for s in ours if ours[s] != ref[s]}
    assert not cluster.stepd_pids(), "step daemons left"
    assert not _processes_with(str(ckpt)), "processes of the job left"


def test_node_lists_expand_as_scontrol_does(cluster: SlurmCluster) -> None:
    """The pure host-list grammar against the real ``scontrol show hostnames``."""
    for text in ["n[1-2]", "gpu-[01-03,7],login1", "rack[1-2]-n[08-10]", "a,b,c[5]", "x[0-0]", "n[9-11]"]:
        real = cluster.run("scontrol", "show", "hostnames", text).stdout.split()
        assert expand_hostlist(text) == real, text


def test_bad_allocations_one_line_each(cluster: SlurmCluster, tmp_path: Path) -> None:
    """Inside a real allocation: a node list Slurm cannot expand, and fewer slots than P."""
    env = {**cluster.env, "SLURM_JOB_ID": "1", "SLURM_TASKS_PER_NODE": "1"}
    for broken in ("n[1-", "n[3-1]"):
        with pytest.raises(ValueError, match="not a Slurm host list|cannot expand") as info:
            allocation_from_env({**env, "SLURM_JOB_NODELIST": broken})
        assert "\n" not in str(info.value)
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('must not run')\n")
    result = cluster.run(
        "salloc", "-N1", "--ntasks-per-node=1", sys.executable, "-m", "varuna.launch", "--slurm",
        "--pipeline-depth", "2", str(script), check=False, env={"PYTHONPATH": str(ROOT)}, timeout=120,
    )
    ours = [line for line in result.stderr.splitlines() if line.startswith("varuna-launch")]
    assert result.returncode == 2 and len(ours) == 1, result.stderr
    assert "fewer slots than the 2 stages of --pipeline-depth 2" in ours[0], ours


CRASH_ON_FIRST_LAUNCH = """
import os, sys
rank, restarts = os.environ["RANK"], os.environ.get("VARUNA_RESTARTS", "-")
print(f"worker rank={rank} restarts={restarts} node={os.environ.get('SLURMD_NODENAME', '?')}", flush=True)
sys.exit(1 if rank == "3" and restarts in ("0", "-") else 0)  # "-": no --max-restarts
"""


@pytest.mark.timeout(300)
def test_max_restarts_relaunches_through_srun_agents(cluster: SlurmCluster, tmp_path: Path) -> None:
    """``--slurm --max-restarts 1`` in a real allocation (salloc -N2, 2 tasks per node): rank 3
    fails in the first launch; the launcher relaunches through fresh srun agents on both nodes,
    every worker with VARUNA_RESTARTS=1, and the job ends 0 with a ``restart`` event. Negative
    control: without --max-restarts the same job fails (exit 1), nothing relaunched."""
    script = tmp_path / "crash_once.py"
    script.write_text(CRASH_ON_FIRST_LAUNCH)
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def launch(*extra: str) -> subprocess.CompletedProcess[str]:
        return cluster.run(
            "salloc", "-N2", "--ntasks-per-node=2", sys.executable, "-m", "varuna.launch", "--slurm",
            "--pipeline-depth", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), "--quiet", *extra,
            str(script), check=False, env=env, timeout=240,
        )  # fmt: skip

    once = launch("--log-dir", str(tmp_path / "once"))
    assert once.returncode == 1, once.stderr[-3000:]
    assert "relaunching" not in once.stderr and "job failed:" in once.stderr, once.stderr[-3000:]

    logs = tmp_path / "logs"
    run = launch("--max-restarts", "1", "--log-dir", str(logs))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "launch 1 failed:" in run.stderr, run.stderr[-3000:]
    assert "relaunching on the 2 host(s) left from the newest checkpoint (restart 1 of 1)" in run.stderr
    seen = re.findall(r"worker rank=(\d) restarts=(\d) node=(\w+)", run.stdout)
    relaunched = {(int(r), node) for r, restarts, node in seen if restarts == "1"}
    assert relaunched == {(0, "n1"), (1, "n1"), (2, "n2"), (3, "n2")}, run.stdout[-3000:]
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["restart"] and events[0]["hosts"] == 2, events
    wait_for(lambda: not cluster.stepd_pids(), 60, "the job's step daemons to end")


HOLD_ON_FIRST_LAUNCH = """
import os, sys, threading
restarts = os.environ.get("VARUNA_RESTARTS", "-")
print(f"worker rank={os.environ['RANK']} restarts={restarts} node={os.environ.get('SLURMD_NODENAME', '?')}",
      flush=True)
if restarts == "0":
    threading.Event().wait(120)  # the first launch ends when the launcher stops it
    sys.exit(1)
"""


@pytest.mark.timeout(300)
def test_a_silent_srun_agent_is_named_and_the_job_relaunched_on_the_node_left(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Main's silence watch over srun: the agent on n2 is SIGSTOPped (a hung node: its step and
    channel stay open); the launcher names h1=n2 silent after --host-timeout, relaunches on n1
    alone at P=2 × D=1 (--max-restarts 1), and ends 0; events.jsonl has host-silent then restart;
    nothing of the job is left once the allocation ends."""
    script = tmp_path / "hold_once.py"
    script.write_text(HOLD_ON_FIRST_LAUNCH)
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    argv = ["salloc", "-N2", "--ntasks-per-node=2", sys.executable, "-m", "varuna.launch", "--slurm",
            "--pipeline-depth", "2", "--checkpoint-dir", str(ckpt), "--max-restarts", "1",
            "--log-dir", str(logs), "--quiet", str(script)]  # fmt: skip
    env = {**cluster.env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        launched = logs / "launch.json"
        wait_for(lambda: launched.exists() and json.loads(launched.read_text() or "{}").get("hosts"), 120,
                 "the first launch's launch.json")
        hosts = json.loads(launched.read_text())["hosts"]
        assert [h["entry"] for h in hosts] == ["n1", "n2"], hosts
        os.kill(int(hosts[1]["agent_pid"]), signal.SIGSTOP)  # the step's task; Slurm kills it at the end
        out, err = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, err[-3000:]
    assert re.search(r"host h1=n2 went silent: no word from its agent for [0-9.]+ s", err), err[-3000:]
    relaunch = "relaunching on the 1 host(s) left from the newest checkpoint (restart 1 of 1); left out: n2"
    assert relaunch in err, err[-3000:]
    assert "P=2 × D=1 on 1 host(s): n1 (2 workers)" in err, err[-3000:]
    relaunched = set(re.findall(r"worker rank=(\d) restarts=1 node=(\w+)", out))
    assert relaunched == {("0", "n1"), ("1", "n1")}, out[-3000:]
    events = [json.loads(line)["event"] for line in (logs / "events.jsonl").read_text().splitlines()]
    assert events == ["host-silent", "restart"], events
    wait_for(lambda: not cluster.stepd_pids() and not _processes_with(str(ckpt)), 60,
             "the job's steps and workers to end with the allocation")


@pytest.mark.timeout(300)
def test_live_morph_under_slurm_survivors_regroup(cluster: SlurmCluster, tmp_path: Path) -> None:
    """``--slurm --live-morph`` (allowed, as with --hosts): member 3 (on n2) SIGKILLs itself after
    step 2; the 3 others — two on n1, one on n2, in srun agents' steps — regroup in their processes
    without a restart (P=1 × D=3) and finish; the job ends 0."""
    worker = ROOT / "tests" / "workers" / "live_launch_worker.py"
    out = tmp_path / "out"
    out.mkdir()
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = cluster.run(
        "salloc", "-N2", "--ntasks-per-node=2", sys.executable, "-m", "varuna.launch", "--slurm",
        "--pipeline-depth", "2", "--live-morph", "--checkpoint-dir", str(tmp_path / "ckpt"), "--stop-timeout",
        "30", "--quiet", str(worker), "--out", str(out), "--steps", "6", "--die-members", "3", "--die-after",
        "2", check=False, env=env, timeout=280,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "live morph: the 3 other worker(s) regroup without a restart" in run.stderr, run.stderr[-3000:]
    assert "restarting" not in run.stderr and not (out / "member3.json").exists()
    reports = {m: json.loads((out / f"member{m}.json").read_text()) for m in (0, 1, 2)}
    for r in reports.values():
        assert r["restarts"] == 0 and (r["P"], r["D"]) == (1, 3), r
        assert [x["resumed_after"] for x in r["morphs"]] == [2], r
