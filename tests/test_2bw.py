"""PipeDream-2BW (``schedule="2bw"``, Note [2BW] in varuna/core/schedule.py): the weight-version
rule against numbers computed by hand, the engine at P×D against a single-process
implementation of the same rule, checkpoint resume, the synchronous schedule as a negative
control, and the flush-free window the simulator prices and ``Engine.train_steps`` runs (Note
[No-flush window] in varuna/runtime/no_flush.py)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from distributed import check_ok, run_world
from models import build_model, make_batch, reference_step
from torch import nn

import varuna
from simulator.engine import SimConfig, simulate
from varuna.core.calibration import AllReduceModel, Calibration
from varuna.core.schedule import get_schedule, schedule_kind
from varuna.core.tasks import format_tasks, validate_stage_tasks
from varuna.runtime.no_flush import MAX_WINDOW_STEPS, no_flush_unsupported
from varuna.runtime.weight_versions import PREVIOUS_KEY, WeightVersions, pop_previous

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "workers" / "two_bw_worker.py"
sys.path.insert(0, str(ROOT / "examples" / "gpt2"))  # the tiny GPT of tests/models.py
LR = 0.1


class TinyLinear(nn.Module):
    """p = c·(A x + a) + d, loss = mean((p - y)^2), one CutPoint between the two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 2)
        self.cut = varuna.CutPoint()
        self.fc2 = nn.Linear(2, 1)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.tensor([[0.5, -0.25], [0.125, 0.75]]))
            self.fc1.bias.copy_(torch.tensor([0.1, -0.2]))
            self.fc2.weight.copy_(torch.tensor([[0.3, -0.6]]))
            self.fc2.bias.copy_(torch.tensor([0.05]))

    def forward(self, x, y):
        p = self.fc2(self.cut(self.fc1(x))).squeeze(-1)
        return ((p - y) ** 2).mean()


# Four examples per mini-batch, one mini-batch per step.
XS = [
    [[1.0, 2.0], [-1.0, 0.5], [0.25, -0.75], [2.0, 1.0]],
    [[0.5, 0.5], [1.5, -1.0], [-2.0, 0.25], [0.0, 1.0]],
    [[-0.5, 1.5], [1.0, 1.0], [0.75, -0.25], [-1.0, -1.0]],
    [[2.0, -0.5], [0.25, 0.25], [-1.5, 1.0], [1.0, 0.0]],
]
YS = [[1.0, -0.5, 0.25, 2.0], [0.0, 1.0, -1.0, 0.5], [0.75, 1.25, -0.5, 0.0], [1.5, 0.0, -0.25, 1.0]]


def hand_grad(w: dict, xs, ys) -> tuple[dict, float]:
    """Gradient and loss of mean((c·(A x + a) + d - y)^2), by the chain rule in plain floats."""
    A, a, c, d = w["fc1.weight"], w["fc1.bias"], w["fc2.weight"][0], w["fc2.bias"][0]
    n = len(xs)
    g = {"fc1.weight": [[0.0, 0.0], [0.0, 0.0]], "fc1.bias": [0.0, 0.0], "fc2.weight": [[0.0, 0.0]],
         "fc2.bias": [0.0]}
    loss = 0.0
    for x, y in zip(xs, ys):
        h = [A[r][0] * x[0] + A[r][1] * x[1] + a[r] for r in range(2)]
        p = c[0] * h[0] + c[1] * h[1] + d
        loss += (p - y) ** 2 / n
        dp = 2.0 * (p - y) / n
        g["fc2.bias"][0] += dp
        for r in range(2):
            g["fc2.weight"][0][r] += dp * h[r]
            dh = dp * c[r]
            g["fc1.bias"][r] += dh
            for col in range(2):
                g["fc1.weight"][r][col] += dh * x[col]
    return g, loss


def sgd(w: dict, g: dict) -> dict:
    def step(p, q):
        return [step(a, b) for a, b in zip(p, q)] if isinstance(p, list) else p - LR * q

    return {n: step(w[n], g[n]) for n in w}


