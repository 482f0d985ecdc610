"""The whole training state (issue 29, docs/checkpoints.md "Whole state"): persistent buffers with
their replica rule, the LR scheduler, registered objects, optimizer state outside ``state[param]``
and the data position, through checkpoints (kill -9 and resume, resizes) and live morphs.

Multi-process tests run tests/workers/state_worker.py (a small ResNet with BatchNorm, SGD with
momentum, OneCycleLR, a torchdata StatefulDataLoader over 48 samples) in deterministic mode and
compare with one undisturbed single-process run, bit for bit, weights *and* buffers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import sys
from pathlib import Path

import pytest
import torch
from distributed import check_ok, run_world
from torch import nn

import varuna
from varuna.cutting.split import persistent_buffers, profile_model
from varuna.runtime.buffers import BufferKeeper, RunningStats
from varuna.runtime.checkpoint import list_checkpoints
from varuna.runtime.extra_state import ExtraState, SchedulerState
from varuna.runtime.optimizer_state import load_optimizer_state_by_name, optimizer_state_by_name
from varuna.runtime.state_codec import StateCodecError, flatten, from_json, to_json, unflatten
from varuna.runtime.stateful_data import StatefulBatches

WORKER = Path(__file__).parent / "workers" / "state_worker.py"
sys.path.insert(0, str(WORKER.parent))
from state_worker import GLOBAL_BATCH, SAMPLES, Images, Indexed, step_batch  # noqa: E402

STEPS = 8  # 6 mini-batches an epoch: the runs cross an epoch boundary


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------- pure parts


def test_codec_round_trips_plain_state_and_refuses_objects_and_bad_tensors():
    tree = {"a": [1, 2.5, None, "x"], "t": (torch.arange(4.0), torch.zeros(0, 3, dtype=torch.int64)),
            3: {"nested": torch.tensor([True, False])}, "raw": b"\x00\x01", "dt": torch.bfloat16}
    back = from_json(json.loads(json.dumps(to_json(tree))))
    assert back["a"] == tree["a"] and back["raw"] == b"\x00\x01" and back["dt"] is torch.bfloat16
    assert torch.equal(back["t"][0], tree["t"][0]) and back["t"][1].shape == (0, 3)
    assert torch.equal(back[3]["nested"], tree[3]["nested"])
    skeleton, tensors = flatten(tree)
    assert torch.equal(unflatten(json.loads(json.dumps(skeleton)), tensors)[3]["nested"], tree[3]["nested"])
    with pytest.raises(StateCodecError, match=r"state.obj is a .*object: a saved state may hold only"):
        to_json({"obj": object()})
    bad = to_json({"t": torch.zeros(4)})
    bad["t"]["@tensor"]["shape"] = [5]
    with pytest.raises(StateCodecError, match="does not match its 16 bytes"):
        from_json(bad)
    bad["t"]["@tensor"]["dtype"] = "Tensor"
    with pytest.raises(StateCodecError, match="bad dtype"):
        from_json(bad)


def test_persistent_buffers_and_their_segments():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)
            self.lin = nn.Linear(3, 3)
            self.register_buffer("cache", torch.zeros(3), persistent=False)
            self.register_buffer("unused", torch.ones(2))
            self.cut = varuna.CutPoint()

        def forward(self, x):
            return self.lin(self.cut(self.bn(x))).sum() + self.cache.sum()

    m = M()
    assert sorted(persistent_buffers(m)) == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var",
                                             "unused"]
    prof = profile_model(m, torch.randn(4, 3), lambda out, batch: out, costs=False)
    assert prof.buffer_segments == {"bn.running_mean": (0,), "bn.running_var": (0,),
                                    "bn.num_batches_tracked": (0,), "unused": (0,)}


def _bn_pair(momentum):
    torch.manual_seed(0)
    eager = nn.BatchNorm2d(4, momentum=momentum)
    ours = nn.BatchNorm2d(4, momentum=momentum)
    ours.load_state_dict(eager.state_dict())
    return eager, ours


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats_match_eager_torch_and_a_recompute_counts_once(momentum):
    eager, ours = _bn_pair(momentum)
    stats = RunningStats({"bn": ours})
    xs = [torch.randn(3, 4, 5, 5) for _ in range(3)]
    for i, x in enumerate(xs):
        y_eager = eager(x)
        stats.current = (1, i)
        y = ours(x)
        y_again = ours(x)  # a recompute of micro-batch i: the same statistics, written again
        assert torch.equal(y, y_eager) and torch.equal(y_again, y), "the output uses the batch's statistics"
        assert ours.track_running_stats
    assert torch.equal(ours.running_mean, torch.zeros(4)), "nothing applied before the step's end"
    stats.apply(stats.take_rows([(1, i) for i in range(3)], torch.device("cpu")))
    assert int(ours.num_batches_tracked) == 3 == int(eager.num_batches_tracked)
    torch.testing.assert_close(ours.running_mean, eager.running_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.running_var, eager.running_var, rtol=1e-6, atol=1e-7)
    ours.eval()
    stats.current = (2, 0)
    ours(xs[0])  # eval mode: the module reads its statistics, nothing is recorded
    assert stats.take_rows([(2, 0)], torch.device("cpu"))[0, 0] == 0
    stats.close()


def test_buffer_keeper_applies_in_micro_batch_order_and_skips_a_skipped_step():
    from varuna.core.batching import plan_microbatches
    from varuna.runtime.groups import ProcessGroups
    from varuna.runtime.layout import Layout

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(2)
            self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    net = Net()
    keeper = BufferKeeper(net, ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "steps"],
                          groups=ProcessGroups(), layout=Layout(world=1, rank=0, P=1, D=1),
                          micro_plan=plan_microbatches(4, 2, 1))
    assert keeper.watched == ["steps"]
    for i in (1, 0):  # the schedule ran micro-batch 1 first: applied in index order all the same
        keeper.stats.current = (1, i)
        net.bn(torch.full((2, 2), float(i)) + torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    keeper.commit(keeper.exchange(1), skipped=True)
    assert int(net.bn.num_batches_tracked) == 0, "a skipped step leaves the statistics"
    keeper.stats.current = (2, 0)
    net.bn(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    keeper.stats.current = (2, 1)
    net.bn(torch.tensor([[1.0, 2.0], [2.0, 1.0]]))
    keeper.commit(keeper.exchange(2), skipped=False)
    ref = torch.zeros(2).mul_(0.9).add_(torch.tensor([0.5, 0.5]), alpha=0.1)
    ref = ref.mul_(0.9).add_(torch.tensor([1.5, 1.5]), alpha=0.1)
    assert torch.equal(net.bn.running_mean, ref) and int(net.bn.num_batches_tracked) == 2
    keeper.close()


def test_scheduler_state_takes_per_group_values_from_this_stages_optimizer():
    w, v = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [w], "lr": 1.0}, {"params": [v], "lr": 0.1}], lr=1.0)
    sched = SchedulerState(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    opt.step()
    sched.step(0.0)
    saved = sched.state_dict()
    # another stage (another P): one group, whose hyper-parameters the checkpoint restored by name
    u = nn.Parameter(torch.zeros(1))
    opt2 = torch.optim.SGD([u], lr=7.0)
    other = SchedulerState(torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5))
    opt2.param_groups[0].update(lr=0.05, initial_lr=0.1)  # what load_optimizer_state_by_name does
    other.load_state_dict(saved)
    assert other.scheduler.last_epoch == 1 and other.scheduler.base_lrs == [0.1]
    opt2.step()
    other.step(0.0)
    assert opt2.param_groups[0]["lr"] == 0.025


def test_registered_state_waits_for_its_object_and_scopes_are_explicit():
    class Box:
        def __init__(self):
            self.value = None

        def state_dict(self):
            return {"value": self.value}

        def load_state_dict(self, state):
            self.value = state["value"]

    reg = ExtraState()
    reg.load({"global": {"data": {"value": 7}}, "rank": {"rng": {"value": 3}}}, rank_state=True)
    box, rng = Box(), Box()
    reg.register("data", box)
    reg.register("rng", rng, "rank")
    assert (box.value, rng.value) == (7, 3), "a state loaded before registration is loaded at it"
    with pytest.raises(ValueError, match="scope must be 'global' or 'rank'"):
        reg.register("x", Box(), "stage")
    with pytest.raises(ValueError, match="has no state_dict"):
        reg.register("y", object())
    with pytest.raises(ValueError, match="'data' is registered already"):
        reg.register("data", Box())
    rng.value = 5
    reg.load({"global": {}, "rank": {"rng": {"value": 9}}}, rank_state=False)
    assert rng.value == 5, "per-rank state is not restored at another P×D"
    assert reg.state_dicts(0) == {"global": {"data": {"value": 7}}, "rank": {"rng": {"value": 5}}}


def test_rng_state_round_trips_through_the_checkpoint_codec():
    import random

    import numpy as np

    from varuna.runtime.extra_state import RNGState

    rng = RNGState()
    saved = json.loads(json.dumps(to_json(rng.state_dict())))
    want = (random.random(), float(np.random.rand()), float(torch.rand(())))
    rng.load_state_dict(from_json(saved))
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == want


def test_optimizer_state_outside_state_param_round_trips_by_name():
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    w.grad = torch.ones(2)
    opt.step()
    opt.state["global_norm"] = torch.tensor(3.0)  # e.g. a LAMB-style optimizer's global state
    sd = optimizer_state_by_name(opt, {"w": w})
    assert torch.equal(sd["stage_state"]["state"]["global_norm"], torch.tensor(3.0))
    sd = from_json(json.loads(json.dumps(to_json(sd))))
    w2 = nn.Parameter(torch.ones(2))
    opt2 = torch.optim.SGD([w2], lr=0.5, momentum=0.9)
    load_optimizer_state_by_name(opt2, {"w": w2}, sd)
    assert torch.equal(opt2.state["global_norm"], torch.tensor(3.0))
    assert torch.equal(opt2.state[w2]["momentum_buffer"], opt.state[w]["momentum_buffer"])


def _loader(seed: int = 11):
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(Images(), batch_size=GLOBAL_BATCH, shuffle=True, drop_last=True,
                              generator=torch.Generator().manual_seed(seed))


def test_stateful_batches_resume_exactly_once_across_epochs_and_redo_a_step():
    pytest.importorskip("torchdata")
    epoch = SAMPLES // GLOBAL_BATCH
    straight = StatefulBatches(_loader())
    seen = [straight.batch_for(s)[2].tolist() for s in range(1, 3 * epoch + 1)]
    for e in range(3):
        flat = sorted(i for b in seen[e * epoch:(e + 1) * epoch] for i in b)
        assert flat == list(range(SAMPLES)), f"epoch {e}: every sample exactly once"
    assert seen[:epoch] != seen[epoch:2 * epoch], "each epoch its own order"
    for cut in (2, epoch, epoch + 1):  # mid-epoch, exactly at the end of one, just after
        first = StatefulBatches(_loader())
        for s in range(1, cut + 3):
            first.batch_for(s)
        saved = json.loads(json.dumps(to_json(first.state_dict_at(cut))))  # as the checkpoint holds it
        resumed = StatefulBatches(_loader(seed=99))  # another seed: the state decides the order
        resumed.load_state_dict(from_json(saved))
        rest = [resumed.batch_for(s)[2].tolist() for s in range(cut + 1, 3 * epoch + 1)]
        assert seen[:cut] + rest == seen, f"resumed after {cut}"
    again = StatefulBatches(_loader())
    b3 = [again.batch_for(s)[2].tolist() for s in (1, 2, 3)][-1]
    assert again.batch_for(3)[2].tolist() == b3, "a redone step gets its batch again"
    with pytest.raises(ValueError, match="asked for step 9, but the loader is at mini-batch 3"):
        again.batch_for(9)
    with pytest.raises(ImportError, match="pip install 'varuna\\[data\\]'"):
        StatefulBatches(torch.utils.data.DataLoader(Images(), batch_size=8))


# ---------------------------------------------------------------------------------- one process


def _engine(tmp_path, **kw):
    a = type("A", (), {"total_steps": 0, "steps": STEPS})
    from state_worker import engine_args

    cfg = varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=2, seed=5,
                              checkpoint_dir=str(tmp_path / "ckpt"), **kw)
    return varuna.Engine(Indexed(), cfg, **engine_args(a))


def test_a_checkpoint_holds_buffers_scheduler_and_data_and_an_old_one_still_loads(tmp_path, caplog):
    pytest.importorskip("torchdata")
    eng = _engine(tmp_path)
    data = StatefulBatches(_loader())
    eng.register_state("data", data)
    for s in (1, 2, 3):
        eng.train_step(data.batch_for(s))
    eng.save_checkpoint(wait=True)
    want = {k: v.clone() for k, v in eng.state_dict()["buffers"].items()}
    lr = eng.optimizer.param_groups[0]["lr"]
    eng.close()
    assert want and any(int(v) == 3 * 4 for k, v in want.items() if k.endswith("num_batches_tracked"))
    manifest = json.loads((tmp_path / "ckpt" / "step_00000003" / "manifest.json").read_text())
    assert manifest["parameters"]["net.stem.1.running_mean"]["buffer"] is True
    assert set(from_json(manifest["state"])) == {"lr_scheduler", "data"}
    back = _engine(tmp_path, resume="1")
    data2 = StatefulBatches(_loader(seed=5))
    back.register_state("data", data2)  # registered after the resume: loaded now
    assert back.step_count == 3 and data2.position == 3
    assert all(torch.equal(v, want[k]) for k, v in back.state_dict()["buffers"].items())
    assert back.optimizer.param_groups[0]["lr"] == lr and back.extras.scheduler.scheduler.last_epoch == 3
    back.close()
    # A checkpoint of an older varuna has no buffers: it loads, the buffers keep their values.
    for f in manifest["files"]:
        path = tmp_path / "ckpt" / "step_00000003" / f["name"]
        shard = torch.load(path, weights_only=True)
        shard["params"] = {n: t for n, t in shard["params"].items() if "running" not in n
                           and "num_batches" not in n}
        torch.save(shard, path)
        f["bytes"], f["sha256"] = path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest()
    manifest["parameters"] = {n: m for n, m in manifest["parameters"].items() if not m.get("buffer")}
    (tmp_path / "ckpt" / "step_00000003" / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="varuna.runtime.whole_state"):
        old = _engine(tmp_path, resume="1")
    assert old.step_count == 3 and "has no buffer" in caplog.text
    old.close()


def test_a_2bw_window_updates_buffers_and_the_schedule_per_mini_batch_like_train_step(tmp_path):
    """No flush (``train_steps`` with 2bw): each mini-batch's statistics are applied at its own
    update inside the window, so the buffers, weights and LR schedule equal four ``train_step``s."""
    def run(window: bool):
        eng = _engine(tmp_path, schedule="2bw", deterministic=True)
        batches = [step_batch(s) for s in range(1, 5)]
        if window:
            eng.train_steps(batches)
        else:
            for b in batches:
                eng.train_step(b)
        sd = eng.state_dict()
        out = {**sd["params"], **sd["buffers"]}, eng.extras.scheduler.scheduler.last_epoch
        eng.close()
        return out

    (w_window, e_window), (w_steps, e_steps) = run(True), run(False)
    assert e_window == e_steps == 4
    assert any(int(v) == 16 for n, v in w_window.items() if n.endswith("num_batches_tracked"))
    assert _differences(w_window, w_steps) == []


# ---------------------------------------------------------------------------------- processes


def _run(tmp_path: Path, name: str, world: int, P: int, *args: str, ok: bool = True):
    out = tmp_path / name
    res = run_world(WORKER, world, ["--out", str(out), "--ckpt-dir", str(tmp_path / f"{name}-ckpt"),
                                    "--pipeline-depth", str(P), "--deterministic", *args], timeout_s=600)
    if ok:
        check_ok(res)
    return out, res


def _tensors(out: Path, prefix: str = "rank") -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob(f"{prefix}*.pt")):
        got.update(torch.load(f, weights_only=True))
    return got


def _rows(out: Path, prefix: str = "rank") -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for f in sorted(out.glob(f"{prefix}*.json")):
        for r in json.loads(f.read_text())["rows"]:
            rows[r["step"]] = r
    return rows


def _differences(got: dict, ref: dict) -> list[str]:
    assert got.keys() == ref.keys(), sorted(got.keys() ^ ref.keys())[:5]
    return [n for n in ref if not torch.equal(got[n].reshape(-1).view(torch.uint8),
                                              ref[n].reshape(-1).view(torch.uint8))]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One undisturbed 1×1 run of STEPS steps over the loader: its weights and buffers, per-step rows."""
    pytest.importorskip("torchdata")
    tmp = tmp_path_factory.mktemp("ref")
    out, _ = _run(tmp, "ref", 1, 1, "--steps", str(STEPS), "--data", "loader")
    ref = _tensors(out)
    assert any("running_var" in n for n in ref) and any("num_batches" in n for n in ref)
    return ref, _rows(out)


