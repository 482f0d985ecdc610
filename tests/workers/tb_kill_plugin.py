"""Engine plugin for tests/test_tensorboard.py: SIGKILL this process from inside step 3, after the
engine's own step callbacks (the TensorBoard log, registered before plugins run) have seen it."""

from __future__ import annotations

import os
import signal

KILL_AT_STEP = 3


def attach(engine) -> None:
    def kill(result) -> None:
        if result.step == KILL_AT_STEP:
            os.kill(os.getpid(), signal.SIGKILL)

    engine.add_step_callback(kill)
