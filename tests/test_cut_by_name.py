"""Cut-points on a model you did not write (issue #16): by module name or pattern from Python,
``VarunaConfig.cut_after`` and ``varuna-launch --cut-after``; automatic ones with the reasons for
rejected boundaries; one clear error when manual and automatic cut-points meet; the HF output's
``loss`` taken without a ``loss_fn``; and stage plans that do not change between identical runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import varuna
from varuna.cutting import split as split_mod
from varuna.cutting.autocut import auto_cutpoints
from varuna.cutting.loss import default_loss
from varuna.cutting.routing import check_no_cutpoints, match_modules, remove_cutpoints
from varuna.runtime.config import VarunaConfig, adopt_cut_env
from varuna.runtime.layout import Layout
from varuna.runtime.stages import check_pipeline_depth, planning_profile

ROOT = Path(__file__).resolve().parent.parent


class _Block(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class _Stack(nn.Module):
    """Names like an HF decoder: ``model.layers.<i>`` (with submodules) and ``lm_head``."""

    def __init__(self, n: int = 4, d: int = 8):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(_Block(d) for _ in range(n))
        self.lm_head = nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(x).pow(2).mean()


# ---------------------------------------------------------------------------------------------
# names and patterns


def test_a_pattern_part_matches_one_level_of_the_name():
    m = _Stack()
    assert match_modules(m, "model.layers.*") == [f"model.layers.{i}" for i in range(4)]
    assert match_modules(m, "model.layers.[13]") == ["model.layers.1", "model.layers.3"]
    assert match_modules(m, "model.layers.*.fc") == [f"model.layers.{i}.fc" for i in range(4)]
    # comma-separated, duplicates once, named_modules() order whatever the pattern order
    assert match_modules(m, "lm_head, model.layers.0,model.layers.0") == ["model.layers.0", "lm_head"]


def test_a_pattern_that_selects_nothing_names_the_closest_modules():
    with pytest.raises(ValueError) as e:
        match_modules(_Stack(), "model.layer.*")
    msg = str(e.value)
    assert "\n" not in msg and "'model.layer.*' matches no module" in msg and "model.layers.0" in msg
    with pytest.raises(ValueError, match="no cut-point names"):
        match_modules(_Stack(), " , ")


def test_apply_by_pattern_cuts_every_layer_and_keeps_parameter_names():
    m = _Stack()
    keys = list(m.state_dict())
    x = torch.randn(3, 8)
    ref = m(x)
    cps = varuna.apply_cutpoints(m, "model.layers.*")
    assert len(cps) == 4 and list(m.state_dict()) == keys
    assert torch.equal(m(x), ref)  # outside the engine a CutPoint is the identity
    from varuna.cutting.split import profile_model

    assert profile_model(m, x, lambda o, b: o, costs=False).num_cutpoints == 4
    with pytest.raises(ValueError, match="ModuleList, never called as a whole.*'model.layers.\\*'"):
        varuna.apply_cutpoints(_Stack(), "model.layers")
    with pytest.raises(ValueError, match="Sequential, which cannot host a cut-point.*'0.1'"):
        varuna.apply_cutpoints(nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU())), "0")
    with pytest.raises(ValueError, match="already has a cut-point"):
        varuna.apply_cutpoints(m, "model.layers.0")


# ---------------------------------------------------------------------------------------------
# manual and automatic together


def test_manual_then_automatic_cut_points_is_one_clear_error():
    m = _Stack()
    varuna.apply_cutpoints(m, "model.layers.1")
    with pytest.raises(ValueError) as e:
        auto_cutpoints(m, torch.randn(2, 8), 2, cost="flop", verbose=False)
    msg = str(e.value)
    assert "\n" not in msg and "cannot be mixed" in msg and "model.layers.1.varuna_cut" in msg
    # the manual cut is still there (it used to be dropped silently)
    cuts = [n for n, x in m.named_modules() if isinstance(x, varuna.CutPoint)]
    assert cuts == ["model.layers.1.varuna_cut"]


def test_automatic_cut_points_are_replaced_by_a_new_plan_but_never_count_as_manual():
    m = _Stack()
    auto_cutpoints(m, torch.randn(2, 8), 3, cost="flop", verbose=False)
    check_no_cutpoints(m)  # automatic ones are not "manual"
    plan = auto_cutpoints(m, torch.randn(2, 8), 1, cost="flop", verbose=False)
    assert len([x for x in m.modules() if isinstance(x, varuna.CutPoint)]) == 1 == len(plan.module_names)
    assert remove_cutpoints(m) == plan.module_names


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(auto_cutpoints=2, cut_after=("model.layers.*",)), "auto_cutpoints and cut_after both set"),
        (dict(auto_cutpoints=0), "auto_cutpoints must be an integer >= 1"),
        (dict(auto_cutpoints=True), "auto_cutpoints must be an integer >= 1"),
        (dict(plan_cost="flops"), "unknown plan_cost 'flops'; choose flop or time"),
    ],
)
def test_config_refuses_bad_cut_settings_in_one_line(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("*", r"\*")) as e:
        VarunaConfig(global_batch_size=4, micro_batch_size=2, **kwargs).validate()
    assert "\n" not in str(e.value)


def test_cut_settings_come_from_the_launchers_environment_unless_the_script_set_them():
    cfg = VarunaConfig(global_batch_size=4, micro_batch_size=2)
    adopt_cut_env(cfg, {"VARUNA_CUT_AFTER": "model.layers.*, lm_head", "VARUNA_PLAN_COST": "time"})
    assert cfg.cut_after == ("model.layers.*", "lm_head") and cfg.plan_cost == "time"
    cfg = VarunaConfig(global_batch_size=4, micro_batch_size=2, auto_cutpoints=3)
    adopt_cut_env(cfg, {"VARUNA_CUT_AFTER": "model.layers.*"})
    assert cfg.cut_after is None and cfg.auto_cutpoints == 3 and cfg.plan_cost == "flop"
    with pytest.raises(ValueError, match="VARUNA_AUTO_CUTPOINTS='x' is not an integer"):
        adopt_cut_env(VarunaConfig(global_batch_size=4, micro_batch_size=2), {"VARUNA_AUTO_CUTPOINTS": "x"})
    with pytest.raises(ValueError, match="VARUNA_PLAN_COST='fast'"):
        adopt_cut_env(VarunaConfig(global_batch_size=4, micro_batch_size=2), {"VARUNA_PLAN_COST": "fast"})


def test_launcher_exports_cut_flags_and_refuses_both_in_one_line(tmp_path, capsys):
    from varuna.launch.launcher import _build_parser, _worker_env_from_args, main

    args = _build_parser().parse_args(["--procs", "2", "--pipeline-depth", "2", "--cut-after",
                                       "transformer.h.*", "--plan-cost", "time", "train.py"])
    env = _worker_env_from_args(args)
    assert env["VARUNA_CUT_AFTER"] == "transformer.h.*" and env["VARUNA_PLAN_COST"] == "time"
    script = tmp_path / "never_runs.py"
    script.write_text("raise SystemExit('the launcher must refuse before starting workers')\n")
    rc = main(["--procs", "2", "--pipeline-depth", "2", "--cut-after", "h.*", "--auto-cutpoints", "1",
               str(script)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--cut-after and --auto-cutpoints both given" in err[0], err


def test_the_no_cut_point_and_too_deep_errors_name_the_ways_to_cut():
    with pytest.raises(ValueError) as e:
        check_pipeline_depth(4, 0)
    assert "--cut-after 'model.layers.*'" in str(e.value) and "--auto-cutpoints 3" in str(e.value)
    with pytest.raises(ValueError) as e:
        check_pipeline_depth(4, 1)
    assert "--cut-after" in str(e.value) and "--auto-cutpoints 3" in str(e.value)


# ---------------------------------------------------------------------------------------------
# rejected boundaries are explained


def test_a_plan_says_why_block_ends_were_rejected(capsys):
    """Block 1's input is read again after block 2 (a long skip connection): the ends of blocks
    1 and 2 cannot be boundaries, and the printed plan says which value blocks them."""

    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(_Block() for _ in range(4))

        def forward(self, x):
            h0 = self.blocks[0](x)
            h2 = self.blocks[2](self.blocks[1](h0))
            return self.blocks[3](h2 + h0).pow(2).mean()

    plan = auto_cutpoints(Skip(), torch.randn(2, 8), 1, cost="flop")
    rejected = dict(plan.rejected)
    # the first block (or its linear: tanh costs no FLOPs) is the only valid cut before the last block
    assert plan.module_names in (["blocks.0"], ["blocks.0.fc"])
    assert {"blocks.1", "blocks.2"} <= set(rejected), rejected
    assert "another value is live across it: output of module 'blocks.0'" in rejected["blocks.1"], rejected
    assert "rejected boundaries" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# stable plans


def test_stage_plans_count_flops_unless_time_is_asked_for(monkeypatch):
    """Timing segment costs on a busy machine gave a different split per run; the default plan
    now never times (a timer that raises proves it) and is identical run to run."""
    calls = []

    def timer(*args, **kwargs):
        calls.append(1)
        return None, None

    monkeypatch.setattr(split_mod, "_time_segments", timer)
    m = _Stack()
    varuna.apply_cutpoints(m, "model.layers.*")
    x = torch.randn(2, 8)
    layout = Layout(world=2, rank=0, P=2, D=1)
    cfg = VarunaConfig(global_batch_size=4, micro_batch_size=2)
    adopt_cut_env(cfg, {})
    a = planning_profile(m, x, lambda o, b: o, cfg, layout)
    b = planning_profile(m, x, lambda o, b: o, cfg, layout)
    assert not calls and a.cost_unit == "flop" and a.fwd_cost == b.fwd_cost and sum(a.fwd_cost) > 0
    cfg.plan_cost = "time"
    planning_profile(m, x, lambda o, b: o, cfg, layout)
    assert calls  # negative control: measured plans do time the segments


# ---------------------------------------------------------------------------------------------
# Hugging Face outputs


def test_the_default_loss_takes_the_hf_outputs_loss_and_explains_otherwise():
    transformers = pytest.importorskip("transformers")
    out = transformers.modeling_outputs.CausalLMOutput(loss=torch.tensor(1.5), logits=torch.zeros(2, 3))
    assert default_loss(out, None) is out.loss
    with pytest.raises(TypeError, match="returned a CausalLMOutput with keys \\['logits'\\]"):
        default_loss(transformers.modeling_outputs.CausalLMOutput(logits=torch.zeros(2, 3)), None)


@pytest.mark.slow
def test_hf_example_by_name_through_the_launcher_matches_one_process(tmp_path):
    """examples/hf/train.py has no cut-points and no loss_fn: ``--cut-after`` places them and the
    engine takes the output's loss. 2×1 losses equal the one-process run's with the same cuts
    (dropout masks are keyed by segment; fp32, same operations per micro-batch: 1e-5 relative)."""
    pytest.importorskip("transformers")
    import json

    common = ["--model", "gpt2", "--steps", "3", "--layers", "2", "--d-model", "32", "--heads", "2",
              "--seq", "16", "--global-batch-size", "8", "--micro-batch-size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for P in (1, 2):
        runs[P] = tmp_path / f"p{P}.jsonl"
        cmd = [sys.executable, "-m", "varuna.launch", "--procs", str(P), "--pipeline-depth", str(P),
               "--cut-after", "transformer.h.*", str(ROOT / "examples/hf/train.py"), *common,
               "--metrics-out", str(runs[P])]
        r = subprocess.run(cmd, timeout=300, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "cut after ['transformer.h.0', 'transformer.h.1']" in r.stdout
    one, two = runs[1], runs[2]
    a = [json.loads(x)["loss"] for x in one.read_text().splitlines()]
    b = [json.loads(x)["loss"] for x in two.read_text().splitlines()]
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (a, b)


def test_auto_cut_points_on_llama_are_balanced_at_four_stages(capsys):
    """Llama's rotary embedding (read by every layer) no longer blocks the layer ends: the plan
    cuts between layers, balanced within 1.15 in the engine's own cost measure (FLOPs). Before,
    it chose embed_tokens / a late layer / norm (max/mean ~3.9) without saying why."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(num_hidden_layers=8, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                   max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 96, (2, 16))
    plan = auto_cutpoints(model, {"input_ids": ids, "labels": ids}, 3, cost="flop")
    assert all(n.startswith("model.layers.") for n in plan.module_names), plan.module_names
    assert plan.imbalance <= 1.15, str(plan)
    assert sum(n.startswith("model.layers.") for n, _, _ in plan.candidates) == 8
    assert "model.rotary_emb" in dict(plan.rejected)  # its own end is no boundary, and it says why
    assert "rejected boundaries" in capsys.readouterr().out


