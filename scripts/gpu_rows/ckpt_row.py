"""Row 6 of the GPU check: a checkpoint written on the GPU, resumed on the CPU, written again there
and resumed on the GPU: the state (parameters and AdamW's moments) is bit-identical at every hop,
and the GPU run that resumed trains the same steps as the run that never stopped, bit for bit
(deterministic mode, same kernels: the hops must not change a bit)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from gpu_rows.common import FAIL, PASS, RowResult, gpt_batches, gpt_model, log, sizes, state_digests
from gpu_rows.gpt_rows import build_engine


def _engine(z: dict[str, Any], device: str, batches: list, **config: Any):
    import varuna

    return build_engine(
        gpt_model(z, dropout=0.1), z, device, batches[0], precision="fp32",
        determinism=varuna.DeterminismConfig(enabled=True), **config
    )


def row_checkpoint(device: str) -> RowResult:
    z = sizes(device, "ckpt")
    steps, save_at = z["steps"], z["steps"] // 2
    batches = gpt_batches(z, steps)
    import varuna

    with tempfile.TemporaryDirectory(prefix="gpu-check-ckpt-") as tmp:
        first, second = Path(tmp) / "from_device", Path(tmp) / "from_cpu"
        log(f"run A on {device}: {steps} steps, checkpoint after step {save_at}")
        eng = _engine(z, device, batches)
        try:
            losses_a = []
            for i, b in enumerate(batches, 1):
                losses_a.append(eng.train_step(b).loss)
                if i == save_at:
                    eng.save_checkpoint(first, wait=True)
                    at_save = state_digests(eng.state_dict())
            final_a = state_digests(eng.state_dict())
            device_of_a = str(next(iter(eng.parameters())).device)
        finally:
            eng.close()
        log("run B on cpu: resume that checkpoint, write it again")
        eng = _engine(z, "cpu", batches, checkpoints=varuna.CheckpointConfig(dir=str(first), resume="1"))
        try:
            loaded_b = state_digests(eng.state_dict())
            step_b = eng.step_count
            eng.save_checkpoint(second, wait=True)
        finally:
            eng.close()
        log(f"run C on {device}: resume the cpu's checkpoint, train steps {save_at + 1}..{steps}")
        eng = _engine(z, device, batches, checkpoints=varuna.CheckpointConfig(dir=str(second), resume="1"))
        try:
            loaded_c = state_digests(eng.state_dict())
            losses_c = [eng.train_step(b).loss for b in batches[save_at:]]
            final_c = state_digests(eng.state_dict())
        finally:
            eng.close()
    hops = {
        "device->cpu": loaded_b == at_save,
        "cpu->device": loaded_c == at_save,
        "continued losses": losses_c == losses_a[save_at:],
        "final state": final_c == final_a,
    }
    ok = all(hops.values()) and step_b == save_at and device_of_a.startswith(device) and len(at_save) > 0
    summary = (
        f"{len(at_save)} tensors (weights + AdamW state), saved on {device_of_a} at step {save_at}: "
        + ", ".join(f"{k} {'bit-identical' if v else 'DIFFERENT'}" for k, v in hops.items())
    )
    return RowResult(
        PASS if ok else FAIL,
        summary,
        {
            "hops": hops,
            "tensors": len(at_save),
            "losses_a": losses_a,
            "losses_c": losses_c,
            "resumed_step": step_b,
        },
    )
