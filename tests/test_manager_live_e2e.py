"""End to end, live morph under the manager: the GPT example (``live_morph = true``) on pretend
VMs. A VM killed with SIGKILL at 2×2; an eviction notice at 2×2 (the VM hands its state over and
leaves: nothing redone); growth from two VMs to four when spot capacity comes back (the new
workers join the running generation); a worker frozen with SIGSTOP (the others go on without it,
its agent kills it on the manager's order). Each time the manager records a ``live-morph`` event (no
relaunch), the workers that stay keep their processes (same pids), and the job finishes with
losses bit-identical to an undisturbed single-process run in deterministic mode
(docs/determinism.md: the numerics do not depend on P×D).

The notice and growth tests pause the training workers (SIGSTOP) while the trigger is set up and
let them go once it is in place (the notified worker continued by its agent's signal; the joiners
registered in the store): otherwise the 30 short steps could end before a VM's agent polled its
notice or before the new VMs' workers had imported torch. Every wait is on an observable state,
with a timeout.

Until the third session a race (about 1 run in 5 on a busy 2-core machine) sent this run down
the restart path: when the kill landed mid-step, one survivor stayed blocked on another
survivor's torn-down group (10 s per blocked link thread) until the others closed the membership
without it. A tear-down now severs its groups first (docs/live_morph.md, Frozen peers and the
failure cascade): 10 runs in a row took the live path beside other test runs. The test still
accepts the restart path (``live-morph-fallback``) and checks what the issue asks of it: the
reason is recorded, the job still ends bit-identical, nothing is left running; it says which
path it saw. The live path itself is checked without the manager,
deterministically, by tests/test_launch_live.py and tests/test_live_morph.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from manager.domain.jobspec import load_jobspec
from manager.transport.convert import spec_to_pb

sys.path.insert(0, str(Path(__file__).parent))
from test_manager_local import (  # noqa: E402
    ManagerProcess,
    MetadataServer,
    events,
    kinds,
    processes_mentioning,
    status,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "gpt2" / "train.py"
STEPS = 30
KILL_AT = 4
MODEL_ARGS = ["--n-layer", "4", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
              "--global-batch-size", "8", "--micro-batch-size", "2", "--eval-every", "0", "--seed", "0",
              "--deterministic"]

pytestmark = pytest.mark.slow
dist = pytest.importorskip("torch.distributed")
from varuna.runtime.live_morph import ROOT as LIVE_ROOT  # noqa: E402


def reference_losses(tmp_path: Path) -> dict[int, float]:
    metrics = tmp_path / "reference.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("VARUNA_CHECKPOINT_DIR", "VARUNA_RESUME", "VARUNA_MANAGER", "VARUNA_LIVE_STORE",
                "VARUNA_LIVE_STORE_KEY"):
        env.pop(key, None)
    cmd = [sys.executable, str(TRAIN), "--steps", str(STEPS), *MODEL_ARGS, "--metrics-out", str(metrics)]
    subprocess.run(cmd, check=True, env=env, timeout=300, capture_output=True)
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}


def test_a_killed_vm_is_a_live_morph_and_the_losses_stay_bit_identical(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    spec = {
        "name": "gpt-live", "script": str(TRAIN),
        "args": ["--steps", str(STEPS), *MODEL_ARGS, "--metrics-out", str(metrics)],
        "global_batch_size": 8, "micro_batch_size": 2, "checkpoint_dir": str(tmp_path / "ckpt"),
        # No periodic checkpoint (a save in flight when a peer dies used to wait 300 s for the dead
        # rank's marker; now abandoned once the rank is known dead, tests/test_checkpoint_safety.py).
        "checkpoint_every": 0, "min_vms": 1, "max_vms": 4, "procs_per_vm": 1, "target_steps": STEPS,
        "pipeline_depth": 2, "live_morph": True, "env": {"OMP_NUM_THREADS": "1"},
        "provider_options": {"max_created": 4},
    }
    (tmp_path / "job.json").write_text(json.dumps(spec))
    mp = ManagerProcess(tmp_path, "--heartbeat-interval", "0.25", "--heartbeat-timeout", "3",
                        "--stop-timeout", "60", "--orphan-timeout", "60", "--gather-timeout", "60")
    reference = reference_losses(tmp_path)
    mp.start()
    job = None
    try:
        job = submit(mp, tmp_path)
        st = running_at_2x2(mp, job)
        pids = {w.rank: w.pid for v in st.vms if v.in_generation for w in v.workers}
        victim = next(v for v in st.vms if any(w.rank == 3 for w in v.workers))
        os.killpg(victim.agent_pid, signal.SIGKILL)
        wait_for(lambda: "live-morph" in kinds(mp, job) or "live-morph-fallback" in kinds(mp, job), 300,
                 "the live morph")
        evs = events(mp, job)
        live = "live-morph" in [e.kind for e in evs]
        if live:
            [ev] = [json.loads(e.data_json) for e in evs if e.kind == "live-morph"]
            assert ev["lost_ranks"] == [3] and ev["duration_s"] > 0
        else:  # the restart path (module docstring), with its reason recorded
            [fallback] = [e.message for e in evs if e.kind == "live-morph-fallback"]
            assert fallback, "the fallback names its reason"
        wait_for(lambda: status(mp, job).state == "finished", 600, "the job to finish")
        st = status(mp, job)
        assert st.step == STEPS
        if live:
            assert st.generation == 1, "one generation: no relaunch"
            assert kinds(mp, job).count("launched") == 1 and "killing" not in kinds(mp, job)
            survivors = {w.rank: w.pid for v in st.vms if v.vm_id != victim.vm_id for w in v.workers}
            kept = {r: p for r, p in pids.items() if r != 3}
            assert survivors == kept, "the survivors kept their processes"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        losses = {r["step"]: r["loss"] for r in rows}  # a relaunch rewrites the steps it redoes
        assert losses == reference, (losses, reference)
        wait_for(lambda: not processes_mentioning(job), 60, "every agent and worker to exit")
        path = [e.message for e in events(mp, job) if e.kind in ("live-morph", "live-morph-fallback")][0]
        print(f"\n{'live' if live else 'RESTART PATH'}: {path}; P×D per step "
              f"{[(r['step'], r['P'], r['D']) for r in rows]}")
    except AssertionError:
        dump(mp, job, tmp_path)
        raise
    finally:
        mp.stop()
        mp.kill_vms()


# -- notice and growth ----------------------------------------------------------------------------


def live_spec(tmp_path: Path, metrics: Path, **over) -> dict:
    spec = {
        "name": "gpt-live", "script": str(TRAIN),
        "args": ["--steps", str(STEPS), *MODEL_ARGS, "--metrics-out", str(metrics)],
        "global_batch_size": 8, "micro_batch_size": 2, "checkpoint_dir": str(tmp_path / "ckpt"),
        "checkpoint_every": 0, "min_vms": 1, "max_vms": 4, "procs_per_vm": 1, "target_steps": STEPS,
        "live_morph": True, "env": {"OMP_NUM_THREADS": "1"},
    }
    spec.update(over)
    (tmp_path / "job.json").write_text(json.dumps(spec))
    return spec


def manager(tmp_path: Path) -> ManagerProcess:
    return ManagerProcess(tmp_path, "--heartbeat-interval", "0.25", "--heartbeat-timeout", "3",
                          "--stop-timeout", "60", "--orphan-timeout", "60", "--gather-timeout", "60",
                          "--create-retry", "1", "--grow-cooldown", "1")


def submit(mp: ManagerProcess, tmp_path: Path):
    """Submit ``tmp_path/job.json`` to the running manager; the job id."""
    with mp.client() as c:
        return c.submit(spec_to_pb(load_jobspec(tmp_path / "job.json")))


def running_at_2x2(mp: ManagerProcess, job):
    """The job's status once it passed step KILL_AT, checked to run at 2×2."""
    wait_for(lambda: status(mp, job).step >= KILL_AT, 300, f"step {KILL_AT}")
    st = status(mp, job)
    assert (st.pipeline_depth, st.data_parallel) == (2, 2)
    return st


