"""The CUDA audit of issue 31, the parts a CPU can check (docs/gpu.md): deterministic mode sets
``CUBLAS_WORKSPACE_CONFIG`` before the engine's first kernel, how a shared GPU is detected and
what then carries the traffic, batches on the stage's device, one loss sync per step, and a meta
model's keyed init leaving the script's RNG alone. The GPU-only checks are in tests/test_cuda.py
(run on a GPU by scripts/gpu_check.sh, row 8)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "gpt2"))

import varuna  # noqa: E402
from varuna.cutting.batches import to_device  # noqa: E402
from varuna.cutting.cutpoint import SplitState  # noqa: E402
from varuna.cutting.split import materialize_stage, profile_model  # noqa: E402
from varuna.runtime.determinism import cuda_deterministic_env  # noqa: E402
from varuna.runtime.executor import _Work  # noqa: E402
from varuna.runtime.layout import Layout, choose_transport, shares_device  # noqa: E402

CUBLAS = "CUBLAS_WORKSPACE_CONFIG"
COMM_BACKEND_ENV = "VARUNA_COMM_BACKEND"


class EnvSpy(nn.Module):
    """Records ``$CUBLAS_WORKSPACE_CONFIG`` at every forward: the dry run is the engine's first."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.seen: list[str | None] = []

    def forward(self, x, y):
        import os

        self.seen.append(os.environ.get(CUBLAS))
        return F.mse_loss(self.lin(x).squeeze(-1), y)


@pytest.fixture
def restore_determinism():
    threads = torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = False
    torch.set_num_threads(threads)


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_mode_sets_cublas_config_before_the_first_kernel(monkeypatch, restore_determinism,
                                                                       deterministic):
    monkeypatch.delenv(CUBLAS, raising=False)
    model = EnvSpy()
    batch = (torch.randn(4, 4), torch.randn(4))
    eng = varuna.Engine(model, varuna.VarunaConfig(global_batch_size=4, micro_batch_size=2, device="cpu",
                                                   determinism=varuna.DeterminismConfig(enabled=deterministic),
                                                   stop_signals=()),
                        example_batch=batch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    try:
        eng.train_step(batch)
    finally:
        eng.close()
    # The dry run is the first forward: the variable was in place before it (deterministic), and
    # the default mode (negative control) leaves the environment alone.
    assert model.seen and all(v == (":4096:8" if deterministic else None) for v in model.seen)
    if deterministic:
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark


def test_cublas_config_values():
    env: dict[str, str] = {}
    assert cuda_deterministic_env(environ=env) == ":4096:8" and env[CUBLAS] == ":4096:8"
    kept = {CUBLAS: ":16:8"}
    # the other deterministic setting stays as it is
    assert cuda_deterministic_env(environ=kept) == ":16:8" and kept == {CUBLAS: ":16:8"}
    with pytest.raises(ValueError, match=":4096:8"):
        cuda_deterministic_env(environ={CUBLAS: ":0:0"})


@pytest.mark.parametrize("env,count,index,shared", [
    ({"LOCAL_WORLD_SIZE": "2"}, 1, 0, True),            # two processes, one GPU: rank 0 knows too
    ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}, 2, 1, False),  # one GPU each
    ({"LOCAL_RANK": "1"}, 1, 0, True),                  # no LOCAL_WORLD_SIZE, but past the last GPU
    ({}, 1, 0, False),
    ({"LOCAL_WORLD_SIZE": "8"}, 8, 3, False),
])
def test_shared_gpu_detection(env, count, index, shared):
    assert shares_device(torch.device("cuda", index), environ=env, device_count=count) is shared
    assert shares_device(torch.device("cpu"), environ=env, device_count=count) is False


def test_transport_choice_and_bad_input(monkeypatch):
    monkeypatch.delenv(COMM_BACKEND_ENV, raising=False)
    one, cpu = Layout(world=1, rank=0, P=1, D=1), torch.device("cpu")
    t = choose_transport(one, cpu)
    assert (t.backend, t.link_device.type, t.description) == (None, "cpu", "gloo")
    with pytest.raises(ValueError, match="needs CUDA"):
        choose_transport(one, cpu, "nccl")
    with pytest.raises(ValueError, match=COMM_BACKEND_ENV):
        choose_transport(one, cpu, environ={COMM_BACKEND_ENV: "mpi"})
    with pytest.raises(ValueError, match="comm_backend"):
        varuna.VarunaConfig(global_batch_size=4, micro_batch_size=2, comm_backend="mpi").validate()


def test_batches_go_to_the_device_once():
    batch = {"x": torch.ones(2, 3), "n": 3, "ids": torch.arange(2)}
    assert to_device(batch, "cpu") is batch  # already there: not even rebuilt
    moved = to_device(batch, "meta")  # a device of its own, without a GPU
    assert moved["x"].is_meta and moved["ids"].is_meta and moved["n"] == 3 and not batch["x"].is_meta


def test_losses_are_read_in_one_go_in_execution_order():
    class Det:  # DeterministicGrads' part that the losses go to
        losses: dict[int, float] = {}

    w = _Work(det=Det, global_batch=8)
    values = [(3, 2, torch.tensor(1.5)), (1, 4, torch.tensor([2.0])), (0, 2, torch.tensor(0.1))]
    w.pending_losses.extend(values)
    expected = 0.0
    for _, size, t in values:
        expected += float(t) * size / 8  # what one read per micro-batch summed, in this order
    assert w.loss_sum == expected and not w.pending_losses
    assert Det.losses == {3: 1.5, 1: 2.0, 0: pytest.approx(0.1)}
    w.pending_losses.append((5, 8, torch.tensor(4.0)))
    w.loss_sum = 0.0  # a no-flush window's reset: what was pending belongs to the step before
    assert w.loss_sum == 0.0 and Det.losses[5] == 4.0


def test_meta_init_leaves_the_scripts_rng_alone():
    from model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8))
    batch = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    prof = profile_model(model, batch, lambda out, b: out, costs=False)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    last, cpu = prof.num_segments - 1, torch.device("cpu")
    params = materialize_stage(model, prof, 0, last, SplitState(), device=cpu)
    assert params and torch.equal(torch.get_rng_state(), before)
    # and the keyed init itself is reproducible: the same values from another global seed
    first = {n: p.detach().clone() for n, p in params.items()}
    with torch.device("meta"):
        again = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8))
    torch.manual_seed(999)
    second = materialize_stage(again, prof, 0, last, SplitState(), device=cpu)
    assert all(torch.equal(first[n], second[n]) for n in first)
