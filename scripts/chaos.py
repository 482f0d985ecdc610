"""Chaos run against a managed job on pretend VMs (local provider), deterministic mode.

First an undisturbed reference run of the job, then ``--trials`` trials that each run the same job
from scratch and ``kill -9`` one random target at a random (seeded) moment — a worker, a VM agent
alone, a VM agent's whole process group, or the manager itself (restarted on the same state
file) — and ``--ckpt-trials`` trials that kill a worker while a checkpoint is being written (a
``step_*`` directory without its manifest, seen by polling the checkpoint store). Per trial it
prints one table row: what was killed, at which step, the morph latency, the steps redone,
whether the newest complete checkpoint stayed intact, whether the final weights and optimizer
state equal the reference bit for bit, and the processes left behind. Exit 1 if any trial fails
a property (docs/reliability.md).

    python scripts/chaos.py                      # 20 + 20 trials (about 40 s a trial on 2 cores)
    python scripts/chaos.py --trials 2 --ckpt-trials 2 --seed 7
    python scripts/chaos.py --launcher --trials 10   # varuna-launch on hosts whose packets vanish

``--launcher`` runs the launcher's trials instead (``scripts/chaos_hosts.py``: silent hosts at any
rank, a partition that heals mid-recovery, two faults in a row, under ``varuna-launch --hosts``
on network namespaces; root only); the options after it are that script's.

Every wait has a timeout; every manager, agent and worker the script started is killed on any
exit (the trial directories are removed unless ``--keep``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from manager.common.procs import find_free_port  # noqa: E402
from manager.domain.jobspec import load_jobspec  # noqa: E402
from manager.transport.client import ClientConfig, ManagerClient  # noqa: E402
from manager.transport.convert import spec_to_pb  # noqa: E402
from varuna.runtime.checkpoint import (  # noqa: E402
    MANIFEST,
    list_checkpoints,
    read_manifest,
    read_shard,
    step_dir_name,
    verify_checkpoint,
)

TRAIN = {"gpt2": ROOT / "examples" / "gpt2" / "train.py", "resnet": ROOT / "examples" / "resnet" / "train.py"}
TARGETS = ("worker", "agent", "agent-group", "manager")
MANAGER_FLAGS = (
    "--heartbeat-interval", "0.25", "--heartbeat-timeout", "3",
    # Fail-stutter evictions are not what this run tests (a loaded 2-core machine makes
    # healthy pretend VMs look slow); they would only add morphs.
    "--slow-threshold-pct", "100000", "--slow-heartbeats", "1000",
    "--stop-timeout", "60", "--kill-timeout", "10", "--orphan-timeout", "60",
    "--gather-timeout", "30", "--create-retry", "2",
)  # fmt: skip


class ChaosError(Exception):
    """A wait ran out or the job did something a trial cannot go on from."""


@dataclass
class Options:
    """The run's knobs (command-line flags)."""

    trials: int = 20
    ckpt_trials: int = 20
    seed: int = 0
    steps: int = 24
    checkpoint_every: int = 2
    vms: int = 3
    pipeline_depth: int = 0
    n_layer: int = 2
    example: str = "resnet"
    """The job's script: ``resnet`` (BatchNorm buffers, an LR schedule and a stateful data loader in
    every checkpoint: the whole state) or ``gpt2``."""
    workdir: Path | None = None
    keep: bool = False
    trial_timeout_s: float = 300.0
    targets: tuple[str, ...] = TARGETS


@dataclass
class TrialResult:
    """One row of the table."""

    name: str
    target: str = "-"
    kill_step: int = -1
    seen: str = ""
    latency_s: list[float] = field(default_factory=list)
    redone: list[int] = field(default_factory=list)
    layouts: str = ""
    intact: bool | None = None
    identical: bool | None = None
    orphans: int = 0
    wall_s: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        """Every property held (the reference run has no kill: only completion and orphans)."""
        return (
            not self.error and self.orphans == 0 and self.intact is not False and self.identical is not False
        )