def hand_trajectory(steps: int, *, stale: bool) -> tuple[list[dict], list[float]]:
    """W(0..steps) and the reported losses: 2BW computes step t's gradient on W(t-2) (W(-1) =
    W(0)) and applies it to W(t-1); the synchronous rule computes it on W(t-1)."""
    w0 = {n: p.detach().tolist() for n, p in TinyLinear().named_parameters()}
    ws, losses = [w0], []
    for t in range(1, steps + 1):
        at = ws[max(t - 2, 0)] if stale else ws[t - 1]
        g, loss = hand_grad(at, XS[t - 1], YS[t - 1])
        ws.append(sgd(ws[t - 1], g))
        losses.append(loss)
    return ws, losses


def engine(schedule: str, **cfg) -> varuna.Engine:
    cfg.setdefault("resume", "0")
    return varuna.Engine(
        TinyLinear(),
        varuna.VarunaConfig(global_batch_size=4, micro_batch_size=2, schedule=schedule, stop_signals=(),
                            **cfg),
        example_batch=batch(1),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
    )


def batch(step: int):
    return torch.tensor(XS[step - 1]), torch.tensor(YS[step - 1])


def weights(eng: varuna.Engine) -> dict:
    return {n: p.detach().clone() for n, p in eng.named_parameters()}


def assert_matches(got: dict, hand: dict, what: str, tol: float = 1e-6) -> None:
    for n, v in hand.items():
        assert torch.allclose(got[n], torch.tensor(v), atol=tol, rtol=0), (what, n, got[n], v)


def test_weight_versions_match_the_hand_computed_rule():
    ws, losses = hand_trajectory(3, stale=True)
    sync, _ = hand_trajectory(3, stale=False)
    with engine("2bw") as eng:
        for t in range(1, 4):
            r = eng.train_step(batch(t))
            assert r.loss == pytest.approx(losses[t - 1], abs=1e-6), t  # f_t at W(t-2)
            assert_matches(weights(eng), ws[t], f"2bw after step {t}")
            assert_matches(eng.weight_versions.previous, ws[t - 1], f"stash after step {t}")
        # Step 1 cannot be stale (W(-1) = W(0)); from step 2 on the rule differs from synchronous.
        assert ws[1] == sync[1] and ws[2] != sync[2]


def test_train_steps_without_a_flush_follow_the_hand_computed_rule():
    ws, losses = hand_trajectory(4, stale=True)
    with engine("2bw") as eng:
        results = eng.train_steps([batch(t) for t in range(1, 5)])
        assert [r.step for r in results] == [1, 2, 3, 4] and eng.step_count == 4
        for r, want in zip(results, losses):
            assert r.loss == pytest.approx(want, abs=1e-6) and not r.skipped
        assert_matches(weights(eng), ws[4], "after the window")
        assert_matches(eng.weight_versions.previous, ws[3], "the stash after the window")
        assert len(eng.executed_orders) == 1  # one task list for the four mini-batches
        assert format_tasks(eng.executed_orders[0]) == " ".join(f"F{i} B{i}" for i in range(8))


def test_train_steps_end_a_window_at_every_periodic_checkpoint(tmp_path):
    with engine("2bw", checkpoint_dir=str(tmp_path), checkpoint_every=2) as eng:
        eng.train_steps([batch(t) for t in range(1, 4)])
        assert [len(o) for o in eng.executed_orders] == [8, 4]  # steps 1-2, then 3
        assert eng.checkpointer.wait(timeout_s=60)  # the save at step 2 copied in the background
    assert (tmp_path / "step_00000002" / "manifest.json").is_file()
    with engine("1f1b") as eng:  # a synchronous kind: train_step on each
        eng.train_steps([batch(1), batch(2)])
        assert len(eng.executed_orders) == 2


def test_a_window_holds_at_most_max_window_steps_mini_batches():
    """A stop request waits for the window's end: bounded by MAX_WINDOW_STEPS, whatever the
    caller passes (here 2.5 windows' worth)."""
    n = 2 * MAX_WINDOW_STEPS + 3
    with engine("2bw") as eng:
        results = eng.train_steps([batch(1)] * n)
        assert [r.step for r in results] == list(range(1, n + 1))
        sizes = [len(o) for o in eng.executed_orders]  # one task list per window
        per_step = sizes[-1] // 3
        assert sizes == [per_step * MAX_WINDOW_STEPS, per_step * MAX_WINDOW_STEPS, per_step * 3]


