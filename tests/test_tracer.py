"""Tests of the tracer (varuna/cutting/tracer.py) and the ``varuna-trace`` command.

Single-process: each test dry-runs a small model and checks the report. The engine's refusal of a
hidden dependency is also checked end to end (2 processes, ``slow``) in tests/test_autocut.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "workers"))

from autocut_worker import PlantedNet, build  # noqa: E402
from models import build_model, make_batch  # noqa: E402

import varuna  # noqa: E402
from varuna.cutting.trace_cli import main as trace_main  # noqa: E402
from varuna.cutting.tracer import TraceReport, trace_model  # noqa: E402


def _xy(n: int = 4):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randn(n, generator=g)


# ----------------------------------------------------------------------------------------------
# (a) tied weights


def test_gpt_tied_embeddings_are_detected() -> None:
    model = build_model("gpt")
    report = trace_model(model, make_batch("gpt", 3))
    assert [(p.name, p.segments) for p in report.shared_params] == [("wte.weight", [0, 4])]
    assert report.shared_params[0].bytes == 256 * 32 * 4
    assert report.ok and not report.hidden_dependencies and not report.buffers
    assert report.cutpoints == [f"cuts.{i}" for i in range(4)]
    text = report.table()
    assert "wte.weight" in text and "registered as shared by the runtime" in text
    assert "VERDICT: OK" in text


def test_tracer_agrees_with_the_engines_dry_run() -> None:
    """The runtime registers exactly the parameters the tracer reports as shared."""
    from varuna.cutting.split import profile_model

    model = build_model("gpt")
    batch = make_batch("gpt", 3)
    profile = profile_model(model, batch, lambda out, b: out, measure=False)
    report = trace_model(model, batch)
    assert {p.name: tuple(p.segments) for p in report.shared_params} == profile.shared_params()


def test_gpt_on_meta_is_traced() -> None:
    model = build_model("gpt", meta=True)
    report = trace_model(model, make_batch("gpt", 3))
    assert [(p.name, p.segments) for p in report.shared_params] == [("wte.weight", [0, 4])]
    assert report.ok


# ----------------------------------------------------------------------------------------------
# (b) values read across segments


def test_negative_control_reports_nothing() -> None:
    model, _ = build("chain")
    report = trace_model(model, _xy())
    assert report.shared_params == [] and report.buffers == [] and report.hidden_dependencies == []
    assert report.external_tensors == [] and report.local_mutable_buffers == []
    assert report.ok and report.errors() == [] and report.warnings() == []
    assert report.num_segments == 4


def test_planted_buffer_read_across_segments_is_flagged_and_allowed() -> None:
    """A module in the last segment reads a buffer owned by segment 0's module: read-only, so the
    runtime's copy of every buffer on every stage serves it (the split still trains: see the
    multi-process test in test_autocut.py)."""
    model, _ = build("planted")
    report = trace_model(model, _xy())
    assert len(report.buffers) == 1
    b = report.buffers[0]
    assert (b.name, b.owner, b.owner_segments, b.read_segments, b.status) == (
        "blocks.0.table", "blocks.0", [0], [3], "replicated")
    assert any("blocks.3" in r for r in b.readers)
    assert report.ok  # replicated read-only buffers are fine
    assert "blocks.0.table" in report.table() and "replicated" in report.table()


def test_mutable_buffer_read_across_segments_is_an_error() -> None:
    model, _ = build("counter")
    report = trace_model(model, _xy())
    bad = [b for b in report.buffers if b.severity == "error"]
    assert [b.name for b in bad] == ["counter"] and bad[0].status == "mutable-cross-segment"
    assert "written in segment 0" in bad[0].message and "read in segment 3" in bad[0].message
    assert not report.ok
    assert float(model.counter) == 0.0  # the dry run restored the buffer


def test_tensor_hidden_dependency_is_an_error_naming_module_and_fix() -> None:
    model, _ = build("skip")
    report = trace_model(model, _xy())
    errors = [d for d in report.hidden_dependencies if d.severity == "error"]
    assert len(errors) == 1
    d = errors[0]
    assert (d.producer, d.produced_in, d.consumed_in) == ("output of module 'blocks.0'", 0, 3)
    assert "add" in d.consumer and d.shape == [4, 16]
    assert not report.ok
    with pytest.raises(ValueError) as e:
        report.check_splittable()
    msg = str(e.value)
    assert "blocks.0" in msg and "cut(x, extra)" in msg and "placeholder" in msg


def test_value_computed_by_a_module_is_a_hidden_dependency_unless_it_can_run_as_glue() -> None:
    """A module building a mask from the batch is skipped on other stages: its output there is a
    placeholder, so reading it in a later segment is an error — unless the module has no parameters,
    then it runs on every stage as glue (Note [Replicated glue modules]; Llama's rotary embedding)."""

    class MaskMaker(nn.Module):
        def __init__(self, with_param: bool):
            super().__init__()
            if with_param:  # a parameter it does not even use: never replicated
                self.unused = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return (x[:, :1] > 0).to(x.dtype)

    class Net(nn.Module):
        def __init__(self, mask_in_glue: bool, with_param: bool = True):
            super().__init__()
            self.mask_in_glue = mask_in_glue
            self.masker = MaskMaker(with_param)
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)
            self.cut = varuna.CutPoint()

        def forward(self, x, y):
            mask = (x[:, :1] > 0).to(x.dtype) if self.mask_in_glue else self.masker(x)
            h = self.cut(self.a(x) * mask)
            return F.mse_loss((self.b(h) * mask).squeeze(-1), y)

    bad = trace_model(Net(mask_in_glue=False), _xy())
    assert [d.producer for d in bad.hidden_dependencies] == ["output of module 'masker'"]
    assert not bad.ok and bad.replicated_modules == []
    replicated = trace_model(Net(mask_in_glue=False, with_param=False), _xy())
    assert replicated.ok and replicated.hidden_dependencies == []
    assert replicated.replicated_modules == ["masker"]
    good = trace_model(Net(mask_in_glue=True), _xy())
    assert good.ok and good.hidden_dependencies == []
    assert any((c.produced_in, c.read_in) == (0, [1]) for c in good.common_reads)  # the glue mask: common


