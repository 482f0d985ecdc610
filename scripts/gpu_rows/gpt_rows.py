"""Rows 1 and 2 of the GPU check: the GPT example at 1×1 against a plain PyTorch loop (losses,
deterministic mode twice), and the engine's step-time overhead and MFU against that loop."""

from __future__ import annotations

import statistics
import time
from typing import Any

from gpu_rows.common import (
    FAIL,
    FIRST_LOSS_RTOL,
    LOSS_RTOL,
    PASS,
    WARN,
    PlainTrainer,
    RowResult,
    fmt,
    gpt_batches,
    gpt_model,
    log,
    max_rel_diff,
    sizes,
    sync,
    tensor_digest,
)

LR, CLIP = 1e-3, 1.0
#: Goal of row 2: the engine's step at 1×1 at most this much slower than the plain loop.
OVERHEAD_GOAL = 0.03


def build_engine(model, z: dict[str, Any], device: str, example_batch, **config: Any):
    """An engine over ``model`` on ``device`` with the rows' optimizer (AdamW) and clipping."""
    import torch

    import varuna

    cfg = varuna.VarunaConfig(
        global_batch_size=z["M"],
        micro_batch_size=z["m"],
        device=device,
        seed=0,
        stop_signals=(),
        **{"precision": "bf16", "max_grad_norm": CLIP, **config},
    )
    return varuna.Engine(
        model,
        cfg,
        example_batch=example_batch,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.0),
    )


def engine_run(z: dict[str, Any], batches: list, device: str, *, dropout: float, **config: Any) -> dict:
    """Train a fresh engine on ``batches``: losses, weight digests, and where it ran."""
    eng = build_engine(gpt_model(z, dropout=dropout), z, device, batches[0], **config)
    try:
        results = [eng.train_step(b) for b in batches]
        return {
            "losses": [r.loss for r in results],
            "digests": {n: tensor_digest(p) for n, p in eng.named_parameters()},
            "param_devices": sorted({str(p.device) for p in eng.parameters()}),
            "results": results,
        }
    finally:
        eng.close()


def row_gpt(device: str) -> RowResult:
    """(1) The GPT example at 1×1, bf16: default mode against a plain loop from the same weights
    on the same data (dropout 0, so the masks cannot differ), and deterministic mode (dropout 0.1:
    keyed masks from the device's generator) run twice in one process: bit-identical."""
    import os

    z = sizes(device, "gpt")
    batches = gpt_batches(z, z["steps"])
    log(f"plain PyTorch loop, {z['steps']} steps of M={z['M']} m={z['m']}, n_embd={z['n_embd']}")
    plain = PlainTrainer(
        gpt_model(z, dropout=0.0),
        M=z["M"],
        m=z["m"],
        device=device,
        precision="bf16",
        lr=LR,
        max_grad_norm=CLIP,
    )
    ref = [plain.step(b) for b in batches]
    del plain
    log("engine 1x1, default mode")
    default = engine_run(z, batches, device, dropout=0.0)
    import varuna

    log("engine 1x1, deterministic mode, run A")
    det_a = engine_run(z, batches, device, dropout=0.1, determinism=varuna.DeterminismConfig(enabled=True))
    log("engine 1x1, deterministic mode, run B (same process: its RNG streams moved on)")
    det_b = engine_run(z, batches, device, dropout=0.1, determinism=varuna.DeterminismConfig(enabled=True))
    first = abs(default["losses"][0] - ref[0]) / ref[0]
    worst = max_rel_diff(default["losses"], ref)
    same = det_a["losses"] == det_b["losses"] and det_a["digests"] == det_b["digests"]
    on_device = all(d.startswith(device) for r in (default, det_a) for d in r["param_devices"])
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    ok = (
        first <= FIRST_LOSS_RTOL
        and worst <= LOSS_RTOL
        and same
        and on_device
        and cublas in (":4096:8", ":16:8")
    )
    summary = (
        f"vs plain loop: step-1 loss rel. diff {first:.1e} (tol {FIRST_LOSS_RTOL:g}), max over "
        f"{len(ref)} steps {worst:.1e} (tol {LOSS_RTOL:g}); deterministic x2: "
        f"{'bit-identical' if same else 'DIFFERENT'} losses and weights; CUBLAS_WORKSPACE_CONFIG={cublas}"
    )
    return RowResult(
        PASS if ok else FAIL,
        summary,
        {
            "plain": ref,
            "default": default["losses"],
            "det_a": det_a["losses"],
            "det_b": det_b["losses"],
            "first_rel_diff": first,
            "max_rel_diff": worst,
            "det_bit_identical": same,
            "param_devices": default["param_devices"],
            "cublas_workspace_config": cublas,
        },
    )