def test_what_needs_a_barrier_per_step_is_refused():
    def cfg(**kw):
        return varuna.VarunaConfig(global_batch_size=4, micro_batch_size=1, schedule="2bw", **kw)

    assert no_flush_unsupported(cfg(), 2) is None
    assert "max_grad_norm" in no_flush_unsupported(cfg(max_grad_norm=1.0), 2)
    assert "fp16" in no_flush_unsupported(cfg(precision="fp16"), 2)
    assert "recompute=True" in no_flush_unsupported(cfg(recompute=False), 2)
    assert no_flush_unsupported(cfg(recompute=False), 1) is None  # F directly precedes B
    with engine("2bw", max_grad_norm=1.0) as eng, pytest.raises(ValueError, match="cannot clip"):
        eng.train_steps([batch(1), batch(2)])


def test_synchronous_schedule_is_the_negative_control():
    ws, _ = hand_trajectory(2, stale=True)
    sync, _ = hand_trajectory(2, stale=False)
    with engine("1f1b") as eng:
        assert eng.weight_versions is None
        eng.train_step(batch(1))
        assert_matches(weights(eng), ws[1], "step 1 is the same under both rules")
        eng.train_step(batch(2))
        assert_matches(weights(eng), sync[2], "1f1b is synchronous")
        got = weights(eng)["fc1.weight"]
        assert not torch.allclose(got, torch.tensor(ws[2]["fc1.weight"]), atol=1e-4), "differs from 2bw"


def test_checkpoint_resume_continues_the_trajectory(tmp_path):
    ckpt = tmp_path / "ckpt"
    with engine("2bw", checkpoint_dir=str(ckpt)) as eng:
        for t in (1, 2):
            eng.train_step(batch(t))
        eng.save_checkpoint(wait=True)
        sd = eng.state_dict()
        sd = {**sd, "optimizer": copy.deepcopy(sd["optimizer"]), "params": copy.deepcopy(sd["params"])}
        for t in (3, 4):
            eng.train_step(batch(t))
        expect = weights(eng)
    assert PREVIOUS_KEY in sd["optimizer"]["state"]["fc1.weight"]
    with engine("2bw", checkpoint_dir=str(ckpt), resume="1") as eng:
        assert eng.step_count == 2
        for t in (3, 4):
            eng.train_step(batch(t))
        got = weights(eng)
    for n in expect:
        assert torch.equal(got[n], expect[n]), n
    # The in-memory state too; and dropping the stashed version (what a checkpoint of only the
    # newest weights would restore) changes the trajectory: the test can fail.
    for keep_previous in (True, False):
        with engine("2bw") as eng:
            state = copy.deepcopy(sd)
            if not keep_previous:
                pop_previous(state["optimizer"])
            eng.load_state_dict(state)
            for t in (3, 4):
                eng.train_step(batch(t))
            same = all(torch.equal(weights(eng)[n], expect[n]) for n in expect)
            assert same == keep_previous


def test_a_failed_step_leaves_both_versions():
    w = nn.Parameter(torch.tensor([1.0]))
    v = WeightVersions({"w": w})
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="boom"), v.stale():
        assert float(w.detach()) == 1.0
        raise RuntimeError("boom")
    assert float(w.detach()) == 2.0 and float(v.previous["w"]) == 1.0


def test_window_is_1f1b_across_the_step_boundary():
    kind = schedule_kind("2bw")
    assert kind.weight_versions == 2 and schedule_kind("1f1b").weight_versions == 1
    for P in (2, 3, 4):
        for nm in (P, P + 1, 2 * P):
            one = get_schedule("2bw", P, nm, False)
            assert one.stages == get_schedule("1f1b", P, nm, False).stages  # the runtime's per-step list
            win = kind.window(P, nm, 2, recompute=False)
            for k, tasks in enumerate(win.stages):
                validate_stage_tasks(tasks, 2 * nm)
                # No flush: the next mini-batch's first forward runs before this one's last backward
                # on every stage but the last.
                order = [str(t) for t in tasks]
                if k < P - 1:
                    assert order.index(f"F{nm}") < order.index(f"B{nm - 1}"), (P, nm, k)
    assert format_tasks(kind.window(2, 2, 2, recompute=False).stages[1]) == "F0 B0 F1 B1 F2 B2 F3 B3"
    with pytest.raises(ValueError, match="flushes the pipeline after every mini-batch"):
        schedule_kind("1f1b").window(2, 2, 2)


