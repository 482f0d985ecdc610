"""Checkpoints: name-keyed optimizer state, shard plans, integrity, safety, kill -9, resume at any P×D.

Multi-process tests run tests/workers/ckpt_worker.py (tiny GPT, AdamW lr 1e-2, dropout on) under
gloo; single-process ones build an engine in this process (world size 1, no signal handlers).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distributed import ROOT, check_ok, free_port, run_world
from models import build_model

import varuna
from varuna.runtime.checkpoint import (
    MANIFEST,
    CheckpointError,
    list_checkpoints,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    plan_shards,
    read_shard,
    resolve_resume,
    step_dir_name,
    verify_checkpoint,
)

WORKER = Path(__file__).parent / "workers" / "ckpt_worker.py"
sys.path.insert(0, str(WORKER.parent))
from ckpt_worker import GLOBAL_BATCH, MICRO_BATCH, batch_for  # noqa: E402

TOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    """In-process engines run with one intra-op thread, like the workers (no oversubscription)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close(got: dict, ref: dict, what: str) -> None:
    assert got.keys() == ref.keys(), f"{what}: parameter sets differ: {sorted(got.keys() ^ ref.keys())}"
    for name, r in ref.items():
        err = rel_err(got[name], r)
        assert err <= TOL, f"{what}: {name} differs (relative error {err:.2e})"


# ---------------------------------------------------------------------------------------------
# Name-keyed optimizer state (fast)


def _params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter(torch.randn(*s, generator=g))
            for n, s in [("a.weight", (3, 4)), ("b.bias", (5,)), ("c.weight", (2, 2))]}


def _step(opt: torch.optim.Optimizer, params: dict, k: int) -> None:
    for i, (_, p) in enumerate(sorted(params.items())):
        p.grad = torch.full_like(p, 0.1 * (i + 1) * (k + 1)).sin()
    opt.step()


def test_optimizer_state_by_name_survives_reordering_and_regrouping():
    src = _params()
    opt = torch.optim.AdamW(list(src.values()), lr=1e-2, weight_decay=0.1)
    for k in range(3):
        _step(opt, src, k)
    sd = optimizer_state_by_name(opt, src)
    assert set(sd["state"]) == set(src) and sd["class"] == "AdamW"
    assert sd["param_groups"][0]["params"] == list(src)
    # Another layout: a fresh copy of the parameters, other order, two groups, other hyper-parameters.
    dst = {n: torch.nn.Parameter(p.detach().clone()) for n, p in src.items()}
    opt2 = torch.optim.AdamW([{"params": [dst["c.weight"], dst["a.weight"]]}, {"params": [dst["b.bias"]]}],
                             lr=5.0, weight_decay=0.0)
    load_optimizer_state_by_name(opt2, dst, sd)
    assert all(g["lr"] == 1e-2 and g["weight_decay"] == 0.1 for g in opt2.param_groups)
    for n in src:
        for key, v in opt.state[src[n]].items():
            assert torch.equal(opt2.state[dst[n]][key], v), (n, key)
    for k in range(3, 5):
        _step(opt, src, k)
        _step(opt2, dst, k)
    for n in src:
        assert torch.equal(src[n], dst[n]), n


def test_optimizer_state_subset_and_sgd_momentum():
    src = _params(1)
    opt = torch.optim.SGD(list(src.values()), lr=0.1, momentum=0.9)
    _step(opt, src, 0)
    part = optimizer_state_by_name(opt, src, only=["b.bias"])
    assert list(part["state"]) == ["b.bias"] and part["param_groups"][0]["params"] == ["b.bias"]
    dst = {"b.bias": torch.nn.Parameter(src["b.bias"].detach().clone())}
    opt2 = torch.optim.SGD(list(dst.values()), lr=1.0, momentum=0.9)
    load_optimizer_state_by_name(opt2, dst, part)
    got, want = opt2.state[dst["b.bias"]], opt.state[src["b.bias"]]
    assert torch.equal(got["momentum_buffer"], want["momentum_buffer"])


