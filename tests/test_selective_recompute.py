"""Per-segment (selective) recompute (issue #32, Note [Selective recompute] in
varuna/core/selective_recompute.py): recomputing some segments of a stage changes neither losses
nor weights (deterministic mode, bit for bit, against whole-stage recompute and against none),
the memory model moves as the set does, and auto-config recomputes only what memory needs."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch

import varuna
from simulator.autoconfig import autoconfigure
from simulator.config import SimConfig
from simulator.costs import stage_cost_tables, stage_memory
from simulator.engine import simulate
from varuna.core.calibration import Calibration
from varuna.core.selective_recompute import choose_recompute_segments, recompute_blocks

sys.path.insert(0, str(Path(__file__).parent))
from models import build_model  # noqa: E402

M, MICRO = 8, 2


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 * step)
    idx = torch.randint(0, 256, (M, 17), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def _train(schedule: str, recompute: bool, segments, steps: int = 2, det: bool = True, lr: float = 1e-2):
    """The tiny GPT (dropout on, tied embedding, clipping) in one process: per-step losses, the
    sha256 of every parameter, and how many blocks a recomputed micro-batch ran as."""
    engine = varuna.Engine(
        build_model("gpt", dropout=0.1),
        varuna.VarunaConfig(global_batch_size=M, micro_batch_size=MICRO, seed=3, schedule=schedule,
                            max_grad_norm=1.0, determinism=varuna.DeterminismConfig(enabled=det),
                            pipeline=varuna.PipelineConfig(recompute=recompute, recompute_segments=segments)),
        example_batch=_batch(0),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr),
    )
    try:
        losses = [engine.train_step(_batch(s)).loss for s in range(1, steps + 1)]
        digests = {n: hashlib.sha256(p.detach().contiguous().numpy().tobytes()).hexdigest()
                   for n, p in engine.named_parameters()}
        blocks = engine._executor.s.blocks(0)
        return losses, digests, engine.profile.num_segments, blocks
    finally:
        engine.close()


@pytest.fixture(scope="module")
def whole_stage():
    return _train("gpipe", True, None)


@pytest.mark.parametrize("segments", [(), (1, 3), (0, 4)])
def test_selective_recompute_trains_the_bits_of_whole_stage_recompute_and_of_none(whole_stage, segments):
    """GPipe at 1×1 recomputes every micro-batch but the last: with a recompute set the stage runs
    them as blocks (kept, recomputed, the source's and the loss's among them), and every loss and
    every parameter equals both whole-stage recompute and no recompute at all."""
    losses, digests, n, blocks = _train("gpipe", True, segments)
    assert n == 5 and blocks is not None, "a recompute set must run the stage as blocks"
    assert [(b.first, b.last, b.recompute) for b in blocks] == recompute_blocks(0, 4, set(segments))
    assert losses == whole_stage[0]
    assert digests == whole_stage[1], ", ".join(k for k in digests if digests[k] != whole_stage[1][k])
    if segments == ():
        none = _train("gpipe", False, None)
        assert (none[0], none[1]) == (losses, digests)


def test_the_comparison_can_fail(whole_stage):
    """Negative control: a change far smaller than a wrong chain of blocks would make (the learning
    rate by one part in 10^6) shows in the losses and the digests the tests above compare."""
    losses, digests, _, _ = _train("gpipe", True, (1,), lr=1e-2 * (1 + 1e-6))
    assert losses[0] == whole_stage[0][0]  # the first loss precedes any update
    assert losses != whole_stage[0] and digests != whole_stage[1]


def test_recompute_segments_past_the_model_get_one_line():
    with pytest.raises(ValueError, match="names segment 7 but the model has 5 segments"):
        _train("gpipe", True, (7,), steps=1)
    with pytest.raises(ValueError, match="segment indices >= 0"):
        varuna.VarunaConfig(global_batch_size=M, micro_batch_size=MICRO,
                            pipeline=varuna.PipelineConfig(recompute_segments=(-1,))).validate()
    with pytest.raises(ValueError, match="not supported with schedule zb-h1"):
        varuna.VarunaConfig(global_batch_size=M, micro_batch_size=MICRO, schedule="zb-h1",
                            pipeline=varuna.PipelineConfig(recompute_segments=(1,))).validate()


def test_blocks_partition_the_stage():
    assert recompute_blocks(0, 4, {0, 1, 3}) == [(0, 1, True), (2, 2, False), (3, 3, True), (4, 4, False)]
    assert recompute_blocks(0, 4, set()) == [(0, 4, False)]
