"""End to end on a Kubernetes API without a cloud (slow): a real ``varuna-manager serve`` with
the kubernetes provider and the official client, talking to kmock's emulated API server on
loopback; the test's kubelet (tests/k8s_cluster.py) runs each pod's command — the manager's agent
— as a local process group, so the whole manager path runs. No real cluster is reached.

The GPT example (deterministic mode, P = 2, checkpoint every 2 steps) on 4 pods, one per node:

1. **a preemption notice**: one node gets GKE's ``cloud.google.com/impending-node-termination``
   taint; the manager's node watch deletes its pod with the grace period; the kubelet runs the
   pod's preStop hook, which gives the agent the notice; the agent stops its workers (checkpoint)
   and approves; the generation stops gracefully and resumes without the pod: 0 steps redone;
2. **a pod lost without notice**: another node is deleted (the VM vanished: the kubelet SIGKILLs
   the pod's processes, the pod GC deletes the pod); the manager morphs, redoing at most
   2·checkpoint_every − 1 steps from the newest checkpoint;
3. **capacity coming back**: two new nodes; the replacement pods the manager asked for (pending
   until then) start, register, and the job grows back onto them;
4. the job finishes with final weights bit-identical to an undisturbed single-process run
   (scripts/chaos.py's byte comparison of every tensor of the last checkpoint), every pod and
   Secret the manager created is deleted, and no process is left.

The workers are paused (SIGSTOP) while the new nodes come up, so the short steps cannot end
before the grow morph; the manager's STOP order continues them (SIGCONT). 200 steps, not 40: on
a loaded machine (stress-ng beside the suite) the job ran 7-8 steps/s while the test took up to
5 s to act on a morph, and finished before the loss (with 40 and with 80 steps); phases 1-2
cannot pause the workers (the notice's graceful stop needs them running). With 200, a stressed
run used 76 steps for the three phases. Every wait is on an observable state, with a timeout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("kmock")
pytest.importorskip("kubernetes")

sys.path.insert(0, str(Path(__file__).parent))
from k8s_cluster import Cluster  # noqa: E402
from test_manager_local import ManagerProcess, events, processes_mentioning, status, wait_for  # noqa: E402

from manager.domain.jobspec import load_jobspec  # noqa: E402
from manager.providers.kubernetes import pod_name  # noqa: E402
from manager.transport.convert import spec_to_pb  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "gpt2" / "train.py"
STEPS = 200
EVERY = 2
MODEL_ARGS = [
    "--n-layer",
    "3",
    "--n-embd",
    "32",
    "--n-head",
    "2",
    "--block-size",
    "32",
    "--global-batch-size",
    "24",
    "--micro-batch-size",
    "2",
    "--eval-every",
    "0",
    "--seed",
    "0",
    "--deterministic",
]
TAINT = "cloud.google.com/impending-node-termination"


def _chaos():
    spec = importlib.util.spec_from_file_location("varuna_chaos_script", ROOT / "scripts" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def reference_state(tmp_path: Path, chaos) -> dict:
    """The final checkpoint of the undisturbed run: one process, same arguments."""
    ckpt = tmp_path / "reference-ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("VARUNA_CHECKPOINT_DIR", "VARUNA_RESUME", "VARUNA_MANAGER", "VARUNA_LIVE_STORE",
                "VARUNA_LIVE_STORE_KEY"):
        env.pop(key, None)
    cmd = [
        sys.executable,
        str(TRAIN),
        "--steps",
        str(STEPS),
        *MODEL_ARGS,
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        str(EVERY),
    ]
    subprocess.run(cmd, check=True, env=env, timeout=600, capture_output=True)
    return chaos.final_state(ckpt / chaos.step_dir_name(STEPS))


def _resumed(mp: ManagerProcess, job: str) -> list[dict]:
    return [json.loads(e.data_json) for e in events(mp, job) if e.kind == "resumed"]


def _in_generation(mp: ManagerProcess, job: str) -> list:
    return [v for v in status(mp, job).vms if v.in_generation]


def test_gpt_on_kubernetes_pods_notice_loss_growth_and_cleanup(tmp_path):
    chaos = _chaos()
    cluster = Cluster(tmp_path / "cluster")
    for i in range(1, 5):
        cluster.add_node(f"n{i}", {"pool": "spot"})
    spec = {
        "name": "gpt-k8s",
        "script": str(TRAIN),
        "args": ["--steps", str(STEPS), *MODEL_ARGS],
        "global_batch_size": 24,
        "micro_batch_size": 2,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "checkpoint_every": EVERY,
        "min_vms": 1,
        "max_vms": 4,
        "procs_per_vm": 1,
        "target_steps": STEPS,
        "pipeline_depth": 2,
        "env": {"OMP_NUM_THREADS": "1"},
        "provider": "kubernetes",
        "provider_options": {
            "image": "varuna:test",
            "namespace": cluster.namespace,
            "kubeconfig": str(cluster.kubeconfig),
            "python": sys.executable,
            "node_selector": {"pool": "spot"},
            "grace_period_s": 60,
            "api_timeout_s": 2,
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
        "60",
        "--stop-timeout",
        "60",
        "--orphan-timeout",
        "60",
        "--slow-threshold-pct",
        "2000",
    )
    reference = reference_state(tmp_path, chaos)
    mp.start()
    job = None
    paused: list[int] = []
    try:
        with mp.client() as c:
            job = c.submit(spec_to_pb(load_jobspec(tmp_path / "job.json")))
        wait_for(lambda: status(mp, job).step >= 4, 300, "step 4 on four pods")
        st = status(mp, job)
        assert (st.pipeline_depth, st.data_parallel) == (2, 2) and len(_in_generation(mp, job)) == 4

        # 1. Preemption notice: the node is tainted, the pod deleted with grace, the agent told.
        noticed = _in_generation(mp, job)[-1].vm_id
        node = cluster.kubelet.node_of(pod_name(noticed))
        assert node, f"{noticed} runs on no node"
        cluster.taint(node, TAINT)
        first = wait_for(lambda: _resumed(mp, job), 300, "the morph after the notice")[0]
        assert first["reason"] == f"eviction notice on {noticed}", first
        assert first["redone_steps"] == 0, first
        assert any(f"pod {pod_name(noticed)}: terminating" in x for x in cluster.kubelet.log)
        assert any(f"pod {pod_name(noticed)}: terminated (0)" in x for x in cluster.kubelet.log), (
            "the agent exited 0 on the kubelet's SIGTERM after approving the notice"
        )
        wait_for(
            lambda: pod_name(noticed) not in [p["metadata"]["name"] for p in cluster.pods()],
            120,
            "the noticed pod to be deleted",
        )
        cluster.delete_node(node)  # the spot VM is gone; its replacement pod waits for capacity

        # 2. A pod lost without notice: its node vanishes.
        resumed_at = status(mp, job).step
        wait_for(lambda: status(mp, job).step >= resumed_at + 2, 300, "two steps after the first morph")
        lost = _in_generation(mp, job)[0].vm_id
        lost_node = cluster.kubelet.node_of(pod_name(lost))
        cluster.delete_node(lost_node)
        second = wait_for(lambda: _resumed(mp, job)[1:], 300, "the morph after the loss")[0]
        # the lost VM is named with its ranks (Note [Blame] in manager/domain/generations.py)
        assert second["reason"].startswith(f"{lost} (rank") and " gone" in second["reason"], second
        assert second["redone_steps"] <= 2 * EVERY - 1, second

        # 3. Capacity comes back: two nodes; the pending replacement pods start there.
        pending = [p["metadata"]["name"] for p in cluster.pods() if not p["spec"].get("nodeName")]
        assert len(pending) == 2, cluster.pods()
        paused = [w.pid for v in _in_generation(mp, job) for w in v.workers if w.running]
        for pid in paused:
            os.killpg(pid, signal.SIGSTOP)
        cluster.add_node("n5", {"pool": "spot"})
        cluster.add_node("n6", {"pool": "spot"})
        third = wait_for(lambda: _resumed(mp, job)[2:], 300, "the grow morph")[0]
        paused = []
        assert third["reason"].startswith("grow"), third
        assert (third["P"], third["D"]) == (2, 2) and third["redone_steps"] == 0, third
        started = set(cluster.kubelet.started)
        assert set(pending) <= started, (pending, started)

        # 4. The end: bit-identical weights, nothing left in the cluster or on this machine.
        wait_for(lambda: status(mp, job).state == "finished", 600, "the job to finish")
        assert status(mp, job).step == STEPS
        diff = chaos.bit_identical(
            chaos.final_state(tmp_path / "ckpt" / chaos.step_dir_name(STEPS)), reference
        )
        assert diff == "", f"final weights differ from the undisturbed run: {diff}"
        wait_for(
            lambda: not cluster.pods() and not cluster.secrets(), 120, "every pod and Secret to be deleted"
        )
        made = cluster.server.objects("pods")
        assert len(made) == 6 and all(deleted for _, _, deleted in made), made  # 4 + 2 replacements
        assert all(deleted for _, _, deleted in cluster.server.objects("secrets"))
        wait_for(lambda: not processes_mentioning(job), 60, "every agent and worker to exit")
        for r in _resumed(mp, job):
            print(f"\n{r['reason']}: {r['previous_P']}x{r['previous_D']} -> {r['P']}x{r['D']}, "
                  f"morph {r['morph_latency_s']:.1f} s, {r['redone_steps']} step(s) redone")
    except BaseException:
        print("\n".join(cluster.kubelet.log[-80:]))
        for log in sorted(tmp_path.glob("manager-*.log")):
            print(log.name, log.read_text(errors="replace")[-4000:])
        raise
    finally:
        for pid in paused:
            try:
                os.killpg(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        mp.stop()
        cluster.close()
        if job:
            for pid in processes_mentioning(job):
                os.kill(pid, signal.SIGKILL)
