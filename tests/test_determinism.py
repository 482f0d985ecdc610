"""Deterministic mode: bit-identical weights and losses at any P×D, with negative controls."""

from __future__ import annotations

import copy
import json
import queue
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from distributed import check_ok, run_world

import varuna
from varuna.core.batching import plan_microbatches
from varuna.core.schedule import BACKWARD
from varuna.core.timeline import Timeline
from varuna.cutting.cutpoint import CutPoint, SplitState
from varuna.cutting.split import materialize_stage, profile_model
from varuna.runtime.comm import Arrival
from varuna.runtime.determinism import DeterminismError, TreeAccumulator, combine_nodes, first_difference
from varuna.runtime.executor import ScheduleExecutor, StageModel
from varuna.testing.negative_controls import with_negative_controls

sys.path.insert(0, str(Path(__file__).parent / "workers"))
import det_attention_worker as attn  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "det_worker.py"
ATTN_WORKER = Path(__file__).parent / "workers" / "det_attention_worker.py"


def run(
    tmp_path: Path, P: int, D: int, *flags: str, worker: Path = WORKER
) -> tuple[list[float], dict[str, str]]:
    out = tmp_path / f"{worker.stem}-{P}x{D}{''.join(flags)}"
    check_ok(
        run_world(
            worker,
            P * D,
            ["--out", str(out), *flags],
            env={"VARUNA_PIPELINE_DEPTH": str(P), "VARUNA_DATA_PARALLEL": str(D)},
        )
    )
    losses, digests = None, {}
    for f in sorted(out.glob("rank*.json")):
        r = json.loads(f.read_text())
        losses = losses or r["losses"]
        assert r["losses"] == losses, "ranks disagree on the loss"
        for n, d in r["digests"].items():
            assert digests.setdefault(n, d) == d, f"copies of {n} differ between ranks"
    return losses, digests


