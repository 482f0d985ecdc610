"""The provider registry: the one place where a provider declares what the rest of the manager
asks about it (Note [Provider registry]).

A provider is one module that registers its class::

    @register_provider(
        name="local",
        options=LocalProviderOptions,          # from_dict(provider_options); ValueError: one line
        type_options=("max_created",),         # what a [[vm_types]] table may set per type
        notice_source=SCHEDULED_EVENTS,        # "module:Class" the agent polls for eviction notices
        check_job=check_local_capacity,        # optional: refuse a job spec this provider cannot run
    )
    class LocalProvider: ...                   # LocalProvider(options, context): the Provider

and builds its agents' command line with :func:`manager.providers.agent_start.agent_argv`.

Note [Provider registry]: job specs (known names, per-type options, a provider's own checks), the
daemon's submit-time validation (options, the extra), provider construction and the agents'
notice source all read the entry; nothing else names a provider. The built-in providers are
imported on the first lookup; more come from modules named in ``$VARUNA_PROVIDER_MODULES``
(comma-separated, imported by every process that looks a provider up: the daemon and the CLI
inherit it) and from the ``varuna.providers`` entry-point group of installed packages. Adding a
provider is therefore one new module plus its registration (docs/manager.md, "Adding a
provider").

    >>> provider_entry("local").type_options
    ('max_created',)
    >>> provider_entry("gcp")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown provider 'gcp'; use one of local, azure...
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from manager.providers.base import Provider, ProviderContext
from varuna.core.extras import require_packages

__all__ = [
    "ENTRY_POINT_GROUP",
    "PROVIDER_MODULES_ENV",
    "JobShape",
    "ProviderEntry",
    "ProviderExtra",
    "make_provider",
    "provider_entry",
    "provider_names",
    "register_provider",
]

#: Modules (comma-separated) imported before the first lookup; each registers its provider(s).
PROVIDER_MODULES_ENV = "VARUNA_PROVIDER_MODULES"
#: Entry-point group of installed packages that bring a provider (``module:object``; loading it
#: imports the module, which registers).
ENTRY_POINT_GROUP = "varuna.providers"
#: The providers that ship with varuna.
BUILTIN_MODULES = ("manager.providers.local", "manager.providers.azure", "manager.providers.kubernetes",
                   "manager.providers.aws")


@dataclass(frozen=True, kw_only=True)
class ProviderExtra:
    """The ``pyproject.toml`` extra a provider's code needs on the manager's host."""

    name: str
    """The extra: ``pip install 'varuna[name]'``."""
    packages: Mapping[str, str]
    """Module → the distribution a person knows it by (``azure.identity`` → ``azure-identity``)."""
    what: str
    """How the one-line error names the feature, e.g. "the azure provider (on the manager's host)"."""

    def require(self) -> None:
        """``MissingExtra`` (one line naming the ``pip install``) when a package is missing."""
        require_packages(self.name, self.what, self.packages)


@dataclass(frozen=True, kw_only=True)
class JobShape:
    """What a provider's :attr:`ProviderEntry.check_job` sees of a job spec."""

    provider: str
    """The provider's name as the job spec says it."""
    max_vms: int
    procs_per_vm: int
    options: Mapping[str, Any]
    """The job's ``provider_options``."""


@dataclass(frozen=True, kw_only=True)
class ProviderEntry:
    """One provider's declaration (module docstring)."""

    name: str
    """What job specs say: ``provider = "local"``."""
    factory: Callable[[Any, ProviderContext], Provider]
    """Makes the provider from its parsed options and the manager's context (usually its class)."""
    options: Any
    """The options class: ``options.from_dict(provider_options)`` parses and validates a job's
    ``provider_options`` (``ValueError`` with one line naming the option and the fix)."""
    extra: ProviderExtra | None = None
    """The extra its code needs, checked when a job is submitted (not at its first tick)."""
    type_options: tuple[str, ...] = ()
    """``provider_options`` keys a ``[[vm_types]]`` table may set for its type (azure:
    ``vm_size``); a type's options are the job's with these replaced, validated by ``options``."""
    notice_source: str | None = None
    """``module:Class`` of the agents' eviction-notice source (``manager.agent.notices``), None:
    none. The agent imports it by name: it never imports the providers."""
    check_job: Callable[[JobShape], None] | None = None
    """Refuses (``ValueError``, one line without the ``jobspec:`` prefix) a job this provider
    cannot run, when the job spec is validated."""
    module: str = field(default="", compare=False)
    """Where it was registered (set by :func:`register_provider`; in error messages)."""

    def parse_options(self, options: Mapping[str, Any]) -> Any:
        """The job's ``provider_options`` parsed by :attr:`options` (``ValueError``: one line)."""
        return self.options.from_dict(options)

    def check_type_options(self, type_name: str, type_options: Mapping[str, Any],
                           job_options: Mapping[str, Any]) -> None:
        """``ValueError`` (one line) when a ``[[vm_types]]`` table sets an option that is not a
        per-type option of this provider, or a value its options class refuses. The job's own
        options are judged at submit: when they do not parse, only the keys are checked here."""
        allowed = self.type_options
        for key in type_options:
            if key not in allowed:
                raise ValueError(
                    f"jobspec: vm_types {type_name}: provider_options {key} is not a per-type {self.name}"
                    f" option; use {', '.join(allowed) or 'none'}"
                )
        try:
            self.parse_options(job_options)
        except (ValueError, TypeError):
            return  # the job's own options are wrong: submit says so in their own words
        try:
            self.parse_options({**job_options, **type_options})
        except (ValueError, TypeError) as exc:
            raise ValueError(f"jobspec: vm_types {type_name}: {str(exc).splitlines()[0]}") from None