def test_a_model_without_counted_flops_is_planned_on_measured_time(monkeypatch, capsys):
    """Emulated devices (elementwise ops that sleep) count zero FLOPs: the plan measures instead
    of splitting on all-zero costs, and says so."""
    from varuna.testing.emulated import emulated_model

    model = emulated_model(3, [0.0, 0.0, 0.0], width=4)
    model.cut_points = nn.ModuleList(varuna.CutPoint() for _ in range(2))
    cfg = VarunaConfig(global_batch_size=4, micro_batch_size=2)
    adopt_cut_env(cfg, {})
    prof = planning_profile(model, (torch.randn(2, 4), torch.randn(2, 4)), lambda o, b: o, cfg,
                            Layout(world=2, rank=0, P=2, D=1))
    assert prof.cost_unit == "s" and "count no FLOPs" in capsys.readouterr().out


def test_varuna_trace_cuts_by_name_like_the_launcher(tmp_path, capsys):
    from varuna.cutting.trace_cli import main

    path = tmp_path / "target.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class B(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return torch.tanh(self.fc(x))

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.h = nn.ModuleList(B() for _ in range(3))

            def forward(self, x):
                for b in self.h:
                    x = b(x)
                return x.pow(2).mean()

        def build():
            return M(), torch.randn(2, 4)
    """))
    assert main([str(path), "--cut-after", "h.*"]) == 0
    out = capsys.readouterr().out
    assert "h.0.varuna_cut" in out and "h.2.varuna_cut" in out
    assert main([str(path)]) == 1  # negative control: without cuts the engine could not split it
    assert "has no CutPoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([str(path), "--cut-after", "h.*", "--cuts", "2"])
    assert e.value.code == 2 and "both given" in capsys.readouterr().err


def test_varuna_trace_and_the_engine_agree_on_an_output_with_a_loss_field(tmp_path, capsys):
    """An HF-style output carrying a scalar 'loss' is taken by the engine without loss_fn, so the
    tracer accepts it too; an output without one is refused by both, in one line."""
    from varuna.cutting.trace_cli import main

    path = tmp_path / "target.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn
        import varuna

        class M(nn.Module):
            def __init__(self, with_loss):
                super().__init__()
                self.a, self.cut, self.b = nn.Linear(4, 4), varuna.CutPoint(), nn.Linear(4, 3)
                self.with_loss = with_loss

            def forward(self, x):
                y = self.b(self.cut(self.a(x)))
                return {"loss": y.pow(2).mean(), "logits": y} if self.with_loss else {"logits": y}

        def build(with_loss=True):
            return M(with_loss), torch.randn(2, 4)
    """))
    assert main([str(path)]) == 0
    assert main([str(path), "--arg", "with_loss=False"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no scalar 'loss'" in err[0], err


def test_the_engine_cuts_by_name_once_and_takes_the_hf_loss(capsys):
    """``cut_after`` on an Engine at P = 1: the model gets its cut-points (an Engine built again on
    the same model, e.g. after a failed start, keeps them rather than failing), and the HF-style
    output's ``loss`` is taken without a ``loss_fn``."""

    class Out(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = _Stack()

        def forward(self, x):
            return {"loss": self.stack(x), "logits": x}

    m = Out()
    cfg = VarunaConfig(global_batch_size=4, micro_batch_size=2, cut_after=("stack.model.layers.*",),
                       stop_signals=())
    for _ in range(2):
        engine = varuna.Engine(m, cfg, example_batch=torch.randn(4, 8),
                               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        try:
            assert engine.profile.num_cutpoints == 4
            r = engine.train_step(torch.randn(4, 8))
            assert r.loss > 0
        finally:
            engine.close()
    assert len([x for x in m.modules() if isinstance(x, varuna.CutPoint)]) == 4


def test_a_cut_after_pattern_matching_nothing_is_refused_before_the_rendezvous(capfd, monkeypatch):
    """Said early: before this rank joins the process group (it needs no other rank to say it;
    the launcher cannot, it never sees the model), with no lifecycle line past the start."""
    from varuna.core.config_error import ConfigError

    monkeypatch.setenv("VARUNA_LIFECYCLE", "1")
    cfg = VarunaConfig(global_batch_size=4, micro_batch_size=2, cut_after=("model.layer.*",), stop_signals=())
    with pytest.raises(ConfigError, match="'model.layer.\\*' matches no module of the model"):
        varuna.Engine(_Stack(), cfg, example_batch=torch.randn(4, 8),
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert not torch.distributed.is_initialized()
    assert "VARUNA_LIFECYCLE" not in capfd.readouterr().out, "refused before the rendezvous line"
