"""The registry of checkpoint formats: a format declares its name and registers itself here.

The built-in formats are registered below (one line each); any other module registers its own with
:func:`register_format` when it is imported: by the training script, or by the engine from
``$VARUNA_CHECKPOINT_FORMAT_MODULES`` (comma-separated module names, for a script you do not
edit; the launcher passes every ``VARUNA_*`` variable to its workers). The format a run writes is
``VarunaConfig.checkpoint_format``, else ``$VARUNA_CHECKPOINT_FORMAT``, else ``"varuna"``; resume
looks for the newest complete checkpoint of *any* registered format (:func:`format_of`; Note
[Checkpoint formats] in checkpoint_format.py says why).

Example::

    >>> checkpoint_format("varuna").commit_file
    'manifest.json'
    >>> checkpoint_format("nope")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: unknown checkpoint format 'nope' (VarunaConfig.checkpoint_format / ...
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

from varuna.core.env import WorkerSettings
from varuna.runtime.checkpoint_dcp import DCPFormat
from varuna.runtime.checkpoint_format import CheckpointFormat
from varuna.runtime.checkpoint_hf import HFFormat
from varuna.runtime.checkpoint_manifest import ManifestFormat

__all__ = [
    "DEFAULT_FORMAT",
    "FORMAT_VAR",
    "MODULES_VAR",
    "checkpoint_format",
    "format_names",
    "format_of",
    "register_format",
    "registered_formats",
]

#: The format a run writes unless told otherwise.
DEFAULT_FORMAT = "varuna"
#: The environment variable naming the format to write (below ``VarunaConfig.checkpoint_format``).
FORMAT_VAR = "VARUNA_CHECKPOINT_FORMAT"
#: The environment variable listing modules to import: each registers its formats.
MODULES_VAR = "VARUNA_CHECKPOINT_FORMAT_MODULES"

F = TypeVar("F", bound=type[CheckpointFormat])

# The process's formats by name, in registration order (the built-ins first). A registry is the
# one mutable table here: a format module adds itself once, at import.
_FORMATS: dict[str, type[CheckpointFormat]] = {}


def register_format(cls: F) -> F:
    """Register a :class:`CheckpointFormat` subclass under its ``name`` (a class decorator).

    Registering another class under a taken name is an error (one line naming both); the same
    class again (its module imported twice) replaces it.

    Example::

        @register_format
        class MyFormat(CheckpointFormat):
            name, commit_file = "mine", "index.json"
            ...
    """
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or not isinstance(getattr(cls, "commit_file", None), str):
        raise ValueError(f"checkpoint format {cls.__qualname__}: set the class attributes name, commit_file")
    old = _FORMATS.get(name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(
            f"checkpoint format name {name!r} is taken by {old.__module__}.{old.__qualname__}; "
            f"give {cls.__module__}.{cls.__qualname__} another name"
        )
    _FORMATS[name] = cls
    return cls


def _import_listed(environ: Mapping[str, str] | None) -> None:
    """Import the modules of ``$VARUNA_CHECKPOINT_FORMAT_MODULES`` (each registers its formats)."""
    for module in WorkerSettings.from_env(environ).checkpoint_format_modules:
        if not module:
            continue
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"{MODULES_VAR}: cannot import {module!r}: {e}") from None


def format_names(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The registered formats' names, the built-ins first.

    >>> format_names()[0]
    'varuna'
    """
    _import_listed(environ)
    return tuple(_FORMATS)


def checkpoint_format(name: str | None = None, environ: Mapping[str, str] | None = None) -> CheckpointFormat:
    """The format named ``name`` (None: ``$VARUNA_CHECKPOINT_FORMAT``, else ``"varuna"``); an
    unknown name is one ``ValueError`` line naming the registered ones and how to add one."""
    names = format_names(environ)
    chosen = name or WorkerSettings.from_env(environ).checkpoint_format or DEFAULT_FORMAT
    cls = _FORMATS.get(chosen)
    if cls is None:
        raise ValueError(
            f"unknown checkpoint format {chosen!r} (VarunaConfig.checkpoints.format / ${FORMAT_VAR}); "
            f"registered: {', '.join(names)}; a format registers itself when its module is imported: "
            f"import it in the script or name the module in ${MODULES_VAR}"
        )
    return cls()


def registered_formats() -> list[CheckpointFormat]:
    """One instance of every registered format, the built-ins first."""
    return [_FORMATS[name]() for name in format_names()]


def format_of(path: str | Path) -> CheckpointFormat | None:
    """The registered format whose committed checkpoint ``path`` (a step directory) holds; None
    for an incomplete directory (no format's commit file). The first registered wins.

    >>> format_of("/nonexistent") is None
    True
    """
    path = Path(path)
    return next((fmt for fmt in registered_formats() if fmt.is_complete(path)), None)


# The built-in formats: adding one is its module plus one line here.
register_format(ManifestFormat)
register_format(HFFormat)
register_format(DCPFormat)
