"""The profiler: measures a model's primitive costs into a calibration file (``docs/profiling.md``).

``profiler.calibrate(model_spec, micro_batch_sizes, out=...)`` is the Python API of ``varuna-profile``
(:func:`profiler.runner.calibrate`). Exports resolve lazily: ``import profiler.spec`` or
``profiler.hosts`` does not import torch.

Example::

    import profiler
    cal = profiler.calibrate("examples/gpt2/profile_target.py:build", [1, 2, 4], out="calib.json")
"""

from __future__ import annotations

from typing import Any

__all__ = ["calibrate", "ProfileOptions", "measure_allreduce"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from profiler import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'profiler' has no attribute {name!r}")