def worker_pids(st) -> dict[int, int]:
    return {w.rank: w.pid for v in st.vms if v.in_generation for w in v.workers if w.running}


def pause(pids, sig=signal.SIGSTOP) -> None:
    for pid in pids:  # each worker is its own process group (the agent starts it in a new session)
        os.killpg(pid, sig)


def proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def redone_lines(tmp_path: Path) -> list[str]:
    """The LiveTrainer's line for a step that failed and is redone, in any worker's log."""
    return [x for log in tmp_path.glob("**/gen*-rank*.log")
            for x in log.read_text(errors="replace").splitlines() if "; regrouping" in x]


def wait_joiners(address: str, key: str, n: int) -> None:
    """Until ``n`` joiners registered in the live store at ``address`` (its joins counter)."""
    from varuna.runtime.auth_store import AuthStore

    host, port = address.rsplit(":", 1)
    store = AuthStore(host, int(port), key=key, timeout=timedelta(seconds=30))
    wait_for(lambda: store.add(f"{LIVE_ROOT}joins", 0) >= n, 300, f"{n} joiners to register")


def finished_in_one_generation(mp: ManagerProcess, job, metrics: Path, reference: dict, *,
                               every_step_once: bool = True):
    """Wait for the job's end and check what every live path promises: one generation (no
    relaunch, no kill or stop order), losses bit-identical to the undisturbed run (each step
    once, unless the step in flight was redone), the last rows at the generation's P×D. Returns
    the final status and the metric rows."""
    wait_for(lambda: status(mp, job).state == "finished", 600, "the job to finish")
    st = status(mp, job)
    assert st.step == STEPS and st.generation == 1, "one generation: no relaunch"
    assert kinds(mp, job).count("launched") == 1 and not {"killing", "stopping"} & set(kinds(mp, job))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    if every_step_once:
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "each step once"
    assert {r["step"]: r["loss"] for r in rows} == reference
    assert (rows[-1]["P"], rows[-1]["D"]) == (st.pipeline_depth, st.data_parallel), "the manager's P×D"
    return st, rows