def test_optimizer_class_mismatch_and_foreign_parameter_are_errors():
    src = _params()
    opt = torch.optim.AdamW(list(src.values()), lr=1e-2)
    _step(opt, src, 0)
    sd = optimizer_state_by_name(opt, src)
    with pytest.raises(CheckpointError, match="AdamW but the engine's optimizer is SGD"):
        load_optimizer_state_by_name(torch.optim.SGD(list(src.values()), lr=0.1), src, sd)
    with pytest.raises(ValueError, match="not among the engine's parameters"):
        optimizer_state_by_name(opt, {"a.weight": src["a.weight"]})


# ---------------------------------------------------------------------------------------------
# Shard plans (fast)

SEGS = {"wte": (0, 3), "wpe": (0,), "b0": (0,), "b1": (1,), "b2": (2,), "ln": (3,)}
SIZES = {"wte": 800, "wpe": 100, "b0": 400, "b1": 400, "b2": 400, "ln": 8}


def _check_plan(plan, D):
    names = [n for s in plan for n in s.params]
    assert sorted(names) == sorted(SEGS), "every parameter in exactly one file"
    assert len({s.name for s in plan}) == len(plan)
    assert all(SEGS[n][0] == s.segment for s in plan for n in s.params), "saved by its first segment"


def test_plan_replicas_write_disjoint_nonempty_parts():
    plan = plan_shards(param_segments=SEGS, param_bytes=SIZES, stage_ranges=[(0, 1), (2, 3)], data_parallel=2)
    _check_plan(plan, 2)
    for stage in (0, 1):
        assert {s.replica for s in plan if s.stage == stage} == {0, 1}
    # The tied embedding has its own file, so the last stage need not read segment 0's blocks.
    assert [s.params for s in plan if "wte" in s.params] == [("wte",)]
    assert plan == plan_shards(param_segments=SEGS, param_bytes=SIZES, stage_ranges=[(0, 1), (2, 3)],
                               data_parallel=2), "deterministic"


def test_plan_splits_by_parameters_when_a_stage_has_fewer_files_than_replicas():
    plan = plan_shards(param_segments=SEGS, param_bytes=SIZES, stage_ranges=[(0, 0), (1, 3)], data_parallel=3)
    _check_plan(plan, 3)
    stage0 = [s for s in plan if s.stage == 0]
    assert {s.replica for s in stage0} == {0, 1, 2}, [(s.name, s.params, s.replica) for s in stage0]
    assert all(s.segment == 0 for s in stage0)


# ---------------------------------------------------------------------------------------------
# Single-process engine (world size 1)


def make_engine(ckpt: Path, *, model=None, micro_batch_size: int = MICRO_BATCH, **cfg) -> varuna.Engine:
    cfg.setdefault("resume", "0")
    return varuna.Engine(
        model or build_model("gpt", dropout=0.1),
        varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=micro_batch_size, seed=7,
                            stop_signals=(), checkpoint_dir=str(ckpt), **cfg),
        example_batch=batch_for(1),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    )


def params_of(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.named_parameters()}


@pytest.fixture
def two_checkpoints(tmp_path):
    """Checkpoints after steps 1 and 2 of one run, and the parameters at each."""
    ckpt = tmp_path / "ckpt"
    eng = make_engine(ckpt)
    snaps = {}
    for step in (1, 2):
        eng.train_step(batch_for(step))
        eng.save_checkpoint(wait=True)
        snaps[step] = params_of(eng)
    assert eng.checkpointer.last_ok
    eng.close()
    return ckpt, snaps


def test_resume_continues_after_the_newest_checkpoint(tmp_path, two_checkpoints):
    ckpt, snaps = two_checkpoints
    assert [c.step for c in list_checkpoints(ckpt)] == [1, 2]
    eng = make_engine(ckpt, resume="1")
    assert eng.step_count == 2
    assert_close(params_of(eng), snaps[2], "resumed")
    eng.close()


