"""The simulator, the auto-configurator and varuna-simulate, checked against analytic formulas."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from simulator.autoconfig import autoconfigure, choose_micro_batch_size, sweep_gpus
from simulator.cli import main
from simulator.engine import SimConfig, simulate
from varuna.core.batching import microbatch_counts
from varuna.core.calibration import AllReduceModel, Calibration, LinkModel
from varuna.core.interleaved import interleaved_order
from varuna.core.partition import balanced_stages, stage_costs
from varuna.core.policy import StagePolicy
from varuna.core.schedule import get_schedule
from varuna.core.tasks import BACKWARD, FORWARD, RECOMPUTE, Task, peak_stashed
from varuna.core.timeline import Timeline

F_PER_SEGMENT = 0.01  # synthetic costs: F = 0.01 s per segment at m=1, B = 2F, R = F


def _uniform(num_segments: int, **kw) -> Calibration:
    """Zero-communication calibration with F=0.01·m per segment, B=2F, R=F."""
    kw.setdefault("micro_batch_sizes", (1, 2))
    return Calibration.synthetic(F_PER_SEGMENT, num_segments=num_segments, **kw)


def _even(num_segments: int, stages: int) -> tuple[tuple[int, int], ...]:
    per = num_segments // stages
    return tuple((k * per, (k + 1) * per - 1) for k in range(stages))


# -- analytic pipeline times ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P,Nm", [(1, 4), (2, 1), (2, 5), (4, 3), (4, 8), (5, 16)])
def test_bubble_fraction_without_recompute(kind, P, Nm):
    cal = _uniform(20)
    r = simulate(
        cal,
        SimConfig(
            num_stages=P,
            micro_batch_size=1,
            num_microbatches=Nm,
            schedule=kind,
            recompute=False,
            stage_segments=_even(20, P),
        ),
    )
    F = F_PER_SEGMENT * 20 / P
    B = 2 * F
    ideal = Nm * (F + B)
    assert r.minibatch_s == pytest.approx((Nm + P - 1) * (F + B), rel=1e-12)
    assert (r.minibatch_s - ideal) / ideal == pytest.approx((P - 1) / Nm, rel=1e-9)
    for k in range(P):
        assert r.stage_busy_s[k] == pytest.approx(ideal)


@pytest.mark.parametrize("P,Nm", [(2, 5), (4, 8), (3, 12)])
def test_gpipe_with_recompute(P, Nm):
    # R_i runs right before B_i except for the last micro-batch (its F is directly followed by
    # its B): each stage works Nm(F+B) + (Nm-1)R, and the recomputes overlap the gradient's
    # trip, so the bubble stays (P-1)(F+B).
    cal = _uniform(12)
    r = simulate(
        cal,
        SimConfig(
            num_stages=P,
            micro_batch_size=1,
            num_microbatches=Nm,
            schedule="gpipe",
            recompute=True,
            stage_segments=_even(12, P),
        ),
    )
    F = F_PER_SEGMENT * 12 / P
    B, R = 2 * F, F
    ideal = Nm * (F + B) + (Nm - 1) * R
    assert r.minibatch_s == pytest.approx(ideal + (P - 1) * (F + B), rel=1e-12)


@pytest.mark.parametrize("v", [2, 4])
@pytest.mark.parametrize("P,Nm", [(4, 8), (4, 4), (2, 6)])
def test_interleaved_bubble_is_divided_by_chunks(v, P, Nm):
    cal = _uniform(16)
    r = simulate(
        cal,
        SimConfig(
            num_stages=P,
            micro_batch_size=1,
            num_microbatches=Nm,
            schedule="interleaved",
            chunks=v,
            recompute=False,
            stage_segments=_even(16, P * v),
        ),
    )
    W = 3 * F_PER_SEGMENT * 16 / P  # F+B of one micro-batch on one device, all its chunks
    ideal = Nm * W
    assert (r.minibatch_s - ideal) / ideal == pytest.approx((P - 1) / (v * Nm), rel=1e-9)


def test_interleaved_needs_nm_multiple_of_p():
    with pytest.raises(ValueError, match="multiple of P=4"):
        simulate(
            _uniform(16),
            SimConfig(num_stages=4, micro_batch_size=1, num_microbatches=6, schedule="interleaved", chunks=2),
        )
    order = interleaved_order(4, 8, 2, stage=1)
    assert sorted((t.op, t.microbatch, t.chunk) for t in order) == sorted(
        (op, i, c) for op in "FB" for i in range(8) for c in range(2)
    )


@pytest.mark.parametrize("P,Nm", [(4, 8), (6, 6), (5, 20)])
def test_1f1b_peak_stash_is_p_minus_r(P, Nm):
    r = simulate(
        _uniform(30),
        SimConfig(num_stages=P, micro_batch_size=1, num_microbatches=Nm, schedule="1f1b", recompute=False),
    )
    assert r.peak_stashed == tuple(P - k for k in range(P))
    g = simulate(
        _uniform(30),
        SimConfig(num_stages=P, micro_batch_size=1, num_microbatches=Nm, schedule="gpipe", recompute=False),
    )
    assert g.peak_stashed == (Nm,) * P


def test_varuna_last_stage_never_recomputes():
    P, Nm = 4, 10
    r = simulate(_uniform(8), SimConfig(num_stages=P, micro_batch_size=1, num_microbatches=Nm))
    executed = r.executed[0]
    assert not any(t.op == RECOMPUTE for t in executed[P - 1])
    for k in range(P - 1):
        assert sum(t.op == RECOMPUTE for t in executed[k]) >= Nm - 1
    F = F_PER_SEGMENT * 2
    assert r.stage_busy_s[P - 1] == pytest.approx(Nm * 3 * F)  # F+B only


# -- the simulator drives the shared StagePolicy ------------------------------------------


@pytest.mark.parametrize(
    "kind,recompute", [("varuna", True), ("gpipe", True), ("gpipe", False), ("1f1b", True), ("1f1b", False)]
)
@pytest.mark.parametrize("P,Nm", [(2, 3), (4, 6), (5, 12)])
def test_executed_order_is_the_static_list_without_jitter(kind, recompute, P, Nm):
    # One segment per stage: F=R=0.01, B=0.02 (the unit ratio the varuna lists are derived with)
    # and free links; the baselines run their lists strictly anyway.
    r = simulate(
        _uniform(P),
        SimConfig(num_stages=P, micro_batch_size=1, num_microbatches=Nm, schedule=kind, recompute=recompute),
    )
    assert tuple(tuple(s) for s in r.executed[0]) == get_schedule(kind, P, Nm, recompute).stages


def _replay_stage(timeline: Timeline, policy: StagePolicy, durations: dict[str, float]) -> list[Task]:
    """Drive ``policy`` by hand with the arrival times the simulation recorded for its stage."""
    k = policy.stage
    arrivals = sorted(
        [(e.end_s, FORWARD, e.microbatch) for e in timeline.events if e.op == "SEND_ACT" and e.stage == k - 1]
        + [
            (e.end_s, BACKWARD, e.microbatch)
            for e in timeline.events
            if e.op == "SEND_GRAD" and e.stage == k + 1
        ]
    )
    now, pos, order = 0.0, 0, []
    while not policy.finished:
        while pos < len(arrivals) and arrivals[pos][0] <= now + 1e-9:
            policy.arrived(arrivals[pos][1], arrivals[pos][2])
            pos += 1
        task = policy.next_task()
        if task is None:
            now = arrivals[pos][0]
            continue
        order.append(task)
        now += durations[task.op]
        policy.complete(task)
    return order


def test_simulator_and_hand_driven_policy_agree_under_jitter():
    cal = _uniform(
        8,
        act_bytes_per_example=1e6,
        inter=LinkModel(latency_s=0.002, bandwidth_bytes_per_s=1e9, jitter_s=0.03),
    )
    P, Nm = 4, 12
    deviated = False
    for seed in range(4):
        r = simulate(
            cal, SimConfig(num_stages=P, micro_batch_size=1, num_microbatches=Nm, seed=seed), record=True
        )
        sched = get_schedule("varuna", P, Nm)
        F = 2 * F_PER_SEGMENT
        for k in range(P):
            order = _replay_stage(r.timeline, sched.policy(k), {"F": F, "R": F, "B": 2 * F})
            assert order == list(r.executed[0][k])
            deviated |= tuple(order) != sched.stages[k]
    assert deviated, "jitter this large should make some stage leave its static list"


def test_task_jitter_keeps_mean_task_cost_and_is_seeded():
    cal = _uniform(4)
    base = dict(num_stages=4, micro_batch_size=1, num_microbatches=8, allreduce=False, optimizer=False)
    exact = simulate(cal, SimConfig(**base))
    assert simulate(cal, SimConfig(**base, task_jitter_s=0.0)).minibatch_s == exact.minibatch_s
    runs = [simulate(cal, SimConfig(**base, task_jitter_s=0.002, seed=s)) for s in range(40)]
    # Every task's duration is cost - j + Exp(j): busy time per stage keeps its mean ...
    for k in range(4):
        mean_busy = sum(r.stage_busy_s[k] for r in runs) / len(runs)
        assert mean_busy == pytest.approx(exact.stage_busy_s[k], rel=0.02)
    # ... but not its value in any one run.
    assert len({r.stage_busy_s[0] for r in runs}) == len(runs)
    assert len({r.minibatch_s for r in runs}) > 1
    again = simulate(cal, SimConfig(**base, task_jitter_s=0.002, seed=3))
    assert again.minibatch_s == runs[3].minibatch_s and again.executed == runs[3].executed
    with pytest.raises(ValueError, match="task_jitter_s"):
        simulate(cal, SimConfig(**base, task_jitter_s=-1.0))


def test_jitter_is_seeded():
    cal = _uniform(
        8,
        act_bytes_per_example=1e6,
        inter=LinkModel(latency_s=0.002, bandwidth_bytes_per_s=1e9, jitter_s=0.005),
    )
    cfg = SimConfig(num_stages=4, micro_batch_size=1, num_microbatches=8, seed=7)
    a, b = simulate(cal, cfg), simulate(cal, cfg)
    assert a.minibatch_s == b.minibatch_s and a.executed == b.executed
    c = simulate(cal, SimConfig(num_stages=4, micro_batch_size=1, num_microbatches=8, seed=8))
    assert c.minibatch_s != a.minibatch_s
    still = simulate(cal, SimConfig(num_stages=4, micro_batch_size=1, num_microbatches=8, jitter_scale=0.0))
    assert (
        still.minibatch_s
        == simulate(
            cal, SimConfig(num_stages=4, micro_batch_size=1, num_microbatches=8, jitter_scale=0.0, seed=99)
        ).minibatch_s
    )


# -- communication, all-reduce, optimizer ------------------------------------------------


def test_point_to_point_uses_intra_or_inter_link_by_placement():
    intra = LinkModel(latency_s=0.001, bandwidth_bytes_per_s=1e9)
    inter = LinkModel(latency_s=0.005, bandwidth_bytes_per_s=1e8)
    cal = _uniform(2, act_bytes_per_example=1e6, intra=intra, inter=inter)
    F, B = F_PER_SEGMENT, 2 * F_PER_SEGMENT
    for slots, link in ((2, intra), (1, inter)):
        r = simulate(
            cal,
            SimConfig(
                num_stages=2,
                micro_batch_size=1,
                num_microbatches=1,
                schedule="gpipe",
                recompute=False,
                host_slots=slots,
            ),
        )
        assert r.minibatch_s == pytest.approx(2 * F + 2 * B + 2 * link.time_s(1e6))


def test_link_is_fifo_with_a_concurrency_limit():
    # Serializing a message takes S, longer than F: with one message at a time, activation i
    # arrives (i+1)·S after the first forward ends (and gradients likewise on the way back).
    S, N = 0.05, 6
    cal = _uniform(
        2, act_bytes_per_example=1e6, inter=LinkModel(latency_s=0.0, bandwidth_bytes_per_s=1e6 / S)
    )
    F, B = F_PER_SEGMENT, 2 * F_PER_SEGMENT
    one = simulate(
        cal,
        SimConfig(
            num_stages=2,
            micro_batch_size=1,
            num_microbatches=N,
            schedule="gpipe",
            recompute=False,
            max_sends_per_link=1,
        ),
    )
    assert one.minibatch_s == pytest.approx(2 * F + 2 * B + 2 * N * S)
    two = simulate(
        cal,
        SimConfig(
            num_stages=2,
            micro_batch_size=1,
            num_microbatches=N,
            schedule="gpipe",
            recompute=False,
            max_sends_per_link=2,
        ),
    )
    assert two.minibatch_s < one.minibatch_s - S
    # Latency is not occupancy: a long latency delays every message once, it does not queue them.
    lat = simulate(
        _uniform(2, act_bytes_per_example=0, inter=LinkModel(latency_s=S, bandwidth_bytes_per_s=1e9)),
        SimConfig(num_stages=2, micro_batch_size=1, num_microbatches=N, schedule="gpipe", recompute=False),
    )
    assert lat.minibatch_s == pytest.approx((N + 1) * (F + B) + 2 * S)


def test_jitter_keeps_the_mean_delay_and_never_reorders_a_link():
    # Mean delay 10 ms with 4 ms jitter: fixed 6 ms + Exponential(mean 4 ms) per message.
    cal = _uniform(
        2, act_bytes_per_example=0, inter=LinkModel(latency_s=0.01, bandwidth_bytes_per_s=1e9, jitter_s=0.004)
    )
    N = 400
    r = simulate(
        cal,
        SimConfig(
            num_stages=2, micro_batch_size=1, num_microbatches=N, schedule="gpipe", recompute=False, seed=3
        ),
        record=True,
    )
    sends = [e for e in r.timeline.events if e.op == "SEND_ACT"]
    delays = [e.duration_s for e in sends]
    assert min(delays) >= 0.006 - 1e-12
    assert sum(delays) / N == pytest.approx(0.01, rel=0.15)
    arrivals = [e.end_s for e in sorted(sends, key=lambda e: e.microbatch)]
    assert arrivals == sorted(arrivals)


def test_allreduce_and_optimizer_costs_appear():
    ar = AllReduceModel(bandwidth_bytes_per_s=1e9, latency_s=1e-3, contention=1.0)
    cal = _uniform(4, param_bytes=10**7, allreduce=ar, optimizer_s_per_param_byte=1e-9)
    F, B, Nm = 4 * F_PER_SEGMENT, 8 * F_PER_SEGMENT, 3
    # P=1, D=4, one GPU per host: each host carries one ring, k=1.
    r = simulate(cal, SimConfig(num_stages=1, num_replicas=4, micro_batch_size=1, num_microbatches=Nm))
    grads = 4 * 10**7
    expect_ar = 2 * 3 / 4 * grads / 1e9 + 3 * 1e-3
    assert r.stage_allreduce_s[0] == pytest.approx(expect_ar)
    assert r.stage_optimizer_s[0] == pytest.approx(grads * 1e-9)
    assert r.minibatch_s == pytest.approx(Nm * (F + B) + expect_ar + grads * 1e-9)
    # P=2 stages of one replica share each 2-slot host: two rings per NIC, bandwidth term doubles.
    r2 = simulate(
        cal,
        SimConfig(
            num_stages=2,
            num_replicas=2,
            micro_batch_size=1,
            num_microbatches=Nm,
            host_slots=2,
            optimizer=False,
        ),
    )
    half = 2 * 10**7
    assert r2.stage_allreduce_s[0] == pytest.approx(2 * 1 / 2 * half / 1e9 * 2 + 1e-3)
    no = simulate(
        cal,
        SimConfig(
            num_stages=2,
            num_replicas=2,
            micro_batch_size=1,
            num_microbatches=Nm,
            host_slots=2,
            optimizer=False,
            allreduce=False,
        ),
    )
    assert r2.minibatch_s > no.minibatch_s


def test_uneven_replicas_and_short_last_microbatch():
    cal = _uniform(2, micro_batch_sizes=(1, 2))
    counts, last = microbatch_counts(global_batch_size=9, micro_batch_size=2, data_parallel=2)
    assert (counts, last) == ((3, 2), (2, 1))  # 5 micro-batches, the last holds 1 example
    r = simulate(
        cal,
        SimConfig(
            num_stages=1,
            num_replicas=2,
            micro_batch_size=2,
            num_microbatches=counts,
            last_microbatch_sizes=last,
        ),
    )
    F2 = 2 * F_PER_SEGMENT * 2
    assert r.minibatch_s == pytest.approx(3 * 3 * F2)  # the replica with 3 full micro-batches
    assert r.examples == 9
    assert r.examples_per_s == pytest.approx(9 / r.minibatch_s)
    alone = simulate(
        cal,
        SimConfig(
            num_stages=1, num_replicas=1, micro_batch_size=2, num_microbatches=2, last_microbatch_sizes=(1,)
        ),
    )
    assert alone.minibatch_s == pytest.approx(3 * F2 + 3 * F2 / 2)


def test_split_matches_the_runtime_batching():
    batching = pytest.importorskip("varuna.core.batching")
    for M, m, D in [(10, 4, 2), (8192, 3, 28), (100, 7, 5), (64, 8, 8)]:
        plan = batching.plan_microbatches(M, m, D)
        cfg = SimConfig.for_global_batch(
            global_batch_size=M, num_replicas=D, micro_batch_size=m, num_stages=1
        )
        assert cfg.num_microbatches == tuple(len(p) for p in plan)
        assert cfg.last_microbatch_sizes == tuple(p[-1].size for p in plan)


# -- the policy's fast bookkeeping equals the plain scan ------------------------------------


class _ScanPolicy:
    """StagePolicy's rules as first written (a scan of the remaining list); the reference."""

    def __init__(self, tasks, stage, num_stages, opportunistic, headroom):
        self.tasks, self.stage, self.num_stages, self.opportunistic = (
            tuple(tasks),
            stage,
            num_stages,
            opportunistic,
        )
        self.headroom = headroom
        self.fills = self.feeds = 0
        self.done, self.act, self.grad = set(), set(), set()
        self.recomputed = {t.microbatch for t in self.tasks if t.op == RECOMPUTE}
        self.awaiting_b, self.next_f = None, 0

    def ready(self, t):
        i = t.microbatch
        if t in self.done:
            return False
        if t.op == FORWARD:
            return i == self.next_f and (self.stage == 0 or i in self.act)
        if t.op == RECOMPUTE:
            return Task(FORWARD, i) in self.done
        if Task(FORWARD, i) not in self.done:
            return False
        if i in self.recomputed and Task(RECOMPUTE, i) not in self.done:
            return False
        return self.stage == self.num_stages - 1 or i in self.grad

    def next_task(self):
        if self.awaiting_b is not None:
            b = Task(BACKWARD, self.awaiting_b)
            if self.ready(b):
                return b
            # Filling the wait: the next forward, if it keeps no graph and the stash has room.
            if self._graphless_forward_fits():
                self.fills += 1
                return Task(FORWARD, self.next_f)
            return None
        rest = [t for t in self.tasks if t not in self.done]
        if not rest:
            return None
        if self.ready(rest[0]):
            return self._feed(rest[0])
        if not self.opportunistic:
            return None
        for t in rest[1:]:
            if self.ready(t) and not (t.op == RECOMPUTE and t.microbatch not in self.grad):
                return self._feed(t)
        return None

    def _graphless_forward_fits(self):
        f = Task(FORWARD, self.next_f)
        live = sum(t.op == FORWARD for t in self.done) - sum(t.op == BACKWARD for t in self.done)
        return (
            self.opportunistic
            and f in self.tasks
            and self.ready(f)
            and self.next_f in self.recomputed
            and live < peak_stashed(self.tasks) + self.headroom
        )

    def _feed(self, t):
        # Keeping the next stage fed: fewer micro-batches downstream than the list has at R_i.
        if t.op != RECOMPUTE or self.stage == self.num_stages - 1:
            return t
        listed_before = self.tasks[: self.tasks.index(t)]
        planned = sum(u.op == FORWARD for u in listed_before) - t.microbatch
        downstream = self.next_f - sum(Task(FORWARD, g) in self.done for g in self.grad)
        if downstream < planned and self._graphless_forward_fits():
            self.feeds += 1
            return Task(FORWARD, self.next_f)
        return t

    def complete(self, t):
        self.done.add(t)
        if t.op == FORWARD:
            self.next_f += 1  # rule 2 stays in force across a forward that filled the wait
        else:
            self.awaiting_b = t.microbatch if t.op == RECOMPUTE else None