def dump(mp: ManagerProcess, job, tmp_path: Path) -> None:
    if job is not None and mp.proc is not None and mp.proc.poll() is None:
        for e in events(mp, job):
            print("EVENT", e.kind, e.message[:300])
    for log in sorted(tmp_path.glob("**/gen*-rank*.log")):
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.startswith("varuna")]
        print(f"== {log.name}", *lines[-6:], sep="\n")


def live_morph_event(mp: ManagerProcess, job, what: str) -> tuple[list, dict]:
    """Wait for the job's live morph (its fallback fails the test); the job's events and the
    ``live-morph`` event's data."""
    wait_for(lambda: {"live-morph", "live-morph-fallback"} & set(kinds(mp, job)), 300, what)
    evs = events(mp, job)
    assert "live-morph-fallback" not in [e.kind for e in evs], [e.message for e in evs]
    [ev] = [json.loads(e.data_json) for e in evs if e.kind == "live-morph"]
    return evs, ev


def nothing_redone_at_the_managers_layout(mp: ManagerProcess, job, tmp_path: Path, rows: list, ev: dict,
                                          why: str) -> None:
    """No step redone (``why``), the last rows at the P×D the manager chose, and every agent and
    worker gone by itself."""
    assert redone_lines(tmp_path) == [], why
    assert (rows[-1]["P"], rows[-1]["D"]) == (ev["pipeline_depth"], ev["data_parallel"]), "manager's P×D"
    wait_for(lambda: not processes_mentioning(job), 60, "every agent and worker to exit")


@pytest.mark.parametrize("leavers", [(3,), (1, 3)], ids=["one-vm", "a-whole-stage"])
def test_a_notice_hands_the_state_over_live_and_redoes_nothing(tmp_path, leavers):
    """``a-whole-stage``: both replicas of stage 1 are on noticed VMs; they hand it over to a worker
    that stays (no checkpoint, no relaunch)."""
    metrics = tmp_path / "metrics.jsonl"
    md = MetadataServer()
    live_spec(tmp_path, metrics, pipeline_depth=2,
              provider_options={"max_created": 4, "metadata_url": md.url, "standby": False})
    mp = manager(tmp_path)
    reference = reference_losses(tmp_path)
    mp.start()
    job = None
    try:
        job = submit(mp, tmp_path)
        st = running_at_2x2(mp, job)
        pids = worker_pids(st)
        noticed = [v for v in st.vms if any(w.rank in leavers for w in v.workers)]
        pause(pids.values())
        md.preempt(noticed[0].vm_id)
        md.document["Events"][0]["Resources"] = [v.vm_id for v in noticed]
        # Their agents continue them with the notice signal once the manager said "leave".
        wait_for(lambda: all(proc_state(pids[r]) not in ("T", "t") for r in leavers), 120,
                 "the leave orders to reach the workers")
        pause([p for r, p in pids.items() if r not in leavers], signal.SIGCONT)
        _, ev = live_morph_event(mp, job, "the live morph")
        assert ev["reason_kind"] == "notice" and ev["lost_ranks"] == list(leavers) and ev["duration_s"] > 0
        gone = {v.vm_id for v in noticed}
        wait_for(lambda: not any(v.in_generation for v in status(mp, job).vms if v.vm_id in gone), 120,
                 "the leavers' exit 0")
        for v in noticed:
            os.killpg(v.agent_pid, signal.SIGKILL)  # the platform evicts it, after the hand-over
        st, rows = finished_in_one_generation(mp, job, metrics, reference)
        survivors = {w.rank: w.pid for v in st.vms if v.vm_id not in gone for w in v.workers}
        assert survivors == {r: p for r, p in pids.items() if r not in leavers}, "the others kept their pids"
        nothing_redone_at_the_managers_layout(mp, job, tmp_path, rows, ev, "with a notice no step is redone")
    except AssertionError:
        dump(mp, job, tmp_path)
        raise
    finally:
        mp.stop()
        mp.kill_vms()
        md.close()


