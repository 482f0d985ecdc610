"""Azure Scheduled Events: the eviction notice a spot VM gets about 30 s before it is taken.

Azure's Instance Metadata Service answers, on the VM itself::

    GET http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01   (header Metadata: true)
    {"DocumentIncarnation": 3,
     "Events": [{"EventId": "...", "EventType": "Preempt", "ResourceType": "VirtualMachine",
                 "Resources": ["myvm_3"], "EventStatus": "Scheduled",
                 "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT", "DurationInSeconds": -1,
                 "Description": "...", "EventSource": "Platform"}]}

An event concerns this VM when its name is in ``Resources``. ``Preempt`` is the spot eviction;
``Terminate`` (a scale-in or delete) also ends the VM; both are notices here. Other types
(``Reboot``, ``Redeploy``, ``Freeze``) do not end the VM and are ignored. After checkpointing,
the agent may approve the event (``POST {"StartRequests": [{"EventId": ...}]}``) so the platform
proceeds without waiting for ``NotBefore``.

This is the notice source (:class:`manager.agent.notices.NoticeSource`) the azure and local
providers declare. The endpoint address is configurable (``--notice-url``) so tests point it at a local HTTP
server replaying a recorded document. Requests bypass any HTTP proxy (the address is link-local
on Azure) and have a short timeout: the poller must never stall the agent.

    >>> doc = {"DocumentIncarnation": 1, "Events": [{"EventId": "e1", "EventType": "Preempt",
    ...        "Resources": ["vm-2"], "EventStatus": "Scheduled", "NotBefore": ""}]}
    >>> [n.event_id for n in parse_notices(doc, "vm-2")], parse_notices(doc, "vm-3")
    (['e1'], [])
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from manager.agent.notices import Notice

__all__ = ["DEFAULT_METADATA_URL", "NOTICE_TYPES", "ScheduledEventsClient", "parse_notices"]

DEFAULT_METADATA_URL = "http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01"
#: Event types that end the VM.
NOTICE_TYPES = ("Preempt", "Terminate")


def parse_notices(document: Mapping[str, Any], vm_name: str) -> list[Notice]:
    """The notices in a Scheduled Events ``document`` that concern ``vm_name``."""
    out: list[Notice] = []
    events = document.get("Events") if isinstance(document, Mapping) else None
    for ev in events or []:
        if not isinstance(ev, Mapping) or ev.get("EventType") not in NOTICE_TYPES:
            continue
        resources = ev.get("Resources") or []
        if vm_name not in resources:
            continue
        if ev.get("EventStatus", "Scheduled") not in ("Scheduled", "Started"):
            continue
        out.append(
            Notice(
                event_id=str(ev.get("EventId", "")),
                event_type=str(ev["EventType"]),
                not_before=str(ev.get("NotBefore", "")),
                description=str(ev.get("Description", "")),
            )
        )
    return out


class ScheduledEventsClient:
    """Polls the metadata endpoint for this VM's notices and approves them (a
    :class:`~manager.agent.notices.NoticeSource`; ``url`` None: Azure's own endpoint)."""

    def __init__(self, url: str | None, vm_name: str, *, timeout_s: float = 2.0) -> None:
        self.url = url or DEFAULT_METADATA_URL
        self.vm_name = vm_name
        self.timeout_s = timeout_s
        # No proxy: the metadata address must be reached directly (Azure docs insist).
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def fetch(self) -> dict[str, Any]:
        """The current document; ``OSError``/``ValueError`` when the endpoint fails."""
        req = urllib.request.Request(self.url, headers={"Metadata": "true"})
        with self._opener.open(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read().decode("utf-8"))

    def poll(self) -> list[Notice]:
        """This VM's notices now (empty when the endpoint cannot be read: no news is no notice)."""
        try:
            return parse_notices(self.fetch(), self.vm_name)
        except (OSError, ValueError, urllib.error.URLError):
            return []

    def approve(self, event_id: str) -> bool:
        """Ask the platform to go ahead with ``event_id`` now; False when the request failed."""
        body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode("utf-8")
        req = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={"Metadata": "true", "Content-Type": "application/json"},
        )
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                return 200 <= resp.status < 300
        except (OSError, urllib.error.URLError):
            return False