@pytest.mark.parametrize("kind", ["varuna", "gpipe", "1f1b"])
def test_stage_policy_matches_reference_scan(kind):
    rng = random.Random(1234)
    fills = feeds = 0
    for trial in range(60):
        P, N = rng.randint(1, 6), rng.randint(1, 14)
        sched = get_schedule(kind, P, N, rng.random() < 0.5)
        k = rng.randrange(P)
        headroom = rng.choice([0, 1, 3])
        fast = sched.policy(k, stash_headroom=headroom)
        ref = _ScanPolicy(sched.stages[k], k, P, sched.opportunistic, headroom)
        pending = [(FORWARD, i) for i in range(N)] + [(BACKWARD, i) for i in range(N)]
        rng.shuffle(pending)
        while not fast.finished:
            if pending and rng.random() < 0.6:  # arrivals in random order, interleaved with work
                op, i = pending.pop()
                fast.arrived(op, i)
                (ref.act if op == FORWARD else ref.grad).add(i)
            a, b = fast.next_task(), ref.next_task()
            assert a == b, (kind, P, N, k, trial)
            if a is not None and rng.random() < 0.8:
                fast.complete(a)
                ref.complete(a)
            elif a is None and not pending:
                break
        assert fast.finished == (len(ref.done) == len(ref.tasks))
        fills += ref.fills
        feeds += ref.feeds
    # The random arrivals exercise both out-of-list forwards (opportunistic lists only).
    assert (fills > 0) == (kind == "varuna")
    assert (feeds > 0) == (kind == "varuna")