def test_module_returning_its_input_is_told_apart_from_the_input() -> None:
    """nn.Identity returns its input object; on other stages it returns a placeholder."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.ident, self.b = nn.Linear(8, 8), nn.Identity(), nn.Linear(8, 1)
            self.cut = varuna.CutPoint()

        def forward(self, x, y):
            h = self.a(x)
            same = self.ident(h)
            h = self.cut(h)
            return F.mse_loss((self.b(h) + same.sum(-1, keepdim=True)).squeeze(-1), y)

    report = trace_model(Net(), _xy())
    assert [d.producer for d in report.hidden_dependencies] == ["output of module 'ident'"]


def test_value_passed_through_the_cutpoint_is_fine() -> None:
    class Net(nn.Module):
        def __init__(self, through: bool):
            super().__init__()
            self.through = through
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)
            self.cut = varuna.CutPoint()

        def forward(self, x, y):
            h = self.a(x)
            extra = torch.tanh(h)
            if self.through:
                h, extra = self.cut(h, extra)
            else:
                h = self.cut(h)
            return F.mse_loss((self.b(h) + extra.mean(-1, keepdim=True)).squeeze(-1), y)

    assert not trace_model(Net(through=False), _xy()).ok
    assert trace_model(Net(through=True), _xy()).ok


def test_glue_net_scalar_side_values_are_warnings_not_errors() -> None:
    """tests/models.py GlueNet reads each block's 0-dim by-product in the next segment: the runtime
    gives a 0 placeholder there (harmless for its 0.0 * m). Reported, not refused."""
    report = trace_model(build_model("glue"), make_batch("glue", 3))
    assert report.ok
    assert report.hidden_dependencies and all(d.severity == "warning" for d in report.hidden_dependencies)
    assert report.warnings()


def test_external_tensor_is_reported() -> None:
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 1)
            self.scale = torch.full((1,), 2.0)  # a plain attribute, not a buffer

        def forward(self, x, y):
            return F.mse_loss((self.a(x) * self.scale).squeeze(-1), y)

    report = trace_model(Net(), _xy())
    assert [e.name for e in report.external_tensors] == ["tensor attribute 'scale'"]
    assert "register it as a buffer" in report.external_tensors[0].message
    assert report.ok and report.warnings()


def test_batchnorm_statistics_are_segment_local_and_restored() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), varuna.CutPoint(), nn.Linear(8, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 8)
    rng = torch.get_rng_state()
    report = trace_model(model, x, loss_fn=lambda out, x: out.sum())
    assert sorted(report.local_mutable_buffers) == [f"1.{n}" for n in ("num_batches_tracked", "running_mean",
                                                                        "running_var")]
    assert report.ok and report.buffers == []
    assert any("NOT synchronized" in g.how for g in report.global_state)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_check_splittable_is_what_the_engine_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import varuna.cutting.tracer as tracer

    with pytest.raises(ValueError, match="blocks.0"):
        tracer.check_splittable(build("skip")[0], _xy())
    with pytest.warns(UserWarning, match="0-dim"):
        report = tracer.check_splittable(build_model("glue"), make_batch("glue", 3))
    assert report is not None and report.ok

    def broken(*args, **kwargs):
        raise RuntimeError("tracer bug")

    monkeypatch.setattr(tracer, "trace_model", broken)  # a tracer failure must not stop training
    with pytest.warns(UserWarning, match="could not run"):
        assert tracer.check_splittable(build("skip")[0], _xy()) is None


# ----------------------------------------------------------------------------------------------
# (c) global state, JSON


def test_global_state_lists_what_the_engine_synchronizes() -> None:
    report = trace_model(build_model("gpt"), make_batch("gpt", 3))
    whats = " | ".join(g.what for g in report.global_state)
    for needle in ("data-parallel gradients", "shared parameters", "global gradient norm",
                   "loss-scale overflow"):
        assert needle in whats
    assert "wte.weight" in next(g.how for g in report.global_state if g.what == "shared parameters")


def test_json_round_trip() -> None:
    model, _ = build("skip")
    report = trace_model(model, _xy())
    data = json.loads(report.to_json())
    assert data["version"] == 1 and data["hidden_dependencies"][0]["severity"] == "error"
    back = TraceReport.from_json(report.to_json())
    assert back == report and not back.ok
    with pytest.raises(ValueError, match="version"):
        TraceReport.from_json(json.dumps({**data, "version": 99}))


# ----------------------------------------------------------------------------------------------
# the command


def _write_factory(tmp_path: Path, mode: str) -> Path:
    f = tmp_path / f"factory_{mode}.py"
    f.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT / 'tests' / 'workers')!r})
        from autocut_worker import PlantedNet

        def build():
            g = torch.Generator().manual_seed(0)
            return PlantedNet({mode!r}), (torch.randn(4, 8, generator=g), torch.randn(4, generator=g))
    """))
    return f


