"""Sharded optimizer state and offload (issue #32): the flat layout, pieces stepping to the bits of
whole parameters, refusals, offload mechanics and the by-name state, in one process. The
multi-process bit-identity tests are in test_determinism.py (sharded layouts, checkpoints) and
test_live_morph.py (live morphs)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import varuna
from varuna.core.shard_layout import ALIGN, ShardLayout, shard_numel
from varuna.runtime.optimizer_state import optimizer_state_by_name
from varuna.runtime.sharded_optimizer import (
    ELEMENTWISE_OPTIMIZERS,
    FlatParameters,
    ShardedOptimizer,
    unshardable,
)

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from ckpt_worker import GLOBAL_BATCH, MICRO_BATCH, batch_for  # noqa: E402
from models import build_model  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_shards_are_equal_aligned_and_their_pieces_partition_every_parameter():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [1, 7, 63, 64, 65, 1000, rng.randint(1, 5000)]
        numels = {f"p{i}": rng.choice(sizes) for i in range(rng.randint(1, 9))}
        D = rng.randint(1, 6)
        layout = ShardLayout.of(numels, D)
        assert layout.shard_numel % ALIGN == 0 and layout.total == D * layout.shard_numel
        assert layout.shard_numel == shard_numel(list(numels.values()), D)
        covered = {n: [] for n in numels}
        for j in range(D):
            lo, hi = layout.shard_range(j)
            for pc in layout.pieces(j):
                assert lo <= pc.flat and pc.flat + pc.numel <= hi
                assert pc.start % ALIGN == 0 and (pc.stop % ALIGN == 0 or pc.stop == numels[pc.name])
                covered[pc.name].append((pc.start, pc.stop))
        for n, spans in covered.items():
            spans.sort()
            assert spans[0][0] == 0 and spans[-1][1] == numels[n]
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), f"{n}: pieces overlap or leave a gap"
        # no shard is mostly padding beyond what alignment forces
        used = layout.offsets[-1] + layout.numels[-1]
        assert layout.shard_numel < used / D + ALIGN


def _model_params(seed: int) -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [("emb", (37, 19)), ("w", (130,)), ("b", (1,)), ("m", (8, 64)), ("s", ())]
    return {n: nn.Parameter(torch.randn(s, generator=g) * 0.1) for n, s in shapes}


def _grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in _model_params(0).items()}


HYPER = {torch.optim.SGD: dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
         torch.optim.Adam: dict(lr=1e-2, weight_decay=0.1, amsgrad=True),
         torch.optim.AdamW: dict(lr=1e-2), torch.optim.RMSprop: dict(lr=1e-2, momentum=0.5, centered=True),
         torch.optim.NAdam: dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
         torch.optim.RAdam: dict(lr=1e-2), torch.optim.Adagrad: dict(lr=1e-2, initial_accumulator_value=0.1),
         torch.optim.Adamax: dict(lr=1e-2), torch.optim.Adadelta: dict(), torch.optim.Rprop: dict(),
         torch.optim.ASGD: dict(t0=1)}


def _stepped_pieces(cls, hyper, D: int, steps: int = 3) -> list[FlatParameters]:
    """Each replica j's flat parameters after stepping only its pieces (no all-gather)."""
    out = []
    for j in range(D):
        params = _model_params(0)
        flat = FlatParameters(params, D)
        shards = ShardedOptimizer(flat, cls(list(params.values()), **hyper), index=j)
        for k in range(steps):
            for n, p in params.items():
                p.grad = _grads(k)[n].clone()
            shards.bind_grads()
            shards.step()
        out.append(flat)
    return out


@pytest.mark.parametrize("cls", ELEMENTWISE_OPTIMIZERS, ids=lambda c: c.__name__)
def test_pieces_step_to_the_bits_of_whole_parameters(cls):
    """Note [Optimizer shards]: for every accepted optimizer, replica j's pieces after 3 steps
    equal those elements of the parameters stepped whole, bit for bit (D = 3 cuts the 37×19
    embedding and the 8×64 matrix inside)."""
    hyper = HYPER[cls]
    ref = _model_params(0)
    opt = cls(list(ref.values()), **hyper)
    for k in range(3):
        for n, p in ref.items():
            p.grad = _grads(k)[n].clone()
        opt.step()
    D = 3
    for j, flat in enumerate(_stepped_pieces(cls, hyper, D)):
        for pc in flat.layout.pieces(j):
            got = flat.buffer[pc.flat : pc.flat + pc.numel]
            want = ref[pc.name].detach().reshape(-1)[pc.start : pc.stop]
            assert torch.equal(got, want), f"{cls.__name__}: replica {j}'s piece of {pc.name} differs"
        assert len({pc.name for pc in flat.layout.pieces(j)}) >= 1