def test_tree_sum_does_not_depend_on_replicas_or_arrival_order():
    rng = random.Random(0)
    for n in (1, 2, 5, 7, 12, 16):
        vals = [torch.randn(64) * 10 ** rng.randint(-4, 4) for _ in range(n)]
        whole = TreeAccumulator(n, 0, n)
        for i in range(n):
            whole.add(i, vals[i])
        ref = whole.result()
        for d in range(1, n + 1):
            cuts = [n * k // d for k in range(d + 1)]
            nodes = {}
            for k in range(d):
                acc = TreeAccumulator(n, cuts[k], cuts[k + 1])
                order = list(range(cuts[k], cuts[k + 1]))
                rng.shuffle(order)
                for i in order:
                    acc.add(i, vals[i])
                nodes.update(acc.partial_nodes())
            assert torch.equal(combine_nodes(nodes, n), ref), (n, d)
    # Negative control: the canonical tree is not the naive sequential sum (else the test is vacuous).
    vals = [torch.randn(256) * 10 ** rng.randint(-4, 4) for _ in range(7)]
    acc = TreeAccumulator(7, 0, 7)
    for i, v in enumerate(vals):
        acc.add(i, v)
    assert not torch.equal(acc.result(), sum(vals[1:], vals[0]))


@pytest.mark.slow
def test_weights_and_losses_are_bit_identical_at_every_layout(tmp_path):
    ref_losses, ref_digests = run(tmp_path, 1, 1)
    for P, D in [(2, 1), (4, 1), (2, 2), (1, 2), (3, 1)]:
        losses, digests = run(tmp_path, P, D)
        assert losses == ref_losses, f"{P}x{D}: per-step losses differ"
        assert digests == ref_digests, f"{P}x{D}: parameters differ: " + ", ".join(
            n for n in ref_digests if digests.get(n) != ref_digests[n]
        )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[list[float], dict[str, str]]:
    """The tiny GPT trained in one process (deterministic): the reference every layout equals."""
    return run(tmp_path_factory.mktemp("one"), 1, 1)


def reports_of(tmp_path: Path, P: int, D: int, *flags: str) -> list[dict]:
    out = tmp_path / f"det_worker-{P}x{D}{''.join(flags)}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(P * D)]


@pytest.mark.slow
@pytest.mark.parametrize("P,D", [(2, 2), (2, 4), (1, 4)])
def test_sharded_optimizer_state_is_bit_identical_to_one_process(tmp_path, one_process, P, D):
    """Issue #32: with the optimizer state sharded over the D replicas (tied embedding, dropout,
    clipping), every loss and every parameter equals the one-process run bit for bit, and each
    replica holds only its part of its stage's Adam moments."""
    losses, digests = run(tmp_path, P, D, "--shard")
    assert losses == one_process[0], f"{P}x{D} sharded: per-step losses differ"
    assert digests == one_process[1], f"{P}x{D} sharded: parameters differ: " + ", ".join(
        n for n in one_process[1] if digests.get(n) != one_process[1][n])
    reports = reports_of(tmp_path, P, D, "--shard")
    for k in range(P):  # rank = replica * P + stage
        stage = [reports[d * P + k] for d in range(D)]
        whole = 2 * stage[0]["stage_elems"]  # exp_avg + exp_avg_sq
        assert sum(r["opt_elems"] for r in stage) == whole, "the replicas' pieces partition the stage"
        assert max(r["opt_elems"] for r in stage) < whole, "some replica holds all of the stage's state"


@pytest.mark.slow
@pytest.mark.parametrize("P,D,common,layout", [
    # 3 overflowing steps skipped (agreed by every rank), then 3 taken
    (2, 2, ("--precision", "fp16", "--loss-scale", str(2**23)), ()),
    # mixed VM types: replica 0 runs 5 of the 6 micro-batches
    (1, 2, (), ("--replica-shares", "5,1")),
])
def test_sharded_state_with_fp16_scaling_and_mixed_shares_is_bit_identical(tmp_path, P, D, common, layout):
    """Issue #32: sharding keeps fp16's overflow skips and the mixed replica shares
    bit-identical to one process with the same settings."""
    ref = run(tmp_path, 1, 1, "--steps", "6", *common)
    flags = ("--steps", "6", *common, *layout, "--shard")
    assert run(tmp_path, P, D, *flags) == ref
    if common:
        skipped = reports_of(tmp_path, P, D, *flags)[0]["skipped"]
        assert True in skipped and False in skipped, f"the scale was meant to overflow some steps: {skipped}"


@pytest.mark.slow
def test_sharded_run_without_canonical_reduction_is_not_bit_identical(tmp_path, one_process):
    """Negative control for the sharded comparison: the same 2×2 sharded run with the
    ring all-reduce instead of the canonical tree differs from the one-process bits."""
    _, digests = run(tmp_path, 2, 2, "--shard", "--no-canonical")
    assert digests != one_process[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag,P,D", [("--no-canonical", 2, 2), ("--unkeyed-rng", 2, 1), ("--unkeyed-data", 1, 2)]
)
def test_disabling_each_mechanism_breaks_equality(tmp_path, flag, P, D):
    ref_losses, ref_digests = run(tmp_path, 1, 1, flag)
    losses, digests = run(tmp_path, P, D, flag)
    assert digests != ref_digests, f"{flag}: still bit-identical, so the test could not detect its loss"


CKPT_WORKER = Path(__file__).parent / "workers" / "ckpt_worker.py"


def ckpt_run(tmp: Path, name: str, P: int, D: int, *args: str):
    out = tmp / name
    check_ok(
        run_world(
            CKPT_WORKER,
            P * D,
            ["--out", str(out), "--pipeline-depth", str(P), "--deterministic", "--eps", "1e-8", *args],
            env={"VARUNA_PIPELINE_DEPTH": str(P)},
            timeout_s=180,
        )
    )
    reports, params = [], {}
    for f in sorted(out.glob("rank*.json")):
        reports.append(json.loads(f.read_text()))
        for n, t in torch.load(f.with_suffix(".pt"), weights_only=True).items():
            assert torch.equal(params.setdefault(n, t), t), f"copies of {n} disagree"
    return reports[0], params


@pytest.mark.slow
def test_morphing_through_checkpoints_equals_the_uninterrupted_run_bitwise(tmp_path):
    """2×2 for steps 1–2 → checkpoint → 4×1 for steps 3–4 → checkpoint → 1×1 for steps 5–6."""
    ckpt = str(tmp_path / "ckpt")
    ref, ref_params = ckpt_run(tmp_path, "ref", 1, 1, "--ckpt-dir", str(tmp_path / "unused"), "--steps", "6")
    a, _ = ckpt_run(tmp_path, "a", 2, 2, "--ckpt-dir", ckpt, "--steps", "2", "--save-at", "2")
    b, _ = ckpt_run(
        tmp_path, "b", 4, 1, "--ckpt-dir", ckpt, "--steps", "4", "--resume", "1", "--save-at", "4"
    )
    c, params = ckpt_run(tmp_path, "c", 1, 1, "--ckpt-dir", ckpt, "--steps", "6", "--resume", "1")
    assert (b["first_step"], c["first_step"]) == (3, 5)
    assert a["losses"] + b["losses"] + c["losses"] == ref["losses"], "per-step losses differ"
    assert params.keys() == ref_params.keys()
    assert [n for n in ref_params if not torch.equal(params[n], ref_params[n])] == []


@pytest.mark.slow
def test_sharded_checkpoints_resume_unsharded_at_another_layout_and_back_bitwise(tmp_path):
    """Issue #32: 2×4 with the optimizer state sharded over the 4 replicas for steps 1–2 →
    checkpoint (state gathered by name) → 4×1 unsharded for steps 3–4 → checkpoint → 2×4 sharded
    again for steps 5–6: bit-identical to the uninterrupted one-process run."""
    ckpt = str(tmp_path / "ckpt")
    ref, ref_params = ckpt_run(tmp_path, "ref", 1, 1, "--ckpt-dir", str(tmp_path / "unused"), "--steps", "6")
    a, _ = ckpt_run(tmp_path, "a", 2, 4, "--ckpt-dir", ckpt, "--steps", "2", "--save-at", "2", "--shard")
    b, _ = ckpt_run(
        tmp_path, "b", 4, 1, "--ckpt-dir", ckpt, "--steps", "4", "--resume", "1", "--save-at", "4"
    )
    c, params = ckpt_run(tmp_path, "c", 2, 4, "--ckpt-dir", ckpt, "--steps", "6", "--resume", "1", "--shard")
    assert (b["first_step"], c["first_step"]) == (3, 5)
    assert a["losses"] + b["losses"] + c["losses"] == ref["losses"], "per-step losses differ"
    assert [n for n in ref_params if not torch.equal(params[n], ref_params[n])] == []


# ---------------------------------------------------------------------------------------------
# Note [Deterministic forward] (varuna/runtime/executor.py, issue #16): kernels that pick their
# algorithm by autograd state, e.g. CPU SDPA with a float mask that requires grad.


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return first_difference((a,), (b,)) is None


def test_cpu_sdpa_with_a_learned_mask_differs_by_grad_mode():
    """Negative control for the tests below: on this torch build the block's SDPA rounds differently
    with autograd off (flash kernel) and on (math kernel, the mask requires grad). Were they equal,
    the bit-identity tests below would not exercise the issue: pick another kernel then."""
    torch.manual_seed(0)
    block = attn.BiasedBlock(32, 2, dropout=0.0)
    x = torch.randn(attn.MICRO, attn.SEQ, 32)
    with torch.no_grad():
        off = block(x)
    on = block(x).detach()
    assert not _bits_equal(off, on)
    assert (off - on).abs().max() < 1e-5  # rounding, not a wrong result


class _FakeDownstream:
    """Stage 1 of a two-stage pipeline, in this process: takes the activation stage 0 sends and
    returns a gradient of ones for it at once."""

    def __init__(self, inbox: queue.Queue) -> None:
        self.inbox = inbox
        self.sent: dict[int, tuple[torch.Tensor, ...]] = {}

    def send(self, microbatch: int, tensors: tuple[torch.Tensor, ...]) -> None:
        self.sent[microbatch] = tensors
        self.inbox.put(Arrival(BACKWARD, microbatch, tuple(torch.ones_like(t) for t in tensors)))


def _first_stage(model: torch.nn.Module, batch, *, deterministic: bool, rng_keyed: bool = True):
    """``model``'s segment 0 as stage 0 of 2 under a real ScheduleExecutor (varuna schedule: every
    forward recomputed), links faked by :class:`_FakeDownstream`; ``rng_keyed=False``: the
    negative control of varuna.testing.negative_controls."""
    cfg = with_negative_controls(
        varuna.VarunaConfig(global_batch_size=attn.GLOBAL_BATCH, micro_batch_size=attn.MICRO,
                            schedule="varuna", determinism=varuna.DeterminismConfig(enabled=deterministic)),
        rng_keyed=rng_keyed,
    )
    loss = lambda out, data: out  # noqa: E731
    prof = profile_model(model, batch, loss, costs=False)
    state = SplitState()
    cps = [m for m in model.modules() if isinstance(m, CutPoint)]
    for cp in cps:
        cp._varuna_state = state
    materialize_stage(model, prof, 0, 0, state, device=torch.device("cpu"))
    inbox: queue.Queue = queue.Queue()
    down = _FakeDownstream(inbox)
    links = SimpleNamespace(act_out=down, grad_out=None, begin_step=lambda n, train: None)
    stage = StageModel(model=model, loss_fn=loss, split=state, cutpoints=cps, first_segment=0,
                       last_segment=0, num_segments=len(cps) + 1, stage=0, replica=0, num_stages=2,
                       device=torch.device("cpu"), cutpoint_names=prof.cutpoint_names)
    ex = ScheduleExecutor(stage=stage, config=cfg, links=links, inbox=inbox, timeline=Timeline())
    return ex, down, plan_microbatches(cfg.global_batch_size, cfg.micro_batch_size, 1)[0]


def test_first_stage_sends_what_one_stage_computes_with_a_grad_mode_dependent_kernel():
    """Stage 0 of 2×1 in deterministic mode sends, bitwise, the boundary activation of the unsplit
    model trained at 1×1 (autograd on), although its forward is recomputed later: failed before
    the fix, when that forward ran with autograd off and its SDPA took the other kernel."""
    torch.manual_seed(1234)
    model = attn.BiasedAttention(dropout=0.0)  # no dropout: the unsplit reference needs no keying
    ref_model = copy.deepcopy(model)
    batch = attn.build("biased")[1](1)
    ex, down, mbs = _first_stage(model, batch, deterministic=True)
    ex.run(batch, mbs, step=1, scale=1.0, train=True)
    boundary = {}
    ref_model.cuts[0].register_forward_hook(lambda mod, inp, out: boundary.__setitem__("act", out))
    for mb in mbs:
        ref_model(*(t[mb.start:mb.end] for t in batch))  # 1×1: one stage, autograd on
        (sent,) = down.sent[mb.index]
        assert _bits_equal(sent, boundary["act"].detach()), f"micro-batch {mb.index}"


class _CallCounting(torch.nn.Module):
    """A module whose result changes from call to call (state outside the RNG keying): what no
    change of autograd state can make a recompute reproduce."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + 1e-3 * self.calls


@pytest.mark.parametrize("deterministic,rng_keyed,raises", [(True, True, True), (True, False, False),
                                                            (False, True, False)])
def test_a_recompute_that_does_not_reproduce_the_send_is_named_on_the_first_step(
    deterministic, rng_keyed, raises
):
    """Deterministic mode checks each recompute of the first step against what its forward sent and
    raises one line naming the boundary; not in default mode, nor with unkeyed dropout (a negative
    control whose recompute draws other masks)."""
    torch.manual_seed(1234)
    model = attn.BiasedAttention(dropout=0.0)
    model.blocks[0].proj = torch.nn.Sequential(model.blocks[0].proj, _CallCounting())
    batch = attn.build("biased")[1](1)
    ex, _, mbs = _first_stage(model, batch, deterministic=deterministic, rng_keyed=rng_keyed)
    if raises:
        line = r"stage 0 .* at CutPoint 'cuts.0' .* max \|diff\| \S+\) that its recompute does not"
        with pytest.raises(DeterminismError, match=line):
            ex.run(batch, mbs, step=1, scale=1.0, train=True)
    else:
        ex.run(batch, mbs, step=1, scale=1.0, train=True)


def test_first_difference_compares_bits():
    nan = float("nan")
    assert first_difference((torch.tensor([nan, 1.0]),), (torch.tensor([nan, 1.0]),)) is None
    assert first_difference((torch.tensor([0.0]),), (torch.tensor([-0.0]),)) is not None
    assert first_difference((torch.ones(2), torch.arange(3)), (torch.ones(2), torch.tensor([0, 1, 3]))) == (
        "tensor 1 of 2, shape (3,) torch.int64: 1 element(s) differ"
    )
    assert "against shape (3,)" in first_difference((torch.ones(2),), (torch.ones(3),))


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 3])
def test_attention_with_a_learned_mask_is_bit_identical_at_every_depth(tmp_path, P):
    """Issue #16 end to end: SDPA whose CPU kernel depends on autograd state, dropout on, 3 steps."""
    ref = run(tmp_path, 1, 1, worker=ATTN_WORKER)
    assert run(tmp_path, P, 1, worker=ATTN_WORKER) == ref


@pytest.mark.slow
def test_hf_llama_with_sharded_optimizer_state_is_bit_identical(tmp_path):
    """Issue #32 on a Hugging Face Llama (tiny config, default attention): sharded at 2×2, 2×4
    and 1×4 equals one process bit for bit."""
    pytest.importorskip("transformers")
    ref = run(tmp_path, 1, 1, "--model", "llama", worker=ATTN_WORKER)
    for P, D in [(2, 2), (2, 4), (1, 4)]:
        assert run(tmp_path, P, D, "--model", "llama", "--shard", worker=ATTN_WORKER) == ref, f"{P}x{D}"


#: Hugging Face models built from tiny configs (tests/workers/hf_worker.py ``build``) with their
#: default attention implementation (SDPA); T5 is the one whose learned position bias made CPU
#: SDPA pick another kernel with autograd on (Note [Deterministic forward] in executor.py).
HF_MODELS = ["gpt2", "llama", "qwen2", "t5"]


@pytest.mark.slow
@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_model_with_default_attention_is_bit_identical_at_2x1(tmp_path, name):
    pytest.importorskip("transformers")
    ref = run(tmp_path, 1, 1, "--model", name, worker=ATTN_WORKER)
    assert run(tmp_path, 2, 1, "--model", name, worker=ATTN_WORKER) == ref
