"""End to end on a fake AWS: ``varuna-manager serve`` with the aws provider trains the GPT example
on EC2 spot instances that moto plays (tests/fake_ec2.py: moto's server behind a spot-capacity
proxy; each instance's user data run as a local process group with its own fake IMDS).

The manager reaches "EC2" and "SSM" through boto3 and ``AWS_ENDPOINT_URL`` like any AWS endpoint,
the instances fetch the token from SSM with their role's key and start the agent, the agents read
``spot/instance-action`` from IMDSv2, in deterministic mode (docs/determinism.md):

1. the job starts on 4 instances;
2. spot capacity shrinks to 3 and one instance gets the two-minute notice: its agent stops the
   workers (checkpoint) and the job goes on on 3 with **no completed step lost** (0 redone); the
   replacement the manager asks for is refused (``InsufficientInstanceCapacity``); the platform
   then terminates the instance;
3. capacity shrinks to 2 and an instance is terminated **without notice**: the manager morphs onto
   the 2 left, from the last checkpoint;
4. capacity comes back to 4: the manager's next requests get 2 instances, and the job grows onto
   4 VMs (the workers are paused meanwhile, so the job cannot finish before the instances boot on
   a machine that trains fast; the grow's stop order continues them);
5. the job finishes: every logged loss and the **final weights are bit-identical** to an
   undisturbed single-process run's, every instance the manager launched is terminated, the
   token parameter is deleted, no agent or worker is left, and every call the manager and the
   instances made is one the IAM policies of docs/manager.md allow.

No AWS account is involved. 40-90 s on the shared 2-core machine. Run with ``-s`` to see the events.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")
pytest.importorskip("flask_cors")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
from fake_ec2 import INSTANCE_KEY, MANAGER_KEY, FakeAWS, InstanceRunner, base_env  # noqa: E402
from fake_metadata import FakeIMDS  # noqa: E402
from test_manager_aws import covered  # noqa: E402
from test_manager_local import ManagerProcess, events, processes_mentioning, status, wait_for  # noqa: E402

from manager.domain.jobspec import load_jobspec  # noqa: E402
from manager.providers.aws import INSTANCE_IAM_POLICY, MANAGER_IAM_POLICY  # noqa: E402
from manager.transport.convert import spec_to_pb  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "gpt2" / "train.py"
STEPS = 150
CHECKPOINT_EVERY = 5
ARGS = [
    "--steps", str(STEPS), "--n-layer", "4", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
    "--global-batch-size", "24", "--micro-batch-size", "2", "--eval-every", "0", "--seed", "0",
    "--deterministic",
]  # fmt: skip

pytestmark = pytest.mark.slow


def _of(mp: ManagerProcess, job: str, kind: str, after: int = 0) -> list:
    return [e for e in events(mp, job) if e.kind == kind and e.id > after]


def _data(event) -> dict:
    return json.loads(event.data_json or "{}")


def _losses(path: Path) -> dict[int, float]:
    """step → loss of the last line for each step (a redone step's latest value)."""
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def final_weights(checkpoint_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """Every parameter of the complete checkpoint of ``step`` (docs/checkpoints.md: the manifest
    lists the files, each a dict of tensors), loaded without unpickling objects."""
    step_dir = checkpoint_dir / f"step_{step:08d}"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    params: dict[str, torch.Tensor] = {}
    for f in manifest["files"]:
        shard = torch.load(step_dir / f["name"], map_location="cpu", weights_only=True)
        for name, tensor in shard["params"].items():
            assert name not in params, f"{name} in two files"
            params[name] = tensor
    assert set(params) == set(manifest["parameters"])
    return params


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:  # each worker is its own process group (its agent starts it in a new session)
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


def training_on(mp: ManagerProcess, job: str, n: int, past: int) -> bool:
    """The job trains on ``n`` VMs, at a step past ``past``."""
    st = status(mp, job)
    return st.generation_state == "running" and st.step > past and sum(v.in_generation for v in st.vms) == n


def test_gpt_on_fake_ec2_spot_survives_a_notice_a_loss_and_grows_back(tmp_path, monkeypatch):
    fake = FakeAWS()
    imds = FakeIMDS(lookup=fake.launch_index)
    runner = InstanceRunner(fake, imds, tmp_path / "instances", base_env(fake, ROOT))
    for key, value in fake.env(MANAGER_KEY).items():  # the manager daemon inherits them
        monkeypatch.setenv(key, value)
    net = fake.network()
    ec2 = fake.client("ec2")

    def instance_of(vm_id: str) -> str:
        for iid, inst in fake.instances().items():
            if {"Key": "varuna-vm", "Value": vm_id} in inst.get("Tags", []):
                return iid
        raise AssertionError(f"no instance is named {vm_id}")

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("VARUNA_CHECKPOINT_DIR", "VARUNA_RESUME", "VARUNA_MANAGER"):
        env.pop(key, None)
    ref_metrics, ref_ckpt = tmp_path / "reference.jsonl", tmp_path / "reference-ckpt"
    reference_run = subprocess.Popen(
        [sys.executable, str(TRAIN), *ARGS, "--metrics-out", str(ref_metrics),
         "--checkpoint-dir", str(ref_ckpt), "--checkpoint-every", str(STEPS)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    spec = {
        "name": "gpt-aws", "script": str(TRAIN), "args": [*ARGS, "--metrics-out", str(metrics)],
        "global_batch_size": 24, "micro_batch_size": 2, "checkpoint_dir": str(ckpt),
        "checkpoint_every": CHECKPOINT_EVERY, "min_vms": 1, "max_vms": 4, "procs_per_vm": 1,
        "target_steps": STEPS, "env": {"OMP_NUM_THREADS": "1"},
        "provider": "aws",
        "provider_options": {**net, "instance_type": "c5.large", "setup_command": "true",
                             "python": sys.executable, "list_interval_s": 1},
    }  # fmt: skip
    (tmp_path / "job.json").write_text(json.dumps(spec))
    mp = ManagerProcess(
        tmp_path,
        "--heartbeat-interval", "0.25", "--heartbeat-timeout", "5", "--create-retry", "1",
        "--grow-cooldown", "1", "--stop-timeout", "60", "--orphan-timeout", "60", "--gather-timeout", "60",
        # Pretend VMs share this machine's cores: none should be called slow.
        "--slow-threshold-pct", "2000",
    )  # fmt: skip
    mp.start()
    job = ""
    fake.capacity = 4
    try:
        with mp.client() as c:
            job = c.submit(spec_to_pb(load_jobspec(tmp_path / "job.json")))

        # 1. Four instances, all in the first generation.
        wait_for(lambda: training_on(mp, job, 4, 3), 300, "training on 4 instances")

        # 2. Capacity shrinks; one instance gets the two-minute notice (AWS's documented document).
        st = status(mp, job)
        assert st.step < STEPS - 40, f"the job is at step {st.step} already"
        noticed = next(v for v in st.vms if v.in_generation).vm_id
        fake.capacity = 3
        imds.interrupt(instance_of(noticed))
        notice = wait_for(lambda: [e for e in _of(mp, job, "preempt-notice") if e.vm_id == noticed], 120,
                          "the agent to report the notice")[0]
        assert _data(notice)["event_type"] == "spot-terminate"
        resumed = wait_for(lambda: _of(mp, job, "resumed", notice.id), 300, "the morph after the notice")[0]
        assert _data(resumed)["redone_steps"] == 0, resumed.message  # no completed step lost
        wait_for(lambda: training_on(mp, job, 3, 0), 120, "training on the 3 instances left")
        wait_for(lambda: _of(mp, job, "capacity"), 120, "the replacement to be refused for capacity")
        ec2.terminate_instances(InstanceIds=[instance_of(noticed)])  # the platform takes it
        wait_for(lambda: [e for e in _of(mp, job, "vm-gone") if e.vm_id == noticed], 60,
                 "the noticed VM to be seen gone")

        # 3. Capacity shrinks again; an instance is terminated without notice.
        st = status(mp, job)
        assert st.step < STEPS - 20, f"the job is at step {st.step} already"
        fake.capacity = 2
        lost = next(v for v in st.vms if v.in_generation).vm_id
        ec2.terminate_instances(InstanceIds=[instance_of(lost)])
        gone = wait_for(lambda: [e for e in _of(mp, job, "vm-gone") if e.vm_id == lost], 60,
                        "the lost VM to be seen gone")[0]
        resumed = wait_for(lambda: _of(mp, job, "resumed", gone.id), 300, "the morph after the loss")[0]
        assert _data(resumed)["redone_steps"] <= 2 * CHECKPOINT_EVERY - 1, resumed.message
        wait_for(lambda: training_on(mp, job, 2, 0), 120, "training on the 2 instances left")

        # 4. Capacity comes back: two new instances, and the job grows onto them. The workers are
        #    paused (SIGSTOP) meanwhile, so that however fast this machine trains, the job is still
        #    running when the instances have booted; the grow's stop order continues them (their
        #    agents send SIGCONT with SIGUSR1).
        st = status(mp, job)
        assert st.step < STEPS - 10, f"the job is at step {st.step} already"
        mark = events(mp, job)[-1].id
        paused = [w.pid for v in st.vms if v.in_generation for w in v.workers if w.running and w.pid > 1]
        signal_all(paused, signal.SIGSTOP)
        try:
            fake.capacity = 4
            wait_for(lambda: len(_of(mp, job, "vm-registered", mark)) == 2, 120,
                     "two new instances to register")
            wait_for(lambda: _of(mp, job, "stopping", mark), 120, "the grow to stop the generation")
        finally:
            signal_all(paused, signal.SIGCONT)
        wait_for(lambda: training_on(mp, job, 4, 0), 300, "the job to grow onto 4 instances")
        grown = _of(mp, job, "launched", mark)
        assert grown and _data(grown[-1])["previous"]["vms"] == 2, [e.message for e in grown]

        # 5. The end.
        wait_for(lambda: status(mp, job).state in ("finished", "failed", "cancelled"), 600, "the job to end")
        st = status(mp, job)
        assert (st.state, st.step) == ("finished", STEPS), (st.state, st.step, st.message)
        _, err = reference_run.communicate(timeout=600)
        assert reference_run.returncode == 0, err.decode()[-2000:]
        reference, got = _losses(ref_metrics), _losses(metrics)
        # A graceful stop's last step is checkpointed but not logged by train.py (docs/manager.md,
        # Limits): only those steps may lack a line.
        stopped_at = {_data(e)["previous_last_step"] for e in _of(mp, job, "resumed")
                      if not _data(e)["redone_steps"]}
        missing = set(range(1, STEPS + 1)) - set(got)
        assert max(got) == STEPS and missing <= stopped_at, (sorted(missing), stopped_at)
        differ = [(s, got[s], reference[s]) for s in got if got[s] != reference[s]]
        assert not differ, differ[:3]
        mine, theirs = final_weights(ckpt, STEPS), final_weights(ref_ckpt, STEPS)
        assert mine.keys() == theirs.keys()
        unequal = [name for name in mine if not torch.equal(mine[name], theirs[name])]
        assert not unequal, f"final weights differ from the undisturbed run's: {unequal[:5]}"

        # Everything the manager made is gone: instances, the token parameter, processes.
        instances = fake.instances()
        assert len(instances) == 6, [i["State"]["Name"] for i in instances.values()]  # 4, then 2 more
        assert all({"Key": "varuna-job", "Value": job} in i["Tags"] for i in instances.values())
        wait_for(lambda: {i["State"]["Name"] for i in fake.instances().values()} == {"terminated"}, 60,
                 "every instance to be terminated")
        ssm = fake.client("ssm")
        wait_for(lambda: not ssm.get_parameters(Names=[f"/varuna/{job}/token"])["Parameters"], 60,
                 "the token parameter to be deleted with the last instance")
        assert not _of(mp, job, "provider-error"), [e.message for e in _of(mp, job, "provider-error")]
        wait_for(lambda: not processes_mentioning(job), 60, "every agent and worker to exit")
        assert covered(fake.actions(MANAGER_KEY), MANAGER_IAM_POLICY)
        assert covered(fake.actions(INSTANCE_KEY), INSTANCE_IAM_POLICY)
        assert runner.errors == [], runner.errors
        print()
        assert mp.cli("events", job) == 0
        print(f"final loss {got[STEPS]!r} == undisturbed {reference[STEPS]!r}; {len(mine)} parameters equal")
    except BaseException:  # AssertionError, pytest's Failed, KeyboardInterrupt: say what happened
        if job and mp.proc is not None and mp.proc.poll() is None:
            for e in events(mp, job):
                print("EVENT", e.kind, e.message[:300])
        for log in sorted((tmp_path / "instances").glob("*/boot.log")):
            print(f"== {log}", log.read_text(errors="replace")[-1500:], sep="\n")
        raise
    finally:
        mp.stop()
        runner.close()
        imds.close()
        fake.close()
        if reference_run.poll() is None:
            reference_run.kill()
            reference_run.wait(10)
