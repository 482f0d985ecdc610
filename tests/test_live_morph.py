"""Live morph (docs/live_morph.md): the layout rules, the flat state transfer, and live worlds of
local processes around a store this test hosts (the supervisor's role): kill -9 (shrink), growth,
preemption notice, a second failure inside the regroup, spares, the lost-stage fallback. Every
run in deterministic mode ends bit-identical to one undisturbed single-process run (the reference)."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import varuna
from varuna.core.live_layout import NoLiveReplica, plan_generation, plan_survivor_layout, transfer_plan
from varuna.runtime.live_transfer import describe_state, receive_targets

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "live_worker.py"


def _communicate_all(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    """Each process's output once it exited (bounded); every one still running is killed."""
    try:
        return [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


STEPS = 9
# ---------------------------------------------------------------------------------- pure rules


def test_layout_keeps_every_survivor_working_and_prefers_the_old_depth():
    plan = plan_survivor_layout(old_P=2, old_D=3, survivors=[0, 1, 2, 4], max_stages=4, max_replicas=8)
    assert (plan.P, plan.D, plan.spares) == (2, 2, [])
    assert plan.new_rank == {0: 0, 1: 1, 2: 2, 4: 3}
    # 3 survivors cannot keep P=2: P=1 and P=3 are equally far, the shorter pipeline wins
    plan = plan_survivor_layout(old_P=2, old_D=2, survivors=[0, 1, 2], max_stages=3, max_replicas=4)
    assert (plan.P, plan.D) == (1, 3)


def test_layout_leaves_spares_when_no_split_fits():
    # 5 survivors, at most 2 stages and 2 replicas: 4 work, the highest old rank waits
    plan = plan_survivor_layout(old_P=2, old_D=3, survivors=[0, 1, 2, 3, 5], max_stages=2, max_replicas=2)
    assert (plan.P, plan.D, plan.spares) == (2, 2, [5])


def test_layout_refuses_a_stage_without_live_replica():
    with pytest.raises(NoLiveReplica, match="stage 1 has no live replica"):
        plan_survivor_layout(old_P=2, old_D=2, survivors=[0, 2], max_stages=2, max_replicas=4)


def test_transfer_plan_sends_only_what_is_missing_from_a_holder():
    held = [["e", "h0"], ["h1", "o"], ["e", "h0"]]
    needs = [["e", "h0", "h1", "o"]] * 3
    plan = transfer_plan(held, needs)
    for (src, dst), names in plan.items():
        assert src != dst and all(n in held[src] and n not in held[dst] for n in names)
    for dst in range(3):  # every receiver ends with its whole stage
        got = set(held[dst]) | {n for (_, d), ns in plan.items() if d == dst for n in ns}
        assert got == set(needs[dst])
    with pytest.raises(ValueError, match="no survivor holds parameter 'x'"):
        transfer_plan(held, [["x"]] * 3)


def test_mixed_steps_resume_after_the_newest_only_when_its_holders_hold_everything():
    """Note [Mixed steps]: the newest step's holders are taken when they hold every name; a holder
    a step behind then holds nothing (it receives, and serves no stale tensor); when the newest
    lack a name the others hold, no step is whole: the restart path, naming the steps."""
    from varuna.runtime.live_morph import LiveMorphFailed, _newest_holders

    def rec(step, names):
        return {"holds": True, "step": step, "names": names}

    recs = {0: rec(7, ["a", "b"]), 1: rec(7, ["c"]), 2: rec(6, ["a", "b"])}
    assert _newest_holders(recs, [0, 1, 2]) == (7, [0, 1])
    assert recs[2]["holds"] is False and recs[0]["holds"] is True
    held = [recs[m]["names"] if recs[m]["holds"] else [] for m in (0, 1, 2)]
    assert all(src != 2 for src, _ in transfer_plan(held, [["a", "b"], ["c"], ["a", "b"]])), \
        "the stale member serves nothing"
    same = {0: rec(5, ["a"]), 1: rec(5, ["b"])}
    assert _newest_holders(same, [0, 1]) == (5, [0, 1]) and same[1]["holds"]
    lacking = {0: rec(7, ["a", "b"]), 1: rec(6, ["c"])}
    with pytest.raises(LiveMorphFailed, match=r"different steps \[6, 7\] and those at step 7 lack 1"):
        _newest_holders(lacking, [0, 1])
    with pytest.raises(LiveMorphFailed, match="no member holds any state"):
        _newest_holders({}, [])


def test_generation_plan_takes_the_managers_layout_when_it_fits():
    # 1x2 plus two joiners: the rule alone would keep P=1 (1x4); the manager asked for 2x2
    limits = {"max_stages": 3, "max_replicas": 4}
    assert plan_generation(old_P=1, holders=2, newcomers=2, **limits) == (1, 4, 4)
    assert plan_generation(old_P=1, holders=2, newcomers=2, hint=(2, 2), **limits) == (2, 2, 4)
    # a hint that does not fit (too many stages, too few members) falls back to the rule
    assert plan_generation(old_P=2, holders=3, newcomers=0, hint=(2, 2), **limits) == (1, 3, 3)
    # five members, the hint uses four: the fifth is a spare
    assert plan_generation(old_P=2, holders=4, newcomers=1, hint=(2, 2), **limits) == (2, 2, 4)


def test_transfer_round_trips_adamw_state_exactly_and_in_place():
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    h = torch.nn.Parameter(torch.randn(7).to(torch.bfloat16))
    opt = torch.optim.AdamW([w, b, h], lr=0.1, betas=(0.8, 0.95))
    for p in (w, b, h):
        p.grad = torch.randn_like(p)
    opt.step()
    from varuna.runtime.optimizer_state import optimizer_state_by_name

    names = {"w": w, "b": b, "h": h}
    state = {"params": {n: p.detach() for n, p in names.items()},
             "optimizer": optimizer_state_by_name(opt, names)}
    meta, sent = describe_state(state)
    assert sent[0].data_ptr() == w.data_ptr()  # sent from the live tensor: no packing copy
    # the receiver's new engine: w in place; b has another dtype there (received aside, loaded by copy)
    into = {"w": torch.zeros(3, 5), "b": torch.zeros(5)}
    back, targets = receive_targets(meta, into)
    assert len(targets) == len(sent)
    for src, dst in zip(sent, targets):  # what each send/recv pair does
        dst.copy_(src)
    assert back["params"]["w"] is into["w"] and back["params"]["b"] is not into["b"]
    for n, p in names.items():
        assert back["params"][n].dtype == p.dtype and torch.equal(back["params"][n], p.detach())
        for k, v in state["optimizer"]["state"][n].items():
            assert torch.equal(back["optimizer"]["state"][n][k], v), (n, k)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.95)
    assert back["optimizer"]["param_groups"][0]["params"] == ["w", "b", "h"]
    with pytest.raises(ValueError, match="bad tensor entry"):
        receive_targets(meta.replace('"float32"', '"Tensor"'), {})


