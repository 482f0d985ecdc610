"""Optional dependencies: which extra of ``pyproject.toml`` provides a module, and the one line
that names the ``pip install`` when a feature is used without it.

The core (runtime, simulator, profiler, launcher) needs torch and numpy only. Everything else is
an extra, imported where it is used through :func:`require` (one module) or
:func:`require_extra` (several at once), so a light install reports what is missing in one line
instead of a traceback from deep inside an import::

    >>> str(MissingExtra("varuna-manager", "manager", ["grpc", "protobuf"]))
    "varuna-manager needs the manager extra (grpc, protobuf): pip install 'varuna[manager]'"

A command line catches :class:`MissingExtra` (an ``ImportError``) and prints it as its one error
line, exit status 2, like any other bad usage.

A cloud provider's extra (``azure``) is not listed here: the provider declares it in the manager's
provider registry (``manager.providers.registry``, ``ProviderExtra``), which checks it with
:func:`require_packages`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtra", "require", "require_extra", "require_packages"]

#: Per extra of ``pyproject.toml``'s ``[project.optional-dependencies]``: the modules it provides,
#: each with the name a person knows it by (the distribution: ``grpc`` is grpcio's module).
EXTRAS: dict[str, dict[str, str]] = {
    "manager": {"grpc": "grpc", "google.protobuf": "protobuf", "scipy": "scipy"},
    "hf": {"transformers": "transformers"},
    "safetensors": {"safetensors": "safetensors"},
    "data": {"torchdata": "torchdata"},
    "plot": {"matplotlib": "matplotlib"},
    "progress": {"tqdm": "tqdm"},
    "tensorboard": {"tensorboard": "tensorboard"},
    "dashboard": {"aiohttp": "aiohttp", "plotly": "plotly"},
}


class MissingExtra(ImportError):
    """``what`` was used without the extra that provides ``packages``; the message is one line
    naming the ``pip install`` that fixes it."""

    def __init__(self, what: str, extra: str, packages: Sequence[str]) -> None:
        self.what, self.extra, self.packages = what, extra, tuple(packages)
        super().__init__(
            f"{what} needs the {extra} extra ({', '.join(self.packages)}): pip install 'varuna[{extra}]'"
        )


def _modules_of(extra: str) -> dict[str, str]:
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; one of {', '.join(EXTRAS)}")
    return EXTRAS[extra]


def _missing(module: str) -> bool:
    """True when importing ``module`` fails because it (or a package holding it) is not installed."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if not _is_missing(e, module):
            raise
        return True
    return False


def _is_missing(exc: ModuleNotFoundError, module: str) -> bool:
    """True when ``exc`` says ``module`` itself (or a package holding it) is not installed.

    A module missing *inside* an installed extra (a broken install, a bug) is not this case: its
    own error is the useful one."""
    missing = exc.name or ""
    return bool(missing) and (module == missing or module.startswith(missing + "."))


def _package_of(module: str, extra: str) -> str:
    modules = _modules_of(extra)
    for m, package in modules.items():
        if module == m or module.startswith(m + "."):
            return package
    raise ValueError(
        f"{module!r} is not a module of the {extra} extra ({', '.join(modules.values())}); "
        "see varuna.core.extras.EXTRAS"
    )


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` (one of ``extra``'s, see :data:`EXTRAS`) for ``what``; raise
    :class:`MissingExtra` when it is not installed.

    Example::

        linprog = require("scipy.optimize", "manager", "pool allocation").linprog
    """
    package = _package_of(module, extra)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if not _is_missing(e, module):
            raise
        raise MissingExtra(what, extra, [package]) from None


def require_extra(extra: str, what: str, modules: Sequence[str] | None = None) -> None:
    """Import ``modules`` of ``extra`` (default: all of them) for ``what``, and raise one
    :class:`MissingExtra` naming every one that is not installed.

    Example::

        require_extra("manager", "varuna-manager", ["grpc", "google.protobuf"])
    """
    missing = []
    for module in _modules_of(extra) if modules is None else modules:
        try:
            require(module, extra, what)
        except MissingExtra:
            missing.append(_package_of(module, extra))
    if missing:
        raise MissingExtra(what, extra, missing)


def require_packages(extra: str, what: str, packages: Mapping[str, str]) -> None:
    """:func:`require_extra` for an extra declared elsewhere than :data:`EXTRAS` (a provider's, in
    its registry entry): ``packages`` maps each module to the distribution a person knows it by.

    Example::

        require_packages("azure", "the azure provider", {"azure.identity": "azure-identity"})
    """
    missing = [package for module, package in packages.items() if _missing(module)]
    if missing:
        raise MissingExtra(what, extra, missing)
