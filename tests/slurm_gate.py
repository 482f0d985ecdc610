"""An engine plugin for tests/test_slurm.py (``VARUNA_ENGINE_PLUGINS=slurm_gate:attach``): in a run
that starts from scratch, rank 0 writes its pid to ``$VARUNA_TEST_GATE`` after step 2 and then
holds there until a graceful stop has been asked of it (its SIGUSR1 handler ran), at most
:data:`HOLD_S`. The whole job waits with it (the next step's collectives), so the test's
``scancel --signal=USR1`` always lands mid-training, and the job stops after step 3 — however fast
or slow the machine is. A resumed run (``engine.step_count`` > 0) is not held.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

GATE_STEP = 2
HOLD_S = 120.0


def attach(engine: Any) -> None:
    if engine.layout.rank != 0 or engine.step_count > 0:
        return
    gate = Path(os.environ["VARUNA_TEST_GATE"])

    def hold(result: Any) -> None:
        if result.step != GATE_STEP:
            return
        gate.write_text(str(os.getpid()))
        deadline = time.monotonic() + HOLD_S
        while not engine.stop_requested and time.monotonic() < deadline:
            time.sleep(0.05)  # polls the flag the signal handler sets (bounded)

    engine.add_step_callback(hold)
