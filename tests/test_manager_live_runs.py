"""Live morph in the manager's control loop (manager/domain/live_runs.py), on simulated VMs and a fake
clock (tests/test_manager_controller.py's World): the store each live-morph generation gets, a
lost VM handled in place (no kill, no relaunch) at the simulator's P×D, the event with its
duration, and the fallbacks (a stage lost whole, a worker exiting 75) to kill + relaunch."""

from __future__ import annotations

import json
import signal
import socket
import sys
from datetime import timedelta
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_manager_controller import FakeProvider, World  # noqa: E402

from manager.domain.generations import BLAME_WINDOW_S  # noqa: E402
from manager.domain.jobspec import JobSpec  # noqa: E402
from manager.domain.messages import Action, PreemptNotice, RegisterVM, WorkerHeartbeat  # noqa: E402
from manager.domain.policy import choose_layout  # noqa: E402
from varuna.core.planning import PlanRequest  # noqa: E402
from varuna.launch.supervisor import PEER_LOST_EXIT_CODE  # noqa: E402

dist = pytest.importorskip("torch.distributed")
from varuna.runtime.live_morph import ROOT  # noqa: E402


def start(tmp_path, **spec):
    """A 2×2 live-morph job on four one-slot simulated VMs, five steps done."""
    w = World(tmp_path, provider=FakeProvider(capacity=4))
    job = w.submit(max_vms=4, pipeline_depth=2, live_morph=True, **spec)
    w.tick()
    w.tick(0.1)
    gen = w.gen(job)
    assert (gen.pipeline_depth, gen.data_parallel) == (2, 2)
    w.steps(job, 1, 5)
    return w, job


def client(env: dict[str, str]):
    """A client of the store a worker with launch environment ``env`` reaches (address, secret)."""
    from varuna.runtime.auth_store import AuthStore

    host, port = env["VARUNA_LIVE_STORE"].rsplit(":", 1)
    return AuthStore(host, int(port), key=env["VARUNA_LIVE_STORE_KEY"], timeout=timedelta(seconds=10))


def kill_vms(w: World, job: str, *indices: int):
    victims = [w.running(job)[i] for i in indices]
    for v in victims:
        v.alive = False  # kill -9: no heartbeat ever again
    return victims


def test_every_worker_gets_the_generations_store(tmp_path):
    w, job = start(tmp_path)
    envs = [vm.launches[r].env for vm in w.running(job) for r in vm.launches]
    addresses = {e["VARUNA_LIVE_STORE"] for e in envs}
    assert len(addresses) == 1 and w.mgr.ctx.live.open_count == 1
    [address] = addresses
    assert address.startswith("127.0.0.1:")  # the advertise host, nothing wider
    keys = {e["VARUNA_LIVE_STORE_KEY"] for e in envs}
    assert len(keys) == 1 and len(next(iter(keys))) == 64, "one fresh secret for the generation's workers"
    with pytest.raises(dist.DistNetworkError, match="refused this process's key"):
        client({**envs[0], "VARUNA_LIVE_STORE_KEY": "0" * 64})
    c = client(envs[0])  # the store serves there, to a client with the secret
    c.set("probe", "1")
    assert c.get("probe") == b"1"
    del c
    w.mgr.stop()
    assert w.mgr.ctx.live.open_count == 0
    host, port = address.rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):  # the server is gone with its port
        socket.create_connection((host, int(port)), timeout=10).close()


def test_a_job_without_live_morph_gets_no_store(tmp_path):
    w = World(tmp_path, provider=FakeProvider(capacity=2))
    job = w.submit(max_vms=2)
    w.tick()
    w.tick(0.1)
    envs = [vm.launches[r].env for vm in w.running(job) for r in vm.launches]
    assert envs and not any("VARUNA_LIVE_STORE" in e for e in envs)
    assert w.mgr.ctx.live.open_count == 0


