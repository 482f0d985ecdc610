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
  failure, for comparison);
- ``morph``: a fault during a morph: under ``--live-morph`` one host goes silent, and a second
  one as soon as the launcher named the first (the survivors are regrouping);
- ``copy``: a fault during a checkpoint's background copy: a bigger GPT (8 layers, ``--copy-embd``
  256: about 6.4 M parameters, each checkpoint about 77 MB with Adam's state), one host goes silent while a
  step directory is being filled (its files copied, its commit not yet written). The silent
  host's writer may go on writing into the shared store: the checkpoint fence refuses anything
  it renames there once the relaunch started (Note [Checkpoint fence]).

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
import threading
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
FAULTS = ("silent", "silent-live", "heal", "twice", "kill", "morph", "copy")
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
#: The bigger model of the ``copy`` trials (its checkpoints take a while to write and copy).
BIG_ARGS = ("--n-layer", "8", "--n-head", "4")
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
    copy_embd: int = 256


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
    copy_s: float | None = None
    """``copy``: how long the step directory struck in was incomplete (files copied, no commit)."""
    watchers: list[threading.Thread] = field(default_factory=list)
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
    try:
        return _chaos_module().final_state(done[0].path)
    except (OSError, ValueError) as e:  # a file of a committed checkpoint missing or refused
        raise TrialError(f"the final checkpoint {done[0].path} is unreadable: {e}") from None


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


def train_args(opts: Options, big: bool = False) -> list[str]:
    """The script and its arguments (the launcher's --checkpoint-dir reaches it as
    VARUNA_CHECKPOINT_DIR); ``big``: the ``copy`` trials' model (later flags win)."""
    model = [*BIG_ARGS, "--n-embd", str(opts.copy_embd)] if big else []
    return [str(TRAIN), "--steps", str(opts.steps), "--checkpoint-every", str(opts.checkpoint_every),
            *GPT_ARGS, *model]


def reference(opts: Options, workdir: Path, big: bool = False) -> dict:
    """The undisturbed run's final state (this machine, P=2 × D=2)."""
    ckpt = workdir / "ckpt"
    workdir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "varuna.launch", "--procs", "4", "--pipeline-depth", "2", "--quiet",
           "--checkpoint-dir", str(ckpt), *train_args(opts, big)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.trial_timeout_s, cwd=workdir,
                         env=_env())
    if run.returncode != 0:
        raise TrialError(f"the reference run failed ({run.returncode}): {run.stderr[-2000:]}")
    return final_state(ckpt, opts.steps)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


class Job:
    """``varuna-launch`` on the control host of ``net``, its output in files."""

    def __init__(self, net: NetHosts, opts: Options, workdir: Path, *, live: bool, big: bool = False) -> None:
        self.net, self.workdir = net, workdir
        self.ckpt, self.logs = workdir / "ckpt", workdir / "logs"
        hosts = ",".join(net.address(h) for h in range(net.num_hosts))
        cmd = [sys.executable, "-m", "varuna.launch", "--hosts", hosts, "--procs-per-host", "1",
               "--pipeline-depth", "2", "--log-dir", str(self.logs), "--quiet", "--max-restarts", "3",
               "--checkpoint-dir", str(self.ckpt), *(["--live-morph"] if live else []), *net.ssh_options(),
               *train_args(opts, big)]
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


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "(gone)"
    return f"[{state}] " + raw.replace(b"\0", b" ").decode(errors="replace")[:160]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


# -- one trial --------------------------------------------------------------------------------


def copying(ckpt: Path) -> Path | None:
    """A step directory being filled: files of a checkpoint in it, its commit file not yet."""
    for c in list_checkpoints(ckpt):
        if not c.complete and any(True for _ in c.path.iterdir()):
            return c.path
    return None


def strike(job: Job, outcome: Outcome, victim: int, *, since: int = 0, wait_step: bool = True) -> float:
    """Wait for the trial's step (and, ``copy``, for a checkpoint being copied), then the fault
    on ``victim``; returns the fault's time."""
    trial = outcome.trial
    if wait_step:
        wait_for(lambda: [s for s in job.steps(since) if s >= trial.step] or job.proc.poll() is not None,
                 180.0, f"step {trial.step}")
    if trial.fault == "copy" and job.proc.poll() is None:
        step_dir = wait_for(lambda: copying(job.ckpt) or job.proc.poll() is not None, 180.0,
                            "a checkpoint being copied", poll_s=0.005)
    if job.proc.poll() is not None:
        last = _read(job.err).strip().splitlines()[-3:]
        raise TrialError(f"the job ended (exit {job.proc.returncode}) before step {trial.step}: {last}")
    pid = job.launched().get(job.net.address(victim))
    if trial.fault == "kill":
        at = time.time()
        job.net.kill(victim)
    else:
        at = job.net.blackhole(victim)
    if trial.fault == "copy":  # how long the struck checkpoint stays incomplete, measured aside
        watch = threading.Thread(target=_incomplete_for, args=(step_dir, 60.0, outcome), daemon=False)
        watch.start()
        outcome.watchers.append(watch)
    if pid is not None:  # the silent host's worker must go: its agent fences it
        gone = wait_for(lambda: not _alive(pid) and time.time(), 30.0, f"the worker of host {victim} to go")
        outcome.fenced_s.append(gone - at)
    return at


