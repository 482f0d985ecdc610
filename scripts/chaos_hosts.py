"""Chaos on real network hosts: ``varuna-launch --hosts`` over network namespaces whose packets can
vanish (``varuna/testing/netns.py``), deterministic mode, recovery by ``--max-restarts`` (or live
morph). Run by ``python scripts/chaos.py --launcher`` (docs/reliability.md, "Silent hosts").

First an undisturbed reference (``--procs`` on this machine: deterministic weights are the same at
any P×D), then per trial a fresh set of hosts (one slot each, P=2) and a fresh job that suffers one
of these faults at a seeded random step:

- ``silent``: one host's link goes down (its packets vanish, nothing is reset), at any rank
  (rank 0's host holds the rendezvous store and commits checkpoints);
- ``silent-live``: the same under ``--live-morph`` (the survivors regroup in place);
- ``heal``: a partition that heals mid-recovery: the link comes back right after the launcher
  named the host, while the job relaunches without it;
- ``twice``: two faults in a row: a second host goes silent once the relaunched job trains again;
- ``kill``: every process of one host SIGKILLed (the kernel resets their connections: the fast
  failure, for comparison).

Per trial one table row: the fault, the host named and its detection latency (the launcher's
``host-silent`` event time minus the fault time, and the silence it measured itself), when the
silent host's worker was gone (its agent fences itself), the launches, whether the final
checkpoint equals the reference bit for bit, and processes left in any namespace once the job
ended and every link is up again. Exit 1 when a trial breaks a property (detection over 5 s, the
wrong host named, no recovery, different weights, a process left).

Root only (network namespaces); every namespace, process and sshd is removed on any exit.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from varuna.runtime.checkpoint_store import list_checkpoints  # noqa: E402
from varuna.testing.netns import NetHosts, netns_unavailable  # noqa: E402
from varuna.testing.sshd import sshd_unavailable  # noqa: E402

TRAIN = ROOT / "examples" / "gpt2" / "train.py"
FAULTS = ("silent", "silent-live", "heal", "twice", "kill")
#: The product claim: a silent host is named within this many seconds of going silent.
DETECTION_BOUND_S = 5.0
#: Extra time granted to the *wall-clock* check (fault → event) on a loaded machine, where the
#: script's own poll and the launcher's threads run late; the launcher's own measurement of the
#: silence (``silent_s``) is held to the bound itself.
LOAD_MARGIN_S = 3.0
GPT_ARGS = (
    "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--global-batch-size", "8",
    "--micro-batch-size", "2", "--eval-every", "0", "--dropout", "0.0", "--deterministic",
)  # fmt: skip
STEP_RE = re.compile(r"\] step +(\d+)/")


class TrialError(Exception):
    """A wait ran out or the job did something a trial cannot go on from."""


@dataclass
class Options:
    trials: int = 10
    seed: int = 0
    steps: int = 24
    checkpoint_every: int = 2
    hosts: int = 4
    faults: tuple[str, ...] = FAULTS
    workdir: Path | None = None
    keep: bool = False
    trial_timeout_s: float = 300.0


@dataclass
class Trial:
    name: str
    fault: str
    victims: list[int]
    step: int


@dataclass
class Outcome:
    """One row of the table."""

    trial: Trial
    code: int | None = None
    named: list[str] = field(default_factory=list)
    detect_s: list[float] = field(default_factory=list)
    silent_s: list[float] = field(default_factory=list)
    fenced_s: list[float] = field(default_factory=list)
    launches: int = 0
    identical: bool | None = None
    orphans: int = 0
    wall_s: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.code == 0 and self.identical is not False and self.orphans == 0


# -- checkpoints ------------------------------------------------------------------------------


def final_state(ckpt: Path, step: int) -> dict:
    """Every tensor (parameters, buffers, optimizer state, by name) and the registered state of
    the checkpoint of ``step`` (the job's last): ``scripts/chaos.py``'s reading of it."""
    done = [c for c in list_checkpoints(ckpt) if c.complete and c.step == step]
    if not done:
        raise TrialError(f"no complete checkpoint of step {step} in {ckpt}")
    return _chaos_module().final_state(done[0].path)


def bit_identical(a: dict, b: dict) -> str:
    """The first difference (bytes, not values: -0.0 is not 0.0), or ""."""
    chaos = _chaos_module()
    return chaos.bit_identical(a, b)


def _chaos_module():
    spec = importlib.util.spec_from_file_location("varuna_chaos_script", ROOT / "scripts" / "chaos.py")
    if "varuna_chaos_script" in sys.modules:
        return sys.modules["varuna_chaos_script"]
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# -- one job ----------------------------------------------------------------------------------


def train_args(opts: Options) -> list[str]:
    """The script and its arguments (the launcher's --checkpoint-dir reaches it as
    VARUNA_CHECKPOINT_DIR)."""
    return [str(TRAIN), "--steps", str(opts.steps), "--checkpoint-every", str(opts.checkpoint_every),
            *GPT_ARGS]


def reference(opts: Options, workdir: Path) -> dict:
    """The undisturbed run's final state (this machine, P=2 × D=2)."""
    ckpt = workdir / "ckpt"
    workdir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "varuna.launch", "--procs", "4", "--pipeline-depth", "2", "--quiet",
           "--checkpoint-dir", str(ckpt), *train_args(opts)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.trial_timeout_s, cwd=workdir,
                         env=_env())
    if run.returncode != 0:
        raise TrialError(f"the reference run failed ({run.returncode}): {run.stderr[-2000:]}")
    return final_state(ckpt, opts.steps)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