# -- auto-configuration ------------------------------------------------------------------------


def _autoconfig_cal(**kw) -> Calibration:
    # 12 segments, m=1 only, gpipe without recompute and free links: T(P) has a closed form.
    return Calibration.synthetic(F_PER_SEGMENT, num_segments=12, micro_batch_sizes=(1,), **kw)


def test_autoconfig_picks_the_analytically_best_config():
    # G=4, M=24, m=1: D = 4 // P, Nm = 24 / D. Pipeline: (Nm + P - 1)(F+B) with F = 0.01·12/P.
    # All-reduce of stage 0 (the last to finish, all stages equal) follows: 2(D-1)/D·bytes/bw.
    param = 10**6
    bw = 1.5 * 12 * param / 0.5  # makes the all-reduce of the whole model over D=4 take 0.5 s
    cal = _autoconfig_cal(
        param_bytes=param, allreduce=AllReduceModel(bandwidth_bytes_per_s=bw, latency_s=0.0)
    )

    def expected(P: int) -> float:
        D = 4 // P
        Nm = 24 // D
        F = F_PER_SEGMENT * 12 / P
        ar = 2 * (D - 1) / D * (12 * param / P) / bw if D > 1 else 0.0
        return (Nm + P - 1) * 3 * F + ar

    # P=1: 2.16+0.5, P=2: 2.34+0.167, P=3: 3.12, P=4: 2.43 -> P=4 wins, then 2, 1, 3.
    plan = autoconfigure(
        cal, gpus=4, global_batch_size=24, schedule="gpipe", recompute=False, exhaustive=True
    )
    got = {c.num_stages: c.minibatch_s for c in plan.candidates}
    for P in (1, 2, 3, 4):
        assert got[P] == pytest.approx(expected(P), rel=1e-9)
    assert [c.num_stages for c in plan.candidates] == [4, 2, 1, 3]
    pruned = autoconfigure(cal, gpus=4, global_batch_size=24, schedule="gpipe", recompute=False)
    assert (pruned.best.num_stages, pruned.best.num_replicas) == (4, 1)
    assert pruned.best.examples_per_s == pytest.approx(24 / expected(4))


