"""Silent hosts under the manager (issue #30, the manager's side): the local provider's pretend VMs
run in network namespaces (``provider_options.netns``, Note [VMs in namespaces] in
manager/providers/local.py), the manager in the set's control namespace, the test talking to it
through a Unix-socket door (varuna/testing/forward.py). P=2 × D=2 GPT on four VMs, deterministic;
one VM's link goes down at step 3 (its packets vanish, nothing is reset, its processes live on).

The manager must name that VM (and its rank) within 5 s of the silence: in its ``vm-gone`` event,
in the ``killing`` event of a relaunch and in the cause the relaunch records (``resumed``), never
the healthy survivors (Note [Blame] in manager/domain/generations.py); recover by itself (a
relaunch on the three VMs left, or a live morph); end with the final weights and optimizer state
of an undisturbed run bit for bit; and leave no process in any namespace.

The manager runs with its DEFAULT heartbeat interval (2 s) and timeout T (15 s): the 5 s come from
its probe of a quiet VM's host (Note [Silence probes] in manager/domain/silence.py), not from a
short T.

Detection is judged on the manager's own measurement (the silence it saw, ``silent_s`` of the
``vm-gone`` event) against the 5 s claim, and on the event's wall-clock time against the fault's
with the margin for a loaded machine of scripts/chaos_hosts.py (``LOAD_MARGIN_S``); never on the
test's duration. Root only (network namespaces); the tests skip with one line elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from manager.domain.jobspec import load_jobspec
from manager.transport.client import ClientConfig, ManagerClient
from manager.transport.convert import spec_to_pb
from varuna.testing.netns import NetHosts, netns_unavailable

ROOT = Path(__file__).resolve().parents[1]
WHY_NOT = netns_unavailable()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(WHY_NOT is not None, reason=f"hosts in namespaces: {WHY_NOT}")]
PORT = 7878
VMS = 4
#: Note [Fencing under the manager]: with the defaults a cut-off agent fences at most a heartbeat
#: interval (2 s) + its failing heartbeat's timeout (2 s) + the probe's timeout (1 s) + the loop's
#: slack after its last answer.
FENCE_BOUND_S = 2.0 + 2.0 + 1.0 + 0.5


def _chaos_hosts():
    name = "varuna_chaos_hosts_script"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "chaos_hosts.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


class NetManager:
    """``varuna-manager serve`` in the control namespace of ``net``, reached through a door."""

    def __init__(self, net: NetHosts, tmp_path: Path, *extra: str) -> None:
        self.net, self.tmp_path = net, tmp_path
        self.token = tmp_path / "token"
        self.token.write_text(secrets.token_urlsafe(32))
        self.token.chmod(0o600)
        listen = f"{net.address(None)}:{PORT}"
        self.log = open(tmp_path / "manager.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            net.control([sys.executable, "-m", "manager.cli", "serve", "--db", str(tmp_path / "state.sqlite"),
                         "--listen", listen, "--token-file", str(self.token), *extra]),
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.door = net.door(tmp_path / "manager.sock", None, PORT)
        self.client = ManagerClient(ClientConfig(address=f"unix:{tmp_path / 'manager.sock'}",
                                                 token=self.token.read_text().strip(), timeout_s=30.0))
        wait_for(self._answers, 60, "the manager to answer", poll_s=0.25)

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the manager exited: {(self.tmp_path / 'manager.log').read_text()[-2000:]}")
        try:
            self.client.status()
            return True
        except Exception:
            return False

    def status(self, job: str):
        return self.client.status(job)[0]

    def events(self, job: str, kind: str | None = None):
        return [e for e in self.client.events(job) if kind is None or e.kind == kind]

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    chaos = _chaos_hosts()
    opts = chaos.Options(steps=12, checkpoint_every=2)
    return opts, chaos.reference(opts, tmp_path_factory.mktemp("reference") / "run")


def _spec(net: NetHosts, tmp_path: Path, opts, *, live: bool, **options) -> Path:
    chaos = _chaos_hosts()
    script, *args = chaos.train_args(opts)
    spec = {
        "name": "gpt-silent", "script": script, "args": args, "global_batch_size": 8, "micro_batch_size": 2,
        "checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": opts.checkpoint_every, "min_vms": 1,
        "max_vms": VMS, "procs_per_vm": 1, "target_steps": opts.steps, "pipeline_depth": 2,
        "live_morph": live, "env": {"OMP_NUM_THREADS": "1"},
        # Four namespaces, four VMs ever: the silent one is not replaced (its namespace stays dark).
        "provider_options": {"max_created": VMS, "standby": False,
                             "netns": [net.namespace(h) for h in range(VMS)], **options},
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(spec))
    return path


def _host_of(net: NetHosts, address: str) -> int:
    return next(h for h in range(net.num_hosts) if net.address(h) == address)


@pytest.mark.timeout(600)
# Rank 0 and another rank, live and not, in two runs (each ~100 s on CI's 2 cores): rank 0 with a
# restart is the case where the rendezvous store goes silent with its host; a live run's store is
# the manager's, so there the victim's rank matters less than the regrouping of the survivors.
@pytest.mark.parametrize(("live", "victim_rank"), [(False, 0), (True, 2)])
def test_a_silent_vm_is_named_within_5s_and_the_job_recovers(reference, tmp_path: Path, live: bool,
                                                              victim_rank: int):
    chaos = _chaos_hosts()
    opts, ref = reference
    with NetHosts.create(VMS, workdir=tmp_path, sshd=False) as net:
        mp = NetManager(net, tmp_path, "--stop-timeout", "30", "--orphan-timeout", "60",
                        "--create-retry", "1")
        try:
            job = mp.client.submit(spec_to_pb(load_jobspec(_spec(net, tmp_path, opts, live=live))))
            wait_for(lambda: mp.status(job).step >= 3 or mp.status(job).state in ("failed", "finished"), 300,
                     "step 3")
            st = mp.status(job)
            assert (st.pipeline_depth, st.data_parallel) == (2, 2), st
            victim = next(v for v in st.vms if any(w.rank == victim_rank for w in v.workers))
            survivors = [v.vm_id for v in st.vms if v.in_generation and v.vm_id != victim.vm_id]
            host = _host_of(net, victim.address)
            fault_at = net.blackhole(host)
            gone = wait_for(lambda: [e for e in mp.events(job, "vm-gone") if e.vm_id == victim.vm_id], 60,
                            "the manager to declare the silent VM gone")[0]
            data = json.loads(gone.data_json)
            assert data["silent_s"] <= chaos.DETECTION_BOUND_S, gone.message
            assert gone.time - fault_at <= chaos.DETECTION_BOUND_S + chaos.LOAD_MARGIN_S, gone.message
            assert data["ranks"] == [victim_rank], gone.message
            assert "its host does not answer" in gone.message, gone.message  # the probe, not T
            wait_for(lambda: mp.status(job).state in ("finished", "failed"), 400, "the job to end")
            st = mp.status(job)
            evs = mp.events(job)
            assert st.state == "finished", (st.message, [(e.kind, e.message) for e in evs])
            # The silent VM with its rank is the cause of a relaunch (its killing event and the
            # cause the relaunch records); a healthy survivor, whose workers exited 75 because of
            # it, never is (Note [Blame]).
            named = f"{victim.vm_id} (rank {victim_rank}) gone (no heartbeat for"
            kinds = [e.kind for e in evs]
            relaunch = [e.message for e in evs if e.kind in ("killing", "resumed")]
            for reason in relaunch:
                assert named in reason, reason
                assert not [v for v in survivors if v in reason], reason
            if live and "live-morph-fallback" not in kinds:
                [lm] = [json.loads(e.data_json) for e in evs if e.kind == "live-morph"]
                assert lm["lost_ranks"] == [victim_rank] and not relaunch, (lm, relaunch)
            else:  # restart, or the live path's fallback (mixed committed steps: docs/live_morph.md)
                assert "resumed" in kinds and "killing" in kinds, kinds
            assert chaos.bit_identical(chaos.final_state(tmp_path / "ckpt", opts.steps), ref) == ""
            net.heal(host)
            # Every agent and worker gone from every host (the silent VM's agent was deleted).
            wait_for(lambda: not any(net.pids(h) for h in range(VMS)), 60, "the namespaces to empty")
            print(f"\n{'live' if live else 'restart'} victim rank {victim_rank}: named"
                  f" {gone.time - fault_at:.2f} s after the fault (silent {data['silent_s']:.2f} s);"
                  f" path {kinds}")
        except BaseException:
            print((tmp_path / "manager.log").read_text(errors="replace")[-3000:])
            with __import__("contextlib").suppress(Exception):
                for e in mp.events(job):
                    print(f"{e.time:.2f} {e.kind} {e.vm_id} {e.message}")
            raise
        finally:
            mp.stop()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.timeout(600)
def test_a_cut_off_vm_fences_its_workers_when_its_delete_does_not_reach_it(reference, tmp_path: Path):
    """Note [Fencing under the manager]: the provider's delete of the silent VM does not take effect
    (``keep_deleted``), so only the agent's own rule can stop its workers. With the manager's
    default settings its agent probes the manager's host after S without an answer; the host does
    not answer (the link is down), so it fences at once: within :data:`FENCE_BOUND_S` of the
    silence (plus the load margin), far before the old bound T + 2 s = 17 s. The relaunch without
    them still ends bit-identical; once the link heals the agent hears that its VM is not wanted
    and exits."""
    chaos = _chaos_hosts()
    opts, ref = reference
    with NetHosts.create(VMS, workdir=tmp_path, sshd=False) as net:
        mp = NetManager(net, tmp_path, "--stop-timeout", "30", "--orphan-timeout", "120",
                        "--create-retry", "1")
        try:
            spec = _spec(net, tmp_path, opts, live=False, keep_deleted=True)
            job = mp.client.submit(spec_to_pb(load_jobspec(spec)))
            wait_for(lambda: mp.status(job).step >= 3 or mp.status(job).state in ("failed", "finished"), 300,
                     "step 3")
            st = mp.status(job)
            victim = next(v for v in st.vms if any(w.rank == 1 for w in v.workers))
            pids = [w.pid for w in victim.workers if w.pid]
            assert pids and all(map(_alive, pids))
            fault_at = net.blackhole(_host_of(net, victim.address))
            gone_at = wait_for(lambda: not any(map(_alive, pids)) and time.time(), 60,
                               "the workers to be fenced")
            assert gone_at - fault_at <= FENCE_BOUND_S + chaos.LOAD_MARGIN_S, gone_at - fault_at
            assert _alive(victim.agent_pid), "the agent itself lives on (its delete did not take effect)"
            log = next(tmp_path.glob(f"**/{victim.vm_id}/agent.log")).read_text()
            assert "does not answer (TCP probe" in log, log[-2000:]
            assert "this VM is cut off; fencing: killing its workers" in log, log[-2000:]
            wait_for(lambda: mp.status(job).state in ("finished", "failed"), 400, "the job to end")
            assert mp.status(job).state == "finished", mp.status(job).message
            assert chaos.bit_identical(chaos.final_state(tmp_path / "ckpt", opts.steps), ref) == ""
            net.heal(_host_of(net, victim.address))
            wait_for(lambda: not any(net.pids(h) for h in range(VMS)), 60, "the namespaces to empty")
            print(f"\nfenced {gone_at - fault_at:.2f} s after the fault (default settings)")
        except BaseException:
            print((tmp_path / "manager.log").read_text(errors="replace")[-3000:])
            raise
        finally:
            mp.stop()
