"""End to end: one GPT job on a pool of pretend VMs of two types (issue #19).

A real ``varuna-manager serve`` and the local provider; the job spec's ``[[vm_types]]`` has 2 ×
``fast`` (speed 1.6) and 2 × ``slow`` (speed 1: the provider stretches its workers' steps, and
its calibration's compute, by 1.6) with one slot each; ``fast`` has a spot capacity of 2 VMs ever
(``max_created``), so a lost fast VM does not come back. Deterministic mode (``--deterministic``:
bit-identical weights at any P×D, shares and stage split, and across morphs; docs/determinism.md).

1. calibration once per type: ``varuna-profile`` runs on the first VM of each type, one after
   the other (two ``calibration-started``/``-finished`` pairs, one per type, never a third);
2. the first generation is planned by the simulator's mixed auto-config on those calibrations and
   every rank runs on a VM of the type the plan put it on;
3. a fast VM of the running generation is preempted (``kill -9`` of its process group): the job
   is re-planned with the mix that is left (at most one fast VM) and resumes from its checkpoint;
4. the job finishes with every logged step's loss equal to its undisturbed single-process run's,
   bit for bit, and no agent or worker is left behind.

~2 minutes on 2 idle cores (two cheap profiles, 60 steps). Run with ``-s`` to see the events.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from manager.domain.jobspec import load_jobspec
from manager.transport.convert import spec_to_pb

sys.path.insert(0, str(Path(__file__).parent))
from test_manager_local import ManagerProcess, events, processes_mentioning, status, wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "gpt2" / "train.py"
PROFILE_TARGET = ROOT / "examples" / "gpt2" / "profile_target.py"
STEPS = 60
CHECKPOINT_EVERY = 3
ARGS = [
    "--steps", str(STEPS), "--n-layer", "4", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
    "--global-batch-size", "24", "--micro-batch-size", "2", "--eval-every", "0", "--seed", "0",
    "--deterministic",
]  # fmt: skip

pytestmark = pytest.mark.slow


def _losses(path: Path) -> dict[int, float]:
    """step → loss of the last line for each step (a redone step's latest value)."""
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def _vm_types(mp: ManagerProcess, job: str) -> dict[str, str]:
    """VM id → type, from the state file (the provider reference the manager keeps)."""
    db = sqlite3.connect(f"file:{mp.tmp_path / 'state.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT vm_id, provider_ref FROM vms WHERE job_id=?", (job,)).fetchall()
    finally:
        db.close()
    return {vm_id: json.loads(ref or "{}").get("vm_type", "") for vm_id, ref in rows}


def _of(mp: ManagerProcess, job: str, kind: str) -> list:
    return [e for e in events(mp, job) if e.kind == kind]


def _data(event) -> dict:
    return json.loads(event.data_json or "{}")


def _spec(tmp_path: Path) -> Path:
    spec = {
        "name": "gpt-mixed",
        "script": str(TRAIN),
        "args": [*ARGS, "--metrics-out", str(tmp_path / "metrics.jsonl")],
        "global_batch_size": 24,
        "micro_batch_size": 2,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "checkpoint_every": CHECKPOINT_EVERY,
        "min_vms": 1,
        "max_vms": 4,
        "procs_per_vm": 1,
        "target_steps": STEPS,
        "env": {"OMP_NUM_THREADS": "1"},
        "vm_types": [
            {"name": "fast", "max_vms": 2, "speed": 1.6, "provider_options": {"max_created": 2}},
            {"name": "slow", "max_vms": 2, "speed": 1.0},
        ],
        # A cheap profile (m = 2 only, few repetitions, loopback hosts), as tests/test_manager_grow.py.
        "profile": {
            "model": f"{PROFILE_TARGET}:build",
            "model_args": {"n_layer": 4, "n_embd": 32, "n_head": 2, "block_size": 32},
            "args": ["--procs", "1", "--reps", "3", "--warmup", "1", "--link-reps", "2",
                     "--allreduce-reps", "1", "--host-emulation", "loopback"],
            "timeout_s": 180,
        },
    }  # fmt: skip
    path = tmp_path / "job.json"
    path.write_text(json.dumps(spec))
    return path


def _generation_ranks_match_types(mp: ManagerProcess, job: str, launched) -> None:
    """Every rank of a launched generation is on a VM of the type its plan put there."""
    data = _data(launched)
    types = _vm_types(mp, job)
    mixed = data["mixed"]
    assert [types[data["vms"][h]] for h in mixed["rank_hosts"]] == mixed["rank_types"], data
    assert data["source"].startswith("simulator, mixed VM types: "), data["source"]


def test_gpt_on_two_vm_types_calibrates_per_type_and_replans_after_losing_a_fast_vm(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("VARUNA_CHECKPOINT_DIR", "VARUNA_RESUME", "VARUNA_MANAGER"):
        env.pop(key, None)
    ref_metrics = tmp_path / "reference.jsonl"
    reference_run = subprocess.Popen(
        [sys.executable, str(TRAIN), *ARGS, "--metrics-out", str(ref_metrics)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    mp = ManagerProcess(
        tmp_path,
        "--heartbeat-interval", "0.25",
        "--heartbeat-timeout", "5",
        "--create-retry", "1",
        "--gather-timeout", "60",
        # Pretend VMs share this machine's cores: under load the per-type calibrations do not
        # describe them, and a VM marked slow would change the layout under test.
        "--slow-threshold-pct", "2000",
        "--stop-timeout", "60",
        "--orphan-timeout", "60",
    )  # fmt: skip
    mp.start()
    job = ""
    try:
        with mp.client() as c:
            job = c.submit(spec_to_pb(load_jobspec(_spec(tmp_path))))

        # 1.-2. One calibration per type, then a launch planned with both.
        wait_for(lambda: status(mp, job).step >= 1, 420, "calibration of both types and training to start")
        finished = _of(mp, job, "calibration-finished")
        of_type = sorted(_data(e)["vm_type"] for e in finished)
        assert of_type == ["fast", "slow"], [e.message for e in finished]
        types = _vm_types(mp, job)
        assert all(types[e.vm_id] == _data(e)["vm_type"] for e in finished)
        first = _of(mp, job, "launched")[0]
        _generation_ranks_match_types(mp, job, first)
        assert "fast" in _data(first)["mixed"]["rank_types"]

        # 3. Preempt a fast VM of the running generation once it has trained a few steps.
        def fast_vm():
            st = status(mp, job)
            steps = [p.step for p in st.throughput if p.generation == st.generation]
            # Past a checkpoint, well before the end, while the generation trains.
            training = st.generation_state == "running" and len(steps) >= 2
            if not training or not 2 * CHECKPOINT_EVERY <= st.step < STEPS - 15:
                return None
            fast = [v for v in st.vms if v.in_generation and v.agent_pid > 1 and types.get(v.vm_id) == "fast"]
            return fast[0] if fast else None

        victim = wait_for(fast_vm, 240, "a fast VM in a generation that trains")
        os.killpg(victim.agent_pid, signal.SIGKILL)
        gone = wait_for(
            lambda: [e for e in events(mp, job) if e.kind == "vm-gone" and e.vm_id == victim.vm_id],
            120,
            "the preempted VM to be seen gone",
        )[0]
        relaunch = wait_for(
            lambda: [e for e in _of(mp, job, "launched") if e.id > gone.id], 360, "the re-planned launch"
        )[0]
        again = _data(relaunch)
        assert victim.vm_id not in again["vms"]
        assert Counter(again["mixed"]["rank_types"])["fast"] <= 1, again["mixed"]  # no fast VM came back
        _generation_ranks_match_types(mp, job, relaunch)
        resumed = wait_for(
            lambda: [e for e in _of(mp, job, "resumed") if e.id > gone.id], 240, "training to resume"
        )[0]
        assert _data(resumed)["redone_steps"] <= 2 * CHECKPOINT_EVERY - 1, resumed.message

        # 4. The end: the undisturbed run's losses, bit for bit.
        wait_for(lambda: status(mp, job).state in ("finished", "failed", "cancelled"), 420, "the job to end")
        st = status(mp, job)
        assert (st.state, st.step) == ("finished", STEPS), (st.state, st.step, st.message)
        _, err = reference_run.communicate(timeout=300)
        assert reference_run.returncode == 0, err.decode()[-2000:]
        reference, got = _losses(ref_metrics), _losses(tmp_path / "metrics.jsonl")
        assert max(got) == STEPS
        differ = [(s, got[s], reference[s]) for s in got if got[s] != reference[s]]
        assert not differ, differ[:3]
        assert len(_of(mp, job, "calibration-started")) == 2  # once per type, never again
        print()
        assert mp.cli("events", job) == 0
        print(f"final loss {got[STEPS]!r} == undisturbed {reference[STEPS]!r}")
        wait_for(
            lambda: not processes_mentioning(job) and not processes_mentioning(str(tmp_path / "metrics")),
            60,
            "every agent and worker to exit",
        )
    finally:
        mp.stop()
        mp.kill_vms()
        if reference_run.poll() is None:
            reference_run.kill()
            reference_run.wait(10)
