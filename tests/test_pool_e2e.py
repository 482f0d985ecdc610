"""End to end: three GPT jobs share one pool of pretend VMs of two types (docs/pool.md).

A real ``varuna-manager serve --pool`` with 2 × ``fast`` and 2 × ``slow`` VMs of one slot (the
local provider emulates ``slow``, speed 0.5, by making its workers take twice as long per step).
Three pool jobs of the GPT example at different sizes, each with a calibration in its spec (no
profiling), in deterministic mode (``--deterministic``: bit-identical weights at any P×D and
across morphs, docs/determinism.md):

1. ``big`` and ``short`` are submitted together; a round places them at once;
2. ``late`` is submitted once both train: a round runs at once and places it (its
   ``reallocated`` event says the round ran because it arrived);
3. ``short`` (the least work, weight 4: an urgent job) finishes first: a round runs at once and
   gives its VMs to the others (their events: the round ran because short finished);
4. a VM of a generation that is training is preempted (``kill -9`` of its agent's process group):
   the manager sees it gone, the job's provider brings a VM of the placed type in its place, the
   job morphs and resumes from its last checkpoint;
5. every job reaches its target step in state ``finished`` with exactly the loss of its
   undisturbed single-process run (every logged step's loss, bit for bit), ``events`` tells each
   part of the story, and no agent or worker is left behind.

The test waits on conditions only; which configurations the policy picks is the policy's
business (tests/test_pool_allocation.py), so it is not asserted here beyond what the story needs.
~1 minute on 2 idle cores, ~1.5–2 minutes beside ``stress-ng --cpu 2``.

Run with ``-s`` to see ``varuna-manager events`` (the pool's ``reallocated`` events and the
morphs) at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from manager.domain.jobspec import load_jobspec
from manager.transport.convert import spec_to_pb
from varuna.core.calibration import Calibration

sys.path.insert(0, str(Path(__file__).parent))
from test_manager_local import ManagerProcess, processes_mentioning, status, wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "gpt2" / "train.py"
CHECKPOINT_EVERY = 3
ENDED = ("finished", "failed", "cancelled")

pytestmark = pytest.mark.slow

POOL = {
    "policy": "las",
    # Rounds short enough that a periodic one may happen during the test, long enough that a
    # morph measured slow on a loaded machine (30 s) still pays for a move to freed VMs; arrivals
    # and departures run one at once regardless.
    "round_s": 90,
    "default_morph_s": 15,
    "types": [
        {"name": "fast", "price_per_hour": 0.74, "capacity": 2, "speed": 1.0},
        {"name": "slow", "price_per_hour": 0.27, "capacity": 2, "speed": 0.5},
    ],
}

# name: (n_layer, n_embd, global batch, steps, forward s per example and segment, weight).
# short has the least work and weight 4 (an urgent job: four times the normalised throughput
# under las), so it runs through the late arrival and finishes first.
JOBS = {
    "big": (4, 48, 24, 150, 0.004, 1),
    "short": (2, 32, 12, 200, 0.002, 4),
    "late": (3, 32, 16, 100, 0.003, 1),
}


def _model_args(name: str) -> list[str]:
    n_layer, n_embd, batch, steps, _, _ = JOBS[name]
    return [
        "--steps", str(steps), "--n-layer", str(n_layer), "--n-embd", str(n_embd), "--n-head", "2",
        "--block-size", "32", "--global-batch-size", str(batch), "--micro-batch-size", "2",
        "--eval-every", "0", "--seed", "0", "--deterministic",
    ]  # fmt: skip


def _start_reference(name: str, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """The undisturbed run of a job: one process (P = D = 1), same script, arguments and data."""
    metrics = tmp_path / f"reference-{name}.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("VARUNA_CHECKPOINT_DIR", "VARUNA_RESUME", "VARUNA_MANAGER"):
        env.pop(key, None)
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN), *_model_args(name), "--metrics-out", str(metrics)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    return proc, metrics


def _losses(path: Path) -> dict[int, float]:
    """step → loss of the last line for each step (a redone step's latest value)."""
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def _spec(name: str, tmp_path: Path) -> Path:
    n_layer, _, batch, steps, fwd_s, weight = JOBS[name]
    cal = Calibration.synthetic(fwd_s, num_segments=n_layer + 1, micro_batch_sizes=(2,), param_bytes=1 << 20)
    cal.save(tmp_path / f"calibration-{name}.json")
    spec = {
        "name": name,
        "script": str(TRAIN),
        "args": [*_model_args(name), "--metrics-out", str(tmp_path / f"metrics-{name}.jsonl")],
        "global_batch_size": batch,
        "micro_batch_size": 2,
        "checkpoint_dir": str(tmp_path / f"ckpt-{name}"),
        "checkpoint_every": CHECKPOINT_EVERY,
        "min_vms": 1,
        "max_vms": 2,
        "procs_per_vm": 1,
        "target_steps": steps,
        "calibration": str(tmp_path / f"calibration-{name}.json"),
        "pool": True,
        "weight": weight,
        "env": {"OMP_NUM_THREADS": "1"},
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    return path


def _submit(mp: ManagerProcess, path: Path) -> str:
    spec = load_jobspec(path)
    with mp.client() as c:
        return c.submit(spec_to_pb(spec, Path(spec.calibration).read_text()))


def _all_events(mp: ManagerProcess) -> list:
    with mp.client() as c:
        return c.events("")


def _running_vm(mp: ManagerProcess, job_ids: list[str]):
    """(job, VM): a VM in the generation of the job of ``job_ids`` with the most steps to go,
    once that generation has trained a few steps (not at a morph's edge) and has more to do;
    else None."""
    sts = [status(mp, j) for j in job_ids]
    assert not all(st.state in ENDED for st in sts), "every job ended before the preemption"
    for st in sorted(sts, key=lambda st: st.step - st.target_steps):
        if st.state in ENDED:
            continue
        steps = [p.step for p in st.throughput if p.generation == st.generation]
        training = st.generation_state == "running" and len(steps) >= 2 and st.step <= st.target_steps - 10
        vm = next((v for v in st.vms if v.in_generation and v.agent_pid > 1), None)
        if training and vm is not None:
            return st.job_id, vm
    return None


def _data(event) -> dict:
    return json.loads(event.data_json or "{}")


def test_three_gpt_jobs_share_a_pool_of_two_types(tmp_path):
    refs = {name: _start_reference(name, tmp_path) for name in JOBS}
    specs = {name: _spec(name, tmp_path) for name in JOBS}
    (tmp_path / "pool.json").write_text(json.dumps(POOL))
    mp = ManagerProcess(
        tmp_path,
        "--pool", str(tmp_path / "pool.json"),
        "--heartbeat-interval", "0.25",
        "--heartbeat-timeout", "4",
        # Two types and a loaded machine: the fail-stutter rule must not take a slow type (or a
        # starved process) for a failing VM; only the pool decides where jobs run here.
        "--slow-threshold-pct", "2000",
        "--stop-timeout", "60",
        "--orphan-timeout", "60",
        "--gather-timeout", "60",
    )  # fmt: skip
    for name, (proc, _) in refs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, err.decode()[-2000:])
    reference = {name: _losses(path) for name, (_, path) in refs.items()}
    mp.start()
    jobs: dict[str, str] = {}
    try:
        # 1. Two jobs arrive together.
        jobs["big"] = _submit(mp, specs["big"])
        jobs["short"] = _submit(mp, specs["short"])
        for name in ("big", "short"):
            wait_for(lambda n=name: status(mp, jobs[n]).step >= 1, 240, f"{name} to train")

        # 2. The late job arrives while both train (short is far from its end after one step).
        assert status(mp, jobs["short"]).state == "running"
        jobs["late"] = _submit(mp, specs["late"])

        # 3. short, urgent and with the least work, finishes early; a round gives away its VMs.
        wait_for(lambda: status(mp, jobs["short"]).state in ENDED, 300, "short to end")

        # 4. Preemption: a VM of a generation that is training vanishes (kill -9 of its process
        #    group, workers included), in the job with the most steps to go.
        victim_job, victim = wait_for(
            lambda: _running_vm(mp, [jobs["big"], jobs["late"]]), 240, "a generation training"
        )
        os.killpg(victim.agent_pid, signal.SIGKILL)
        wait_for(
            lambda: any(e.kind == "vm-gone" and e.vm_id == victim.vm_id for e in _all_events(mp)),
            120,
            "the preempted VM to be seen gone",
        )

        # 5. Everyone finishes.
        for name in ("short", "big", "late"):
            wait_for(
                lambda n=name: status(mp, jobs[n]).state in ENDED,
                420,
                f"{name} to finish",
            )
        evs = _all_events(mp)
        by_id = {j: n for n, j in jobs.items()}
        print()
        for e in evs:
            if e.kind in (
                "reallocated",
                "vm-gone",
                "launched",
                "resumed",
                "finished",
                "vm-released",
                "stopping",
                "pool-error",
                "failed",
            ):
                print(
                    f"EVENT {e.id:4d} {by_id.get(e.job_id, e.job_id):5s} {e.kind:12s} {e.vm_id:14s} "
                    f"{e.message[:150]}"
                )

        for name, job in jobs.items():
            st = status(mp, job)
            assert (st.state, st.step) == ("finished", JOBS[name][3]), (name, st.state, st.step, st.message)
            got = _losses(tmp_path / f"metrics-{name}.jsonl")
            assert max(got) == JOBS[name][3], (name, sorted(got))
            # Deterministic mode: every logged step's loss, the final one included, equals the
            # undisturbed run's exactly, whatever VMs, P×D and morphs the pool gave the job.
            assert got[max(got)] == reference[name][max(got)], (
                name,
                got[max(got)],
                reference[name][max(got)],
            )
            assert all(got[s] == reference[name][s] for s in got), name
            print(f"{name}: final loss {got[max(got)]!r} == undisturbed {reference[name][max(got)]!r}")

        def of(name: str, kind: str) -> list:
            return [e for e in evs if e.job_id == jobs[name] and e.kind == kind]

        def trigger(e) -> str:
            return _data(e).get("trigger", "")

        realloc = [e for e in evs if e.kind == "reallocated"]
        assert all(_data(e)["reason"] and trigger(e) for e in realloc)
        # The late arrival: a round ran at once for it and placed it (it never waited for a
        # periodic one; whoever made room for it was moved by the same round).
        late_first = of("late", "reallocated")[0]
        assert _data(late_first)["reason"].startswith("started on "), late_first.message
        assert f"{jobs['late']} arrived" in trigger(late_first), late_first.message
        # Preemption: the VM is gone, its job relaunched afterwards on VMs of its placed type
        # (a replacement from its provider), resuming from a checkpoint.
        gone = next(e for e in evs if e.kind == "vm-gone" and e.vm_id == victim.vm_id)
        victim_name = by_id[victim_job]
        after = [e for e in of(victim_name, "resumed") if e.id > gone.id]
        assert after, f"{victim_name} never resumed after {victim.vm_id} was lost"
        assert _data(after[0])["redone_steps"] <= 2 * CHECKPOINT_EVERY - 1, after[0].message
        requested = [e for e in of(victim_name, "vm-requested") if e.id > gone.id]
        assert requested and "of pool type" in requested[0].message, requested
        # The early finish: short ended first, and the round it triggered at once gave its VMs to
        # a job still running.
        short_end = of("short", "finished")[0]
        assert all(of(n, "finished")[0].id > short_end.id for n in ("big", "late"))
        freed = [e for e in realloc if trigger(e) == f"{jobs['short']} finished"]
        assert freed and all(e.id > short_end.id and e.job_id in (jobs["big"], jobs["late"]) for e in freed)
        assert any(e.id < of(by_id[e.job_id], "finished")[0].id for e in freed)

        assert mp.cli("events", "--kind", "reallocated", "--kind", "vm-gone", "--kind", "finished") == 0
        # No orphans: every job's agents and workers are gone by themselves.
        wait_for(
            lambda: (
                not any(processes_mentioning(j) for j in jobs.values())
                and not processes_mentioning(str(tmp_path / "metrics-"))
            ),
            60,
            "every agent and worker to exit",
        )
    finally:
        mp.stop()
        mp.kill_vms()
        for proc, _ in refs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