def test_load_with_another_micro_batch_size(tmp_path, two_checkpoints):
    ckpt, snaps = two_checkpoints
    eng = make_engine(ckpt, micro_batch_size=4, resume="1")
    assert eng.step_count == 2 and len(eng.micro_plan[0]) == 2
    assert_close(params_of(eng), snaps[2], "resumed with m=4")
    eng.train_step(batch_for(3))
    eng.close()


@pytest.mark.parametrize("damage", ["truncate", "alter", "delete"])
def test_corrupt_file_is_detected_and_that_checkpoint_skipped(tmp_path, two_checkpoints, damage, caplog):
    ckpt, snaps = two_checkpoints
    victim = ckpt / step_dir_name(2) / "seg002-00.pt"
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "alter":
        victim.write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    else:
        victim.unlink()
    assert verify_checkpoint(ckpt / step_dir_name(2)), "verify_checkpoint must report it"
    with caplog.at_level(logging.WARNING, logger="varuna.runtime.checkpoint"):
        eng = make_engine(ckpt, resume="1")
    assert eng.step_count == 1
    assert_close(params_of(eng), snaps[1], "resumed from the older checkpoint")
    warned = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert warned and step_dir_name(2) in warned[0] and "seg002-00.pt" in warned[0], warned
    eng.close()


def test_checkpoint_without_manifest_does_not_exist(tmp_path, two_checkpoints):
    ckpt, _ = two_checkpoints
    (ckpt / step_dir_name(2) / MANIFEST).unlink()
    eng = make_engine(ckpt, resume="1")
    assert eng.step_count == 1
    eng.close()