def test_a_non_elementwise_optimizer_on_pieces_differs_which_is_why_it_is_refused():
    """Negative control: Adafactor's factored statistics see a piece's rows, not the matrix's,
    so the comparison above does detect an optimizer that must not be sharded."""
    ref = _model_params(0)
    opt = torch.optim.Adafactor(list(ref.values()), lr=1e-2)
    for k in range(2):
        for n, p in ref.items():
            p.grad = _grads(k)[n].clone()
        opt.step()
    params = _model_params(0)
    flat = FlatParameters(params, 3)
    # bypass the refusal to show what it prevents
    pieces = [nn.Parameter(flat.buffer[pc.flat : pc.flat + pc.numel]) for pc in flat.layout.pieces(0)]
    names = [pc for pc in flat.layout.pieces(0)]
    op2 = torch.optim.Adafactor(pieces, lr=1e-2)
    for k in range(2):
        for q, pc in zip(pieces, names):
            q.grad = _grads(k)[pc.name].reshape(-1)[pc.start : pc.stop].clone()
        op2.step()
    differs = [pc.name for q, pc in zip(pieces, names)
               if not torch.equal(q.detach(), ref[pc.name].detach().reshape(-1)[pc.start : pc.stop])]
    assert differs, "Adafactor stepped pieces like whole matrices: the control could not fail"


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.LBFGS(ps),
    lambda ps: torch.optim.Adafactor(ps),
    lambda ps: type("Lamb", (torch.optim.Adam,), {})(ps),
], ids=["lbfgs", "adafactor", "subclass"])
def test_an_optimizer_that_is_not_elementwise_is_refused_in_one_line(make):
    reason = unshardable(make([nn.Parameter(torch.ones(4, 4))]))
    assert reason is not None and "\n" not in reason and "optimizer_state.shard" in reason


def _engine(**optimizer_state) -> varuna.Engine:
    return varuna.Engine(
        build_model("gpt", dropout=0.1),
        varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=7,
                            stop_signals=(), max_grad_norm=1.0,
                            optimizer_state=varuna.OptimizerStateConfig(**optimizer_state)),
        example_batch=batch_for(1),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    )


def _storages(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_offload_keeps_the_state_in_its_own_host_buffer_and_steps_identically():
    """Issue #32, offload's mechanics on a CPU-only machine: the optimizer's parameters and
    state are separate host tensors (no storage shared with the model's), the model's weights
    are written back after each step, and 3 steps give the bits of the plain engine."""
    plain, off = _engine(), _engine(offload=True)
    try:
        for step in (1, 2, 3):
            assert off.train_step(batch_for(step)).loss == plain.train_step(batch_for(step)).loss
        model_storages = {_storages(p) for p in off.parameters()}
        opt_params = [q for g in off.optimizer.param_groups for q in g["params"]]
        assert opt_params and all(_storages(q) not in model_storages for q in opt_params)
        for st in off.optimizer.state.values():
            assert all(_storages(v) not in model_storages for v in st.values() if v.dim() > 0)
        for (n, p), (_, q) in zip(plain.named_parameters(), off.named_parameters()):
            assert torch.equal(p, q), n
        # the state reads back by name, whole, as the plain engine's
        a, b = plain.optimizer_state(), off.optimizer_state()
        assert a["state"].keys() == b["state"].keys()
        for n in a["state"]:
            for k in a["state"][n]:
                assert torch.equal(a["state"][n][k], b["state"][n][k]), (n, k)
    finally:
        plain.close()
        off.close()


def test_sharded_state_round_trips_by_name_into_an_unsharded_engine():
    """One replica "sharded" (D = 1: one shard) saves by name; the plain engine loads it and
    the next step gives the same bits as the sharded engine's."""
    sharded, plain = _engine(shard=True), _engine()
    try:
        sharded.train_step(batch_for(1))
        sd = sharded.state_dict()
        ref = optimizer_state_by_name(plain.optimizer, dict(plain.named_parameters()))
        assert ref["state"] == {}  # not stepped yet
        shapes = {n: p.shape for n, p in plain.stage_params.items()}
        assert {n: v.shape for n, v in sd["params"].items()} == shapes
        for n, st in sd["optimizer"]["state"].items():
            assert st["exp_avg"].shape == sd["params"][n].shape, "state is shaped as the parameter"
        plain.load_state_dict(sd)
        assert plain.train_step(batch_for(2)).loss == sharded.train_step(batch_for(2)).loss
        for (n, p), (_, q) in zip(plain.named_parameters(), sharded.named_parameters()):
            assert torch.equal(p, q), n
    finally:
        sharded.close()
        plain.close()


def test_sharding_with_two_weight_versions_is_refused_in_one_line():
    cfg = varuna.VarunaConfig(global_batch_size=8, micro_batch_size=2, schedule="2bw",
                              optimizer_state=varuna.OptimizerStateConfig(shard=True))
    with pytest.raises(ValueError, match="weight versions.*optimizer_state.shard/offload off"):
        cfg.validate()
    bad = varuna.VarunaConfig(global_batch_size=8, micro_batch_size=2,
                              optimizer_state=varuna.OptimizerStateConfig(grad_reduce="ring"))
    with pytest.raises(ValueError, match="unknown optimizer_state.grad_reduce 'ring'"):
        bad.validate()


@pytest.mark.slow
@pytest.mark.parametrize("reduce", ["reduce_scatter", "all_reduce"])
def test_sharded_state_without_determinism_trains_like_one_process(tmp_path, reduce):
    """The ordinary (ring) path, at 2×2 with each reduction of sharded gradients: every step's
    loss within float rounding of one process's, and the replicas' weights identical after the
    all-gathers (the worker checks every copy of every parameter)."""
    from test_determinism import run

    ref, _ = run(tmp_path, 1, 1, "--no-deterministic", "--steps", "4")
    got, _ = run(tmp_path, 2, 2, "--no-deterministic", "--steps", "4", "--shard", "--grad-reduce", reduce)
    assert got == pytest.approx(ref, rel=1e-5)
