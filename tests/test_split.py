"""Stage materialisation: only the stage's own modules compute; the rest are placeholders."""

from __future__ import annotations

import pytest
import torch
from models import build_model, make_batch

from varuna.cutting.cutpoint import CutPoint, ForwardRun, SplitState, StopForward
from varuna.cutting.split import materialize_stage, profile_model


@pytest.mark.parametrize("stage", [0, 2, 4])
def test_only_the_stage_modules_compute(stage):
    model = build_model("gpt").eval()  # blocks live in an nn.ModuleList, which is never called
    batch = make_batch("gpt", 2)
    prof = profile_model(model, batch, lambda out, b: out, measure=False)
    state = SplitState()
    cuts = {n: m for n, m in model.named_modules() if isinstance(m, CutPoint)}
    for cp in cuts.values():
        cp._varuna_state = state
    reference_block = None
    if 0 < stage < 4:
        import copy

        reference_block = copy.deepcopy(model.blocks[stage])
    materialize_stage(model, prof, stage, stage, state, device=torch.device("cpu"))
    from torch.overrides import TorchFunctionMode

    class CountLinear(TorchFunctionMode):
        """Counts matrix products on real (non-meta) tensors: actual compute, whatever the weights."""

        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.linear and not args[0].is_meta:
                self.n += 1
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 16, 32)
    run = ForwardRun(cutpoints=[cuts[n] for n in prof.cutpoint_names], first_segment=stage,
                     last_segment=stage if stage < 4 else len(cuts), num_segments=5,
                     inputs=(x,) if stage > 0 else None)
    state.run = run
    counter = CountLinear()
    try:
        with counter:
            out = model(*batch)
    except StopForward as stop:
        out = stop.outputs[0]
    finally:
        state.run = None
    # One GPT block runs 4 linears (qkv, attention proj, mlp fc, mlp proj); the head runs 1.
    assert counter.n == {0: 4, 2: 4, 4: 1}[stage], f"stage {stage} ran {counter.n} real linears"
    if reference_block is not None:
        torch.testing.assert_close(out, reference_block(x), rtol=0, atol=0)