def test_tear_down_collects_only_when_a_group_handle_has_another_holder():
    from varuna.runtime.live_morph import _held_elsewhere

    handles = [object(), object()]
    assert not _held_elsewhere(handles)  # only the list holds them: freed without a collection
    cycle = {"frame-like": handles[1]}
    cycle["self"] = cycle
    assert _held_elsewhere(handles), "a cycle still holds one: the morph must collect"
    del cycle
    assert _held_elsewhere(handles), "only a collection frees a cycle"
    gc.collect()
    assert not _held_elsewhere(handles)


def test_live_watch_declares_only_a_silent_member_dead_and_a_declared_one_learns_it():
    """Member 1 beat once and went silent (frozen), member 2 beats from its own watch thread,
    member 3 closed its world (beat "exit"), member 4 has not beaten yet (still starting): member
    0's watch declares 1 dead, with the reason in the store, and never 2, 3 or 4. A member declared
    dead learns it at its next beat."""
    from varuna.runtime.live_watch import LiveWatch, frozen_verdict

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    store.set("varuna/live/beat/1", "1 4242")
    store.set("varuna/live/beat/3", "9 4343 exit")  # member 4 never beat: still starting, not frozen
    verdicts: list[set[int]] = []
    seen_dead, told = threading.Event(), threading.Event()

    def on_dead(dead: set[int]) -> None:
        verdicts.append(dead)
        seen_dead.set()

    two = LiveWatch.start(store, member=2, watched=lambda: [], freeze_s=0, on_dead=on_dead, beat_s=0.05)
    two.on_self_dead = lambda member, why: told.set()
    zero = LiveWatch.start(store, member=0, watched=lambda: [1, 2, 3, 4], freeze_s=2.0, on_dead=on_dead)
    try:
        assert seen_dead.wait(60), "the silent member was never declared dead"
        assert verdicts[0] == {1} and zero.dead == {1}
        assert "no heartbeat for" in (frozen_verdict(store, 1) or "") and frozen_verdict(store, 2) is None
        assert not told.is_set()
        store.set("varuna/live/dead/2", "1")  # e.g. the others declared member 2 frozen meanwhile
        assert told.wait(60), "a member declared dead did not learn it"
    finally:
        zero.close()
        two.close()
    assert not zero._thread.is_alive() and not two._thread.is_alive()
    assert store.get("varuna/live/beat/0").decode().endswith(" exit")


