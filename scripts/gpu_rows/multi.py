"""Rows 4 and 5 of the GPU check, several processes on the one device, and their worker.

(4) P=2 on one GPU against 1×1: NCCL refuses two ranks on one device ("Duplicate GPU detected"),
so the engine carries the job on gloo (``VarunaConfig.comm_backend``: chosen automatically when
processes share a GPU), activations and gradients staged through pinned host memory (gloo's
send/recv cannot take CUDA tensors), all-reduces through gloo's CUDA support. Deterministic mode
must give the 1×1 weights bit for bit; the default mode, the same losses within bf16 tolerance.

(5) The GPT example built on ``meta`` at a size whose training state is ~13 GB, P=2: each process
materialises only its stage on the GPU; its peak CUDA memory (the allocator's) against its share.

The worker is ``scripts/gpu_check.py --worker {pipe,meta}``, started as ranks on 127.0.0.1 by
``varuna.testing.emulated.run_local_world``; each writes ``rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from gpu_rows.common import (
    FAIL,
    LOSS_RTOL,
    PASS,
    ROOT,
    RowResult,
    gpt_batches,
    gpt_model,
    log,
    max_rel_diff,
    sizes,
    tensor_digest,
)
from gpu_rows.gpt_rows import build_engine

#: A stage's peak memory may exceed its ideal share (training state + activations, the estimate
#: of scripts/bench_too_big.py) by this factor: AdamW's foreach step holds one more parameter-sized
#: temporary (sqrt of the second moment), and the allocator rounds blocks.
SHARE_FACTOR = 1.5
#: ... and must stay below this fraction of the whole model's training state (it did not build it all).
WHOLE_FRACTION = 0.75


def _world(kind: str, device: str, world: int, work: Path, timeout_s: float) -> list[dict]:
    from varuna.testing.emulated import run_local_world

    out = work / f"{kind}-{world}"
    out.mkdir(parents=True, exist_ok=True)
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # what varuna-launch and torchrun tell each worker
    try:
        return run_local_world(
            str(ROOT / "scripts" / "gpu_check.py"),
            ["--worker", kind, "--device", device, "--worker-out", str(out)],
            world,
            out,
            timeout_s,
            what=f"{kind} P={world}",
        )
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)


def row_pipe(device: str) -> RowResult:
    with tempfile.TemporaryDirectory(prefix="gpu-check-pipe-") as tmp:
        log("1x1 reference (default mode, then deterministic)")
        single = _world("pipe", device, 1, Path(tmp), 240)[0]
        log("P=2: two processes on the one device")
        ranks = _world("pipe", device, 2, Path(tmp), 240)
    det_losses_equal = all(r["det"]["losses"] == single["det"]["losses"] for r in ranks)
    joined = {n: d for r in ranks for n, d in r["det"]["digests"].items()}
    det_weights_equal = joined == single["det"]["digests"]
    default_diff = max(max_rel_diff(r["default"]["losses"], single["default"]["losses"]) for r in ranks)
    transport = ranks[0]["default"]["transport"]
    gloo_ok = device != "cuda" or transport.startswith("gloo")
    stages = [r["default"]["stage_ranges"] for r in ranks]
    ok = det_losses_equal and det_weights_equal and default_diff <= LOSS_RTOL and gloo_ok
    summary = (
        f"P=2 on {ranks[0]['default']['device']} (stages {stages[0]}) over {transport}: deterministic "
        f"losses {'bit-identical' if det_losses_equal else 'DIFFERENT'} and weights "
        f"{'bit-identical' if det_weights_equal else 'DIFFERENT'} to 1x1; default max rel. loss diff "
        f"{default_diff:.1e} (tol {LOSS_RTOL:g})"
    )
    return RowResult(
        PASS if ok else FAIL,
        summary,
        {
            "single": single,
            "ranks": ranks,
            "det_losses_equal": det_losses_equal,
            "det_weights_equal": det_weights_equal,
            "default_max_rel_diff": default_diff,
            "transport": transport,
        },
    )


def _stage_share(z: dict[str, Any], rank: dict) -> dict:
    from bench_too_big import Setup, ideal_share, model_summary

    s = Setup(
        n_layer=z["n_layer"],
        n_embd=z["n_embd"],
        n_head=z["n_head"],
        block_size=z["block_size"],
        global_batch_size=z["M"],
        micro_batch_size=z["m"],
    )
    summary = model_summary(s)
    share = ideal_share(rank["params"], rank["blocks"], rank["last_stage"], s, summary)
    return {"share": share["total"], "whole_state": summary["state_bytes"], "whole_params": summary["params"]}


def row_meta(device: str) -> RowResult:
    z = sizes(device, "meta")
    with tempfile.TemporaryDirectory(prefix="gpu-check-meta-") as tmp:
        log(f"GPT n_layer={z['n_layer']} n_embd={z['n_embd']} on meta, P=2: each rank materialises its stage")
        ranks = _world("meta", device, 2, Path(tmp), 300)
    rows, ok = [], True
    for r in ranks:
        share = _stage_share(z, r)
        peak = r["peak_cuda_bytes"]
        own = r["resident_param_bytes"] <= r["param_bytes"] * 1.01 + (1 << 20)
        if peak is not None:  # CUDA: the allocator's peak over materialisation and training
            fits = peak <= SHARE_FACTOR * share["share"] and peak < WHOLE_FRACTION * share["whole_state"]
            what = (f"peak {peak / 2**30:.2f} GiB = {peak / share['share']:.2f}x its share "
                    f"{share['share'] / 2**30:.2f} GiB")
        else:  # CPU: no allocator peak; the resident parameters must be the stage's only
            fits, what = (
                True,
                f"resident params {r['resident_param_bytes'] / 2**20:.1f} MiB (no allocator peak on CPU)",
            )
        ok = (
            ok
            and fits
            and own
            and r["params"] < share["whole_params"]
            and all(d.startswith(device) for d in r["param_devices"])
        )
        rows.append(f"stage {r['stage']} ({r['params'] / 1e6:.3g}M params): {what}")
        r.update(share)
    whole = ranks[0]["whole_state"]
    summary = (
        f"whole model {ranks[0]['whole_params'] / 1e6:.3g}M params, state {whole / 2**30:.1f} GiB; "
        + "; ".join(rows)
        + f" (limit {SHARE_FACTOR}x share, < {WHOLE_FRACTION:.0%} of the whole)"
    )
    return RowResult(PASS if ok else FAIL, summary, {"ranks": ranks, "share_factor": SHARE_FACTOR})


# ---------------------------------------------------------------------------------------------
# The worker (one rank)


def _worker_pipe(device: str, z: dict[str, Any]) -> dict:
    import torch.distributed as dist

    import varuna
    from varuna.runtime.layout import init_distributed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    _, owns = init_distributed(world, 1, device=device, timeout_s=180.0)  # one group, two engines
    batches = gpt_batches(z, z["steps"])
    out: dict[str, Any] = {}
    try:
        for mode, det in (("default", False), ("det", True)):  # deterministic kernels stay on after
            eng = build_engine(
                gpt_model(z, dropout=0.1),
                z,
                device,
                batches[0],
                pipeline_depth=world,
                determinism=varuna.DeterminismConfig(enabled=det),
                timeouts=varuna.TimeoutConfig(comm_s=180.0, peer_s=60.0),
            )
            try:
                out[mode] = {
                    "losses": [eng.train_step(b).loss for b in batches],
                    "digests": {n: tensor_digest(p) for n, p in eng.named_parameters()},
                    "transport": eng.transport.description,
                    "device": str(eng.device),
                    "stage_ranges": eng.stage_ranges,
                }
            finally:
                eng.close()
    finally:
        if owns and dist.is_initialized():
            dist.destroy_process_group()
    return out


def _worker_meta(device: str, z: dict[str, Any]) -> dict:
    import torch

    import varuna
    from varuna.cutting.split import resident_param_bytes

    cuda = device == "cuda" and torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    batches = gpt_batches(z, z["steps"])
    cfg = varuna.VarunaConfig(
        global_batch_size=z["M"],
        micro_batch_size=z["m"],
        pipeline_depth=world,
        device=device,
        stop_signals=(),
        timeouts=varuna.TimeoutConfig(comm_s=180.0, peer_s=60.0),
    )
    eng = varuna.Engine(
        gpt_model(z, dropout=0.1, meta=True),
        cfg,
        example_batch=batches[0],
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4, eps=1e-6),
    )
    try:
        losses = [eng.train_step(b).loss for b in batches]
        params = list(eng.stage_params.values())
        out = {
            "losses": losses,
            "params": sum(p.numel() for p in params),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "resident_param_bytes": resident_param_bytes(eng.model),
            "blocks": sum(
                1 for n in eng.stage_params if n.startswith("blocks.") and n.endswith("ln1.weight")
            ),
            "last_stage": eng.is_last_stage,
            "param_devices": sorted({str(p.device) for p in params}),
            "peak_cuda_bytes": torch.cuda.max_memory_allocated(eng.device) if cuda else None,
            "transport": eng.transport.description,
        }
    finally:
        eng.close()
    return out


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="one rank of a GPU-check row")
    p.add_argument("--worker", choices=["pipe", "meta"], required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--worker-out", type=Path, required=True)
    a = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    z = sizes(a.device, "pipe" if a.worker == "pipe" else "meta")
    out = _worker_pipe(a.device, z) if a.worker == "pipe" else _worker_meta(a.device, z)
    out.update(rank=rank, stage=rank)
    (a.worker_out / f"rank{rank}.json").write_text(json.dumps(out))
    return 0
