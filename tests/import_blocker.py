"""Run Python as if the optional dependencies were not installed, for the light-install tests.

:func:`blocker_env` writes a ``sitecustomize.py`` (Python runs it at start-up, before any user
code) into a directory put first on ``PYTHONPATH``. It wraps every meta-path finder so that a
blocked module is *not found*, exactly as when it is absent: ``import grpc`` raises
``ModuleNotFoundError`` and ``importlib.util.find_spec("tqdm")`` returns None (torch probes some
of these with ``find_spec``; a finder that raised instead would break torch, not varuna).
Subprocesses inherit the environment, so every worker of a launched job is blocked too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: What the core install (torch + numpy) does not have: every extra's top-level modules.
BLOCKED = (
    "grpc",
    "grpc_tools",
    "google.protobuf",
    "azure",
    "boto3",
    "botocore",
    "transformers",
    "scipy",
    "matplotlib",
    "tqdm",
    "tensorboard",
    "aiohttp",
    "plotly",
)

_SITECUSTOMIZE = '''\
"""Written by tests/import_blocker.py: these modules are not found, as if not installed."""
import sys

_BLOCKED = {blocked!r}


def _blocked(name):
    return any(name == b or name.startswith(b + ".") for b in _BLOCKED)


class _Hide:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, fullname, path=None, target=None):
        if _blocked(fullname):
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(fullname, path, target) if find is not None else None

    def invalidate_caches(self):
        inv = getattr(self.finder, "invalidate_caches", None)
        if inv is not None:
            inv()


sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
'''


def blocker_env(
    directory: Path, blocked: Sequence[str] = BLOCKED, *, base: dict | None = None
) -> dict[str, str]:
    """The environment (``base``, default ``os.environ``) with ``blocked`` hidden from Python and
    this checkout first on ``PYTHONPATH``; the ``sitecustomize.py`` goes into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(blocked=tuple(blocked)))
    env = dict(os.environ if base is None else base)
    paths = (str(directory), str(ROOT), env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env
