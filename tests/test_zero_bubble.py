"""Zero-bubble kinds (``zb-h1``, ``varuna-zb``): the lists, the policy, the split backward, the
simulator's W tasks, and the engine against the single-process reference.

References: ZB-H1's bubble from Qi et al. (ICLR'24), (P-1)(F+B-W) against 1F1B's (P-1)(F+B+W);
a whole ``backward()`` for the split backward (bitwise); plain autograd over the whole model
(``tests/models.py``, tolerance 1e-5 relative per tensor, as tests/test_engine.py) and the 1×1
deterministic run (bitwise) for the engine.
"""

from __future__ import annotations

import pytest
import torch
from distributed import check_ok, run_world
from test_determinism import run as det_run
from test_engine import WORKER, assert_close, load, merged_grads, reference

from simulator.engine import SimConfig, simulate
from varuna.core.calibration import Calibration
from varuna.core.schedule import get_schedule, schedule_kind
from varuna.core.tasks import BACKWARD, FORWARD, RECOMPUTE, WEIGHT, Task, parse_tasks
from varuna.core.zero_bubble import ZeroBubblePolicy, peak_in_flight, validate_split_tasks, zb_h1_order
from varuna.runtime.split_backward import backward_input, backward_weight
from varuna.testing.emulated import EmulatedBlock

KINDS = ("zb-h1", "varuna-zb")


# --------------------------------------------------------------------------------------------
# The lists


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recompute", [False, True])
def test_lists_are_well_formed_and_keep_P_in_flight(kind, recompute):
    for P in range(1, 7):
        for N in range(1, 11):
            sched = get_schedule(kind, P, N, recompute)
            for k, tasks in enumerate(sched.stages):
                validate_split_tasks(tasks, N)
                # ZB-H1: every stage holds what 1F1B's first stage holds, min(P, Nm) micro-batches.
                assert peak_in_flight(tasks) == min(P, N), (kind, P, N, k)
                rec = schedule_kind(kind).recomputes(P, k, recompute=recompute)
                has_r = any(t.op == RECOMPUTE for t in tasks)
                assert has_r == (rec and N >= 2), (kind, P, N, k)
                assert k < P - 1 or not has_r, "the last stage runs B_i right after F_i"


def test_validation_rejects_a_w_before_its_b():
    with pytest.raises(ValueError, match="F0, B0 and W0 in that order"):
        validate_split_tasks(parse_tasks("F0 W0 B0"), 1)
    with pytest.raises(ValueError, match="R0 must directly precede B0"):
        validate_split_tasks(parse_tasks("F0 R0 F1 B0 W0 B1 W1"), 2)


@pytest.mark.parametrize("P,N", [(2, 2), (3, 6), (4, 4), (4, 16), (6, 12)])
def test_zb_h1_bubble_is_a_third_of_1f1b(P, N):
    # Balanced stages, F = 20 ms, B = 40 ms split into B = W = 20 ms (the default halves), instant
    # links: the paper's bubbles (P-1)(F+B+W) for 1F1B and (P-1)(F+B-W) for ZB-H1.
    cal = Calibration.synthetic(0.01, num_segments=2 * P, micro_batch_sizes=(1,))
    common = dict(num_stages=P, micro_batch_size=1, num_microbatches=N, recompute=False, allreduce=False,
                  optimizer=False, step_overhead_s=0.0, task_overhead_s=0.0, placeholder_s=0.0,
                  jitter_scale=0)
    F, B = 0.02, 0.04
    one = simulate(cal, SimConfig(schedule="1f1b", **common)).minibatch_s
    zb = simulate(cal, SimConfig(schedule="zb-h1", **common)).minibatch_s
    assert one == pytest.approx(N * (F + B) + (P - 1) * (F + B), rel=1e-9)
    assert zb == pytest.approx(N * (F + B) + (P - 1) * F, rel=1e-9)
    assert (zb - N * (F + B)) == pytest.approx((one - N * (F + B)) / 3, rel=1e-9)


# --------------------------------------------------------------------------------------------
# The policy


