"""TensorBoard output (varuna/runtime/tensorboard.py): the event files, read back with TensorBoard's
own reader (``EventAccumulator``), against the JSON Lines the GPT example writes in the same run.

Scalars are stored as float32 (``simple_value``), so each is compared exactly with the float32 of
the JSON value; wall times are float64 in both and compared exactly.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import ROOT
from models import build_model
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

import varuna
from varuna.launch.launcher import main as launch_main
from varuna.runtime.tensorboard import INSTALL_HINT, TensorBoardLog

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from ckpt_worker import GLOBAL_BATCH, MICRO_BATCH, batch_for  # noqa: E402

TRAIN = ROOT / "examples" / "gpt2" / "train.py"
SMALL = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
         "--global-batch-size", "8", "--micro-batch-size", "2", "--threads", "1"]
#: TensorBoard scalar tag -> JSON Lines key of the example's metrics
SERIES = {"train/loss": "loss", "train/grad_norm": "grad_norm", "train/samples_per_s": "samples_per_s",
          "train/step_s": "step_s", "layout/P": "P", "layout/D": "D"}


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def read_events(logdir: Path) -> tuple[dict, dict]:
    """Every scalar series ({tag: [(step, value, wall_time)]}) and text series ({tag: [(step, text)]})
    of a log directory, as TensorBoard shows them (restarts purged)."""
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value, e.wall_time) for e in acc.Scalars(t)] for t in tags["scalars"]}
    def text(e) -> str:
        return tensor_util.make_ndarray(e.tensor_proto).item().decode()

    texts = {t.removesuffix("/text_summary"): [(e.step, text(e)) for e in acc.Tensors(t)]
             for t in tags["tensors"]}
    return scalars, texts


def last_record_per_step(jsonl: Path) -> dict[int, dict]:
    """A relaunch appends to the file: a step run twice keeps its newest record, as TensorBoard does."""
    return {r["step"]: r for r in map(json.loads, jsonl.read_text().splitlines())}


def assert_series_match(scalars: dict, records: dict[int, dict]) -> None:
    steps = sorted(records)
    series = dict(SERIES)
    optional = (("train/tflops", "tflops"), ("train/hardware_tflops", "hardware_tflops"),
                ("train/mfu", "mfu"))
    for tag, key in optional:
        # Written only when known (MFU: when a peak is given): as the JSON Lines say.
        if all(records[s].get(key) is not None for s in steps):
            series[tag] = key
        else:
            assert tag not in scalars, f"{tag} written although the JSON Lines have no value"
    for tag, key in series.items():
        got = scalars[tag]
        assert [s for s, _, _ in got] == steps, f"{tag}: steps {[s for s, _, _ in got]}, JSON Lines {steps}"
        for step, value, wall in got:
            assert value == f32(records[step][key]), f"{tag} at step {step}: {value} vs {records[step][key]}"
            assert wall == records[step]["wall_time"], f"{tag} at step {step}: wall time differs"


def run_example(args: list[str], env: dict | None = None, timeout: float = 120):
    e = {k: v for k, v in os.environ.items() if k != "VARUNA_TENSORBOARD_DIR"}  # only the flag turns it on
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    e.update(env or {})
    return subprocess.run([sys.executable, *args], env=e, capture_output=True, text=True, timeout=timeout)


def test_events_match_the_json_lines_of_the_gpt_example(tmp_path):
    tb, jsonl = tmp_path / "tb", tmp_path / "metrics.jsonl"
    res = run_example([str(TRAIN), "--steps", "3", "--eval-every", "2", *SMALL,
                       "--tensorboard-dir", str(tb), "--metrics-out", str(jsonl)],
                      env={"VARUNA_PEAK_TFLOPS": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1
    records = last_record_per_step(jsonl)
    assert sorted(records) == [1, 2, 3]
    scalars, texts = read_events(tb)
    assert_series_match(scalars, records)
    assert {"train/tflops", "train/hardware_tflops", "train/mfu"} <= set(scalars)  # a peak was given
    assert {v for _, v, _ in scalars["layout/P"]} == {1.0} and {v for _, v, _ in scalars["layout/D"]} == {1.0}
    evals = {s: r["val_loss"] for s, r in records.items() if "val_loss" in r}
    assert [(s, v) for s, v, _ in scalars["eval/loss"]] == [(s, f32(v)) for s, v in sorted(evals.items())]
    assert [s for s, _ in texts["varuna/layout"]] == [1] and "P×D 1×1" in texts["varuna/layout"][0][1]
    assert "varuna/resume" not in texts and "varuna/morph" not in texts  # a fresh run


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_engine(ckpt: Path, **cfg) -> varuna.Engine:
    return varuna.Engine(
        build_model("gpt", dropout=0.1),
        varuna.VarunaConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH, seed=7,
                            stop_signals=(), checkpoint_dir=str(ckpt), **cfg),
        example_batch=batch_for(1),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    )


def test_off_writes_nothing_and_a_resume_at_the_same_layout_is_no_morph(tmp_path, monkeypatch, one_thread):
    monkeypatch.delenv("VARUNA_TENSORBOARD_DIR", raising=False)
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    eng = make_engine(ckpt, resume="0")  # negative control: TensorBoard output off
    for step in (1, 2):
        eng.train_step(batch_for(step))
    eng.save_checkpoint(wait=True)
    eng.close()
    assert not list(tmp_path.rglob("events.out.tfevents.*"))

    monkeypatch.setenv("VARUNA_TENSORBOARD_DIR", str(tb))  # what varuna-launch --tensorboard-dir exports
    eng = make_engine(ckpt, resume="1")
    seen = []
    eng.add_step_callback(seen.append)
    eng.train_step(batch_for(3))
    eng.close()
    scalars, texts = read_events(tb)
    (r,) = seen
    assert [(s, v) for s, v, _ in scalars["train/loss"]] == [(3, f32(r.loss))]
    assert [(s, v) for s, v, _ in scalars["train/grad_norm"]] == [(3, f32(r.grad_norm))]
    assert [s for s, _ in texts["varuna/resume"]] == [3]
    assert "after step 2" in texts["varuna/resume"][0][1] and "1×1" in texts["varuna/resume"][0][1]
    assert "varuna/morph" not in texts


def test_missing_package_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError) as e:
        make_engine(tmp_path / "ckpt", resume="0", tensorboard_dir=str(tmp_path / "tb"))
    assert INSTALL_HINT in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "tb").exists()


def test_bad_values_are_one_line_errors(tmp_path, capsys):
    cfg = dict(global_batch_size=8, micro_batch_size=2)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for bad, needle in [("  ", "must be a directory path"), (3, "must be a directory path"),
                        (str(a_file), "is a file, not a directory")]:
        with pytest.raises(ValueError, match=needle) as e:
            varuna.VarunaConfig(**cfg, tensorboard_dir=bad).validate()
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="cannot write event files there") as e:
        TensorBoardLog(str(a_file / "sub"), info={"P": 1, "D": 1, "m": 2, "Nm": [4], "schedule": "varuna",
                                                  "stage_ranges": [(0, 2)]})
    assert "\n" not in str(e.value)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    assert launch_main(["--procs", "1", "--pipeline-depth", "1", "--tensorboard-dir", " ", str(script)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--tensorboard-dir needs a directory" in err[0], err


def test_kill_9_keeps_every_completed_step(tmp_path):
    """The writer is flushed after every step: a SIGKILL inside step 3, after the log saw it, loses
    nothing."""
    tb, jsonl = tmp_path / "tb", tmp_path / "metrics.jsonl"
    res = run_example([str(TRAIN), "--steps", "5", "--eval-every", "0", *SMALL,
                       "--tensorboard-dir", str(tb), "--metrics-out", str(jsonl)],
                      env={"VARUNA_ENGINE_PLUGINS": "tb_kill_plugin:attach",
                           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "workers")])})
    assert res.returncode == -9, res.stdout[-2000:] + res.stderr[-2000:]
    records = last_record_per_step(jsonl)
    assert sorted(records) == [1, 2]  # the script never got step 3 back
    scalars, _ = read_events(tb)
    assert [s for s, _, _ in scalars["train/loss"]] == [1, 2, 3]
    assert_series_match({t: v[:2] for t, v in scalars.items()}, records)


@pytest.mark.slow
def test_morph_through_a_checkpoint_adds_the_event_and_continues_the_series(tmp_path):
    """1×2 runs steps 1-3 (checkpoint after 2), the relaunch at 2×1 resumes after step 2 and runs 3-5:
    every series has steps 1-5 once, step 3 from the second run, P and D following the layout."""
    tb, jsonl, ckpt = tmp_path / "tb", tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    common = ["--tensorboard-dir", str(tb), "--checkpoint-dir", str(ckpt), str(TRAIN), *SMALL,
              "--eval-every", "0", "--metrics-out", str(jsonl)]
    launch = ["-m", "varuna.launch", "--procs", "2"]
    first = run_example(
        [*launch, "--pipeline-depth", "1", *common, "--steps", "3", "--checkpoint-every", "2"], timeout=180
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    second = run_example([*launch, "--pipeline-depth", "2", *common, "--steps", "5"], timeout=180)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-2000:]
    assert "resumed from the checkpoint of step 2" in second.stdout
    assert len(list(tb.glob("events.out.tfevents.*"))) == 2  # one file per run, rank 0 only

    raw_steps = [json.loads(line)["step"] for line in jsonl.read_text().splitlines()]
    assert raw_steps == [1, 2, 3, 3, 4, 5]  # step 3 ran twice; the series must hold it once
    records = last_record_per_step(jsonl)
    scalars, texts = read_events(tb)
    assert_series_match(scalars, records)  # steps 1..5, each once, step 3 from the relaunch
    layout = {s: (P, D) for (s, P, _), (_, D, _) in zip(scalars["layout/P"], scalars["layout/D"])}
    assert layout == {1: (1, 2), 2: (1, 2), 3: (2, 1), 4: (2, 1), 5: (2, 1)}
    assert texts["varuna/morph"] == [(3, "P×D 1×2 → 2×1 at step 3")]
    assert [s for s, _ in texts["varuna/resume"]] == [3] and "after step 2" in texts["varuna/resume"][0][1]
    assert [s for s, _ in texts["varuna/layout"]] == [1, 3]
