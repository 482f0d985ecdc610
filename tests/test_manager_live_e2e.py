"""End to end, live morph under the manager: the GPT example (``live_morph = true``) on four
pretend VMs at 2×2; one VM's agent and worker are killed with SIGKILL; the manager records a
``live-morph`` event (no relaunch), the surviving workers keep their processes (same pids), and
the job finishes with losses bit-identical to an undisturbed single-process run in deterministic
mode (docs/determinism.md: the numerics do not depend on P×D).

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
from pathlib import Path

import pytest

from manager.jobspec import load_jobspec, spec_to_pb

sys.path.insert(0, str(Path(__file__).parent))
from test_manager_local import ManagerProcess, events, kinds, processes_mentioning, status, wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "gpt2" / "train.py"
STEPS = 30
KILL_AT = 4
MODEL_ARGS = ["--n-layer", "4", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
              "--global-batch-size", "8", "--micro-batch-size", "2", "--eval-every", "0", "--seed", "0",
              "--deterministic"]

pytestmark = pytest.mark.slow


def reference_losses(tmp_path: Path) -> dict[int, float]:
    metrics = tmp_path / "reference.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("VARUNA_CHECKPOINT_DIR", "VARUNA_RESUME", "VARUNA_MANAGER", "VARUNA_LIVE_STORE"):
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
        with mp.client() as c:
            job = c.submit(spec_to_pb(load_jobspec(tmp_path / "job.json")))
        wait_for(lambda: status(mp, job).step >= KILL_AT, 300, f"step {KILL_AT}")
        st = status(mp, job)
        assert (st.pipeline_depth, st.data_parallel) == (2, 2)
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
        if job is not None and mp.proc is not None and mp.proc.poll() is None:
            for e in events(mp, job):
                print("EVENT", e.kind, e.message[:300])
        for log in sorted(tmp_path.glob("**/gen*-rank*.log")):  # what the workers said
            lines = [x for x in log.read_text(errors="replace").splitlines() if x.startswith("varuna")]
            print(f"== {log.name}", *lines[-4:], sep="\n")
        raise
    finally:
        mp.stop()
        mp.kill_vms()