@pytest.mark.slow
def test_batchnorm_2x2_killed_and_resumed_is_bit_identical_to_1x1_weights_and_buffers(tmp_path, reference):
    ref, ref_rows = reference
    common = ("--steps", str(STEPS), "--data", "loader", "--every", "2")
    _, res = _run(tmp_path, "run", 4, 2, *common, "--kill-after", "5", "--kill-rank", "3", ok=False)
    assert res[3].returncode == -signal.SIGKILL, res[3].stdout[-2000:]
    # The save of step 4 may not have been committed when rank 3 died (it is written in the
    # background): the newest complete checkpoint is step 4 or step 2.
    newest = max(c.step for c in list_checkpoints(tmp_path / "run-ckpt") if c.complete)
    assert newest in (2, 4)
    out, _ = _run(tmp_path, "run", 4, 2, *common, "--resume", "1")
    assert _differences(_tensors(out), ref) == []
    rows = _rows(out)
    assert min(rows) == newest + 1, "resumed from the newest complete checkpoint"
    for s, r in rows.items():
        want = ref_rows[s]
        assert (r["loss"], r["lr"], r["index"]) == (want["loss"], want["lr"], want["index"]), s
    # Negative control: the engine before buffers were state (not saved, each replica its own, a
    # recompute counting twice) ends with other buffers, although the weights are the same.
    _run(tmp_path, "old", 4, 2, *common, "--old-buffers", "--kill-after", "5", "--kill-rank", "3", ok=False)
    old, _ = _run(tmp_path, "old", 4, 2, *common, "--old-buffers", "--resume", "1")
    diff = _differences(_tensors(old), ref)
    assert diff and all("running" in n or "num_batches" in n for n in diff), diff