class _Registry:
    """The process's providers (module docstring); loaded on the first lookup."""

    def __init__(self) -> None:
        self._entries: dict[str, ProviderEntry] = {}
        self._loaded = False

    def add(self, entry: ProviderEntry) -> None:
        known = self._entries.get(entry.name)
        if known is not None and (known.module, _qualname(known.factory)) != (
            entry.module, _qualname(entry.factory)
        ):
            raise ValueError(
                f"provider {entry.name!r} is registered twice ({known.module} and {entry.module}); "
                "rename one of them"
            )
        self._entries[entry.name] = entry

    def entry(self, name: str) -> ProviderEntry:
        self.load()
        if name not in self._entries:
            raise ValueError(f"unknown provider {name!r}; use one of {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> tuple[str, ...]:
        """Built-in providers first (in :data:`BUILTIN_MODULES` order), then the others as they
        registered (a plug-in module may import a built-in one before the first lookup)."""
        self.load()
        builtin = {m: i for i, m in enumerate(BUILTIN_MODULES)}
        order = {name: i for i, name in enumerate(self._entries)}
        return tuple(sorted(self._entries, key=lambda n: (builtin.get(self._entries[n].module, len(builtin)),
                                                           order[n])))

    def load(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # first: a provider module that looks a provider up must not recurse
        extra = [m.strip() for m in os.environ.get(PROVIDER_MODULES_ENV, "").split(",") if m.strip()]
        for module in (*BUILTIN_MODULES, *extra):
            try:
                importlib.import_module(module)
            except ImportError as exc:
                self._loaded = False
                where = f"${PROVIDER_MODULES_ENV}" if module in extra else "a built-in provider"
                raise ValueError(f"{where}: cannot import {module}: {exc}".splitlines()[0]) from None
        for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
            point.load()


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


_REGISTRY = _Registry()


def register_provider(
    *,
    name: str,
    options: Any,
    extra: ProviderExtra | None = None,
    type_options: tuple[str, ...] = (),
    notice_source: str | None = None,
    check_job: Callable[[JobShape], None] | None = None,
) -> Callable[[Any], Any]:
    """Class decorator: register the decorated provider class under ``name`` (module docstring);
    the class is called as ``cls(parsed_options, context)``. Returns the class unchanged."""

    def register(cls: Any) -> Any:
        if not isinstance(cls, type):
            # A function left between the decorator and the class would be registered instead and
            # fail only when a job first asks for the provider.
            raise TypeError(f"register_provider({name!r}) decorates {_qualname(cls)}, not a class")
        _REGISTRY.add(ProviderEntry(name=name, factory=cls, options=options, extra=extra,
                                    type_options=tuple(type_options), notice_source=notice_source,
                                    check_job=check_job, module=cls.__module__))
        return cls

    return register


def provider_entry(name: str) -> ProviderEntry:
    """The registered provider ``name``; ``ValueError`` naming the known ones when unknown."""
    return _REGISTRY.entry(name)


def provider_names() -> tuple[str, ...]:
    """Every registered provider, built-in ones first."""
    return _REGISTRY.names()


def make_provider(name: str, options: Mapping[str, Any], context: ProviderContext) -> Provider:
    """The provider called ``name`` for a job with ``provider_options`` ``options``; ``ValueError``
    if the name or an option is wrong, ``MissingExtra`` when its extra is not installed."""
    entry = provider_entry(name)
    if entry.extra is not None:
        entry.extra.require()
    return entry.factory(entry.parse_options(options), context)