def _run_on_time(tasks, stage, P, opportunistic):
    """Drive a policy whose inputs are all there before they are needed."""
    pol = ZeroBubblePolicy(tasks, stage, P, opportunistic)
    n = 1 + max(t.microbatch for t in tasks)
    for i in range(n):
        pol.arrived(FORWARD, i)
        pol.arrived(BACKWARD, i)
    while not pol.finished:
        t = pol.next_task()
        assert t is not None, f"stage {stage} stalled after {pol.executed}"
        pol.complete(t)
    return pol.executed


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("P,N", [(2, 5), (3, 3), (4, 8)])
def test_executed_order_is_the_static_list_when_inputs_are_on_time(kind, P, N):
    sched = get_schedule(kind, P, N, True)
    for k in range(P):
        assert _run_on_time(sched.stages[k], k, P, sched.opportunistic) == list(sched.stages[k])


def test_a_late_gradient_is_filled_with_a_deferred_w_only_opportunistically():
    # List F0 F1 B0 B1 W0 W1 on stage 0 of P=2; gradient 0 arrives, gradient 1 is late.
    got = {}
    for opportunistic in (False, True):
        pol = ZeroBubblePolicy(parse_tasks("F0 F1 B0 B1 W0 W1"), 0, 2, opportunistic)
        pol.arrived(BACKWARD, 0)
        for expected in ("F0", "F1", "B0"):
            task = pol.next_task()
            assert str(task) == expected
            pol.complete(task)
        got[opportunistic] = pol.next_task()
    assert got[True] == Task(WEIGHT, 0)  # W0 fills the wait for B1's gradient
    assert got[False] is None  # negative control: the strict policy waits at the head B1


def test_opportunistic_stash_stays_within_the_bound_under_jitter():
    cal = Calibration.synthetic(0.01, num_segments=8, micro_batch_sizes=(1,))
    deviated = False
    for seed in range(3):
        cfg = SimConfig(num_stages=4, micro_batch_size=1, num_microbatches=16, schedule="varuna-zb",
                        extra_latency_s=0.01, jitter_scale=1.0, task_jitter_s=0.005, seed=seed)
        res = simulate(cal, cfg)
        sched = get_schedule("varuna-zb", 4, 16)
        for k in range(4):
            assert res.peak_stashed[k] <= peak_in_flight(sched.stages[k]) + cfg.stash_headroom
            assert sorted(res.executed[0][k]) == sorted(sched.stages[k])
            deviated |= list(res.executed[0][k]) != list(sched.stages[k])
    assert deviated, "varuna-zb never left its list under jitter"


def test_bad_inputs_are_named():
    pol = ZeroBubblePolicy(zb_h1_order(2, 2, 0), 0, 2)
    with pytest.raises(ValueError, match="micro-batches 0..1"):
        pol.arrived(FORWARD, 5)
    cal = Calibration.synthetic(0.01, num_segments=2, micro_batch_sizes=(1,))
    with pytest.raises(ValueError, match="weight_grad_fraction must lie in"):
        simulate(cal, SimConfig(num_stages=2, micro_batch_size=1, num_microbatches=2, schedule="zb-h1",
                                weight_grad_fraction=1.5))


# --------------------------------------------------------------------------------------------
# The split backward


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.GELU(), torch.nn.Linear(8, 6)
    )


def _twice(net, x):
    v = net[0].weight[:6, :6] * 2  # one weight-only node entered from two boundary nodes
    return net(x) @ v + x @ v


@pytest.mark.parametrize("model,input_grad,split", [("mlp", True, True), ("mlp", False, True),
                                                     ("twice", True, False)])
def test_split_backward_equals_one_backward_bitwise(model, input_grad, split):
    net = _mlp()
    fn = (lambda x: net(x)) if model == "mlp" else (lambda x: _twice(net, x))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 6, generator=g) for _ in range(3)]
    gs = [torch.randn(3, 6, generator=g) for _ in range(3)]
    ref_x = []
    for x, go in zip(xs, gs):  # reference: one whole backward per micro-batch
        x = x.clone().requires_grad_(input_grad)
        fn(x).backward(go)
        ref_x.append(x.grad)
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    works = []
    for x, go, rx in zip(xs, gs, ref_x):
        x = x.clone().requires_grad_(input_grad)
        got, work = backward_input([fn(x)], [go], [x] if input_grad else [])
        assert work.split == split
        if input_grad:
            assert torch.equal(got[0], rx)
        works.append(work)
    # Negative control: B alone leaves the parameters without gradients; the W's bring them.
    assert all(p.grad is None for p in net.parameters())
    for work in works:
        backward_weight(work)
    for p, r in zip(net.parameters(), ref):
        assert torch.equal(p.grad, r)


