"""Train a Hugging Face causal LM, unmodified, across pipeline stages with varuna.

The model is built from its config with random weights (no download) and never edited: the
cut-points come from the launcher, by module name or pattern (``--cut-after``), or are chosen by
the engine (``--auto-cutpoints``). The data is the byte corpus of the GPT example.

    varuna-launch --procs 2 --pipeline-depth 2 --cut-after 'model.layers.*' examples/hf/train.py --model llama
    varuna-launch --procs 4 --pipeline-depth 2 --cut-after 'transformer.h.*' examples/hf/train.py --model gpt2
    varuna-launch --procs 4 --pipeline-depth 4 --auto-cutpoints 3 examples/hf/train.py --model qwen2
    python examples/hf/train.py --model llama --steps 5        # one process (P = D = 1)

Pretrained weights: ``--init-from DIR`` (a ``save_pretrained`` directory, safetensors, sharded or
not, or a varuna/DCP checkpoint) builds the model on ``meta`` and each stage reads only its own
tensors (docs/checkpoints.md "Formats"); ``--checkpoint-format hf`` writes checkpoints
``from_pretrained`` loads as they are. Needs the ``[hf]`` extra: ``pip install 'varuna[hf]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt2"))

from data import ByteBatches  # noqa: E402

import varuna  # noqa: E402
from varuna.core.extras import MissingExtra, require  # noqa: E402

#: model family -> (HF model_type, the config's names for layers, width, heads, kv heads, positions)
FAMILIES = {
    "gpt2": ("gpt2", "n_layer", "n_embd", "n_head", None, "n_positions"),
    "llama": ("llama", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
              "max_position_embeddings"),
    "qwen2": ("qwen2", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
              "max_position_embeddings"),
    "mistral": ("mistral", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "max_position_embeddings"),
}
#: the byte corpus: one token per byte
VOCAB = 256
#: This script's own values for the planned fields it leaves to the launcher (Note [Run plan] in
#: varuna/core/env.py): used only when neither the command line nor the run plan gives one.
PLAN_DEFAULTS = {"global_batch_size": 16, "micro_batch_size": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", choices=sorted(FAMILIES))
    p.add_argument("--steps", type=int, default=20, help="total optimizer steps")
    # Planned fields default to None (unset): the launcher's plan then applies, else PLAN_DEFAULTS.
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="examples per step (default: the launcher's --global-batch-size, else 16)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="examples per micro-batch (default: auto-config's choice, else 4)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query families)")
    p.add_argument("--seq", type=int, default=64, help="tokens per example")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    p.add_argument("--deterministic", action="store_true", help="bit-identical weights at any P×D")
    p.add_argument("--metrics-out", type=Path, help="JSON Lines, one object per step (rank 0)")
    p.add_argument("--checkpoint-dir", help="global checkpoint store (also the launcher's --checkpoint-dir)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: on stop)")
    p.add_argument("--checkpoint-format", help="varuna (default), hf (from_pretrained loads it) or dcp")
    p.add_argument("--init-from", help="start from these weights (HF model directory, checkpoint): "
                                       "the model is built on meta, each stage reads its own tensors")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.d_model % args.heads or args.heads % args.kv_heads:
        p.error("--d-model must be a multiple of --heads, and --heads a multiple of --kv-heads")
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The family's causal LM from a small config, random weights seeded by ``--seed``."""
    transformers = require("transformers", "hf", "examples/hf/train.py")
    transformers.logging.set_verbosity_error()
    model_type, layers, width, heads, kv_heads, positions = FAMILIES[args.model]
    kw = {layers: args.layers, width: args.d_model, heads: args.heads, positions: args.seq,
          "vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0}
    if kv_heads is not None:
        kw.update({kv_heads: args.kv_heads, "intermediate_size": 4 * args.d_model, "pad_token_id": 0})
    config = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(args.seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def batch(data: ByteBatches, split: str, step: int, size: int) -> dict[str, torch.Tensor]:
    """HF convention: ``labels`` are the inputs (the model shifts them); the output carries ``loss``."""
    x, _ = data.get(split, step, size)
    return {"input_ids": x, "labels": x}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = ByteBatches(args.seq, seed=args.seed)
    if args.init_from:
        with torch.device("meta"):  # no process holds the whole model: each stage reads its tensors
            model = build_model(args)
        init = {"param_init": lambda name, m: model._init_weights(m)}  # also rotary frequencies
    else:
        model, init = build_model(args), {}
    # Cut-points: VARUNA_CUT_AFTER / VARUNA_AUTO_CUTPOINTS from the launcher, or set
    # cutting=varuna.CuttingConfig(cut_after=("model.layers.*",)) here. The batch sizes the command
    # line left unset come from the launcher's run plan (else PLAN_DEFAULTS): the data needs them.
    config = varuna.VarunaConfig(
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        seed=args.seed,
        determinism=varuna.DeterminismConfig(enabled=args.deterministic, threads=args.threads),
        checkpoints=varuna.CheckpointConfig(dir=args.checkpoint_dir, every=args.checkpoint_every,
                                            format=args.checkpoint_format, init_from=args.init_from),
    ).with_plan(defaults=PLAN_DEFAULTS)
    args.global_batch_size = config.global_batch_size
    engine = varuna.Engine(
        model,
        config,
        example_batch=batch(data, "train", 0, args.global_batch_size),
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0),
        # no loss_fn: the engine takes the HF output's `loss`
        **init,
    )
    info = engine.describe()
    leader = engine.layout.rank == 0
    if leader:
        print(f"varuna: {type(model).__name__} P={info['P']} D={info['D']} cut after "
              f"{[n.rsplit('.', 1)[0] for n in info['cutpoints']]} stages={info['stage_ranges']}", flush=True)
    out = open(args.metrics_out, "a") if (leader and args.metrics_out) else None
    try:
        for step in range(engine.step_count + 1, args.steps + 1):
            r = engine.train_step(batch(data, "train", step, args.global_batch_size))
            if leader:
                print(f"step {r.step:5d}/{args.steps} loss {r.loss:.4f} {r.samples_per_s:8.1f} samples/s",
                      flush=True)
                if out:
                    row = {"step": r.step, "loss": r.loss, "P": info["P"], "D": info["D"],
                           "samples_per_s": r.samples_per_s, "step_s": r.step_s, "tflops": r.tflops,
                           "mfu": r.mfu}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
    finally:
        if out:
            out.close()
        engine.close()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        sys.exit(main())
    except (ValueError, MissingExtra) as e:  # bad input: one line naming the problem and the fix
        print(f"train.py: error: {e}", file=sys.stderr)
        sys.exit(2)