@pytest.mark.parametrize("schedule", ["varuna", "1f1b", "gpipe"])
def test_lower_bound_never_exceeds_the_simulation(schedule):
    cal = Calibration.synthetic(
        [0.002] + [0.01] * 14 + [0.02],
        micro_batch_sizes=(1, 2, 4),
        overhead_s=0.002,
        param_bytes=5 * 10**7,
        act_bytes_per_example=2e6,
        intra=LinkModel(latency_s=1e-5, bandwidth_bytes_per_s=1e10),
        inter=LinkModel(latency_s=2e-4, bandwidth_bytes_per_s=1e9),
        allreduce=AllReduceModel(bandwidth_bytes_per_s=1e9, latency_s=1e-4, contention=0.8),
        optimizer_s_per_param_byte=1e-11,
    )
    for gpus, M, slots in [(12, 96, 4), (16, 37, 2)]:
        full = autoconfigure(
            cal, gpus=gpus, global_batch_size=M, schedule=schedule, host_slots=slots, exhaustive=True
        )
        for c in full.candidates:
            assert c.lower_bound_s <= c.minibatch_s * (1 + 1e-9), (c.num_stages, c.num_replicas)
        fast = autoconfigure(cal, gpus=gpus, global_batch_size=M, schedule=schedule, host_slots=slots)
        assert fast.best.minibatch_s == full.best.minibatch_s
        assert fast.simulations <= full.simulations


