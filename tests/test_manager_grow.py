"""End to end: a job submitted without a calibration is calibrated on its first VM, starts on
fewer pretend VMs than it can use, and grows when spot capacity comes back.

The GPT example on the local provider, whose spot capacity is a file (``capacity_file``): 2 VMs
at first, 4 once training runs.

1. The job spec has no calibration but a ``[profile]``: the manager orders the first VM's agent to
   run ``varuna-profile`` (a cheap profile: m = 2, few repetitions); the manager is killed with
   ``kill -9`` while that runs and restarted: the same run is awaited, not started again; the
   calibration is stored with the job and the first generation's P×D and predicted throughput
   are auto-config's for that calibration.
2. Capacity rises to 4 while training: the manager's periodic requests get 2 more VMs, their
   agents register, and the job morphs onto 4 VMs (a graceful ``grow`` morph: the events record
   the old and new P×D).
3. The manager is killed and restarted again: the stored calibration is reused (no second
   profile), the job reaches its target step, and its final loss equals an undisturbed run's.

Run with ``-s`` to see ``varuna-manager events`` at the end.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

import pytest

from manager.domain.jobspec import load_jobspec
from manager.transport.convert import spec_to_pb
from varuna.core.calibration import Calibration

sys.path.insert(0, str(Path(__file__).parent))
from test_manager_e2e import MODEL_ARGS, TRAIN, reference_loss  # noqa: E402
from test_manager_local import ManagerProcess, events, processes_mentioning, status, wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROFILE_TARGET = ROOT / "examples" / "gpt2" / "profile_target.py"
STEPS = 150
CHECKPOINT_EVERY = 10

pytestmark = pytest.mark.slow


def _of(mp: ManagerProcess, job: str, kind: str) -> list:
    return [e for e in events(mp, job) if e.kind == kind]


def _data(event) -> dict:
    return json.loads(event.data_json or "{}")


def _stored_calibration(mp: ManagerProcess, job: str) -> tuple[str, str]:
    """(calibration_state, calibration_json) of the job row, read from the state file."""
    db = sqlite3.connect(f"file:{mp.tmp_path / 'state.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        return db.execute(
            "SELECT calibration_state, calibration_json FROM jobs WHERE job_id=?", (job,)
        ).fetchone()
    finally:
        db.close()


def test_gpt_calibrates_on_its_first_vm_then_grows_when_capacity_comes_back(tmp_path):
    from simulator.autoconfig import autoconfigure

    metrics = tmp_path / "metrics.jsonl"
    capacity = tmp_path / "capacity"
    capacity.write_text("2\n")
    spec = {
        "name": "gpt-grow",
        "script": str(TRAIN),
        "args": ["--steps", str(STEPS), *MODEL_ARGS, "--metrics-out", str(metrics)],
        "global_batch_size": 24,
        "micro_batch_size": 2,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "checkpoint_every": CHECKPOINT_EVERY,
        "min_vms": 2,
        "max_vms": 4,
        "procs_per_vm": 1,
        "target_steps": STEPS,
        "env": {"OMP_NUM_THREADS": "1"},
        "provider_options": {"capacity_file": str(capacity)},
        # The model of MODEL_ARGS; a cheap profile (m = 2 only, few repetitions, loopback hosts).
        "profile": {
            "model": f"{PROFILE_TARGET}:build",
            "model_args": {"n_layer": 4, "n_embd": 32, "n_head": 2, "block_size": 32},
            "args": [
                "--procs",
                "1",
                "--reps",
                "3",
                "--warmup",
                "1",
                "--link-reps",
                "2",
                "--allreduce-reps",
                "1",
                "--host-emulation",
                "loopback",
            ],
            "timeout_s": 180,
        },
    }
    (tmp_path / "job.json").write_text(json.dumps(spec))
    mp = ManagerProcess(
        tmp_path,
        "--heartbeat-interval",
        "0.25",
        "--heartbeat-timeout",
        "5",
        "--create-retry",
        "1",
        "--grow-cooldown",
        "1",
        "--gather-timeout",
        "30",
        # The cheap calibration predicts compute times loosely and 2 cores run every worker: the
        # fail-stutter rule (which uses it with fewer than 3 replicas) must not take contention for
        # a failing VM; this test is about calibration and growth (tests/test_manager_e2e.py
        # covers stutter).
        "--slow-threshold-pct",
        "2000",
        "--orphan-timeout",
        "60",
    )
    reference = reference_loss(tmp_path, STEPS)
    mp.start()
    job = None
    try:
        with mp.client() as c:
            job = c.submit(spec_to_pb(load_jobspec(tmp_path / "job.json")))

        # 1. Calibration on the first VM; the manager dies while it runs and comes back.
        started = wait_for(lambda: _of(mp, job, "calibration-started"), 60, "the calibration to start")
        profiled_on = started[0].vm_id
        assert profiled_on in (f"{job}-vm1", f"{job}-vm2")  # whichever was usable first
        vm_dir = tmp_path / "state.sqlite.d" / job / profiled_on
        # Killed once the agent runs varuna-profile (the run's log exists), long before it ends.
        wait_for(
            lambda: (vm_dir / "calibration-attempt1.log").exists(), 60, "the agent to start varuna-profile"
        )
        assert not _of(mp, job, "calibration-finished")
        mp.kill()
        mp.start()
        finished = wait_for(lambda: _of(mp, job, "calibration-finished"), 180, "the calibration to finish")
        assert finished[0].vm_id == profiled_on and _data(finished[0])["attempt"] == 1
        wall_s = _data(finished[0])["wall_s"]
        assert 0 < wall_s < 180
        state, text = _stored_calibration(mp, job)
        assert state == "done"
        cal = Calibration.from_dict(json.loads(text))
        assert cal.num_segments == 5 and cal.micro_batch_sizes == [2]

        wait_for(lambda: status(mp, job).step >= 1, 180, "training to start")
        st = status(mp, job)
        assert st.calibration_state == "done"
        assert st.calibration == f"profiled on {profiled_on} in {wall_s:.1f} s"
        # The first generation was planned with the stored calibration (auto-config on 2 VMs).
        first = _data(_of(mp, job, "launched")[0])
        best = autoconfigure(cal, gpus=2, global_batch_size=24, micro_batch_size=2).best
        assert first["source"].startswith("simulator")
        assert (
            (first["P"], first["D"])
            == (best.num_stages, best.num_replicas)
            == (st.pipeline_depth, st.data_parallel)
        )
        assert first["predicted_samples_per_s"] == pytest.approx(best.examples_per_s)
        assert len(first["vms"]) == 2

        # 2. Spot capacity comes back while training: two more VMs, one grow morph onto them.
        capacity.write_text("4\n")
        resumed = wait_for(
            lambda: [e for e in _of(mp, job, "resumed") if _data(e)["reason"].startswith("grow")],
            180,
            "the grow morph",
        )
        grow = _data(resumed[0])
        best4 = autoconfigure(cal, gpus=4, global_batch_size=24, micro_batch_size=2).best
        assert (grow["previous_P"], grow["previous_D"]) == (first["P"], first["D"])
        assert (grow["P"], grow["D"]) == (best4.num_stages, best4.num_replicas)
        assert grow["redone_steps"] == 0  # a graceful morph: checkpoint at the stop
        second = _data(_of(mp, job, "launched")[1])
        assert second["previous"]["D"] == first["D"] and len(second["vms"]) == 4
        assert second["reason"].startswith("grow")

        # 3. Another manager kill -9 + restart: the stored calibration is reused, never re-profiled.
        mp.kill()
        mp.start()
        wait_for(lambda: status(mp, job).state == "finished", 240, "the job to finish")
        st = status(mp, job)
        assert st.step == STEPS
        assert st.calibration == f"profiled on {profiled_on} in {wall_s:.1f} s"
        assert len(_of(mp, job, "calibration-started")) == 1
        assert len(_of(mp, job, "calibration-finished")) == 1
        assert not _of(mp, job, "calibration-failed") and not _of(mp, job, "calibration-lost")
        # varuna-profile ran once: one run log, one run in it, one start in the agent's log.
        runs = sorted((tmp_path / "state.sqlite.d" / job).glob("*/calibration-attempt*.log"))
        assert [p.parent.name for p in runs] == [profiled_on], runs  # only there
        assert runs[0].read_text().count("calibration wall time:") == 1
        agent_log = (vm_dir / "agent.log").read_text()
        assert agent_log.count("calibration attempt 1: varuna-profile") == 1, agent_log
        assert len(_of(mp, job, "manager-started")) >= 2

        # The metrics file (rank 0 appends one line per step, across generations).
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert rows[-1]["step"] == STEPS and rows[-1]["D"] == grow["D"]
        redone = [
            prev["step"] - row["step"] + 1 for prev, row in zip(rows, rows[1:]) if row["step"] <= prev["step"]
        ]
        assert not redone, redone
        final = rows[-1]["loss"]
        assert abs(final - reference[-1]) < 0.02 * reference[-1], (final, reference[-1])

        print()
        assert mp.cli("events", job) == 0
        print(f"final loss {final:.4f} vs undisturbed {reference[-1]:.4f}; calibration {wall_s:.1f} s")
        wait_for(
            lambda: not processes_mentioning(job) and not processes_mentioning(str(metrics)),
            30,
            "every agent, worker and profiler to exit",
        )
    finally:
        mp.stop()
        mp.kill_vms()
