"""Engine plugins: callables that get every engine once it is built (``$VARUNA_ENGINE_PLUGINS``).

A plugin extends a run without editing the training script, through the engine's public hooks
(``add_step_callback``, ``add_stop_callback``, ``checkpointer``). The variable holds a comma
separated list of ``module:function``; each function is imported and called with the engine, in
order, at the end of ``Engine.__init__`` (after a resume, so ``engine.step_count`` is the step it
resumed from). The manager's worker shim uses it to attach its heartbeat reporter. A bad entry is
one ``ValueError`` line naming it.

Example::

    VARUNA_ENGINE_PLUGINS=mypkg.metrics:attach varuna-launch --procs 2 train.py

    # mypkg/metrics.py
    def attach(engine):
        engine.add_step_callback(lambda r: print(r.step, r.loss, r.timings.fwd_s))
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from varuna.core.env import WorkerSettings

__all__ = ["PLUGINS_VAR", "load_plugins", "run_plugins"]

#: The environment variable listing the plugins.
PLUGINS_VAR = "VARUNA_ENGINE_PLUGINS"


def load_plugins(spec: str) -> list[Callable[[Any], None]]:
    """Import the ``module:function`` entries of ``spec`` (comma separated; blanks ignored).

    Example::

        >>> [f.__name__ for f in load_plugins("os.path:basename, os.path:dirname")]
        ['basename', 'dirname']
    """
    plugins = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        module_name, sep, attr = entry.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(f"{PLUGINS_VAR}: bad entry {entry!r}: expected module:function")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(
                f"{PLUGINS_VAR}: cannot import {module_name!r} for entry {entry!r}: {e}"
            ) from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ValueError(f"{PLUGINS_VAR}: {module_name} has no function {attr!r} (entry {entry!r})")
        plugins.append(fn)
    return plugins


def run_plugins(engine: Any, plugins: str | Mapping[str, str] | None = None) -> None:
    """Call every plugin named in ``plugins`` (the ``VARUNA_ENGINE_PLUGINS`` value, as the engine
    passes it from ``varuna.core.env.WorkerSettings``; or an environment, default ``os.environ``,
    to read it from) with ``engine``.

    Example::

        run_plugins(engine, "mypkg.metrics:attach")
        run_plugins(engine, {"VARUNA_ENGINE_PLUGINS": "mypkg.metrics:attach"})
    """
    spec = plugins if isinstance(plugins, str) else WorkerSettings.from_env(plugins).engine_plugins
    for fn in load_plugins(spec):
        fn(engine)