def test_a_lost_vm_is_a_live_morph_in_place(tmp_path):
    w, job = start(tmp_path)
    address = w.running(job)[0].launches[0].env  # the store's address and secret
    [victim] = kill_vms(w, job, 3)
    w.until(lambda: victim.vm_id not in w.gen(job).vm_ids)
    detected = w.clock.now
    gen = w.gen(job)
    # The simulator's (here: the fallback rule's, P forced to 2) layout for three one-slot VMs.
    ref = choose_layout(slots=[1, 1, 1], num_segments=4, request=PlanRequest(
        calibration=None, global_batch_size=24, micro_batch_size=2, pipeline_depth=2))
    assert gen.generation == 1 and gen.state == "running", "no kill, no relaunch"
    assert (gen.pipeline_depth, gen.data_parallel) == (ref.pipeline_depth, ref.data_parallel)
    assert gen.vm_ids == [vm.vm_id for vm in w.running(job)] and len(gen.vm_ids) == 3
    c = client(address)
    assert c.check([f"{ROOT}dead/3"]) and not c.check([f"{ROOT}dead/2"])
    assert c.get(f"{ROOT}plan").decode() == f"{ref.pipeline_depth} {ref.data_parallel}"
    assert not {"killing", "stopping", "live-morph-fallback"} & set(w.kinds(job))
    assert w.event(job, "live-morph") == [], "recorded once the survivors step past the one in flight"
    w.clock.advance(1.5)
    w.steps(job, 5, 5)  # the step in flight, redone: not yet past it
    assert w.event(job, "live-morph") == []
    w.steps(job, 6, 6)
    [ev] = w.event(job, "live-morph")
    assert ev.data["lost_ranks"] == [3] and ev.data["old"] == [2, 2]
    assert (ev.data["pipeline_depth"], ev.data["data_parallel"]) == (ref.pipeline_depth, ref.data_parallel)
    assert ev.data["duration_s"] == pytest.approx(w.clock.now - detected, abs=1e-3)
    assert w.store.job(job).detection_time is None  # a later relaunch measures its own latency
    for _ in range(3):
        w.tick(0.5)
    assert w.store.job(job).generation == 1 and w.gen(job).state == "running"
    w.steps(job, 50, 50)
    for vm in w.running(job):  # the job ends: its store is closed
        vm.finish(0)
    w.until(lambda: w.store.job(job).state == "finished")
    assert w.mgr.ctx.live.open_count == 0


def test_a_stage_lost_whole_falls_back_to_the_restart_path(tmp_path):
    w, job = start(tmp_path)
    first = w.running(job)[0].launches[0].env["VARUNA_LIVE_STORE"]
    kill_vms(w, job, 1, 3)  # ranks 1 and 3: both replicas of stage 1
    w.until(lambda: w.store.job(job).generation == 2)
    [fb] = w.event(job, "live-morph-fallback")
    assert "stage 1 has no live replica" in fb.message and fb.data["lost_ranks"] == [1, 3]
    assert w.store.generation(job, 1).graceful == 0 and "killing" in w.kinds(job)
    assert w.event(job, "live-morph") == []
    second = w.running(job)[0].launches[0].env["VARUNA_LIVE_STORE"]
    assert second != first and w.mgr.ctx.live.open_count == 1, "a fresh store per generation"


def test_a_worker_exiting_75_falls_back(tmp_path):
    w, job = start(tmp_path)
    w.running(job)[2].finish(code=PEER_LOST_EXIT_CODE)
    w.tick(0.1)
    # A symptom (Note [Blame] in manager/domain/generations.py): its cause may yet show, for a while.
    assert w.event(job, "live-morph-fallback") == [] and w.store.generation(job, 1).state == "running"
    w.tick(BLAME_WINDOW_S)
    [fb] = w.event(job, "live-morph-fallback")
    assert f"exited with {PEER_LOST_EXIT_CODE}" in fb.data["reason"]
    assert w.store.generation(job, 1).state in ("killing", "ended")


