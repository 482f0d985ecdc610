"""CUDA-only checks of the audit (issue 31, docs/gpu.md): they skip without a GPU, and
``scripts/gpu_check.sh`` runs them on one (row 8) -- every skip there is a failure.

Host-staged messages (gloo carrying a CUDA job), header copies that do not sync, device
selection when processes share a GPU, batches moved to the device, the CUDA generator restored
around a meta model's keyed init, and deterministic mode's kernels on the device."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "gpt2"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import varuna  # noqa: E402
from varuna.cutting.batches import to_device  # noqa: E402
from varuna.cutting.cutpoint import SplitState  # noqa: E402
from varuna.cutting.split import materialize_stage, profile_model  # noqa: E402
from varuna.runtime.comm import LinkReceiver, pack_message, unpack_message  # noqa: E402
from varuna.runtime.layout import pick_device  # noqa: E402


def _tensors():
    g = torch.Generator(device="cuda").manual_seed(0)
    return (torch.randn(3, 5, device="cuda", generator=g).bfloat16(),
            torch.randint(0, 9, (4,), device="cuda", generator=g), torch.randn(7, device="cuda", generator=g))


def test_host_staged_message_round_trip():
    """CUDA tensors packed into a host message (gloo's transport) land in pinned memory, whole."""
    xs = _tensors()
    msg = pack_message(5, xs, torch.device("cpu"), size=4096)
    assert msg.device.type == "cpu" and msg.is_pinned() and msg.numel() == 4096
    mb, ys = unpack_message(msg)
    assert mb == 5 and all(torch.equal(x.cpu(), y) for x, y in zip(xs, ys))
    back = tuple(y.to("cuda", non_blocking=True) for y in ys)  # what the executor does with an arrival
    assert all(torch.equal(x, y) for x, y in zip(xs, back))


def test_device_message_round_trip():
    xs = _tensors()
    msg = pack_message(2, xs, torch.device("cuda"))
    assert msg.is_cuda
    mb, ys = unpack_message(msg)
    assert mb == 2 and all(torch.equal(x, y) for x, y in zip(xs, ys))


def test_receiver_thread_runs_on_the_compute_device_and_its_own_stream():
    """Note [Receiver streams]: the context a receiver thread runs under."""
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    recv = LinkReceiver.__new__(LinkReceiver)  # the context only: no group, no thread
    recv.device, recv.compute_device = dev, dev
    recv._stream = torch.cuda.Stream(dev)
    seen = {}

    def body():
        with recv._context():
            seen["device"] = torch.cuda.current_device()
            seen["stream"] = torch.cuda.current_stream(dev)

    t = threading.Thread(target=body)
    t.start()
    t.join(60)
    assert seen["device"] == dev.index and seen["stream"] == recv._stream


def test_more_local_processes_than_gpus_share_them(monkeypatch):
    n = torch.cuda.device_count()
    monkeypatch.setenv("LOCAL_RANK", str(n))  # one past the last GPU: the first one again
    assert pick_device(None) == torch.device("cuda", 0)
    assert pick_device("cuda").index is not None  # "cuda" gets the current device's index


def test_pinned_batch_to_device():
    batch = (torch.arange(10).pin_memory(), {"y": torch.ones(3).pin_memory()})
    moved = to_device(batch, "cuda")
    assert moved[0].is_cuda and torch.equal(moved[0].cpu(), torch.arange(10)) and moved[1]["y"].is_cuda


def test_meta_init_on_the_gpu_restores_its_generator():
    from model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8))
    batch = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    prof = profile_model(model, batch, lambda out, b: out, costs=False)
    torch.cuda.manual_seed(7)
    before = torch.cuda.get_rng_state()
    last, cuda = prof.num_segments - 1, torch.device("cuda")
    params = materialize_stage(model, prof, 0, last, SplitState(), device=cuda)
    assert all(p.is_cuda for p in params.values())
    assert torch.equal(torch.cuda.get_rng_state(), before)


def test_engine_trains_a_host_batch_on_the_gpu_deterministically(monkeypatch):
    """A CPU batch (the examples') trains on CUDA weights; deterministic mode twice in one process
    gives the same bits (keyed masks from the GPU's generator, deterministic cuBLAS)."""
    from model import GPT, GPTConfig

    def run() -> list[float]:
        torch.default_generator.manual_seed(0)  # the CPU's only: the GPU's stream goes on between runs
        model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=32, dropout=0.1))
        g = torch.Generator().manual_seed(1)
        batch = (torch.randint(0, 256, (8, 32), generator=g), torch.randint(0, 256, (8, 32), generator=g))
        cfg = varuna.VarunaConfig(global_batch_size=8, micro_batch_size=2,
                                  determinism=varuna.DeterminismConfig(enabled=True),
                                  precision="bf16", stop_signals=())
        eng = varuna.Engine(model, cfg, example_batch=batch,
                            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        try:
            assert eng.device.type == "cuda"
            return [eng.train_step(batch).loss for _ in range(3)]
        finally:
            eng.close()

    try:
        first = run()
        torch.randn(100, device="cuda")  # move the global CUDA stream on: keyed masks must not care
        assert run() == first
    finally:
        torch.use_deterministic_algorithms(False)
