"""Worker for the Hugging Face model tests (tests/test_hf_models.py) and scripts/bench_hf_cache.py.

Builds a tiny, randomly initialised transformers model (no download), puts a cut-point after every
decoder block (``apply_cutpoints``; for T5 after every encoder and every decoder block), trains
``--steps`` steps under the engine and writes, per rank, ``rank<R>.json`` (losses,
placeholder-cache entries, RSS and wall time per step) and ``rank<R>.pt`` (the stage's parameters
after the last step).

The model, the data of each step and the optimizer are built here, so the test's single-process
reference uses exactly the same ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import varuna  # noqa: E402

SEED, VOCAB = 7, 96
#: T5 token ids (the tiny configs' own): pad doubles as the decoder's start token
PAD, EOS = 0, 1
SIZES = {"test": dict(global_batch=8, micro=2, seq=16, d=32, layers=2),
         "test4": dict(global_batch=8, micro=2, seq=16, d=32, layers=4, t5_layers=2),
         "auto4": dict(global_batch=8, micro=2, seq=16, d=64, layers=4),  # T5: 4 + 4 blocks (auto cuts)
         "leak": dict(global_batch=8, micro=2, seq=64, d=64, layers=2),
         "bench": dict(global_batch=16, micro=2, seq=64, d=128, layers=4),
         # tests/test_checkpoint_formats.py: a model whose weights (~80-100 MB) dwarf a stage's share
         "export": dict(global_batch=8, micro=2, seq=16, d=512, layers=8)}
MODELS = ("gpt2", "llama", "qwen2", "t5")
#: T5's segments (2 + 2 blocks): 0-1 encoder blocks, 2 encoder end + first decoder block, 3 second
#: decoder block, 4 head and loss. Stages start at segment 3, where the encoder output must be
#: carried in, rather than wherever the timings put them.
T5_RANGES = {2: [(0, 2), (3, 4)], 4: [(0, 0), (1, 1), (2, 2), (3, 4)]}


def build(name: str, use_cache: str = "default", size: str = "test"):
    """(model, names of the modules to cut after) of a tiny random ``name`` (one of ``MODELS``).

    T5 has ``layers`` (``t5_layers`` if set) encoder and as many decoder blocks, 2 + 2 at sizes
    "test" and "test4", and a cut after each of them; Qwen2 uses grouped-query attention (4 query heads,
    2 key/value heads)."""
    import transformers

    transformers.logging.set_verbosity_error()  # the tiny configs' token ids trip a config warning
    z = SIZES[size]
    extra = {} if use_cache == "default" else {"use_cache": use_cache == "true"}
    torch.manual_seed(1234)
    common = dict(num_hidden_layers=z["layers"], hidden_size=z["d"], intermediate_size=2 * z["d"],
                  vocab_size=VOCAB, max_position_embeddings=z["seq"], bos_token_id=0, eos_token_id=0,
                  pad_token_id=0, **extra)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=z["layers"], n_embd=z["d"], n_head=2, vocab_size=VOCAB,
                                      n_positions=z["seq"], bos_token_id=0, eos_token_id=0, **extra)
        model = transformers.GPT2LMHeadModel(cfg)
        blocks = [f"transformer.h.{i}" for i in range(z["layers"])]
    elif name == "llama":
        cfg = transformers.LlamaConfig(num_attention_heads=2, num_key_value_heads=2, **common)
        model = transformers.LlamaForCausalLM(cfg)
        blocks = [f"model.layers.{i}" for i in range(z["layers"])]
    elif name == "qwen2":
        cfg = transformers.Qwen2Config(num_attention_heads=4, num_key_value_heads=2, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
        blocks = [f"model.layers.{i}" for i in range(z["layers"])]
    elif name == "t5":
        t5_layers = z.get("t5_layers", z["layers"])
        cfg = transformers.T5Config(vocab_size=VOCAB, d_model=z["d"], d_kv=z["d"] // 2, d_ff=2 * z["d"],
                                    num_layers=t5_layers, num_decoder_layers=t5_layers, num_heads=2,
                                    relative_attention_num_buckets=8,
                                    relative_attention_max_distance=z["seq"], pad_token_id=PAD,
                                    eos_token_id=EOS, decoder_start_token_id=PAD, **extra)
        model = transformers.T5ForConditionalGeneration(cfg)
        blocks = [f"{stack}.block.{i}" for stack in ("encoder", "decoder") for i in range(t5_layers)]
    else:
        raise ValueError(name)
    model.train()  # from_config models start in train mode already; dropout stays as configured
    return model, blocks


def _padded(g: torch.Generator, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask with every other row right-padded (at least 3 real tokens)."""
    ids = torch.randint(2, VOCAB, (rows, seq), generator=g)
    keep = torch.full((rows,), seq)
    keep[1::2] = torch.randint(3, seq, (rows // 2,), generator=g)
    mask = (torch.arange(seq)[None, :] < keep[:, None]).long()
    return ids.masked_fill(mask == 0, PAD), mask


def step_batch(step: int, size: str = "test", name: str = "gpt2") -> dict[str, torch.Tensor]:
    """The global batch of step ``step`` (1-based), the same on every rank and in the reference.

    GPT-2 and T5 batches are padded: an ``attention_mask`` and -100 labels at the pads (ignored by
    the loss); T5's labels are half as long as its inputs. Llama and Qwen2 get full rows."""
    z = SIZES[size]
    g = torch.Generator().manual_seed(1000 + step)
    rows, seq = z["global_batch"], z["seq"]
    if name == "t5":
        ids, mask = _padded(g, rows, seq)
        ids[torch.arange(rows), mask.sum(1) - 1] = EOS
        labels, lmask = _padded(g, rows, seq // 2)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels.masked_fill(lmask == 0, -100)}
    if name == "gpt2":
        ids, mask = _padded(g, rows, seq)
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def loss_of(output, batch):
    return output.loss


def cache_entries(model) -> int:
    """Placeholder-cache entries of every skipped module (``varuna.cutting.placeholders.
    placeholder_cache_entries``, by duck typing so that the leak test also measures older code)."""
    fwds = [m.__dict__.get("forward") for m in model.modules()]
    return sum(len(f.cache) for f in fwds if hasattr(f, "cache"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def train(name: str, a: argparse.Namespace, out: Path) -> None:
    """Train ``name`` under the engine and write this rank's results to ``out``."""
    z = SIZES[a.size]
    model, blocks = build(name, a.use_cache, a.size)
    varuna.apply_cutpoints(model, blocks)
    P = int(os.environ.get("VARUNA_PIPELINE_DEPTH", "1"))
    t5_blocks = z.get("t5_layers", z["layers"])  # T5_RANGES are for 2 + 2 blocks
    engine = varuna.Engine(
        model,
        varuna.VarunaConfig(global_batch_size=z["global_batch"], micro_batch_size=z["micro"], seed=SEED,
                            pipeline=varuna.PipelineConfig(
                                stage_ranges=T5_RANGES.get(P) if name == "t5" and t5_blocks == 2 else None)),
        example_batch=step_batch(1, a.size, name), optimizer=make_optimizer, loss_fn=loss_of)
    rank = engine.layout.rank
    rec: dict[str, list] = {"loss": [], "entries": [], "rss": [], "step_s": []}
    for step in range(1, a.steps + 1):
        batch = step_batch(step, a.size, name)
        t0 = time.perf_counter()
        r = engine.train_step(batch)
        rec["step_s"].append(time.perf_counter() - t0)
        rec["loss"].append(r.loss)
        rec["entries"].append(cache_entries(model))
        rec["rss"].append(rss_bytes())
    out.mkdir(parents=True, exist_ok=True)
    torch.save({n: q.detach().clone() for n, q in engine.named_parameters()}, out / f"rank{rank}.pt")
    plan = engine._executor.s.carry_plan  # what crossed this stage's boundaries besides the routed outputs
    carried = {k: [f"{c.module}#{c.call}.{c.leaf}" for c in getattr(plan, k, ())] for k in ("recv", "send")}
    (out / f"rank{rank}.json").write_text(json.dumps({**rec, "stage": engine.stage, "carried": carried,
                                                      "stage_ranges": engine.stage_ranges}))
    engine.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="gpt2",
                   help=f"one of {', '.join(MODELS)}, or several comma-separated (results in OUT/<model>/)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--use-cache", default="default", choices=["default", "true", "false"])
    p.add_argument("--size", default="test", choices=sorted(SIZES))
    a = p.parse_args()
    names = a.model.split(",")
    if any(n not in MODELS for n in names):
        p.error(f"--model: choose from {', '.join(MODELS)}")
    torch.set_num_threads(1)
    if len(names) > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # One process group for all the engines (they do not own it): starting the processes and
        # importing transformers is most of a run's time on a 2-core host, so one world trains all.
        import torch.distributed as dist

        dist.init_process_group("gloo")
    for name in names:
        train(name, a, a.out / name if len(names) > 1 else a.out)
    if len(names) > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