class Evil:
    """A custom class: weights_only unpickling must refuse it (it could run code)."""

    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickled_custom_object_is_refused(tmp_path, two_checkpoints):
    ckpt, _ = two_checkpoints
    step_dir = ckpt / step_dir_name(2)
    victim = step_dir / "seg001-00.pt"
    good = read_shard(victim)
    torch.save({**good, "extra": Evil()}, victim)
    # Make the manifest agree, so only the safe unpickler stands between the file and the process.
    m = json.loads((step_dir / MANIFEST).read_text())
    data = victim.read_bytes()
    for f in m["files"]:
        if f["name"] == victim.name:
            f["bytes"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (step_dir / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="refusing to load"):
        read_shard(victim)
    with pytest.raises(CheckpointError, match=r"seg001-00.pt: refusing to load.*objects other than tensors"):
        make_engine(ckpt, resume="1")


def test_keep_prunes_old_checkpoints_and_auto_resume(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("VARUNA_CHECKPOINT_DIR", str(ckpt))
    monkeypatch.setenv("VARUNA_RESUME", "auto")
    eng = varuna.Engine(build_model("gpt"), varuna.VarunaConfig(
        global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=7, stop_signals=(),
        checkpoint_every=1, keep_checkpoints=2), example_batch=batch_for(1),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    assert eng.step_count == 0, "auto with no checkpoint starts from scratch"
    for step in range(1, 5):
        eng.train_step(batch_for(step))
    assert eng.checkpointer.wait() and eng.checkpointer.last_ok
    assert [(c.step, c.complete) for c in list_checkpoints(ckpt)] == [(3, True), (4, True)]
    expect = params_of(eng)
    eng.close()
    eng = varuna.Engine(build_model("gpt"), varuna.VarunaConfig(
        global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=7, stop_signals=()),
        example_batch=batch_for(1), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    assert eng.step_count == 4, "VARUNA_RESUME=auto + VARUNA_CHECKPOINT_DIR resume without config"
    assert_close(params_of(eng), expect, "env resume")
    eng.close()


def test_state_dict_round_trip(tmp_path):
    eng = make_engine(tmp_path)
    eng.train_step(batch_for(1))
    sd = copy.deepcopy(eng.state_dict())  # state_dict() holds references to live tensors, like torch's
    r2 = eng.train_step(batch_for(2)).loss
    after2 = params_of(eng)
    other = make_engine(tmp_path)
    other.load_state_dict(sd)
    assert other.step_count == 1
    assert other.train_step(batch_for(2)).loss == pytest.approx(r2, rel=1e-6)
    assert_close(params_of(other), after2, "state_dict round trip")
    eng.close()
    other.close()


def test_bad_settings_are_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="checkpoint_every must be >= 0"):
        make_engine(tmp_path, checkpoint_every=-1)
    with pytest.raises(ValueError, match="keep_checkpoints must be >= 1"):
        make_engine(tmp_path, keep_checkpoints=0)
    with pytest.raises(ValueError, match="use 1, 0 or auto"):
        resolve_resume("sometimes")
    monkeypatch.delenv("VARUNA_RESUME", raising=False)
    assert resolve_resume(None) == "never"
    monkeypatch.setenv("VARUNA_RESUME", "auto")
    assert resolve_resume(None) == "auto" and resolve_resume("0") == "never", "the config wins"
    monkeypatch.delenv("VARUNA_RESUME")
    with pytest.raises(CheckpointError, match="no complete, sound checkpoint"):
        make_engine(tmp_path / "empty", resume="1")
    monkeypatch.delenv("VARUNA_CHECKPOINT_DIR", raising=False)
    with pytest.raises(ValueError, match="needs a checkpoint directory"):
        varuna.Engine(build_model("gpt"), varuna.VarunaConfig(global_batch_size=8, micro_batch_size=2,
                                                              stop_signals=(), resume="1"),
                      example_batch=batch_for(1), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_checkpoint_of_another_model_is_an_error(tmp_path, two_checkpoints):
    from model import GPT, GPTConfig

    ckpt, _ = two_checkpoints
    torch.manual_seed(0)
    other = GPT(GPTConfig(block_size=16, n_layer=4, n_head=2, n_embd=16, dropout=0.1))
    with pytest.raises(CheckpointError, match="another model configuration"):
        make_engine(ckpt, model=other, resume="1")


# ---------------------------------------------------------------------------------------------
# Multi-process


def world(tmp: Path, name: str, P: int, D: int, *args: str, timeout_s: float = 120):
    out = tmp / name
    return out, run_world(WORKER, P * D, ["--out", str(out), "--pipeline-depth", str(P), *args],
                          env={"VARUNA_PIPELINE_DEPTH": str(P)}, timeout_s=timeout_s)


def gather(out: Path) -> tuple[list[dict], dict]:
    """Every rank's report and the union of their final parameters (copies must agree)."""
    reports, params = [], {}
    for f in sorted(out.glob("rank*.json")):
        reports.append(json.loads(f.read_text()))
        for n, t in torch.load(f.with_suffix(".pt"), weights_only=True).items():
            if n in params:
                assert torch.equal(params[n], t), f"copies of {n} disagree"
            params[n] = t
    return reports, params


@pytest.fixture(scope="module")
def run_2x2(tmp_path_factory):
    """5 uninterrupted steps at P=2, D=2, checkpointing after step 3."""
    tmp = tmp_path_factory.mktemp("ckpt2x2")
    out, res = world(tmp, "ref", 2, 2, "--ckpt-dir", str(tmp / "ckpt"), "--steps", "5", "--save-at", "3")
    check_ok(res)
    return tmp, out


@pytest.mark.slow
@pytest.mark.parametrize("P,D", [(4, 1), (1, 1), (2, 2)])
def test_resume_at_another_layout_equals_uninterrupted_run(run_2x2, P, D):
    tmp, ref_out = run_2x2
    ref_reports, ref_params = gather(ref_out)
    ref_losses = dict((s, loss) for s, loss in ref_reports[0]["losses"])
    out, res = world(tmp, f"resume{P}x{D}", P, D, "--ckpt-dir", str(tmp / "ckpt"), "--steps", "5",
                     "--resume", "1")
    check_ok(res)
    reports, params = gather(out)
    assert len(reports) == P * D and all(r["P"] == P and r["D"] == D for r in reports)
    assert all(r["first_step"] == 4 for r in reports), "the resumed run's first step is 4"
    for s, loss in reports[0]["losses"]:
        assert abs(loss - ref_losses[s]) <= TOL * abs(ref_losses[s]), (s, loss, ref_losses[s])
    assert [s for s, _ in reports[0]["losses"]] == [4, 5]
    assert_close(params, ref_params, f"final parameters resumed at {P}x{D}")
    if (P, D) == (2, 2):  # same layout: the resumed run is bit-identical
        assert all(torch.equal(params[n], ref_params[n]) for n in ref_params)
        assert reports[0]["losses"] == [[s, ref_losses[s]] for s in (4, 5)]


@pytest.fixture(scope="module")
def run_2x2_deterministic(tmp_path_factory):
    """The same in deterministic mode (docs/determinism.md) with AdamW's default eps."""
    tmp = tmp_path_factory.mktemp("ckpt2x2det")
    out, res = world(tmp, "ref", 2, 2, "--ckpt-dir", str(tmp / "ckpt"), "--steps", "5", "--save-at", "3",
                     "--deterministic", "--eps", "1e-8")
    check_ok(res)
    return tmp, out


@pytest.mark.slow
@pytest.mark.parametrize("P,D", [(1, 1), (4, 1)])
def test_deterministic_resume_at_another_layout_is_bit_identical(run_2x2_deterministic, P, D):
    """A morph (checkpoint at 2×2, resume at P×D) loses nothing: with layout-independent
    numerics the resumed run is bit-for-bit the uninterrupted one."""
    tmp, ref_out = run_2x2_deterministic
    ref_reports, ref_params = gather(ref_out)
    out, res = world(tmp, f"resume{P}x{D}", P, D, "--ckpt-dir", str(tmp / "ckpt"), "--steps", "5",
                     "--resume", "1", "--deterministic", "--eps", "1e-8")
    check_ok(res)
    reports, params = gather(out)
    assert reports[0]["first_step"] == 4
    assert reports[0]["losses"] == ref_reports[0]["losses"][3:]
    assert params.keys() == ref_params.keys()
    assert [n for n in ref_params if not torch.equal(params[n], ref_params[n])] == []


@pytest.mark.slow
def test_replicas_split_the_writing(run_2x2):
    tmp, _ = run_2x2
    m = json.loads((tmp / "ckpt" / step_dir_name(3) / MANIFEST).read_text())
    assert m["step"] == 3 and m["config"]["P"] == 2 and m["config"]["D"] == 2
    names = [n for f in m["files"] for n in f["params"]]
    assert len(names) == len(set(names)) == len(m["parameters"]), "each parameter saved once"
    for stage in (0, 1):
        owners = {f["replica"] for f in m["files"] if f["stage"] == stage}
        assert owners == {0, 1}, f"stage {stage}: files written by replicas {owners}, want both"
        assert all(f["rank"] == f["replica"] * 2 + stage for f in m["files"] if f["stage"] == stage)
    assert verify_checkpoint(tmp / "ckpt" / step_dir_name(3)) == []


# (rank, progress event, occurrence, step that must be resumed): kill -9 at that point of the save
# of step 2 (step 1's checkpoint is complete). Occurrences of copy-chunk are drawn from a seeded RNG.
_rng = random.Random(2024)
KILLS = [
    (1, "local-write", 1, 1),
    (1, "copy-chunk", _rng.randint(1, 60), 1),
    (0, "copy-chunk", _rng.randint(1, 90), 1),
    (0, "marker", 1, 1),
    (0, "commit-tmp", 1, 1),
    (1, "marker", 1, 2),  # rank 1's part was already in the store: rank 0 completes the checkpoint
    (0, "commit", 1, 2),  # killed right after the commit: the new checkpoint exists
]


@pytest.mark.slow
@pytest.mark.parametrize("rank,event,count,expect", KILLS, ids=[f"r{k[0]}-{k[1]}-{k[2]}" for k in KILLS])
def test_kill_during_save_keeps_previous_checkpoint(tmp_path, rank, event, count, expect):
    ckpt = tmp_path / "ckpt"
    out, res = world(tmp_path, "run", 2, 1, "--ckpt-dir", str(ckpt), "--steps", "2", "--save-at", "1,2",
                     "--timeout", "6", "--chunk-bytes", "4096", "--kill-rank", str(rank), "--kill-at", "2",
                     "--kill-event", event, "--kill-count", str(count))
    assert res[rank].returncode == -signal.SIGKILL, f"rank {rank} was not killed:\n{res[rank].stdout[-2000:]}"
    complete = [c.step for c in list_checkpoints(ckpt) if c.complete]
    assert complete and complete[-1] == expect, complete
    assert verify_checkpoint(ckpt / step_dir_name(expect)) == []
    if expect == 2:
        assert verify_checkpoint(ckpt / step_dir_name(1)) == [], "the previous one stays intact"
    snap = {}
    for r in (0, 1):
        snap.update(torch.load(out / f"step{expect}-rank{r}.pt", weights_only=True))
    eng = make_engine(ckpt, resume="1")
    assert eng.step_count == expect
    assert_close(params_of(eng), snap, "resumed after the kill")
    eng.close()


def _start_world(script: Path, n: int, args: list[str], env: dict) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(n):
        e = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
             "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
             "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=e, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    return procs


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_random_external_kill_never_leaves_a_broken_complete_checkpoint(tmp_path, seed):
    rng = random.Random(seed)
    ckpt = tmp_path / "ckpt"
    args = ["--out", str(tmp_path / "run"), "--pipeline-depth", "2", "--ckpt-dir", str(ckpt),
            "--steps", "200", "--every", "1", "--keep", "2", "--timeout", "5"]
    procs = _start_world(WORKER, 2, args, env={"VARUNA_PIPELINE_DEPTH": "2"})
    try:
        deadline = time.monotonic() + 60
        while not any(c.complete for c in list_checkpoints(ckpt)):
            alive = all(p.poll() is None for p in procs)
            assert time.monotonic() < deadline and alive, "no checkpoint appeared"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))
        procs[rng.randrange(2)].kill()  # SIGKILL, at a random point of training and saving
    finally:
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
    complete = [c for c in list_checkpoints(ckpt) if c.complete]
    assert complete
    for c in complete:
        assert verify_checkpoint(c.path) == [], f"complete checkpoint {c.path} is broken"
    eng = make_engine(ckpt, resume="1")
    assert eng.step_count == complete[-1].step
    eng.close()


TRAIN = ROOT / "examples" / "gpt2" / "train.py"
SMALL = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
         "--global-batch-size", "8", "--micro-batch-size", "2", "--eval-every", "0"]


@pytest.mark.slow
def test_stop_signal_checkpoints_and_launcher_env_resumes(tmp_path):
    """The launcher's stop protocol (SIGUSR1: finish the mini-batch, checkpoint, exit 0), then a
    relaunch at another P×D that resumes through VARUNA_RESUME / VARUNA_CHECKPOINT_DIR alone."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "first.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as f:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "varuna.launch", "--procs", "2", "--pipeline-depth", "2", str(TRAIN),
             "--steps", "100000", "--checkpoint-dir", str(ckpt), *SMALL],
            stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while "step     2/" not in log.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        launcher.send_signal(signal.SIGUSR1)
        assert launcher.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
    complete = [c for c in list_checkpoints(ckpt) if c.complete]
    assert len(complete) == 1 and complete[0].step >= 2 and verify_checkpoint(complete[0].path) == []
    saved = complete[0].step
    res = subprocess.run(
        [sys.executable, "-m", "varuna.launch", "--procs", "1", "--pipeline-depth", "1", str(TRAIN),
         "--steps", str(saved + 2), *SMALL],
        env={**env, "VARUNA_RESUME": "1", "VARUNA_CHECKPOINT_DIR": str(ckpt)},
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    steps = [int(line.split("] step")[1].split("/")[0])
             for line in res.stdout.splitlines() if "] step " in line]
    assert f"resumed from the checkpoint of step {saved}" in res.stdout
    assert steps == [saved + 1, saved + 2], res.stdout