def test_new_vms_join_the_running_generation_live(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    capacity = tmp_path / "capacity"
    capacity.write_text("2\n")
    live_spec(tmp_path, metrics, min_vms=2,
              provider_options={"capacity_file": str(capacity), "standby": False})
    mp = manager(tmp_path)
    reference = reference_losses(tmp_path)
    mp.start()
    job = None
    try:
        job = submit(mp, tmp_path)
        wait_for(lambda: status(mp, job).step >= 2, 300, "step 2")
        st = status(mp, job)
        before = (st.pipeline_depth, st.data_parallel)
        assert before[0] * before[1] == 2
        pids = worker_pids(st)
        environ = dict(x.split("=", 1) for x in Path(f"/proc/{pids[0]}/environ").read_bytes().decode()
                       .split("\0") if "=" in x)
        address, key = environ["VARUNA_LIVE_STORE"], environ["VARUNA_LIVE_STORE_KEY"]
        pause(pids.values())
        capacity.write_text("4\n")  # spot capacity comes back
        wait_joiners(address, key, 2)  # started by the new VMs' agents as RANK 2, 3 with VARUNA_LIVE_JOIN=1
        pause(pids.values(), signal.SIGCONT)
        _, ev = live_morph_event(mp, job, "the growth")
        assert ev["reason_kind"] == "growth" and ev["joined_ranks"] == [2, 3] and ev["old"] == list(before)
        grown = worker_pids(status(mp, job))
        st, rows = finished_in_one_generation(mp, job, metrics, reference)
        assert {r: p for r, p in grown.items() if r < 2} == pids, "the first workers kept their processes"
        assert sorted(grown) == [0, 1, 2, 3]
        nothing_redone_at_the_managers_layout(mp, job, tmp_path, rows, ev, "growth redoes no step")
    except AssertionError:
        dump(mp, job, tmp_path)
        raise
    finally:
        mp.stop()
        mp.kill_vms()


# -- a frozen worker ------------------------------------------------------------------------------


def test_a_frozen_worker_is_killed_by_its_agent_and_the_others_go_on_live(tmp_path):
    """Rank 3 stopped with SIGSTOP (frozen: its sockets stay open) at 2×2: the other workers'
    heartbeat watches declare it dead after ``--live-freeze-s`` and regroup without it; the manager
    drops it (``live-frozen``), orders its agent to kill it (gone, reaped) and takes its exit as no
    failure: one generation, the others' pids kept, losses bit-identical, the generation's P×D the
    workers' own."""
    metrics = tmp_path / "metrics.jsonl"
    live_spec(tmp_path, metrics, pipeline_depth=2, provider_options={"max_created": 4},
              args=["--steps", str(STEPS), *MODEL_ARGS, "--metrics-out", str(metrics),
                    "--live-freeze-s", "10"])
    mp = manager(tmp_path)
    reference = reference_losses(tmp_path)
    mp.start()
    job = None
    try:
        job = submit(mp, tmp_path)
        st = running_at_2x2(mp, job)
        pids = worker_pids(st)
        pause([pids[3]])
        wait_for(lambda: "live-frozen" in kinds(mp, job), 300, "the manager to see the verdict")
        wait_for(lambda: proc_state(pids[3]) == "gone", 120, "its agent to kill and reap it")
        evs, ev = live_morph_event(mp, job, "the live morph")
        [frozen] = [json.loads(e.data_json) for e in evs if e.kind == "live-frozen"]
        assert frozen["members"] == [3] and "no heartbeat" in frozen["why"]["3"]
        assert ev["reason_kind"] == "frozen" and ev["lost_ranks"] == [3] and ev["duration_s"] > 0
        # The step in flight is redone (its metric row may come twice, with the same loss).
        st, rows = finished_in_one_generation(mp, job, metrics, reference, every_step_once=False)
        others = {w.rank: w.pid for v in st.vms if v.in_generation for w in v.workers if w.rank != 3}
        assert others == {r: p for r, p in pids.items() if r != 3}, "the others kept their processes"
        wait_for(lambda: not processes_mentioning(job), 60, "every agent and worker to exit")
        [message] = [e.message for e in evs if e.kind == "live-morph"]
        print(f"\n{message}; P×D per step {[(r['step'], r['P'], r['D']) for r in rows]}")
    except AssertionError:
        dump(mp, job, tmp_path)
        raise
    finally:
        mp.stop()
        mp.kill_vms()