def test_a_fallback_after_a_lost_vm_blames_that_vm_not_the_survivors(tmp_path):
    """A silent VM is dropped live; then the survivors find the run cannot go on (members
    committed different steps) and exit 75. The relaunch's cause is the lost VM with its rank
    (Note [Blame] in manager/domain/generations.py), not the survivors' exits."""
    w, job = start(tmp_path)
    [victim] = kill_vms(w, job, 2)
    rank = next(iter(victim.workers))
    w.until(lambda: w.event(job, "vm-gone"))
    survivors = [vm for vm in w.running(job) if vm is not victim]
    for vm in survivors:
        vm.finish(code=PEER_LOST_EXIT_CODE)
    w.tick(0.1)
    w.until(lambda: w.event(job, "killing"), dt=0.25, max_ticks=4)
    [killing] = w.event(job, "killing")
    assert f"failure on {victim.vm_id} (rank {rank}) gone" in killing.message, killing.message
    assert not [vm.vm_id for vm in survivors if vm.vm_id in killing.message], killing.message
    assert len(w.event(job, "live-morph-fallback")) == 1


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"pool": True}, "live_morph is not supported for pool jobs"),
        ({"live_morph": "yes"}, "'live_morph' must be true or false"),
        ({"schedule": "2bw"}, "live_morph does not carry the 2bw schedule"),
    ],
)
def test_live_morph_spec_errors(extra, needle):
    spec = dict(script="t.py", global_batch_size=8, checkpoint_dir="c", max_vms=2, target_steps=3,
                live_morph=True)
    spec.update(extra)
    with pytest.raises(ValueError) as err:
        JobSpec(**spec)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_closed_engine_is_not_kept_alive_by_its_heartbeat_reporter():
    """After a live morph the old engine (model, optimizer state) must be freed: the manager's
    reporter, pinned by atexit until the process ends, must not hold it."""
    import gc
    import weakref

    import torch
    from models import build_model

    import varuna
    from manager.transport.client import ClientConfig, ManagerClient
    from manager.worker.reporter import WorkerReporter
    from varuna.launch.procs import find_free_port

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    idx = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    batch = (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    engine = varuna.Engine(build_model("gpt"), varuna.VarunaConfig(global_batch_size=8, micro_batch_size=2),
                           example_batch=batch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    client = ManagerClient(ClientConfig(address=f"127.0.0.1:{find_free_port('127.0.0.1')}", token="x" * 32,
                                        timeout_s=1.0))  # nobody listens: heartbeats are dropped
    reporter = WorkerReporter(engine, client, job_id="j", vm_id="v", generation=1)
    engine.add_step_callback(reporter.on_step)
    engine.train_step(batch)
    ref = weakref.ref(engine)
    engine.close()
    for sig, handler in handlers.items():  # the engine's stop handlers go, as the next engine's replace them
        signal.signal(sig, handler)
    del engine
    gc.collect()
    try:
        assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]
    finally:
        reporter.close()


def test_live_morph_crosses_the_wire():
    from manager.transport.convert import spec_from_pb, spec_to_pb

    spec = JobSpec(script="t.py", global_batch_size=8, checkpoint_dir="c", max_vms=2, target_steps=3,
                   live_morph=True)
    assert spec_from_pb(spec_to_pb(spec)).live_morph is True
    assert spec_from_pb(spec_to_pb(JobSpec(**{**spec.to_dict(), "live_morph": False}))).live_morph is False


# -- notices and growth (live) ---------------------------------------------------------------------


NOTICE = dict(event_id="e1", event_type="Preempt", not_before="soon")


def report(w: World, job: str, step: int, layout: tuple[int, int]) -> None:
    """Every running worker of the generation reports ``step`` at ``layout`` (P, D): what the live
    workers say once they regrouped (SimVM.step would repeat the launch layout)."""
    gen = w.gen(job)
    for vm in w.running(job):
        for rank, state in vm.workers.items():
            if state["running"]:
                w.mgr.worker_heartbeat(WorkerHeartbeat(
                    job_id=job, vm_id=vm.vm_id, generation=gen.generation, rank=rank,
                    pipeline_depth=layout[0], data_parallel=layout[1], step=step, loss=1.0,
                    samples_per_s=10.0, fwd_s=0.01, bwd_s=0.02, num_microbatches=2, micro_batch_size=2))


def test_a_notice_hands_over_live_and_nothing_is_relaunched(tmp_path):
    w, job = start(tmp_path)
    address = w.running(job)[0].launches[0].env  # the store's address and secret
    assert w.running(job)[0].launches[0].env["VARUNA_LIVE_NOTICE_SIGNAL"] == "SIGUSR2"
    noticed = w.running(job)[3]
    noticed.notice = PreemptNotice(**NOTICE)
    w.tick(0.1)
    orders = {vm.vm_id: vm.beat() for vm in w.running(job)}
    assert [v for v, o in orders.items() if o.leave] == [noticed.vm_id], "only the noticed VM leaves"
    assert all(o.action == Action.RUN for o in orders.values()), "nobody is stopped"
    ref = choose_layout(slots=[1, 1, 1], num_segments=4, request=PlanRequest(
        calibration=None, global_batch_size=24, micro_batch_size=2, pipeline_depth=2))
    c = client(address)
    assert c.get(f"{ROOT}plan").decode() == f"{ref.pipeline_depth} {ref.data_parallel}", "before the leave"
    assert not c.check([f"{ROOT}dead/3"]), "a leaver is not dead before it handed over"
    gen = w.gen(job)
    assert (gen.pipeline_depth, gen.data_parallel) == (ref.pipeline_depth, ref.data_parallel)
    assert noticed.vm_id in gen.vm_ids and json.loads(gen.live_json)["leaving"] == [noticed.vm_id]
    report(w, job, 6, (2, 2))  # the leavers' last step, still at the old layout: not the end
    assert w.event(job, "live-morph") == []
    noticed.finish(0)  # handed over, exit 0
    w.tick(0.1)
    gen = w.gen(job)
    assert noticed.vm_id not in gen.vm_ids and gen.generation == 1 and gen.state == "running"
    assert c.check([f"{ROOT}dead/3"])
    [left] = w.event(job, "live-left")
    assert left.data["members"] == [3]
    report(w, job, 7, (ref.pipeline_depth, ref.data_parallel))
    [ev] = w.event(job, "live-morph")
    assert ev.data["reason_kind"] == "notice" and ev.data["lost_ranks"] == [3] and ev.data["duration_s"] > 0
    assert "handed their state over" in ev.message
    assert not {"stopping", "killing", "live-morph-fallback"} & set(w.kinds(job))
    assert w.store.job(job).generation == 1


def test_notices_reported_one_by_one_are_one_hand_over(tmp_path):
    """Both replicas of stage 1 get a notice; their agents report in turn: the leavers hand stage 1
    over to those that stay, and the event is one, for both."""
    w, job = start(tmp_path)
    first, second = w.running(job)[1], w.running(job)[3]
    first.notice = PreemptNotice(**NOTICE)
    w.tick(0.1)
    second.notice = PreemptNotice(**NOTICE)
    w.tick(0.1)
    assert json.loads(w.gen(job).live_json)["leaving"] == [first.vm_id, second.vm_id]
    first.finish(0)
    second.finish(0)
    w.tick(0.1)
    gen = w.gen(job)
    assert gen.vm_ids == [w.running(job)[0].vm_id, w.running(job)[1].vm_id] and len(gen.vm_ids) == 2
    report(w, job, 7, (gen.pipeline_depth, gen.data_parallel))
    [ev] = w.event(job, "live-morph")
    assert ev.data["lost_ranks"] == [1, 3] and ev.data["old"] == [2, 2] and ev.data["duration_s"] > 0
    assert not {"stopping", "killing", "live-morph-fallback"} & set(w.kinds(job))


def test_a_notice_on_every_vm_falls_back_to_the_graceful_stop(tmp_path):
    w, job = start(tmp_path)
    for vm in w.running(job):
        vm.notice = PreemptNotice(**NOTICE)
    w.tick(0.1)
    [fb] = w.event(job, "live-morph-fallback")
    assert "nobody stays to receive their state" in fb.message and fb.data["reason_kind"] == "notice"
    assert w.store.generation(job, 1).state in ("stopping", "ended") and "stopping" in w.kinds(job)


def grown(tmp_path):
    """A 1×2 live-morph job on two one-slot VMs (P forced to 1); two more come back and it grows."""
    provider = FakeProvider(capacity=2)
    w = World(tmp_path, provider=provider, gather_timeout_s=0.0, create_retry_s=1.0)
    job = w.submit(max_vms=4, min_vms=2, pipeline_depth=1, live_morph=True)
    w.tick()
    w.tick(0.1)
    assert (w.gen(job).pipeline_depth, w.gen(job).data_parallel) == (1, 2)
    w.steps(job, 1, 2)
    provider.capacity = 4  # spot capacity comes back
    w.tick(1.5)
    w.tick(0.1)
    w.until(lambda: len(w.gen(job).vm_ids) == 4)
    return w, job


def test_new_vms_join_the_running_generation_live(tmp_path):
    w, job = grown(tmp_path)
    gen = w.gen(job)
    ref = choose_layout(slots=[1, 1, 1, 1], num_segments=4, request=PlanRequest(
        calibration=None, global_batch_size=24, micro_batch_size=2, pipeline_depth=1))
    assert gen.generation == 1 and gen.state == "running", "no stop, no relaunch"
    assert (gen.pipeline_depth, gen.data_parallel) == (ref.pipeline_depth, ref.data_parallel)
    old, new = w.running(job)[:2], w.running(job)[2:]
    for vm in old:  # an agent starts a generation once: the old VMs keep their workers
        assert list(vm.launches) == [int(vm.launches[r].env["RANK"]) for r in vm.launches]
    joiners = {r: vm.launches[r].env for vm in new for r in vm.launches}
    assert sorted(joiners) == [2, 3], "fresh member ids"
    for r, env in joiners.items():
        assert env["RANK"] == str(r) and env["VARUNA_LIVE_JOIN"] == "1"
        assert env["VARUNA_LIVE_STORE"] == old[0].launches[0].env["VARUNA_LIVE_STORE"], "the gen's store"
    c = client(joiners[2])
    assert c.get(f"{ROOT}plan").decode() == f"{ref.pipeline_depth} {ref.data_parallel}"
    assert json.loads(gen.live_json)["next_id"] == 4
    report(w, job, 3, (1, 3))  # one joiner admitted first (the other still starting): not the plan yet
    assert w.event(job, "live-morph") == []
    report(w, job, 4, (ref.pipeline_depth, ref.data_parallel))
    [ev] = w.event(job, "live-morph")
    assert ev.data["reason_kind"] == "growth" and ev.data["joined_ranks"] == [2, 3] and "joined" in ev.message
    assert not {"stopping", "killing", "live-morph-fallback"} & set(w.kinds(job))
    assert w.store.job(job).generation == 1


def test_member_ids_follow_the_morphs_and_are_never_reused(tmp_path):
    """A VM lost after a growth: the manager declares dead the members that VM held (not the
    ranks a launch placement would give it)."""
    w, job = grown(tmp_path)
    address = w.running(job)[0].launches[0].env  # the store's address and secret
    report(w, job, 4, (w.gen(job).pipeline_depth, w.gen(job).data_parallel))
    [victim] = kill_vms(w, job, 2)  # the first joiner's VM: member 2
    w.until(lambda: victim.vm_id not in w.gen(job).vm_ids)
    c = client(address)
    assert c.check([f"{ROOT}dead/2"]) and not c.check([f"{ROOT}dead/3"])
    members = json.loads(w.gen(job).live_json)
    assert sorted(r for ids in members["members"].values() for r in ids) == [0, 1, 3]
    assert members["next_id"] == 4 and members["morphed"] is True
    assert w.store.job(job).generation == 1


def test_a_restarted_manager_ends_a_grown_live_generation_through_the_fallback(tmp_path):
    """kill -9 of the manager after a growth: the SQLite record holds the VMs, P×D and members of
    one write; the store died with the process, so the joiners get no workers and the generation
    ends through the restart path, relaunched on every VM from a fresh store."""
    from manager.domain.controller import Manager

    w, job = grown(tmp_path)
    config = w.mgr.ctx.config
    w.mgr.ctx.live.close_all()  # what the kill does to the stores (their threads die with the process)
    w.mgr = Manager(w.store, config, provider_factory=lambda *a: w.provider, clock=w.clock)
    for vm in w.vms.values():
        vm.mgr = w.mgr
    gen = w.gen(job)
    assert len(gen.vm_ids) == 4 and json.loads(gen.live_json)["joiners"]
    launches = w.mgr.launches.launches(w.store.job(job), gen)
    assert all(not launches[v] for v in json.loads(gen.live_json)["joiners"]), "nobody to join"
    for vm in w.running(job)[:2]:  # the old workers lose the store: they fail
        vm.finish(1)
    w.until(lambda: w.store.job(job).generation == 2)
    [fb] = w.event(job, "live-morph-fallback")
    assert "not a lost VM" in fb.data["reason"] or "store was lost" in fb.data["reason"]
    gen2 = w.gen(job)
    envs = [vm.launches[r].env for vm in w.running(job) for r in vm.launches]
    assert len(gen2.vm_ids) == 4 and not any("VARUNA_LIVE_JOIN" in e for e in envs)
    assert sorted(int(e["RANK"]) for e in envs) == list(range(4)), "a relaunch numbers from 0 again"
    assert w.mgr.ctx.live.open_count == 1


NOTICE_WORKER = """
import os, signal, sys, time
out = sys.argv[1]
def got(signum, frame):
    with open(out, "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
    os._exit(0)
signal.signal(signal.SIGUSR1, got)
signal.signal(signal.SIGUSR2, got)
open(out + ".ready", "w").close()
deadline = time.monotonic() + 60  # bounded: the agent's kill_all reaps it anyway
while time.monotonic() < deadline:
    signal.pause() if hasattr(signal, "pause") else time.sleep(0.1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("word", ["leave", "none"])
def test_the_agent_of_a_live_job_waits_for_the_leave_order(tmp_path, monkeypatch, word):
    """A real agent and worker process: on a notice a live-morph job's worker gets nothing until the
    manager's ``leave`` (then the notice signal, SIGUSR2), or SIGUSR1 once ``NOTICE_WAIT_S`` passed
    without a word; never both."""
    from test_manager_local import wait_for

    from manager.agent import vm_agent
    from manager.agent.notices import Notice
    from manager.transport import varuna_manager_pb2 as pb

    token = tmp_path / "token"
    token.write_text("x" * 32)
    token.chmod(0o600)
    script, out = tmp_path / "worker.py", tmp_path / "signals"
    script.write_text(NOTICE_WORKER)
    agent = vm_agent.VMAgent(vm_agent.AgentConfig(manager="127.0.0.1:1", token_file=str(token), vm_id="v",
                                                  log_dir=str(tmp_path)))
    try:
        launch = pb.WorkerLaunch(rank=3, argv=[str(script), str(out)],
                                 env={"VARUNA_LIVE_NOTICE_SIGNAL": "SIGUSR2", "VARUNA_LIVE_STORE": "h:1"})
        agent._apply(pb.Orders(action=pb.Orders.RUN, generation=1, workers=[launch]))
        assert agent._pool.notice_signal == signal.SIGUSR2
        wait_for(lambda: Path(f"{out}.ready").exists(), 60, "the worker's handlers")
        agent._notice = Notice(event_id="e", event_type="Preempt", not_before="")
        agent._act_on_notice()
        assert agent._pool.workers[0].stop_sent is None, "no signal before the manager's word"
        if word == "leave":
            agent._apply(pb.Orders(action=pb.Orders.RUN, generation=1, workers=[launch], leave=True))
        else:
            monkeypatch.setattr(vm_agent, "NOTICE_WAIT_S", 0.0)
            agent._act_on_notice()
        wait_for(lambda: out.exists() and out.read_text(), 60, "the worker's signal")
        agent._act_on_notice()
        agent._apply(pb.Orders(action=pb.Orders.RUN, generation=1, workers=[launch], leave=True))
        wait_for(lambda: agent._pool.poll() or not agent._pool.any_running, 60, "the worker's exit")
        assert out.read_text().split() == (["SIGUSR2"] if word == "leave" else ["SIGUSR1"])
        assert agent._pool.workers[0].exit_code == 0
    finally:
        agent._pool.kill_all()
        agent._client.close()


def test_growth_waits_for_the_leavers_of_a_notice(tmp_path):
    """Capacity comes back while a noticed VM still hands over: no restart, and the growth is
    planned only once the leaver left (its worker is not counted among those that stay)."""
    provider = FakeProvider(capacity=3)
    w = World(tmp_path, provider=provider, gather_timeout_s=0.0, create_retry_s=1.0)
    job = w.submit(max_vms=4, min_vms=2, pipeline_depth=1, live_morph=True)
    w.tick()
    w.tick(0.1)
    w.steps(job, 1, 2)
    noticed = w.running(job)[2]
    noticed.notice = PreemptNotice(**NOTICE)
    w.tick(0.1)
    assert json.loads(w.gen(job).live_json)["leaving"] == [noticed.vm_id]
    provider.capacity = 4  # one more VM comes back
    for _ in range(14):
        w.tick(0.5)
    assert len(w.gen(job).vm_ids) == 3 and not json.loads(w.gen(job).live_json)["joiners"], "growth waits"
    noticed.finish(0)
    w.until(lambda: json.loads(w.gen(job).live_json)["joiners"])
    gen = w.gen(job)
    assert noticed.vm_id not in gen.vm_ids and len(gen.vm_ids) == 3
    assert json.loads(gen.live_json)["joiners"] == {gen.vm_ids[2]: [3]}, "a fresh id; 2 is never reused"
    assert gen.pipeline_depth * gen.data_parallel == 3
    assert not {"stopping", "killing", "live-morph-fallback"} & set(w.kinds(job))


# -- a frozen member (declared dead by its peers' heartbeat watches) -------------------------------


def two_slot_start(tmp_path, monkeypatch):
    """A 2×2 live-morph job on two two-slot simulated VMs (members [0, 1] and [2, 3]), 5 steps done."""
    from test_manager_controller import SimVM

    def register(vm):
        vm.mgr.register_vm(RegisterVM(vm_id=vm.vm_id, job_id=vm.job_id, agent_instance=vm.instance,
                                                address="127.0.0.1", slots=2, pid=1))

    monkeypatch.setattr(SimVM, "register", register)
    w = World(tmp_path, provider=FakeProvider(capacity=2))
    job = w.submit(max_vms=2, procs_per_vm=2, pipeline_depth=2, live_morph=True)
    w.tick()
    w.tick(0.1)
    gen = w.gen(job)
    assert (gen.pipeline_depth, gen.data_parallel) == (2, 2) and len(gen.vm_ids) == 2
    assert json.loads(gen.live_json)["members"] == {gen.vm_ids[0]: [0, 1], gen.vm_ids[1]: [2, 3]}
    w.steps(job, 1, 5)
    return w, job


def declare_frozen(address: dict[str, str], member: int) -> None:
    """What a peer's heartbeat watch writes for a member silent for ``freeze_s`` (live_watch._look)."""
    c = client(address)
    c.compare_set(f"{ROOT}dead_why/{member}", "", "no heartbeat for 31s, seen by member 0: frozen or hung")
    c.set(f"{ROOT}dead/{member}", "1")


def kill_orders(w: World, job: str) -> dict[str, list[int]]:
    return {vm.vm_id: list(vm.beat().kill) for vm in w.running(job)}


@pytest.mark.parametrize("code", [76, 1])
def test_a_worker_exiting_76_was_dropped_by_its_peers_not_a_failure(tmp_path, monkeypatch, code):
    """Exit 76 (declared dead by the others, then resumed): only that member leaves the generation,
    its VM's other worker goes on; any other failure of a worker (1) is still the restart path."""
    w, job = two_slot_start(tmp_path, monkeypatch)
    a, b = w.running(job)
    b.workers[3].update(running=False, exit_code=code)
    w.tick(0.1)
    if code != 76:  # negative control: a real failure
        [fb] = w.event(job, "live-morph-fallback")
        assert "not a lost VM" in fb.data["reason"]
        assert w.store.generation(job, 1).state in ("killing", "ended")
        return
    gen = w.gen(job)
    assert gen.generation == 1 and gen.state == "running" and gen.vm_ids == [a.vm_id, b.vm_id]
    live = json.loads(gen.live_json)
    assert live["members"] == {a.vm_id: [0, 1], b.vm_id: [2]} and live["frozen"] == {b.vm_id: [3]}
    assert b.workers[2]["running"], "the VM's other worker is not touched"
    [ev] = w.event(job, "live-frozen")
    assert ev.data["members"] == [3] and ev.data["vms"] == [b.vm_id] and "exited with 76" in ev.message
    ref = choose_layout(slots=[2, 1], num_segments=4, request=PlanRequest(
        calibration=None, global_batch_size=24, micro_batch_size=2, pipeline_depth=2))
    assert (gen.pipeline_depth, gen.data_parallel) == (ref.pipeline_depth, ref.data_parallel)
    for _ in range(4):
        w.tick(0.5)
    assert not {"stopping", "killing", "live-morph-fallback"} & set(w.kinds(job))
    assert w.event(job, "live-morph") == []
    report(w, job, 6, (ref.pipeline_depth, ref.data_parallel))
    [morph] = w.event(job, "live-morph")
    assert morph.data["reason_kind"] == "frozen" and morph.data["lost_ranks"] == [3]
    layout = (morph.data["pipeline_depth"], morph.data["data_parallel"])
    assert layout == (ref.pipeline_depth, ref.data_parallel)
    assert morph.data["duration_s"] > 0 and len(w.event(job, "live-frozen")) == 1, "dropped once"


def test_a_frozen_verdict_gets_exactly_that_worker_killed(tmp_path, monkeypatch):
    """A verdict in the store: a kill order for that member only, on its VM only; the survivors'
    own layout (they regrouped before the manager's plan reached them) becomes the generation's;
    its killed exit (-9) is no failure and the job still ends when the others finish."""
    from varuna.core.live_layout import plan_generation
    from varuna.runtime.live_morph import declare_dead

    w, job = two_slot_start(tmp_path, monkeypatch)
    a, b = w.running(job)
    address = a.launches[0].env  # the store's address and secret
    declare_dead(client(address), 1)  # dead without a verdict (the supervisor's word): no kill
    w.tick(0.1)
    assert kill_orders(w, job) == {a.vm_id: [], b.vm_id: []} and w.event(job, "live-frozen") == []
    declare_frozen(address, 3)
    w.tick(0.1)
    assert kill_orders(w, job) == {a.vm_id: [], b.vm_id: [3]}
    [ev] = w.event(job, "live-frozen")
    assert ev.data["members"] == [3] and "no heartbeat for 31s" in ev.data["why"]["3"]
    b.workers[3].update(running=False, exit_code=-9)  # what the agent's SIGKILL gives
    w.tick(0.1)
    w.tick(0.5)
    assert not {"stopping", "killing", "live-morph-fallback"} & set(w.kinds(job))
    P, D, _ = plan_generation(old_P=2, holders=3, newcomers=0, max_stages=4, max_replicas=24)
    plan = w.gen(job)
    assert (plan.pipeline_depth, plan.data_parallel) != (P, D), "the case where the workers chose first"
    report(w, job, 6, (P, D))
    [morph] = w.event(job, "live-morph")
    assert morph.data["reason_kind"] == "frozen" and "workers' rule" in morph.data["source"]
    gen = w.gen(job)
    assert (gen.pipeline_depth, gen.data_parallel) == (P, D) == (morph.data["pipeline_depth"],
                                                                  morph.data["data_parallel"])
    w.steps(job, 50, 50)
    a.finish(0)
    b.workers[2].update(running=False, exit_code=0)
    w.until(lambda: w.store.job(job).state == "finished")
    assert w.store.job(job).generation == 1


def second_vm_frozen(tmp_path, monkeypatch):
    """A two-slot start whose second VM's members (2, 3) both were declared frozen, after one
    pass of the manager's loop: (world, job, first VM, second VM)."""
    w, job = two_slot_start(tmp_path, monkeypatch)
    a, b = w.running(job)
    address = a.launches[0].env  # the store's address and secret
    declare_frozen(address, 2)
    declare_frozen(address, 3)
    w.tick(0.1)
    return w, job, a, b


def test_a_vm_whose_every_member_froze_stays_idle_and_leaves_on_a_notice(tmp_path, monkeypatch):
    """Both members of a two-slot VM froze: the VM stays in the generation without members (both
    killed by order); a notice there later lets it leave at once (no worker to hand over), so it
    holds up nothing (growth waits for leavers)."""
    w, job, a, b = second_vm_frozen(tmp_path, monkeypatch)
    gen = w.gen(job)
    assert gen.vm_ids == [a.vm_id, b.vm_id] and json.loads(gen.live_json)["members"][b.vm_id] == []
    assert kill_orders(w, job) == {a.vm_id: [], b.vm_id: [2, 3]}
    b.finish(-9)
    b.notice = PreemptNotice(**NOTICE)
    w.tick(0.1)
    w.tick(0.1)
    gen = w.gen(job)
    assert gen.vm_ids == [a.vm_id] and json.loads(gen.live_json)["leaving"] == []
    assert not {"stopping", "killing", "live-morph-fallback"} & set(w.kinds(job))


def test_a_lost_vm_whose_every_member_froze_leaves_without_another_morph(tmp_path, monkeypatch):
    w, job, a, b = second_vm_frozen(tmp_path, monkeypatch)
    layout = (w.gen(job).pipeline_depth, w.gen(job).data_parallel)
    b.alive = False  # then the VM itself is lost
    w.until(lambda: b.vm_id not in w.gen(job).vm_ids)
    gen = w.gen(job)
    assert gen.generation == 1 and gen.state == "running"
    assert (gen.pipeline_depth, gen.data_parallel) == layout, "no re-plan: nobody was lost with it"
    assert w.store.job(job).detection_time is None
    assert not {"stopping", "killing", "live-morph-fallback"} & set(w.kinds(job))
    report(w, job, 6, layout)
    [morph] = w.event(job, "live-morph")
    assert morph.data["reason_kind"] == "frozen" and morph.data["lost_ranks"] == [2, 3], "one morph"

@pytest.mark.slow
def test_the_agent_kills_a_stopped_worker_on_the_order_and_reaps_it(tmp_path):
    """A real agent with two real workers of one generation: the one stopped with SIGSTOP (frozen)
    is SIGKILLed and reaped on a RUN order naming it in ``kill``; the other is not touched, and an
    order without ``kill`` touches neither."""
    import os

    from test_manager_local import wait_for

    from manager.agent import vm_agent
    from manager.transport import varuna_manager_pb2 as pb
    token = tmp_path / "token"
    token.write_text("x" * 32)
    token.chmod(0o600)
    script = tmp_path / "worker.py"
    script.write_text(NOTICE_WORKER)
    agent = vm_agent.VMAgent(vm_agent.AgentConfig(manager="127.0.0.1:1", token_file=str(token), vm_id="v",
                                                  slots=2, log_dir=str(tmp_path)))
    try:
        launches = [pb.WorkerLaunch(rank=r, argv=[str(script), str(tmp_path / f"out{r}")],
                                    env={"VARUNA_LIVE_STORE": "h:1"}) for r in (2, 3)]
        agent._apply(pb.Orders(action=pb.Orders.RUN, generation=1, workers=launches))
        wait_for(lambda: all((tmp_path / f"out{r}.ready").exists() for r in (2, 3)), 60, "the workers")
        frozen, other = agent._pool.workers[1], agent._pool.workers[0]
        assert frozen.rank == 3 and other.rank == 2
        os.kill(frozen.popen.pid, signal.SIGSTOP)
        wait_for(lambda: Path(f"/proc/{frozen.popen.pid}/stat").read_text().split(") ")[1][0] == "T", 60,
                 "the stop")
        agent._apply(pb.Orders(action=pb.Orders.RUN, generation=1, workers=launches))
        assert frozen.exit_code is None and other.exit_code is None, "no kill without the order"
        agent._apply(pb.Orders(action=pb.Orders.RUN, generation=1, workers=launches, kill=[3]))
        assert frozen.exit_code == -signal.SIGKILL, "killed and reaped by the order itself"
        with pytest.raises(ProcessLookupError):  # reaped: no zombie left behind
            os.kill(frozen.popen.pid, 0)
        agent._pool.poll()
        assert other.exit_code is None and other.popen.poll() is None, "its VM's other worker runs on"
        assert [(w.rank, w.exit_code) for w in agent._pool.workers] == [(2, None), (3, -signal.SIGKILL)]
    finally:
        agent._pool.kill_all()
        agent._client.close()
