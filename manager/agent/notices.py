"""Eviction notices on a VM: what the agent learns before its VM is taken (a :class:`Notice`),
and where it learns it from (a :class:`NoticeSource`).

Each provider names its notice source in its registry entry as ``module:Class``
(``manager.providers.registry``); the provider's agent start command passes it on
(``--notice-source``), and the agent loads it by name with :func:`load_notice_source`, so the
agent never imports the providers and a new provider's source is one class in its own module.
Azure's Scheduled Events is :class:`manager.agent.scheduled_events.ScheduledEventsClient`; others
would be AWS ``instance-action``, GCP ``preempted``, a Kubernetes grace period or Slurm's signal.

    >>> source = load_notice_source("manager.agent.scheduled_events:ScheduledEventsClient",
    ...                             url="http://127.0.0.1:1/none", vm_name="vm-1")
    >>> type(source).__name__, source.vm_name
    ('ScheduledEventsClient', 'vm-1')
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Notice", "NoticeSource", "load_notice_source"]


@dataclass(frozen=True, kw_only=True)
class Notice:
    """One event announcing the end of this VM."""

    event_id: str
    event_type: str
    not_before: str
    description: str = ""


class NoticeSource(Protocol):
    """Where an agent polls for its VM's eviction notices (a thread calls :meth:`poll` about once
    a second). The class is called as ``Class(url, vm_name)``: ``url`` the endpoint the provider
    named (None: the source's default), ``vm_name`` this VM's name there."""

    def poll(self) -> list[Notice]:
        """This VM's notices now; empty when there are none or the source cannot be read (no
        news is no notice). Never raises, never blocks for long."""
        ...

    def approve(self, event_id: str) -> bool:
        """Tell the platform to go ahead now (the workers are done); False when that failed or
        the platform has no such step."""
        ...


def load_notice_source(spec: str, *, url: str | None, vm_name: str) -> NoticeSource:
    """The notice source ``module:Class`` for this VM; ``ValueError`` (one line) when ``spec``
    does not name an importable class."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--notice-source {spec!r} is not module:Class")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--notice-source {spec}: {exc}".splitlines()[0]) from None
    return cls(url, vm_name)
