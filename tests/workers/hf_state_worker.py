"""Worker for the format round trips (tests/test_checkpoint_formats.py): a Hugging Face model from
a config (tests/workers/hf_worker.py: no download), a cut-point after every decoder block,
deterministic mode, SGD with momentum.

``--phase train`` trains ``--save-at`` steps, saves (``--format``), dumps each rank's parameters
and buffers of that step, then trains one more step and records its loss (what a resumed run
must reproduce). ``--phase resume`` builds the model on ``meta`` (``param_init`` is the model's own
``_init_weights``: it also recomputes Llama's rotary frequencies, which are not in a
checkpoint), resumes from the checkpoint root (any format) and trains the next step; it reports
the loss, the bytes of tensors it holds against its stage's, and its peak RSS above a baseline
taken after start-up (``VmHWM`` reset, as scripts/bench_too_big.py does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_worker import SIZES, build, loss_of, make_optimizer  # noqa: E402
from hf_worker import step_batch as hf_batch  # noqa: E402

import varuna  # noqa: E402
from varuna.cutting.split import resident_param_bytes  # noqa: E402

SEED = 7


def step_batch(step: int, size: str, model: str) -> dict[str, torch.Tensor]:
    """Full rows (no padding mask) for both models: on ``meta`` the dry run cannot run the
    padding-mask check of HF's causal mask (it reads the mask's values)."""
    return hf_batch(step, size, "llama")


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def warm_up() -> int:
    """Import and touch what the engine uses lazily, then reset the RSS high-water mark: the
    baseline every stage's peak is measured from (it holds no model)."""
    from torch.utils.flop_counter import FlopCounterMode

    import varuna.cutting.tracer
    import varuna.runtime.engine  # noqa: F401

    with FlopCounterMode(display=False):
        torch.ones(2, 2) @ torch.ones(2, 2)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return status()["VmRSS"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--model", choices=["gpt2", "llama"], required=True)
    p.add_argument("--size", default="test", choices=sorted(SIZES))
    p.add_argument("--phase", choices=["train", "resume"], required=True)
    p.add_argument("--save-at", type=int, default=2)
    p.add_argument("--format", default="varuna")
    a = p.parse_args()
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    z = SIZES[a.size]
    base = warm_up() if a.phase == "resume" else 0
    if a.phase == "resume":
        with torch.device("meta"):
            model, blocks = build(a.model, "default", a.size)
        init = {"param_init": lambda name, m: model._init_weights(m)}
    else:
        model, blocks = build(a.model, "default", a.size)
        init = {}
    varuna.apply_cutpoints(model, blocks)
    whole = sum(t.numel() * t.element_size() for t in model.parameters())
    engine = varuna.Engine(
        model,
        varuna.VarunaConfig(global_batch_size=z["global_batch"], micro_batch_size=z["micro"], seed=SEED,
                            deterministic=True, checkpoint_dir=str(a.ckpt_dir), checkpoint_format=a.format,
                            resume="1" if a.phase == "resume" else "0", comm_timeout_s=120.0),
        example_batch=step_batch(1, a.size, a.model), optimizer=make_optimizer, loss_fn=loss_of, **init)
    rank = engine.layout.rank
    a.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"stage": engine.stage, "P": engine.layout.P, "D": engine.layout.D}
    if a.phase == "train":
        for step in range(1, a.save_at + 1):
            engine.train_step(step_batch(step, a.size, a.model))
        engine.save_checkpoint(wait=True)
        sd = engine.state_dict()
        tensors = {**sd["params"], **sd["buffers"]}
        torch.save({n: t.clone() for n, t in tensors.items()}, a.out / f"rank{rank}.pt")
    else:
        report["resumed_step"] = engine.step_count
        stage_bytes = sum(t.numel() * t.element_size() for t in engine.stage_params.values())
        report.update(stage_param_bytes=stage_bytes, resident_param_bytes=resident_param_bytes(model),
                      whole_model_param_bytes=whole, base_rss=base)
    step = engine.step_count + 1
    report["next_loss"] = engine.train_step(step_batch(step, a.size, a.model)).loss
    report["next_step"] = step
    if a.phase == "resume":
        report["peak_rss_above_base"] = status()["VmHWM"] - base
    (a.out / f"rank{rank}.json").write_text(json.dumps(report))
    engine.close()


if __name__ == "__main__":
    main()
