"""Worker of tests/test_flops.py: a two-layer MLP with one CutPoint trained under the engine at the
world's P (D=1); prints one JSON line per step with the ``StepResult``'s FLOP fields."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import varuna  # noqa: E402

IN, HID, OUT, M, m = 8, 16, 4, 8, 2


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(IN, HID), nn.Linear(HID, OUT)
        self.cut = varuna.CutPoint()

    def forward(self, x, y):
        return F.mse_loss(self.b(self.cut(torch.relu(self.a(x)))), y)


def main() -> int:
    P = int(sys.argv[1])
    torch.manual_seed(0)
    batch = (torch.randn(M, IN), torch.randn(M, OUT))
    eng = varuna.Engine(MLP(), varuna.VarunaConfig(global_batch_size=M, micro_batch_size=m, pipeline_depth=P,
                                                   pipeline=varuna.PipelineConfig(
                                                       stage_ranges=[(0, 0), (1, 1)] if P == 2 else None),
                                                   metrics=varuna.MetricsConfig(peak_tflops=2.0),
                                                   stop_signals=()),
                        example_batch=batch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    try:
        for _ in range(2):
            r = eng.train_step(batch)
            print(json.dumps({"rank": eng.layout.rank, "model_flops": r.model_flops, "tflops": r.tflops,
                              "hardware_tflops": r.hardware_tflops, "mfu": r.mfu, "step_s": r.step_s,
                              "world": eng.layout.world}), flush=True)
    finally:
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