class Job:
    """``varuna-launch`` on the control host of ``net``, its output in files."""

    def __init__(self, net: NetHosts, opts: Options, workdir: Path, *, live: bool) -> None:
        self.net, self.workdir = net, workdir
        self.ckpt, self.logs = workdir / "ckpt", workdir / "logs"
        hosts = ",".join(net.address(h) for h in range(net.num_hosts))
        cmd = [sys.executable, "-m", "varuna.launch", "--hosts", hosts, "--procs-per-host", "1",
               "--pipeline-depth", "2", "--log-dir", str(self.logs), "--quiet", "--max-restarts", "3",
               "--checkpoint-dir", str(self.ckpt), *(["--live-morph"] if live else []), *net.ssh_options(),
               *train_args(opts)]
        self.out, self.err = workdir / "launcher.out", workdir / "launcher.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(net.control(cmd), stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         cwd=workdir, env=_env())

    def steps(self, after: int = 0) -> list[int]:
        """Step numbers printed since byte ``after`` of the output."""
        return [int(m) for m in STEP_RE.findall(_read(self.out)[after:])]

    def events(self, kind: str) -> list[dict]:
        path = self.logs / "events.jsonl"
        lines = _read(path).splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == kind]

    def launched(self) -> dict[str, int]:
        """Worker pid by host address, of the launch in progress (``launch.json``)."""
        try:
            record = json.loads(_read(self.logs / "launch.json"))
        except json.JSONDecodeError:
            return {}
        address = {h["host_id"]: h["entry"] for h in record.get("hosts", [])}
        return {address[w["host_id"]]: w["pid"] for w in record["workers"] if w["pid"]}

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TrialError(f"the launcher did not finish within {timeout_s:g} s") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TrialError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


# -- one trial --------------------------------------------------------------------------------


def strike(job: Job, outcome: Outcome, victim: int, *, since: int = 0) -> float:
    """Wait for the trial's step, then the fault on ``victim``; returns the fault's time."""
    trial = outcome.trial
    wait_for(lambda: [s for s in job.steps(since) if s >= trial.step] or job.proc.poll() is not None,
             180.0, f"step {trial.step}")
    if job.proc.poll() is not None:
        last = _read(job.err).strip().splitlines()[-3:]
        raise TrialError(f"the job ended (exit {job.proc.returncode}) before step {trial.step}: {last}")
    pid = job.launched().get(job.net.address(victim))
    if trial.fault == "kill":
        at = time.time()
        job.net.kill(victim)
    else:
        at = job.net.blackhole(victim)
    if pid is not None:  # the silent host's worker must go: its agent fences it
        gone = wait_for(lambda: not _alive(pid) and time.time(), 30.0, f"the worker of host {victim} to go")
        outcome.fenced_s.append(gone - at)
    return at