# -- processes --------------------------------------------------------------------------------


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    """Poll ``condition`` until it returns something true; ChaosError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise ChaosError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def processes_mentioning(text: str) -> list[int]:
    """Live (non-zombie) processes with ``text`` in their command line or environment: the
    manager names its state file, agents their job, workers their checkpoint dir in the env."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and (text.encode() in cmdline or text.encode() in environ):
            pids.append(int(entry.name))
    return pids


def kill_all(pids: list[int]) -> None:
    """SIGKILL each pid (already gone is fine)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


class Manager:
    """``varuna-manager serve`` as a child process, restartable on the same state file."""

    def __init__(self, trial_dir: Path) -> None:
        self.dir = trial_dir
        self.token = trial_dir / "token"
        self.token.write_text(secrets.token_urlsafe(32))
        self.token.chmod(0o600)
        self.address = f"127.0.0.1:{find_free_port('127.0.0.1')}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        """Start it and wait (at most 60 s) until it answers."""
        self.starts += 1
        with open(self.dir / f"manager-{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "manager.cli", "serve", "--db", str(self.dir / "state.sqlite"),
                 "--listen", self.address, "--token-file", str(self.token), *MANAGER_FLAGS],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
        wait_for(self._answers, 60, "the manager to answer", poll_s=0.2)

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise ChaosError(f"the manager exited with {self.proc.returncode} (see {self.dir}/manager-*.log)")
        try:
            with self.client(timeout_s=5.0) as c:
                c.status()
            return True
        except Exception:
            return False

    def client(self, timeout_s: float = 30.0) -> ManagerClient:
        """A client with a generous deadline (the machine may be loaded far beyond its cores)."""
        return ManagerClient(
            ClientConfig(address=self.address, token=self.token.read_text().strip(), timeout_s=timeout_s)
        )

    def kill9(self) -> None:
        """``kill -9`` the manager and reap it."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# -- the job ----------------------------------------------------------------------------------


def job_spec(opts: Options, trial_dir: Path) -> dict:
    """The example, small, deterministic, on ``opts.vms`` pretend VMs that are not replaced: GPT
    (``--n-layer`` blocks, a cut after each) or the ResNet (``--n-layer`` residual blocks, 96
    images: an epoch every 8 steps, so the data loader's state crosses epochs)."""
    if opts.example == "gpt2":
        args = [
            "--n-layer", str(opts.n_layer), "--n-embd", "32", "--n-head", "2", "--block-size", "32",
            "--eval-every", "0",
        ]  # fmt: skip
        segments = opts.n_layer + 1
    else:
        args = ["--widths", ",".join(["8"] * opts.n_layer), "--blocks", "1", "--image-size", "8",
                "--samples", "96"]  # fmt: skip
        segments = opts.n_layer + 2
    args += [
        "--steps", str(opts.steps), "--global-batch-size", "12", "--micro-batch-size", "2", "--seed", "0",
        "--deterministic", "--metrics-out", str(trial_dir / "metrics.jsonl"),
    ]  # fmt: skip
    return {
        "name": "chaos",
        "script": str(TRAIN[opts.example]),
        "args": args,
        "global_batch_size": 12,
        "micro_batch_size": 2,
        "checkpoint_dir": str(trial_dir / "ckpt"),
        "checkpoint_every": opts.checkpoint_every,
        "min_vms": 1,
        "max_vms": opts.vms,
        "target_steps": opts.steps,
        "pipeline_depth": opts.pipeline_depth,
        "num_segments": segments,
        "env": {"OMP_NUM_THREADS": "1"},
        # Lost VMs are not replaced: each kill of a VM shrinks the job (a different P×D).
        "provider_options": {"max_created": opts.vms},
    }