def test_fewer_microbatches_than_stages_is_refused():
    assert schedule_kind("2bw").unsupported(4, 4) is None
    assert "at least P=4 micro-batches per replica (got 3)" in schedule_kind("2bw").unsupported(4, 3)
    cal = Calibration.synthetic(0.01, num_segments=4, micro_batch_sizes=(1,))
    with pytest.raises(ValueError, match="at least P=4 micro-batches"):
        simulate(cal, SimConfig(num_stages=4, micro_batch_size=1, num_microbatches=3, schedule="2bw"))


def test_simulator_shows_no_flush_bubble_in_steady_state():
    F, P = 0.01, 4
    cal = Calibration.synthetic(F, num_segments=P, micro_batch_sizes=(1,))
    B = cal.bwd_s(0, 1)
    for nm in (4, 8):
        common = dict(num_stages=P, micro_batch_size=1, num_microbatches=nm, recompute=False, allreduce=False,
                      optimizer=False, task_overhead_s=0.0, placeholder_s=0.0, step_overhead_s=0.0)
        sync = simulate(cal, SimConfig(schedule="1f1b", **common))
        two = simulate(cal, SimConfig(schedule="2bw", **common))
        assert sync.minibatch_s == pytest.approx((nm + P - 1) * (F + B))  # the bubble (P-1)(F+B)
        assert two.minibatch_s == pytest.approx(nm * (F + B))  # gone
        assert all(i == pytest.approx(0.0, abs=1e-9) for i in two.stage_idle_s)
        assert [len(o) for o in two.executed[0]] == [2 * nm] * P  # the second mini-batch's F and B
        assert all(t.microbatch >= nm for o in two.executed[0] for t in o)
        params = cal.segments[0].param_bytes
        assert two.stage_memory_bytes[0] == sync.stage_memory_bytes[0] + params  # the stashed version
    # With D=2, each stage all-reduces its gradients right after its own last backward of a
    # mini-batch, before its next task (what the engine's no-flush window does): once per step.
    ar = AllReduceModel(bandwidth_bytes_per_s=1e12, latency_s=0.005, contention=0.0)
    cal = Calibration.synthetic(F, num_segments=P, micro_batch_sizes=(1,), allreduce=ar)
    for nm in (4, 8):
        common = dict(num_stages=P, num_replicas=2, micro_batch_size=1, num_microbatches=nm, recompute=False,
                      optimizer=False, task_overhead_s=0.0, placeholder_s=0.0, step_overhead_s=0.0)
        sync = simulate(cal, SimConfig(schedule="1f1b", **common))
        two = simulate(cal, SimConfig(schedule="2bw", **common), record=True)
        hold = sync.stage_allreduce_s[0]
        assert hold > 0.005 and two.minibatch_s == pytest.approx(nm * (F + B) + hold)
        assert sum(e.op == "SYNC" for e in two.timeline.events) == P  # one per stage in the 2-step window


def merged(out: Path, name: str, world: int) -> tuple[dict, dict]:
    """Every rank's dumped weights (by step, by name) and losses of run ``name``."""
    weights_by_step: dict = {}
    losses: dict = {}
    for r in range(world):
        d = torch.load(out / name / f"rank{r}.pt")
        for step, ws in d["weights"].items():
            weights_by_step.setdefault(step, {}).update(ws)
        losses.update(d["losses"])
    return weights_by_step, losses


def check_no_flush(out: Path, world: int, *, lean: bool = False) -> None:
    """The ``--no-flush`` runs: at each window's end the weights of the single-process rule
    (tolerance 2e-5) and, bit for bit, those of the engine flushing after every step (the same
    tasks on the same versions, summed in the same order); the same losses, bit for bit; the
    window resumed from its checkpoint equals the uninterrupted one."""
    flush, flush_losses = merged(out, "2bw", world)
    ref = reference(stale=True)
    names = ("window",) if lean else ("window", "window_ckpt", "window_resumed")
    runs = {name: merged(out, name, world) for name in names}
    assert sorted(runs["window"][0]) == [4] and sorted(runs["window"][1]) == [1, 2, 3, 4]
    if not lean:
        assert sorted(runs["window_ckpt"][0]) == [2, 4]
        assert sorted(runs["window_resumed"][0]) == [4] and sorted(runs["window_resumed"][1]) == [3, 4]
    for name, (ws_by_step, losses) in runs.items():
        for t, ws in ws_by_step.items():
            assert set(ws) == set(flush[t])
            for n, w in ws.items():
                assert torch.allclose(w, ref[t][n], atol=2e-5, rtol=0), (name, t, n)
                assert torch.equal(w, flush[t][n]), (name, t, n)
        assert all(losses[t] == flush_losses[t] for t in losses), name