def test_cli_ok_model_exits_0_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert trace_main([f"{_write_factory(tmp_path, 'buffer')}:build", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "blocks.0.table" in text and "VERDICT: OK" in text
    assert TraceReport.from_json(out.read_text()).buffers[0].status == "replicated"


def test_cli_hidden_dependency_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert trace_main([str(_write_factory(tmp_path, "skip")), "--json", "-"]) == 1  # default factory: build
    data = json.loads(capsys.readouterr().out)
    assert data["hidden_dependencies"][0]["producer"] == "output of module 'blocks.0'"


def test_cli_auto_cuts_on_the_resnet_example(capsys: pytest.CaptureFixture[str]) -> None:
    rc = trace_main([str(ROOT / "examples" / "resnet" / "model.py") + ":build", "--cuts", "2",
                     "--cost", "flop", "--arg", "batch_size=2", "--arg", "image_size=8"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "varuna.auto_cutpoints: 2 cut-point(s)" in text and "varuna_cut" in text


@pytest.mark.parametrize("argv, needle", [
    (["no/such/file.py:build"], "no such file"),
    ([f"{ROOT / 'examples' / 'resnet' / 'model.py'}:nope"], "no callable 'nope'"),
    ([f"{ROOT / 'examples' / 'resnet' / 'model.py'}", "--cuts", "0"], "--cuts must be >= 1"),
    ([f"{ROOT / 'examples' / 'resnet' / 'model.py'}", "--arg", "no-equals"], "KEY=VALUE"),
    (["os:getcwd"], "must return (model, example_batch)"),
    (["json:dumps"], "calling dumps()"),
])
def test_cli_bad_usage_exits_2_with_one_line(argv: list[str], needle: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        trace_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1] and err[-1].startswith("varuna-trace: error:")


def test_console_script_help() -> None:
    r = subprocess.run(["varuna-trace", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "FACTORY" in r.stdout


def test_planted_net_modes_are_what_the_tests_assume() -> None:
    """Guard for the shared test models: the plain chain trains like an ordinary module."""
    model = PlantedNet("none")
    loss = model(*_xy())
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
