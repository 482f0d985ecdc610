"""Dynamic loss scaling for fp16, with the overflow decision agreed by every stage and replica.

torch's ``GradScaler`` decides per process; in a pipeline the gradients of one step live on P×D
processes, so the engine all-reduces an overflow flag and every process calls :meth:`update`
with the same answer (the scale therefore stays identical everywhere).
"""

from __future__ import annotations

import math
import socket
import sys
from dataclasses import dataclass, field

__all__ = ["DynamicLossScale", "NonFiniteLossStop", "NonFiniteLosses"]


@dataclass(kw_only=True)
class DynamicLossScale:
    """Multiply the loss by ``scale``; halve it on overflow, double it after ``growth_interval``
    clean steps.

    >>> s = DynamicLossScale(scale=8.0, growth_interval=2)
    >>> s.update(found_inf=True); s.scale
    4.0
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    good_steps: int = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.good_steps = float(sd["scale"]), int(sd["good_steps"])


class NonFiniteLossStop(SystemExit):
    """Raised on every rank (the loss is agreed) after ``max_nonfinite_steps`` NaN/Inf losses in a
    row. A ``SystemExit``: uncaught, the process prints its one line and exits 1 (no traceback)."""


@dataclass
class NonFiniteLosses:
    """The NaN/Inf loss policy: such a step is skipped (varuna/runtime/grad_sync.py), rank 0 warns
    in one line, and ``limit`` in a row (0: never) stop the run.

    >>> policy = NonFiniteLosses(limit=2, rank=1, host="h")
    >>> policy.observe(4, float("nan")) is None
    True
    >>> policy.observe(5, float("inf"))  # doctest: +ELLIPSIS
    'varuna: rank 1 (host h): the loss was inf in 2 steps in a row (steps 4-5); stopping: ...'
    """

    limit: int
    rank: int
    host: str = field(default_factory=socket.gethostname)
    run: list[int] = field(default_factory=list)
    """Steps in the current run of non-finite losses."""

    def observe(self, step: int, loss: float) -> str | None:
        """Record ``step``'s agreed loss; the line to stop with, or None to go on."""
        if math.isfinite(loss):
            self.run.clear()
            return None
        self.run.append(step)
        n = len(self.run)
        if self.limit and n >= self.limit:
            return (
                f"varuna: rank {self.rank} (host {self.host}): the loss was {loss} in {n} steps in a row "
                f"(steps {self.run[0]}-{step}); stopping: check the data and the learning rate, or "
                "raise VarunaConfig.max_nonfinite_steps (0: never stop)"
            )
        if self.rank == 0:
            print(
                f"varuna: step {step}: loss is {loss}; step skipped ({n} in a row; stopping at "
                f"{self.limit or 'never'}, VarunaConfig.max_nonfinite_steps)",
                file=sys.stderr,
                flush=True,
            )
        return None