def stage0_overlaps(rows: list) -> list[bool]:
    """Per step boundary t|t+1: does stage 0 run a forward of t+1 before its own last backward of
    t? A flush never does (every backward of t, then the step's end, then t+1); the no-flush window
    must (1F1B over both). Read from the order stage 0 ran its tasks in (one at a time, so their
    start times order them whatever the load), not from how long anything took. ``rows``:
    (stage, op, step, start, end) from the engine's gathered timeline."""
    mine = sorted((r for r in rows if r[0] == 0 and r[1] in ("F", "B")), key=lambda r: r[3])
    steps = 1 + max(r[2] for r in mine)
    out = []
    for t in range(steps - 1):
        first_next = min(i for i, r in enumerate(mine) if r[1] == "F" and r[2] == t + 1)
        last_back = max(i for i, r in enumerate(mine) if r[1] == "B" and r[2] == t)
        out.append(first_next < last_back)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 3])
def test_no_flush_at_px1_overlaps_mini_batches_and_equals_the_reference(tmp_path, P):
    """P × D=1: ``train_steps`` against the single-process rule and the flushing engine (P=3:
    in deterministic mode). At P=2
    the executed order (the engine's timeline) shows stage 0 starting mini-batch t+1 before its
    own last backward of t, i.e. before t drained. Negative control: the same through
    ``train_step`` (a flush per step) never does."""
    env = {"VARUNA_PIPELINE_DEPTH": str(P)}
    # At P=3 without checkpoints (those: 2x1, 2x2) and in deterministic mode (canonical sums
    # restarted inside the window at each update).
    lean = ["--lean", "--deterministic"] if P == 3 else []
    check_ok(run_world(WORKER, P, ["--out", str(tmp_path), "--no-flush", *lean], env=env, timeout_s=600))
    check_no_flush(tmp_path, P, lean=bool(lean))
    if P != 2:
        return
    found = json.loads((tmp_path / "overlap.json").read_text())
    # By the list, stage 0 starts t+1 right after its backward of t's micro-batch Nm-P, before
    # the gradients of t's last micro-batch come back from the last stage.
    assert all(stage0_overlaps(found["train_steps"])), found["train_steps"]
    # A flush: stage 0's next forward waits for the end of step agreement, after every backward.
    assert not any(stage0_overlaps(found["train_step"])), found["train_step"]


@pytest.mark.slow
def test_pipeline_and_data_parallel_equal_a_single_process_2bw(tmp_path):
    """P=2 × D=2 processes against plain torch running the same rule: tolerance 2e-5 (fp32
    sums in another order); the resumed run must equal the uninterrupted one exactly. (The
    synchronous engine as a negative control: the fast tests above.) Then the same without a
    flush (``train_steps``), in one window and in two around a checkpoint."""
    env = {"VARUNA_PIPELINE_DEPTH": "2"}
    check_ok(run_world(WORKER, 4, ["--out", str(tmp_path), "--no-flush"], env=env, timeout_s=600))
    got, resumed = merged(tmp_path, "2bw", 4)[0], merged(tmp_path, "resumed", 4)[0]
    ref2, ref_sync = reference(stale=True), reference(stale=False)
    for t in range(1, 5):
        for n, w in got[t].items():
            assert torch.allclose(w, ref2[t][n], atol=2e-5, rtol=0), ("2bw", t, n)
    for t in (3, 4):
        assert set(resumed[t]) == set(got[t])
        assert all(torch.equal(resumed[t][n], got[t][n]) for n in got[t]), t
    # The rules agree at step 1 and part at step 2 by ten times the tolerance above or more.
    assert all(torch.allclose(ref2[1][n], ref_sync[1][n], atol=1e-6, rtol=0) for n in ref2[1])
    assert max((ref2[2][n] - ref_sync[2][n]).abs().max().item() for n in ref2[2]) > 10 * 2e-5
    # The 2×2 checkpoint resumed in one process (another layout) continues the same trajectory.
    for t, ws in resume_in_one_process(tmp_path / "ckpt").items():
        for n, w in ws.items():
            assert torch.allclose(w, got[t][n], atol=2e-5, rtol=0), ("1x1 resume", t, n)
    check_no_flush(tmp_path, 4)


