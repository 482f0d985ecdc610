"""varuna: pipeline + data-parallel training of large models on cheap, preemptible VMs.

Exports are lazy so that ``import varuna.core.schedule`` (used by the simulator) never imports torch.

    >>> import varuna
    >>> varuna.CutPoint  # doctest: +SKIP
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CutPoint": "varuna.cutting.cutpoint",
    "Engine": "varuna.runtime.engine",
    "VarunaConfig": "varuna.runtime.config",
    "StepResult": "varuna.runtime.config",
    # VarunaConfig's groups (varuna/runtime/config_groups.py)
    "PipelineConfig": "varuna.runtime.config_groups",
    "CuttingConfig": "varuna.runtime.config_groups",
    "CheckpointConfig": "varuna.runtime.config_groups",
    "DeterminismConfig": "varuna.runtime.config_groups",
    "TimeoutConfig": "varuna.runtime.config_groups",
    "NumericsConfig": "varuna.runtime.config_groups",
    "MetricsConfig": "varuna.runtime.config_groups",
    "OptimizerStateConfig": "varuna.runtime.config_groups",
    "balanced_partition": "varuna.core.partition",
    "auto_cutpoints": "varuna.cutting.autocut",
    "apply_cutpoints": "varuna.cutting.routing",
    "keyed_seed": "varuna.cutting.split",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'varuna' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)


def __dir__() -> list[str]:
    return __all__
