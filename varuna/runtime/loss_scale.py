"""Dynamic loss scaling for fp16, with the overflow decision agreed by every stage and replica.

torch's ``GradScaler`` decides per process; in a pipeline the gradients of one step live on P×D
processes, so the engine all-reduces an overflow flag and every process calls :meth:`update`
with the same answer (the scale therefore stays identical everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DynamicLossScale"]


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