def test_emulated_block_b_runs_the_input_half_and_w_the_weight_half():
    block = EmulatedBlock(0.0, 4)
    x = torch.randn(2, 4, requires_grad=True)
    y = block(x)
    torch.testing.assert_close(y, x * block.scale + block.bias, rtol=0, atol=0)
    (gx,), work = backward_input([y], [torch.ones(2, 4)], [x])
    assert block.num_backward == 0 and block.scale.grad is None  # the weight half did not run
    backward_weight(work)
    assert block.num_backward == 1
    torch.testing.assert_close(block.scale.grad, x.detach().sum(0), rtol=0, atol=0)
    torch.testing.assert_close(gx, block.scale.detach().expand(2, 4), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# The engine (real processes, gloo)


@pytest.mark.slow
@pytest.mark.parametrize("P,D", [(2, 2), (3, 1), (4, 1)])
def test_engine_equals_single_process(tmp_path, P, D):
    """The tiny GPT (tied embedding on the first and last stage, dropout) at P×D, both kinds."""
    check_ok(run_world(WORKER, P * D, ["--out", str(tmp_path), "--schedules", ",".join(KINDS)],
                       env={"VARUNA_PIPELINE_DEPTH": str(P)}))
    ref_loss, ref_grads, _ = reference()
    for kind in KINDS:
        ranks = load(tmp_path, kind)
        assert len(ranks) == P * D
        for _, rep in ranks:
            assert rep["loss"] == pytest.approx(ref_loss, rel=1e-6), f"{kind}: loss on stage {rep['stage']}"
            assert sorted(rep["executed"][0]) == sorted(rep["static"])
            if kind == "zb-h1":  # strict: always the static list
                assert rep["executed"][0] == rep["static"]
            assert any(t.startswith("W") for t in rep["executed"][0])
        assert_close(merged_grads(ranks), ref_grads, f"{kind} {P}x{D}")


@pytest.mark.slow
def test_engine_without_recompute_equals_single_process(tmp_path):
    check_ok(run_world(WORKER, 2, ["--out", str(tmp_path), "--schedules", "zb-h1", "--no-recompute"],
                       env={"VARUNA_PIPELINE_DEPTH": "2"}))
    _, ref_grads, _ = reference()
    ranks = load(tmp_path, "zb-h1")
    assert not any(t.startswith("R") for _, rep in ranks for t in rep["executed"][0])
    assert_close(merged_grads(ranks), ref_grads, "zb-h1 2x1 without recompute")


@pytest.mark.slow
@pytest.mark.parametrize("kind,P,D", [("zb-h1", 2, 2), ("varuna-zb", 3, 1)])
def test_deterministic_mode_is_bit_identical_to_one_process(tmp_path, kind, P, D):
    ref_losses, ref_digests = det_run(tmp_path, 1, 1, "--steps", "3")
    losses, digests = det_run(tmp_path, P, D, "--steps", "3", "--schedule", kind)
    assert losses == ref_losses, f"{kind} {P}x{D}: per-step losses differ"
    assert digests == ref_digests, f"{kind} {P}x{D}: parameters differ: " + ", ".join(
        n for n in ref_digests if digests.get(n) != ref_digests[n]
    )



def test_gathered_timeline_keeps_w_tasks() -> None:
    """A zero-bubble run's timeline (W intervals) goes through the engine's gather unchanged."""
    from varuna.core.timeline import Timeline
    from varuna.runtime.layout import Layout
    from varuna.runtime.timeline_gather import gather_timeline

    tl = Timeline(metadata={})
    for k, op in enumerate(["F", "B", "W", "AR", "OPT"]):
        tl.add(0, 0, op, 0 if op in "FBW" else None, 1.0 + k, 1.5 + k)
    got = gather_timeline(tl, Layout(world=1, rank=0, P=1, D=1), {"kind": "zb-h1"})
    assert [(e.op, e.microbatch, e.start_s) for e in got.events] == [
        (e.op, e.microbatch, e.start_s - 1.0) for e in tl.events
    ]