@dataclass
class Run:
    """One managed job in its own directory, under its own manager."""

    opts: Options
    dir: Path
    manager: Manager = field(init=False)
    job: str = ""

    def __post_init__(self) -> None:
        self.dir.mkdir(parents=True)
        self.manager = Manager(self.dir)

    @property
    def ckpt(self) -> Path:
        return self.dir / "ckpt"

    def submit(self) -> None:
        """Start the manager and submit the job."""
        (self.dir / "job.json").write_text(json.dumps(job_spec(self.opts, self.dir)))
        self.manager.start()
        with self.manager.client() as c:
            self.job = c.submit(spec_to_pb(load_jobspec(self.dir / "job.json")))

    def status(self) -> Any:
        """The job's status (a pb.JobStatus); a failed job stops the trial."""
        with self.manager.client() as c:
            st = c.status(self.job, history=0)[0]
        if st.state in ("failed", "cancelled"):
            raise ChaosError(f"job {st.state}: {st.message}")
        return st

    def events(self, kind: str) -> list[Any]:
        """The job's events of ``kind``."""
        with self.manager.client() as c:
            return [e for e in c.events(self.job) if e.kind == kind]

    def wait_step(self, step: int, timeout_s: float) -> Any:
        """Wait until the job reached ``step`` (or finished); its status then."""

        def reached() -> Any:
            st = self.status()
            return st if st.step >= step or st.state == "finished" else None

        return wait_for(reached, timeout_s, f"step {step}")

    def finish(self, timeout_s: float) -> None:
        """Wait for the job to finish."""
        wait_for(lambda: self.status().state == "finished", timeout_s, "the job to finish", poll_s=0.3)

    def teardown(self) -> int:
        """Stop the manager, wait (at most 30 s) for every process of the run to be gone; kill and
        count the ones that are not (orphans)."""
        self.manager.stop()
        marker = f"{self.dir}/"  # with the slash: kill-1 must not match kill-10's processes
        try:
            wait_for(lambda: not processes_mentioning(marker), 30, "every process to exit", poll_s=0.3)
            return 0
        except ChaosError:
            left = processes_mentioning(marker)
            kill_all(left)
            return len(left)


# -- checkpoints ------------------------------------------------------------------------------


def newest_complete(ckpt: Path) -> int:
    """Step of the newest checkpoint with a manifest (0: none)."""
    done = [c.step for c in list_checkpoints(ckpt) if c.complete]
    return max(done, default=0)


def write_in_progress(ckpt: Path) -> str:
    """What shows a checkpoint being written now ("" when nothing does): a temporary file or a
    rank's marker in a ``step_*`` directory that has no manifest yet."""
    try:
        entries = list(os.scandir(ckpt))
    except OSError:
        return ""
    for d in entries:
        if not d.name.startswith("step_") or not d.is_dir(follow_symlinks=False):
            continue
        try:
            names = os.listdir(d.path)
        except OSError:
            continue
        if MANIFEST in names or not names:
            continue
        if any(".tmp-" in n for n in names):
            return f"{d.name}: temporary file"
        return f"{d.name}: no manifest yet ({len(names)} entries)"
    return ""


