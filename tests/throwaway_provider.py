"""A throw-away provider, ``gadget``: everything a provider is, in this one module, registration
included (docs/manager.md, "Adding a provider"). Nothing else in the repository names it;
tests/test_seams_provider.py imports it (in its own process) or names it in
``$VARUNA_PROVIDER_MODULES`` (for a manager daemon and its agents).

A gadget VM is one of the local provider's pretend VMs (its mechanics reused by subclassing), with
options of its own and an eviction-notice source of its own: a file named after the VM in the
job's ``notice_dir`` announces its eviction (:class:`FileNotices`, which the agents load by the
name the registry entry gives them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from manager.agent.notices import Notice
from manager.providers.base import ProviderContext
from manager.providers.local import LocalProvider, LocalProviderOptions, check_local_capacity
from manager.providers.registry import register_provider

FLAVOURS = ("small", "large")
#: This module's notice source, by the name the agents import it under.
NOTICE_SOURCE = f"{__name__}:FileNotices"


@dataclass(frozen=True, kw_only=True)
class GadgetOptions:
    """``provider_options`` of a gadget job."""

    flavour: str
    """Required: ``small`` or ``large`` (a ``[[vm_types]]`` table may set its own)."""
    max_created: int | None = None
    notice_dir: str | None = None
    """A directory where a file named after a VM announces that VM's eviction."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GadgetOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"provider_options: unknown gadget option(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        if data.get("flavour") not in FLAVOURS:
            raise ValueError(f"provider_options.flavour must be one of {', '.join(FLAVOURS)}, "
                             f"got {data.get('flavour')!r}")
        return cls(**dict(data))


class FileNotices:
    """The gadget's notice source (``manager.agent.notices.NoticeSource``): ``url`` is the notice
    directory, a file named ``vm_name`` there is the notice; approving writes ``vm_name.approved``."""

    def __init__(self, url: str | None, vm_name: str) -> None:
        self.dir = Path(url or ".")
        self.vm_name = vm_name

    def poll(self) -> list[Notice]:
        path = self.dir / self.vm_name
        if not path.exists():
            return []
        return [Notice(event_id=f"gadget-{self.vm_name}", event_type="Reclaim", not_before="",
                       description=path.read_text().strip())]

    def approve(self, event_id: str) -> bool:
        (self.dir / f"{self.vm_name}.approved").write_text(json.dumps({"event_id": event_id}))
        return True


@register_provider(
    name="gadget",
    options=GadgetOptions,
    type_options=("flavour",),
    notice_source=NOTICE_SOURCE,
    check_job=check_local_capacity,  # its VMs are processes on this machine
)
class GadgetProvider(LocalProvider):
    """Pretend VMs (the local provider's) whose agents watch :class:`FileNotices`: the local
    mechanics start each agent with the notice source of this provider's registry entry, at the
    endpoint the local options call ``metadata_url`` (here: the notice directory)."""

    name = "gadget"

    def __init__(self, options: GadgetOptions, context: ProviderContext) -> None:
        local = LocalProviderOptions(max_created=options.max_created, standby=False,
                                     metadata_url=options.notice_dir, approve_notices=True)
        super().__init__(local, context)
        self.gadget = options
