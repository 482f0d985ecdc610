"""Row 3 of the GPU check: a Hugging Face Llama built from a config (no download) at 1×1 on the
device, its own ``use_cache`` default (True: a ``DynamicCache`` inside every forward) and default
attention (SDPA), against the plain loop on the same weights and data."""

from __future__ import annotations

from typing import Any

from gpu_rows.common import (
    FAIL,
    FIRST_LOSS_RTOL,
    LOSS_RTOL,
    PASS,
    PlainTrainer,
    RowResult,
    fmt,
    log,
    max_rel_diff,
    sizes,
)

LR, CLIP, SEED = 3e-4, 1.0, 0


def _llama(z: dict[str, Any]):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        vocab_size=z["vocab"],
        hidden_size=z["hidden"],
        intermediate_size=z["inter"],
        num_hidden_layers=z["layers"],
        num_attention_heads=z["heads"],
        num_key_value_heads=z["kv_heads"],
        max_position_embeddings=z["seq"],
    )
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(cfg)


def _batches(z: dict[str, Any], count: int) -> list[dict]:
    import torch

    out = []
    for step in range(1, count + 1):
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, z["vocab"], (z["M"], z["seq"]), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def row_llama(device: str) -> RowResult:
    import torch

    import varuna

    z = sizes(device, "llama")
    batches = _batches(z, z["steps"])
    model = _llama(z)
    use_cache = model.config.use_cache
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"LlamaForCausalLM from config: {n_params / 1e6:.3g}M parameters, use_cache={use_cache}, "
        f"attention {getattr(model.config, '_attn_implementation', '?')}, seq {z['seq']}"
    )
    log("plain PyTorch loop")
    plain = PlainTrainer(
        model,
        M=z["M"],
        m=z["m"],
        device=device,
        precision="bf16",
        lr=LR,
        max_grad_norm=CLIP,
        loss_of=lambda mdl, mb: mdl(**mb).loss,
    )
    ref = [plain.step(b) for b in batches]
    del plain, model
    log("engine 1x1 (the HF output's loss, no loss_fn)")
    cfg = varuna.VarunaConfig(
        global_batch_size=z["M"],
        micro_batch_size=z["m"],
        device=device,
        precision="bf16",
        max_grad_norm=CLIP,
        stop_signals=(),
    )
    eng = varuna.Engine(
        _llama(z),
        cfg,
        example_batch=batches[0],
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.0),
    )
    try:
        results = [eng.train_step(b) for b in batches]
        devices = sorted({str(p.device) for p in eng.parameters()})
    finally:
        eng.close()
    got = [r.loss for r in results]
    first = abs(got[0] - ref[0]) / ref[0]
    worst = max_rel_diff(got, ref)
    finite = all(torch.isfinite(torch.tensor(got)))
    ok = (
        use_cache
        and finite
        and first <= FIRST_LOSS_RTOL
        and worst <= LOSS_RTOL
        and all(d.startswith(device) for d in devices)
    )
    tflops = results[-1].tflops
    summary = (
        f"{n_params / 1e6:.3g}M params, use_cache={use_cache}: step-1 loss rel. diff {first:.1e} "
        f"(tol {FIRST_LOSS_RTOL:g}), max over {len(got)} steps {worst:.1e} (tol {LOSS_RTOL:g}); "
        f"last step {fmt(tflops)} TFLOP/s, MFU {fmt(results[-1].mfu, '.1%')}"
    )
    return RowResult(
        PASS if ok else FAIL,
        summary,
        {
            "plain": ref,
            "engine": got,
            "first_rel_diff": first,
            "max_rel_diff": worst,
            "use_cache": use_cache,
            "param_devices": devices,
            "tflops": tflops,
            "mfu": results[-1].mfu,
            "params": n_params,
        },
    )