# ---------------------------------------------------------------------------------- processes


def run_live_world(out: Path, ckpt: Path, *, world: int = 4, P: int = 2, args: tuple[str, ...] = (),
                   joiners: tuple[int, ...] = (), plan: tuple[int, int] | None = None,
                   timeout_s: float = 240.0, frozen: tuple[int, ...] = (),
                   states: dict[int, str] | None = None, worker: Path = WORKER,
                   steps: int = STEPS) -> tuple[dict[int, int], dict[int, int | None]]:
    """``world`` workers at P×(world/P) around a store this process hosts (the supervisor's role):
    a thread per worker waits for its exit and declares it dead; ``joiners`` start (with
    $VARUNA_LIVE_JOIN) once member 0 set ``test/joiners``; ``frozen`` members (they SIGSTOP
    themselves) get SIGCONT once every other member exited, their process state just before it
    goes to ``states``. ``worker``: the script (tests/workers/state_worker.py runs the BatchNorm
    model). Returns pids and exit codes by member."""
    from varuna.launch.live_store import LiveStore
    from varuna.runtime.live_morph import declare_dead, request_layout

    live = LiveStore(timeout_s=timeout_s)
    store = live.store
    if plan:
        request_layout(store, *plan)
    cmd = [sys.executable, str(worker), "--out", str(out), "--ckpt-dir", str(ckpt), "--steps", str(steps),
           "--timeout", "60", *args]
    out.mkdir(parents=True)
    procs: dict[int, subprocess.Popen] = {}
    logs, threads = [], []

    def supervise(m: int) -> None:
        try:
            procs[m].wait(timeout_s)
        except subprocess.TimeoutExpired:
            return
        declare_dead(store, m)

    def start(m: int, joining: bool) -> None:
        env = {**os.environ, **live.worker_env(), "RANK": str(m),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(m), "VARUNA_PIPELINE_DEPTH": str(P),
               "VARUNA_LIVE_JOIN": "1" if joining else "0", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        logs.append(open(out / f"member{m}.log", "w"))  # noqa: SIM115 (closed below)
        procs[m] = subprocess.Popen(cmd, env=env, stdout=logs[-1], stderr=subprocess.STDOUT)
        threads.append(threading.Thread(target=supervise, args=(m,), daemon=True))
        threads[-1].start()

    try:
        for m in range(world):
            start(m, False)
        if joiners:  # bounded waits while the world lives: a world that ended early fails fast
            deadline = time.monotonic() + timeout_s
            while not store.check(["test/joiners"]):
                assert time.monotonic() < deadline and any(p.poll() is None for p in procs.values()), \
                    ("member 0 never asked for the joiners", logs_of(out))
                try:
                    store.wait(["test/joiners"], timedelta(seconds=1))
                except dist.DistStoreError:
                    pass
            for j in joiners:
                start(j, True)
        for m, t in zip(list(procs), list(threads)):
            if m not in frozen:
                t.join(timeout_s)
        for m in frozen:
            if states is not None:
                states[m] = process_state(procs[m].pid)
            os.kill(procs[m].pid, signal.SIGCONT)
        for t in threads:
            t.join(timeout_s)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for f in logs:
            f.close()
        live.close()
    return {m: p.pid for m, p in procs.items()}, {m: p.returncode for m, p in procs.items()}


def process_state(pid: int) -> str:
    """The kernel's state letter of a process (T: stopped), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def read_member(out: Path, m: int) -> tuple[dict, dict | None]:
    pt = out / f"member{m}.pt"
    return json.loads((out / f"member{m}.json").read_text()), torch.load(pt) if pt.exists() else None


def logs_of(out: Path) -> dict[str, str]:
    return {f.name: f.read_text()[-2500:] for f in sorted(out.glob("member*.log"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, list]:
    """One undisturbed single-process run (deterministic mode makes every P×D equal to it; a
    2×2 run gave the same bits, and costs four processes): every parameter after STEPS steps,
    and the losses."""
    out = tmp_path_factory.mktemp("live") / "ref"
    _, codes = run_live_world(out, out.parent / "ckpt", world=1, P=1)
    assert codes == {0: 0}, logs_of(out)
    report, params = read_member(out, 0)
    return params, report["losses"]


def check_bit_identical(out: Path, members: list[int], reference: tuple[dict, list]) -> dict[int, dict]:
    """Working members at the end: together the whole model, each parameter equal to the
    reference's; every loss they ran equal to the reference's; no checkpoint opened."""
    ref_params, ref_losses = reference
    reports, params = {}, {}
    for m in members:
        report, p = read_member(out, m)
        reports[m] = report
        assert report["opened"] == [], "a live morph reads no checkpoint"
        for step, loss in report["losses"]:
            assert loss == ref_losses[step - 1][1], (m, step)
        assert p is not None, f"member {m} ended without a stage"
        assert [n for n in p if not torch.equal(p[n], ref_params[n])] == [], m
        params.update(p)
    assert params.keys() == ref_params.keys()
    return reports


@pytest.mark.slow
def test_kill_one_of_2x2_survivors_go_on_in_process_bit_identical(tmp_path, reference):
    out, ckpt = tmp_path / "live", tmp_path / "ckpt"
    pids, codes = run_live_world(out, ckpt, args=("--die", "3:2"))
    assert codes == {0: 0, 1: 0, 2: 0, 3: -signal.SIGKILL}, logs_of(out)
    reports = check_bit_identical(out, [0, 1, 2], reference)
    for m, report in reports.items():
        assert report["pid"] == pids[m], "the survivor is the process started at 2x2 (no restart)"
        assert (report["P"], report["D"]) == (1, 3)
        [morph] = report["morphs"]
        assert morph["lost"] == [3] and morph["old"] == [2, 2] and morph["new"] == [1, 3]
        assert morph["resumed_after"] == 2 and report["failed_steps"] == [3], "only the step in flight redone"
        assert morph["received_bytes"] > 0, "each survivor lacked half the model and got it from a peer"
        assert [s for s, _ in report["losses"]] == list(range(1, STEPS + 1))
    assert not ckpt.exists()


@pytest.mark.slow
def test_a_frozen_member_is_declared_dead_and_the_survivors_go_on_live(tmp_path, reference):
    """Member 3 SIGSTOPs itself after step 2 (sockets open, no exit for a supervisor to see): the
    survivors' heartbeat watches declare it dead, sever the groups they were blocked in, and go on
    at 1×3 in their processes, bit-identical, no checkpoint read. Resumed at the end (SIGCONT), the
    frozen member finds itself declared dead and exits at once with its own code, no orphan."""
    from varuna.runtime.live_watch import DECLARED_DEAD_EXIT_CODE

    out, states = tmp_path / "frozen", {}
    pids, codes = run_live_world(out, tmp_path / "ckpt", args=("--freeze", "3:2", "--freeze-s", "10"),
                                 frozen=(3,), states=states)
    assert codes == {0: 0, 1: 0, 2: 0, 3: DECLARED_DEAD_EXIT_CODE}, logs_of(out)
    assert states[3] == "T", "member 3 stayed frozen until the survivors had finished"
    reports = check_bit_identical(out, [0, 1, 2], reference)
    for m, report in reports.items():
        assert report["pid"] == pids[m] and (report["P"], report["D"]) == (1, 3)
        [morph] = report["morphs"]
        assert morph["lost"] == [3] and morph["resumed_after"] == 2 and report["failed_steps"] == [3]
    log3 = (out / "member3.log").read_text()
    assert "member 3 was declared dead (no heartbeat for" in log3, log3[-2000:]
    assert not (out / "member3.json").exists(), "the stale member wrote nothing after it resumed"
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_a_member_a_step_behind_takes_its_stage_from_those_that_committed_it(tmp_path, reference):
    """Note [Mixed steps]: member 2 fails between the end-of-step agreement and its optimizer step
    of step 3, so members 0, 1 and 3 commit step 3 and it stays at step 2. Those at step 3 hold the
    whole model: the run goes on at 2×2 after step 3, member 2 receiving its stage from its replica
    peer like a newcomer (its stale state serves nothing), bit-identical, no checkpoint read. The
    old rule (every holder at one step) sent this run to the restart path (exit 75)."""
    out = tmp_path / "mixed"
    pids, codes = run_live_world(out, tmp_path / "ckpt", args=("--fail-before-commit", "2:3"))
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}, logs_of(out)
    reports = check_bit_identical(out, [0, 1, 2, 3], reference)
    for m, report in reports.items():
        assert report["pid"] == pids[m] and (report["P"], report["D"]) == (2, 2)
        [morph] = report["morphs"]
        assert morph["lost"] == [] and morph["resumed_after"] == 3, morph
        assert report["failed_steps"] == ([3] if m == 2 else [4]), report["failed_steps"]
    assert [s for s, _ in reports[2]["losses"]] == [1, 2, *range(4, STEPS + 1)]
    assert "members committed different steps" not in "".join(logs_of(out).values())
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_a_torn_down_survivor_releases_a_peer_blocked_on_it_at_once(tmp_path):
    """The cascade (docs/live_morph.md): members 0 and 1 each have a receiver blocked on the other;
    member 1 tears down as after a failed step. Severing its groups alone, before its engine closes
    (no thread join, no group destroyed), frees member 0: its receiver fails, far below
    comm_timeout_s (120 s)."""
    from varuna.launch.live_store import LiveStore

    worker = ROOT / "tests" / "workers" / "live_cascade_worker.py"
    live = LiveStore(timeout_s=60)
    env = {**os.environ, **live.worker_env(), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(worker), "--out", str(tmp_path), "--within", "30"],
                              env={**env, "RANK": str(m), "LOCAL_RANK": str(m)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for m in (0, 1)]
    outs = _communicate_all(procs, 180)
    live.close()
    assert [p.returncode for p in procs] == [0, 0], outs
    seen = json.loads((tmp_path / "member0.json").read_text())
    assert seen["released"], seen
    # Before severing, only Engine.close freed member 0 (once its 10 s thread join had timed out):
    # here close() waits for member 0's release, so the old tear-down ends with False.
    assert json.loads((tmp_path / "member1.json").read_text()) == {"released_before_close": True}


@pytest.mark.slow
def test_growth_1x2_to_2x2_joiners_get_their_state_from_peers_and_a_spare_waits(tmp_path, reference):
    """Two workers at 1×2; three join: the manager's 2×2 is used, the fifth waits as a spare and
    leaves (exit 0) when the job ends. Nobody redoes a step; the joiners never read a checkpoint."""
    out = tmp_path / "grow"
    pids, codes = run_live_world(out, tmp_path / "ckpt", world=2, P=1, args=("--joiners-after", "2:3"),
                                 joiners=(2, 3, 4), plan=(2, 2))
    assert codes == {m: 0 for m in range(5)}, logs_of(out)
    reports = check_bit_identical(out, [0, 1, 2, 3], reference)
    boundary = reports[0]["morphs"][0]["resumed_after"]
    assert boundary in (3, 4), "admitted at the boundary after they registered"
    for m, report in reports.items():
        assert report["failed_steps"] == [] and (report["P"], report["D"]) == (2, 2)
        [morph] = report["morphs"]
        assert morph["joined"] == [2, 3] and morph["new"] == [2, 2] and morph["resumed_after"] == boundary
        first = report["losses"][0][0]
        assert first == (1 if m < 2 else boundary + 1)
        assert [s for s, _ in report["losses"]] == list(range(first, STEPS + 1))
    for m in (0, 1):
        assert reports[m]["pid"] == pids[m] and reports[m]["morphs"][0]["old"] == [1, 2]
        # each held the whole model: its new stage is a part of it, so nothing came over the wire
        assert reports[m]["morphs"][0]["received_bytes"] == 0
    for m in (2, 3):
        assert reports[m]["morphs"][0]["received_bytes"] > 0, "a joiner's whole stage came from a peer"
    spare, _ = read_member(out, 4)
    assert spare["losses"] == [] and spare["finished"], "the spare waited for the end of the job"


@pytest.mark.slow
def test_notice_hands_state_over_and_nothing_is_redone(tmp_path, reference):
    """Both replicas of stage 1 get a notice after step 2: they finish step 3, hand stage 1 to the
    survivors (its only holders) and exit 0; the survivors go on at 2×1 without redoing a step."""
    out = tmp_path / "notice"
    pids, codes = run_live_world(out, tmp_path / "ckpt", args=("--notice", "1:2,3:2"))
    assert codes == {m: 0 for m in range(4)}, logs_of(out)
    reports = check_bit_identical(out, [0, 2], reference)
    for m, report in reports.items():
        assert report["pid"] == pids[m] and report["failed_steps"] == []
        [morph] = report["morphs"]
        assert morph["left"] == [1, 3] and morph["lost"] == [] and morph["resumed_after"] == 3
        assert (report["P"], report["D"]) == (2, 1)
        assert [s for s, _ in report["losses"]] == list(range(1, STEPS + 1)), "0 steps redone"
    assert reports[2]["morphs"][0]["received_bytes"] > 0, "stage 1 came from the leavers"
    for m in (1, 3):
        leaver, params = read_member(out, m)
        assert params is None and leaver["role"] == "gone" and leaver["failed_steps"] == []
        assert [s for s, _ in leaver["losses"]] == [1, 2, 3]


@pytest.mark.slow
def test_a_second_failure_inside_the_regroup_retries_into_the_next_generation(tmp_path, reference):
    """Member 3 dies after step 2; member 2 dies as generation 1's state transfer starts. The two
    left retry into generation 2 (2×1) and end bit-identical: no hang, no mixed-step model."""
    out = tmp_path / "second"
    pids, codes = run_live_world(out, tmp_path / "ckpt", args=("--die", "3:2", "--die-in-transfer", "2:1"))
    assert codes == {0: 0, 1: 0, 2: -signal.SIGKILL, 3: -signal.SIGKILL}, logs_of(out)
    reports = check_bit_identical(out, [0, 1], reference)
    for m, report in reports.items():
        assert report["pid"] == pids[m] and report["failed_steps"] == [3]
        [morph] = report["morphs"]
        assert morph["generation"] == 2 and morph["attempts"] == 2 and morph["resumed_after"] == 2
        assert (report["P"], report["D"]) == (2, 1)


@pytest.mark.slow
def test_several_live_morphs_in_one_run_stay_bit_identical(tmp_path, reference):
    """2×2 -> kill 3 -> 1×3 -> notice to 2 -> 1×2 -> three join -> 2×2 + a spare -> kill 5 ->
    the spare takes its place (2×2): four live morphs, same pids throughout, bit-identical."""
    out = tmp_path / "many"
    args = ("--die", "3:2,5:8", "--notice", "2:4", "--joiners-after", "5:3")
    pids, codes = run_live_world(out, tmp_path / "ckpt", args=args, joiners=(4, 5, 6), plan=(2, 2))
    assert codes == {0: 0, 1: 0, 2: 0, 3: -signal.SIGKILL, 4: 0, 5: -signal.SIGKILL, 6: 0}, logs_of(out)
    reports = check_bit_identical(out, [0, 1, 4, 6], reference)
    kinds = [(m["lost"], m["left"], m["joined"]) for m in reports[0]["morphs"]]
    assert kinds == [([3], [], []), ([], [2], []), ([], [], [4, 5]), ([5], [], [])], kinds
    assert reports[0]["failed_steps"] == [3, 9] and reports[0]["pid"] == pids[0]
    assert reports[6]["morphs"][-1]["received_bytes"] > 0, "the spare got its stage from peers"
    assert (reports[6]["P"], reports[6]["D"]) == (2, 2)


@pytest.mark.slow
def test_a_lost_stage_falls_back_to_the_restart_path(tmp_path):
    """Both replicas of stage 1 die: no live copy of its state, so the survivors say so and exit
    with the peer-lost code (the supervisor restarts from a checkpoint) instead of hanging."""
    from varuna.runtime.peer_watch import PEER_LOST_EXIT_CODE

    out = tmp_path / "lost"
    _, codes = run_live_world(out, tmp_path / "ckpt", args=("--die", "1:1,3:1"), timeout_s=120)
    assert codes == {0: PEER_LOST_EXIT_CODE, 1: -signal.SIGKILL, 2: PEER_LOST_EXIT_CODE, 3: -signal.SIGKILL}
    for m in (0, 2):
        assert "live morph impossible: stage 1 has no live replica" in (out / f"member{m}.log").read_text()


@pytest.mark.slow
def test_notice_with_sharded_optimizer_state_hands_it_over_whole(tmp_path, reference):
    """Issue #32: at 2×2 with the optimizer state sharded over the replicas, both replicas of
    stage 1 leave after a notice; at the boundary each stage gathers its shards whole, the
    leavers hand stage 1 over peer to peer, and the survivors go on at 2×1 bit-identical."""
    out = tmp_path / "notice-shard"
    pids, codes = run_live_world(out, tmp_path / "ckpt", args=("--notice", "1:2,3:2", "--shard"))
    assert codes == {m: 0 for m in range(4)}, logs_of(out)
    reports = check_bit_identical(out, [0, 2], reference)
    for m, report in reports.items():
        assert report["pid"] == pids[m] and report["failed_steps"] == []
        assert (report["P"], report["D"]) == (2, 1) and report["morphs"][0]["left"] == [1, 3]
    assert reports[2]["morphs"][0]["received_bytes"] > 0, "stage 1 came from the leavers"


@pytest.mark.slow
def test_growth_with_sharded_optimizer_state_reshards_it(tmp_path, reference):
    """Issue #32: 1×2 sharded grows to 2×2 sharded: the holders gather their shards at the
    boundary, joiners receive their stage whole from a peer, and every replica keeps its new
    shard; bit-identical to the one-process run."""
    out = tmp_path / "grow-shard"
    _, codes = run_live_world(out, tmp_path / "ckpt", world=2, P=1,
                              args=("--joiners-after", "2:2", "--shard"), joiners=(2, 3), plan=(2, 2))
    assert codes == {m: 0 for m in range(4)}, logs_of(out)
    reports = check_bit_identical(out, [0, 1, 2, 3], reference)
    assert all((r["P"], r["D"]) == (2, 2) for r in reports.values())


@pytest.mark.slow
def test_a_failed_step_with_sharded_optimizer_state_takes_the_restart_path(tmp_path):
    """A replica dies with its shard: nobody else holds those moments, so the survivors say so
    in one line and exit with the peer-lost code (restart from a checkpoint), never hang."""
    from varuna.runtime.peer_watch import PEER_LOST_EXIT_CODE

    out = tmp_path / "lost-shard"
    _, codes = run_live_world(out, tmp_path / "ckpt", args=("--die", "3:1", "--shard"), timeout_s=120)
    lost = PEER_LOST_EXIT_CODE
    assert codes == {0: lost, 1: lost, 2: lost, 3: -signal.SIGKILL}
    for m in (0, 1, 2):
        assert "optimizer state was sharded over the replicas" in (out / f"member{m}.log").read_text()


@pytest.mark.parametrize("overrides, needle", [({"schedule": "2bw"}, "second weight version"),
                                               ({"schedule": "interleaved", "chunks": 2}, "chunks=2")])
def test_live_trainer_refuses_state_it_cannot_carry_in_one_line(overrides: dict, needle: str) -> None:
    """2bw's previous weight version and interleaved chunks are not in the transfer: refused before
    any rendezvous (no store, no process group is touched)."""
    from varuna.runtime.live_trainer import LiveTrainer

    config = varuna.VarunaConfig(global_batch_size=4, micro_batch_size=1, **overrides)
    with pytest.raises(ValueError, match=needle) as err:
        LiveTrainer(lambda: torch.nn.Linear(2, 2), config, example_batch=torch.zeros(4, 2),
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert "\n" not in str(err.value)


_EXIT_WITHOUT_CLOSE = """import sys
from datetime import timedelta
import torch.distributed as dist
from varuna.runtime.live_watch import LiveWatch
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
w = LiveWatch.start(store, member=0, watched=lambda: [0, 1], freeze_s=0.4,
                    on_dead=lambda dead: None, beat_s=0.001)
store.wait(["varuna/live/beat/0"], timedelta(seconds=10))
sys.exit(0)
"""


@pytest.mark.slow
def test_a_process_that_never_closes_its_heartbeat_thread_still_exits_cleanly():
    """The heartbeat thread inside a store call while the interpreter finalises aborted the
    process (exit -6, "terminate called without an active exception": about 1 exit in 5 here,
    seen on survivors at the end of a live-morph benchmark). The watch is closed at exit now.
    Eight processes at once, each beating every millisecond."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _EXIT_WITHOUT_CLOSE], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(8)]
    outs = _communicate_all(procs, 120)
    assert [p.returncode for p in procs] == [0] * 8, outs


_BLOCKED_MAIN_THREAD = """import sys
from datetime import timedelta
import torch.distributed as dist
from varuna.runtime.live_morph import LiveWorld
from varuna.runtime.live_watch import LiveWatch
from varuna.launch.live_store import LiveStore
from varuna.runtime.auth_store import AuthStore
master = LiveStore(timeout_s=30)
me = LiveWorld.join(master.address, member=0, joining=True, freeze_s=1.0, timeout_s=30, key=master.key)
other = AuthStore("127.0.0.1", master.server.port, key=master.key, timeout=timedelta(seconds=30))
watcher = LiveWatch.start(other, member=1, watched=lambda: [0], freeze_s=1.0, on_dead=lambda dead: None,
                          beat_s=0.05)
other.wait(["varuna/live/beat/0"], timedelta(seconds=30))
try:  # the main thread blocked in a store wait 4x freeze_s (as in a rendezvous with a slow peer)
    me.store.wait(["never-set"], timedelta(seconds=4))
except Exception:
    pass
verdict = other.check(["varuna/live/dead/0"])
watcher.close()
me.close()
master.close()
print("declared dead" if verdict else "alive")
sys.exit(1 if verdict else 0)
"""


@pytest.mark.slow
def test_a_main_thread_blocked_in_a_store_wait_is_not_taken_for_frozen():
    """The heartbeat thread has its own connection to the store: a TCPStore client serialises
    its calls, so beats through the main thread's connection stalled behind its blocking waits
    and the others declared a live member frozen (exit 76 on the old code)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _BLOCKED_MAIN_THREAD], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "alive", (r.returncode, r.stdout, r.stderr[-2000:])