def test_memory_pruning_and_too_few_gpus():
    # Static memory: 4 bytes per parameter byte (param + grad + 2× optimizer) = 4 MB per segment.
    cal = _autoconfig_cal(param_bytes=10**6, act_bytes_per_example=1000)
    memory = 17 * 10**6  # 4 segments per stage fit, 6 do not: P >= 3
    plan = autoconfigure(cal, gpus=8, global_batch_size=32, gpu_memory_bytes=memory)
    by_p = {c.num_stages: c for c in plan.candidates}
    assert by_p[1].status == by_p[2].status == "no-memory"
    assert plan.best.num_stages >= 3
    assert all(c.memory_bytes <= memory for c in plan.candidates if c.status == "simulated")
    with pytest.raises(ValueError) as info:
        autoconfigure(cal, gpus=2, global_batch_size=32, gpu_memory_bytes=memory)
    assert "needs at least P=3 pipeline stages" in str(info.value) and "ask for at least 3 GPUs" in str(
        info.value
    )
    with pytest.raises(ValueError, match="does not fit .* even at P=12"):
        autoconfigure(cal, gpus=16, global_batch_size=32, gpu_memory_bytes=10**6)


def test_autoconfig_errors():
    cal = _autoconfig_cal()
    with pytest.raises(
        ValueError, match=r"calibration lacks micro-batch size m=8 \(has 1\); re-run varuna-profile"
    ):
        autoconfigure(cal, gpus=4, global_batch_size=64, micro_batch_size=8)
    with pytest.raises(ValueError, match="unknown schedule kind 'zb'; choose one of varuna, gpipe, 1f1b"):
        autoconfigure(cal, gpus=4, global_batch_size=64, schedule="zb")
    with pytest.raises(ValueError, match="unknown schedule kind"):
        sweep_gpus(cal, [2, 4], global_batch_size=64, schedule="zb")


