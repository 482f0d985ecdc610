"""A setting a run cannot start with, answered in one line (Note [One-line refusals]).

Note [One-line refusals]
~~~~~~~~~~~~~~~~~~~~~~~~
Configuration errors that only a worker can find (the model at hand: a pipeline depth beyond its
segments, no CutPoint, a ``--cut-after`` pattern matching nothing; the checkpoint directory: no
complete checkpoint for ``--resume 1``, a checkpoint refused) raise :class:`ConfigError`, a
``ValueError`` whose message is one line naming the setting and the fix. Uncaught in a worker,
:func:`install_excepthook` (the engine installs it) prints that line as ``varuna: error: ...``,
without a traceback, and ends the process with :data:`CONFIG_EXIT_CODE` at once (``os._exit``:
no finaliser may wait on the peers' groups and abort the process). ``varuna-launch`` does not
show such a line from each rank: it stops the others, quiets their output and ends with one line
quoting the rank that found it (exit 2, bad usage; no restart, which would find it again).

Example::

    >>> str(ConfigError("pipeline depth 3 exceeds the 2 segments ...; use --pipeline-depth <= 2"))
    'pipeline depth 3 exceeds the 2 segments ...; use --pipeline-depth <= 2'
"""

from __future__ import annotations

import os
import sys
from types import TracebackType

__all__ = ["CONFIG_EXIT_CODE", "ERROR_PREFIX", "ConfigError", "install_excepthook"]

#: A worker's exit code for a :class:`ConfigError` (``EX_CONFIG`` of sysexits.h).
CONFIG_EXIT_CODE = 78
#: How the line starts (the launcher recognises it).
ERROR_PREFIX = "varuna: error: "


class ConfigError(ValueError):
    """A setting the run cannot start with; the message is one line naming it and the fix."""


def install_excepthook() -> None:
    """Print an uncaught :class:`ConfigError` as one line and exit :data:`CONFIG_EXIT_CODE`;
    anything else goes to the hook that was there. Installing twice is a no-op.

    Example::

        install_excepthook()
        raise ConfigError("--resume 1 but ckpt/ holds no checkpoint; drop --resume")
    """
    if getattr(sys.excepthook, "_varuna_one_line", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(exc, ConfigError):
            previous(kind, exc, tb)
            return
        text = " ".join(str(exc).split("\n")) or type(exc).__name__
        try:
            sys.stdout.flush()
            # Straight to descriptor 2: a hook installed later (torch.distributed's, which prefixes
            # "[rankN]: ") calls this one with sys.stderr pointed at a buffer it prints afterwards.
            os.write(2, f"{ERROR_PREFIX}{text}\n".encode(errors="replace"))
        finally:
            os._exit(CONFIG_EXIT_CODE)

    hook._varuna_one_line = True  # type: ignore[attr-defined]
    sys.excepthook = hook