@pytest.mark.slow
def test_batchnorm_live_morph_2x2_to_1x3_is_bit_identical_to_1x1(tmp_path, reference):
    from test_live_morph import logs_of, run_live_world

    ref, ref_rows = reference
    out = tmp_path / "live"
    _, codes = run_live_world(out, tmp_path / "ckpt", worker=WORKER, steps=STEPS,
                              args=("--live", "--deterministic", "--data", "loader", "--die", "3:2"))
    assert codes == {0: 0, 1: 0, 2: 0, 3: -signal.SIGKILL}, logs_of(out)
    got = {}
    for m in (0, 1, 2):
        report = json.loads((out / f"member{m}.json").read_text())
        assert (report["P"], report["D"]) == (1, 3) and report["failed_steps"] == [3]
        for r in report["rows"]:
            want = ref_rows[r["step"]]
            assert (r["loss"], r["lr"], r["index"]) == (want["loss"], want["lr"], want["index"]), r["step"]
        got.update(torch.load(out / f"member{m}.pt", weights_only=True))
    assert _differences(got, ref) == []
    assert not (tmp_path / "ckpt").exists(), "a live morph reads and writes no checkpoint"


@pytest.mark.slow
def test_lr_schedule_and_stateful_loader_across_2x2_to_3x1_and_back_see_each_sample_once(tmp_path, reference):
    """Graceful resizes (save, exit, relaunch at another P×D): every step runs once, every sample is
    read once per epoch, the LR sequence (and the momentum OneCycleLR sets) equals the undisturbed
    run's, and so do the losses and the final weights and buffers."""
    ref, ref_rows = reference
    args = ("--data", "loader", "--total-steps", str(STEPS))
    _run(tmp_path, "a", 4, 2, *args, "--steps", "3", "--save-at", "3")
    (tmp_path / "b-ckpt").symlink_to(tmp_path / "a-ckpt")
    _run(tmp_path, "b", 3, 3, *args, "--steps", "6", "--save-at", "6", "--resume", "1")
    (tmp_path / "c-ckpt").symlink_to(tmp_path / "a-ckpt")
    out, _ = _run(tmp_path, "c", 4, 2, *args, "--steps", str(STEPS), "--resume", "1")
    rows = {**_rows(tmp_path / "a"), **_rows(tmp_path / "b"), **_rows(out)}
    assert sorted(rows) == list(range(1, STEPS + 1))
    epoch = SAMPLES // GLOBAL_BATCH
    first = sorted(i for s in range(1, epoch + 1) for i in rows[s]["index"])
    assert first == list(range(SAMPLES)), "the first epoch reads every sample exactly once"
    second = [i for s in range(epoch + 1, STEPS + 1) for i in rows[s]["index"]]
    assert len(set(second)) == len(second), "no sample twice in the second epoch"
    for s in range(1, STEPS + 1):
        want = ref_rows[s]
        assert (rows[s]["lr"], rows[s]["momentum"], rows[s]["index"]) == \
            (want["lr"], want["momentum"], want["index"]), s
        assert rows[s]["loss"] == want["loss"], s
    assert len({r["lr"] for r in rows.values()}) == STEPS, "the schedule moves every step"
    assert _differences(_tensors(out), ref) == []
