"""The rows of the prepared GPU check (``scripts/gpu_check.sh``, issue 31; docs/gpu.md).

Each row is a function ``row(device) -> RowResult`` run in its own process by
``scripts/gpu_check.py`` (a hung row fails alone); :data:`ROWS` lists them with their names and
time limits in seconds (on a GPU, on the CPU of a CI machine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    number: int
    name: str
    run: Callable[[str], object]
    timeout_cuda_s: float
    timeout_cpu_s: float

    def timeout_s(self, device: str) -> float:
        return self.timeout_cuda_s if device == "cuda" else self.timeout_cpu_s


def _rows() -> dict[int, Row]:
    from gpu_rows.ckpt_row import row_checkpoint
    from gpu_rows.gpt_rows import row_gpt, row_overhead
    from gpu_rows.hf_row import row_llama
    from gpu_rows.multi import row_meta, row_pipe
    from gpu_rows.profile_row import row_profile
    from gpu_rows.unit_row import row_unit

    rows = [
        Row(1, "GPT example 1×1, bf16: default and deterministic vs a plain PyTorch loop", row_gpt,
            120, 240),
        Row(2, "step-time overhead of the engine 1×1 vs the plain loop, bf16, TFLOP/s and MFU", row_overhead,
            150, 300),
        Row(3, "HF Llama from config 1×1 (default use_cache, SDPA) vs the plain loop", row_llama, 120, 240),
        Row(4, "P=2 on one device (two processes) vs 1×1: deterministic bit-identical", row_pipe, 180, 420),
        Row(5, "model built on meta, P=2: each stage materialised on the device, peak memory vs share",
            row_meta, 150, 300),
        Row(6, "checkpoint saved on the device, resumed on CPU and back: bit-identical", row_checkpoint,
            120, 300),
        Row(7, "varuna-profile on the device (allocator-peak memory, FLOPs per example)", row_profile,
            240, 420),
        Row(8, "CUDA-only unit tests of the audit (tests/test_cuda.py; a skip fails on a GPU)", row_unit,
            120, 180),
    ]
    return {r.number: r for r in rows}


def rows() -> dict[int, Row]:
    """Every row by number (imports each row's module: nothing heavy until a row runs)."""
    return _rows()