def gpt_in_one_process(steps, m_total: int = 8, window: bool = False, **cfg) -> dict:
    """The tiny GPT under a 1×1 engine with 2bw, as the worker trains it; weights per step
    (``window``: all steps through one ``train_steps``, weights at its end)."""
    data = make_batch("gpt", 4 * m_total)

    def batch_of(t):
        return tuple(x[(t - 1) * m_total : t * m_total] for x in data)

    config = varuna.VarunaConfig(global_batch_size=m_total, micro_batch_size=2, schedule="2bw", seed=7,
                                 stop_signals=(), **cfg)
    out = {}
    with varuna.Engine(build_model("gpt", dropout=0.1), config, example_batch=batch_of(1),
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) as eng:
        if window:
            eng.train_steps([batch_of(t) for t in steps])
            return {eng.step_count: weights(eng)}
        for t in steps:
            if t > eng.step_count:
                eng.train_step(batch_of(t))
                out[t] = weights(eng)
    return out


def resume_in_one_process(ckpt: Path) -> dict:
    out = gpt_in_one_process((1, 2, 3, 4), checkpoint_dir=str(ckpt), resume="1")
    assert sorted(out) == [3, 4], "resumed after step 2"
    return out


def test_deterministic_mode_with_a_tied_weight():
    """Deterministic mode reads the tied embedding through per-segment aliases of its storage;
    they must see the stale version too. Against the single-process rule, tolerance 2e-5."""
    got, ref = gpt_in_one_process((1, 2, 3), deterministic=True), reference(stale=True, steps=3)
    for t in (1, 2, 3):
        for n, w in got[t].items():
            assert torch.allclose(w, ref[t][n], atol=2e-5, rtol=0), (t, n)


def test_deterministic_train_steps_equal_train_step_bit_for_bit():
    """Deterministic mode's per-step canonical sums restart inside the window at each update."""
    got = gpt_in_one_process((1, 2, 3), deterministic=True, window=True)
    assert sorted(got) == [3]
    flushed = gpt_in_one_process((1, 2, 3), deterministic=True)
    assert all(torch.equal(w, flushed[3][n]) for n, w in got[3].items())


def reference(*, stale: bool, steps: int = 4, m_total: int = 8, micro: int = 2, lr: float = 0.1):
    """Single-process SGD with momentum on the tiny GPT: gradients at W(t-2) (2bw) or W(t-1).
    (Not Adam: its g/sqrt(v) turns float noise in near-zero gradients into full-size steps.)"""
    cur = build_model("gpt", dropout=0.1)
    prev = copy.deepcopy(cur)
    opt = torch.optim.SGD(cur.parameters(), lr=lr, momentum=0.9)
    data = make_batch("gpt", steps * m_total)
    out = {}
    for t in range(1, steps + 1):
        b = tuple(x[(t - 1) * m_total : t * m_total] for x in data)
        at = prev if stale else cur
        at.zero_grad(set_to_none=True)
        reference_step(at, b, m_total, micro, seed=7, step=t)
        newest = {n: p.detach().clone() for n, p in cur.named_parameters()}
        for pc, pa in zip(cur.parameters(), at.parameters()):
            pc.grad = pa.grad.clone()
        opt.step()
        with torch.no_grad():
            for n, p in prev.named_parameters():
                p.copy_(newest[n])
        out[t] = {n: p.detach().clone() for n, p in cur.named_parameters()}
    return out


@pytest.mark.slow
def test_a_tied_weight_stays_one_when_only_one_of_its_stages_sees_a_non_finite_gradient(tmp_path):
    """No flush, P=2, the embedding tied to the LM head (a copy on each stage): stage 0 alone gets
    an Inf gradient (a private parameter's) at step 2. Both stages holding the tied weight must
    skip that update, else its copies part for good; the step is reported skipped everywhere."""
    worker = Path(__file__).parent / "workers" / "two_bw_tied_skip_worker.py"
    env = {"VARUNA_PIPELINE_DEPTH": "2"}
    check_ok(run_world(worker, 2, ["--out", str(tmp_path)], env=env, timeout_s=300))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["skipped"] == r1["skipped"] == [2]
    assert set(r0["tied"]) == set(r1["tied"]) and r0["tied"]
    for n in r0["tied"]:
        assert torch.equal(r0["tied"][n], r1["tied"][n]), n