def test_micro_batch_size_choice_and_gpu_sweep():
    cal = Calibration.synthetic(0.01, num_segments=8, overhead_s=0.002, micro_batch_sizes=(1, 2, 4, 8))
    # F(m)/m per segment: 0.012, 0.011 (-8%), 0.0105 (-4.5%): m=2 is where it stops paying.
    assert choose_micro_batch_size(cal) == 2
    points = sweep_gpus(cal, [1, 2, 4, 8], global_batch_size=64)
    rates = [p.examples_per_s for p in points]
    assert rates == sorted(rates) and rates[0] > 0
    assert all(p.examples_per_s_per_gpu == pytest.approx(p.examples_per_s / p.gpus) for p in points)


def test_balanced_partition_minimises_the_costliest_stage():
    rng = random.Random(5)
    for _ in range(40):
        n = rng.randint(1, 9)
        full = [rng.uniform(0.5, 3.0) for _ in range(n)]
        last = [x * rng.uniform(0.5, 1.0) for x in full]
        P = rng.randint(1, n)
        got = max(stage_costs(full, last, balanced_stages(full, last, P)))
        # brute force over all cut positions
        best = min(
            max(stage_costs(full, last, [(a, b - 1) for a, b in zip((0,) + cuts, cuts + (n,))]))
            for cuts in itertools.combinations(range(1, n), P - 1)
        )
        assert got == pytest.approx(best)


