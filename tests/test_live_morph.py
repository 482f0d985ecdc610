"""Live morph (docs/live_morph.md): the layout rule, the transfer plan, and 2×2 -> kill -9 one
worker -> the three survivors go on at 1×3 in the same processes, without a checkpoint, and end
bit-identical to an undisturbed 2×2 run (deterministic mode)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from varuna.core.live_layout import NoLiveReplica, plan_survivor_layout, transfer_plan

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "live_worker.py"


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


# ---------------------------------------------------------------------------------- processes


def run_live_world(out: Path, ckpt: Path, steps: int, die: tuple[list[int], int] | None = None,
                   timeout_s: float = 180.0) -> tuple[list[int], list[int | None]]:
    """4 workers at 2×2 around a store this process hosts (the supervisor's role); when ``die``
    = (members, step), those members kill themselves after the step and each is declared dead
    once its exit is seen. Returns the workers' pids and exit codes."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    args = [sys.executable, str(WORKER), "--out", str(out), "--ckpt-dir", str(ckpt), "--steps", str(steps)]
    if die:
        args += ["--die-members", ",".join(map(str, die[0])), "--die-after", str(die[1])]
    out.mkdir(parents=True)
    procs, logs = [], []
    try:
        for r in range(4):
            env = {**os.environ, "VARUNA_LIVE_STORE": f"127.0.0.1:{store.port}", "RANK": str(r),
                   "WORLD_SIZE": "4", "LOCAL_RANK": str(r), "VARUNA_PIPELINE_DEPTH": "2",
                   "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            logs.append(open(out / f"member{r}.log", "w"))  # noqa: SIM115 (closed below)
            procs.append(subprocess.Popen(args, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        from varuna.runtime.live_morph import declare_dead

        for m in die[0] if die else []:
            procs[m].wait(timeout_s)  # the supervisor sees the exit...
            declare_dead(store, m)  # ...and says so
        for p in procs:
            p.wait(timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for f in logs:
            f.close()
    return [p.pid for p in procs], [p.returncode for p in procs]


def read_member(out: Path, m: int) -> tuple[dict, dict]:
    return json.loads((out / f"member{m}.json").read_text()), torch.load(out / f"member{m}.pt")


@pytest.mark.slow
def test_kill_one_of_2x2_survivors_go_on_in_process_bit_identical(tmp_path):
    steps, die_after = 5, 2
    ref_out, live_out, ckpt = tmp_path / "ref", tmp_path / "live", tmp_path / "ckpt"
    _, codes = run_live_world(ref_out, ckpt, steps)
    assert codes == [0, 0, 0, 0], [(out.name, (ref_out / f"member{m}.log").read_text()[-2000:])
                                   for m, out in enumerate([ref_out] * 4)]
    ref_params: dict = {}
    for m in range(4):
        ref_params.update(read_member(ref_out, m)[1])
    ref_losses = read_member(ref_out, 0)[0]["losses"]

    pids, codes = run_live_world(live_out, ckpt, steps, die=([3], die_after))
    logs = {m: (live_out / f"member{m}.log").read_text()[-3000:] for m in range(4)}
    assert codes == [0, 0, 0, -signal.SIGKILL], logs
    for m in range(3):
        report, params = read_member(live_out, m)
        assert report["pid"] == pids[m], "the survivor is the process started at 2x2 (no restart)"
        assert (report["P"], report["D"]) == (1, 3)
        [morph] = report["morphs"]
        assert morph["lost"] == [3] and morph["old"] == [2, 2] and morph["new"] == [1, 3]
        assert morph["resumed_after"] == die_after, "only the step in flight is redone"
        assert morph["received_bytes"] > 0, "each survivor lacked half the model and got it from a peer"
        assert report["opened"] == [], "a live morph reads no checkpoint"
        assert [s for s, _ in report["losses"]] == list(range(1, steps + 1))
        assert report["losses"][die_after:] == ref_losses[die_after:]
        assert params.keys() == ref_params.keys()
        assert [n for n in params if not torch.equal(params[n], ref_params[n])] == []
    assert not ckpt.exists()


@pytest.mark.slow
def test_a_lost_stage_falls_back_to_the_restart_path(tmp_path):
    """Both replicas of stage 1 die: no live copy of its state, so the survivors say so and exit
    with the peer-lost code (the supervisor restarts from a checkpoint) instead of hanging."""
    from varuna.runtime.peer_watch import PEER_LOST_EXIT_CODE

    out = tmp_path / "lost"
    _, codes = run_live_world(out, tmp_path / "ckpt", 4, die=([1, 3], 1), timeout_s=120)
    assert codes == [PEER_LOST_EXIT_CODE, -signal.SIGKILL, PEER_LOST_EXIT_CODE, -signal.SIGKILL]
    for m in (0, 2):
        assert "stage 1 has no live replica" in (out / f"member{m}.log").read_text()