def judge_detection(job: Job, outcome: Outcome, faults: list[tuple[int, float]]) -> None:
    """Each silent host named, within the bound, by the launcher (its host-silent events)."""
    events = job.events("host-silent")
    for victim, at in faults:
        label = f"={job.net.address(victim)}"
        mine = [e for e in events if e["host"].endswith(label) and e["time"] >= at - 1.0]
        if outcome.trial.fault == "kill":
            continue  # a killed host is a worker exit (agent reports it), not a silence
        if not mine:
            raise TrialError(f"host {victim} was never named silent (events: {events})")
        e = mine[0]
        outcome.named.append(e["host"])
        outcome.detect_s.append(e["time"] - at)
        outcome.silent_s.append(e["silent_s"])
        if e["silent_s"] > DETECTION_BOUND_S or e["time"] - at > DETECTION_BOUND_S + LOAD_MARGIN_S:
            raise TrialError(f"host {victim} named {e['time'] - at:.1f} s after the fault (silent for"
                             f" {e['silent_s']:.1f} s by the launcher's clock)")


def run_trial(opts: Options, trial: Trial, workdir: Path, ref: dict) -> Outcome:
    outcome = Outcome(trial)
    started = time.monotonic()
    workdir.mkdir(parents=True)
    with NetHosts.create(opts.hosts, workdir=workdir) as net:
        job = Job(net, opts, workdir, live=trial.fault == "silent-live")
        try:
            faults = [(trial.victims[0], strike(job, outcome, trial.victims[0]))]
            if trial.fault == "heal":
                wait_for(lambda: job.events("host-silent"), 30.0, "the launcher to name the host")
                net.heal(trial.victims[0])  # mid-recovery: the relaunch is starting without it
            if trial.fault == "twice":
                wait_for(lambda: job.events("restart"), 60.0, "the first restart")
                since = len(_read(job.out))
                first = wait_for(lambda: job.steps(since), 120.0, "the relaunched job to train")
                # The second victim: a host of the relaunched job (one it does not use would not
                # be noticed), chosen by the trial's seed.
                used = wait_for(lambda: [a for a in job.launched() if a != net.address(trial.victims[0])],
                                30.0, "the relaunched workers")
                trial.victims[1] = [h for h in range(net.num_hosts) if net.address(h) in used][
                    trial.victims[1] % len(used)]
                trial.step = min(opts.steps - 2, first[0] + 2)
                faults.append((trial.victims[1], strike(job, outcome, trial.victims[1], since=since)))
            outcome.code = job.wait(opts.trial_timeout_s)
            judge_detection(job, outcome, faults)
            outcome.launches = 1 + len(job.events("restart"))
            diff = bit_identical(final_state(job.ckpt, opts.steps), ref)
            outcome.identical = not diff
            if diff:
                raise TrialError(diff)
        except TrialError as e:
            outcome.error = str(e)
        finally:
            job.kill()
            for h in range(net.num_hosts):
                net.heal(h)
            with contextlib.suppress(TrialError):  # the sessions of a healed host end (RST): bounded
                wait_for(lambda: not any(net.pids(h) for h in net.members()), 30.0, "the namespaces to empty")
            outcome.orphans = sum(len(net.pids(h)) for h in net.members())
    if outcome.code not in (0, None) and not outcome.error:
        outcome.error = f"launcher exit {outcome.code}: {_read(job.err).strip().splitlines()[-1:]}"
    outcome.wall_s = time.monotonic() - started
    return outcome