def _count_step_flops(model, z: dict[str, Any], batch, device: str) -> float:
    """Model FLOPs of one step of the plain loop, counted independently of the engine: the forward
    of one micro-batch under ``FlopCounterMode``, × 3 (Note [Model FLOPs]) × micro-batches."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    x, y = (t[: z["m"]].to(device) for t in batch)
    with (
        torch.no_grad(),
        FlopCounterMode(display=False) as counter,
        torch.autocast(torch.device(device).type, dtype=torch.bfloat16),
    ):
        model(x, y)
    return 3.0 * counter.get_total_flops() * (z["M"] / z["m"])


def _timed(step, batches: list, device: str) -> list[float]:
    out = []
    for b in batches:
        sync(device)
        t0 = time.perf_counter()
        step(b)
        sync(device)  # the step's kernels finished: wall time of the whole step
        out.append(time.perf_counter() - t0)
    return out


def row_overhead(device: str) -> RowResult:
    """(2) Step time of the engine at 1×1 against the plain loop, bf16, on a model whose step takes
    tens of ms on an H100 (so Python overhead is not the whole story), alternating rounds; TFLOP/s
    and MFU of both from one FLOP count, and the engine's own ``StepResult`` numbers against it."""
    import torch

    from varuna.core.flops import peak_tflops
    from varuna.runtime.flops import device_name

    z = sizes(device, "big")
    batches = gpt_batches(z, z["warmup"] + z["steps"])
    warm, timed = batches[: z["warmup"]], batches[z["warmup"] :]
    log(f"models: n_layer={z['n_layer']} n_embd={z['n_embd']} T={z['block_size']} M={z['M']} m={z['m']}")
    plain = PlainTrainer(
        gpt_model(z, dropout=0.0),
        M=z["M"],
        m=z["m"],
        device=device,
        precision="bf16",
        lr=LR,
        max_grad_norm=CLIP,
    )
    flops = _count_step_flops(plain.model, z, batches[0], device)
    eng = build_engine(gpt_model(z, dropout=0.0), z, device, batches[0])
    reported: list = []
    try:
        times: dict[str, list[float]] = {"plain": [], "engine": []}
        for step in warm:
            plain.step(step)
            eng.train_step(step)
        for r in range(z["rounds"]):
            log(f"round {r + 1}/{z['rounds']}: {len(timed)} steps each")
            times["plain"] += _timed(plain.step, timed, device)
            times["engine"] += _timed(lambda b: reported.append(eng.train_step(b)), timed, device)
        transport = eng.transport.description
    finally:
        eng.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    overhead = med["engine"] / med["plain"] - 1.0
    peak = peak_tflops(device_name(torch.device(device)), "bf16")
    tflops = {k: flops / t / 1e12 for k, t in med.items()}
    mfu = {k: (v / peak if peak else None) for k, v in tflops.items()}
    engine_flops = reported[-1].model_flops
    flops_ok = engine_flops is not None and abs(engine_flops - flops) <= 1e-9 * flops
    rep_tflops = statistics.median(r.tflops for r in reported)
    rep_mfu = reported[-1].mfu
    goal = device != "cuda" or overhead <= OVERHEAD_GOAL
    status = FAIL if not flops_ok else (PASS if goal else WARN)
    summary = (
        f"step {med['plain'] * 1e3:.1f} ms plain, {med['engine'] * 1e3:.1f} ms engine: overhead "
        f"{overhead:+.1%} (goal <= {OVERHEAD_GOAL:.0%}{'' if device == 'cuda' else ', judged on GPU only'}); "
        f"{fmt(tflops['plain'])} / {fmt(tflops['engine'])} TFLOP/s, MFU {fmt(mfu['plain'], '.1%')} / "
        f"{fmt(mfu['engine'], '.1%')} (peak {fmt(peak)}); engine's own: {fmt(rep_tflops)} TFLOP/s, MFU "
        f"{fmt(rep_mfu, '.1%')}, FLOP count {'equal' if flops_ok else 'DIFFERENT'}"
    )
    return RowResult(
        status,
        summary,
        {
            "step_s": med,
            "overhead": overhead,
            "model_flops_per_step": flops,
            "engine_model_flops": engine_flops,
            "tflops": tflops,
            "mfu": mfu,
            "peak_tflops": peak,
            "engine_reported_tflops": rep_tflops,
            "engine_reported_mfu": rep_mfu,
            "times": times,
            "transport": transport,
        },
    )