# -- varuna-simulate -------------------------------------------------------------------------


@pytest.fixture()
def cal_file(tmp_path):
    path = tmp_path / "cal.json"
    Calibration.synthetic(
        0.01,
        num_segments=8,
        micro_batch_sizes=(1, 2, 4),
        overhead_s=0.003,
        inter=LinkModel(latency_s=1e-4, bandwidth_bytes_per_s=1e9, jitter_s=1e-4),
        allreduce=AllReduceModel(bandwidth_bytes_per_s=1e9, latency_s=1e-4),
    ).save(path)
    return str(path)


def test_cli_table(cal_file, capsys):
    assert main(["--calibration", cal_file, "--gpus", "8", "--global-batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("best: P=") and "examples/s" in out and "simulated" in out


def test_cli_json_lists_every_candidate(cal_file, capsys):
    assert (
        main(
            [
                "--calibration",
                cal_file,
                "--gpus",
                "8",
                "--global-batch-size",
                "64",
                "--json",
                "--sweep-gpus",
                "4,8",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert {c["P"] for c in data["candidates"]} == set(range(1, 9))
    assert data["best"]["examples_per_s"] == max(c["examples_per_s"] or 0 for c in data["candidates"])
    assert [p["gpus"] for p in data["sweep"]] == [4, 8]


def test_cli_trace_and_plot(cal_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    trace, png = tmp_path / "t.json", tmp_path / "g.png"
    rc = main(
        [
            "--calibration",
            cal_file,
            "--gpus",
            "8",
            "--global-batch-size",
            "64",
            "--config",
            "4x2",
            "--trace",
            str(trace),
            "--plot",
            str(png),
            "--jitter-scale",
            "1",
        ]
    )
    assert rc == 0
    assert "time per mini-batch" in capsys.readouterr().out
    tl = Timeline.from_chrome_trace(trace)
    assert {e.stage for e in tl.events} == {0, 1, 2, 3}
    assert sum(e.op == "F" for e in tl.events) == 4 * 8 * len({e.replica for e in tl.events})
    raw = png.read_bytes()
    assert raw[:4] == b"\x89PNG" and len(raw) > 20_000


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--gpus", "8", "--global-batch-size", "64"], "required: --calibration"),
        (["--gpus", "8", "--global-batch-size", "64", "--schedule", "zb"], "unknown schedule kind 'zb'"),
        (["--gpus", "8", "--global-batch-size", "64", "--config", "4x4"], "needs 16 GPUs but --gpus is 8"),
        (["--gpus", "8", "--global-batch-size", "64", "--config", "four"], "write PxD"),
        (["--gpus", "8", "--global-batch-size", "64", "--micro-batch-size", "0"], "positive integer"),
        (["--gpus", "8", "--global-batch-size", "64", "--gpu-memory", "lots"], "16GiB"),
    ],
)
def test_cli_bad_input_is_one_line_and_status_2(cal_file, capsys, argv, needle):
    if "--calibration" not in argv and needle != "required: --calibration":
        argv = ["--calibration", cal_file] + argv
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("varuna-simulate: error: ") and err.count("\n") == 1 and needle in err
    assert "Traceback" not in err


def test_cli_reports_calibration_errors(tmp_path, capsys):
    bad = tmp_path / "old.json"
    data = Calibration.synthetic(0.01, num_segments=2).to_dict()
    data["version"] = 0
    bad.write_text(json.dumps(data))
    assert main(["--calibration", str(bad), "--gpus", "2", "--global-batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "unsupported calibration version 0" in err and err.count("\n") == 1