def final_state(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, by parameter or buffer name (and ``opt:NAME:KEY`` for
    optimizer state), whatever P×D wrote it (files are split per segment and replica), and the
    registered state (the data loader's position and generator, the LR schedule) as ``state``:
    the bytes of its JSON, keys sorted."""
    manifest = read_manifest(step_dir)
    registered = json.dumps(manifest.get("state", {}), sort_keys=True).encode()
    out: dict[str, torch.Tensor] = {"state": torch.frombuffer(bytearray(registered), dtype=torch.uint8)}
    for f in manifest["files"]:
        shard = read_shard(step_dir / f["name"])
        out.update(shard["params"])
        for name, state in shard["optimizer"]["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"opt:{name}:{key}"] = value
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str:
    """The first difference between two checkpoints' tensors; empty when equal bit for bit."""
    if a.keys() != b.keys():
        return f"tensor names differ: {sorted(a.keys() ^ b.keys())[:3]}"
    for name in sorted(a):
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{name}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        # Compare the bytes: torch.equal would call -0.0 and 0.0 equal and NaN unequal to itself.
        if not torch.equal(_as_bytes(x), _as_bytes(y)):
            return f"{name} differs"
    return ""


# -- trials -----------------------------------------------------------------------------------


@dataclass
class Plan:
    """What a trial kills, and when."""

    target: str
    step: int
    delay_s: float
    during_checkpoint: bool


def plan_trial(opts: Options, index: int, during_checkpoint: bool) -> Plan:
    """A seeded random target and moment: any step but the first and the last few, plus a
    fraction of a step."""
    rng = random.Random(opts.seed * 100_003 + index)
    target = "worker" if during_checkpoint else rng.choice(opts.targets)
    step = rng.randint(2, max(2, opts.steps - 6))
    return Plan(target=target, step=step, delay_s=rng.uniform(0.0, 0.3), during_checkpoint=during_checkpoint)


def pick_pid(st: Any, target: str, rng: random.Random) -> tuple[int, str]:
    """The pid to kill for ``target`` in the running generation, and a label."""
    vms = [v for v in st.vms if v.in_generation and v.agent_pid > 0]
    if not vms:
        raise ChaosError("no VM in the running generation")
    vm = rng.choice(vms)
    if target == "worker":
        workers = [w for w in vm.workers if w.running and w.pid > 0]
        if not workers:
            raise ChaosError(f"no running worker on {vm.vm_id}")
        w = rng.choice(workers)
        return w.pid, f"worker rank {w.rank} on {vm.vm_id}"
    return vm.agent_pid, f"{target} of {vm.vm_id}"


def strike(run: Run, plan: Plan, rng: random.Random, result: TrialResult) -> int:
    """Wait for the planned moment and kill; returns the newest complete checkpoint's step at
    the moment of the kill."""
    st = run.wait_step(plan.step, 180)
    if st.state == "finished":
        raise ChaosError(f"the job finished before step {plan.step}")
    if plan.target == "manager":
        time.sleep(plan.delay_s)  # a random moment inside a step, not a synchronisation
        before = newest_complete(run.ckpt)
        result.kill_step = run.status().step
        run.manager.kill9()
        return before
    pid, label = pick_pid(st, plan.target, rng)
    result.target = label
    if plan.during_checkpoint:
        # Poll the store closely: a tiny model's save takes milliseconds.
        result.seen = wait_for(lambda: write_in_progress(run.ckpt), 120, "a checkpoint write", poll_s=0.0005)
        st.step = int(result.seen[len("step_") :].split(":")[0])  # the step being saved
    else:
        time.sleep(plan.delay_s)
    before = newest_complete(run.ckpt)
    if plan.target == "agent-group":
        os.killpg(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGKILL)
    result.kill_step = st.step
    return before


def recover(run: Run, plan: Plan, timeout_s: float) -> None:
    """After the kill: restart a killed manager; otherwise wait for the morph to resume."""
    if plan.target == "manager":
        run.manager.start()
        return
    wait_for(
        lambda: run.events("resumed") or run.status().state == "finished", timeout_s, "the morph", poll_s=0.3
    )


def check_checkpoints(run: Run, before: int, result: TrialResult) -> None:
    """The newest complete checkpoint at the kill was not lost: every morph resumed from it or a
    newer one, and every complete checkpoint left at the end verifies (size + sha256)."""
    resumed = [json.loads(e.data_json) for e in run.events("resumed")]
    result.latency_s = [r.get("morph_latency_s", 0.0) for r in resumed]
    result.redone = [r.get("redone_steps", 0) for r in resumed]
    result.layouts = " ".join(
        f"{r.get('previous_P')}x{r.get('previous_D')}>{r['P']}x{r['D']}" for r in resumed
    )
    problems = [f"resumed from {r['resumed_from']} < {before}" for r in resumed if r["resumed_from"] < before]
    for c in list_checkpoints(run.ckpt):
        if c.complete:
            problems += [f"{c.path.name}: {p}" for p in verify_checkpoint(c.path)]
    result.intact = not problems
    if problems:
        result.error = "; ".join(problems[:3])


def run_trial(
    opts: Options, root: Path, index: int, plan: Plan | None, reference: dict | None
) -> tuple[TrialResult, dict | None]:
    """One managed job from scratch, with ``plan``'s kill (none for the reference run)."""
    name = "reference" if plan is None else f"{'ckpt' if plan.during_checkpoint else 'kill'}-{index}"
    result = TrialResult(name=name, target=plan.target if plan else "-")
    run = Run(opts, root / name)
    started = time.monotonic()
    state = None
    try:
        run.submit()
        if plan is not None:
            before = strike(run, plan, random.Random(opts.seed * 7919 + index), result)
            recover(run, plan, opts.trial_timeout_s)
        run.finish(opts.trial_timeout_s)
        if plan is not None:
            check_checkpoints(run, before, result)
        state = final_state(run.ckpt / step_dir_name(opts.steps))
        if reference is not None:
            diff = bit_identical(state, reference)
            result.identical = not diff
            if diff:
                result.error = result.error or diff
    except ChaosError as e:
        result.error = str(e)
    finally:
        result.orphans = run.teardown()
        result.wall_s = time.monotonic() - started
    return result, state


# -- output -----------------------------------------------------------------------------------

HEADER = (
    f"{'trial':<10} {'killed':<34} {'step':>4}  {'P×D':<9} {'morph latency s':<16} {'redone':<7} "
    f"{'ckpt intact':<11} {'bit-identical':<13} {'orphans':>7} {'wall s':>6}"
)


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def row(r: TrialResult) -> str:
    """One line of the table (and the error, if any, on the next)."""
    lat = ",".join(f"{x:.1f}" for x in r.latency_s) or "-"
    redone = ",".join(str(x) for x in r.redone) or "-"
    step = str(r.kill_step) if r.kill_step >= 0 else "-"
    line = (
        f"{r.name:<10} {r.target[:34]:<34} {step:>4}  {r.layouts or '-':<9} {lat:<16} {redone:<7} "
        f"{_yes(r.intact):<11} "
        f"{_yes(r.identical):<13} {r.orphans:>7} {r.wall_s:>6.1f}"
    )
    if r.seen:
        line += f"\n{'':<10} killed while writing: {r.seen}"
    if r.error:
        line += f"\n{'':<10} FAILED: {r.error}"
    return line


def parse_args(argv: list[str] | None) -> Options:
    """Command-line flags → Options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20, help="kill -9 trials at random moments (default 20)")
    p.add_argument(
        "--ckpt-trials", type=int, default=20, help="kill -9 trials during a checkpoint write (default 20)"
    )
    p.add_argument("--seed", type=int, default=0, help="replays the same targets and moments")
    p.add_argument("--steps", type=int, default=24, help="target steps of the job (default 24)")
    p.add_argument("--checkpoint-every", type=int, default=2)
    p.add_argument("--vms", type=int, default=3, help="pretend VMs (not replaced when lost; default 3)")
    p.add_argument("--pipeline-depth", type=int, default=0, help="force P (0: the manager's fallback rule)")
    p.add_argument("--n-layer", type=int, default=2, help="GPT blocks, or ResNet stages of one block")
    p.add_argument("--example", choices=sorted(TRAIN), default="resnet",
                   help="the job: resnet (buffers, LR schedule, data loader state: default) or gpt2")
    p.add_argument(
        "--workdir", type=Path, default=None, help="where the trial directories go (default: a temp dir)"
    )
    p.add_argument("--keep", action="store_true", help="keep the trial directories (logs, checkpoints)")
    p.add_argument("--trial-timeout", type=float, default=300.0, help="seconds a trial's waits may take")
    p.add_argument(
        "--targets", default=",".join(TARGETS), help="what the random trials may kill (default: all)"
    )
    a = p.parse_args(argv)
    if min(a.trials, a.ckpt_trials) < 0 or a.steps < 8 or a.checkpoint_every < 1 or a.vms < 1:
        p.error("need --trials/--ckpt-trials >= 0, --steps >= 8, --checkpoint-every >= 1, --vms >= 1")
    targets = tuple(t for t in a.targets.split(",") if t)
    if not targets or set(targets) - set(TARGETS):
        p.error(f"--targets {a.targets!r}: use a comma-separated subset of {','.join(TARGETS)}")
    return Options(
        trials=a.trials, ckpt_trials=a.ckpt_trials, seed=a.seed, steps=a.steps,
        checkpoint_every=a.checkpoint_every, vms=a.vms, pipeline_depth=a.pipeline_depth,
        n_layer=a.n_layer, example=a.example, workdir=a.workdir, keep=a.keep,
        trial_timeout_s=a.trial_timeout, targets=targets,
    )  # fmt: skip


@contextlib.contextmanager
def trial_root(opts: Options) -> Iterator[Path]:
    """The directory of every trial; on any exit (SIGTERM included) every process started under
    it is killed, and it is removed unless ``--keep``."""
    if opts.workdir is not None:  # a --workdir that does not exist yet is made, as --keep expects
        opts.workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="varuna-chaos-", dir=opts.workdir))
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield root
    finally:
        signal.signal(signal.SIGTERM, previous)
        kill_all(processes_mentioning(str(root)))
        if opts.keep:
            print(f"chaos: trial directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Reference run, then the trials; 0 when every trial kept every property."""
    argv = sys.argv[1:] if argv is None else argv
    if "--launcher" in argv:  # varuna-launch's faults on real network hosts (scripts/chaos_hosts.py)
        import importlib.util

        path = Path(__file__).with_name("chaos_hosts.py")
        spec = importlib.util.spec_from_file_location("varuna_chaos_hosts", path)
        hosts = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = hosts
        spec.loader.exec_module(hosts)
        return hosts.main([a for a in argv if a != "--launcher"])
    opts = parse_args(argv)
    results: list[TrialResult] = []
    with trial_root(opts) as root:
        print(f"chaos: {opts.example}, seed {opts.seed}, {opts.vms} pretend VMs, {opts.steps} steps, "
              f"checkpoint every {opts.checkpoint_every}, deterministic; trial directories in {root}",
              flush=True)
        print(HEADER, flush=True)
        ref_result, reference = run_trial(opts, root, 0, None, None)
        print(row(ref_result), flush=True)
        if reference is None or not ref_result.ok:
            print("chaos: the reference run failed; no trials", file=sys.stderr)
            return 1
        plans = [plan_trial(opts, i, False) for i in range(1, opts.trials + 1)]
        plans += [
            plan_trial(opts, i, True) for i in range(opts.trials + 1, opts.trials + opts.ckpt_trials + 1)
        ]
        for i, plan in enumerate(plans, start=1):
            result, _ = run_trial(opts, root, i, plan, reference)
            results.append(result)
            print(row(result), flush=True)
    failed = [r.name for r in results if not r.ok]
    walls = [r.wall_s for r in results] or [0.0]
    redone = max((x for r in results for x in r.redone), default=0)
    print(f"chaos: {len(results) - len(failed)}/{len(results)} trials kept every property; "
          f"{sum(walls) / len(walls):.1f} s per trial on average; at most {redone} step(s) redone "
          f"per morph (checkpoint every {opts.checkpoint_every})")  # fmt: skip
    if failed:
        print(f"chaos: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
