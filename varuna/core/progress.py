"""Progress bars for the long waits of the interactive front-ends (tqdm, the ``progress`` extra).

A bar is drawn on stderr only where someone watches it: when stderr is a terminal, the command
was not given ``--quiet`` and ``VARUNA_QUIET`` is not set (:func:`progress_wanted`). Everywhere
else (logs, pipes, CI, worker processes whose output the launcher relays) and without tqdm
installed, :class:`Progress` is a silent no-op: the core never needs the extra.

Example::

    >>> with Progress("auto-config", total=3, unit="config", enabled=False) as bar:
    ...     for _ in range(3):
    ...         bar.update()
    >>> bar.n
    3
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from typing import IO, Any

__all__ = ["Progress", "progress_wanted", "QUIET_VAR"]

#: Set (to anything but "", "0", "false", "no") to silence every bar, e.g. in scripts.
QUIET_VAR = "VARUNA_QUIET"


def progress_wanted(
    quiet: bool = False, stream: IO[str] | None = None, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether a bar should be drawn on ``stream`` (default ``sys.stderr``): a terminal, no
    ``--quiet`` (``quiet``), no ``VARUNA_QUIET``.

    Example::

        >>> import io
        >>> progress_wanted(stream=io.StringIO())  # not a terminal
        False
    """
    env = os.environ if environ is None else environ
    if quiet or env.get(QUIET_VAR, "").strip().lower() not in ("", "0", "false", "no"):
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def _columns(stream: IO[str]) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


class Progress:
    """One progress bar: a context manager whose ``update``/``set_*`` may be called from any
    thread (a checkpoint's background copy). ``enabled``: None decides by
    :func:`progress_wanted`; False never draws (``--quiet``); True draws wherever ``file`` is.
    ``delay``: seconds before the bar first appears (short work then draws nothing);
    ``leave=False`` erases the bar when it closes.
    ``n`` counts even when nothing is drawn.

    Example::

        with Progress("copying", total=nbytes, unit="B", unit_scale=True) as bar:
            for chunk in chunks:
                bar.update(len(chunk))
    """

    def __init__(
        self,
        desc: str,
        total: float | None = None,
        *,
        unit: str = "it",
        enabled: bool | None = None,
        unit_scale: bool = False,
        leave: bool = True,
        delay: float = 0.0,
        file: IO[str] | None = None,
    ) -> None:
        self.n: float = 0
        self._lock = threading.Lock()
        self._bar: Any = None
        file = sys.stderr if file is None else file
        if not (progress_wanted(stream=file) if enabled is None else enabled):
            return
        try:
            from tqdm import tqdm  # the ``progress`` extra; imported only when a bar is drawn
        except ImportError:
            return
        self._bar = tqdm(
            desc=desc,
            total=total,
            unit=unit,
            unit_scale=unit_scale,
            leave=leave,
            delay=delay,
            file=file,
            # A terminal that reports no size (a bare pty: 0 columns) would get an empty bar.
            **({"dynamic_ncols": True} if _columns(file) > 0 else {"ncols": 80, "nrows": 24}),
        )

    @property
    def active(self) -> bool:
        """True while a bar is being drawn."""
        return self._bar is not None

    def update(self, n: float = 1) -> None:
        with self._lock:
            self.n += n
            if self._bar is not None:
                self._bar.update(n)

    def set_description(self, desc: str) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.set_description(desc)

    def set_postfix(self, text: str) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.set_postfix_str(text)

    def set_total(self, total: float) -> None:
        """Change the total (e.g. once it is known, or when work turned out unnecessary)."""
        with self._lock:
            if self._bar is not None:
                self._bar.total = total
                self._bar.refresh()

    def close(self) -> None:
        with self._lock:
            bar, self._bar = self._bar, None
            if bar is not None:
                bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
