"""The ``hf`` (sharded safetensors) and ``dcp`` (torch.distributed.checkpoint) checkpoint formats,
``VarunaConfig.init_from`` and ``varuna-checkpoint`` (issue 29; docs/checkpoints.md "Formats").

Single-process tests save and resume a 1×1 engine (the BatchNorm ResNet of
tests/workers/state_worker.py: buffers, an LR scheduler, a data loader) in each format; the slow
ones train Hugging Face GPT-2 and Llama at 2×2, export them, load them with ``from_pretrained``
and resume the export on ``meta`` at 4×1 (tests/workers/hf_state_worker.py), and save the ResNet
as DCP at 2×2 for a plain single-process DCP script and a 4×1 varuna run.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import ROOT, check_ok, run_world

import varuna
from varuna.runtime.checkpoint import list_checkpoints, step_dir_name, verify_checkpoint
from varuna.runtime.checkpoint_cli import main as cli
from varuna.runtime.checkpoint_files import CheckpointError
from varuna.runtime.checkpoint_registry import format_names, format_of

sys.path.insert(0, str(ROOT / "tests" / "workers"))
from state_worker import GLOBAL_BATCH, Indexed, engine_args, step_batch  # noqa: E402

pytest.importorskip("safetensors")
FORMATS = ("varuna", "hf", "dcp")


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _engine(ckpt: Path, fmt: str | None = None, **kw) -> varuna.Engine:
    a = type("A", (), {"total_steps": 0, "steps": 8})
    cfg = varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=2, seed=5,
                              checkpoint_dir=str(ckpt), checkpoint_format=fmt, **kw)
    return varuna.Engine(Indexed(), cfg, **engine_args(a))


def _whole(eng: varuna.Engine) -> dict[str, torch.Tensor]:
    sd = eng.state_dict()
    out = {**sd["params"], **sd["buffers"]}
    for n, st in sd["optimizer"]["state"].items():
        out.update({f"opt:{n}:{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return {k: v.detach().clone() for k, v in out.items()}


def _same(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return [k for k in a
            if not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))]


def test_the_formats_are_registered_in_order():
    assert format_names()[:3] == FORMATS


@pytest.mark.parametrize("fmt", ["hf", "dcp"])
def test_save_and_resume_the_whole_state_in_each_format(tmp_path, fmt):
    eng = _engine(tmp_path / "ckpt", fmt)
    for s in (1, 2):
        eng.train_step(step_batch(s))
    eng.save_checkpoint(wait=True)
    want, lr = _whole(eng), eng.optimizer.param_groups[0]["lr"]
    loss3 = eng.train_step(step_batch(3)).loss
    eng.close()
    step_dir = tmp_path / "ckpt" / step_dir_name(2)
    assert format_of(step_dir).name == fmt and verify_checkpoint(step_dir) == []
    back = _engine(tmp_path / "ckpt", resume="1")  # writes the default format, reads any
    assert back.step_count == 2 and back.checkpointer.resumed.format == fmt
    assert _same(_whole(back), want) == [], "parameters, buffers and optimizer state bit for bit"
    assert back.optimizer.param_groups[0]["lr"] == lr and back.extras.scheduler.scheduler.last_epoch == 2
    assert back.train_step(step_batch(3)).loss == loss3
    back.close()


@pytest.mark.parametrize("fmt", ["hf", "dcp"])
def test_a_corrupt_file_is_found_and_the_resume_falls_back(tmp_path, fmt):
    eng = _engine(tmp_path / "ckpt", fmt)
    eng.train_step(step_batch(1))
    eng.save_checkpoint(wait=True)
    eng.train_step(step_batch(2))
    eng.save_checkpoint(wait=True)
    eng.close()
    newest = tmp_path / "ckpt" / step_dir_name(2)
    data = sorted(p for p in newest.iterdir() if p.suffix in (".safetensors", ".distcp"))[-1]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert any("sha256 mismatch" in p for p in verify_checkpoint(newest))
    back = _engine(tmp_path / "ckpt", resume="1")
    assert back.step_count == 1, "the corrupt checkpoint is skipped, the older one resumed"
    back.close()


def test_dcp_metadata_of_another_tool_is_unpickled_only_as_dcp_metadata(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = Indexed()
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "foreign"), no_dist=True)
    eng = _engine(tmp_path / "ckpt", init_from=str(tmp_path / "foreign"))  # a DCP dir torch wrote
    assert _same({n: t for n, t in model.state_dict().items() if n in eng.stage_params},
                 {n: p.detach() for n, p in eng.stage_params.items()}) == []
    eng.close()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned > " + str(tmp_path / "owned"),))

    (tmp_path / "foreign" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"refers to (posix|os)\.system, which is not DCP metadata"):
        _engine(tmp_path / "ckpt", init_from=str(tmp_path / "foreign"))
    assert not (tmp_path / "owned").exists()


def test_init_from_a_hugging_face_model_directory_reads_the_model_names(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hf_worker import build, loss_of, make_optimizer
    from hf_worker import step_batch as hf_batch

    src, blocks = build("gpt2")
    src.save_pretrained(tmp_path / "gpt2")  # a single model.safetensors, tied weights once
    model, _ = build("gpt2")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    varuna.apply_cutpoints(model, blocks)
    eng = varuna.Engine(model, varuna.VarunaConfig(global_batch_size=8, micro_batch_size=2,
                                                   init_from=str(tmp_path / "gpt2")),
                        example_batch=hf_batch(1), optimizer=make_optimizer, loss_fn=loss_of)
    assert eng.step_count == 0
    assert _same({n: p.detach() for n, p in src.named_parameters()},
                 {n: p.detach() for n, p in eng.stage_params.items()}) == []
    eng.close()
    assert transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2") is not None


def test_export_round_trips_every_format_and_a_weights_only_export_does_not_resume(tmp_path, capsys):
    eng = _engine(tmp_path / "ckpt")
    for s in (1, 2):
        eng.train_step(step_batch(s))
    eng.save_checkpoint(wait=True)
    want = _whole(eng)
    eng.close()
    src = tmp_path / "ckpt"
    assert cli(["export", "--to", "hf", str(src), str(tmp_path / "a")]) == 0
    assert cli(["export", "--to", "dcp", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert cli(["export", "--to", "varuna", str(tmp_path / "b"), str(tmp_path / "c" / step_dir_name(2))]) == 0
    assert cli(["verify", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c")]) == 0
    back = _engine(tmp_path / "c", resume="1")
    assert _same(_whole(back), want) == [], "varuna -> hf -> dcp -> varuna keeps every bit"
    assert back.extras.scheduler.scheduler.last_epoch == 2
    back.close()
    weights = tmp_path / "w" / step_dir_name(2)
    assert cli(["export", "--to", "hf", "--weights-only", str(src), str(weights)]) == 0
    assert not any(p.name.startswith("optimizer-") for p in weights.iterdir())
    with pytest.raises(CheckpointError, match="exported with --weights-only"):
        _engine(tmp_path / "w", resume="1")
    started = _engine(tmp_path / "x", init_from=str(tmp_path / "w"))  # a root: its newest checkpoint
    assert _same({n: p.detach() for n, p in started.stage_params.items()},
                 {n: want[n] for n in started.stage_params}) == []
    started.close()
    out = capsys.readouterr().out
    assert "exported" in out and f"{tmp_path / 'a'}: ok" in out
    assert cli(["list", str(src)]) == 0 and "varuna   yes" in capsys.readouterr().out


@pytest.mark.parametrize("argv, line", [
    (["export", "--to", "nope", "SRC", "DST"], "unknown format 'nope'; registered: varuna, hf, dcp"),
    (["export", "--to", "hf", "/nonexistent", "DST"], "/nonexistent is not a directory"),
    (["verify", "/nonexistent"], "/nonexistent does not exist"),
    (["list", "/nonexistent"], "/nonexistent is not a directory"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_command_lines_are_one_line(argv, line, capsys):
    with pytest.raises(SystemExit) as e:
        cli(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and line in err and len(err.strip().splitlines()) == 1, err


def test_export_refuses_a_non_empty_destination_and_an_unknown_source(tmp_path, capsys):
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "x").write_text("keep me")
    (tmp_path / "src").mkdir()
    assert cli(["export", "--to", "hf", str(tmp_path / "src"), str(tmp_path / "dst")]) == 1
    err = capsys.readouterr().err
    assert "no complete checkpoint here" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "dst" / "x").read_text() == "keep me"


# ---------------------------------------------------------------------------------- processes

HF_WORKER = ROOT / "tests" / "workers" / "hf_state_worker.py"


def _hf_world(tmp_path: Path, name: str, P: int, D: int, *args: str) -> Path:
    out = tmp_path / name
    res = run_world(HF_WORKER, P * D, ["--out", str(out), *args], env={"VARUNA_PIPELINE_DEPTH": str(P)},
                    timeout_s=900)
    check_ok(res)
    return out


def _reports(out: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_hf_round_trip_from_pretrained_and_a_meta_resume_at_4x1(tmp_path, model):
    transformers = pytest.importorskip("transformers")
    from hf_worker import build
    from hf_worker import step_batch as hf_batch

    common = ("--model", model, "--size", "export")
    train = _hf_world(tmp_path, "train", 2, 2, *common, "--phase", "train",
                      "--ckpt-dir", str(tmp_path / "ck"), "--save-at", "2")
    engine_tensors: dict[str, torch.Tensor] = {}
    for f in sorted(train.glob("rank*.pt")):
        engine_tensors.update(torch.load(f, weights_only=True))
    export = tmp_path / "root" / step_dir_name(2)
    assert cli(["export", "--to", "hf", str(tmp_path / "ck"), str(export)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(export)
    mine = {**dict(hf.named_parameters()), **{n: b for n, b in hf.named_buffers() if n in engine_tensors}}
    assert _same({n: t.detach() for n, t in mine.items()}, engine_tensors) == [], "bit for bit"
    assert json.loads((export / "config.json").read_text())["model_type"] == model
    ref, _ = build(model, "default", "export")
    ref.load_state_dict(engine_tensors, strict=False)
    batch = hf_batch(3, "export", "llama")  # full rows: what the worker trains on
    hf.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.equal(hf(input_ids=batch["input_ids"]).logits, ref(input_ids=batch["input_ids"]).logits)
    # The export, as a checkpoint of the hf format, resumed by a model built on meta at 4×1.
    resumed = _reports(_hf_world(tmp_path, "resume", 4, 1, *common, "--phase", "resume",
                                 "--ckpt-dir", str(tmp_path / "root")))
    continued = _reports(train)[0]
    whole = resumed[0]["whole_model_param_bytes"]
    print(f"\n{model}: whole model {whole / 2**20:.1f} MiB of weights; at 4×1 from the hf export:")
    print("stage | weights held (MiB) | its stage's (MiB) | ideal share: 4x weights (MiB) "
          "| peak RSS - base (MiB)")
    for r in resumed:
        share = 4 * r["stage_param_bytes"]  # weights, loaded copy, gradients, momentum
        print(f"{r['stage']} | {r['resident_param_bytes'] / 2**20:.2f} | "
              f"{r['stage_param_bytes'] / 2**20:.2f} | {share / 2**20:.1f} | "
              f"{r['peak_rss_above_base'] / 2**20:.1f}")
        assert r["resumed_step"] == 2 and r["next_loss"] == continued["next_loss"], "the same next-step loss"
        assert r["resident_param_bytes"] - r["stage_param_bytes"] < 4096, "only the stage's tensors are held"
        assert r["stage_param_bytes"] < whole / 2
        # Training the whole model (its weights, gradients, momentum and a loaded copy) would need
        # more than this; a stage's peak also holds deterministic mode's partial gradient sums and
        # ~100 MiB the engine needs whatever the model (docs/too_big.md measures the same way).
        assert r["peak_rss_above_base"] < 4 * whole, (r, whole)


@pytest.mark.slow
def test_dcp_saved_at_2x2_loads_in_a_plain_dcp_script_and_at_4x1_bit_identical(tmp_path):
    worker = ROOT / "tests" / "workers" / "state_worker.py"

    def world(name: str, n: int, P: int, *args: str) -> Path:
        out = tmp_path / name
        check_ok(run_world(worker, n, ["--out", str(out), "--ckpt-dir", str(tmp_path / "ckpt"),
                                       "--pipeline-depth", str(P), "--deterministic", *args], timeout_s=600))
        return out

    saved = world("save", 4, 2, "--steps", "3", "--save-at", "3", "--format", "dcp", "--total-steps", "6")
    at_save: dict[str, torch.Tensor] = {}
    for f in sorted(saved.glob("rank*.pt")):
        at_save.update(torch.load(f, weights_only=True))
    step_dir = tmp_path / "ckpt" / step_dir_name(3)
    assert format_of(step_dir).name == "dcp"
    script = (  # no varuna: the model (examples/resnet, as the worker wraps it) and DCP only
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        f"sys.path.insert(0, {str(ROOT / 'examples' / 'resnet')!r})\n"
        "from model import ResNet, ResNetConfig\n"
        "model = torch.nn.Module()\n"
        "model.net = ResNet(ResNetConfig(widths=(8, 16), blocks_per_stage=1))\n"
        "sd = model.state_dict()\n"
        f"dcp.load(sd, checkpoint_id={str(step_dir)!r}, no_dist=True)\n"
        f"torch.save(sd, {str(tmp_path / 'plain.pt')!r})\n"
        "assert 'varuna' not in sys.modules\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr[-2000:]
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert _same({n: plain[n] for n in at_save}, at_save) == [], "a plain DCP load: the 2×2 run's tensors"
    # At 4×1 in varuna: resumed from the DCP checkpoint and trained on, the same as 2×2 goes on.
    straight = world("straight", 4, 2, "--steps", "6", "--total-steps", "6")
    on = world("on", 4, 4, "--steps", "6", "--resume", "1", "--total-steps", "6")

    def tensors(out: Path) -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        for f in sorted(out.glob("rank*.pt")):
            got.update(torch.load(f, weights_only=True))
        return got

    assert json.loads((on / "rank0.json").read_text())["resumed"]
    assert _same(tensors(on), tensors(straight)) == []
    assert verify_checkpoint(step_dir) == []
    assert [c.format for c in list_checkpoints(tmp_path / "ckpt")][0] == "dcp"


def test_plain_io_has_no_pickle_in_hf_files(tmp_path):
    """safetensors shards and the index are data: their bytes hold no pickle opcode stream."""
    eng = _engine(tmp_path / "ckpt", "hf")
    eng.train_step(step_batch(1))
    eng.save_checkpoint(wait=True)
    eng.close()
    step_dir = tmp_path / "ckpt" / step_dir_name(1)
    for f in step_dir.iterdir():
        head = f.read_bytes()[:2]
        assert head != b"\x80\x04" and head != b"PK", f.name  # neither a pickle nor a torch.save zip
        if f.suffix == ".safetensors":
            n = int.from_bytes(f.read_bytes()[:8], "little")
            json.load(io.BytesIO(f.read_bytes()[8:8 + n]))