def plan(opts: Options, index: int) -> Trial:
    rng = random.Random(opts.seed * 100_003 + index)
    fault = opts.faults[(index - 1) % len(opts.faults)]
    victims = rng.sample(range(opts.hosts), 2)
    return Trial(name=f"{fault}-{index}", fault=fault, victims=victims,
                 step=rng.randint(2, max(2, opts.steps // 3)))


# -- output -----------------------------------------------------------------------------------

HEADER = (f"{'trial':<16} {'fault at (host, step)':<22} {'named':<28} {'detect s':<10} {'silent s':<10}"
          f" {'fenced s':<10} {'launches':>8} {'bit-identical':<13} {'orphans':>7} {'wall s':>6}")


def row(o: Outcome) -> str:
    def nums(xs: list[float]) -> str:
        return ",".join(f"{x:.1f}" for x in xs) or "-"

    t = o.trial
    where = ",".join(f"h{v}" for v in t.victims[: 2 if t.fault == "twice" else 1]) + f" @{t.step}"
    same = "-" if o.identical is None else ("yes" if o.identical else "NO")
    line = (f"{t.name:<16} {where:<22} {','.join(o.named) or '-':<28} {nums(o.detect_s):<10} "
            f"{nums(o.silent_s):<10} {nums(o.fenced_s):<10} {o.launches:>8} {same:<13} {o.orphans:>7}"
            f" {o.wall_s:>6.1f}")
    return line + (f"\n{'':<16} FAILED: {o.error}" if o.error else "")


def parse_args(argv: list[str] | None) -> Options:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=10, help="trials, the faults in turn (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--checkpoint-every", type=int, default=2)
    p.add_argument("--faults", default=",".join(FAULTS), help=f"a subset of {','.join(FAULTS)}")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the trial directories")
    p.add_argument("--trial-timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    faults = tuple(f for f in a.faults.split(",") if f)
    if not faults or set(faults) - set(FAULTS):
        p.error(f"--faults {a.faults!r}: use a comma-separated subset of {','.join(FAULTS)}")
    if a.trials < 1 or a.steps < 12 or a.checkpoint_every < 1:
        p.error("need --trials >= 1, --steps >= 12, --checkpoint-every >= 1")
    return Options(trials=a.trials, seed=a.seed, steps=a.steps, checkpoint_every=a.checkpoint_every,
                   faults=faults, workdir=a.workdir, keep=a.keep, trial_timeout_s=a.trial_timeout)


@contextlib.contextmanager
def trial_root(opts: Options) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="varuna-chaos-hosts-", dir=opts.workdir))
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield root
    finally:
        signal.signal(signal.SIGTERM, previous)
        if opts.keep:
            print(f"chaos: trial directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    why = netns_unavailable() or sshd_unavailable()
    if why is not None:
        print(f"chaos: cannot run the launcher trials: {why}", file=sys.stderr)
        return 2
    opts = parse_args(argv)
    results: list[Outcome] = []
    with trial_root(opts) as root:
        print(f"chaos (launcher): seed {opts.seed}, {opts.hosts} hosts in network namespaces (1 slot each,"
              f" P=2), {opts.steps} steps, checkpoint every {opts.checkpoint_every}, deterministic,"
              f" --max-restarts 3; trial directories in {root}", flush=True)
        ref = reference(opts, root / "reference")
        print(HEADER, flush=True)
        for i in range(1, opts.trials + 1):
            outcome = run_trial(opts, plan(opts, i), root / f"trial-{i}", ref)
            results.append(outcome)
            print(row(outcome), flush=True)
    failed = [o.trial.name for o in results if not o.ok]
    detect = [x for o in results for x in o.detect_s]
    print(f"chaos: {len(results) - len(failed)}/{len(results)} trials kept every property; detection"
          f" {min(detect, default=0):.1f}-{max(detect, default=0):.1f} s after the fault")
    if failed:
        print(f"chaos: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