def _incomplete_for(step_dir: Path, timeout_s: float, outcome: Outcome) -> None:
    """``outcome.copy_s``: seconds from the step directory's creation until its commit file (or
    its removal: an abandoned checkpoint), at most ``timeout_s`` after the fault."""
    try:
        born = step_dir.stat().st_ctime  # the first writer's mkdir (or a later rename into it)
    except OSError:
        return
    with contextlib.suppress(TrialError):
        wait_for(lambda: not step_dir.is_dir() or any(c.complete and c.path == step_dir
                                                       for c in list_checkpoints(step_dir.parent)),
                 timeout_s, "the struck checkpoint to end", poll_s=0.01)
    outcome.copy_s = time.time() - born


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


def run_trial(opts: Options, trial: Trial, workdir: Path, ref: dict) -> Outcome:  # noqa: C901
    outcome = Outcome(trial)
    started = time.monotonic()
    workdir.mkdir(parents=True)
    with NetHosts.create(opts.hosts, workdir=workdir) as net:
        job = Job(net, opts, workdir, live=trial.fault in ("silent-live", "morph"), big=trial.fault == "copy")
        try:
            faults = [(trial.victims[0], strike(job, outcome, trial.victims[0]))]
            if trial.fault == "morph":
                # The survivors regroup as soon as the host is named: strike a second one then.
                wait_for(lambda: job.events("host-silent"), 30.0, "the launcher to name the host")
                used = [h for h in range(net.num_hosts) if h != trial.victims[0]]
                trial.victims[1] = used[trial.victims[1] % len(used)]
                faults.append((trial.victims[1], strike(job, outcome, trial.victims[1], wait_step=False)))
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
            for watch in outcome.watchers:
                watch.join(65.0)
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
            left = {h: net.pids(h) for h in net.members()}
            outcome.orphans = sum(len(p) for p in left.values())
            if outcome.orphans and not outcome.error:  # name them: a real leak or a slow exit?
                outcome.error = "left in the namespaces: " + "; ".join(
                    f"{h}: {pid} {_cmdline(pid)}" for h, pids in left.items() for pid in pids)
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
          f" {'fenced s':<10} {'launches':>8} {'bit-identical':<13} {'orphans':>7} {'wall s':>6}"
          f" {'copy s':>6}")


def row(o: Outcome) -> str:
    def nums(xs: list[float]) -> str:
        return ",".join(f"{x:.1f}" for x in xs) or "-"

    t = o.trial
    where = ",".join(f"h{v}" for v in t.victims[: 2 if t.fault in ("twice", "morph") else 1]) + f" @{t.step}"
    same = "-" if o.identical is None else ("yes" if o.identical else "NO")
    line = (f"{t.name:<16} {where:<22} {','.join(o.named) or '-':<28} {nums(o.detect_s):<10} "
            f"{nums(o.silent_s):<10} {nums(o.fenced_s):<10} {o.launches:>8} {same:<13} {o.orphans:>7}"
            f" {o.wall_s:>6.1f} {'-' if o.copy_s is None else f'{o.copy_s:.1f}':>6}")
    return line + (f"\n{'':<16} FAILED: {o.error}" if o.error else "")


def _span(xs: list[float]) -> str:
    return f"{min(xs):.1f}-{max(xs):.1f} s" if xs else "- (none named: a kill is a worker exit)"


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
    p.add_argument("--copy-embd", type=int, default=256, help="n_embd of the copy trials' GPT (8 layers)")
    a = p.parse_args(argv)
    faults = tuple(f for f in a.faults.split(",") if f)
    if not faults or set(faults) - set(FAULTS):
        p.error(f"--faults {a.faults!r}: use a comma-separated subset of {','.join(FAULTS)}")
    if a.trials < 1 or a.steps < 12 or a.checkpoint_every < 1:
        p.error("need --trials >= 1, --steps >= 12, --checkpoint-every >= 1")
    return Options(trials=a.trials, seed=a.seed, steps=a.steps, checkpoint_every=a.checkpoint_every,
                   faults=faults, workdir=a.workdir, keep=a.keep, trial_timeout_s=a.trial_timeout,
                   copy_embd=a.copy_embd)


@contextlib.contextmanager
def trial_root(opts: Options) -> Iterator[Path]:
    if opts.workdir is not None:  # a --workdir that does not exist yet is made, as --keep expects
        opts.workdir.mkdir(parents=True, exist_ok=True)
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
        big: dict | None = None  # the copy trials' reference, made when the first one comes
        print(HEADER, flush=True)
        for i in range(1, opts.trials + 1):
            trial = plan(opts, i)
            if trial.fault == "copy" and big is None:
                big = reference(opts, root / "reference-big", big=True)
            outcome = run_trial(opts, trial, root / f"trial-{i}", big if trial.fault == "copy" else ref)
            results.append(outcome)
            print(row(outcome), flush=True)
    failed = [o.trial.name for o in results if not o.ok]
    detect = [x for o in results for x in o.detect_s]
    print(f"chaos: {len(results) - len(failed)}/{len(results)} trials kept every property; detection"
          f" {min(detect, default=0):.1f}-{max(detect, default=0):.1f} s after the fault")
    for kind in opts.faults:
        mine = [o for o in results if o.trial.fault == kind]
        d = [x for o in mine for x in o.detect_s]
        f = [x for o in mine for x in o.fenced_s]
        if mine:
            print(f"chaos: {kind}: {sum(o.ok for o in mine)}/{len(mine)} kept; detection {_span(d)}, worker"
                  f" fenced {_span(f)} after the fault")
    if failed:
        print(f"chaos: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
