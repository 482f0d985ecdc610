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


class _HookCutBlock(torch.nn.Module):
    """A block with a CutPoint child that the user calls from a forward hook (no source edit)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.cut = CutPoint()

    def forward(self, x):
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("hooked", [True, False])
def test_cutpoint_attached_by_a_forward_hook_cuts_after_the_block(hooked):
    """A CutPoint called from the block's own forward hook marks the block's end: the block is in
    one segment (not 'spanning', which made every stage run it) and the last stage skips it.
    Negative control (hooked=False): the same cut placed as a child called from the parent's
    forward gives the same split, so the hook path is held to the plain path's behaviour."""
    torch.manual_seed(0)
    blocks = [_HookCutBlock(), _HookCutBlock()]

    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.b0, self.b1, self.head = blocks[0], blocks[1], torch.nn.Linear(8, 1)

        def forward(self, x):
            h = self.b0(x) if hooked else self.b0.cut(self.b0(x))
            h = self.b1(h) if hooked else self.b1.cut(self.b1(h))
            return self.head(h).sum()

    model = Parent()
    if hooked:
        for b in blocks:
            b.register_forward_hook(lambda mod, args, out: mod.cut(out))
    x = torch.randn(2, 8)
    prof = profile_model(model, x, lambda out, b: out, costs=False)
    assert prof.num_cutpoints == 2 and prof.spanning_modules == {""}, prof.spanning_modules
    assert prof.param_segments["b0.lin.weight"] == (0,) and prof.param_segments["b1.lin.weight"] == (1,)
    state = SplitState()
    for cp in (b.cut for b in blocks):
        cp._varuna_state = state
    materialize_stage(model, prof, 2, 2, state, device=torch.device("cpu"))
    ran = []
    for b in blocks:
        b.lin.register_forward_hook(lambda mod, args, out: ran.append(not out.is_meta))
    act = torch.randn(2, 8)
    state.run = ForwardRun(cutpoints=[b.cut for b in blocks], first_segment=2, last_segment=2, num_segments=3,
                           inputs=(act,))
    try:
        loss = model(x)
    finally:
        state.run = None
    assert not any(ran), "the last stage ran a block of an earlier stage on real tensors"
    torch.testing.assert_close(loss, model.head(act).sum(), rtol=0, atol=0)
